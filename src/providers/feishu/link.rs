//! Feishu's side of the link supervisor (`link::supervise`): one long connection per app,
//! shared by every chat bound through it.
//!
//! The task runs on the executor and never blocks it: the endpoint request, parsing and each
//! event's handling (binding lookup, file fetch, the outbox commit) run on the blocking pool.
//! Events go to one lane per chat: a chat's events in arrival order, chats side by side, while
//! the reader keeps answering pongs. An event is answered only once its commit returned, so
//! whatever imgate did not store, Feishu delivers again.
//!
//! What the connection holds is bounded until it is written (`link::Conn`): each event takes
//! its bytes and those of its answer from the connection's budget (`QUEUED_BYTES`) when it is
//! read, and gives them back only once the writer wrote the answer (or the connection ended).
//! The heartbeat is Feishu's own ping frame, every `PingInterval` of the server's
//! `ClientConfig`; three intervals without a frame end the connection.
//!
//! Reconnects follow `link::Pace` and the server's `ClientConfig` (`Dial::paced`): after a
//! drop, the later of what `Pace` says and a random part of `ReconnectNonce`; after a failed
//! attempt, `ReconnectInterval` (or the backoff, if longer).

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use async_tungstenite::tungstenite::Message;

use super::event::{self, Event};
use super::frame::{Frame, MAX_FRAME};
use super::longconn::{self, ClientConfig, Endpoint, EndpointError, Reassembly, Received};
use super::Feishu;
use crate::ids;
use crate::providers::link::workers::Worker;
use crate::providers::link::{Conn, Dial, Ended, Heard, Keepalive, Line, Opened, Session};
use crate::providers::socket::{Held, Lanes, Out};
use crate::quiet::Quiet;
use crate::runtime;
use crate::wsclient;

/// The endpoint request gives up after this long.
const ENDPOINT_TIMEOUT: Duration = Duration::from_secs(15);
/// Bytes of a connection's events, and of their answers, from the event's read until its
/// answer was written: past this the reader stops reading (and the server holds what it has not
/// sent). Nothing is dropped.
const QUEUED_BYTES: usize = 2 << 20;
/// An event's payload counts as at least this many bytes against `QUEUED_BYTES`...
const MIN_EVENT_COST: usize = 1024;

/// The link of `app`, given its state line.
pub fn start(feishu: &Weak<Feishu>, line: Line) -> Option<Worker> {
    let app = App {
        feishu: feishu.clone(),
        id: line.account().to_string(),
        config: Mutex::default(),
    };
    crate::providers::link::supervise::start(Arc::new(app), line)
}

/// One app's long connection.
struct App {
    feishu: Weak<Feishu>,
    id: String,
    /// The server's latest `ClientConfig`, kept across connections.
    config: Mutex<ClientConfig>,
}

impl App {
    fn config(&self) -> ClientConfig {
        *self.config.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Dial for App {
    type Socket = (Box<wsclient::Ws>, Endpoint);

    /// A refused app (wrong secret, long connection not enabled) is asked again this often.
    const REFUSED_WAIT: Option<Duration> = Some(Duration::from_secs(300));

    /// The endpoint request on the blocking pool, then the handshake.
    async fn open(&self) -> Option<Opened<Self::Socket>> {
        let f = self.feishu.upgrade()?;
        let (app, config) = (self.id.clone(), self.config());
        let endpoint = runtime::unblock(move || {
            let creds = f
                .creds_of(&app)
                .ok_or_else(|| EndpointError::Retry("the app's secret is no longer available".into()))?;
            let body = f
                .api
                .endpoint(&creds, longconn::ENDPOINT_PATH, ENDPOINT_TIMEOUT)
                .map_err(|e| EndpointError::Retry(e.to_string()))?;
            longconn::read_endpoint(&body, config)
        })
        .await;
        let ep = match endpoint {
            Ok(ep) => ep,
            Err(EndpointError::Refused { code, msg }) => {
                return Some(Opened::Refused(format!(
                    "Feishu refused the long connection (code {code}: {msg}); check the app's credentials and that it receives events through the long connection"
                )))
            }
            Err(EndpointError::Retry(why)) => return Some(Opened::Failed(format!("no address: {why}"), None)),
        };
        *self.config.lock().unwrap_or_else(|e| e.into_inner()) = ep.config;
        Some(match wsclient::open(&ep.url, MAX_FRAME).await {
            Ok(ws) => Opened::Up((Box::new(ws), ep)),
            Err(why) => Opened::Failed(why, None),
        })
    }

    async fn serve(self: Arc<Self>, (ws, ep): Self::Socket, session: Session) -> Ended {
        let _up = session.up();
        let every = self.config().ping_every;
        // The first ping at once.
        let keepalive = Keepalive::Ticks {
            first: Duration::ZERO,
            every,
        };
        let mut conn = Conn::with_budget(*ws, QUEUED_BYTES, keepalive);
        let why = live(&self, &mut conn, &ep).await;
        Ended::down(why, conn.heard())
    }

    /// After a drop, no sooner than the random part of `ReconnectNonce` the server asks for
    /// (spreading its clients out); after a failure, no sooner than its `ReconnectInterval`.
    fn paced(&self, wait: Duration, ended: bool) -> Duration {
        let config = self.config();
        match ended {
            true => wait.max(Duration::from_millis(ids::below(
                config.reconnect_jitter.as_millis() as u64 + 1,
            ))),
            false => wait.max(config.reconnect_every),
        }
    }
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

/// One connection, until it ends: why.
async fn live(app: &App, conn: &mut Conn, ep: &Endpoint) -> String {
    // Unbounded by count: the connection's budget bounds the bytes of the events in it.
    let (job_tx, job_rx) = smol::channel::unbounded::<Job>();
    let _worker = runtime::spawn(worker(app.feishu.clone(), app.id.clone(), job_rx, conn.sender()));
    let mut reassembly = Reassembly::default();
    let mut bad_frames = Quiet::new();
    loop {
        let bytes = match conn.next().await {
            Heard::Binary(b) => b,
            Heard::Text(_) => continue,
            Heard::Tick { .. } => {
                let every = app.config().ping_every;
                // The server answers every ping; three intervals of silence is a dead link.
                if conn.silent_for() > every * 3 {
                    return "no answer to pings".into();
                }
                if let Err(why) = conn.offer(binary(&longconn::ping(ep.service_id))) {
                    return why;
                }
                continue;
            }
            Heard::Closed(_) => return "closed by the server".into(),
            Heard::Broken(e) => return e.to_string(),
            Heard::Ended(why) => return why,
        };
        let now = Instant::now();
        let frame = match Frame::decode(&bytes) {
            Ok(f) => f,
            Err(e) => {
                if let Some(more) = bad_frames.admit() {
                    log::warn!("feishu: app {}: an unreadable frame was dropped: {e}{more}", app.id);
                }
                continue;
            }
        };
        match reassembly.receive(frame, now) {
            Received::Pong(update) => {
                let config = app.config().updated(update);
                *app.config.lock().unwrap_or_else(|e| e.into_inner()) = config;
                conn.keep_alive(Keepalive::Ticks {
                    first: config.ping_every,
                    every: config.ping_every,
                });
            }
            Received::Event { payload, answer, .. } => {
                let held = conn.budget().take(cost(&payload, &answer));
                if job_tx.send((payload, answer, now, held)).await.is_err() {
                    return "the event worker stopped".into();
                }
            }
            Received::Partial => {}
            Received::Ignored(what) => log::debug!("feishu: app {}: frame ignored: {what}", app.id),
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
