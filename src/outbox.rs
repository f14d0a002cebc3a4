//! The durable outbox: per-source FIFO of accepted inbound messages with TTL, caps, dedupe and
//! counters (IM profile v1 sections 7 and 8).
//!
//! A *source* is where messages come from (`webhook:NAME`); the channel bound to a source
//! receives its queue, so per-source is per-channel. Messages accepted before any binding wait
//! here under the same TTL and caps.
//!
//! Invariants:
//! - A message is accepted (and its sender told so) only after the commit that stores it.
//!   Enqueues from all HTTP threads go through one committer thread that groups whatever is
//!   waiting into one transaction (group commit): one fsync for many senders.
//! - `expires_at = accepted_at + ttl` is written once, at acceptance, and never changed.
//! - A message leaves the queue in exactly three ways, each counted and logged: delivered (a
//!   `pong` answered a `ping` sent after its push), expired, or evicted (`capacity_exceeded`).
//!   Expired and evicted messages take their reply reference with them.
//! - `COUNTERS.pending/pending_bytes` always equal what `MESSAGES` holds for that source: every
//!   change to `MESSAGES` updates them in the same transaction. Bytes are stored record sizes;
//!   the total over all sources is their sum (few sources, so no table of its own to rewrite).
//! - Dedupe entries live until the message's `expires_at`, so a sender retry within the TTL is
//!   answered `duplicate` even after delivery; the sweep removes them afterwards.

use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::sync::mpsc;
use std::sync::Mutex;

use miniserde::{Deserialize, Serialize};
use redb::{ReadableDatabase, ReadableTable, TableDefinition, WriteTransaction};

use crate::config::Overflow;
use crate::store::{ReplyRef, Result, Store, StoreError, REPLY_REFS};

/// `(source, seq)` → `StoredMessage` JSON. `seq` grows per source, so key order is acceptance order.
const MESSAGES: TableDefinition<(&str, u64), &str> = TableDefinition::new("messages");
/// `(source, message_id)` → `expires_at`.
const DEDUPE: TableDefinition<(&str, &str), u64> = TableDefinition::new("dedupe");
/// source → `Counters` JSON.
const COUNTERS: TableDefinition<&str, &str> = TableDefinition::new("counters");

/// Most enqueues folded into one transaction.
const MAX_GROUP: usize = 256;
/// How long the committer may wait for enqueues that announced themselves (see `Intent`).
const LINGER: std::time::Duration = std::time::Duration::from_micros(1500);

pub(crate) fn create_tables(txn: &WriteTransaction) -> Result<()> {
    txn.open_table(MESSAGES)?;
    txn.open_table(DEDUPE)?;
    txn.open_table(COUNTERS)?;
    Ok(())
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct StoredMessage {
    pub message_id: String,
    pub accepted_at: u64,
    pub expires_at: u64,
    pub attempts: u64,
    /// The reply reference minted for this message, removed with it on expiry or eviction.
    pub reply_ref: Option<String>,
    /// The rendered `message.push` payload, exactly as it will go on the wire.
    pub payload: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct Counters {
    pub pending: u64,
    pub pending_bytes: u64,
    pub delivered: u64,
    pub expired: u64,
    pub evicted: u64,
    pub attempts: u64,
    pub last_error: Option<String>,
}

/// The capacity policy, from `[queue]`.
#[derive(Clone, Copy, Debug)]
pub struct Policy {
    pub max_messages_per_channel: u64,
    pub max_bytes_per_channel: u64,
    pub max_bytes_total: u64,
    pub overflow: Overflow,
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

/// A message to accept.
pub struct NewMessage {
    pub source: String,
    pub message_id: String,
    pub payload: String,
    pub reply_ref: Option<(String, ReplyRef)>,
    pub accepted_at: u64,
    pub expires_at: u64,
}

struct Job {
    message: NewMessage,
    policy: Policy,
    done: mpsc::SyncSender<Result<Enqueued>>,
}

/// The sending side of the committer thread. Dropping it stops the thread and waits for it, so
/// the database is closed when the `Store` is gone.
pub(crate) struct Committer {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Option<std::thread::JoinHandle<()>>,
    intents: std::sync::Arc<AtomicUsize>,
    /// Group commits made and messages they carried, for `/metrics`.
    stats: std::sync::Arc<(AtomicUsize, AtomicUsize)>,
}

/// An enqueue on its way (its request is being parsed). While any exist, the committer lingers
/// briefly so their messages share its commit: one fsync for many senders. Unannounced
/// enqueues never wait.
pub struct Intent(std::sync::Arc<AtomicUsize>);

impl Drop for Intent {
    fn drop(&mut self) {
        self.0.fetch_sub(1, AtomicOrdering::SeqCst);
    }
}

impl Drop for Committer {
    fn drop(&mut self) {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn record_bytes(source: &str, value: &str) -> u64 {
    (source.len() + 8 + value.len()) as u64
}

impl Store {
    /// Starts the committer thread; called once by `Store::open`.
    pub(crate) fn start_committer(db: std::sync::Arc<redb::Database>) -> Committer {
        let (tx, rx) = mpsc::channel::<Job>();
        let intents = std::sync::Arc::new(AtomicUsize::new(0));
        let announced = intents.clone();
        let stats = std::sync::Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
        let counted = stats.clone();
        let thread = std::thread::Builder::new()
            .name("outbox-commit".into())
            .spawn(move || {
                let mut last_group = 1usize;
                while let Ok(first) = rx.recv() {
                    let mut jobs = vec![first];
                    let deadline = std::time::Instant::now() + LINGER;
                    while jobs.len() < MAX_GROUP {
                        match rx.try_recv() {
                            Ok(j) => jobs.push(j),
                            Err(mpsc::TryRecvError::Disconnected) => break,
                            Err(mpsc::TryRecvError::Empty) => {
                                // Jobs in the group still hold their intents.
                                let coming = announced.load(AtomicOrdering::SeqCst).saturating_sub(jobs.len());
                                let left = deadline.saturating_duration_since(std::time::Instant::now());
                                // Concurrency seen in the last group is expected to go on.
                                let expected = coming.max(last_group.saturating_sub(jobs.len()));
                                if expected == 0 || left.is_zero() {
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
                    counted.0.fetch_add(1, AtomicOrdering::Relaxed);
                    counted.1.fetch_add(jobs.len(), AtomicOrdering::Relaxed);
                    commit_group(&db, jobs);
                }
            })
            .expect("the outbox committer thread starts");
        Committer {
            tx: Mutex::new(Some(tx)),
            thread: Some(thread),
            intents,
            stats,
        }
    }

    /// `(group commits, messages carried)` since start.
    pub fn commit_stats(&self) -> (u64, u64) {
        let s = &self.committer.stats;
        (s.0.load(AtomicOrdering::Relaxed) as u64, s.1.load(AtomicOrdering::Relaxed) as u64)
    }

    /// Announces an enqueue that will follow shortly (hold it until `enqueue` returns).
    pub fn intent(&self) -> Intent {
        self.committer.intents.fetch_add(1, AtomicOrdering::SeqCst);
        Intent(self.committer.intents.clone())
    }

    /// Accepts a message durably (the call returns after the commit), answers `Duplicate`, or
    /// `CapacityExceeded` with nothing stored.
    pub fn enqueue(&self, message: NewMessage, policy: Policy) -> Result<Enqueued> {
        let (done, result) = mpsc::sync_channel(1);
        let sender = self.committer.tx.lock().unwrap_or_else(|e| e.into_inner()).clone();
        sender
            .ok_or_else(|| StoreError("the outbox committer stopped".into()))?
            .send(Job { message, policy, done })
            .map_err(|_| StoreError("the outbox committer stopped".into()))?;
        result
            .recv()
            .map_err(|_| StoreError("the outbox committer stopped".into()))?
    }

    /// Up to `limit` unexpired pending messages of `source`, oldest first.
    pub fn pending(&self, source: &str, limit: usize, now: u64) -> Result<Vec<Pending>> {
        let t = self.db.begin_read()?.open_table(MESSAGES)?;
        let mut out = Vec::new();
        for row in t.range((source, 0)..=(source, u64::MAX))? {
            let (k, v) = row?;
            let Ok(message) = miniserde::json::from_str::<StoredMessage>(v.value()) else {
                continue;
            };
            // Expired messages are skipped here and removed by the next sweep: never delivered.
            if message.expires_at <= now {
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
    }

    /// The delivery boundary was reached for these messages: remove them in one commit.
    pub fn mark_delivered(&self, source: &str, seqs: &[u64]) -> Result<u64> {
        let txn = self.db.begin_write()?;
        let mut n = 0;
        {
            let mut messages = txn.open_table(MESSAGES)?;
            let mut freed = 0;
            for &seq in seqs {
                if let Some(v) = messages.remove((source, seq))? {
                    n += 1;
                    freed += record_bytes(source, v.value());
                }
            }
            bump(&txn, source, |c| {
                c.delivered += n;
                c.pending = c.pending.saturating_sub(n);
                c.pending_bytes = c.pending_bytes.saturating_sub(freed);
            })?;
        }
        txn.commit()?;
        Ok(n)
    }

    /// The connection failed before the boundary: the messages stay pending, `attempts + 1`.
    pub fn mark_attempt_failed(&self, source: &str, seqs: &[u64], error: &str) -> Result<()> {
        let txn = self.db.begin_write()?;
        {
            let mut messages = txn.open_table(MESSAGES)?;
            let (mut n, mut delta) = (0u64, 0i64);
            for &seq in seqs {
                let old = messages.get((source, seq))?.map(|v| v.value().to_string());
                let Some(old) = old else { continue };
                let Ok(mut rec) = miniserde::json::from_str::<StoredMessage>(&old) else {
                    continue;
                };
                rec.attempts += 1;
                n += 1;
                let new = miniserde::json::to_string(&rec);
                delta += new.len() as i64 - old.len() as i64;
                messages.insert((source, seq), new.as_str())?;
            }
            bump(&txn, source, |c| {
                c.attempts += n;
                c.pending_bytes = c.pending_bytes.saturating_add_signed(delta);
                c.last_error = Some(error.to_string());
            })?;
        }
        txn.commit()?;
        Ok(())
    }

    /// Removes every message and dedupe entry past its `expires_at`; returns messages expired.
    pub fn sweep_expired(&self, now: u64) -> Result<u64> {
        let txn = self.db.begin_write()?;
        let n = expire_all(&txn, now)?;
        txn.open_table(DEDUPE)?.retain(|_, exp| exp > now)?;
        txn.commit()?;
        Ok(n)
    }

    /// Counters of every source that has any, including pending count and bytes.
    pub fn stats(&self) -> Result<Vec<(String, Counters)>> {
        let t = self.db.begin_read()?.open_table(COUNTERS)?;
        let mut out = Vec::new();
        for row in t.iter()? {
            let (k, v) = row?;
            out.push((
                k.value().to_string(),
                miniserde::json::from_str(v.value()).unwrap_or_default(),
            ));
        }
        Ok(out)
    }

    /// Bytes held by the outbox over all sources.
    pub fn total_bytes(&self) -> Result<u64> {
        Ok(self.stats()?.iter().map(|(_, c)| c.pending_bytes).sum())
    }
}

/// One transaction for a group of enqueues; every job learns the commit's outcome.
fn commit_group(db: &redb::Database, jobs: Vec<Job>) {
    let run = || -> Result<(WriteTransaction, Vec<Enqueued>)> {
        let txn = db.begin_write()?;
        let mut outcomes = Vec::with_capacity(jobs.len());
        for job in &jobs {
            outcomes.push(enqueue_in(&txn, &job.message, job.policy)?);
        }
        Ok((txn, outcomes))
    };
    let result = run().and_then(|(txn, outcomes)| {
        txn.commit()?;
        Ok(outcomes)
    });
    match result {
        Ok(outcomes) => {
            for (job, outcome) in jobs.into_iter().zip(outcomes) {
                let _ = job.done.send(Ok(outcome));
            }
        }
        Err(e) => {
            log::error!("outbox: commit of {} message(s) failed: {e}", jobs.len());
            for job in jobs {
                let _ = job.done.send(Err(StoreError(e.0.clone())));
            }
        }
    }
}

/// The enqueue rules of one message inside a (group) transaction.
fn enqueue_in(txn: &WriteTransaction, m: &NewMessage, policy: Policy) -> Result<Enqueued> {
    let src = m.source.as_str();
    {
        let dedupe = txn.open_table(DEDUPE)?;
        let seen = dedupe.get((src, m.message_id.as_str()))?.map(|v| v.value());
        if seen.is_some_and(|exp| exp > m.accepted_at) {
            return Ok(Enqueued::Duplicate);
        }
    }
    // Expiry at enqueue: this source's expired head goes first (FIFO with one TTL means the
    // expired messages are the oldest ones).
    expire_head(txn, src, m.accepted_at)?;

    let rec = StoredMessage {
        message_id: m.message_id.clone(),
        accepted_at: m.accepted_at,
        expires_at: m.expires_at,
        attempts: 0,
        reply_ref: m.reply_ref.as_ref().map(|(t, _)| t.clone()),
        payload: m.payload.clone(),
    };
    let value = miniserde::json::to_string(&rec);
    let size = record_bytes(src, &value);
    if size > policy.max_bytes_per_channel || size > policy.max_bytes_total {
        log::warn!(
            "outbox: {src}: message {} of {size} bytes can never fit the caps; refused",
            m.message_id
        );
        return Ok(Enqueued::CapacityExceeded);
    }
    let fits = |c: &Counters, total: u64| {
        c.pending < policy.max_messages_per_channel
            && c.pending_bytes + size <= policy.max_bytes_per_channel
            && total + size <= policy.max_bytes_total
    };
    let mut counters = counters_of(txn, src)?;
    let mut total = total_of(txn)?;
    if !fits(&counters, total) && total + size > policy.max_bytes_total {
        // Over the global cap: first reclaim expired messages everywhere.
        expire_all(txn, m.accepted_at)?;
        counters = counters_of(txn, src)?;
        total = total_of(txn)?;
    }
    let mut evicted = 0;
    if !fits(&counters, total) {
        if policy.overflow == Overflow::RejectNew {
            log::warn!(
                "outbox: {src}: caps full, overflow = reject_new: message {} refused",
                m.message_id
            );
            return Ok(Enqueued::CapacityExceeded);
        }
        // drop_oldest: evict this source's oldest pending messages until the new one fits.
        let mut messages = txn.open_table(MESSAGES)?;
        let mut refs = txn.open_table(REPLY_REFS)?;
        while !fits(&counters, total) {
            let head = messages
                .range((src, 0)..=(src, u64::MAX))?
                .next()
                .transpose()?
                .map(|(k, v)| (k.value().1, v.value().to_string()));
            let Some((seq, old)) = head else { break };
            messages.remove((src, seq))?;
            let bytes = record_bytes(src, &old);
            if let Ok(r) = miniserde::json::from_str::<StoredMessage>(&old) {
                if let Some(t) = r.reply_ref {
                    refs.remove(t.as_str())?;
                }
            }
            counters.pending = counters.pending.saturating_sub(1);
            counters.pending_bytes = counters.pending_bytes.saturating_sub(bytes);
            total = total.saturating_sub(bytes);
            evicted += 1;
        }
        drop((messages, refs));
        counters.evicted += evicted;
        put_counters(txn, src, &counters)?;
        if evicted > 0 {
            log::warn!("outbox: {src}: evicted {evicted} oldest pending message(s): capacity_exceeded");
        }
        if !fits(&counters, total) {
            // This source is empty and the others fill the global cap.
            log::warn!(
                "outbox: {src}: max_bytes_total reached by other channels: message {} refused",
                m.message_id
            );
            return Ok(Enqueued::CapacityExceeded);
        }
    }

    txn.open_table(DEDUPE)?
        .insert((src, m.message_id.as_str()), m.expires_at)?;
    let mut messages = txn.open_table(MESSAGES)?;
    let next = messages
        .range((src, 0)..=(src, u64::MAX))?
        .next_back()
        .transpose()?
        .map_or(0, |(k, _)| k.value().1 + 1);
    messages.insert((src, next), value.as_str())?;
    drop(messages);
    if let Some((token, r)) = &m.reply_ref {
        txn.open_table(REPLY_REFS)?
            .insert(token.as_str(), miniserde::json::to_string(r).as_str())?;
    }
    bump(txn, src, |c| {
        c.pending += 1;
        c.pending_bytes += size;
    })?;
    Ok(Enqueued::Accepted {
        expires_at: m.expires_at,
        evicted,
    })
}

/// An expired message to remove: seq, stored value length, its reply reference.
type Gone = (u64, usize, Option<String>);

/// Removes the expired messages at the head of one source.
fn expire_head(txn: &WriteTransaction, src: &str, now: u64) -> Result<u64> {
    let mut gone = Vec::new();
    {
        let messages = txn.open_table(MESSAGES)?;
        for row in messages.range((src, 0)..=(src, u64::MAX))? {
            let (k, v) = row?;
            match miniserde::json::from_str::<StoredMessage>(v.value()) {
                Ok(r) if r.expires_at <= now => gone.push((k.value().1, v.value().len(), r.reply_ref)),
                _ => break,
            }
        }
    }
    remove_expired(txn, src, gone)
}

/// Removes every expired message of every source.
fn expire_all(txn: &WriteTransaction, now: u64) -> Result<u64> {
    let mut per_source: Vec<(String, Vec<Gone>)> = Vec::new();
    {
        let messages = txn.open_table(MESSAGES)?;
        for row in messages.iter()? {
            let (k, v) = row?;
            let (src, seq) = k.value();
            let Ok(r) = miniserde::json::from_str::<StoredMessage>(v.value()) else {
                continue;
            };
            if r.expires_at > now {
                continue;
            }
            match per_source.last_mut() {
                Some((s, list)) if s == src => list.push((seq, v.value().len(), r.reply_ref)),
                _ => per_source.push((src.to_string(), vec![(seq, v.value().len(), r.reply_ref)])),
            }
        }
    }
    let mut n = 0;
    for (src, gone) in per_source {
        n += remove_expired(txn, &src, gone)?;
    }
    Ok(n)
}

fn remove_expired(txn: &WriteTransaction, src: &str, gone: Vec<(u64, usize, Option<String>)>) -> Result<u64> {
    if gone.is_empty() {
        return Ok(0);
    }
    let n = gone.len() as u64;
    let mut freed = 0;
    {
        let mut messages = txn.open_table(MESSAGES)?;
        let mut refs = txn.open_table(REPLY_REFS)?;
        for (seq, len, reply_ref) in gone {
            messages.remove((src, seq))?;
            freed += (src.len() + 8 + len) as u64;
            if let Some(t) = reply_ref {
                refs.remove(t.as_str())?;
            }
        }
    }
    bump(txn, src, |c| {
        c.expired += n;
        c.pending = c.pending.saturating_sub(n);
        c.pending_bytes = c.pending_bytes.saturating_sub(freed);
    })?;
    log::warn!("outbox: {src}: {n} message(s) expired undelivered");
    Ok(n)
}

fn counters_of(txn: &WriteTransaction, src: &str) -> Result<Counters> {
    let t = txn.open_table(COUNTERS)?;
    let c = t
        .get(src)?
        .and_then(|v| miniserde::json::from_str(v.value()).ok())
        .unwrap_or_default();
    Ok(c)
}

fn put_counters(txn: &WriteTransaction, src: &str, c: &Counters) -> Result<()> {
    txn.open_table(COUNTERS)?
        .insert(src, miniserde::json::to_string(c).as_str())?;
    Ok(())
}

fn bump(txn: &WriteTransaction, src: &str, f: impl FnOnce(&mut Counters)) -> Result<()> {
    let mut c = counters_of(txn, src)?;
    f(&mut c);
    put_counters(txn, src, &c)
}

fn total_of(txn: &WriteTransaction) -> Result<u64> {
    let t = txn.open_table(COUNTERS)?;
    let mut total = 0;
    for row in t.iter()? {
        let (_, v) = row?;
        total += miniserde::json::from_str::<Counters>(v.value()).map_or(0, |c| c.pending_bytes);
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids;

    fn store() -> Store {
        let dir = std::env::temp_dir().join(format!("imgate-outbox-{}", ids::random_hex(4)));
        Store::open(&dir).unwrap()
    }

    const ROOMY: Policy = Policy {
        max_messages_per_channel: 1000,
        max_bytes_per_channel: 1 << 20,
        max_bytes_total: 1 << 22,
        overflow: Overflow::DropOldest,
    };

    fn msg(id: &str, now: u64, ttl: u64) -> NewMessage {
        msg_in("webhook:a", id, now, ttl)
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
        }
    }

    fn ids_of(s: &Store, src: &str, now: u64) -> Vec<String> {
        s.pending(src, 100, now)
            .unwrap()
            .into_iter()
            .map(|p| p.message.message_id)
            .collect()
    }

    fn counters(s: &Store, src: &str) -> Counters {
        s.stats()
            .unwrap()
            .into_iter()
            .find(|(k, _)| k == src)
            .map(|(_, c)| c)
            .unwrap_or_default()
    }

    /// The counters must always agree with what the table holds.
    fn assert_accounting(s: &Store) {
        let txn = s.db.begin_read().unwrap();
        let t = txn.open_table(MESSAGES).unwrap();
        let mut per: std::collections::BTreeMap<String, (u64, u64)> = Default::default();
        let mut total = 0;
        for row in t.iter().unwrap() {
            let (k, v) = row.unwrap();
            let b = record_bytes(k.value().0, v.value());
            let e = per.entry(k.value().0.to_string()).or_default();
            e.0 += 1;
            e.1 += b;
            total += b;
        }
        for (src, c) in s.stats().unwrap() {
            let (n, b) = per.get(&src).copied().unwrap_or_default();
            assert_eq!((c.pending, c.pending_bytes), (n, b), "counters of {src}");
        }
        assert_eq!(s.total_bytes().unwrap(), total);
    }

    #[test]
    fn messages_come_out_in_acceptance_order_and_leave_only_when_delivered() {
        let s = store();
        for id in ["m1", "m2", "m3"] {
            assert!(matches!(
                s.enqueue(msg(id, 1000, 60_000), ROOMY).unwrap(),
                Enqueued::Accepted { .. }
            ));
        }
        let p = s.pending("webhook:a", 10, 1000).unwrap();
        assert_eq!(ids_of(&s, "webhook:a", 1000), ["m1", "m2", "m3"]);
        s.mark_attempt_failed("webhook:a", &[p[0].seq], "disconnected").unwrap();
        s.mark_delivered("webhook:a", &[p[1].seq]).unwrap();
        let p = s.pending("webhook:a", 10, 1000).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].message.attempts, 1);
        assert_eq!(
            p[0].message.expires_at, 61_000,
            "a failed attempt never moves expires_at"
        );
        let c = counters(&s, "webhook:a");
        assert_eq!(
            (c.delivered, c.attempts, c.last_error.as_deref()),
            (1, 1, Some("disconnected"))
        );
        assert_accounting(&s);
    }

    #[test]
    fn a_repeated_message_id_is_a_duplicate_even_after_delivery() {
        let s = store();
        s.enqueue(msg("m1", 1000, 60_000), ROOMY).unwrap();
        let p = s.pending("webhook:a", 10, 1000).unwrap();
        s.mark_delivered("webhook:a", &[p[0].seq]).unwrap();
        assert_eq!(s.enqueue(msg("m1", 2000, 60_000), ROOMY).unwrap(), Enqueued::Duplicate);
        assert!(s.pending("webhook:a", 10, 2000).unwrap().is_empty());
        // After the TTL the dedupe entry is gone and the ID is new again.
        s.sweep_expired(62_000).unwrap();
        assert!(matches!(
            s.enqueue(msg("m1", 62_000, 60_000), ROOMY).unwrap(),
            Enqueued::Accepted { .. }
        ));
    }

    #[test]
    fn expired_messages_are_never_pending_and_the_sweep_counts_them_and_drops_their_reply_refs() {
        let s = store();
        s.enqueue(msg("old", 1000, 10), ROOMY).unwrap();
        s.enqueue(msg("new", 1000, 60_000), ROOMY).unwrap();
        assert_eq!(ids_of(&s, "webhook:a", 2000), ["new"], "expiry on read");
        assert!(s.reply_ref("rr_old").unwrap().is_some());
        assert_eq!(s.sweep_expired(2000).unwrap(), 1);
        assert!(
            s.reply_ref("rr_old").unwrap().is_none(),
            "temporary state goes with the message"
        );
        assert!(s.reply_ref("rr_new").unwrap().is_some());
        let c = counters(&s, "webhook:a");
        assert_eq!((c.pending, c.expired), (1, 1));
        assert_accounting(&s);
    }

    #[test]
    fn enqueue_expires_the_head_of_its_source() {
        let s = store();
        s.enqueue(msg("old", 1000, 10), ROOMY).unwrap();
        s.enqueue(msg("new", 5000, 60_000), ROOMY).unwrap();
        assert_eq!(counters(&s, "webhook:a").expired, 1);
        assert!(s.reply_ref("rr_old").unwrap().is_none());
        assert_accounting(&s);
    }

    #[test]
    fn drop_oldest_evicts_at_the_message_cap() {
        let s = store();
        let p = Policy {
            max_messages_per_channel: 3,
            ..ROOMY
        };
        for i in 0..5 {
            s.enqueue(msg(&format!("m{i}"), 1000, 60_000), p).unwrap();
        }
        assert_eq!(ids_of(&s, "webhook:a", 1000), ["m2", "m3", "m4"]);
        assert_eq!(counters(&s, "webhook:a").evicted, 2);
        assert!(s.reply_ref("rr_m0").unwrap().is_none());
        assert_accounting(&s);
    }

    #[test]
    fn drop_oldest_evicts_at_the_channel_byte_cap() {
        let s = store();
        let one = record_bytes(
            "webhook:a",
            &miniserde::json::to_string(&StoredMessage {
                message_id: "m0".into(),
                accepted_at: 1000,
                expires_at: 61_000,
                attempts: 0,
                reply_ref: Some("rr_m0".into()),
                payload: "{\"message_id\":\"m0\"}".into(),
            }),
        );
        let p = Policy {
            max_bytes_per_channel: one * 2,
            ..ROOMY
        };
        for i in 0..4 {
            s.enqueue(msg(&format!("m{i}"), 1000, 60_000), p).unwrap();
        }
        assert_eq!(ids_of(&s, "webhook:a", 1000), ["m2", "m3"]);
        assert_eq!(counters(&s, "webhook:a").evicted, 2);
        assert!(counters(&s, "webhook:a").pending_bytes <= one * 2);
        assert_accounting(&s);
    }

    #[test]
    fn reject_new_refuses_at_each_cap_and_stores_nothing() {
        let s = store();
        let p = Policy {
            max_messages_per_channel: 2,
            overflow: Overflow::RejectNew,
            ..ROOMY
        };
        s.enqueue(msg("m0", 1000, 60_000), p).unwrap();
        s.enqueue(msg("m1", 1000, 60_000), p).unwrap();
        assert_eq!(
            s.enqueue(msg("m2", 1000, 60_000), p).unwrap(),
            Enqueued::CapacityExceeded
        );
        assert!(s.reply_ref("rr_m2").unwrap().is_none());
        assert_eq!(ids_of(&s, "webhook:a", 1000), ["m0", "m1"]);
        // Not deduped: the sender may retry once there is room.
        let p2 = Policy {
            max_messages_per_channel: 3,
            ..p
        };
        assert!(matches!(
            s.enqueue(msg("m2", 1000, 60_000), p2).unwrap(),
            Enqueued::Accepted { .. }
        ));

        let s = store();
        let p = Policy {
            max_bytes_total: 150,
            overflow: Overflow::RejectNew,
            ..ROOMY
        };
        s.enqueue(msg_in("webhook:a", "a0", 1000, 60_000), p).unwrap();
        assert_eq!(
            s.enqueue(msg_in("webhook:b", "b0", 1000, 60_000), p).unwrap(),
            Enqueued::CapacityExceeded
        );
        assert_eq!(counters(&s, "webhook:a").evicted, 0);
        assert_accounting(&s);
    }

    #[test]
    fn the_total_cap_reclaims_expired_messages_before_it_refuses() {
        let s = store();
        let one = {
            let tmp = store();
            tmp.enqueue(msg_in("webhook:b", "b0", 1000, 10), ROOMY).unwrap();
            tmp.total_bytes().unwrap()
        };
        let p = Policy {
            max_bytes_total: one + one / 2,
            ..ROOMY
        };
        s.enqueue(msg_in("webhook:b", "b0", 1000, 10), p).unwrap();
        // b0 expired; a0 needs its room, in another source.
        let r = s.enqueue(msg_in("webhook:a", "a0", 5000, 60_000), p).unwrap();
        assert!(matches!(r, Enqueued::Accepted { .. }), "{r:?}");
        assert_eq!(counters(&s, "webhook:b").expired, 1);
        // With drop_oldest, a full total cap held by another source refuses rather than
        // evicting someone else's messages.
        let r = s.enqueue(msg_in("webhook:c", "c0", 5000, 60_000), p).unwrap();
        assert_eq!(r, Enqueued::CapacityExceeded);
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
                        let src = format!("webhook:t{t}");
                        let r = s
                            .enqueue(msg_in(&src, &format!("{i:03}"), 1000, 60_000), ROOMY)
                            .unwrap();
                        assert!(matches!(r, Enqueued::Accepted { .. }));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        for t in 0..8 {
            let ids = ids_of(&s, &format!("webhook:t{t}"), 1000);
            let want: Vec<String> = (0..50).map(|i| format!("{i:03}")).take(ids.len()).collect();
            assert_eq!(ids.len(), 50);
            assert_eq!(ids, want);
        }
        assert_accounting(&s);
    }
}
