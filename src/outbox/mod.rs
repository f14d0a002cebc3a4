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

mod committer;
mod durable;
mod index;
mod outcomes;
mod overlay;
mod queue;
mod record;
mod tables;
mod tx;
pub mod wal;

use std::sync::Arc;
#[cfg(test)]
use std::time::Duration;

use miniserde::{Deserialize, Serialize};

pub use self::durable::LogReport;
use self::durable::Shared;
use self::index::{Index, Place};
pub use self::outcomes::Outcome;
use self::outcomes::Outcomes;
use self::overlay::Which;
use self::queue::{Job, Queue};
pub use self::record::{Header, StoredMessage};
use self::tx::Tx;
use crate::config::Overflow;
use crate::store::{self, Db, Result, StoreError};

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
    /// The size of each of the two log files (`[queue] log_file_size`, or fitted).
    pub log_file_bytes: u64,
}

impl Policy {
    /// A group commit stops growing at this many payload bytes, so its log record stays well
    /// inside the log.
    pub fn group_bytes(&self) -> usize {
        (self.log_file_bytes / 8) as usize
    }

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
    /// Group commits, the messages they carried and how each ended, for `/metrics`.
    stats: Arc<Outcomes>,
}

/// Dropping the outbox stops the committer, which checkpoints, and waits for it, so the
/// database closes with the log applied.
impl Drop for Outbox {
    fn drop(&mut self) {
        self.shared.queue.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Outbox {
    /// Creates the tables, replays the log of the last run, loads the index and starts the
    /// committer thread.
    pub fn open(db: Arc<Db>, policy: Policy) -> Result<Outbox> {
        db.write(durable::create_tables)?;
        let shared = Arc::new(Shared::open(db, policy, Arc::new(Queue::new(policy.group_bytes())))?);
        let stats = Arc::new(Outcomes::default());
        let (counted, group_shared) = (stats.clone(), shared.clone());
        let thread = std::thread::Builder::new()
            .name("outbox-commit".into())
            .spawn(move || committer::run(&group_shared, &counted))
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
        self.stats.commits()
    }

    /// How `provider`'s messages ended since start, in `Outcome::ALL` order.
    pub fn intake_counts(&self, provider: &str) -> [u64; outcomes::COUNT] {
        self.stats.of(provider)
    }

    /// A message of `source` was older than the TTL when it arrived (not stored).
    pub fn count_stale(&self, source: &str) {
        self.stats.count(source, Outcome::Stale);
    }

    /// A message for `provider` was refused before it reached the outbox (not stored).
    pub fn count_refused(&self, provider: &str) {
        self.stats.count(provider, Outcome::Refused);
    }

    /// Commits made to the database since start, the outbox's checkpoints among them.
    pub fn store_commits(&self) -> u64 {
        self.shared.db.commits()
    }

    /// Replays, checkpoints and unreadable log records since start.
    pub fn log_report(&self) -> LogReport {
        self.shared.report()
    }

    /// Hands a message to the committer; the ticket tells when (and how) it was committed.
    pub fn submit(&self, message: NewMessage) -> Ticket {
        let (done, result) = smol::channel::bounded(1);
        match self.shared.queue.push(Job { message, done }) {
            true => Ticket(Ok(result)),
            false => Ticket(Err(stopped())),
        }
    }

    /// Accepts a message durably (returns once it is on the disk), answers `Duplicate`, or
    /// `CapacityExceeded` with nothing stored.
    #[cfg(test)]
    pub fn enqueue(&self, message: NewMessage) -> Result<Enqueued> {
        self.submit(message).wait()
    }

    /// A `meta` value as the outbox's changes left it: a provider's cursor, which moves with
    /// the messages it covers and reaches redb only at a checkpoint.
    pub fn cursor(&self, key: &str) -> Result<Option<String>> {
        self.shared.view(|read, _| read.meta(key))
    }

    /// Moves cursors past a batch that stored nothing. Logged without a sync, like a delivery:
    /// a power cut at worst fetches that batch again.
    pub fn move_cursors(&self, cursors: &[Cursor]) -> Result<()> {
        self.shared.write(false, |tx, _| move_cursors(tx, cursors))
    }

    /// Up to `limit` unexpired pending messages of `source`, oldest first.
    #[cfg(test)]
    pub fn pending(&self, source: &str, limit: usize, now: u64) -> Result<Vec<Pending>> {
        self.pending_within(source, limit, usize::MAX, now)
    }

    /// `pending`, stopping once the payloads read come to `max_bytes` (one message at least).
    pub fn pending_within(&self, source: &str, limit: usize, max_bytes: usize, now: u64) -> Result<Vec<Pending>> {
        self.shared.view(|read, idx| {
            let mut out = Vec::new();
            let mut bytes = 0usize;
            let si = idx.source(source);
            let mut first = None;
            read.source_messages(source, si.first_seq, |seq, value| {
                first.get_or_insert(seq);
                // Expired messages are skipped here and removed by the next sweep: never
                // delivered. An unreadable one is left for `read_pending` to set aside.
                if let Some(message) = record::decode(value) {
                    if message.header.expires_at > now {
                        bytes = bytes.saturating_add(message.payload.len());
                        out.push(Pending { seq, message });
                    }
                }
                out.len() < limit && bytes < max_bytes
            })?;
            if let Some(first) = first {
                si.first_seq = first;
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
                let old = tx.read().message(source, seq)?;
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
            tx.read().all_named(Which::ReplyRefs, |token, v| {
                if !miniserde::json::from_str::<ReplyRef>(v).is_ok_and(|r| r.expires_at > now) {
                    gone.push(token.to_string());
                }
                true
            })?;
            for token in &gone {
                tx.remove_reply_ref(token)?;
            }
            Ok(gone.len() as u64)
        })
    }

    /// The message a reply reference answers, while it may be used.
    pub fn reply_ref(&self, token: &str) -> Result<Option<ReplyRef>> {
        let Some(v) = self.shared.view(|read, _| read.reply_ref(token))? else {
            return Ok(None);
        };
        let r: ReplyRef = miniserde::json::from_str(&v).map_err(|_| store::corrupt("reply reference"))?;
        Ok(Some(r))
    }

    /// Counts messages that expired before acceptance (a provider's backlog older than the TTL).
    pub fn record_expired(&self, source: &str, n: u64) -> Result<()> {
        self.shared.write(false, |tx, _| tally(tx, source, |t| t.expired += n))
    }

    /// Figures of every source that has any.
    pub fn stats(&self) -> Result<Vec<(String, Counters)>> {
        let mut out: Vec<(String, Counters)> = self.shared.view(|read, _| {
            let mut rows = Vec::new();
            read.all_named(Which::Counters, |src, v| {
                rows.push((src.to_string(), miniserde::json::from_str::<Tally>(v)));
                true
            })?;
            let mut out = Vec::new();
            for (src, t) in rows {
                let t = t.map_err(|_| store::corrupt("outbox counters"))?;
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
                out.push((src, c));
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
    let scanned = wal::scan(
        bytes,
        bytes.len().min(wal::MAX_LOG_BYTES as usize) as u64,
        |_, payload| {
            parsed += u64::from(tx::parse(payload).is_ok());
            Ok::<_, ()>(())
        },
    );
    (scanned.unwrap_or_default(), parsed)
}

/// The enqueue rules of one message inside a (group) transaction.
pub(super) fn enqueue_in(tx: &mut Tx, idx: &mut Index, m: &NewMessage, policy: Policy) -> Result<Enqueued> {
    let outcome = enqueue_message(tx, idx, m, policy)?;
    if outcome == Enqueued::CapacityExceeded {
        return Ok(outcome);
    }
    move_cursors(tx, &m.cursors)?;
    Ok(outcome)
}

fn move_cursors(tx: &mut Tx, cursors: &[Cursor]) -> Result<()> {
    for cursor in cursors {
        match cursor {
            Cursor::Forward(key, value) => {
                let current = store::parse_u64(key, tx.read().meta(key)?)?.unwrap_or(0);
                if *value > current {
                    tx.set_meta(key, &value.to_string())?;
                }
            }
            Cursor::Set(key, value) => tx.set_meta(key, value)?,
        }
    }
    Ok(())
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
            let mut head = None;
            let from = idx.source(src).first_seq;
            tx.read().source_messages(src, from, |seq, v| {
                head = Some((seq, v.to_string()));
                false
            })?;
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
    let read = tx.read();
    Ok(match place {
        Place::Pending(seq) => read
            .message(src, seq)?
            .and_then(|v| record::header(&v))
            .map(|h| h.message_id),
        Place::Delivered(seq) => read
            .delivered(src, seq)?
            .and_then(|v| record::parse_delivered(&v).map(|(_, _, id)| id.to_string())),
    })
}

/// Removes the expired messages at the head of one source.
fn expire_head(tx: &mut Tx, idx: &mut Index, src: &str, now: u64) -> Result<u64> {
    let si = idx.source(src);
    if si.pending == 0 || now < si.head_expires {
        return Ok(0);
    }
    let mut gone = Vec::new();
    let mut head = None;
    tx.read()
        .source_messages(src, si.first_seq, |seq, v| match record::header(v) {
            Some(h) if h.expires_at <= now => {
                gone.push((src.to_string(), seq, v.to_string()));
                true
            }
            // An unreadable header counts as expiring now: read again next time.
            h => {
                head = Some((seq, h.map_or(now, |h| h.expires_at)));
                false
            }
        })?;
    if let Some((seq, expires)) = head {
        let si = idx.source(src);
        si.first_seq = seq;
        si.head_expires = expires;
    }
    remove_expired(tx, idx, gone)
}

/// Removes every expired message of every source.
fn expire_all(tx: &mut Tx, idx: &mut Index, now: u64) -> Result<u64> {
    let mut gone = Vec::new();
    tx.read().all_seq(Which::Messages, |src, seq, v| {
        if record::header(v).is_some_and(|h| h.expires_at <= now) {
            gone.push((src.to_string(), seq, v.to_string()));
        }
        true
    })?;
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
        .read()
        .counter(src)?
        .and_then(|v| miniserde::json::from_str(&v).ok())
        .unwrap_or_default();
    f(&mut c);
    tx.put_counter(src, &miniserde::json::to_string(&c))
}

#[cfg(test)]
mod tests {
    use super::*;

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
        log_file_bytes: wal::LOG_BYTES,
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
            .view(|read, _| {
                read.all_seq(Which::Messages, |src, _, v| {
                    let b = record::bytes(src, v);
                    let e = per.entry(src.to_string()).or_default();
                    e.0 += 1;
                    e.1 += b;
                    total += b;
                    true
                })
            })
            .unwrap();
        for (src, c) in s.stats().unwrap() {
            let (n, b) = per.get(&src).copied().unwrap_or_default();
            assert_eq!((c.pending, c.pending_bytes), (n, b), "counters of {src}");
        }
        assert_eq!(s.total_bytes(), total);
    }

    #[test]
    fn a_read_within_a_byte_budget_stops_past_it_and_takes_one_message_at_least() {
        let s = store();
        for id in ["m1", "m2", "m3", "m4"] {
            assert!(accepted(s.enqueue(msg(id, 1000, 60_000))));
        }
        // Each payload is `{"message_id":"mN"}`, 19 bytes.
        let ids = |max: usize| -> Vec<String> {
            let p = s.pending_within("hook:a", 10, max, 1000).unwrap();
            p.into_iter().map(|p| p.message.header.message_id).collect()
        };
        assert_eq!(ids(1), ["m1"], "one at least");
        assert_eq!(ids(19), ["m1"]);
        assert_eq!(ids(20), ["m1", "m2"]);
        assert_eq!(ids(usize::MAX), ["m1", "m2", "m3", "m4"]);
        assert_eq!(s.pending_within("hook:a", 3, usize::MAX, 1000).unwrap().len(), 3);
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
    fn enqueue_expires_the_head_once_the_expiry_it_last_saw_there_has_passed() {
        let s = store();
        s.enqueue(msg("a", 1000, 100)).unwrap();
        // Reads the head ("a", until 1100): nothing to expire before then.
        s.enqueue(msg("b", 1050, 100)).unwrap();
        s.enqueue(msg("c", 1080, 100)).unwrap();
        assert_eq!(counters(&s, "hook:a").expired, 0);
        // Past 1100 and 1150: "a" and "b" go, "c" (until 1180) stays the head.
        s.enqueue(msg("d", 1160, 100)).unwrap();
        assert_eq!(counters(&s, "hook:a").expired, 2);
        assert_eq!(ids_of(&s, "hook:a", 1160), ["c", "d"]);
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
        assert_eq!(s.enqueue(msg("m1", 1000, 60_000)).unwrap(), Enqueued::Duplicate);
        // accepted, duplicate, full, failed, stale: what /metrics shows for the provider.
        assert_eq!(s.intake_counts("hook"), [2, 1, 1, 0, 0, 0]);
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
        let mut kept = 0;
        s.shared
            .view(|read, _| {
                read.all_seq(Which::Delivered, |_, _, _| {
                    kept += 1;
                    true
                })
            })
            .unwrap();
        assert_eq!(kept, 1000);
        assert_accounting(&s);
    }

    /// What a process crash at this moment leaves behind: the files as the page cache holds
    /// them (no outbox write runs while they are copied). `cut` truncates the log copy.
    fn crash_copy(s: &Outbox, dir: &std::path::Path, cut: Option<u64>) -> Outbox {
        let to = crate::scratch::scratch_dir("crash");
        {
            let _no_writes = s.shared.lock();
            for f in ["imgate.redb", wal::FILES[0], wal::FILES[1]] {
                if dir.join(f).exists() {
                    std::fs::copy(dir.join(f), to.join(f)).unwrap();
                }
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
        s.shared.flush_log();
        (s, dir)
    }

    #[test]
    fn a_log_written_at_another_size_is_replayed_whole_and_made_at_the_new_size() {
        let (s, dir) = logged_history();
        let checkpoints = s.log_report().checkpoints;
        // Past what the new size would read: 300 KB more in the 2 MiB log.
        for i in 0..150 {
            let mut m = msg(&format!("big{i:03}"), 1000, 60_000);
            m.payload = "b".repeat(2000);
            assert!(accepted(s.enqueue(m)));
        }
        s.shared.flush_log();
        assert_eq!(s.log_report().checkpoints, checkpoints, "all of it only in the log");
        let before = ids_of(&s, "hook:a", 1000);
        assert!(before.last().is_some_and(|id| id == "big149"), "{before:?}");
        let to = crate::scratch::scratch_dir("resized");
        {
            let _no_writes = s.shared.lock();
            for f in ["imgate.redb", wal::FILES[0], wal::FILES[1]] {
                std::fs::copy(dir.join(f), to.join(f)).unwrap();
            }
        }
        let small = Policy {
            log_file_bytes: wal::MIN_LOG_BYTES,
            ..ROOMY
        };
        let r = Outbox::open(Db::open(&to).unwrap(), small).unwrap();
        let same = crash_copy(&s, &dir, None).log_report().replayed;
        assert!(same >= 50, "{same}");
        assert_eq!(r.log_report().replayed, same, "every record of the 2 MiB file");
        assert_eq!(ids_of(&r, "hook:a", 1000), before);
        // Messages go on: the small log fills, checkpoints and is recycled, each file made
        // again at the new size when its turn comes.
        for i in 0..400 {
            assert!(accepted(r.enqueue(msg(&format!("n{i:03}"), 1000, 60_000))));
        }
        assert!(r.log_report().checkpoints > 1);
        for f in wal::FILES {
            assert_eq!(std::fs::metadata(to.join(f)).unwrap().len(), wal::MIN_LOG_BYTES, "{f}");
        }
        drop(r);
        let r = Outbox::open(Db::open(&to).unwrap(), small).unwrap();
        assert_eq!(ids_of(&r, "hook:a", 1000).len(), before.len() + 400);
    }

    #[test]
    fn a_delivery_held_in_memory_when_the_process_dies_is_delivered_again() {
        let (db, dir) = store::temp_db("held");
        let s = Outbox::open(db, ROOMY).unwrap();
        for i in 0..3 {
            assert!(accepted(s.enqueue(msg(&format!("m{i}"), 1000, 60_000))));
        }
        let p = s.pending("hook:a", 1, 1000).unwrap();
        s.mark_delivered("hook:a", &[p[0].seq]).unwrap();
        assert_eq!(ids_of(&s, "hook:a", 1000), ["m1", "m2"]);
        // Its record waits for the next synced append (or `HOLD`): a crash now loses it, and
        // the message comes again, with its ID (at least once, as after a power cut).
        let r = crash_copy(&s, &dir, None);
        assert_eq!(ids_of(&r, "hook:a", 1000), ["m0", "m1", "m2"]);
        // The next accept takes it to the disk.
        assert!(accepted(s.enqueue(msg("m3", 1000, 60_000))));
        let r = crash_copy(&s, &dir, None);
        assert_eq!(ids_of(&r, "hook:a", 1000), ["m1", "m2", "m3"]);
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
    fn a_checkpoint_is_due_only_once_the_log_holds_512_kib() {
        let (db, _dir) = store::temp_db("due");
        let s = Outbox::open(db, ROOMY).unwrap();
        assert_eq!(s.shared.upkeep_due(), None, "an empty log needs no checkpoint");
        assert!(accepted(s.enqueue(msg("a", 1000, 60_000))));
        assert_eq!(s.shared.upkeep_due(), None, "no timer: one record waits for more");
        // 8 KB messages: the committer checkpoints by itself once 512 KiB are logged.
        let before = s.log_report().checkpoints;
        let mut sent = 0;
        while sent < 200 {
            sent += 1;
            assert!(accepted(s.enqueue(big(&format!("b{sent}"), 8000))));
            if s.log_report().checkpoints > before
                || s.shared.upkeep_due() == Some(Duration::ZERO)
                || s.shared.checkpoint_in_flight()
            {
                break;
            }
        }
        assert!((60..=70).contains(&sent), "due after {sent} messages of 8 KB");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while s.log_report().checkpoints == before {
            assert!(
                std::time::Instant::now() < deadline,
                "the committer checkpoints by itself"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(s.shared.upkeep_due(), None, "the log is empty again");
    }

    /// A message of `bytes` bytes of payload.
    fn big(id: &str, bytes: usize) -> NewMessage {
        NewMessage {
            payload: "x".repeat(bytes),
            ..msg(id, 1000, 60_000)
        }
    }

    /// Accepts of 4 KB until a checkpoint is due, then waits for the committer to start it (it
    /// is held at `checkpoint_gate`); how many were sent, all of them in what it writes.
    fn fill_until_a_checkpoint_starts(s: &Outbox, prefix: &str) -> usize {
        let mut sent = 0;
        while s.shared.upkeep_due() != Some(Duration::ZERO) && !s.shared.checkpoint_in_flight() {
            assert!(sent < 400, "no checkpoint due after {sent} messages of 4 KB");
            sent += 1;
            assert!(accepted(s.enqueue(big(&format!("{prefix}{sent:03}"), 4000))));
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !s.shared.checkpoint_in_flight() {
            assert!(
                std::time::Instant::now() < deadline,
                "the committer starts the checkpoint"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        sent
    }

    #[test]
    fn accepts_and_deliveries_go_on_during_a_checkpoint_and_a_crash_meanwhile_loses_nothing() {
        let (db, dir) = store::temp_db("inflight");
        let s = Outbox::open(db.clone(), ROOMY).unwrap();
        let gate = s.shared.checkpoint_gate.clone();
        let held = gate.lock().unwrap();
        let checkpoints = s.log_report().checkpoints;
        let before = fill_until_a_checkpoint_starts(&s, "a");
        // While the checkpoint waits at the gate: new accepts (into the other log file), and
        // deliveries of messages it is writing and of one accepted since.
        for i in 0..20 {
            assert!(accepted(s.enqueue(msg(&format!("n{i:02}"), 1000, 60_000))));
        }
        let p = s.pending("hook:a", 1000, 1000).unwrap();
        assert_eq!(p.len(), before + 20);
        s.mark_delivered("hook:a", &[p[0].seq, p[1].seq, p[before].seq])
            .unwrap();
        let live = ids_of(&s, "hook:a", 1000);
        assert_eq!(live.len(), before + 17);
        assert!(s.shared.checkpoint_in_flight(), "it still waits");
        // The deliveries' records, held for a sync, written as `wal::HOLD` after them would.
        s.shared.flush_log();
        let r = crash_copy(&s, &dir, None);
        assert_eq!(ids_of(&r, "hook:a", 1000), live, "a crash replays both files");
        assert_accounting(&r);
        drop(r);

        drop(held);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while s.shared.checkpoint_in_flight() {
            assert!(std::time::Instant::now() < deadline, "the checkpoint ends");
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(s.log_report().checkpoints, checkpoints + 1);
        assert_eq!(ids_of(&s, "hook:a", 1000), live, "the same after it");
        assert_eq!(
            s.shared.overlay_messages(),
            19,
            "the overlay holds only what came since: the 19 accepted and still pending"
        );
        s.shared.flush_log();
        let r = crash_copy(&s, &dir, None);
        assert_eq!(ids_of(&r, "hook:a", 1000), live, "and after a crash now");
        assert_accounting(&r);
        drop(r);
        // The two delivered while it ran are removed from redb by the next checkpoint.
        s.shared.checkpoint();
        let in_redb = db
            .read(|txn| {
                use redb::ReadableTableMetadata;
                Ok(txn.open_table(tables::MESSAGES)?.len()?)
            })
            .unwrap();
        assert_eq!(in_redb as usize, live.len());
        assert_accounting(&s);
    }

    #[test]
    fn a_checkpoint_that_fails_in_flight_loses_nothing_and_the_next_writes_it_all() {
        let (db, dir) = store::temp_db("inflight-fail");
        let s = Outbox::open(db.clone(), ROOMY).unwrap();
        let gate = s.shared.checkpoint_gate.clone();
        let mut held = gate.lock().unwrap();
        let before = fill_until_a_checkpoint_starts(&s, "a");
        for i in 0..5 {
            assert!(accepted(s.enqueue(msg(&format!("n{i}"), 1000, 60_000))));
        }
        let (commits, checkpoints) = (db.commits(), s.log_report().checkpoints);
        *held = true;
        drop(held);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while s.shared.checkpoint_in_flight() {
            assert!(std::time::Instant::now() < deadline, "the checkpoint ends");
            std::thread::sleep(Duration::from_millis(2));
        }
        let retried = || s.log_report().checkpoints > checkpoints;
        match s.shared.upkeep_due() {
            Some(due) => assert!(due > Duration::ZERO, "a retry after a pause, not at once"),
            None => assert!(retried(), "a retry is due unless it was made already"),
        }
        let live = ids_of(&s, "hook:a", 1000);
        assert_eq!(live.len(), before + 5);
        // Both files hold records redb lacks (or, once retried, redb holds all): a crash now
        // loses nothing either way.
        let r = crash_copy(&s, &dir, None);
        assert_eq!(ids_of(&r, "hook:a", 1000), live);
        drop(r);
        // The committer retries by itself, in place (the other file is not free): one commit
        // writes them all.
        while !retried() {
            assert!(std::time::Instant::now() < deadline, "the checkpoint is retried");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(db.commits(), commits + 1);
        assert!(!s.shared.checkpoint_in_flight());
        assert_eq!(s.shared.overlay_messages(), 0);
        let in_redb = db
            .read(|txn| {
                use redb::ReadableTableMetadata;
                Ok(txn.open_table(tables::MESSAGES)?.len()?)
            })
            .unwrap();
        assert_eq!(in_redb as usize, live.len());
        let r = crash_copy(&s, &dir, None);
        assert_eq!(ids_of(&r, "hook:a", 1000), live);
        assert_eq!(r.log_report().replayed, 0, "nothing left to replay");
        assert_accounting(&r);
    }

    #[test]
    fn when_the_second_log_file_cannot_be_made_the_checkpoint_is_made_in_place_and_loses_nothing() {
        let (db, dir) = store::temp_db("nospare");
        // A directory where the second file is made: it cannot be, as on a full disk.
        std::fs::create_dir_all(dir.join(format!("{}.tmp", wal::FILES[1]))).unwrap();
        let s = Outbox::open(db, ROOMY).unwrap();
        let checkpoints = s.log_report().checkpoints;
        let mut sent = 0;
        while s.log_report().checkpoints == checkpoints {
            assert!(sent < 400, "no checkpoint after {sent} messages of 4 KB");
            sent += 1;
            assert!(accepted(s.enqueue(big(&format!("a{sent:03}"), 4000))));
        }
        assert!(!s.shared.checkpoint_in_flight());
        assert!(
            s.shared.upkeep_due().is_none(),
            "done, not failed: {:?}",
            s.shared.upkeep_due()
        );
        let live = ids_of(&s, "hook:a", 1000);
        assert_eq!(live.len(), sent);
        let r = crash_copy(&s, &dir, None);
        assert_eq!(ids_of(&r, "hook:a", 1000), live);
        assert_accounting(&r);
    }

    #[test]
    fn a_message_accepted_and_delivered_between_checkpoints_never_reaches_redb() {
        let (db, dir) = store::temp_db("hot");
        let s = Outbox::open(db.clone(), ROOMY).unwrap();
        let commits = db.commits();
        for id in ["m1", "m2", "m3"] {
            assert!(accepted(s.enqueue(msg(id, 1000, 60_000))));
        }
        let p = s.pending("hook:a", 10, 1000).unwrap();
        s.mark_delivered("hook:a", &[p[0].seq, p[1].seq]).unwrap();
        s.mark_attempt_failed("hook:a", &[p[2].seq], "disconnected").unwrap();
        s.sweep_expired(1000).unwrap();
        assert_eq!(
            db.commits(),
            commits,
            "accepts, deliveries and sweeps commit nothing to redb"
        );
        assert_eq!(
            s.shared.overlay_messages(),
            1,
            "only the pending message waits for redb"
        );
        s.shared.checkpoint();
        assert_eq!(db.commits(), commits + 1, "one commit for the checkpoint");
        assert_eq!(s.log_report().checkpointed_messages, 1);
        let in_redb: Vec<u64> = db
            .read(|txn| {
                use redb::ReadableTable;
                let table = txn.open_table(tables::MESSAGES)?;
                let seqs = table.iter()?.map(|r| Ok(r?.0.value().1)).collect();
                seqs
            })
            .unwrap();
        assert_eq!(in_redb, [p[2].seq], "m1 and m2 were never written");
        s.shared.checkpoint();
        assert_eq!(db.commits(), commits + 1, "nothing logged since: no commit");
        drop((s, db));
        let r = Outbox::open(Db::open(&dir).unwrap(), ROOMY).unwrap();
        assert_eq!(r.log_report().replayed, 0, "a clean stop leaves nothing to replay");
        assert_eq!(ids_of(&r, "hook:a", 1000), ["m3"]);
        assert_eq!(r.enqueue(msg("m1", 2000, 60_000)).unwrap(), Enqueued::Duplicate);
        assert_eq!(counters(&r, "hook:a").delivered, 2);
        assert!(
            r.reply_ref("rr_m1").unwrap().is_some(),
            "a delivered message can be answered"
        );
    }

    #[test]
    fn reads_after_a_checkpoint_start_at_the_head_not_at_the_rows_delivered_since() {
        let s = store();
        for i in 0..100 {
            assert!(accepted(s.enqueue(msg(&format!("m{i:03}"), 1000, 60_000))));
        }
        s.shared.checkpoint();
        let seqs: Vec<u64> = s.pending("hook:a", 99, 1000).unwrap().iter().map(|p| p.seq).collect();
        s.mark_delivered("hook:a", &seqs).unwrap();
        assert_eq!(ids_of(&s, "hook:a", 1000), ["m099"]);
        let first = s.shared.lock().index.source("hook:a").first_seq;
        assert!(
            first > seqs[98],
            "the next read starts past the 99 delivered rows redb still holds"
        );
        assert!(accepted(s.enqueue(msg("m100", 1000, 60_000))));
        assert_eq!(ids_of(&s, "hook:a", 1000), ["m099", "m100"]);
        assert_accounting(&s);
    }

    #[test]
    fn cursors_read_back_what_the_last_change_moved_before_and_after_a_checkpoint() {
        let (db, _dir) = store::temp_db("cursor");
        let s = Outbox::open(db, ROOMY).unwrap();
        let mut m = msg("c1", 1000, 60_000);
        m.cursors = vec![Cursor::Forward("off".into(), 7), Cursor::Set("buf".into(), "a".into())];
        assert!(accepted(s.enqueue(m)));
        s.move_cursors(&[Cursor::Forward("off".into(), 5), Cursor::Set("buf".into(), "b".into())])
            .unwrap();
        assert_eq!(s.cursor("off").unwrap().as_deref(), Some("7"), "forward only");
        assert_eq!(s.cursor("buf").unwrap().as_deref(), Some("b"));
        s.shared.checkpoint();
        assert_eq!(s.cursor("buf").unwrap().as_deref(), Some("b"));
        assert_eq!(s.cursor("off").unwrap().as_deref(), Some("7"));
    }

    #[test]
    fn a_torn_log_keeps_exactly_the_whole_records_before_the_tear() {
        let (s, dir) = logged_history();
        let live = ids_of(&s, "hook:a", 1000);
        let full = s.shared.lock().log_used();
        let mut last_kept = 0;
        // Records never cross a page, so one starts each page: 100 bytes in is inside it.
        let page = wal::PAGE;
        for cut in [0, 1, 15, 16, 17, page + 100, 2 * page + 100, full - 5, full - 1] {
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
            let to = crate::scratch::scratch_dir("flip");
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
    fn the_other_log_file_is_cleared_after_a_replay_that_stopped_short_and_otherwise_left_alone() {
        let (s, dir) = logged_history();
        // Both files hold the same 50 records: a copy of the log in place of the other file.
        let start_with = |flip: bool| {
            let to = crate::scratch::scratch_dir("spare");
            let _no_writes = s.shared.lock();
            std::fs::copy(dir.join("imgate.redb"), to.join("imgate.redb")).unwrap();
            let mut log = std::fs::read(dir.join(wal::FILES[0])).unwrap();
            if flip {
                log[2000] ^= 0x40;
            }
            std::fs::write(to.join(wal::FILES[0]), &log).unwrap();
            std::fs::write(to.join(wal::FILES[1]), &log).unwrap();
            drop(_no_writes);
            let r = Outbox::open(Db::open(&to).unwrap(), ROOMY).unwrap();
            let spare = std::fs::read(to.join(wal::FILES[1])).unwrap();
            (r, log, spare)
        };
        let records = |bytes: &[u8]| {
            wal::scan(bytes, wal::LOG_BYTES, |_, _| Ok::<_, ()>(()))
                .unwrap()
                .records
        };

        let (r, log, spare) = start_with(false);
        assert_eq!(r.log_report().unreadable, 0);
        assert_eq!(
            spare, log,
            "all of it is in redb now and numbered below what comes next"
        );
        let (r, log, spare) = start_with(true);
        assert_eq!(r.log_report().unreadable, 1);
        assert!(records(&log) > 0);
        assert_eq!(
            records(&spare),
            0,
            "what lies past the stop can never pass for a later record"
        );
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
