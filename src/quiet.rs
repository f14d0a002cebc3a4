//! Log lines for events that repeat as fast as clients can cause them (refused requests, a full
//! queue): at most one line a minute per subject, carrying how many went unlogged since, so a
//! flood cannot fill an SD card with the journal and the operator still sees that it happened.

use std::time::{Duration, Instant};

/// A subject is logged at most this often.
pub const EVERY: Duration = Duration::from_secs(60);

/// When one subject was last logged and how many of its events were not.
#[derive(Clone, Copy, Debug, Default)]
pub struct Quiet {
    last: Option<Instant>,
    since: u64,
}

impl Quiet {
    pub const fn new() -> Quiet {
        Quiet { last: None, since: 0 }
    }

    /// Whether this event gets a line: `Some` with the text to append to it (the count of the
    /// events not logged since the last line, if any), `None` to stay quiet.
    pub fn admit(&mut self) -> Option<String> {
        if self.last.is_some_and(|t| t.elapsed() < EVERY) {
            self.since += 1;
            return None;
        }
        let more = match self.since {
            0 => String::new(),
            n => format!(" ({n} more since the last line)"),
        };
        self.last = Some(Instant::now());
        self.since = 0;
        Some(more)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_gets_one_line_and_the_next_line_counts_the_rest() {
        let mut q = Quiet::default();
        assert_eq!(q.admit().as_deref(), Some(""));
        for _ in 0..5 {
            assert_eq!(q.admit(), None);
        }
        q.last = Some(Instant::now() - EVERY);
        assert_eq!(q.admit().as_deref(), Some(" (5 more since the last line)"));
        assert_eq!(q.admit(), None);
    }
}
