//! A small Feishu/Lark Open Platform client over ureq: the app's `tenant_access_token`
//! (cached, renewed before it expires, fetched again when the server calls it invalid), JSON
//! calls, multipart uploads, message resource downloads, and the long connection's endpoint
//! request.
//!
//! Every answer is `{"code": 0, "msg": …, "data": …}`; a nonzero `code` is an error whatever
//! the HTTP status. The token travels only in the `Authorization` header and the app secret
//! only in request bodies, so no URL or error text carries either.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::config::Secret;
use crate::json::{self, obj, s, Value};
use crate::providers::Transient;

/// Feishu's code for "too many requests" (with HTTP 429 or 400).
const CODE_RATE_LIMITED: i64 = 99991400;
/// Codes meaning the token is missing, invalid or expired: fetch a new one and call again.
const TOKEN_CODES: &[i64] = &[99991661, 99991663, 99991664, 99991668, 99991677];
/// A token is renewed this long before Feishu says it expires.
const RENEW_EARLY: Duration = Duration::from_secs(300);
/// Answers larger than this are refused (JSON answers are small; downloads have their own cap).
const MAX_ANSWER: u64 = 1 << 20;

/// An app's credentials.
#[derive(Clone)]
pub struct AppCreds {
    pub app_id: String,
    pub secret: Secret,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// The HTTP status, or 0 when the server could not be reached or answered nonsense.
    pub status: u16,
    /// Feishu's `code` (0 when the answer had none).
    pub code: i64,
    pub msg: String,
}

impl ApiError {
    fn unreachable(e: impl std::fmt::Display) -> ApiError {
        ApiError {
            status: 0,
            code: 0,
            msg: e.to_string(),
        }
    }

    /// The server no longer takes the token.
    pub fn token_invalid(&self) -> bool {
        TOKEN_CODES.contains(&self.code)
    }
}

impl Transient for ApiError {
    fn unreachable(&self) -> bool {
        self.status == 0
    }

    fn temporary(&self) -> bool {
        self.status == 0 || self.status == 429 || self.status >= 500 || self.code == CODE_RATE_LIMITED
    }

    fn retry_after(&self) -> Option<Duration> {
        None
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.status, self.code) {
            (0, _) => write!(f, "Feishu unreachable: {}", self.msg),
            (status, 0) => write!(f, "Feishu answered HTTP {status}: {}", self.msg),
            (status, code) => write!(f, "Feishu answered HTTP {status}, code {code}: {}", self.msg),
        }
    }
}

struct Token {
    value: String,
    renew_at: Instant,
}

pub struct Api {
    base: String,
    http: ureq::Agent,
    /// app_id → its current token.
    tokens: Mutex<HashMap<String, Token>>,
}

/// A file downloaded from a message.
pub struct Download {
    pub bytes: Vec<u8>,
    pub content_type: Option<String>,
}

impl Api {
    pub fn new(base: &str) -> Api {
        Api {
            base: base.trim_end_matches('/').to_string(),
            http: ureq::Agent::config_builder()
                .timeout_global(Some(Duration::from_secs(15)))
                .timeout_connect(Some(Duration::from_secs(5)))
                .http_status_as_error(false)
                .build()
                .into(),
            tokens: Mutex::new(HashMap::new()),
        }
    }

    /// The app's `tenant_access_token`: the cached one while it has time left, else a new one.
    pub fn token(&self, app: &AppCreds, timeout: Duration) -> Result<String, ApiError> {
        let now = Instant::now();
        if let Some(t) = self.lock().get(&app.app_id).filter(|t| t.renew_at > now) {
            return Ok(t.value.clone());
        }
        let body = obj([("app_id", s(&app.app_id)), ("app_secret", s(app.secret.expose()))]);
        let o = self.send_json(
            "POST",
            "/open-apis/auth/v3/tenant_access_token/internal",
            None,
            Some(&body),
            timeout,
        )?;
        let value = json::get_str(&o, "tenant_access_token")
            .filter(|t| !t.is_empty())
            .ok_or_else(|| ApiError::unreachable("the token answer has no tenant_access_token"))?
            .to_string();
        let keep = kept_for(json::get_u64(&o, "expire").unwrap_or(0));
        self.lock().insert(
            app.app_id.clone(),
            Token {
                value: value.clone(),
                renew_at: now + keep,
            },
        );
        Ok(value)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Token>> {
        self.tokens.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Forgets the app's token (its credentials changed or it was refused).
    pub fn forget_token(&self, app_id: &str) {
        self.lock().remove(app_id);
    }

    /// An API call with the app's token; the answer's `data`. A token the server no longer
    /// takes is fetched again once.
    pub fn call(
        &self,
        app: &AppCreds,
        method: &str,
        path: &str,
        body: Option<&Value>,
        timeout: Duration,
    ) -> Result<Value, ApiError> {
        self.authorized(app, timeout, |token| {
            let o = self.send_json(method, path, Some(token), body, timeout)?;
            Ok(o.get("data").cloned().unwrap_or(Value::Null))
        })
    }

    /// A multipart/form-data upload (`body` is complete, with `boundary`); the answer's `data`.
    pub fn upload(
        &self,
        app: &AppCreds,
        path: &str,
        boundary: &str,
        body: &[u8],
        timeout: Duration,
    ) -> Result<Value, ApiError> {
        let ctype = format!("multipart/form-data; boundary={boundary}");
        self.authorized(app, timeout, |token| {
            let req = self
                .post(path, timeout)
                .header("Authorization", &format!("Bearer {token}"))
                .header("Content-Type", &ctype);
            let o = read_answer(req.send(body))?;
            Ok(o.get("data").cloned().unwrap_or(Value::Null))
        })
    }

    /// Downloads a file of a message (at most `limit` bytes).
    pub fn download(&self, app: &AppCreds, path: &str, limit: u64, timeout: Duration) -> Result<Download, ApiError> {
        self.authorized(app, timeout, |token| {
            let mut resp = self
                .get(path, timeout)
                .header("Authorization", &format!("Bearer {token}"))
                .call()
                .map_err(ApiError::unreachable)?;
            let status = resp.status().as_u16();
            let content_type = resp
                .headers()
                .get("Content-Type")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            if status != 200
                || content_type
                    .as_deref()
                    .is_some_and(|c| c.starts_with("application/json"))
            {
                // Errors come as JSON, whatever the status.
                let text = answer_text(&mut resp).unwrap_or_default();
                return Err(error_of(status, &text));
            }
            let bytes = resp
                .body_mut()
                .with_config()
                .limit(limit)
                .read_to_vec()
                .map_err(|e| ApiError {
                    status: 413,
                    code: 0,
                    msg: format!("the file is larger than the cache allows: {e}"),
                })?;
            Ok(Download { bytes, content_type })
        })
    }

    /// The long connection's endpoint request; the raw answer for `longconn::read_endpoint`.
    pub fn endpoint(&self, app: &AppCreds, path: &str, timeout: Duration) -> Result<String, ApiError> {
        let body = obj([("AppID", s(&app.app_id)), ("AppSecret", s(app.secret.expose()))]);
        let req = self
            .post(path, timeout)
            .header("Content-Type", "application/json")
            .header("locale", "en");
        let mut resp = req
            .send(json::to_string(&body).as_bytes())
            .map_err(ApiError::unreachable)?;
        let status = resp.status().as_u16();
        let text = answer_text(&mut resp)?;
        match status {
            200 => Ok(text),
            _ => Err(error_of(status, &text)),
        }
    }

    fn post(&self, path: &str, timeout: Duration) -> ureq::RequestBuilder<ureq::typestate::WithBody> {
        let url = format!("{}{path}", self.base);
        self.http.post(&url).config().timeout_global(Some(timeout)).build()
    }

    fn get(&self, path: &str, timeout: Duration) -> ureq::RequestBuilder<ureq::typestate::WithoutBody> {
        let url = format!("{}{path}", self.base);
        self.http.get(&url).config().timeout_global(Some(timeout)).build()
    }

    /// Runs `attempt` with the app's token; once more with a new token if it was refused.
    fn authorized<T>(
        &self,
        app: &AppCreds,
        timeout: Duration,
        attempt: impl Fn(&str) -> Result<T, ApiError>,
    ) -> Result<T, ApiError> {
        let token = self.token(app, timeout)?;
        match attempt(&token) {
            Err(e) if e.token_invalid() => {
                log::info!(
                    "feishu: app {}: the server refused its token ({e}); fetching a new one",
                    app.app_id
                );
                self.forget_token(&app.app_id);
                let token = self.token(app, timeout)?;
                attempt(&token)
            }
            other => other,
        }
    }

    fn send_json(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&Value>,
        timeout: Duration,
    ) -> Result<json::Object, ApiError> {
        let auth = token.map(|t| format!("Bearer {t}"));
        let sent = if method == "GET" {
            let mut req = self.get(path, timeout);
            if let Some(a) = &auth {
                req = req.header("Authorization", a);
            }
            req.call()
        } else {
            let mut req = self
                .post(path, timeout)
                .header("Content-Type", "application/json; charset=utf-8");
            if let Some(a) = &auth {
                req = req.header("Authorization", a);
            }
            let text = body.map(json::to_string).unwrap_or_else(|| "{}".into());
            req.send(text.as_bytes())
        };
        read_answer(sent)
    }
}

/// How long a token Feishu says lives `expire` seconds is used: until `RENEW_EARLY` before its
/// end, or half its life when that is shorter; a day at most, whatever the server says.
fn kept_for(expire: u64) -> Duration {
    let lifetime = Duration::from_secs(expire.min(86_400));
    lifetime.saturating_sub(RENEW_EARLY).max(lifetime / 2)
}

/// Reads a JSON answer: the object when its `code` is 0.
fn read_answer(sent: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Result<json::Object, ApiError> {
    let mut resp = sent.map_err(ApiError::unreachable)?;
    let status = resp.status().as_u16();
    let text = answer_text(&mut resp)?;
    let o = json::parse(&text).ok().and_then(|v| json::as_object(&v).cloned());
    match o {
        Some(o) if status == 200 && code_of(&o) == Some(0) => Ok(o),
        _ => Err(error_of(status, &text)),
    }
}

/// An answer's body as text, at most `MAX_ANSWER` bytes.
fn answer_text(resp: &mut ureq::http::Response<ureq::Body>) -> Result<String, ApiError> {
    resp.body_mut()
        .with_config()
        .limit(MAX_ANSWER)
        .read_to_string()
        .map_err(ApiError::unreachable)
}

fn code_of(o: &json::Object) -> Option<i64> {
    match o.get("code") {
        Some(Value::Number(json::Number::U64(n))) => i64::try_from(*n).ok(),
        Some(Value::Number(json::Number::I64(n))) => Some(*n),
        _ => None,
    }
}

/// The error an answer stands for: its `code` and `msg` when it has them.
fn error_of(status: u16, text: &str) -> ApiError {
    let o = json::parse(text).ok().and_then(|v| json::as_object(&v).cloned());
    let code = o.as_ref().and_then(code_of).unwrap_or(0);
    let msg = o
        .as_ref()
        .and_then(|o| json::get_str(o, "msg"))
        .unwrap_or(if o.is_some() {
            "no message"
        } else {
            "an answer that is not JSON"
        })
        .chars()
        .take(200)
        .collect();
    ApiError {
        // A 200 with a nonzero code is still an error; keep the status it came with.
        status: if status == 0 { 500 } else { status },
        code,
        msg,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_renewed_five_minutes_before_it_expires_or_at_half_life() {
        assert_eq!(kept_for(7200), Duration::from_secs(6900), "Feishu's two hours");
        assert_eq!(kept_for(400), Duration::from_secs(200), "a short token: half its life");
        assert_eq!(kept_for(0), Duration::ZERO, "no lifetime: fetched again next time");
        assert_eq!(kept_for(u64::MAX), Duration::from_secs(86_100), "a day at most");
    }

    #[test]
    fn answers_with_a_code_are_errors_and_rate_limits_and_server_errors_are_temporary() {
        let e = error_of(400, r#"{"code":232011,"msg":"Operator can NOT be out of the chat."}"#);
        assert_eq!((e.status, e.code), (400, 232011));
        assert!(!e.temporary());
        assert!(error_of(400, r#"{"code":99991400,"msg":"request trigger frequency limit"}"#).temporary());
        assert!(error_of(502, "<html>bad gateway</html>").temporary());
        assert!(error_of(200, r#"{"code":99991663,"msg":"Invalid access token"}"#).token_invalid());
        let long = format!(r#"{{"code":1,"msg":"{}"}}"#, "x".repeat(5000));
        assert_eq!(error_of(400, &long).msg.len(), 200, "a server's message is bounded");
    }
}
