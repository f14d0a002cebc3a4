//! A small DingTalk client over `upstream`: the app's access token (cached, renewed before it
//! expires, fetched again when refused), the OpenAPI's JSON calls, the Stream connection's
//! ticket, a conversation's session webhook, the legacy OpenAPI's media upload and message
//! file downloads.
//!
//! The OpenAPI (`api.dingtalk.com`) answers JSON; a refusal is a 4xx/5xx with
//! `{code, message}` (`InvalidAuthentication`, `Forbidden.AccessDenied.QpsLimitForApi`...).
//! The legacy OpenAPI (`oapi.dingtalk.com`) and session webhooks answer `{errcode, errmsg}`,
//! an error whatever the status when `errcode` is not 0. The token travels in the
//! `x-acs-dingtalk-access-token` header, except on the legacy upload, where DingTalk takes it
//! only in the URL: that URL, a session webhook's and a download's are credentials, and are
//! hidden from every error text.

use std::time::Duration;

use crate::config::Secret;
use crate::files::{FileError, FilePart};
use crate::json::{self, obj, s, Object, Value};
use crate::providers::tokens::Tokens;
use crate::providers::{StreamedForm, Upload};
pub use crate::upstream::ApiError;
use crate::upstream::{self, Kind, Platform};

/// Answers larger than this are refused unread (DingTalk's JSON answers are small).
const MAX_ANSWER: u64 = 256 << 10;
/// Characters of a server's message kept (it reaches logs and tool results, escaped).
const MAX_MESSAGE: usize = 200;
/// A throttled call (`…QpsLimit…`) waits at least this long: DingTalk counts per second.
const THROTTLE_WAIT: Duration = Duration::from_secs(1);
/// The session webhook's `errcode` for a webhook past its life.
const HOOK_EXPIRED: &str = "300001";
/// Not a code DingTalk sends: a batchSend it answered with the user in
/// `flowControlledStaffIdList` (it held the message back from them).
const FLOW_CONTROLLED: &str = "flowControlledStaffIdList";
/// The legacy API's codes for a token that is not (or no longer) valid.
const LEGACY_TOKEN_CODES: &[i64] = &[40001, 40014, 42001];

/// An app's credentials: its `clientId` (AppKey, also the robot's `robotCode`) and secret.
#[derive(Clone)]
pub struct AppCreds {
    pub client_id: String,
    pub secret: Secret,
}

/// DingTalk: the OpenAPI's `{code, message}` (a word: `InvalidAuthentication`), the legacy
/// API's and session webhooks' `{errcode, errmsg}` (a number, as text).
pub static PLATFORM: Platform = Platform {
    rate_wait: Some(THROTTLE_WAIT),
    ..Platform::new("DingTalk", classify)
};

fn classify(status: u16, code: &str) -> Option<Kind> {
    // Too many calls for this app or API (the legacy API's 90018; a session webhook's 130101,
    // "send too fast"), or for this user (flow control).
    let throttled = status == 429
        || code == FLOW_CONTROLLED
        || code.contains("QpsLimit")
        || code.contains("Throttling")
        || code == "90018"
        || code == "130101";
    match status {
        _ if throttled => Some(Kind::RateLimited),
        _ if token_code(code) => Some(Kind::Auth),
        // The app's credentials or permissions refused (`Forbidden.AccessDenied...`).
        400 | 401 | 403 if code.starts_with("Forbidden") => Some(Kind::Auth),
        _ if code == HOOK_EXPIRED => Some(Kind::Gone),
        _ => None,
    }
}

/// DingTalk's codes for a token it no longer takes (400 or 401 `InvalidAuthentication`, or a
/// legacy code).
fn token_code(code: &str) -> bool {
    code == "InvalidAuthentication"
        || code.starts_with("InvalidAuthentication.")
        || LEGACY_TOKEN_CODES.iter().any(|c| code == c.to_string())
}

/// DingTalk no longer takes the token: fetch a new one and call again.
pub fn token_invalid(e: &ApiError) -> bool {
    token_code(&e.code)
}

/// DingTalk itself refused the app's credentials (a wrong `clientId` or secret, Stream mode
/// off): its JSON refusal, not a proxy's page.
pub fn credentials_refused(e: &ApiError) -> bool {
    matches!(e.status, 400 | 401 | 403) && !e.code.is_empty() && e.kind() != Kind::RateLimited
}

/// DingTalk held a one-to-one message back from its user (`flowControlledStaffIdList`):
/// nothing was sent, so it is sent again as a throttled call is.
pub fn flow_controlled() -> ApiError {
    ApiError {
        code: FLOW_CONTROLLED.into(),
        ..PLATFORM.refused(200, "DingTalk held the message back: the user is flow-controlled")
    }
}

pub fn is_flow_controlled(e: &ApiError) -> bool {
    e.code == FLOW_CONTROLLED
}

pub struct Api {
    base: String,
    oapi: String,
    http: ureq::Agent,
    /// Downloads and uploads: a slow link's 20 MiB in one call.
    files: ureq::Agent,
    /// Each app's access token, by client ID.
    tokens: Tokens,
}

impl Api {
    pub fn new(base: &str, oapi: &str) -> Api {
        Api {
            base: base.trim_end_matches('/').to_string(),
            oapi: oapi.trim_end_matches('/').to_string(),
            http: upstream::agent(Duration::from_secs(20)),
            files: upstream::agent(Duration::from_secs(120)),
            tokens: Tokens::new("dingtalk: app"),
        }
    }

    /// The app's access token: the kept one while it has time left, else a new one.
    pub fn token(&self, app: &AppCreds, timeout: Duration) -> Result<String, ApiError> {
        self.tokens.get(&app.client_id, || self.new_token(app, timeout))
    }

    fn new_token(&self, app: &AppCreds, timeout: Duration) -> Result<(String, u64), ApiError> {
        let body = obj([("appKey", s(&app.client_id)), ("appSecret", s(app.secret.expose()))]);
        let o = self.post_json(&format!("{}/v1.0/oauth2/accessToken", self.base), None, &body, timeout)?;
        let value = json::get_str(&o, "accessToken")
            .filter(|t| !t.is_empty() && t.len() <= 512 && t.bytes().all(|b| b.is_ascii_graphic()))
            .ok_or_else(|| PLATFORM.refused(502, "the token answer has no usable accessToken"))?
            .to_string();
        Ok((value, json::get_u64(&o, "expireIn").unwrap_or(0)))
    }

    /// Forgets the app's token (refused, or its app is no longer bound).
    pub fn forget_token(&self, client_id: &str) {
        self.tokens.forget(client_id);
    }

    /// A Stream connection's `endpoint` and single-use `ticket`, for the robot topic.
    pub fn open_stream(&self, app: &AppCreds, timeout: Duration) -> Result<(String, String), ApiError> {
        let subscription = obj([("type", s("CALLBACK")), ("topic", s(super::event::ROBOT_TOPIC))]);
        let body = obj([
            ("clientId", s(&app.client_id)),
            ("clientSecret", s(app.secret.expose())),
            ("subscriptions", json::arr([subscription])),
            ("ua", s(format!("imgate/{}", crate::protocol::card::VERSION))),
            ("localIp", s("")),
        ]);
        let o = self.post_json(
            &format!("{}/v1.0/gateway/connections/open", self.base),
            None,
            &body,
            timeout,
        )?;
        let field = |k: &str| {
            json::get_str(&o, k)
                .filter(|v| !v.is_empty() && v.len() <= 2048)
                .map(str::to_string)
        };
        match (field("endpoint"), field("ticket")) {
            (Some(endpoint), Some(ticket)) => Ok((endpoint, ticket)),
            _ => Err(PLATFORM.refused(502, "the connection answer has no endpoint or ticket")),
        }
    }

    /// An OpenAPI call (`POST {api_base}{path}`) with the app's token; the answer. A token
    /// DingTalk no longer takes is fetched again once.
    pub fn call(&self, app: &AppCreds, path: &str, body: &Value, timeout: Duration) -> Result<Object, ApiError> {
        let url = format!("{}{path}", self.base);
        self.authorized(app, timeout, |token| self.post_json(&url, Some(token), body, timeout))
    }

    /// A text to a conversation's session webhook (no token: the URL is the credential).
    pub fn post_webhook(&self, url: &str, body: &Value, timeout: Duration) -> Result<(), ApiError> {
        let text = json::to_string(body);
        let sent = upstream::within(&self.http, self.http.post(url), timeout)
            .header("Content-Type", "application/json")
            .send(text.as_bytes());
        let mut resp = sent.map_err(|e| hidden(e, url, "the session webhook"))?;
        legacy_answer(&mut resp).map(|_| ())
    }

    /// Uploads a file through the legacy API (`type` `image` or `file`); its `media_id`.
    pub fn upload(&self, app: &AppCreds, kind: &str, file: &Upload, timeout: Duration) -> Result<String, ApiError> {
        self.authorized(app, timeout, |token| {
            let url = format!(
                "{}/media/upload?access_token={}",
                self.oapi,
                upstream::query_value(token)
            );
            let mut form = StreamedForm::new(&[("type", None, kind)], "media", file)
                .map_err(|e| PLATFORM.cache(FileError::Storage(e.to_string())))?;
            let sent = upstream::within(&self.files, self.files.post(&url), timeout)
                .header(
                    "Content-Type",
                    &format!("multipart/form-data; boundary={}", form.boundary),
                )
                .header("Content-Length", &form.length.to_string())
                .send(ureq::SendBody::from_reader(&mut form.body));
            let mut resp = sent.map_err(|e| hidden(e, &url, "the upload URL"))?;
            let o = legacy_answer(&mut resp)?;
            json::get_str(&o, "media_id")
                .filter(|m| !m.is_empty() && m.len() <= 512 && m.bytes().all(|b| b.is_ascii_graphic()))
                .map(str::to_string)
                .ok_or_else(|| PLATFORM.refused(502, "the upload answer has no media_id"))
        })
    }

    /// A message's file into `part`: a short-lived URL from `messageFiles/download`, then its
    /// bytes (without the token: the URL is signed). The type the server gives it.
    pub fn download(
        &self,
        app: &AppCreds,
        download_code: &str,
        part: &mut FilePart,
        timeout: Duration,
    ) -> Result<Option<String>, ApiError> {
        let body = obj([("downloadCode", s(download_code)), ("robotCode", s(&app.client_id))]);
        let o = self.call(app, "/v1.0/robot/messageFiles/download", &body, timeout)?;
        let url = json::get_str(&o, "downloadUrl")
            .filter(|u| (u.starts_with("https://") || u.starts_with("http://")) && u.len() <= 4096)
            .ok_or_else(|| PLATFORM.refused(502, "the download answer has no downloadUrl"))?;
        let mut resp = upstream::within(&self.files, self.files.get(url), timeout)
            .call()
            .map_err(|e| hidden(e, url, "the file's URL"))?;
        let status = resp.status().as_u16();
        if status != 200 {
            return Err(PLATFORM.refused(status, "the file's download was refused"));
        }
        let content_type = upstream::content_type(&resp);
        PLATFORM.save(&mut resp, part)?;
        Ok(content_type)
    }

    /// Runs `attempt` with the app's token; once more with a new token if it was refused.
    fn authorized<T>(
        &self,
        app: &AppCreds,
        timeout: Duration,
        attempt: impl FnMut(&str) -> Result<T, ApiError>,
    ) -> Result<T, ApiError> {
        let fetch = || self.new_token(app, timeout);
        self.tokens.authorized(&app.client_id, fetch, token_invalid, attempt)
    }

    fn post_json(&self, url: &str, token: Option<&str>, body: &Value, timeout: Duration) -> Result<Object, ApiError> {
        let mut req =
            upstream::within(&self.http, self.http.post(url), timeout).header("Content-Type", "application/json");
        if let Some(t) = token {
            req = req.header("x-acs-dingtalk-access-token", t);
        }
        let mut resp = req
            .send(json::to_string(body).as_bytes())
            .map_err(|e| PLATFORM.unreachable(e.into()))?;
        match upstream::read_json(&mut resp, MAX_ANSWER).map_err(|e| PLATFORM.unreachable(e))? {
            (200, Some(o)) => Ok(o),
            (status, o) => Err(error_of(if status == 200 { 502 } else { status }, o.as_ref())),
        }
    }
}

/// A call's failure with `secret` (a URL or token in it) shown as `name`.
fn hidden(e: ureq::Error, secret: &str, name: &str) -> ApiError {
    PLATFORM.unreachable(upstream::Error::from(e).hiding(secret, name))
}

/// A legacy answer (`{errcode, errmsg}`): the object when `errcode` is 0.
fn legacy_answer(resp: &mut upstream::Response) -> Result<Object, ApiError> {
    let (status, o) = upstream::read_json(resp, MAX_ANSWER).map_err(|e| PLATFORM.unreachable(e))?;
    let Some(o) = o else {
        return Err(error_of(if status == 200 { 502 } else { status }, None));
    };
    match json::get_i64(&o, "errcode") {
        Some(0) if status == 200 => Ok(o),
        Some(code) => Err(ApiError {
            code: code.to_string(),
            from_peer: true,
            ..PLATFORM.refused(status, message_of(json::get_str(&o, "errmsg")))
        }),
        None => Err(error_of(if status == 200 { 502 } else { status }, Some(&o))),
    }
}

/// The error an OpenAPI answer stands for: its `code` and `message` when it has them.
fn error_of(status: u16, o: Option<&Object>) -> ApiError {
    let code = o
        .and_then(|o| json::get_str(o, "code"))
        .filter(|c| c.len() <= 96 && c.bytes().all(|b| b.is_ascii_graphic()))
        .unwrap_or_default();
    let message = match o {
        Some(o) => message_of(json::get_str(o, "message")),
        None => "an answer that is not JSON".into(),
    };
    ApiError {
        code: code.to_string(),
        from_peer: o.is_some(),
        ..PLATFORM.refused(status, message)
    }
}

/// A server's message, bounded (shown escaped).
fn message_of(m: Option<&str>) -> String {
    m.unwrap_or("no message").chars().take(MAX_MESSAGE).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::Transient;

    fn error_text(status: u16, text: &str) -> ApiError {
        let v = json::parse(text).ok();
        error_of(status, v.as_ref().and_then(json::as_object))
    }

    #[test]
    fn refusals_throttling_and_token_errors_are_told_apart() {
        let bad = error_text(
            401,
            r#"{"code":"InvalidAuthentication","message":"不合法的access_token"}"#,
        );
        assert!(token_invalid(&bad) && credentials_refused(&bad) && !bad.temporary());
        assert!(token_invalid(&error_text(
            400,
            r#"{"code":"InvalidAuthentication","message":"x"}"#
        )));
        let qps = error_text(
            403,
            r#"{"code":"Forbidden.AccessDenied.QpsLimitForAppkeyAndApi","message":"too many"}"#,
        );
        assert!(qps.temporary() && !credentials_refused(&qps));
        assert_eq!(qps.retry_after(), Some(THROTTLE_WAIT));
        assert!(error_text(502, "<html>").temporary());
        let held = flow_controlled();
        assert!(is_flow_controlled(&held) && held.temporary() && !credentials_refused(&held));
        assert_eq!(
            held.retry_after(),
            Some(THROTTLE_WAIT),
            "sent again as a throttled call"
        );
        let long = format!(r#"{{"code":"x","message":"{}"}}"#, "y".repeat(5000));
        assert!(
            error_text(400, &long).message.chars().count() <= 200,
            "a server's message is bounded"
        );
        let odd = error_text(400, r#"{"code":"a\nb","message":"m"}"#);
        assert_eq!(odd.code, "", "a code with a line break is not shown");
    }
}
