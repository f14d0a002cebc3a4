//! `ApiError`: an IM system's API failed, the same type for every provider. Each provider names
//! its `Platform` (how messages call it, and its classifier: which of its statuses and codes
//! are a refused credential, a rate limit, a thing gone, a server's failure), so the same kind
//! of failure is told apart the same way everywhere.

use std::time::Duration;

use super::Error;

/// What kind of failure an IM system's answer is, as its platform's classifier reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// No answer, or none readable (status 0).
    Unreachable,
    /// The platform refused the credential: a token invalid, revoked or expired, a login ended.
    Auth,
    /// Too many calls: the same call may pass after a wait.
    RateLimited,
    /// What the call names (a conversation, a webhook) is unknown or gone.
    Gone,
    /// The server failed (a 5xx, its own internal error): the same call may pass later.
    Transient,
    /// Any other refusal: the same call meets it again.
    Refused,
}

impl Kind {
    /// Whether the same call may pass later.
    pub fn temporary(self) -> bool {
        matches!(self, Kind::Unreachable | Kind::RateLimited | Kind::Transient)
    }
}

/// An IM system as its errors name and classify it; each provider has one `static`.
#[derive(Debug)]
pub struct Platform {
    /// How messages name it: `Slack`, `homeserver`.
    pub name: &'static str,
    /// What the platform's own codes say of an answer with this status (never 0) and code (""
    /// if none); `None`: as HTTP says (429 a rate limit, 5xx the server's failure).
    pub classify: fn(status: u16, code: &str) -> Option<Kind>,
    /// How long a rate limit that names no wait holds, if the platform's counting is known.
    pub rate_wait: Option<Duration>,
    /// Whether a call whose answer passed its cap may be made again (`false`: the answer is
    /// as large the next time, the caller asks for less).
    pub retry_too_large: bool,
}

impl Platform {
    /// A platform named `name` with its classifier; no known rate wait, a call whose answer
    /// was too large may be made again.
    pub const fn new(name: &'static str, classify: fn(u16, &str) -> Option<Kind>) -> Platform {
        Platform {
            name,
            classify,
            rate_wait: None,
            retry_too_large: true,
        }
    }

    /// What `upstream` reported: no (whole) answer.
    pub fn unreachable(&'static self, e: Error) -> ApiError {
        ApiError {
            too_large: matches!(e, Error::TooLarge { .. }),
            timed_out: e == Error::TimedOut,
            ..self.refused(0, e)
        }
    }

    /// A refusal with `status` and no code of the platform's: a status, a page, an answer
    /// without what it must hold, imgate's own.
    pub fn refused(&'static self, status: u16, message: impl std::fmt::Display) -> ApiError {
        ApiError {
            platform: self,
            status,
            code: String::new(),
            message: message.to_string(),
            retry_after: None,
            too_large: false,
            timed_out: false,
            from_peer: false,
            detail: None,
        }
    }

    /// The file cache refused the bytes (`FileError`): not temporary, its caps or its disk are
    /// not the platform's.
    pub fn cache(&'static self, e: impl std::fmt::Display) -> ApiError {
        self.refused(413, e)
    }

    /// Streams a download's body into the file cache: a failed read is unreachable, a refused
    /// write the cache's (`cache`).
    pub fn save(&'static self, resp: &mut super::Response, part: &mut crate::files::FilePart) -> Result<(), ApiError> {
        match super::stream_body(resp, |piece| part.write(piece)) {
            Ok(()) => Ok(()),
            Err(super::Streamed::Read(e)) => Err(self.unreachable(e)),
            Err(super::Streamed::Write(e)) => Err(self.cache(e)),
        }
    }
}

/// A call of an IM system's API failed.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub platform: &'static Platform,
    /// The HTTP status (Telegram's `error_code`), or 0 when the server could not be reached.
    pub status: u16,
    /// The platform's own code as text (Slack's `error`, Matrix's `errcode`, Feishu's `code`,
    /// Discord's JSON code...), "" if none.
    pub code: String,
    /// The server's words or what went wrong, bounded by the provider; shown escaped.
    pub message: String,
    /// The wait the server asked for, as it said it (bounded where used, `peer_wait`).
    pub retry_after: Option<Duration>,
    /// The answer passed its cap and was not read.
    pub too_large: bool,
    /// No answer within the call's time.
    pub timed_out: bool,
    /// The platform's own JSON said it: not a proxy, a network or a cache.
    pub from_peer: bool,
    /// What the refusal names besides (Slack's `missing_scope`: the scopes `needed`).
    pub detail: Option<String>,
}

impl ApiError {
    /// Its kind, by its platform's classifier.
    pub fn kind(&self) -> Kind {
        match self.status {
            0 => Kind::Unreachable,
            status => (self.platform.classify)(status, &self.code).unwrap_or(match status {
                429 => Kind::RateLimited,
                500.. => Kind::Transient,
                _ => Kind::Refused,
            }),
        }
    }

    /// The error with `secret` (a token) shown as `name`: a server (or a proxy) may echo a
    /// request's header in its error text.
    pub fn hiding(mut self, secret: &str, name: &str) -> ApiError {
        if !secret.is_empty() {
            self.message = self.message.replace(secret, name);
        }
        self
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The server's words, escaped: they reach log lines and tool results.
        let (name, message) = (self.platform.name, crate::quiet::shown(&self.message));
        if self.status == 0 {
            return write!(f, "{name} unreachable: {message}");
        }
        write!(f, "{name} answered {}", self.status)?;
        if !self.code.is_empty() {
            write!(f, " {}", crate::quiet::shown(&self.code))?;
        }
        match message.is_empty() {
            true => Ok(()),
            false => write!(f, ": {message}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static TEST: Platform = Platform::new("Test", |status, _| (status == 401).then_some(Kind::Auth));

    #[test]
    fn an_error_shows_its_platform_status_code_and_escaped_words() {
        assert_eq!(
            TEST.unreachable(Error::TimedOut).to_string(),
            "Test unreachable: no answer in time"
        );
        assert!(TEST.unreachable(Error::TimedOut).timed_out);
        assert_eq!(TEST.unreachable(Error::TimedOut).kind(), Kind::Unreachable);
        let e = ApiError {
            code: "E_X".into(),
            ..TEST.refused(401, "bad\ntoken t0k")
        }
        .hiding("t0k", "<token>");
        assert_eq!(e.to_string(), "Test answered 401 E_X: bad\\u{a}token <token>");
        assert_eq!(e.kind(), Kind::Auth);
        assert_eq!(TEST.cache("cache full").to_string(), "Test answered 413: cache full");
        assert!(!TEST.cache("x").kind().temporary() && TEST.refused(503, "").kind().temporary());
    }
}
