//! What every provider's long connection shares (Feishu's, Slack's Socket Mode): what it holds
//! stays bounded until it is written, and one conversation's slow work never holds up another's.
//!
//! - `Budget`: each event takes its bytes and those of its answer when it is read and gives them
//!   back only once the writer wrote the answer (or the connection ended). A full budget stops
//!   the reader; nothing is dropped, the server holds what it has not sent.
//! - `writer`: the one task that writes a connection's frames, from a queue bounded in count;
//!   a frame the server does not take within `WRITE_DEADLINE` ends the connection, so a server
//!   that sends events and never reads the answers stalls the reader, then loses the link.
//! - `Lanes`: one lane per conversation, its events in arrival order and in batches (their
//!   commits shared), conversations side by side.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_tungstenite::tungstenite::Message;
use async_tungstenite::WebSocketSender;
use smol::future::FutureExt;

use crate::runtime;

/// Frames a writer's queue holds (a bounded queue takes its slots' memory at once). Answers past
/// it wait in their lanes, holding their event's share of the budget.
pub const QUEUE_SLOTS: usize = 64;
/// A frame the server does not take within this long ends the connection: a server that reads
/// nothing would otherwise hold the connection's answers, and its budget, forever.
pub const WRITE_DEADLINE: Duration = Duration::from_secs(30);
/// A lane hands at most this many of its waiting events to the outbox at once.
const LANE_BATCH: usize = 64;
/// At most this many conversations have a lane of their own at once.
const MAX_LANES: usize = 32;
const OVERFLOW_LANE: &str = "*";
/// Conversations remembered as the shared lane's (a peer naming new ones without end fills
/// this; past it, a new conversation may get a lane of its own once one is free).
const MAX_SHARED: usize = 4096;
/// A lane with nothing to do for this long ends (a new event starts it again).
const LANE_IDLE: Duration = Duration::from_secs(60);

/// The bytes of events read whose answers are not written yet, and a wake-up for a reader
/// waiting for room.
#[derive(Clone)]
pub struct Budget {
    queued: Arc<AtomicUsize>,
    limit: usize,
    room: smol::channel::Sender<()>,
}

impl Budget {
    /// A budget of `limit` bytes, and the wake-up a reader waits on while it is full.
    pub fn new(limit: usize) -> (Budget, smol::channel::Receiver<()>) {
        let (room, wake) = smol::channel::bounded(1);
        let budget = Budget {
            queued: Arc::default(),
            limit,
            room,
        };
        (budget, wake)
    }

    /// Every answer taken for was written (or dropped).
    pub fn empty(&self) -> bool {
        self.queued.load(Ordering::Relaxed) == 0
    }

    pub fn full(&self) -> bool {
        self.queued.load(Ordering::Relaxed) >= self.limit
    }

    /// Takes `bytes` until the share is dropped.
    pub fn take(&self, bytes: usize) -> Held {
        self.queued.fetch_add(bytes, Ordering::Relaxed);
        Held {
            budget: self.clone(),
            bytes,
        }
    }
}

/// One event's share of the budget, from its read until the writer wrote its answer; dropped
/// unwritten too when the connection ends (whatever holds it is dropped with it).
pub struct Held {
    budget: Budget,
    bytes: usize,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.budget.queued.fetch_sub(self.bytes, Ordering::Relaxed);
        let _ = self.budget.room.try_send(());
    }
}

/// Counts a connection as up while it lives (`/metrics`' `…_connections_up`).
pub struct Up(Arc<AtomicUsize>);

impl Up {
    pub fn new(count: &Arc<AtomicUsize>) -> Up {
        count.fetch_add(1, Ordering::Relaxed);
        Up(count.clone())
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A frame for the writer, with the budget share of the event it answers (none for a ping).
pub type Out = (Message, Option<Held>);

/// Writes the frames of `queue` to `sink` until the queue closes, a close frame was written, or
/// a write fails or takes `WRITE_DEADLINE`; why it stopped. Each frame's share of the budget is given back once written.
pub fn writer<S>(mut sink: WebSocketSender<S>, queue: smol::channel::Receiver<Out>) -> smol::Task<String>
where
    S: smol::io::AsyncRead + smol::io::AsyncWrite + Unpin + Send + 'static,
{
    runtime::spawn(async move {
        while let Ok((message, held)) = queue.recv().await {
            let closing = matches!(message, Message::Close(_));
            let send = async { sink.send(message).await.map_err(|e| e.to_string()) };
            let late = async {
                smol::Timer::after(WRITE_DEADLINE).await;
                Err(format!(
                    "nothing could be written for {}: the server is not reading",
                    crate::config::fmt_duration(WRITE_DEADLINE)
                ))
            };
            if let Err(why) = send.or(late).await {
                return why;
            }
            // Written: the event's bytes are free for the next one.
            drop(held);
            if closing {
                return "closed".to_string();
            }
        }
        // Every sender is gone: a close frame, if the server takes it in time.
        let close = async {
            let _ = sink.close(None).await;
        };
        let late = async {
            smol::Timer::after(Duration::from_secs(5)).await;
        };
        close.or(late).await;
        "the writer's queue closed".to_string()
    })
}

/// The lanes of one connection (or of one account across its connections: Discord's), by
/// conversation. Each lane runs `handle` on batches of its events in order; `handle` returning
/// false ends the lane (what it answers is gone).
pub struct Lanes<J, H> {
    lanes: HashMap<String, smol::channel::Sender<J>>,
    /// Conversations sent to the shared lane while it lives: they stay there, so a lane of their
    /// own (one freed meanwhile) cannot overtake what the shared lane still holds of theirs.
    shared: HashSet<String>,
    handle: H,
}

impl<J, H, F> Lanes<J, H>
where
    J: Send + 'static,
    H: Fn(Vec<J>) -> F + Clone + Send + 'static,
    F: Future<Output = bool> + Send + 'static,
{
    pub fn new(handle: H) -> Lanes<J, H> {
        Lanes {
            lanes: HashMap::new(),
            shared: HashSet::new(),
            handle,
        }
    }

    /// Hands `job` to the lane of `conversation` (started when it has none). Lanes are unbounded
    /// by count: the connection's `Budget` bounds the bytes of all of them.
    pub fn route(&mut self, conversation: String, mut job: J) {
        let key = match self.shared.contains(&conversation) {
            true => OVERFLOW_LANE.to_string(),
            false => lane_key(&self.lanes, conversation.clone()),
        };
        if key == OVERFLOW_LANE && self.shared.len() < MAX_SHARED {
            self.shared.insert(conversation);
        }
        loop {
            let lane = self
                .lanes
                .entry(key.clone())
                .or_insert_with(|| start_lane(self.handle.clone()));
            match lane.try_send(job) {
                Ok(()) | Err(smol::channel::TrySendError::Full(_)) => break,
                // The lane closed itself after a quiet while: a new one takes the job.
                Err(smol::channel::TrySendError::Closed(back)) => {
                    self.lanes.remove(&key);
                    job = back;
                }
            }
        }
        self.lanes.retain(|_, lane| !lane.is_closed());
        if !self.lanes.contains_key(OVERFLOW_LANE) {
            self.shared.clear();
        }
    }
}

/// A lane's batch as runs of one conversation each, in their order: past the lane cap,
/// conversations share a lane, and a run is one commit of one conversation.
pub fn runs<J>(batch: Vec<J>, conversation: impl Fn(&J) -> &str) -> Vec<(String, Vec<J>)> {
    let mut runs: Vec<(String, Vec<J>)> = Vec::new();
    for job in batch {
        match runs.last_mut() {
            Some((c, run)) if c.as_str() == conversation(&job) => run.push(job),
            _ => runs.push((conversation(&job).to_string(), vec![job])),
        }
    }
    runs
}

fn start_lane<J, H, F>(handle: H) -> smol::channel::Sender<J>
where
    J: Send + 'static,
    H: Fn(Vec<J>) -> F + Send + 'static,
    F: Future<Output = bool> + Send + 'static,
{
    let (tx, rx) = smol::channel::unbounded::<J>();
    runtime::spawn(async move {
        while let Some(batch) = next_batch(&rx, LANE_IDLE, LANE_BATCH).await {
            if !handle(batch).await {
                return;
            }
        }
    })
    .detach();
    tx
}

/// The lane of `conversation`: its own, while fewer than `MAX_LANES` have one; past that the
/// newest conversations share one lane.
fn lane_key<V>(lanes: &HashMap<String, V>, conversation: String) -> String {
    match lanes.contains_key(&conversation) || lanes.len() < MAX_LANES {
        true => conversation,
        false => OVERFLOW_LANE.to_string(),
    }
}

/// The lane's next events: whatever waits, up to `max`, once there is one. `None` when the lane
/// should end: nothing came for `idle` (the channel is then closed, so a sender gets its event
/// back and starts a new lane), or every sender is gone.
async fn next_batch<T>(rx: &smol::channel::Receiver<T>, idle: Duration, max: usize) -> Option<Vec<T>> {
    let next = async { rx.recv().await.ok() }
        .or(async {
            smol::Timer::after(idle).await;
            None
        })
        .await;
    let first = match next {
        Some(job) => job,
        None => {
            // Closed first, so no event slips in behind the last look.
            rx.close();
            rx.try_recv().ok()?
        }
    };
    let mut batch = vec![first];
    while batch.len() < max {
        match rx.try_recv() {
            Ok(job) => batch.push(job),
            Err(_) => break,
        }
    }
    Some(batch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lane_takes_what_waits_in_batches_and_closes_when_idle_handing_late_events_back() {
        let (tx, rx) = smol::channel::unbounded::<u32>();
        for i in 0..5 {
            tx.try_send(i).unwrap();
        }
        let idle = Duration::from_millis(50);
        smol::block_on(async {
            assert_eq!(next_batch(&rx, idle, 3).await, Some(vec![0, 1, 2]), "at most `max`");
            assert_eq!(
                next_batch(&rx, idle, 3).await,
                Some(vec![3, 4]),
                "then the rest, in order"
            );
            assert_eq!(next_batch(&rx, idle, 3).await, None, "idle: the lane ends");
        });
        match tx.try_send(9) {
            Err(smol::channel::TrySendError::Closed(back)) => assert_eq!(back, 9, "the sender gets it back"),
            other => panic!("an ended lane took an event: {other:?}"),
        }
    }

    #[test]
    fn a_lanes_batch_is_cut_into_runs_of_one_conversation_in_order() {
        let batch = vec![("a", 1), ("a", 2), ("b", 3), ("a", 4)];
        let runs = runs(batch, |j: &(&str, u32)| j.0);
        let shape: Vec<(String, Vec<u32>)> = runs
            .into_iter()
            .map(|(c, r)| (c, r.into_iter().map(|j| j.1).collect()))
            .collect();
        assert_eq!(
            shape,
            vec![("a".into(), vec![1, 2]), ("b".into(), vec![3]), ("a".into(), vec![4])],
            "a conversation met again later is a run of its own: order is kept"
        );
        assert!(super::runs(Vec::<(&str, u32)>::new(), |j: &(&str, u32)| j.0).is_empty());
    }

    #[test]
    fn past_the_lane_cap_new_conversations_share_one_lane_and_known_ones_keep_theirs() {
        let mut lanes: HashMap<String, ()> = (0..MAX_LANES - 1).map(|i| (format!("oc_{i}"), ())).collect();
        assert_eq!(lane_key(&lanes, "oc_new".into()), "oc_new", "a lane is free");
        lanes.insert("oc_new".into(), ());
        assert_eq!(lane_key(&lanes, "oc_later".into()), OVERFLOW_LANE);
        assert_eq!(lane_key(&lanes, "oc_3".into()), "oc_3");
    }

    #[test]
    fn a_share_of_the_budget_is_given_back_when_dropped_and_wakes_the_reader() {
        let (budget, room) = Budget::new(100);
        let held = budget.take(100);
        assert!(budget.full());
        drop(held);
        assert!(!budget.full());
        assert!(room.try_recv().is_ok(), "a reader waiting for room is woken");
    }
}
