//! One Stream mode connection per app, shared by every conversation bound through it: it
//! starts with the app's first binding and stops with its last (`Connections::sync`).
//!
//! A connection: `connections/open` with the app's credentials gives an endpoint and a ticket
//! valid once (a new one for every connection); the socket then carries `SYSTEM` pings
//! (answered at once, echoing their data) and `CALLBACK` robot messages, each answered `200`
//! only after its message was committed (`DingTalk::accept`, in the conversation's lane). A
//! message that could not be stored gets no answer. What a connection holds is bounded until
//! written (`socket::Budget`, the writer's queue and deadline).
//!
//! - `disconnect`: DingTalk closes the socket within about 10 s. The next connection is opened
//!   at once (`Pace`); the old one writes what it owes until DingTalk closes it (at most
//!   `DRAIN`).
//! - A refused `connections/open` (a wrong secret, Stream mode off): the app is disabled (its
//!   Descriptors and `/status` say why, one log line) and asked again every `REFUSED_WAIT`.
//! - A socket that says nothing for `SILENT` (a WebSocket ping every `PING_EVERY` is answered
//!   by any live server) is replaced: half-open links behind NAT are common.
//! - Other ends: the next connection when `Pace` says.
//!
//! Robot messages are fire-and-forget at DingTalk: what it sends while no socket is open is
//! not sent again, and there is no history to read it back from. Every second without a
//! connection may lose messages, so a connection that worked is replaced at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use async_tungstenite::tungstenite::Message as WsMessage;
use smol::future::FutureExt;
use smol::stream::StreamExt;

use super::event::{self, Frame, RobotMessage};
use super::DingTalk;
use crate::providers::link::Pace;
use crate::providers::socket::{self, Budget, Held, Lanes, Out, Up, QUEUE_SLOTS};
use crate::providers::workers::{Worker, Workers};
use crate::providers::Transient;
use crate::quiet::Quiet;
use crate::runtime;
use crate::wsclient;

/// A frame larger than this ends the connection (robot messages are far smaller).
const MAX_FRAME: usize = 1 << 20;
/// Bytes of frames read and of their answers, until the answer was written: past this the
/// reader stops reading.
const QUEUED_BYTES: usize = 1 << 20;
/// A frame counts as at least this many bytes against `QUEUED_BYTES`.
const MIN_FRAME_COST: usize = 1024;
/// `connections/open` gives up after this long.
const OPEN_TIMEOUT: Duration = Duration::from_secs(15);
/// The client pings this often (DingTalk's SDK: every 60 s)...
const PING_EVERY: Duration = Duration::from_secs(60);
/// ...and a socket from which nothing came for this long is replaced (one lost pong is
/// forgiven).
const SILENT: Duration = Duration::from_secs(130);
/// After `disconnect`, the old socket writes what it owes for at most this long, then closes.
const DRAIN: Duration = Duration::from_secs(15);
/// A refused app is asked again this often.
const REFUSED_WAIT: Duration = Duration::from_secs(600);

/// The running connections, by client ID.
pub struct Connections {
    running: Workers<String>,
    shared: Arc<Shared>,
}

/// What the connections tell the provider.
#[derive(Default)]
struct Shared {
    /// Sockets open now.
    up: Arc<AtomicUsize>,
    /// Apps whose connection DingTalk refuses, and why.
    refused: Mutex<HashMap<String, String>>,
}

impl Default for Connections {
    fn default() -> Connections {
        Connections {
            running: Workers::new("dingtalk: app", "Stream connection"),
            shared: Arc::default(),
        }
    }
}

impl Connections {
    /// Starts a connection for every app in `wanted` and stops the others.
    pub fn sync(&self, dingtalk: &Arc<DingTalk>, wanted: &[String]) {
        self.running.sync(wanted, |app| {
            let task = runtime::spawn(run(Arc::downgrade(dingtalk), app.clone(), self.shared.clone()));
            Some(Worker::Task(task))
        });
        let mut refused = self.shared.refused.lock().unwrap_or_else(|e| e.into_inner());
        refused.retain(|app, _| wanted.contains(app));
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

    /// Why DingTalk refuses `app`'s connection, if it does.
    pub fn refused(&self, app: &str) -> Option<String> {
        let refused = self.shared.refused.lock().unwrap_or_else(|e| e.into_inner());
        refused.get(app).cloned()
    }
}

/// Logs an app's connection state when it changes, and keeps its refusal for the Descriptor.
struct State {
    app: String,
    last: String,
    shared: Arc<Shared>,
}

impl State {
    fn set(&mut self, now: String, warn: bool) {
        if now != self.last {
            match warn {
                true => log::warn!("dingtalk: app {}: {now}", self.app),
                false => log::info!("dingtalk: app {}: {now}", self.app),
            }
            self.last = now;
        }
    }

    /// Whether the app's refusal changed (its conversations' Descriptors change with it):
    /// `Some(why)` refused, `None` taken again.
    fn refused(&mut self, why: Option<String>) -> bool {
        let mut refused = self.shared.refused.lock().unwrap_or_else(|e| e.into_inner());
        let changed = match &why {
            Some(why) => refused.insert(self.app.clone(), why.clone()).as_ref() != Some(why),
            None => refused.remove(&self.app).is_some(),
        };
        drop(refused);
        if let Some(why) = why {
            let wait = crate::config::fmt_duration(REFUSED_WAIT);
            self.set(format!("{why}; asking again in {wait}"), true);
        }
        changed
    }
}

/// The app's conversations' Descriptors changed (it was refused, or is taken again): xAgent
/// is told.
async fn tell(dingtalk: &Weak<DingTalk>, app: &str) {
    let (d, a) = (dingtalk.clone(), app.to_string());
    runtime::unblock(move || {
        if let Some(d) = d.upgrade() {
            for (source, _) in d.conversations_of(&a) {
                d.host.binding_state_changed(&source);
            }
        }
    })
    .await;
}

/// What a session tells the app's loop.
enum Signal {
    /// DingTalk will close this socket (`disconnect`): open the next one now.
    Replace(u64),
    /// The session ended, why, and whether DingTalk sent anything on it.
    Ended(u64, String, bool),
}

/// The connection loop of one app: forever, until its task is dropped.
async fn run(dingtalk: Weak<DingTalk>, app: String, shared: Arc<Shared>) {
    let mut state = State {
        app: app.clone(),
        last: String::new(),
        shared: shared.clone(),
    };
    // Unbounded by count, bounded by sessions: each sends at most one `Replace` and one `Ended`.
    let (signals, signaled) = smol::channel::unbounded::<Signal>();
    // The session in use, and those told to go that still write what they owe: dropping one
    // cancels it.
    let mut current: Option<(u64, smol::Task<()>)> = None;
    let mut leaving: Vec<(u64, smol::Task<()>)> = Vec::new();
    let mut pace = Pace::default();
    let mut drops = Quiet::new();
    let mut serial = 0u64;
    loop {
        let wait = match open(&dingtalk, &app).await {
            None => return,
            Some(Opened::Ws(ws)) => {
                serial = serial.wrapping_add(1);
                pace.opened();
                if state.refused(None) {
                    tell(&dingtalk, &app).await;
                }
                state.set("Stream connection up".into(), false);
                let task = runtime::spawn(session(
                    dingtalk.clone(),
                    app.clone(),
                    serial,
                    *ws,
                    signals.clone(),
                    shared.clone(),
                ));
                if let Some(old) = current.replace((serial, task)) {
                    leaving.push(old);
                }
                None
            }
            Some(Opened::Refused(why)) => {
                if state.refused(Some(why)) {
                    tell(&dingtalk, &app).await;
                }
                Some(REFUSED_WAIT)
            }
            Some(Opened::Failed(why)) => {
                state.set(format!("cannot open the Stream connection: {why}; retrying"), true);
                Some(pace.failed())
            }
        };
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
            let now_serial = current.as_ref().map_or(0, |c| c.0);
            match signal {
                Signal::Replace(s) if s == now_serial => {
                    // Paced by the socket's minimum age, and still a line a minute at most.
                    static CLOSING: crate::quiet::Site = crate::quiet::Site::new();
                    if let Some(more) = CLOSING.admit() {
                        log::info!(
                            "dingtalk: app {app}: DingTalk will close the connection; opening the next one{more}"
                        );
                    }
                    if let Some(old) = current.take() {
                        leaving.push(old);
                    }
                    smol::Timer::after(pace.after_work()).await;
                    break;
                }
                Signal::Ended(s, why, heard) if s == now_serial => {
                    current = None;
                    // DingTalk may close every connection, met with one every `link::MIN_AGE`: a
                    // line a minute, and "up" is said again only after a "down" was.
                    if let Some(more) = drops.admit() {
                        state.set(format!("Stream connection down ({why}); reconnecting{more}"), true);
                    }
                    smol::Timer::after(pace.ended(heard)).await;
                    break;
                }
                Signal::Ended(s, _, _) => leaving.retain(|l| l.0 != s),
                Signal::Replace(_) => {}
            }
        }
    }
}

enum Opened {
    Ws(Box<wsclient::Ws>),
    /// DingTalk refuses the app (its credentials, Stream mode): why, for the owner.
    Refused(String),
    /// Could not connect now.
    Failed(String),
}

/// `connections/open` on the blocking pool, then the handshake; `None` once the provider is
/// gone.
async fn open(dingtalk: &Weak<DingTalk>, app: &str) -> Option<Opened> {
    let d = dingtalk.upgrade()?;
    let a = app.to_string();
    let opened = runtime::unblock(move || {
        let creds = d.creds(&a).ok_or(None)?;
        d.api.open_stream(&creds, OPEN_TIMEOUT).map_err(Some)
    })
    .await;
    let (endpoint, ticket) = match opened {
        Ok(o) => o,
        Err(None) => return Some(Opened::Failed("the app's secret is no longer available".into())),
        Err(Some(e)) if e.temporary() || !super::api::credentials_refused(&e) => return Some(Opened::Failed(e.to_string())),
        Err(Some(e)) => {
            return Some(Opened::Refused(format!(
                "DingTalk refused a Stream connection ({e}): check the app's Client ID and Client Secret, and that the robot uses Stream mode"
            )))
        }
    };
    // The ticket is a credential: wsclient's errors do not name the URL.
    let url = format!("{endpoint}?ticket={}", crate::upstream::query_value(&ticket));
    let target = match wsclient::parse_url(&url) {
        Ok(t) => t,
        Err(why) => return Some(Opened::Failed(why)),
    };
    let request = match wsclient::request(&url) {
        Ok(r) => r,
        Err(why) => return Some(Opened::Failed(why)),
    };
    Some(
        match wsclient::connect(&target, request, None, wsclient::bounded_config(MAX_FRAME)).await {
            Ok(ws) => Opened::Ws(Box::new(ws)),
            Err(why) => Opened::Failed(crate::quiet::shown(&why)),
        },
    )
}

/// One robot message and the frame to answer once it is stored, with its budget share.
struct Job(Box<RobotMessage>, String, Held);

/// One socket, until it ends: its end goes to the loop.
async fn session(
    dingtalk: Weak<DingTalk>,
    app: String,
    serial: u64,
    ws: wsclient::Ws,
    signals: smol::channel::Sender<Signal>,
    shared: Arc<Shared>,
) {
    let _up = Up::new(&shared.up);
    let mut heard = false;
    let why = live(dingtalk, app, serial, ws, &signals, &mut heard).await;
    let _ = signals.send(Signal::Ended(serial, why, heard)).await;
}

async fn live(
    dingtalk: Weak<DingTalk>,
    app: String,
    serial: u64,
    ws: wsclient::Ws,
    signals: &smol::channel::Sender<Signal>,
    heard: &mut bool,
) -> String {
    let (sink, mut stream) = ws.split();
    let (out_tx, out_rx) = smol::channel::bounded::<Out>(QUEUE_SLOTS);
    let (budget, room) = Budget::new(QUEUED_BYTES);
    let mut writer = socket::writer(sink, out_rx);
    let (d, a, out) = (dingtalk.clone(), app.clone(), out_tx.clone());
    let mut lanes = Lanes::new(move |batch: Vec<Job>| lane(d.clone(), a.clone(), out.clone(), batch));
    let mut unreadable = Quiet::new();
    let mut last_heard = Instant::now();
    let mut next_ping = Instant::now() + PING_EVERY;
    // Set by `disconnect`: the socket closes once it owes nothing, or then.
    let mut leaving: Option<Instant> = None;
    let mut fair = runtime::Fair::default();
    loop {
        fair.turn().await;
        enum Step {
            Read(Option<Result<WsMessage, async_tungstenite::tungstenite::Error>>),
            Ping,
            Room,
            Writer(String),
        }
        if let Some(until) = leaving {
            if budget.empty() || Instant::now() >= until {
                let _ = out_tx.try_send((WsMessage::Close(None), None));
                let late = async {
                    smol::Timer::after(Duration::from_secs(2)).await;
                    String::new()
                };
                (&mut writer).or(late).await;
                return "DingTalk asked for a new connection".into();
            }
        }
        let paused = budget.full();
        if paused {
            // A paused reader hears nothing, pongs included: silence counts only while reading.
            last_heard = Instant::now();
        }
        let ping = async {
            let at = leaving.map_or(next_ping, |until| until.min(next_ping));
            smol::Timer::at(at).await;
            Step::Ping
        };
        let writer_ended = async { Step::Writer((&mut writer).await) };
        let step = match paused {
            true => {
                let waiting_room = async {
                    let _ = room.recv().await;
                    Step::Room
                };
                waiting_room.or(ping).or(writer_ended).await
            }
            false => {
                async { Step::Read(stream.next().await) }
                    .or(ping)
                    .or(writer_ended)
                    .await
            }
        };
        let now = Instant::now();
        let text = match step {
            Step::Writer(why) => return why,
            Step::Room => continue,
            // Leaving: no more pings, and the timer waits for the deadline alone.
            Step::Ping if leaving.is_some() => {
                next_ping = now + PING_EVERY;
                continue;
            }
            Step::Ping => {
                if now.duration_since(last_heard) > SILENT {
                    return format!("nothing heard for {SILENT:?}");
                }
                if let Err(smol::channel::TrySendError::Closed(_)) =
                    out_tx.try_send((WsMessage::Ping(Vec::new().into()), None))
                {
                    return "the writer stopped".into();
                }
                next_ping = now + PING_EVERY;
                continue;
            }
            Step::Read(None) | Step::Read(Some(Ok(WsMessage::Close(_)))) => return "closed by DingTalk".into(),
            Step::Read(Some(Err(e))) => return e.to_string(),
            Step::Read(Some(Ok(WsMessage::Text(t)))) => t,
            Step::Read(Some(Ok(_))) => {
                last_heard = now;
                *heard = true;
                continue;
            }
        };
        last_heard = now;
        *heard = true;
        let cost = text.len().max(MIN_FRAME_COST).saturating_add(256);
        let frame = match text.len() <= crate::json::INLINE_PARSE {
            true => event::read_frame(text.as_str()),
            // Parsing a large frame is work for the pool, not the executor.
            false => runtime::unblock(move || event::read_frame(text.as_str())).await,
        };
        let answer = match frame {
            Frame::Robot { message_id, message } => {
                let held = budget.take(cost);
                lanes.route(message.conversation.clone(), Job(message, message_id, held));
                continue;
            }
            Frame::Ping { message_id, data } => event::answer(&message_id, 200, "OK", &data),
            Frame::Disconnect { reason } => {
                log::debug!("dingtalk: app {app}: disconnect ({})", crate::quiet::shown(&reason));
                if leaving.is_none() {
                    leaving = Some(now + DRAIN);
                    let _ = signals.send(Signal::Replace(serial)).await;
                }
                continue;
            }
            Frame::Unreadable { message_id, why } => {
                if let Some(more) = unreadable.admit() {
                    log::warn!("dingtalk: app {app}: a robot message was not read: {why}{more}");
                }
                event::answer(&message_id, 400, "bad request", "{}")
            }
            Frame::Unwanted { message_id } => event::answer(&message_id, 404, "topic not handled", "{}"),
            Frame::Other(what) => {
                if let Some(more) = unreadable.admit() {
                    log::warn!(
                        "dingtalk: app {app}: a frame was not read: {}{more}",
                        crate::quiet::shown(&what)
                    );
                }
                continue;
            }
        };
        if out_tx
            .send((WsMessage::Text(answer.into()), Some(budget.take(cost))))
            .await
            .is_err()
        {
            return "the writer stopped".into();
        }
    }
}

/// A batch of one lane's robot messages, in order: each conversation's run handed to
/// `DingTalk::accept` on the pool, and those stored answered (the answer carries the frame's
/// budget share to the writer). A lane outlives its connection: DingTalk sends nothing again,
/// so what was read is stored even when no answer can be written any more. False once the
/// provider is gone.
async fn lane(dingtalk: Weak<DingTalk>, app: String, out: smol::channel::Sender<Out>, batch: Vec<Job>) -> bool {
    let mut jobs = batch.into_iter().peekable();
    while let Some(first) = jobs.next() {
        // Past the lane cap, conversations share a lane: one `accept` per run of one.
        let conversation = first.0.conversation.clone();
        let mut run = vec![first];
        while let Some(next) = jobs.next_if(|j| j.0.conversation == conversation) {
            run.push(next);
        }
        let (messages, frames): (Vec<RobotMessage>, Vec<(String, Held)>) =
            run.into_iter().map(|Job(m, id, held)| (*m, (id, held))).unzip();
        let Some(d) = dingtalk.upgrade() else { return false };
        let a = app.clone();
        let outcomes = runtime::unblock(move || d.accept(&a, &conversation, messages)).await;
        for ((message_id, held), stored) in frames.into_iter().zip(outcomes) {
            // Not stored: no answer (DingTalk does not send it again either way). A connection
            // gone meanwhile takes no answer: it is dropped with its budget share.
            if stored && !out.is_closed() {
                let answer = WsMessage::Text(event::stored(&message_id).into());
                let _ = out.send((answer, Some(held))).await;
            }
        }
    }
    true
}
