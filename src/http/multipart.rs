//! A strict `multipart/form-data` parser (RFC 7578, framing of RFC 2046 5.1.1) for
//! `POST /files/uploads`. `Stream` is fed the body in pieces as they arrive and hands out each
//! part's bytes as it goes, so an upload reaches the disk without being held in memory; `parse`
//! is the same parser over a whole body. Malformed input is an error that names the problem,
//! never a panic.

/// The longest header block of one part.
pub const MAX_HEAD_BYTES: usize = 8 * 1024;
/// The most parts in one body.
pub const MAX_PARTS: usize = 16;
/// The most bytes before the first delimiter (clients send none).
pub const MAX_PREAMBLE_BYTES: usize = 1024;
/// The most transport padding (spaces, tabs) after a delimiter.
const MAX_PADDING: usize = 64;
/// RFC 2046: a boundary is 1 to 70 characters.
const MAX_BOUNDARY: usize = 70;

/// One part of a body read whole.
#[derive(Debug, PartialEq)]
pub struct Part {
    pub name: String,
    pub filename: Option<String>,
    pub content_type: Option<String>,
    pub data: Vec<u8>,
}

/// A part's headers, as read.
#[derive(Debug, PartialEq, Clone)]
pub struct PartHead {
    pub name: String,
    pub filename: Option<String>,
    pub content_type: Option<String>,
}

#[derive(Debug, PartialEq)]
pub enum Event<'a> {
    /// A part begins; its `Data` follows, then `PartEnd`.
    Part(PartHead),
    /// The next bytes of the current part, exactly (never empty).
    Data(&'a [u8]),
    PartEnd,
}

/// The boundary of a `Content-Type: multipart/form-data; boundary=...` header.
pub fn boundary(content_type: &str) -> Option<String> {
    let mut parts = content_type.split(';');
    if !parts.next()?.trim().eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    parts
        .filter_map(|p| p.trim().split_once('='))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("boundary"))
        .map(|(_, v)| v.trim().trim_matches('"').to_string())
        .filter(|b| !b.is_empty() && b.len() <= MAX_BOUNDARY)
}

/// A whole body's parts, through `Stream`.
pub fn parse(body: &[u8], boundary: &str) -> Result<Vec<Part>, String> {
    let mut stream = Stream::new(boundary);
    let mut parts: Vec<Part> = Vec::new();
    stream.feed(body, &mut |event| {
        match event {
            Event::Part(head) => parts.push(Part {
                name: head.name,
                filename: head.filename,
                content_type: head.content_type,
                data: Vec::new(),
            }),
            Event::Data(bytes) => {
                if let Some(part) = parts.last_mut() {
                    part.data.extend_from_slice(bytes);
                }
            }
            Event::PartEnd => {}
        }
        Ok(())
    })?;
    stream.finish()?;
    Ok(parts)
}

#[derive(Debug, Clone, PartialEq)]
enum State {
    /// Before the first delimiter; counts the bytes skipped.
    Preamble { skipped: usize },
    /// `--boundary` matched: `--` closes, padding then CRLF opens a part.
    AfterDelimiter { padding: usize },
    /// One `-` of the closing `--`.
    ClosingDash,
    /// The CR of the delimiter line's CRLF.
    DelimiterCr,
    /// A part's header block, collected in `head`.
    Head,
    /// A part's bytes.
    Data,
    /// The closing delimiter came: the rest (epilogue) is ignored.
    Done,
    /// An error was returned; every later call returns it again.
    Failed(String),
}

/// A push parser of a `multipart/form-data` body.
///
/// Memory: the delimiter (`\r\n--` + boundary, at most 74 bytes), plus while a part's headers
/// are read their block (at most `MAX_HEAD_BYTES`, freed once parsed). Of a part's data, the
/// parser holds back only the bytes that may start a delimiter, at most the delimiter's length
/// less one, and does not copy them (they equal the delimiter's own prefix). So a stream never
/// retains more than `MAX_HEAD_BYTES + 74` bytes of input, whatever the size of a part or of
/// the pieces it is fed.
pub struct Stream {
    /// `\r\n--boundary`. The body is read as if it began with `\r\n`, so a delimiter at its
    /// very start is found like any other.
    delim: Vec<u8>,
    /// How many bytes of `delim` the input seen last matched (held back, not yet data).
    matched: usize,
    head: Vec<u8>,
    parts: usize,
    state: State,
}

impl Stream {
    pub fn new(boundary: &str) -> Stream {
        let delim: Vec<u8> = [b"\r\n--", boundary.as_bytes()].concat();
        // No CR in the boundary: then a CR only ever starts a delimiter (see `scan`).
        let state = if boundary.is_empty() || boundary.len() > MAX_BOUNDARY || boundary.contains(['\r', '\n']) {
            State::Failed("invalid multipart boundary".into())
        } else {
            State::Preamble { skipped: 0 }
        };
        Stream {
            delim,
            matched: 2,
            head: Vec::new(),
            parts: 0,
            state,
        }
    }

    /// Feeds the next body bytes (any split, one byte at a time included); calls `on` for each
    /// event in order. Err(reason) for malformed input or a limit exceeded, or the error `on`
    /// returned; the stream is then failed for good.
    pub fn feed(&mut self, input: &[u8], on: &mut dyn FnMut(Event<'_>) -> Result<(), String>) -> Result<(), String> {
        let result = self.run(input, on);
        if let Err(e) = &result {
            self.state = State::Failed(e.clone());
            self.head = Vec::new();
        }
        result
    }

    /// Whether the closing delimiter (`--boundary--`) has been seen.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Called at the end of the body: Err when the closing delimiter never came, or no part at all.
    pub fn finish(&self) -> Result<(), String> {
        match &self.state {
            State::Done if self.parts > 0 => Ok(()),
            State::Done => Err("multipart body has no parts".into()),
            State::Failed(e) => Err(e.clone()),
            State::Preamble { .. } => Err("no multipart boundary in the body".into()),
            _ => Err("multipart body ends before its closing boundary".into()),
        }
    }

    /// Input bytes the stream holds right now (see the bound on `Stream`).
    #[cfg(test)]
    fn retained(&self) -> usize {
        self.head.capacity() + self.matched
    }

    fn run(&mut self, input: &[u8], on: &mut dyn FnMut(Event<'_>) -> Result<(), String>) -> Result<(), String> {
        let mut at = 0;
        while at < input.len() {
            match self.state.clone() {
                State::Failed(e) => return Err(e),
                State::Done => return Ok(()),
                State::Preamble { mut skipped } => {
                    let found = self.scan(input, &mut at, &mut |bytes| {
                        skipped += bytes.len();
                        // The 2 are the CRLF the body is read as beginning with.
                        if skipped > MAX_PREAMBLE_BYTES + 2 {
                            return Err("multipart preamble too long".into());
                        }
                        Ok(())
                    })?;
                    self.state = if found {
                        State::AfterDelimiter { padding: 0 }
                    } else {
                        State::Preamble { skipped }
                    };
                }
                State::Data => {
                    if self.scan(input, &mut at, &mut |bytes| on(Event::Data(bytes)))? {
                        on(Event::PartEnd)?;
                        self.state = State::AfterDelimiter { padding: 0 };
                    }
                }
                State::Head => {
                    let rest = input.get(at..).unwrap_or_default();
                    let (block_ends, taken) = self.collect_head(rest)?;
                    at += taken;
                    if block_ends {
                        let head = part_head(&std::mem::take(&mut self.head))?;
                        self.state = State::Data;
                        self.matched = 0;
                        on(Event::Part(head))?;
                    }
                }
                line_state => {
                    let Some(&byte) = input.get(at) else { break };
                    at += 1;
                    self.state = self.delimiter_line(line_state, byte)?;
                }
            }
        }
        Ok(())
    }

    /// What follows `--boundary`, a byte at a time: `--`, or transport padding and CRLF.
    fn delimiter_line(&mut self, state: State, byte: u8) -> Result<State, String> {
        match (state, byte) {
            (State::AfterDelimiter { padding: 0 }, b'-') => Ok(State::ClosingDash),
            (State::AfterDelimiter { padding }, b' ' | b'\t') if padding < MAX_PADDING => {
                Ok(State::AfterDelimiter { padding: padding + 1 })
            }
            (State::AfterDelimiter { .. }, b'\r') => Ok(State::DelimiterCr),
            (State::ClosingDash, b'-') if self.parts == 0 => Err("multipart body has no parts".into()),
            (State::ClosingDash, b'-') => Ok(State::Done),
            (State::DelimiterCr, b'\n') if self.parts >= MAX_PARTS => {
                Err(format!("more than {MAX_PARTS} multipart parts"))
            }
            (State::DelimiterCr, b'\n') => {
                self.parts += 1;
                Ok(State::Head)
            }
            _ => Err("malformed multipart boundary line".into()),
        }
    }

    /// Takes header bytes from `rest` up to the blank line that ends the block: whether it
    /// ended, and how many bytes were taken.
    fn collect_head(&mut self, rest: &[u8]) -> Result<(bool, usize), String> {
        for (i, &byte) in rest.iter().enumerate() {
            if self.head.len() >= MAX_HEAD_BYTES {
                return Err("multipart part headers too long".into());
            }
            self.head.push(byte);
            if self.head.ends_with(b"\r\n\r\n") || self.head == b"\r\n" {
                return Ok((true, i + 1));
            }
        }
        Ok((false, rest.len()))
    }

    /// Reads `input` from `*at` until a whole delimiter has been matched (`true`, `*at` just
    /// past it) or the input ends (`false`, a possible start of a delimiter held back in
    /// `matched`). Every byte found not to be part of a delimiter goes to `out`, in order.
    fn scan(
        &mut self,
        input: &[u8],
        at: &mut usize,
        out: &mut dyn FnMut(&[u8]) -> Result<(), String>,
    ) -> Result<bool, String> {
        // A match held back from the last input, continued byte by byte. On a mismatch the held
        // bytes are all data: the delimiter's only CR is its first byte, so no tail of them
        // can start another.
        while self.matched > 0 {
            let Some(&byte) = input.get(*at) else {
                return Ok(false);
            };
            if self.delim.get(self.matched) != Some(&byte) {
                out(self.delim.get(..self.matched).unwrap_or_default())?;
                self.matched = 0;
                break;
            }
            self.matched += 1;
            *at += 1;
            if self.matched == self.delim.len() {
                self.matched = 0;
                return Ok(true);
            }
        }
        // Nothing held: search this input for a delimiter, or the start of one at its end.
        let rest = input.get(*at..).unwrap_or_default();
        let mut from = 0;
        while let Some(cr) = rest.get(from..).and_then(|r| r.iter().position(|&b| b == b'\r')) {
            let start = from + cr;
            let candidate = rest.get(start..).unwrap_or_default();
            let full = candidate.len() >= self.delim.len() && candidate.starts_with(&self.delim);
            let partial = candidate.len() < self.delim.len() && self.delim.starts_with(candidate);
            if full || partial {
                let data = rest.get(..start).unwrap_or_default();
                if !data.is_empty() {
                    out(data)?;
                }
                if full {
                    *at += start + self.delim.len();
                    return Ok(true);
                }
                self.matched = candidate.len();
                *at = input.len();
                return Ok(false);
            }
            from = start + 1;
        }
        if !rest.is_empty() {
            out(rest)?;
        }
        *at = input.len();
        Ok(false)
    }
}

/// A part's header block (through its blank line): `Content-Disposition` name and filename,
/// `Content-Type`; other headers are ignored, a part without a name is refused.
fn part_head(block: &[u8]) -> Result<PartHead, String> {
    let block = block.strip_suffix(b"\r\n").unwrap_or(block);
    let block = block.strip_suffix(b"\r\n").unwrap_or(block);
    let head = std::str::from_utf8(block).map_err(|_| "multipart headers are not UTF-8")?;
    let (mut name, mut filename, mut content_type) = (None, None, None);
    for line in head.split("\r\n") {
        let Some((k, v)) = line.split_once(':') else {
            return Err("malformed multipart header".into());
        };
        match k.trim().to_ascii_lowercase().as_str() {
            "content-disposition" => {
                for param in v.split(';').skip(1) {
                    let Some((pk, pv)) = param.trim().split_once('=') else {
                        continue;
                    };
                    let pv = pv.trim().trim_matches('"').to_string();
                    match pk.trim() {
                        "name" => name = Some(pv),
                        "filename" => filename = Some(pv),
                        _ => {}
                    }
                }
            }
            "content-type" => content_type = Some(v.trim().to_string()),
            _ => {}
        }
    }
    Ok(PartHead {
        name: name.ok_or("multipart part without a name")?,
        filename,
        content_type,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: &[u8] = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.png\"\r\nContent-Type: image/png\r\n\r\n\x89PNG\r\n--XyZ\r\nContent-Disposition: form-data; name=\"note\"\r\n\r\nhi\r\n--XyZ--\r\n";

    /// What a stream fed `pieces` in order produced: its events (data joined per part) and
    /// its outcome with `finish`.
    #[derive(Debug, PartialEq)]
    enum Seen {
        Part(PartHead),
        Data(Vec<u8>),
        PartEnd,
    }

    fn stream(pieces: &[&[u8]], boundary: &str) -> (Vec<Seen>, Result<(), String>) {
        let mut s = Stream::new(boundary);
        let mut seen = Vec::new();
        let mut on = |e: Event<'_>| {
            match e {
                Event::Part(h) => seen.push(Seen::Part(h)),
                Event::Data(d) => {
                    assert!(!d.is_empty(), "empty Data event");
                    match seen.last_mut() {
                        Some(Seen::Data(v)) => v.extend_from_slice(d),
                        _ => seen.push(Seen::Data(d.to_vec())),
                    }
                }
                Event::PartEnd => seen.push(Seen::PartEnd),
            }
            Ok(())
        };
        let mut outcome = Ok(());
        for piece in pieces {
            outcome = s.feed(piece, &mut on);
            if outcome.is_err() {
                break;
            }
        }
        (seen, outcome.and_then(|()| s.finish()))
    }

    fn upload(boundary: &str, data: &[u8]) -> Vec<u8> {
        let head = format!("--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\n\r\n");
        [head.as_bytes(), data, format!("\r\n--{boundary}--\r\n").as_bytes()].concat()
    }

    #[test]
    fn parts_come_out_with_names_filenames_and_exact_bytes() {
        assert_eq!(boundary("multipart/form-data; boundary=XyZ").as_deref(), Some("XyZ"));
        assert_eq!(boundary("application/json"), None);
        let parts = parse(BODY, "XyZ").unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].name, "file");
        assert_eq!(parts[0].filename.as_deref(), Some("a.png"));
        assert_eq!(parts[0].content_type.as_deref(), Some("image/png"));
        assert_eq!(parts[0].data, b"\x89PNG");
        assert_eq!(parts[1].data, b"hi");
    }

    #[test]
    fn malformed_bodies_are_errors_not_panics() {
        for bad in [
            &b""[..],
            b"--XyZ",
            b"--XyZ\r\n",
            b"--XyZ\r\nContent-Disposition: form-data\r\n\r\nx",
            b"--XyZ--",
            b"--XyZ\r\nno colon\r\n\r\nx\r\n--XyZ--",
        ] {
            assert!(parse(bad, "XyZ").is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        for input in crate::testutil::mutations(&[BODY], 5000, 5) {
            let _ = parse(&input, "XyZ");
        }
    }

    #[test]
    fn every_split_of_a_body_gives_the_events_of_the_whole() {
        let near = upload("XyZ", b"a\r\n--Xy\r\n-\r\n--X\r\r\n--X\r\n\r\n-x--XyZ");
        let padded = b"preamble\r\n--XyZ  \t\r\nContent-Disposition: form-data; name=a\r\n\r\n\r\n--XyZ--x";
        for body in [BODY, &padded[..], &near[..]] {
            let whole = stream(&[body], "XyZ");
            assert_eq!(whole.1, Ok(()), "{:?}", String::from_utf8_lossy(body));
            for at in 0..=body.len() {
                let (a, b) = body.split_at(at);
                assert_eq!(stream(&[a, b], "XyZ"), whole, "split at {at}");
            }
            let bytes: Vec<&[u8]> = body.chunks(1).collect();
            assert_eq!(stream(&bytes, "XyZ"), whole);
        }
    }

    #[test]
    fn near_delimiters_and_delimiters_without_crlf_are_data() {
        // Within the delimiter's length of every byte of the data: `\r\n--XyZ` unfinished, and
        // `--XyZ` with no CRLF before it.
        let data = b"--XyZ\r\n--Xy\r--XyZ\n--XyZ\r\n-\r\n--Xy\r\n\r\n--XyQ--XyZ";
        let body = upload("XyZ", data);
        assert_eq!(parse(&body, "XyZ").unwrap()[0].data, data);
        let (seen, outcome) = stream(&body.chunks(1).collect::<Vec<_>>(), "XyZ");
        assert_eq!(outcome, Ok(()));
        assert_eq!(seen[1], Seen::Data(data.to_vec()));
        // A boundary of dashes: the close's `--` is not taken for more of the boundary.
        let body = upload("--", b"\r\n---\r\n-\r\n--");
        assert_eq!(parse(&body, "--").unwrap()[0].data, b"\r\n---\r\n-\r\n--");
    }

    #[test]
    fn a_five_mib_part_passes_through_with_a_bounded_hold_back() {
        let boundary = "----------------------------a1b2c3d4e5f6";
        let delim_len = boundary.len() + 4;
        // Data full of near-delimiters so the hold-back is exercised at every piece's end.
        let pattern: Vec<u8> = [&b"\r\n--"[..], &boundary.as_bytes()[..20], b"\x00\xff\r"].concat();
        let data: Vec<u8> = pattern.iter().copied().cycle().take(5 << 20).collect();
        let body = upload(boundary, &data);
        let mut s = Stream::new(boundary);
        let (mut passed, mut max_retained) = (0usize, 0usize);
        let mut on = |e: Event<'_>| {
            if let Event::Data(d) = e {
                let at = passed;
                passed += d.len();
                // Compared as it goes: nothing of 5 MiB is collected.
                assert!(data.get(at..passed) == Some(d), "data differs at {at}");
            }
            Ok(())
        };
        for (i, piece) in body.chunks(4093).enumerate() {
            s.feed(piece, &mut on).unwrap();
            if i > 0 {
                max_retained = max_retained.max(s.retained());
                assert!(s.retained() < delim_len, "{} bytes retained", s.retained());
            }
        }
        s.finish().unwrap();
        assert_eq!(passed, data.len());
        assert!(max_retained > 0, "the hold-back was never exercised");
        assert!(s.retained() <= MAX_HEAD_BYTES + delim_len);
    }

    #[test]
    fn limits_and_malformed_streams_are_errors() {
        let part = b"--XyZ\r\nContent-Disposition: form-data; name=a\r\n\r\nx\r\n";
        let too_many = [part.repeat(MAX_PARTS + 1), b"--XyZ--".to_vec()].concat();
        let just_enough = [part.repeat(MAX_PARTS), b"--XyZ--".to_vec()].concat();
        assert_eq!(parse(&just_enough, "XyZ").map(|p| p.len()), Ok(MAX_PARTS));
        let long_head = format!(
            "--XyZ\r\nX-Pad: {}\r\nContent-Disposition: form-data; name=a\r\n\r\nx\r\n--XyZ--",
            "p".repeat(MAX_HEAD_BYTES)
        );
        let preamble = [vec![b'p'; MAX_PREAMBLE_BYTES + 1], b"\r\n".to_vec(), BODY.to_vec()].concat();
        let cases: [(&[u8], &str); 9] = [
            (b"no delimiter at all", "no multipart boundary"),
            (&too_many[..], "more than 16"),
            (long_head.as_bytes(), "too long"),
            (&preamble[..], "preamble too long"),
            (b"--XyZ\r\nContent-Type: a/b\r\n\r\nx\r\n--XyZ--", "without a name"),
            (
                b"--XyZ\r\nContent-Disposition: form-data; name=\xff\r\n\r\nx\r\n--XyZ--",
                "not UTF-8",
            ),
            (
                b"--XyZ\r\nContent-Disposition: form-data; name=a\r\n\r\nx\r\n--XyZx",
                "boundary line",
            ),
            (b"--XyZ --", "boundary line"),
            (b"--XyZ--", "no parts"),
        ];
        for (body, reason) in cases {
            for pieces in [vec![body], body.chunks(1).collect()] {
                let (_, outcome) = stream(&pieces, "XyZ");
                let e = outcome.expect_err(reason);
                assert!(e.contains(reason), "{e:?} for {:?}", String::from_utf8_lossy(body));
            }
        }
        // A body cut anywhere before its closing delimiter is never complete.
        let closed = BODY.len() - 2;
        for at in 0..closed {
            let (seen, outcome) = stream(&[&BODY[..at]], "XyZ");
            assert!(outcome.is_err(), "cut at {at}: {seen:?}");
        }
        // An error from the consumer stops the stream and stays.
        let mut s = Stream::new("XyZ");
        assert_eq!(s.feed(BODY, &mut |_| Err("disk full".into())), Err("disk full".into()));
        assert_eq!(s.feed(b"x", &mut |_| Ok(())), Err("disk full".into()));
        assert_eq!(s.finish(), Err("disk full".into()));
        let long = "b".repeat(71);
        for bad in ["", &long, "a\r\nb"] {
            assert!(Stream::new(bad).feed(BODY, &mut |_| Ok(())).is_err());
        }
    }

    #[test]
    fn the_stream_meets_mutated_bodies_split_anywhere_as_the_whole_parser_does() {
        let seeds: [&[u8]; 2] = [
            BODY,
            b"pre\r\n--XyZ \r\nContent-Disposition: form-data; name=a\r\n\r\n\r\n--X\r\n--XyZ--",
        ];
        for (i, input) in crate::testutil::mutations(&seeds, 3000, 9).iter().enumerate() {
            let at = i % (input.len() + 1);
            let (a, b) = input.split_at(at);
            let split = stream(&[a, b], "XyZ");
            assert_eq!(
                split,
                stream(&[input], "XyZ"),
                "{:?} split at {at}",
                String::from_utf8_lossy(input)
            );
            let parsed = parse(input, "XyZ");
            assert_eq!(parsed.is_ok(), split.1.is_ok());
        }
    }
}
