//! A small Slack Web API client (https://api.slack.com/web) over `upstream`.
//!
//! Every method is a form-encoded POST to `{api_base}/{method}` with the token in the
//! `Authorization` header (never in a URL, so no error text can carry it) and answers
//! `{"ok":true,…}` or `{"ok":false,"error":"…"}` with 200; a rate limit is `429` with
//! `Retry-After` in whole seconds. Files download with the bot token from `url_private_download`;
//! uploads go as raw bytes to the URL `files.getUploadURLExternal` gave, with no token.

use std::time::Duration;

use crate::files::FilePart;
use crate::json::{self, Object, Value};
pub use crate::upstream::ApiError;
use crate::upstream::{self, Kind, Platform};

/// An answer larger than this is refused unread: a history page of 200 messages at Slack's
/// 40,000 characters each would pass it, so the catch-up asks for fewer when it is refused.
pub const MAX_ANSWER: u64 = 1 << 20;
/// Characters of an error's text kept (it reaches logs and tool results).
const MAX_ERROR: usize = 100;

/// Slack: its errors are `snake_case` words (a refusal answers 200).
pub static PLATFORM: Platform = Platform {
    retry_too_large: false,
    ..Platform::new("Slack", classify)
};

/// Slack's `error` word, or what went wrong when Slack named none.
pub fn error(e: &ApiError) -> &str {
    match e.code.is_empty() {
        true => &e.message,
        false => &e.code,
    }
}

fn classify(_: u16, error: &str) -> Option<Kind> {
    match error {
        "ratelimited" => Some(Kind::RateLimited),
        "internal_error" | "fatal_error" | "service_unavailable" => Some(Kind::Transient),
        "invalid_auth"
        | "not_authed"
        | "account_inactive"
        | "token_revoked"
        | "token_expired"
        | "not_allowed_token_type" => Some(Kind::Auth),
        "channel_not_found" => Some(Kind::Gone),
        _ => None,
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
            .map_err(|e| PLATFORM.unreachable(e.into()))?;
        let retry_after = upstream::retry_after(&resp);
        let (status, answer) = upstream::read_json(&mut resp, MAX_ANSWER).map_err(|e| PLATFORM.unreachable(e))?;
        let Some(o) = answer else {
            return Err(ApiError {
                retry_after,
                ..PLATFORM.refused(status, format!("the answer to {method} is not JSON"))
            });
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
        let code = text(&o, "error").unwrap_or_default();
        let needed = text(&o, "needed").filter(|_| code == "missing_scope");
        let message = match (&needed, code.is_empty()) {
            (Some(scope), _) => format!("the app needs {scope}"),
            (None, true) => "an error it did not name".into(),
            (None, false) => String::new(),
        };
        Err(ApiError {
            code,
            retry_after,
            from_peer: true,
            detail: needed,
            ..PLATFORM.refused(if status == 200 { 400 } else { status }, message)
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
            .map_err(|e| PLATFORM.unreachable(upstream::Error::from(e).hiding(url, "the file's URL")))?;
        let status = resp.status().as_u16();
        let content_type = upstream::content_type(&resp);
        if status != 200 {
            return Err(PLATFORM.refused(status, "the file download was refused"));
        }
        // Slack answers a request it does not accept with its sign-in page, not with a status.
        if content_type.as_deref().is_some_and(|c| c.starts_with("text/html")) {
            return Err(PLATFORM.refused(
                403,
                "Slack answered a web page, not the file (does the app have the files:read scope?)",
            ));
        }
        PLATFORM.save(&mut resp, part)?;
        Ok(content_type)
    }

    /// Streams a file's bytes to the URL `files.getUploadURLExternal` gave (it needs no token).
    pub fn upload(&self, url: &str, bytes: &std::fs::File, timeout: Duration) -> Result<(), ApiError> {
        let mut resp = upstream::within(&self.files, self.files.post(url), timeout)
            .header("Content-Type", "application/octet-stream")
            .send(bytes)
            .map_err(|e| PLATFORM.unreachable(upstream::Error::from(e).hiding(url, "the upload URL")))?;
        let status = resp.status().as_u16();
        // The body is a short status line; read (capped) so the connection can be reused.
        let _ = upstream::read_body(&mut resp, 4096);
        match status {
            200 => Ok(()),
            _ => Err(PLATFORM.refused(status, "the upload was refused")),
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
