//! The durable outbox: per-source FIFO of accepted inbound messages, dedupe and counters.
//!
//! A *source* is where messages come from (`webhook:NAME`); the channel bound to a source
//! receives its queue. Messages accepted before any binding wait here under the same TTL.
//!
//! Invariants:
//! - A message is accepted (and its sender told so) only after the commit that stores it.
//! - `expires_at = accepted_at + ttl` is written once, at acceptance, and never changed.
//! - A message leaves the queue in exactly three ways, each counted: delivered (a `pong` answered
//!   a `ping` sent after its push), expired, or evicted.
//! - Dedupe entries live until the message's `expires_at`, so a sender retry within the TTL is
//!   answered `duplicate` even after delivery.

use miniserde::{Deserialize, Serialize};
use redb::{ReadableDatabase, ReadableTable, TableDefinition, WriteTransaction};

use crate::store::{ReplyRef, Result, Store, REPLY_REFS};

/// `(source, seq)` → `StoredMessage` JSON. `seq` grows per source, so key order is acceptance order.
const MESSAGES: TableDefinition<(&str, u64), &str> = TableDefinition::new("messages");
/// `(source, message_id)` → `expires_at`.
const DEDUPE: TableDefinition<(&str, &str), u64> = TableDefinition::new("dedupe");
/// source → `Counters` JSON.
const COUNTERS: TableDefinition<&str, &str> = TableDefinition::new("counters");

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
    /// The rendered `message.push` payload, exactly as it will go on the wire.
    pub payload: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct Counters {
    pub delivered: u64,
    pub expired: u64,
    pub evicted: u64,
    pub attempts: u64,
    pub last_error: Option<String>,
}

/// What an enqueue did.
#[derive(Debug, PartialEq)]
pub enum Enqueued {
    Accepted { expires_at: u64 },
    Duplicate,
}

/// A pending message as delivery sees it.
#[derive(Debug, Clone)]
pub struct Pending {
    pub seq: u64,
    pub message: StoredMessage,
}

/// Per-source view for `/status`.
#[derive(Debug, Default, Clone)]
pub struct SourceStats {
    pub pending: u64,
    pub pending_bytes: u64,
    pub counters: Counters,
}

/// A message to accept.
pub struct NewMessage<'a> {
    pub source: &'a str,
    pub message_id: &'a str,
    pub payload: String,
    pub reply_ref: Option<(String, ReplyRef)>,
    pub accepted_at: u64,
    pub expires_at: u64,
}

impl Store {
    /// Accepts a message durably, or answers `Duplicate` and stores nothing.
    pub fn enqueue(&self, m: NewMessage<'_>) -> Result<Enqueued> {
        let txn = self.db.begin_write()?;
        let outcome = {
            let mut dedupe = txn.open_table(DEDUPE)?;
            let seen = dedupe.get((m.source, m.message_id))?.map(|v| v.value());
            if seen.is_some_and(|exp| exp > m.accepted_at) {
                Enqueued::Duplicate
            } else {
                dedupe.insert((m.source, m.message_id), m.expires_at)?;
                let mut messages = txn.open_table(MESSAGES)?;
                let next = messages
                    .range((m.source, 0)..=(m.source, u64::MAX))?
                    .next_back()
                    .transpose()?
                    .map_or(0, |(k, _)| k.value().1 + 1);
                let rec = StoredMessage {
                    message_id: m.message_id.to_string(),
                    accepted_at: m.accepted_at,
                    expires_at: m.expires_at,
                    attempts: 0,
                    payload: m.payload,
                };
                messages.insert((m.source, next), miniserde::json::to_string(&rec).as_str())?;
                if let Some((token, r)) = &m.reply_ref {
                    txn.open_table(REPLY_REFS)?
                        .insert(token.as_str(), miniserde::json::to_string(r).as_str())?;
                }
                Enqueued::Accepted {
                    expires_at: m.expires_at,
                }
            }
        };
        if outcome == Enqueued::Duplicate {
            txn.abort()?;
        } else {
            txn.commit()?;
        }
        Ok(outcome)
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
            // Expired heads are skipped here and removed by the next sweep: never delivered.
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
            for &seq in seqs {
                n += u64::from(messages.remove((source, seq))?.is_some());
            }
            bump(&txn, source, |c| c.delivered += n)?;
        }
        txn.commit()?;
        Ok(n)
    }

    /// The connection failed before the boundary: the messages stay pending, `attempts + 1`.
    pub fn mark_attempt_failed(&self, source: &str, seqs: &[u64], error: &str) -> Result<()> {
        let txn = self.db.begin_write()?;
        {
            let mut messages = txn.open_table(MESSAGES)?;
            let mut n = 0;
            for &seq in seqs {
                let rec = messages
                    .get((source, seq))?
                    .and_then(|v| miniserde::json::from_str::<StoredMessage>(v.value()).ok());
                if let Some(mut rec) = rec {
                    rec.attempts += 1;
                    n += 1;
                    messages.insert((source, seq), miniserde::json::to_string(&rec).as_str())?;
                }
            }
            bump(&txn, source, |c| {
                c.attempts += n;
                c.last_error = Some(error.to_string());
            })?;
        }
        txn.commit()?;
        Ok(())
    }

    /// Removes every message and dedupe entry past its `expires_at`; returns messages expired.
    pub fn sweep_expired(&self, now: u64) -> Result<u64> {
        let txn = self.db.begin_write()?;
        let mut expired_per_source: Vec<(String, u64)> = Vec::new();
        {
            let mut messages = txn.open_table(MESSAGES)?;
            messages.retain(|(source, _), v| {
                let keep =
                    miniserde::json::from_str::<StoredMessage>(v).is_ok_and(|m| m.expires_at > now);
                if !keep {
                    match expired_per_source.last_mut() {
                        Some((s, n)) if s == source => *n += 1,
                        _ => expired_per_source.push((source.to_string(), 1)),
                    }
                }
                keep
            })?;
            txn.open_table(DEDUPE)?.retain(|_, exp| exp > now)?;
            for (source, n) in &expired_per_source {
                bump(&txn, source, |c| c.expired += n)?;
            }
        }
        txn.commit()?;
        let total = expired_per_source.iter().map(|(_, n)| n).sum();
        for (source, n) in &expired_per_source {
            log::warn!("outbox: {n} message(s) of {source} expired undelivered");
        }
        Ok(total)
    }

    /// Pending count, pending bytes and counters of every source that has any.
    pub fn stats(&self) -> Result<Vec<(String, SourceStats)>> {
        let txn = self.db.begin_read()?;
        let mut out: Vec<(String, SourceStats)> = Vec::new();
        for row in txn.open_table(COUNTERS)?.iter()? {
            let (k, v) = row?;
            let counters = miniserde::json::from_str(v.value()).unwrap_or_default();
            out.push((
                k.value().to_string(),
                SourceStats {
                    counters,
                    ..Default::default()
                },
            ));
        }
        for row in txn.open_table(MESSAGES)?.iter()? {
            let (k, v) = row?;
            let source = k.value().0;
            let bytes = (v.value().len() + source.len() + 8) as u64;
            let idx = match out.iter().position(|(s, _)| s == source) {
                Some(i) => i,
                None => {
                    out.push((source.to_string(), SourceStats::default()));
                    out.len() - 1
                }
            };
            out[idx].1.pending += 1;
            out[idx].1.pending_bytes += bytes;
        }
        Ok(out)
    }
}

fn bump(txn: &WriteTransaction, source: &str, f: impl FnOnce(&mut Counters)) -> Result<()> {
    let mut t = txn.open_table(COUNTERS)?;
    let mut c: Counters = t
        .get(source)?
        .and_then(|v| miniserde::json::from_str(v.value()).ok())
        .unwrap_or_default();
    f(&mut c);
    t.insert(source, miniserde::json::to_string(&c).as_str())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids;

    fn store() -> Store {
        let dir = std::env::temp_dir().join(format!("imgate-outbox-{}", ids::random_hex(4)));
        Store::open(&dir).unwrap()
    }

    fn msg<'a>(id: &'a str, now: u64, ttl: u64) -> NewMessage<'a> {
        NewMessage {
            source: "webhook:a",
            message_id: id,
            payload: format!("{{\"message_id\":\"{id}\"}}"),
            reply_ref: None,
            accepted_at: now,
            expires_at: now + ttl,
        }
    }

    #[test]
    fn messages_come_out_in_acceptance_order_and_leave_only_when_delivered() {
        let s = store();
        for id in ["m1", "m2", "m3"] {
            assert!(matches!(
                s.enqueue(msg(id, 1000, 60_000)).unwrap(),
                Enqueued::Accepted { .. }
            ));
        }
        let p = s.pending("webhook:a", 10, 1000).unwrap();
        let ids: Vec<_> = p.iter().map(|p| p.message.message_id.as_str()).collect();
        assert_eq!(ids, ["m1", "m2", "m3"]);
        s.mark_attempt_failed("webhook:a", &[p[0].seq], "disconnected")
            .unwrap();
        s.mark_delivered("webhook:a", &[p[1].seq]).unwrap();
        let p = s.pending("webhook:a", 10, 1000).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].message.attempts, 1);
        assert_eq!(
            p[0].message.expires_at, 61_000,
            "a failed attempt never moves expires_at"
        );
    }

    #[test]
    fn a_repeated_message_id_is_a_duplicate_even_after_delivery() {
        let s = store();
        s.enqueue(msg("m1", 1000, 60_000)).unwrap();
        let p = s.pending("webhook:a", 10, 1000).unwrap();
        s.mark_delivered("webhook:a", &[p[0].seq]).unwrap();
        assert_eq!(
            s.enqueue(msg("m1", 2000, 60_000)).unwrap(),
            Enqueued::Duplicate
        );
        assert!(s.pending("webhook:a", 10, 2000).unwrap().is_empty());
    }

    #[test]
    fn expired_messages_are_never_pending_and_are_counted_by_the_sweep() {
        let s = store();
        s.enqueue(msg("old", 1000, 10)).unwrap();
        s.enqueue(msg("new", 1000, 60_000)).unwrap();
        let p = s.pending("webhook:a", 10, 2000).unwrap();
        assert_eq!(p.len(), 1);
        assert_eq!(s.sweep_expired(2000).unwrap(), 1);
        let stats = s.stats().unwrap();
        let (_, st) = stats.iter().find(|(src, _)| src == "webhook:a").unwrap();
        assert_eq!((st.pending, st.counters.expired), (1, 1));
    }
}
