//! A small Telegram Bot API client (https://core.telegram.org/bots/api) over ureq.
//!
//! Every call goes to `{api_base}/bot{token}/{method}` with a JSON body and answers
//! `{"ok":true,"result":…}` or `{"ok":false,"error_code":…,"description":…,"parameters":{…}}`.
//! The token is part of every URL, so no error text leaves this module before the token is
//! scrubbed from it.

use std::time::Duration;

use crate::json::{self, Value};

/// Long polls wait this long at Telegram; the HTTP timeout adds a margin.
pub const POLL_SECONDS: u64 = 25;

#[derive(Debug, Clone)]
pub struct ApiError {
    /// Telegram's `error_code` (HTTP-like), or 0 when the server could not be reached.
    pub code: u16,
    pub description: String,
    pub retry_after: Option<u64>,
}

impl crate::providers::Transient for ApiError {
    fn unreachable(&self) -> bool {
        self.code == 0
    }

    fn temporary(&self) -> bool {
        self.code == 0 || self.code == 429 || self.code >= 500
    }

    fn retry_after(&self) -> Option<Duration> {
        // Bounded where it is used (`peer_wait::retry_after`).
        self.retry_after.map(Duration::from_secs)
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.code == 0 {
            write!(f, "Telegram unreachable: {}", self.description)
        } else {
            write!(f, "Telegram answered {}: {}", self.code, self.description)
        }
    }
}

#[derive(Clone)]
pub struct Api {
    base: String,
    http: ureq::Agent,
    poll: ureq::Agent,
}

fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .timeout_connect(Some(Duration::from_secs(5)))
        .http_status_as_error(false)
        .build()
        .into()
}

impl Api {
    pub fn new(base: &str) -> Api {
        Api {
            base: base.trim_end_matches('/').to_string(),
            http: agent(Duration::from_secs(15)),
            poll: agent(Duration::from_secs(POLL_SECONDS + 10)),
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

    /// Downloads a file named by `getFile`'s `file_path`, at most `limit` bytes, within
    /// `timeout`. The URL holds the token, so it never leaves this function.
    pub fn download(&self, token: &str, file_path: &str, limit: u64, timeout: Duration) -> Result<Vec<u8>, ApiError> {
        let url = format!("{}/file/bot{token}/{file_path}", self.base);
        let scrub = |s: String| s.replace(token, "<token>");
        let unreachable = |e: ureq::Error| ApiError {
            code: 0,
            description: scrub(e.to_string()),
            retry_after: None,
        };
        let mut resp = self
            .http
            .get(&url)
            .config()
            .timeout_global(Some(timeout))
            .build()
            .call()
            .map_err(unreachable)?;
        let status = resp.status().as_u16();
        if status != 200 {
            return Err(ApiError {
                code: status,
                description: "file download refused".into(),
                retry_after: None,
            });
        }
        resp.body_mut()
            .with_config()
            .limit(limit)
            .read_to_vec()
            .map_err(|e| ApiError {
                code: 413,
                description: scrub(e.to_string()),
                retry_after: None,
            })
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
        let scrub = |s: String| s.replace(token, "<token>");
        let mut req = agent.post(&url);
        if let Some(t) = timeout {
            let agent_limit = agent.config().timeouts().global.unwrap_or(t);
            req = req.config().timeout_global(Some(t.min(agent_limit))).build();
        }
        let mut resp = req
            .header("Content-Type", ctype)
            .send(&body[..])
            .map_err(|e| ApiError {
                code: 0,
                description: scrub(e.to_string()),
                retry_after: None,
            })?;
        let status = resp.status().as_u16();
        let text = resp
            .body_mut()
            .with_config()
            .limit(8 << 20)
            .read_to_string()
            .map_err(|e| ApiError {
                code: 0,
                description: scrub(e.to_string()),
                retry_after: None,
            })?;
        let v = json::parse(&text).map_err(|_| ApiError {
            code: status,
            description: format!("answer to {method} is not JSON"),
            retry_after: None,
        })?;
        let o = json::as_object(&v).cloned().unwrap_or_default();
        if matches!(o.get("ok"), Some(Value::Bool(true))) {
            return Ok(o.get("result").cloned().unwrap_or(Value::Null));
        }
        let code = json::get_u64(&o, "error_code").map_or(status, |c| c as u16);
        Err(ApiError {
            code: if code == 0 { 500 } else { code },
            description: scrub(json::get_str(&o, "description").unwrap_or("no description").to_string()),
            retry_after: json::get_obj(&o, "parameters").and_then(|p| json::get_u64(p, "retry_after")),
        })
    }
}
