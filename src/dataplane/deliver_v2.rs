//! Delivery under IM profile v2 (sections 5, 7 and 9): every pending message goes out as
//! `chat.message` and leaves the outbox only on a `chat.message.ack` whose `reply_to`,
//! `connector_channel_id` and `message_id` match it:
//!
//! - `accepted` or `duplicate`: delivered (moved to the delivered log, so its ID stays known);
//! - `rejected`, `retryable: true`: pending again with `attempts + 1`, its channel waits a
//!   capped backoff (1 s doubling to 60 s), then the same message goes again;
//! - `rejected`, `retryable: false`: a failed terminal state, kept with its code and message in
//!   the channel's counters (`failed`, `last_failure`), never sent again;
//! - no ack within `ACK_TIMEOUT`, or the connection ends: pending again, same `message_id`, same
//!   `expires_at`.
//!
//! One message per channel is unacked at a time, so per-channel order holds whatever the acks
//! say; channels do not wait for each other. Terminal acks are committed in a batch while the
//! next message is already on its way; a crash in between sends a message again, which xAgent
//! answers `duplicate`. The ping/pong barrier of v1 is not used; a ping every `KEEPALIVE` only
//! notices a dead peer.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use smol::future::FutureExt;

use super::blocking;
use super::out::{Missed, Out};
use super::session::{lock, State};
use crate::app::App;
use crate::ids;
use crate::json::{self, arr, obj, s, Value};
use crate::outbox::Pending;
use crate::protocol::Packet;
use crate::providers::inbound::Inbound;
use crate::source::Source;

/// Pending messages read per channel at a time (held in memory while they go out one by one).
const READ_AHEAD: usize = 32;
/// An ack later than this counts as lost: the message goes again.
const ACK_TIMEOUT: Duration = Duration::from_secs(20);
const BACKOFF_START: Duration = Duration::from_secs(1);
const BACKOFF_CAP: Duration = Duration::from_secs(60);
/// A ping at least this often notices a dead peer; no pong within `PONG_TIMEOUT` ends it.
const KEEPALIVE: Duration = Duration::from_secs(30);
const PONG_TIMEOUT: Duration = Duration::from_secs(20);

/// xAgent's `chat.message.ack` for one of our messages.
pub(super) struct Ack {
    pub reply_to: String,
    pub channel: String,
    pub message_id: String,
    pub status: String,
    pub code: String,
    pub message: String,
    pub retryable: bool,
}

impl Ack {
    /// Reads an ack packet; `None` when it lacks what matching needs.
    pub(super) fn of(p: &Packet) -> Option<Ack> {
        let pl = &p.payload;
        Some(Ack {
            reply_to: p.reply_to.clone()?,
            channel: p.channel_id()?.to_string(),
            message_id: json::get_str(pl, "message_id")?.to_string(),
            status: json::get_str(pl, "status")?.to_string(),
            code: json::get_str(pl, "code").unwrap_or("rejected").to_string(),
            message: json::get_str(pl, "message").unwrap_or_default().to_string(),
            retryable: matches!(pl.get("retryable"), Some(Value::Bool(true))),
        })
    }
}

struct Sent {
    packet_id: String,
    seq: u64,
    message_id: String,
    at: Instant,
}

struct Channel {
    source: Source,
    queue: VecDeque<Pending>,
    /// Nothing more to read until a wake-up says a message arrived.
    drained: bool,
    sent: Option<Sent>,
    backoff: Duration,
    resume_at: Option<Instant>,
}

/// Terminal outcomes waiting for their commit.
#[derive(Default)]
struct Outcomes {
    delivered: Vec<(String, u64)>,
    failed: Vec<(String, u64, String)>,
    retried: Vec<(String, u64, String)>,
}

impl Outcomes {
    fn is_empty(&self) -> bool {
        self.delivered.is_empty() && self.failed.is_empty() && self.retried.is_empty()
    }
}

/// The `chat.message` of a stored message: the user's words and files, nothing the model could
/// route by (no chat or sender IDs). In a group the sender's name leads the text.
pub(super) fn chat_message(app: &App, stored: &crate::outbox::StoredMessage) -> Value {
    let h = &stored.header;
    let Some(m) = Inbound::of(stored) else {
        return obj([("message_id", s(&h.message_id)), ("text", s("[unreadable message]"))]);
    };
    let base = app.public_base();
    let files = m.files.as_deref().unwrap_or_default();
    let mut text = m.text.clone();
    if text.is_empty() && files.is_empty() {
        text = format!("[{}]", m.message_type);
    }
    if m.chat_type == "group" && !text.is_empty() {
        let sender = m
            .sender_name
            .clone()
            .unwrap_or_else(|| crate::providers::inbound::redact(&m.sender_id));
        text = format!("{sender}: {text}");
    }
    let files: Vec<Value> = files
        .iter()
        .map(|f| crate::providers::inbound::file_json(f, base))
        .collect();
    obj([
        ("message_id", s(&h.message_id)),
        ("text", if text.is_empty() { Value::Null } else { s(text) }),
        ("files", if files.is_empty() { Value::Null } else { arr(files) }),
        ("created_at", json::n(m.event_time.unwrap_or(h.accepted_at))),
    ])
}

/// Delivers the outbox of every channel open on session `id` until the session ends.
pub(super) async fn run(
    app: Arc<App>,
    id: u64,
    state: Arc<State>,
    out: Out,
    wake: smol::channel::Receiver<()>,
    acks: smol::channel::Receiver<Ack>,
    stop: smol::channel::Sender<String>,
) {
    let mut channels: HashMap<String, Channel> = HashMap::new();
    let mut done = Outcomes::default();
    let mut next_ping = Instant::now() + KEEPALIVE;
    let mut ping: Option<(String, smol::channel::Receiver<()>, Instant)> = None;
    let mut refresh = true;
    loop {
        if lock(&state.profiles).is_some() {
            if refresh {
                refresh = false;
                follow_channels(&app, id, &mut channels).await;
            }
            // First what is in memory, then the commit, then reads: a read must not see a
            // message whose ack is not committed yet.
            for (cch, ch) in channels.iter_mut() {
                if !send_next(&app, cch, ch, &out).await {
                    return;
                }
            }
            if !done.is_empty() {
                let batch = std::mem::take(&mut done);
                if !commit(&app, batch).await {
                    // Nothing is lost: the messages stay pending. Do not spin on a failing disk.
                    smol::Timer::after(Duration::from_secs(1)).await;
                }
            }
            let needy: Vec<(String, Source)> = channels
                .iter()
                .filter(|(_, ch)| ch.queue.is_empty() && !ch.drained && ch.sent.is_none())
                .map(|(c, ch)| (c.clone(), ch.source.clone()))
                .collect();
            if !needy.is_empty() {
                let read = blocking(&app, move |app| {
                    let now = ids::now_ms();
                    needy
                        .into_iter()
                        .map(|(c, src)| (c, app.outbox.pending(src.as_str(), READ_AHEAD, now)))
                        .collect::<Vec<_>>()
                })
                .await;
                for (cch, pending) in read {
                    let Some(ch) = channels.get_mut(&cch) else { continue };
                    match pending {
                        Ok(p) => {
                            ch.drained = p.is_empty();
                            ch.queue.extend(p);
                        }
                        Err(e) => log::debug!("outbox: cannot read {}: {e}", ch.source),
                    }
                    if !send_next(&app, &cch, ch, &out).await {
                        return;
                    }
                }
            }
            publish_in_flight(&state, &channels);
        }

        // Then wait for whatever comes first.
        let now = Instant::now();
        let mut deadline = next_ping;
        for ch in channels.values() {
            if let Some(sent) = &ch.sent {
                deadline = deadline.min(sent.at + ACK_TIMEOUT);
            }
            if let Some(t) = ch.resume_at {
                deadline = deadline.min(t);
            }
        }
        if let Some((_, _, t)) = &ping {
            deadline = deadline.min(*t);
        }
        enum Event {
            Wake,
            Ack(Ack),
            Pong,
            Timer,
            Closed,
        }
        let pong = async {
            match &ping {
                Some((_, rx, _)) => {
                    let _ = rx.recv().await;
                    Event::Pong
                }
                None => std::future::pending().await,
            }
        };
        let event = async {
            match wake.recv().await {
                Ok(()) => Event::Wake,
                Err(_) => Event::Closed,
            }
        }
        .or(async {
            match acks.recv().await {
                Ok(a) => Event::Ack(a),
                Err(_) => Event::Closed,
            }
        })
        .or(pong)
        .or(async {
            smol::Timer::at(deadline.max(now)).await;
            Event::Timer
        })
        .await;
        match event {
            Event::Closed => return,
            Event::Wake => {
                // New messages somewhere, or a channel opened or bound.
                refresh = true;
                for ch in channels.values_mut() {
                    ch.drained = false;
                }
            }
            Event::Ack(a) => on_ack(a, &mut channels, &mut done, id),
            Event::Pong => {
                if let Some((request_id, _, _)) = ping.take() {
                    lock(&state.barriers).remove(&request_id);
                }
            }
            Event::Timer => {}
        }
        let now = Instant::now();
        // Lost acks: the message goes again (same message_id).
        for ch in channels.values_mut() {
            if ch.sent.as_ref().is_some_and(|s| now >= s.at + ACK_TIMEOUT) {
                if let Some(sent) = ch.sent.take() {
                    log::warn!(
                        "data plane: session {id}: no ack for message {} within {ACK_TIMEOUT:?}; sending it again",
                        crate::quiet::shown(&sent.message_id)
                    );
                    done.retried
                        .push((ch.source.to_string(), sent.seq, "no ack in time".into()));
                    ch.queue.clear();
                    ch.drained = false;
                }
            }
            if ch.resume_at.is_some_and(|t| now >= t) {
                ch.resume_at = None;
            }
        }
        if let Some((_, _, t)) = &ping {
            if now >= *t {
                log::warn!("data plane: session {id}: no pong within {PONG_TIMEOUT:?}; closing the connection");
                let _ = stop.try_send(format!("no pong within {PONG_TIMEOUT:?}"));
                return;
            }
        }
        publish_in_flight(&state, &channels);
        if ping.is_none() && now >= next_ping && lock(&state.profiles).is_some() {
            next_ping = now + KEEPALIVE;
            let request_id = ids::short("req_");
            let (tx, rx) = smol::channel::bounded::<()>(1);
            lock(&state.barriers).insert(request_id.clone(), tx);
            let mut p = Packet::new("ping");
            p.request_id = Some(request_id.clone());
            // The pong's timer runs from now, while the ping waits in a full queue too.
            match out.send_by(p, now + PONG_TIMEOUT).await {
                Err(Missed::Ended) => return,
                Err(Missed::Late) => {
                    log::warn!("data plane: session {id}: no pong within {PONG_TIMEOUT:?}; closing the connection");
                    let _ = stop.try_send(format!("no pong within {PONG_TIMEOUT:?}"));
                    return;
                }
                Ok(()) => {}
            }
            ping = Some((request_id, rx, now + PONG_TIMEOUT));
        }
    }
}

/// Tracks the channels open on the session and bound: new ones start, gone ones are dropped.
async fn follow_channels(app: &Arc<App>, id: u64, channels: &mut HashMap<String, Channel>) {
    let open = app.hub.channels_of(id);
    let bound = blocking(app, move |app| {
        open.into_iter()
            .filter_map(|cch| match app.channels.channel(&cch) {
                Ok(rec) => rec.and_then(|r| r.source()).map(|s| (cch, s)),
                Err(e) => {
                    log::debug!("data plane: cannot read channel {cch}: {e}");
                    None
                }
            })
            .collect::<Vec<_>>()
    })
    .await;
    channels.retain(|cch, ch| bound.iter().any(|(c, s)| c == cch && *s == ch.source));
    for (cch, source) in bound {
        channels.entry(cch).or_insert(Channel {
            source,
            queue: VecDeque::new(),
            drained: false,
            sent: None,
            backoff: BACKOFF_START,
            resume_at: None,
        });
    }
}

/// Sends the channel's next message when nothing of it is unacked; false when the session's
/// writer is gone.
async fn send_next(app: &Arc<App>, cch: &str, ch: &mut Channel, out: &Out) -> bool {
    if ch.sent.is_some() || ch.resume_at.is_some() {
        return true;
    }
    let now = ids::now_ms();
    // Messages that expired while they waited here are skipped; the sweep counts them.
    while ch.queue.front().is_some_and(|p| p.message.header.expires_at <= now) {
        ch.queue.pop_front();
    }
    let Some(next) = ch.queue.pop_front() else { return true };
    let packet = Packet::new("chat.message")
        .with_channel(cch)
        .with_payload(chat_message(app, &next.message));
    ch.sent = Some(Sent {
        packet_id: packet.packet_id.clone(),
        seq: next.seq,
        message_id: next.message.header.message_id.clone(),
        at: Instant::now(),
    });
    out.send(packet).await.is_ok()
}

/// Matches an ack to the message it answers; anything else is ignored.
fn on_ack(a: Ack, channels: &mut HashMap<String, Channel>, done: &mut Outcomes, id: u64) {
    let Some(ch) = channels.get_mut(&a.channel) else {
        log::debug!("data plane: session {id}: an ack for a channel not delivering here");
        return;
    };
    let matches = ch
        .sent
        .as_ref()
        .is_some_and(|s| s.packet_id == a.reply_to && s.message_id == a.message_id);
    if !matches {
        log::debug!("data plane: session {id}: an ack that answers no message in flight");
        return;
    }
    let Some(sent) = ch.sent.take() else { return };
    let source = ch.source.to_string();
    match a.status.as_str() {
        "accepted" | "duplicate" => {
            ch.backoff = BACKOFF_START;
            done.delivered.push((source, sent.seq));
        }
        "rejected" if a.retryable => {
            let why = format!("rejected {}: {}", a.code, a.message);
            log::info!(
                "data plane: message {} rejected {}: {}; sending it again in {:?}",
                crate::quiet::shown(&sent.message_id),
                crate::quiet::shown(&a.code),
                crate::quiet::shown(&a.message),
                ch.backoff
            );
            done.retried.push((source, sent.seq, why));
            ch.resume_at = Some(Instant::now() + ch.backoff);
            ch.backoff = (ch.backoff * 2).min(BACKOFF_CAP);
            // Read again after the backoff: the message is still first in line.
            ch.queue.clear();
            ch.drained = false;
        }
        _ => {
            log::warn!(
                "data plane: xAgent refused message {} for good: {} ({})",
                crate::quiet::shown(&sent.message_id),
                crate::quiet::shown(&a.code),
                crate::quiet::shown(&a.message)
            );
            ch.backoff = BACKOFF_START;
            done.failed
                .push((source, sent.seq, format!("{}\u{0}{}", a.code, a.message)));
        }
    }
}

/// Commits a batch of outcomes; false when the disk refused some (they stay pending).
async fn commit(app: &Arc<App>, batch: Outcomes) -> bool {
    blocking(app, move |app| {
        let mut all = true;
        let mut by_source: HashMap<String, Vec<u64>> = HashMap::new();
        for (src, seq) in batch.delivered {
            by_source.entry(src).or_default().push(seq);
        }
        for (src, seqs) in by_source {
            if let Err(e) = app.outbox.mark_delivered(&src, &seqs) {
                log::error!("outbox: cannot record delivery for {src}: {e}");
                all = false;
            }
        }
        for (src, seq, why) in batch.failed {
            let (code, message) = why.split_once('\u{0}').unwrap_or((&why, ""));
            if let Err(e) = app.outbox.mark_failed(&src, seq, code, message) {
                log::error!("outbox: cannot record a refused message of {src}: {e}");
                all = false;
            }
        }
        for (src, seq, why) in batch.retried {
            if let Err(e) = app.outbox.mark_attempt_failed(&src, &[seq], &why) {
                log::error!("outbox: cannot record a failed attempt for {src}: {e}");
            }
        }
        all
    })
    .await
}

/// What is unacked now, for the session's end (attempts + 1).
fn publish_in_flight(state: &State, channels: &HashMap<String, Channel>) {
    let mut in_flight = lock(&state.in_flight);
    in_flight.clear();
    for ch in channels.values() {
        if let Some(s) = &ch.sent {
            in_flight.push((ch.source.to_string(), vec![s.seq]));
        }
    }
}
