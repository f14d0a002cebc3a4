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
//!   until its `expires_at`, for at most `Policy::delivered_cap` delivered IDs per source and
//!   `MAX_DELIVERED_IDS` over all. The delivered IDs are kept in `DELIVERED`, written in
//!   sequence at delivery, so the state is bounded on disk and in memory and survives restarts.
//!   In memory an ID costs at most `index::BYTES_PER_ID` (and a source `BYTES_PER_SOURCE`).

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
pub use self::index::{BYTES_PER_ID, BYTES_PER_SOURCE};
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
    /// Delivered IDs remembered over all sources (`MAX_DELIVERED_IDS`).
    pub max_delivered_ids: u64,
}

impl Policy {
    /// A group commit stops growing at this many payload bytes, so its log record stays well
    /// inside the log.
    pub fn group_bytes(&self) -> usize {
        (self.log_file_bytes / 8) as usize
    }

    /// Delivered IDs remembered per source for dedupe (and `MAX_DELIVERED_IDS` over all).
    pub fn delivered_cap(&self) -> u64 {
        (self.max_messages_per_channel.saturating_mul(4)).clamp(1000, 100_000)
    }
}

/// Delivered IDs remembered over all sources: what bounds the delivered log's share of the
/// index (the queue's caps bound the pending share), whatever the number of channels.
pub const MAX_DELIVERED_IDS: u64 = 100_000;

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
    /// Who sent the message answered (the provider's user ID), for a reply that names them;
    /// absent in references an older imgate made.
    pub sender_id: Option<String>,
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

    /// The dedupe index: IDs known now, the bytes they take, stored IDs read since start to
    /// confirm a candidate.
    pub fn index_report(&self) -> (u64, u64, u64) {
        let st = self.shared.lock();
        let ids = st.index.sources.values().map(|s| s.known.len() as u64).sum();
        (ids, st.index.known_bytes() as u64, st.index.id_reads)
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
        let (cap, max_delivered_ids) = (self.shared.policy.delivered_cap(), self.shared.policy.max_delivered_ids);
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
                idx.source(source).deliver(seq, hash, record::bytes(source, &value));
                n += 1;
            }
            let over = idx.source(source).delivered.saturating_sub(cap);
            if over > 0 {
                trim_delivered(tx, idx, source, |_| false, over)?;
            }
            // The delivered log over all sources: the source that holds most gives way.
            let mut over = idx.total_delivered().saturating_sub(max_delivered_ids);
            while over > 0 {
                let Some(most) = idx.most_delivered().map(str::to_string) else {
                    break;
                };
                let gone = trim_delivered(tx, idx, &most, |_| false, over)?;
                if gone == 0 {
                    break;
                }
                over -= gone;
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
            let n = expire_all(tx, idx, now)?;
            let sources: Vec<String> = idx.sources.keys().cloned().collect();
            for src in &sources {
                let si = idx.source(src);
                if si.delivered > 0 && si.delivered_head_expires <= now {
                    trim_delivered(tx, idx, src, |exp| exp <= now, 0)?;
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

/// Bytes the smallest record with this payload takes in the queue, as the caps count them:
/// an ID of one byte, times of 13 digits (milliseconds from 2001 to 2286), no source name.
pub fn smallest_record(payload: &str) -> u64 {
    let header = Header {
        message_id: "x".into(),
        accepted_at: 1_000_000_000_000,
        expires_at: 1_000_000_000_000,
        attempts: 0,
        reply_ref: None,
    };
    record::bytes("", &record::encode(&header, payload))
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
    // Usually none; one for a duplicate; a second only where two IDs share the index's bits.
    let candidates: Vec<Place> = idx.source(src).candidates(hash).collect();
    for place in candidates {
        idx.id_reads += 1;
        if stored_id(tx, src, place, now)?.as_deref() == Some(m.message_id.as_str()) {
            return Ok(Enqueued::Duplicate);
        }
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
            // The next eviction starts past it: at the caps every accept evicts, and a walk
            // from the old head would pass every row evicted since the last checkpoint.
            idx.source(src).first_seq = seq + 1;
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
    si.add_pending(seq, hash, size);
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

/// Removes a source's oldest delivered-log entries: `at_least` of them, then those `expired`
/// answers true for (by expiry); each with the reply reference it carried, so reply
/// references are bounded like the log. Returns how many went.
fn trim_delivered(
    tx: &mut Tx,
    idx: &mut Index,
    src: &str,
    expired: impl Fn(u64) -> bool,
    at_least: u64,
) -> Result<u64> {
    let mut gone = Vec::new();
    let mut head = None;
    tx.read()
        .source_delivered(src, idx.source(src).delivered_from, |seq, v| {
            // An entry that does not parse can confirm nothing: it goes.
            let exp = record::parse_delivered(v).map_or(0, |(exp, _, _)| exp);
            if (gone.len() as u64) < at_least || expired(exp) {
                gone.push(seq);
                true
            } else {
                head = Some((seq, exp));
                false
            }
        })?;
    for seq in gone.iter().copied() {
        // The remove hands back the entry it read: its reply reference and ID.
        let value = tx.remove_delivered(src, seq)?;
        let entry = value.as_deref().and_then(record::parse_delivered);
        if let Some(token) = entry.and_then(|(_, t, _)| t) {
            tx.remove_reply_ref(token)?;
        }
        let hash = entry.map(|(_, _, id)| idx.hash(id));
        idx.source(src).forget_delivered(seq, hash);
    }
    let si = idx.source(src);
    match head {
        Some((seq, exp)) => {
            si.delivered_from = seq;
            si.delivered_head_expires = exp;
        }
        // The log holds no more of this source, whatever the count said.
        None => si.delivered = 0,
    }
    Ok(gone.len() as u64)
}

/// The message ID stored at `place` if it has not expired at `now`, to confirm an index hit.
fn stored_id(tx: &Tx, src: &str, place: Place, now: u64) -> Result<Option<String>> {
    let read = tx.read();
    Ok(match place {
        Place::Pending(seq) => read
            .message(src, seq)?
            .and_then(|v| record::header(&v))
            .filter(|h| h.expires_at > now)
            .map(|h| h.message_id),
        Place::Delivered(seq) => read.delivered(src, seq)?.and_then(|v| {
            record::parse_delivered(&v)
                .filter(|(exp, _, _)| *exp > now)
                .map(|(_, _, id)| id.to_string())
        }),
    })
}

/// Removes the expired messages at the head of one source.
fn expire_head(tx: &mut Tx, idx: &mut Index, src: &str, now: u64) -> Result<u64> {
    let si = idx.source(src);
    if !si.head_may_expire(now) {
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

/// Removes the expired messages of every source: each source's are at its head, and a head is
/// read only once the expiry last seen there has passed (so at the total cap, where every
/// accept comes here, an accept reads and copies no more than it would below it).
fn expire_all(tx: &mut Tx, idx: &mut Index, now: u64) -> Result<u64> {
    let sources: Vec<String> = idx
        .sources
        .iter()
        .filter(|(_, si)| si.head_may_expire(now))
        .map(|(src, _)| src.clone())
        .collect();
    let mut n = 0;
    for src in &sources {
        n += expire_head(tx, idx, src, now)?;
    }
    Ok(n)
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
mod tests;
