//! The link supervisor: how every provider holds its links to an IM system, stated once. A
//! provider folder keeps only its protocol (its open call and hello, its frames, what an event
//! is); the machinery is here:
//!
//! - `Links` (accounts.rs): one link per account, started with its first binding and stopped
//!   with its last; each link's `Line` logs its state once per change and keeps a refusal
//!   (what only the owner can fix) for its bindings' Descriptors and `/status`.
//! - `supervise::run`: a long connection's loop: open (`Dial::open`), serve (`Dial::serve`),
//!   the next one next-before-old when the server asks, refusals asked again at their pace.
//! - `Conn` (conn.rs): one connection's reading: keepalive and silence, the byte budget, the
//!   writer's deadline, the drain before a close.
//! - `Backoff` and `Pace` (below): when the next attempt comes, for poll loops and long
//!   connections alike.
//!
//! Why a connection that worked is replaced at once: DingTalk and WeCom keep nothing for a
//! robot that is not connected, and Slack, Discord and Feishu deliver live what their catch-up
//! would otherwise fetch later; every second without a link loses messages or delays them.
//! Why only failures back off: an attempt that fails says the server (or the way to it) is not
//! ready, and asking again at once would be a storm.

pub mod accounts;
pub mod calls;
pub mod conn;
pub mod supervise;
pub mod workers;

pub use self::accounts::{followers, Followers, Line, Links};
pub use self::conn::{Conn, Heard, Keepalive};
pub use self::supervise::{Dial, Ended, Opened, Session};

use std::time::{Duration, Instant};

/// The first wait after a failure, and the longest, each before its jitter (up to half again).
pub const MIN_BACKOFF: Duration = Duration::from_secs(1);
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// A long connection that stayed up this long worked, and connections that worked are replaced
/// at most once per `MIN_AGE`: a server that closes every connection gets one per `MIN_AGE`.
pub const MIN_AGE: Duration = Duration::from_secs(10);

/// `wait` plus up to half of it again, at random, so accounts do not retry in step.
pub fn jittered(wait: Duration) -> Duration {
    let extra = crate::ids::below(wait.as_millis() as u64 / 2 + 1);
    wait.saturating_add(Duration::from_millis(extra))
}

/// The waits after failed attempts: `min` doubling to `max`, each jittered; a success starts it
/// over.
#[derive(Clone, Debug)]
pub struct Backoff {
    next: Duration,
    min: Duration,
    max: Duration,
}

impl Backoff {
    pub const fn new(min: Duration, max: Duration) -> Backoff {
        Backoff { next: min, min, max }
    }

    /// The usual one: `MIN_BACKOFF` doubling to `MAX_BACKOFF`.
    pub const fn standard() -> Backoff {
        Backoff::new(MIN_BACKOFF, MAX_BACKOFF)
    }

    /// An attempt failed: the wait before the next; the one after that is twice as long.
    pub fn failed(&mut self) -> Duration {
        let wait = jittered(self.next);
        self.next = self.next.saturating_mul(2).min(self.max);
        wait
    }

    /// An attempt worked: the next failure waits `min` again.
    pub fn reset(&mut self) {
        self.next = self.min;
    }
}

/// When a long connection's next socket opens. The rule: a connection that worked (the server
/// sent something on it, or it stayed up `MIN_AGE`) and ended, however it ended (closed by the
/// server, replaced on its request, dropped, fallen silent), is followed by the next one at
/// once; the only floor is that such replacements come at most once per `MIN_AGE`, so a single
/// drop costs no wait and a server that closes every connection gets one per `MIN_AGE`. An
/// attempt that failed (the open refused or unreachable, the handshake failed, a socket that
/// ended before it worked) waits the `Backoff`, which only a connection that worked starts over.
#[derive(Debug)]
pub struct Pace {
    backoff: Backoff,
    /// When the last connection opened.
    opened: Option<Instant>,
    /// When the last connection that worked was replaced (or is to be).
    replaced: Option<Instant>,
}

impl Default for Pace {
    fn default() -> Pace {
        Pace {
            backoff: Backoff::standard(),
            opened: None,
            replaced: None,
        }
    }
}

impl Pace {
    /// A connection is open now.
    pub fn opened(&mut self) {
        self.opened = Some(Instant::now());
    }

    /// Whether the connection opened last worked, given whether the server sent anything on it.
    pub fn worked(&self, heard: bool) -> bool {
        heard || self.opened.is_some_and(|t| t.elapsed() >= MIN_AGE)
    }

    /// The connection opened last ended: the wait before the next (at once after one that
    /// worked, but for the floor; the backoff after one that did not).
    pub fn ended(&mut self, heard: bool) -> Duration {
        match self.worked(heard) {
            true => self.after_work(),
            false => self.failed(),
        }
    }

    /// A connection that worked is to be replaced (it ended, or the server asked for another,
    /// as Slack's and DingTalk's `disconnect`): the wait before the next, the floor only.
    pub fn after_work(&mut self) -> Duration {
        self.backoff.reset();
        let now = Instant::now();
        // `MIN_AGE` after the last replacement, which may still be to come.
        let due = self.replaced.and_then(|t| t.checked_add(MIN_AGE));
        let wait = due.map_or(Duration::ZERO, |d| d.saturating_duration_since(now));
        self.replaced = now.checked_add(wait);
        wait
    }

    /// An attempt failed: the backoff's wait.
    pub fn failed(&mut self) -> Duration {
        self.backoff.failed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn within(wait: Duration, base: Duration) -> bool {
        wait >= base && wait <= base + base / 2
    }

    #[test]
    fn failures_double_to_the_cap_with_jitter_and_a_success_starts_over() {
        let mut b = Backoff::standard();
        let waits: Vec<Duration> = (0..8).map(|_| b.failed()).collect();
        let bases = [1, 2, 4, 8, 16, 32, 60, 60].map(Duration::from_secs);
        for (w, base) in waits.iter().zip(bases) {
            assert!(within(*w, base), "{w:?} for {base:?}");
        }
        b.reset();
        assert!(within(b.failed(), MIN_BACKOFF));
        let mut huge = Backoff::new(Duration::MAX / 2, Duration::MAX);
        huge.failed();
        huge.failed();
        assert!(huge.failed() >= Duration::MAX / 2, "no overflow");
    }

    #[test]
    fn a_connection_that_worked_is_followed_at_once_but_for_the_floor_and_only_failures_back_off() {
        // Failures: the backoff grows.
        let mut p = Pace::default();
        p.opened();
        assert!(within(p.ended(false), Duration::from_secs(1)), "died before it worked");
        p.opened();
        assert!(within(p.ended(false), Duration::from_secs(2)));
        // One that heard the server: the next at once, the first such replacement.
        p.opened();
        assert_eq!(p.ended(true), Duration::ZERO);
        // And the backoff starts over.
        p.opened();
        assert!(within(p.ended(false), MIN_BACKOFF));
        // Another that worked, right after: the floor, one replacement per `MIN_AGE`.
        p.opened();
        let wait = p.ended(true);
        assert!(wait <= MIN_AGE && wait > MIN_AGE - Duration::from_secs(1), "{wait:?}");
        // And the next one again a whole `MIN_AGE` after that.
        p.opened();
        let next = p.after_work();
        assert!(
            next >= wait + MIN_AGE - Duration::from_secs(1) && next <= wait + MIN_AGE,
            "{next:?} after {wait:?}"
        );
        // One that stayed up `MIN_AGE` worked, heard or not, and is followed at once.
        let mut p = Pace {
            opened: Instant::now().checked_sub(MIN_AGE),
            ..Pace::default()
        };
        if p.opened.is_some() {
            assert!(p.worked(false));
            assert_eq!(p.ended(false), Duration::ZERO);
        }
    }
}
