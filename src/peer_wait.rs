//! Waits a peer names (Telegram's `retry_after`, a long connection's reconnect interval) are
//! the peer's to choose and ours to bound: each is clamped to a maximum stated here and compared
//! with a deadline without adding it to the clock. No answer can then overflow an `Instant` (a
//! panic, and with `panic = "abort"` an outage) or park a poller for years.

use std::time::{Duration, Instant};

/// The longest rate-limit wait honoured (`retry_after`): a peer that asks for more is asked
/// again after this, which costs it one refused call a minute.
pub const RETRY_AFTER_MAX: Duration = Duration::from_secs(60);
/// The shortest: a peer that refuses a call and says "again at once" (`Retry-After: 0`) is not
/// asked again in a loop.
pub const RETRY_AFTER_MIN: Duration = Duration::from_millis(250);
/// The longest reconnect interval a server may set for a long connection.
pub const RECONNECT_MAX: Duration = Duration::from_secs(600);

/// How long to wait before trying again: what the peer asked for (`retry_after`), within
/// `RETRY_AFTER_MIN` and `RETRY_AFTER_MAX`, or our own `backoff` when it asked for nothing.
pub fn retry_after(peer: Option<Duration>, backoff: Duration) -> Duration {
    peer.map_or(backoff, |w| w.clamp(RETRY_AFTER_MIN, RETRY_AFTER_MAX))
}

/// Whether waiting `wait` from now would pass `deadline`.
pub fn passes(deadline: Instant, wait: Duration) -> bool {
    deadline.saturating_duration_since(Instant::now()) <= wait
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `u64` a peer could send, at the edges and spread between them.
    fn peer_values() -> Vec<u64> {
        let mut values = vec![0, 1, 59, 60, 61, 600, 601, u64::MAX / 2, u64::MAX - 1, u64::MAX];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..10_000 {
            // xorshift: values of every magnitude.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            values.push(x >> (x % 64));
        }
        values
    }

    #[test]
    fn no_value_a_peer_sends_panics_or_waits_past_the_maximum() {
        let now = Instant::now();
        for v in peer_values() {
            let wait = retry_after(Some(Duration::from_secs(v)), Duration::ZERO);
            let want = Duration::from_secs(v).clamp(RETRY_AFTER_MIN, RETRY_AFTER_MAX);
            assert_eq!(wait, want, "{v}");
            let _ = passes(now, wait);
            // Unclamped durations too: the comparison itself never adds to the clock.
            let _ = passes(now, Duration::new(v, (v % 1_000_000_000) as u32));
        }
        assert_eq!(retry_after(None, Duration::from_secs(2)), Duration::from_secs(2));
        assert_eq!(
            retry_after(Some(Duration::ZERO), Duration::from_secs(2)),
            RETRY_AFTER_MIN,
            "not at once"
        );
        assert!(passes(now + Duration::from_secs(5), Duration::MAX));
        assert!(!passes(now + Duration::from_secs(3600), Duration::from_secs(1)));
    }
}
