//! A WeCom (企业微信) intelligent-robot simulator written from public material, not from imgate's
//! code: the long connection ("智能机器人长连接", developer docs path 101463) as the official
//! SDKs speak it (`@wecom/aibot-node-sdk` 1.0.7: `src/ws.ts`, `src/client.ts`, `src/api.ts`,
//! `src/crypto.ts`, `src/types/{api,message,event}.ts`; `wecom-aibot-python-sdk` 1.0.2:
//! `aibot/ws.py`, `aibot/crypto_utils.py`) and WeCom's own plugin on top of it
//! (WecomTeam/wecom-openclaw-plugin: `src/const.ts`, `src/message-sender.ts`). The facts, with
//! file and line, are in `docs/providers/wecom-protocol.md`; comments here name the file.
//!
//! Shape: a std listener + sync tungstenite is `wss://openws.work.weixin.qq.com`
//! (`ws_url`, path `/`), one thread per socket; a tiny_http server serves the encrypted media
//! downloads and the `response_url`s (`http_base`). Everything lives in one `State` behind a
//! mutex with a condvar, so tests wait on conditions; a ticker thread sends delayed answers and
//! closes kicked links. What the simulator keeps is bounded (frames, pushes, pings, callbacks,
//! media, uploads): a flood test measures imgate, not the simulator.
//! Choices where the sources are silent are marked "Chosen:".

use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use aes::cipher::generic_array::GenericArray;
use aes::cipher::{BlockEncrypt, KeyInit};
use aes::Aes256;
use serde_json::{json, Value};

use super::kit::{self, base64_decode, base64_unpadded, hex, now_ms, socket_loop, Heard, Out};

// ---------- commands (node SDK src/types/api.ts `WsCmd`) ----------

pub const SUBSCRIBE: &str = "aibot_subscribe";
pub const PING: &str = "ping";
pub const RESPOND: &str = "aibot_respond_msg";
pub const RESPOND_WELCOME: &str = "aibot_respond_welcome_msg";
pub const RESPOND_UPDATE: &str = "aibot_respond_update_msg";
pub const SEND_MSG: &str = "aibot_send_msg";
pub const UPLOAD_INIT: &str = "aibot_upload_media_init";
pub const UPLOAD_CHUNK: &str = "aibot_upload_media_chunk";
pub const UPLOAD_FINISH: &str = "aibot_upload_media_finish";
pub const MSG_CALLBACK: &str = "aibot_msg_callback";
pub const EVENT_CALLBACK: &str = "aibot_event_callback";

// ---------- error codes ----------

/// "stream message update expired": a reply after the window (plugin `src/message-sender.ts`
/// `STREAM_EXPIRED_ERRCODE`, "超过6分钟").
pub const STREAM_EXPIRED: i64 = 846_608;
/// "invalid req_id": a reply to a req_id WeCom never pushed (third party: @yanhaidao/wecom).
pub const INVALID_REQ_ID: i64 = 846_605;
/// "aibot websocket not subscribed" (third party: NousResearch/hermes-agent #29667).
pub const NOT_SUBSCRIBED: i64 = 846_609;
/// "invalid bot_id" (WecomTeam/wecom-cli #15, from the MCP-config call). Chosen for subscribe.
pub const INVALID_BOT_ID: i64 = 93_019;
/// Chosen: no source names the subscribe answer to a wrong secret; 40001 "invalid credential"
/// is what a third-party test assumes. The SDK takes any non-zero code as failure (`ws.ts`).
pub const INVALID_SECRET: i64 = 40_001;
/// `aibot_send_msg` with `msgtype: text` (the tracker's issue; WeCom's generic "invalid message
/// type"; the SDK has no text send body at all, `types/api.ts` `SendMsgBody`).
pub const INVALID_MSGTYPE: i64 = 40_008;
/// Chosen: a send to a user or chat that never wrote to the robot (a user reports the rule,
/// BytePioneer-AI/openclaw-china #223; no code is named). WeCom's "invalid userid".
pub const NOT_ACTIVATED: i64 = 40_003;
/// Chosen: a `media_id` no upload produced (WeCom's "invalid media_id").
pub const INVALID_MEDIA_ID: i64 = 40_007;
/// Chosen: a body over a documented limit or malformed (WeCom's "invalid parameter").
pub const INVALID_PARAM: i64 = 40_058;

// ---------- limits ----------

/// Stream `content`: "最长不超过 20480 个字节" (`types/api.ts` `StreamReplyBody`).
pub const MAX_STREAM_BYTES: usize = 20_480;
/// A chunk before base64, and chunks an upload may have (`client.ts` `uploadMedia`).
pub const MAX_CHUNK_BYTES: usize = 512 * 1024;
pub const MAX_CHUNKS: u64 = 100;
/// The reply window (plugin `src/message-sender.ts`: 846608 after 6 minutes).
pub const REPLY_WINDOW: Duration = Duration::from_secs(6 * 60);
/// Welcome and card-update replies: "5 秒内" (`client.ts` replyWelcome/updateTemplateCard).
pub const EVENT_REPLY_WINDOW: Duration = Duration::from_secs(5);
/// A media URL: "五分钟内有效" (`types/message.ts` ImageContent).
pub const MEDIA_URL_TTL: Duration = Duration::from_secs(5 * 60);

/// What the simulator keeps at most of each record.
const KEEP_FRAMES: usize = 4096;
const KEEP_PUSHES: usize = 4096;
const KEEP_PINGS: usize = 1024;
const KEEP_CALLBACKS: usize = 65_536;
const KEEP_MEDIA: usize = 256;
const KEEP_UPLOADED: usize = 8;
const KEEP_FAULTS: usize = 256;

/// A conversation: one-to-one (no `chatid`, "仅群聊类型时返回", `types/message.ts`) or a group.
#[derive(Clone, Debug)]
pub struct Chat {
    pub chatid: Option<String>,
    pub userid: String,
}

impl Chat {
    pub fn single(userid: &str) -> Chat {
        Chat {
            chatid: None,
            userid: userid.into(),
        }
    }

    pub fn group(chatid: &str, userid: &str) -> Chat {
        Chat {
            chatid: Some(chatid.into()),
            userid: userid.into(),
        }
    }

    /// What `aibot_send_msg`'s `chatid` names for it: the user's userid one-to-one, the group's
    /// chatid in a group (`client.ts` sendMessage).
    pub fn target(&self) -> &str {
        self.chatid.as_deref().unwrap_or(&self.userid)
    }
}

/// One part of a `mixed` message (`types/message.ts` MixedMsgItem: text or image).
pub enum Part<'a> {
    Text(&'a str),
    Image { bytes: &'a [u8], filename: &'a str },
}

/// A callback as pushed: its frame's `req_id`, its `msgid`, and the media it references.
#[derive(Clone, Debug)]
pub struct Pushed {
    pub req_id: String,
    pub msgid: String,
    pub delivered: bool,
    /// (url, aeskey) of each image or file, in body order.
    pub media: Vec<(String, String)>,
}

/// How the download server answers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Download {
    Normal,
    /// Headers, then a trickle of bytes that never ends (until the client goes or the sim stops).
    Endless,
    /// This HTTP status with an empty body.
    Status(u16),
}

struct Robot {
    bot_id: String,
    secret: String,
}

struct Link {
    tx: mpsc::Sender<Out>,
    /// The robot it subscribed as.
    bot: Option<String>,
    /// A newer link of its robot took over (`disconnected_event` sent).
    kicked: bool,
    close_at: Option<Instant>,
    /// Answers nothing, delivers nothing: a dead link the server does not know about.
    silent: bool,
    /// Answers (pings too) but delivers no callback: "pings but delivers nothing".
    deaf: bool,
}

/// A req_id WeCom pushed, for the replies that reuse it.
struct Issued {
    bot: String,
    at: Instant,
    event: bool,
}

struct Media {
    cipher: Arc<[u8]>,
    filename: String,
    at: Instant,
}

struct Upload {
    bot: String,
    kind: String,
    filename: String,
    total_size: u64,
    total_chunks: u64,
    md5: String,
    chunks: BTreeMap<u64, Vec<u8>>,
}

struct Delayed {
    link: u64,
    due: Option<Instant>,
    req_id: String,
    text: String,
}

struct State {
    http: String,
    ws_port: u16,
    robots: Vec<Robot>,
    links: HashMap<u64, Link>,
    next_link: u64,
    handshakes: u64,
    /// Successful subscribes per robot: a client's reconnects.
    subscribes: HashMap<String, u64>,
    auth_failures: Vec<(String, i64)>,
    kicks: HashMap<String, u64>,
    kick_closes: bool,
    kick_grace: Duration,
    issued: HashMap<String, Issued>,
    issued_order: VecDeque<String>,
    /// Targets (`Chat::target`) that wrote to each robot: who `aibot_send_msg` may reach.
    talked: HashMap<String, HashSet<String>>,
    frames: VecDeque<Value>,
    frames_dropped: u64,
    pushes: VecDeque<Value>,
    lost: u64,
    pings: VecDeque<(String, u64)>,
    window: Duration,
    event_window: Duration,
    ack_delay: Option<Duration>,
    delayed: VecDeque<Delayed>,
    /// req_ids with a reply frame not yet answered, and those that got a second one meanwhile.
    in_flight: HashSet<String>,
    overlaps: Vec<String>,
    faults: VecDeque<(String, i64, String)>,
    chunk_base: u64,
    uploads: HashMap<String, Upload>,
    /// media_id → (type, bytes while kept).
    media_ids: HashMap<String, (String, Option<Vec<u8>>)>,
    uploaded_order: VecDeque<String>,
    media: HashMap<String, Media>,
    media_order: VecDeque<String>,
    media_ttl: Duration,
    download: Download,
    downloads: Vec<Value>,
    /// response_code → (req_id, issued, used).
    response_urls: HashMap<String, (String, Instant, bool)>,
    response_posts: Vec<Value>,
    next_id: u64,
}

type Shared = Arc<(Mutex<State>, Condvar)>;

pub struct WecomSim {
    /// Where the long connection is: `ws://127.0.0.1:PORT` (WeCom: `wss://openws.work.weixin.qq.com`).
    pub ws_url: String,
    /// The media and response_url host: `http://127.0.0.1:PORT`.
    pub http_base: String,
    state: Shared,
    stopped: Arc<AtomicBool>,
}

impl WecomSim {
    pub fn start() -> WecomSim {
        let http = Arc::new(tiny_http::Server::http("127.0.0.1:0").unwrap());
        let http_port = http.server_addr().to_ip().unwrap().port();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let ws_port = listener.local_addr().unwrap().port();
        let state: Shared = Arc::new((
            Mutex::new(State {
                http: format!("http://127.0.0.1:{http_port}"),
                ws_port,
                robots: vec![],
                links: HashMap::new(),
                next_link: 0,
                handshakes: 0,
                subscribes: HashMap::new(),
                auth_failures: vec![],
                kicks: HashMap::new(),
                kick_closes: true,
                // Chosen: the sources say the server "主动断开" the old link, not when.
                kick_grace: Duration::from_millis(500),
                issued: HashMap::new(),
                issued_order: VecDeque::new(),
                talked: HashMap::new(),
                frames: VecDeque::new(),
                frames_dropped: 0,
                pushes: VecDeque::new(),
                lost: 0,
                pings: VecDeque::new(),
                window: REPLY_WINDOW,
                event_window: EVENT_REPLY_WINDOW,
                ack_delay: Some(Duration::ZERO),
                delayed: VecDeque::new(),
                in_flight: HashSet::new(),
                overlaps: vec![],
                faults: VecDeque::new(),
                // The SDK sends 0 … n−1 (`client.ts` uploadMedia) although its type says "从 1 开始".
                chunk_base: 0,
                uploads: HashMap::new(),
                media_ids: HashMap::new(),
                uploaded_order: VecDeque::new(),
                media: HashMap::new(),
                media_order: VecDeque::new(),
                media_ttl: MEDIA_URL_TTL,
                download: Download::Normal,
                downloads: vec![],
                response_urls: HashMap::new(),
                response_posts: vec![],
                next_id: 0,
            }),
            Condvar::new(),
        ));
        let stopped = Arc::new(AtomicBool::new(false));
        let (st, stop) = (state.clone(), stopped.clone());
        kit::serve_http(&http, 3, &stopped, move |req| serve(&st, &stop, req));
        let st = state.clone();
        kit::accept_each(listener, &stopped, move |stream, stop| link(&st, stream, stop));
        let st = state.clone();
        kit::tick_until(&stopped, move || tick(&st));
        WecomSim {
            ws_url: format!("ws://127.0.0.1:{ws_port}"),
            http_base: format!("http://127.0.0.1:{http_port}"),
            state,
            stopped,
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        kit::change(&self.state, f)
    }

    fn wait(&self, timeout: Duration, ready: impl Fn(&State) -> bool) -> bool {
        kit::wait_for(&self.state, timeout, ready)
    }

    // ---------- robots ----------

    /// A robot in long-connection API mode with its Bot ID and Secret (docs 101463 "获取凭证").
    pub fn robot(&self, bot_id: &str, secret: &str) {
        self.with(|s| {
            s.robots.push(Robot {
                bot_id: bot_id.into(),
                secret: secret.into(),
            })
        });
    }

    /// Successful subscribes of the robot so far: its first connection and every reconnect.
    pub fn subscribes(&self, bot_id: &str) -> u64 {
        self.with(|s| s.subscribes.get(bot_id).copied().unwrap_or(0))
    }

    pub fn wait_subscribes(&self, bot_id: &str, n: u64, timeout: Duration) -> bool {
        self.wait(timeout, |s| s.subscribes.get(bot_id).copied().unwrap_or(0) >= n)
    }

    /// WebSocket handshakes completed, subscribed or not.
    pub fn handshakes(&self) -> u64 {
        self.with(|s| s.handshakes)
    }

    /// Subscribes refused: (bot_id, errcode), in order.
    pub fn auth_failures(&self) -> Vec<(String, i64)> {
        self.with(|s| s.auth_failures.clone())
    }

    /// Links of the robot open now (a kicked one until it is closed).
    pub fn open_links(&self, bot_id: &str) -> usize {
        self.with(|s| s.links.values().filter(|l| l.bot.as_deref() == Some(bot_id)).count())
    }

    pub fn wait_open_links(&self, bot_id: &str, n: usize, timeout: Duration) -> bool {
        self.wait(timeout, |s| {
            s.links.values().filter(|l| l.bot.as_deref() == Some(bot_id)).count() == n
        })
    }

    /// `disconnected_event`s sent to the robot's links.
    pub fn kicks(&self, bot_id: &str) -> u64 {
        self.with(|s| s.kicks.get(bot_id).copied().unwrap_or(0))
    }

    // ---------- link knobs ----------

    /// Off: a kicked link is sent `disconnected_event` but stays open, answering pings and
    /// delivering nothing: the "half-alive" socket WeCom's plugin users saw
    /// (wecom-openclaw-plugin #54). On (the default): closed after a short grace.
    pub fn set_kick_closes(&self, on: bool) {
        self.with(|s| s.kick_closes = on);
    }

    /// The robot's newest link answers nothing more (pings included) and delivers nothing; it
    /// still reads and records: a dead link the server does not know about.
    pub fn go_silent(&self, bot_id: &str) {
        self.with(|s| {
            if let Some(l) = newest(s, bot_id).and_then(|k| s.links.get_mut(&k)) {
                l.silent = true;
            }
        });
    }

    /// The robot's newest link keeps answering pings and replies but delivers no callback.
    pub fn go_deaf(&self, bot_id: &str) {
        self.with(|s| {
            if let Some(l) = newest(s, bot_id).and_then(|k| s.links.get_mut(&k)) {
                l.deaf = true;
            }
        });
    }

    /// A `disconnected_event` on the robot's newest link with no new connection (closed after
    /// the grace when kicks close). False with no link.
    pub fn kick(&self, bot_id: &str) -> bool {
        self.with(|s| match newest(s, bot_id) {
            Some(k) => {
                kick_link(s, k, bot_id);
                true
            }
            None => false,
        })
    }

    /// The robot's newest link: TCP closed with no close frame.
    pub fn drop_link(&self, bot_id: &str) {
        self.with(|s| {
            if let Some(k) = newest(s, bot_id) {
                let _ = s.links[&k].tx.send(Out::Drop);
            }
        });
    }

    /// The robot's newest link: a close frame with `code`, then TCP closed.
    pub fn close_link(&self, bot_id: &str, code: u16) {
        self.with(|s| {
            if let Some(k) = newest(s, bot_id) {
                let _ = s.links[&k].tx.send(Out::Close(code));
            }
        });
    }

    /// A raw text frame on the robot's newest link.
    pub fn send_raw(&self, bot_id: &str, text: &str) {
        self.with(|s| {
            if let Some(k) = newest(s, bot_id) {
                let _ = s.links[&k].tx.send(Out::Text(text.into()));
            }
        });
    }

    // ---------- answer knobs ----------

    /// The next client frame of `cmd` (any link) is answered with this errcode instead of its
    /// due answer. Queued in order.
    pub fn fail_next(&self, cmd: &str, errcode: i64, errmsg: &str) {
        self.with(|s| {
            if s.faults.len() < KEEP_FAULTS {
                s.faults.push_back((cmd.into(), errcode, errmsg.into()));
            }
        });
    }

    /// Answers to replies, sends and uploads come this late; `None`: never (the SDK gives up
    /// after 5 s, `ws.ts` replyAckTimeout). Subscribe and ping answers are never delayed.
    pub fn set_ack_delay(&self, delay: Option<Duration>) {
        self.with(|s| s.ack_delay = delay);
    }

    /// How long a pushed req_id takes replies (default 6 minutes).
    pub fn set_reply_window(&self, window: Duration) {
        self.with(|s| s.window = window);
    }

    /// Welcome and card-update replies' window (default 5 s).
    pub fn set_event_reply_window(&self, window: Duration) {
        self.with(|s| s.event_window = window);
    }

    /// The first `chunk_index` uploads take: 0 as the SDK sends, 1 as its type's comment says.
    pub fn set_chunk_base(&self, base: u64) {
        self.with(|s| s.chunk_base = base);
    }

    /// How media downloads answer from now on.
    pub fn set_download(&self, mode: Download) {
        self.with(|s| s.download = mode);
    }

    /// How long a media URL stays valid (default 5 minutes).
    pub fn set_media_ttl(&self, ttl: Duration) {
        self.with(|s| s.media_ttl = ttl);
    }

    // ---------- what users do ----------

    /// A file served encrypted at a fresh URL with a fresh 43-character `aeskey` (see `encrypt`).
    /// Returns (url, aeskey).
    pub fn add_media(&self, bytes: &[u8], filename: &str) -> (String, String) {
        self.with(|s| add_media(s, bytes, filename))
    }

    /// The body of a message callback as WeCom builds it (`types/message.ts` BaseMessage):
    /// `msgid`, `aibotid`, `chatid` (groups only), `chattype`, `from.userid`, `create_time`,
    /// `response_url`, `msgtype` and `content` under the msgtype's key. Not pushed: change
    /// fields (a `quote`, say), then `push_callback`.
    pub fn callback_body(&self, bot_id: &str, chat: &Chat, msgtype: &str, content: Value) -> Value {
        self.with(|s| {
            let msgid = hex(&rand_bytes(s, 16));
            let code = hex(&rand_bytes(s, 16));
            let mut b = json!({
                "msgid": msgid,
                "aibotid": bot_id,
                "chattype": if chat.chatid.is_some() { "group" } else { "single" },
                "from": {"userid": chat.userid},
                // Chosen: seconds, as WeCom's other timestamps.
                "create_time": now_ms() / 1000,
                // docs 101138: `…/cgi-bin/aibot/response?response_code=…`.
                "response_url": format!("{}/cgi-bin/aibot/response?response_code={code}", s.http),
                "msgtype": msgtype,
            });
            if let Some(c) = &chat.chatid {
                b["chatid"] = json!(c);
            }
            b[msgtype] = content;
            s.response_urls.insert(code, (String::new(), Instant::now(), false));
            b
        })
    }

    /// Pushes a message callback `{cmd: aibot_msg_callback, headers: {req_id}, body}` on the
    /// robot's newest live link (`ws.ts` handleFrame). With none, or a silent or deaf one, it is
    /// lost: WeCom neither waits for an answer nor pushes it again.
    pub fn push_callback(&self, bot_id: &str, body: Value) -> Pushed {
        self.with(|s| push(s, bot_id, MSG_CALLBACK, body, false))
    }

    pub fn send_text(&self, bot_id: &str, chat: &Chat, text: &str) -> Pushed {
        let b = self.callback_body(bot_id, chat, "text", json!({"content": text}));
        self.push_callback(bot_id, b)
    }

    /// A text callback whose frame is about `bytes` long: a huge frame.
    pub fn send_huge_text(&self, bot_id: &str, chat: &Chat, bytes: usize) -> Pushed {
        self.send_text(bot_id, chat, &"x".repeat(bytes))
    }

    /// Voice arrives as text only: `voice.content` is the transcript (`types/message.ts`).
    pub fn send_voice(&self, bot_id: &str, chat: &Chat, transcript: &str) -> Pushed {
        let b = self.callback_body(bot_id, chat, "voice", json!({"content": transcript}));
        self.push_callback(bot_id, b)
    }

    /// `image: {url, aeskey}`.
    pub fn send_image(&self, bot_id: &str, chat: &Chat, bytes: &[u8], filename: &str) -> Pushed {
        self.send_media("image", bot_id, chat, bytes, filename)
    }

    /// `file: {url, aeskey}`.
    pub fn send_file(&self, bot_id: &str, chat: &Chat, bytes: &[u8], filename: &str) -> Pushed {
        self.send_media("file", bot_id, chat, bytes, filename)
    }

    fn send_media(&self, kind: &str, bot_id: &str, chat: &Chat, bytes: &[u8], filename: &str) -> Pushed {
        let (url, aeskey) = self.add_media(bytes, filename);
        let b = self.callback_body(bot_id, chat, kind, json!({"url": url, "aeskey": aeskey}));
        self.push_callback(bot_id, b)
    }

    /// `mixed: {msg_item: [{msgtype: text, text: {content}} | {msgtype: image, image: {url, aeskey}}]}`.
    pub fn send_mixed(&self, bot_id: &str, chat: &Chat, parts: &[Part]) -> Pushed {
        let items: Vec<Value> = parts
            .iter()
            .map(|p| match p {
                Part::Text(t) => json!({"msgtype": "text", "text": {"content": t}}),
                Part::Image { bytes, filename } => {
                    let (url, aeskey) = self.add_media(bytes, filename);
                    json!({"msgtype": "image", "image": {"url": url, "aeskey": aeskey}})
                }
            })
            .collect();
        let b = self.callback_body(bot_id, chat, "mixed", json!({"msg_item": items}));
        self.push_callback(bot_id, b)
    }

    /// An event callback (`types/event.ts` EventMessage): `msgtype: event`, `event: {eventtype,
    /// …extra}`, `from.userid`, `chatid`/`chattype` as for messages.
    pub fn send_event(&self, bot_id: &str, chat: &Chat, eventtype: &str, extra: Value) -> Pushed {
        self.with(|s| {
            let mut event = json!({"eventtype": eventtype});
            if let Value::Object(m) = extra {
                event.as_object_mut().unwrap().extend(m);
            }
            let mut b = json!({
                "msgid": hex(&rand_bytes(s, 16)),
                "create_time": now_ms() / 1000,
                "aibotid": bot_id,
                "chattype": if chat.chatid.is_some() { "group" } else { "single" },
                "from": {"userid": chat.userid},
                "msgtype": "event",
                "event": event,
            });
            if let Some(c) = &chat.chatid {
                b["chatid"] = json!(c);
            }
            push(s, bot_id, EVENT_CALLBACK, b, true)
        })
    }

    /// `enter_chat`: the user opened the one-to-one chat (first time that day).
    pub fn enter_chat(&self, bot_id: &str, userid: &str) -> Pushed {
        self.send_event(bot_id, &Chat::single(userid), "enter_chat", json!({}))
    }

    /// `template_card_event` with the button's `event_key` and the card's `task_id`.
    pub fn card_click(&self, bot_id: &str, chat: &Chat, event_key: &str, task_id: &str) -> Pushed {
        self.send_event(
            bot_id,
            chat,
            "template_card_event",
            json!({"event_key": event_key, "task_id": task_id}),
        )
    }

    /// Callbacks pushed (at most the last 4096): `{req_id, cmd, body, delivered}`.
    pub fn pushes(&self) -> Vec<Value> {
        self.with(|s| s.pushes.iter().cloned().collect())
    }

    /// Callbacks no link took.
    pub fn lost(&self) -> u64 {
        self.with(|s| s.lost)
    }

    // ---------- what the client sent ----------

    /// Every frame the client sent (at most the last 4096), in order, each as
    /// `{link, at_ms, frame, errcode}` (`errcode` of the answer given, null when none is due or
    /// it is delayed). A chunk's `base64_data` is replaced by its length.
    pub fn frames(&self) -> Vec<Value> {
        self.with(|s| s.frames.iter().cloned().collect())
    }

    /// The client's frames of one `cmd`.
    pub fn frames_of(&self, cmd: &str) -> Vec<Value> {
        self.with(|s| s.frames.iter().filter(|f| f["frame"]["cmd"] == cmd).cloned().collect())
    }

    pub fn wait_frames(&self, cmd: &str, n: usize, timeout: Duration) -> bool {
        self.wait(timeout, |s| {
            s.frames.iter().filter(|f| f["frame"]["cmd"] == cmd).count() >= n
        })
    }

    /// The reply frames (`aibot_respond_*`) on one req_id, in the order they came.
    pub fn replies(&self, req_id: &str) -> Vec<Value> {
        self.with(|s| {
            s.frames
                .iter()
                .filter(|f| {
                    f["frame"]["headers"]["req_id"] == req_id
                        && f["frame"]["cmd"]
                            .as_str()
                            .is_some_and(|c| c.starts_with("aibot_respond"))
                })
                .cloned()
                .collect()
        })
    }

    /// Waits for a stream frame with `finish: true` on `req_id`.
    pub fn wait_finished(&self, req_id: &str, timeout: Duration) -> bool {
        self.wait(timeout, |s| {
            s.frames
                .iter()
                .any(|f| f["frame"]["headers"]["req_id"] == req_id && f["frame"]["body"]["stream"]["finish"] == true)
        })
    }

    /// Frames dropped from the record to keep it bounded.
    pub fn frames_dropped(&self) -> u64 {
        self.with(|s| s.frames_dropped)
    }

    /// When the robot's links sent `ping` (ms since the epoch; at most the last 1024).
    pub fn pings(&self, bot_id: &str) -> Vec<u64> {
        self.with(|s| s.pings.iter().filter(|(b, _)| b == bot_id).map(|(_, t)| *t).collect())
    }

    /// req_ids that got a reply frame while the previous one on it was still unanswered: the
    /// SDK never does that (`ws.ts` sendReply: one at a time per req_id).
    pub fn overlaps(&self) -> Vec<String> {
        self.with(|s| s.overlaps.clone())
    }

    /// The bytes of a finished upload (the last 8 kept), by its media_id.
    pub fn uploaded(&self, media_id: &str) -> Option<Vec<u8>> {
        self.with(|s| s.media_ids.get(media_id).and_then(|(_, b)| b.clone()))
    }

    /// Media downloads served: `{id, status, at_ms}`.
    pub fn downloads(&self) -> Vec<Value> {
        self.with(|s| s.downloads.clone())
    }

    /// POSTs to response_urls: `{response_code, body, errcode}`.
    pub fn response_posts(&self) -> Vec<Value> {
        self.with(|s| s.response_posts.clone())
    }
}

impl Drop for WecomSim {
    /// Every thread ends: links close, HTTP workers and the ticker see the flag, the accept loop
    /// is woken by one last connection.
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::Relaxed);
        let port = self.with(|s| {
            for l in s.links.values() {
                let _ = l.tx.send(Out::Drop);
            }
            s.ws_port
        });
        let _ = TcpStream::connect(("127.0.0.1", port));
    }
}

// ---------- media encryption (the inverse of the SDKs' decryptFile) ----------

/// What `crypto.ts` decryptFile undoes: key = base64(aeskey) (32 bytes, AES-256), IV = the key's
/// first 16 bytes, CBC, PKCS#7 padding to a multiple of 32 bytes (pad 1..=32, `crypto.ts`;
/// `wecom-crypto/index.ts` pkcs7Pad with block size 32). CBC over the `aes` block cipher.
pub fn encrypt(aeskey: &str, plain: &[u8]) -> Vec<u8> {
    let key = base64_decode(aeskey);
    assert_eq!(key.len(), 32, "an aeskey is 32 bytes in base64");
    let cipher = Aes256::new(GenericArray::from_slice(&key));
    let pad = 32 - plain.len() % 32;
    let mut data = plain.to_vec();
    data.resize(plain.len() + pad, pad as u8);
    let mut prev: [u8; 16] = key[..16].try_into().unwrap();
    for block in data.chunks_mut(16) {
        block.iter_mut().zip(prev).for_each(|(b, p)| *b ^= p);
        cipher.encrypt_block(GenericArray::from_mut_slice(block));
        prev.copy_from_slice(block);
    }
    data
}

fn add_media(s: &mut State, bytes: &[u8], filename: &str) -> (String, String) {
    // Chosen: 43 characters, as the webhook mode's encodingAESKey (no source gives the length
    // of a message's aeskey; both SDKs accept it with or without its `=`).
    let aeskey = base64_unpadded(&rand_bytes(s, 32));
    let id = hex(&rand_bytes(s, 16));
    if s.media_order.len() >= KEEP_MEDIA {
        if let Some(old) = s.media_order.pop_front() {
            s.media.remove(&old);
        }
    }
    s.media.insert(
        id.clone(),
        Media {
            cipher: encrypt(&aeskey, bytes).into(),
            filename: filename.into(),
            at: Instant::now(),
        },
    );
    s.media_order.push_back(id.clone());
    (format!("{}/media/{id}", s.http), aeskey)
}

// ---------- pushing ----------

fn push(s: &mut State, bot_id: &str, cmd: &str, body: Value, event: bool) -> Pushed {
    assert!(s.robots.iter().any(|r| r.bot_id == bot_id), "unknown robot {bot_id}");
    // Chosen: a random req_id (the server's format is not documented).
    let req_id = hex(&rand_bytes(s, 16));
    let msgid = body["msgid"].as_str().unwrap_or_default().to_string();
    if s.issued_order.len() >= KEEP_CALLBACKS {
        if let Some(old) = s.issued_order.pop_front() {
            s.issued.remove(&old);
        }
    }
    s.issued.insert(
        req_id.clone(),
        Issued {
            bot: bot_id.into(),
            at: Instant::now(),
            event,
        },
    );
    s.issued_order.push_back(req_id.clone());
    if let Some(code) = body["response_url"]
        .as_str()
        .and_then(|u| u.split("response_code=").nth(1))
    {
        if let Some(r) = s.response_urls.get_mut(code) {
            r.0 = req_id.clone();
        }
    }
    let target = body["chatid"]
        .as_str()
        .or(body["from"]["userid"].as_str())
        .map(str::to_string);
    if let Some(t) = target.filter(|_| !event || body["event"]["eventtype"] == "enter_chat") {
        s.talked.entry(bot_id.into()).or_default().insert(t);
    }
    let media = media_of(&body);
    let frame = json!({"cmd": cmd, "headers": {"req_id": req_id}, "body": body});
    let delivered = match newest(s, bot_id).map(|k| &s.links[&k]) {
        Some(l) if !l.silent && !l.deaf => l.tx.send(Out::Text(frame.to_string())).is_ok(),
        _ => false,
    };
    if !delivered {
        s.lost += 1;
    }
    if s.pushes.len() >= KEEP_PUSHES {
        s.pushes.pop_front();
    }
    let mut kept = frame;
    kept["delivered"] = json!(delivered);
    if kept["body"]["msgtype"] == "text" && kept["body"]["text"]["content"].as_str().is_some_and(|t| t.len() > 4096) {
        kept["body"]["text"]["content"] = json!("<huge>");
    }
    s.pushes.push_back(kept);
    Pushed {
        req_id,
        msgid,
        delivered,
        media,
    }
}

fn media_of(body: &Value) -> Vec<(String, String)> {
    let one = |v: &Value| Some((v["url"].as_str()?.to_string(), v["aeskey"].as_str()?.to_string()));
    match body["msgtype"].as_str() {
        Some(k @ ("image" | "file" | "video")) => one(&body[k]).into_iter().collect(),
        Some("mixed") => body["mixed"]["msg_item"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|i| one(&i["image"]))
            .collect(),
        _ => vec![],
    }
}

/// The robot's newest subscribed link that was not kicked.
fn newest(s: &State, bot_id: &str) -> Option<u64> {
    s.links
        .iter()
        .filter(|(_, l)| l.bot.as_deref() == Some(bot_id) && !l.kicked)
        .map(|(k, _)| *k)
        .max()
}

/// `disconnected_event` on link `k` (`types/event.ts`: "有新连接建立时，服务端向旧连接推送此事件
/// 并主动断开"), then the close after the grace when kicks close. Chosen body: the EventMessage
/// fields with no user (`msgid`, `create_time`, `aibotid`, `msgtype`, `event`).
fn kick_link(s: &mut State, k: u64, bot_id: &str) {
    let req_id = hex(&rand_bytes(s, 16));
    let body = json!({"msgid": hex(&rand_bytes(s, 16)), "create_time": now_ms() / 1000, "aibotid": bot_id,
                      "msgtype": "event", "event": {"eventtype": "disconnected_event"}});
    let frame = json!({"cmd": EVENT_CALLBACK, "headers": {"req_id": req_id}, "body": body});
    let (closes, grace) = (s.kick_closes, s.kick_grace);
    if let Some(l) = s.links.get_mut(&k) {
        l.kicked = true;
        if !l.silent {
            let _ = l.tx.send(Out::Text(frame.to_string()));
        }
        if closes {
            l.close_at = Some(Instant::now() + grace);
        }
    }
    *s.kicks.entry(bot_id.into()).or_default() += 1;
}

/// Sends due delayed answers and closes kicked links whose grace has passed.
fn tick(state: &Shared) {
    let mut s = state.0.lock().unwrap();
    let now = Instant::now();
    let mut changed = false;
    for l in s.links.values_mut() {
        if l.close_at.is_some_and(|t| t <= now) {
            // Chosen: a close frame (1000) before the TCP close.
            let _ = l.tx.send(Out::Close(1000));
            l.close_at = None;
            changed = true;
        }
    }
    while s.delayed.front().is_some_and(|d| d.due.is_some_and(|t| t <= now)) {
        let d = s.delayed.pop_front().unwrap();
        s.in_flight.remove(&d.req_id);
        if let Some(l) = s.links.get(&d.link) {
            let _ = l.tx.send(Out::Text(d.text));
        }
        changed = true;
    }
    drop(s);
    if changed {
        state.1.notify_all();
    }
}

// ---------- the WebSocket side ----------

/// One connection to `/`: any other path is refused with 404 (Chosen; the SDK dials the bare
/// host, `ws.ts` DEFAULT_WS_URL).
#[allow(clippy::result_large_err)] // tungstenite fixes the callback's error type
fn link(state: &Shared, stream: TcpStream, stopped: &AtomicBool) {
    let _ = stream.set_nodelay(true);
    let callback = |req: &tungstenite::handshake::server::Request, resp| {
        if req.uri().path() == "/" {
            Ok(resp)
        } else {
            let mut refused = tungstenite::handshake::server::ErrorResponse::new(Some("not found".into()));
            *refused.status_mut() = tungstenite::http::StatusCode::NOT_FOUND;
            Err(refused)
        }
    };
    let Ok(mut ws) = tungstenite::accept_hdr(stream, callback) else {
        return;
    };
    let (tx, rx) = mpsc::channel::<Out>();
    let k = kit::change(state, |s| {
        s.handshakes += 1;
        s.next_link += 1;
        s.links.insert(
            s.next_link,
            Link {
                tx,
                bot: None,
                kicked: false,
                close_at: None,
                silent: false,
                deaf: false,
            },
        );
        s.next_link
    });
    let _ = ws.get_ref().set_read_timeout(Some(Duration::from_millis(10)));
    let _ = ws.get_ref().set_write_timeout(Some(Duration::from_secs(10)));
    socket_loop(&mut ws, &rx, stopped, |heard| {
        if let Heard::Text(t) = heard {
            kit::change(state, |s| on_client_text(s, k, t));
        }
    });
    kit::change(state, |s| {
        s.links.remove(&k);
        s.delayed.retain(|d| d.link != k);
    });
}

/// Records a client frame and answers it as WeCom does (`ws.ts` handleFrame is the other side).
fn on_client_text(s: &mut State, k: u64, text: &str) {
    let mut v: Value = serde_json::from_str(text).unwrap_or_else(|_| json!(text));
    if let Some(d) = v.pointer_mut("/body/base64_data") {
        let n = d.as_str().map_or(0, str::len);
        let raw = std::mem::replace(d, json!(format!("<{n} base64 chars>")));
        v["_data"] = raw; // kept only until the chunk is handled
    }
    let cmd = v["cmd"].as_str().unwrap_or_default().to_string();
    let req_id = v["headers"]["req_id"].as_str().unwrap_or_default().to_string();
    let data = v.as_object_mut().and_then(|o| o.remove("_data"));
    if s.frames.len() >= KEEP_FRAMES {
        s.frames.pop_front();
        s.frames_dropped += 1;
    }
    s.frames
        .push_back(json!({"link": k, "at_ms": now_ms(), "frame": v, "errcode": null}));
    let Some(l) = s.links.get(&k) else { return };
    if l.silent || cmd.is_empty() {
        // A frame with no cmd (an answer to a callback?) gets nothing: callbacks take none.
        return;
    }
    let bot = l.bot.clone();
    if cmd == PING {
        if let Some(b) = bot {
            if s.pings.len() >= KEEP_PINGS {
                s.pings.pop_front();
            }
            s.pings.push_back((b, now_ms()));
        }
        // Chosen: a ping is answered also before subscribe.
        return answer(s, k, &req_id, 0, "ok", None, false);
    }
    if cmd == SUBSCRIBE {
        return subscribe(s, k, &req_id, &v["body"]);
    }
    let Some(bot) = bot else {
        return answer(
            s,
            k,
            &req_id,
            NOT_SUBSCRIBED,
            "aibot websocket not subscribed",
            None,
            false,
        );
    };
    let replying = cmd.starts_with("aibot_respond") || cmd == SEND_MSG || cmd.starts_with("aibot_upload");
    if replying && !s.in_flight.insert(req_id.clone()) {
        s.overlaps.push(req_id.clone());
    }
    if let Some(i) = s.faults.iter().position(|f| f.0 == cmd) {
        let (_, code, msg) = s.faults.remove(i).unwrap();
        return answer(s, k, &req_id, code, &msg, None, replying);
    }
    let (code, msg, body) = match cmd.as_str() {
        RESPOND | RESPOND_WELCOME | RESPOND_UPDATE => respond(s, &bot, &cmd, &req_id, &v["body"]),
        SEND_MSG => send_msg(s, &bot, &v["body"]),
        UPLOAD_INIT => upload_init(s, &bot, &v["body"]),
        UPLOAD_CHUNK => upload_chunk(s, &bot, &v["body"], data),
        UPLOAD_FINISH => upload_finish(s, &bot, &v["body"]),
        // Chosen: an unknown command is a bad parameter.
        _ => (INVALID_PARAM, "unknown cmd".into(), None),
    };
    answer(s, k, &req_id, code, &msg, body, replying)
}

/// `{headers: {req_id}, errcode, errmsg[, body]}` (`types/api.ts` WsFrame: answers have no cmd),
/// now or after the ack delay for replies.
fn answer(s: &mut State, k: u64, req_id: &str, code: i64, msg: &str, body: Option<Value>, delayable: bool) {
    let mut a = json!({"headers": {"req_id": req_id}, "errcode": code, "errmsg": msg});
    if let Some(b) = body {
        a["body"] = b;
    }
    if let Some(f) = s.frames.back_mut() {
        f["errcode"] = json!(code);
    }
    let delay = if delayable { s.ack_delay } else { Some(Duration::ZERO) };
    match delay {
        Some(d) if d.is_zero() => {
            s.in_flight.remove(req_id);
            if let Some(l) = s.links.get(&k) {
                let _ = l.tx.send(Out::Text(a.to_string()));
            }
        }
        due => s.delayed.push_back(Delayed {
            link: k,
            due: due.map(|d| Instant::now() + d),
            req_id: req_id.into(),
            text: a.to_string(),
        }),
    }
}

/// `aibot_subscribe {bot_id, secret, scene?, plug_version?}` (`ws.ts` sendAuth, `client.ts`).
/// A success kicks the robot's other links: one connection per robot.
fn subscribe(s: &mut State, k: u64, req_id: &str, body: &Value) {
    let bot_id = body["bot_id"].as_str().unwrap_or_default().to_string();
    let secret = body["secret"].as_str().unwrap_or_default();
    let code = match s.robots.iter().find(|r| r.bot_id == bot_id) {
        None => INVALID_BOT_ID,
        Some(r) if r.secret != secret => INVALID_SECRET,
        Some(_) => 0,
    };
    if code != 0 {
        s.auth_failures.push((bot_id, code));
        // Chosen: the link stays open, unsubscribed (the SDK closes it itself, `ws.ts`).
        return answer(s, k, req_id, code, "invalid credential", None, false);
    }
    let others: Vec<u64> = s
        .links
        .iter()
        .filter(|(o, l)| **o != k && l.bot.as_deref() == Some(bot_id.as_str()) && !l.kicked)
        .map(|(o, _)| *o)
        .collect();
    for o in others {
        kick_link(s, o, &bot_id);
    }
    if let Some(l) = s.links.get_mut(&k) {
        l.bot = Some(bot_id.clone());
    }
    *s.subscribes.entry(bot_id).or_default() += 1;
    answer(s, k, req_id, 0, "ok", None, false);
}

type Verdict = (i64, String, Option<Value>);

fn ok() -> Verdict {
    (0, "ok".into(), None)
}

fn bad(code: i64, msg: &str) -> Verdict {
    (code, msg.into(), None)
}

/// Replies on a pushed req_id: known to this robot, inside its window (6 minutes, 5 s for
/// welcome and card updates), a stream's content ≤ 20480 bytes, media by a known media_id.
fn respond(s: &mut State, bot: &str, cmd: &str, req_id: &str, body: &Value) -> Verdict {
    let Some(i) = s.issued.get(req_id).filter(|i| i.bot == bot) else {
        return bad(INVALID_REQ_ID, "invalid req_id");
    };
    let window = if cmd == RESPOND { s.window } else { s.event_window };
    if i.at.elapsed() > window {
        return bad(STREAM_EXPIRED, "stream message update expired");
    }
    if cmd == RESPOND_WELCOME && !i.event {
        return bad(INVALID_REQ_ID, "invalid req_id");
    }
    if let Some(c) = body["stream"]["content"].as_str() {
        if c.len() > MAX_STREAM_BYTES {
            return bad(INVALID_PARAM, "stream content exceeds 20480 bytes");
        }
    }
    media_check(s, body)
}

/// A media body's `media_id` must come from a finished upload.
fn media_check(s: &State, body: &Value) -> Verdict {
    if let Some(k @ ("file" | "image" | "voice" | "video")) = body["msgtype"].as_str() {
        let id = body[k]["media_id"].as_str().unwrap_or_default();
        if !s.media_ids.contains_key(id) {
            return bad(INVALID_MEDIA_ID, "invalid media_id");
        }
    }
    ok()
}

/// `aibot_send_msg {chatid, msgtype, …}` (`client.ts` sendMessage): markdown, template_card or
/// media; text refused with 40008; only to a user or group that wrote to the robot.
fn send_msg(s: &mut State, bot: &str, body: &Value) -> Verdict {
    match body["msgtype"].as_str() {
        Some("markdown" | "template_card" | "file" | "image" | "voice" | "video") => {}
        _ => return bad(INVALID_MSGTYPE, "invalid message type"),
    }
    let chatid = body["chatid"].as_str().unwrap_or_default();
    if !s.talked.get(bot).is_some_and(|t| t.contains(chatid)) {
        return bad(NOT_ACTIVATED, "chat has not talked to the robot");
    }
    media_check(s, body)
}

/// The official plugin's limits per type (`src/const.ts`): image and video 10 MB, voice 2 MB,
/// file 20 MB.
fn type_limit(kind: &str) -> Option<u64> {
    match kind {
        "image" | "video" => Some(10 << 20),
        "voice" => Some(2 << 20),
        "file" => Some(20 << 20),
        _ => None,
    }
}

/// `{type, filename, total_size, total_chunks, md5}` → `body.upload_id` (`client.ts` uploadMedia).
fn upload_init(s: &mut State, bot: &str, body: &Value) -> Verdict {
    let kind = body["type"].as_str().unwrap_or_default().to_string();
    let (total_size, total_chunks) = (body["total_size"].as_u64(), body["total_chunks"].as_u64());
    let (Some(limit), Some(size), Some(n)) = (type_limit(&kind), total_size, total_chunks) else {
        return bad(INVALID_PARAM, "bad upload init");
    };
    if n == 0 || n > MAX_CHUNKS || size > limit || size > n * MAX_CHUNK_BYTES as u64 {
        return bad(INVALID_PARAM, "upload too large");
    }
    let id = hex(&rand_bytes(s, 16));
    s.uploads.insert(
        id.clone(),
        Upload {
            bot: bot.into(),
            kind,
            filename: body["filename"].as_str().unwrap_or_default().into(),
            total_size: size,
            total_chunks: n,
            md5: body["md5"].as_str().unwrap_or_default().into(),
            chunks: BTreeMap::new(),
        },
    );
    (0, "ok".into(), Some(json!({"upload_id": id})))
}

/// `{upload_id, chunk_index, base64_data}`: ≤ 512 KiB decoded, index in range.
fn upload_chunk(s: &mut State, bot: &str, body: &Value, data: Option<Value>) -> Verdict {
    let base = s.chunk_base;
    let Some(u) = s
        .uploads
        .get_mut(body["upload_id"].as_str().unwrap_or_default())
        .filter(|u| u.bot == bot)
    else {
        return bad(INVALID_PARAM, "invalid upload_id");
    };
    let bytes = base64_decode(data.as_ref().and_then(Value::as_str).unwrap_or_default());
    match body["chunk_index"].as_u64() {
        Some(i) if i >= base && i < base + u.total_chunks && bytes.len() <= MAX_CHUNK_BYTES => {
            u.chunks.insert(i, bytes);
            ok()
        }
        _ => bad(INVALID_PARAM, "bad chunk"),
    }
}

/// `{upload_id}` → `body {type, media_id, created_at}`: every chunk there, `total_size` bytes.
fn upload_finish(s: &mut State, bot: &str, body: &Value) -> Verdict {
    let id = body["upload_id"].as_str().unwrap_or_default();
    let complete = s.uploads.get(id).filter(|u| u.bot == bot).is_some_and(|u| {
        u.chunks.len() as u64 == u.total_chunks && u.chunks.values().map(Vec::len).sum::<usize>() as u64 == u.total_size
    });
    if !complete {
        return bad(INVALID_PARAM, "upload incomplete");
    }
    let u = s.uploads.remove(id).unwrap();
    let bytes: Vec<u8> = u.chunks.into_values().flatten().collect();
    let media_id = format!("3{}", hex(&rand_bytes(s, 20)));
    if s.uploaded_order.len() >= KEEP_UPLOADED {
        if let Some(old) = s.uploaded_order.pop_front() {
            if let Some(m) = s.media_ids.get_mut(&old) {
                m.1 = None;
            }
        }
    }
    s.media_ids.insert(media_id.clone(), (u.kind.clone(), Some(bytes)));
    s.uploaded_order.push_back(media_id.clone());
    // Chosen: created_at as a string of seconds (`types/api.ts` types it as a string).
    let created = (now_ms() / 1000).to_string();
    (
        0,
        "ok".into(),
        Some(json!({"type": u.kind, "media_id": media_id, "created_at": created})),
    )
}

// ---------- the HTTP side ----------

/// `GET /media/<id>`: the encrypted bytes with `Content-Disposition: attachment;
/// filename*=UTF-8''…` (the form `api.ts` downloadFileRaw looks for first). An unknown or
/// expired URL: 404 (Chosen). `POST /cgi-bin/aibot/response?response_code=…`: docs 101138,
/// once per URL, for an hour.
fn serve(state: &Shared, stopped: &Arc<AtomicBool>, mut req: tiny_http::Request) {
    let url = req.url().to_string();
    let mut body = Vec::new();
    let _ = req.as_reader().take(1 << 20).read_to_end(&mut body);
    if let Some(code) = url.strip_prefix("/cgi-bin/aibot/response?response_code=") {
        let errcode = kit::change(state, |s| {
            let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let errcode = match s.response_urls.get_mut(code) {
                Some(r) if !r.2 && r.1.elapsed() < Duration::from_secs(3600) => {
                    r.2 = true;
                    0
                }
                // Chosen: WeCom's "invalid parameter" for a used, expired or unknown URL.
                _ => INVALID_PARAM,
            };
            s.response_posts
                .push(json!({"response_code": code, "body": v, "errcode": errcode}));
            errcode
        });
        let text = json!({"errcode": errcode, "errmsg": if errcode == 0 { "ok" } else { "invalid response_code" }});
        let _ = req.respond(tiny_http::Response::from_string(text.to_string()));
        return;
    }
    let id = url.strip_prefix("/media/").unwrap_or_default().to_string();
    let (mode, found) = kit::change(state, |s| {
        let ttl = s.media_ttl;
        let found = s
            .media
            .get(&id)
            .filter(|m| m.at.elapsed() <= ttl)
            .map(|m| (m.cipher.clone(), m.filename.clone()));
        let status = match (s.download, &found) {
            (Download::Status(c), _) => c,
            (_, None) => 404,
            _ => 200,
        };
        s.downloads.push(json!({"id": id, "status": status, "at_ms": now_ms()}));
        (s.download, found)
    });
    let (cipher, filename) = match (mode, found) {
        (Download::Status(c), _) => {
            let _ = req.respond(tiny_http::Response::empty(c));
            return;
        }
        (_, None) => {
            let _ = req.respond(tiny_http::Response::empty(404));
            return;
        }
        (_, Some(f)) => f,
    };
    let disposition = format!("attachment; filename*=UTF-8''{}", pct(&filename));
    let headers = vec![
        tiny_http::Header::from_bytes("Content-Disposition", disposition).unwrap(),
        tiny_http::Header::from_bytes("Content-Type", "application/octet-stream").unwrap(),
    ];
    if mode == Download::Endless {
        let r = tiny_http::Response::new(200.into(), headers, Endless(stopped.clone()), None, None);
        let _ = req.respond(r);
        return;
    }
    let len = cipher.len();
    let r = tiny_http::Response::new(200.into(), headers, std::io::Cursor::new(cipher), Some(len), None);
    let _ = req.respond(r);
}

/// A body that never ends: 1 KiB every 20 ms until the simulator stops.
struct Endless(Arc<AtomicBool>);

impl Read for Endless {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.0.load(Ordering::Relaxed) {
            return Ok(0);
        }
        std::thread::sleep(Duration::from_millis(20));
        let n = buf.len().min(1024);
        buf[..n].fill(0x5a);
        Ok(n)
    }
}

/// RFC 5987 percent-encoding of a file name.
fn pct(name: &str) -> String {
    name.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'.' | b'-' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

// ---------- ids ----------

fn rand_bytes(s: &mut State, n: usize) -> Vec<u8> {
    (0..n.div_ceil(8))
        .flat_map(|_| {
            s.next_id += 1;
            let mut h = RandomState::new().build_hasher();
            h.write_u64(s.next_id);
            h.finish().to_le_bytes()
        })
        .take(n)
        .collect()
}

// ---------- self-checks: a tiny client of tungstenite + ureq speaking as the SDK does ----------

#[cfg(test)]
mod selfcheck {
    use super::*;
    use aes::cipher::BlockDecrypt;
    use tungstenite::{Message, WebSocket};

    // Generous: a bound on a wait for progress, reached only when something is wrong.
    const WAIT: Duration = Duration::from_secs(15);
    type Ws = WebSocket<TcpStream>;

    fn connect(sim: &WecomSim) -> Ws {
        let stream = TcpStream::connect(sim.ws_url.trim_start_matches("ws://")).unwrap();
        stream.set_read_timeout(Some(WAIT)).unwrap();
        tungstenite::client(sim.ws_url.as_str(), stream).unwrap().0
    }

    fn send(ws: &mut Ws, v: Value) {
        ws.send(Message::Text(v.to_string().into())).unwrap();
    }

    /// The next text frame; None when the link closed.
    fn next(ws: &mut Ws) -> Option<Value> {
        loop {
            match ws.read() {
                Ok(Message::Text(t)) => return Some(serde_json::from_str(t.as_str()).unwrap()),
                Ok(Message::Close(_)) | Err(_) => return None,
                Ok(_) => {}
            }
        }
    }

    /// Sends `{cmd, headers: {req_id}, body}` and reads up to its answer (a frame with no cmd).
    fn call(ws: &mut Ws, cmd: &str, req_id: &str, body: Value) -> Value {
        send(ws, json!({"cmd": cmd, "headers": {"req_id": req_id}, "body": body}));
        loop {
            let f = next(ws).expect("an answer");
            if f.get("cmd").is_none() && f["headers"]["req_id"] == req_id {
                return f;
            }
        }
    }

    fn subscribe(ws: &mut Ws, bot: &str, secret: &str) -> i64 {
        let id = format!("{SUBSCRIBE}_{}_0badcafe", now_ms());
        call(ws, SUBSCRIBE, &id, json!({"bot_id": bot, "secret": secret})).code()
    }

    trait Code {
        fn code(&self) -> i64;
    }
    impl Code for Value {
        fn code(&self) -> i64 {
            self["errcode"].as_i64().unwrap()
        }
    }

    fn stream(id: &str, content: &str, finish: bool) -> Value {
        json!({"msgtype": "stream", "stream": {"id": id, "finish": finish, "content": content}})
    }

    /// The SDK's decryptFile (`crypto.ts`, `crypto_utils.py`): key from base64 (padding
    /// restored), IV = key[..16], AES-256-CBC, PKCS#7 with pad 1..=32.
    fn decrypt(aeskey: &str, data: &[u8]) -> Vec<u8> {
        let padded = format!("{aeskey}{}", "=".repeat((4 - aeskey.len() % 4) % 4));
        let key = base64_decode(&padded);
        let cipher = Aes256::new(GenericArray::from_slice(&key));
        let mut prev: Vec<u8> = key[..16].to_vec();
        let mut out = Vec::new();
        for block in data.chunks(16) {
            let mut b = GenericArray::clone_from_slice(block);
            cipher.decrypt_block(&mut b);
            out.extend(b.iter().zip(&prev).map(|(x, p)| x ^ p));
            prev = block.to_vec();
        }
        let pad = *out.last().unwrap() as usize;
        assert!((1..=32).contains(&pad) && out[out.len() - pad..].iter().all(|b| *b as usize == pad));
        out.truncate(out.len() - pad);
        out
    }

    fn get(url: &str) -> (u16, Option<String>, Vec<u8>) {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(5)))
            .build()
            .into();
        let mut r = agent.get(url).call().unwrap();
        let cd = r
            .headers()
            .get("content-disposition")
            .map(|v| v.to_str().unwrap().to_string());
        (r.status().as_u16(), cd, r.body_mut().read_to_vec().unwrap())
    }

    /// subscribe (errors, then right) → ping → callbacks single and group → stream replies one at
    /// a time → reply errors → proactive sends → a second link kicks the first.
    #[test]
    fn subscribe_callbacks_replies_and_kick() {
        let sim = WecomSim::start();
        sim.robot("bot1", "secret1");
        let mut a = connect(&sim);
        assert_eq!(subscribe(&mut a, "bot1", "wrong"), INVALID_SECRET);
        assert_eq!(subscribe(&mut a, "nobot", "secret1"), INVALID_BOT_ID);
        let early = call(
            &mut a,
            SEND_MSG,
            "aibot_send_msg_1_x",
            json!({"chatid": "u", "msgtype": "markdown"}),
        );
        assert_eq!(early.code(), NOT_SUBSCRIBED);
        assert_eq!(subscribe(&mut a, "bot1", "secret1"), 0);
        assert!(sim.wait_subscribes("bot1", 1, WAIT));
        assert_eq!(sim.auth_failures().len(), 2);

        let pong = call(&mut a, PING, "ping_1_abc", Value::Null);
        assert_eq!((pong.code(), pong.get("cmd")), (0, None), "{pong}");
        assert_eq!(sim.pings("bot1").len(), 1);

        let single = Chat::single("zhangsan");
        let p = sim.send_text("bot1", &single, "hello");
        assert!(p.delivered);
        let f = next(&mut a).unwrap();
        assert_eq!(
            (f["cmd"].as_str(), f["headers"]["req_id"].as_str()),
            (Some(MSG_CALLBACK), Some(p.req_id.as_str()))
        );
        let b = &f["body"];
        assert_eq!(
            (b["chattype"].as_str(), b["from"]["userid"].as_str()),
            (Some("single"), Some("zhangsan"))
        );
        assert!(b.get("chatid").is_none(), "one-to-one callbacks carry no chatid: {b}");
        assert_eq!(
            (b["msgtype"].as_str(), b["text"]["content"].as_str()),
            (Some("text"), Some("hello"))
        );
        assert_eq!(
            (b["aibotid"].as_str(), b["msgid"].as_str()),
            (Some("bot1"), Some(p.msgid.as_str()))
        );

        let group = Chat::group("wrgroup1", "lisi");
        let g = sim.send_voice("bot1", &group, "说的话");
        let f = next(&mut a).unwrap();
        assert_eq!(
            (f["body"]["chattype"].as_str(), f["body"]["chatid"].as_str()),
            (Some("group"), Some("wrgroup1"))
        );
        assert_eq!(f["body"]["voice"]["content"], "说的话");

        // One frame at a time on the callback's req_id, each after its answer.
        for (i, (content, finish)) in [("he", false), ("hello", false), ("hello **world**", true)]
            .into_iter()
            .enumerate()
        {
            let a1 = call(&mut a, RESPOND, &p.req_id, stream("s1", content, finish));
            assert_eq!(a1.code(), 0, "frame {i}: {a1}");
        }
        assert!(sim.wait_finished(&p.req_id, WAIT));
        let r = sim.replies(&p.req_id);
        let contents: Vec<_> = r
            .iter()
            .map(|f| f["frame"]["body"]["stream"]["content"].as_str().unwrap())
            .collect();
        assert_eq!(contents, ["he", "hello", "hello **world**"]);
        assert!(sim.overlaps().is_empty());
        let big = "x".repeat(MAX_STREAM_BYTES + 1);
        assert_eq!(
            call(&mut a, RESPOND, &g.req_id, stream("s2", &big, true)).code(),
            INVALID_PARAM
        );
        assert_eq!(
            call(&mut a, RESPOND, "made_up", stream("s3", "x", true)).code(),
            INVALID_REQ_ID
        );

        let md = |chatid: &str| json!({"chatid": chatid, "msgtype": "markdown", "markdown": {"content": "**hi**"}});
        assert_eq!(call(&mut a, SEND_MSG, "aibot_send_msg_2_x", md("zhangsan")).code(), 0);
        assert_eq!(call(&mut a, SEND_MSG, "aibot_send_msg_3_x", md("wrgroup1")).code(), 0);
        assert_eq!(
            call(&mut a, SEND_MSG, "aibot_send_msg_4_x", md("stranger")).code(),
            NOT_ACTIVATED
        );
        let text = json!({"chatid": "zhangsan", "msgtype": "text", "text": {"content": "hi"}});
        assert_eq!(
            call(&mut a, SEND_MSG, "aibot_send_msg_5_x", text).code(),
            INVALID_MSGTYPE
        );
        assert_eq!(sim.frames_of(SEND_MSG).len(), 5);

        // A second link for the robot: the first gets disconnected_event, then is closed.
        let mut b2 = connect(&sim);
        assert_eq!(subscribe(&mut b2, "bot1", "secret1"), 0);
        let ev = next(&mut a).unwrap();
        assert_eq!(
            (ev["cmd"].as_str(), ev["body"]["event"]["eventtype"].as_str()),
            (Some(EVENT_CALLBACK), Some("disconnected_event"))
        );
        assert!(next(&mut a).is_none(), "the kicked link is closed");
        assert_eq!((sim.kicks("bot1"), sim.subscribes("bot1")), (1, 2));
        assert!(sim.wait_open_links("bot1", 1, WAIT));
        let p2 = sim.send_text("bot1", &single, "again");
        assert_eq!(next(&mut b2).unwrap()["headers"]["req_id"], p2.req_id.as_str());

        // Outside the window: 846608.
        sim.set_reply_window(Duration::ZERO);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(
            call(&mut b2, RESPOND, &p2.req_id, stream("s4", "late", true)).code(),
            STREAM_EXPIRED
        );
    }

    /// Media: served encrypted as the SDK decrypts it, named by Content-Disposition; mixed and
    /// file callbacks; an upload init/chunk/finish whose media_id a send then names.
    #[test]
    fn media_downloads_and_uploads() {
        let sim = WecomSim::start();
        sim.robot("bot1", "secret1");
        let mut a = connect(&sim);
        assert_eq!(subscribe(&mut a, "bot1", "secret1"), 0);
        let chat = Chat::single("wangwu");

        let png: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let p = sim.send_image("bot1", &chat, &png, "图 1.png");
        let f = next(&mut a).unwrap();
        let (url, key) = (
            f["body"]["image"]["url"].as_str().unwrap(),
            f["body"]["image"]["aeskey"].as_str().unwrap(),
        );
        assert_eq!((url, key), (p.media[0].0.as_str(), p.media[0].1.as_str()));
        assert_eq!(key.len(), 43);
        let (status, cd, body) = get(url);
        assert_eq!(status, 200);
        assert_eq!(body.len() % 32, 0, "padded to 32 bytes");
        assert_eq!(decrypt(key, &body), png);
        let cd = cd.unwrap();
        let name = cd.split("filename*=UTF-8''").nth(1).unwrap();
        assert_eq!(kit::url_decode(name), "图 1.png");
        assert_eq!(decrypt(key, &encrypt(key, &[7u8; 32])), [7u8; 32]);
        assert_eq!(encrypt(key, &[7u8; 32]).len(), 64, "a whole block of padding");

        let m = sim.send_mixed(
            "bot1",
            &chat,
            &[
                Part::Text("看图"),
                Part::Image {
                    bytes: b"jpg",
                    filename: "a.jpg",
                },
            ],
        );
        let f = next(&mut a).unwrap();
        let items = f["body"]["mixed"]["msg_item"].as_array().unwrap();
        assert_eq!(
            (items[0]["text"]["content"].as_str(), items[1]["msgtype"].as_str()),
            (Some("看图"), Some("image"))
        );
        assert_eq!(decrypt(&m.media[0].1, &get(&m.media[0].0).2), b"jpg");
        sim.send_file("bot1", &chat, b"%PDF-1.4", "r.pdf");
        assert_eq!(next(&mut a).unwrap()["body"]["msgtype"], "file");

        // Upload: 600 KiB in two chunks (0-based, as the SDK sends them).
        let data: Vec<u8> = (0..600 * 1024u32).map(|i| (i % 251) as u8).collect();
        let init = call(
            &mut a,
            UPLOAD_INIT,
            "aibot_upload_media_init_1_x",
            json!({"type": "file", "filename": "big.bin", "total_size": data.len(), "total_chunks": 2, "md5": "m"}),
        );
        let upload_id = init["body"]["upload_id"].as_str().unwrap().to_string();
        let too_big = kit::base64(&vec![0u8; MAX_CHUNK_BYTES + 1]);
        let c = call(
            &mut a,
            UPLOAD_CHUNK,
            "aibot_upload_media_chunk_0_x",
            json!({"upload_id": upload_id, "chunk_index": 0, "base64_data": too_big}),
        );
        assert_eq!(c.code(), INVALID_PARAM);
        for (i, part) in data.chunks(MAX_CHUNK_BYTES).enumerate() {
            let c = call(
                &mut a,
                UPLOAD_CHUNK,
                &format!("aibot_upload_media_chunk_{i}_y"),
                json!({"upload_id": upload_id, "chunk_index": i, "base64_data": kit::base64(part)}),
            );
            assert_eq!(c.code(), 0, "{c}");
        }
        let fin = call(
            &mut a,
            UPLOAD_FINISH,
            "aibot_upload_media_finish_1_x",
            json!({"upload_id": upload_id}),
        );
        assert_eq!((fin.code(), fin["body"]["type"].as_str()), (0, Some("file")), "{fin}");
        let media_id = fin["body"]["media_id"].as_str().unwrap();
        assert_eq!(sim.uploaded(media_id).unwrap(), data);
        let send = |id: &str| json!({"chatid": "wangwu", "msgtype": "file", "file": {"media_id": id}});
        assert_eq!(call(&mut a, SEND_MSG, "aibot_send_msg_1_x", send(media_id)).code(), 0);
        assert_eq!(
            call(&mut a, SEND_MSG, "aibot_send_msg_2_x", send("nope")).code(),
            INVALID_MEDIA_ID
        );
        assert!(sim
            .frames_of(UPLOAD_CHUNK)
            .iter()
            .all(|f| f["frame"]["body"]["base64_data"].as_str().unwrap().starts_with('<')));

        // An endless download: headers, then bytes that keep coming.
        sim.set_download(Download::Endless);
        let mut s = TcpStream::connect(sim.http_base.trim_start_matches("http://")).unwrap();
        let path = p.media[0].0.trim_start_matches(&sim.http_base).to_string();
        let head = crate::common::send_and_read_head(
            &mut s,
            format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes(),
            WAIT,
        );
        assert!(
            head.starts_with("HTTP/1.1 200") && !head.to_ascii_lowercase().contains("content-length"),
            "{head}"
        );
        let mut got = 0;
        let mut buf = [0u8; 4096];
        while got < 8192 {
            got += s.read(&mut buf).unwrap();
        }
        drop(s);
        sim.set_download(Download::Normal);
        sim.set_media_ttl(Duration::ZERO);
        assert_eq!(get(&p.media[0].0).0, 404, "a media URL expires");
    }

    /// The links' knobs: a silent link answers nothing, a deaf one answers pings but delivers
    /// nothing; delayed answers show a second frame sent early; faults; a kick that stays open.
    #[test]
    fn silent_deaf_delayed_and_faults() {
        let sim = WecomSim::start();
        sim.robot("bot1", "secret1");
        let chat = Chat::single("zhaoliu");
        let mut a = connect(&sim);
        assert_eq!(subscribe(&mut a, "bot1", "secret1"), 0);
        sim.go_silent("bot1");
        send(&mut a, json!({"cmd": PING, "headers": {"req_id": "ping_2_x"}}));
        assert!(!sim.send_text("bot1", &chat, "lost").delivered);
        a.get_ref().set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        assert!(next(&mut a).is_none(), "a silent link answers nothing");
        assert!(sim.wait_frames(PING, 1, WAIT), "but hears");

        let mut b = connect(&sim);
        assert_eq!(subscribe(&mut b, "bot1", "secret1"), 0);
        sim.go_deaf("bot1");
        assert_eq!(call(&mut b, PING, "ping_3_x", Value::Null).code(), 0);
        assert!(!sim.send_text("bot1", &chat, "lost too").delivered);
        assert_eq!(sim.lost(), 2);

        let mut c = connect(&sim);
        assert_eq!(subscribe(&mut c, "bot1", "secret1"), 0);
        let p = sim.send_text("bot1", &chat, "hi");
        assert_eq!(next(&mut c).unwrap()["headers"]["req_id"], p.req_id.as_str());
        sim.set_ack_delay(Some(Duration::from_millis(300)));
        send(
            &mut c,
            json!({"cmd": RESPOND, "headers": {"req_id": p.req_id}, "body": stream("s", "a", false)}),
        );
        send(
            &mut c,
            json!({"cmd": RESPOND, "headers": {"req_id": p.req_id}, "body": stream("s", "ab", true)}),
        );
        assert!(sim.wait_frames(RESPOND, 2, WAIT));
        assert_eq!(sim.overlaps(), std::slice::from_ref(&p.req_id));
        assert_eq!(next(&mut c).unwrap().code(), 0);
        assert_eq!(next(&mut c).unwrap().code(), 0);
        sim.set_ack_delay(Some(Duration::ZERO));

        sim.fail_next(SEND_MSG, 45_009, "api freq out of limit");
        let md = json!({"chatid": "zhaoliu", "msgtype": "markdown", "markdown": {"content": "x"}});
        assert_eq!(call(&mut c, SEND_MSG, "aibot_send_msg_6_x", md.clone()).code(), 45_009);
        assert_eq!(call(&mut c, SEND_MSG, "aibot_send_msg_7_x", md).code(), 0);

        sim.set_kick_closes(false);
        assert!(sim.kick("bot1"));
        assert_eq!(
            next(&mut c).unwrap()["body"]["event"]["eventtype"],
            "disconnected_event"
        );
        assert_eq!(
            call(&mut c, PING, "ping_4_x", Value::Null).code(),
            0,
            "a half-alive kicked link"
        );
        assert!(!sim.send_text("bot1", &chat, "nobody").delivered);
    }
}
