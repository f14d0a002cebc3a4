//! The committer thread: gathers concurrent enqueues into one group, commits it with one synced
//! log append, answers every sender, checkpoints when the log asks for one, and writes the
//! log records held for a sync that did not come (`wal::HOLD`).
//!
//! Senders hand their jobs over through `Queue` (`queue.rs`), a mutex-guarded list the
//! committer drains whole. A sender wakes the committer only when it is needed: the first job while the
//! committer is idle, or the one that completes the group it waits for, and only once a wait
//! (the pushes before the committer runs again would each wake it, a syscall apiece). Jobs
//! that arrive while a group commits just queue up and are taken at once by the next round,
//! so a burst of senders costs one wake-up per group, not one per sender.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::durable::Shared;
use super::outcomes::{Outcome, Outcomes};
use super::queue::{Job, MAX_GROUP};
use super::{enqueue_in, Enqueued};

/// The committer never waits longer than this for a group to fill.
const LINGER: Duration = Duration::from_millis(4);

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
pub fn run(shared: &Shared, counts: &Outcomes) {
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
            while n < w.jobs.len() && n < MAX_GROUP && bytes < w.group_bytes {
                bytes += w.jobs[n].bytes();
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
            counts.groups.fetch_add(1, Ordering::Relaxed);
            counts.messages.fetch_add(grouped, Ordering::Relaxed);
            commit_group(shared, jobs, counts);
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
fn commit_group(shared: &Shared, jobs: Vec<Job>, counts: &Outcomes) {
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
                let counted = match outcome {
                    Enqueued::Accepted { .. } => Outcome::Accepted,
                    Enqueued::Duplicate => Outcome::Duplicate,
                    Enqueued::CapacityExceeded => Outcome::Full,
                };
                counts.count(&job.message.source, counted);
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
                counts.count(&job.message.source, Outcome::Failed);
                let _ = job.done.try_send(Err(e.clone()));
            }
        }
    }
}
