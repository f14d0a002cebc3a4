//! A small Slack Web API client (https://api.slack.com/web) over `upstream`.
//!
//! Every method is a form-encoded POST to `{api_base}/{method}` with the token in the
//! `Authorization` header (never in a URL, so no error text can carry it) and answers
//! `{"ok":true,…}` or `{"ok":false,"error":"…"}` with 200; a rate limit is `429` with
//! `Retry-After` in whole seconds. Files download with the bot token from `url_private_download`;
//! uploads go as raw bytes to the URL `files.getUploadURLExternal` gave, with no token.

use std::time::Duration;

use crate::files::{FileError, FilePart};
use crate::json::{self, Object, Value};
use crate::upstream::{self, Streamed};

/// An answer larger than this is refused unread: a history page of 200 messages at Slack's
/// 40,000 characters each would pass it, so the catch-up asks for fewer when it is refused.
pub const MAX_ANSWER: u64 = 1 << 20;
/// Characters of an error's text kept (it reaches logs and tool results).
const MAX_ERROR: usize = 100;

#[derive(Debug, Clone)]
pub struct ApiError {
    /// The HTTP status, or 0 when the server could not be reached.
    pub status: u16,
    /// Slack's `error` (`invalid_auth`, `not_in_channel`), or what went wrong.
    pub error: String,
    /// `missing_scope`'s `needed`.
    pub needed: Option<String>,
    pub retry_after: Option<u64>,
    /// The answer passed `MAX_ANSWER` and was not read.
    pub too_large: bool,
    /// Slack itself refused (its JSON said `ok: false`), not a proxy, a network or a cache.
    pub from_slack: bool,
}

impl ApiError {
    fn unreachable(e: upstream::Error) -> ApiError {
        ApiError {
            status: 0,
            too_large: matches!(e, upstream::Error::TooLarge { .. }),
            error: e.to_string(),
            needed: None,
            retry_after: None,
            from_slack: false,
        }
    }

    /// A refusal that is not Slack's JSON (a status, a page, the file cache).
    pub fn refused(status: u16, error: impl Into<String>) -> ApiError {
        ApiError {
            status,
            error: error.into(),
            needed: None,
            retry_after: None,
            too_large: false,
            from_slack: false,
        }
    }

    /// The file cache refused the bytes: not temporary, its caps or its disk are not Slack's.
    pub fn cache(e: FileError) -> ApiError {
        ApiError::refused(413, e.to_string())
    }

    /// Slack refused the token itself.
    pub fn bad_token(&self) -> bool {
        matches!(
            self.error.as_str(),
            "invalid_auth"
                | "not_authed"
                | "account_inactive"
                | "token_revoked"
                | "token_expired"
                | "not_allowed_token_type"
        )
    }
}

impl crate::providers::Transient for ApiError {
    fn unreachable(&self) -> bool {
        self.status == 0
    }

    fn temporary(&self) -> bool {
        // An answer too large is as large the next time: the caller asks for less.
        let again = self.status == 0
            || self.status == 429
            || self.status >= 500
            || matches!(
                self.error.as_str(),
                "ratelimited" | "internal_error" | "fatal_error" | "service_unavailable"
            );
        again && !self.too_large
    }

    fn retry_after(&self) -> Option<Duration> {
        // Bounded where it is used (`peer_wait::retry_after`).
        self.retry_after.map(Duration::from_secs)
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.status, &self.needed) {
            (0, _) => write!(f, "Slack unreachable: {}", self.error),
            (_, Some(scope)) => write!(f, "Slack refused: missing_scope (the app needs {scope})"),
            (status, None) => write!(f, "Slack answered {status}: {}", self.error),
        }
    }
}

#[derive(Clone)]
pub struct Api {
    base: String,
    http: ureq::Agent,
    /// Downloads and uploads: a slow link's 20 MiB in one call.
    files: ureq::Agent,
}

impl Api {
    pub fn new(base: &str) -> Api {
        Api {
            base: base.trim_end_matches('/').to_string(),
            http: upstream::agent(Duration::from_secs(15)),
            files: upstream::agent(super::FETCH_DEADLINE),
        }
    }

    /// Calls `method` with form parameters, within `timeout`; the whole answer when `ok`.
    pub fn call(
        &self,
        token: &str,
        method: &str,
        params: &[(&str, &str)],
        timeout: Duration,
    ) -> Result<Object, ApiError> {
        let url = format!("{}/{method}", self.base);
        let body = form(params);
        let mut resp = upstream::within(&self.http, self.http.post(&url), timeout)
            .header("Authorization", &format!("Bearer {token}"))
            .header("Content-Type", "application/x-www-form-urlencoded")
            .send(body.as_bytes())
            .map_err(|e| ApiError::unreachable(e.into()))?;
        let retry_after = resp
            .headers()
            .get("Retry-After")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        let (status, answer) = upstream::read_json(&mut resp, MAX_ANSWER).map_err(ApiError::unreachable)?;
        let Some(o) = answer else {
            let mut e = ApiError::refused(status, format!("the answer to {method} is not JSON"));
            e.retry_after = retry_after;
            return Err(e);
        };
        if status == 200 && matches!(o.get("ok"), Some(Value::Bool(true))) {
            return Ok(o);
        }
        // Slack's error codes are `snake_case` words, its scopes `a:b` lists: anything else (a
        // server echoing what it was sent, the token included) is not shown.
        let text = |o: &Object, k: &str| {
            json::get_str(o, k)
                .filter(|e| e.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.:,-".contains(&b)))
                .map(|e| e.chars().take(MAX_ERROR).collect::<String>())
        };
        let error = text(&o, "error").unwrap_or_else(|| "an error it did not name".into());
        Err(ApiError {
            status: if status == 200 { 400 } else { status },
            needed: text(&o, "needed").filter(|_| error == "missing_scope"),
            error,
            retry_after,
            too_large: false,
            from_slack: true,
        })
    }

    /// Downloads a message's file into `part`, within `timeout`; the server's content type.
    pub fn download(
        &self,
        token: &str,
        url: &str,
        part: &mut FilePart,
        timeout: Duration,
    ) -> Result<Option<String>, ApiError> {
        let mut resp = upstream::within(&self.files, self.files.get(url), timeout)
            .header("Authorization", &format!("Bearer {token}"))
            .call()
            .map_err(|e| ApiError::unreachable(upstream::Error::from(e).hiding(url, "the file's URL")))?;
        let status = resp.status().as_u16();
        let content_type = resp
            .headers()
            .get("Content-Type")
            .and_then(|v| v.to_str().ok())
            .map(|c| c.chars().take(128).collect::<String>());
        if status != 200 {
            return Err(ApiError::refused(status, "the file download was refused"));
        }
        // Slack answers a request it does not accept with its sign-in page, not with a status.
        if content_type.as_deref().is_some_and(|c| c.starts_with("text/html")) {
            return Err(ApiError::refused(
                403,
                "Slack answered a web page, not the file (does the app have the files:read scope?)",
            ));
        }
        match upstream::stream_body(&mut resp, |piece| part.write(piece)) {
            Ok(()) => Ok(content_type),
            Err(Streamed::Read(e)) => Err(ApiError::unreachable(e)),
            Err(Streamed::Write(e)) => Err(ApiError::cache(e)),
        }
    }

    /// Streams a file's bytes to the URL `files.getUploadURLExternal` gave (it needs no token).
    pub fn upload(&self, url: &str, bytes: &std::fs::File, timeout: Duration) -> Result<(), ApiError> {
        let mut resp = upstream::within(&self.files, self.files.post(url), timeout)
            .header("Content-Type", "application/octet-stream")
            .send(bytes)
            .map_err(|e| ApiError::unreachable(upstream::Error::from(e).hiding(url, "the upload URL")))?;
        let status = resp.status().as_u16();
        // The body is a short status line; read (capped) so the connection can be reused.
        let _ = upstream::read_body(&mut resp, 4096);
        match status {
            200 => Ok(()),
            _ => Err(ApiError::refused(status, "the upload was refused")),
        }
    }
}

/// `application/x-www-form-urlencoded` (the WHATWG URL standard's byte serializer).
pub fn form(params: &[(&str, &str)]) -> String {
    let mut out = String::new();
    for (i, (k, v)) in params.iter().enumerate() {
        if i > 0 {
            out.push('&');
        }
        encode_into(&mut out, k);
        out.push('=');
        encode_into(&mut out, v);
    }
    out
}

fn encode_into(out: &mut String, s: &str) {
    for b in s.bytes() {
        match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'*' | b'-' | b'.' | b'_' => out.push(b as char),
            b' ' => out.push('+'),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn form_bodies_encode_every_reserved_byte() {
        assert_eq!(
            form(&[("channel", "C01"), ("text", "a b&c=d/é")]),
            "channel=C01&text=a+b%26c%3Dd%2F%C3%A9"
        );
    }
}
