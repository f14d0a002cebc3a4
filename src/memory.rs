//! The memory the queue's caps let imgate take, said beside them (`imgate check`, a line at
//! start), as `fit` says the disk. A backlog itself is on the disk; what grows with it in
//! memory is the outbox's dedupe index, at most `BYTES_PER_ID` an ID, and the caps bound the
//! IDs it can hold: pending ones by `max_bytes_total` over the smallest message imgate stores,
//! delivered ones by `MAX_DELIVERED_IDS`.

use crate::config::{approx_size as approx, fmt_size};
use crate::outbox::{self, BYTES_PER_ID, BYTES_PER_SOURCE, MAX_DELIVERED_IDS};
use crate::providers::inbound::Inbound;

/// The memory budget of an edge appliance: a router with 64 or 128 MiB runs other things too.
pub const BUDGET: u64 = 16 << 20;
/// What imgate takes besides the index at its busiest. Measured: the boards' musl build 6.1
/// MiB at the default caps' largest backlog (`largest_backlog_at_the_default_total_cap`: 8.3
/// MiB peak, 2.2 MiB of it index); the x86_64 glibc build 8.3 MiB with 50,000 pending and 9.4
/// with 500,000, past the default caps (`bench_backlog_memory`).
pub const BESIDES_INDEX: u64 = 9 << 20;

/// What the caps allow.
#[derive(Debug, PartialEq)]
pub struct Allowed {
    /// The smallest record a message takes in the queue: its ID of one byte, nothing else.
    pub smallest_message: u64,
    pub pending_ids: u64,
    pub delivered_ids: u64,
}

impl Allowed {
    /// At `[queue] max_bytes_total`.
    pub fn of(max_bytes_total: u64) -> Allowed {
        let empty = Inbound {
            message_id: "x".into(),
            sender_id: String::new(),
            sender_name: None,
            chat_id: None,
            chat_type: String::new(),
            message_type: String::new(),
            text: String::new(),
            event_time: None,
            files: None,
        };
        let smallest_message = outbox::smallest_record(&miniserde::json::to_string(&empty));
        Allowed {
            smallest_message,
            pending_ids: max_bytes_total / smallest_message.max(1),
            delivered_ids: MAX_DELIVERED_IDS,
        }
    }

    /// Bytes of index at the caps.
    pub fn index_bytes(&self) -> u64 {
        self.pending_ids
            .saturating_add(self.delivered_ids)
            .saturating_mul(BYTES_PER_ID)
    }

    pub fn total(&self) -> u64 {
        self.index_bytes().saturating_add(BESIDES_INDEX)
    }

    /// What `imgate check` prints and the start logs, after `memory:`.
    pub fn line(&self) -> String {
        format!(
            "up to {} at the caps (budget {}): a dedupe index of up to {} ({} messages pending at \
             {} B the smallest, {} delivered IDs; and {} a channel), {} for the rest of imgate at \
             its busiest",
            approx(self.total()),
            approx(BUDGET),
            approx(self.index_bytes()),
            self.pending_ids,
            self.smallest_message,
            self.delivered_ids,
            approx(BYTES_PER_SOURCE),
            approx(BESIDES_INDEX)
        )
    }

    /// A warning when the caps let the index pass the budget, with the cap that keeps it.
    pub fn warning(&self) -> Option<String> {
        if self.total() <= BUDGET {
            return None;
        }
        let room = BUDGET.saturating_sub(BESIDES_INDEX) / BYTES_PER_ID;
        let pending = room.saturating_sub(self.delivered_ids);
        // Down to whole MiB, as a user would write it.
        let fits = (pending.saturating_mul(self.smallest_message) >> 20).max(1) << 20;
        Some(format!(
            "[queue] max_bytes_total lets a backlog of small messages take {} of memory, past the {} budget; \
             {} or less keeps within it (a backlog of larger messages takes less)",
            approx(self.total()),
            approx(BUDGET),
            fmt_size(fits)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_default_caps_keep_within_the_budget_and_a_larger_queue_is_told_what_fits() {
        let default = Allowed::of(64 * MIB);
        assert!(default.smallest_message > 150, "{default:?}");
        assert_eq!(default.warning(), None, "{}", default.line());
        let large = Allowed::of(512 * MIB);
        let w = large.warning().expect("past the budget");
        let fits: u64 = w
            .split_once(" or less")
            .and_then(|(head, _)| head.rsplit(' ').next())
            .and_then(|s| s.strip_suffix("MiB"))
            .and_then(|n| n.parse().ok())
            .expect(&w);
        assert_eq!(Allowed::of(fits * MIB).warning(), None, "what it names fits: {w}");
        assert!(
            Allowed::of((fits + 2) * MIB).warning().is_some(),
            "and not much more: {w}"
        );
    }
}
