//! Test-only: a small deterministic mutator, so every parser of outside bytes can be hit with
//! thousands of malformed variants of valid inputs in a plain `cargo test`.

/// Yields `rounds` mutations of each seed: bytes flipped, cut, duplicated or spliced from
/// other seeds. Deterministic for a given `seed`.
pub fn mutations(seeds: &[&[u8]], rounds: usize, seed: u64) -> Vec<Vec<u8>> {
    let mut state = seed | 1;
    let mut next = move |n: usize| -> usize {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % (n.max(1) as u64)) as usize
    };
    let mut out = Vec::new();
    for s in seeds {
        for _ in 0..rounds {
            let mut v = s.to_vec();
            for _ in 0..1 + next(4) {
                match next(6) {
                    0 if !v.is_empty() => {
                        let i = next(v.len());
                        v[i] = next(256) as u8;
                    }
                    1 => v.truncate(next(v.len() + 1)),
                    2 if !v.is_empty() => {
                        let i = next(v.len());
                        let j = i + next(v.len() - i);
                        let part = v[i..j].to_vec();
                        v.splice(i..i, part);
                    }
                    3 => {
                        let other = seeds[next(seeds.len())];
                        let i = next(v.len() + 1);
                        v.splice(i..i, other.iter().copied());
                    }
                    4 => {
                        let i = next(v.len() + 1);
                        let specials = b"{}[]\",:\\\n\x00\xff";
                        v.insert(i, specials[next(specials.len())]);
                    }
                    _ => v.reverse(),
                }
            }
            out.push(v);
        }
    }
    out
}
