//! Log lines for events that repeat as fast as clients can cause them (refused requests, a full
//! queue): at most one line a minute per subject, carrying how many went unlogged since, so a
//! flood cannot fill an SD card with the journal and the operator still sees that it happened.
//!
//! The rule for every log line (ARCHITECTURE, "Logs a peer cannot forge or flood"):
//! - a line at info or above that a peer can cause at will (a webhook sender, xAgent, anyone
//!   on the port) goes through a `Quiet` of its own subject;
//! - text a peer chose (an ID, a name, an error message) is shown through `shown`: control and
//!   bidirectional-override characters escaped, so it cannot forge a line or drive a terminal,
//!   and at most `SHOWN` characters, so it cannot fill one.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Characters of peer text a log line shows at most.
pub const SHOWN: usize = 64;

/// Peer-chosen `text` as a log line may show it (see the rule above).
pub fn shown(text: &str) -> String {
    let mut out = String::new();
    for (i, c) in text.chars().enumerate() {
        if i == SHOWN {
            out.push('…');
            break;
        }
        let reorders = matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        if c.is_control() || reorders {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}

/// A log site shared by callers of several subjects (a provider's name): a `Quiet` for each, so
/// one subject's flood never hides another's line. At most `SUBJECTS` are kept; a new one takes
/// the place of the one logged longest ago.
pub struct Subjects(Mutex<Vec<(String, Quiet)>>);

const SUBJECTS: usize = 16;

impl Subjects {
    pub const fn new() -> Subjects {
        Subjects(Mutex::new(Vec::new()))
    }

    /// Whether a line of `subject` may be logged now; if so, the suffix counting its others.
    pub fn admit(&self, subject: &str) -> Option<String> {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, q)) = all.iter_mut().find(|(s, _)| s == subject) {
            return q.admit();
        }
        if all.len() >= SUBJECTS {
            let oldest = all.iter().enumerate().min_by_key(|(_, (_, q))| q.last).map(|(i, _)| i);
            if let Some(i) = oldest {
                all.swap_remove(i);
            }
        }
        let mut q = Quiet::new();
        let admitted = q.admit();
        all.push((subject.to_string(), q));
        admitted
    }
}

/// One log site's `Quiet`, shareable as a `static`.
#[derive(Default)]
pub struct Site(Mutex<Quiet>);

impl Site {
    pub const fn new() -> Site {
        Site(Mutex::new(Quiet::new()))
    }

    /// `Quiet::admit` for this site.
    pub fn admit(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).admit()
    }
}

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
    fn peer_text_cannot_forge_a_line_drive_a_terminal_or_fill_a_line() {
        let forged = "m1\n[2026-12-03T00:00:00Z ERROR imgate] forged\x1b]0;title\x07\x1b[31m\u{202e}";
        let s = shown(forged);
        assert!(!s.chars().any(|c| c.is_control()), "{s}");
        assert!(s.starts_with("m1\\u{a}[2026"), "{s}");
        assert!(s.contains("\\u{1b}") && s.contains("\\u{202e}"), "{s}");
        let long = shown(&"x".repeat(1 << 20));
        assert_eq!(long.chars().count(), SHOWN + 1);
        assert!(long.ends_with('…'));
        assert_eq!(shown("Ada Lovelace, 李"), "Ada Lovelace, 李");
    }

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

    #[test]
    fn one_subjects_flood_hides_no_other_subjects_line_and_the_subjects_are_bounded() {
        let s = Subjects::new();
        assert!(s.admit("discord: send").is_some());
        assert!(s.admit("discord: send").is_none(), "its second line waits");
        assert!(
            s.admit("dingtalk: send").is_some(),
            "another subject's first line is logged"
        );
        for i in 0..100 {
            s.admit(&format!("subject {i}"));
        }
        assert!(s.0.lock().unwrap().len() <= SUBJECTS);
    }
}
