//! The outbox's redb tables: what the overlay holds changes of (`overlay.rs`) and what a
//! transaction reads and changes through it (`tx.rs`), named here so that neither needs the other
//! for them.

use redb::TableDefinition;

/// `(source, seq)` → record (`record.rs`). `seq` grows per source: key order is acceptance order.
pub const MESSAGES: TableDefinition<(&str, u64), &str> = TableDefinition::new("messages");
/// `(source, seq)` → `"expires_at reply_ref message_id"` of delivered messages, for dedupe.
pub const DELIVERED: TableDefinition<(&str, u64), &str> = TableDefinition::new("delivered");
/// source → `Tally` JSON.
pub const COUNTERS: TableDefinition<&str, &str> = TableDefinition::new("counters");
/// reply_ref token → `ReplyRef` JSON; a reference leaves with its message or its dedupe entry.
pub const REPLY_REFS: TableDefinition<&str, &str> = TableDefinition::new("reply_refs");
