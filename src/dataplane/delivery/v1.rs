//! Delivery under IM profile v1 (section 7.3, the boundary this deployment publishes): pending
//! messages go out as `message.push`, in batches per channel, then one `ping`; a message leaves
//! the outbox as delivered only in the commit that follows the `pong` to a `ping` sent after
//! its push on the same connection. If the session ends first, the batch stays pending with
//! `attempts + 1` and the next connection pushes it again. The barrier doubles as keepalive.
//!
//! The core's states: `Idle` (waiting for a wake-up or the keepalive), `Reading` (the shell
//! reads the session's bound channels), `Barrier` (pushed, pinged, waiting for the pong),
//! `Recording` (the shell commits the round).

use std::time::{Duration, Instant};

use super::{read_pending, tell_delivered, Input, Prepared, Readable, Shell, Wait, PAUSE};
use crate::ids;
use crate::protocol::{Packet, Rendered};
use crate::providers::inbound::{self, Origin};
use crate::source::Source;

/// Pushes per channel per delivery round, at most (the round is bounded by bytes too: `READ_BYTES`).
const BATCH: usize = 64;
/// A `ping` is sent at least this often, pushed or not, to notice dead peers.
const KEEPALIVE: Duration = Duration::from_secs(30);
/// How long a `pong` may take before the connection is considered dead.
const BARRIER_TIMEOUT: Duration = Duration::from_secs(20);

/// One round's messages: (source, seqs) in push order.
type Round = Vec<(Source, Vec<u64>)>;

#[derive(Debug, PartialEq)]
enum Phase {
    Idle,
    /// Reading; `woken`: started by a wake-up (an empty read then needs no ping).
    Reading {
        woken: bool,
    },
    Barrier {
        request_id: String,
        due: Instant,
        round: Round,
    },
    Recording {
        round: Round,
    },
}

#[derive(Debug)]
pub(super) enum Event {
    Ready,
    Wake,
    /// The keepalive or a pause ran out; `pending`: the outbox holds anything at all.
    Timer {
        pending: bool,
    },
    /// What the read found, per channel: (channel, source, messages).
    Read(Vec<(String, Source, Vec<u64>)>),
    Pong(String),
    Recorded {
        ok: bool,
    },
}

#[derive(Debug, PartialEq)]
pub(super) enum Action {
    /// Read the bound channels' pending messages; answer with `Event::Read`.
    Read,
    /// Push these messages (the read's order), then ping with this request ID.
    PushAndPing {
        request_id: String,
        due: Instant,
    },
    /// Commit the round as delivered; answer with `Event::Recorded`.
    Record(Round),
    Close(String),
}

pub(super) struct Core {
    ready: bool,
    phase: Phase,
    /// Look again at once when idle: the last round pushed something (more may be pending), or
    /// a wake-up came while a round was under way.
    again: bool,
    /// When the next keepalive round (or the end of a pause) is due while idle.
    next_round: Instant,
}

impl Core {
    pub fn new(now: Instant) -> Core {
        Core {
            ready: false,
            phase: Phase::Idle,
            again: false,
            next_round: now + KEEPALIVE,
        }
    }

    /// When the shell must come back with `Event::Timer` (or check the barrier).
    pub fn deadline(&self) -> Instant {
        match &self.phase {
            Phase::Barrier { due, .. } => *due,
            _ => self.next_round,
        }
    }

    /// What was pushed and is not yet past the barrier.
    pub fn in_flight(&self) -> Round {
        match &self.phase {
            Phase::Barrier { round, .. } | Phase::Recording { round } => round.clone(),
            _ => Vec::new(),
        }
    }

    pub fn on(&mut self, event: Event, now: Instant) -> Vec<Action> {
        match (event, &mut self.phase) {
            (Event::Ready, _) => {
                // Read now, or as soon as the round under way (a keepalive) ends.
                self.ready = true;
                self.again = true;
                self.start_round(true)
            }
            (Event::Wake, Phase::Idle) if self.ready => self.start_round(true),
            (Event::Timer { pending }, Phase::Idle) if now >= self.next_round => {
                if self.ready && (pending || self.again) {
                    self.start_round(self.again)
                } else {
                    // A keepalive round with nothing pending anywhere only pings: no read.
                    self.barrier(Vec::new(), now)
                }
            }
            (Event::Read(found), Phase::Reading { woken }) => {
                let woken = *woken;
                let round: Round = found
                    .into_iter()
                    .filter(|(_, _, seqs)| !seqs.is_empty())
                    .map(|(_, source, seqs)| (source, seqs))
                    .collect();
                self.again |= !round.is_empty();
                if round.is_empty() && woken {
                    // Nothing to confirm and no keepalive due.
                    self.idle(now, None);
                    return Vec::new();
                }
                self.barrier(round, now)
            }
            (Event::Pong(id), Phase::Barrier { request_id, round, .. }) if id == *request_id => {
                let round = std::mem::take(round);
                if round.is_empty() {
                    self.idle(now, None);
                    return Vec::new();
                }
                self.phase = Phase::Recording { round: round.clone() };
                vec![Action::Record(round)]
            }
            (Event::Timer { .. }, Phase::Barrier { due, .. }) if now >= *due => {
                vec![Action::Close(format!("no pong within {BARRIER_TIMEOUT:?}"))]
            }
            (Event::Recorded { ok }, Phase::Recording { .. }) => {
                // A failing disk: the messages stay pending; wait before the next round.
                self.idle(now, (!ok).then_some(PAUSE));
                Vec::new()
            }
            (Event::Wake, _) => {
                // Busy (or before hello): the next round reads, at once.
                self.again = self.ready;
                Vec::new()
            }
            // A pong to another ping, an early timer: nothing to do.
            _ => Vec::new(),
        }
    }

    fn start_round(&mut self, woken: bool) -> Vec<Action> {
        if self.phase != Phase::Idle {
            return Vec::new();
        }
        self.phase = Phase::Reading { woken };
        self.again = false;
        vec![Action::Read]
    }

    fn barrier(&mut self, round: Round, now: Instant) -> Vec<Action> {
        let (request_id, due) = (ids::short("req_"), now + BARRIER_TIMEOUT);
        self.phase = Phase::Barrier {
            request_id: request_id.clone(),
            due,
            round,
        };
        vec![Action::PushAndPing { request_id, due }]
    }

    /// Back to waiting: at once after a round that pushed (unless paused), else the keepalive.
    fn idle(&mut self, now: Instant, pause: Option<Duration>) {
        self.phase = Phase::Idle;
        self.next_round = match (pause, self.again) {
            (Some(p), _) => now + p,
            (None, true) => now,
            (None, false) => now + KEEPALIVE,
        };
    }
}

/// The shell: runs the core until the session ends.
pub(super) async fn run(shell: Shell) {
    let mut core = Core::new(Instant::now());
    // Read but not yet pushed: the messages of the round being built.
    let mut batches: Vec<(String, Source, Vec<Prepared>)> = Vec::new();
    let mut events = std::collections::VecDeque::new();
    loop {
        while let Some(event) = events.pop_front() {
            for action in core.on(event, Instant::now()) {
                match action {
                    Action::Read => {
                        let bound = shell.plane.hub.bound_on(shell.session);
                        let read = read_pending(&shell.plane, bound, BATCH, render_push).await;
                        batches = read
                            .into_iter()
                            .filter_map(|(cch, source, r)| Some((cch, source, r.ok()?)))
                            .collect();
                        let found = batches
                            .iter()
                            .map(|(cch, src, m)| (cch.clone(), src.clone(), m.iter().map(|r| r.seq).collect()))
                            .collect();
                        events.push_back(Event::Read(found));
                    }
                    Action::PushAndPing { request_id, due } => {
                        for (cch, _, messages) in std::mem::take(&mut batches) {
                            for m in messages {
                                let packet = Packet::new("message.push").with_channel(&cch).with_rendered(m.payload);
                                if shell.out.send(packet).await.is_err() {
                                    return;
                                }
                            }
                        }
                        shell.publish(core.in_flight());
                        if !shell.ping(request_id, due).await {
                            return;
                        }
                    }
                    Action::Record(round) => {
                        let ok = record(&shell, round).await;
                        events.push_back(Event::Recorded { ok });
                    }
                    Action::Close(reason) => return shell.close(reason),
                }
            }
        }
        shell.publish(core.in_flight());
        events.push_back(match shell.next(core.deadline()).await {
            Wait::Closed => return,
            Wait::Wake => Event::Wake,
            Wait::Input(Input::Ready) => Event::Ready,
            Wait::Input(Input::Pong(id)) => Event::Pong(id),
            Wait::Input(Input::Ack(_)) => continue, // v2's packet: the router never sends it here.
            Wait::Timer => Event::Timer {
                pending: shell.plane.outbox.total_bytes() > 0,
            },
        });
    }
}

/// Commits a round as delivered; false when the disk refused some (they stay pending).
async fn record(shell: &Shell, round: Round) -> bool {
    let n: usize = round.iter().map(|(_, s)| s.len()).sum();
    let session = shell.session;
    super::blocking(&shell.plane, move |plane| {
        let mut all = true;
        for (source, seqs) in round {
            match plane.outbox.mark_delivered(source.as_str(), &seqs) {
                Ok(_) => tell_delivered(plane, &source),
                Err(e) => {
                    log::error!("outbox: cannot record delivery for {source}: {e}");
                    all = false;
                }
            }
        }
        log::debug!("data plane: session {session}: {n} message(s) delivered");
        all
    })
    .await
}

/// The `message.push` payload of a stored message: the provider names its origin.
fn render_push(plane: &super::Plane, source: &Source, m: &Readable) -> Rendered {
    let provider = plane.providers.of(source);
    let label = provider.map_or_else(|| source.key().to_string(), |p| p.label(source));
    let origin = Origin {
        provider: source.provider(),
        label: &label,
        tools: provider.map_or(&[], |p| p.declaration().tools),
        base: plane.public_base(),
        skill: plane.config.server.card_id.skill_name(),
    };
    inbound::render(&origin, &m.inbound, &m.stored).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn src(k: &str) -> Source {
        Source::new("webhook", k)
    }

    fn ping_of(actions: &[Action]) -> String {
        match actions {
            [Action::PushAndPing { request_id, .. }] => request_id.clone(),
            other => panic!("expected one push-and-ping, got {other:?}"),
        }
    }

    #[test]
    fn a_round_is_recorded_only_after_the_pong_to_its_own_ping() {
        let t = Instant::now();
        let mut c = Core::new(t);
        assert_eq!(c.on(Event::Wake, t), [], "nothing is read before hello");
        assert_eq!(c.on(Event::Ready, t), [Action::Read]);
        let id = ping_of(&c.on(Event::Read(vec![("cch".into(), src("a"), vec![1, 2])]), t));
        assert_eq!(c.in_flight(), [(src("a"), vec![1, 2])]);
        assert_eq!(
            c.on(Event::Pong("req_other".into()), t),
            [],
            "another ping's pong is no barrier"
        );
        assert_eq!(c.on(Event::Wake, t), [], "one round at a time");
        assert_eq!(c.on(Event::Pong(id), t), [Action::Record(vec![(src("a"), vec![1, 2])])]);
        assert_eq!(c.in_flight(), [(src("a"), vec![1, 2])], "in flight until committed");
        assert_eq!(c.on(Event::Recorded { ok: true }, t), []);
        assert!(c.in_flight().is_empty());
        // It pushed: the next round starts at once.
        assert_eq!(c.deadline(), t);
        assert_eq!(c.on(Event::Timer { pending: false }, t), [Action::Read]);
    }

    #[test]
    fn hello_during_a_keepalive_round_reads_as_soon_as_its_pong_arrives() {
        let t = Instant::now();
        let mut c = Core::new(t);
        let id = ping_of(&c.on(Event::Timer { pending: true }, t + KEEPALIVE));
        assert_eq!(c.on(Event::Ready, t + KEEPALIVE), [], "one round at a time");
        assert_eq!(c.on(Event::Pong(id), t + KEEPALIVE), []);
        assert_eq!(c.deadline(), t + KEEPALIVE, "at once, not a keepalive later");
        assert_eq!(c.on(Event::Timer { pending: false }, t + KEEPALIVE), [Action::Read]);
    }

    #[test]
    fn an_empty_woken_round_sends_no_ping_and_the_keepalive_pings_without_reading() {
        let t = Instant::now();
        let mut c = Core::new(t);
        c.on(Event::Ready, t);
        assert_eq!(c.on(Event::Read(vec![("cch".into(), src("a"), vec![])]), t), []);
        assert_eq!(c.deadline(), t + KEEPALIVE);
        assert_eq!(
            c.on(Event::Timer { pending: false }, t + KEEPALIVE / 2),
            [],
            "early timer"
        );
        let later = t + KEEPALIVE;
        let id = ping_of(&c.on(Event::Timer { pending: false }, later));
        assert!(c.in_flight().is_empty());
        assert_eq!(c.on(Event::Pong(id), later), [], "an empty round records nothing");
        // With something pending anywhere, the keepalive round reads first.
        let again = later + KEEPALIVE;
        assert_eq!(c.on(Event::Timer { pending: true }, again), [Action::Read]);
    }

    #[test]
    fn no_pong_by_the_deadline_closes_and_the_round_stays_in_flight_for_the_next_connection() {
        let t = Instant::now();
        let mut c = Core::new(t);
        c.on(Event::Ready, t);
        ping_of(&c.on(Event::Read(vec![("cch".into(), src("a"), vec![7])]), t));
        assert_eq!(c.deadline(), t + BARRIER_TIMEOUT);
        assert_eq!(c.on(Event::Timer { pending: true }, t + BARRIER_TIMEOUT / 2), []);
        let out = c.on(Event::Timer { pending: true }, t + BARRIER_TIMEOUT);
        assert!(matches!(out.as_slice(), [Action::Close(_)]), "{out:?}");
        assert_eq!(c.in_flight(), [(src("a"), vec![7])], "handed back as a failed attempt");
    }

    #[test]
    fn a_failed_commit_pauses_before_the_next_round_and_keeps_channel_order() {
        let t = Instant::now();
        let mut c = Core::new(t);
        c.on(Event::Ready, t);
        let read = vec![("c1".into(), src("a"), vec![1, 2]), ("c2".into(), src("b"), vec![5])];
        let id = ping_of(&c.on(Event::Read(read), t));
        let recorded = c.on(Event::Pong(id), t);
        assert_eq!(
            recorded,
            [Action::Record(vec![(src("a"), vec![1, 2]), (src("b"), vec![5])])]
        );
        c.on(Event::Recorded { ok: false }, t);
        assert_eq!(c.deadline(), t + PAUSE);
        assert_eq!(c.on(Event::Timer { pending: true }, t), []);
        assert_eq!(c.on(Event::Timer { pending: true }, t + PAUSE), [Action::Read]);
    }
}
