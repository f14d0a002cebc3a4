//! A Feishu/Lark Open Platform simulator written from the public documents: the
//! `tenant_access_token` API, the long connection (the endpoint request, then a WebSocket of
//! protobuf `Frame`s: pings answered with pongs carrying `ClientConfig`, events as data frames,
//! split across frames when asked, redelivered until answered with code 200), and the im/v1
//! chat, message, reply, image/file upload and message-resource APIs. A connection can also be
//! a hostile gateway's (`flood_next`): events as fast as the socket takes them, or WebSocket
//! pings, and nothing of imgate's read.
//!
//! Its protobuf code is its own, written from the `pbbp2.proto` message the SDKs use, not
//! imgate's.

use std::collections::HashMap;
use std::io::ErrorKind;
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

use super::kit::now_ms;
use tungstenite::Message;

/// `pbbp2.Frame`: SeqID 1, LogID 2, service 3, method 4, headers 5 (key 1, value 2),
/// payload_encoding 6, payload_type 7, payload 8, LogIDNew 9.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PbFrame {
    pub seq_id: u64,
    pub log_id: u64,
    pub service: i32,
    pub method: i32,
    pub headers: Vec<(String, String)>,
    pub payload_encoding: String,
    pub payload_type: String,
    pub payload: Vec<u8>,
    pub log_id_new: String,
}

impl PbFrame {
    pub fn header(&self, k: &str) -> Option<&str> {
        self.headers.iter().find(|(h, _)| h == k).map(|(_, v)| v.as_str())
    }

    pub fn encode(&self) -> Vec<u8> {
        fn varint(out: &mut Vec<u8>, mut v: u64) {
            while v >= 0x80 {
                out.push((v as u8) | 0x80);
                v >>= 7;
            }
            out.push(v as u8);
        }
        fn bytes(out: &mut Vec<u8>, field: u64, b: &[u8]) {
            varint(out, field << 3 | 2);
            varint(out, b.len() as u64);
            out.extend_from_slice(b);
        }
        let mut out = Vec::new();
        for (field, v) in [
            (1, self.seq_id),
            (2, self.log_id),
            (3, self.service as i64 as u64),
            (4, self.method as i64 as u64),
        ] {
            varint(&mut out, field << 3);
            varint(&mut out, v);
        }
        for (k, v) in &self.headers {
            let mut h = Vec::new();
            bytes(&mut h, 1, k.as_bytes());
            bytes(&mut h, 2, v.as_bytes());
            bytes(&mut out, 5, &h);
        }
        // The optional strings only when set, as protobuf writes proto3 fields.
        for (field, text) in [(6, &self.payload_encoding), (7, &self.payload_type)] {
            if !text.is_empty() {
                bytes(&mut out, field, text.as_bytes());
            }
        }
        bytes(&mut out, 8, &self.payload);
        if !self.log_id_new.is_empty() {
            bytes(&mut out, 9, self.log_id_new.as_bytes());
        }
        out
    }

    pub fn decode(mut b: &[u8]) -> Option<PbFrame> {
        fn varint(b: &mut &[u8]) -> Option<u64> {
            let mut v = 0u64;
            for shift in (0..64).step_by(7) {
                let (&byte, rest) = b.split_first()?;
                *b = rest;
                v |= u64::from(byte & 0x7f) << shift;
                if byte < 0x80 {
                    return Some(v);
                }
            }
            None
        }
        fn field<'a>(b: &mut &'a [u8]) -> Option<(u64, u64, &'a [u8])> {
            let key = varint(b)?;
            match key & 7 {
                0 => Some((key >> 3, varint(b)?, &[])),
                2 => {
                    let n = varint(b)? as usize;
                    let (v, rest) = (b.get(..n)?, b.get(n..)?);
                    *b = rest;
                    Some((key >> 3, 0, v))
                }
                _ => None,
            }
        }
        let mut f = PbFrame::default();
        while !b.is_empty() {
            let (n, v, data) = field(&mut b)?;
            match n {
                1 => f.seq_id = v,
                2 => f.log_id = v,
                3 => f.service = v as i32,
                4 => f.method = v as i32,
                5 => {
                    let (mut h, mut kv) = (data, (String::new(), String::new()));
                    while !h.is_empty() {
                        let (hn, _, hv) = field(&mut h)?;
                        let text = String::from_utf8(hv.to_vec()).ok()?;
                        if hn == 1 {
                            kv.0 = text;
                        } else if hn == 2 {
                            kv.1 = text;
                        }
                    }
                    f.headers.push(kv);
                }
                6 => f.payload_encoding = String::from_utf8(data.to_vec()).ok()?,
                7 => f.payload_type = String::from_utf8(data.to_vec()).ok()?,
                8 => f.payload = data.to_vec(),
                9 => f.log_id_new = String::from_utf8(data.to_vec()).ok()?,
                _ => {}
            }
        }
        Some(f)
    }
}

pub const SERVICE_ID: i32 = 4242;

#[derive(Default)]
struct State {
    /// app_id → secret.
    apps: HashMap<String, String>,
    /// Apps whose events go through the long connection.
    long_conn: Vec<String>,
    /// token → (app_id, still valid).
    tokens: HashMap<String, (String, bool)>,
    tokens_issued: usize,
    /// chat_id → (name, chat_mode, apps whose bot is a member).
    chats: HashMap<String, (String, String, Vec<String>)>,
    endpoint_calls: usize,
    /// access_key → app_id, for URLs the endpoint handed out.
    access_keys: HashMap<String, String>,
    /// app_id → the sender of its live connection, and a serial of connections.
    conns: HashMap<String, (u64, mpsc::Sender<Vec<u8>>)>,
    next_conn: u64,
    /// Events not answered with 200 yet: (app, frame message_id, payload, parts).
    unanswered: Vec<(String, String, Vec<u8>, usize)>,
    /// Answers: frame message_id → (code, biz_rt header).
    answers: Vec<(String, u64, Option<String>)>,
    pings: Vec<i32>,
    ping_interval: u64,
    /// Every API call: (method, path with query, JSON body or Null).
    calls: Vec<(String, String, Value)>,
    /// Multipart uploads: (path, raw body).
    uploads: Vec<(String, Vec<u8>)>,
    /// (message_id, file_key) → (bytes, content type).
    resources: HashMap<(String, String), (Vec<u8>, String)>,
    /// Answers to give first to calls whose path contains the key: (status, code).
    failures: Vec<(String, u16, i64)>,
    /// Calls whose path contains the key hang this long before they are answered (once each).
    stalls: Vec<(String, Duration)>,
    next_id: u64,
    /// app_id → what its next connection does instead of the usual exchange.
    floods: HashMap<String, Flood>,
    /// Frames (events or bursts of pings) the flooding connections wrote so far.
    flood_sent: usize,
    /// Floods that ended (their writes failed, or the pings were all sent).
    floods_ended: usize,
}

/// A hostile gateway: its connection writes and never reads a byte of imgate's.
#[derive(Clone, Debug)]
pub enum Flood {
    /// `im.message.receive_v1` events of `chat` (bound to no channel), each frame with
    /// `headers` extra headers of `header_len` bytes, as fast as the socket takes them, until a
    /// write fails or stalls for two minutes. The frame's `message_id` and `trace_id` headers,
    /// `payload_encoding`, `payload_type` and `LogIDNew` are `echoed_len` bytes each: the
    /// answers are as large as imgate writes them, so its buffers fill with fewer events.
    Events {
        chat: String,
        headers: usize,
        header_len: usize,
        echoed_len: usize,
    },
    /// 125-byte WebSocket pings (each would get a pong), `ping_bursts()` bursts of 1,000, each
    /// burst written within 30 s or the flood ends.
    Pings,
}

pub struct FeishuSim {
    pub base: String,
    state: Arc<(Mutex<State>, Condvar)>,
}

fn reply(req: tiny_http::Request, status: u16, body: Value) {
    let resp = tiny_http::Response::from_string(body.to_string())
        .with_status_code(status)
        .with_header(
            "Content-Type: application/json; charset=utf-8"
                .parse::<tiny_http::Header>()
                .unwrap(),
        );
    let _ = req.respond(resp);
}

impl FeishuSim {
    pub fn start() -> FeishuSim {
        let http = Arc::new(tiny_http::Server::http("127.0.0.1:0").unwrap());
        let port = http.server_addr().to_ip().unwrap().port();
        let ws = TcpListener::bind("127.0.0.1:0").unwrap();
        let ws_port = ws.local_addr().unwrap().port();
        let state: Arc<(Mutex<State>, Condvar)> = Arc::default();
        state.0.lock().unwrap().ping_interval = 120;
        for _ in 0..4 {
            let (http, state) = (http.clone(), state.clone());
            std::thread::spawn(move || {
                while let Ok(req) = http.recv() {
                    serve(&state, req, ws_port);
                }
            });
        }
        let st = state.clone();
        std::thread::spawn(move || {
            for stream in ws.incoming().flatten() {
                let st = st.clone();
                std::thread::spawn(move || long_connection(&st, stream));
            }
        });
        FeishuSim {
            base: format!("http://127.0.0.1:{port}"),
            state,
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        super::kit::change(&self.state, f)
    }

    /// Waits until `ready` holds; false after `timeout`.
    fn wait(&self, timeout: Duration, ready: impl Fn(&State) -> bool) -> bool {
        super::kit::wait_for(&self.state, timeout, ready)
    }

    /// Waits until `ready` holds for as long as `progress` (a figure that moves with every event)
    /// keeps changing; false only once it has not changed for `quiet`: a busy machine is slower,
    /// not stuck.
    fn wait_moving<P: PartialEq>(
        &self,
        quiet: Duration,
        progress: impl Fn(&State) -> P,
        ready: impl Fn(&State) -> bool,
    ) -> bool {
        let mut moving = super::Progress::new(quiet);
        let mut s = self.state.0.lock().unwrap();
        while !ready(&s) {
            if !moving.moving(progress(&s)) {
                return false;
            }
            s = self.state.1.wait_timeout(s, Duration::from_millis(50)).unwrap().0;
        }
        true
    }

    /// A self-built app; `long_conn`: its events go through the long connection.
    pub fn add_app(&self, app_id: &str, secret: &str, long_conn: bool) {
        self.with(|s| {
            s.apps.insert(app_id.into(), secret.into());
            if long_conn {
                s.long_conn.push(app_id.into());
            }
        });
    }

    pub fn add_chat(&self, chat_id: &str, name: &str, mode: &str, member_apps: &[&str]) {
        self.with(|s| {
            let apps = member_apps.iter().map(|a| a.to_string()).collect();
            s.chats.insert(chat_id.into(), (name.into(), mode.into(), apps));
        });
    }

    pub fn add_resource(&self, message_id: &str, file_key: &str, bytes: &[u8], ctype: &str) {
        self.with(|s| {
            s.resources
                .insert((message_id.into(), file_key.into()), (bytes.to_vec(), ctype.into()));
        });
    }

    /// The next calls whose path contains `path` fail with `status` and `code` first.
    pub fn fail_next(&self, path: &str, status: u16, code: i64, times: usize) {
        self.with(|s| {
            for _ in 0..times {
                s.failures.push((path.into(), status, code));
            }
        });
    }

    /// The next call whose path contains `path` hangs for `d` before it is answered.
    pub fn stall_next(&self, path: &str, d: Duration) {
        self.with(|s| s.stalls.push((path.into(), d)));
    }

    /// Every token issued so far stops working (as after its two hours).
    /// The `PingInterval` (seconds) the endpoint and pong frames give from now on.
    pub fn set_ping_interval(&self, secs: u64) {
        self.with(|s| s.ping_interval = secs);
    }

    pub fn expire_tokens(&self) {
        self.with(|s| s.tokens.values_mut().for_each(|t| t.1 = false));
    }

    pub fn tokens_issued(&self) -> usize {
        self.with(|s| s.tokens_issued)
    }

    pub fn endpoint_calls(&self) -> usize {
        self.with(|s| s.endpoint_calls)
    }

    /// Waits for the app's long connection (the `n`-th one when `n` > 1).
    pub fn wait_connected(&self, app: &str, n: u64, timeout: Duration) -> bool {
        self.wait(timeout, |s| s.conns.get(app).is_some_and(|(serial, _)| *serial >= n))
    }

    /// The serial of the app's connection now (connections of every app are numbered from 1
    /// as they come), 0 when it has none.
    pub fn connections(&self, app: &str) -> u64 {
        self.with(|s| s.conns.get(app).map_or(0, |(serial, _)| *serial))
    }

    /// Closes the app's connection as the server would.
    pub fn drop_connection(&self, app: &str) {
        self.with(|s| s.conns.remove(app));
    }

    /// The app's next connection floods imgate as `flood` says and reads nothing; the one after
    /// it is an ordinary one again.
    pub fn flood_next(&self, app: &str, flood: Flood) {
        self.with(|s| s.floods.insert(app.into(), flood));
    }

    /// Frames the flooding connections wrote so far (events, or bursts of 1,000 pings).
    pub fn flood_sent(&self) -> usize {
        self.with(|s| s.flood_sent)
    }

    /// Floods that ended: their connection's writes failed (imgate closed it, or read nothing
    /// for two minutes), or every burst of pings was written.
    pub fn floods_ended(&self) -> usize {
        self.with(|s| s.floods_ended)
    }

    /// Waits until `n` floods ended, for as long as their frames keep going out: false only once
    /// neither a frame was written nor a flood ended for `quiet`.
    pub fn wait_floods_ended(&self, n: usize, quiet: Duration) -> bool {
        self.wait_moving(quiet, |s| (s.flood_sent, s.floods_ended), |s| s.floods_ended >= n)
    }

    /// Waits for a ping naming `service`.
    pub fn wait_ping(&self, service: i32, timeout: Duration) -> bool {
        self.wait(timeout, |s| s.pings.contains(&service))
    }

    /// Calls made to `path` (a prefix of the path and query): their JSON bodies.
    pub fn calls(&self, path: &str) -> Vec<Value> {
        self.with(|s| {
            s.calls
                .iter()
                .filter(|(_, p, _)| p.starts_with(path))
                .map(|(_, _, b)| b.clone())
                .collect()
        })
    }

    pub fn uploads(&self) -> Vec<(String, Vec<u8>)> {
        self.with(|s| s.uploads.clone())
    }

    /// An `im.message.receive_v1` event payload.
    pub fn message_event(app: &str, chat: &str, message_id: &str, msg_type: &str, content: Value) -> Vec<u8> {
        json!({
            "schema": "2.0",
            "header": {
                "event_id": format!("ev_{message_id}"),
                "event_type": "im.message.receive_v1",
                "create_time": now_ms().to_string(),
                "token": "",
                "app_id": app,
                "tenant_key": "tenant_1",
            },
            "event": {
                "sender": {"sender_id": {"open_id": "ou_ada0001", "union_id": "on_1", "user_id": "u1"}, "sender_type": "user", "tenant_key": "tenant_1"},
                "message": {
                    "message_id": message_id,
                    "create_time": now_ms().to_string(),
                    "chat_id": chat,
                    "chat_type": "group",
                    "message_type": msg_type,
                    "content": content.to_string(),
                    "mentions": [],
                },
            },
        })
        .to_string()
        .into_bytes()
    }

    /// Sends an event to the app over its connection, in `parts` frames; the frame
    /// `message_id` it goes under. It is sent again on every new connection until answered 200.
    pub fn push_event(&self, app: &str, payload: &[u8], parts: usize) -> String {
        let id = self.with(|s| {
            s.next_id += 1;
            format!("frame_{}", s.next_id)
        });
        self.with(|s| {
            s.unanswered.push((app.into(), id.clone(), payload.to_vec(), parts));
            if let Some((_, tx)) = s.conns.get(app) {
                for f in event_frames(&id, payload, parts) {
                    let _ = tx.send(f.encode());
                }
            }
        });
        id
    }

    /// The answer to the event sent under `frame_id`: (code, biz_rt).
    pub fn answer(&self, frame_id: &str, timeout: Duration) -> Option<(u64, Option<String>)> {
        self.wait(timeout, |s| s.answers.iter().any(|(id, _, _)| id == frame_id));
        self.with(|s| {
            s.answers
                .iter()
                .find(|(id, _, _)| id == frame_id)
                .map(|(_, c, rt)| (*c, rt.clone()))
        })
    }

    /// How many events were answered with `code`.
    pub fn answered(&self, code: u64) -> usize {
        self.with(|s| s.answers.iter().filter(|a| a.1 == code).count())
    }

    /// Waits until `n` events were answered with 200, for as long as answers keep coming: false
    /// only once no new one came for `quiet` (no total deadline over many events).
    pub fn wait_answered(&self, n: usize, quiet: Duration) -> bool {
        let ok = |s: &State| s.answers.iter().filter(|a| a.1 == 200).count();
        self.wait_moving(quiet, ok, |s| ok(s) >= n)
    }
}

/// An event as data frames: one, or `parts` with `sum`/`seq` under one message_id.
fn event_frames(id: &str, payload: &[u8], parts: usize) -> Vec<PbFrame> {
    let parts = parts.max(1);
    let size = payload.len().div_ceil(parts).max(1);
    payload
        .chunks(size)
        .enumerate()
        .map(|(seq, chunk)| PbFrame {
            seq_id: 1,
            log_id: 7,
            service: SERVICE_ID,
            method: 1,
            headers: vec![
                ("type".into(), "event".into()),
                ("message_id".into(), id.into()),
                ("sum".into(), parts.to_string()),
                ("seq".into(), seq.to_string()),
                ("trace_id".into(), format!("trace-{id}")),
            ],
            payload: chunk.to_vec(),
            ..PbFrame::default()
        })
        .collect()
}

fn client_config(ping: u64) -> Value {
    json!({"ReconnectCount": -1, "ReconnectInterval": 5, "ReconnectNonce": 0, "PingInterval": ping})
}

fn serve(state: &Arc<(Mutex<State>, Condvar)>, mut req: tiny_http::Request, ws_port: u16) {
    let mut raw = Vec::new();
    let _ = std::io::Read::read_to_end(req.as_reader(), &mut raw);
    let url = req.url().to_string();
    let method = req.method().to_string();
    let path = url.split('?').next().unwrap_or_default().to_string();
    let body: Value = serde_json::from_slice(&raw).unwrap_or(Value::Null);
    let auth = req
        .headers()
        .iter()
        .find(|h| h.field.equiv("Authorization"))
        .map(|h| h.value.to_string());
    let ctype = req
        .headers()
        .iter()
        .find(|h| h.field.equiv("Content-Type"))
        .map(|h| h.value.to_string())
        .unwrap_or_default();
    let (lock, cv) = &**state;
    let mut s = lock.lock().unwrap();
    if let Some(i) = s.stalls.iter().position(|(p, _)| url.contains(p.as_str())) {
        let (_, d) = s.stalls.remove(i);
        drop(s);
        std::thread::sleep(d);
        s = lock.lock().unwrap();
    }
    s.calls.push((method.clone(), url.clone(), body.clone()));
    if ctype.starts_with("multipart/form-data") {
        s.uploads.push((path.clone(), raw.clone()));
    }
    cv.notify_all();
    if let Some(i) = s.failures.iter().position(|(p, _, _)| url.contains(p.as_str())) {
        let (_, status, code) = s.failures.remove(i);
        drop(s);
        return reply(req, status, json!({"code": code, "msg": "simulated failure"}));
    }
    if path == "/open-apis/auth/v3/tenant_access_token/internal" {
        let (app, secret) = (
            body["app_id"].as_str().unwrap_or(""),
            body["app_secret"].as_str().unwrap_or(""),
        );
        if s.apps.get(app).map(String::as_str) != Some(secret) || secret.is_empty() {
            drop(s);
            return reply(req, 400, json!({"code": 10014, "msg": "app secret invalid"}));
        }
        s.tokens_issued += 1;
        let token = format!("t-sim{}-{}", s.tokens_issued, app);
        s.tokens.insert(token.clone(), (app.to_string(), true));
        drop(s);
        return reply(
            req,
            200,
            json!({"code": 0, "msg": "ok", "tenant_access_token": token, "expire": 7200}),
        );
    }
    if path == "/callback/ws/endpoint" {
        s.endpoint_calls += 1;
        let (app, secret) = (
            body["AppID"].as_str().unwrap_or(""),
            body["AppSecret"].as_str().unwrap_or(""),
        );
        if s.apps.get(app).map(String::as_str) != Some(secret) {
            drop(s);
            return reply(req, 200, json!({"code": 514, "msg": "auth failed"}));
        }
        if !s.long_conn.iter().any(|a| a == app) {
            drop(s);
            return reply(
                req,
                200,
                json!({"code": 403, "msg": "the app does not receive events through the long connection"}),
            );
        }
        let key = format!("ak{}", s.endpoint_calls);
        s.access_keys.insert(key.clone(), app.to_string());
        let url = format!(
            "ws://127.0.0.1:{ws_port}/ws/v2?fpid=493&aid=552564&device_id=dev{}&access_key={key}&service_id={SERVICE_ID}&ticket=tk",
            s.endpoint_calls
        );
        let config = client_config(s.ping_interval);
        drop(s);
        return reply(
            req,
            200,
            json!({"code": 0, "msg": "ok", "data": {"URL": url, "ClientConfig": config}}),
        );
    }
    // Everything under /open-apis/im needs a valid token.
    let app = match auth.as_deref().and_then(|a| a.strip_prefix("Bearer ")) {
        None => {
            drop(s);
            return reply(
                req,
                400,
                json!({"code": 99991661, "msg": "Missing access token for authorization."}),
            );
        }
        Some(t) => match s.tokens.get(t) {
            Some((app, true)) => app.clone(),
            _ => {
                drop(s);
                return reply(
                    req,
                    400,
                    json!({"code": 99991663, "msg": "Invalid access token for authorization."}),
                );
            }
        },
    };
    s.next_id += 1;
    let n = s.next_id;
    let parts: Vec<&str> = path.trim_start_matches("/open-apis/im/v1/").split('/').collect();
    let answer = match (method.as_str(), parts.as_slice()) {
        ("GET", ["chats", chat]) => match s.chats.get(*chat) {
            None => (
                400,
                json!({"code": 232006, "msg": "Your request specifies a chat_id which is invalid."}),
            ),
            Some((_, _, members)) if !members.contains(&app) => (
                400,
                json!({"code": 232011, "msg": "Operator can NOT be out of the chat."}),
            ),
            Some((name, mode, _)) => (
                200,
                json!({"code": 0, "msg": "success", "data": {"name": name, "chat_mode": mode, "chat_type": "private"}}),
            ),
        },
        ("POST", ["messages"]) | ("POST", ["messages", _, "reply"]) => {
            let chat = body["receive_id"].as_str().unwrap_or("");
            if parts.len() == 1 && !s.chats.get(chat).is_some_and(|c| c.2.contains(&app)) {
                (
                    400,
                    json!({"code": 230002, "msg": "The bot can not be outside the group."}),
                )
            } else {
                (
                    200,
                    json!({"code": 0, "msg": "success", "data": {"message_id": format!("om_sent{n}")}}),
                )
            }
        }
        ("POST", ["images"]) => (
            200,
            json!({"code": 0, "msg": "success", "data": {"image_key": format!("img_v3_{n}")}}),
        ),
        ("POST", ["files"]) => (
            200,
            json!({"code": 0, "msg": "success", "data": {"file_key": format!("file_v3_{n}")}}),
        ),
        ("GET", ["messages", mid, "resources", key]) => match s.resources.get(&(mid.to_string(), key.to_string())) {
            Some((bytes, ctype)) => {
                let (bytes, ctype) = (bytes.clone(), ctype.clone());
                drop(s);
                let resp = tiny_http::Response::from_data(bytes)
                    .with_header(format!("Content-Type: {ctype}").parse::<tiny_http::Header>().unwrap());
                let _ = req.respond(resp);
                return;
            }
            None => (400, json!({"code": 234003, "msg": "File not in msg."})),
        },
        _ => (404, json!({"code": 404, "msg": "not found"})),
    };
    drop(s);
    reply(req, answer.0, answer.1);
}

/// One WebSocket client: the URL must carry an access key the endpoint handed out.
#[allow(clippy::result_large_err)] // tungstenite's handshake callback returns its response type
fn long_connection(state: &Arc<(Mutex<State>, Condvar)>, stream: TcpStream) {
    let app = Arc::new(Mutex::new(None::<String>));
    let seen = app.clone();
    let st = state.clone();
    let callback = move |req: &tungstenite::handshake::server::Request, resp| {
        let query = req.uri().query().unwrap_or_default().to_string();
        let key = query
            .split('&')
            .find_map(|kv| kv.strip_prefix("access_key="))
            .unwrap_or_default()
            .to_string();
        match st.0.lock().unwrap().access_keys.get(&key) {
            Some(a) => {
                *seen.lock().unwrap() = Some(a.clone());
                Ok(resp)
            }
            None => {
                let mut refused = tungstenite::handshake::server::ErrorResponse::new(None);
                *refused.status_mut() = tungstenite::http::StatusCode::FORBIDDEN;
                refused.headers_mut().insert("Handshake-Status", "403".parse().unwrap());
                Err(refused)
            }
        }
    };
    let Ok(mut ws) = tungstenite::accept_hdr(stream, callback) else {
        return;
    };
    let Some(app) = app.lock().unwrap().clone() else { return };
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    // The serial and the flood are decided under one lock: a test that sees connection `n` and
    // then asks for a flood gets it on the next connection, never on `n`.
    let (serial, flood) = {
        let mut s = state.0.lock().unwrap();
        s.next_conn += 1;
        let serial = s.next_conn;
        // Feishu delivers what is still unanswered when the app connects again (under the
        // same lock, so a `push_event` racing the connection sends nothing twice).
        for (a, id, payload, parts) in &s.unanswered {
            if *a == app {
                for f in event_frames(id, payload, *parts) {
                    let _ = tx.send(f.encode());
                }
            }
        }
        s.conns.insert(app.clone(), (serial, tx));
        state.1.notify_all();
        (serial, s.floods.remove(&app))
    };
    if let Some(flood) = flood {
        match flood {
            Flood::Events {
                chat,
                headers,
                header_len,
                echoed_len,
            } => flood_events(state, &mut ws, &app, &chat, (headers, header_len), echoed_len),
            Flood::Pings => flood_pings(state, &mut ws),
        }
        let mut s = state.0.lock().unwrap();
        s.floods_ended += 1;
        if s.conns.get(&app).is_some_and(|(n, _)| *n == serial) {
            s.conns.remove(&app);
        }
        state.1.notify_all();
        return;
    }
    // Short, so that what the test pushes goes out at once (one thread reads and writes).
    let _ = ws.get_mut().set_read_timeout(Some(Duration::from_millis(2)));
    loop {
        let current = state.0.lock().unwrap().conns.get(&app).map(|(n, _)| *n);
        if current != Some(serial) {
            let _ = ws.close(None);
            let _ = ws.flush();
            return;
        }
        while let Ok(out) = rx.try_recv() {
            if ws.send(Message::Binary(out.into())).is_err() {
                return;
            }
        }
        match ws.read() {
            Ok(Message::Binary(b)) => {
                let Some(f) = PbFrame::decode(&b) else { continue };
                let mut s = state.0.lock().unwrap();
                match (f.method, f.header("type")) {
                    (0, Some("ping")) => {
                        s.pings.push(f.service);
                        let pong = PbFrame {
                            service: f.service,
                            method: 0,
                            headers: vec![("type".into(), "pong".into())],
                            payload: client_config(s.ping_interval).to_string().into_bytes(),
                            ..PbFrame::default()
                        };
                        drop(s);
                        if ws.send(Message::Binary(pong.encode().into())).is_err() {
                            return;
                        }
                        continue;
                    }
                    (1, _) => {
                        let id = f.header("message_id").unwrap_or_default().to_string();
                        let answer: Value = serde_json::from_slice(&f.payload).unwrap_or(Value::Null);
                        let code = answer["code"].as_u64().unwrap_or(0);
                        s.answers
                            .push((id.clone(), code, f.header("biz_rt").map(str::to_string)));
                        if code == 200 {
                            s.unanswered.retain(|(_, i, _, _)| *i != id);
                        }
                        state.1.notify_all();
                    }
                    _ => {}
                }
            }
            Ok(Message::Close(_)) => return,
            Ok(_) => {}
            Err(tungstenite::Error::Io(e)) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => {
                let mut s = state.0.lock().unwrap();
                if s.conns.get(&app).is_some_and(|(n, _)| *n == serial) {
                    s.conns.remove(&app);
                }
                return;
            }
        }
    }
}

/// Events of `chat` as fast as the socket takes them, each with `count` extra headers of
/// `len` bytes and its echoed fields `echoed_len` bytes long (`Flood::Events`); nothing is
/// read, so neither imgate's answers nor its pings are.
fn flood_events(
    state: &Arc<(Mutex<State>, Condvar)>,
    ws: &mut tungstenite::WebSocket<TcpStream>,
    app: &str,
    chat: &str,
    (count, len): (usize, usize),
    echoed_len: usize,
) {
    // Generous: imgate reading slowly on a busy machine is not the stall this looks for.
    let _ = ws.get_mut().set_write_timeout(Some(Duration::from_secs(120)));
    let pad = "h".repeat(len);
    let extra: Vec<(String, String)> = (0..count).map(|i| (format!("x-pad-{i}"), pad.clone())).collect();
    let long = |what: String| format!("{what:-<echoed_len$}");
    for i in 0.. {
        let id = long(format!("flood_{i}"));
        let payload = FeishuSim::message_event(app, chat, &format!("om_flood{i}"), "text", json!({"text": "flood"}));
        let mut frame = event_frames(&id, &payload, 1).remove(0);
        for (k, v) in frame.headers.iter_mut() {
            if k == "trace_id" {
                *v = long(format!("trace-{i}"));
            }
        }
        frame.payload_encoding = long("identity".into());
        frame.payload_type = long("json".into());
        frame.log_id_new = long(format!("log-{i}"));
        frame.headers.extend(extra.iter().cloned());
        if ws.send(Message::Binary(frame.encode().into())).is_err() {
            return;
        }
        state.0.lock().unwrap().flood_sent += 1;
        state.1.notify_all();
    }
}

/// The bytes of one burst of `Flood::Pings`: 1,000 pings of 125 bytes with their headers.
const PING_BURST: usize = 127 * 1000;

/// Bursts in a ping flood: at least 200 (their pongs, were they all queued, would be 26 MB),
/// and 100 more than this machine's largest TCP buffers of both ends hold, so that a flood
/// written whole was read by imgate, not only taken by the kernel (loopback buffers grow to
/// `tcp_rmem`'s maximum, 32 MiB on some machines).
pub fn ping_bursts() -> usize {
    let most = |file: &str| -> usize {
        let text = std::fs::read_to_string(format!("/proc/sys/net/ipv4/{file}")).unwrap_or_default();
        text.split_whitespace()
            .last()
            .and_then(|n| n.parse().ok())
            .unwrap_or(8 << 20)
    };
    ((most("tcp_rmem") + most("tcp_wmem")) / PING_BURST + 100).max(200)
}

/// `ping_bursts()` bursts of 1,000 WebSocket pings of 125 bytes (server frames: unmasked),
/// written straight to the socket.
fn flood_pings(state: &Arc<(Mutex<State>, Condvar)>, ws: &mut tungstenite::WebSocket<TcpStream>) {
    let mut ping = vec![0x89u8, 125];
    ping.extend_from_slice(&[b'p'; 125]);
    let burst: Vec<u8> = ping.iter().copied().cycle().take(PING_BURST).collect();
    let socket = ws.get_mut();
    // Generous: a busy machine reads slowly, but a reader that stopped never takes this long.
    let _ = socket.set_write_timeout(Some(Duration::from_secs(30)));
    for _ in 0..ping_bursts() {
        if std::io::Write::write_all(socket, &burst).is_err() {
            return;
        }
        state.0.lock().unwrap().flood_sent += 1;
        state.1.notify_all();
    }
}
