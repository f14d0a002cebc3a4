//! A small Discord REST client (https://discord.com/developers/docs/reference) over `upstream`.
//!
//! Every call carries `Authorization: Bot TOKEN` (a header, never a URL, so no error text can
//! hold it) and the `User-Agent` Discord asks bots for. Answers are JSON (objects, or arrays
//! for a history); a refusal is `{code, message}` with its status, a rate limit `429` with
//! `retry_after` in (fractional) seconds. A route whose bucket answered `X-RateLimit-Remaining:
//! 0` waits its `X-RateLimit-Reset-After` before the next call, so a burst of sends meets no
//! 429 (each 401, 403 and 429 counts toward Discord's ban of an address that makes too many).
//! A global 429 (`"global": true`, `X-RateLimit-Global`, `X-RateLimit-Scope: global`) limits
//! the bot on every route: until it ends no call carrying that bot's token is made, whatever
//! its route or channel; a call meeting it waits within its own deadline, or fails as a
//! retryable 429 without asking.
//! Attachments download from the CDN with no token: their signed URL is the credential, and
//! they are none of the bot's calls.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::files::{FileError, FilePart};
use crate::json::{self, Value};
use crate::peer_wait;
use crate::providers::{StreamedForm, Upload};
use crate::quiet::Site;
pub use crate::upstream::ApiError;
use crate::upstream::{self, Kind, Platform};

/// An answer larger than this is refused unread: a history page of 100 messages at their
/// 4,000 characters, embeds included, stays well below it.
pub const MAX_ANSWER: u64 = 2 << 20;
/// Characters of Discord's error message kept (it reaches logs and tool results).
const MAX_ERROR: usize = 120;
/// Routes whose bucket wait is remembered (a bucket per channel and method).
const MAX_BUCKETS: usize = 256;
/// The longest bucket wait honoured before a call (a peer's figure, clamped).
const MAX_BUCKET_WAIT: Duration = Duration::from_secs(60);
/// Bots whose global rate limit is remembered (one entry per token limited).
const MAX_HELD: usize = 64;
/// How long a global 429 that names no wait holds the bot (Discord's limit is per second).
const GLOBAL_WAIT: Duration = Duration::from_secs(1);

/// Discord: a refusal is `{code, message}` with its status.
pub static PLATFORM: Platform = Platform {
    retry_too_large: false,
    ..Platform::new("Discord", classify)
};

fn classify(status: u16, code: &str) -> Option<Kind> {
    match (status, code) {
        (401, _) => Some(Kind::Auth),
        // Unknown channel.
        (404, _) | (_, "10003") => Some(Kind::Gone),
        _ => None,
    }
}

pub struct Api {
    base: String,
    http: ureq::Agent,
    /// Downloads and uploads: a slow link's 20 MiB in one call.
    files: ureq::Agent,
    /// Route → when its bucket has room again.
    buckets: Mutex<HashMap<String, Instant>>,
    /// Bot (`bot_key` of its token) → when its global rate limit ends.
    held: Mutex<HashMap<u64, Instant>>,
    /// Global limits met, logged once a minute (Discord decides how often).
    global_log: Site,
}

impl Api {
    pub fn new(base: &str) -> Api {
        Api {
            base: base.trim_end_matches('/').to_string(),
            http: upstream::agent(Duration::from_secs(15)),
            files: upstream::agent(super::FETCH_DEADLINE),
            buckets: Mutex::default(),
            held: Mutex::default(),
            global_log: Site::new(),
        }
    }

    /// The REST base (`https://discord.com/api/v10`).
    pub fn base(&self) -> &str {
        &self.base
    }

    /// `GET {base}{path}` within `timeout`: the JSON answer.
    pub fn get(&self, token: &str, path: &str, timeout: Duration) -> Result<Value, ApiError> {
        self.call("GET", token, path, None, timeout)
    }

    /// `POST {base}{path}` with a JSON body (or none) within `timeout`: the JSON answer (`Null`
    /// for a 204).
    pub fn post(&self, token: &str, path: &str, body: Option<&str>, timeout: Duration) -> Result<Value, ApiError> {
        self.call("POST", token, path, body, timeout)
    }

    fn call(
        &self,
        method: &str,
        token: &str,
        path: &str,
        body: Option<&str>,
        timeout: Duration,
    ) -> Result<Value, ApiError> {
        let route = format!("{method} {}", path.split('?').next().unwrap_or(path));
        let deadline = Instant::now() + timeout;
        self.wait_for_room(token, &route, deadline)?;
        let url = format!("{}{path}", self.base);
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        let auth = format!("Bot {token}");
        let sent = match body {
            None if method == "GET" => {
                authorized(upstream::within(&self.http, self.http.get(&url), left), &auth).call()
            }
            None => authorized(upstream::within(&self.http, self.http.post(&url), left), &auth).send_empty(),
            Some(b) => authorized(upstream::within(&self.http, self.http.post(&url), left), &auth)
                .header("Content-Type", "application/json")
                .send(b),
        };
        let mut resp = sent.map_err(|e| PLATFORM.unreachable(e.into()))?;
        self.answer(token, &route, &mut resp)
    }

    /// Creates a message with one file: `payload_json` and `files[0]`, streamed from disk.
    pub fn post_file(
        &self,
        token: &str,
        path: &str,
        payload: &str,
        file: &Upload,
        timeout: Duration,
    ) -> Result<Value, ApiError> {
        let route = format!("POST {path}");
        let deadline = Instant::now() + timeout;
        self.wait_for_room(token, &route, deadline)?;
        let fields = [("payload_json", Some("application/json"), payload)];
        let mut form = StreamedForm::new(&fields, "files[0]", file)
            .map_err(|e| PLATFORM.cache(FileError::Storage(e.to_string())))?;
        let url = format!("{}{path}", self.base);
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        let mut resp = authorized(
            upstream::within(&self.files, self.files.post(&url), left),
            &format!("Bot {token}"),
        )
        .header(
            "Content-Type",
            &format!("multipart/form-data; boundary={}", form.boundary),
        )
        .header("Content-Length", &form.length.to_string())
        .send(ureq::SendBody::from_reader(&mut form.body))
        .map_err(|e| PLATFORM.unreachable(e.into()))?;
        self.answer(token, &route, &mut resp)
    }

    /// Reads an answer: the JSON when it is a success, else Discord's refusal. A global 429
    /// holds every call of the bot of `token` (`hold`).
    fn answer(&self, token: &str, route: &str, resp: &mut upstream::Response) -> Result<Value, ApiError> {
        let status = resp.status().as_u16();
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(|v| v.trim().to_string())
        };
        let seconds = |v: Option<String>| v.and_then(|v| v.parse::<f64>().ok()).and_then(seconds_of);
        if header("X-RateLimit-Remaining").as_deref() == Some("0") {
            if let Some(wait) = seconds(header("X-RateLimit-Reset-After")) {
                self.bucket_empty(route, wait);
            }
        }
        let retry_header = seconds(header("Retry-After"));
        let global_header = header("X-RateLimit-Global").is_some_and(|v| v.eq_ignore_ascii_case("true"))
            || header("X-RateLimit-Scope").is_some_and(|v| v.eq_ignore_ascii_case("global"));
        let body = upstream::read_body(resp, MAX_ANSWER).map_err(|e| PLATFORM.unreachable(e))?;
        if status == 204 {
            return Ok(Value::Null);
        }
        let value = String::from_utf8(body).ok().and_then(|t| json::parse(&t).ok());
        if (200..300).contains(&status) {
            return value.ok_or_else(|| PLATFORM.refused(status, "the answer is not JSON"));
        }
        let refusal = value.as_ref().and_then(json::as_object);
        let retry_body = refusal
            .and_then(|o| match json::get(o, "retry_after") {
                Some(Value::Number(n)) => number(n),
                _ => None,
            })
            .and_then(seconds_of);
        let global_body = refusal.is_some_and(|o| matches!(json::get(o, "global"), Some(Value::Bool(true))));
        if status == 429 && (global_header || global_body) {
            self.hold(token, peer_wait::retry_after(retry_body.or(retry_header), GLOBAL_WAIT));
        }
        let message = refusal.and_then(|o| json::get_str(o, "message")).map_or_else(
            || "an error it did not describe".into(),
            |m| m.chars().take(MAX_ERROR).collect::<String>(),
        );
        Err(ApiError {
            code: refusal
                .and_then(|o| json::get_u64(o, "code"))
                .filter(|c| *c != 0)
                .map(|c| c.to_string())
                .unwrap_or_default(),
            retry_after: retry_body.or(retry_header),
            from_peer: refusal.is_some(),
            ..PLATFORM.refused(status, message)
        })
    }

    /// Waits until the bot of `token` is past its global rate limit and the route's bucket has
    /// room, unless that passes `deadline` (then a 429 without asking: the caller's retry knows
    /// when). Checked again after a wait: another call may have met a new limit meanwhile.
    fn wait_for_room(&self, token: &str, route: &str, deadline: Instant) -> Result<(), ApiError> {
        let bot = bot_key(token);
        loop {
            let global = {
                let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
                held.get(&bot).copied()
            };
            let bucket = {
                let buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
                buckets.get(route).copied()
            };
            let now = Instant::now();
            let wait_global = global.map_or(Duration::ZERO, |t| t.saturating_duration_since(now));
            let wait_route = bucket.map_or(Duration::ZERO, |t| t.saturating_duration_since(now));
            let wait = wait_global.max(wait_route);
            if wait.is_zero() {
                return Ok(());
            }
            if peer_wait::passes(deadline, wait) {
                let why = match wait_global >= wait_route {
                    true => "Discord's global rate limit holds every call of this bot past the deadline",
                    false => "the route's rate limit has no room before the deadline",
                };
                return Err(ApiError {
                    retry_after: Some(wait),
                    ..PLATFORM.refused(429, why)
                });
            }
            std::thread::sleep(wait);
        }
    }

    /// Discord's global rate limit holds the bot of `token` for `wait` (a peer's figure, clamped
    /// by the caller): no call of it is made before that ends.
    fn hold(&self, token: &str, wait: Duration) {
        let now = Instant::now();
        let until = now.checked_add(wait).unwrap_or(now);
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if held.len() >= MAX_HELD {
            held.retain(|_, t| *t > now);
            // Still full: the hold that ends soonest makes room.
            let soonest = held.iter().min_by_key(|(_, t)| **t).map(|(bot, _)| *bot);
            if let Some(bot) = soonest.filter(|_| held.len() >= MAX_HELD) {
                held.remove(&bot);
            }
        }
        let entry = held.entry(bot_key(token)).or_insert(until);
        *entry = (*entry).max(until);
        drop(held);
        if let Some(more) = self.global_log.admit() {
            log::warn!("discord: Discord's global rate limit holds every call of a bot for {wait:?}{more}");
        }
    }

    fn bucket_empty(&self, route: &str, wait: Duration) {
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if buckets.len() >= MAX_BUCKETS {
            buckets.retain(|_, until| *until > now);
            if buckets.len() >= MAX_BUCKETS {
                buckets.clear();
            }
        }
        buckets.insert(route.to_string(), now + wait.min(MAX_BUCKET_WAIT));
    }

    /// Downloads an attachment into `part` from its signed CDN URL (no token: the CDN needs
    /// none, and the token must not travel to another host), within `timeout`; the server's
    /// content type.
    pub fn download(&self, url: &str, part: &mut FilePart, timeout: Duration) -> Result<Option<String>, ApiError> {
        let mut resp = upstream::within(&self.files, self.files.get(url), timeout)
            .call()
            .map_err(|e| PLATFORM.unreachable(upstream::Error::from(e).hiding(url, "the attachment's URL")))?;
        let status = resp.status().as_u16();
        let content_type = upstream::content_type(&resp);
        if status != 200 {
            // A signed URL past its `ex` answers 404: the message's URL expired.
            return Err(PLATFORM.refused(status, "the attachment's download was refused"));
        }
        PLATFORM.save(&mut resp, part)?;
        Ok(content_type)
    }
}

/// A bot as the global rate limit knows it: its token hashed, so the token is kept in no table.
fn bot_key(token: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    token.hash(&mut h);
    h.finish()
}

fn authorized<B>(req: ureq::RequestBuilder<B>, auth: &str) -> ureq::RequestBuilder<B> {
    req.header("Authorization", auth).header(
        "User-Agent",
        &format!(
            "DiscordBot (https://github.com/imgate/imgate, {})",
            crate::protocol::card::VERSION
        ),
    )
}

/// A JSON number as `f64`.
fn number(n: &miniserde::json::Number) -> Option<f64> {
    match *n {
        miniserde::json::Number::U64(u) => Some(u as f64),
        miniserde::json::Number::I64(i) => Some(i as f64),
        miniserde::json::Number::F64(f) => Some(f),
    }
}

/// Seconds a peer named as a `Duration`: finite, not negative, at most a day (callers clamp
/// further); `None` otherwise.
fn seconds_of(s: f64) -> Option<Duration> {
    (s.is_finite() && s >= 0.0).then(|| Duration::from_secs_f64(s.min(86_400.0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_a_peer_names_are_finite_and_bounded() {
        assert_eq!(seconds_of(0.25), Some(Duration::from_millis(250)));
        assert_eq!(seconds_of(1e300), Some(Duration::from_secs(86_400)));
        for bad in [f64::NAN, f64::INFINITY, -1.0] {
            assert_eq!(seconds_of(bad), None);
        }
    }

    #[test]
    fn a_global_limit_holds_every_route_of_its_bot_only_and_a_call_past_its_deadline_fails_retryable() {
        let api = Api::new("http://127.0.0.1:9");
        // Any figure, clamped where it is named; the clock is never overflowed.
        api.hold("a.b.c", Duration::MAX);
        api.hold("a.b.c", peer_wait::retry_after(Some(Duration::MAX), GLOBAL_WAIT));
        let soon = Instant::now() + Duration::from_millis(50);
        for route in [
            "POST /channels/1/messages",
            "GET /channels/2/messages",
            "GET /gateway/bot",
        ] {
            let e = api.wait_for_room("a.b.c", route, soon).unwrap_err();
            assert_eq!(e.status, 429);
            assert!(crate::providers::Transient::temporary(&e));
            assert!(e.retry_after.is_some_and(|w| w <= peer_wait::RETRY_AFTER_MAX), "{e:?}");
        }
        assert!(api.wait_for_room("d.e.f", "POST /channels/1/messages", soon).is_ok());
    }
}
