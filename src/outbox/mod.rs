//! The durable outbox: per-source FIFO of accepted inbound messages with TTL, caps, dedupe and
//! counters (IM profile v1 sections 7 and 8). It owns its tables (`messages`, `delivered`,
//! `counters`, `reply_refs`, in `tx.rs`), its capacity policy, its write-ahead log
//! (`wal.rs`, `durable.rs`) and the committer thread.
//!
//! A *source* is where messages come from (`webhook:NAME`); the channel bound to a source
//! receives its queue, so per-source is per-channel. Messages accepted before any binding wait
//! here under the same TTL and caps.
//!
//! Invariants:
//! - A message is accepted (and its sender told so) only once the log record that stores it is
//!   on the disk. Enqueues from every thread and task go through one committer thread that
//!   groups whatever is waiting into one transaction and one log append (group commit): one
//!   `fdatasync` for many senders. A sender waits on its `Ticket`, blocking (`wait`) or as a
//!   future (`outcome`), so a waiting sender costs no thread on the async side.
//! - Every change to the outbox's tables goes through `Shared::write` (durable.rs), which logs
//!   it; the committer also runs the checkpoints that recycle the log.
//! - `expires_at = accepted_at + ttl` is written once, at acceptance, and never changed.
//! - A message leaves the queue in exactly three ways, each counted and logged: delivered (the
//!   profile's delivery boundary was reached), expired, or evicted (`capacity_exceeded`).
//!   Expired and evicted messages take their reply reference with them.
//! - The in-memory `Index` (pending counts, bytes, known IDs) mirrors the tables: every writer
//!   holds its lock across its transaction and changes both together; a failed commit rebuilds
//!   it from disk. Bytes are stored record sizes (key + value).
//! - Dedupe: an ID is answered `duplicate` while its message is pending and, once delivered,
//!   until its `expires_at`, for at most `Policy::delivered_cap` delivered IDs per source. The
//!   delivered IDs are kept in `DELIVERED`, written in sequence at delivery, so the state is
//!   bounded on disk and in memory and survives restarts.

mod durable;
mod index;
mod record;
mod tx;
pub mod wal;

use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use miniserde::{Deserialize, Serialize};
use redb::ReadableTable;

pub use self::durable::LogReport;
use self::durable::Shared;
use self::index::{Index, Place};
pub use self::record::{Header, StoredMessage};
use self::tx::{Tx, COUNTERS, MESSAGES, REPLY_REFS};
use crate::config::Overflow;
use crate::store::{self, Db, Result, StoreError};

/// Most enqueues folded into one transaction.
const MAX_GROUP: usize = 256;
/// A group stops growing at this many payload bytes, so its log record stays well inside the log.
const MAX_GROUP_BYTES: usize = (wal::LOG_BYTES / 8) as usize;
/// The committer never waits longer than this for a group to fill.
const LINGER: Duration = Duration::from_millis(4);

/// What is persisted per source besides the messages.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
struct Tally {
    delivered: u64,
    expired: u64,
    evicted: u64,
    attempts: u64,
    last_error: Option<String>,
    /// Messages xAgent refused for good (IM profile v2); optional, so older records still read.
    failed: Option<u64>,
    /// The last of them: `message_id: code: message`.
    last_failure: Option<String>,
}

/// Per-source figures for `/status` and `/metrics`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Counters {
    pub pending: u64,
    pub pending_bytes: u64,
    pub delivered: u64,
    pub expired: u64,
    pub evicted: u64,
    pub attempts: u64,
    pub last_error: Option<String>,
    /// Refused for good by xAgent (v2 `rejected`, not retryable): never retried.
    pub failed: u64,
    pub last_failure: Option<String>,
}

/// The capacity policy, from `[queue]`.
#[derive(Clone, Copy, Debug)]
pub struct Policy {
    pub max_messages_per_channel: u64,
    pub max_bytes_per_channel: u64,
    pub max_bytes_total: u64,
    pub overflow: Overflow,
}

impl Policy {
    /// Delivered IDs remembered per source for dedupe.
    pub fn delivered_cap(&self) -> usize {
        (self.max_messages_per_channel.saturating_mul(4)).clamp(1000, 100_000) as usize
    }
}

/// What an enqueue did.
#[derive(Debug, PartialEq)]
pub enum Enqueued {
    Accepted {
        expires_at: u64,
        evicted: u64,
    },
    Duplicate,
    /// `reject_new` with full caps, or a message that cannot fit at all: nothing stored.
    CapacityExceeded,
}

/// A pending message as delivery sees it.
#[derive(Debug, Clone)]
pub struct Pending {
    pub seq: u64,
    pub message: StoredMessage,
}

/// Which message a reply reference answers, and until when it may be used.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct ReplyRef {
    pub source: String,
    pub message_id: String,
    pub expires_at: u64,
}

/// A message to accept.
pub struct NewMessage {
    pub source: String,
    pub message_id: String,
    pub payload: String,
    pub reply_ref: Option<(String, ReplyRef)>,
    pub accepted_at: u64,
    pub expires_at: u64,
    /// A provider's consumer cursors (`meta` entries) moved in the same transaction, accepted
    /// or duplicate: a crash can then neither skip the message nor accept it twice.
    pub cursors: Vec<Cursor>,
}

/// A provider's position in its IM system's stream, kept in `meta`.
#[derive(Clone, Debug, PartialEq)]
pub enum Cursor {
    /// A number that only moves forward (Telegram's update offset).
    Forward(String, u64),
    /// A value replaced by the newest (WeChat's opaque sync buffer, a conversation's latest
    /// context token).
    Set(String, String),
}

struct Job {
    message: NewMessage,
    done: smol::channel::Sender<Result<Enqueued>>,
}

/// What the committer thread is told. Nearly every item is a job, so the small variants'
/// wasted space costs nothing that boxing each job would not cost more.
#[allow(clippy::large_enum_variant)]
enum Work {
    Enqueue(Job),
    /// The log got its first record since a checkpoint, or is full enough for one.
    Wake,
    /// Checkpoint and exit (the outbox is being dropped).
    Stop,
}

/// The answer to one enqueue, once its group has committed.
pub struct Ticket(std::result::Result<smol::channel::Receiver<Result<Enqueued>>, StoreError>);

fn stopped() -> StoreError {
    StoreError::Internal("the outbox committer stopped".into())
}

impl Ticket {
    /// Blocks the calling thread until the commit.
    pub fn wait(self) -> Result<Enqueued> {
        self.0?.recv_blocking().map_err(|_| stopped())?
    }

    /// Waits for the commit as a future: no thread is held while the group commits.
    pub async fn outcome(self) -> Result<Enqueued> {
        self.0?.recv().await.map_err(|_| stopped())?
    }
}

/// Called after a commit with every source that got a new message (the data plane wakes the
/// session holding its channel).
type AcceptHook = Box<dyn Fn(&str) + Send + Sync>;

pub struct Outbox {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Group commits made and messages they carried, for `/metrics`.
    stats: Arc<(AtomicUsize, AtomicUsize)>,
}

/// Dropping the outbox stops the committer, which checkpoints, and waits for it, so the
/// database closes with the log applied.
impl Drop for Outbox {
    fn drop(&mut self) {
        let _ = self.shared.work.send(Work::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How long, and for how many senders, the committer waits before it commits a group.
///
/// Waiting pays only while senders are still arriving, one after the other, as the answers to
/// the last group go out: each one caught saves an fsync and a log page. So the committer waits
/// for as many as the last group had, for at most one commit's time; and once that many are
/// in, it waits on only while the next one comes within twice the gap between the ones it
/// caught. Senders already queued are taken without waiting; a lone sender never waits.
struct Batcher {
    /// The last group's size.
    target: usize,
    last_commit: Duration,
}

impl Batcher {
    fn new() -> Batcher {
        Batcher {
            target: 1,
            last_commit: Duration::from_micros(500),
        }
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.last_commit.min(LINGER)
    }
}

/// One group being gathered: when it must be committed, and how arrivals have been spaced.
struct Gathering {
    started: Instant,
    deadline: Instant,
    caught: u32,
    last_arrival: Instant,
}

impl Gathering {
    /// How long to wait for the next sender with `size` in the group; zero: commit now.
    fn wait(&self, size: usize, target: usize) -> Duration {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if size < target {
            return left;
        }
        if self.caught == 0 {
            return Duration::ZERO;
        }
        let gap = self.last_arrival.duration_since(self.started) / self.caught;
        (2 * gap).saturating_sub(self.last_arrival.elapsed()).min(left)
    }
}

/// The committer: gathers a group, commits it, and checkpoints when one is due.
fn run_committer(shared: &Shared, rx: &mpsc::Receiver<Work>, counted: &(AtomicUsize, AtomicUsize)) {
    let mut batch = Batcher::new();
    loop {
        // Asleep until work arrives, or until the log's oldest record needs a checkpoint.
        let next = match shared.checkpoint_due() {
            None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
            Some(wait) => rx.recv_timeout(wait),
        };
        let first = match next {
            Ok(Work::Enqueue(job)) => job,
            Ok(Work::Wake) | Err(mpsc::RecvTimeoutError::Timeout) => {
                if shared.checkpoint_due() == Some(Duration::ZERO) {
                    shared.checkpoint();
                }
                continue;
            }
            Ok(Work::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let mut jobs = vec![first];
        let mut bytes = jobs[0].message.payload.len();
        let mut stop = false;
        let now = Instant::now();
        let mut g = Gathering {
            started: now,
            deadline: batch.deadline(),
            caught: 0,
            last_arrival: now,
        };
        while jobs.len() < MAX_GROUP && bytes < MAX_GROUP_BYTES && !stop {
            let (next, waited) = match rx.try_recv() {
                Ok(w) => (Ok(w), false),
                Err(mpsc::TryRecvError::Disconnected) => break,
                Err(mpsc::TryRecvError::Empty) => {
                    let wait = g.wait(jobs.len(), batch.target);
                    if wait.is_zero() {
                        break;
                    }
                    (rx.recv_timeout(wait), true)
                }
            };
            match next {
                Ok(Work::Enqueue(j)) => {
                    bytes += j.message.payload.len();
                    jobs.push(j);
                    if waited {
                        g.caught += 1;
                        g.last_arrival = Instant::now();
                    }
                }
                Ok(Work::Wake) => {}
                Ok(Work::Stop) => stop = true,
                Err(_) => break,
            }
        }
        batch.target = jobs.len();
        let started = Instant::now();
        counted.0.fetch_add(1, AtomicOrdering::Relaxed);
        counted.1.fetch_add(jobs.len(), AtomicOrdering::Relaxed);
        commit_group(shared, jobs);
        batch.last_commit = started.elapsed();
        if stop {
            break;
        }
        if shared.checkpoint_due() == Some(Duration::ZERO) {
            shared.checkpoint();
        }
    }
    // Clean shutdown: the log is applied to redb durably, so the next start replays nothing.
    shared.checkpoint();
}

impl Outbox {
    /// Creates the tables, replays the log of the last run, loads the index and starts the
    /// committer thread.
    pub fn open(db: Arc<Db>, policy: Policy) -> Result<Outbox> {
        db.write(durable::create_tables)?;
        let (work, rx) = mpsc::channel::<Work>();
        let shared = Arc::new(Shared::open(db, policy, work)?);
        let stats = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
        let (counted, group_shared) = (stats.clone(), shared.clone());
        let thread = std::thread::Builder::new()
            .name("outbox-commit".into())
            .spawn(move || run_committer(&group_shared, &rx, &counted))
            .map_err(|e| StoreError::Internal(format!("cannot start the outbox committer: {e}")))?;
        Ok(Outbox {
            shared,
            thread: Some(thread),
            stats,
        })
    }

    /// Sets the function told about sources with new messages (once, by the data plane).
    pub fn on_accepted(&self, hook: impl Fn(&str) + Send + Sync + 'static) {
        let _ = self.shared.on_accept.set(Box::new(hook));
    }

    /// After a disk that was full, read-only or failing: reopens the database if an I/O error
    /// asked for it and replays the log into it, or starts a failed log again.
    pub fn recover(&self) {
        self.shared.recover();
    }

    /// Whether `recover` still has work to do (maintenance then calls it every second).
    pub fn needs_recovery(&self) -> bool {
        self.shared.needs_recovery()
    }

    /// `(group commits, messages carried)` since start.
    pub fn commit_stats(&self) -> (u64, u64) {
        (
            self.stats.0.load(AtomicOrdering::Relaxed) as u64,
            self.stats.1.load(AtomicOrdering::Relaxed) as u64,
        )
    }

    /// Replays, checkpoints and unreadable log records since start.
    pub fn log_report(&self) -> LogReport {
        self.shared.report()
    }

    /// Hands a message to the committer; the ticket tells when (and how) it was committed.
    pub fn submit(&self, message: NewMessage) -> Ticket {
        let (done, result) = smol::channel::bounded(1);
        match self.shared.work.send(Work::Enqueue(Job { message, done })) {
            Ok(()) => Ticket(Ok(result)),
            Err(_) => Ticket(Err(stopped())),
        }
    }

    /// Accepts a message durably (returns once it is on the disk), answers `Duplicate`, or
    /// `CapacityExceeded` with nothing stored.
    #[cfg(test)]
    pub fn enqueue(&self, message: NewMessage) -> Result<Enqueued> {
        self.submit(message).wait()
    }

    /// Up to `limit` unexpired pending messages of `source`, oldest first.
    pub fn pending(&self, source: &str, limit: usize, now: u64) -> Result<Vec<Pending>> {
        self.shared.db.read(|txn| {
            let mut out = Vec::new();
            for row in txn.open_table(MESSAGES)?.range((source, 0)..=(source, u64::MAX))? {
                let (k, v) = row?;
                let Some(message) = record::decode(v.value()) else {
                    continue;
                };
                // Expired messages are skipped here and removed by the next sweep: never delivered.
                if message.header.expires_at <= now {
                    continue;
                }
                out.push(Pending {
                    seq: k.value().1,
                    message,
                });
                if out.len() >= limit {
                    break;
                }
            }
            Ok(out)
        })
    }

    /// The delivery boundary was reached for these messages: move them from the queue to the
    /// delivered log in one commit.
    pub fn mark_delivered(&self, source: &str, seqs: &[u64]) -> Result<u64> {
        self.finish(source, seqs, None)
    }

    /// xAgent refused a message for good (v2 `rejected`, not retryable): it leaves the queue
    /// like a delivered one (its ID stays a duplicate), counted `failed` with its reason.
    pub fn mark_failed(&self, source: &str, seq: u64, code: &str, message: &str) -> Result<u64> {
        self.finish(source, &[seq], Some((code, message)))
    }

    fn finish(&self, source: &str, seqs: &[u64], failure: Option<(&str, &str)>) -> Result<u64> {
        let cap = self.shared.policy.delivered_cap();
        self.shared.write(false, |tx, idx| {
            let (mut n, mut last_id) = (0, String::new());
            for &seq in seqs {
                let Some(value) = tx.remove_message(source, seq)? else {
                    continue;
                };
                let Some(h) = record::header(&value) else { continue };
                last_id.clone_from(&h.message_id);
                tx.put_delivered(
                    source,
                    seq,
                    &record::delivered_entry(h.expires_at, h.reply_ref.as_deref(), &h.message_id),
                )?;
                let hash = idx.hash(&h.message_id);
                idx.source(source)
                    .deliver(seq, hash, h.expires_at, record::bytes(source, &value));
                n += 1;
            }
            let si = idx.source(source);
            while si.delivered_len() > cap {
                if let Some(seq) = si.pop_delivered() {
                    forget_delivered(tx, source, seq)?;
                }
            }
            tally(tx, source, |t| match failure {
                None => t.delivered += n,
                Some((code, message)) => {
                    t.failed = Some(t.failed.unwrap_or(0) + n);
                    t.last_failure = Some(format!("{last_id}: {code}: {message}"));
                }
            })?;
            Ok(n)
        })
    }

    /// The connection failed before the boundary: the messages stay pending, `attempts + 1`.
    pub fn mark_attempt_failed(&self, source: &str, seqs: &[u64], error: &str) -> Result<()> {
        self.shared.write(false, |tx, idx| {
            let (mut n, mut delta) = (0u64, 0i64);
            for &seq in seqs {
                let old = tx.messages.get((source, seq))?.map(|v| v.value().to_string());
                let Some(mut m) = old.as_deref().and_then(record::decode) else {
                    continue;
                };
                m.header.attempts += 1;
                let new = record::encode(&m.header, &m.payload);
                delta += new.len() as i64 - old.map_or(0, |o| o.len()) as i64;
                tx.put_message(source, seq, &new)?;
                n += 1;
            }
            idx.source(source).adjust_bytes(delta);
            tally(tx, source, |t| {
                t.attempts += n;
                t.last_error = Some(error.to_string());
            })
        })
    }

    /// Removes expired messages and delivered-log entries; returns messages expired.
    ///
    /// Each source is a FIFO with one TTL, so its expired messages are its oldest: the sweep
    /// reads only the heads and stays cheap with a large backlog. (A message that expires
    /// before an older one, after the TTL was lowered, is skipped by every read and removed
    /// once it reaches the head.)
    pub fn sweep_expired(&self, now: u64) -> Result<u64> {
        self.shared.write(false, |tx, idx| {
            let sources: Vec<String> = idx.sources.keys().cloned().collect();
            let mut n = 0;
            for src in &sources {
                n += expire_head(tx, idx, src, now)?;
            }
            for (src, si) in idx.sources.iter_mut() {
                while si.oldest_delivered_expiry().is_some_and(|exp| exp <= now) {
                    if let Some(seq) = si.pop_delivered() {
                        forget_delivered(tx, src, seq)?;
                    }
                }
            }
            Ok(n)
        })
    }

    /// Drops reply references past their expiry that nothing removed with their message;
    /// returns how many went.
    pub fn sweep_reply_refs(&self, now: u64) -> Result<u64> {
        self.shared.write(false, |tx, _| {
            let mut gone = Vec::new();
            for row in tx.reply_refs.iter()? {
                let (k, v) = row?;
                if !miniserde::json::from_str::<ReplyRef>(v.value()).is_ok_and(|r| r.expires_at > now) {
                    gone.push(k.value().to_string());
                }
            }
            for token in &gone {
                tx.remove_reply_ref(token)?;
            }
            Ok(gone.len() as u64)
        })
    }

    /// The message a reply reference answers, while it may be used.
    pub fn reply_ref(&self, token: &str) -> Result<Option<ReplyRef>> {
        self.shared.db.read(|txn| {
            let Some(v) = txn.open_table(REPLY_REFS)?.get(token)? else {
                return Ok(None);
            };
            let r: ReplyRef = miniserde::json::from_str(v.value()).map_err(|_| store::corrupt("reply reference"))?;
            Ok(Some(r))
        })
    }

    /// Counts messages that expired before acceptance (a provider's backlog older than the TTL).
    pub fn record_expired(&self, source: &str, n: u64) -> Result<()> {
        self.shared.write(false, |tx, _| tally(tx, source, |t| t.expired += n))
    }

    /// Figures of every source that has any.
    pub fn stats(&self) -> Result<Vec<(String, Counters)>> {
        let mut out: Vec<(String, Counters)> = self.shared.db.read(|txn| {
            let mut out = Vec::new();
            for row in txn.open_table(COUNTERS)?.iter()? {
                let (k, v) = row?;
                let t: Tally = miniserde::json::from_str(v.value()).map_err(|_| store::corrupt("outbox counters"))?;
                let c = Counters {
                    delivered: t.delivered,
                    expired: t.expired,
                    evicted: t.evicted,
                    attempts: t.attempts,
                    last_error: t.last_error,
                    failed: t.failed.unwrap_or(0),
                    last_failure: t.last_failure,
                    ..Default::default()
                };
                out.push((k.value().to_string(), c));
            }
            Ok(out)
        })?;
        let st = self.shared.lock();
        for (src, si) in &st.index.sources {
            let i = match out.iter().position(|(s, _)| s == src) {
                Some(i) => i,
                None => {
                    out.push((src.clone(), Counters::default()));
                    out.len() - 1
                }
            };
            out[i].1.pending = si.pending;
            out[i].1.pending_bytes = si.pending_bytes;
        }
        Ok(out)
    }

    /// Bytes of pending messages over all sources, as of the last change; takes no lock, so
    /// the executor may ask.
    pub fn total_bytes(&self) -> u64 {
        self.shared.pending_bytes()
    }
}

/// Reads the bytes of an outbox log as a replay does, applying nothing: what the scan found,
/// and how many of its records hold changes that parse (the fuzz target's entry point).
pub fn read_log(bytes: &[u8]) -> (wal::Scanned, u64) {
    let mut parsed = 0;
    let scanned = wal::scan(&mut &bytes[..], wal::LOG_BYTES, |_, payload| {
        parsed += u64::from(tx::parse(payload).is_ok());
        Ok::<_, ()>(())
    });
    (scanned.unwrap_or_default(), parsed)
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

/// The enqueue rules of one message inside a (group) transaction.
fn enqueue_in(tx: &mut Tx, idx: &mut Index, m: &NewMessage, policy: Policy) -> Result<Enqueued> {
    let outcome = enqueue_message(tx, idx, m, policy)?;
    if outcome == Enqueued::CapacityExceeded {
        return Ok(outcome);
    }
    for cursor in &m.cursors {
        match cursor {
            Cursor::Forward(key, value) => {
                let current = store::parse_u64(key, tx.meta(key)?)?.unwrap_or(0);
                if *value > current {
                    tx.set_meta(key, &value.to_string())?;
                }
            }
            Cursor::Set(key, value) => tx.set_meta(key, value)?,
        }
    }
    Ok(outcome)
}

/// A full queue refuses or evicts at the senders' rate: one line a minute per source, with
/// the count of the others (evictions are counted in `/status`; each refusal is the sender's
/// answer).
fn caps_warning(idx: &mut Index, src: &str, line: impl FnOnce() -> String) {
    if let Some(more) = idx.source(src).caps_log.admit() {
        log::warn!("outbox: {src}: {}{more}", line());
    }
}

fn enqueue_message(tx: &mut Tx, idx: &mut Index, m: &NewMessage, policy: Policy) -> Result<Enqueued> {
    let (src, now) = (m.source.as_str(), m.accepted_at);
    let hash = idx.hash(&m.message_id);
    if let Some(place) = idx.source(src).lookup(hash, now) {
        if stored_id(tx, src, place)?.as_deref() == Some(m.message_id.as_str()) {
            return Ok(Enqueued::Duplicate);
        }
        log::warn!(
            "outbox: {src}: message {} shares an ID hash with another; accepted",
            m.message_id
        );
    }
    // Expiry at enqueue: this source's expired head goes first (FIFO with one TTL means the
    // expired messages are the oldest ones).
    expire_head(tx, idx, src, now)?;

    let header = Header {
        message_id: m.message_id.clone(),
        accepted_at: m.accepted_at,
        expires_at: m.expires_at,
        attempts: 0,
        reply_ref: m.reply_ref.as_ref().map(|(t, _)| t.clone()),
    };
    let value = record::encode(&header, &m.payload);
    let size = record::bytes(src, &value);
    if size > policy.max_bytes_per_channel || size > policy.max_bytes_total {
        caps_warning(idx, src, || {
            format!(
                "message {} of {size} bytes can never fit the caps; refused",
                m.message_id
            )
        });
        return Ok(Enqueued::CapacityExceeded);
    }
    let fits = |idx: &mut Index| {
        let total = idx.total_bytes();
        let si = idx.source(src);
        si.pending < policy.max_messages_per_channel
            && si.pending_bytes + size <= policy.max_bytes_per_channel
            && total + size <= policy.max_bytes_total
    };
    if !fits(idx) && idx.total_bytes() + size > policy.max_bytes_total {
        // Over the global cap: first reclaim expired messages everywhere.
        expire_all(tx, idx, now)?;
    }
    let mut evicted = 0;
    if !fits(idx) {
        if policy.overflow == Overflow::RejectNew {
            caps_warning(idx, src, || {
                format!("caps full, overflow = reject_new: message {} refused", m.message_id)
            });
            return Ok(Enqueued::CapacityExceeded);
        }
        // drop_oldest: evict this source's oldest pending messages until the new one fits.
        while !fits(idx) {
            let head = tx
                .messages
                .range((src, 0)..=(src, u64::MAX))?
                .next()
                .transpose()?
                .map(|(k, v)| (k.value().1, v.value().to_string()));
            let Some((seq, old)) = head else { break };
            remove_message(tx, idx, src, seq, &old)?;
            evicted += 1;
        }
        if evicted > 0 {
            tally(tx, src, |t| t.evicted += evicted)?;
            caps_warning(idx, src, || {
                format!(
                    "evicted {evicted} oldest pending message(s) for message {}: capacity_exceeded",
                    m.message_id
                )
            });
        }
        if !fits(idx) {
            // This source is empty and the others fill the global cap.
            caps_warning(idx, src, || {
                format!(
                    "max_bytes_total reached by other channels: message {} refused",
                    m.message_id
                )
            });
            return Ok(Enqueued::CapacityExceeded);
        }
    }

    let si = idx.source(src);
    let seq = si.next_seq;
    tx.put_message(src, seq, &value)?;
    if let Some((token, r)) = &m.reply_ref {
        tx.put_reply_ref(token, &miniserde::json::to_string(r))?;
    }
    si.add_pending(seq, hash, m.expires_at, size);
    Ok(Enqueued::Accepted {
        expires_at: m.expires_at,
        evicted,
    })
}

/// Removes one pending message that leaves undelivered, with its reply reference.
fn remove_message(tx: &mut Tx, idx: &mut Index, src: &str, seq: u64, value: &str) -> Result<()> {
    tx.remove_message(src, seq)?;
    let header = record::header(value);
    if let Some(t) = header.as_ref().and_then(|h| h.reply_ref.as_deref()) {
        tx.remove_reply_ref(t)?;
    }
    let hash = idx.hash(&header.map(|h| h.message_id).unwrap_or_default());
    idx.source(src).drop_pending(seq, hash, record::bytes(src, value));
    Ok(())
}

/// Removes a delivered-log entry and the reply reference it carried: both end together, so
/// reply references are bounded like the log.
fn forget_delivered(tx: &mut Tx, src: &str, seq: u64) -> Result<()> {
    let entry = tx.remove_delivered(src, seq)?;
    if let Some(token) = entry
        .as_deref()
        .and_then(record::parse_delivered)
        .and_then(|(_, t, _)| t)
    {
        tx.remove_reply_ref(token)?;
    }
    Ok(())
}

/// The message ID stored at `place`, to confirm an index hit.
fn stored_id(tx: &Tx, src: &str, place: Place) -> Result<Option<String>> {
    Ok(match place {
        Place::Pending(seq) => tx
            .messages
            .get((src, seq))?
            .and_then(|v| record::header(v.value()))
            .map(|h| h.message_id),
        Place::Delivered(seq) => tx
            .delivered
            .get((src, seq))?
            .and_then(|v| record::parse_delivered(v.value()).map(|(_, _, id)| id.to_string())),
    })
}

/// Removes the expired messages at the head of one source.
fn expire_head(tx: &mut Tx, idx: &mut Index, src: &str, now: u64) -> Result<u64> {
    let mut gone = Vec::new();
    for row in tx.messages.range((src, 0)..=(src, u64::MAX))? {
        let (k, v) = row?;
        match record::header(v.value()) {
            Some(h) if h.expires_at <= now => gone.push((src.to_string(), k.value().1, v.value().to_string())),
            _ => break,
        }
    }
    remove_expired(tx, idx, gone)
}

/// Removes every expired message of every source.
fn expire_all(tx: &mut Tx, idx: &mut Index, now: u64) -> Result<u64> {
    let mut gone = Vec::new();
    for row in tx.messages.iter()? {
        let (k, v) = row?;
        let (src, seq) = k.value();
        if record::header(v.value()).is_some_and(|h| h.expires_at <= now) {
            gone.push((src.to_string(), seq, v.value().to_string()));
        }
    }
    remove_expired(tx, idx, gone)
}

/// Removes expired messages, given as `(source, seq, value)` grouped by source.
fn remove_expired(tx: &mut Tx, idx: &mut Index, gone: Vec<(String, u64, String)>) -> Result<u64> {
    let total = gone.len() as u64;
    let mut i = 0;
    while i < gone.len() {
        let src = gone[i].0.clone();
        let mut n = 0;
        while i < gone.len() && gone[i].0 == src {
            remove_message(tx, idx, &src, gone[i].1, &gone[i].2)?;
            n += 1;
            i += 1;
        }
        tally(tx, &src, |t| t.expired += n)?;
        if let Some(more) = idx.source(&src).expiry_log.admit() {
            log::warn!("outbox: {src}: {n} message(s) expired undelivered{more}");
        }
    }
    Ok(total)
}

fn tally(tx: &mut Tx, src: &str, f: impl FnOnce(&mut Tally)) -> Result<()> {
    let mut c: Tally = tx
        .counters
        .get(src)?
        .and_then(|v| miniserde::json::from_str(v.value()).ok())
        .unwrap_or_default();
    f(&mut c);
    tx.put_counter(src, &miniserde::json::to_string(&c))
}

#[cfg(test)]
mod tests {
    use super::tx::DELIVERED;
    use super::*;
    use redb::ReadableTableMetadata;

    fn store() -> Outbox {
        store_with(ROOMY)
    }

    fn store_with(p: Policy) -> Outbox {
        Outbox::open(store::temp_db("outbox").0, p).unwrap()
    }

    const ROOMY: Policy = Policy {
        max_messages_per_channel: 1000,
        max_bytes_per_channel: 1 << 20,
        max_bytes_total: 1 << 22,
        overflow: Overflow::DropOldest,
    };

    fn msg(id: &str, now: u64, ttl: u64) -> NewMessage {
        msg_in("hook:a", id, now, ttl)
    }

    fn msg_in(src: &str, id: &str, now: u64, ttl: u64) -> NewMessage {
        NewMessage {
            source: src.to_string(),
            message_id: id.to_string(),
            payload: format!("{{\"message_id\":\"{id}\"}}"),
            reply_ref: Some((
                format!("rr_{id}"),
                ReplyRef {
                    source: src.to_string(),
                    message_id: id.to_string(),
                    expires_at: now + 2 * ttl,
                },
            )),
            accepted_at: now,
            expires_at: now + ttl,
            cursors: Vec::new(),
        }
    }

    fn accepted(r: Result<Enqueued>) -> bool {
        matches!(r, Ok(Enqueued::Accepted { .. }))
    }

    fn ids_of(s: &Outbox, src: &str, now: u64) -> Vec<String> {
        s.pending(src, 1000, now)
            .unwrap()
            .into_iter()
            .map(|p| p.message.header.message_id)
            .collect()
    }

    fn counters(s: &Outbox, src: &str) -> Counters {
        s.stats()
            .unwrap()
            .into_iter()
            .find(|(k, _)| k == src)
            .map(|(_, c)| c)
            .unwrap_or_default()
    }

    /// The index must always agree with what the table holds.
    fn assert_accounting(s: &Outbox) {
        let mut per: std::collections::BTreeMap<String, (u64, u64)> = Default::default();
        let mut total = 0;
        s.shared
            .db
            .read(|txn| {
                for row in txn.open_table(MESSAGES)?.iter()? {
                    let (k, v) = row?;
                    let b = record::bytes(k.value().0, v.value());
                    let e = per.entry(k.value().0.to_string()).or_default();
                    e.0 += 1;
                    e.1 += b;
                    total += b;
                }
                Ok(())
            })
            .unwrap();
        for (src, c) in s.stats().unwrap() {
            let (n, b) = per.get(&src).copied().unwrap_or_default();
            assert_eq!((c.pending, c.pending_bytes), (n, b), "counters of {src}");
        }
        assert_eq!(s.total_bytes(), total);
    }

    #[test]
    fn messages_come_out_in_acceptance_order_and_leave_only_when_delivered() {
        let s = store();
        for id in ["m1", "m2", "m3"] {
            assert!(accepted(s.enqueue(msg(id, 1000, 60_000))));
        }
        let p = s.pending("hook:a", 10, 1000).unwrap();
        assert_eq!(ids_of(&s, "hook:a", 1000), ["m1", "m2", "m3"]);
        s.mark_attempt_failed("hook:a", &[p[0].seq], "disconnected").unwrap();
        s.mark_delivered("hook:a", &[p[1].seq]).unwrap();
        let p = s.pending("hook:a", 10, 1000).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].message.header.attempts, 1);
        assert_eq!(
            p[0].message.header.expires_at, 61_000,
            "a failed attempt never moves expires_at"
        );
        let c = counters(&s, "hook:a");
        assert_eq!(
            (c.delivered, c.attempts, c.last_error.as_deref()),
            (1, 1, Some("disconnected"))
        );
        assert_accounting(&s);
    }

    #[test]
    fn a_message_refused_for_good_leaves_counted_failed_and_stays_a_duplicate() {
        let s = store();
        s.enqueue(msg("m1", 1000, 60_000)).unwrap();
        s.enqueue(msg("m2", 1000, 60_000)).unwrap();
        let p = s.pending("hook:a", 10, 1000).unwrap();
        s.mark_failed("hook:a", p[0].seq, "invalid_content", "no").unwrap();
        assert_eq!(ids_of(&s, "hook:a", 1000), ["m2"]);
        let c = counters(&s, "hook:a");
        assert_eq!((c.failed, c.delivered), (1, 0));
        assert_eq!(c.last_failure.as_deref(), Some("m1: invalid_content: no"));
        assert_eq!(s.enqueue(msg("m1", 2000, 60_000)).unwrap(), Enqueued::Duplicate);
        assert_accounting(&s);
        // Counters written before `failed` existed still read.
        let old: Tally =
            miniserde::json::from_str(r#"{"delivered":1,"expired":0,"evicted":0,"attempts":2,"last_error":null}"#)
                .unwrap();
        assert_eq!((old.failed, old.attempts), (None, 2));
    }

    #[test]
    fn a_repeated_message_id_is_a_duplicate_even_after_delivery_until_its_ttl() {
        let s = store();
        s.enqueue(msg("m1", 1000, 60_000)).unwrap();
        assert_eq!(
            s.enqueue(msg("m1", 1500, 60_000)).unwrap(),
            Enqueued::Duplicate,
            "while pending"
        );
        let p = s.pending("hook:a", 10, 1000).unwrap();
        s.mark_delivered("hook:a", &[p[0].seq]).unwrap();
        assert_eq!(
            s.enqueue(msg("m1", 2000, 60_000)).unwrap(),
            Enqueued::Duplicate,
            "after delivery"
        );
        assert!(s.pending("hook:a", 10, 2000).unwrap().is_empty());
        // After the TTL the dedupe entry is gone and the ID is new again.
        s.sweep_expired(62_000).unwrap();
        assert!(accepted(s.enqueue(msg("m1", 62_000, 60_000))));
    }

    #[test]
    fn expired_messages_are_never_pending_and_the_sweep_counts_them_and_drops_their_reply_refs() {
        let s = store();
        s.enqueue(msg("old", 1000, 10)).unwrap();
        s.enqueue(msg("new", 1000, 60_000)).unwrap();
        assert_eq!(ids_of(&s, "hook:a", 2000), ["new"], "expiry on read");
        assert!(s.reply_ref("rr_old").unwrap().is_some());
        assert_eq!(s.sweep_expired(2000).unwrap(), 1);
        assert!(
            s.reply_ref("rr_old").unwrap().is_none(),
            "temporary state goes with the message"
        );
        assert!(s.reply_ref("rr_new").unwrap().is_some());
        let c = counters(&s, "hook:a");
        assert_eq!((c.pending, c.expired), (1, 1));
        assert_accounting(&s);
    }

    #[test]
    fn enqueue_expires_the_head_of_its_source() {
        let s = store();
        s.enqueue(msg("old", 1000, 10)).unwrap();
        s.enqueue(msg("new", 5000, 60_000)).unwrap();
        assert_eq!(counters(&s, "hook:a").expired, 1);
        assert!(s.reply_ref("rr_old").unwrap().is_none());
        assert_accounting(&s);
    }

    #[test]
    fn drop_oldest_evicts_at_the_message_cap() {
        let s = store_with(Policy {
            max_messages_per_channel: 3,
            ..ROOMY
        });
        for i in 0..5 {
            s.enqueue(msg(&format!("m{i}"), 1000, 60_000)).unwrap();
        }
        assert_eq!(ids_of(&s, "hook:a", 1000), ["m2", "m3", "m4"]);
        assert_eq!(counters(&s, "hook:a").evicted, 2);
        assert!(s.reply_ref("rr_m0").unwrap().is_none());
        assert_accounting(&s);
    }

    #[test]
    fn drop_oldest_evicts_at_the_channel_byte_cap() {
        let header = Header {
            message_id: "m0".into(),
            accepted_at: 1000,
            expires_at: 61_000,
            attempts: 0,
            reply_ref: Some("rr_m0".into()),
        };
        let one = record::bytes("hook:a", &record::encode(&header, "{\"message_id\":\"m0\"}"));
        let s = store_with(Policy {
            max_bytes_per_channel: one * 2,
            ..ROOMY
        });
        for i in 0..4 {
            s.enqueue(msg(&format!("m{i}"), 1000, 60_000)).unwrap();
        }
        assert_eq!(ids_of(&s, "hook:a", 1000), ["m2", "m3"]);
        assert_eq!(counters(&s, "hook:a").evicted, 2);
        assert!(counters(&s, "hook:a").pending_bytes <= one * 2);
        assert_accounting(&s);
    }

    #[test]
    fn reject_new_refuses_at_each_cap_and_stores_nothing() {
        let p = Policy {
            max_messages_per_channel: 2,
            overflow: Overflow::RejectNew,
            ..ROOMY
        };
        let (db, _dir) = store::temp_db("outbox");
        let s = Outbox::open(db.clone(), p).unwrap();
        s.enqueue(msg("m0", 1000, 60_000)).unwrap();
        s.enqueue(msg("m1", 1000, 60_000)).unwrap();
        assert_eq!(s.enqueue(msg("m2", 1000, 60_000)).unwrap(), Enqueued::CapacityExceeded);
        assert!(s.reply_ref("rr_m2").unwrap().is_none());
        assert_eq!(ids_of(&s, "hook:a", 1000), ["m0", "m1"]);
        // Not deduped: the sender may retry once there is room.
        drop(s);
        let s = Outbox::open(
            db,
            Policy {
                max_messages_per_channel: 3,
                ..p
            },
        )
        .unwrap();
        assert!(accepted(s.enqueue(msg("m2", 1000, 60_000))));

        let s = store_with(Policy {
            max_bytes_total: 150,
            overflow: Overflow::RejectNew,
            ..ROOMY
        });
        s.enqueue(msg_in("hook:a", "a0", 1000, 60_000)).unwrap();
        assert_eq!(
            s.enqueue(msg_in("hook:b", "b0", 1000, 60_000)).unwrap(),
            Enqueued::CapacityExceeded
        );
        assert_eq!(counters(&s, "hook:a").evicted, 0);
        assert_accounting(&s);
    }

    #[test]
    fn the_total_cap_reclaims_expired_messages_before_it_refuses() {
        let one = {
            let tmp = store();
            tmp.enqueue(msg_in("hook:b", "b0", 1000, 10)).unwrap();
            tmp.total_bytes()
        };
        let s = store_with(Policy {
            max_bytes_total: one + one / 2,
            ..ROOMY
        });
        s.enqueue(msg_in("hook:b", "b0", 1000, 10)).unwrap();
        // b0 expired; a0 needs its room, in another source.
        let r = s.enqueue(msg_in("hook:a", "a0", 5000, 60_000)).unwrap();
        assert!(matches!(r, Enqueued::Accepted { .. }), "{r:?}");
        assert_eq!(counters(&s, "hook:b").expired, 1);
        // With drop_oldest, a full total cap held by another source refuses rather than
        // evicting someone else's messages.
        let r = s.enqueue(msg_in("hook:c", "c0", 5000, 60_000)).unwrap();
        assert_eq!(r, Enqueued::CapacityExceeded);
        assert_accounting(&s);
    }

    #[test]
    fn drop_oldest_at_the_total_cap_evicts_from_the_new_messages_own_source() {
        let one = {
            let tmp = store();
            tmp.enqueue(msg_in("hook:a", "a0", 1000, 60_000)).unwrap();
            tmp.total_bytes()
        };
        let p = Policy {
            max_bytes_total: one * 3 + one / 2,
            ..ROOMY
        };
        let s = store_with(p);
        s.enqueue(msg_in("hook:b", "b0", 1000, 60_000)).unwrap();
        for i in 0..4 {
            assert!(accepted(s.enqueue(msg_in("hook:a", &format!("a{i}"), 1000, 60_000))));
        }
        assert_eq!(ids_of(&s, "hook:a", 1000), ["a2", "a3"]);
        assert_eq!(
            ids_of(&s, "hook:b", 1000),
            ["b0"],
            "another channel's messages are never evicted"
        );
        assert_eq!(counters(&s, "hook:a").evicted, 2);
        assert!(s.total_bytes() <= p.max_bytes_total);
        assert_accounting(&s);
    }

    #[test]
    fn dedupe_state_survives_restart_and_is_bounded_per_source() {
        let p = Policy {
            max_messages_per_channel: 1,
            ..ROOMY
        }; // delivered_cap() = 1000
        let (db, dir) = store::temp_db("outbox");
        let s = Outbox::open(db, p).unwrap();
        for i in 0..1005 {
            s.enqueue(msg(&format!("d{i}"), 1000, 60_000)).unwrap();
            let seqs: Vec<u64> = s.pending("hook:a", 10, 1000).unwrap().iter().map(|p| p.seq).collect();
            s.mark_delivered("hook:a", &seqs).unwrap();
        }
        s.enqueue(msg("pending-one", 1000, 60_000)).unwrap();
        assert!(
            s.reply_ref("rr_d0").unwrap().is_none(),
            "reply refs leave with the trimmed log entry"
        );
        assert!(
            s.reply_ref("rr_d1004").unwrap().is_some(),
            "a delivered message can still be answered"
        );
        drop(s);
        let s = Outbox::open(Db::open(&dir).unwrap(), p).unwrap();
        assert_eq!(
            s.enqueue(msg("d1004", 2000, 60_000)).unwrap(),
            Enqueued::Duplicate,
            "delivered IDs persist"
        );
        assert_eq!(
            s.enqueue(msg("pending-one", 2000, 60_000)).unwrap(),
            Enqueued::Duplicate,
            "pending IDs persist"
        );
        // Only the newest 1000 delivered IDs are kept: the oldest ones are new again.
        assert!(accepted(s.enqueue(msg("d0", 2000, 60_000))));
        let kept = s.shared.db.read(|txn| Ok(txn.open_table(DELIVERED)?.len()?));
        assert_eq!(kept.unwrap(), 1000);
        assert_accounting(&s);
    }

    /// What a process crash at this moment leaves behind: the files as the page cache holds
    /// them (no outbox write runs while they are copied). `cut` truncates the log copy.
    fn crash_copy(s: &Outbox, dir: &std::path::Path, cut: Option<u64>) -> Outbox {
        let to = std::env::temp_dir().join(format!("imgate-crash-{}", crate::ids::random_hex(4)));
        std::fs::create_dir_all(&to).unwrap();
        {
            let _no_writes = s.shared.lock();
            for f in ["imgate.redb", "outbox.log"] {
                std::fs::copy(dir.join(f), to.join(f)).unwrap();
            }
        }
        if let Some(len) = cut {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(to.join("outbox.log"))
                .unwrap();
            f.set_len(len).unwrap();
        }
        Outbox::open(Db::open(&to).unwrap(), s.shared.policy).unwrap()
    }

    /// Fifty accepts (one log record each), two deliveries and a failed attempt, nothing
    /// checkpointed since the start.
    fn logged_history() -> (Outbox, std::path::PathBuf) {
        let (db, dir) = store::temp_db("crash");
        let s = Outbox::open(db, ROOMY).unwrap();
        s.shared.hold_checkpoints();
        for i in 0..50 {
            assert!(accepted(s.enqueue(msg(&format!("m{i:02}"), 1000, 60_000))));
        }
        let p = s.pending("hook:a", 3, 1000).unwrap();
        s.mark_delivered("hook:a", &[p[0].seq, p[1].seq]).unwrap();
        s.mark_attempt_failed("hook:a", &[p[2].seq], "disconnected").unwrap();
        (s, dir)
    }

    #[test]
    fn after_a_crash_the_log_restores_every_accept_delivery_and_count() {
        let (s, dir) = logged_history();
        let r = crash_copy(&s, &dir, None);
        r.shared.hold_checkpoints();
        assert_eq!(r.log_report().replayed, 52, "every record came back from the log");
        assert_eq!(r.log_report().unreadable, 0);
        assert_eq!(ids_of(&r, "hook:a", 1000), ids_of(&s, "hook:a", 1000));
        assert_eq!(counters(&r, "hook:a"), counters(&s, "hook:a"));
        assert_eq!(r.pending("hook:a", 1, 1000).unwrap()[0].message.header.attempts, 1);
        assert_eq!(
            r.enqueue(msg("m00", 2000, 60_000)).unwrap(),
            Enqueued::Duplicate,
            "delivered"
        );
        assert_eq!(
            r.enqueue(msg("m49", 2000, 60_000)).unwrap(),
            Enqueued::Duplicate,
            "pending"
        );
        assert!(r.reply_ref("rr_m01").unwrap().is_some());
        assert_accounting(&r);
        assert!(accepted(r.enqueue(msg("m50", 2000, 60_000))));
        // The replay was a checkpoint: a second crash replays only what came after it.
        let dir_r = r.shared.db.dir().to_path_buf();
        let again = crash_copy(&r, &dir_r, None);
        assert_eq!(again.log_report().replayed, 1, "only the accept made since");
        assert_eq!(ids_of(&again, "hook:a", 1000), ids_of(&r, "hook:a", 1000));
    }

    #[test]
    fn a_checkpoint_is_due_when_the_oldest_record_is_30_s_old_or_the_log_holds_512_kib() {
        let (db, _dir) = store::temp_db("due");
        let s = Outbox::open(db, ROOMY).unwrap();
        assert_eq!(s.shared.checkpoint_due(), None, "an empty log needs no checkpoint");
        assert!(accepted(s.enqueue(msg("a", 1000, 60_000))));
        let due = s.shared.checkpoint_due().expect("a record arms the timer");
        assert!(
            due > Duration::from_secs(25) && due <= Duration::from_secs(30),
            "{due:?}"
        );
        // 8 KB messages: the committer checkpoints by itself once 512 KiB are logged.
        let before = s.log_report().checkpoints;
        let mut sent = 0;
        while s.log_report().checkpoints == before && sent < 200 {
            sent += 1;
            let big = NewMessage {
                payload: "x".repeat(8000),
                ..msg(&format!("b{sent}"), 1000, 60_000)
            };
            assert!(accepted(s.enqueue(big)));
            // The checkpoint runs on the committer thread, after the group that filled the log.
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!((60..=70).contains(&sent), "checkpointed after {sent} messages of 8 KB");
        assert_eq!(s.shared.checkpoint_due(), None, "the log is empty again");
    }

    #[test]
    fn a_torn_log_keeps_exactly_the_whole_records_before_the_tear() {
        let (s, dir) = logged_history();
        let live = ids_of(&s, "hook:a", 1000);
        let full = s.shared.lock().log_used();
        let mut last_kept = 0;
        for cut in [0, 1, 15, 16, 17, full / 3, full / 2, full - 5, full - 1] {
            let r = crash_copy(&s, &dir, Some(cut));
            let ids = ids_of(&r, "hook:a", 1000);
            let report = r.log_report();
            // Accepts are the first 50 records, then the delivery of m00 and m01: what survives
            // is the accepts before the cut, without the two once their delivery survived too.
            let all: Vec<String> = (0..50).map(|i| format!("m{i:02}")).collect();
            let start = all.iter().position(|id| Some(id) == ids.first()).unwrap_or(0);
            assert!(start == 0 || start == 2, "cut at {cut}: {ids:?}");
            assert_eq!(ids[..], all[start..start + ids.len()], "cut at {cut}");
            assert!(start + ids.len() >= last_kept, "cut at {cut}");
            last_kept = start + ids.len();
            assert_eq!(report.unreadable, u64::from(cut != 0), "cut at {cut}: {report:?}");
            assert_accounting(&r);
        }
        assert_eq!(last_kept, 50, "a cut in the last record loses that record only");
        let r = crash_copy(&s, &dir, Some(full));
        assert_eq!(ids_of(&r, "hook:a", 1000), live);
        assert_eq!(r.log_report().unreadable, 0);
    }

    #[test]
    fn a_corrupt_record_stops_the_replay_there_and_is_counted() {
        let (s, dir) = logged_history();
        let r = {
            let to = std::env::temp_dir().join(format!("imgate-flip-{}", crate::ids::random_hex(4)));
            std::fs::create_dir_all(&to).unwrap();
            let _no_writes = s.shared.lock();
            std::fs::copy(dir.join("imgate.redb"), to.join("imgate.redb")).unwrap();
            let mut log = std::fs::read(dir.join("outbox.log")).unwrap();
            log[2000] ^= 0x40;
            std::fs::write(to.join("outbox.log"), log).unwrap();
            drop(_no_writes);
            Outbox::open(Db::open(&to).unwrap(), ROOMY).unwrap()
        };
        let ids = ids_of(&r, "hook:a", 1000);
        assert!(!ids.is_empty() && ids.len() < 50, "{} kept", ids.len());
        assert_eq!(r.log_report().unreadable, 1);
        assert!(accepted(r.enqueue(msg("new", 2000, 60_000))), "the outbox works on");
        assert_accounting(&r);
    }

    #[test]
    fn a_change_too_large_for_the_log_is_committed_durably_instead() {
        let big = Policy {
            max_bytes_per_channel: 8 << 20,
            max_bytes_total: 8 << 20,
            ..ROOMY
        };
        let (db, dir) = store::temp_db("big");
        let s = Outbox::open(db, big).unwrap();
        s.shared.hold_checkpoints();
        let mut m = msg("huge", 1000, 60_000);
        m.payload = "x".repeat(wal::LOG_BYTES as usize + 1);
        let before = s.log_report().checkpoints;
        assert!(accepted(s.enqueue(m)));
        assert_eq!(s.log_report().checkpoints, before + 1, "the commit was the checkpoint");
        assert!(
            accepted(s.enqueue(msg("small", 1000, 60_000))),
            "the log takes the next one"
        );
        let r = crash_copy(&s, &dir, None);
        assert_eq!(ids_of(&r, "hook:a", 1000), ["huge", "small"]);
    }

    #[test]
    fn concurrent_enqueues_all_commit_and_keep_per_source_order() {
        let s = std::sync::Arc::new(store());
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let s = s.clone();
                std::thread::spawn(move || {
                    for i in 0..50 {
                        let src = format!("hook:t{t}");
                        assert!(accepted(s.enqueue(msg_in(&src, &format!("{i:03}"), 1000, 60_000))));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        for t in 0..8 {
            let ids = ids_of(&s, &format!("hook:t{t}"), 1000);
            let want: Vec<String> = (0..50).map(|i| format!("{i:03}")).collect();
            assert_eq!(ids, want);
        }
        assert_accounting(&s);
    }
}
