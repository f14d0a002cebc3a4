//! What senders hand the committer (`committer.rs`): `Queue`, the jobs waiting for the next
//! group under a mutex and a condition variable, and when a push wakes the committer. The
//! durable state (`durable.rs`) holds it so the log can ask for upkeep; the committer drains it.
//!
//! A sender wakes the committer only when it is needed: the first job while the committer is
//! idle, or the one that completes the group it waits for, and only once a wait.

#[cfg(test)]
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

use super::{Enqueued, NewMessage};
use crate::store::Result;

/// Most enqueues folded into one transaction.
pub const MAX_GROUP: usize = 256;
pub struct Job {
    pub message: NewMessage,
    pub done: smol::channel::Sender<Result<Enqueued>>,
}

/// What a message adds to its group's log record besides its fields: the record's keys, header
/// line and reply reference, generously, so that a group of the smallest messages still fits the
/// smallest log.
const RECORD_OVERHEAD: usize = 512;

impl Job {
    /// The bytes this job adds to its group's log record, at most.
    pub fn bytes(&self) -> usize {
        let m = &self.message;
        m.payload.len() + m.source.len() + m.message_id.len() + RECORD_OVERHEAD
    }
}

/// What senders hand the committer.
pub struct Queue {
    waiting: Mutex<Waiting>,
    pub(super) ready: Condvar,
    #[cfg(test)]
    wakes: AtomicUsize,
}

#[derive(Default)]
pub(super) struct Waiting {
    pub(super) jobs: Vec<Job>,
    pub(super) bytes: usize,
    /// How many queued jobs make the committer want to be woken; 0 while it is busy.
    pub(super) want: usize,
    /// The log asks for upkeep (a checkpoint, or held records to write in time).
    pub(super) upkeep: bool,
    /// The outbox is being dropped: commit what is queued, checkpoint and exit.
    pub(super) stop: bool,
    /// A group stops growing at this many bytes of its jobs (`Job::bytes`, `Policy::group_bytes`).
    pub(super) group_bytes: usize,
}

impl Waiting {
    pub(super) fn full(&self) -> bool {
        self.jobs.len() >= MAX_GROUP || self.bytes >= self.group_bytes
    }
}

impl Queue {
    /// A queue whose groups stop growing at `group_bytes` (`Job::bytes`).
    pub fn new(group_bytes: usize) -> Queue {
        Queue {
            waiting: Mutex::new(Waiting {
                group_bytes,
                ..Waiting::default()
            }),
            ready: Condvar::new(),
            #[cfg(test)]
            wakes: AtomicUsize::new(0),
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a job; false once the committer has stopped.
    pub fn push(&self, job: Job) -> bool {
        let mut w = self.lock();
        if w.stop {
            return false;
        }
        w.bytes += job.bytes();
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn a_group_of_tiny_messages_is_bounded_by_their_records_not_their_payloads() {
        // The smallest log's groups (a policy's eighth of 128 KiB): tiny payloads, whole records.
        let q = Queue::new((crate::outbox::wal::MIN_LOG_BYTES / 8) as usize);
        let mut n = 0;
        while !q.lock().full() {
            assert!(q.push(job(&format!("m{n}"))));
            n += 1;
        }
        assert!(n < MAX_GROUP, "full after {n} jobs, before the count cap");
        assert!(
            q.lock().bytes >= n * RECORD_OVERHEAD,
            "each counted with its record's overhead"
        );
    }

    #[test]
    fn only_the_push_the_committer_waits_for_wakes_it_and_only_once() {
        let q = Queue::new(1 << 20);
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
