//! The one way imgate calls a server: every provider's API and CDN, and a webhook's `reply_url`.
//! Those servers may be broken or hostile, so every call is bounded here, not at each site:
//!
//! - time: a connection within `CONNECT_TIMEOUT`, the whole call within the agent's timeout
//!   (or a shorter one the caller gives, `within`);
//! - redirects: none followed. A `3xx` is an answer like any other status, so the bytes come
//!   from the host the provider chose, never from wherever an answer points;
//! - answers: read whole only up to a cap the caller names (`read_json`); past it the call
//!   fails and the rest is never read. JSON is shape-checked before it is parsed
//!   (`json::parse`) and parsed once: the caller takes the tree, no copy of it is made here;
//! - downloads: streamed to a writer (the file cache's `.part`) 64 KiB at a time
//!   (`stream_body`), so memory does not grow with a file's size.
//!
//! Waits a server names (`retry_after`, reconnect intervals) are bounded by `peer_wait`. An IM
//! system's refusal is one `ApiError` whatever the provider (`api_error`).

mod api_error;

pub use api_error::{ApiError, Kind, Platform};

use std::io::Read;
use std::time::Duration;

use crate::json::{self, Object, Value};

/// A server must accept the connection within this.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A download is read and written this many bytes at a time.
const PIECE: usize = 64 * 1024;

pub type Response = ureq::http::Response<ureq::Body>;

/// A client with the bounds above; a call ends after `timeout` whatever the server does.
/// HTTP statuses are answers, not errors: callers read a refusal's body for its reason.
pub fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .timeout_connect(Some(CONNECT_TIMEOUT))
        .http_status_as_error(false)
        .max_redirects(0)
        .user_agent(format!("imgate/{}", crate::protocol::card::VERSION))
        .build()
        .into()
}

/// `timeout` for one call, never longer than the agent's own.
pub fn within<B>(agent: &ureq::Agent, req: ureq::RequestBuilder<B>, timeout: Duration) -> ureq::RequestBuilder<B> {
    let limit = agent.config().timeouts().global.unwrap_or(timeout);
    req.config().timeout_global(Some(timeout.min(limit))).build()
}

/// The wait an answer's `Retry-After` names in whole seconds, as it said it (bounded where used).
pub fn retry_after(resp: &Response) -> Option<Duration> {
    let seconds = resp
        .headers()
        .get("Retry-After")?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(Duration::from_secs(seconds))
}

/// Percent-encodes a query value (RFC 3986 unreserved characters stay).
pub fn query_value(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for b in v.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => out.push(b as char),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// Why a call or the reading of its answer failed.
#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    /// No answer: refused, reset, a TLS failure, or cut short while reading.
    Unreachable(String),
    /// No (whole) answer within the call's time.
    TimedOut,
    /// The answer is larger than the call allows (`cap` bytes); the rest was not read.
    TooLarge { cap: u64 },
}

impl Error {
    /// The error with `secret` (a token in a URL, a URL with a credential) shown as `name`,
    /// for errors that quote the URL; before it is shown, which shortens it.
    pub fn hiding(self, secret: &str, name: &str) -> Error {
        match self {
            Error::Unreachable(text) if !secret.is_empty() => Error::Unreachable(text.replace(secret, name)),
            other => other,
        }
    }
}

impl From<ureq::Error> for Error {
    fn from(e: ureq::Error) -> Error {
        match e {
            ureq::Error::Timeout(_) => Error::TimedOut,
            ureq::Error::BodyExceedsLimit(cap) => Error::TooLarge { cap },
            ureq::Error::Io(io) if io.kind() == std::io::ErrorKind::TimedOut => Error::TimedOut,
            other => Error::Unreachable(other.to_string()),
        }
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Unreachable(e) => write!(f, "{}", crate::quiet::shown(e)),
            Error::TimedOut => write!(f, "no answer in time"),
            Error::TooLarge { cap } => write!(f, "an answer larger than {cap} bytes"),
        }
    }
}

/// The body, at most `cap` bytes.
pub fn read_body(resp: &mut Response, cap: u64) -> Result<Vec<u8>, Error> {
    let mut body = Vec::new();
    let mut reader = resp.body_mut().with_config().limit(cap).reader();
    reader.read_to_end(&mut body).map_err(io_error)?;
    Ok(body)
}

/// An answer's status and its body read as a JSON object: `None` when the body is not one (a
/// proxy's HTML page, nothing, too deep, too many values). The body is at most `cap` bytes
/// and dropped once parsed.
pub fn read_json(resp: &mut Response, cap: u64) -> Result<(u16, Option<Object>), Error> {
    let status = resp.status().as_u16();
    let body = read_body(resp, cap)?;
    let object = String::from_utf8(body).ok().and_then(|text| match json::parse(&text) {
        Ok(Value::Object(o)) => Some(o),
        _ => None,
    });
    Ok((status, object))
}

/// The answer's `Content-Type`, at most 128 characters of it.
pub fn content_type(resp: &Response) -> Option<String> {
    let value = resp.headers().get("Content-Type")?.to_str().ok()?;
    Some(value.chars().take(128).collect())
}

/// Streams the body to `write` in pieces of at most 64 KiB. `write` bounds the total (the file
/// cache refuses a file past its caps, and knows what it wrote) and its error ends the stream.
pub fn stream_body<E>(resp: &mut Response, mut write: impl FnMut(&[u8]) -> Result<(), E>) -> Result<(), Streamed<E>> {
    let mut reader = resp.body_mut().as_reader();
    let mut piece = vec![0u8; PIECE];
    loop {
        let n = match reader.read(&mut piece) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Streamed::Read(io_error(e))),
        };
        write(&piece[..n]).map_err(Streamed::Write)?;
    }
}

/// How `stream_body` failed: reading from the server, or writing where the bytes go.
#[derive(Debug)]
pub enum Streamed<E> {
    Read(Error),
    Write(E),
}

/// A body reader's error as the `Error` it stands for (ureq wraps its own in `io::Error`).
fn io_error(e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::TimedOut {
        return Error::TimedOut;
    }
    match e.into_inner().map(|inner| inner.downcast::<ureq::Error>()) {
        Some(Ok(inner)) => Error::from(*inner),
        Some(Err(other)) => Error::Unreachable(other.to_string()),
        None => Error::Unreachable("the connection failed".into()),
    }
}
