//! The generic webhook provider: `POST /hooks/NAME` inbound, `reply_url` outbound.
//!
//! Source key: the endpoint `NAME`. The sender's `message_id` is the push's `message_id`, so it
//! is stable across the sender's retries and imgate's redeliveries.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use ring::hmac;

use super::inbound::Inbound;
use super::intake::{Arrival, Intake, WhenStale};
use super::{
    Declaration, Delta, Description, Failure, Field, Flow, Host, HttpAnswer, HttpRequest, Outbound, Provider,
    Registration, Reply, Route,
};
use crate::config::{Config, Fields, Problems, Reader, Secret, Section, Settings};
use crate::ids;
use crate::json::{self, arr, obj, opt_s, s, Object, Value};
use crate::outbox::Enqueued;
use crate::protocol::descriptor::{Target, ToolState};
use crate::protocol::{code, TOOL_REPLY, TOOL_SEND};
use crate::quiet::{self, Site};
use crate::source::Source;
use crate::store::StoreError;
use crate::upstream;

const NAME: &str = "webhook";
/// Longest accepted `message_id` / `sender_id` / `chat_id`.
const MAX_ID: usize = 256;
const TOOLS: &[&str] = &[TOOL_SEND, TOOL_REPLY];
const FLOW_ID: &str = "webhook_binding";
/// Outbound POSTs to a `reply_url`: no answer within this is `upstream_unreachable`.
const REPLY_TIMEOUT: Duration = Duration::from_secs(15);
/// A `reply_url`'s answer is read up to this many bytes (it may name a message ID, no more).
const MAX_REPLY_ANSWER: u64 = 64 * 1024;
/// Failed sends are logged once a minute (xAgent can call the tool at will).
static UNREACHABLE: Site = Site::new();
static REFUSED: Site = Site::new();
/// Stale messages are refused as often as a sender sends them: one line a minute.
static STALE_LOG: quiet::Site = quiet::Site::new();

pub const REGISTRATION: Registration = Registration {
    reader: Reader {
        provider: NAME,
        section: "webhook.",
        secrets: &["secret"],
        read,
        left_out: false,
    },
    start,
};

/// One `[webhook.NAME]` section.
#[derive(Clone)]
pub struct Endpoint {
    pub secret: Secret,
    pub reply_url: Option<String>,
    pub label: String,
    /// IM profile v2: forward the agent's text deltas to `reply_url`, not only finals.
    pub stream: bool,
}

/// Every configured endpoint, by name.
pub struct Endpoints(pub BTreeMap<String, Endpoint>);

impl Settings for Endpoints {
    fn summary(&self) -> String {
        if self.0.is_empty() {
            return "webhooks:          none\n".into();
        }
        self.0
            .iter()
            .map(|(name, w)| {
                format!(
                    "webhook {name}:  label \"{}\", reply_url {}\n",
                    w.label,
                    w.reply_url.as_deref().unwrap_or("none (send/reply tools unavailable)")
                )
            })
            .collect()
    }
}

/// Endpoint names appear in URLs (`/hooks/NAME`) and in auth input, so keep them plain.
fn valid_name(n: &str) -> bool {
    !n.is_empty() && n.len() <= 64 && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn read(_: &Config, sections: &[&Section], p: &mut Problems) -> Option<Arc<dyn Settings>> {
    let mut endpoints = BTreeMap::new();
    for section in sections {
        let name = section.name.strip_prefix("webhook.").unwrap_or_default();
        let mut f = Fields::new(section, p, &["secret"]);
        if !valid_name(name) {
            f.err(format!(
                "webhook name `{name}` must be 1-64 characters of A-Z a-z 0-9 _ -"
            ));
        }
        let secret = f.secret("secret");
        let reply_url = f.url("reply_url");
        let stream = f.bool("stream").unwrap_or(false);
        let label = match f.raw("label") {
            Some((v, line)) if v.is_empty() => {
                f.err_at(line, "label must not be empty");
                None
            }
            other => other.map(|(v, _)| v),
        };
        match secret {
            Some(secret) => {
                endpoints.insert(
                    name.to_string(),
                    Endpoint {
                        secret,
                        reply_url,
                        label: label.unwrap_or_else(|| name.to_string()),
                        stream,
                    },
                );
            }
            None => f.err(format!(
                "[webhook.{name}] needs `secret` (or `secret_file`): senders must authenticate"
            )),
        }
        f.finish();
    }
    // Always enabled: a channel can be bound to an endpoint added to the config later.
    Some(Arc::new(Endpoints(endpoints)))
}

fn start(host: &Arc<Host>) -> Result<Option<Arc<dyn Provider>>, StoreError> {
    Ok(Some(Arc::new(Webhooks {
        host: host.clone(),
        http: upstream::agent(REPLY_TIMEOUT),
    })))
}

pub struct Webhooks {
    host: Arc<Host>,
    /// One client for every `reply_url`, so connections are reused.
    http: ureq::Agent,
}

impl Webhooks {
    fn endpoints(&self) -> &BTreeMap<String, Endpoint> {
        static NONE: BTreeMap<String, Endpoint> = BTreeMap::new();
        self.host.config.provider::<Endpoints>(NAME).map_or(&NONE, |e| &e.0)
    }
}

/// Checks the sender: `Authorization: Bearer <secret>` or `X-Imgate-Signature: sha256=<hex>`.
pub fn authorized(hook: &Endpoint, authorization: Option<&str>, signature: Option<&str>, body: &[u8]) -> bool {
    if let Some(token) = authorization.and_then(ids::bearer) {
        return ids::secret_eq(token, hook.secret.expose());
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

fn invalid(detail: impl Into<String>) -> HttpAnswer {
    HttpAnswer::new(400, obj([("error", s("invalid_payload")), ("detail", s(detail))]))
}

/// Parses a webhook body (contract section 4); the `Err` is the `detail` of a 400.
pub fn parse_body(body: &[u8]) -> Result<Inbound, String> {
    let text = std::str::from_utf8(body).map_err(|_| "body is not UTF-8".to_string())?;
    let v = json::parse(text)?;
    let o = json::as_object(&v).ok_or("body must be a JSON object")?;
    let id_field = |k: &str| -> Result<Option<String>, String> {
        let v = match json::get(o, k) {
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
    let required = |k: &str| id_field(k)?.ok_or_else(|| format!("`{k}` is required"));
    let str_field = |k: &str| -> Result<Option<String>, String> {
        match json::get(o, k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(format!("`{k}` must be a string")),
        }
    };
    let message_id = required("message_id")?;
    let sender_id = required("sender_id")?;
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
        message_id,
        sender_id,
        sender_name: str_field("sender_name")?.filter(|n| !n.trim().is_empty()),
        chat_id: id_field("chat_id")?,
        chat_type,
        message_type,
        text: str_field("text")?.unwrap_or_default(),
        event_time,
        files: None,
    })
}

impl Webhooks {
    /// `POST /hooks/NAME` once the body is read (its size was checked by the front door).
    fn accept(&self, name: &str, req: &HttpRequest) -> Reply {
        let Some(hook) = self.endpoints().get(name) else {
            return Reply::Now(HttpAnswer::error(404, "unknown_endpoint"));
        };
        let (auth, sig) = (req.header("Authorization"), req.header("X-Imgate-Signature"));
        if !authorized(hook, auth, sig, req.body) {
            log::debug!("webhook {name}: rejected a request with a missing or wrong secret/signature");
            return Reply::Now(HttpAnswer::error(401, "unauthorized"));
        }
        let m = match parse_body(req.body) {
            Ok(m) => m,
            Err(detail) => {
                log::debug!("webhook {name}: invalid payload: {detail}");
                return Reply::Now(invalid(detail));
            }
        };
        let id = m.message_id.clone();
        let arrival = Arrival {
            source: Source::new(NAME, name),
            inbound: m,
            file: None,
            reply_ref: hook.reply_url.is_some(),
            cursors: Vec::new(),
            when_stale: WhenStale::Refuse,
        };
        let ticket = match self.host.intake(arrival) {
            Intake::Submitted(ticket) => ticket,
            Intake::Stale => {
                if let Some(more) = STALE_LOG.admit() {
                    log::info!(
                        "webhook {name}: message {} is stale (event_time older than the ttl){more}",
                        quiet::shown(&id)
                    );
                }
                let body = obj([("error", s("stale")), ("message_id", s(&id))]);
                return Reply::Now(HttpAnswer::new(409, body));
            }
        };
        let name = name.to_string();
        Reply::AfterCommit(
            ticket,
            Box::new(move |outcome| {
                let answer = |status, what| HttpAnswer::new(status, obj([("status", s(what)), ("message_id", s(&id))]));
                match outcome {
                    Ok(Enqueued::Accepted { .. }) => {
                        log::debug!("webhook {name}: accepted message {id}");
                        answer(202, "accepted")
                    }
                    Ok(Enqueued::Duplicate) => {
                        log::debug!("webhook {name}: duplicate message {id}");
                        answer(200, "duplicate")
                    }
                    Ok(Enqueued::CapacityExceeded) => HttpAnswer::error(503, "capacity_exceeded"),
                    Err(e) => {
                        // The store logs the outage once; each refused message only at debug.
                        log::debug!("webhook {name}: cannot store message {id}: {e}");
                        HttpAnswer::error(503, "storage_unavailable")
                    }
                }
            }),
        )
    }
}

impl Webhooks {
    /// POSTs a signed JSON body to the endpoint's `reply_url`; the receiver's `message_id`, if
    /// its answer names one. A 429, a 5xx or no answer may pass (`retryable`), another status
    /// will not.
    fn post(&self, name: &str, body: &Value) -> Result<Option<String>, Failure> {
        let hook = self
            .endpoints()
            .get(name)
            .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "the bound endpoint is no longer configured"))?;
        let url = hook
            .reply_url
            .as_deref()
            .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "this endpoint has no reply_url configured"))?;
        let body = json::to_string(body);
        let signature = sign(hook.secret.expose(), body.as_bytes());
        let result = self
            .http
            .post(url)
            .header("Content-Type", "application/json")
            .header("X-Imgate-Signature", &signature)
            .send(body.as_bytes());
        let mut resp = result.map_err(|e| {
            // The configured URL may carry a credential of its own: never echo it.
            let e = upstream::Error::from(e).hiding(url, "<reply_url>").to_string();
            if let Some(more) = UNREACHABLE.admit() {
                log::warn!("webhook {name}: reply_url unreachable: {e}{more}");
            }
            Failure::temporary(
                code::UPSTREAM_UNREACHABLE,
                format!("reply_url could not be reached: {e}"),
            )
        })?;
        let status = resp.status().as_u16();
        if !(200..300).contains(&status) {
            if let Some(more) = REFUSED.admit() {
                log::warn!("webhook {name}: reply_url answered HTTP {status}{more}");
            }
            let message = format!("reply_url answered HTTP {status}");
            return Err(match status {
                429 | 500.. => Failure::temporary(code::UPSTREAM_REJECTED, message),
                _ => Failure::new(code::UPSTREAM_REJECTED, message),
            });
        }
        // The receiver may name the message it created; its answer is not needed otherwise.
        let answer = upstream::read_json(&mut resp, MAX_REPLY_ANSWER)
            .ok()
            .and_then(|(_, o)| o);
        Ok(answer.and_then(|o| json::get_str(&o, "message_id").map(|id| id.chars().take(MAX_ID).collect())))
    }
}

const DECLARATION: Declaration = Declaration {
    name: NAME,
    label: "Webhook",
    description: "Any system that can POST JSON to an HTTP endpoint.",
    flows: &[FLOW],
    tools: TOOLS,
};

const FLOW: Flow = Flow::form(
    FLOW_ID,
    "Bind a Webhook Endpoint",
    "Bind this channel to a [webhook.NAME] endpoint configured on the imgate device.",
    &[
        Field::text(
            "endpoint",
            "Endpoint name",
            Some("alerts"),
            "The NAME of a [webhook.NAME] section in imgate.conf.",
        ),
        Field::secret(
            "secret",
            "Endpoint secret",
            None,
            "The secret of that endpoint, proving you administer the device.",
        ),
    ],
);

impl Provider for Webhooks {
    fn declaration(&self) -> &'static Declaration {
        &DECLARATION
    }

    /// `webhook_binding`: the endpoint must exist and the secret must be that endpoint's.
    fn bind(&self, input: &Object) -> Result<Source, Failure> {
        let endpoint = json::get_str(input, "endpoint").map(str::trim).unwrap_or_default();
        let secret = json::get_str(input, "secret").unwrap_or_default();
        if endpoint.is_empty() || secret.is_empty() {
            return Err(Failure::new(
                code::INVALID_ARGUMENTS,
                "both `endpoint` and `secret` are required",
            ));
        }
        match self.endpoints().get(endpoint) {
            Some(hook) if ids::secret_eq(secret, hook.secret.expose()) => Ok(Source::new(NAME, endpoint)),
            // One answer for both cases, so the form cannot be used to probe endpoint names.
            _ => Err(Failure::new(
                code::CONNECTION_NOT_AUTHENTICATED,
                "no webhook endpoint with that name and secret is configured on this device",
            )),
        }
    }

    fn describe(&self, source: &Source) -> Result<Description, StoreError> {
        let name = source.key();
        Ok(match self.endpoints().get(name) {
            Some(hook) => {
                let reply = if hook.reply_url.is_some() {
                    ToolState::available()
                } else {
                    ToolState::unavailable("this endpoint has no reply_url configured")
                };
                Description {
                    status: "connected",
                    target: Target {
                        provider: NAME.into(),
                        label: hook.label.clone(),
                        display_name: format!("Webhook {}", hook.label),
                        account_hint: Some(name.to_string()),
                    },
                    tools: TOOLS.iter().map(|t| (*t, reply.clone())).collect(),
                }
            }
            // Bound to an endpoint that was removed from the config.
            None => Description {
                status: "error",
                target: Target {
                    provider: NAME.into(),
                    label: name.to_string(),
                    display_name: format!("Webhook {name} (no longer configured)"),
                    account_hint: None,
                },
                tools: TOOLS
                    .iter()
                    .map(|t| (*t, ToolState::unavailable("the bound endpoint is no longer configured")))
                    .collect(),
            },
        })
    }

    /// The label as configured now; an endpoint removed since acceptance keeps its name.
    fn label(&self, source: &Source) -> String {
        let name = source.key();
        self.endpoints()
            .get(name)
            .map_or_else(|| name.to_string(), |h| h.label.clone())
    }

    /// POSTs the message to the endpoint's `reply_url`, signed with its secret: a tool call as
    /// `{endpoint, text, reply_to_message_id?, idempotency_key}`, an assistant message of IM
    /// profile v2 as `{type: "message", endpoint, message_id, text, files, idempotency_key}`
    /// (each file with the `download_url` its receiver fetches it from).
    fn send(&self, source: &Source, out: &Outbound) -> Result<String, Failure> {
        let name = source.key();
        let body = match out.message_id {
            None => obj([
                ("endpoint", s(name)),
                ("text", s(out.text)),
                ("reply_to_message_id", opt_s(out.reply_to)),
                ("idempotency_key", s(out.idempotency_key)),
            ]),
            Some(id) => {
                let base = self.host.public_base();
                // The receiver fetches the files by their refs: those become downloadable.
                for (_, path) in out.files {
                    self.host
                        .files
                        .share(&crate::files::ref_of(path))
                        .map_err(Failure::storage)?;
                }
                let files = out.files.iter().map(|(f, path)| {
                    let file_ref = crate::files::ref_of(path);
                    obj([
                        ("type", s(&f.kind)),
                        ("download_url", s(format!("{base}/files/refs/{file_ref}"))),
                        ("file_ref", s(file_ref)),
                        ("filename", s(&f.filename)),
                        ("mime_type", s(&f.mime_type)),
                        ("byte_size", json::n(f.byte_size)),
                        ("expires_at", json::n(f.expires_at)),
                    ])
                });
                obj([
                    ("type", s("message")),
                    ("endpoint", s(name)),
                    ("message_id", s(id)),
                    ("text", s(out.text)),
                    ("files", arr(files)),
                    ("idempotency_key", s(out.idempotency_key)),
                ])
            }
        };
        let remote = self.post(name, &body)?;
        Ok(remote.unwrap_or_else(|| out.idempotency_key.to_string()))
    }

    /// With `stream = true`: each delta is POSTed as `{type: "delta", endpoint, message_id,
    /// sequence, text}` (the delta's own text); otherwise only the final goes out.
    fn stream(&self, source: &Source, delta: &Delta, _handle: Option<&str>) -> Result<Option<String>, Failure> {
        let name = source.key();
        if !self.endpoints().get(name).is_some_and(|h| h.stream) {
            return Ok(None);
        }
        let body = obj([
            ("type", s("delta")),
            ("endpoint", s(name)),
            ("message_id", s(delta.message_id)),
            ("sequence", json::n(delta.sequence)),
            ("text", s(delta.piece)),
        ]);
        self.post(name, &body)?;
        Ok(Some("streamed".into()))
    }

    fn routes(&self) -> &'static [Route] {
        &[Route {
            method: "POST",
            path: "/hooks/",
            prefix: true,
        }]
    }

    fn screen(&self, req: &HttpRequest) -> Option<HttpAnswer> {
        let name = req.path.strip_prefix("/hooks/").unwrap_or_default();
        let Some(hook) = self.endpoints().get(name) else {
            return Some(HttpAnswer::error(404, "unknown_endpoint"));
        };
        let auth = req.header("Authorization");
        if auth.and_then(ids::bearer).is_none() && req.header("X-Imgate-Signature").is_some() {
            return None; // a signature covers the body
        }
        (!authorized(hook, auth, None, &[])).then(|| HttpAnswer::error(401, "unauthorized"))
    }

    fn handle(&self, req: &HttpRequest) -> Reply {
        let name = req.path.strip_prefix("/hooks/").unwrap_or_default();
        self.accept(name, req)
    }
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
        let hook = Endpoint {
            secret: crate::config::Secret::new("k"),
            reply_url: None,
            label: "x".into(),
            stream: false,
        };
        let sig = sign("k", b"body");
        assert!(authorized(&hook, None, Some(&sig), b"body"));
        assert!(!authorized(&hook, None, Some(&sig), b"bodY"));
        assert!(!authorized(&hook, None, Some("sha256=zz"), b"body"));
        assert!(authorized(&hook, Some("Bearer k"), None, b""));
        assert!(
            authorized(&hook, Some("bearer  k"), None, b""),
            "the scheme is case-insensitive"
        );
        assert!(!authorized(&hook, Some("Bearer x"), None, b""));
        assert!(!authorized(&hook, None, None, b""));
    }
}
