//! The committer thread: gathers concurrent enqueues into one group, commits it with one synced
//! log append, answers every sender, checkpoints when the log asks for one, and writes the
//! log records held for a sync that did not come (`wal::HOLD`).
//!
//! Senders hand their jobs over through `Queue`, a mutex-guarded list the committer drains
//! whole. A sender wakes the committer only when it is needed: the first job while the
//! committer is idle, or the one that completes the group it waits for, and only once a wait
//! (the pushes before the committer runs again would each wake it, a syscall apiece). Jobs
//! that arrive while a group commits just queue up and are taken at once by the next round,
//! so a burst of senders costs one wake-up per group, not one per sender.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::durable::Shared;
use super::{enqueue_in, wal, Enqueued, NewMessage};
use crate::store::Result;

/// Most enqueues folded into one transaction.
const MAX_GROUP: usize = 256;
/// A group stops growing at this many payload bytes, so its log record stays well inside the log.
pub const MAX_GROUP_BYTES: usize = (wal::LOG_BYTES / 8) as usize;
/// The committer never waits longer than this for a group to fill.
const LINGER: Duration = Duration::from_millis(4);

pub struct Job {
    pub message: NewMessage,
    pub done: smol::channel::Sender<Result<Enqueued>>,
}

/// What senders hand the committer.
#[derive(Default)]
pub struct Queue {
    waiting: Mutex<Waiting>,
    ready: Condvar,
    #[cfg(test)]
    wakes: AtomicUsize,
}

#[derive(Default)]
struct Waiting {
    jobs: Vec<Job>,
    bytes: usize,
    /// How many queued jobs make the committer want to be woken; 0 while it is busy.
    want: usize,
    /// The log asks for upkeep (a checkpoint, or held records to write in time).
    upkeep: bool,
    /// The outbox is being dropped: commit what is queued, checkpoint and exit.
    stop: bool,
}

impl Waiting {
    fn full(&self) -> bool {
        self.jobs.len() >= MAX_GROUP || self.bytes >= MAX_GROUP_BYTES
    }
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a job; false once the committer has stopped.
    pub fn push(&self, job: Job) -> bool {
        let mut w = self.lock();
        if w.stop {
            return false;
        }
        w.bytes += job.message.payload.len();
        w.jobs.push(job);
        let wake = w.want > 0 && (w.jobs.len() >= w.want || w.full());
        if wake {
            // One wake-up a wait: the pushes until the committer runs would wake it again.
            w.want = 0;
        }
        drop(w);
        if wake {
            #[cfg(test)]
            self.wakes.fetch_add(1, Ordering::Relaxed);
            self.ready.notify_one();
        }
        true
    }

    /// The log needs upkeep: a checkpoint, or a new deadline for held records.
    pub fn wake(&self) {
        self.lock().upkeep = true;
        self.ready.notify_one();
    }

    pub fn stop(&self) {
        self.lock().stop = true;
        self.ready.notify_one();
    }
}

/// How long, and for how many senders, the committer waits before it commits a group.
///
/// Waiting pays only while senders are still arriving, one after the other, as the answers to
/// the last group go out: each one caught saves an fsync and a log page. So the committer waits
/// for as many as the last group had plus those that queued up while it committed (they show
/// there are more senders than one group held), for at most one commit's time (`LINGER` at
/// most). So concurrent senders that drifted apart into small groups merge again, and a lone
/// sender, whom nobody ever joins, never waits.
struct Batcher {
    /// The last group's size plus the jobs queued when it was committed.
    target: usize,
    last_commit: Duration,
}

/// The committer's loop, until the outbox is dropped; then a last checkpoint.
pub fn run(shared: &Shared, counted: &(AtomicUsize, AtomicUsize)) {
    let queue = &*shared.queue;
    let mut batch = Batcher {
        target: 1,
        last_commit: Duration::from_micros(500),
    };
    loop {
        // Asked outside the queue's lock: a writer holding the outbox's lock may be waking us.
        let due = shared.upkeep_due();
        let (jobs, upkeep, stop) = {
            let mut w = queue.lock();
            w.want = 1;
            if w.jobs.is_empty() && !w.upkeep && !w.stop {
                w = match due {
                    None => queue.ready.wait(w).unwrap_or_else(|e| e.into_inner()),
                    Some(wait) => queue.ready.wait_timeout(w, wait).unwrap_or_else(|e| e.into_inner()).0,
                };
            }
            if !w.jobs.is_empty() && w.jobs.len() < batch.target {
                let deadline = Instant::now() + batch.last_commit.min(LINGER);
                w.want = batch.target;
                while w.jobs.len() < batch.target && !w.full() && !w.stop {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    w = queue.ready.wait_timeout(w, left).unwrap_or_else(|e| e.into_inner()).0;
                }
            }
            w.want = 0;
            let (mut n, mut bytes) = (0, 0);
            while n < w.jobs.len() && n < MAX_GROUP && bytes < MAX_GROUP_BYTES {
                bytes += w.jobs[n].message.payload.len();
                n += 1;
            }
            w.bytes -= bytes;
            let jobs: Vec<Job> = w.jobs.drain(..n).collect();
            let stop = w.stop && w.jobs.is_empty();
            (jobs, std::mem::take(&mut w.upkeep), stop)
        };
        if !jobs.is_empty() {
            let started = Instant::now();
            let grouped = jobs.len();
            counted.0.fetch_add(1, Ordering::Relaxed);
            counted.1.fetch_add(grouped, Ordering::Relaxed);
            commit_group(shared, jobs);
            batch.last_commit = started.elapsed();
            batch.target = (grouped + queue.lock().jobs.len()).min(MAX_GROUP);
        }
        if stop {
            break;
        }
        if upkeep || due.is_some() {
            shared.upkeep();
        }
    }
    // Clean shutdown: the log is applied to redb durably, so the next start replays nothing.
    shared.checkpoint();
}

/// One transaction and one synced log append for a group of enqueues; every job learns the
/// outcome, then the hook hears of each source that got a message.
fn commit_group(shared: &Shared, jobs: Vec<Job>) {
    let policy = shared.policy;
    let result = shared.write(true, |tx, idx| {
        let mut outcomes = Vec::with_capacity(jobs.len());
        for job in &jobs {
            outcomes.push(enqueue_in(tx, idx, &job.message, policy)?);
        }
        Ok(outcomes)
    });
    match result {
        Ok(outcomes) => {
            let mut woken: Vec<String> = Vec::new();
            for (job, outcome) in jobs.into_iter().zip(outcomes) {
                if matches!(outcome, Enqueued::Accepted { .. }) && !woken.contains(&job.message.source) {
                    woken.push(job.message.source.clone());
                }
                let _ = job.done.try_send(Ok(outcome));
            }
            if let Some(hook) = shared.on_accept.get() {
                for source in &woken {
                    hook(source);
                }
            }
        }
        Err(e) => {
            log::debug!("outbox: commit of {} message(s) failed: {e}", jobs.len());
            for job in jobs {
                let _ = job.done.try_send(Err(e.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::NewMessage;

    fn job(id: &str) -> Job {
        let (done, _) = smol::channel::bounded(1);
        let message = NewMessage {
            source: "hook:a".into(),
            message_id: id.into(),
            payload: "{}".into(),
            reply_ref: None,
            accepted_at: 0,
            expires_at: 1,
            cursors: Vec::new(),
        };
        Job { message, done }
    }

    #[test]
    fn only_the_push_the_committer_waits_for_wakes_it_and_only_once() {
        let q = Queue::default();
        let wakes = || q.wakes.load(Ordering::Relaxed);
        q.lock().want = 3;
        assert!(q.push(job("1")) && q.push(job("2")));
        assert_eq!(wakes(), 0, "the group is not complete yet");
        assert!(q.push(job("3")));
        assert_eq!(wakes(), 1, "the third completes the group");
        assert!(q.push(job("4")) && q.push(job("5")));
        assert_eq!(
            wakes(),
            1,
            "until the committer runs and waits again, nobody wakes it twice"
        );
        q.lock().want = 1;
        assert!(q.push(job("6")));
        assert_eq!(wakes(), 2, "waiting again, it is woken again");
        q.stop();
        assert!(!q.push(job("7")), "a stopped committer takes nothing");
    }
}
