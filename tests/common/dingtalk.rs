//! A DingTalk simulator written from public material, not from imgate's code: Stream mode as the
//! open-dingtalk developerpedia describes it (`docs/learn/stream/protocol.md`, `faq.md`) and as
//! the official SDKs speak it (`dingtalk-stream-sdk-python`: `stream.py`, `frames.py`,
//! `handlers.py`, `chatbot.py`; `dingtalk-stream-sdk-go`: `client/client.go`,
//! `payload/data_frame.go`, `chatbot/model.go`), and the robot OpenAPI as the generated
//! `alibabacloud-go/dingtalk` clients and DingTalk's API pages name it (`oauth2/accessToken`,
//! `robot/groupMessages/send`, `robot/oToMessages/batchSend`, `robot/messageFiles/download`,
//! the legacy oapi `media/upload` and a message's `sessionWebhook`).
//!
//! Shape: one tiny_http server is `api.dingtalk.com` (`api_base`), another is
//! `oapi.dingtalk.com` (`oapi_base`: media uploads and session webhooks); a std listener + sync
//! tungstenite is `wss-open-connection.dingtalk.com` (`ws://127.0.0.1:PORT/connect`), one thread
//! per socket. Everything lives in one `State` behind a mutex with a condvar, so tests wait on
//! conditions. A ticker thread closes sockets when a disconnect's grace has passed.
//! Choices where the sources are silent are marked "Chosen:".
//!
//! Facts from the sources this follows:
//! - connections/open: `{clientId, clientSecret, subscriptions:[{type, topic}], ua, localIp}` →
//!   `{endpoint, ticket}`; "ticket的有效期为90秒且只能用来建立一条连接"; the socket is
//!   `GET {endpoint}?ticket=…`. Wrong credentials: HTTP 401
//!   `{"requestid":…,"code":"authFailed","message":"鉴权失败"}` (as the Python SDK logs it).
//! - Frames: `{specVersion, type: SYSTEM|EVENT|CALLBACK, headers:{topic, messageId, contentType,
//!   time, appId?}, data: "<JSON text>"}`; header values are all strings (the Go SDK decodes
//!   headers as `map[string]string`; the examples show `"time":"1690362102194"`).
//! - Answers: `{code, headers:{contentType, messageId}, message, data}`. A ping's answer carries
//!   the ping's data (`{"opaque":…}`); a robot message's answer may carry `{"response": null}`
//!   (developerpedia) or the message's own data (the Python SDK echoes it).
//! - `disconnect`: "客户端不需要对此推送信息做任何响应，服务端在静默10s之后会主动断开 tcp 连接".
//! - Robot messages are "fire-forgot": never pushed again. Several sockets of one app: "通过随机
//!   策略选取一个Stream通道推送".
//! - accessToken: `{appKey, appSecret}` → `{accessToken, expireIn}`; wrong pair: 400
//!   `invalidClientIdOrSecret` "无效的clientId或者clientSecret". A bad token on the v1.0 API:
//!   400 `{"code":"InvalidAuthentication","requestid":…,"message":"不合法的access_token"}`; on oapi:
//!   200 `{"errcode":40014,"errmsg":"不合法的access_token"}`. QPS limits: v1.0 answers
//!   `Forbidden.AccessDenied.QpsLimitForAppkeyAndApi` (403), the old oapi errcode 90018.
//! - Robot send errors: 400 `invalid.openConversationId`, `invalidParameter.robotCode.notExsit`,
//!   `invalidParameter.msgKey.invalid`, `invalidParameter.msgParam.invalid`,
//!   `invalidParameter.userIds.empty` (DingTalk's API pages). batchSend answers 200 with
//!   `invalidStaffIdList` (unknown users) and `flowControlledStaffIdList` ("被限流的userid列表":
//!   users the message was held back from) beside `processQueryKey`.
//! - A session webhook takes `at: {atUserIds}`; the Python SDK's reply_text and reply_markdown
//!   always name the sender (`incoming_message.sender_staff_id`).
//! - media/upload: multipart field `type` and file part `media` → `{"errcode":0,"errmsg":"ok",
//!   "media_id":"@lA…","type":…,"created_at":…}`; a bad type: 40004 "不合法的媒体文件类型".

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::kit::{self, base64, hex, multipart, now_ms, socket_loop, url_decode, Heard, Out};
use tungstenite::Message;

/// The topic of robot messages (developerpedia protocol.md, the SDKs' `ChatbotMessage.TOPIC`).
pub const BOT_TOPIC: &str = "/v1.0/im/bot/messages/get";
/// The corp every app, user and conversation of the simulator belongs to.
pub const CORP_ID: &str = "dingsimcorp0000000000000000000001";
/// msgKeys groupMessages/send and oToMessages/batchSend accept ("Message types sent by
/// enterprise bots"); others answer `invalidParameter.msgKey.invalid`.
pub const MSG_KEYS: &[&str] = &[
    "sampleText",
    "sampleMarkdown",
    "sampleImageMsg",
    "sampleLink",
    "sampleActionCard",
    "sampleActionCard2",
    "sampleActionCard3",
    "sampleActionCard4",
    "sampleActionCard5",
    "sampleActionCard6",
    "sampleAudio",
    "sampleFile",
    "sampleVideo",
];

struct App {
    client_id: String,
    client_secret: String,
    /// The unified app id sent as the frames' `appId` header.
    app_uuid: String,
    chatbot_user_id: String,
    stream: bool,
}

struct Ticket {
    client_id: String,
    issued: Instant,
    used: bool,
    subscriptions: Vec<Value>,
}

struct Sock {
    app: String,
    tx: mpsc::Sender<Out>,
    /// The TCP connection is up.
    open: bool,
    /// A `disconnect` was sent: nothing more is pushed on it ("静默"), it closes at `close_at`.
    closing: bool,
    close_at: Option<Instant>,
    close_sent: bool,
    silent: bool,
    subscriptions: Vec<Value>,
    /// WebSocket-level pings from the client.
    ws_pings: usize,
}

struct Conv {
    group: bool,
    title: String,
    /// The user of a one-to-one conversation.
    staff: String,
}

/// A robot message as DingTalk pushed it (or would have, with no socket).
struct Sent {
    msg_id: String,
    /// The frame's `headers.messageId`.
    frame_id: String,
    data: Value,
    delivered: bool,
}

struct Session {
    cid: String,
    msg_id: String,
    expires_ms: u64,
}

struct Fault {
    path: String,
    status: u16,
    body: Value,
}

#[derive(Default)]
struct State {
    api: String,
    oapi: String,
    ws_port: u16,
    apps: Vec<App>,
    users: HashMap<String, String>,
    convs: HashMap<String, Conv>,
    tickets: HashMap<String, Ticket>,
    ticket_ttl: Duration,
    tickets_issued: HashMap<String, usize>,
    reused_tickets: usize,
    refused: Vec<Value>,
    sockets: Vec<Sock>,
    connections: HashMap<String, u64>,
    disconnect_grace: Duration,
    /// token → (client_id, valid until).
    tokens: HashMap<String, (String, Instant)>,
    token_ttl: u64,
    grants: HashMap<String, usize>,
    sent: Vec<Sent>,
    answered: Vec<String>,
    client_frames: Vec<Value>,
    /// ping messageId → its data text.
    pings: HashMap<String, String>,
    /// ping messageIds answered with code 200 and the same data.
    pongs: Vec<String>,
    sessions: HashMap<String, Session>,
    session_ttl: Duration,
    webhook_posts: Vec<Value>,
    group_sends: Vec<Value>,
    oto_sends: Vec<Value>,
    /// downloadCode → (bytes, filename).
    media: HashMap<String, (Vec<u8>, String)>,
    /// download URL id → (downloadCode, still valid).
    download_urls: HashMap<String, (String, bool)>,
    downloads: Vec<Value>,
    uploads: Vec<Value>,
    uploaded: HashMap<String, Vec<u8>>,
    calls: Vec<Value>,
    faults: Vec<Fault>,
    /// staffId → batchSend calls still to hold back for that user (`flowControlledStaffIdList`).
    flow_controlled: HashMap<String, usize>,
    next_id: u64,
}

type Shared = Arc<(Mutex<State>, Condvar)>;

pub struct DingTalkSim {
    /// `https://api.dingtalk.com` here: `{api_base}/v1.0/…`.
    pub api_base: String,
    /// `https://oapi.dingtalk.com` here: `{oapi_base}/media/upload`, session webhooks.
    pub oapi_base: String,
    /// The `endpoint` connections/open hands out: `ws://127.0.0.1:PORT/connect`.
    pub endpoint: String,
    state: Shared,
    stopped: Arc<AtomicBool>,
}

#[derive(Clone, Copy, PartialEq)]
enum Host {
    Api,
    Oapi,
}

impl DingTalkSim {
    pub fn start() -> DingTalkSim {
        let api = Arc::new(tiny_http::Server::http("127.0.0.1:0").unwrap());
        let oapi = Arc::new(tiny_http::Server::http("127.0.0.1:0").unwrap());
        let api_port = api.server_addr().to_ip().unwrap().port();
        let oapi_port = oapi.server_addr().to_ip().unwrap().port();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let ws_port = listener.local_addr().unwrap().port();
        let state: Shared = Arc::default();
        {
            let mut s = state.0.lock().unwrap();
            s.api = format!("http://127.0.0.1:{api_port}");
            s.oapi = format!("http://127.0.0.1:{oapi_port}");
            s.ws_port = ws_port;
            s.ticket_ttl = Duration::from_secs(90);
            s.disconnect_grace = Duration::from_secs(10);
            s.token_ttl = 7200;
            // "sessionWebhook … 约 1.5 小时有效"; the example: expiredTime − createAt = 5 400 258 ms.
            s.session_ttl = Duration::from_secs(90 * 60);
        }
        let stopped = Arc::new(AtomicBool::new(false));
        for (server, host, workers) in [(api, Host::Api, 3), (oapi, Host::Oapi, 2)] {
            let st = state.clone();
            kit::serve_http(&server, workers, &stopped, move |req| serve(&st, host, req));
        }
        let st = state.clone();
        kit::accept_each(listener, &stopped, move |stream, stop| link(&st, stream, stop));
        let st = state.clone();
        kit::tick_until(&stopped, move || tick(&st));
        DingTalkSim {
            api_base: format!("http://127.0.0.1:{api_port}"),
            oapi_base: format!("http://127.0.0.1:{oapi_port}"),
            endpoint: format!("ws://127.0.0.1:{ws_port}/connect"),
            state,
            stopped,
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        super::kit::change(&self.state, f)
    }

    /// Waits until `ready` holds; false after `timeout`.
    fn wait(&self, timeout: Duration, ready: impl Fn(&State) -> bool) -> bool {
        super::kit::wait_for(&self.state, timeout, ready)
    }

    // ---------- apps, users, conversations ----------

    /// An internal app with a Stream-mode robot; its robotCode is its clientId.
    pub fn add_app(&self, client_id: &str, client_secret: &str) {
        self.with(|s| {
            let app_uuid = uuid(s);
            let chatbot_user_id = format!("$:LWCP_v1:${}", base64(&hash_bytes(client_id, 18)));
            s.apps.push(App {
                client_id: client_id.into(),
                client_secret: client_secret.into(),
                app_uuid,
                chatbot_user_id,
                stream: true,
            });
        });
    }

    /// Off: connections/open answers 403 and tickets not yet used are refused at the handshake.
    /// Open sockets stay up (Chosen: the sources say nothing of what a running socket sees).
    pub fn set_stream_enabled(&self, client_id: &str, on: bool) {
        self.with(|s| {
            if let Some(a) = s.apps.iter_mut().find(|a| a.client_id == client_id) {
                a.stream = on;
            }
        });
    }

    /// The `chatbotUserId` of the app's robot (the `dingtalkId` in a group's `atUsers`).
    pub fn chatbot_user_id(&self, client_id: &str) -> String {
        self.with(|s| app(s, client_id).chatbot_user_id.clone())
    }

    pub fn add_user(&self, staff_id: &str, nick: &str) {
        self.with(|s| s.users.insert(staff_id.into(), nick.into()));
    }

    pub fn add_group(&self, cid: &str, title: &str) {
        self.with(|s| {
            s.convs.insert(
                cid.into(),
                Conv {
                    group: true,
                    title: title.into(),
                    staff: String::new(),
                },
            )
        });
    }

    /// A one-to-one conversation between the robot and `staff_id`.
    pub fn add_p2p(&self, cid: &str, staff_id: &str) {
        self.with(|s| {
            s.convs.insert(
                cid.into(),
                Conv {
                    group: false,
                    title: String::new(),
                    staff: staff_id.into(),
                },
            )
        });
    }

    /// A file a message references: `POST /v1.0/robot/messageFiles/download` with this
    /// downloadCode hands out a URL serving `bytes`.
    pub fn add_media(&self, download_code: &str, bytes: &[u8], filename: &str) {
        self.with(|s| s.media.insert(download_code.into(), (bytes.to_vec(), filename.into())));
    }

    // ---------- what users do ----------

    /// `sender` writes `text` in `cid` (in a group: @-ing the robot). Returns the msgId.
    pub fn send_text(&self, client_id: &str, cid: &str, sender_staff_id: &str, text: &str) -> String {
        self.send_message(client_id, cid, sender_staff_id, "text", json!({"content": text}))
    }

    /// A robot message of any `msgtype`: `content` goes under `text` for "text", under `content`
    /// otherwise (`richText`: `{"richText":[{"text"}|{"type":"picture","downloadCode",
    /// "pictureDownloadCode"}]}`, `picture`: `{downloadCode, pictureDownloadCode}`, `file`:
    /// `{downloadCode, fileName}`, `audio`: `{recognition, duration, downloadCode}`, `video`:
    /// `{downloadCode, duration, videoType}`). Pushed on one of the app's sockets subscribed to
    /// the robot topic; with none the message is lost (fire-and-forget) and recorded as not
    /// delivered. Returns the msgId either way.
    pub fn send_message(
        &self,
        client_id: &str,
        cid: &str,
        sender_staff_id: &str,
        msgtype: &str,
        content: Value,
    ) -> String {
        let data = self.robot_message(client_id, cid, sender_staff_id, msgtype, content);
        self.push_message(client_id, data)
    }

    /// The `data` of a robot message as `send_message` makes it (a fresh msgId and session
    /// webhook), not pushed: change fields, then `push_message`.
    pub fn robot_message(
        &self,
        client_id: &str,
        cid: &str,
        sender_staff_id: &str,
        msgtype: &str,
        content: Value,
    ) -> Value {
        self.with(|s| {
            let conv = s.convs.get(cid).unwrap_or_else(|| panic!("unknown conversation {cid}"));
            let (group, title) = (conv.group, conv.title.clone());
            let a = app(s, client_id);
            let (robot, chatbot_user_id) = (a.client_id.clone(), a.chatbot_user_id.clone());
            let nick = s
                .users
                .get(sender_staff_id)
                .cloned()
                .unwrap_or_else(|| sender_staff_id.into());
            let msg_id = format!("msg{}", base64(&rand_bytes(s, 16)));
            let session = hex(&rand_bytes(s, 16));
            let now = now_ms();
            let expires = now + s.session_ttl.as_millis() as u64;
            s.sessions.insert(
                session.clone(),
                Session {
                    cid: cid.into(),
                    msg_id: msg_id.clone(),
                    expires_ms: expires,
                },
            );
            let mut d = json!({
                "conversationId": cid,
                "chatbotCorpId": CORP_ID,
                "chatbotUserId": chatbot_user_id,
                "msgId": msg_id,
                "senderNick": nick,
                "isAdmin": false,
                "senderStaffId": sender_staff_id,
                "sessionWebhookExpiredTime": expires,
                "createAt": now,
                "senderCorpId": CORP_ID,
                "conversationType": if group { "2" } else { "1" },
                "senderId": format!("$:LWCP_v1:${}", base64(&hash_bytes(sender_staff_id, 18))),
                "sessionWebhook": format!("{}/robot/sendBySession?session={session}", s.oapi),
                "robotCode": robot,
                "msgtype": msgtype,
            });
            // Chosen: a group message reaches the robot only when it is @-ed ("在群里需要 AT
            // 机器人的消息才能被接收"), so isInAtList is true and atUsers names the robot.
            if group {
                d["conversationTitle"] = json!(title);
                d["isInAtList"] = json!(true);
                d["atUsers"] = json!([{"dingtalkId": chatbot_user_id}]);
            } else {
                d["atUsers"] = json!([]);
            }
            if msgtype == "text" {
                d["text"] = content;
            } else {
                d["content"] = content;
            }
            d
        })
    }

    /// Pushes a robot message `data` (its `msgId` is the returned key) as a CALLBACK frame.
    pub fn push_message(&self, client_id: &str, data: Value) -> String {
        self.with(|s| {
            let msg_id = data["msgId"].as_str().unwrap_or_default().to_string();
            let frame_id = frame_id(s);
            let a = app(s, client_id);
            let frame = json!({
                "specVersion": "1.0",
                "type": "CALLBACK",
                "headers": {"appId": a.app_uuid, "contentType": "application/json", "messageId": frame_id,
                            "time": now_ms().to_string(), "topic": BOT_TOPIC},
                "data": data.to_string(),
            });
            // Chosen: the newest eligible socket (DingTalk picks one at random).
            let k = s.sockets.iter().rposition(|k| {
                k.app == client_id
                    && k.open
                    && !k.closing
                    && k.subscriptions
                        .iter()
                        .any(|t| t["type"] == "CALLBACK" && t["topic"] == BOT_TOPIC)
            });
            let mut delivered = false;
            if let Some(k) = k {
                // A silent socket is a dead link the server does not know about: the push is lost.
                delivered = !s.sockets[k].silent && s.sockets[k].tx.send(Out::Text(frame.to_string())).is_ok();
            }
            s.sent.push(Sent {
                msg_id: msg_id.clone(),
                frame_id,
                data,
                delivered,
            });
            msg_id
        })
    }

    /// The data of a message sent with `send_*`/`push_message`.
    pub fn message(&self, msg_id: &str) -> Option<Value> {
        self.with(|s| s.sent.iter().find(|m| m.msg_id == msg_id).map(|m| m.data.clone()))
    }

    /// Whether a socket was there to take the message.
    pub fn delivered(&self, msg_id: &str) -> bool {
        self.with(|s| s.sent.iter().any(|m| m.msg_id == msg_id && m.delivered))
    }

    /// msgIds whose CALLBACK frame the client answered with code 200, in order.
    pub fn answered(&self) -> Vec<String> {
        self.with(|s| s.answered.clone())
    }

    pub fn wait_answered(&self, msg_id: &str, timeout: Duration) -> bool {
        self.wait(timeout, |s| s.answered.iter().any(|m| m == msg_id))
    }

    /// Every text frame the client sent, parsed (a frame that is not JSON: a JSON string).
    pub fn client_frames(&self) -> Vec<Value> {
        self.with(|s| s.client_frames.clone())
    }

    // ---------- Stream control ----------

    /// A raw text frame on the app's newest socket that is not closing.
    pub fn send_raw(&self, client_id: &str, text: &str) {
        self.with(|s| {
            if let Some(k) = newest(s, client_id) {
                let _ = s.sockets[k].tx.send(Out::Text(text.into()));
            }
        });
    }

    /// A SYSTEM `ping` (data `{"opaque": uuid}`) on the app's newest socket; its messageId (also
    /// when no socket took it).
    pub fn ping(&self, client_id: &str) -> String {
        self.with(|s| {
            let id = frame_id(s);
            let data = json!({"opaque": uuid(s)}).to_string();
            let frame = json!({"specVersion": "1.0", "type": "SYSTEM",
                "headers": {"contentType": "application/json", "messageId": id, "time": now_ms().to_string(), "topic": "ping"},
                "data": data});
            if let Some(k) = newest(s, client_id) {
                let _ = s.sockets[k].tx.send(Out::Text(frame.to_string()));
            }
            s.pings.insert(id.clone(), data);
            id
        })
    }

    /// Waits for the answer to ping `message_id`: code 200, the same messageId, the same data
    /// (compared as JSON: the Python SDK re-serialises it).
    pub fn wait_pong(&self, message_id: &str, timeout: Duration) -> bool {
        self.wait(timeout, |s| s.pongs.iter().any(|p| p == message_id))
    }

    /// A SYSTEM `disconnect` (data `{"reason":"connection is expired"}`) on the app's newest
    /// socket; nothing more is pushed on it and it closes after the grace. False with no socket.
    pub fn disconnect(&self, client_id: &str) -> bool {
        self.with(|s| {
            let Some(k) = newest(s, client_id) else { return false };
            let id = frame_id(s);
            // Chosen: a messageId although the doc's example has none (the common-fields table
            // calls it required).
            let frame = json!({"specVersion": "1.0", "type": "SYSTEM",
                "headers": {"contentType": "application/json", "messageId": id, "time": now_ms().to_string(), "topic": "disconnect"},
                "data": json!({"reason": "connection is expired"}).to_string()});
            let _ = s.sockets[k].tx.send(Out::Text(frame.to_string()));
            s.sockets[k].closing = true;
            s.sockets[k].close_at = Some(Instant::now() + s.disconnect_grace);
            true
        })
    }

    /// How long after a `disconnect` the server closes the socket (DingTalk: 10 s).
    pub fn set_disconnect_grace(&self, grace: Duration) {
        self.with(|s| s.disconnect_grace = grace);
    }

    /// The app's newest open socket ends with no close frame.
    pub fn drop_connection(&self, client_id: &str) {
        self.with(|s| {
            if let Some(k) = s.sockets.iter().rposition(|k| k.app == client_id && k.open) {
                let _ = s.sockets[k].tx.send(Out::Drop);
                s.sockets[k].open = false;
            }
        });
    }

    /// The server closes the app's newest open socket: a close frame (1000), then the TCP
    /// connection ends (as after a `disconnect`'s grace, without the `disconnect`). False with
    /// no socket.
    pub fn close_connection(&self, client_id: &str) -> bool {
        self.with(|s| {
            let Some(k) = s
                .sockets
                .iter()
                .rposition(|k| k.app == client_id && k.open && !k.close_sent)
            else {
                return false;
            };
            let _ = s.sockets[k].tx.send(Out::Close(1000));
            s.sockets[k].close_sent = true;
            true
        })
    }

    /// Every open socket of the app stops reading (no pongs, no frames recorded) and writing:
    /// half-open links. Messages pushed to them are lost.
    pub fn go_silent(&self, client_id: &str) {
        self.with(|s| {
            for k in s.sockets.iter_mut().filter(|k| k.app == client_id && k.open) {
                let _ = k.tx.send(Out::Silent);
                k.silent = true;
            }
        });
    }

    /// Waits until `n` sockets of the app completed their handshake, counted since the start.
    pub fn wait_connected(&self, client_id: &str, n: u64, timeout: Duration) -> bool {
        self.wait(timeout, |s| s.connections.get(client_id).copied().unwrap_or(0) >= n)
    }

    /// Sockets opened so far (handshakes completed).
    pub fn connections(&self, client_id: &str) -> u64 {
        self.with(|s| s.connections.get(client_id).copied().unwrap_or(0))
    }

    /// Sockets whose TCP connection is up now, closing ones (after a `disconnect`) included.
    pub fn open_sockets(&self, client_id: &str) -> usize {
        self.with(|s| s.sockets.iter().filter(|k| k.app == client_id && k.open).count())
    }

    pub fn wait_open_sockets(&self, client_id: &str, n: usize, timeout: Duration) -> bool {
        self.wait(timeout, |s| {
            s.sockets.iter().filter(|k| k.app == client_id && k.open).count() == n
        })
    }

    /// WebSocket-level pings the client sent on the app's sockets.
    pub fn ws_pings(&self, client_id: &str) -> usize {
        self.with(|s| {
            s.sockets
                .iter()
                .filter(|k| k.app == client_id)
                .map(|k| k.ws_pings)
                .sum()
        })
    }

    pub fn tickets_issued(&self, client_id: &str) -> usize {
        self.with(|s| s.tickets_issued.get(client_id).copied().unwrap_or(0))
    }

    /// Handshakes that presented a ticket already used.
    pub fn reused_ticket_attempts(&self) -> usize {
        self.with(|s| s.reused_tickets)
    }

    /// Refused handshakes: `{path, ticket, reason, status}` (reason: unknown, reused, expired,
    /// stream_disabled, path).
    pub fn refused_handshakes(&self) -> Vec<Value> {
        self.with(|s| s.refused.clone())
    }

    /// Waits until `n` handshakes were refused, counted since the start.
    pub fn wait_refused_handshakes(&self, n: usize, timeout: Duration) -> bool {
        self.wait(timeout, |s| s.refused.len() >= n)
    }

    /// How long a ticket may wait for its handshake (DingTalk: 90 s).
    pub fn set_ticket_ttl(&self, ttl: Duration) {
        self.with(|s| s.ticket_ttl = ttl);
    }

    // ---------- OpenAPI control and records ----------

    /// `expireIn` of tokens granted from now on (default 7200); the token dies after that.
    pub fn set_token_ttl(&self, secs: u64) {
        self.with(|s| s.token_ttl = secs);
    }

    /// Every token granted so far stops working.
    pub fn expire_tokens(&self) {
        self.with(|s| s.tokens.clear());
    }

    /// Successful accessToken grants for the app.
    pub fn token_grants(&self, client_id: &str) -> usize {
        self.with(|s| s.grants.get(client_id).copied().unwrap_or(0))
    }

    /// Session webhooks of messages sent from now on live this long (default 90 min).
    pub fn set_session_webhook_ttl(&self, ttl: Duration) {
        self.with(|s| s.session_ttl = ttl);
    }

    /// Every session webhook handed out so far is expired.
    pub fn expire_session_webhooks(&self) {
        self.with(|s| s.sessions.values_mut().for_each(|w| w.expires_ms = 0));
    }

    /// POSTs to the session webhooks of `cid`: `{session, msgId, body, errcode}`.
    pub fn webhook_posts(&self, cid: &str) -> Vec<Value> {
        self.with(|s| s.webhook_posts.iter().filter(|p| p["cid"] == cid).cloned().collect())
    }

    /// Accepted groupMessages/send calls to `cid`: the request body plus `param` (msgParam
    /// parsed) and `processQueryKey`.
    pub fn group_sends(&self, cid: &str) -> Vec<Value> {
        self.with(|s| {
            s.group_sends
                .iter()
                .filter(|p| p["openConversationId"] == cid)
                .cloned()
                .collect()
        })
    }

    /// Accepted oToMessages/batchSend calls: the request body plus `param`, `processQueryKey`,
    /// `invalidStaffIdList` and `flowControlledStaffIdList` (users the message did not reach).
    pub fn oto_sends(&self) -> Vec<Value> {
        self.with(|s| s.oto_sends.clone())
    }

    /// Accepted media uploads: `{media_id, type, filename, size, content_type}`.
    pub fn uploads(&self) -> Vec<Value> {
        self.with(|s| s.uploads.clone())
    }

    pub fn uploaded_bytes(&self, media_id: &str) -> Vec<u8> {
        self.with(|s| s.uploaded.get(media_id).cloned().unwrap_or_default())
    }

    /// GETs of download URLs: `{downloadCode, status, size}`.
    pub fn downloads(&self) -> Vec<Value> {
        self.with(|s| s.downloads.clone())
    }

    /// Every download URL handed out so far answers 403.
    pub fn expire_download_urls(&self) {
        self.with(|s| s.download_urls.values_mut().for_each(|u| u.1 = false));
    }

    /// Calls of `path` (either host, no query): `{host, method, path, query, token, content_type,
    /// body, status, answer}`; `token` is the `x-acs-dingtalk-access-token` header (api) or the
    /// `access_token` query parameter (oapi), `body` the JSON body or null.
    pub fn calls(&self, path: &str) -> Vec<Value> {
        self.with(|s| s.calls.iter().filter(|c| c["path"] == path).cloned().collect())
    }

    /// The next `times` calls of `path` answer `status` with `body`, before any other check.
    pub fn fail_next(&self, path: &str, status: u16, body: Value, times: usize) {
        self.with(|s| {
            for _ in 0..times {
                s.faults.push(Fault {
                    path: path.into(),
                    status,
                    body: body.clone(),
                })
            }
        });
    }

    /// The next `times` batchSend calls naming `staff_id` hold the message back for that user:
    /// the call succeeds, nothing reaches the user, and the answer lists the user in
    /// `flowControlledStaffIdList` ("被限流的userid列表").
    pub fn flow_control_next(&self, staff_id: &str, times: usize) {
        self.with(|s| s.flow_controlled.insert(staff_id.into(), times));
    }

    /// The next `times` calls of `path` are throttled: a v1.0 path answers 403
    /// `Forbidden.AccessDenied.QpsLimitForAppkeyAndApi`, an oapi path 200 errcode 90018.
    pub fn throttle_next(&self, path: &str, times: usize) {
        let (status, body) = if path.starts_with("/v1.0/") {
            // Chosen: the message text (only the code is documented).
            (
                403,
                json!({"code": "Forbidden.AccessDenied.QpsLimitForAppkeyAndApi", "requestid": "SIM-QPS",
                       "message": "The request has exceeded the QPS limit of this app for this API."}),
            )
        } else {
            (200, json!({"errcode": 90018, "errmsg": "当前请求频率过高，请稍后重试"}))
        };
        self.fail_next(path, status, body, times);
    }
}

impl Drop for DingTalkSim {
    /// Every thread ends: sockets close, HTTP workers and the ticker see the flag, the accept
    /// loop is woken by one last connection.
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::Relaxed);
        let port = self.with(|s| {
            for k in s.sockets.iter().filter(|k| k.open) {
                let _ = k.tx.send(Out::Drop);
            }
            s.ws_port
        });
        let _ = TcpStream::connect(("127.0.0.1", port));
    }
}

// ---------- ids ----------

fn rand64(s: &mut State) -> u64 {
    s.next_id += 1;
    let mut h = RandomState::new().build_hasher();
    h.write_u64(s.next_id);
    h.finish()
}

fn rand_bytes(s: &mut State, n: usize) -> Vec<u8> {
    (0..n.div_ceil(8))
        .flat_map(|_| rand64(s).to_le_bytes())
        .take(n)
        .collect()
}

/// Stable bytes derived from `key` (the same user always has the same senderId).
fn hash_bytes(key: &str, n: usize) -> Vec<u8> {
    (0..n.div_ceil(8) as u64)
        .flat_map(|i| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            h.write(key.as_bytes());
            h.write_u64(i);
            h.finish().to_le_bytes()
        })
        .take(n)
        .collect()
}

fn uuid(s: &mut State) -> String {
    let b = rand_bytes(s, 16);
    let h = hex(&b);
    format!(
        "{}-{}-4{}-a{}-{}",
        &h[..8],
        &h[8..12],
        &h[13..16],
        &h[17..20],
        &h[20..32]
    )
}

/// A push's messageId, shaped like the docs' "213d841d_972_1898bb26334_70a7".
fn frame_id(s: &mut State) -> String {
    let r = rand64(s);
    format!(
        "{:08x}_{:x}_{:x}_{:x}",
        r as u32,
        (r >> 32) & 0xfff,
        now_ms(),
        s.next_id
    )
}

fn app<'a>(s: &'a State, client_id: &str) -> &'a App {
    s.apps
        .iter()
        .find(|a| a.client_id == client_id)
        .unwrap_or_else(|| panic!("unknown app {client_id}"))
}

/// The app's newest socket that is up and not closing.
fn newest(s: &State, client_id: &str) -> Option<usize> {
    s.sockets
        .iter()
        .rposition(|k| k.app == client_id && k.open && !k.closing)
}

/// Closes sockets whose disconnect grace has passed.
fn tick(state: &Shared) {
    let mut s = state.0.lock().unwrap();
    let now = Instant::now();
    let mut changed = false;
    for k in s.sockets.iter_mut() {
        if k.open && !k.close_sent && k.close_at.is_some_and(|t| t <= now) {
            // Chosen: a close frame (1000) before the TCP close ("主动断开 tcp 连接").
            let _ = k.tx.send(Out::Close(1000));
            k.close_sent = true;
            changed = true;
        }
    }
    drop(s);
    if changed {
        state.1.notify_all();
    }
}

// ---------- the WebSocket side ----------

/// One `/connect?ticket=…` connection: the ticket must come from connections/open, unused,
/// younger than the ticket TTL, and the app must still be in Stream mode; otherwise the
/// handshake is refused. Chosen: 401 with a JSON body (the sources say only that the server
/// "通过 ticket 校验客户端身份信息"); 404 for another path.
#[allow(clippy::result_large_err)] // tungstenite fixes the callback's error type
fn link(state: &Shared, stream: TcpStream, stopped: &AtomicBool) {
    let _ = stream.set_nodelay(true);
    let admitted = Arc::new(Mutex::new(None::<(String, Vec<Value>)>));
    let (seen, st) = (admitted.clone(), state.clone());
    let callback = move |req: &tungstenite::handshake::server::Request, resp| {
        let path = req.uri().path().to_string();
        let ticket = req
            .uri()
            .query()
            .unwrap_or_default()
            .split('&')
            .find_map(|kv| kv.strip_prefix("ticket="))
            .map(url_decode)
            .unwrap_or_default();
        let mut s = st.0.lock().unwrap();
        let ttl = s.ticket_ttl;
        let verdict = if path != "/connect" {
            Err((404, "path"))
        } else {
            let stream_on = |s: &State, c: &str| s.apps.iter().any(|a| a.client_id == c && a.stream);
            match s
                .tickets
                .get(&ticket)
                .map(|t| (t.used, t.issued.elapsed() > ttl, t.client_id.clone()))
            {
                None => Err((401, "unknown")),
                Some((true, _, _)) => Err((401, "reused")),
                Some((_, true, _)) => Err((401, "expired")),
                Some((_, _, c)) if !stream_on(&s, &c) => Err((401, "stream_disabled")),
                Some(_) => Ok(()),
            }
        };
        let out = match verdict {
            Ok(()) => {
                let t = s.tickets.get_mut(&ticket).unwrap();
                t.used = true;
                *seen.lock().unwrap() = Some((t.client_id.clone(), t.subscriptions.clone()));
                Ok(resp)
            }
            Err((status, reason)) => {
                if reason == "reused" {
                    s.reused_tickets += 1;
                }
                s.refused
                    .push(json!({"path": path, "ticket": ticket, "reason": reason, "status": status}));
                let body = json!({"code": if status == 404 { "NotFound" } else { "InvalidTicket" },
                                  "message": format!("ticket refused: {reason}")});
                let mut refused = tungstenite::handshake::server::ErrorResponse::new(Some(body.to_string()));
                *refused.status_mut() = tungstenite::http::StatusCode::from_u16(status).unwrap();
                Err(refused)
            }
        };
        drop(s);
        st.1.notify_all();
        out
    };
    let Ok(mut ws) = tungstenite::accept_hdr(stream, callback) else {
        return;
    };
    let Some((app, subscriptions)) = admitted.lock().unwrap().clone() else {
        return;
    };
    let (tx, rx) = mpsc::channel::<Out>();
    let k = {
        let mut s = state.0.lock().unwrap();
        *s.connections.entry(app.clone()).or_default() += 1;
        s.sockets.push(Sock {
            app,
            tx,
            open: true,
            closing: false,
            close_at: None,
            close_sent: false,
            silent: false,
            subscriptions,
            ws_pings: 0,
        });
        state.1.notify_all();
        s.sockets.len() - 1
    };
    let _ = ws.get_ref().set_read_timeout(Some(Duration::from_millis(10)));
    let _ = ws.get_ref().set_write_timeout(Some(Duration::from_secs(10)));
    socket_loop(&mut ws, &rx, stopped, |heard| {
        let mut s = state.0.lock().unwrap();
        match heard {
            Heard::Text(t) => on_client_text(&mut s, t),
            Heard::Pings(n) => s.sockets[k].ws_pings += n,
            Heard::Binary => {}
        }
        drop(s);
        state.1.notify_all();
    });
    state.0.lock().unwrap().sockets[k].open = false;
    state.1.notify_all();
}

/// Records the frame; an answer (`{code, headers:{messageId}, …}`) with code 200 marks its ping
/// ponged (when `data` is the ping's, compared as JSON) or its robot message answered.
fn on_client_text(s: &mut State, text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|_| json!(text));
    s.client_frames.push(v.clone());
    if v["code"].as_u64() != Some(200) {
        return;
    }
    let Some(id) = v.pointer("/headers/messageId").and_then(Value::as_str) else {
        return;
    };
    if let Some(data) = s.pings.get(id) {
        let same = match (v["data"].as_str(), serde_json::from_str::<Value>(data)) {
            (Some(d), Ok(want)) => serde_json::from_str::<Value>(d).is_ok_and(|got| got == want),
            _ => false,
        };
        if same && !s.pongs.iter().any(|p| p == id) {
            s.pongs.push(id.to_string());
        }
        return;
    }
    if let Some(m) = s.sent.iter().find(|m| m.frame_id == id) {
        let msg_id = m.msg_id.clone();
        if !s.answered.contains(&msg_id) {
            s.answered.push(msg_id);
        }
    }
}

// ---------- the HTTP side ----------

struct Answer {
    status: u16,
    body: Vec<u8>,
    ctype: &'static str,
}

fn answer(status: u16, v: Value) -> Answer {
    Answer {
        status,
        body: v.to_string().into_bytes(),
        ctype: "application/json;charset=utf-8",
    }
}

/// A v1.0 API error: `{"code","requestid","message"}`.
fn api_err(s: &mut State, status: u16, code: &str, message: &str) -> Answer {
    let requestid = uuid(s).to_uppercase();
    answer(
        status,
        json!({"code": code, "requestid": requestid, "message": message}),
    )
}

fn oapi_err(errcode: u64, errmsg: &str) -> Answer {
    answer(200, json!({"errcode": errcode, "errmsg": errmsg}))
}

struct Req {
    host: Host,
    method: String,
    path: String,
    query: String,
    token: String,
    ctype: String,
    body: Vec<u8>,
    json: Option<Value>,
}

impl Req {
    fn query_param(&self, key: &str) -> Option<String> {
        self.query
            .split('&')
            .find_map(|kv| kv.strip_prefix(&format!("{key}=")).map(url_decode))
    }

    fn str(&self, key: &str) -> String {
        self.json
            .as_ref()
            .and_then(|j| j[key].as_str())
            .unwrap_or_default()
            .to_string()
    }
}

fn serve(state: &Shared, host: Host, mut req: tiny_http::Request) {
    let mut body = Vec::new();
    let _ = req.as_reader().read_to_end(&mut body);
    let header = |name: &'static str| {
        req.headers()
            .iter()
            .find(|h| h.field.equiv(name))
            .map(|h| h.value.to_string())
            .unwrap_or_default()
    };
    let (token_header, ctype) = (header("x-acs-dingtalk-access-token"), header("Content-Type"));
    let url = req.url().to_string();
    let (path, query) = url.split_once('?').unwrap_or((&url, ""));
    let mut r = Req {
        host,
        method: req.method().as_str().to_string(),
        path: path.to_string(),
        query: query.to_string(),
        token: token_header,
        ctype,
        json: serde_json::from_slice(&body).ok(),
        body,
    };
    if host == Host::Oapi {
        r.token = r.query_param("access_token").unwrap_or_default();
    }
    let a = {
        let mut s = state.0.lock().unwrap();
        let a = match s.faults.iter().position(|f| f.path == r.path) {
            Some(i) => {
                let f = s.faults.remove(i);
                answer(f.status, f.body)
            }
            None => match host {
                Host::Api => api(&mut s, &r),
                Host::Oapi => oapi(&mut s, &r),
            },
        };
        let recorded_body = if r.ctype.starts_with("multipart/") {
            Value::Null
        } else {
            r.json.clone().unwrap_or(Value::Null)
        };
        let call = json!({
            "host": if host == Host::Api { "api" } else { "oapi" }, "method": r.method, "path": r.path,
            "query": r.query, "token": r.token, "content_type": r.ctype, "body": recorded_body,
            "status": a.status, "answer": serde_json::from_slice::<Value>(&a.body).unwrap_or(Value::Null),
        });
        s.calls.push(call);
        drop(s);
        state.1.notify_all();
        a
    };
    let resp = tiny_http::Response::from_data(a.body)
        .with_status_code(a.status)
        .with_header(tiny_http::Header::from_bytes(&b"Content-Type"[..], a.ctype.as_bytes()).unwrap());
    let _ = req.respond(resp);
}

fn api(s: &mut State, r: &Req) -> Answer {
    if let Some(id) = r.path.strip_prefix("/files/") {
        return file_get(s, id);
    }
    let known = [
        "/v1.0/gateway/connections/open",
        "/v1.0/oauth2/accessToken",
        "/v1.0/robot/groupMessages/send",
        "/v1.0/robot/oToMessages/batchSend",
        "/v1.0/robot/messageFiles/download",
    ];
    if r.method != "POST" || !known.contains(&r.path.as_str()) {
        // Chosen: what api.dingtalk.com is said to answer an unknown action.
        return api_err(
            s,
            404,
            "InvalidAction.NotFound",
            "Specified api is not found, please check your url and method.",
        );
    }
    if !r.json.as_ref().is_some_and(Value::is_object) {
        // A form-encoded body: "code: 400, body is mandatory for this action" (code Missingbody).
        return api_err(s, 400, "Missingbody", "body is mandatory for this action.");
    }
    match r.path.as_str() {
        "/v1.0/gateway/connections/open" => open_connection(s, r),
        "/v1.0/oauth2/accessToken" => access_token(s, r),
        _ => {
            // Every robot API wants a live token of an app.
            let client_id = match s.tokens.get(&r.token) {
                Some((c, until)) if *until > Instant::now() => c.clone(),
                _ => return api_err(s, 400, "InvalidAuthentication", "不合法的access_token"),
            };
            let robot = r.str("robotCode");
            if robot.is_empty() {
                return api_err(s, 400, "invalidParameter.robotCode.empty", "机器人 robotCode 为空");
            }
            if !s.apps.iter().any(|a| a.client_id == robot) {
                return api_err(s, 400, "invalidParameter.robotCode.notExsit", "机器人不存在");
            }
            if robot != client_id {
                return api_err(
                    s,
                    400,
                    "invalidParameter.robotCode.auth",
                    "该应用的appkey与机器人robotCode不匹配，请使用机器人所属应用的appkey",
                );
            }
            match r.path.as_str() {
                "/v1.0/robot/groupMessages/send" => group_send(s, r),
                "/v1.0/robot/oToMessages/batchSend" => oto_send(s, r),
                _ => file_download_url(s, r),
            }
        }
    }
}

fn open_connection(s: &mut State, r: &Req) -> Answer {
    let (id, secret) = (r.str("clientId"), r.str("clientSecret"));
    let Some(a) = s.apps.iter().find(|a| a.client_id == id && a.client_secret == secret) else {
        return api_err(s, 401, "authFailed", "鉴权失败");
    };
    let stream = a.stream;
    if !stream {
        // Chosen: the sources name no error for an app whose robot is not in Stream mode.
        return api_err(
            s,
            403,
            "Forbidden.AccessDenied",
            "stream mode is not enabled for this app",
        );
    }
    let subscriptions: Vec<Value> = r
        .json
        .as_ref()
        .and_then(|j| j["subscriptions"].as_array().cloned())
        .unwrap_or_default();
    let well_formed = |t: &Value| {
        ["EVENT", "CALLBACK", "SYSTEM"].contains(&t["type"].as_str().unwrap_or_default()) && t["topic"].is_string()
    };
    if subscriptions.is_empty() || !subscriptions.iter().all(well_formed) {
        // Chosen: subscriptions is required ("是否必填: 是"); its error is not documented.
        return api_err(s, 400, "invalidParameter.subscriptions", "subscriptions is invalid");
    }
    let ticket = uuid(s);
    s.tickets.insert(
        ticket.clone(),
        Ticket {
            client_id: id.clone(),
            issued: Instant::now(),
            used: false,
            subscriptions,
        },
    );
    *s.tickets_issued.entry(id).or_default() += 1;
    let endpoint = format!("ws://127.0.0.1:{}/connect", s.ws_port);
    answer(200, json!({"endpoint": endpoint, "ticket": ticket}))
}

/// Chosen: every grant is a new token and earlier ones stay valid until their own expiry (the
/// v1.0 page's wording differs from the legacy gettoken's "有效期内重复获取返回相同结果").
fn access_token(s: &mut State, r: &Req) -> Answer {
    let (key, secret) = (r.str("appKey"), r.str("appSecret"));
    if !s.apps.iter().any(|a| a.client_id == key && a.client_secret == secret) {
        return api_err(s, 400, "invalidClientIdOrSecret", "无效的clientId或者clientSecret");
    }
    let token = hex(&rand_bytes(s, 16));
    let ttl = s.token_ttl;
    s.tokens
        .insert(token.clone(), (key.clone(), Instant::now() + Duration::from_secs(ttl)));
    *s.grants.entry(key).or_default() += 1;
    answer(200, json!({"accessToken": token, "expireIn": ttl}))
}

/// msgKey and msgParam checked; msgParam parsed into `param`.
fn message_param(s: &mut State, r: &Req) -> Result<Value, Answer> {
    let key = r.str("msgKey");
    if key.is_empty() {
        return Err(api_err(s, 400, "invalidParameter.msgKey.empty", "缺少msgKey"));
    }
    if !MSG_KEYS.contains(&key.as_str()) {
        return Err(api_err(s, 400, "invalidParameter.msgKey.invalid", "msgKey无效"));
    }
    match serde_json::from_str::<Value>(&r.str("msgParam")) {
        Ok(p) if p.is_object() => Ok(p),
        _ => Err(api_err(
            s,
            400,
            "invalidParameter.msgParam.invalid",
            "msgParam必须是JSON格式",
        )),
    }
}

fn group_send(s: &mut State, r: &Req) -> Answer {
    let cid = r.str("openConversationId");
    // Chosen: a one-to-one conversation's id is no group for this API.
    if !s.convs.get(&cid).is_some_and(|c| c.group) {
        return api_err(s, 400, "invalid.openConversationId", "无效的openConversationId");
    }
    let param = match message_param(s, r) {
        Ok(p) => p,
        Err(a) => return a,
    };
    let key = base64(&rand_bytes(s, 24));
    let mut rec = r.json.clone().unwrap_or_default();
    rec["param"] = param;
    rec["processQueryKey"] = json!(key);
    s.group_sends.push(rec);
    answer(200, json!({"processQueryKey": key}))
}

fn oto_send(s: &mut State, r: &Req) -> Answer {
    let users: Vec<String> = r
        .json
        .as_ref()
        .and_then(|j| j["userIds"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter_map(|u| u.as_str().map(str::to_string))
        .collect();
    if users.is_empty() {
        return api_err(s, 400, "invalidParameter.userIds.empty", "用户userId列表为空");
    }
    let param = match message_param(s, r) {
        Ok(p) => p,
        Err(a) => return a,
    };
    let invalid: Vec<&String> = users.iter().filter(|u| !s.users.contains_key(*u)).collect();
    let invalid = json!(invalid);
    let mut held = Vec::new();
    for u in &users {
        if let Some(left) = s.flow_controlled.get_mut(u).filter(|left| **left > 0) {
            *left -= 1;
            held.push(u.clone());
        }
    }
    let held = json!(held);
    let key = base64(&rand_bytes(s, 24));
    let mut rec = r.json.clone().unwrap_or_default();
    rec["param"] = param;
    rec["processQueryKey"] = json!(key);
    rec["invalidStaffIdList"] = invalid.clone();
    rec["flowControlledStaffIdList"] = held.clone();
    s.oto_sends.push(rec);
    answer(
        200,
        json!({"processQueryKey": key, "invalidStaffIdList": invalid, "flowControlledStaffIdList": held}),
    )
}

/// Chosen: a URL on this simulator, valid until `expire_download_urls` (the real one is a
/// short-lived signed URL on a file host); an unknown downloadCode: 400 (code not documented).
fn file_download_url(s: &mut State, r: &Req) -> Answer {
    let code = r.str("downloadCode");
    if !s.media.contains_key(&code) {
        return api_err(s, 400, "invalidParameter.downloadCode.invalid", "downloadCode无效");
    }
    let id = hex(&rand_bytes(s, 16));
    s.download_urls.insert(id.clone(), (code, true));
    let url = format!("{}/files/{id}?Expires={}&Signature=sim", s.api, now_ms() / 1000 + 3600);
    answer(200, json!({"downloadUrl": url}))
}

fn file_get(s: &mut State, id: &str) -> Answer {
    let (status, code, bytes) = match s.download_urls.get(id) {
        Some((code, true)) => match s.media.get(code) {
            Some((b, _)) => (200, code.clone(), b.clone()),
            None => (404, code.clone(), Vec::new()),
        },
        Some((code, false)) => (403, code.clone(), Vec::new()),
        None => (404, String::new(), Vec::new()),
    };
    s.downloads
        .push(json!({"downloadCode": code, "status": status, "size": bytes.len()}));
    match status {
        200 => Answer {
            status,
            body: bytes,
            ctype: "application/octet-stream",
        },
        // Chosen: an object store's refusal.
        _ => Answer {
            status,
            body: format!(
                "<Error><Code>{}</Code></Error>",
                if status == 403 { "AccessDenied" } else { "NoSuchKey" }
            )
            .into_bytes(),
            ctype: "application/xml",
        },
    }
}

fn oapi(s: &mut State, r: &Req) -> Answer {
    match (r.method.as_str(), r.path.as_str()) {
        ("POST", "/media/upload") => media_upload(s, r),
        ("POST", "/robot/sendBySession") => session_send(s, r),
        _ => Answer {
            status: 404,
            body: b"<html><body><h1>404 Not Found</h1></body></html>".to_vec(),
            ctype: "text/html",
        },
    }
}

fn media_upload(s: &mut State, r: &Req) -> Answer {
    if s.tokens.get(&r.token).is_none_or(|(_, until)| *until <= Instant::now()) {
        return oapi_err(40014, "不合法的access_token");
    }
    let parts = multipart(&r.body, &r.ctype).unwrap_or_default();
    let kind = parts
        .iter()
        .find(|p| p.name == "type")
        .map(|p| String::from_utf8_lossy(&p.data).into_owned())
        .or_else(|| r.query_param("type"))
        .unwrap_or_default();
    if !["image", "voice", "video", "file"].contains(&kind.as_str()) {
        return oapi_err(40004, "不合法的媒体文件类型");
    }
    let Some(media) = parts.iter().find(|p| p.name == "media" && p.filename.is_some()) else {
        // Chosen: the errcode for a missing file part.
        return oapi_err(40035, "缺少参数 media");
    };
    let media_id = format!("@lA{}", base64(&rand_bytes(s, 15)).replace(['+', '/'], "x"));
    let created = now_ms();
    s.uploads
        .push(json!({"media_id": media_id, "type": kind, "filename": media.filename,
                          "size": media.data.len(), "content_type": media.content_type}));
    s.uploaded.insert(media_id.clone(), media.data.clone());
    answer(
        200,
        json!({"errcode": 0, "errmsg": "ok", "media_id": media_id, "type": kind, "created_at": created}),
    )
}

/// `POST sessionWebhook` with `{"msgtype":"text","text":{"content"}}` or `markdown` `{title,
/// text}`, and an optional `at` (chatbot.py's reply_text / reply_markdown). Chosen: an unknown or expired session
/// answers 300001 "token is not exist" (the errcode and errmsg DingTalk's robot webhooks give a
/// token they do not know; none is documented for sessions); a malformed body 40035.
fn session_send(s: &mut State, r: &Req) -> Answer {
    let session = r.query_param("session").unwrap_or_default();
    let body = r.json.clone().unwrap_or(Value::Null);
    let live = s.sessions.get(&session).filter(|w| w.expires_ms > now_ms());
    let (cid, msg_id) = match live {
        Some(w) => (w.cid.clone(), w.msg_id.clone()),
        None => (
            s.sessions.get(&session).map(|w| w.cid.clone()).unwrap_or_default(),
            String::new(),
        ),
    };
    let well_formed = match body["msgtype"].as_str() {
        Some("text") => body["text"]["content"].is_string(),
        Some("markdown") => body["markdown"]["title"].is_string() && body["markdown"]["text"].is_string(),
        Some("actionCard" | "link" | "feedCard") => true,
        _ => false,
    };
    // `at`: `{atUserIds: [userId…], atMobiles, isAtAll}` (chatbot.py's reply_text sends
    // `atUserIds` with the sender's staff ID).
    let at_ok = match &body["at"] {
        Value::Null => true,
        at => match &at["atUserIds"] {
            Value::Null => true,
            Value::Array(ids) => ids.iter().all(Value::is_string),
            _ => false,
        },
    };
    let well_formed = well_formed && at_ok;
    let (errcode, a) = if live.is_none() {
        (300001, oapi_err(300001, "token is not exist"))
    } else if !well_formed {
        (40035, oapi_err(40035, "不合法的参数"))
    } else {
        (0, oapi_err(0, "ok"))
    };
    s.webhook_posts
        .push(json!({"session": session, "cid": cid, "msgId": msg_id, "body": body, "errcode": errcode}));
    a
}

// ---------- self-checks: a tiny client of tungstenite + ureq ----------

#[cfg(test)]
mod selfcheck {
    use super::*;
    use tungstenite::WebSocket;

    // Generous: a bound on a wait for progress, reached only when something is wrong.
    const WAIT: Duration = Duration::from_secs(15);
    type Ws = WebSocket<TcpStream>;

    fn agent() -> ureq::Agent {
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(5)))
            .build()
            .into()
    }

    fn post(url: &str, token: Option<&str>, body: Value) -> (u16, Value) {
        let mut req = agent().post(url).header("Content-Type", "application/json");
        if let Some(t) = token {
            req = req.header("x-acs-dingtalk-access-token", t);
        }
        let mut r = req.send(body.to_string()).unwrap();
        let text = r.body_mut().read_to_string().unwrap();
        (r.status().as_u16(), serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    fn open(sim: &DingTalkSim, secret: &str) -> (u16, Value) {
        post(
            &format!("{}/v1.0/gateway/connections/open", sim.api_base),
            None,
            json!({"clientId": "dingapp1", "clientSecret": secret, "ua": "selfcheck/1", "localIp": "127.0.0.1",
                   "subscriptions": [{"type": "CALLBACK", "topic": BOT_TOPIC}]}),
        )
    }

    fn connect(endpoint: &str, ticket: &str) -> Result<Ws, u16> {
        let url = format!("{endpoint}?ticket={ticket}");
        let stream = TcpStream::connect(url.trim_start_matches("ws://").split('/').next().unwrap()).unwrap();
        stream.set_read_timeout(Some(WAIT)).unwrap();
        match tungstenite::client(url.as_str(), stream) {
            Ok((ws, _)) => Ok(ws),
            Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(r))) => Err(r.status().as_u16()),
            Err(e) => panic!("handshake: {e}"),
        }
    }

    fn next(ws: &mut Ws) -> Value {
        loop {
            match ws.read().expect("a frame within the wait") {
                Message::Text(t) => return serde_json::from_str(t.as_str()).unwrap(),
                Message::Close(f) => panic!("closed: {f:?}"),
                _ => {}
            }
        }
    }

    /// The answer the SDKs send: code 200, the frame's messageId, `data` as given.
    fn ack(ws: &mut Ws, frame: &Value, data: &str) {
        let a = json!({"code": 200, "headers": {"contentType": "application/json", "messageId": frame["headers"]["messageId"]},
                       "message": "OK", "data": data});
        ws.send(Message::Text(a.to_string().into())).unwrap();
    }

    /// connections/open (wrong secret refused) → ticket → socket → ping answered → robot message
    /// answered; the ticket once used is refused; a disconnect closes after its grace and a
    /// message pushed meanwhile is lost.
    #[test]
    fn stream_open_ping_callback_disconnect() {
        let sim = DingTalkSim::start();
        sim.add_app("dingapp1", "secret1");
        sim.add_user("staff1", "Alice");
        sim.add_group("cidGroup1==", "Team");

        let (status, body) = open(&sim, "wrong");
        assert_eq!((status, body["code"].as_str()), (401, Some("authFailed")), "{body}");
        let (status, body) = open(&sim, "secret1");
        assert_eq!(status, 200, "{body}");
        let (endpoint, ticket) = (body["endpoint"].as_str().unwrap(), body["ticket"].as_str().unwrap());
        assert_eq!(endpoint, sim.endpoint);
        let mut ws = connect(endpoint, ticket).unwrap();
        assert!(sim.wait_connected("dingapp1", 1, WAIT));
        assert_eq!(connect(endpoint, ticket).err(), Some(401), "a ticket works once");
        assert!(sim.wait(WAIT, |s| s.reused_tickets == 1));

        let ping_id = sim.ping("dingapp1");
        let ping = next(&mut ws);
        assert_eq!(
            (
                ping["type"].as_str(),
                ping["headers"]["topic"].as_str(),
                ping["headers"]["messageId"].as_str()
            ),
            (Some("SYSTEM"), Some("ping"), Some(ping_id.as_str()))
        );
        assert!(ping["headers"]["time"].is_string(), "{ping}");
        let opaque: Value = serde_json::from_str(ping["data"].as_str().unwrap()).unwrap();
        // Re-serialised as Python does: the same JSON, other bytes.
        ack(&mut ws, &ping, &format!("{{\"opaque\": {}}}", opaque["opaque"]));
        assert!(sim.wait_pong(&ping_id, WAIT));

        let msg_id = sim.send_text("dingapp1", "cidGroup1==", "staff1", "hello");
        let cb = next(&mut ws);
        assert_eq!(
            (
                cb["type"].as_str(),
                cb["headers"]["topic"].as_str(),
                cb["specVersion"].as_str()
            ),
            (Some("CALLBACK"), Some(BOT_TOPIC), Some("1.0"))
        );
        let data: Value = serde_json::from_str(cb["data"].as_str().unwrap()).unwrap();
        assert_eq!(
            (
                data["msgId"].as_str(),
                data["text"]["content"].as_str(),
                data["conversationType"].as_str()
            ),
            (Some(msg_id.as_str()), Some("hello"), Some("2"))
        );
        assert_eq!(
            (data["senderNick"].as_str(), data["robotCode"].as_str()),
            (Some("Alice"), Some("dingapp1"))
        );
        assert!(
            data["sessionWebhook"].as_str().unwrap().starts_with(&sim.oapi_base),
            "{data}"
        );
        assert!(sim.delivered(&msg_id));
        ack(&mut ws, &cb, "{\"response\": null}");
        assert!(sim.wait_answered(&msg_id, WAIT));
        assert_eq!(sim.answered(), [msg_id]);

        sim.set_disconnect_grace(Duration::from_millis(200));
        assert!(sim.disconnect("dingapp1"));
        let d = next(&mut ws);
        assert_eq!(d["headers"]["topic"], "disconnect", "{d}");
        let lost = sim.send_text("dingapp1", "cidGroup1==", "staff1", "during the grace");
        assert!(!sim.delivered(&lost), "nothing is pushed on a disconnecting socket");
        loop {
            match ws.read() {
                Ok(Message::Close(_)) => {
                    let _ = ws.flush(); // the close answer
                    break;
                }
                Err(_) => break,
                Ok(Message::Text(t)) => panic!("a push after disconnect: {t}"),
                Ok(_) => {}
            }
        }
        assert!(sim.wait_open_sockets("dingapp1", 0, WAIT));
        assert_eq!((sim.connections("dingapp1"), sim.tickets_issued("dingapp1")), (1, 1));
    }

    /// Token grant and refusal, a group send, a one-to-one send with an unknown user, a throttled
    /// call, a multipart upload, a file download, a session webhook before and after expiry.
    #[test]
    fn openapi_token_send_upload_download_webhook() {
        let sim = DingTalkSim::start();
        sim.add_app("dingapp1", "secret1");
        sim.add_user("staff1", "Alice");
        sim.add_group("cidGroup1==", "Team");
        let api = |p: &str| format!("{}{p}", sim.api_base);

        let (status, body) = post(
            &api("/v1.0/oauth2/accessToken"),
            None,
            json!({"appKey": "dingapp1", "appSecret": "x"}),
        );
        assert_eq!((status, body["code"].as_str()), (400, Some("invalidClientIdOrSecret")));
        let (status, body) = post(
            &api("/v1.0/oauth2/accessToken"),
            None,
            json!({"appKey": "dingapp1", "appSecret": "secret1"}),
        );
        assert_eq!((status, body["expireIn"].as_u64()), (200, Some(7200)), "{body}");
        let token = body["accessToken"].as_str().unwrap().to_string();
        assert_eq!(sim.token_grants("dingapp1"), 1);

        let send = json!({"robotCode": "dingapp1", "openConversationId": "cidGroup1==", "msgKey": "sampleText",
                          "msgParam": json!({"content": "hi"}).to_string()});
        let (status, body) = post(&api("/v1.0/robot/groupMessages/send"), Some("bad"), send.clone());
        assert_eq!((status, body["code"].as_str()), (400, Some("InvalidAuthentication")));
        let (status, body) = post(&api("/v1.0/robot/groupMessages/send"), Some(&token), send.clone());
        assert!(status == 200 && body["processQueryKey"].is_string(), "{body}");
        assert_eq!(sim.group_sends("cidGroup1==")[0]["param"]["content"], "hi");
        sim.throttle_next("/v1.0/robot/groupMessages/send", 1);
        let (status, body) = post(&api("/v1.0/robot/groupMessages/send"), Some(&token), send);
        assert_eq!(
            (status, body["code"].as_str()),
            (403, Some("Forbidden.AccessDenied.QpsLimitForAppkeyAndApi"))
        );
        assert_eq!(sim.calls("/v1.0/robot/groupMessages/send")[1]["token"], token.as_str());

        let oto = json!({"robotCode": "dingapp1", "userIds": ["staff1", "ghost"], "msgKey": "sampleMarkdown",
                         "msgParam": json!({"title": "t", "text": "**x**"}).to_string()});
        let (status, body) = post(&api("/v1.0/robot/oToMessages/batchSend"), Some(&token), oto);
        assert_eq!(
            (status, body["invalidStaffIdList"].clone()),
            (200, json!(["ghost"])),
            "{body}"
        );

        let boundary = "selfcheckBoundary";
        let mut form = format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"type\"\r\n\r\nfile\r\n--{boundary}\r\n\
             Content-Disposition: form-data; name=\"media\"; filename=\"r.pdf\"\r\nContent-Type: application/pdf\r\n\r\n"
        )
        .into_bytes();
        form.extend_from_slice(b"%PDF\r\n--not-the-boundary");
        form.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
        let mut r = agent()
            .post(&format!("{}/media/upload?access_token={token}", sim.oapi_base))
            .header("Content-Type", &format!("multipart/form-data; boundary={boundary}"))
            .send(&form[..])
            .unwrap();
        let up: Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
        assert_eq!(
            (up["errcode"].as_u64(), up["type"].as_str()),
            (Some(0), Some("file")),
            "{up}"
        );
        let media_id = up["media_id"].as_str().unwrap();
        assert_eq!(sim.uploaded_bytes(media_id), b"%PDF\r\n--not-the-boundary");
        assert_eq!(sim.uploads()[0]["filename"], "r.pdf");

        sim.add_media("dlc1", b"png-bytes", "a.png");
        let (status, body) = post(
            &api("/v1.0/robot/messageFiles/download"),
            Some(&token),
            json!({"downloadCode": "dlc1", "robotCode": "dingapp1"}),
        );
        assert_eq!(status, 200, "{body}");
        let mut r = agent().get(body["downloadUrl"].as_str().unwrap()).call().unwrap();
        assert_eq!(r.body_mut().read_to_vec().unwrap(), b"png-bytes");

        let msg_id = sim.send_text("dingapp1", "cidGroup1==", "staff1", "no socket");
        assert!(!sim.delivered(&msg_id));
        let hook = sim.message(&msg_id).unwrap()["sessionWebhook"]
            .as_str()
            .unwrap()
            .to_string();
        let reply = json!({"msgtype": "text", "text": {"content": "pong"}});
        assert_eq!(
            post(&hook, None, reply.clone()).1,
            json!({"errcode": 0, "errmsg": "ok"})
        );
        sim.expire_session_webhooks();
        assert_eq!(post(&hook, None, reply).1["errcode"], 300001);
        let posts = sim.webhook_posts("cidGroup1==");
        assert_eq!((posts.len(), posts[0]["msgId"].as_str()), (2, Some(msg_id.as_str())));
        sim.expire_tokens();
        let (status, _) = post(
            &api("/v1.0/robot/messageFiles/download"),
            Some(&token),
            json!({"downloadCode": "dlc1", "robotCode": "dingapp1"}),
        );
        assert_eq!(status, 400);
    }
}
