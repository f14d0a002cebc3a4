//! The in-memory view of the outbox that every enqueue consults: per source, how many messages
//! and bytes are pending, and which message IDs were seen (pending or recently delivered).
//!
//! It is rebuilt from the database at startup and changed only together with the transaction it
//! mirrors (the writer holds its lock across the commit). Keeping it in memory means an accept
//! writes one sequential B-tree entry instead of also a dedupe entry at a random key: one
//! 4 KiB page per group commit instead of one per message on the SD card.
//!
//! IDs are kept as 64-bit keyed hashes (24 bytes an entry, whatever the ID's length); a hit is
//! confirmed against the stored ID before a message is called a duplicate, so a collision can
//! never drop a message. Size is bounded: pending IDs by the queue caps, delivered IDs by
//! `Policy::delivered_cap` per source and by their TTL.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};

use crate::quiet::Quiet;

/// Where a known ID's message is: still queued, or in the delivered log.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Place {
    Pending(u64),
    Delivered(u64),
}

/// A known ID: until when it counts, and where its message is, packed into 16 bytes (a seq
/// fits in 63 bits; the top bit says delivered), so the table holds 24 bytes an entry.
#[derive(Clone, Copy)]
struct Known {
    expires_at: u64,
    place: u64,
}

const DELIVERED_BIT: u64 = 1 << 63;

impl Known {
    fn new(expires_at: u64, place: Place) -> Known {
        let place = match place {
            Place::Pending(seq) => seq & !DELIVERED_BIT,
            Place::Delivered(seq) => seq | DELIVERED_BIT,
        };
        Known { expires_at, place }
    }

    fn place(&self) -> Place {
        match self.place & DELIVERED_BIT {
            0 => Place::Pending(self.place),
            _ => Place::Delivered(self.place & !DELIVERED_BIT),
        }
    }
}

#[derive(Default)]
pub struct Index {
    pub sources: HashMap<String, SourceIndex>,
    hasher: RandomState,
}

#[derive(Default)]
pub struct SourceIndex {
    pub pending: u64,
    pub pending_bytes: u64,
    /// hash(ID) → where its message is and until when it counts.
    ids: HashMap<u64, Known>,
    /// Delivered entries in delivery order, oldest first: `(seq, hash, expires_at)`.
    delivered: VecDeque<(u64, u64, u64)>,
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

    pub fn total_bytes(&self) -> u64 {
        self.sources.values().map(|s| s.pending_bytes).sum()
    }
}

impl SourceIndex {
    /// Where the message with this ID hash is, if it was accepted and has not expired at `now`.
    /// The caller confirms the ID itself there.
    pub fn lookup(&self, hash: u64, now: u64) -> Option<Place> {
        self.ids.get(&hash).filter(|k| k.expires_at > now).map(|k| k.place())
    }

    pub fn add_pending(&mut self, seq: u64, hash: u64, expires_at: u64, bytes: u64) {
        self.pending += 1;
        self.pending_bytes += bytes;
        self.ids.insert(hash, Known::new(expires_at, Place::Pending(seq)));
        self.next_seq = self.next_seq.max(seq + 1);
    }

    /// A pending message left the queue without delivery (expired or evicted): forget its ID.
    pub fn drop_pending(&mut self, seq: u64, hash: u64, bytes: u64) {
        self.pending = self.pending.saturating_sub(1);
        self.pending_bytes = self.pending_bytes.saturating_sub(bytes);
        if self.ids.get(&hash).is_some_and(|k| k.place() == Place::Pending(seq)) {
            self.ids.remove(&hash);
        }
    }

    /// A pending message was delivered: its ID stays known, now in the delivered log.
    pub fn deliver(&mut self, seq: u64, hash: u64, expires_at: u64, bytes: u64) {
        self.pending = self.pending.saturating_sub(1);
        self.pending_bytes = self.pending_bytes.saturating_sub(bytes);
        self.load_delivered(seq, hash, expires_at);
    }

    /// Records a delivered-log entry (at delivery, and at startup).
    pub fn load_delivered(&mut self, seq: u64, hash: u64, expires_at: u64) {
        self.ids.insert(hash, Known::new(expires_at, Place::Delivered(seq)));
        self.delivered.push_back((seq, hash, expires_at));
        self.next_seq = self.next_seq.max(seq + 1);
    }

    /// Pending bytes change when a record is rewritten (attempt counts).
    pub fn adjust_bytes(&mut self, delta: i64) {
        self.pending_bytes = self.pending_bytes.saturating_add_signed(delta);
    }

    pub fn delivered_len(&self) -> usize {
        self.delivered.len()
    }

    /// Removes the oldest delivered entry; returns its `seq` (to delete it from disk too).
    pub fn pop_delivered(&mut self) -> Option<u64> {
        let (seq, hash, _) = self.delivered.pop_front()?;
        // The same ID may have been accepted again after this entry expired; keep that one.
        if self.ids.get(&hash).is_some_and(|k| k.place() == Place::Delivered(seq)) {
            self.ids.remove(&hash);
        }
        Some(seq)
    }

    /// The oldest delivered entry's expiry.
    pub fn oldest_delivered_expiry(&self) -> Option<u64> {
        self.delivered.front().map(|(_, _, exp)| *exp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_known_id_keeps_its_place_in_16_bytes() {
        assert_eq!(std::mem::size_of::<Known>(), 16);
        for place in [
            Place::Pending(0),
            Place::Pending(u64::MAX >> 1),
            Place::Delivered(7),
            Place::Delivered(u64::MAX >> 1),
        ] {
            assert_eq!(Known::new(5, place).place(), place);
        }
    }
}
