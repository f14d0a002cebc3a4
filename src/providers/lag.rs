//! Which conversations may have messages in their IM system's history that imgate did not
//! store, for the providers that catch up from a history (Slack, Discord): a conversation
//! falls behind when its connection was new or a message could not be stored, is read from
//! its mark by one catch-up at a time, and is caught up unless it fell behind again meanwhile.
//! While a conversation is behind, its live messages are stored without moving the mark: one
//! not stored must not be passed by a later one that was.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::source::Source;

/// A catch-up that failed (or was cut short) is tried again after this long.
pub const AGAIN: Duration = Duration::from_secs(30);

#[derive(Default)]
pub struct Lag {
    behind: Mutex<HashMap<Source, Behind>>,
    /// Conversations a catch-up is reading now.
    reading: Mutex<HashSet<Source>>,
}

/// Where a conversation that is behind is read from, and when a catch-up last tried.
#[derive(Clone, Copy)]
struct Behind {
    /// Read from the mark or from this point, whichever is older.
    from: u64,
    tried: Option<Instant>,
    /// Bumped whenever the conversation falls behind again: a catch-up that began before does
    /// not clear it.
    generation: u64,
}

impl Lag {
    /// `source` may have unstored messages from `from` on (`u64::MAX`: from its mark);
    /// `throttled`: its next catch-up waits `AGAIN` (a message just failed to store).
    pub fn fell_behind(&self, source: &Source, from: u64, throttled: bool) {
        let mut behind = self.behind.lock().unwrap_or_else(|e| e.into_inner());
        let entry = behind.entry(source.clone()).or_insert(Behind {
            from,
            tried: None,
            generation: 0,
        });
        entry.from = entry.from.min(from);
        entry.tried = throttled.then(Instant::now);
        entry.generation = entry.generation.wrapping_add(1);
    }

    pub fn is_behind(&self, source: &Source) -> bool {
        self.behind
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(source)
    }

    /// Whether `source` is behind and its catch-up may run now.
    pub fn due(&self, source: &Source) -> bool {
        let behind = self.behind.lock().unwrap_or_else(|e| e.into_inner());
        behind.get(source).is_some_and(is_due)
    }

    /// The keys (past `prefix`) of the conversations that are behind and due, and not being
    /// read now.
    pub fn due_under(&self, prefix: &str) -> Vec<String> {
        let reading = self.reading.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let behind = self.behind.lock().unwrap_or_else(|e| e.into_inner());
        behind
            .iter()
            .filter(|(s, b)| is_due(b) && !reading.contains(*s))
            .filter_map(|(s, _)| s.key().strip_prefix(prefix).map(str::to_string))
            .collect()
    }

    /// A new binding starts afresh: what an earlier binding of the same conversation left
    /// behind is forgotten.
    pub fn forget(&self, source: &Source) {
        self.behind.lock().unwrap_or_else(|e| e.into_inner()).remove(source);
    }

    /// Starts the catch-up of `source`; `None` when another is reading it now (which may have
    /// read the history before what this one was for: `source` stays due, and that one does
    /// not clear it).
    pub fn start(&self, source: &Source) -> Option<Reading<'_>> {
        let claimed = self
            .reading
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(source.clone());
        if !claimed {
            self.fell_behind(source, u64::MAX, false);
            return None;
        }
        let mut behind = self.behind.lock().unwrap_or_else(|e| e.into_inner());
        let entry = behind.entry(source.clone()).or_insert(Behind {
            from: u64::MAX,
            tried: None,
            generation: 0,
        });
        entry.tried = Some(Instant::now());
        Some(Reading {
            lag: self,
            source: source.clone(),
            from: entry.from,
            generation: entry.generation,
        })
    }

    /// Forgets the conversations no binding names.
    pub fn retain(&self, bound: &[Source]) {
        let mut behind = self.behind.lock().unwrap_or_else(|e| e.into_inner());
        behind.retain(|s, _| bound.contains(s));
    }
}

fn is_due(b: &Behind) -> bool {
    b.tried.is_none_or(|t| t.elapsed() >= AGAIN)
}

/// One catch-up in progress; dropped, the conversation is free for the next.
pub struct Reading<'a> {
    lag: &'a Lag,
    source: Source,
    /// Read from the mark or from this point, whichever is older (`u64::MAX`: the mark).
    pub from: u64,
    generation: u64,
}

impl Reading<'_> {
    /// Everything up to the mark the caller just moved is stored: a later run reads from the
    /// mark, not again from the point this one began at (unless the conversation fell behind
    /// again meanwhile).
    pub fn passed_mark(&mut self) {
        let mut behind = self.lag.behind.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = behind.get_mut(&self.source).filter(|b| b.generation == self.generation) {
            b.from = u64::MAX;
        }
        self.from = u64::MAX;
    }

    /// Every message after the mark is stored: the conversation is no longer behind, unless it
    /// fell behind again meanwhile. True, for the caller's answer.
    pub fn caught_up(self) -> bool {
        let mut behind = self.lag.behind.lock().unwrap_or_else(|e| e.into_inner());
        if behind
            .get(&self.source)
            .is_some_and(|b| b.generation == self.generation)
        {
            behind.remove(&self.source);
        }
        true
    }
}

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        let mut reading = self.lag.reading.lock().unwrap_or_else(|e| e.into_inner());
        reading.remove(&self.source);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_catch_up_clears_only_what_it_began_for_and_runs_once_at_a_time() {
        let lag = Lag::default();
        let s = Source::new("slack", "U1:C1");
        lag.fell_behind(&s, 100, false);
        assert!(lag.due(&s) && lag.is_behind(&s));
        assert_eq!(lag.due_under("U1:"), ["C1"]);
        let reading = lag.start(&s).unwrap();
        assert_eq!(reading.from, 100);
        assert!(lag.start(&s).is_none(), "one catch-up at a time");
        assert!(reading.caught_up());
        assert!(lag.is_behind(&s), "the second start marked it behind again");
        let reading = lag.start(&s).unwrap();
        assert!(!lag.due(&s), "tried just now");
        lag.fell_behind(&s, 50, true);
        reading.caught_up();
        assert!(lag.is_behind(&s), "fell behind during the catch-up: not cleared");
        assert!(!lag.due(&s), "throttled");
        let mut reading = lag.start(&s).unwrap();
        assert_eq!(reading.from, 50, "the oldest point wins");
        reading.passed_mark();
        drop(reading);
        assert_eq!(
            lag.start(&s).map(|r| r.from),
            Some(u64::MAX),
            "past the mark: read from it"
        );
        let reading = lag.start(&s).unwrap();
        reading.caught_up();
        assert!(!lag.is_behind(&s));
        lag.fell_behind(&s, 1, false);
        lag.retain(&[]);
        assert!(!lag.is_behind(&s), "unbound: forgotten");
    }
}
