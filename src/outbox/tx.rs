//! One outbox transaction: its four tables open, and every change made through it recorded as
//! a redo record for the write-ahead log (`log.rs`). Replaying a record applies the same puts
//! and removes through the same methods, so a replay cannot differ from what live traffic did:
//! no rule (TTL, caps, dedupe) is evaluated a second time, and applying a record twice leaves
//! the same tables as applying it once.
//!
//! Record payload, little-endian, one change after another:
//!
//! ```text
//! change = op:u8 key [value]      op = table (1..=5), | 0x80 for a remove (no value)
//! key    = len:u16 utf8[len] [seq:u64]      (seq only for `messages` and `delivered`)
//! value  = len:u32 utf8[len]
//! ```

use redb::{Table, TableDefinition, WriteTransaction};

use crate::store::{self, Result, StoreError};

/// `(source, seq)` → record (`record.rs`). `seq` grows per source: key order is acceptance order.
pub const MESSAGES: TableDefinition<(&str, u64), &str> = TableDefinition::new("messages");
/// `(source, seq)` → `"expires_at reply_ref message_id"` of delivered messages, for dedupe.
pub const DELIVERED: TableDefinition<(&str, u64), &str> = TableDefinition::new("delivered");
/// source → `Tally` JSON.
pub const COUNTERS: TableDefinition<&str, &str> = TableDefinition::new("counters");
/// reply_ref token → `ReplyRef` JSON; a reference leaves with its message or its dedupe entry.
pub const REPLY_REFS: TableDefinition<&str, &str> = TableDefinition::new("reply_refs");

const T_MESSAGES: u8 = 1;
const T_DELIVERED: u8 = 2;
const T_COUNTERS: u8 = 3;
const T_REPLY_REFS: u8 = 4;
/// A provider's cursor in the store's `meta` table, advanced with the messages it covers.
const T_META: u8 = 5;
const REMOVE: u8 = 0x80;

type SeqTable<'t> = Table<'t, (&'static str, u64), &'static str>;
type NameTable<'t> = Table<'t, &'static str, &'static str>;

pub struct Tx<'t> {
    txn: &'t WriteTransaction,
    pub messages: SeqTable<'t>,
    pub delivered: SeqTable<'t>,
    pub counters: NameTable<'t>,
    pub reply_refs: NameTable<'t>,
    redo: Vec<u8>,
}

impl<'t> Tx<'t> {
    pub fn open(txn: &'t WriteTransaction) -> Result<Tx<'t>> {
        Ok(Tx {
            txn,
            messages: txn.open_table(MESSAGES)?,
            delivered: txn.open_table(DELIVERED)?,
            counters: txn.open_table(COUNTERS)?,
            reply_refs: txn.open_table(REPLY_REFS)?,
            redo: Vec::new(),
        })
    }

    /// The redo record of everything changed so far (empty: nothing changed).
    pub fn into_redo(self) -> Vec<u8> {
        self.redo
    }

    pub fn put_message(&mut self, src: &str, seq: u64, value: &str) -> Result<()> {
        framable(src, value)?;
        self.messages.insert((src, seq), value)?;
        self.note(T_MESSAGES, src, Some(seq), Some(value));
        Ok(())
    }

    pub fn remove_message(&mut self, src: &str, seq: u64) -> Result<Option<String>> {
        framable(src, "")?;
        let old = self.messages.remove((src, seq))?.map(|v| v.value().to_string());
        if old.is_some() {
            self.note(T_MESSAGES | REMOVE, src, Some(seq), None);
        }
        Ok(old)
    }

    pub fn put_delivered(&mut self, src: &str, seq: u64, value: &str) -> Result<()> {
        framable(src, value)?;
        self.delivered.insert((src, seq), value)?;
        self.note(T_DELIVERED, src, Some(seq), Some(value));
        Ok(())
    }

    pub fn remove_delivered(&mut self, src: &str, seq: u64) -> Result<Option<String>> {
        framable(src, "")?;
        let old = self.delivered.remove((src, seq))?.map(|v| v.value().to_string());
        if old.is_some() {
            self.note(T_DELIVERED | REMOVE, src, Some(seq), None);
        }
        Ok(old)
    }

    pub fn put_counter(&mut self, src: &str, value: &str) -> Result<()> {
        framable(src, value)?;
        self.counters.insert(src, value)?;
        self.note(T_COUNTERS, src, None, Some(value));
        Ok(())
    }

    pub fn put_reply_ref(&mut self, token: &str, value: &str) -> Result<()> {
        framable(token, value)?;
        self.reply_refs.insert(token, value)?;
        self.note(T_REPLY_REFS, token, None, Some(value));
        Ok(())
    }

    pub fn remove_reply_ref(&mut self, token: &str) -> Result<()> {
        framable(token, "")?;
        if self.reply_refs.remove(token)?.is_some() {
            self.note(T_REPLY_REFS | REMOVE, token, None, None);
        }
        Ok(())
    }

    /// A `meta` value (a provider's cursor) read in this transaction.
    pub fn meta(&self, key: &str) -> Result<Option<String>> {
        store::meta_in(self.txn, key)
    }

    pub fn set_meta(&mut self, key: &str, value: &str) -> Result<()> {
        framable(key, value)?;
        store::set_meta(self.txn, key, Some(value))?;
        self.note(T_META, key, None, Some(value));
        Ok(())
    }

    fn note(&mut self, op: u8, key: &str, seq: Option<u64>, value: Option<&str>) {
        self.redo.push(op);
        self.redo.extend_from_slice(&(key.len() as u16).to_le_bytes());
        self.redo.extend_from_slice(key.as_bytes());
        if let Some(seq) = seq {
            self.redo.extend_from_slice(&seq.to_le_bytes());
        }
        if let Some(v) = value {
            self.redo.extend_from_slice(&(v.len() as u32).to_le_bytes());
            self.redo.extend_from_slice(v.as_bytes());
        }
    }

    /// Applies a redo record (replay). A record that does not parse changes nothing.
    pub fn apply(&mut self, record: &[u8]) -> Result<()> {
        for change in parse(record).map_err(|why| StoreError::Corrupt(format!("outbox log record: {why}")))? {
            match change {
                Change::Put(T_MESSAGES, key, Some(seq), v) => self.put_message(key, seq, v)?,
                Change::Put(T_DELIVERED, key, Some(seq), v) => self.put_delivered(key, seq, v)?,
                Change::Put(T_COUNTERS, key, None, v) => self.put_counter(key, v)?,
                Change::Put(T_REPLY_REFS, key, None, v) => self.put_reply_ref(key, v)?,
                Change::Put(T_META, key, None, v) => self.set_meta(key, v)?,
                Change::Remove(T_MESSAGES, key, Some(seq)) => drop(self.remove_message(key, seq)?),
                Change::Remove(T_DELIVERED, key, Some(seq)) => drop(self.remove_delivered(key, seq)?),
                Change::Remove(T_REPLY_REFS, key, None) => self.remove_reply_ref(key)?,
                _ => return Err(StoreError::Corrupt("outbox log record: unknown change".into())),
            }
        }
        Ok(())
    }
}

/// Keys are source names, tokens and meta keys (short, chosen by imgate) and values are bounded
/// by the body limit; one that the redo format cannot frame is refused before it is stored.
fn framable(key: &str, value: &str) -> Result<()> {
    if key.len() > u16::MAX as usize || value.len() > u32::MAX as usize {
        return Err(StoreError::Internal(format!(
            "a key of {} bytes cannot be logged",
            key.len()
        )));
    }
    Ok(())
}

/// One decoded change: table, key, seq (for the seq-keyed tables), value.
#[derive(Debug, PartialEq)]
pub enum Change<'a> {
    Put(u8, &'a str, Option<u64>, &'a str),
    Remove(u8, &'a str, Option<u64>),
}

/// Decodes a whole redo record, or says why it cannot be.
pub fn parse(mut b: &[u8]) -> std::result::Result<Vec<Change<'_>>, &'static str> {
    fn take<'a>(b: &mut &'a [u8], n: usize) -> std::result::Result<&'a [u8], &'static str> {
        if b.len() < n {
            return Err("cut short");
        }
        let (head, rest) = b.split_at(n);
        *b = rest;
        Ok(head)
    }
    fn text<'a>(b: &mut &'a [u8], n: usize) -> std::result::Result<&'a str, &'static str> {
        std::str::from_utf8(take(b, n)?).map_err(|_| "not UTF-8")
    }
    let mut out = Vec::new();
    while let Some((&op, rest)) = b.split_first() {
        b = rest;
        let table = op & !REMOVE;
        if !(T_MESSAGES..=T_META).contains(&table) {
            return Err("unknown table");
        }
        let klen = take(&mut b, 2)?;
        let key = text(&mut b, u16::from_le_bytes([klen[0], klen[1]]) as usize)?;
        let seq = if table == T_MESSAGES || table == T_DELIVERED {
            let s = take(&mut b, 8)?;
            let mut a = [0u8; 8];
            a.copy_from_slice(s);
            Some(u64::from_le_bytes(a))
        } else {
            None
        };
        if op & REMOVE != 0 {
            out.push(Change::Remove(table, key, seq));
        } else {
            let vlen = take(&mut b, 4)?;
            let n = u32::from_le_bytes([vlen[0], vlen[1], vlen[2], vlen[3]]) as usize;
            out.push(Change::Put(table, key, seq, text(&mut b, n)?));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Vec<u8> {
        let (db, _dir) = store::temp_db("tx");
        db.write(|txn| {
            let mut tx = Tx::open(txn)?;
            tx.messages.insert(("webhook:a", 3), "x")?;
            tx.reply_refs.insert("rr_y", "y")?;
            tx.put_message("webhook:a", 7, "{\"h\":1}\npayload")?;
            tx.remove_message("webhook:a", 3)?;
            // Removing what is not there changes nothing, and is not recorded.
            tx.remove_message("webhook:a", 99)?;
            tx.put_delivered("webhook:a", 2, "1000 - m2")?;
            tx.put_counter("webhook:a", "{}")?;
            tx.put_reply_ref("rr_x", "{\"r\":1}")?;
            tx.remove_reply_ref("rr_y")?;
            tx.set_meta("cursor:x", "42")?;
            Ok(tx.into_redo())
        })
        .unwrap()
    }

    #[test]
    fn a_redo_record_lists_every_change_in_order() {
        let r = record();
        let changes = parse(&r).unwrap();
        assert_eq!(
            changes,
            [
                Change::Put(T_MESSAGES, "webhook:a", Some(7), "{\"h\":1}\npayload"),
                Change::Remove(T_MESSAGES, "webhook:a", Some(3)),
                Change::Put(T_DELIVERED, "webhook:a", Some(2), "1000 - m2"),
                Change::Put(T_COUNTERS, "webhook:a", None, "{}"),
                Change::Put(T_REPLY_REFS, "rr_x", None, "{\"r\":1}"),
                Change::Remove(T_REPLY_REFS, "rr_y", None),
                Change::Put(T_META, "cursor:x", None, "42"),
            ]
        );
    }

    #[test]
    fn applying_a_record_twice_leaves_what_applying_it_once_does() {
        let r = record();
        let (db, _dir) = store::temp_db("tx-apply");
        for _ in 0..2 {
            db.write(|txn| Tx::open(txn)?.apply(&r)).unwrap();
        }
        db.read(|txn| {
            let m = txn.open_table(MESSAGES)?;
            assert_eq!(m.get(("webhook:a", 7))?.unwrap().value(), "{\"h\":1}\npayload");
            assert_eq!(store::meta(txn, "cursor:x")?.as_deref(), Some("42"));
            Ok(())
        })
        .unwrap();
    }

    #[test]
    fn malformed_records_are_refused_whole_and_never_panic() {
        let r = record();
        assert!(parse(&r[..r.len() - 1]).is_err());
        assert!(parse(&[0x09, 0, 0]).is_err());
        for m in crate::testutil::mutations(&[&r], 3000, 5) {
            let _ = parse(&m);
        }
    }
}
