//! Delivery: the outbox of a session's channels to xAgent, one handle per profile.
//!
//! Each profile is an I/O-free core (events in, actions out; `v1::Core`, `v2::Core`, unit
//! tested here) and a small shell that does what the core asks: reads the outbox on the pool,
//! sends packets, commits outcomes, arms timers. The session hands it the packets it owns
//! (`pong`, `chat.message.ack`) through `Delivery`; the hub wakes it when a message of one of its
//! channels is accepted. When the session ends, whatever is unconfirmed goes back to pending
//! with one more attempt (`Delivery::stop`, then `Unconfirmed::back_to_pending`).
//!
//! Both profiles read the outbox the same way (`read_pending`): a stored message this build
//! cannot read is never sent; it leaves the queue as `failed` (code `unreadable`), counted in
//! the channel's figures of `/status`. The read also renders each message's payload and
//! serializes it, on the pool: the executor, which also answers every webhook, only wraps the
//! finished payload in its envelope. A read takes at most `READ_BYTES` of stored messages over
//! all its channels, and the first empty read after a large one gives the heap's free memory
//! back (`heap::give_back`): a drained backlog does not leave the daemon at its peak.

mod v1;
mod v2;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use smol::channel::{Receiver, Sender};
use smol::future::FutureExt;

use super::out::{Missed, Out};
use super::request::Ack;
use super::{blocking, Plane};
use crate::hub::SessionId;
use crate::ids;
use crate::outbox::StoredMessage;
use crate::protocol::{Packet, Profile, Rendered};
use crate::providers::inbound::Inbound;
use crate::source::Source;

/// Inputs queued per session at most (acks and pongs); a flood beyond it is dropped, and a
/// dropped ack only means the message goes again after its timeout.
const INPUTS: usize = 256;
/// A failed commit or read is tried again after this, not at once (a failing disk).
const PAUSE: Duration = Duration::from_secs(1);

/// What the session tells its delivery.
enum Input {
    /// `connector.hello` completed: the channels may be delivered.
    Ready,
    Pong(String),
    Ack(Ack),
}

/// A pending message this build can read, as its profile's renderer sees it.
pub(super) struct Readable {
    pub stored: StoredMessage,
    pub inbound: Inbound,
}

/// A profile's payload of one message (`message.push` or `chat.message`).
type Render = fn(&Plane, &Source, &Readable) -> Rendered;

/// A pending message with its payload rendered and serialized, ready to send.
pub(super) struct Prepared {
    pub seq: u64,
    pub message_id: String,
    pub expires_at: u64,
    pub payload: Rendered,
}

/// The messages sent and not yet confirmed: (source, seqs).
type InFlight = Arc<Mutex<Vec<(Source, Vec<u64>)>>>;

/// One session's delivery, whichever the profile.
pub(super) struct Delivery {
    inputs: Sender<Input>,
    task: smol::Task<()>,
    in_flight: InFlight,
}

/// What a delivery shell needs from its session.
pub(super) struct Shell {
    pub plane: Arc<Plane>,
    pub session: SessionId,
    pub out: Out,
    pub wake: Receiver<()>,
    pub stop: Sender<String>,
    inputs: Receiver<Input>,
    in_flight: InFlight,
}

impl Delivery {
    pub fn start(
        plane: Arc<Plane>,
        session: SessionId,
        out: Out,
        wake: Receiver<()>,
        stop: Sender<String>,
    ) -> Delivery {
        let (inputs_tx, inputs) = smol::channel::bounded(INPUTS);
        let in_flight = InFlight::default();
        let profile = plane.config.xagent.profile;
        let shell = Shell {
            plane,
            session,
            out,
            wake,
            stop,
            inputs,
            in_flight: in_flight.clone(),
        };
        let task = match profile {
            Profile::V1 => crate::runtime::spawn(v1::run(shell)),
            Profile::V2 => crate::runtime::spawn(v2::run(shell)),
        };
        Delivery {
            inputs: inputs_tx,
            task,
            in_flight,
        }
    }

    pub fn ready(&self) {
        let _ = self.inputs.try_send(Input::Ready);
    }

    pub fn pong(&self, request_id: String) {
        let _ = self.inputs.try_send(Input::Pong(request_id));
    }

    pub fn ack(&self, ack: Ack) {
        if self.inputs.try_send(Input::Ack(ack)).is_err() {
            log::debug!("data plane: an ack was dropped (too many queued); its message goes again");
        }
    }

    /// Stops delivering at once (before the session lets go of its channels, so nothing is
    /// sent or dropped from the in-flight list after); what was sent and not confirmed.
    pub async fn stop(self) -> Unconfirmed {
        self.task.cancel().await;
        Unconfirmed(std::mem::take(&mut *super::lock(&self.in_flight)))
    }
}

/// Messages sent and not confirmed when a session ended.
pub(super) struct Unconfirmed(Vec<(Source, Vec<u64>)>);

impl Unconfirmed {
    /// They go back to pending with one more attempt, and the next connection sends them again.
    pub async fn back_to_pending(self, plane: &Arc<Plane>, reason: &str) {
        let in_flight = self.0;
        if in_flight.is_empty() {
            return;
        }
        let why = format!("connection lost before the delivery boundary: {reason}");
        blocking(plane, move |plane| {
            for (source, seqs) in in_flight {
                if let Err(e) = plane.outbox.mark_attempt_failed(source.as_str(), &seqs, &why) {
                    log::error!("outbox: cannot record failed attempt for {source}: {e}");
                }
            }
        })
        .await;
    }
}

/// What the shell waits for next.
enum Wait {
    Wake,
    Input(Input),
    Timer,
    /// The session is ending.
    Closed,
}

impl Shell {
    /// The next of: a wake-up, an input, the deadline.
    async fn next(&self, deadline: Instant) -> Wait {
        async {
            match self.wake.recv().await {
                Ok(()) => Wait::Wake,
                Err(_) => Wait::Closed,
            }
        }
        .or(async {
            match self.inputs.recv().await {
                Ok(i) => Wait::Input(i),
                Err(_) => Wait::Closed,
            }
        })
        .or(async {
            smol::Timer::at(deadline).await;
            Wait::Timer
        })
        .await
    }

    /// Sends a ping whose pong is due by `due`; false when the session must end (its reason
    /// already given to the session).
    async fn ping(&self, request_id: String, due: Instant) -> bool {
        let mut p = Packet::new("ping");
        p.request_id = Some(request_id);
        // The pong's timer runs from when the ping is due, also while the queue holds it.
        match self.out.send_by(p, due).await {
            Ok(()) => true,
            Err(Missed::Ended) => false,
            Err(Missed::Late) => {
                self.close("no pong within the keepalive timeout (the peer reads nothing)".into());
                false
            }
        }
    }

    fn close(&self, reason: String) {
        log::warn!("data plane: session {}: {reason}; closing the connection", self.session);
        let _ = self.stop.try_send(reason);
    }

    fn publish(&self, in_flight: Vec<(Source, Vec<u64>)>) {
        *super::lock(&self.in_flight) = in_flight;
    }
}

/// One channel's part of a read: its messages rendered, or `Err` when the outbox could not be
/// read.
type Read = (String, Source, Result<Vec<Prepared>, ()>);

/// Stored bytes one read takes of all its channels together, shared out equally. A channel
/// stops once its share is reached, so it may pass it by one message (and gets one at least):
/// a read holds at most this plus one message per channel, and its rendering about twice that
/// (a push carries the text as `raw_text` and `text`).
const READ_BYTES: usize = 512 * 1024;

/// A read that took at least this much leaves the heap larger than idle needs: once the
/// outbox runs dry the heap gives its free memory back (`heap::give_back`).
const GREW: usize = 256 * 1024;

/// The next `limit` pending messages of each channel, within `READ_BYTES` in all, read and
/// rendered on the pool. A message this build cannot read leaves the queue as `failed` here, so
/// neither profile ever sends it.
async fn read_pending(plane: &Arc<Plane>, channels: Vec<(String, Source)>, limit: usize, render: Render) -> Vec<Read> {
    let share = READ_BYTES / channels.len().max(1);
    let read = blocking(plane, move |plane| {
        let now = ids::now_ms();
        channels
            .into_iter()
            .map(|(cch, source)| {
                let pending = match plane.outbox.pending_within(source.as_str(), limit, share, now) {
                    Ok(p) => p,
                    Err(e) => {
                        log::debug!("outbox: cannot read {source}: {e}");
                        return (cch, source, Err(()));
                    }
                };
                let mut prepared = Vec::with_capacity(pending.len());
                for p in pending {
                    let Some(inbound) = Inbound::of(&p.message) else {
                        set_aside(plane, &source, p.seq, &p.message.header.message_id);
                        continue;
                    };
                    let readable = Readable {
                        stored: p.message,
                        inbound,
                    };
                    let payload = render(plane, &source, &readable);
                    let header = readable.stored.header;
                    prepared.push(Prepared {
                        seq: p.seq,
                        message_id: header.message_id,
                        expires_at: header.expires_at,
                        payload,
                    });
                }
                (cch, source, Ok(prepared))
            })
            .collect::<Vec<_>>()
    })
    .await;
    give_back_after_a_burst(&read);
    read
}

/// Remembers a read that made the heap grow and, at the first read after it that finds nothing,
/// gives the heap's free memory back on the pool: a drained backlog leaves the daemon at its
/// idle size, not at its peak.
fn give_back_after_a_burst(read: &[Read]) {
    static GREWN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let bytes: usize = read
        .iter()
        .filter_map(|(_, _, r)| r.as_ref().ok())
        .flatten()
        .map(|p| p.payload.size())
        .sum();
    if bytes >= GREW {
        GREWN.store(true, std::sync::atomic::Ordering::Relaxed);
    } else if bytes == 0 && GREWN.swap(false, std::sync::atomic::Ordering::Relaxed) {
        crate::runtime::spawn_blocking(crate::heap::give_back);
    }
}

/// Takes an unreadable stored message out of delivery, counted as failed.
fn set_aside(plane: &Plane, source: &Source, seq: u64, message_id: &str) {
    log::error!(
        "outbox: stored message {} of {source} is unreadable by this build; it is counted as failed and not sent",
        crate::quiet::shown(message_id)
    );
    let why = "the stored message cannot be read by this imgate";
    if let Err(e) = plane.outbox.mark_failed(source.as_str(), seq, "unreadable", why) {
        log::error!("outbox: cannot set aside an unreadable message of {source}: {e}");
    }
}

/// Providers are told their messages were delivered (typing indicators).
fn tell_delivered(plane: &Plane, source: &Source) {
    if let Some(p) = plane.providers.of(source) {
        p.delivered(source);
    }
}
