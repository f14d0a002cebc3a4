//! Discord's side of the link supervisor (`link::supervise`): one Gateway session per bot,
//! shared by every channel bound through it. Each channel's messages go to the outbox in the
//! channel's lane, on the pool (`Discord::accept`).
//!
//! A connection (gateway-events.mdx, gateway.mdx): HELLO names the heartbeat interval; the
//! first heartbeat goes after a random part of it, each carries the last sequence number, and a
//! heartbeat not acknowledged (op 11) by the next one means a zombie connection: closed with a
//! code other than 1000/1001 (which would end the session) and resumed. RESUME first, on the
//! session's `resume_gateway_url`, so Discord replays what was missed; IDENTIFY only when there
//! is no session to resume (at start, after op 9 `false`, 4007, 4009). After every READY (a new
//! session: nothing replayed) each bound channel is caught up from its cursor.
//!
//! IDENTIFY is rationed: Discord allows 1,000 a day per bot and then resets its token. So
//! IDENTIFYs are at least `IDENTIFY_MIN` apart, the gap doubles (to `IDENTIFY_MAX`) whenever a
//! new session ends within `SHORT_LIVED` or never becomes ready, and none is sent while
//! `session_start_limit.remaining` is 0: the bot's channels are then `degraded` (no messages
//! arrive; sends work), their Descriptors and `/status` say until when, and one log line says
//! it, however often the budget is asked for meanwhile. A close that says the configuration is
//! wrong (4004 bad token, 4010–4013, 4014 the Message Content intent) stops the bot: its
//! channels' Descriptors and `/status` say why, and nothing is tried until it is bound again.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use async_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use async_tungstenite::tungstenite::protocol::CloseFrame;
use async_tungstenite::tungstenite::Message as WsMessage;

use super::event::{self, Event, Frame, Message};
use super::Discord;
use crate::atomic::AtomicU64;
use crate::ids;
use crate::json;
use crate::providers::link::workers::Worker;
use crate::providers::link::{
    self, conn, Conn, Dial, Ended, Followers, Heard, Keepalive, Line, Links, Opened, Session,
};
use crate::providers::socket::{self, Budget, Held, Up};
use crate::providers::Transient;
use crate::quiet::Quiet;
use crate::runtime;
use crate::wsclient;

/// GUILD_MESSAGES, DIRECT_MESSAGES, MESSAGE_CONTENT (gateway.mdx "List of Intents").
const INTENTS: u64 = (1 << 9) | (1 << 12) | (1 << 15);
/// A frame larger than this ends the connection. With the intents above the Gateway sends
/// messages, READY and small events; a message with embeds is a few KiB.
const MAX_FRAME: usize = 1 << 20;
/// Bytes of messages read and not yet handed to the outbox: past this the reader stops reading
/// (Discord holds what it has not sent).
const QUEUED_BYTES: usize = 1 << 20;
/// A message counts as at least this many bytes against `QUEUED_BYTES`.
const MIN_EVENT_COST: usize = 1024;
/// `GET /gateway/bot` gives up after this long.
const OPEN_TIMEOUT: Duration = Duration::from_secs(15);
/// HELLO must come this soon after the handshake.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// The heartbeat interval HELLO may name, clamped to this range (Discord's is about 41 s).
const BEAT_MIN: Duration = Duration::from_millis(500);
const BEAT_MAX: Duration = Duration::from_secs(120);
/// IDENTIFYs are at least this far apart (`max_concurrency` 1: one per 5 s)...
const IDENTIFY_MIN: Duration = Duration::from_secs(6);
/// ...and, while sessions keep failing, at most this far (under 150 a day).
const IDENTIFY_MAX: Duration = Duration::from_secs(600);
/// A new session that ends sooner than this counts as failed: the IDENTIFY gap grows.
const SHORT_LIVED: Duration = Duration::from_secs(60);
/// A resume URL that cannot be reached this many times in a row is given up for IDENTIFY.
const RESUME_TRIES: u32 = 3;
/// The longest wait for the daily session budget honoured at once (Discord names when it
/// resets; asked again after this).
const BUDGET_WAIT_MAX: Duration = Duration::from_secs(3600);
/// The longest `reset_after` believed: the budget is daily.
const BUDGET_RESET_MAX: Duration = Duration::from_secs(86_400);

/// The running sessions, by bot user ID.
pub struct Sessions {
    links: Links,
    shared: Arc<Shared>,
}

/// What the sessions tell the provider besides their links' state.
#[derive(Default)]
struct Shared {
    /// Bots whose daily budget of new sessions is spent, and when it resets (ms since 1970).
    spent: Mutex<HashMap<String, u64>>,
    identifies: AtomicU64,
}

impl Shared {
    fn spent(&self) -> MutexGuard<'_, HashMap<String, u64>> {
        self.spent.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Notes that `bot`'s session budget is spent until `resets_ms` (or, `None`, that it is
    /// not); whether that changed the bot's state (spent or not).
    fn set_spent(&self, bot: &str, resets_ms: Option<u64>) -> bool {
        match resets_ms {
            Some(at) => self.spent().insert(bot.to_string(), at).is_none(),
            None => self.spent().remove(bot).is_some(),
        }
    }
}

impl Sessions {
    /// `followers`: the bots' channels' Descriptors.
    pub fn new(followers: Followers) -> Sessions {
        Sessions {
            links: Links::new("discord: bot", "Gateway session").followed_by(followers),
            shared: Arc::default(),
        }
    }

    /// Starts a session for every bot in `wanted` and stops the others.
    pub fn sync(&self, discord: &Weak<Discord>, wanted: &[String]) {
        let followers = self.links.followers();
        self.links.sync(wanted, |line| {
            start(discord, line, self.shared.clone(), followers.clone())
        });
        self.shared.spent().retain(|bot, _| wanted.contains(bot));
    }

    /// Stops the session of `bot` (a refused one, bound again): the next `sync` starts anew.
    pub fn forget(&self, bot: &str) {
        self.shared.set_spent(bot, None);
        self.links.forget(bot);
    }

    pub fn stop_all(&self) {
        self.links.stop_all();
    }

    /// The sessions; one is up while it is ready (READY or RESUMED).
    pub fn links(&self) -> &Links {
        &self.links
    }

    pub fn identifies(&self) -> u64 {
        self.shared.identifies.load(Ordering::Relaxed)
    }

    /// Why Discord refuses `bot`, if it does.
    pub fn refused(&self, bot: &str) -> Option<String> {
        self.links.refused(bot)
    }

    /// When `bot`'s spent budget of new sessions resets (ms since 1970), while it is spent.
    pub fn spent_until(&self, bot: &str) -> Option<u64> {
        self.shared.spent().get(bot).copied()
    }

    /// What a binding's `GET /gateway/bot` said of `bot`'s session budget, so the binding's own
    /// Descriptor tells before its session asks.
    pub fn budget_seen(&self, bot: &str, answer: &json::Value) {
        let reset = json::as_object(answer).and_then(spent_for);
        self.shared.set_spent(bot, reset.map(resets_at));
    }
}

/// How long until the session budget resets, when `GET /gateway/bot`'s answer says it is spent
/// (`session_start_limit.remaining` 0); at most a day, and a day when it does not say.
pub fn spent_for(answer: &json::Object) -> Option<Duration> {
    let limit = json::get_obj(answer, "session_start_limit")?;
    if json::get_u64(limit, "remaining") != Some(0) {
        return None;
    }
    let reset = json::get_u64(limit, "reset_after").map_or(BUDGET_RESET_MAX, Duration::from_millis);
    Some(reset.min(BUDGET_RESET_MAX))
}

/// The clock time (ms since 1970) `reset` from now.
fn resets_at(reset: Duration) -> u64 {
    ids::now_ms().saturating_add(u64::try_from(reset.as_millis()).unwrap_or(u64::MAX))
}

/// A session that can be resumed.
#[derive(Clone)]
struct Resume {
    session_id: String,
    url: String,
    seq: Option<u64>,
}

/// How a connection ended, and what comes next.
enum End {
    /// Reconnect and RESUME.
    Resume(String),
    /// The session is gone: IDENTIFY anew (after a short wait when Discord asked for one).
    Identify(String, bool),
    /// Discord refuses the bot for a reason only its owner can fix.
    Refused(String),
}

/// The link of `bot`, given its state line.
fn start(discord: &Weak<Discord>, line: Line, shared: Arc<Shared>, followers: Option<Followers>) -> Option<Worker> {
    let plain_ok = discord.upgrade().is_some_and(|d| d.api.base().starts_with("http://"));
    let (budget, room) = Budget::new(QUEUED_BYTES);
    let (d, b) = (discord.clone(), line.account().to_string());
    let bot = Bot {
        discord: discord.clone(),
        id: line.account().to_string(),
        shared,
        followers,
        budget,
        room,
        lanes: Mutex::new(socket::Lanes::new(move |batch: Vec<Job>| {
            lane(d.clone(), b.clone(), batch)
        })),
        plain_ok,
        state: Mutex::new(State {
            resume: None,
            resume_failures: 0,
            identify_gap: IDENTIFY_MIN,
            next_identify: Instant::now(),
            spent_said: false,
            url: String::new(),
        }),
    };
    link::supervise::start(Arc::new(bot), line)
}

/// What one bot's connections share, kept across reconnects: messages a lane is still storing
/// from an ended connection count against the same budget, and a channel keeps one lane, so
/// its messages stay in order whichever connection read them.
struct Bot<H> {
    discord: Weak<Discord>,
    id: String,
    shared: Arc<Shared>,
    followers: Option<Followers>,
    budget: Budget,
    room: smol::channel::Receiver<()>,
    lanes: Mutex<socket::Lanes<Job, H>>,
    /// Gateway URLs may be `ws://` only when the REST base is `http://` (a test server): the
    /// token travels in IDENTIFY and RESUME.
    plain_ok: bool,
    state: Mutex<State>,
}

/// The session state, across connections.
struct State {
    resume: Option<Resume>,
    /// Resume URLs that could not be reached in a row.
    resume_failures: u32,
    identify_gap: Duration,
    next_identify: Instant,
    /// The spent budget was logged in this spell (one line, not one per question).
    spent_said: bool,
    /// The URL of the connection up now.
    url: String,
}

/// What `Bot::open` hands `serve`: the socket, the token, whether it IDENTIFYs.
type Opening = (Box<wsclient::Ws>, String, bool);

impl<H> Bot<H> {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The bot's channels' Descriptors changed.
    async fn tell(&self) {
        link::accounts::tell(self.followers.clone(), &self.id).await;
    }

    /// A Gateway URL imgate may send the token to.
    fn usable(&self, url: &str) -> bool {
        url.len() <= 2048 && (url.starts_with("wss://") || (self.plain_ok && url.starts_with("ws://")))
    }
}

impl<H, F> Bot<H>
where
    H: Fn(Vec<Job>) -> F + Clone + Send + Sync + 'static,
    F: std::future::Future<Output = bool> + Send + 'static,
{
    fn route(&self, channel: String, job: Job) {
        self.lanes.lock().unwrap_or_else(|e| e.into_inner()).route(channel, job);
    }

    /// The URL of the next IDENTIFY, once the gap and the session budget allow one.
    async fn identify_url(&self, token: &str) -> Result<String, Opened<Opening>> {
        let at = self.state().next_identify;
        smol::Timer::at(at).await;
        match gateway_url(self, token).await {
            Ok(url) => {
                self.state().spent_said = false;
                if self.shared.set_spent(&self.id, None) {
                    self.tell().await;
                }
                Ok(url)
            }
            Err(Open::Refused(why)) => Err(Opened::Refused(why)),
            Err(Open::Spent(reset)) => {
                let resets = resets_at(reset);
                let say = !std::mem::replace(&mut self.state().spent_said, true);
                if self.shared.set_spent(&self.id, Some(resets)) {
                    self.tell().await;
                }
                let note = say.then(|| {
                    format!(
                        "Discord's daily budget of new sessions is used up; no Gateway session (no messages arrive) until it resets at {}",
                        ids::utc(resets)
                    )
                });
                // At least the IDENTIFY gap: a peer's 0 must not make a loop.
                Err(Opened::Later(reset.min(BUDGET_WAIT_MAX).max(IDENTIFY_MIN), note))
            }
            Err(Open::Failed(why, retry_after)) => {
                Err(Opened::Failed(format!("cannot reach the Gateway: {why}"), retry_after))
            }
        }
    }
}

impl<H, F> Dial for Bot<H>
where
    H: Fn(Vec<Job>) -> F + Clone + Send + Sync + 'static,
    F: std::future::Future<Output = bool> + Send + 'static,
{
    type Socket = Opening;

    /// A refusal only the owner can fix: nothing is tried until the channel is bound again.
    const REFUSED_WAIT: Option<Duration> = None;

    /// RESUME's URL, or a new session's (`GET /gateway/bot`, within the IDENTIFY gap and the
    /// daily budget), and the handshake.
    async fn open(&self) -> Option<Opened<Opening>> {
        let token = token_of(&self.discord, &self.id).await?;
        let resume_url = self.state().resume.as_ref().map(|r| r.url.clone());
        let identify = resume_url.is_none();
        let url = match resume_url {
            Some(url) => url,
            None => match self.identify_url(&token).await {
                Ok(url) => url,
                Err(not_now) => return Some(not_now),
            },
        };
        let ws = match connect(&url).await {
            Ok(ws) => ws,
            Err(why) => {
                let mut state = self.state();
                if !identify {
                    state.resume_failures += 1;
                    if state.resume_failures >= RESUME_TRIES {
                        state.resume = None;
                    }
                }
                return Some(Opened::Failed(format!("cannot connect to the Gateway: {why}"), None));
            }
        };
        let mut state = self.state();
        state.resume_failures = 0;
        state.url = url;
        if identify {
            self.shared.identifies.fetch_add(1, Ordering::Relaxed);
            state.next_identify = Instant::now() + state.identify_gap;
        }
        Some(Opened::Up((Box::new(ws), token, identify)))
    }

    async fn serve(self: Arc<Self>, (ws, token, identify): Opening, session: Session) -> Ended {
        let started = Instant::now();
        let mut ready = false;
        let end = live(&self, *ws, &token, &session, &mut ready).await;
        if identify {
            let mut state = self.state();
            let before = state.identify_gap;
            state.identify_gap = next_gap(before, ready && started.elapsed() >= SHORT_LIVED);
            if state.identify_gap == IDENTIFY_MAX && before < IDENTIFY_MAX {
                log::warn!(
                    "discord: bot {}: new sessions keep failing; one is tried every {} to spare the daily budget",
                    self.id,
                    crate::config::fmt_duration(IDENTIFY_MAX)
                );
            }
        }
        match end {
            End::Refused(why) => Ended::refused(why),
            // A session that became ready (or resumed) worked: resumed at once.
            End::Resume(why) => Ended::down(format!("{why}; resuming"), ready),
            End::Identify(why, pause) => {
                self.state().resume = None;
                let ended = Ended::down(format!("{why}; starting a new session"), ready);
                match pause {
                    // Op 9: "wait a random amount of time between 1 and 5 seconds".
                    true => ended.pausing(Duration::from_millis(1000 + ids::below(4000))),
                    false => ended,
                }
            }
        }
    }
}

/// The gap before the next IDENTIFY: back to the least after a session that held, doubled
/// (to at most `IDENTIFY_MAX`) after one that failed.
fn next_gap(gap: Duration, held: bool) -> Duration {
    match held {
        true => IDENTIFY_MIN,
        false => gap.saturating_mul(2).clamp(IDENTIFY_MIN, IDENTIFY_MAX),
    }
}

async fn token_of(discord: &Weak<Discord>, bot: &str) -> Option<String> {
    let (d, b) = (discord.upgrade()?, bot.to_string());
    // A token file read is disk I/O: on the pool.
    runtime::unblock(move || d.token(&b)).await
}

enum Open {
    /// Discord refuses the token.
    Refused(String),
    /// The daily session budget is used up: how long until it resets (at most a day).
    Spent(Duration),
    /// Could not ask now; the wait Discord asked for, if it did.
    Failed(String, Option<Duration>),
}

/// `GET /gateway/bot` on the pool: the Gateway's URL, once the session budget allows one more.
async fn gateway_url<H>(bot: &Bot<H>, token: &str) -> Result<String, Open> {
    let Some(d) = bot.discord.upgrade() else {
        return Err(Open::Failed("stopping".into(), None));
    };
    let t = token.to_string();
    let answer = runtime::unblock(move || d.api.get(&t, "/gateway/bot", OPEN_TIMEOUT)).await;
    let answer = match answer {
        Ok(a) => a,
        Err(e) if e.status == 401 => {
            return Err(Open::Refused(
                "Discord rejected the bot token (401): bind the channel again with a new token".into(),
            ))
        }
        Err(e) => return Err(Open::Failed(e.to_string(), e.retry_after())),
    };
    let o = json::as_object(&answer).cloned().unwrap_or_default();
    if let Some(reset) = spent_for(&o) {
        return Err(Open::Spent(reset));
    }
    match json::get_str(&o, "url") {
        Some(url) if bot.usable(url) => Ok(url.to_string()),
        _ => Err(Open::Failed("no usable Gateway URL (wss://)".into(), None)),
    }
}

/// The Gateway URL with the version and encoding imgate speaks (no compression).
fn versioned(url: &str) -> String {
    match url.contains('?') {
        true => format!("{url}&v=10&encoding=json"),
        false => format!("{}/?v=10&encoding=json", url.trim_end_matches('/')),
    }
}

async fn connect(url: &str) -> Result<wsclient::Ws, String> {
    wsclient::open(&versioned(url), MAX_FRAME).await
}

fn text(v: json::Value) -> WsMessage {
    WsMessage::Text(json::to_string(&v).into())
}

fn identify_payload(token: &str) -> WsMessage {
    let properties = json::obj([
        ("os", json::s("linux")),
        ("browser", json::s("imgate")),
        ("device", json::s("imgate")),
    ]);
    let d = json::obj([
        ("token", json::s(token)),
        ("intents", json::n(INTENTS)),
        ("properties", properties),
    ]);
    text(json::obj([("op", json::n(2)), ("d", d)]))
}

fn resume_payload(token: &str, r: &Resume) -> WsMessage {
    let d = json::obj([
        ("token", json::s(token)),
        ("session_id", json::s(&r.session_id)),
        // READY carries the first sequence number, so a session always has one.
        ("seq", json::n(r.seq.unwrap_or(0))),
    ]);
    text(json::obj([("op", json::n(6)), ("d", d)]))
}

/// Op 1 with the last sequence number, `null` before the first (written out: `json::obj`
/// leaves nulls out, and `d` must be there).
fn heartbeat(seq: Option<u64>) -> WsMessage {
    let d = seq.map_or_else(|| "null".to_string(), |s| s.to_string());
    WsMessage::Text(format!("{{\"op\":1,\"d\":{d}}}").into())
}

/// A close that keeps the session resumable (any code but 1000 and 1001).
fn resumable_close() -> WsMessage {
    WsMessage::Close(Some(CloseFrame {
        code: CloseCode::from(4000u16),
        reason: "resuming".into(),
    }))
}

/// What a close code from Discord means (opcodes-and-status-codes.mdx, "Gateway Close Event
/// Codes").
fn closed_with(code: u16) -> End {
    match code {
        4004 => End::Refused("Discord rejected the bot token (4004): bind the channel again with a new token".into()),
        4014 => End::Refused(
            "the bot's Message Content Intent is off (4014): turn it on (Developer Portal, Bot, Privileged Gateway Intents), then bind again"
                .into(),
        ),
        4010..=4013 => End::Refused(format!(
            "Discord refused the session ({code}): this imgate cannot connect this bot"
        )),
        4007 | 4009 => End::Identify(format!("closed by Discord ({code})"), false),
        _ => End::Resume(format!("closed by Discord ({code})")),
    }
}

/// One job of a channel's lane.
enum Job {
    /// Read the channel's history from its cursor first.
    CatchUp(String),
    /// A message, with its share of the budget until it is handed to the outbox.
    Message(Box<Message>, Held),
}

impl Job {
    fn channel(&self) -> &str {
        match self {
            Job::CatchUp(c) => c,
            Job::Message(m, _) => &m.channel,
        }
    }
}

/// One connection, until it ends. The session's `resume` is kept current (READY's session,
/// each sequence number); `ready` is set once the session is ready.
async fn live<H, F>(bot: &Bot<H>, ws: wsclient::Ws, token: &str, session: &Session, ready: &mut bool) -> End
where
    H: Fn(Vec<Job>) -> F + Clone + Send + Sync + 'static,
    F: std::future::Future<Output = bool> + Send + 'static,
{
    // Until HELLO names the heartbeat, the one tick is HELLO's deadline.
    let waiting = Keepalive::Ticks {
        first: HELLO_TIMEOUT,
        every: HELLO_TIMEOUT,
    };
    let mut conn = Conn::new(ws, bot.budget.clone(), bot.room.clone(), waiting);
    let interval = match hello(&mut conn).await {
        Ok(ms) => Duration::from_millis(ms).clamp(BEAT_MIN, BEAT_MAX),
        Err(why) => return End::Resume(crate::quiet::shown(&why)),
    };
    // The first beat after `interval * jitter` (gateway.mdx "Sending Heartbeats").
    conn.keep_alive(Keepalive::Ticks {
        first: interval.mul_f64(ids::below(1000) as f64 / 1000.0),
        every: interval,
    });
    let first = match bot.state().resume.as_ref() {
        Some(r) => resume_payload(token, r),
        None => identify_payload(token),
    };
    if conn.send(first, None).await.is_err() {
        return End::Resume("the writer stopped".into());
    }
    let mut up_while_ready: Option<Up> = None;
    let mut unreadable = Quiet::new();
    let mut acked = true;
    loop {
        let text = match conn.next().await {
            Heard::Text(t) => t,
            Heard::Binary(_) => continue,
            // A paused reader hears no ACK either: a heartbeat meanwhile is not a zombie's.
            Heard::Tick { paused } => {
                if !acked && !paused {
                    conn.close(resumable_close()).await;
                    return End::Resume("no heartbeat acknowledged: a zombie connection".into());
                }
                let seq = bot.state().resume.as_ref().and_then(|r| r.seq);
                if conn.offer(heartbeat(seq)).is_err() {
                    return End::Resume("the writer stopped".into());
                }
                acked = false;
                // A channel whose catch-up failed is tried again at a heartbeat.
                if let Some(d) = bot.discord.upgrade() {
                    for channel in d.due(&bot.id) {
                        bot.route(channel.clone(), Job::CatchUp(channel));
                    }
                }
                continue;
            }
            Heard::Closed(Some(f)) => return closed_with(u16::from(f.code)),
            Heard::Closed(None) => return End::Resume("closed by Discord".into()),
            // A frame past `MAX_FRAME` would come again in a RESUME's replay: a new session
            // skips it (the catch-up reads the channels' histories instead).
            Heard::Broken(async_tungstenite::tungstenite::Error::Capacity(e)) => {
                return End::Identify(format!("a frame too large ({e})"), false)
            }
            Heard::Broken(e) => return End::Resume(crate::quiet::shown(&e.to_string())),
            Heard::Ended(why) => return End::Resume(why),
        };
        let cost = text.len().max(MIN_EVENT_COST);
        match conn::parse(text, event::read_frame).await {
            Frame::Hello { .. } => {}
            Frame::HeartbeatAck => acked = true,
            Frame::Heartbeat => {
                let seq = bot.state().resume.as_ref().and_then(|r| r.seq);
                let _ = conn.offer(heartbeat(seq));
            }
            Frame::Reconnect => {
                conn.close(resumable_close()).await;
                return End::Resume("Discord asked for a reconnect".into());
            }
            Frame::InvalidSession { resumable: true } => {
                conn.close(resumable_close()).await;
                return End::Resume("Discord invalidated the connection".into());
            }
            Frame::InvalidSession { resumable: false } => {
                conn.close(resumable_close()).await;
                return End::Identify("Discord invalidated the session".into(), true);
            }
            Frame::Dispatch { seq, event } => {
                let resumable = {
                    let mut state = bot.state();
                    if let (Some(s), Some(r)) = (seq, state.resume.as_mut()) {
                        r.seq = Some(r.seq.map_or(s, |old| old.max(s)));
                    }
                    state.resume.is_some()
                };
                match event {
                    Event::Ready {
                        session_id,
                        resume_url,
                        user_id,
                    } => {
                        if user_id != bot.id {
                            return End::Refused("the token now belongs to another bot: bind the channel again".into());
                        }
                        // A resume URL imgate would not send the token to: resumed where it
                        // connected, as clients did before Discord named one.
                        {
                            let mut state = bot.state();
                            let url = match bot.usable(&resume_url) {
                                true => resume_url,
                                false => state.url.clone(),
                            };
                            state.resume = Some(Resume { session_id, url, seq });
                        }
                        // A new session replays nothing: every channel reads its history first,
                        // and a channel not marked so would let live messages pass a gap.
                        let (d, b) = (bot.discord.clone(), bot.id.clone());
                        let channels = runtime::unblock(move || d.upgrade().and_then(|d| d.session_started(&b))).await;
                        let Some(channels) = channels else {
                            conn.close(resumable_close()).await;
                            return End::Identify("the bindings cannot be read".into(), true);
                        };
                        for channel in channels {
                            bot.route(channel.clone(), Job::CatchUp(channel));
                        }
                        *ready = true;
                        up_while_ready = Some(session.up());
                    }
                    Event::Resumed => {
                        *ready = true;
                        up_while_ready.get_or_insert_with(|| session.up());
                    }
                    Event::Message(m) => {
                        let held = conn.budget().take(cost);
                        bot.route(m.channel.clone(), Job::Message(m, held));
                    }
                    // A session whose READY cannot be read cannot be resumed, and its catch-up
                    // would not run: a new one.
                    Event::Unreadable(why) if !resumable => {
                        conn.close(resumable_close()).await;
                        return End::Identify(why.into(), true);
                    }
                    Event::Unreadable(why) => {
                        if let Some(more) = unreadable.admit() {
                            log::warn!("discord: bot {}: an event was not read: {why}{more}", bot.id);
                        }
                    }
                    Event::Other => {}
                }
            }
            Frame::Other(what) => {
                if let Some(more) = unreadable.admit() {
                    log::warn!(
                        "discord: bot {}: a frame was not read: {}{more}",
                        bot.id,
                        crate::quiet::shown(&what)
                    );
                }
            }
        }
    }
}

/// HELLO's heartbeat interval (ms): the first frame, within `HELLO_TIMEOUT`.
async fn hello(conn: &mut Conn) -> Result<u64, String> {
    let not_hello = || Err("the first frame is not HELLO".to_string());
    match conn.next().await {
        // A HELLO is about 100 bytes: a large first frame is not parsed on the executor.
        Heard::Text(t) if t.len() > json::INLINE_PARSE => not_hello(),
        Heard::Text(t) => match event::read_frame(t.as_str()) {
            Frame::Hello { heartbeat_interval } => Ok(heartbeat_interval),
            _ => not_hello(),
        },
        Heard::Binary(_) => not_hello(),
        Heard::Tick { .. } => Err(format!("no HELLO within {HELLO_TIMEOUT:?}")),
        Heard::Closed(f) => Err(format!("closed before HELLO ({:?})", f.map(|f| u16::from(f.code)))),
        Heard::Broken(e) => Err(e.to_string()),
        Heard::Ended(why) => Err(why),
    }
}

/// A batch of one lane's jobs, in order: each channel's run of jobs handed to
/// `Discord::accept` on the pool. The lane goes on after its connection ended: what was read is
/// stored.
async fn lane(discord: Weak<Discord>, bot: String, batch: Vec<Job>) -> bool {
    for (channel, run) in socket::runs(batch, Job::channel) {
        let catch_up = run.iter().any(|j| matches!(j, Job::CatchUp(_)));
        let (messages, held): (Vec<Message>, Vec<Held>) = run
            .into_iter()
            .filter_map(|j| match j {
                Job::Message(m, held) => Some((*m, held)),
                Job::CatchUp(_) => None,
            })
            .unzip();
        let Some(d) = discord.upgrade() else { return false };
        let b = bot.clone();
        runtime::unblock(move || d.accept(&b, &channel, catch_up, messages)).await;
        drop(held);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn close_codes_that_only_the_owner_can_fix_stop_the_bot() {
        for code in [4004, 4010, 4011, 4012, 4013, 4014] {
            assert!(matches!(closed_with(code), End::Refused(_)), "{code}");
        }
        for code in [4007, 4009] {
            assert!(matches!(closed_with(code), End::Identify(_, false)), "{code}");
        }
        for code in [1000, 1001, 1006, 4000, 4001, 4002, 4003, 4005, 4008] {
            assert!(matches!(closed_with(code), End::Resume(_)), "{code}");
        }
    }

    #[test]
    fn identifies_that_keep_failing_are_spaced_out_to_ten_minutes_and_a_session_that_held_resets_them() {
        let mut gap = IDENTIFY_MIN;
        let mut per_day = 0;
        let mut t = Duration::ZERO;
        while t < Duration::from_secs(86_400) {
            per_day += 1;
            t += gap;
            gap = next_gap(gap, false);
        }
        assert_eq!(gap, IDENTIFY_MAX);
        assert!(
            per_day < 160,
            "{per_day} IDENTIFYs a day when every session fails at once"
        );
        assert_eq!(next_gap(IDENTIFY_MAX, true), IDENTIFY_MIN);
        assert_eq!(next_gap(Duration::MAX, false), IDENTIFY_MAX);
    }

    #[test]
    fn a_spent_budget_is_read_bounded_and_its_reset_shown_as_a_utc_time() {
        let answer = |v: &str| json::as_object(&json::parse(v).unwrap()).cloned().unwrap();
        let spent = answer(r#"{"session_start_limit":{"total":1000,"remaining":0,"reset_after":7000}}"#);
        assert_eq!(spent_for(&spent), Some(Duration::from_secs(7)));
        let silent = answer(r#"{"session_start_limit":{"remaining":0,"reset_after":1e300}}"#);
        assert_eq!(spent_for(&silent), Some(BUDGET_RESET_MAX));
        let huge = answer(r#"{"session_start_limit":{"remaining":0,"reset_after":18446744073709551615}}"#);
        assert_eq!(spent_for(&huge), Some(BUDGET_RESET_MAX));
        assert_eq!(spent_for(&answer(r#"{"session_start_limit":{"remaining":3}}"#)), None);
        assert_eq!(spent_for(&answer(r#"{"url":"wss://g"}"#)), None);
        assert!(resets_at(Duration::MAX) >= ids::now_ms());
    }

    #[test]
    fn gateway_urls_get_the_version_and_encoding() {
        assert_eq!(
            versioned("wss://gateway.discord.gg"),
            "wss://gateway.discord.gg/?v=10&encoding=json"
        );
        assert_eq!(versioned("ws://127.0.0.1:9/"), "ws://127.0.0.1:9/?v=10&encoding=json");
        assert_eq!(
            versioned("wss://g.example/?x=1"),
            "wss://g.example/?x=1&v=10&encoding=json"
        );
    }

    #[test]
    fn identify_and_resume_carry_the_token_bare_and_the_intents() {
        let WsMessage::Text(t) = identify_payload("a.b.c") else {
            panic!()
        };
        let v: serde_json::Value = serde_json::from_str(t.as_str()).unwrap();
        assert_eq!(v["op"], 2);
        assert_eq!(v["d"]["token"], "a.b.c");
        assert_eq!(v["d"]["intents"], 37376);
        let r = Resume {
            session_id: "s1".into(),
            url: String::new(),
            seq: Some(7),
        };
        let WsMessage::Text(t) = resume_payload("a.b.c", &r) else {
            panic!()
        };
        let v: serde_json::Value = serde_json::from_str(t.as_str()).unwrap();
        assert_eq!((v["op"].clone(), v["d"]["seq"].clone()), (6.into(), 7.into()));
        let WsMessage::Text(t) = heartbeat(None) else { panic!() };
        assert_eq!(t.as_str(), "{\"op\":1,\"d\":null}");
        let WsMessage::Text(t) = heartbeat(Some(42)) else {
            panic!()
        };
        assert_eq!(t.as_str(), "{\"op\":1,\"d\":42}");
    }
}
