//! The long connection's protocol, without I/O: what the endpoint request answers, what a
//! received frame means, the frames imgate sends (ping, the response to an event), and the
//! reassembly of a payload split across frames. The connection task (`link.rs`) drives it.
//!
//! The exchange, as the official SDKs implement it:
//! 1. `POST {base}/callback/ws/endpoint` with `{"AppID", "AppSecret"}` answers
//!    `{"code", "msg", "data": {"URL", "ClientConfig"}}`; the `URL` (a `wss://` address whose
//!    query holds `device_id` and `service_id`) is dialed as a WebSocket.
//! 2. The client sends a ping (a control frame, header `type: ping`, `service` = the
//!    `service_id`) every `PingInterval` seconds; the pong may carry a new `ClientConfig`.
//! 3. Events arrive as data frames (header `type: event`); a payload over the server's frame
//!    size comes as `sum` frames with `seq` 0..sum under one `message_id`. Each event is answered
//!    with the same frame, its payload replaced by `{"code": 200, ...}` and a `biz_rt` header;
//!    an event left unanswered is delivered again. imgate answers only after the outbox commit,
//!    and echoes only the headers the SDKs read (`ANSWER_HEADERS`), not every one the event
//!    came with.
//! 4. When the connection drops, the client waits a random part of `ReconnectNonce` seconds,
//!    then tries again every `ReconnectInterval` seconds.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::frame::{Frame, METHOD_CONTROL, METHOD_DATA};
use crate::json::{self, Value};
use crate::peer_wait;

/// The endpoint request's path under the API base.
pub const ENDPOINT_PATH: &str = "/callback/ws/endpoint";

/// How often to ping, how to reconnect: the server's `ClientConfig`, within our bounds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClientConfig {
    pub ping_every: Duration,
    pub reconnect_every: Duration,
    /// The first reconnect waits a random part of this.
    pub reconnect_jitter: Duration,
}

impl Default for ClientConfig {
    /// The SDKs' defaults.
    fn default() -> ClientConfig {
        ClientConfig {
            ping_every: Duration::from_secs(120),
            reconnect_every: Duration::from_secs(120),
            reconnect_jitter: Duration::from_secs(30),
        }
    }
}

/// A server value outside these bounds is clamped: a ping every second, or a reconnect loop
/// without pause, must not follow from one odd answer.
const PING_BOUNDS: (u64, u64) = (10, 600);
const RECONNECT_BOUNDS: (u64, u64) = (5, peer_wait::RECONNECT_MAX.as_secs());
const JITTER_MAX: u64 = 120;

/// A `ClientConfig` as the server sent it (endpoint answer or pong): seconds, each field only
/// if present and a count. `ReconnectCount` is not read: imgate never gives up.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ConfigUpdate {
    pub ping: Option<u64>,
    pub reconnect: Option<u64>,
    pub jitter: Option<u64>,
}

impl ConfigUpdate {
    fn read(v: &Value) -> ConfigUpdate {
        let Some(o) = json::as_object(v) else {
            return ConfigUpdate::default();
        };
        ConfigUpdate {
            ping: json::get_u64(o, "PingInterval"),
            reconnect: json::get_u64(o, "ReconnectInterval"),
            jitter: json::get_u64(o, "ReconnectNonce"),
        }
    }
}

impl ClientConfig {
    /// With the server's update applied within our bounds; absent fields keep their value.
    pub fn updated(self, u: ConfigUpdate) -> ClientConfig {
        let secs = |v: Option<u64>, (lo, hi): (u64, u64), current: Duration| {
            v.map_or(current, |s| Duration::from_secs(s.clamp(lo, hi)))
        };
        ClientConfig {
            ping_every: secs(u.ping, PING_BOUNDS, self.ping_every),
            reconnect_every: secs(u.reconnect, RECONNECT_BOUNDS, self.reconnect_every),
            reconnect_jitter: secs(u.jitter, (0, JITTER_MAX), self.reconnect_jitter),
        }
    }
}

/// Where to connect, from the endpoint answer.
#[derive(Clone, PartialEq)]
pub struct Endpoint {
    /// A credential: its query carries the connection's access key. Never logged (`Debug`
    /// shows only scheme, host and path).
    pub url: String,
    /// The `service_id` of the URL's query, sent in every ping's `service` field.
    pub service_id: i32,
    pub config: ClientConfig,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let without_query = self.url.split(['?', '#']).next().unwrap_or_default();
        f.debug_struct("Endpoint")
            .field("url", &format_args!("{without_query}?…"))
            .field("service_id", &self.service_id)
            .field("config", &self.config)
            .finish()
    }
}

/// Why the endpoint request did not give an address.
#[derive(Clone, Debug, PartialEq)]
pub enum EndpointError {
    /// Worth trying again later (busy, an internal error, an answer we cannot read).
    Retry(String),
    /// The app is refused (wrong credentials, long connection not enabled, too many
    /// connections): retrying will not help until the operator acts.
    Refused { code: u64, msg: String },
}

/// The code Feishu answers when it is busy.
const CODE_BUSY: u64 = 1;
/// Its internal error.
const CODE_INTERNAL: u64 = 1000040343;

/// Reads the endpoint request's answer (status 200; other statuses are `Retry` by the caller).
pub fn read_endpoint(body: &str, config: ClientConfig) -> Result<Endpoint, EndpointError> {
    let retry = |why: &str| EndpointError::Retry(why.to_string());
    let v = json::parse(body).map_err(|_| retry("the endpoint answer is not JSON"))?;
    let o = json::as_object(&v).ok_or_else(|| retry("the endpoint answer is not an object"))?;
    let code = json::get_u64(o, "code").ok_or_else(|| retry("the endpoint answer has no code"))?;
    let msg = json::get_str(o, "msg")
        .unwrap_or_default()
        .chars()
        .take(200)
        .collect::<String>();
    match code {
        0 => {}
        CODE_BUSY | CODE_INTERNAL => return Err(EndpointError::Retry(format!("code {code}: {msg}"))),
        _ => return Err(EndpointError::Refused { code, msg }),
    }
    let data = json::get_obj(o, "data").ok_or_else(|| retry("the endpoint answer has no data"))?;
    let url = json::get_str(data, "URL").filter(|u| u.starts_with("wss://") || u.starts_with("ws://"));
    let url = url.ok_or_else(|| retry("the endpoint answer has no WebSocket URL"))?;
    let service_id = query_param(url, "service_id")
        .and_then(|s| s.parse::<i32>().ok())
        .ok_or_else(|| retry("the endpoint URL has no service_id"))?;
    let config = match json::get(data, "ClientConfig") {
        Some(c) => config.updated(ConfigUpdate::read(c)),
        None => config,
    };
    Ok(Endpoint {
        url: url.to_string(),
        service_id,
        config,
    })
}

/// One query parameter's raw value (the ones read here are plain numbers).
fn query_param<'a>(url: &'a str, name: &str) -> Option<&'a str> {
    let query = url.split_once('?')?.1.split('#').next()?;
    query.split('&').find_map(|pair| match pair.split_once('=') {
        Some((k, v)) if k == name => Some(v),
        _ => None,
    })
}

/// A ping for the connection's service.
pub fn ping(service_id: i32) -> Frame {
    Frame {
        service: service_id,
        method: METHOD_CONTROL,
        headers: vec![("type".into(), "ping".into())],
        ..Frame::default()
    }
}

/// What a received frame means.
#[derive(Debug, PartialEq)]
pub enum Received {
    /// A pong, perhaps with a new `ClientConfig` (all `None` if not).
    Pong(ConfigUpdate),
    /// An event's whole payload (reassembled if it was split), and the frame to answer it with
    /// (`respond` fills in the outcome).
    Event {
        message_id: String,
        payload: Vec<u8>,
        answer: Frame,
    },
    /// Part of a split payload; the rest is still to come.
    Partial,
    /// Anything else (card callbacks, unknown types), answered by nobody: a card action is not
    /// an IM message.
    Ignored(String),
}

/// Parts of split payloads waiting for the rest, bounded in count, size and age.
#[derive(Default)]
pub struct Reassembly {
    parts: HashMap<String, Pending>,
}

struct Pending {
    started: Instant,
    parts: Vec<Option<Vec<u8>>>,
    bytes: usize,
}

/// At most this many split payloads in progress at once (the oldest goes first)...
pub const MAX_SPLIT: usize = 16;
/// ...each in at most this many parts...
pub const MAX_PARTS: usize = 64;
/// ...of at most this many bytes in all...
pub const MAX_PAYLOAD: usize = 4 << 20;
/// ...and complete within this long (the SDKs keep parts 5 s).
pub const SPLIT_TTL: Duration = Duration::from_secs(5);

impl Reassembly {
    /// Reads one received frame. `now` is passed in so tests control time.
    pub fn receive(&mut self, frame: Frame, now: Instant) -> Received {
        let kind = frame.header("type").unwrap_or_default().to_string();
        match (frame.method, kind.as_str()) {
            (METHOD_CONTROL, "pong") => {
                let config = std::str::from_utf8(&frame.payload)
                    .ok()
                    .and_then(|t| json::parse(t).ok());
                Received::Pong(config.as_ref().map(ConfigUpdate::read).unwrap_or_default())
            }
            (METHOD_DATA, "event") => self.event(frame, now),
            (method, kind) => Received::Ignored(format!("method {method}, type {kind:?}")),
        }
    }

    fn event(&mut self, mut frame: Frame, now: Instant) -> Received {
        let message_id = frame.header("message_id").unwrap_or_default().to_string();
        let number = |key: &str| frame.header(key).and_then(|v| v.parse::<usize>().ok());
        let (sum, seq) = (number("sum").unwrap_or(1), number("seq").unwrap_or(0));
        let payload = std::mem::take(&mut frame.payload);
        // What waits for the answer is the frame cut down to what the answer needs, not the
        // headers the event came with (up to 64 of 4 KiB each).
        let frame = answer_frame(frame);
        if sum <= 1 {
            return Received::Event {
                message_id,
                payload,
                answer: frame,
            };
        }
        if sum > MAX_PARTS || seq >= sum || message_id.is_empty() {
            return Received::Ignored(format!("a split payload of {sum} parts, part {seq}"));
        }
        self.parts.retain(|_, p| now.duration_since(p.started) < SPLIT_TTL);
        if !self.parts.contains_key(&message_id) && self.parts.len() >= MAX_SPLIT {
            if let Some(oldest) = self.parts.iter().min_by_key(|(_, p)| p.started).map(|(k, _)| k.clone()) {
                self.parts.remove(&oldest);
            }
        }
        let pending = self.parts.entry(message_id.clone()).or_insert_with(|| Pending {
            started: now,
            parts: vec![None; sum],
            bytes: 0,
        });
        if pending.parts.len() != sum {
            self.parts.remove(&message_id);
            return Received::Ignored(format!("{message_id}: parts disagree on their count"));
        }
        let old = pending.parts[seq].as_ref().map_or(0, Vec::len);
        if pending.bytes - old + payload.len() > MAX_PAYLOAD {
            self.parts.remove(&message_id);
            return Received::Ignored(format!("{message_id}: a split payload over {MAX_PAYLOAD} bytes"));
        }
        pending.bytes = pending.bytes - old + payload.len();
        pending.parts[seq] = Some(payload);
        if pending.parts.iter().any(Option::is_none) {
            return Received::Partial;
        }
        let whole = self
            .parts
            .remove(&message_id)
            .map(|p| p.parts.into_iter().flatten().flatten().collect());
        Received::Event {
            message_id,
            payload: whole.unwrap_or_default(),
            answer: frame,
        }
    }
}

/// The headers an answer echoes from its event: those the official SDKs read from an event
/// frame (`type`, `message_id`, `sum`, `seq`, `trace_id`), which is all the server can match an
/// answer by. The SDKs echo the whole frame; imgate echoes these, each once, so an event's other
/// headers (up to 64 of 4 KiB each) are never written back, nor held while the answer waits.
pub const ANSWER_HEADERS: [&str; 5] = ["type", "message_id", "sum", "seq", "trace_id"];
/// An echoed header value, `payload_encoding`, `payload_type` or `LogIDNew` longer than this is
/// left out (the server's are IDs and numbers, far shorter); an answer is at most about 2 KiB.
pub const MAX_ECHOED: usize = 256;
/// What `respond` adds to its frame at most, in encoded bytes: the `biz_rt` header and the
/// outcome as payload.
pub const RESPONSE_GROWTH: usize = 128;

/// `event` as the frame to answer it with: its own fields (`SeqID`, `LogID`, `service`,
/// `method`, and the short text fields), the first of each of `ANSWER_HEADERS` within
/// `MAX_ECHOED`, no payload.
fn answer_frame(event: Frame) -> Frame {
    let short = |t: String| if t.len() <= MAX_ECHOED { t } else { String::new() };
    let mut headers: Vec<(String, String)> = Vec::with_capacity(ANSWER_HEADERS.len() + 1);
    for (k, v) in event.headers {
        let wanted = ANSWER_HEADERS.contains(&k.as_str()) && v.len() <= MAX_ECHOED;
        if wanted && !headers.iter().any(|(seen, _)| *seen == k) {
            headers.push((k, v));
        }
    }
    Frame {
        seq_id: event.seq_id,
        log_id: event.log_id,
        service: event.service,
        method: event.method,
        headers,
        payload_encoding: short(event.payload_encoding),
        payload_type: short(event.payload_type),
        payload: Vec::new(),
        log_id_new: short(event.log_id_new),
    }
}

/// The encoded size of `respond(answer, ..)` at most: what an answer costs until it is written.
pub fn response_size(answer: &Frame) -> usize {
    answer.encoded_len().saturating_add(RESPONSE_GROWTH)
}

/// The answer to an event: its frame (`answer_frame`: only what the server needs) with the
/// outcome as payload (200: stored, so Feishu may forget it; 500: not stored, deliver it again)
/// and how long handling took (`biz_rt`, in milliseconds, as the SDKs write it).
pub fn respond(answer: Frame, stored: bool, took: Duration) -> Frame {
    let mut answer = answer_frame(answer);
    let code = if stored { 200 } else { 500 };
    answer.headers.push(("biz_rt".into(), took.as_millis().to_string()));
    answer.payload = format!(r#"{{"code":{code},"headers":{{}},"data":null}}"#).into_bytes();
    answer
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: &str, sum: usize, seq: usize, payload: &[u8]) -> Frame {
        Frame {
            seq_id: 3,
            log_id: 4,
            service: 77,
            method: METHOD_DATA,
            headers: vec![
                ("type".into(), "event".into()),
                ("message_id".into(), id.into()),
                ("sum".into(), sum.to_string()),
                ("seq".into(), seq.to_string()),
                ("trace_id".into(), "t".into()),
            ],
            payload: payload.to_vec(),
            ..Frame::default()
        }
    }

    #[test]
    fn the_endpoint_answer_gives_the_url_the_service_and_a_bounded_config() {
        let body = r#"{"code":0,"msg":"ok","data":{"URL":"wss://msg.example/ws/v2?fpid=1&device_id=d9&service_id=321&access_key=k","ClientConfig":{"PingInterval":1,"ReconnectCount":-1,"ReconnectInterval":30,"ReconnectNonce":99999}}}"#;
        let e = read_endpoint(body, ClientConfig::default()).unwrap();
        assert_eq!(e.service_id, 321);
        let shown = format!("{e:?}");
        assert!(
            !shown.contains("access_key") && shown.contains("wss://msg.example/ws/v2"),
            "{shown}"
        );
        assert!(e.url.starts_with("wss://msg.example/ws/v2?"));
        assert_eq!(
            e.config,
            ClientConfig {
                ping_every: Duration::from_secs(10),
                reconnect_every: Duration::from_secs(30),
                reconnect_jitter: Duration::from_secs(JITTER_MAX),
            }
        );
    }

    #[test]
    fn endpoint_refusals_and_passing_trouble_are_told_apart() {
        let d = ClientConfig::default();
        assert_eq!(
            read_endpoint(r#"{"code":1000040350,"msg":"exceed conn limit"}"#, d),
            Err(EndpointError::Refused {
                code: 1000040350,
                msg: "exceed conn limit".into()
            })
        );
        assert!(matches!(
            read_endpoint(r#"{"code":1,"msg":"busy"}"#, d),
            Err(EndpointError::Retry(_))
        ));
        assert!(matches!(
            read_endpoint(r#"{"code":1000040343}"#, d),
            Err(EndpointError::Retry(_))
        ));
        for bad in [
            "",
            "[]",
            r#"{"msg":"no code"}"#,
            r#"{"code":0}"#,
            r#"{"code":0,"data":{"URL":"https://not-a-websocket?service_id=1"}}"#,
            r#"{"code":0,"data":{"URL":"wss://x/ws?device_id=1"}}"#,
            r#"{"code":0,"data":{"URL":"wss://x/ws?service_id=99999999999"}}"#,
        ] {
            assert!(matches!(read_endpoint(bad, d), Err(EndpointError::Retry(_))), "{bad}");
        }
    }

    #[test]
    fn a_pong_carries_a_new_config_and_odd_values_keep_the_old_ones() {
        let mut r = Reassembly::default();
        let pong = Frame {
            method: METHOD_CONTROL,
            headers: vec![("type".into(), "pong".into())],
            payload: br#"{"PingInterval":90,"ReconnectInterval":"soon"}"#.to_vec(),
            ..Frame::default()
        };
        let Received::Pong(u) = r.receive(pong, Instant::now()) else {
            panic!("a pong")
        };
        let c = ClientConfig::default().updated(u);
        assert_eq!(c.ping_every, Duration::from_secs(90));
        assert_eq!(c.reconnect_every, ClientConfig::default().reconnect_every);
    }

    #[test]
    fn a_split_payload_is_joined_in_order_whatever_order_its_parts_come_in() {
        let mut r = Reassembly::default();
        let now = Instant::now();
        assert_eq!(r.receive(event("m", 3, 2, b"c"), now), Received::Partial);
        assert_eq!(r.receive(event("m", 3, 0, b"a"), now), Received::Partial);
        let Received::Event {
            message_id,
            payload,
            answer,
        } = r.receive(event("m", 3, 1, b"b"), now)
        else {
            panic!("complete")
        };
        assert_eq!((message_id.as_str(), payload.as_slice()), ("m", &b"abc"[..]));
        assert_eq!((answer.seq_id, answer.service), (3, 77));
        assert!(r.parts.is_empty(), "nothing kept once joined");
    }

    #[test]
    fn split_payloads_are_bounded_in_count_size_parts_and_age() {
        let mut r = Reassembly::default();
        let t0 = Instant::now();
        for i in 0..MAX_SPLIT + 5 {
            r.receive(
                event(&format!("m{i}"), 2, 0, b"x"),
                t0 + Duration::from_millis(i as u64),
            );
        }
        assert_eq!(r.parts.len(), MAX_SPLIT);
        assert!(!r.parts.contains_key("m0"), "the oldest went first");
        // Too old: dropped at the next frame, and its second part starts over.
        let later = t0 + SPLIT_TTL + Duration::from_secs(1);
        assert_eq!(r.receive(event("m20", 2, 1, b"y"), later), Received::Partial);
        assert_eq!(r.parts.len(), 1);
        assert!(matches!(
            r.receive(event("big", MAX_PARTS + 1, 0, b""), later),
            Received::Ignored(_)
        ));
        assert!(matches!(
            r.receive(event("seq", 2, 2, b""), later),
            Received::Ignored(_)
        ));
        let half = vec![0u8; MAX_PAYLOAD / 2 + 1];
        assert_eq!(r.receive(event("huge", 2, 0, &half), later), Received::Partial);
        assert!(matches!(
            r.receive(event("huge", 2, 1, &half), later),
            Received::Ignored(_)
        ));
        assert!(!r.parts.contains_key("huge"));
        assert_eq!(r.receive(event("n", 2, 0, b"a"), later), Received::Partial);
        assert!(matches!(r.receive(event("n", 3, 1, b"b"), later), Received::Ignored(_)));
    }

    #[test]
    fn the_answer_is_the_event_frame_with_the_outcome_and_the_time_taken() {
        let Received::Event { answer, .. } = Reassembly::default().receive(event("m", 1, 0, b"{}"), Instant::now())
        else {
            panic!("an event")
        };
        let ok = respond(answer.clone(), true, Duration::from_millis(12));
        assert_eq!(ok.header("biz_rt"), Some("12"));
        assert_eq!(ok.header("message_id"), Some("m"));
        assert_eq!(ok.payload, br#"{"code":200,"headers":{},"data":null}"#);
        assert_eq!(Frame::decode(&ok.encode()), Ok(ok));
        let failed = respond(answer, false, Duration::ZERO);
        assert!(std::str::from_utf8(&failed.payload).unwrap().contains("500"));
    }

    #[test]
    fn the_answer_echoes_only_the_headers_the_server_matches_it_by_and_stays_small() {
        let mut frame = event("m-42", 1, 0, b"{}");
        frame.payload_type = "json".into();
        frame.log_id_new = "x".repeat(MAX_ECHOED + 1);
        // 58 headers of 4,000 bytes (one a `trace_id` too long to be the server's, which the
        // later one stands for) and a second `type`: 64 headers, as many as a frame may have.
        let big = "h".repeat(4000);
        let mut padding: Vec<(String, String)> = (0..57).map(|i| (format!("x-pad-{i}"), big.clone())).collect();
        padding.push(("trace_id".into(), big.clone()));
        frame.headers.splice(1..1, padding);
        frame.headers.push(("type".into(), "card".into()));
        let bytes = frame.encode();
        assert!(bytes.len() > 58 * 4000, "{}", bytes.len());
        assert_eq!(Frame::decode(&bytes).map(|f| f.headers.len()), Ok(64));
        let Received::Event { answer, .. } = Reassembly::default().receive(frame.clone(), Instant::now()) else {
            panic!("an event")
        };
        assert!(answer.headers.len() <= ANSWER_HEADERS.len(), "cut down while it waits");
        let took = Duration::from_millis(7);
        for answer in [respond(frame, true, took), respond(answer, true, took)] {
            let keys: Vec<(&str, &str)> = answer.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            assert_eq!(
                keys,
                [
                    ("type", "event"),
                    ("message_id", "m-42"),
                    ("sum", "1"),
                    ("seq", "0"),
                    ("trace_id", "t"),
                    ("biz_rt", "7")
                ]
            );
            assert_eq!(
                (answer.seq_id, answer.log_id, answer.service, answer.method),
                (3, 4, 77, METHOD_DATA)
            );
            assert_eq!((answer.payload_type.as_str(), answer.log_id_new.as_str()), ("json", ""));
            let bytes = answer.encode();
            assert!(bytes.len() < 200, "an answer of {} bytes", bytes.len());
            assert_eq!(Frame::decode(&bytes), Ok(answer));
        }
    }

    #[test]
    fn an_answer_never_outgrows_its_stated_size() {
        // Every echoed field as long as it may be (`sum` and `seq` are numbers still).
        let mut frame = event(&"m".repeat(MAX_ECHOED), 1, 0, b"");
        frame.headers = vec![
            ("type".into(), "event".into()),
            ("message_id".into(), "m".repeat(MAX_ECHOED)),
            ("sum".into(), format!("{:0>MAX_ECHOED$}", 1)),
            ("seq".into(), "0".repeat(MAX_ECHOED)),
            ("trace_id".into(), "t".repeat(MAX_ECHOED)),
        ];
        frame.payload_encoding = "e".repeat(MAX_ECHOED);
        frame.payload_type = "t".repeat(MAX_ECHOED);
        frame.log_id_new = "l".repeat(MAX_ECHOED);
        frame.seq_id = u64::MAX;
        frame.log_id = u64::MAX;
        frame.service = i32::MIN;
        let Received::Event { answer, .. } = Reassembly::default().receive(frame, Instant::now()) else {
            panic!("an event")
        };
        let size = response_size(&answer);
        assert_eq!(answer.headers.len(), ANSWER_HEADERS.len(), "every one echoed");
        let longest = respond(answer, false, Duration::MAX).encode().len();
        assert!(longest <= size, "{longest} > {size}");
        assert!(size <= 2 << 10, "an answer counted as {size} bytes");
    }

    #[test]
    fn a_ping_names_the_service_and_other_frames_are_ignored() {
        let p = ping(321);
        assert_eq!(
            (p.service, p.method, p.header("type")),
            (321, METHOD_CONTROL, Some("ping"))
        );
        let card = Frame {
            method: METHOD_DATA,
            headers: vec![("type".into(), "card".into())],
            ..Frame::default()
        };
        assert!(matches!(
            Reassembly::default().receive(card, Instant::now()),
            Received::Ignored(_)
        ));
    }
}
