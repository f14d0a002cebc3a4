//! DingTalk's side of the link supervisor (`link::supervise`): one Stream mode connection per
//! app, shared by every conversation bound through it.
//!
//! A connection: `connections/open` with the app's credentials gives an endpoint and a ticket
//! valid once (a new one for every connection); the socket then carries `SYSTEM` pings
//! (answered at once, echoing their data) and `CALLBACK` robot messages, each answered `200`
//! only after its message was committed (`DingTalk::accept`, in the conversation's lane). A
//! message that could not be stored gets no answer. What a connection holds is bounded until
//! written (`socket::Budget`, the writer's queue and deadline).
//!
//! - `disconnect`: DingTalk closes the socket within about 10 s. The next connection is opened
//!   at once (`Pace`); the old one reads on and writes what it owes until DingTalk closes it
//!   (at most `DRAIN`).
//! - A refused `connections/open` (a wrong secret, Stream mode off): the app is refused (its
//!   Descriptors and `/status` say why, one log line) and asked again every
//!   `Dial::REFUSED_WAIT`.
//! - A socket that says nothing for its `silent` time (a WebSocket ping every `every` is
//!   answered by any live server) is replaced: half-open links behind NAT are common.
//!
//! Robot messages are fire-and-forget at DingTalk: what it sends while no socket is open is
//! not sent again, and there is no history to read it back from. Every second without a
//! connection may lose messages, so a connection that worked is replaced at once.

use std::sync::{Arc, Weak};
use std::time::Duration;

use async_tungstenite::tungstenite::Message as WsMessage;

use super::event::{self, Frame, RobotMessage};
use super::DingTalk;
use crate::providers::link::workers::Worker;
use crate::providers::link::{conn, Conn, Dial, Ended, Heard, Keepalive, Line, Opened, Session};
use crate::providers::socket::{self, Held, Lanes, Out};
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
/// The client pings this often (DingTalk's SDK: every 60 s), and a socket from which nothing
/// came for `silent` is replaced (one lost pong is forgiven).
const KEEPALIVE: Keepalive = Keepalive::Pings {
    every: Duration::from_secs(60),
    silent: Duration::from_secs(130),
};
/// After `disconnect`, the old socket writes what it owes for at most this long, then closes.
const DRAIN: Duration = Duration::from_secs(15);

/// The link of `app`, given its state line.
pub fn start(dingtalk: &Weak<DingTalk>, line: Line) -> Option<Worker> {
    let app = App {
        dingtalk: dingtalk.clone(),
        id: line.account().to_string(),
    };
    crate::providers::link::supervise::start(Arc::new(app), line)
}

/// One app's Stream link.
struct App {
    dingtalk: Weak<DingTalk>,
    id: String,
}

impl Dial for App {
    type Socket = Box<wsclient::Ws>;

    /// `connections/open` on the blocking pool, then the handshake.
    async fn open(&self) -> Option<Opened<Box<wsclient::Ws>>> {
        let d = self.dingtalk.upgrade()?;
        let a = self.id.clone();
        let opened = runtime::unblock(move || {
            let creds = d.creds(&a).ok_or(None)?;
            d.api.open_stream(&creds, OPEN_TIMEOUT).map_err(Some)
        })
        .await;
        let (endpoint, ticket) = match opened {
            Ok(o) => o,
            Err(None) => return Some(Opened::Failed("the app's secret is no longer available".into(), None)),
            Err(Some(e)) if e.temporary() || !super::api::credentials_refused(&e) => {
                return Some(Opened::Failed(e.to_string(), None))
            }
            Err(Some(e)) => {
                return Some(Opened::Refused(format!(
                    "DingTalk refused a Stream connection ({e}): check the app's Client ID and Client Secret, and that the robot uses Stream mode"
                )))
            }
        };
        // The ticket is a credential: wsclient's errors do not name the URL.
        let url = format!("{endpoint}?ticket={}", crate::upstream::query_value(&ticket));
        Some(match wsclient::open(&url, MAX_FRAME).await {
            Ok(ws) => Opened::Up(Box::new(ws)),
            Err(why) => Opened::Failed(crate::quiet::shown(&why), None),
        })
    }

    async fn serve(self: Arc<Self>, ws: Box<wsclient::Ws>, session: Session) -> Ended {
        let _up = session.up();
        let mut conn = Conn::with_budget(*ws, QUEUED_BYTES, KEEPALIVE);
        let why = live(&self, &mut conn, session).await;
        Ended::down(why, conn.heard())
    }
}

/// One robot message and the frame to answer once it is stored, with its budget share.
struct Job(Box<RobotMessage>, String, Held);

/// One socket, until it ends: why.
async fn live(app: &App, conn: &mut Conn, mut session: Session) -> String {
    // DingTalk sends nothing again: a connection told to go reads on until it closes.
    conn.retire_on(session.retire.clone(), DRAIN, true);
    let (d, a, out) = (app.dingtalk.clone(), app.id.clone(), conn.sender());
    let mut lanes = Lanes::new(move |batch: Vec<Job>| lane(d.clone(), a.clone(), out.clone(), batch));
    let mut unreadable = Quiet::new();
    loop {
        let text = match conn.next().await {
            Heard::Text(t) => t,
            Heard::Binary(_) | Heard::Tick { .. } => continue,
            Heard::Closed(_) => return "closed by DingTalk".into(),
            Heard::Broken(e) => return e.to_string(),
            Heard::Ended(why) => return why,
        };
        let cost = text.len().max(MIN_FRAME_COST).saturating_add(256);
        let answer = match conn::parse(text, event::read_frame).await {
            Frame::Robot { message_id, message } => {
                let held = conn.budget().take(cost);
                lanes.route(message.conversation.clone(), Job(message, message_id, held));
                continue;
            }
            Frame::Ping { message_id, data } => event::answer(&message_id, 200, "OK", &data),
            Frame::Disconnect { reason } => {
                log::debug!(
                    "dingtalk: app {}: disconnect ({})",
                    app.id,
                    crate::quiet::shown(&reason)
                );
                conn.drain(DRAIN, true);
                session.replace().await;
                continue;
            }
            Frame::Unreadable { message_id, why } => {
                if let Some(more) = unreadable.admit() {
                    log::warn!("dingtalk: app {}: a robot message was not read: {why}{more}", app.id);
                }
                event::answer(&message_id, 400, "bad request", "{}")
            }
            Frame::Unwanted { message_id } => event::answer(&message_id, 404, "topic not handled", "{}"),
            Frame::Other(what) => {
                if let Some(more) = unreadable.admit() {
                    log::warn!(
                        "dingtalk: app {}: a frame was not read: {}{more}",
                        app.id,
                        crate::quiet::shown(&what)
                    );
                }
                continue;
            }
        };
        let held = conn.budget().take(cost);
        if let Err(why) = conn.send(WsMessage::Text(answer.into()), Some(held)).await {
            return why;
        }
    }
}

/// A batch of one lane's robot messages, in order: each conversation's run handed to
/// `DingTalk::accept` on the pool, and those stored answered (the answer carries the frame's
/// budget share to the writer). A lane outlives its connection: DingTalk sends nothing again,
/// so what was read is stored even when no answer can be written any more. False once the
/// provider is gone.
async fn lane(dingtalk: Weak<DingTalk>, app: String, out: smol::channel::Sender<Out>, batch: Vec<Job>) -> bool {
    for (conversation, run) in socket::runs(batch, |j: &Job| j.0.conversation.as_str()) {
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
