//! What the committer did since start, for `/metrics`: group commits, the messages they
//! carried, and how each provider's messages ended (accepted, duplicate, refused for full caps,
//! refused for a failed write), plus those the intake found stale before they reached it and
//! those the front door refused for what the sender sent.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Outcomes counted.
pub const COUNT: usize = 6;

/// How a message handed to the outbox ended, in `/metrics`' `outcome` label.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Outcome {
    /// Stored.
    Accepted,
    /// Its `message_id` was known: nothing stored, the sender told so.
    Duplicate,
    /// `reject_new` with full caps (or too big for them): nothing stored.
    Full,
    /// The store could not write: nothing stored, the sender not answered "got it".
    Failed,
    /// Older than the TTL when it arrived: not stored.
    Stale,
    /// Refused before the outbox for what the sender sent (a wrong secret, a malformed or too
    /// large body): not stored, the sender told so.
    Refused,
}

impl Outcome {
    pub const ALL: [Outcome; COUNT] = [
        Outcome::Accepted,
        Outcome::Duplicate,
        Outcome::Full,
        Outcome::Failed,
        Outcome::Stale,
        Outcome::Refused,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::Accepted => "accepted",
            Outcome::Duplicate => "duplicate",
            Outcome::Full => "full",
            Outcome::Failed => "failed",
            Outcome::Stale => "stale",
            Outcome::Refused => "refused",
        }
    }
}

/// Providers counted apart at most: sources come only from the registered providers (eight),
/// so this only bounds a mistake.
const MAX_PROVIDERS: usize = 32;

#[derive(Default)]
pub struct Outcomes {
    /// Group commits made.
    pub groups: AtomicUsize,
    /// Messages those commits carried.
    pub messages: AtomicUsize,
    /// provider → a count per `Outcome::ALL`.
    by_provider: Mutex<Vec<(String, [u64; COUNT])>>,
}

impl Outcomes {
    /// One message of `source` (`provider:key`) ended as `outcome`.
    pub fn count(&self, source: &str, outcome: Outcome) {
        let provider = source.split(':').next().unwrap_or(source);
        let mut v = self.by_provider.lock().unwrap_or_else(|e| e.into_inner());
        let i = match v.iter().position(|(p, _)| p == provider) {
            Some(i) => i,
            None if v.len() < MAX_PROVIDERS => {
                v.push((provider.to_string(), [0; COUNT]));
                v.len() - 1
            }
            None => return,
        };
        let slot = Outcome::ALL.iter().position(|o| *o == outcome).unwrap_or(0);
        v[i].1[slot] = v[i].1[slot].saturating_add(1);
    }

    /// The counts of `provider`, in `Outcome::ALL` order (zeros when none came yet).
    pub fn of(&self, provider: &str) -> [u64; COUNT] {
        let v = self.by_provider.lock().unwrap_or_else(|e| e.into_inner());
        v.iter().find(|(p, _)| p == provider).map_or([0; COUNT], |(_, c)| *c)
    }

    pub fn commits(&self) -> (u64, u64) {
        (
            self.groups.load(Ordering::Relaxed) as u64,
            self.messages.load(Ordering::Relaxed) as u64,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_provider_and_outcome() {
        let t = Outcomes::default();
        t.count("telegram:bot:1", Outcome::Accepted);
        t.count("telegram:bot:2", Outcome::Accepted);
        t.count("telegram:bot:1", Outcome::Duplicate);
        t.count("webhook:alerts", Outcome::Stale);
        assert_eq!(t.of("telegram"), [2, 1, 0, 0, 0, 0]);
        assert_eq!(t.of("webhook"), [0, 0, 0, 0, 1, 0]);
        assert_eq!(t.of("slack"), [0; COUNT]);
        for i in 0..100 {
            t.count(&format!("p{i}:x"), Outcome::Full);
        }
        assert_eq!(t.by_provider.lock().unwrap().len(), MAX_PROVIDERS, "bounded");
    }
}
