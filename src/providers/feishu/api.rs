//! A small Feishu/Lark Open Platform client over ureq: the app's `tenant_access_token`
//! (cached, renewed before it expires, fetched again when the server calls it invalid), JSON
//! calls, multipart uploads, message resource downloads, and the long connection's endpoint
//! request.
//!
//! Every answer is `{"code": 0, "msg": …, "data": …}`; a nonzero `code` is an error whatever
//! the HTTP status. The token travels only in the `Authorization` header and the app secret
//! only in request bodies, so no URL or error text carries either.

use std::time::Duration;

use crate::config::Secret;
use crate::files::FilePart;
use crate::json::{self, obj, s, Value};
use crate::providers::tokens::Tokens;
pub use crate::upstream::ApiError;
use crate::upstream::{self, Kind, Platform};

/// Feishu's code for "too many requests" (with HTTP 429 or 400).
const CODE_RATE_LIMITED: i64 = 99991400;
/// Codes meaning the token is missing, invalid or expired: fetch a new one and call again.
const TOKEN_CODES: &[i64] = &[99991661, 99991663, 99991664, 99991668, 99991677];
/// Answers larger than this are refused (JSON answers are small; downloads have their own cap).
const MAX_ANSWER: u64 = 1 << 20;

/// An app's credentials.
#[derive(Clone)]
pub struct AppCreds {
    pub app_id: String,
    pub secret: Secret,
}

/// Feishu: a nonzero `code` is an error whatever the status.
pub static PLATFORM: Platform = Platform::new("Feishu", classify);

fn classify(_: u16, code: &str) -> Option<Kind> {
    match code.parse::<i64>().ok()? {
        CODE_RATE_LIMITED => Some(Kind::RateLimited),
        c if TOKEN_CODES.contains(&c) => Some(Kind::Auth),
        // A chat ID it does not know.
        232001 | 232006 => Some(Kind::Gone),
        _ => None,
    }
}

/// Feishu no longer takes the token: fetch a new one and call again.
pub fn token_invalid(e: &ApiError) -> bool {
    e.kind() == Kind::Auth
}

pub struct Api {
    base: String,
    http: ureq::Agent,
    /// Each app's token, by app ID.
    tokens: Tokens,
}

impl Api {
    pub fn new(base: &str) -> Api {
        Api {
            base: base.trim_end_matches('/').to_string(),
            http: upstream::agent(Duration::from_secs(15)),
            tokens: Tokens::new("feishu: app"),
        }
    }

    /// The app's `tenant_access_token`: the kept one while it has time left, else a new one.
    pub fn token(&self, app: &AppCreds, timeout: Duration) -> Result<String, ApiError> {
        self.tokens.get(&app.app_id, || self.new_token(app, timeout))
    }

    fn new_token(&self, app: &AppCreds, timeout: Duration) -> Result<(String, u64), ApiError> {
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
            .ok_or_else(|| PLATFORM.refused(0, "the token answer has no tenant_access_token"))?
            .to_string();
        Ok((value, json::get_u64(&o, "expire").unwrap_or(0)))
    }

    /// Forgets the app's token (its credentials changed or it was refused).
    pub fn forget_token(&self, app_id: &str) {
        self.tokens.forget(app_id);
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
            let mut o = self.send_json(method, path, Some(token), body, timeout)?;
            Ok(o.remove("data").unwrap_or(Value::Null))
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
            let mut o = read_answer(req.send(body))?;
            Ok(o.remove("data").unwrap_or(Value::Null))
        })
    }

    /// Downloads a file of a message into `part`; the type the server gives it.
    pub fn download(
        &self,
        app: &AppCreds,
        path: &str,
        part: &mut FilePart,
        timeout: Duration,
    ) -> Result<Option<String>, ApiError> {
        self.authorized(app, timeout, |token| {
            let mut resp = self
                .get(path, timeout)
                .header("Authorization", &format!("Bearer {token}"))
                .call()
                .map_err(|e| PLATFORM.unreachable(e.into()))?;
            let status = resp.status().as_u16();
            let content_type = upstream::content_type(&resp);
            if status != 200
                || content_type
                    .as_deref()
                    .is_some_and(|c| c.starts_with("application/json"))
            {
                // Errors come as JSON, whatever the status.
                let o = upstream::read_json(&mut resp, MAX_ANSWER).ok().and_then(|(_, o)| o);
                return Err(error_of(status, o.as_ref()));
            }
            PLATFORM.save(&mut resp, part)?;
            Ok(content_type)
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
            .map_err(|e| PLATFORM.unreachable(e.into()))?;
        let status = resp.status().as_u16();
        if status != 200 {
            // A refusal keeps its status even when its body cannot be read.
            let o = upstream::read_json(&mut resp, MAX_ANSWER).ok().and_then(|(_, o)| o);
            return Err(error_of(status, o.as_ref()));
        }
        let body = upstream::read_body(&mut resp, MAX_ANSWER).map_err(|e| PLATFORM.unreachable(e))?;
        String::from_utf8(body).map_err(|_| PLATFORM.refused(0, "the endpoint answer is not text"))
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
        attempt: impl FnMut(&str) -> Result<T, ApiError>,
    ) -> Result<T, ApiError> {
        let fetch = || self.new_token(app, timeout);
        self.tokens.authorized(&app.app_id, fetch, token_invalid, attempt)
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

/// Reads a JSON answer: the object when its `code` is 0.
fn read_answer(sent: Result<upstream::Response, ureq::Error>) -> Result<json::Object, ApiError> {
    let mut resp = sent.map_err(|e| PLATFORM.unreachable(e.into()))?;
    match upstream::read_json(&mut resp, MAX_ANSWER).map_err(|e| PLATFORM.unreachable(e))? {
        (200, Some(o)) if code_of(&o) == Some(0) => Ok(o),
        (status, o) => Err(error_of(status, o.as_ref())),
    }
}

fn code_of(o: &json::Object) -> Option<i64> {
    match o.get("code") {
        Some(Value::Number(json::Number::U64(n))) => i64::try_from(*n).ok(),
        Some(Value::Number(json::Number::I64(n))) => Some(*n),
        _ => None,
    }
}

/// The error an answer stands for: its `code` and `msg` when it has them.
fn error_of(status: u16, o: Option<&json::Object>) -> ApiError {
    let code = o.and_then(code_of).unwrap_or(0);
    let msg = o
        .and_then(|o| json::get_str(o, "msg"))
        .unwrap_or(if o.is_some() {
            "no message"
        } else {
            "an answer that is not JSON"
        })
        .chars()
        .take(200)
        .collect::<String>();
    ApiError {
        code: match code {
            0 => String::new(),
            c => c.to_string(),
        },
        from_peer: o.is_some(),
        // A 200 with a nonzero code is still an error; keep the status it came with.
        ..PLATFORM.refused(if status == 0 { 500 } else { status }, msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::Transient;

    fn error_text(status: u16, text: &str) -> ApiError {
        let o = json::parse(text).ok().and_then(|v| match v {
            Value::Object(o) => Some(o),
            _ => None,
        });
        error_of(status, o.as_ref())
    }

    #[test]
    fn answers_with_a_code_are_errors_and_rate_limits_and_server_errors_are_temporary() {
        let e = error_text(400, r#"{"code":232011,"msg":"Operator can NOT be out of the chat."}"#);
        assert_eq!((e.status, e.code.as_str()), (400, "232011"));
        assert!(!e.temporary());
        assert!(error_text(400, r#"{"code":99991400,"msg":"request trigger frequency limit"}"#).temporary());
        assert!(error_text(502, "<html>bad gateway</html>").temporary());
        assert!(token_invalid(&error_text(
            200,
            r#"{"code":99991663,"msg":"Invalid access token"}"#
        )));
        let long = format!(r#"{{"code":1,"msg":"{}"}}"#, "x".repeat(5000));
        assert_eq!(
            error_text(400, &long).message.len(),
            200,
            "a server's message is bounded"
        );
    }
}
