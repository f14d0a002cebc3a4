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
//! next message is already on its way; a read waits for that commit, so it never sees a message
//! whose ack is not committed yet. A crash in between sends a message again, which xAgent
//! answers `duplicate`. The ping/pong barrier of v1 is not used; a ping every `KEEPALIVE` only
//! notices a dead peer.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use super::{read_pending, tell_delivered, Input, Plane, Readable, Shell, Wait, PAUSE};
use crate::dataplane::request::Ack;
use crate::ids;
use crate::json::ObjWriter;
use crate::protocol::{Packet, Rendered};
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

/// A message as the core tracks it: its place, ID and expiry, and what the shell sends
/// (`body`, its rendered payload; the tests use `()`).
#[derive(Debug, PartialEq)]
pub(super) struct Msg<B> {
    pub seq: u64,
    pub message_id: String,
    pub expires_at: u64,
    pub body: B,
}

struct Sent {
    packet_id: String,
    seq: u64,
    message_id: String,
    at: Instant,
}

struct Channel<B> {
    source: Source,
    queue: VecDeque<Msg<B>>,
    /// Nothing more to read until a wake-up says a message arrived.
    drained: bool,
    reading: bool,
    sent: Option<Sent>,
    backoff: Duration,
    resume_at: Option<Instant>,
}

/// Terminal outcomes waiting for their commit.
#[derive(Default, Debug, PartialEq)]
pub(super) struct Outcomes {
    pub delivered: Vec<(Source, u64)>,
    /// (source, seq, code, message)
    pub failed: Vec<(Source, u64, String, String)>,
    pub retried: Vec<(Source, u64, String)>,
}

impl Outcomes {
    fn is_empty(&self) -> bool {
        self.delivered.is_empty() && self.failed.is_empty() && self.retried.is_empty()
    }
}

#[derive(Debug)]
pub(super) enum Event<B> {
    Ready,
    /// New messages somewhere, or a channel opened, closed, bound or unbound: the session's
    /// bound channels now.
    Channels(Vec<(String, Source)>),
    /// A channel's next pending messages (`None`: the read failed).
    Read(String, Option<Vec<Msg<B>>>),
    Ack(Ack),
    Pong(String),
    Committed {
        ok: bool,
    },
    Timer,
}

#[derive(Debug, PartialEq)]
pub(super) enum Action<B> {
    /// Read these channels' pending messages; answer with one `Event::Read` each.
    Read(Vec<(String, Source)>),
    /// Send this message as `chat.message` with this packet ID.
    Send {
        cch: String,
        packet_id: String,
        msg: Msg<B>,
    },
    /// Commit these outcomes; answer with `Event::Committed`.
    Commit(Outcomes),
    Ping {
        request_id: String,
        due: Instant,
    },
    Close(String),
}

pub(super) struct Core<B> {
    ready: bool,
    channels: BTreeMap<String, Channel<B>>,
    done: Outcomes,
    committing: bool,
    /// A failed commit or read: nothing is read before this.
    paused_until: Option<Instant>,
    next_ping: Instant,
    ping: Option<(String, Instant)>,
}

impl<B> Core<B> {
    pub fn new(now: Instant) -> Core<B> {
        Core {
            ready: false,
            channels: BTreeMap::new(),
            done: Outcomes::default(),
            committing: false,
            paused_until: None,
            next_ping: now + KEEPALIVE,
            ping: None,
        }
    }

    /// The earliest timer: a ping due, a pong due, an ack due, a backoff or pause ending.
    pub fn deadline(&self) -> Instant {
        let mut d = self.next_ping;
        for ch in self.channels.values() {
            if let Some(sent) = &ch.sent {
                d = d.min(sent.at + ACK_TIMEOUT);
            }
            if let Some(t) = ch.resume_at {
                d = d.min(t);
            }
        }
        d.min(self.ping.as_ref().map_or(d, |p| p.1))
            .min(self.paused_until.unwrap_or(d))
    }

    /// What is unacked now.
    pub fn in_flight(&self) -> Vec<(Source, Vec<u64>)> {
        self.channels
            .values()
            .filter_map(|ch| Some((ch.source.clone(), vec![ch.sent.as_ref()?.seq])))
            .collect()
    }

    /// Takes an event; `now_ms` is the wall clock, for expiry.
    pub fn on(&mut self, event: Event<B>, now: Instant, now_ms: u64) -> Vec<Action<B>> {
        match event {
            Event::Ready => self.ready = true,
            Event::Channels(bound) => self.follow(bound),
            Event::Read(cch, found) => {
                if let Some(ch) = self.channels.get_mut(&cch) {
                    ch.reading = false;
                    match found {
                        Some(msgs) => {
                            ch.drained = msgs.is_empty();
                            ch.queue.extend(msgs);
                        }
                        None => self.paused_until = Some(now + PAUSE),
                    }
                }
            }
            Event::Ack(a) => self.on_ack(a, now),
            Event::Pong(id) => {
                if self.ping.as_ref().is_some_and(|(p, _)| *p == id) {
                    self.ping = None;
                }
            }
            Event::Committed { ok } => {
                self.committing = false;
                if !ok {
                    // Nothing is lost: the messages stay pending. Do not spin on a failing disk.
                    self.paused_until = Some(now + PAUSE);
                }
            }
            Event::Timer => {}
        }
        self.step(now, now_ms)
    }

    /// Tracks the channels open on the session and bound: new ones start, gone ones are dropped.
    fn follow(&mut self, bound: Vec<(String, Source)>) {
        self.channels
            .retain(|cch, ch| bound.iter().any(|(c, s)| c == cch && *s == ch.source));
        for (cch, source) in bound {
            let ch = self.channels.entry(cch).or_insert(Channel {
                source,
                queue: VecDeque::new(),
                drained: false,
                reading: false,
                sent: None,
                backoff: BACKOFF_START,
                resume_at: None,
            });
            ch.drained = false;
        }
    }

    /// What is due now: timers, then sends from memory, then the commit, then reads, then a ping.
    fn step(&mut self, now: Instant, now_ms: u64) -> Vec<Action<B>> {
        if self.ping.as_ref().is_some_and(|(_, due)| now >= *due) {
            return vec![Action::Close(format!("no pong within {PONG_TIMEOUT:?}"))];
        }
        self.timers(now);
        if !self.ready {
            return Vec::new();
        }
        let mut actions = self.sends(now, now_ms);
        if !self.done.is_empty() && !self.committing {
            self.committing = true;
            actions.push(Action::Commit(std::mem::take(&mut self.done)));
        }
        // A read must not see a message whose outcome is not committed yet.
        if !self.committing && self.done.is_empty() && self.paused_until.is_none() {
            let needy: Vec<(String, Source)> = self
                .channels
                .iter_mut()
                .filter(|(_, ch)| {
                    ch.queue.is_empty() && !ch.drained && !ch.reading && ch.sent.is_none() && ch.resume_at.is_none()
                })
                .map(|(c, ch)| {
                    ch.reading = true;
                    (c.clone(), ch.source.clone())
                })
                .collect();
            if !needy.is_empty() {
                actions.push(Action::Read(needy));
            }
        }
        if self.ping.is_none() && now >= self.next_ping {
            self.next_ping = now + KEEPALIVE;
            let request_id = ids::short("req_");
            let due = now + PONG_TIMEOUT;
            self.ping = Some((request_id.clone(), due));
            actions.push(Action::Ping { request_id, due });
        }
        actions
    }

    /// Ends what ran out: pauses, backoffs, and acks that are late (their message goes again).
    fn timers(&mut self, now: Instant) {
        if self.paused_until.is_some_and(|t| now >= t) {
            self.paused_until = None;
        }
        for ch in self.channels.values_mut() {
            if ch.sent.as_ref().is_some_and(|s| now >= s.at + ACK_TIMEOUT) {
                if let Some(sent) = ch.sent.take() {
                    log::warn!(
                        "data plane: no ack for message {} within {ACK_TIMEOUT:?}; sending it again",
                        crate::quiet::shown(&sent.message_id)
                    );
                    self.done
                        .retried
                        .push((ch.source.clone(), sent.seq, "no ack in time".into()));
                    ch.queue.clear();
                    ch.drained = false;
                }
            }
            if ch.resume_at.is_some_and(|t| now >= t) {
                ch.resume_at = None;
            }
        }
    }

    /// The next message of every channel with none unacked and no backoff running.
    fn sends(&mut self, now: Instant, now_ms: u64) -> Vec<Action<B>> {
        let mut actions = Vec::new();
        for (cch, ch) in self.channels.iter_mut() {
            if ch.sent.is_some() || ch.resume_at.is_some() {
                continue;
            }
            // Messages that expired while they waited here are skipped; the sweep counts them.
            while ch.queue.front().is_some_and(|m| m.expires_at <= now_ms) {
                ch.queue.pop_front();
            }
            if let Some(msg) = ch.queue.pop_front() {
                let packet_id = ids::short("pkt_");
                ch.sent = Some(Sent {
                    packet_id: packet_id.clone(),
                    seq: msg.seq,
                    message_id: msg.message_id.clone(),
                    at: now,
                });
                actions.push(Action::Send {
                    cch: cch.clone(),
                    packet_id,
                    msg,
                });
            }
        }
        actions
    }

    /// Matches an ack to the message it answers; anything else is ignored.
    fn on_ack(&mut self, a: Ack, now: Instant) {
        let Some(ch) = self.channels.get_mut(&a.channel) else {
            log::debug!("data plane: an ack for a channel not delivering here");
            return;
        };
        let matches = ch
            .sent
            .as_ref()
            .is_some_and(|s| s.packet_id == a.reply_to && s.message_id == a.message_id);
        if !matches {
            log::debug!("data plane: an ack that answers no message in flight");
            return;
        }
        let Some(sent) = ch.sent.take() else { return };
        let (source, seq, shown) = (ch.source.clone(), sent.seq, crate::quiet::shown(&sent.message_id));
        match a.status.as_str() {
            "accepted" | "duplicate" => {
                ch.backoff = BACKOFF_START;
                self.done.delivered.push((source, seq));
            }
            "rejected" if a.retryable => {
                log::info!(
                    "data plane: message {shown} rejected {}: {}; sending it again in {:?}",
                    crate::quiet::shown(&a.code),
                    crate::quiet::shown(&a.message),
                    ch.backoff
                );
                let why = format!("rejected {}: {}", a.code, a.message);
                self.done.retried.push((source, seq, why));
                ch.resume_at = Some(now + ch.backoff);
                ch.backoff = (ch.backoff * 2).min(BACKOFF_CAP);
                // Read again after the backoff: the message is still first in line.
                ch.queue.clear();
                ch.drained = false;
            }
            _ => {
                log::warn!(
                    "data plane: xAgent refused message {shown} for good: {} ({})",
                    crate::quiet::shown(&a.code),
                    crate::quiet::shown(&a.message)
                );
                ch.backoff = BACKOFF_START;
                self.done.failed.push((source, seq, a.code, a.message));
            }
        }
    }
}

/// The shell: runs the core until the session ends.
pub(super) async fn run(shell: Shell) {
    let mut core = Core::<Rendered>::new(Instant::now());
    let mut events = VecDeque::new();
    loop {
        while let Some(event) = events.pop_front() {
            for action in core.on(event, Instant::now(), ids::now_ms()) {
                match action {
                    Action::Read(channels) => {
                        let read = read_pending(&shell.plane, channels, READ_AHEAD, chat_message).await;
                        for (cch, _, found) in read {
                            let msgs = found.ok().map(|list| {
                                list.into_iter()
                                    .map(|p| Msg {
                                        seq: p.seq,
                                        message_id: p.message_id,
                                        expires_at: p.expires_at,
                                        body: p.payload,
                                    })
                                    .collect()
                            });
                            events.push_back(Event::Read(cch, msgs));
                        }
                    }
                    Action::Send { cch, packet_id, msg } => {
                        let mut packet = Packet::new("chat.message").with_channel(&cch).with_rendered(msg.body);
                        packet.packet_id = packet_id;
                        if shell.out.send(packet).await.is_err() {
                            return;
                        }
                    }
                    Action::Commit(batch) => {
                        let ok = commit(&shell, batch).await;
                        events.push_back(Event::Committed { ok });
                    }
                    Action::Ping { request_id, due } => {
                        if !shell.ping(request_id, due).await {
                            return;
                        }
                    }
                    Action::Close(reason) => return shell.close(reason),
                }
            }
        }
        shell.publish(core.in_flight());
        let event = match shell.next(core.deadline()).await {
            Wait::Closed => return,
            Wait::Wake => Event::Channels(shell.plane.hub.bound_on(shell.session)),
            Wait::Input(Input::Ready) => {
                events.push_back(Event::Ready);
                Event::Channels(shell.plane.hub.bound_on(shell.session))
            }
            Wait::Input(Input::Pong(id)) => Event::Pong(id),
            Wait::Input(Input::Ack(a)) => Event::Ack(a),
            Wait::Timer => Event::Timer,
        };
        events.push_back(event);
    }
}

/// The `chat.message` of a stored message: the user's words and files, nothing the model could
/// route by (no chat or sender IDs). In a group the sender's name leads the text.
fn chat_message(plane: &Plane, _: &Source, r: &Readable) -> Rendered {
    let (h, m, base) = (&r.stored.header, &r.inbound, plane.public_base());
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
    let mut w = ObjWriter::with_capacity(256 + 2 * text.len());
    w.str("message_id", &h.message_id)
        .opt_str("text", Some(text.as_str()).filter(|t| !t.is_empty()))
        .objs(
            "files",
            files.iter().map(|f| crate::providers::inbound::file_json(f, base)),
        )
        .num("created_at", m.event_time.unwrap_or(h.accepted_at));
    w.into()
}

/// Commits a batch of outcomes; false when the disk refused some (they stay pending).
async fn commit(shell: &Shell, batch: Outcomes) -> bool {
    super::blocking(&shell.plane, move |plane| {
        let mut all = true;
        let mut by_source: BTreeMap<Source, Vec<u64>> = BTreeMap::new();
        for (src, seq) in batch.delivered {
            by_source.entry(src).or_default().push(seq);
        }
        for (src, seqs) in by_source {
            match plane.outbox.mark_delivered(src.as_str(), &seqs) {
                Ok(_) => tell_delivered(plane, &src),
                Err(e) => {
                    log::error!("outbox: cannot record delivery for {src}: {e}");
                    all = false;
                }
            }
        }
        for (src, seq, code, message) in batch.failed {
            if let Err(e) = plane.outbox.mark_failed(src.as_str(), seq, &code, &message) {
                log::error!("outbox: cannot record a refused message of {src}: {e}");
                all = false;
            }
        }
        for (src, seq, why) in batch.retried {
            if let Err(e) = plane.outbox.mark_attempt_failed(src.as_str(), &[seq], &why) {
                log::error!("outbox: cannot record a failed attempt for {src}: {e}");
            }
        }
        all
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    const FAR: u64 = u64::MAX;

    fn src(k: &str) -> Source {
        Source::new("webhook", k)
    }

    fn msg(seq: u64) -> Msg<()> {
        Msg {
            seq,
            message_id: format!("m{seq}"),
            expires_at: FAR,
            body: (),
        }
    }

    fn ack(cch: &str, packet_id: &str, seq: u64, status: &str, retryable: bool) -> Ack {
        Ack {
            reply_to: packet_id.into(),
            channel: cch.into(),
            message_id: format!("m{seq}"),
            status: status.into(),
            code: if status == "rejected" {
                "busy".into()
            } else {
                String::new()
            },
            message: String::new(),
            retryable,
        }
    }

    /// The packet ID of the one message sent, checking its seq.
    fn sent(actions: &[Action<()>], want_seq: u64) -> String {
        let sends: Vec<_> = actions
            .iter()
            .filter_map(|a| match a {
                Action::Send { packet_id, msg, .. } => Some((packet_id.clone(), msg.seq)),
                _ => None,
            })
            .collect();
        assert_eq!(sends.len(), 1, "{actions:?}");
        assert_eq!(sends[0].1, want_seq, "{actions:?}");
        sends[0].0.clone()
    }

    /// A core past hello with one bound channel `c` whose read found `seqs`.
    fn started(t: Instant, seqs: &[u64]) -> (Core<()>, Vec<Action<()>>) {
        let mut c = Core::new(t);
        assert_eq!(
            c.on(Event::Channels(vec![("c".into(), src("a"))]), t, 0),
            [],
            "nothing before hello"
        );
        let read = c.on(Event::Ready, t, 0);
        assert_eq!(read, [Action::Read(vec![("c".into(), src("a"))])]);
        let found = c.on(
            Event::Read("c".into(), Some(seqs.iter().map(|s| msg(*s)).collect())),
            t,
            0,
        );
        (c, found)
    }

    #[test]
    fn one_message_per_channel_is_unacked_and_order_holds_through_acks() {
        let t = Instant::now();
        let (mut c, first) = started(t, &[1, 2]);
        let p1 = sent(&first, 1);
        assert_eq!(c.in_flight(), [(src("a"), vec![1])]);
        // An ack for another packet or message answers nothing.
        assert!(c
            .on(Event::Ack(ack("c", "pkt_other", 1, "accepted", false)), t, 0)
            .is_empty());
        assert!(c.on(Event::Ack(ack("c", &p1, 2, "accepted", false)), t, 0).is_empty());
        let next = c.on(Event::Ack(ack("c", &p1, 1, "accepted", false)), t, 0);
        let p2 = sent(&next, 2);
        assert!(next.contains(&Action::Commit(Outcomes {
            delivered: vec![(src("a"), 1)],
            ..Outcomes::default()
        })));
        // While the commit runs, nothing is read.
        let after = c.on(Event::Ack(ack("c", &p2, 2, "duplicate", false)), t, 0);
        assert!(after.iter().all(|a| !matches!(a, Action::Read(_))), "{after:?}");
        let done = c.on(Event::Committed { ok: true }, t, 0);
        assert!(done.contains(&Action::Commit(Outcomes {
            delivered: vec![(src("a"), 2)],
            ..Outcomes::default()
        })));
        let read = c.on(Event::Committed { ok: true }, t, 0);
        assert_eq!(
            read,
            [Action::Read(vec![("c".into(), src("a"))])],
            "read once committed"
        );
    }

    #[test]
    fn a_retryable_rejection_backs_off_then_reads_the_same_message_again() {
        let t = Instant::now();
        let (mut c, first) = started(t, &[1, 2]);
        let p1 = sent(&first, 1);
        let out = c.on(Event::Ack(ack("c", &p1, 1, "rejected", true)), t, 0);
        assert_eq!(
            out,
            [Action::Commit(Outcomes {
                retried: vec![(src("a"), 1, "rejected busy: ".into())],
                ..Outcomes::default()
            })],
            "message 2 does not overtake message 1"
        );
        assert!(c.on(Event::Committed { ok: true }, t, 0).is_empty(), "backing off");
        assert_eq!(c.deadline(), t + BACKOFF_START);
        let again = c.on(Event::Timer, t + BACKOFF_START, 0);
        assert_eq!(again, [Action::Read(vec![("c".into(), src("a"))])]);
        let resent = c.on(
            Event::Read("c".into(), Some(vec![msg(1), msg(2)])),
            t + BACKOFF_START,
            0,
        );
        let p = sent(&resent, 1);
        // A second rejection doubles the backoff.
        c.on(Event::Ack(ack("c", &p, 1, "rejected", true)), t + BACKOFF_START, 0);
        assert_eq!(c.deadline(), t + BACKOFF_START + BACKOFF_START * 2);
    }

    #[test]
    fn a_final_rejection_fails_the_message_and_the_next_one_goes() {
        let t = Instant::now();
        let (mut c, first) = started(t, &[1, 2]);
        let p1 = sent(&first, 1);
        let mut a = ack("c", &p1, 1, "rejected", false);
        a.code = "invalid".into();
        let out = c.on(Event::Ack(a), t, 0);
        sent(&out, 2);
        assert!(out.contains(&Action::Commit(Outcomes {
            failed: vec![(src("a"), 1, "invalid".into(), String::new())],
            ..Outcomes::default()
        })));
    }

    #[test]
    fn a_lost_ack_sends_the_message_again_and_a_missing_pong_closes() {
        let t = Instant::now();
        let (mut c, first) = started(t, &[1]);
        sent(&first, 1);
        assert_eq!(c.deadline(), t + ACK_TIMEOUT);
        let late = t + ACK_TIMEOUT;
        let out = c.on(Event::Timer, late, 0);
        assert_eq!(
            out,
            [Action::Commit(Outcomes {
                retried: vec![(src("a"), 1, "no ack in time".into())],
                ..Outcomes::default()
            })]
        );
        assert!(c.in_flight().is_empty());
        // The keepalive: a ping, then no pong by its deadline closes the connection.
        let ping = c.on(Event::Committed { ok: true }, t + KEEPALIVE, 0);
        assert!(ping.iter().any(|a| matches!(a, Action::Ping { .. })), "{ping:?}");
        let out = c.on(Event::Timer, t + KEEPALIVE + PONG_TIMEOUT, 0);
        assert!(matches!(out.as_slice(), [Action::Close(_)]), "{out:?}");
    }

    #[test]
    fn a_reconnect_starts_from_the_store_and_an_unbound_channel_stops_delivering() {
        let t = Instant::now();
        let (mut c, first) = started(t, &[1]);
        sent(&first, 1);
        // The channel is unbound (logout): its message is no longer tracked here.
        c.on(Event::Channels(vec![]), t, 0);
        assert!(c.in_flight().is_empty());
        // A new session (a reconnect) has a new core: it reads what the store holds.
        let (_, again) = started(t, &[1]);
        sent(&again, 1);
    }

    #[test]
    fn expired_messages_are_skipped_and_channels_do_not_wait_for_each_other() {
        let t = Instant::now();
        let mut c = Core::new(t);
        c.on(Event::Ready, t, 10);
        let reads = c.on(
            Event::Channels(vec![("c1".into(), src("a")), ("c2".into(), src("b"))]),
            t,
            10,
        );
        assert_eq!(
            reads,
            [Action::Read(vec![("c1".into(), src("a")), ("c2".into(), src("b"))])]
        );
        let mut old = msg(1);
        old.expires_at = 5;
        let out = c.on(Event::Read("c1".into(), Some(vec![old, msg(2)])), t, 10);
        sent(&out, 2);
        let out = c.on(Event::Read("c2".into(), Some(vec![msg(9)])), t, 10);
        sent(&out, 9);
        assert_eq!(c.in_flight().len(), 2);
    }
}
