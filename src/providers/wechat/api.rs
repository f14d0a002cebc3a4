//! A small client of WeChat's iLink bot API over ureq: the QR login (`get_bot_qrcode`,
//! `get_qrcode_status`), the receive long-poll (`getupdates`) and `sendmessage`.
//!
//! Every POST carries `AuthorizationType: ilink_bot_token`, the bot token as a bearer, a random
//! `X-WECHAT-UIN` and a `base_info` in its body. Answers are JSON, read through `json::parse`
//! with a size cap; `ret` or `errcode` other than 0 is an error whatever the HTTP status. The
//! token travels only in the `Authorization` header, so no URL or error text carries it.

use std::time::Duration;

use crate::json::{self, obj, s, Object, Value};
pub use crate::upstream::ApiError;
use crate::upstream::{self, Kind, Platform};

/// Answers larger than this are refused (a batch of updates is small; media go to the CDN).
pub const MAX_ANSWER: u64 = 4 << 20;
/// No call waits longer than this (the receive long poll is the longest).
const LONGEST_CALL: Duration = Duration::from_secs(60);
/// `errcode` of a login WeChat ended (session timeout): a new QR login is needed.
pub const SESSION_ENDED: i64 = -14;

/// WeChat's iLink: `ret` or `errcode` other than 0 is an error whatever the status.
pub static PLATFORM: Platform = Platform::new("WeChat", |_, code| {
    (code.parse::<i64>() == Ok(SESSION_ENDED)).then_some(Kind::Auth)
});

/// WeChat ended the login: the bot token is no longer good.
pub fn session_ended(e: &ApiError) -> bool {
    e.kind() == Kind::Auth
}

#[derive(Clone)]
pub struct Api {
    http: ureq::Agent,
}

impl Default for Api {
    fn default() -> Api {
        Api {
            http: upstream::agent(LONGEST_CALL),
        }
    }
}

/// `X-WECHAT-UIN`: a random 32-bit number in decimal, base64-encoded.
fn random_uin() -> String {
    let n = u32::from_str_radix(&crate::ids::random_hex(4), 16).unwrap_or(0);
    crate::ids::base64(n.to_string().as_bytes())
}

impl Api {
    /// The HTTP client, for the CDN.
    pub fn http(&self) -> &ureq::Agent {
        &self.http
    }

    /// `GET {base}/{path}` without a token (the QR login); the answer object.
    pub fn get(&self, base: &str, path: &str, timeout: Duration) -> Result<Object, ApiError> {
        let url = format!("{}/{path}", base.trim_end_matches('/'));
        let resp = upstream::within(&self.http, self.http.get(&url), timeout)
            .call()
            .map_err(|e| PLATFORM.unreachable(e.into()))?;
        read_answer(resp)
    }

    /// `POST {base}/{path}` with the bot token and `base_info` added to `body`.
    pub fn post(
        &self,
        base: &str,
        path: &str,
        token: &str,
        body: Object,
        timeout: Duration,
    ) -> Result<Object, ApiError> {
        let url = format!("{}/{path}", base.trim_end_matches('/'));
        let mut body = body;
        body.insert(
            "base_info".into(),
            obj([
                ("channel_version", s(crate::protocol::card::VERSION)),
                ("bot_agent", s("imgate")),
            ]),
        );
        let resp = upstream::within(&self.http, self.http.post(&url), timeout)
            .header("Content-Type", "application/json")
            .header("AuthorizationType", "ilink_bot_token")
            .header("Authorization", &format!("Bearer {token}"))
            .header("X-WECHAT-UIN", &random_uin())
            .send(json::to_string(&Value::Object(body)).as_bytes())
            .map_err(|e| PLATFORM.unreachable(e.into()))?;
        read_answer(resp)
    }
}

/// The answer's object: an error when the status is not 200, or `ret`/`errcode` is not 0.
fn read_answer(mut resp: upstream::Response) -> Result<Object, ApiError> {
    let (status, parsed) = upstream::read_json(&mut resp, MAX_ANSWER).map_err(|e| PLATFORM.unreachable(e))?;
    let Some(o) = parsed else {
        let msg = if status == 200 {
            "an answer that is not a JSON object"
        } else {
            "no readable answer"
        };
        return Err(PLATFORM.refused(if status == 200 { 0 } else { status }, msg));
    };
    let code = [json::get_i64(&o, "ret"), json::get_i64(&o, "errcode")]
        .into_iter()
        .flatten()
        .find(|c| *c != 0)
        .unwrap_or(0);
    if status != 200 || code != 0 {
        return Err(ApiError {
            code: match code {
                0 => String::new(),
                c => c.to_string(),
            },
            from_peer: true,
            ..PLATFORM.refused(status, json::get_str(&o, "errmsg").unwrap_or("refused"))
        });
    }
    Ok(o)
}
