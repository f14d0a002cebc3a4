//! What several providers call the same way: retries within a deadline, multipart forms (whole
//! or streamed from the file cache), token lifetimes, idempotent send IDs, MIME types, text
//! split at a platform's limit.

use std::time::{Duration, Instant};

use super::link::Backoff;
use crate::peer_wait;
use crate::quiet::Subjects;
use crate::upstream::{ApiError, Kind};

/// An error of a provider's API that may pass if the call is made again.
pub trait Transient: std::fmt::Display {
    /// Unreachable, rate limited or a server error.
    fn temporary(&self) -> bool;
    /// How long the server asked to wait before the next call, if it said.
    fn retry_after(&self) -> Option<Duration>;
}

/// Every provider's API error, by its kind: a rate limit that names no wait holds as long as
/// its platform counts.
impl Transient for ApiError {
    fn temporary(&self) -> bool {
        self.kind().temporary() && (!self.too_large || self.platform.retry_too_large)
    }

    fn retry_after(&self) -> Option<Duration> {
        // Bounded where it is used (`peer_wait::retry_after`).
        let rate_wait = self.platform.rate_wait.filter(|_| self.kind() == Kind::RateLimited);
        self.retry_after.or(rate_wait)
    }
}

/// Runs `attempt` (one API call, given the time left) until it succeeds, fails for good, or
/// `deadline` passes: rate limits and server errors are retried with backoff, and no attempt may
/// outlive the deadline, so a tool answers in time even when the IM system stalls.
pub fn with_retry<T, E: Transient>(
    what: &str,
    deadline: Instant,
    mut attempt: impl FnMut(Duration) -> Result<T, E>,
) -> Result<T, E> {
    // An IM system may throttle every call: one line a minute for each `what`, with the count
    // of the others.
    static RETRIES: Subjects = Subjects::new();
    let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(5));
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match attempt(left.max(Duration::from_millis(1))) {
            Err(e) if e.temporary() => {
                let wait = peer_wait::retry_after(e.retry_after(), backoff.failed());
                if peer_wait::passes(deadline, wait) {
                    return Err(e);
                }
                if let Some(more) = RETRIES.admit(what) {
                    log::info!("{what}: {e}; retrying in {wait:?}{more}");
                }
                std::thread::sleep(wait);
            }
            other => return other,
        }
    }
}

/// A multipart/form-data body: text fields, then one file as `part`; its boundary and bytes.
pub fn multipart(fields: &[(&str, &str)], part: &str, filename: &str, mime: &str, bytes: &[u8]) -> (String, Vec<u8>) {
    let boundary = format!("imgate{}", crate::ids::random_hex(12));
    let mut body = Vec::with_capacity(bytes.len() + 512);
    for (name, value) in fields {
        body.extend_from_slice(
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n").as_bytes(),
        );
    }
    // The name comes from an upload (checked there), but a quote would still end the header value.
    let filename = filename.replace(['"', '\r', '\n'], "_");
    body.extend_from_slice(
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"{part}\"; filename=\"{filename}\"\r\nContent-Type: {mime}\r\n\r\n"
        )
        .as_bytes(),
    );
    body.extend_from_slice(bytes);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    (boundary, body)
}

/// A file from the cache to upload: its name, type, size and bytes on disk.
pub struct Upload<'a> {
    pub filename: &'a str,
    pub mime: &'a str,
    pub size: u64,
    pub path: &'a std::path::Path,
}

/// A multipart/form-data body read from disk as it is sent: text fields (each with its own
/// `Content-Type` when it has one), then the file as `part`. Memory does not grow with the file.
pub struct StreamedForm {
    pub boundary: String,
    /// The body's length in bytes, for `Content-Length`.
    pub length: u64,
    pub body: Box<dyn std::io::Read + Send>,
}

impl StreamedForm {
    pub fn new(fields: &[(&str, Option<&str>, &str)], part: &str, file: &Upload) -> std::io::Result<StreamedForm> {
        use std::io::Read;
        let boundary = format!("imgate{}", crate::ids::random_hex(12));
        let mut head = String::new();
        for (name, content_type, value) in fields {
            head.push_str(&format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n"
            ));
            if let Some(t) = content_type {
                head.push_str(&format!("Content-Type: {t}\r\n"));
            }
            head.push_str(&format!("\r\n{value}\r\n"));
        }
        // A quote or a line break would end the header's value: never in a name we send.
        let filename = file.filename.replace(['"', '\r', '\n', '\\'], "_");
        head.push_str(&format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"{part}\"; filename=\"{filename}\"\r\nContent-Type: {}\r\n\r\n",
            file.mime
        ));
        let tail = format!("\r\n--{boundary}--\r\n");
        let bytes = std::fs::File::open(file.path)?;
        let length = (head.len() as u64)
            .saturating_add(file.size)
            .saturating_add(tail.len() as u64);
        let body = std::io::Cursor::new(head.into_bytes())
            .chain(bytes.take(file.size))
            .chain(std::io::Cursor::new(tail.into_bytes()));
        Ok(StreamedForm {
            boundary,
            length,
            body: Box::new(body),
        })
    }
}

/// How long an access token the server says lives `expire` seconds is used: until five minutes
/// before its end, or half its life when that is shorter; a day at most, whatever the server says.
pub fn token_kept_for(expire: u64) -> Duration {
    const RENEW_EARLY: Duration = Duration::from_secs(300);
    let lifetime = Duration::from_secs(expire.min(86_400));
    lifetime.saturating_sub(RENEW_EARLY).max(lifetime / 2)
}

/// A name for part `part` of one send, the same whenever the call is retried, so the IM
/// system can tell a retry from a new message: `bytes` of SHA-256(idempotency key, part) in hex.
pub fn send_id(idempotency_key: &str, part: usize, bytes: usize) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, format!("{idempotency_key}:{part}").as_bytes());
    crate::ids::hex(&digest.as_ref()[..bytes.min(32)])
}

/// The type a downloaded file is stored as: the server's `Content-Type` when it names one (an
/// image may be a JPEG, not the PNG its message said), else what the message declared.
pub fn served_mime(served: Option<&str>, declared: &str) -> String {
    served
        .map(|c| c.split(';').next().unwrap_or_default().trim())
        .filter(|c| c.contains('/') && !c.starts_with("application/octet-stream"))
        .unwrap_or(declared)
        .to_string()
}

/// Splits text into parts of at most `max_chars` characters, preferring line breaks, never
/// inside a character.
pub fn split_text(text: &str, max_chars: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    // One scan per part: the byte offset of character `max_chars` exists only while too long.
    while let Some((cut, _)) = rest.char_indices().nth(max_chars) {
        let at = rest[..cut].rfind('\n').filter(|&i| i > cut / 2).map_or(cut, |i| i + 1);
        out.push(rest[..at].to_string());
        rest = &rest[at..];
    }
    if !rest.is_empty() || out.is_empty() {
        out.push(rest.to_string());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_renewed_five_minutes_before_it_expires_or_at_half_life() {
        assert_eq!(token_kept_for(7200), Duration::from_secs(6900), "two hours");
        assert_eq!(
            token_kept_for(400),
            Duration::from_secs(200),
            "a short token: half its life"
        );
        assert_eq!(
            token_kept_for(0),
            Duration::ZERO,
            "no lifetime: fetched again next time"
        );
        assert_eq!(token_kept_for(u64::MAX), Duration::from_secs(86_100), "a day at most");
    }

    #[test]
    fn long_text_is_split_at_the_limit_without_breaking_characters() {
        let text = "é".repeat(5000);
        let parts = split_text(&text, 4096);
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].chars().count(), 4096);
        assert_eq!(parts.concat(), text);
        let lines = format!("{}\n{}", "a".repeat(3000), "b".repeat(3000));
        let parts = split_text(&lines, 4096);
        assert_eq!(
            parts[0],
            format!("{}\n", "a".repeat(3000)),
            "a line break is the preferred cut"
        );
        assert_eq!(split_text("hi", 4096), ["hi"]);
    }
}
