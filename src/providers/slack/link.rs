//! Slack's side of the link supervisor (`link::supervise`): one Socket Mode connection per
//! bot, shared by every channel bound through it.
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
//!   revoked token): the bot is refused (its Descriptor and `/status` say why, one log line)
//!   and asked again every `Dial::REFUSED_WAIT`.
//! - A socket that says nothing for `SILENT` (a ping every `PING_EVERY` is answered by any
//!   live server) is replaced: half-open links behind NAT are common.
//! - Other ends: the next connection when `link::Pace` says (a socket that said hello worked:
//!   the next one at once, at most one per `link::MIN_AGE`; a failed open backs off), or after
//!   a 429's `Retry-After` (clamped).

use std::sync::{Arc, Weak};
use std::time::Duration;

use async_tungstenite::tungstenite::Message as WsMessage;
use smol::future::FutureExt;
use smol::stream::StreamExt;

use super::event::{self, Event, Frame, Message};
use super::Slack;
use crate::providers::link::workers::Worker;
use crate::providers::link::{conn, Conn, Dial, Ended, Heard, Keepalive, Line, Opened, Session};
use crate::providers::socket::{self, Held, Lanes, Out};
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
/// The client pings this often, and a socket from which nothing came for `SILENT` is
/// replaced: one lost pong is forgiven, a half-open link is found at the third ping, within a
/// minute.
const KEEPALIVE: Keepalive = Keepalive::Pings {
    every: Duration::from_secs(15),
    silent: Duration::from_secs(40),
};
/// A replaced connection writes what it owes for at most this long, then closes.
const DRAIN: Duration = Duration::from_secs(5);
const LINK_DISABLED: &str =
    "Slack disabled the app's Socket Mode link (link_disabled): turn Socket Mode on in the app's settings";

/// The link of `bot`, given its state line.
pub fn start(slack: &Weak<Slack>, line: Line) -> Option<Worker> {
    let bot = Bot {
        slack: slack.clone(),
        id: line.account().to_string(),
    };
    crate::providers::link::supervise::start(Arc::new(bot), line)
}

/// One bot's Socket Mode link.
struct Bot {
    slack: Weak<Slack>,
    id: String,
}

impl Dial for Bot {
    type Socket = Box<wsclient::Ws>;

    /// `apps.connections.open` on the blocking pool, the handshake, and the `hello`.
    async fn open(&self) -> Option<Opened<Box<wsclient::Ws>>> {
        let s = self.slack.upgrade()?;
        let b = self.id.clone();
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
            Err(Some(e)) if e.temporary() || !e.from_peer => {
                return Some(Opened::Failed(e.to_string(), e.retry_after()))
            }
            Err(Some(e)) => {
                return Some(Opened::Refused(format!(
                    "Slack refused a Socket Mode connection ({}): check the app-level token and that Socket Mode is on",
                    super::api::error(&e)
                )))
            }
        };
        // The URL holds a ticket: it is never logged (wsclient's errors do not name it).
        let mut ws = match wsclient::open(&url, MAX_FRAME).await {
            Ok(ws) => ws,
            Err(why) => return Some(Opened::Failed(why, None)),
        };
        let hello = async {
            while let Some(frame) = ws.next().await {
                match frame {
                    Ok(WsMessage::Text(t)) if t.len() <= crate::json::INLINE_PARSE => {
                        match event::read_frame(t.as_str()) {
                            Frame::Hello => return Ok(()),
                            // `link_disabled`, or `too_many_websockets` (an eleventh socket of the app).
                            Frame::Disconnect { reason } => return Err(reason),
                            _ => {}
                        }
                    }
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
            Ok(()) => Opened::Up(Box::new(ws)),
            Err(reason) if reason == "link_disabled" => Opened::Refused(LINK_DISABLED.into()),
            Err(why) => Opened::Failed(crate::quiet::shown(&why), None),
        })
    }

    async fn serve(self: Arc<Self>, ws: Box<wsclient::Ws>, session: Session) -> Ended {
        let _up = session.up();
        // It said hello: it worked, however it ends.
        match live(&self, *ws, session).await {
            Ok(why) => Ended::down(why, true),
            Err(why) => Ended::refused(why),
        }
    }
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

/// The acknowledgement of an envelope (its ID was checked: no character needs escaping).
fn ack(envelope_id: &str) -> WsMessage {
    WsMessage::Text(format!("{{\"envelope_id\":\"{envelope_id}\"}}").into())
}

/// One socket, until it ends: why (`Err`: Slack disabled the link).
async fn live(bot: &Bot, ws: wsclient::Ws, mut session: Session) -> Result<String, String> {
    let mut conn = Conn::with_budget(ws, QUEUED_BYTES, KEEPALIVE);
    // Once the next socket said hello, this one stops reading and writes what it owes.
    conn.retire_on(session.retire.clone(), DRAIN, false);
    let (s, b, out) = (bot.slack.clone(), bot.id.clone(), conn.sender());
    let mut lanes = Lanes::new(move |batch: Vec<Job>| lane(s.clone(), b.clone(), out.clone(), batch));
    // Every bound channel is caught up first, in its own lane, before its live messages.
    let (s, b) = (bot.slack.clone(), bot.id.clone());
    let channels = runtime::unblock(move || s.upgrade().map(|s| s.connected(&b)).unwrap_or_default()).await;
    for channel in channels {
        lanes.route(channel.clone(), Job::CatchUp(channel));
    }
    let mut unreadable = Quiet::new();
    loop {
        let text = match conn.next().await {
            Heard::Text(t) => t,
            Heard::Binary(_) | Heard::Tick { .. } => continue,
            Heard::Closed(_) => return Ok("closed by Slack".into()),
            Heard::Broken(e) => return Ok(e.to_string()),
            Heard::Ended(why) => return Ok(why),
        };
        let cost = text.len().max(MIN_EVENT_COST).saturating_add(64);
        match conn::parse(text, event::read_frame).await {
            Frame::Hello => {}
            Frame::Disconnect { reason } if reason == "link_disabled" => return Err(LINK_DISABLED.into()),
            Frame::Disconnect { reason } => {
                log::debug!("slack: bot {}: disconnect ({})", bot.id, crate::quiet::shown(&reason));
                session.replace().await;
            }
            Frame::Envelope {
                envelope_id,
                event: Event::Message(m),
            } if !m.channel.is_empty() => {
                let held = conn.budget().take(cost);
                lanes.route(m.channel.clone(), Job::Message(m, envelope_id, held));
            }
            Frame::Envelope { envelope_id, event } => {
                if let Event::Skipped(why) = event {
                    log::debug!("slack: bot {}: {why} acknowledged, not stored", bot.id);
                    if let Some(s) = bot.slack.upgrade() {
                        s.counts.skipped.add(1);
                    }
                }
                // Nothing to store: acknowledged at once (within Slack's 3 s).
                let held = conn.budget().take(cost);
                if let Err(why) = conn.send(ack(&envelope_id), Some(held)).await {
                    return Ok(why);
                }
            }
            Frame::Other(what) => {
                if let Some(more) = unreadable.admit() {
                    log::warn!(
                        "slack: bot {}: a frame was not read: {}{more}",
                        bot.id,
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
    for (channel, run) in socket::runs(batch, Job::channel) {
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
