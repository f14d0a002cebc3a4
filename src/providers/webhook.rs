//! The generic webhook provider: `POST /hooks/NAME` inbound, `reply_url` outbound.
//!
//! Source key: `webhook:NAME`. The sender's `message_id` is the push's `message_id`, so it is
//! stable across the sender's retries and imgate's redeliveries.

use ring::hmac;

use super::inbound::{self, Inbound};
use super::Failure;
use crate::app::App;
use crate::config::Webhook;
use crate::ids;
use crate::json::{self, obj, opt_s, s, Object, Value};
use crate::outbox::{Enqueued, NewMessage, StoredMessage};
use crate::protocol::descriptor::{Target, ToolState};
use crate::protocol::{code, TOOL_REPLY, TOOL_SEND};
use crate::store::ReplyRef;

const SOURCE_PREFIX: &str = "webhook:";
/// Longest accepted `message_id` / `sender_id` / `chat_id`.
const MAX_ID: usize = 256;

pub fn source_of(name: &str) -> String {
    format!("{SOURCE_PREFIX}{name}")
}

pub fn endpoint_of(source: &str) -> Option<&str> {
    source.strip_prefix(SOURCE_PREFIX)
}

/// The HTTP answer to a webhook POST: status and JSON body.
pub struct Answer {
    pub status: u16,
    pub body: Value,
}

fn answer(status: u16, pairs: Vec<(&str, Value)>) -> Answer {
    Answer {
        status,
        body: obj(pairs),
    }
}

fn invalid(detail: impl Into<String>) -> Answer {
    answer(400, vec![("error", s("invalid_payload")), ("detail", s(detail))])
}

/// Checks the sender: `Authorization: Bearer <secret>` or `X-Imgate-Signature: sha256=<hex>`.
pub fn authorized(hook: &Webhook, authorization: Option<&str>, signature: Option<&str>, body: &[u8]) -> bool {
    if let Some(token) = authorization.and_then(|a| a.strip_prefix("Bearer ")) {
        return ids::secret_eq(token.trim(), hook.secret.expose());
    }
    if let Some(sig) = signature.and_then(|s| s.trim().strip_prefix("sha256=")) {
        let Some(mac) = unhex(sig) else { return false };
        let key = hmac::Key::new(hmac::HMAC_SHA256, hook.secret.expose().as_bytes());
        return hmac::verify(&key, body, &mac).is_ok();
    }
    false
}

/// `X-Imgate-Signature` value for an outbound body.
pub fn sign(secret: &str, body: &[u8]) -> String {
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret.as_bytes());
    format!("sha256={}", ids::hex(hmac::sign(&key, body).as_ref()))
}

fn unhex(h: &str) -> Option<Vec<u8>> {
    if h.len() % 2 != 0 {
        return None;
    }
    (0..h.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(h.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Parses a webhook body (contract section 4); the `Err` is the `detail` of a 400.
pub fn parse_body(body: &[u8]) -> Result<Inbound, String> {
    let text = std::str::from_utf8(body).map_err(|_| "body is not UTF-8".to_string())?;
    let v = json::parse(text)?;
    let o = json::as_object(&v).ok_or("body must be a JSON object")?;
    let id_field = |k: &str, required: bool| -> Result<Option<String>, String> {
        let v = match json::get(o, k) {
            None if required => return Err(format!("`{k}` is required")),
            None => return Ok(None),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(_)) => match json::get_u64(o, k) {
                Some(n) => n.to_string(),
                None => return Err(format!("`{k}` must be a string or a non-negative integer")),
            },
            Some(_) => return Err(format!("`{k}` must be a string")),
        };
        if v.is_empty() || v.len() > MAX_ID {
            return Err(format!("`{k}` must be 1 to {MAX_ID} characters"));
        }
        Ok(Some(v))
    };
    let str_field = |k: &str| -> Result<Option<String>, String> {
        match json::get(o, k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(format!("`{k}` must be a string")),
        }
    };
    let chat_type = str_field("chat_type")?.unwrap_or_else(|| "p2p".into());
    if chat_type != "p2p" && chat_type != "group" {
        return Err("`chat_type` must be p2p or group".into());
    }
    let message_type = str_field("message_type")?.unwrap_or_else(|| "text".into());
    if message_type.is_empty()
        || message_type.len() > 32
        || !message_type.bytes().all(|c| c.is_ascii_lowercase() || c == b'_')
    {
        return Err("`message_type` must be a short lowercase word such as text, image or file".into());
    }
    let event_time = match json::get(o, "event_time") {
        None => None,
        Some(_) => Some(json::get_u64(o, "event_time").ok_or("`event_time` must be Unix milliseconds")?),
    };
    Ok(Inbound {
        message_id: id_field("message_id", true)?.expect("required"),
        sender_id: id_field("sender_id", true)?.expect("required"),
        sender_name: str_field("sender_name")?.filter(|n| !n.trim().is_empty()),
        chat_id: id_field("chat_id", false)?,
        chat_type,
        message_type,
        text: str_field("text")?.unwrap_or_default(),
        event_time,
        files: None,
    })
}

/// The `message.push` payload of a stored message (IM profile v1 sections 5 and 6).
pub fn render_push(app: &App, name: &str, stored: &StoredMessage) -> Value {
    let Ok(m) = miniserde::json::from_str::<Inbound>(&stored.payload) else {
        log::error!(
            "webhook {name}: stored message {} is unreadable",
            stored.header.message_id
        );
        return obj([]);
    };
    // The label as configured now; an endpoint removed since acceptance keeps its name.
    let label = app.config.webhooks.get(name).map_or(name, |h| h.label.as_str());
    let h = &stored.header;
    let base = app.config.server.public_url.as_deref().unwrap_or("");
    inbound::render(
        "webhook",
        label,
        &m,
        h.reply_ref.as_deref(),
        h.accepted_at,
        h.expires_at,
        base,
    )
}

/// Handles `POST /hooks/NAME` once the body is read (size was checked by the HTTP layer).
pub fn accept(app: &App, name: &str, authorization: Option<&str>, signature: Option<&str>, body: &[u8]) -> Answer {
    let Some(hook) = app.config.webhooks.get(name) else {
        return answer(404, vec![("error", s("unknown_endpoint"))]);
    };
    if !authorized(hook, authorization, signature, body) {
        log::info!("webhook {name}: rejected a request with a missing or wrong secret/signature");
        return answer(401, vec![("error", s("unauthorized"))]);
    }
    let m = match parse_body(body) {
        Ok(m) => m,
        Err(detail) => {
            log::info!("webhook {name}: invalid payload: {detail}");
            return invalid(detail);
        }
    };
    let now = ids::now_ms();
    let ttl = app.ttl_ms();
    if m.event_time.is_some_and(|t| t.saturating_add(ttl) <= now) {
        log::info!(
            "webhook {name}: message {} is stale (event_time older than the ttl)",
            m.message_id
        );
        return answer(409, vec![("error", s("stale")), ("message_id", s(&m.message_id))]);
    }
    let source = source_of(name);
    let expires_at = now + ttl;
    let reply_ref = hook.reply_url.as_ref().map(|_| ids::token("rr_"));
    let payload = miniserde::json::to_string(&m);
    let message = NewMessage {
        source: source.clone(),
        message_id: m.message_id.clone(),
        payload,
        // A reply is possible within the message's TTL, delivered or not; the reference
        // leaves with the message's dedupe entry.
        reply_ref: reply_ref.map(|t| {
            (
                t,
                ReplyRef {
                    source: source.clone(),
                    message_id: m.message_id.clone(),
                    expires_at,
                },
            )
        }),
        accepted_at: now,
        expires_at,
        cursor: None,
    };
    match app.store.enqueue(message, app.policy()) {
        Ok(Enqueued::Accepted { .. }) => {
            log::debug!("webhook {name}: accepted message {}", m.message_id);
            app.hub.notify_source(&app.store, &source);
            answer(202, vec![("status", s("accepted")), ("message_id", s(&m.message_id))])
        }
        Ok(Enqueued::Duplicate) => {
            log::debug!("webhook {name}: duplicate message {}", m.message_id);
            answer(200, vec![("status", s("duplicate")), ("message_id", s(&m.message_id))])
        }
        Ok(Enqueued::CapacityExceeded) => answer(503, vec![("error", s("capacity_exceeded"))]),
        Err(e) => {
            // The store logs the outage once; each refused message only at debug.
            log::debug!("webhook {name}: cannot store message {}: {e}", m.message_id);
            answer(503, vec![("error", s("storage_unavailable"))])
        }
    }
}

/// Descriptor parts of a webhook channel.
pub fn describe(app: &App, name: &str) -> (&'static str, Target, Vec<(&'static str, ToolState)>) {
    match app.config.webhooks.get(name) {
        Some(hook) => {
            let reply = if hook.reply_url.is_some() {
                ToolState::available()
            } else {
                ToolState::unavailable("this endpoint has no reply_url configured")
            };
            (
                "connected",
                Target {
                    provider: "webhook".into(),
                    label: hook.label.clone(),
                    display_name: format!("Webhook {}", hook.label),
                    account_hint: Some(name.to_string()),
                },
                vec![(TOOL_SEND, reply.clone()), (TOOL_REPLY, reply)],
            )
        }
        // Bound to an endpoint that was removed from the config.
        None => (
            "error",
            Target {
                provider: "webhook".into(),
                label: name.to_string(),
                display_name: format!("Webhook {name} (no longer configured)"),
                account_hint: None,
            },
            vec![
                (
                    TOOL_SEND,
                    ToolState::unavailable("the bound endpoint is no longer configured"),
                ),
                (
                    TOOL_REPLY,
                    ToolState::unavailable("the bound endpoint is no longer configured"),
                ),
            ],
        ),
    }
}

/// `webhook_binding`: the endpoint must exist and the secret must be that endpoint's.
pub fn check_binding(app: &App, input: &Object) -> Result<String, Failure> {
    let endpoint = json::get_str(input, "endpoint").map(str::trim).unwrap_or_default();
    let secret = json::get_str(input, "secret").unwrap_or_default();
    if endpoint.is_empty() || secret.is_empty() {
        return Err(Failure::new(
            code::INVALID_ARGUMENTS,
            "both `endpoint` and `secret` are required",
        ));
    }
    match app.config.webhooks.get(endpoint) {
        Some(hook) if ids::secret_eq(secret, hook.secret.expose()) => Ok(source_of(endpoint)),
        // One answer for both cases, so the form cannot be used to probe endpoint names.
        _ => Err(Failure::new(
            code::CONNECTION_NOT_AUTHENTICATED,
            "no webhook endpoint with that name and secret is configured on this device",
        )),
    }
}

/// POSTs an outbound message to the endpoint's `reply_url`, signed with its secret.
pub fn send(
    app: &App,
    name: &str,
    text: &str,
    reply_to_message_id: Option<&str>,
    idempotency_key: &str,
) -> Result<Value, Failure> {
    let hook = app
        .config
        .webhooks
        .get(name)
        .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "the bound endpoint is no longer configured"))?;
    let url = hook
        .reply_url
        .as_deref()
        .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "this endpoint has no reply_url configured"))?;
    let body = json::to_string(&obj([
        ("endpoint", s(name)),
        ("text", s(text)),
        ("reply_to_message_id", opt_s(reply_to_message_id)),
        ("idempotency_key", s(idempotency_key)),
    ]));
    let signature = sign(hook.secret.expose(), body.as_bytes());
    let result = app
        .http
        .post(url)
        .header("Content-Type", "application/json")
        .header("X-Imgate-Signature", &signature)
        .send(body.as_bytes());
    let mut resp = result.map_err(|e| {
        // The configured URL may carry a credential of its own: never echo it.
        let e = e.to_string().replace(url, "<reply_url>");
        log::warn!("webhook {name}: reply_url unreachable: {e}");
        Failure::new(
            code::UPSTREAM_UNREACHABLE,
            format!("reply_url could not be reached: {e}"),
        )
    })?;
    let status = resp.status().as_u16();
    if !(200..300).contains(&status) {
        log::warn!("webhook {name}: reply_url answered HTTP {status}");
        return Err(Failure::new(
            code::UPSTREAM_REJECTED,
            format!("reply_url answered HTTP {status}"),
        ));
    }
    // The receiver may name the message it created; otherwise the idempotency key identifies it.
    let answer = resp
        .body_mut()
        .with_config()
        .limit(64 * 1024)
        .read_to_string()
        .unwrap_or_default();
    let remote_id = json::parse(&answer).ok().and_then(|v| {
        json::as_object(&v)
            .and_then(|o| json::get_str(o, "message_id"))
            .map(str::to_string)
    });
    Ok(obj([
        ("status", s("sent")),
        (
            "message_id",
            s(remote_id.unwrap_or_else(|| idempotency_key.to_string())),
        ),
    ]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_parser_accepts_the_documented_fields() {
        let m = parse_body(br#"{"message_id":"m1","sender_id":42,"text":"hi","chat_type":"group","event_time":5}"#)
            .unwrap();
        assert_eq!(m.sender_id, "42");
        assert_eq!(m.chat_type, "group");
        assert_eq!(m.message_type, "text");
        assert_eq!(m.event_time, Some(5));
    }

    #[test]
    fn body_parser_names_the_bad_field() {
        let cases: [(&[u8], &str); 8] = [
            (b"{", "JSON"),
            (b"[1]", "object"),
            (br#"{"sender_id":"a"}"#, "message_id"),
            (br#"{"message_id":"m"}"#, "sender_id"),
            (br#"{"message_id":"m","sender_id":"a","text":5}"#, "text"),
            (br#"{"message_id":"m","sender_id":"a","chat_type":"room"}"#, "chat_type"),
            (
                br#"{"message_id":"m","sender_id":"a","event_time":"now"}"#,
                "event_time",
            ),
            (b"\xff\xfe", "UTF-8"),
        ];
        for (body, field) in cases {
            let err = parse_body(body).unwrap_err();
            assert!(err.contains(field), "{err} should name {field}");
        }
    }

    #[test]
    fn body_parser_survives_thousands_of_malformed_bodies() {
        let seeds: [&[u8]; 2] = [
            br#"{"message_id":"m1","sender_id":"u","sender_name":"Ada","chat_id":"c","chat_type":"group","message_type":"text","text":"hi","event_time":1790000000000}"#,
            br#"{"message_id":12345678901234567890,"sender_id":-1,"text":"\u00e9\ud83d\ude00"}"#,
        ];
        for input in crate::testutil::mutations(&seeds, 5000, 11) {
            let _ = parse_body(&input);
        }
    }

    #[test]
    fn hmac_signatures_verify_and_tampering_fails() {
        let hook = Webhook {
            secret: crate::config::Secret::new("k"),
            reply_url: None,
            label: "x".into(),
        };
        let sig = sign("k", b"body");
        assert!(authorized(&hook, None, Some(&sig), b"body"));
        assert!(!authorized(&hook, None, Some(&sig), b"bodY"));
        assert!(!authorized(&hook, None, Some("sha256=zz"), b"body"));
        assert!(authorized(&hook, Some("Bearer k"), None, b""));
        assert!(!authorized(&hook, Some("Bearer x"), None, b""));
        assert!(!authorized(&hook, None, None, b""));
    }
}
