//! WeCom's side of the link supervisor (`link::supervise`): one long connection per robot,
//! shared by every chat bound through it.
//!
//! A connection: the socket, then `aibot_subscribe` with the robot's ID and secret, answered 0
//! (`api::subscribe`). Robot messages arrive as `aibot_msg_callback`; WeCom wants no answer
//! and sends nothing twice, so a message is stored in its chat's lane (`WeCom::accept`) and
//! the `req_id` a reply names is kept in the same commit. Replies and sends go out on the same
//! connection (`link::calls`), answered by their `req_id`.
//!
//! - Heartbeat: a `ping` every `PING_EVERY`; two unanswered pings end the connection at the
//!   next one (the SDK's rule: about 90 s after the last answer).
//! - A link that answers pings but delivers nothing (reported of WeCom: group messages stop
//!   while pings still work) cannot be told from a quiet one; a connection that brought no
//!   message for `DEAF` is replaced. The cost is the moment between two connections, in which
//!   WeCom would drop what it sends; a deaf link would lose everything until it is noticed.
//! - `disconnected_event`: another client subscribed as this robot, and WeCom closes this
//!   connection. That is a refusal only the owner can settle (two deployments of one robot):
//!   its bindings say so, and the robot is asked again after `Dial::REFUSED_WAIT`, with no
//!   reconnect fight meanwhile.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::api::{self, Answer, Refusal};
use super::event::{self, Frame, RobotMessage};
use super::WeCom;
use crate::providers::link::calls::Calls;
use crate::providers::link::workers::Worker;
use crate::providers::link::{conn, Conn, Dial, Ended, Heard, Keepalive, Line, Opened, Session};
use crate::providers::socket::{self, Held, Lanes};
use crate::quiet::Quiet;
use crate::runtime;
use crate::wsclient;

/// Bytes of messages read and not yet stored: past this the reader stops reading.
const QUEUED_BYTES: usize = 1 << 20;
/// A message counts as at least this many bytes against `QUEUED_BYTES`.
const MIN_EVENT_COST: usize = 1024;
/// The SDK's heartbeat; more often when `replace_quiet` is short (a quarter of it), so a
/// silent link is found before a quiet one is replaced.
const PING_EVERY: Duration = Duration::from_secs(30);
/// Unanswered pings after which the connection is dead.
const MISSED_PINGS: u32 = 2;
/// A connection that brought no message for this long is replaced.
pub const DEAF: Duration = Duration::from_secs(30 * 60);

/// The link of `line`'s robot.
pub fn start(wecom: &Weak<WeCom>, calls: Arc<Calls<Answer>>, deaf: Duration, line: Line) -> Option<Worker> {
    let robot = Robot {
        wecom: wecom.clone(),
        id: line.account().to_string(),
        calls,
        deaf,
    };
    crate::providers::link::supervise::start(Arc::new(robot), line)
}

/// One robot's long connection.
struct Robot {
    wecom: Weak<WeCom>,
    id: String,
    /// Replies and sends waiting for their answers.
    calls: Arc<Calls<Answer>>,
    deaf: Duration,
}

impl Dial for Robot {
    type Socket = Box<wsclient::Ws>;

    /// The socket and the subscribe.
    async fn open(&self) -> Option<Opened<Box<wsclient::Ws>>> {
        let w = self.wecom.upgrade()?;
        let id = self.id.clone();
        // The secret is a file read: on the pool.
        let (url, secret) = runtime::unblock(move || (w.settings.ws_url.clone(), w.secret(&id))).await;
        let Some(secret) = secret else {
            return Some(Opened::Failed("the robot's secret is no longer available".into(), None));
        };
        Some(match api::subscribe(&url, &self.id, &secret).await {
            Ok(ws) => Opened::Up(Box::new(ws)),
            Err(Refusal::Refused(code, why)) if api::CREDENTIALS_REFUSED.contains(&code) => {
                Opened::Refused(format!("{why}: check the robot's Bot ID and Secret"))
            }
            Err(Refusal::Refused(_, why)) => Opened::Failed(why, None),
            Err(Refusal::Failed(why)) => Opened::Failed(why, None),
        })
    }

    async fn serve(self: Arc<Self>, ws: Box<wsclient::Ws>, session: Session) -> Ended {
        let _up = session.up();
        let every = PING_EVERY.min(self.deaf / 4);
        let keepalive = Keepalive::Ticks { first: every, every };
        let mut conn = Conn::with_budget(*ws, QUEUED_BYTES, keepalive);
        let out = conn.sender();
        self.calls.connected(out.clone());
        let end = live(&self, &mut conn).await;
        self.calls.ended(&out);
        end
    }
}

/// One robot message, the `req_id` a reply names, and its share of the budget.
struct Job(Box<RobotMessage>, String, Held);

/// One connection, until it ends.
async fn live(robot: &Robot, conn: &mut Conn) -> Ended {
    let (w, b) = (robot.wecom.clone(), robot.id.clone());
    let mut lanes = Lanes::new(move |batch: Vec<Job>| lane(w.clone(), b.clone(), batch));
    let mut unreadable = Quiet::new();
    let mut missed = 0u32;
    let mut last_message = Instant::now();
    loop {
        let text = match conn.next().await {
            Heard::Text(t) => t,
            Heard::Binary(_) => continue,
            Heard::Tick { paused } => {
                // A paused reader hears no answer either.
                if paused {
                    missed = 0;
                }
                if missed >= MISSED_PINGS {
                    return Ended::down(format!("{MISSED_PINGS} pings unanswered"), conn.heard());
                }
                // Deaf is a link that answers pings and delivers nothing: one whose pings go
                // unanswered is told by the rule above, so the reason given never depends on
                // which of the two a tick meets first.
                if missed == 0 && last_message.elapsed() >= robot.deaf {
                    let quiet = crate::config::fmt_duration(robot.deaf);
                    return Ended::down(format!("no message for {quiet}: replaced in case it went deaf"), true);
                }
                if let Err(why) = conn.offer(api::ping(&api::req_id("ping"))) {
                    return Ended::down(why, conn.heard());
                }
                missed += 1;
                continue;
            }
            Heard::Closed(_) => return Ended::down("closed by WeCom".into(), conn.heard()),
            Heard::Broken(e) => return Ended::down(e.to_string(), conn.heard()),
            Heard::Ended(why) => return Ended::down(why, conn.heard()),
        };
        let cost = text.len().max(MIN_EVENT_COST);
        match conn::parse(text, event::read_frame).await {
            Frame::Answer { req_id, errcode, .. } if req_id.starts_with("ping_") => {
                if errcode == 0 {
                    missed = 0;
                }
            }
            Frame::Answer {
                req_id,
                errcode,
                errmsg,
                upload_id,
                media_id,
            } => {
                let answer = Answer {
                    errcode,
                    errmsg,
                    upload_id,
                    media_id,
                };
                robot.calls.answered(&req_id, answer);
            }
            Frame::Message { req_id, message } => {
                last_message = Instant::now();
                let held = conn.budget().take(cost);
                lanes.route(message.chat.clone(), Job(message, req_id, held));
            }
            Frame::Kicked => {
                return Ended::refused(
                    "another client subscribed as this robot and WeCom closed this connection (disconnected_event; one connection per robot): stop the other client, or bind again"
                        .into(),
                )
            }
            Frame::Event(_) => {}
            Frame::Unreadable(why) => {
                if let Some(more) = unreadable.admit() {
                    log::warn!("wecom: robot {}: a message was not read: {why}{more}", robot.id);
                }
            }
            Frame::Other(what) => {
                if let Some(more) = unreadable.admit() {
                    log::warn!(
                        "wecom: robot {}: a frame was not read: {}{more}",
                        robot.id,
                        crate::quiet::shown(&what)
                    );
                }
            }
        }
    }
}

/// A batch of one lane's messages, in order: each chat's run handed to `WeCom::accept` on the
/// pool. WeCom sends nothing again: a lane outlives its connection, and what was read is
/// stored.
async fn lane(wecom: Weak<WeCom>, robot: String, batch: Vec<Job>) -> bool {
    for (chat, run) in socket::runs(batch, |j: &Job| j.0.chat.as_str()) {
        let Some(w) = wecom.upgrade() else { return false };
        let (messages, held): (Vec<(RobotMessage, String)>, Vec<Held>) =
            run.into_iter().map(|Job(m, r, h)| ((*m, r), h)).unzip();
        let r = robot.clone();
        runtime::unblock(move || w.accept(&r, &chat, messages)).await;
        drop(held);
    }
    true
}
