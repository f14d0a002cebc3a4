//! The in-memory view of the outbox that every enqueue consults: per source, how many messages
//! and bytes are pending, and which message IDs were seen (pending or recently delivered).
//!
//! It is rebuilt from the database at startup and changed only together with the transaction it
//! mirrors (the writer holds its lock across the commit). Keeping it in memory means an accept
//! writes one sequential B-tree entry instead of also a dedupe entry at a random key: one
//! 4 KiB page per group commit instead of one per message on the SD card.
//!
//! A known ID costs one 8-byte slot, whatever the ID's length (`Known`): 24 bits of its keyed
//! hash and where its message is. A hit is only a candidate: the stored ID and its expiry are
//! read and compared before a message is called a duplicate, so two IDs that share the 24 bits
//! cost one more read and never drop a message. Nothing else grows with the backlog: the
//! delivered log's order and expiries are read from the disk when it is trimmed, oldest first.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};

use crate::quiet::Quiet;

/// Where a known ID's message is: still queued, or in the delivered log.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Place {
    Pending(u64),
    Delivered(u64),
}

/// A slot holds the hash's top 24 bits (never 0, so 0 is an empty slot), a delivered bit and
/// the seq's low 39 bits; the seq is made whole again from the source's next seq (every known
/// seq is below it and, with 2^39 seqs, within reach of it for as long as an entry lives).
const SEQ_BITS: u32 = 39;
const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;
const DELIVERED_BIT: u64 = 1 << SEQ_BITS;
const TAG_SHIFT: u32 = 40;
const TAG_BITS: u32 = 24;
/// A table never has fewer slots (unless empty, when it has none).
const MIN_SLOTS: usize = 4;

/// Bytes of index an ID costs at most: a table is resized to 70% full, grows again past 87.5%
/// and shrinks below 50%, so a table of more than `MIN_SLOTS` is always at least half full.
/// A source adds at most `BYTES_PER_SOURCE` (its 16 tables' headers, and tables of one ID at
/// their least). What `imgate check` states for the caps.
pub const BYTES_PER_ID: u64 = 16;
pub const BYTES_PER_SOURCE: u64 = (TABLES * (std::mem::size_of::<Table>() + MIN_SLOTS * 8)) as u64;
// What the docs say a channel costs at most.
const _: () = assert!(BYTES_PER_SOURCE <= 1024);

fn tag(hash: u64) -> u64 {
    (hash >> TAG_SHIFT).max(1)
}

fn slot(hash: u64, place: Place) -> u64 {
    let (seq, delivered) = match place {
        Place::Pending(seq) => (seq, 0),
        Place::Delivered(seq) => (seq, DELIVERED_BIT),
    };
    tag(hash) << TAG_SHIFT | delivered | seq & SEQ_MASK
}

/// The known IDs of one source, in 16 tables by the tag's top 4 bits: a resize copies one
/// sixteenth of them, so the two tables alive during the copy add a sixteenth, not the whole.
#[derive(Default)]
pub struct Known {
    tables: Vec<Table>,
}

const TABLES: usize = 16;
/// The tag's bits below the table's: where in its table a tag's run starts.
const RUN_BITS: u32 = TAG_BITS - 4;

impl Known {
    fn table(&self, hash: u64) -> Option<&Table> {
        self.tables.get((tag(hash) >> RUN_BITS) as usize)
    }

    /// The hash's table, if this source has its tables yet.
    fn table_mut(&mut self, hash: u64) -> Option<&mut Table> {
        self.tables.get_mut((tag(hash) >> RUN_BITS) as usize)
    }

    /// Every entry whose tag is this hash's, as places (seqs made whole below `next_seq`).
    pub fn candidates(&self, hash: u64, next_seq: u64) -> impl Iterator<Item = Place> + '_ {
        self.table(hash)
            .into_iter()
            .flat_map(move |t| t.candidates(hash, next_seq))
    }

    pub fn insert(&mut self, hash: u64, place: Place) {
        if self.tables.is_empty() {
            self.tables.resize_with(TABLES, Table::default);
        }
        if let Some(t) = self.table_mut(hash) {
            t.insert(hash, place);
        }
    }

    /// Forgets one entry; false when it was not there.
    pub fn remove(&mut self, hash: u64, place: Place) -> bool {
        let removed = self.table_mut(hash).is_some_and(|t| t.remove(hash, place));
        if removed && self.len() == 0 {
            self.tables = Vec::new();
        }
        removed
    }

    /// Moves an entry to another place of the same ID (its slot, as the tag is the same).
    pub fn replace(&mut self, hash: u64, from: Place, to: Place) -> bool {
        self.table_mut(hash).is_some_and(|t| t.replace(hash, from, to))
    }

    pub fn len(&self) -> usize {
        self.tables.iter().map(|t| t.len).sum()
    }

    /// Bytes the tables hold.
    pub fn bytes(&self) -> usize {
        self.tables.iter().map(|t| t.slots.capacity() * 8).sum()
    }
}

/// One table: open addressing with linear probing over 8-byte slots, removal by backward
/// shift (no tombstones, so a long-lived table does not slow down).
#[derive(Default)]
struct Table {
    slots: Vec<u64>,
    len: usize,
}

impl Table {
    /// Where a tag's run starts: its low bits scaled to the table (any size, not only powers
    /// of two, so a resize can aim at a load instead of doubling).
    fn home(&self, tag: u64) -> usize {
        (((tag & ((1 << RUN_BITS) - 1)) * self.slots.len() as u64) >> RUN_BITS) as usize
    }

    fn next(&self, i: usize) -> usize {
        if i + 1 == self.slots.len() {
            0
        } else {
            i + 1
        }
    }

    /// The slots of the run a hash's entries are in, from its home to the first empty slot.
    fn run(&self, hash: u64) -> impl Iterator<Item = usize> + '_ {
        let mut i = (!self.slots.is_empty()).then(|| self.home(tag(hash)));
        std::iter::from_fn(move || {
            let at = i.filter(|&at| self.slots[at] != 0)?;
            i = Some(self.next(at));
            Some(at)
        })
    }

    fn candidates(&self, hash: u64, next_seq: u64) -> impl Iterator<Item = Place> + '_ {
        let tag = tag(hash);
        self.run(hash)
            .map(|i| self.slots[i])
            .filter(move |s| s >> TAG_SHIFT == tag)
            .map(move |s| {
                let seq = whole_seq(s & SEQ_MASK, next_seq);
                match s & DELIVERED_BIT {
                    0 => Place::Pending(seq),
                    _ => Place::Delivered(seq),
                }
            })
    }

    fn insert(&mut self, hash: u64, place: Place) {
        if (self.len + 1) * 8 > self.slots.len() * 7 {
            self.resize(self.len + 1);
        }
        let mut i = self.home(tag(hash));
        while self.slots[i] != 0 {
            i = self.next(i);
        }
        self.slots[i] = slot(hash, place);
        self.len += 1;
    }

    fn find(&self, hash: u64, place: Place) -> Option<usize> {
        let s = slot(hash, place);
        self.run(hash).find(|&i| self.slots[i] == s)
    }

    fn remove(&mut self, hash: u64, place: Place) -> bool {
        let Some(mut hole) = self.find(hash, place) else {
            return false;
        };
        // Backward shift: each later entry of the run moves into the hole when that is still
        // at or after its home, so every run stays unbroken.
        let n = self.slots.len();
        let mut j = hole;
        loop {
            j = self.next(j);
            let s = self.slots[j];
            if s == 0 {
                break;
            }
            let home = self.home(s >> TAG_SHIFT);
            if (hole + n - home) % n < (j + n - home) % n {
                self.slots[hole] = s;
                hole = j;
            }
        }
        self.slots[hole] = 0;
        self.len -= 1;
        if self.len == 0 {
            self.slots = Vec::new();
        } else if self.slots.len() > MIN_SLOTS && self.len * 2 < self.slots.len() {
            self.resize(self.len);
        }
        true
    }

    fn replace(&mut self, hash: u64, from: Place, to: Place) -> bool {
        match self.find(hash, from) {
            Some(i) => {
                self.slots[i] = slot(hash, to);
                true
            }
            None => false,
        }
    }

    /// A table 70% full with `len` entries.
    fn resize(&mut self, len: usize) {
        let old = std::mem::take(&mut self.slots);
        self.slots = vec![0; (len * 10 / 7 + 1).max(MIN_SLOTS)];
        for s in old.into_iter().filter(|&s| s != 0) {
            let mut i = self.home(s >> TAG_SHIFT);
            while self.slots[i] != 0 {
                i = self.next(i);
            }
            self.slots[i] = s;
        }
    }
}

/// The seq whose low bits are `low`, the latest below `next_seq`.
fn whole_seq(low: u64, next_seq: u64) -> u64 {
    let seq = next_seq & !SEQ_MASK | low;
    if seq < next_seq {
        seq
    } else {
        seq.checked_sub(1 << SEQ_BITS).unwrap_or(seq)
    }
}

#[derive(Default)]
pub struct Index {
    pub sources: HashMap<String, SourceIndex>,
    hasher: RandomState,
    /// Stored IDs read to confirm a candidate since start (a duplicate's, or another ID's
    /// that shares the bits).
    pub id_reads: u64,
}

#[derive(Default)]
pub struct SourceIndex {
    pub pending: u64,
    pub pending_bytes: u64,
    /// Where the messages of known IDs are.
    pub known: Known,
    /// Entries in the delivered log.
    pub delivered: u64,
    /// Every delivered-log entry of this source below this seq is gone: trims read from here.
    pub delivered_from: u64,
    /// The expiry of the oldest delivered-log entry as last read (0: read it again). Entries
    /// are delivered in order with one TTL, so none expires sooner (the sweep covers a TTL
    /// that was lowered, as for the queue's head).
    pub delivered_head_expires: u64,
    /// The next `seq` to assign.
    pub next_seq: u64,
    /// Every message of this source below this seq has left the queue: reads of the queue
    /// start here, and so skip the rows a checkpoint wrote that were delivered since (hidden
    /// by the overlay, but still walked). Raised by every read that finds the head.
    pub first_seq: u64,
    /// The expiry of the message the last enqueue found at the head of the queue (0: not read
    /// yet). No pending message expires sooner: with one TTL, expiry follows acceptance order
    /// (up to a step of the clock, which the sweep covers), and a message that leaves only
    /// moves the head later. So an enqueue reads the head again only once this has passed.
    pub head_expires: u64,
    /// The source's capacity warnings (a full queue refuses or evicts at the senders' rate).
    pub caps_log: Quiet,
    /// Its expiry warnings (each enqueue may expire the head of a queue nobody reads).
    pub expiry_log: Quiet,
}

impl Index {
    pub fn hash(&self, id: &str) -> u64 {
        self.hasher.hash_one(id)
    }

    pub fn source(&mut self, src: &str) -> &mut SourceIndex {
        if !self.sources.contains_key(src) {
            self.sources.insert(src.to_string(), SourceIndex::default());
        }
        self.sources.get_mut(src).expect("inserted above")
    }

    /// Takes an index read from the disk again, keeping the reads counted since start.
    pub fn reload(&mut self, fresh: Index) {
        let id_reads = self.id_reads;
        *self = fresh;
        self.id_reads = id_reads;
    }

    pub fn total_bytes(&self) -> u64 {
        self.sources.values().map(|s| s.pending_bytes).sum()
    }

    /// Delivered-log entries over all sources.
    pub fn total_delivered(&self) -> u64 {
        self.sources.values().map(|s| s.delivered).sum()
    }

    /// The source with the most delivered-log entries (of two, the later name).
    pub fn most_delivered(&self) -> Option<&str> {
        let (src, _) = self.sources.iter().max_by_key(|(src, s)| (s.delivered, *src))?;
        Some(src)
    }

    /// Bytes the known IDs take over all sources.
    pub fn known_bytes(&self) -> usize {
        self.sources.values().map(|s| s.known.bytes()).sum()
    }
}

impl SourceIndex {
    /// Where messages with this ID hash may be: every place is confirmed against the stored
    /// ID and expiry by the caller.
    pub fn candidates(&self, hash: u64) -> impl Iterator<Item = Place> + '_ {
        self.known.candidates(hash, self.next_seq)
    }

    pub fn add_pending(&mut self, seq: u64, hash: u64, bytes: u64) {
        self.pending += 1;
        self.pending_bytes += bytes;
        self.known.insert(hash, Place::Pending(seq));
        self.next_seq = self.next_seq.max(seq + 1);
    }

    /// A pending message left the queue without delivery (expired or evicted): forget its ID.
    pub fn drop_pending(&mut self, seq: u64, hash: u64, bytes: u64) {
        self.pending = self.pending.saturating_sub(1);
        self.pending_bytes = self.pending_bytes.saturating_sub(bytes);
        self.known.remove(hash, Place::Pending(seq));
    }

    /// A pending message was delivered: its ID stays known, now in the delivered log.
    pub fn deliver(&mut self, seq: u64, hash: u64, bytes: u64) {
        self.pending = self.pending.saturating_sub(1);
        self.pending_bytes = self.pending_bytes.saturating_sub(bytes);
        if !self.known.replace(hash, Place::Pending(seq), Place::Delivered(seq)) {
            self.known.insert(hash, Place::Delivered(seq));
        }
        // A message delivered after a later one (a v2 batch answered out of order) lies below
        // where the trims started: they start at it now, and read the head's expiry again.
        if self.delivered == 0 || seq < self.delivered_from {
            self.delivered_from = self.delivered_from.min(seq);
            self.delivered_head_expires = 0;
        }
        self.delivered += 1;
    }

    /// Records a delivered-log entry at startup (read in order, oldest first).
    pub fn load_delivered(&mut self, seq: u64, hash: u64, expires_at: u64) {
        if self.delivered == 0 {
            self.delivered_from = seq;
            self.delivered_head_expires = expires_at;
        }
        self.known.insert(hash, Place::Delivered(seq));
        self.delivered += 1;
        self.next_seq = self.next_seq.max(seq + 1);
    }

    /// The oldest delivered-log entry, at `seq`, was removed; `hash` is its ID's, unless the
    /// entry was unreadable (then it was neither counted nor known).
    pub fn forget_delivered(&mut self, seq: u64, hash: Option<u64>) {
        if let Some(hash) = hash {
            self.known.remove(hash, Place::Delivered(seq));
            self.delivered = self.delivered.saturating_sub(1);
        }
        self.delivered_from = seq + 1;
        self.delivered_head_expires = 0;
    }

    /// Whether the head of the queue may have expired at `now` (see `head_expires`), so that
    /// expiry has to read it.
    pub fn head_may_expire(&self, now: u64) -> bool {
        self.pending > 0 && now >= self.head_expires
    }

    /// Pending bytes change when a record is rewritten (attempt counts).
    pub fn adjust_bytes(&mut self, delta: i64) {
        self.pending_bytes = self.pending_bytes.saturating_add_signed(delta);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_known_id_keeps_its_place_in_8_bytes() {
        let mut k = Known::default();
        for (n, place) in [
            Place::Pending(0),
            Place::Pending(SEQ_MASK + 5),
            Place::Delivered(7),
            Place::Delivered(u64::MAX >> 2),
        ]
        .into_iter()
        .enumerate()
        {
            let hash = (n as u64 + 1) << 60;
            k.insert(hash, place);
            let next = match place {
                Place::Pending(s) | Place::Delivered(s) => s + 1,
            };
            assert_eq!(k.candidates(hash, next).collect::<Vec<_>>(), vec![place]);
        }
        assert_eq!(k.bytes(), 4 * MIN_SLOTS * 8, "four tables in use, at their least");
    }

    /// A model: every entry is found under its hash after any mix of inserts and removals,
    /// through resizes both ways, and the tables keep to their bytes an ID at every moment.
    #[test]
    fn entries_survive_removals_and_resizes_and_the_table_keeps_its_size() {
        let mut k = Known::default();
        let mut model: Vec<(u64, Place)> = Vec::new();
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let (mut at_peak, mut shrunk) = (0, usize::MAX);
        for round in 0..60_000u64 {
            // Grow to 20,000, shrink to a few hundred, grow again.
            let grow = match round {
                0..20_000 => true,
                20_000..40_000 => model.len() < 300,
                _ => next() % 4 != 0,
            };
            if grow || model.is_empty() {
                // 5,000 tags spread over the 24 bits, so that tags are shared and runs cross.
                let hash = (next() % 5_000 * 3_355 + 1) << TAG_SHIFT | next() & 0xff;
                let place = Place::Pending(round);
                k.insert(hash, place);
                model.push((hash, place));
            } else {
                let (hash, place) = model.swap_remove((next() % model.len() as u64) as usize);
                assert!(k.remove(hash, place));
            }
            let bound = BYTES_PER_ID * model.len() as u64 + BYTES_PER_SOURCE;
            assert!(k.bytes() as u64 <= bound, "{} bytes for {} IDs", k.bytes(), model.len());
            if round == 19_999 {
                at_peak = k.bytes();
            }
            if round == 39_999 {
                shrunk = k.bytes();
            }
            if round % 997 == 0 {
                for &(hash, place) in &model {
                    assert!(k.candidates(hash, round + 1).any(|p| p == place), "{place:?} found");
                }
                assert_eq!(k.len(), model.len());
            }
        }
        assert!(shrunk * 20 < at_peak, "the tables shrank: {shrunk} of {at_peak} bytes");
        for (hash, place) in model.drain(..) {
            assert!(k.remove(hash, place));
        }
        assert_eq!(k.bytes(), 0, "an empty index holds nothing");
    }

    #[test]
    fn a_seq_is_made_whole_below_the_next() {
        assert_eq!(whole_seq(5, 6), 5);
        assert_eq!(whole_seq(SEQ_MASK, (1 << SEQ_BITS) + 3), SEQ_MASK);
        assert_eq!(whole_seq(2, (1 << SEQ_BITS) + 3), (1 << SEQ_BITS) + 2);
        assert_eq!(
            whole_seq(9, 3),
            9,
            "no entry can be there: the read that confirms finds none"
        );
    }
}
