//! One long connection per app, shared by every chat bound through it: it starts with the
//! app's first binding and stops with its last (`Connections::sync`).
//!
//! The task runs on the executor and never blocks it: the endpoint request, parsing and each
//! event's handling (binding lookup, file fetch, the outbox commit) run on the blocking pool.
//! Events go to one lane per chat: a chat's events in arrival order, chats side by side, while
//! the reader keeps answering pongs. An event is answered only once its commit returned, so
//! whatever imgate did not store, Feishu delivers again.
//!
//! What the connection holds is bounded until it is written: each event takes its bytes and
//! those of its answer from the connection's budget (`QUEUED_BYTES`) when it is read, and gives
//! them back only once the writer wrote the answer (or the connection ended). A full budget
//! stops the reader; the writer's queue is bounded in count too (`QUEUE_SLOTS`); a frame the
//! server does not take within `WRITE_DEADLINE` ends the connection. So a server that sends
//! events and never reads the answers stalls the reader, then loses the connection.
//!
//! Reconnects follow `link::Pace` and the server's `ClientConfig`: after a drop, the later of
//! what `Pace` says (a connection that worked: at once, at most one per `link::MIN_AGE`; one
//! that did not: its backoff) and a random part of `ReconnectNonce`; after a failed attempt,
//! `ReconnectInterval` (or the backoff, if longer). Each change of state (up, down, refused,
//! unreachable) is logged once, not once per retry.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use async_tungstenite::tungstenite::Message;
use smol::future::FutureExt;
use smol::stream::StreamExt;

use super::event::{self, Event};
use super::frame::{Frame, MAX_FRAME};
use super::longconn::{self, ClientConfig, Endpoint, EndpointError, Reassembly, Received};
use super::Feishu;
use crate::ids;
use crate::providers::link::Pace;
use crate::providers::socket::{self, Budget, Held, Lanes, Out, Up, QUEUE_SLOTS};
use crate::providers::workers::{Worker, Workers};
use crate::quiet::Quiet;
use crate::runtime;
use crate::wsclient;

/// The endpoint request gives up after this long.
const ENDPOINT_TIMEOUT: Duration = Duration::from_secs(15);
/// A refused app (wrong secret, long connection not enabled) is asked again this often at most.
const REFUSED_WAIT: Duration = Duration::from_secs(300);
/// Bytes of a connection's events, and of their answers, from the event's read until its
/// answer was written: past this the reader stops reading (and the server holds what it has not
/// sent). Nothing is dropped.
const QUEUED_BYTES: usize = 2 << 20;
/// An event's payload counts as at least this many bytes against `QUEUED_BYTES`...
const MIN_EVENT_COST: usize = 1024;

/// The running connections, by app ID.
pub struct Connections {
    running: Workers<String>,
    /// Connections whose WebSocket is up now.
    up: Arc<AtomicUsize>,
}

impl Default for Connections {
    fn default() -> Connections {
        Connections {
            running: Workers::new("feishu: app", "long connection"),
            up: Arc::default(),
        }
    }
}

impl Connections {
    /// Starts a connection for every app in `wanted` and stops the others.
    pub fn sync(&self, feishu: &Arc<Feishu>, wanted: &[String]) {
        self.running.sync(wanted, |app| {
            let task = runtime::spawn(run(Arc::downgrade(feishu), app.clone(), self.up.clone()));
            Some(Worker::Task(task))
        });
    }

    /// Shutdown: every connection stops (dropping a task cancels it).
    pub fn stop_all(&self) {
        self.running.stop_all();
    }

    pub fn count(&self) -> usize {
        self.running.count()
    }

    pub fn up(&self) -> usize {
        self.up.load(Ordering::Relaxed)
    }
}

/// Logs a connection's state when it changes.
struct State {
    app: String,
    last: String,
}

impl State {
    fn set(&mut self, now: String, warn: bool) {
        if now != self.last {
            match warn {
                true => log::warn!("feishu: app {}: {now}", self.app),
                false => log::info!("feishu: app {}: {now}", self.app),
            }
            self.last = now;
        }
    }
}

/// The connection loop of one app: forever, until its task is dropped.
async fn run(feishu: Weak<Feishu>, app: String, up: Arc<AtomicUsize>) {
    let mut config = ClientConfig::default();
    let mut state = State {
        app: app.clone(),
        last: String::new(),
    };
    let mut pace = Pace::default();
    loop {
        let wait = match endpoint(&feishu, &app, config).await {
            None => return,
            Some(Err(EndpointError::Refused { code, msg })) => {
                state.set(
                    format!(
                        "Feishu refused the long connection (code {code}: {msg}); check the app's credentials and that it receives events through the long connection; asking again in {}",
                        crate::config::fmt_duration(REFUSED_WAIT)
                    ),
                    true,
                );
                REFUSED_WAIT
            }
            Some(Err(EndpointError::Retry(why))) => {
                state.set(
                    format!("cannot get the long connection's address: {why}; retrying"),
                    true,
                );
                pace.failed().max(config.reconnect_every)
            }
            Some(Ok(ep)) => {
                config = ep.config;
                match connect(&ep).await {
                    Err(why) => {
                        state.set(format!("cannot open the long connection: {why}; retrying"), true);
                        pace.failed().max(config.reconnect_every)
                    }
                    Ok(ws) => {
                        state.set("long connection up".into(), false);
                        pace.opened();
                        let up_now = Up::new(&up);
                        let mut heard = false;
                        let why = session(&feishu, &app, ws, &ep, &mut config, &mut heard).await;
                        drop(up_now);
                        state.set(format!("long connection down ({why}); reconnecting"), true);
                        // `link::Pace`'s rule, and no sooner than the random part of its
                        // `ReconnectNonce` the server asks for (spreading its clients out).
                        let random = ids::below(config.reconnect_jitter.as_millis() as u64 + 1);
                        pace.ended(heard).max(Duration::from_millis(random))
                    }
                }
            }
        };
        smol::Timer::after(wait).await;
    }
}

/// The endpoint request on the blocking pool; `None` once the provider is gone.
async fn endpoint(feishu: &Weak<Feishu>, app: &str, config: ClientConfig) -> Option<Result<Endpoint, EndpointError>> {
    let f = feishu.upgrade()?;
    let app = app.to_string();
    Some(
        runtime::unblock(move || {
            let creds = f
                .creds_of(&app)
                .ok_or_else(|| EndpointError::Retry("the app's secret is no longer available".into()))?;
            let body = f
                .api
                .endpoint(&creds, longconn::ENDPOINT_PATH, ENDPOINT_TIMEOUT)
                .map_err(|e| EndpointError::Retry(e.to_string()))?;
            longconn::read_endpoint(&body, config)
        })
        .await,
    )
}

type Ws = wsclient::Ws;

async fn connect(ep: &Endpoint) -> Result<Ws, String> {
    let target = wsclient::parse_url(&ep.url)?;
    let request = wsclient::request(&ep.url)?;
    wsclient::connect(&target, request, None, wsclient::bounded_config(MAX_FRAME)).await
}

/// One received event on its way to the worker: its payload, the frame to answer it with, when
/// it arrived, and its share of the budget.
type Job = (Vec<u8>, Frame, Instant, Held);

/// What an event costs until its answer is written: its payload (at least `MIN_EVENT_COST`)
/// and its answer as it will be encoded (the frame `answer`, with the outcome).
fn cost(payload: &[u8], answer: &Frame) -> usize {
    payload
        .len()
        .max(MIN_EVENT_COST)
        .saturating_add(longconn::response_size(answer))
}

/// One connection, until it ends; why it ended. `heard`: the server sent a frame on it.
async fn session(
    feishu: &Weak<Feishu>,
    app: &str,
    ws: Ws,
    ep: &Endpoint,
    config: &mut ClientConfig,
    heard: &mut bool,
) -> String {
    let (sink, mut stream) = ws.split();
    // Bounded by count; lanes wait for room, and pings are only offered.
    let (out_tx, out_rx) = smol::channel::bounded::<Out>(QUEUE_SLOTS);
    // Unbounded by count: `Budget` bounds the bytes of the events and answers in it.
    let (job_tx, job_rx) = smol::channel::unbounded::<Job>();
    let (budget, room_rx) = Budget::new(QUEUED_BYTES);
    let mut writer = socket::writer(sink, out_rx);
    let _worker = runtime::spawn(worker(feishu.clone(), app.to_string(), job_rx, out_tx.clone()));
    let mut reassembly = Reassembly::default();
    let mut bad_frames = Quiet::new();
    let mut last_heard = Instant::now();
    let mut next_ping = Instant::now();
    // A gateway that keeps the socket full must not hold up other connections.
    let mut fair = runtime::Fair::default();
    loop {
        fair.turn().await;
        enum Step {
            Read(Option<Result<Message, async_tungstenite::tungstenite::Error>>),
            Ping,
            Room,
            Writer(String),
        }
        let ping = async {
            smol::Timer::at(next_ping).await;
            Step::Ping
        };
        let writer_ended = async { Step::Writer((&mut writer).await) };
        // Past the byte budget, nothing is read until written answers make room; pings go on,
        // and a writer that gives up ends the connection. Silence counts only while reading:
        // a paused reader hears nothing, pongs included.
        if budget.full() {
            last_heard = Instant::now();
        }
        let step = match budget.full() {
            true => {
                async {
                    let _ = room_rx.recv().await;
                    Step::Room
                }
                .or(ping)
                .or(writer_ended)
                .await
            }
            false => {
                async { Step::Read(stream.next().await) }
                    .or(ping)
                    .or(writer_ended)
                    .await
            }
        };
        let now = Instant::now();
        let bytes = match step {
            Step::Writer(why) => return why,
            Step::Ping => {
                log::trace!(
                    "feishu: app {app}: ping; last heard from the server {:?} ago",
                    now.duration_since(last_heard)
                );
                // The server answers every ping; three intervals of silence is a dead link.
                if now.duration_since(last_heard) > config.ping_every * 3 {
                    return "no answer to pings".into();
                }
                // Offered, not awaited: a queue full of answers means the server is not
                // reading, and the writer's deadline ends the connection.
                if let Err(smol::channel::TrySendError::Closed(_)) =
                    out_tx.try_send((binary(&longconn::ping(ep.service_id)), None))
                {
                    return "the writer stopped".into();
                }
                next_ping = now + config.ping_every;
                continue;
            }
            Step::Room => continue,
            Step::Read(None) | Step::Read(Some(Ok(Message::Close(_)))) => return "closed by the server".into(),
            Step::Read(Some(Err(e))) => return e.to_string(),
            Step::Read(Some(Ok(Message::Binary(b)))) => b,
            Step::Read(Some(Ok(_))) => {
                last_heard = now;
                continue;
            }
        };
        last_heard = now;
        *heard = true;
        let frame = match Frame::decode(&bytes) {
            Ok(f) => f,
            Err(e) => {
                if let Some(more) = bad_frames.admit() {
                    log::warn!("feishu: app {app}: an unreadable frame was dropped: {e}{more}");
                }
                continue;
            }
        };
        match reassembly.receive(frame, now) {
            Received::Pong(update) => *config = config.updated(update),
            Received::Event { payload, answer, .. } => {
                let held = budget.take(cost(&payload, &answer));
                if job_tx.send((payload, answer, now, held)).await.is_err() {
                    return "the event worker stopped".into();
                }
            }
            Received::Partial => {}
            Received::Ignored(what) => log::debug!("feishu: app {app}: frame ignored: {what}"),
        }
    }
}

/// Routes the connection's events to one lane per chat: a chat's events are handled in
/// arrival order, chats side by side, so one chat's slow file cannot hold up another's
/// messages. Each event is answered after its commit.
async fn worker(
    feishu: Weak<Feishu>,
    app: String,
    jobs: smol::channel::Receiver<Job>,
    out: smol::channel::Sender<Out>,
) {
    let mut lanes = Lanes::new(move |batch: Vec<Parsed>| lane(feishu.clone(), app.clone(), out.clone(), batch));
    while let Ok((payload, answer, arrived, held)) = jobs.recv().await {
        // Parsing a payload of up to 4 MiB is work for the pool, not the executor.
        let read = runtime::unblock(move || event::read(&payload)).await;
        let chat = match &read {
            Ok(Event { message: Some(m), .. }) => m.chat_id.clone(),
            _ => String::new(),
        };
        lanes.route(chat, (read, answer, arrived, held));
    }
}

/// An event read on the pool, the frame to answer it with, when it arrived, and its share of
/// the budget.
type Parsed = (Result<Event, event::Unreadable>, Frame, Instant, Held);

/// A frame as the WebSocket carries it.
fn binary(frame: &Frame) -> Message {
    Message::Binary(frame.encode().into())
}

/// A batch of one chat's events, in order (their commits shared), each answered after its
/// commit returned; the answer carries the event's share of the budget to the writer. False
/// when the connection is gone.
async fn lane(feishu: Weak<Feishu>, app: String, out: smol::channel::Sender<Out>, batch: Vec<Parsed>) -> bool {
    let Some(f) = feishu.upgrade() else { return false };
    let (reads, rest): (Vec<_>, Vec<_>) = batch
        .into_iter()
        .map(|(read, answer, arrived, held)| (read, (answer, arrived, held)))
        .unzip();
    let outcomes = runtime::unblock(move || f.accept(&app, reads)).await;
    for ((answer, arrived, held), stored) in rest.into_iter().zip(outcomes) {
        let frame = longconn::respond(answer, stored, arrived.elapsed());
        if out.send((binary(&frame), Some(held))).await.is_err() {
            return false;
        }
    }
    true
}
