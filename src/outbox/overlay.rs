//! The outbox's changes since the last checkpoint, in memory: what its log holds, applied.
//!
//! redb holds the outbox as of the last checkpoint; the overlay holds every put and remove made
//! since, each of which is also a record in the log. Readers see the overlay over redb. A
//! checkpoint writes the overlay into redb in one durable commit and empties it; so a message
//! accepted and delivered between two checkpoints (a put, then a remove of a key redb never
//! had) leaves nothing to write, and never reaches redb.
//!
//! Size: every entry came from a log record, and the log is checkpointed at
//! `durable::checkpoint_bytes`, so the overlay is bounded by the checkpoint trigger, not by
//! the queue caps.

use std::borrow::Cow;
use std::collections::BTreeMap;

use redb::WriteTransaction;

use super::tables::{COUNTERS, DELIVERED, MESSAGES, REPLY_REFS};
use crate::store::{self, Result};

/// One key's state in the overlay.
#[derive(Clone, Debug, PartialEq)]
pub enum Slot {
    /// Written since the last checkpoint.
    Put(String),
    /// Removed since the last checkpoint while redb still holds it.
    Gone,
}

/// A table keyed by `(source, seq)`.
pub type SeqLayer = BTreeMap<(String, u64), Slot>;
/// A table keyed by a name (source, token, meta key).
pub type NameLayer = BTreeMap<String, Slot>;

#[derive(Clone, Default)]
pub struct Overlay {
    pub messages: SeqLayer,
    pub delivered: SeqLayer,
    pub counters: NameLayer,
    pub reply_refs: NameLayer,
    /// Providers' cursors in the store's `meta` table.
    pub meta: NameLayer,
}

/// Which layer a change touched.
#[derive(Clone, Copy, Debug)]
pub enum Which {
    Messages,
    Delivered,
    Counters,
    ReplyRefs,
    Meta,
}

/// How to take one change back: the key's slot before it.
pub enum Undo {
    Seq(Which, (String, u64), Option<Slot>),
    Name(Which, String, Option<Slot>),
}

impl Overlay {
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
            && self.delivered.is_empty()
            && self.counters.is_empty()
            && self.reply_refs.is_empty()
            && self.meta.is_empty()
    }

    /// Message records a checkpoint would write now (puts in `messages`).
    pub fn message_puts(&self) -> u64 {
        self.messages.values().filter(|s| matches!(s, Slot::Put(_))).count() as u64
    }

    pub fn seq_layer(&self, which: Which) -> &SeqLayer {
        match which {
            Which::Delivered => &self.delivered,
            _ => &self.messages,
        }
    }

    pub fn name_layer(&self, which: Which) -> &NameLayer {
        match which {
            Which::Counters => &self.counters,
            Which::ReplyRefs => &self.reply_refs,
            _ => &self.meta,
        }
    }

    pub fn seq_layer_mut(&mut self, which: Which) -> &mut SeqLayer {
        match which {
            Which::Delivered => &mut self.delivered,
            _ => &mut self.messages,
        }
    }

    pub fn name_layer_mut(&mut self, which: Which) -> &mut NameLayer {
        match which {
            Which::Counters => &mut self.counters,
            Which::ReplyRefs => &mut self.reply_refs,
            _ => &mut self.meta,
        }
    }

    /// Takes back changes, newest first (a transaction whose record could not be logged).
    pub fn undo(&mut self, undo: Vec<Undo>) {
        for u in undo.into_iter().rev() {
            match u {
                Undo::Seq(w, key, before) => restore(self.seq_layer_mut(w), key, before),
                Undo::Name(w, key, before) => restore(self.name_layer_mut(w), key, before),
            }
        }
    }

    /// After a checkpoint of `older` (the overlay before this one) failed: takes its slots back
    /// under this overlay's, so it again holds every change since the last checkpoint made.
    pub fn absorb(&mut self, older: &Overlay) {
        for w in [Which::Messages, Which::Delivered] {
            absorb_into(self.seq_layer_mut(w), older.seq_layer(w));
        }
        for w in [Which::Counters, Which::ReplyRefs, Which::Meta] {
            absorb_into(self.name_layer_mut(w), older.name_layer(w));
        }
    }

    /// Writes every change into redb (the checkpoint's transaction).
    pub fn write_to(&self, txn: &WriteTransaction) -> Result<()> {
        for (table, layer) in [(MESSAGES, &self.messages), (DELIVERED, &self.delivered)] {
            let mut t = txn.open_table(table)?;
            for ((src, seq), slot) in layer {
                match slot {
                    Slot::Put(v) => drop(t.insert((src.as_str(), *seq), v.as_str())?),
                    Slot::Gone => drop(t.remove((src.as_str(), *seq))?),
                }
            }
        }
        for (table, layer) in [(COUNTERS, &self.counters), (REPLY_REFS, &self.reply_refs)] {
            let mut t = txn.open_table(table)?;
            for (key, slot) in layer {
                match slot {
                    Slot::Put(v) => drop(t.insert(key.as_str(), v.as_str())?),
                    Slot::Gone => drop(t.remove(key.as_str())?),
                }
            }
        }
        for (key, slot) in &self.meta {
            match slot {
                Slot::Put(v) => store::set_meta(txn, key, Some(v))?,
                Slot::Gone => store::set_meta(txn, key, None)?,
            }
        }
        Ok(())
    }
}

fn absorb_into<K: Ord + Clone>(layer: &mut BTreeMap<K, Slot>, older: &BTreeMap<K, Slot>) {
    for (key, slot) in older {
        if !layer.contains_key(key) {
            layer.insert(key.clone(), slot.clone());
        }
    }
}

fn restore<K: Ord>(layer: &mut BTreeMap<K, Slot>, key: K, before: Option<Slot>) {
    match before {
        Some(slot) => drop(layer.insert(key, slot)),
        None => drop(layer.remove(&key)),
    }
}

/// A row of a table as read: its key and value (borrowed from an overlay, or read from redb).
pub type Row<'a, K> = Result<(K, Cow<'a, str>)>;

/// Walks two key-ordered sequences as one: the rows below (`base`) under the overlay's slots
/// (`over`), the overlay winning on equal keys and a `Gone` hiding the row below it. `each`
/// answers whether to go on.
pub fn merge<'a, K: Ord>(
    base: impl Iterator<Item = Row<'a, K>>,
    over: impl Iterator<Item = (K, &'a Slot)>,
    mut each: impl FnMut(K, &str) -> bool,
) -> Result<()> {
    for row in layered(base, over) {
        let (k, v) = row?;
        if !each(k, &v) {
            break;
        }
    }
    Ok(())
}

/// The rows `merge` walks, as an iterator: so a layer can lie under another (redb's rows under
/// the overlay a checkpoint in flight writes, under the overlay). Stops at the first error.
pub fn layered<'a, K: Ord>(
    base: impl Iterator<Item = Row<'a, K>>,
    over: impl Iterator<Item = (K, &'a Slot)>,
) -> impl Iterator<Item = Row<'a, K>> {
    Layered {
        base,
        over,
        b: None,
        o: None,
        primed: false,
    }
}

struct Layered<'a, K, B, O> {
    base: B,
    over: O,
    /// The next row of each, once primed.
    b: Option<(K, Cow<'a, str>)>,
    o: Option<(K, &'a Slot)>,
    primed: bool,
}

impl<'a, K, B, O> Layered<'a, K, B, O>
where
    B: Iterator<Item = Row<'a, K>>,
{
    fn pull(&mut self) -> Result<()> {
        self.b = self.base.next().transpose()?;
        Ok(())
    }
}

impl<'a, K, B, O> Iterator for Layered<'a, K, B, O>
where
    K: Ord,
    B: Iterator<Item = Row<'a, K>>,
    O: Iterator<Item = (K, &'a Slot)>,
{
    type Item = Row<'a, K>;

    fn next(&mut self) -> Option<Self::Item> {
        if !self.primed {
            self.primed = true;
            self.o = self.over.next();
            if let Err(e) = self.pull() {
                return Some(Err(e));
            }
        }
        loop {
            let base_first = match (&self.b, &self.o) {
                (None, None) => return None,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (Some((kb, _)), Some((ko, _))) => kb < ko,
            };
            if base_first {
                let row = self.b.take();
                if let Err(e) = self.pull() {
                    return Some(Err(e));
                }
                return row.map(Ok);
            }
            let (k, slot) = self.o.take()?;
            self.o = self.over.next();
            if self.b.as_ref().is_some_and(|(kb, _)| *kb == k) {
                if let Err(e) = self.pull() {
                    return Some(Err(e));
                }
            }
            if let Slot::Put(v) = slot {
                return Some(Ok((k, Cow::Borrowed(v.as_str()))));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn walk(base: &[(u64, &str)], over: &[(u64, Slot)], stop_after: usize) -> Vec<(u64, String)> {
        let mut out = Vec::new();
        merge(
            base.iter().map(|(k, v)| Ok((*k, Cow::Borrowed(*v)))),
            over.iter().map(|(k, s)| (*k, s)),
            |k, v| {
                out.push((k, v.to_string()));
                out.len() < stop_after
            },
        )
        .unwrap();
        out
    }

    #[test]
    fn the_overlay_wins_over_redb_and_a_removal_hides_the_row() {
        let base = [(1, "a"), (2, "b"), (3, "c")];
        let over = [(2, Slot::Gone), (3, Slot::Put("C".into())), (5, Slot::Put("e".into()))];
        let all = walk(&base, &over, usize::MAX);
        assert_eq!(all, [(1, "a".into()), (3, "C".into()), (5, "e".into())]);
        assert_eq!(walk(&base, &over, 2).len(), 2, "each stops the walk");
        assert_eq!(walk(&[], &over, usize::MAX).len(), 2);
        assert_eq!(walk(&base, &[], usize::MAX).len(), 3);
    }

    #[test]
    fn three_layers_read_as_one_the_top_winning() {
        let base = [(1, "a"), (2, "b"), (3, "c"), (4, "d")];
        let mid = [(1, Slot::Gone), (2, Slot::Put("B".into())), (6, Slot::Put("f".into()))];
        let top = [(2, Slot::Gone), (3, Slot::Put("C".into())), (1, Slot::Put("A".into()))];
        let mut top = top.to_vec();
        top.sort_by_key(|(k, _)| *k);
        let mut out = Vec::new();
        merge(
            layered(
                base.iter().map(|(k, v)| Ok((*k, Cow::Borrowed(*v)))),
                mid.iter().map(|(k, s)| (*k, s)),
            ),
            top.iter().map(|(k, s)| (*k, s)),
            |k, v| {
                out.push((k, v.to_string()));
                true
            },
        )
        .unwrap();
        let want = [(1, "A"), (3, "C"), (4, "d"), (6, "f")];
        assert_eq!(out, want.map(|(k, v)| (k, v.to_string())));
    }

    #[test]
    fn undo_restores_every_slot_newest_first() {
        let mut ov = Overlay::default();
        ov.messages.insert(("s".into(), 1), Slot::Put("one".into()));
        let undo = vec![
            Undo::Seq(Which::Messages, ("s".into(), 1), Some(Slot::Put("one".into()))),
            Undo::Seq(Which::Messages, ("s".into(), 1), Some(Slot::Gone)),
            Undo::Name(Which::Counters, "s".into(), None),
        ];
        ov.messages.insert(("s".into(), 1), Slot::Put("three".into()));
        ov.counters.insert("s".into(), Slot::Put("{}".into()));
        ov.undo(undo);
        assert_eq!(ov.messages.get(&("s".to_string(), 1)), Some(&Slot::Put("one".into())));
        assert!(ov.counters.is_empty());
    }
}
