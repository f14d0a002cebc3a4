//! Random identifiers and opaque references from the OS CSPRNG.

use ring::rand::{SecureRandom, SystemRandom};

/// `bytes` random bytes as lowercase hex.
pub fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    SystemRandom::new()
        .fill(&mut buf)
        .expect("the OS random source must work");
    hex(&buf)
}

/// Random bytes a thread draws from the OS at a time for `short` IDs: a `message.push` carries
/// a fresh packet ID, and one `getrandom` per 32 of them instead of one each keeps that system
/// call off the executor's per-message path. Keys and references (`token`, `random_hex`) still
/// come from the OS one by one.
const SHORT_POOL: usize = 256;

thread_local! {
    static POOL: std::cell::RefCell<([u8; SHORT_POOL], usize)> =
        const { std::cell::RefCell::new(([0; SHORT_POOL], SHORT_POOL)) };
}

/// A fresh ID with `prefix`, 64 random bits (packet IDs, request IDs, auth sessions).
pub fn short(prefix: &str) -> String {
    let mut bits = [0u8; 8];
    POOL.with(|pool| {
        let (bytes, used) = &mut *pool.borrow_mut();
        if *used + bits.len() > SHORT_POOL {
            SystemRandom::new().fill(bytes).expect("the OS random source must work");
            *used = 0;
        }
        bits.copy_from_slice(&bytes[*used..*used + 8]);
        // Spent bytes are wiped, so the pool never holds an ID already handed out.
        bytes[*used..*used + 8].fill(0);
        *used += 8;
    });
    format!("{prefix}{}", hex(&bits))
}

/// A fresh unguessable reference with `prefix`, 128 random bits (reply_ref, file_ref, channel IDs).
pub fn token(prefix: &str) -> String {
    format!("{prefix}{}", random_hex(16))
}

pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[(b >> 4) as usize] as char);
        out.push(DIGITS[(b & 15) as usize] as char);
    }
    out
}

/// A random number in `0..n` for backoff jitter.
pub fn below(n: u64) -> u64 {
    let mut buf = [0u8; 8];
    SystemRandom::new()
        .fill(&mut buf)
        .expect("the OS random source must work");
    if n == 0 {
        0
    } else {
        u64::from_le_bytes(buf) % n
    }
}

/// Compares secrets in time independent of where they differ.
pub fn secret_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    // Length is not secret enough to hide; the content comparison is constant time.
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The credentials of an `Authorization: Bearer <token>` value; the scheme is matched
/// case-insensitively (RFC 9110 11.1), the token is trimmed.
pub fn bearer(authorization: &str) -> Option<&str> {
    let (scheme, token) = authorization.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// `ms` since 1970 as `YYYY-MM-DDTHH:MM:SSZ` (UTC), for a time a person reads in a reason.
pub fn utc(ms: u64) -> String {
    let (year, month, day, hour, minute, second) = crate::civil::civil(ms / 1000);
    format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}Z")
}

/// Standard base64 with padding (RFC 4648 section 4).
pub fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, b)| acc | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decodes standard base64 (padding optional); `None` for any other character.
pub fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let text = text.trim_end_matches('=');
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0);
    for c in text.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        acc = (acc << 6 | u32::from(v)) & 0xff_ffff;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_names_the_civil_date_and_time() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_767_225_599_999), "2025-12-31T23:59:59Z");
        assert!(!utc(u64::MAX).is_empty());
    }

    #[test]
    fn base64_pads_as_rfc_4648_says() {
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        for bytes in [&b""[..], b"f", b"fo", b"foo", b"\xff\x00\x10 any bytes"] {
            assert_eq!(base64_decode(&base64(bytes)).as_deref(), Some(bytes));
        }
        assert_eq!(base64_decode("a*b"), None);
    }

    #[test]
    fn tokens_are_unique_and_carry_128_bits() {
        let a = token("rr_");
        assert_eq!(a.len(), 3 + 32);
        assert_ne!(a, token("rr_"));
    }

    #[test]
    fn short_ids_stay_unique_and_64_bits_across_many_pool_refills() {
        let ids: std::collections::HashSet<String> = (0..10 * SHORT_POOL).map(|_| short("pkt_")).collect();
        assert_eq!(ids.len(), 10 * SHORT_POOL, "no ID repeats when the pool refills");
        assert!(ids
            .iter()
            .all(|id| id.len() == 4 + 16 && id[4..].bytes().all(|b| b.is_ascii_hexdigit())));
        assert!(
            !ids.contains("pkt_0000000000000000"),
            "a spent slot is never handed out again"
        );
    }

    #[test]
    fn the_bearer_scheme_matches_in_any_case() {
        assert_eq!(bearer("Bearer k"), Some("k"));
        assert_eq!(bearer("bEaReR  k "), Some("k"));
        assert_eq!(bearer("Basic k"), None);
        assert_eq!(bearer("Bearerk"), None);
    }

    #[test]
    fn secret_eq_matches_only_equal_strings() {
        assert!(secret_eq("abc", "abc"));
        assert!(!secret_eq("abc", "abd"));
        assert!(!secret_eq("abc", "abcd"));
    }
}
