//! A session's outgoing queue, bounded twice: by frames (the channel's capacity) and by the
//! bytes those frames serialize to (`BUDGET`). A sender waits while its frame would overrun the
//! budget; the writer frees the bytes as each frame goes out, and ends the session when a frame
//! does not go out by its deadline (`write_deadline`). A peer that stops reading therefore holds
//! at most the budget, stops every sender (the reader included, so its pings go unanswered and
//! unread), and is disconnected within the deadline; its channels then wait for the lease as
//! after any disconnect.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_tungstenite::tungstenite::protocol::CloseFrame;
use smol::channel::{Receiver, Sender};
use smol::future::FutureExt;

use crate::protocol::Packet;

/// Frames queued per session at most.
const FRAMES: usize = 256;
/// Bytes queued per session at most (a frame larger than this still goes, alone).
pub const BUDGET: usize = 4 << 20;
/// A frame must be written within this, plus its size at `MIN_RATE`.
pub const WRITE_STALL: Duration = Duration::from_secs(20);
/// The slowest peer served: bytes a second a large frame must average.
const MIN_RATE: u64 = 16 * 1024;

/// What the writer sends.
pub enum Outgoing {
    /// One packet, serialized; `kind` only for the trace log.
    Frame { kind: String, text: String },
    /// Send this close frame (`None`: only what tungstenite owes the peer) and stop.
    Close(Option<CloseFrame>),
}

/// `p` as the writer takes it, and its bytes against the budget.
fn frame(p: Packet) -> (Outgoing, usize) {
    let kind = p.kind.clone();
    let text = p.into_json();
    let n = text.len();
    (Outgoing::Frame { kind, text }, n)
}

/// The session ended: nothing more can be sent.
#[derive(Debug)]
pub struct Ended;

/// Why `send_by` did not queue its packet.
#[derive(Debug, PartialEq)]
pub enum Missed {
    Ended,
    /// Not even queued by the deadline: the peer is not reading.
    Late,
}

/// The sending side, cloned by everything that sends to one session.
#[derive(Clone)]
pub struct Out {
    tx: Sender<Outgoing>,
    queued: Arc<AtomicUsize>,
    /// Woken by the writer as bytes go out.
    room: Receiver<()>,
}

/// The writer's side.
pub struct OutRx {
    rx: Receiver<Outgoing>,
    queued: Arc<AtomicUsize>,
    room: Sender<()>,
}

pub fn queue() -> (Out, OutRx) {
    let (tx, rx) = smol::channel::bounded(FRAMES);
    let (room_tx, room_rx) = smol::channel::bounded(1);
    let queued = Arc::new(AtomicUsize::new(0));
    (
        Out {
            tx,
            queued: queued.clone(),
            room: room_rx,
        },
        OutRx {
            rx,
            queued,
            room: room_tx,
        },
    )
}

impl Out {
    /// Takes `n` bytes of the budget if they fit (or if nothing is queued: one frame larger
    /// than the budget still goes).
    fn reserve(&self, n: usize) -> bool {
        let mut q = self.queued.load(Ordering::SeqCst);
        loop {
            if q != 0 && q.saturating_add(n) > BUDGET {
                return false;
            }
            match self
                .queued
                .compare_exchange(q, q + n, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return true,
                Err(now) => q = now,
            }
        }
    }

    /// Queues `p`, waiting while the budget or the queue is full.
    pub async fn send(&self, p: Packet) -> Result<(), Ended> {
        let (frame, n) = frame(p);
        while !self.reserve(n) {
            if self.tx.is_closed() {
                return Err(Ended);
            }
            // Another sender may take a wake-up first: look again now and then regardless.
            let _ = self
                .room
                .recv()
                .or(async {
                    smol::Timer::after(Duration::from_millis(50)).await;
                    Ok(())
                })
                .await;
        }
        self.tx.send(frame).await.map_err(|_| {
            self.queued.fetch_sub(n, Ordering::SeqCst);
            Ended
        })
    }

    /// `send`, given up at `deadline`. The keepalive uses it: its timer runs from when the ping
    /// is due, not from when a full queue lets it in.
    pub async fn send_by(&self, p: Packet, deadline: std::time::Instant) -> Result<(), Missed> {
        async { self.send(p).await.map_err(|_| Missed::Ended) }
            .or(async {
                smol::Timer::at(deadline).await;
                Err(Missed::Late)
            })
            .await
    }

    /// Queues `p` if there is room now; false otherwise or when the session ended.
    pub fn try_send(&self, p: Packet) -> bool {
        let (frame, n) = frame(p);
        if !self.reserve(n) {
            return false;
        }
        if self.tx.try_send(frame).is_err() {
            self.queued.fetch_sub(n, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// Asks the writer to send `frame` and stop (waits only for room in the queue).
    pub async fn close(&self, frame: Option<CloseFrame>) {
        let _ = self.tx.send(Outgoing::Close(frame)).await;
    }

    /// Bytes queued and not yet written.
    #[cfg(test)]
    fn queued(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }
}

impl OutRx {
    pub async fn recv(&self) -> Option<Outgoing> {
        self.rx.recv().await.ok()
    }

    /// Nothing more is queued now.
    pub fn is_empty(&self) -> bool {
        self.rx.is_empty()
    }

    /// A frame of `n` bytes left the queue (written or not): its bytes are free again.
    pub fn done(&self, n: usize) {
        self.queued.fetch_sub(n, Ordering::SeqCst);
        let _ = self.room.try_send(());
    }
}

/// How long writing a frame of `n` bytes may take before the peer counts as not reading.
pub fn write_deadline(n: usize) -> Duration {
    WRITE_STALL + Duration::from_secs(n as u64 / MIN_RATE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packet(bytes: usize) -> Packet {
        let mut p = Packet::new("ping");
        p.request_id = Some("r".repeat(bytes));
        p
    }

    #[test]
    fn senders_wait_while_the_byte_budget_is_used_and_go_on_as_the_writer_frees_it() {
        smol::block_on(async {
            let (out, rx) = queue();
            let big = BUDGET / 2 + 1;
            out.send(packet(big)).await.unwrap();
            assert!(out.queued() > big);
            assert!(!out.try_send(packet(big)), "a second half-budget frame does not fit");
            let waiting = {
                let out = out.clone();
                smol::spawn(async move { out.send(packet(big)).await })
            };
            smol::Timer::after(Duration::from_millis(100)).await;
            assert!(!waiting.is_finished(), "the sender waits for room");
            let Some(Outgoing::Frame { text, .. }) = rx.recv().await else {
                panic!("a frame is queued")
            };
            rx.done(text.len());
            waiting.await.unwrap();
            assert!(out.queued() > big && out.queued() < BUDGET);
        });
    }

    #[test]
    fn a_frame_larger_than_the_budget_goes_alone() {
        smol::block_on(async {
            let (out, rx) = queue();
            out.send(packet(BUDGET + 10)).await.unwrap();
            assert!(!out.try_send(packet(10)));
            let Some(Outgoing::Frame { text, .. }) = rx.recv().await else {
                panic!("a frame is queued")
            };
            rx.done(text.len());
            assert_eq!(out.queued(), 0);
            assert!(out.try_send(packet(10)));
        });
    }

    #[test]
    fn a_waiting_sender_is_released_when_the_session_ends() {
        smol::block_on(async {
            let (out, rx) = queue();
            out.send(packet(BUDGET)).await.unwrap();
            let waiting = {
                let out = out.clone();
                smol::spawn(async move { out.send(packet(10)).await })
            };
            drop(rx);
            assert!(waiting.await.is_err());
        });
    }

    #[test]
    fn a_keepalive_that_cannot_be_queued_by_its_deadline_is_late() {
        smol::block_on(async {
            let (out, _rx) = queue();
            out.send(packet(BUDGET)).await.unwrap();
            let deadline = std::time::Instant::now() + Duration::from_millis(100);
            assert_eq!(out.send_by(packet(10), deadline).await, Err(Missed::Late));
        });
    }

    #[test]
    fn the_write_deadline_grows_with_the_frame() {
        assert_eq!(write_deadline(100), WRITE_STALL);
        assert_eq!(write_deadline(1 << 20), WRITE_STALL + Duration::from_secs(64));
    }
}
