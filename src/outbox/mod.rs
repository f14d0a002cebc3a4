//! The durable outbox: per-source FIFO of accepted inbound messages with TTL, caps, dedupe and
//! counters (IM profile v1 sections 7 and 8). It owns its tables (`messages`, `delivered`,
//! `counters`, `reply_refs`), its capacity policy and the committer thread.
//!
//! A *source* is where messages come from (`webhook:NAME`); the channel bound to a source
//! receives its queue, so per-source is per-channel. Messages accepted before any binding wait
//! here under the same TTL and caps.
//!
//! Invariants:
//! - A message is accepted (and its sender told so) only after the commit that stores it.
//!   Enqueues from every thread and task go through one committer thread that groups whatever
//!   is waiting into one transaction (group commit): one fsync for many senders. A sender waits
//!   on its `Ticket`, blocking (`wait`) or as a future (`outcome`), so a waiting sender costs no
//!   thread on the async side.
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

mod index;
mod record;

use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use miniserde::{Deserialize, Serialize};
use redb::{ReadTransaction, ReadableTable, TableDefinition, WriteTransaction};

use self::index::{Index, Place};
pub use self::record::{Header, StoredMessage};
use crate::config::Overflow;
use crate::store::{self, Db, Result, StoreError};

/// `(source, seq)` → record (`record.rs`). `seq` grows per source: key order is acceptance order.
const MESSAGES: TableDefinition<(&str, u64), &str> = TableDefinition::new("messages");
/// `(source, seq)` → `"expires_at reply_ref message_id"` of delivered messages, for dedupe.
const DELIVERED: TableDefinition<(&str, u64), &str> = TableDefinition::new("delivered");
/// source → `Tally` JSON.
const COUNTERS: TableDefinition<&str, &str> = TableDefinition::new("counters");
/// reply_ref token → `ReplyRef` JSON; a reference leaves with its message or its dedupe entry.
const REPLY_REFS: TableDefinition<&str, &str> = TableDefinition::new("reply_refs");

/// Most enqueues folded into one transaction.
const MAX_GROUP: usize = 256;
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
    /// A provider's consumer cursor (`meta` key, value) advanced in the same transaction,
    /// accepted or duplicate: a crash can then neither skip the message nor accept it twice.
    pub cursor: Option<(String, u64)>,
}

struct Job {
    message: NewMessage,
    done: smol::channel::Sender<Result<Enqueued>>,
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

/// The database and the in-memory index, shared with the committer thread.
struct Shared {
    db: Arc<Db>,
    index: Mutex<Index>,
    policy: Policy,
    on_accept: OnceLock<AcceptHook>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` in one write transaction with the index locked; on any failure the index is
    /// rebuilt from what the database really holds.
    fn write<T>(&self, f: impl FnOnce(&WriteTransaction, &mut Index) -> Result<T>) -> Result<T> {
        let mut idx = self.lock();
        let result = self.db.write(|txn| f(txn, &mut idx));
        if result.is_err() {
            // After an I/O error (disk full, read-only) the file must be reopened first.
            self.db.recover();
            match self.db.read(load_index) {
                Ok(fresh) => *idx = fresh,
                // Rebuilt on the next failure or reopen; the outage itself is logged once.
                Err(e) => log::debug!("outbox: cannot reload the index: {e}"),
            }
        }
        result
    }
}

pub struct Outbox {
    shared: Arc<Shared>,
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Group commits made and messages they carried, for `/metrics`.
    stats: Arc<(AtomicUsize, AtomicUsize)>,
}

/// Dropping the outbox stops the committer and waits for it, so the database can close.
impl Drop for Outbox {
    fn drop(&mut self) {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Builds the index from the tables (startup, and after a failed commit).
fn load_index(txn: &ReadTransaction) -> Result<Index> {
    let mut idx = Index::default();
    for row in txn.open_table(MESSAGES)?.iter()? {
        let (k, v) = row?;
        let (src, seq) = k.value();
        let value = v.value();
        match record::header(value) {
            Some(h) => {
                let hash = idx.hash(&h.message_id);
                idx.source(src)
                    .add_pending(seq, hash, h.expires_at, record::bytes(src, value));
            }
            None => log::error!("outbox: unreadable record {src}/{seq} left in place"),
        }
    }
    for row in txn.open_table(DELIVERED)?.iter()? {
        let (k, v) = row?;
        let (src, seq) = k.value();
        if let Some((exp, _, id)) = record::parse_delivered(v.value()) {
            let hash = idx.hash(id);
            idx.source(src).load_delivered(seq, hash, exp);
        }
    }
    Ok(idx)
}

impl Outbox {
    /// Creates the tables, loads the index and starts the committer thread.
    pub fn open(db: Arc<Db>, policy: Policy) -> Result<Outbox> {
        db.write(|txn| {
            txn.open_table(MESSAGES)?;
            txn.open_table(DELIVERED)?;
            txn.open_table(COUNTERS)?;
            txn.open_table(REPLY_REFS)?;
            Ok(())
        })?;
        let shared = Arc::new(Shared {
            index: Mutex::new(db.read(load_index)?),
            db,
            policy,
            on_accept: OnceLock::new(),
        });
        let (tx, rx) = mpsc::channel::<Job>();
        let stats = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
        let (counted, group_shared) = (stats.clone(), shared.clone());
        let thread = std::thread::Builder::new()
            .name("outbox-commit".into())
            .spawn(move || {
                let (mut last_group, mut last_commit) = (1usize, Duration::from_micros(500));
                while let Ok(first) = rx.recv() {
                    let mut jobs = vec![first];
                    // Waiting pays only while the senders of the last group are still coming:
                    // up to as many as last time, for at most half a commit. A lone sender
                    // never waits.
                    let deadline = Instant::now() + (last_commit / 2).min(LINGER);
                    while jobs.len() < MAX_GROUP {
                        match rx.try_recv() {
                            Ok(j) => jobs.push(j),
                            Err(mpsc::TryRecvError::Disconnected) => break,
                            Err(mpsc::TryRecvError::Empty) => {
                                let left = deadline.saturating_duration_since(Instant::now());
                                if jobs.len() >= last_group || left.is_zero() {
                                    break;
                                }
                                match rx.recv_timeout(left) {
                                    Ok(j) => jobs.push(j),
                                    Err(_) => break,
                                }
                            }
                        }
                    }
                    last_group = jobs.len();
                    let started = Instant::now();
                    counted.0.fetch_add(1, AtomicOrdering::Relaxed);
                    counted.1.fetch_add(jobs.len(), AtomicOrdering::Relaxed);
                    commit_group(&group_shared, jobs);
                    last_commit = started.elapsed();
                }
            })
            .map_err(|e| StoreError::Internal(format!("cannot start the outbox committer: {e}")))?;
        Ok(Outbox {
            shared,
            tx: Mutex::new(Some(tx)),
            thread: Some(thread),
            stats,
        })
    }

    /// Sets the function told about sources with new messages (once, by the data plane).
    pub fn on_accepted(&self, hook: impl Fn(&str) + Send + Sync + 'static) {
        let _ = self.shared.on_accept.set(Box::new(hook));
    }

    pub fn policy(&self) -> Policy {
        self.shared.policy
    }

    /// After a disk that was full or read-only: reopens the file if an I/O error asked for it,
    /// and rebuilds the index from what the reopened file holds.
    pub fn recover(&self) {
        if self.shared.db.recover() {
            let mut idx = self.shared.lock();
            match self.shared.db.read(load_index) {
                Ok(fresh) => *idx = fresh,
                Err(e) => log::debug!("outbox: cannot reload the index: {e}"),
            }
        }
    }

    /// `(group commits, messages carried)` since start.
    pub fn commit_stats(&self) -> (u64, u64) {
        (
            self.stats.0.load(AtomicOrdering::Relaxed) as u64,
            self.stats.1.load(AtomicOrdering::Relaxed) as u64,
        )
    }

    /// Hands a message to the committer; the ticket tells when (and how) it was committed.
    pub fn submit(&self, message: NewMessage) -> Ticket {
        let (done, result) = smol::channel::bounded(1);
        let sender = self.tx.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match sender.map(|s| s.send(Job { message, done }).is_ok()) {
            Some(true) => Ticket(Ok(result)),
            _ => Ticket(Err(stopped())),
        }
    }

    /// Accepts a message durably (returns after the commit), answers `Duplicate`, or
    /// `CapacityExceeded` with nothing stored.
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
        self.shared.write(|txn, idx| {
            let mut messages = txn.open_table(MESSAGES)?;
            let mut delivered = txn.open_table(DELIVERED)?;
            let (mut n, mut last_id) = (0, String::new());
            for &seq in seqs {
                let Some(v) = messages.remove((source, seq))? else {
                    continue;
                };
                let value = v.value().to_string();
                drop(v);
                let Some(h) = record::header(&value) else { continue };
                last_id.clone_from(&h.message_id);
                delivered.insert(
                    (source, seq),
                    record::delivered_entry(h.expires_at, h.reply_ref.as_deref(), &h.message_id).as_str(),
                )?;
                let hash = idx.hash(&h.message_id);
                idx.source(source)
                    .deliver(seq, hash, h.expires_at, record::bytes(source, &value));
                n += 1;
            }
            drop(delivered);
            let si = idx.source(source);
            while si.delivered_len() > cap {
                if let Some(seq) = si.pop_delivered() {
                    forget_delivered(txn, source, seq)?;
                }
            }
            tally(txn, source, |t| match failure {
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
        self.shared.write(|txn, idx| {
            let mut messages = txn.open_table(MESSAGES)?;
            let (mut n, mut delta) = (0u64, 0i64);
            for &seq in seqs {
                let old = messages.get((source, seq))?.map(|v| v.value().to_string());
                let Some(mut m) = old.as_deref().and_then(record::decode) else {
                    continue;
                };
                m.header.attempts += 1;
                let new = record::encode(&m.header, &m.payload);
                delta += new.len() as i64 - old.map_or(0, |o| o.len()) as i64;
                messages.insert((source, seq), new.as_str())?;
                n += 1;
            }
            idx.source(source).adjust_bytes(delta);
            tally(txn, source, |t| {
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
        self.shared.write(|txn, idx| {
            let sources: Vec<String> = idx.sources.keys().cloned().collect();
            let mut n = 0;
            for src in &sources {
                n += expire_head(txn, idx, src, now)?;
            }
            for (src, si) in idx.sources.iter_mut() {
                while si.oldest_delivered_expiry().is_some_and(|exp| exp <= now) {
                    if let Some(seq) = si.pop_delivered() {
                        forget_delivered(txn, src, seq)?;
                    }
                }
            }
            Ok(n)
        })
    }

    /// Drops reply references past their expiry that nothing removed with their message;
    /// returns how many went.
    pub fn sweep_reply_refs(&self, now: u64) -> Result<u64> {
        self.shared.db.write(|txn| {
            let mut n = 0;
            txn.open_table(REPLY_REFS)?.retain(|_, v| {
                let keep = miniserde::json::from_str::<ReplyRef>(v).is_ok_and(|r| r.expires_at > now);
                n += u64::from(!keep);
                keep
            })?;
            Ok(n)
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
        self.shared.write(|txn, _| tally(txn, source, |t| t.expired += n))
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
        let idx = self.shared.lock();
        for (src, si) in &idx.sources {
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

    /// Bytes held by the outbox over all sources.
    pub fn total_bytes(&self) -> u64 {
        self.shared.lock().total_bytes()
    }
}

/// One transaction for a group of enqueues; every job learns the commit's outcome, then the
/// hook hears of each source that got a message.
fn commit_group(shared: &Shared, jobs: Vec<Job>) {
    let policy = shared.policy;
    let result = shared.write(|txn, idx| {
        let mut outcomes = Vec::with_capacity(jobs.len());
        for job in &jobs {
            outcomes.push(enqueue_in(txn, idx, &job.message, policy)?);
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
fn enqueue_in(txn: &WriteTransaction, idx: &mut Index, m: &NewMessage, policy: Policy) -> Result<Enqueued> {
    let outcome = enqueue_message(txn, idx, m, policy)?;
    if let Some((key, value)) = &m.cursor {
        if outcome != Enqueued::CapacityExceeded {
            let current = store::parse_u64(key, store::meta_in(txn, key)?)?.unwrap_or(0);
            if *value > current {
                store::set_meta(txn, key, Some(&value.to_string()))?;
            }
        }
    }
    Ok(outcome)
}

fn enqueue_message(txn: &WriteTransaction, idx: &mut Index, m: &NewMessage, policy: Policy) -> Result<Enqueued> {
    let (src, now) = (m.source.as_str(), m.accepted_at);
    let hash = idx.hash(&m.message_id);
    if let Some(place) = idx.source(src).lookup(hash, now) {
        if stored_id(txn, src, place)?.as_deref() == Some(m.message_id.as_str()) {
            return Ok(Enqueued::Duplicate);
        }
        log::warn!(
            "outbox: {src}: message {} shares an ID hash with another; accepted",
            m.message_id
        );
    }
    // Expiry at enqueue: this source's expired head goes first (FIFO with one TTL means the
    // expired messages are the oldest ones).
    expire_head(txn, idx, src, now)?;

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
        log::warn!(
            "outbox: {src}: message {} of {size} bytes can never fit the caps; refused",
            m.message_id
        );
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
        expire_all(txn, idx, now)?;
    }
    let mut evicted = 0;
    if !fits(idx) {
        if policy.overflow == Overflow::RejectNew {
            log::warn!(
                "outbox: {src}: caps full, overflow = reject_new: message {} refused",
                m.message_id
            );
            return Ok(Enqueued::CapacityExceeded);
        }
        // drop_oldest: evict this source's oldest pending messages until the new one fits.
        while !fits(idx) {
            let head = txn
                .open_table(MESSAGES)?
                .range((src, 0)..=(src, u64::MAX))?
                .next()
                .transpose()?
                .map(|(k, v)| (k.value().1, v.value().to_string()));
            let Some((seq, old)) = head else { break };
            remove_message(txn, idx, src, seq, &old)?;
            evicted += 1;
        }
        if evicted > 0 {
            tally(txn, src, |t| t.evicted += evicted)?;
            log::warn!("outbox: {src}: evicted {evicted} oldest pending message(s): capacity_exceeded");
        }
        if !fits(idx) {
            // This source is empty and the others fill the global cap.
            log::warn!(
                "outbox: {src}: max_bytes_total reached by other channels: message {} refused",
                m.message_id
            );
            return Ok(Enqueued::CapacityExceeded);
        }
    }

    let si = idx.source(src);
    let seq = si.next_seq;
    txn.open_table(MESSAGES)?.insert((src, seq), value.as_str())?;
    if let Some((token, r)) = &m.reply_ref {
        txn.open_table(REPLY_REFS)?
            .insert(token.as_str(), miniserde::json::to_string(r).as_str())?;
    }
    si.add_pending(seq, hash, m.expires_at, size);
    Ok(Enqueued::Accepted {
        expires_at: m.expires_at,
        evicted,
    })
}

/// Removes one pending message that leaves undelivered, with its reply reference.
fn remove_message(txn: &WriteTransaction, idx: &mut Index, src: &str, seq: u64, value: &str) -> Result<()> {
    txn.open_table(MESSAGES)?.remove((src, seq))?;
    let header = record::header(value);
    if let Some(t) = header.as_ref().and_then(|h| h.reply_ref.as_deref()) {
        txn.open_table(REPLY_REFS)?.remove(t)?;
    }
    let hash = idx.hash(&header.map(|h| h.message_id).unwrap_or_default());
    idx.source(src).drop_pending(seq, hash, record::bytes(src, value));
    Ok(())
}

/// Removes a delivered-log entry and the reply reference it carried: both end together, so
/// reply references are bounded like the log.
fn forget_delivered(txn: &WriteTransaction, src: &str, seq: u64) -> Result<()> {
    let entry = txn
        .open_table(DELIVERED)?
        .remove((src, seq))?
        .map(|v| v.value().to_string());
    if let Some(token) = entry
        .as_deref()
        .and_then(record::parse_delivered)
        .and_then(|(_, t, _)| t)
    {
        txn.open_table(REPLY_REFS)?.remove(token)?;
    }
    Ok(())
}

/// The message ID stored at `place`, to confirm an index hit.
fn stored_id(txn: &WriteTransaction, src: &str, place: Place) -> Result<Option<String>> {
    Ok(match place {
        Place::Pending(seq) => txn
            .open_table(MESSAGES)?
            .get((src, seq))?
            .and_then(|v| record::header(v.value()))
            .map(|h| h.message_id),
        Place::Delivered(seq) => txn
            .open_table(DELIVERED)?
            .get((src, seq))?
            .and_then(|v| record::parse_delivered(v.value()).map(|(_, _, id)| id.to_string())),
    })
}

/// Removes the expired messages at the head of one source.
fn expire_head(txn: &WriteTransaction, idx: &mut Index, src: &str, now: u64) -> Result<u64> {
    let mut gone = Vec::new();
    for row in txn.open_table(MESSAGES)?.range((src, 0)..=(src, u64::MAX))? {
        let (k, v) = row?;
        match record::header(v.value()) {
            Some(h) if h.expires_at <= now => gone.push((src.to_string(), k.value().1, v.value().to_string())),
            _ => break,
        }
    }
    remove_expired(txn, idx, gone)
}

/// Removes every expired message of every source.
fn expire_all(txn: &WriteTransaction, idx: &mut Index, now: u64) -> Result<u64> {
    let mut gone = Vec::new();
    for row in txn.open_table(MESSAGES)?.iter()? {
        let (k, v) = row?;
        let (src, seq) = k.value();
        if record::header(v.value()).is_some_and(|h| h.expires_at <= now) {
            gone.push((src.to_string(), seq, v.value().to_string()));
        }
    }
    remove_expired(txn, idx, gone)
}

/// Removes expired messages, given as `(source, seq, value)` grouped by source.
fn remove_expired(txn: &WriteTransaction, idx: &mut Index, gone: Vec<(String, u64, String)>) -> Result<u64> {
    let total = gone.len() as u64;
    let mut i = 0;
    while i < gone.len() {
        let src = gone[i].0.clone();
        let mut n = 0;
        while i < gone.len() && gone[i].0 == src {
            remove_message(txn, idx, &src, gone[i].1, &gone[i].2)?;
            n += 1;
            i += 1;
        }
        tally(txn, &src, |t| t.expired += n)?;
        log::warn!("outbox: {src}: {n} message(s) expired undelivered");
    }
    Ok(total)
}

fn tally(txn: &WriteTransaction, src: &str, f: impl FnOnce(&mut Tally)) -> Result<()> {
    let mut t = txn.open_table(COUNTERS)?;
    let mut c: Tally = t
        .get(src)?
        .and_then(|v| miniserde::json::from_str(v.value()).ok())
        .unwrap_or_default();
    f(&mut c);
    t.insert(src, miniserde::json::to_string(&c).as_str())?;
    Ok(())
}

#[cfg(test)]
mod tests {
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
            cursor: None,
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
