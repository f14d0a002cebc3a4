//! One outbox transaction over the overlay (`overlay.rs`): reads see the overlay over redb as
//! of the last checkpoint; every put and remove changes the overlay, is recorded as a redo
//! record for the write-ahead log (`wal.rs`), and can be taken back (`Undo`) until that record
//! is logged. Replaying a record applies the same puts and removes through the same methods, so
//! a replay cannot differ from what live traffic did: no rule (TTL, caps, dedupe) is evaluated
//! a second time, and applying a record twice leaves the same state as applying it once.
//!
//! Record payload, little-endian, one change after another:
//!
//! ```text
//! change = op:u8 key [value]      op = table (1..=5), | 0x80 for a remove (no value)
//! key    = len:u16 utf8[len] [seq:u64]      (seq only for `messages` and `delivered`)
//! value  = len:u32 utf8[len]
//! ```

use std::borrow::Cow;
use std::cell::OnceCell;

use redb::{ReadOnlyTable, ReadTransaction, ReadableTable, TableDefinition};

use super::overlay::{layered, merge, Overlay, Row, Slot, Undo, Which};
use super::tables::{COUNTERS, DELIVERED, MESSAGES, REPLY_REFS};
use crate::store::{self, Result, StoreError};

const T_MESSAGES: u8 = 1;
const T_DELIVERED: u8 = 2;
const T_COUNTERS: u8 = 3;
const T_REPLY_REFS: u8 = 4;
/// A provider's cursor in the store's `meta` table, advanced with the messages it covers.
const T_META: u8 = 5;
const REMOVE: u8 = 0x80;

type SeqTable = ReadOnlyTable<(&'static str, u64), &'static str>;
type NameTable = ReadOnlyTable<&'static str, &'static str>;

/// What lies under the overlay: redb as of the last checkpoint made (its tables opened once per
/// transaction when first read), and over it the overlay a checkpoint in flight is writing into
/// it (`durable.rs`), if one is.
pub struct Base<'t> {
    txn: &'t ReadTransaction,
    writing: Option<&'t Overlay>,
    messages: OnceCell<SeqTable>,
    delivered: OnceCell<SeqTable>,
    counters: OnceCell<NameTable>,
    reply_refs: OnceCell<NameTable>,
}

fn opened<'c, K: redb::Key + 'static, V: redb::Value + 'static>(
    txn: &ReadTransaction,
    cell: &'c OnceCell<ReadOnlyTable<K, V>>,
    def: TableDefinition<K, V>,
) -> Result<&'c ReadOnlyTable<K, V>> {
    if cell.get().is_none() {
        let _ = cell.set(txn.open_table(def)?);
    }
    cell.get()
        .ok_or_else(|| StoreError::Internal("an outbox table did not open".into()))
}

impl<'t> Base<'t> {
    pub fn new(txn: &'t ReadTransaction) -> Base<'t> {
        Base::under(txn, None)
    }

    /// redb with a checkpoint in flight writing `writing` into it.
    pub fn under(txn: &'t ReadTransaction, writing: Option<&'t Overlay>) -> Base<'t> {
        Base {
            txn,
            writing,
            messages: OnceCell::new(),
            delivered: OnceCell::new(),
            counters: OnceCell::new(),
            reply_refs: OnceCell::new(),
        }
    }

    fn seq_table(&self, which: Which) -> Result<&SeqTable> {
        match which {
            Which::Delivered => opened(self.txn, &self.delivered, DELIVERED),
            _ => opened(self.txn, &self.messages, MESSAGES),
        }
    }

    fn get_seq(&self, which: Which, src: &str, seq: u64) -> Result<Option<String>> {
        if let Some(slot) = self
            .writing
            .and_then(|w| w.seq_layer(which).get(&(src.to_string(), seq)))
        {
            return Ok(slot_value(slot));
        }
        self.redb_seq(which, src, seq)
    }

    fn redb_seq(&self, which: Which, src: &str, seq: u64) -> Result<Option<String>> {
        Ok(self.seq_table(which)?.get((src, seq))?.map(|v| v.value().to_string()))
    }

    fn get_name(&self, which: Which, key: &str) -> Result<Option<String>> {
        if let Some(slot) = self.writing.and_then(|w| w.name_layer(which).get(key)) {
            return Ok(slot_value(slot));
        }
        self.redb_name(which, key)
    }

    fn redb_name(&self, which: Which, key: &str) -> Result<Option<String>> {
        if matches!(which, Which::Meta) {
            return store::meta(self.txn, key);
        }
        Ok(self.name_table(which)?.get(key)?.map(|v| v.value().to_string()))
    }

    /// Whether redb holds the row now, or may once the checkpoint in flight has committed (or
    /// failed: its overlay then comes back under this one): a remove must then leave `Gone`
    /// rather than drop the key from the overlay.
    fn may_hold_seq(&self, which: Which, src: &str, seq: u64) -> Result<bool> {
        let key = (src.to_string(), seq);
        if self.writing.is_some_and(|w| w.seq_layer(which).contains_key(&key)) {
            return Ok(true);
        }
        Ok(self.redb_seq(which, src, seq)?.is_some())
    }

    fn may_hold_name(&self, which: Which, key: &str) -> Result<bool> {
        if self.writing.is_some_and(|w| w.name_layer(which).contains_key(key)) {
            return Ok(true);
        }
        Ok(self.redb_name(which, key)?.is_some())
    }

    /// One source's rows of `messages` or `delivered` from `from` on, in key order.
    fn rows_from<'s>(
        &'s self,
        which: Which,
        src: &'s str,
        from: u64,
    ) -> Result<impl Iterator<Item = Row<'s, u64>> + 's> {
        let rows = self.seq_table(which)?.range((src, from)..=(src, u64::MAX))?;
        let rows = rows.map(|row| {
            let (k, v) = row?;
            Ok((k.value().1, Cow::Owned(v.value().to_string())))
        });
        let range = (src.to_string(), from)..=(src.to_string(), u64::MAX);
        let writing = self
            .writing
            .into_iter()
            .flat_map(move |w| w.seq_layer(which).range(range.clone()));
        Ok(layered(rows, writing.map(|((_, seq), slot)| (*seq, slot))))
    }

    /// Every row of `messages` or `delivered`, by source then seq.
    fn all_seq(&self, which: Which) -> Result<impl Iterator<Item = Row<'_, (String, u64)>> + '_> {
        let rows = self.seq_table(which)?.iter()?.map(|row| {
            let (k, v) = row?;
            let (src, seq) = k.value();
            Ok(((src.to_string(), seq), Cow::Owned(v.value().to_string())))
        });
        let writing = self.writing.into_iter().flat_map(move |w| w.seq_layer(which).iter());
        Ok(layered(rows, writing.map(|(k, slot)| (k.clone(), slot))))
    }

    /// Every row of `counters` or `reply_refs`, by key.
    fn all_named(&self, which: Which) -> Result<impl Iterator<Item = Row<'_, String>> + '_> {
        let rows = self.name_table(which)?.iter()?.map(|row| {
            let (k, v) = row?;
            Ok((k.value().to_string(), Cow::Owned(v.value().to_string())))
        });
        let writing = self.writing.into_iter().flat_map(move |w| w.name_layer(which).iter());
        Ok(layered(rows, writing.map(|(k, slot)| (k.clone(), slot))))
    }

    fn name_table(&self, which: Which) -> Result<&NameTable> {
        match which {
            Which::Counters => opened(self.txn, &self.counters, COUNTERS),
            _ => opened(self.txn, &self.reply_refs, REPLY_REFS),
        }
    }
}

fn slot_value(slot: &Slot) -> Option<String> {
    match slot {
        Slot::Put(v) => Some(v.clone()),
        Slot::Gone => None,
    }
}

/// Reads of the outbox: the overlay over redb.
pub struct Reader<'a> {
    base: &'a Base<'a>,
    ov: &'a Overlay,
}

impl<'a> Reader<'a> {
    pub fn new(base: &'a Base<'a>, ov: &'a Overlay) -> Reader<'a> {
        Reader { base, ov }
    }

    fn seq(&self, which: Which, src: &str, seq: u64) -> Result<Option<String>> {
        match self.ov.seq_layer(which).get(&(src.to_string(), seq)) {
            Some(Slot::Put(v)) => Ok(Some(v.clone())),
            Some(Slot::Gone) => Ok(None),
            None => self.base.get_seq(which, src, seq),
        }
    }

    fn name(&self, which: Which, key: &str) -> Result<Option<String>> {
        match self.ov.name_layer(which).get(key) {
            Some(Slot::Put(v)) => Ok(Some(v.clone())),
            Some(Slot::Gone) => Ok(None),
            None => self.base.get_name(which, key),
        }
    }

    pub fn message(&self, src: &str, seq: u64) -> Result<Option<String>> {
        self.seq(Which::Messages, src, seq)
    }

    pub fn delivered(&self, src: &str, seq: u64) -> Result<Option<String>> {
        self.seq(Which::Delivered, src, seq)
    }

    pub fn counter(&self, src: &str) -> Result<Option<String>> {
        self.name(Which::Counters, src)
    }

    pub fn reply_ref(&self, token: &str) -> Result<Option<String>> {
        self.name(Which::ReplyRefs, token)
    }

    /// A `meta` value (a provider's cursor).
    pub fn meta(&self, key: &str) -> Result<Option<String>> {
        self.name(Which::Meta, key)
    }

    /// One source's messages from `from` on (a seq below which all have left: see
    /// `SourceIndex::first_seq`), in acceptance order, while `each` answers true.
    pub fn source_messages(&self, src: &str, from: u64, each: impl FnMut(u64, &str) -> bool) -> Result<()> {
        self.source_rows(Which::Messages, src, from, each)
    }

    /// One source's entries of the delivered log from `from` on, oldest first, while `each`
    /// answers true.
    pub fn source_delivered(&self, src: &str, from: u64, each: impl FnMut(u64, &str) -> bool) -> Result<()> {
        self.source_rows(Which::Delivered, src, from, each)
    }

    fn source_rows(&self, which: Which, src: &str, from: u64, mut each: impl FnMut(u64, &str) -> bool) -> Result<()> {
        let range = (src.to_string(), from)..=(src.to_string(), u64::MAX);
        merge(
            self.base.rows_from(which, src, from)?,
            self.ov
                .seq_layer(which)
                .range(range)
                .map(|((_, seq), slot)| (*seq, slot)),
            |seq, v| each(seq, v),
        )
    }

    /// Every row of `messages` or `delivered`, by source then seq, while `each` answers true.
    pub fn all_seq(&self, which: Which, mut each: impl FnMut(&str, u64, &str) -> bool) -> Result<()> {
        merge(
            self.base.all_seq(which)?,
            self.ov.seq_layer(which).iter().map(|(k, slot)| (k.clone(), slot)),
            |(src, seq): (String, u64), v: &str| each(&src, seq, v),
        )
    }

    /// Every row of `counters` or `reply_refs`, by key, while `each` answers true.
    pub fn all_named(&self, which: Which, mut each: impl FnMut(&str, &str) -> bool) -> Result<()> {
        merge(
            self.base.all_named(which)?,
            self.ov.name_layer(which).iter().map(|(k, slot)| (k.clone(), slot)),
            |k: String, v: &str| each(&k, v),
        )
    }
}

pub struct Tx<'a> {
    base: &'a Base<'a>,
    ov: &'a mut Overlay,
    redo: Vec<u8>,
    undo: Vec<Undo>,
}

impl<'a> Tx<'a> {
    pub fn new(base: &'a Base<'a>, ov: &'a mut Overlay) -> Tx<'a> {
        Tx {
            base,
            ov,
            redo: Vec::new(),
            undo: Vec::new(),
        }
    }

    /// Reads as this transaction has left things so far.
    pub fn read(&self) -> Reader<'_> {
        Reader::new(self.base, self.ov)
    }

    /// The redo record of everything changed (empty: nothing changed), and how to take it back.
    pub fn finish(self) -> (Vec<u8>, Vec<Undo>) {
        (self.redo, self.undo)
    }

    /// Puts (`Some`) or removes a `(source, seq)` row; a remove returns what was there.
    fn change_seq(&mut self, which: Which, src: &str, seq: u64, value: Option<&str>) -> Result<Option<String>> {
        framable(src, value.unwrap_or(""))?;
        let key = (src.to_string(), seq);
        let op = match which {
            Which::Delivered => T_DELIVERED,
            _ => T_MESSAGES,
        };
        let before = match value {
            Some(v) => {
                let before = self
                    .ov
                    .seq_layer_mut(which)
                    .insert(key.clone(), Slot::Put(v.to_string()));
                self.note(op, src, Some(seq), value);
                before
            }
            None => {
                let (old, in_base) = match self.ov.seq_layer(which).get(&key) {
                    Some(Slot::Gone) => return Ok(None),
                    Some(Slot::Put(v)) => (Some(v.clone()), self.base.may_hold_seq(which, src, seq)?),
                    None => {
                        let b = self.base.get_seq(which, src, seq)?;
                        (b.clone(), b.is_some())
                    }
                };
                if old.is_none() {
                    return Ok(None);
                }
                let layer = self.ov.seq_layer_mut(which);
                let before = match in_base {
                    true => layer.insert(key.clone(), Slot::Gone),
                    false => layer.remove(&key),
                };
                self.note(op | REMOVE, src, Some(seq), None);
                self.undo.push(Undo::Seq(which, key, before));
                return Ok(old);
            }
        };
        self.undo.push(Undo::Seq(which, key, before));
        Ok(None)
    }

    /// Puts (`Some`) or removes a named row.
    fn change_name(&mut self, which: Which, key: &str, value: Option<&str>) -> Result<()> {
        framable(key, value.unwrap_or(""))?;
        let op = match which {
            Which::Counters => T_COUNTERS,
            Which::ReplyRefs => T_REPLY_REFS,
            _ => T_META,
        };
        let before = match value {
            Some(v) => self
                .ov
                .name_layer_mut(which)
                .insert(key.to_string(), Slot::Put(v.to_string())),
            None => {
                let in_base = match self.ov.name_layer(which).get(key) {
                    Some(Slot::Gone) => return Ok(()),
                    Some(Slot::Put(_)) => self.base.may_hold_name(which, key)?,
                    None if self.base.get_name(which, key)?.is_some() => true,
                    None => return Ok(()),
                };
                let layer = self.ov.name_layer_mut(which);
                match in_base {
                    true => layer.insert(key.to_string(), Slot::Gone),
                    false => layer.remove(key),
                }
            }
        };
        self.note(if value.is_some() { op } else { op | REMOVE }, key, None, value);
        self.undo.push(Undo::Name(which, key.to_string(), before));
        Ok(())
    }

    pub fn put_message(&mut self, src: &str, seq: u64, value: &str) -> Result<()> {
        self.change_seq(Which::Messages, src, seq, Some(value)).map(drop)
    }

    pub fn remove_message(&mut self, src: &str, seq: u64) -> Result<Option<String>> {
        self.change_seq(Which::Messages, src, seq, None)
    }

    pub fn put_delivered(&mut self, src: &str, seq: u64, value: &str) -> Result<()> {
        self.change_seq(Which::Delivered, src, seq, Some(value)).map(drop)
    }

    pub fn remove_delivered(&mut self, src: &str, seq: u64) -> Result<Option<String>> {
        self.change_seq(Which::Delivered, src, seq, None)
    }

    pub fn put_counter(&mut self, src: &str, value: &str) -> Result<()> {
        self.change_name(Which::Counters, src, Some(value))
    }

    pub fn put_reply_ref(&mut self, token: &str, value: &str) -> Result<()> {
        self.change_name(Which::ReplyRefs, token, Some(value))
    }

    pub fn remove_reply_ref(&mut self, token: &str) -> Result<()> {
        self.change_name(Which::ReplyRefs, token, None)
    }

    pub fn set_meta(&mut self, key: &str, value: &str) -> Result<()> {
        self.change_name(Which::Meta, key, Some(value))
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
        let changes = parse(record).map_err(|why| StoreError::Corrupt(format!("outbox log record: {why}")))?;
        for change in changes {
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

    /// redb holding one message and one reply reference, as a checkpoint left them.
    fn checkpointed(tag: &str) -> (std::sync::Arc<store::Db>, std::path::PathBuf) {
        let (db, dir) = store::temp_db(tag);
        db.write(|txn| {
            crate::outbox::durable::create_tables(txn)?;
            txn.open_table(MESSAGES)?.insert(("webhook:a", 3), "x")?;
            txn.open_table(REPLY_REFS)?.insert("rr_y", "y")?;
            Ok(())
        })
        .unwrap();
        (db, dir)
    }

    fn record(ov: &mut Overlay) -> Vec<u8> {
        let (db, _dir) = checkpointed("tx");
        db.read(|txn| {
            let base = Base::new(txn);
            let mut tx = Tx::new(&base, ov);
            tx.put_message("webhook:a", 7, "{\"h\":1}\npayload")?;
            tx.remove_message("webhook:a", 3)?;
            // Removing what is not there changes nothing, and is not recorded.
            tx.remove_message("webhook:a", 99)?;
            tx.put_delivered("webhook:a", 2, "1000 - m2")?;
            tx.put_counter("webhook:a", "{}")?;
            tx.put_reply_ref("rr_x", "{\"r\":1}")?;
            tx.remove_reply_ref("rr_y")?;
            tx.set_meta("cursor:x", "42")?;
            Ok(tx.finish().0)
        })
        .unwrap()
    }

    #[test]
    fn a_redo_record_lists_every_change_in_order() {
        let r = record(&mut Overlay::default());
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
    fn a_row_put_and_removed_since_the_checkpoint_leaves_nothing_to_write() {
        let (db, _dir) = checkpointed("tx-cancel");
        let mut ov = Overlay::default();
        db.read(|txn| {
            let base = Base::new(txn);
            let mut tx = Tx::new(&base, &mut ov);
            tx.put_message("webhook:a", 8, "new")?;
            assert_eq!(tx.remove_message("webhook:a", 8)?.as_deref(), Some("new"));
            assert_eq!(tx.remove_message("webhook:a", 3)?.as_deref(), Some("x"));
            assert_eq!(tx.read().message("webhook:a", 3)?, None, "a removal hides redb's row");
            Ok(())
        })
        .unwrap();
        assert!(
            !ov.messages.contains_key(&("webhook:a".to_string(), 8)),
            "never reaches redb"
        );
        assert_eq!(ov.messages.get(&("webhook:a".to_string(), 3)), Some(&Slot::Gone));
        assert_eq!(ov.message_puts(), 0);
    }

    #[test]
    fn applying_a_record_twice_leaves_what_applying_it_once_does() {
        let r = record(&mut Overlay::default());
        let (db, _dir) = checkpointed("tx-apply");
        let mut ov = Overlay::default();
        db.read(|txn| {
            let base = Base::new(txn);
            for _ in 0..2 {
                Tx::new(&base, &mut ov).apply(&r)?;
            }
            let read = Reader::new(&base, &ov);
            assert_eq!(read.message("webhook:a", 7)?.as_deref(), Some("{\"h\":1}\npayload"));
            assert_eq!(read.message("webhook:a", 3)?, None);
            assert_eq!(read.meta("cursor:x")?.as_deref(), Some("42"));
            assert_eq!(read.reply_ref("rr_y")?, None);
            Ok(())
        })
        .unwrap();
    }

    #[test]
    fn undo_takes_a_transaction_back_whole() {
        let (db, _dir) = checkpointed("tx-undo");
        let mut ov = Overlay::default();
        let undo = db
            .read(|txn| {
                let base = Base::new(txn);
                let mut tx = Tx::new(&base, &mut ov);
                tx.put_message("webhook:a", 7, "seven")?;
                tx.remove_message("webhook:a", 3)?;
                tx.put_counter("webhook:a", "{}")?;
                Ok(tx.finish().1)
            })
            .unwrap();
        ov.undo(undo);
        assert!(ov.is_empty(), "nothing left of the transaction");
    }

    #[test]
    fn malformed_records_are_refused_whole_and_never_panic() {
        let r = record(&mut Overlay::default());
        assert!(parse(&r[..r.len() - 1]).is_err());
        assert!(parse(&[0x09, 0, 0]).is_err());
        for m in crate::testutil::mutations(&[&r], 3000, 5) {
            let _ = parse(&m);
        }
    }
}
