//! A Discord simulator written from Discord's public documentation (`discord/discord-api-docs`,
//! files under `developers/`), not from imgate's code; discord.py (`discord/gateway.py`) was read
//! where the docs are silent. Sources:
//!
//! - `events/gateway.mdx`: the connection lifecycle; Hello's `heartbeat_interval`; heartbeats
//!   answered by op 11; Identify (token, intents, properties), max_concurrency per 5 s (else op 9),
//!   the daily session start limit (then every session ends and the token is reset); Ready's
//!   `session_id` and `resume_gateway_url`; Resume replays the missed events in order and ends with
//!   RESUMED; a client close with 1000/1001 invalidates the session, a bare TCP close keeps it "a
//!   few minutes"; intents (invalid → 4013, privileged not enabled → 4014); the message content
//!   intent and its exceptions (the app's own messages, DMs, mentions of the app); client payloads
//!   ≤ 4096 bytes (else 4002); `GET /gateway/bot` and the session start limit object.
//! - `events/gateway-events.mdx`: the payload structure (`s`, `t` null unless op 0); Identify,
//!   Resume, Heartbeat; Ready's fields; Reconnect (op 7); Invalid Session (op 9, `d` = resumable);
//!   MESSAGE_CREATE's extra fields (`guild_id`, `member`, `mentions`), MESSAGE_UPDATE (same shape),
//!   MESSAGE_DELETE (`id`, `channel_id`, `guild_id?`), TYPING_START, GUILD_CREATE after READY.
//! - `topics/opcodes-and-status-codes.mdx`: opcodes, close codes 4000–4014, HTTP statuses, JSON
//!   error codes (10003, 40005, 50001, 50006, 50013, 50035, 50109, 160002).
//! - `resources/message.mdx`: the message, attachment and message reference objects; Get Channel
//!   Messages (newest first, limit 1–100 default 50, before/after exclusive, "no messages" without
//!   READ_MESSAGE_HISTORY); Create Message (content ≤ 2000, `files[n]` + `payload_json`,
//!   `attachments` metadata, 25 MiB requests, replies need READ_MESSAGE_HISTORY and an existing
//!   message unless `fail_if_not_exists` is false); the proxy's 415 for non-media; `nonce` (up to 25
//!   characters) with `enforce_nonce` (a repeated nonce of the same author within "the past few
//!   minutes" returns the earlier message and creates none).
//! - `resources/application.mdx`: Get Current Application (`GET /applications/@me`), the
//!   application object and its flags (GATEWAY_MESSAGE_CONTENT `1 << 18` and the like).
//! - `resources/channel.mdx`: the channel object and types (0 GUILD_TEXT, 1 DM); Trigger Typing
//!   Indicator (204, fires TYPING_START).
//! - `topics/rate-limits.mdx`: 429 with `{message, retry_after (float s), global}`, `Retry-After`,
//!   `X-RateLimit-{Limit,Remaining,Reset,Reset-After,Bucket,Scope,Global}`.
//! - `reference.mdx`: snowflakes (ms since 1420070400000 << 22 | worker << 17 | process << 12 |
//!   increment, strings in JSON); `Authorization: Bot TOKEN`; error bodies (`code`, `message`,
//!   `errors._errors`); the Content-Type rule (else 50035); signed attachment CDN URLs (`ex` expiry
//!   and `is` issue time in hex, `hm` signature); uploading files.
//!
//! Shape (as `slack.rs`): tiny_http serves the REST API at `{http}/api/v10/…` and the attachment
//! CDN at `{http}/attachments/…` (`proxy_url`: `{http}/media/attachments/…`); two std listeners +
//! sync tungstenite serve the Gateway (the `/gateway/bot` URL) and the `resume_gateway_url` (another
//! port, so tests can tell which one a client used), one thread per socket. Everything lives in one
//! `State` behind a mutex with a condvar, so tests wait on conditions (`wait_until` over `Records`).
//! Settings are `Knobs`; Gateway misbehaviour is `gateway(Gw::…)`; REST faults are `fault(…)`, the
//! bot's global rate limit for a while `global_limit(…)`.
//! Choices where the sources are silent are marked "Chosen:". All the sim reads or keeps is bounded.
//! Not simulated: sharding, compression/ETF, the 120-per-minute Gateway send limit, closing
//! clients that stop heartbeating, `around`, form-urlencoded bodies, the `_LIMITED` application
//! flags of apps in fewer than 100 servers (Chosen: the full flags, as for a verified app).

use std::collections::{HashMap, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use super::kit::{self, multipart, now_ms, socket_loop, Heard, Out, Part};
use tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tungstenite::protocol::WebSocketConfig;
use tungstenite::{Message, WebSocket};

pub const DISCORD_EPOCH: u64 = 1_420_070_400_000;
/// The bot token a new simulator accepts (token-shaped; `Knobs::token` changes it).
pub const BOT_TOKEN: &str = "MTA5ODc2NTQzMjEwOTg3NjU0.GsimTk.discord-simulator-bot-token-000";

// Gateway intents (gateway.mdx, "List of Intents").
pub const GUILDS: u64 = 1 << 0;
pub const GUILD_MEMBERS: u64 = 1 << 1;
pub const GUILD_PRESENCES: u64 = 1 << 8;
pub const GUILD_MESSAGES: u64 = 1 << 9;
pub const GUILD_MESSAGE_TYPING: u64 = 1 << 11;
pub const DIRECT_MESSAGES: u64 = 1 << 12;
pub const DIRECT_MESSAGE_TYPING: u64 = 1 << 14;
pub const MESSAGE_CONTENT: u64 = 1 << 15;
const PRIVILEGED: u64 = GUILD_MEMBERS | GUILD_PRESENCES | MESSAGE_CONTENT;
/// Bits 0–16, 20, 21, 24, 25: every intent the list defines.
const VALID_INTENTS: u64 = 0x1_FFFF | (1 << 20) | (1 << 21) | (1 << 24) | (1 << 25);
/// Server closes after which the session cannot be resumed (1000/1001: gateway.mdx "Initiating a
/// Disconnect", discord-api-docs#2922; the others: their close-code rows say to start anew).
const INVALIDATING: [u16; 9] = [1000, 1001, 4004, 4007, 4009, 4011, 4012, 4013, 4014];

const MAX_CLIENT_PAYLOAD: usize = 4096;
const MAX_WS_MESSAGE: usize = 64 * 1024;
const MAX_BODY: usize = 25 * 1024 * 1024;
/// Chosen: a session keeps its last 1000 dispatches for replay; an older `seq` gets op 9.
const MAX_REPLAY: usize = 1000;
const MAX_RECORDS: usize = 10_000;
/// Chosen: Discord's 10 attachments per message; 64 multipart parts.
const MAX_FILES: usize = 10;
const MAX_PARTS: usize = 64;

/// A Discord user (a person, or a bot when `bot`).
#[derive(Clone, Debug, Default)]
pub struct User {
    pub id: String,
    pub username: String,
    pub bot: bool,
}

/// A message someone other than our bot posts (`DiscordSim::post`).
#[derive(Clone, Debug, Default)]
pub struct UserMsg {
    pub author: User,
    pub content: String,
    /// (filename, content type, bytes)
    pub files: Vec<(String, String, Vec<u8>)>,
    pub reply_to: Option<String>,
    /// Into the channel's history only, no MESSAGE_CREATE (an event the client never got).
    pub skip_gateway: bool,
}

impl UserMsg {
    pub fn text(author: &User, content: &str) -> UserMsg {
        UserMsg {
            author: author.clone(),
            content: content.into(),
            ..Default::default()
        }
    }
    pub fn file(mut self, filename: &str, content_type: &str, bytes: &[u8]) -> UserMsg {
        self.files.push((filename.into(), content_type.into(), bytes.to_vec()));
        self
    }
    pub fn reply_to(mut self, message_id: &str) -> UserMsg {
        self.reply_to = Some(message_id.into());
        self
    }
    pub fn offline(mut self) -> UserMsg {
        self.skip_gateway = true;
        self
    }
}

/// A file our bot uploaded with a message, as it arrived (`filename` as sent, before Discord's
/// sanitising).
#[derive(Clone, Debug)]
pub struct PostedFile {
    pub filename: String,
    pub content_type: String,
    pub description: Option<String>,
    pub bytes: Vec<u8>,
}

/// A message our bot created through `POST /channels/{id}/messages`.
#[derive(Clone, Debug)]
pub struct Posted {
    pub id: String,
    pub channel: String,
    pub content: String,
    /// The message it replies to (when created as a reply, type 19).
    pub reply_to: Option<String>,
    pub files: Vec<PostedFile>,
    pub nonce: Option<Value>,
    /// The JSON body (or `payload_json`, or the form fields) as sent.
    pub payload: Value,
}

/// One REST call: `route` is the template (`/channels/{id}/messages`), `path` the real one.
#[derive(Clone, Debug)]
pub struct Call {
    pub method: String,
    pub route: String,
    pub path: String,
    pub status: u16,
    pub auth: String,
    pub content_type: String,
    /// reference.mdx asks for `DiscordBot ($url, $versionNumber)`; recorded, not enforced.
    pub user_agent: String,
    /// When the call arrived.
    pub at: Instant,
}

/// What the newest open Gateway connection is made to do.
#[derive(Clone, Debug)]
pub enum Gw {
    /// Op 7; the connection stays open for the client to close.
    Reconnect,
    /// Op 9 with `d`; false ends the session (the client may IDENTIFY on the same connection).
    InvalidSession(bool),
    /// Op 1: the client should heartbeat at once.
    RequestHeartbeat,
    /// A close frame; INVALIDATING codes end the session, others leave it resumable.
    Close(u16),
    /// The TCP connection ends without a close frame; the session stays resumable.
    Drop,
    /// Stays open, sends and answers nothing more (a half-open link); events are still logged.
    Silent,
    /// A raw text frame.
    Text(String),
}

/// A REST fault for the next calls of a route.
#[derive(Clone, Debug)]
pub enum Fault {
    /// 429 as rate-limits.mdx shows (user scope with the route's headers, or global).
    RateLimit { retry_after: f64, global: bool },
    /// This status with `{"message": "500: Internal Server Error", "code": 0}` (Chosen).
    Status(u16),
    /// This status and body.
    Body(u16, Value),
    /// The call is carried out, then answered with this status (a proxy that timed out after
    /// Discord acted: the client cannot tell, and tries again).
    Lost(u16),
}

/// Settings; change them with `DiscordSim::knobs`.
#[derive(Clone, Debug, Default)]
pub struct Knobs {
    /// `Bot {token}` on REST, bare in IDENTIFY/RESUME; a new value is a token reset.
    pub token: String,
    /// Hello's value for connections opened from now on (default 45 s, the docs' example).
    pub heartbeat_interval: Duration,
    /// Off: heartbeats are counted but not ACKed (zombie-connection tests).
    pub ack_heartbeats: bool,
    /// How long a session outlives its connection (Chosen: 3 min for "a few minutes").
    pub resume_window: Duration,
    /// Privileged intents toggled on for the app (Chosen default: MESSAGE_CONTENT).
    pub app_intents: u64,
    /// Identifies allowed per `identify_window` (docs: 1 per 5 s); more get op 9 false.
    pub max_concurrency: usize,
    pub identify_window: Duration,
    /// The session start limit (docs' example: 1000, 14,400,000 ms); remaining drops per IDENTIFY.
    pub session_start_total: u64,
    pub session_start_remaining: u64,
    pub session_start_reset_after: u64,
    /// Without READ_MESSAGE_HISTORY, history is `[]` (message.mdx); on: 403 50013 instead.
    pub history_denied_403: bool,
    /// Lifetime of signed attachment URLs handed out from now on (Chosen default: 24 h).
    pub attachment_ttl: Duration,
    /// Chosen: 10 MiB per file (reference.mdx has said 10 MiB, later 20 MiB), else 413 40005.
    pub max_file_bytes: usize,
    /// How long `enforce_nonce` remembers a nonce (message.mdx: "the past few minutes"; Chosen:
    /// 3 min, as `resume_window`).
    pub nonce_window: Duration,
}

/// What happened, for assertions (the lists keep their last 10,000 entries).
#[derive(Debug, Default)]
pub struct Records {
    /// IDENTIFY `d` payloads, refused ones included.
    pub identifies: Vec<Value>,
    /// When each IDENTIFY arrived (as `identifies`).
    pub identified_at: Vec<Instant>,
    /// `{session_id, seq, via_resume_url, outcome}`; outcome: "resumed", "unknown_session",
    /// "expired", "too_old", "bad_seq", "bad_token", "already_authenticated".
    pub resumes: Vec<Value>,
    /// READY dispatches sent.
    pub ready: u64,
    pub heartbeats: u64,
    /// Each heartbeat's `d` (the client's last sequence).
    pub heartbeat_seqs: Vec<Value>,
    /// Each handshake: (request URI with its query, came in on the resume URL).
    pub connections: Vec<(String, bool)>,
    /// The request line of each WebSocket handshake refused: not a WebSocket upgrade, or a request
    /// target without its "/" (`GET ?v=10&encoding=json HTTP/1.1`, answered 400).
    pub refused_handshakes: Vec<String>,
    /// Sockets whose thread still runs.
    pub open_connections: usize,
    /// Client-side endings: Some(code) for a close frame (1005 without a code), None for a TCP
    /// close without one. Closes the sim started are not listed.
    pub client_closes: Vec<Option<u16>>,
    /// Close codes the sim sent.
    pub server_closes: Vec<u16>,
    /// Dispatches by type (sent, or kept for replay).
    pub dispatched: HashMap<String, u64>,
    pub calls: Vec<Call>,
    pub posted: Vec<Posted>,
    /// POST /channels/{id}/typing per channel.
    pub typing: HashMap<String, u64>,
    /// CDN GETs: `{path, proxied, status}`.
    pub downloads: Vec<Value>,
    /// Creates answered with an earlier message because of `enforce_nonce`: that message's ID.
    pub nonce_hits: Vec<String>,
}

impl Records {
    /// Calls matching `route`: a template with or without its method ("POST
    /// /channels/{id}/messages", "/gateway/bot"), or "*".
    pub fn calls_to<'a>(&'a self, route: &'a str) -> impl Iterator<Item = &'a Call> + 'a {
        self.calls
            .iter()
            .filter(move |c| route_matches(route, &c.method, &c.route))
    }
    pub fn posted_in<'a>(&'a self, channel: &'a str) -> impl Iterator<Item = &'a Posted> + 'a {
        self.posted.iter().filter(move |p| p.channel == channel)
    }
    pub fn resumed(&self) -> usize {
        self.resumes.iter().filter(|r| r["outcome"] == "resumed").count()
    }
}

struct Conn {
    tx: mpsc::Sender<Out>,
    via_resume: bool,
    /// Takes output: false once closing, dropped or ended.
    open: bool,
    session: Option<usize>,
}

struct Session {
    id: String,
    intents: u64,
    seq: u64,
    /// (s, frame) of the last MAX_REPLAY dispatches.
    log: VecDeque<(u64, String)>,
    conn: Option<usize>,
    invalid: bool,
    detached: Option<Instant>,
}

struct Channel {
    id: String,
    guild: Option<String>,
    name: String,
    recipient: Option<Value>,
    view: bool,
    send: bool,
    history: bool,
    /// Oldest first (snowflakes only grow).
    msgs: Vec<Msg>,
}

struct Msg {
    id: String,
    author: Value,
    content: String,
    files: Vec<String>,
    reference: Option<String>,
    edited_ms: Option<u64>,
    nonce: Option<Value>,
}

struct StoredFile {
    channel: String,
    filename: String,
    content_type: String,
    description: Option<String>,
    bytes: Vec<u8>,
}

#[derive(Default)]
struct State {
    k: Knobs,
    rec: Records,
    http: String,
    gateway_url: String,
    resume_url: String,
    ports: (u16, u16),
    bot: Value,
    bot_id: String,
    started_ms: u64,
    guilds: Vec<(String, String)>,
    users: HashMap<String, Value>,
    channels: HashMap<String, Channel>,
    files: HashMap<String, StoredFile>,
    conns: Vec<Conn>,
    sessions: Vec<Session>,
    identify_times: VecDeque<Instant>,
    faults: Vec<(String, Fault)>,
    /// Until then every authorised REST call meets the bot's global rate limit (`global_limit`).
    global_until: Option<Instant>,
    url_generation: u64,
    last_snowflake: u64,
}

type Shared = Arc<(Mutex<State>, Condvar)>;

pub struct DiscordSim {
    /// The REST base: `{http}/api/v10`.
    pub base: String,
    /// `http://127.0.0.1:PORT` (the CDN URLs live here too).
    pub http: String,
    /// What `GET /gateway/bot` answers as `url`: `ws://127.0.0.1:PORT/` (the docs' example form,
    /// ending in "/"); a client adds `?v=10&encoding=json`.
    pub gateway_url: String,
    /// READY's `resume_gateway_url`: `ws://127.0.0.1:PORT2`, another port; Chosen: no path, as
    /// READY's are in practice, so a client must add "/?v=10&encoding=json" (a bare "?v=10…" makes
    /// the request line `GET ?v=10… HTTP/1.1`, answered 400 and kept in `refused_handshakes`).
    pub resume_url: String,
    state: Shared,
    stopped: Arc<AtomicBool>,
}

impl DiscordSim {
    pub fn start() -> DiscordSim {
        let http = Arc::new(tiny_http::Server::http("127.0.0.1:0").unwrap());
        let port = http.server_addr().to_ip().unwrap().port();
        let main = TcpListener::bind("127.0.0.1:0").unwrap();
        let resume = TcpListener::bind("127.0.0.1:0").unwrap();
        let ports = (main.local_addr().unwrap().port(), resume.local_addr().unwrap().port());
        let state: Shared = Arc::default();
        let sim = {
            let mut g = state.0.lock().unwrap();
            let s = &mut *g;
            s.http = format!("http://127.0.0.1:{port}");
            s.gateway_url = format!("ws://127.0.0.1:{}/", ports.0);
            s.resume_url = format!("ws://127.0.0.1:{}", ports.1);
            s.ports = ports;
            s.started_ms = now_ms();
            s.bot_id = snowflake(s);
            s.bot = json!({"id": s.bot_id, "username": "imgate-sim", "discriminator": "0", "global_name": null,
                           "avatar": null, "bot": true, "flags": 0, "mfa_enabled": false, "verified": true});
            s.users.insert(s.bot_id.clone(), s.bot.clone());
            s.k = Knobs {
                token: BOT_TOKEN.into(),
                heartbeat_interval: Duration::from_millis(45_000),
                ack_heartbeats: true,
                resume_window: Duration::from_secs(180),
                app_intents: MESSAGE_CONTENT,
                max_concurrency: 1,
                identify_window: Duration::from_secs(5),
                session_start_total: 1000,
                session_start_remaining: 1000,
                session_start_reset_after: 14_400_000,
                history_denied_403: false,
                attachment_ttl: Duration::from_secs(86_400),
                max_file_bytes: 10 * 1024 * 1024,
                nonce_window: Duration::from_secs(180),
            };
            DiscordSim {
                base: format!("{}/api/v10", s.http),
                http: s.http.clone(),
                gateway_url: s.gateway_url.clone(),
                resume_url: s.resume_url.clone(),
                state: state.clone(),
                stopped: Arc::new(AtomicBool::new(false)),
            }
        };
        let st = state.clone();
        kit::serve_http(&http, 3, &sim.stopped, move |req| serve(&st, req));
        for (listener, via_resume) in [(main, false), (resume, true)] {
            let st = state.clone();
            kit::accept_each(listener, &sim.stopped, move |stream, stop| {
                gateway_conn(&st, stream, via_resume, stop)
            });
        }
        sim
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        super::kit::change(&self.state, f)
    }

    /// Reads or changes the settings: `sim.knobs(|k| k.ack_heartbeats = false)`.
    pub fn knobs<T>(&self, f: impl FnOnce(&mut Knobs) -> T) -> T {
        self.with(|s| f(&mut s.k))
    }

    /// Reads the records (under the sim's lock: `f` must not call the sim).
    pub fn records<T>(&self, f: impl FnOnce(&Records) -> T) -> T {
        f(&self.state.0.lock().unwrap().rec)
    }

    /// Waits until `cond` holds over the records; false after `timeout`. It is evaluated again
    /// on every change (and at least every 50 ms), never after a fixed sleep.
    pub fn wait_until(&self, timeout: Duration, cond: impl Fn(&Records) -> bool) -> bool {
        super::kit::wait_for(&self.state, timeout, |s| cond(&s.rec))
    }

    // ---------- setup ----------

    /// A snowflake minted now (for IDs a test needs before the sim makes them).
    pub fn snowflake(&self) -> String {
        self.with(snowflake)
    }

    pub fn bot_user(&self) -> User {
        self.with(|s| User {
            id: s.bot_id.clone(),
            username: "imgate-sim".into(),
            bot: true,
        })
    }

    /// A person, or another bot.
    pub fn add_user(&self, username: &str, bot: bool) -> User {
        self.with(|s| {
            let u = User {
                id: snowflake(s),
                username: username.into(),
                bot,
            };
            s.users.insert(u.id.clone(), user_json(&u));
            u
        })
    }

    /// A guild the bot is in (READY lists it; GUILD_CREATE follows for sessions with GUILDS).
    pub fn add_guild(&self, name: &str) -> String {
        self.with(|s| {
            let id = snowflake(s);
            s.guilds.push((id.clone(), name.into()));
            id
        })
    }

    /// A GUILD_TEXT channel the bot can view, post in and read the history of.
    pub fn add_text_channel(&self, guild: &str, name: &str) -> String {
        self.with(|s| {
            assert!(s.guilds.iter().any(|(g, _)| g == guild), "unknown guild {guild}");
            let id = snowflake(s);
            s.channels
                .insert(id.clone(), new_channel(&id, Some(guild.into()), name, None));
            id
        })
    }

    /// The DM channel between the bot and `user`.
    pub fn add_dm_channel(&self, user: &User) -> String {
        self.with(|s| {
            let id = snowflake(s);
            s.users.entry(user.id.clone()).or_insert_with(|| user_json(user));
            s.channels
                .insert(id.clone(), new_channel(&id, None, "", Some(user_json(user))));
            id
        })
    }

    /// The channel is gone: its routes answer 404 10003 Unknown Channel.
    pub fn remove_channel(&self, channel: &str) {
        self.with(|s| s.channels.remove(channel));
    }

    /// The bot's permissions in the channel. Without VIEW_CHANNEL every route answers 403 50001
    /// Missing Access; without SEND_MESSAGES posting and typing answer 403 50013; without
    /// READ_MESSAGE_HISTORY history is empty (see `Knobs::history_denied_403`) and replies get
    /// 403 160002.
    pub fn set_perms(&self, channel: &str, view: bool, send: bool, read_history: bool) {
        self.with(|s| {
            let ch = channel_mut(s, channel);
            (ch.view, ch.send, ch.history) = (view, send, read_history);
        });
    }

    /// Every attachment URL handed out so far stops working (404); messages fetched again carry
    /// fresh ones (reference.mdx: fetched payloads have valid signed URLs).
    pub fn expire_attachment_urls(&self) {
        self.with(|s| s.url_generation += 1);
    }

    /// Every session so far times out: resuming it gets op 9 false.
    pub fn expire_sessions(&self) {
        self.with(|s| s.sessions.iter_mut().for_each(|x| x.invalid = true));
    }

    /// The bot meets its global rate limit for `span` from now (rate-limits.mdx "Global Rate
    /// Limit": per bot, across every route): each authorised REST call meanwhile answers 429 with
    /// `"global": true`, `X-RateLimit-Global: true`, `X-RateLimit-Scope: global` and `retry_after`
    /// the time left. When it ends.
    pub fn global_limit(&self, span: Duration) -> Instant {
        let until = Instant::now() + span;
        self.with(|s| s.global_until = Some(until));
        until
    }

    /// The next `times` calls of `route` (see `Records::calls_to`) answer `fault`.
    pub fn fault(&self, route: &str, times: usize, fault: Fault) {
        self.with(|s| (0..times).for_each(|_| s.faults.push((route.into(), fault.clone()))));
    }

    // ---------- what other people do ----------

    /// A message by someone else: into the history and, unless `skip_gateway`, MESSAGE_CREATE
    /// to every live session (intents and the message content rule applied per session).
    pub fn post(&self, channel: &str, m: UserMsg) -> String {
        self.with(|s| {
            assert!(s.channels.contains_key(channel), "unknown channel {channel}");
            let author = user_json(&m.author);
            s.users.entry(m.author.id.clone()).or_insert_with(|| author.clone());
            let mut files = vec![];
            for (name, content_type, bytes) in m.files {
                let fid = snowflake(s);
                let filename = sanitize(&name);
                let f = StoredFile {
                    channel: channel.into(),
                    filename,
                    content_type,
                    description: None,
                    bytes,
                };
                s.files.insert(fid.clone(), f);
                files.push(fid);
            }
            let id = snowflake(s);
            let msg = Msg {
                id: id.clone(),
                author,
                content: m.content,
                files,
                reference: m.reply_to,
                edited_ms: None,
                nonce: None,
            };
            push_msg(s, channel, msg);
            if !m.skip_gateway {
                announce(s, channel, &id, "MESSAGE_CREATE");
            }
            id
        })
    }

    /// The author edits a message: MESSAGE_UPDATE with the whole message, `edited_timestamp` set.
    pub fn edit(&self, channel: &str, id: &str, content: &str) {
        self.with(|s| {
            let m = channel_mut(s, channel)
                .msgs
                .iter_mut()
                .find(|m| m.id == id)
                .expect("a known message");
            m.content = content.into();
            m.edited_ms = Some(now_ms());
            announce(s, channel, id, "MESSAGE_UPDATE");
        });
    }

    /// The message is deleted: gone from the history, MESSAGE_DELETE `{id, channel_id, guild_id?}`.
    pub fn delete(&self, channel: &str, id: &str) {
        self.with(|s| {
            let ch = channel_mut(s, channel);
            ch.msgs.retain(|m| m.id != id);
            let guild = ch.guild.clone();
            let mut d = json!({"id": id, "channel_id": channel});
            if let Some(g) = &guild {
                d["guild_id"] = json!(g);
            }
            let intent = if guild.is_some() {
                GUILD_MESSAGES
            } else {
                DIRECT_MESSAGES
            };
            broadcast(s, "MESSAGE_DELETE", intent, false, &d);
        });
    }

    /// `user` starts typing: TYPING_START (an event a bridge ignores).
    pub fn typing(&self, channel: &str, user: &User) {
        self.with(|s| typing_event(s, channel, &user.id));
    }

    /// Any dispatch, as it is, to every live session (no intent filtering).
    pub fn dispatch_raw(&self, t: &str, d: Value) {
        self.with(|s| {
            for i in 0..s.sessions.len() {
                if live(s, i) {
                    send_dispatch(s, i, t, d.clone());
                }
            }
        });
    }

    // ---------- the Gateway ----------

    /// `action` on the newest open connection; false when there is none.
    pub fn gateway(&self, action: Gw) -> bool {
        self.with(|s| {
            let Some(k) = current(s) else { return false };
            match action {
                Gw::Reconnect => send(s, k, Out::Text(frame(7, Value::Null))),
                Gw::RequestHeartbeat => send(s, k, Out::Text(frame(1, Value::Null))),
                Gw::Text(t) => send(s, k, Out::Text(t)),
                Gw::Close(code) => close_conn(s, k, code),
                Gw::Drop => drop_conn(s, k),
                Gw::Silent => send(s, k, Out::Silent),
                Gw::InvalidSession(resumable) => {
                    send(s, k, Out::Text(frame(9, json!(resumable))));
                    let ended = if resumable { None } else { s.conns[k].session.take() };
                    if let Some(i) = ended {
                        (s.sessions[i].invalid, s.sessions[i].conn) = (true, None);
                    }
                }
            }
            true
        })
    }

    /// The session on the newest open connection: (session_id, last `s` sent).
    pub fn current_session(&self) -> Option<(String, u64)> {
        self.with(|s| {
            let i = current(s).and_then(|k| s.conns[k].session)?;
            Some((s.sessions[i].id.clone(), s.sessions[i].seq))
        })
    }

    // ---------- views ----------

    /// Messages our bot created in `channel`, in order.
    pub fn posted(&self, channel: &str) -> Vec<Posted> {
        self.records(|r| r.posted_in(channel).cloned().collect())
    }

    pub fn calls(&self, route: &str) -> Vec<Call> {
        self.records(|r| r.calls_to(route).cloned().collect())
    }

    /// The channel's messages as the REST API renders them, oldest first.
    pub fn history(&self, channel: &str) -> Vec<Value> {
        self.with(|s| {
            let Some(ch) = s.channels.get(channel) else {
                return vec![];
            };
            ch.msgs.iter().map(|m| render_msg(s, ch, m, false, false)).collect()
        })
    }
}

impl Drop for DiscordSim {
    /// Every thread ends: sockets drop, HTTP workers see the flag, the accept loops
    /// are woken by one last connection each.
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::Relaxed);
        let ports = self.with(|s| {
            for c in &s.conns {
                let _ = c.tx.send(Out::Drop);
            }
            s.ports
        });
        let _ = TcpStream::connect(("127.0.0.1", ports.0));
        let _ = TcpStream::connect(("127.0.0.1", ports.1));
    }
}

// ---------- ids, time, small helpers ----------

fn now_secs() -> u64 {
    now_ms() / 1000
}

/// reference.mdx: ms since the Discord epoch << 22 | worker << 17 | process << 12 | increment.
/// Chosen: worker 1, process 1; strictly increasing within the sim.
fn snowflake(s: &mut State) -> String {
    let base = (now_ms().saturating_sub(DISCORD_EPOCH) << 22) | (1 << 17) | (1 << 12);
    s.last_snowflake = base.max(s.last_snowflake + 1);
    s.last_snowflake.to_string()
}

fn snowflake_num(id: &str) -> u64 {
    id.parse().unwrap_or(0)
}

/// ISO8601 as Discord writes it ("2017-07-11T17:27:07.299000+00:00"); days → date after
/// H. Hinnant's civil_from_days.
fn iso(ms: u64) -> String {
    let (secs, z) = (ms / 1000, (ms / 86_400_000) as i64 + 719_468);
    let (era, doe) = (z.div_euclid(146_097), z.rem_euclid(146_097));
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let (d, m) = (doy - (153 * mp + 2) / 5 + 1, if mp < 10 { mp + 3 } else { mp - 9 });
    let y = yoe + era * 400 + i64::from(m <= 2);
    let t = secs % 86_400;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}000+00:00",
        t / 3600,
        t % 3600 / 60,
        t % 60,
        ms % 1000
    )
}

fn hash_hex(parts: impl Hash) -> String {
    let mut h = DefaultHasher::new();
    parts.hash(&mut h);
    format!("{:016x}", h.finish())
}

fn push_capped<T>(v: &mut Vec<T>, x: T) {
    if v.len() >= MAX_RECORDS {
        v.remove(0);
    }
    v.push(x);
}

fn user_json(u: &User) -> Value {
    let mut v = json!({"id": u.id, "username": u.username, "discriminator": "0", "global_name": u.username,
                       "avatar": null});
    if u.bot {
        v["bot"] = json!(true); // `bot?` is optional; people go without it
    }
    v
}

fn new_channel(id: &str, guild: Option<String>, name: &str, recipient: Option<Value>) -> Channel {
    let (view, send, history, msgs) = (true, true, true, vec![]);
    Channel {
        id: id.into(),
        guild,
        name: name.into(),
        recipient,
        view,
        send,
        history,
        msgs,
    }
}

fn channel_mut<'a>(s: &'a mut State, id: &str) -> &'a mut Channel {
    s.channels.get_mut(id).unwrap_or_else(|| panic!("unknown channel {id}"))
}

/// A channel keeps its last 10,000 messages.
fn push_msg(s: &mut State, channel: &str, m: Msg) {
    let msgs = &mut channel_mut(s, channel).msgs;
    msgs.push(m);
    if msgs.len() > MAX_RECORDS {
        msgs.remove(0);
    }
}

/// Chosen: like Discord, characters other than letters, digits, '.', '_' and '-' become '_'.
fn sanitize(name: &str) -> String {
    let keep = |c: char| c.is_ascii_alphanumeric() || "._-".contains(c);
    let n: String = name.chars().take(255).map(|c| if keep(c) { c } else { '_' }).collect();
    if n.is_empty() {
        "unknown".into()
    } else {
        n
    }
}

fn guess_mime(name: &str) -> &'static str {
    match name.rsplit_once('.').map(|(_, e)| e.to_ascii_lowercase()).as_deref() {
        Some("png") => "image/png",
        Some("jpg" | "jpeg") => "image/jpeg",
        Some("gif") => "image/gif",
        Some("pdf") => "application/pdf",
        Some("txt") => "text/plain; charset=utf-8",
        _ => "application/octet-stream",
    }
}

/// User IDs mentioned as `<@id>` or `<@!id>`.
fn mentioned_ids(content: &str) -> Vec<String> {
    let mut out: Vec<String> = vec![];
    let mut rest = content;
    while let Some(i) = rest.find("<@") {
        rest = &rest[i + 2..];
        let r = rest.strip_prefix('!').unwrap_or(rest);
        let digits: String = r.chars().take_while(|c| c.is_ascii_digit()).collect();
        if !digits.is_empty() && r[digits.len()..].starts_with('>') && !out.contains(&digits) {
            out.push(digits);
        }
    }
    out
}

fn query_param(q: &str, key: &str) -> Option<String> {
    q.split('&')
        .map(|kv| kv.split_once('=').unwrap_or((kv, "")))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.to_string())
}

// ---------- messages and events ----------

fn member_json(s: &State) -> Value {
    json!({"roles": [], "joined_at": iso(s.started_ms), "deaf": false, "mute": false, "flags": 0})
}

fn channel_json(ch: &Channel) -> Value {
    let last = ch.msgs.last().map_or(Value::Null, |m| json!(m.id));
    match &ch.guild {
        Some(g) => json!({"id": ch.id, "type": 0, "guild_id": g, "name": ch.name, "position": 0,
                          "permission_overwrites": [], "nsfw": false, "topic": null, "last_message_id": last,
                          "rate_limit_per_user": 0, "parent_id": null, "flags": 0}),
        None => json!({"id": ch.id, "type": 1, "last_message_id": last, "recipients": [ch.recipient], "flags": 0}),
    }
}

fn guild_json(s: &State, gid: &str) -> Value {
    let name = s
        .guilds
        .iter()
        .find(|(g, _)| g == gid)
        .map_or("guild", |(_, n)| n.as_str());
    let mut channels: Vec<&Channel> = s
        .channels
        .values()
        .filter(|c| c.guild.as_deref() == Some(gid))
        .collect();
    channels.sort_by_key(|c| snowflake_num(&c.id));
    let channels: Vec<Value> = channels.into_iter().map(channel_json).collect();
    json!({"id": gid, "name": name, "unavailable": false, "joined_at": iso(s.started_ms), "large": false,
           "member_count": 2, "owner_id": "0", "channels": channels, "threads": [], "members": [],
           "voice_states": [], "presences": [], "roles": [], "emojis": [], "stickers": [], "features": []})
}

/// The application's public flags (application.mdx, "Application Flags"): the privileged intents
/// toggled on for the app. Chosen: the full flags (GATEWAY_MESSAGE_CONTENT `1 << 18`, …), not
/// the `_LIMITED` ones (`1 << 19`, …) of unverified apps in fewer than 100 servers.
fn app_flags(s: &State) -> u64 {
    let mut flags = 0;
    for (intent, flag) in [
        (GUILD_PRESENCES, 1 << 12),
        (GUILD_MEMBERS, 1 << 14),
        (MESSAGE_CONTENT, 1 << 18),
    ] {
        if s.k.app_intents & intent != 0 {
            flags |= flag;
        }
    }
    flags
}

/// The application object of Get Current Application (application.mdx, "Application Structure":
/// the fields without `?`, plus `bot` and `flags`). Chosen: the app's ID is the bot's, as for
/// apps created with a bot; name and bot name are the same.
fn application_json(s: &State) -> Value {
    json!({"id": s.bot_id, "name": "imgate-sim", "icon": null, "description": "", "bot_public": true,
           "bot_require_code_grant": false, "bot": s.bot, "verify_key": hash_hex((&s.bot_id, "verify_key")),
           "team": null, "flags": app_flags(s), "approximate_guild_count": s.guilds.len(),
           "event_webhooks_status": 1, "interactions_endpoint_url": null,
           "role_connections_verification_url": null, "event_webhooks_url": null})
}

/// 64 hex characters only the sim can produce for (path, ex, is, generation).
fn sign(s: &State, path: &str, ex: u64, is: u64) -> String {
    (0..4u64)
        .map(|salt| hash_hex((salt, s.url_generation, path, ex, is, "discord-sim")))
        .collect()
}

fn attachment_json(s: &State, id: &str) -> Option<Value> {
    let f = s.files.get(id)?;
    let path = format!("/attachments/{}/{id}/{}", f.channel, f.filename);
    let is = now_secs();
    let ex = is + s.k.attachment_ttl.as_secs().max(1);
    let query = format!("?ex={ex:x}&is={is:x}&hm={}&", sign(s, &path, ex, is));
    let mut a = json!({"id": id, "filename": f.filename, "size": f.bytes.len(), "content_type": f.content_type,
                       "url": format!("{}{path}{query}", s.http), "proxy_url": format!("{}/media{path}{query}", s.http)});
    if let Some(d) = &f.description {
        a["description"] = json!(d);
    }
    Some(a)
}

/// A message object (message.mdx); `gateway` adds MESSAGE_CREATE's extra fields.
fn render_msg(s: &State, ch: &Channel, m: &Msg, gateway: bool, nested: bool) -> Value {
    let files: Vec<Value> = m.files.iter().filter_map(|f| attachment_json(s, f)).collect();
    let mentions: Vec<Value> = mentioned_ids(&m.content)
        .iter()
        .filter_map(|id| s.users.get(id).cloned())
        .collect();
    let kind = if m.reference.is_some() { 19 } else { 0 };
    let mut v = json!({"id": m.id, "channel_id": ch.id, "author": m.author, "content": m.content,
        "timestamp": iso((snowflake_num(&m.id) >> 22) + DISCORD_EPOCH), "edited_timestamp": m.edited_ms.map(iso),
        "tts": false, "mention_everyone": false, "mentions": mentions, "mention_roles": [], "attachments": files,
        "embeds": [], "components": [], "pinned": false, "type": kind,
        "flags": 0});
    if let Some(n) = &m.nonce {
        v["nonce"] = n.clone();
    }
    if let Some(r) = &m.reference {
        v["message_reference"] = json!({"type": 0, "message_id": r, "channel_id": ch.id});
        if let Some(g) = &ch.guild {
            v["message_reference"]["guild_id"] = json!(g);
        }
        if !nested {
            // null: the referenced message was deleted (message.mdx, note [4]).
            let found = ch.msgs.iter().find(|x| x.id == *r);
            v["referenced_message"] = found.map_or(Value::Null, |x| render_msg(s, ch, x, false, true));
        }
    }
    if let Some(g) = ch.guild.as_ref().filter(|_| gateway) {
        v["guild_id"] = json!(g);
        v["member"] = member_json(s);
    }
    v
}

/// The message content intent's exceptions (gateway.mdx): the app's own messages, DMs, and
/// messages mentioning the app.
fn exempt(s: &State, ch: &Channel, m: &Msg) -> bool {
    ch.guild.is_none() || m.author["id"] == s.bot_id.as_str() || mentioned_ids(&m.content).contains(&s.bot_id)
}

fn blank(d: &mut Value) {
    d["content"] = json!("");
    d["embeds"] = json!([]);
    d["attachments"] = json!([]);
    d["components"] = json!([]);
}

/// MESSAGE_CREATE / MESSAGE_UPDATE of a stored message to every session that should see it.
fn announce(s: &mut State, channel: &str, msg_id: &str, t: &str) {
    let Some(ch) = s.channels.get(channel) else { return };
    let Some(m) = ch.msgs.iter().find(|m| m.id == msg_id) else {
        return;
    };
    let (d, blankable) = (render_msg(s, ch, m, true, false), !exempt(s, ch, m));
    let intent = if ch.guild.is_some() {
        GUILD_MESSAGES
    } else {
        DIRECT_MESSAGES
    };
    broadcast(s, t, intent, blankable, &d);
}

fn typing_event(s: &mut State, channel: &str, user_id: &str) {
    let Some(ch) = s.channels.get(channel) else { return };
    let mut d = json!({"channel_id": channel, "user_id": user_id, "timestamp": now_secs()});
    let intent = match &ch.guild {
        Some(g) => {
            d["guild_id"] = json!(g);
            d["member"] = member_json(s);
            d["member"]["user"] = s.users.get(user_id).cloned().unwrap_or(Value::Null);
            GUILD_MESSAGE_TYPING
        }
        None => DIRECT_MESSAGE_TYPING,
    };
    broadcast(s, "TYPING_START", intent, false, &d);
}

/// A session receives (and can be resumed) while attached, or detached within the window.
fn live(s: &State, i: usize) -> bool {
    let x = &s.sessions[i];
    !x.invalid && (x.conn.is_some() || x.detached.is_some_and(|t| t.elapsed() < s.k.resume_window))
}

/// `d` to every live session whose intents cover it; `blankable`: message content is emptied
/// for sessions without MESSAGE_CONTENT.
fn broadcast(s: &mut State, t: &str, intent: u64, blankable: bool, d: &Value) {
    for i in 0..s.sessions.len() {
        let intents = s.sessions[i].intents;
        if !live(s, i) || intents & intent == 0 {
            continue;
        }
        let mut d = d.clone();
        if blankable && intents & MESSAGE_CONTENT == 0 {
            blank(&mut d);
        }
        send_dispatch(s, i, t, d);
    }
}

/// One op 0 with the session's next `s`, kept for replay, sent if a connection is attached.
fn send_dispatch(s: &mut State, i: usize, t: &str, d: Value) {
    let sess = &mut s.sessions[i];
    sess.seq += 1;
    let f = json!({"op": 0, "t": t, "s": sess.seq, "d": d}).to_string();
    sess.log.push_back((sess.seq, f.clone()));
    if sess.log.len() > MAX_REPLAY {
        sess.log.pop_front();
    }
    let conn = sess.conn;
    *s.rec.dispatched.entry(t.to_string()).or_default() += 1;
    if let Some(k) = conn {
        send(s, k, Out::Text(f));
    }
}

// ---------- the Gateway ----------

/// A non-dispatch payload: `s` and `t` are null (gateway-events.mdx, Payload Structure).
fn frame(op: u8, d: Value) -> String {
    json!({"op": op, "d": d, "s": null, "t": null}).to_string()
}

fn send(s: &State, k: usize, out: Out) {
    if s.conns[k].open {
        let _ = s.conns[k].tx.send(out);
    }
}

fn close_conn(s: &mut State, k: usize, code: u16) {
    if !s.conns[k].open {
        return;
    }
    send(s, k, Out::Close(code));
    s.conns[k].open = false;
    push_capped(&mut s.rec.server_closes, code);
    if let Some(i) = s.conns[k].session.filter(|_| INVALIDATING.contains(&code)) {
        s.sessions[i].invalid = true;
    }
}

fn drop_conn(s: &mut State, k: usize) {
    send(s, k, Out::Drop);
    s.conns[k].open = false;
}

fn current(s: &State) -> Option<usize> {
    s.conns.iter().rposition(|c| c.open)
}

/// Hello, or a close when the URL asks for what the sim cannot speak. Chosen: `v` other than
/// 9/10 → 4012; `encoding` other than json → 4002; `compress` is ignored (nothing is compressed).
fn greet(s: &mut State, k: usize, uri: &str) {
    let q = uri.split_once('?').map_or("", |(_, q)| q);
    if query_param(q, "v").is_some_and(|v| v != "10" && v != "9") {
        return close_conn(s, k, 4012);
    }
    if query_param(q, "encoding").is_some_and(|e| e != "json") {
        return close_conn(s, k, 4002);
    }
    send(
        s,
        k,
        Out::Text(frame(
            10,
            json!({"heartbeat_interval": s.k.heartbeat_interval.as_millis() as u64}),
        )),
    );
}

fn on_client_text(s: &mut State, k: usize, text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or(Value::Null);
    let Some(op) = v["op"].as_u64().filter(|_| text.len() <= MAX_CLIENT_PAYLOAD) else {
        return close_conn(s, k, 4002);
    };
    let d = v["d"].clone();
    match op {
        1 => {
            s.rec.heartbeats += 1;
            push_capped(&mut s.rec.heartbeat_seqs, d);
            if s.k.ack_heartbeats {
                send(s, k, Out::Text(frame(11, Value::Null)));
            }
        }
        2 => identify(s, k, d),
        6 => {
            let sid = d["session_id"].as_str().unwrap_or_default().to_string();
            let outcome = resume(s, k, &d, &sid);
            let rec = json!({"session_id": sid, "seq": d["seq"], "via_resume_url": s.conns[k].via_resume,
                             "outcome": outcome});
            push_capped(&mut s.rec.resumes, rec);
        }
        3 | 4 | 8 | 31 | 43 if s.conns[k].session.is_none() => close_conn(s, k, 4003),
        3 | 4 | 8 | 31 | 43 => {}
        _ => close_conn(s, k, 4001),
    }
}

fn identify(s: &mut State, k: usize, d: Value) {
    push_capped(&mut s.rec.identifies, d.clone());
    push_capped(&mut s.rec.identified_at, Instant::now());
    if s.conns[k].session.is_some() {
        return close_conn(s, k, 4005);
    }
    // Chosen: no `properties` object is a decode error; the token is bare, as in the docs'
    // examples; missing intents (required since v8) close like invalid ones.
    if !d["properties"].is_object() {
        return close_conn(s, k, 4002);
    }
    if d["token"].as_str() != Some(s.k.token.as_str()) {
        return close_conn(s, k, 4004);
    }
    let intents = d["intents"].as_u64().unwrap_or(u64::MAX);
    if intents & !VALID_INTENTS != 0 {
        return close_conn(s, k, 4013);
    }
    if intents & PRIVILEGED & !s.k.app_intents != 0 {
        return close_conn(s, k, 4014);
    }
    if s.k.session_start_remaining == 0 {
        // gateway.mdx: every session ends and the token is reset. Chosen: closes with 4004.
        s.k.token = format!("{}.reset", s.k.token);
        (0..s.conns.len()).for_each(|j| close_conn(s, j, 4004));
        s.sessions.iter_mut().for_each(|x| x.invalid = true);
        return;
    }
    let now = Instant::now();
    let window = s.k.identify_window;
    while s
        .identify_times
        .front()
        .is_some_and(|t| now.duration_since(*t) >= window)
    {
        s.identify_times.pop_front();
    }
    if s.identify_times.len() >= s.k.max_concurrency.max(1) {
        // Chosen: `d` false (the docs name the op, not its value).
        return send(s, k, Out::Text(frame(9, json!(false))));
    }
    s.identify_times.push_back(now);
    s.k.session_start_remaining -= 1;
    let id = hash_hex((s.sessions.len(), now_ms(), "session")) + &hash_hex((s.sessions.len(), "sid"));
    let i = s.sessions.len();
    let log = VecDeque::new();
    s.sessions.push(Session {
        id: id.clone(),
        intents,
        seq: 0,
        log,
        conn: Some(k),
        invalid: false,
        detached: None,
    });
    s.conns[k].session = Some(i);
    let guilds: Vec<Value> = s
        .guilds
        .iter()
        .map(|(g, _)| json!({"id": g, "unavailable": true}))
        .collect();
    // gateway-events.mdx, Ready: `application` is the partial application object, `id` and `flags`;
    // `shard` is there when IDENTIFY sent one.
    let mut ready = json!({"v": 10, "user": s.bot, "guilds": guilds, "session_id": id,
                           "resume_gateway_url": s.resume_url, "application": {"id": s.bot_id, "flags": app_flags(s)}});
    if d["shard"].is_array() {
        ready["shard"] = d["shard"].clone();
    }
    s.rec.ready += 1;
    send_dispatch(s, i, "READY", ready);
    // gateway-events.mdx: guilds start unavailable and arrive as GUILD_CREATE (GUILDS intent).
    if intents & GUILDS != 0 {
        let creates: Vec<Value> = s.guilds.iter().map(|(g, _)| guild_json(s, g)).collect();
        creates.into_iter().for_each(|g| send_dispatch(s, i, "GUILD_CREATE", g));
    }
}

fn resume(s: &mut State, k: usize, d: &Value, sid: &str) -> &'static str {
    let invalid = |s: &mut State, i: Option<usize>, why| {
        if let Some(i) = i {
            s.sessions[i].invalid = true;
        }
        send(s, k, Out::Text(frame(9, json!(false))));
        why
    };
    if s.conns[k].session.is_some() {
        close_conn(s, k, 4005);
        return "already_authenticated";
    }
    if d["token"].as_str() != Some(s.k.token.as_str()) {
        close_conn(s, k, 4004);
        return "bad_token";
    }
    let Some(i) = s.sessions.iter().position(|x| x.id == sid) else {
        return invalid(s, None, "unknown_session");
    };
    if !live(s, i) {
        return invalid(s, Some(i), "expired");
    }
    // Chosen: a null `seq` (nothing received yet) is 0.
    let seq = d["seq"].as_u64().unwrap_or(0);
    if seq > s.sessions[i].seq {
        close_conn(s, k, 4007);
        return "bad_seq";
    }
    if s.sessions[i].log.front().is_some_and(|(first, _)| seq + 1 < *first) {
        return invalid(s, Some(i), "too_old");
    }
    // Chosen: a resume on the main URL works too (`via_resume_url` tells); the connection the
    // session was on, if still open, is dropped.
    if let Some(old) = s.sessions[i].conn.filter(|old| *old != k) {
        drop_conn(s, old);
        s.conns[old].session = None;
    }
    (s.sessions[i].conn, s.sessions[i].detached, s.conns[k].session) = (Some(k), None, Some(i));
    let replay: Vec<String> = s.sessions[i]
        .log
        .iter()
        .filter(|(q, _)| *q > seq)
        .map(|(_, f)| f.clone())
        .collect();
    replay.into_iter().for_each(|f| send(s, k, Out::Text(f)));
    // Chosen: RESUMED is a dispatch with the next `s` and `d` {}.
    send_dispatch(s, i, "RESUMED", json!({}));
    "resumed"
}

/// The handshake's request line, peeked (left in the socket for tungstenite); at most 1 KiB.
fn request_line(stream: &TcpStream) -> String {
    let mut buf = [0u8; 1024];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // Blocks until bytes arrive (the read timeout bounds it), then returns what is there.
        let n = stream.peek(&mut buf).unwrap_or(0);
        if let Some(end) = buf[..n].windows(2).position(|w| w == b"\r\n") {
            return String::from_utf8_lossy(&buf[..end]).into_owned();
        }
        if n == 0 || n == buf.len() || Instant::now() >= deadline {
            return String::from_utf8_lossy(&buf[..n]).into_owned();
        }
        std::thread::sleep(Duration::from_millis(1)); // the rest of a split first line
    }
}

fn refuse_handshake(state: &Shared, line: String) {
    let mut g = state.0.lock().unwrap();
    push_capped(&mut g.rec.refused_handshakes, line);
    drop(g);
    state.1.notify_all();
}

fn gateway_conn(state: &Shared, mut stream: TcpStream, via_resume: bool, stopped: &AtomicBool) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10))); // bounds the handshake
    let line = request_line(&stream);
    // RFC 9112 §3.2.1: a request target is origin-form ("/…"). A client that appends "?v=10…" to a
    // URL without a path (READY's resume_gateway_url has none) may send "GET ?v=10… HTTP/1.1";
    // Chosen: 400, as an HTTP server answers it, and recorded (tungstenite alone would just hang
    // up, which a client reports as an incomplete handshake).
    if !line.split(' ').nth(1).is_some_and(|target| target.starts_with('/')) {
        // An empty line: the peer hung up (or stayed silent) before asking anything.
        if !line.is_empty() {
            // Recorded first: a client that reads the 400 finds it recorded.
            refuse_handshake(state, line);
            let _ = stream.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
        let _ = stream.shutdown(Shutdown::Both);
        return;
    }
    let uri = Arc::new(Mutex::new(String::new()));
    let seen = uri.clone();
    #[allow(clippy::result_large_err)] // tungstenite fixes the callback's error type
    let callback = move |req: &Request, resp: Response| -> Result<Response, ErrorResponse> {
        *seen.lock().unwrap() = req.uri().to_string();
        Ok(resp)
    };
    let config = WebSocketConfig::default()
        .max_message_size(Some(MAX_WS_MESSAGE))
        .max_frame_size(Some(MAX_WS_MESSAGE));
    let Ok(mut ws) = tungstenite::accept_hdr_with_config(stream, callback, Some(config)) else {
        return refuse_handshake(state, line);
    };
    let uri = uri.lock().unwrap().clone();
    let (tx, rx) = mpsc::channel::<Out>();
    let k = {
        let mut g = state.0.lock().unwrap();
        let s = &mut *g;
        if s.conns.len() >= MAX_RECORDS {
            return;
        }
        let k = s.conns.len();
        s.conns.push(Conn {
            tx,
            via_resume,
            open: true,
            session: None,
        });
        s.rec.connections.push((uri.clone(), via_resume));
        s.rec.open_connections += 1;
        greet(s, k, &uri);
        k
    };
    state.1.notify_all();
    let _ = ws.get_ref().set_read_timeout(Some(Duration::from_millis(10)));
    let _ = ws.get_ref().set_write_timeout(Some(Duration::from_secs(10)));
    // Some(Some(code)): the client's close frame; Some(None): TCP ended bare; None: the sim did.
    let end = socket_loop(&mut ws, &rx, stopped, |heard| {
        match heard {
            Heard::Text(t) => on_client_text(&mut state.0.lock().unwrap(), k, t),
            // Chosen: binary (ETF, compressed) payloads are not spoken here: 4002.
            Heard::Binary => close_conn(&mut state.0.lock().unwrap(), k, 4002),
            Heard::Pings(_) => return,
        }
        state.1.notify_all();
    });
    let mut g = state.0.lock().unwrap();
    let s = &mut *g;
    s.conns[k].open = false;
    s.rec.open_connections -= 1;
    let code = end.flatten();
    if let Some(c) = end {
        push_capped(&mut s.rec.client_closes, c);
    }
    if let Some(i) = s.conns[k].session.filter(|&i| s.sessions[i].conn == Some(k)) {
        (s.sessions[i].conn, s.sessions[i].detached) = (None, Some(Instant::now()));
        // gateway.mdx: a client close with 1000 or 1001 invalidates the session.
        s.sessions[i].invalid |= matches!(code, Some(1000 | 1001));
    }
    drop(g);
    state.1.notify_all();
}

// ---------- the HTTP side ----------

struct Answer {
    status: u16,
    body: Vec<u8>,
    headers: Vec<(String, String)>,
}

fn hdr(a: &mut Answer, k: &str, v: impl Into<String>) {
    a.headers.push((k.to_string(), v.into()));
}

fn json_answer(status: u16, v: &Value) -> Answer {
    let headers = vec![("Content-Type".to_string(), "application/json".to_string())];
    Answer {
        status,
        body: v.to_string().into_bytes(),
        headers,
    }
}

fn err_json(status: u16, code: u64, message: &str) -> Answer {
    json_answer(status, &json!({"message": message, "code": code}))
}

/// 50035 Invalid Form Body with `errors` shaped as reference.mdx shows (under the field's name,
/// or the request's own `_errors` when `field` is None).
fn form_error(field: Option<&str>, code: &str, message: &str) -> Answer {
    let e = json!({"_errors": [{"code": code, "message": message}]});
    let errors = match field {
        Some(f) => Value::Object(Map::from_iter([(f.to_string(), e)])),
        None => e,
    };
    json_answer(
        400,
        &json!({"code": 50035, "errors": errors, "message": "Invalid Form Body"}),
    )
}

fn route_matches(pattern: &str, method: &str, route: &str) -> bool {
    pattern == "*" || pattern == route || pattern.split_once(' ') == Some((method, route))
}

fn fault_answer(route: &str, fault: Fault) -> Answer {
    let (retry_after, global) = match fault {
        Fault::RateLimit { retry_after, global } => (retry_after, global),
        Fault::Body(status, body) => return json_answer(status, &body),
        Fault::Lost(status) => return err_json(status, 0, "502: Bad Gateway"),
        Fault::Status(status) => {
            let reason = match status {
                500 => "Internal Server Error",
                502 => "Bad Gateway",
                503 => "Service Unavailable",
                504 => "Gateway Timeout",
                _ => "Error",
            };
            return err_json(status, 0, &format!("{status}: {reason}"));
        }
    };
    let body = json!({"message": "You are being rate limited.", "retry_after": retry_after, "global": global});
    let mut a = json_answer(429, &body);
    hdr(&mut a, "Retry-After", (retry_after.max(0.0).ceil() as u64).to_string());
    if global {
        hdr(&mut a, "X-RateLimit-Global", "true");
        hdr(&mut a, "X-RateLimit-Scope", "global");
    } else {
        bucket_headers(&mut a, route, 0, retry_after);
        hdr(&mut a, "X-RateLimit-Scope", "user");
    }
    a
}

/// Chosen: outside a fault, every answer shows a roomy bucket (5 per second, 4 left).
fn bucket_headers(a: &mut Answer, route: &str, remaining: u32, reset_after: f64) {
    hdr(a, "X-RateLimit-Limit", "5");
    hdr(a, "X-RateLimit-Remaining", remaining.to_string());
    hdr(
        a,
        "X-RateLimit-Reset",
        format!("{:.3}", now_ms() as f64 / 1000.0 + reset_after),
    );
    hdr(a, "X-RateLimit-Reset-After", format!("{reset_after:.3}"));
    hdr(a, "X-RateLimit-Bucket", hash_hex((route, "bucket")));
}

fn serve(state: &Shared, mut req: tiny_http::Request) {
    let mut body = Vec::new();
    let reader: &mut dyn Read = req.as_reader();
    let too_big = Read::take(reader, MAX_BODY as u64 + 1).read_to_end(&mut body).is_err() || body.len() > MAX_BODY;
    let header = |name: &'static str| {
        let h = req.headers().iter().find(|h| h.field.equiv(name));
        h.map(|h| h.value.to_string()).unwrap_or_default()
    };
    let (auth, ctype, agent) = (header("Authorization"), header("Content-Type"), header("User-Agent"));
    let url = req.url().to_string();
    let (path, query) = url.split_once('?').unwrap_or((&url, ""));
    let method = req.method().as_str().to_string();
    let a = {
        let mut g = state.0.lock().unwrap();
        let s = &mut *g;
        if path.starts_with("/attachments/") || path.starts_with("/media/attachments/") {
            cdn(s, path, query)
        } else if let Some(rest) = path.strip_prefix("/api/") {
            let a = api(s, &method, rest, query, &ctype, &auth, &body, too_big);
            let call = Call {
                method: method.clone(),
                route: a.1.into(),
                path: url.clone(),
                status: a.0.status,
                auth: auth.clone(),
                content_type: ctype.clone(),
                user_agent: agent.clone(),
                at: Instant::now(),
            };
            push_capped(&mut s.rec.calls, call);
            a.0
        } else {
            err_json(404, 0, "404: Not Found")
        }
    };
    state.1.notify_all();
    let mut resp = tiny_http::Response::from_data(a.body).with_status_code(a.status);
    for (k, v) in a.headers {
        if let Ok(h) = tiny_http::Header::from_bytes(k.as_bytes(), v.as_bytes()) {
            resp = resp.with_header(h);
        }
    }
    let _ = req.respond(resp);
}

/// One REST call: the answer and the route template it matched ("?" for none).
#[allow(clippy::too_many_arguments)]
fn api(
    s: &mut State,
    method: &str,
    rest: &str,
    query: &str,
    ctype: &str,
    auth: &str,
    body: &[u8],
    too_big: bool,
) -> (Answer, &'static str) {
    // Chosen: v10 and v9 (both "Available") are served; other versions are unknown routes.
    let segs: Vec<&str> = rest.split('/').filter(|x| !x.is_empty()).collect();
    let (route, id) = match (method, segs.as_slice()) {
        ("GET", ["v10" | "v9", "gateway", "bot"]) => ("/gateway/bot", ""),
        ("GET", ["v10" | "v9", "users", "@me"]) => ("/users/@me", ""),
        ("GET", ["v10" | "v9", "applications", "@me"]) => ("/applications/@me", ""),
        ("GET", ["v10" | "v9", "guilds", id]) => ("/guilds/{id}", *id),
        ("GET", ["v10" | "v9", "channels", id]) => ("/channels/{id}", *id),
        ("GET" | "POST", ["v10" | "v9", "channels", id, "messages"]) => ("/channels/{id}/messages", *id),
        ("POST", ["v10" | "v9", "channels", id, "typing"]) => ("/channels/{id}/typing", *id),
        _ => return (err_json(404, 0, "404: Not Found"), "?"),
    };
    let mut a = if auth != format!("Bot {}", s.k.token) {
        err_json(401, 0, "401: Unauthorized")
    } else if too_big {
        err_json(413, 40005, "Request entity too large")
    } else if let Some(left) = s
        .global_until
        .and_then(|t| t.checked_duration_since(Instant::now()))
        .filter(|left| !left.is_zero())
    {
        // Chosen: `retry_after` rounded up to the millisecond, so a client that waits it is past
        // the window.
        let retry_after = left.as_micros().div_ceil(1000) as f64 / 1000.0;
        fault_answer(
            route,
            Fault::RateLimit {
                retry_after,
                global: true,
            },
        )
    } else if let Some(i) = s
        .faults
        .iter()
        .position(|(r, f)| route_matches(r, method, route) && !matches!(f, Fault::Lost(_)))
    {
        let fault = s.faults.remove(i).1;
        fault_answer(route, fault)
    } else {
        match (method, route) {
            (_, "/gateway/bot") => json_answer(
                200,
                &json!({"url": s.gateway_url, "shards": 1, "session_start_limit": {
                    "total": s.k.session_start_total, "remaining": s.k.session_start_remaining,
                    "reset_after": s.k.session_start_reset_after, "max_concurrency": s.k.max_concurrency}}),
            ),
            (_, "/users/@me") => json_answer(200, &s.bot),
            (_, "/applications/@me") => json_answer(200, &application_json(s)),
            // guild.mdx "Get Guild": the guild object (a few of its fields), or 404 10004.
            (_, "/guilds/{id}") => match s.guilds.iter().find(|(g, _)| g == id) {
                Some((g, name)) => json_answer(
                    200,
                    &json!({"id": g, "name": name, "icon": null, "owner_id": s.bot_id, "features": [], "roles": []}),
                ),
                None => err_json(404, 10004, "Unknown Guild"),
            },
            (_, "/channels/{id}") => match visible(s, id) {
                Ok(ch) => json_answer(200, &channel_json(ch)),
                Err(a) => a,
            },
            ("GET", "/channels/{id}/messages") => get_messages(s, id, query),
            ("POST", "/channels/{id}/messages") => post_message(s, id, ctype, body),
            _ => typing(s, id),
        }
    };
    let lost = s
        .faults
        .iter()
        .position(|(r, f)| route_matches(r, method, route) && matches!(f, Fault::Lost(_)));
    if let Some(i) = lost.filter(|_| a.status < 300) {
        if let Fault::Lost(status) = s.faults.remove(i).1 {
            a = err_json(status, 0, "502: Bad Gateway");
        }
    }
    if a.status != 429 {
        bucket_headers(&mut a, route, 4, 1.0);
    }
    (a, route)
}

fn visible<'a>(s: &'a State, id: &str) -> Result<&'a Channel, Answer> {
    match s.channels.get(id) {
        None => Err(err_json(404, 10003, "Unknown Channel")),
        Some(c) if !c.view => Err(err_json(403, 50001, "Missing Access")),
        Some(c) => Ok(c),
    }
}

/// Newest first. REST reads lose message content when the app lacks MESSAGE_CONTENT (gateway.mdx
/// "HTTP Restrictions": independent of the intents a session asked for).
fn get_messages(s: &State, id: &str, query: &str) -> Answer {
    let ch = match visible(s, id) {
        Ok(c) => c,
        Err(a) => return a,
    };
    let limit = match query_param(query, "limit").map(|l| l.parse::<usize>()) {
        None => 50,
        Some(Ok(n)) if (1..=100).contains(&n) => n,
        _ => {
            return form_error(
                Some("limit"),
                "NUMBER_TYPE_MAX",
                "int value should be between 1 and 100.",
            )
        }
    };
    let mut anchors = vec![];
    for key in ["before", "after"] {
        match query_param(query, key).map(|v| v.parse::<u64>()) {
            Some(Ok(n)) => anchors.push((key, n)),
            Some(Err(_)) => return form_error(Some(key), "NUMBER_TYPE_COERCE", "Value is not snowflake."),
            None => {}
        }
    }
    if anchors.len() > 1 {
        // Chosen: the docs say "mutually exclusive" without the answer.
        return form_error(None, "BASE_TYPE_BAD_REQUEST", "Mutually exclusive.");
    }
    if !ch.history {
        return if s.k.history_denied_403 {
            err_json(403, 50013, "Missing Permissions")
        } else {
            json_answer(200, &json!([]))
        };
    }
    let (all, num) = (&ch.msgs, |m: &&Msg| snowflake_num(&m.id));
    // `after` takes the oldest ones after it (still listed newest first).
    let page: Vec<&Msg> = match anchors.first().copied() {
        None => all.iter().rev().take(limit).collect(),
        Some(("after", a)) => {
            let mut v: Vec<&Msg> = all.iter().filter(|m| num(m) > a).take(limit).collect();
            v.reverse();
            v
        }
        Some((_, b)) => all.iter().rev().filter(|m| num(m) < b).take(limit).collect(),
    };
    let list = page.into_iter().map(|m| {
        let mut v = render_msg(s, ch, m, false, false);
        if s.k.app_intents & MESSAGE_CONTENT == 0 && !exempt(s, ch, m) {
            blank(&mut v);
        }
        v
    });
    json_answer(200, &Value::Array(list.collect()))
}

fn typing(s: &mut State, id: &str) -> Answer {
    match visible(s, id) {
        Err(a) => return a,
        Ok(ch) if !ch.send => return err_json(403, 50013, "Missing Permissions"),
        Ok(_) => {}
    }
    *s.rec.typing.entry(id.to_string()).or_default() += 1;
    let bot = s.bot_id.clone();
    typing_event(s, id, &bot);
    Answer {
        status: 204,
        body: vec![],
        headers: vec![],
    }
}

/// The request's fields: JSON, multipart (`payload_json` wins over plain fields) or a form;
/// files go to `uploads` as (n of `files[n]`, part).
fn post_payload(ctype: &str, body: &[u8], uploads: &mut Vec<(usize, Part)>) -> Result<Value, Answer> {
    let parse = |b: &[u8]| match serde_json::from_slice::<Value>(b) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err(form_error(
            None,
            "DICT_TYPE_CONVERT",
            "Only dictionaries may be used in a DictType",
        )),
        Err(_) => Err(err_json(400, 50109, "The request body contains invalid JSON.")),
    };
    let lower = ctype.to_ascii_lowercase();
    if lower.starts_with("application/json") {
        return parse(body);
    }
    if !lower.starts_with("multipart/form-data") {
        // reference.mdx, "Content Type": anything else is 50035.
        return Err(form_error(
            None,
            "CONTENT_TYPE_INVALID",
            "Expected JSON or multipart; form-urlencoded is not simulated.",
        ));
    }
    let Some(parts) = multipart(body, ctype) else {
        return Err(form_error(None, "MULTIPART_INVALID", "Invalid multipart body."));
    };
    let (mut fields, mut payload_json) = (Map::new(), None);
    for part in parts {
        if part.name == "payload_json" {
            payload_json = Some(parse(part.data.as_slice())?);
        } else if part.name.starts_with("files[") {
            // reference.mdx: each file part needs a filename.
            if part.filename.is_none() {
                return Err(form_error(
                    Some(part.name.as_str()),
                    "BASE_TYPE_REQUIRED",
                    "A filename is required.",
                ));
            }
            let n = part
                .name
                .trim_start_matches("files[")
                .trim_end_matches(']')
                .parse()
                .unwrap_or(uploads.len());
            uploads.push((n, part));
        } else {
            fields.insert(part.name.clone(), json!(String::from_utf8_lossy(&part.data)));
        }
    }
    Ok(payload_json.unwrap_or(Value::Object(fields)))
}

fn post_message(s: &mut State, id: &str, ctype: &str, body: &[u8]) -> Answer {
    let can_read = match visible(s, id) {
        Err(a) => return a,
        Ok(ch) if !ch.send => return err_json(403, 50013, "Missing Permissions"),
        Ok(ch) => ch.history,
    };
    let mut uploads: Vec<(usize, Part)> = vec![];
    let payload = match post_payload(ctype, body, &mut uploads) {
        Ok(p) => p,
        Err(a) => return a,
    };
    let content = match &payload["content"] {
        Value::Null => String::new(),
        Value::String(c) if c.chars().count() <= 2000 => c.clone(),
        Value::String(_) => {
            return form_error(
                Some("content"),
                "BASE_TYPE_MAX_LENGTH",
                "Must be 2000 or fewer in length.",
            )
        }
        _ => {
            return form_error(
                Some("content"),
                "BASE_TYPE_STRING",
                "Could not interpret value as string.",
            )
        }
    };
    // message.mdx, Create Message: `nonce` is an integer or a string of up to 25 characters.
    // Chosen: the error shapes (the docs give the limit, not the answer).
    let nonce = match &payload["nonce"] {
        Value::Null => None,
        n @ Value::String(x) if x.chars().count() <= 25 => Some(n.clone()),
        n @ Value::Number(x) if x.is_i64() || x.is_u64() => Some(n.clone()),
        Value::String(_) => return form_error(Some("nonce"), "BASE_TYPE_MAX_LENGTH", "Must be 25 or fewer in length."),
        _ => {
            return form_error(
                Some("nonce"),
                "NONCE_TYPE_INVALID",
                "Only integers and strings are allowed.",
            )
        }
    };
    // A form field arrives as the string "true".
    let enforce_nonce = payload["enforce_nonce"] == json!(true) || payload["enforce_nonce"] == json!("true");
    if uploads.len() > MAX_FILES {
        return form_error(Some("files"), "BASE_TYPE_MAX_LENGTH", "Must be 10 or fewer in length.");
    }
    if uploads.iter().any(|(_, p)| p.data.len() > s.k.max_file_bytes) {
        return err_json(413, 40005, "Request entity too large");
    }
    let present = |k: &str| payload[k].as_array().map_or(!payload[k].is_null(), |a| !a.is_empty());
    if content.trim().is_empty()
        && uploads.is_empty()
        && !["embeds", "components", "sticker_ids", "poll"]
            .iter()
            .any(|k| present(k))
    {
        return err_json(400, 50006, "Cannot send an empty message");
    }
    let ch = &s.channels[id];
    let mr = &payload["message_reference"];
    let mut reference = None;
    if !mr.is_null() {
        if !can_read {
            return err_json(403, 160002, "Cannot reply without permission to read message history");
        }
        let mid = mr["message_id"]
            .as_str()
            .map(str::to_string)
            .or_else(|| mr["message_id"].as_u64().map(|n| n.to_string()));
        let here = mr["channel_id"].as_str().is_none_or(|c| c == id);
        reference = mid.filter(|mid| here && ch.msgs.iter().any(|m| m.id == *mid));
        if reference.is_none() && mr["fail_if_not_exists"].as_bool() != Some(false) {
            // Chosen: the error's code string (the docs give the rule, not the error).
            return form_error(
                Some("message_reference"),
                "MESSAGE_REFERENCE_UNKNOWN_MESSAGE",
                "Unknown message",
            );
        }
    }
    // message.mdx, `enforce_nonce`: "If another message was created by the same author with the same
    // nonce, that message will be returned and no new message will be created." Checked once the
    // request is otherwise valid; nothing is stored, posted or dispatched.
    if let Some((cid, mid)) = nonce
        .as_ref()
        .filter(|_| enforce_nonce)
        .and_then(|n| earlier_nonce(s, n))
    {
        push_capped(&mut s.rec.nonce_hits, mid.clone());
        let ch = &s.channels[&cid];
        let m = ch.msgs.iter().find(|m| m.id == mid).expect("just found");
        return json_answer(200, &render_msg(s, ch, m, false, false));
    }
    let meta = payload["attachments"].as_array().cloned().unwrap_or_default();
    uploads.sort_by_key(|(n, _)| *n);
    let (mut files, mut posted_files) = (vec![], vec![]);
    for (n, part) in uploads {
        // message.mdx, attachment request objects: `id` is the `n` of files[n].
        let m = meta
            .iter()
            .find(|a| a["id"].as_u64().or_else(|| a["id"].as_str()?.parse().ok()) == Some(n as u64));
        let filename = m
            .and_then(|a| a["filename"].as_str())
            .map(str::to_string)
            .or(part.filename)
            .unwrap_or_default();
        let content_type = part
            .content_type
            .filter(|c| !c.is_empty())
            .unwrap_or_else(|| guess_mime(&filename).into());
        let description = m.and_then(|a| a["description"].as_str()).map(str::to_string);
        let bytes = part.data;
        let (f, fid) = (sanitize(&filename), snowflake(s));
        let stored = StoredFile {
            channel: id.into(),
            filename: f,
            content_type: content_type.clone(),
            description: description.clone(),
            bytes: bytes.clone(),
        };
        s.files.insert(fid.clone(), stored);
        files.push(fid);
        posted_files.push(PostedFile {
            filename,
            content_type,
            description,
            bytes,
        });
    }
    let mid = snowflake(s);
    let (author, reply_to) = (s.bot.clone(), reference.clone());
    let msg = Msg {
        id: mid.clone(),
        author,
        content: content.clone(),
        files,
        reference,
        edited_ms: None,
        nonce: nonce.clone(),
    };
    push_msg(s, id, msg);
    let posted = Posted {
        id: mid.clone(),
        channel: id.into(),
        content,
        reply_to,
        files: posted_files,
        nonce,
        payload,
    };
    push_capped(&mut s.rec.posted, posted);
    announce(s, id, &mid, "MESSAGE_CREATE");
    let ch = &s.channels[id];
    json_answer(
        200,
        &render_msg(s, ch, ch.msgs.last().expect("just posted"), false, false),
    )
}

/// The bot's newest message with this nonce created within `Knobs::nonce_window`: (channel, id).
/// Chosen where the docs are silent: any channel of the bot's (the docs name only author and
/// nonce); 5 and "5" are the same nonce; a deleted message is forgotten.
fn earlier_nonce(s: &State, nonce: &Value) -> Option<(String, String)> {
    let key = |n: &Value| n.as_str().map_or_else(|| n.to_string(), str::to_string);
    let since = now_ms().saturating_sub(s.k.nonce_window.as_millis() as u64);
    s.channels
        .values()
        .flat_map(|ch| ch.msgs.iter().map(move |m| (ch, m)))
        .filter(|(_, m)| m.author["id"] == s.bot_id.as_str())
        .filter(|(_, m)| m.nonce.as_ref().is_some_and(|n| key(n) == key(nonce)))
        .filter(|(_, m)| (snowflake_num(&m.id) >> 22) + DISCORD_EPOCH >= since)
        .max_by_key(|(_, m)| snowflake_num(&m.id))
        .map(|(ch, m)| (ch.id.clone(), m.id.clone()))
}

/// GET `{http}/attachments/{channel}/{id}/{filename}?ex=&is=&hm=` (or under `/media`, the
/// proxy). Chosen where the docs are silent: an expired, unsigned or tampered URL answers 404
/// "This content is no longer available."; the proxy answers 415 for what is not image, video or
/// audio (message.mdx, the `proxy_url` note).
fn cdn(s: &mut State, path: &str, query: &str) -> Answer {
    let proxied = path.starts_with("/media/");
    let plain = path.strip_prefix("/media").unwrap_or(path);
    let found = cdn_file(s, plain, query).map(|f| (f.content_type.clone(), f.bytes.clone()));
    let a = match found {
        None => {
            let headers = vec![("Content-Type".to_string(), "text/plain".to_string())];
            Answer {
                status: 404,
                body: b"This content is no longer available.".to_vec(),
                headers,
            }
        }
        Some((t, _)) if proxied && !["image/", "video/", "audio/"].iter().any(|p| t.starts_with(*p)) => {
            err_json(415, 0, "415: Unsupported Media Type")
        }
        Some((t, body)) => Answer {
            status: 200,
            body,
            headers: vec![("Content-Type".to_string(), t)],
        },
    };
    push_capped(
        &mut s.rec.downloads,
        json!({"path": path, "proxied": proxied, "status": a.status}),
    );
    a
}

fn cdn_file<'a>(s: &'a State, plain: &str, query: &str) -> Option<&'a StoredFile> {
    let parts: Vec<&str> = plain.strip_prefix("/attachments/")?.split('/').collect();
    let [channel, id, name] = parts.as_slice() else {
        return None;
    };
    let f = s
        .files
        .get(*id)
        .filter(|f| f.channel == *channel && f.filename == *name)?;
    let ex = u64::from_str_radix(&query_param(query, "ex")?, 16).ok()?;
    let is = u64::from_str_radix(&query_param(query, "is")?, 16).ok()?;
    (query_param(query, "hm")? == sign(s, plain, ex, is) && ex > now_secs()).then_some(f)
}

/// The simulator driven the way a client drives it, on its own: a plain sync tungstenite client
/// on the Gateway and ureq on REST. Every wait is a read with a socket timeout or `wait_until`.
#[cfg(test)]
mod selfcheck {
    use super::*;

    const INTENTS: u64 = GUILD_MESSAGES | DIRECT_MESSAGES | MESSAGE_CONTENT;
    // Generous: a bound on a wait for progress, reached only when something is wrong (the
    // self-checks also run beside CPU-bound loops in CI).
    const READ_TIMEOUT: Duration = Duration::from_secs(15);

    type Ws = WebSocket<TcpStream>;

    /// A client connection to `url` (its path "/" when it has none, as `resume_url`) with
    /// `?v=10&encoding=json`.
    fn connect(url: &str) -> Ws {
        let slash = if url.trim_start_matches("ws://").contains('/') {
            ""
        } else {
            "/"
        };
        try_connect(&format!("{url}{slash}?v=10&encoding=json")).unwrap()
    }

    fn try_connect(url: &str) -> Result<Ws, tungstenite::Error> {
        let host = url.trim_start_matches("ws://");
        let host = &host[..host.find(['/', '?']).unwrap_or(host.len())];
        let stream = TcpStream::connect(host).unwrap();
        stream.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
        tungstenite::client(url, stream).map(|(ws, _)| ws).map_err(|e| match e {
            tungstenite::HandshakeError::Failure(e) => e,
            tungstenite::HandshakeError::Interrupted(_) => panic!("a blocking socket"),
        })
    }

    /// The next payload; panics on a close, an error or after READ_TIMEOUT of silence.
    fn next(ws: &mut Ws) -> Value {
        loop {
            match ws.read().expect("a payload within the read timeout") {
                Message::Text(t) => return serde_json::from_str(t.as_str()).unwrap(),
                Message::Close(f) => panic!("closed: {f:?}"),
                _ => {}
            }
        }
    }

    /// The close code the server ends with (answering its close frame).
    fn close_code(ws: &mut Ws) -> u16 {
        loop {
            match ws.read().expect("a close frame within the read timeout") {
                Message::Close(f) => {
                    let _ = ws.flush();
                    return f.map_or(1005, |f| u16::from(f.code));
                }
                Message::Text(t) => assert!(!t.contains("\"op\":0"), "a dispatch before the close: {t}"),
                _ => {}
            }
        }
    }

    fn send(ws: &mut Ws, v: Value) {
        ws.send(Message::Text(v.to_string().into())).unwrap();
    }

    fn identify(token: &str, intents: u64) -> Value {
        json!({"op": 2, "d": {"token": token, "intents": intents,
               "properties": {"os": "linux", "browser": "selfcheck", "device": "selfcheck"}}})
    }

    fn agent() -> ureq::Agent {
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(5)))
            .build()
            .into()
    }

    /// (status, Retry-After, JSON body) of an authorised REST call.
    fn rest(sim: &DiscordSim, method: &str, path: &str, body: Option<(&str, Vec<u8>)>) -> (u16, String, Value) {
        let url = format!("{}{path}", sim.base);
        let auth = format!("Bot {BOT_TOKEN}");
        let mut r = match (method, body) {
            ("GET", _) => agent().get(&url).header("Authorization", &auth).call(),
            (_, Some((ctype, bytes))) => agent()
                .post(&url)
                .header("Authorization", &auth)
                .header("Content-Type", ctype)
                .send(bytes),
            _ => agent().post(&url).header("Authorization", &auth).send_empty(),
        }
        .unwrap();
        let retry = r.headers().get("Retry-After").map(|v| v.to_str().unwrap().to_string());
        let text = r.body_mut().read_to_string().unwrap();
        (
            r.status().as_u16(),
            retry.unwrap_or_default(),
            serde_json::from_str(&text).unwrap_or(Value::Null),
        )
    }

    fn post_json(sim: &DiscordSim, channel: &str, v: Value) -> (u16, Value) {
        let path = format!("/channels/{channel}/messages");
        let (status, _, body) = rest(
            sim,
            "POST",
            &path,
            Some(("application/json", v.to_string().into_bytes())),
        );
        (status, body)
    }

    fn ids(v: &Value) -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect()
    }

    /// HELLO, IDENTIFY → READY, MESSAGE_CREATE with its `s`; a bare TCP drop; RESUME on the resume
    /// URL replays the missed MESSAGE_CREATE, then RESUMED; new events follow on the new socket.
    #[test]
    fn gateway_identify_drop_resume() {
        let sim = DiscordSim::start();
        sim.knobs(|k| k.heartbeat_interval = Duration::from_millis(250));
        let guild = sim.add_guild("guild");
        let channel = sim.add_text_channel(&guild, "general");
        let alice = sim.add_user("alice", false);

        let (status, _, gw) = rest(&sim, "GET", "/gateway/bot", None);
        assert_eq!(
            (status, gw["url"].as_str()),
            (200, Some(sim.gateway_url.as_str())),
            "{gw}"
        );
        let mut ws = connect(&sim.gateway_url);
        let hello = next(&mut ws);
        assert_eq!(
            (hello["op"].as_u64(), hello["d"]["heartbeat_interval"].as_u64()),
            (Some(10), Some(250))
        );
        send(&mut ws, json!({"op": 1, "d": null}));
        assert_eq!(next(&mut ws)["op"], 11);

        send(&mut ws, identify(BOT_TOKEN, INTENTS));
        let ready = next(&mut ws);
        assert_eq!(
            (ready["op"].as_u64(), ready["t"].as_str(), ready["s"].as_u64()),
            (Some(0), Some("READY"), Some(1))
        );
        let d = &ready["d"];
        assert_eq!(d["resume_gateway_url"].as_str(), Some(sim.resume_url.as_str()));
        assert_eq!(d["user"]["id"].as_str(), Some(sim.bot_user().id.as_str()));
        assert_eq!(d["application"]["flags"].as_u64().unwrap() & (1 << 18), 1 << 18);
        let session = d["session_id"].as_str().unwrap().to_string();

        let first = sim.post(&channel, UserMsg::text(&alice, "hello"));
        let ev = next(&mut ws);
        assert_eq!(
            (ev["t"].as_str(), ev["s"].as_u64()),
            (Some("MESSAGE_CREATE"), Some(2)),
            "{ev}"
        );
        assert_eq!(
            (ev["d"]["id"].as_str(), ev["d"]["content"].as_str()),
            (Some(first.as_str()), Some("hello"))
        );
        assert_eq!(ev["d"]["guild_id"].as_str(), Some(guild.as_str()));
        let last_s = ev["s"].as_u64().unwrap();

        // A bare TCP close keeps the session (gateway.mdx, "Initiating a Disconnect").
        ws.get_mut().shutdown(Shutdown::Both).unwrap();
        drop(ws);
        assert!(sim.wait_until(READ_TIMEOUT, |r| r.open_connections == 0 && r.client_closes == [None]));
        let missed = sim.post(&channel, UserMsg::text(&alice, "while away"));

        // The resume URL has no path: "?v=10…" appended bare is no request target (400).
        match try_connect(&format!("{}?v=10&encoding=json", sim.resume_url)) {
            Err(tungstenite::Error::Http(r)) => assert_eq!(r.status(), 400),
            other => panic!("{:?}", other.map(|_| "connected")),
        }
        // Recorded by the socket's thread, maybe after the client read the 400: waited for.
        let line = "GET ?v=10&encoding=json HTTP/1.1";
        assert!(sim.wait_until(READ_TIMEOUT, |r| r.refused_handshakes == [line]));
        let mut ws = connect(&sim.resume_url);
        assert_eq!(next(&mut ws)["op"], 10);
        send(
            &mut ws,
            json!({"op": 6, "d": {"token": BOT_TOKEN, "session_id": session, "seq": last_s}}),
        );
        let ev = next(&mut ws);
        assert_eq!(
            (ev["t"].as_str(), ev["s"].as_u64()),
            (Some("MESSAGE_CREATE"), Some(3)),
            "{ev}"
        );
        assert_eq!(ev["d"]["id"].as_str(), Some(missed.as_str()));
        let resumed = next(&mut ws);
        assert_eq!(
            (resumed["t"].as_str(), resumed["s"].as_u64()),
            (Some("RESUMED"), Some(4)),
            "{resumed}"
        );
        let after = sim.post(&channel, UserMsg::text(&alice, "back"));
        let ev = next(&mut ws);
        assert_eq!(
            (ev["d"]["id"].as_str(), ev["s"].as_u64()),
            (Some(after.as_str()), Some(5)),
            "{ev}"
        );

        sim.records(|r| {
            assert_eq!(r.resumes.len(), 1);
            assert_eq!(
                (
                    r.resumes[0]["outcome"].as_str(),
                    r.resumes[0]["via_resume_url"].as_bool()
                ),
                (Some("resumed"), Some(true))
            );
            assert_eq!(r.connections.iter().map(|c| c.1).collect::<Vec<_>>(), [false, true]);
            assert_eq!(r.connections[1].0, "/?v=10&encoding=json");
        });
        assert_eq!(sim.current_session(), Some((session, 5)));
    }

    /// IDENTIFY refusals: a wrong token, the REST form "Bot …" of the right one (4004), and a
    /// privileged intent the app lacks (4014); GET /applications/@me's flags follow the knob.
    #[test]
    fn identify_refusals_and_application_flags() {
        let sim = DiscordSim::start();
        for token in ["wrong", &format!("Bot {BOT_TOKEN}")] {
            let mut ws = connect(&sim.gateway_url);
            assert_eq!(next(&mut ws)["op"], 10);
            send(&mut ws, identify(token, INTENTS));
            assert_eq!(close_code(&mut ws), 4004, "token {token:?}");
        }
        let (status, _, app) = rest(&sim, "GET", "/applications/@me", None);
        assert_eq!(status, 200, "{app}");
        assert_eq!(app["id"].as_str(), Some(sim.bot_user().id.as_str()));
        assert_eq!(
            (app["bot_public"].as_bool(), app["name"].is_string()),
            (Some(true), true)
        );
        assert_eq!(app["flags"].as_u64().unwrap() & (3 << 18), 1 << 18);

        sim.knobs(|k| k.app_intents = 0);
        let (_, _, app) = rest(&sim, "GET", "/applications/@me", None);
        assert_eq!(app["flags"].as_u64().unwrap() & (3 << 18), 0, "{app}");
        let mut ws = connect(&sim.gateway_url);
        assert_eq!(next(&mut ws)["op"], 10);
        send(&mut ws, identify(BOT_TOKEN, INTENTS));
        assert_eq!(close_code(&mut ws), 4014);
        assert_eq!(sim.calls("GET /applications/@me").len(), 2);
        sim.records(|r| {
            assert_eq!(
                (r.identifies.len(), r.ready, r.server_closes.clone()),
                (3, 0, vec![4004, 4004, 4014])
            )
        });
    }

    /// History paging (newest first, `after` too), `enforce_nonce`, a multipart upload and its CDN
    /// URL, and a 429 with `retry_after` and `Retry-After`.
    #[test]
    fn rest_history_nonce_upload_rate_limit() {
        let sim = DiscordSim::start();
        let guild = sim.add_guild("guild");
        let channel = sim.add_text_channel(&guild, "general");
        let alice = sim.add_user("alice", false);
        let m: Vec<String> = (0..5)
            .map(|i| sim.post(&channel, UserMsg::text(&alice, &format!("m{i}")).offline()))
            .collect();
        let want = |ix: &[usize]| ix.iter().map(|&i| m[i].clone()).collect::<Vec<_>>();
        let page = |q: &str| {
            let (status, _, v) = rest(&sim, "GET", &format!("/channels/{channel}/messages?{q}"), None);
            assert_eq!(status, 200, "{v}");
            ids(&v)
        };
        assert_eq!(page("limit=2"), want(&[4, 3]));
        assert_eq!(page(&format!("after={}&limit=2", m[0])), want(&[2, 1]));
        assert_eq!(page(&format!("after={}&limit=2", m[2])), want(&[4, 3]));
        assert_eq!(page(&format!("after={}", m[4])), want(&[]));
        assert_eq!(page(&format!("before={}&limit=10", m[2])), want(&[1, 0]));

        let body = json!({"content": "once", "nonce": "n-1", "enforce_nonce": true});
        let (s1, a) = post_json(&sim, &channel, body.clone());
        let (s2, b) = post_json(&sim, &channel, body);
        assert_eq!(
            (s1, s2, &a["id"], a["nonce"].as_str()),
            (200, 200, &b["id"], Some("n-1")),
            "{a} {b}"
        );
        let (_, c) = post_json(&sim, &channel, json!({"content": "again", "nonce": "n-1"}));
        assert_ne!(
            c["id"], a["id"],
            "without enforce_nonce a repeated nonce is a new message"
        );
        let (status, _) = post_json(&sim, &channel, json!({"content": "x", "nonce": "n".repeat(26)}));
        assert_eq!(status, 400);
        assert_eq!(sim.posted(&channel).len(), 2);
        sim.records(|r| assert_eq!(r.nonce_hits, [a["id"].as_str().unwrap()]));

        let boundary = "selfcheck-boundary";
        let payload = json!({"content": "file", "attachments": [{"id": 0, "filename": "a b.txt"}],
                             "message_reference": {"message_id": m[4]}});
        let mut form = format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"payload_json\"\r\n\
            Content-Type: application/json\r\n\r\n{payload}\r\n--{boundary}\r\nContent-Disposition: form-data; \
            name=\"files[0]\"; filename=\"a b.txt\"\r\nContent-Type: text/plain\r\n\r\n"
        )
        .into_bytes();
        form.extend_from_slice(b"bytes\r\n");
        form.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
        let ctype = format!("multipart/form-data; boundary={boundary}");
        let (status, _, msg) = rest(
            &sim,
            "POST",
            &format!("/channels/{channel}/messages"),
            Some((&ctype, form)),
        );
        assert_eq!((status, msg["type"].as_u64()), (200, Some(19)), "{msg}");
        let att = &msg["attachments"][0];
        assert_eq!(
            (att["filename"].as_str(), att["size"].as_u64()),
            (Some("a_b.txt"), Some(7)),
            "{att}"
        );
        let url = att["url"].as_str().unwrap();
        assert!(
            url.starts_with(&format!("{}/attachments/{channel}/", sim.http)) && url.contains("&hm="),
            "{url}"
        );
        let mut r = agent().get(url).call().unwrap();
        assert_eq!(
            (r.status().as_u16(), r.body_mut().read_to_vec().unwrap()),
            (200, b"bytes\r\n".to_vec())
        );
        sim.expire_attachment_urls();
        assert_eq!(agent().get(url).call().unwrap().status().as_u16(), 404);

        sim.fault(
            "POST /channels/{id}/typing",
            1,
            Fault::RateLimit {
                retry_after: 1.25,
                global: false,
            },
        );
        let typing = format!("/channels/{channel}/typing");
        let (status, retry, body) = rest(&sim, "POST", &typing, None);
        assert_eq!(
            (status, retry.as_str(), body["retry_after"].as_f64()),
            (429, "2", Some(1.25)),
            "{body}"
        );
        assert_eq!(rest(&sim, "POST", &typing, None).0, 204);
        sim.records(|r| assert_eq!(r.typing.get(&channel), Some(&1)));
    }
}
