//! One Socket Mode connection per bot, shared by every channel bound through it: it starts
//! with the bot's first binding and stops with its last (`Connections::sync`).
//!
//! A connection: `apps.connections.open` with the app token gives a WebSocket URL valid once;
//! the socket says `hello`, then carries envelopes, each acknowledged (`{"envelope_id":…}`)
//! only after its message was committed (`Slack::accept`, in the channel's lane, after the
//! channel's catch-up). What a connection holds is bounded until written (`socket::Budget`,
//! the writer's queue and deadline): a server that sends and never reads stalls the reader,
//! then loses the link.
//!
//! - `disconnect` `warning` / `refresh_requested`: the next connection is opened at once; once it
//!   said hello the old one stops reading, writes what it owes (at most `DRAIN`) and closes.
//! - `disconnect` `link_disabled`, or a refused `apps.connections.open` (Socket Mode off, a
//!   revoked token): the bot is disabled (its Descriptor and `/status` say why, one log line)
//!   and asked again every `REFUSED_WAIT`.
//! - A socket that says nothing for `SILENT` (a ping every `PING_EVERY` is answered by any
//!   live server) is replaced: half-open links behind NAT are common.
//! - Other ends: the next connection when `link::Pace` says (a socket that said hello worked:
//!   the next one at once, at most one per `link::MIN_AGE`; a failed open backs off), or after
//!   a 429's `Retry-After` (clamped).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use async_tungstenite::tungstenite::Message as WsMessage;
use smol::future::FutureExt;
use smol::stream::StreamExt;

use super::event::{self, Event, Frame, Message};
use super::Slack;
use crate::peer_wait;
use crate::providers::link::Pace;
use crate::providers::socket::{self, Budget, Held, Lanes, Out, Up, QUEUE_SLOTS};
use crate::providers::workers::{Worker, Workers};
use crate::providers::Transient;
use crate::quiet::Quiet;
use crate::runtime;
use crate::wsclient;

/// A frame larger than this ends the connection (Slack's events are far smaller).
const MAX_FRAME: usize = 1 << 20;
/// Bytes of envelopes read and of their acknowledgements, until the acknowledgement was written:
/// past this the reader stops reading (Slack holds what it has not sent, and delivers again what
/// was not acknowledged).
const QUEUED_BYTES: usize = 1 << 20;
/// An envelope counts as at least this many bytes against `QUEUED_BYTES`.
const MIN_EVENT_COST: usize = 1024;
/// `apps.connections.open` gives up after this long.
const OPEN_TIMEOUT: Duration = Duration::from_secs(15);
/// A socket that has not said hello this long after its handshake is given up.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// The client pings this often...
const PING_EVERY: Duration = Duration::from_secs(15);
/// ...and a socket from which nothing came for this long is replaced: one lost pong is
/// forgiven, a half-open link is found at the third ping, within a minute.
const SILENT: Duration = Duration::from_secs(40);
/// A replaced connection writes what it owes for at most this long, then closes.
const DRAIN: Duration = Duration::from_secs(5);
/// A refused bot is asked again this often.
const REFUSED_WAIT: Duration = Duration::from_secs(600);

/// The running connections, by bot user ID.
pub struct Connections {
    running: Workers<String>,
    shared: Arc<Shared>,
}

/// What the connections tell the provider.
#[derive(Default)]
struct Shared {
    /// Sockets that said hello and are open now.
    up: Arc<AtomicUsize>,
    /// Bots whose connection Slack refuses, and why.
    disabled: Mutex<HashMap<String, String>>,
}

impl Default for Connections {
    fn default() -> Connections {
        Connections {
            running: Workers::new("slack: bot", "Socket Mode connection"),
            shared: Arc::default(),
        }
    }
}

impl Connections {
    /// Starts a connection for every bot in `wanted` and stops the others.
    pub fn sync(&self, slack: &Arc<Slack>, wanted: &[String]) {
        self.running.sync(wanted, |bot| {
            let task = runtime::spawn(run(Arc::downgrade(slack), bot.clone(), self.shared.clone()));
            Some(Worker::Task(task))
        });
        let mut disabled = self.shared.disabled.lock().unwrap_or_else(|e| e.into_inner());
        disabled.retain(|bot, _| wanted.contains(bot));
    }

    pub fn stop_all(&self) {
        self.running.stop_all();
    }

    pub fn count(&self) -> usize {
        self.running.count()
    }

    pub fn up(&self) -> usize {
        self.shared.up.load(Ordering::Relaxed)
    }

    /// Why Slack refuses `bot`'s connection, if it does.
    pub fn disabled(&self, bot: &str) -> Option<String> {
        let disabled = self.shared.disabled.lock().unwrap_or_else(|e| e.into_inner());
        disabled.get(bot).cloned()
    }
}

/// Logs a bot's connection state when it changes, and keeps its refusal for the Descriptor.
struct State {
    bot: String,
    last: String,
    shared: Arc<Shared>,
}

impl State {
    fn set(&mut self, now: String, warn: bool) {
        if now != self.last {
            match warn {
                true => log::warn!("slack: bot {}: {now}", self.bot),
                false => log::info!("slack: bot {}: {now}", self.bot),
            }
            self.last = now;
        }
    }

    /// Slack refuses the bot: true when it did not before (its channels' Descriptors change).
    fn refused(&mut self, why: String) -> bool {
        let mut disabled = self.shared.disabled.lock().unwrap_or_else(|e| e.into_inner());
        let changed = disabled.insert(self.bot.clone(), why.clone()).as_ref() != Some(&why);
        drop(disabled);
        self.set(
            format!("{why}; asking again in {}", crate::config::fmt_duration(REFUSED_WAIT)),
            true,
        );
        changed
    }

    /// Slack took a connection: true when it refused the bot before.
    fn accepted(&mut self) -> bool {
        let mut disabled = self.shared.disabled.lock().unwrap_or_else(|e| e.into_inner());
        disabled.remove(&self.bot).is_some()
    }
}

/// The bot's channels' Descriptors changed (it was refused, or is taken again): xAgent is told.
async fn tell(slack: &Weak<Slack>, bot: &str) {
    let (s, b) = (slack.clone(), bot.to_string());
    runtime::unblock(move || {
        if let Some(s) = s.upgrade() {
            for (source, _) in s.channels_of(&b) {
                s.host.binding_state_changed(&source);
            }
        }
    })
    .await;
}

/// What a session tells the bot's loop.
enum Signal {
    /// Slack asked for a new connection (`warning`, `refresh_requested`).
    Replace(u64),
    /// The session ended.
    Ended(u64, End),
}

enum End {
    Down(String),
    /// `link_disabled`: Socket Mode was turned off for the app.
    Disabled,
}

/// A session the loop holds: dropping it cancels it.
struct Running {
    serial: u64,
    retire: smol::channel::Sender<()>,
    _task: smol::Task<()>,
}

/// The connection loop of one bot: forever, until its task is dropped.
async fn run(slack: Weak<Slack>, bot: String, shared: Arc<Shared>) {
    let mut state = State {
        bot: bot.clone(),
        last: String::new(),
        shared: shared.clone(),
    };
    // Unbounded by count, bounded by sessions: each sends at most one `Replace` and one `Ended`.
    let (signals, signaled) = smol::channel::unbounded::<Signal>();
    let mut current: Option<Running> = None;
    // Replaced sessions, writing what they owe before they close.
    let mut retiring: Vec<Running> = Vec::new();
    let mut pace = Pace::default();
    let mut serial = 0u64;
    loop {
        // Open the next socket; `wait`: how long until trying again, when it did not open.
        let wait = match open(&slack, &bot).await {
            None => return,
            Some(Opened::Ws(ws)) => {
                serial += 1;
                pace.opened();
                if state.accepted() {
                    tell(&slack, &bot).await;
                }
                state.set("Socket Mode connection up".into(), false);
                let (retire, retired) = smol::channel::bounded(1);
                let task = runtime::spawn(session(
                    slack.clone(),
                    bot.clone(),
                    serial,
                    *ws,
                    signals.clone(),
                    retired,
                    shared.clone(),
                ));
                let next = Running {
                    serial,
                    retire,
                    _task: task,
                };
                if let Some(old) = current.replace(next) {
                    let _ = old.retire.try_send(());
                    retiring.push(old);
                }
                None
            }
            // A replacement Slack asked for failed: the socket in use goes on meanwhile.
            Some(Opened::Refused(why) | Opened::Failed(why, None)) if current.is_some() => {
                state.set(
                    format!("cannot open the next Socket Mode connection: {why}; the current one goes on"),
                    true,
                );
                Some(pace.failed())
            }
            Some(Opened::Refused(why)) => {
                if state.refused(why) {
                    tell(&slack, &bot).await;
                }
                Some(REFUSED_WAIT)
            }
            Some(Opened::Failed(why, retry_after)) => {
                state.set(format!("cannot open the Socket Mode connection: {why}; retrying"), true);
                Some(peer_wait::retry_after(retry_after, pace.failed()))
            }
        };
        // Wait for what the sessions say, and for `wait` to pass when it is set.
        let until = wait.map(|w| Instant::now() + w);
        loop {
            let next = async { signaled.recv().await.ok().map(Some) };
            let passed = async {
                match until {
                    Some(t) => {
                        smol::Timer::at(t).await;
                        Some(None)
                    }
                    None => std::future::pending().await,
                }
            };
            let signal = match next.or(passed).await {
                None => return,
                Some(None) => break,
                Some(Some(signal)) => signal,
            };
            let serial_now = current.as_ref().map_or(0, |c| c.serial);
            match signal {
                Signal::Replace(s) if s == serial_now => {
                    log::info!("slack: bot {bot}: Slack asked for a new connection; opening it");
                    // A server that asks at every hello gets a new socket every `link::MIN_AGE`.
                    smol::Timer::after(pace.after_work()).await;
                    break;
                }
                Signal::Ended(s, end) if s == serial_now => {
                    current = None;
                    match end {
                        End::Disabled => {
                            let why = "Slack disabled the app's Socket Mode link (link_disabled): turn Socket Mode on in the app's settings";
                            if state.refused(why.into()) {
                                tell(&slack, &bot).await;
                            }
                            smol::Timer::after(REFUSED_WAIT).await;
                        }
                        End::Down(why) => {
                            state.set(format!("Socket Mode connection down ({why}); reconnecting"), true);
                            // It said hello: it worked.
                            smol::Timer::after(pace.ended(true)).await;
                        }
                    }
                    break;
                }
                Signal::Ended(s, _) => retiring.retain(|r| r.serial != s),
                Signal::Replace(_) => {}
            }
        }
    }
}

enum Opened {
    Ws(Box<wsclient::Ws>),
    /// Slack refuses the app (a token, Socket Mode off): why, for the owner.
    Refused(String),
    /// Could not connect now; the wait Slack asked for, if it did.
    Failed(String, Option<Duration>),
}

/// `apps.connections.open` on the blocking pool, the handshake, and the `hello`; `None` once
/// the provider is gone.
async fn open(slack: &Weak<Slack>, bot: &str) -> Option<Opened> {
    let s = slack.upgrade()?;
    let b = bot.to_string();
    let url = runtime::unblock(move || {
        let tokens = s.tokens(&b).ok_or(None::<super::api::ApiError>)?;
        let answer = s
            .api
            .call(&tokens.app, "apps.connections.open", &[], OPEN_TIMEOUT)
            .map_err(Some)?;
        crate::json::get_str(&answer, "url")
            .map(str::to_string)
            .ok_or(None::<super::api::ApiError>)
    })
    .await;
    let url = match url {
        Ok(url) => url,
        Err(None) => return Some(Opened::Failed("no usable URL (or the tokens are gone)".into(), None)),
        // Only Slack's own refusal (its JSON) disables the bot; a proxy's page is a failure.
        Err(Some(e)) if e.temporary() || !e.from_peer => return Some(Opened::Failed(e.to_string(), e.retry_after())),
        Err(Some(e)) => {
            return Some(Opened::Refused(format!(
                "Slack refused a Socket Mode connection ({}): check the app-level token and that Socket Mode is on",
                super::api::error(&e)
            )))
        }
    };
    // The URL holds a ticket: it is never logged (wsclient's errors do not name it).
    let target = match wsclient::parse_url(&url) {
        Ok(t) => t,
        Err(why) => return Some(Opened::Failed(why, None)),
    };
    let request = match wsclient::request(&url) {
        Ok(r) => r,
        Err(why) => return Some(Opened::Failed(why, None)),
    };
    let mut ws = match wsclient::connect(&target, request, None, wsclient::bounded_config(MAX_FRAME)).await {
        Ok(ws) => ws,
        Err(why) => return Some(Opened::Failed(why, None)),
    };
    let hello = async {
        while let Some(frame) = ws.next().await {
            match frame {
                Ok(WsMessage::Text(t)) if t.len() <= crate::json::INLINE_PARSE => match event::read_frame(t.as_str()) {
                    Frame::Hello => return Ok(()),
                    // `link_disabled`, or `too_many_websockets` (an eleventh socket of the app).
                    Frame::Disconnect { reason } => return Err(reason),
                    _ => {}
                },
                Ok(WsMessage::Close(_)) => return Err("closed before hello".to_string()),
                Ok(_) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
        Err("closed before hello".to_string())
    };
    let late = async {
        smol::Timer::after(HELLO_TIMEOUT).await;
        Err(format!("no hello within {HELLO_TIMEOUT:?}"))
    };
    Some(match hello.or(late).await {
        Ok(()) => Opened::Ws(Box::new(ws)),
        Err(reason) if reason == "link_disabled" => Opened::Refused(
            "Slack disabled the app's Socket Mode link (link_disabled): turn Socket Mode on in the app's settings"
                .into(),
        ),
        Err(why) => Opened::Failed(crate::quiet::shown(&why), None),
    })
}

/// One job of a channel's lane.
enum Job {
    /// Read the channel's history from its high-water mark first.
    CatchUp(String),
    /// A message and the envelope to acknowledge once it is handled, with its budget share.
    Message(Box<Message>, String, Held),
}

impl Job {
    fn channel(&self) -> &str {
        match self {
            Job::CatchUp(c) => c,
            Job::Message(m, _, _) => &m.channel,
        }
    }
}

/// One socket, until it ends: its end goes to the loop.
async fn session(
    slack: Weak<Slack>,
    bot: String,
    serial: u64,
    ws: wsclient::Ws,
    signals: smol::channel::Sender<Signal>,
    retire: smol::channel::Receiver<()>,
    shared: Arc<Shared>,
) {
    let _up = Up::new(&shared.up);
    let end = live(slack, bot, serial, ws, &signals, retire).await;
    let _ = signals.send(Signal::Ended(serial, end)).await;
}

/// The acknowledgement of an envelope (its ID was checked: no character needs escaping).
fn ack(envelope_id: &str) -> WsMessage {
    WsMessage::Text(format!("{{\"envelope_id\":\"{envelope_id}\"}}").into())
}

async fn live(
    slack: Weak<Slack>,
    bot: String,
    serial: u64,
    ws: wsclient::Ws,
    signals: &smol::channel::Sender<Signal>,
    retire: smol::channel::Receiver<()>,
) -> End {
    let (sink, mut stream) = ws.split();
    // Bounded by count; lanes wait for room, and pings are only offered.
    let (out_tx, out_rx) = smol::channel::bounded::<Out>(QUEUE_SLOTS);
    let (budget, room) = Budget::new(QUEUED_BYTES);
    let mut writer = socket::writer(sink, out_rx);
    let (s, b, out) = (slack.clone(), bot.clone(), out_tx.clone());
    let mut lanes = Lanes::new(move |batch: Vec<Job>| lane(s.clone(), b.clone(), out.clone(), batch));
    // Every bound channel is caught up first, in its own lane, before its live messages.
    let (s, b) = (slack.clone(), bot.clone());
    let channels = runtime::unblock(move || s.upgrade().map(|s| s.connected(&b)).unwrap_or_default()).await;
    for channel in channels {
        lanes.route(channel.clone(), Job::CatchUp(channel));
    }
    let mut unreadable = Quiet::new();
    let mut last_heard = Instant::now();
    let mut next_ping = Instant::now() + PING_EVERY;
    let mut draining: Option<Instant> = None;
    let mut replace_asked = false;
    // A server that keeps the socket full must not hold up other connections.
    let mut fair = runtime::Fair::default();
    loop {
        fair.turn().await;
        enum Step {
            Read(Option<Result<WsMessage, async_tungstenite::tungstenite::Error>>),
            Ping,
            Room,
            Retire,
            Writer(String),
        }
        if let Some(until) = draining {
            if budget.empty() || Instant::now() >= until {
                // A close frame after what it owed; the writer ends once it is written.
                let _ = out_tx.try_send((WsMessage::Close(None), None));
                let late = async {
                    smol::Timer::after(Duration::from_secs(2)).await;
                    String::new()
                };
                (&mut writer).or(late).await;
                return End::Down("replaced by a new connection".into());
            }
        }
        let paused = budget.full() || draining.is_some();
        if paused {
            // A paused reader hears nothing, pongs included: silence counts only while reading.
            last_heard = Instant::now();
        }
        let ping = async {
            smol::Timer::at(next_ping).await;
            Step::Ping
        };
        let writer_ended = async { Step::Writer((&mut writer).await) };
        let retired = async {
            match retire.recv().await {
                Ok(()) => Step::Retire,
                // The loop is gone: nothing will read this session's end.
                Err(_) => Step::Writer("the bot's connection stopped".into()),
            }
        };
        // Past the byte budget, or while draining, nothing is read until written
        // acknowledgements make room; pings go on, and a writer that gives up ends the socket.
        let step = match paused {
            true => {
                let waiting_room = async {
                    let _ = room.recv().await;
                    Step::Room
                };
                let drained = async {
                    match draining {
                        Some(until) => smol::Timer::at(until).await,
                        None => std::future::pending().await,
                    };
                    Step::Room
                };
                let retired_too = async {
                    match draining {
                        Some(_) => std::future::pending().await,
                        None => retired.await,
                    }
                };
                waiting_room.or(drained).or(ping).or(writer_ended).or(retired_too).await
            }
            // The retirement first: a socket full of frames must not keep it from draining.
            false => {
                retired
                    .or(async { Step::Read(stream.next().await) })
                    .or(ping)
                    .or(writer_ended)
                    .await
            }
        };
        let now = Instant::now();
        let text = match step {
            Step::Writer(why) => return End::Down(why),
            Step::Retire => {
                draining = Some(now + DRAIN);
                continue;
            }
            Step::Room => continue,
            Step::Ping => {
                if now.duration_since(last_heard) > SILENT {
                    return End::Down(format!("nothing heard for {SILENT:?}"));
                }
                if let Err(smol::channel::TrySendError::Closed(_)) =
                    out_tx.try_send((WsMessage::Ping(Vec::new().into()), None))
                {
                    return End::Down("the writer stopped".into());
                }
                next_ping = now + PING_EVERY;
                continue;
            }
            Step::Read(None) | Step::Read(Some(Ok(WsMessage::Close(_)))) => return End::Down("closed by Slack".into()),
            Step::Read(Some(Err(e))) => return End::Down(e.to_string()),
            Step::Read(Some(Ok(WsMessage::Text(t)))) => t,
            Step::Read(Some(Ok(_))) => {
                last_heard = now;
                continue;
            }
        };
        last_heard = now;
        let cost = text.len().max(MIN_EVENT_COST).saturating_add(64);
        let frame = match text.len() <= crate::json::INLINE_PARSE {
            true => event::read_frame(text.as_str()),
            // Parsing a large frame is work for the pool, not the executor.
            false => runtime::unblock(move || event::read_frame(text.as_str())).await,
        };
        match frame {
            Frame::Hello => {}
            Frame::Disconnect { reason } if reason == "link_disabled" => return End::Disabled,
            Frame::Disconnect { reason } => {
                log::debug!("slack: bot {bot}: disconnect ({})", crate::quiet::shown(&reason));
                // Once per socket: a flood of them asks for one new socket.
                if !replace_asked {
                    replace_asked = true;
                    let _ = signals.send(Signal::Replace(serial)).await;
                }
            }
            Frame::Envelope {
                envelope_id,
                event: Event::Message(m),
            } if !m.channel.is_empty() => {
                let held = budget.take(cost);
                lanes.route(m.channel.clone(), Job::Message(m, envelope_id, held));
            }
            Frame::Envelope { envelope_id, event } => {
                if let Event::Skipped(why) = event {
                    log::debug!("slack: bot {bot}: {why} acknowledged, not stored");
                    if let Some(s) = slack.upgrade() {
                        s.counts.skipped.fetch_add(1, Ordering::Relaxed);
                    }
                }
                // Nothing to store: acknowledged at once (within Slack's 3 s).
                if out_tx.send((ack(&envelope_id), Some(budget.take(cost)))).await.is_err() {
                    return End::Down("the writer stopped".into());
                }
            }
            Frame::Other(what) => {
                if let Some(more) = unreadable.admit() {
                    log::warn!(
                        "slack: bot {bot}: a frame was not read: {}{more}",
                        crate::quiet::shown(&what)
                    );
                }
            }
        }
    }
}

/// A batch of one lane's jobs, in order: each channel's run of jobs handed to `Slack::accept`
/// on the pool, and the envelopes it may acknowledge acknowledged (the acknowledgement carries
/// the envelope's budget share to the writer). False when the connection is gone.
async fn lane(slack: Weak<Slack>, bot: String, out: smol::channel::Sender<Out>, batch: Vec<Job>) -> bool {
    let mut jobs = batch.into_iter().peekable();
    while let Some(first) = jobs.next() {
        // Past the lane cap, channels share a lane: one `accept` per run of one channel.
        let channel = first.channel().to_string();
        let mut run = vec![first];
        while let Some(next) = jobs.next_if(|j| j.channel() == channel) {
            run.push(next);
        }
        let catch_up = run.iter().any(|j| matches!(j, Job::CatchUp(_)));
        let (messages, envelopes): (Vec<Message>, Vec<(String, Held)>) = run
            .into_iter()
            .filter_map(|j| match j {
                Job::Message(m, id, held) => Some((*m, (id, held))),
                Job::CatchUp(_) => None,
            })
            .unzip();
        // The socket is gone: nothing would be acknowledged, and its replacement catches up.
        if out.is_closed() {
            return false;
        }
        let Some(s) = slack.upgrade() else { return false };
        let b = bot.clone();
        let outcomes = runtime::unblock(move || s.accept(&b, &channel, catch_up, messages)).await;
        for ((envelope_id, held), stored) in envelopes.into_iter().zip(outcomes) {
            // Not stored: no acknowledgement, so Slack delivers it again.
            if stored && out.send((ack(&envelope_id), Some(held))).await.is_err() {
                return false;
            }
        }
    }
    true
}
