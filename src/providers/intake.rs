//! One intake for every provider: what a provider parsed from its IM system becomes an outbox
//! message here, the same way for all of them. The stale check (older than the TTL), the
//! message's file fetched into the file cache or noted in its text as unavailable, the reply
//! reference, the expiry, the provider's cursor, the hand-over to the group committer.
//!
//! The provider keeps what is its own: reading its events, whether a conversation is bound, how
//! it answers its IM system (`202`, an answer frame, an offset) once the `Ticket` resolves.

use std::collections::VecDeque;
use std::sync::Mutex;

use super::inbound::{FileItem, Inbound};
use super::Host;
use crate::ids;
use crate::outbox::{Cursor, Enqueued, NewMessage, ReplyRef, Ticket};
use crate::quiet::Subjects;
use crate::source::Source;

/// A message a provider read, for the outbox.
pub struct Arrival<'a> {
    pub source: Source,
    pub inbound: Inbound,
    /// A file of the message, fetched before it is stored.
    pub file: Option<Fetch<'a>>,
    /// Mint a reply reference (the conversation can be answered).
    pub reply_ref: bool,
    /// Consumer cursors moved in the same transaction.
    pub cursors: Vec<Cursor>,
    pub when_stale: WhenStale,
}

/// A file to fetch: its kind (`photo`) for the note if it cannot be had, and how to get it
/// into the file cache (the `Err` says why not).
pub struct Fetch<'a> {
    pub kind: String,
    pub fetch: Box<dyn FnOnce() -> Result<FileItem, String> + 'a>,
}

/// What a stale message (older than the TTL) means to its provider.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum WhenStale {
    /// The sender is told (a webhook's 409): nothing is counted.
    Refuse,
    /// The IM system delivered a backlog: the message is counted expired and confirmed.
    CountExpired,
}

/// What became of an arrival.
pub enum Intake {
    /// Older than the TTL: not stored.
    Stale,
    /// Handed to the committer; the ticket says how it ended.
    Submitted(Ticket),
}

/// How a submitted message's commit ended.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Committed {
    /// Stored, or a duplicate of a stored message.
    Stored,
    /// The queue is full (`reject_new`): not stored.
    Full,
    /// The store failed: not stored.
    Failed,
}

impl Host {
    /// Waits for a message's commit. A full queue is a warning, at most once a minute per
    /// provider, with `then`: what becomes of the message. A failure is said only at debug: the
    /// store says its outage once, and a line per message would flood the log.
    pub fn committed(&self, ticket: Ticket, source: &Source, then: &str) -> Committed {
        static FULL: Subjects = Subjects::new();
        match ticket.wait() {
            Ok(Enqueued::Accepted { .. } | Enqueued::Duplicate) => Committed::Stored,
            Ok(Enqueued::CapacityExceeded) => {
                if let Some(more) = FULL.admit(source.provider()) {
                    log::warn!("{source}: queue full; {then}{more}");
                }
                Committed::Full
            }
            Err(e) => {
                log::debug!("{source}: cannot store a message: {e}");
                Committed::Failed
            }
        }
    }

    /// Takes one message in: stale check, file, reply reference, submit.
    pub fn intake(&self, a: Arrival) -> Intake {
        let now = ids::now_ms();
        let ttl = self.ttl_ms();
        let source = a.source;
        if a.inbound.event_time.is_some_and(|t| t.saturating_add(ttl) <= now) {
            self.outbox.count_stale(source.as_str());
            if a.when_stale == WhenStale::CountExpired {
                if let Err(e) = self.outbox.record_expired(source.as_str(), 1) {
                    log::error!("{source}: cannot count a stale message: {e}");
                }
            }
            return Intake::Stale;
        }
        let mut inbound = a.inbound;
        if let Some(f) = a.file {
            // Fetched now: the IM system's file URLs carry its credentials or expire; ours do
            // neither.
            match (f.fetch)() {
                Ok(item) => inbound.files = Some(vec![item]),
                Err(why) => {
                    // A sender can send a file too large again and again: a line a minute per
                    // provider, with the count of the others.
                    static NOT_CACHED: Subjects = Subjects::new();
                    if let Some(more) = NOT_CACHED.admit(source.provider()) {
                        log::warn!("{source}: {} not cached: {why}{more}", f.kind);
                    }
                    inbound.text = format!("{} [{} not available: {why}]", inbound.text, f.kind)
                        .trim()
                        .to_string();
                }
            }
        }
        crate::faults::crash_at("intake-before-commit");
        let expires_at = now + ttl;
        // A reply is possible within the message's TTL, delivered or not; the reference leaves
        // with the message's dedupe entry.
        let reply_ref = a.reply_ref.then(|| {
            (
                ids::token("rr_"),
                ReplyRef {
                    source: source.to_string(),
                    message_id: inbound.message_id.clone(),
                    expires_at,
                    sender_id: Some(inbound.sender_id.clone()),
                },
            )
        });
        Intake::Submitted(self.outbox.submit(NewMessage {
            source: source.to_string(),
            message_id: inbound.message_id.clone(),
            payload: miniserde::json::to_string(&inbound),
            reply_ref,
            accepted_at: now,
            expires_at,
            cursors: a.cursors,
        }))
    }
}

/// Event and message IDs of a provider's recently stored messages: a redelivery (an IM system
/// that did not hear the answer) is answered at once, without fetching its file again. The
/// outbox's message-ID dedupe is what makes it a duplicate, also after a restart; this only
/// saves the work.
pub struct Recent {
    ids: Mutex<VecDeque<(String, String)>>,
    cap: usize,
}

impl Recent {
    pub fn new(cap: usize) -> Recent {
        Recent {
            ids: Mutex::new(VecDeque::new()),
            cap,
        }
    }

    /// Whether this event (an empty ID names none), or another delivery of its message, was
    /// stored lately.
    pub fn seen(&self, event_id: &str, message_id: &str) -> bool {
        let ids = self.ids.lock().unwrap_or_else(|e| e.into_inner());
        ids.iter()
            .any(|(e, m)| m == message_id || (!event_id.is_empty() && e == event_id))
    }

    pub fn stored(&self, event_id: String, message_id: String) {
        let mut ids = self.ids.lock().unwrap_or_else(|e| e.into_inner());
        if ids.len() >= self.cap {
            ids.pop_front();
        }
        ids.push_back((event_id, message_id));
    }
}
