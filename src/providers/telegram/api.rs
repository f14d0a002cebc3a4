//! A small Telegram Bot API client (https://core.telegram.org/bots/api) over ureq.
//!
//! Every call goes to `{api_base}/bot{token}/{method}` with a JSON body and answers
//! `{"ok":true,"result":…}` or `{"ok":false,"error_code":…,"description":…,"parameters":{…}}`.
//! The token is part of every URL, so no error text leaves this module before the token is
//! scrubbed from it.

use std::time::Duration;

use crate::files::FilePart;
use crate::json::{self, Value};
pub use crate::upstream::ApiError;
use crate::upstream::{self, Kind, Platform, Streamed};

/// Long polls wait this long at Telegram; the HTTP timeout adds a margin.
pub const POLL_SECONDS: u64 = 25;

/// Telegram: its `error_code` is HTTP's; a bot token it does not know is `401`.
pub static PLATFORM: Platform = Platform::new("Telegram", |code, _| (code == 401).then_some(Kind::Auth));

/// A file is fetched for at most this long (a 5xx or 429 is retried) before the message goes on
/// with a note instead: one broken file must not hold up the bot's other chats for long.
pub(super) const FETCH_DEADLINE: Duration = Duration::from_secs(30);

#[derive(Clone)]
pub struct Api {
    base: String,
    http: ureq::Agent,
    poll: ureq::Agent,
    /// File downloads: the longest a fetch may take (`FETCH_DEADLINE`), a slow link's 20 MiB
    /// included.
    files: ureq::Agent,
}

/// An answer larger than this is refused unread (`ApiError::too_large`): a `getUpdates` batch
/// past it is asked for again in fewer updates (`link.rs`), so no answer of any size is held.
pub const MAX_ANSWER: u64 = 1 << 20;
/// Characters of an error's `description` kept (it reaches logs and tool results).
const MAX_DESCRIPTION: usize = 200;

/// What `upstream` reported, the token scrubbed from it.
fn unreachable(e: upstream::Error, token: &str) -> ApiError {
    PLATFORM.unreachable(e.hiding(token, "<token>"))
}

impl Api {
    pub fn new(base: &str) -> Api {
        Api {
            base: base.trim_end_matches('/').to_string(),
            http: upstream::agent(Duration::from_secs(15)),
            poll: upstream::agent(Duration::from_secs(POLL_SECONDS + 10)),
            files: upstream::agent(FETCH_DEADLINE),
        }
    }

    /// Calls `method` with a JSON object of parameters; returns `result`.
    pub fn call(&self, token: &str, method: &str, params: &Value) -> Result<Value, ApiError> {
        let agent = if method == "getUpdates" { &self.poll } else { &self.http };
        let body = json::to_string(params).into_bytes();
        self.post(agent, token, method, "application/json", body, None)
    }

    /// Like `call`, but gives up after `timeout` at most: a tool must answer in time even when
    /// Telegram accepts the connection and never replies.
    pub fn call_within(&self, token: &str, method: &str, params: &Value, timeout: Duration) -> Result<Value, ApiError> {
        let body = json::to_string(params).into_bytes();
        self.post(&self.http, token, method, "application/json", body, Some(timeout))
    }

    /// Calls `method` with a ready multipart/form-data body (file uploads), within `timeout`.
    pub fn call_multipart(
        &self,
        token: &str,
        method: &str,
        boundary: &str,
        body: Vec<u8>,
        timeout: Duration,
    ) -> Result<Value, ApiError> {
        let ctype = format!("multipart/form-data; boundary={boundary}");
        self.post(&self.http, token, method, &ctype, body, Some(timeout))
    }

    /// Downloads a file named by `getFile`'s `file_path` into `part`, within `timeout`. The
    /// URL holds the token, so it never leaves this function.
    pub fn download(
        &self,
        token: &str,
        file_path: &str,
        part: &mut FilePart,
        timeout: Duration,
    ) -> Result<(), ApiError> {
        let url = format!("{}/file/bot{token}/{file_path}", self.base);
        let mut resp = upstream::within(&self.files, self.files.get(&url), timeout)
            .call()
            .map_err(|e| unreachable(e.into(), token))?;
        let status = resp.status().as_u16();
        if status != 200 {
            return Err(PLATFORM.refused(status, "file download refused"));
        }
        match upstream::stream_body(&mut resp, |piece| part.write(piece)) {
            Ok(()) => Ok(()),
            Err(Streamed::Read(e)) => Err(unreachable(e, token)),
            Err(Streamed::Write(e)) => Err(PLATFORM.cache(e)),
        }
    }

    /// One POST; `timeout` shortens the agent's own limit for this request.
    fn post(
        &self,
        agent: &ureq::Agent,
        token: &str,
        method: &str,
        ctype: &str,
        body: Vec<u8>,
        timeout: Option<Duration>,
    ) -> Result<Value, ApiError> {
        let url = format!("{}/bot{token}/{method}", self.base);
        let mut req = agent.post(&url);
        if let Some(t) = timeout {
            req = upstream::within(agent, req, t);
        }
        let mut resp = req
            .header("Content-Type", ctype)
            .send(&body[..])
            .map_err(|e| unreachable(e.into(), token))?;
        drop(body);
        let (status, answer) = upstream::read_json(&mut resp, MAX_ANSWER).map_err(|e| unreachable(e, token))?;
        let Some(mut o) = answer else {
            return Err(PLATFORM.refused(status, format!("answer to {method} is not JSON")));
        };
        if matches!(o.get("ok"), Some(Value::Bool(true))) {
            return Ok(o.remove("result").unwrap_or(Value::Null));
        }
        let code = json::get_u64(&o, "error_code").map_or(status, |c| u16::try_from(c).unwrap_or(500));
        let description = json::get_str(&o, "description").unwrap_or("no description");
        Err(ApiError {
            retry_after: json::get_obj(&o, "parameters")
                .and_then(|p| json::get_u64(p, "retry_after"))
                .map(Duration::from_secs),
            from_peer: true,
            ..PLATFORM.refused(
                if code == 0 { 500 } else { code },
                description
                    .replace(token, "<token>")
                    .chars()
                    .take(MAX_DESCRIPTION)
                    .collect::<String>(),
            )
        })
    }
}
