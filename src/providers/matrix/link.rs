//! One `/sync` long-poll loop per account, shared by every room bound through it: it starts with
//! the account's first binding and stops with its last (`Syncers::sync`), or when the homeserver
//! says the token is gone.
//!
//! Nothing is lost and nothing is stored twice:
//! - the sync cursor (`next_batch`) is stored in the transaction of the batch's last stored
//!   message (a `Cursor::Set`); a crash before it syncs again from the previous cursor, and what
//!   was stored already is a duplicate by its `event_id`;
//! - every joined room is in the filter: a room bound while a poll is under way is read back
//!   from that poll's answer on (it is not synced yet), and an unbound one is only listed;
//! - each stored message also keeps its room's last stored event (a binding sets it to the
//!   room's newest message), so a gap is filled up to it, or to an event handled lately:
//!   a `limited` timeline (more events than the filter's limit since the last sync), and every
//!   room the loop has not synced yet (its first answer after a start, or a room bound while a
//!   poll was under way), read back from the answer's `next_batch` with `/messages`;
//! - a batch with no message moves the cursor at most every `SAVE_EVERY`: an idle account does
//!   not write to the SD card every 30 s (syncing again from an older cursor only re-reads).

use std::collections::HashSet;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::api::{seg, Account, POLL_MS};
use super::event::{self, Event, Page, RoomBatch};
use super::{AccountState, Matrix, RoomInfo};
use crate::json;
use crate::outbox::Cursor;
use crate::peer_wait;
use crate::providers::intake::{Arrival, Committed, Fetch, Intake, WhenStale};
use crate::providers::link::workers::{Stop, Worker};
use crate::providers::link::{Backoff, Line};
use crate::source::Source;

/// The filter's timeline limit: events per room per answer (Synapse's own default).
const MAX_TIMELINE: u64 = 10;
/// A gap is read back at most this many pages of up to `PAGE` events (fewer when a page's answer
/// passes the cap); what lies before is not fetched (logged and counted).
const MAX_PAGES: usize = 200;
const PAGE: u64 = 50;
/// An idle account stores its sync cursor at most this often.
const SAVE_EVERY: Duration = Duration::from_secs(300);
/// A page of history is asked for within this.
const PAGE_DEADLINE: Duration = Duration::from_secs(20);

pub(super) fn since_key(account: &str) -> String {
    format!("matrix_since:{account}")
}

pub(super) fn last_key(source: &Source) -> String {
    format!("matrix_last:{source}")
}

/// The sync loop of `account` (signed in as `user`), on a thread of its own.
pub(super) fn start(mx: &Weak<Matrix>, user: &str, line: Line) -> Option<Worker> {
    let account = line.account().to_string();
    log::info!("matrix: syncing {} (account {account})", crate::quiet::shown(user));
    let mx = mx.clone();
    Worker::thread(format!("mx-sync-{}", &account[..8.min(account.len())]), move |stop| {
        run(mx, account, stop, line)
    })
}

/// What a room's timeline is asked for: its messages, and encryption turned on (after which
/// its messages can no longer be read).
const WATCHED: [&str; 2] = ["m.room.message", "m.room.encryption"];

/// The `/sync` query: every room's messages and their senders' member events, nothing else.
/// Every room, not only the bound ones: a room bound while a poll is under way ends that poll
/// with its first message (a filter of the bound rooms would hold it until the poll's timeout),
/// and a room no binding names yet is seen when someone writes in it (`/status` lists it).
/// `only`: the bound rooms alone, for an account in so many busy rooms that an answer with one
/// event per room passes the cap.
fn query(since: Option<&str>, limit: u64, only: Option<&[String]>) -> String {
    let mut room = vec![
        (
            "timeline",
            json::obj([("limit", json::n(limit)), ("types", json::strs(WATCHED))]),
        ),
        (
            "state",
            json::obj([
                ("types", json::strs(["m.room.member", "m.room.encryption"])),
                ("lazy_load_members", json::b(true)),
            ]),
        ),
        ("ephemeral", json::obj([("types", json::arr([]))])),
        ("account_data", json::obj([("types", json::arr([]))])),
    ];
    if let Some(rooms) = only {
        room.push(("rooms", json::strs(rooms.iter().map(String::as_str))));
    }
    let filter = json::obj([
        ("presence", json::obj([("types", json::arr([]))])),
        ("account_data", json::obj([("types", json::arr([]))])),
        ("room", json::obj(room)),
    ]);
    let filter = crate::upstream::query_value(&json::to_string(&filter));
    match since {
        Some(s) => format!(
            "filter={filter}&set_presence=offline&timeout={POLL_MS}&since={}",
            crate::upstream::query_value(s)
        ),
        // The first sync answers at once: it only finds where the account's stream is.
        None => format!("filter={filter}&set_presence=offline&timeout=0"),
    }
}

/// The loop. It holds the provider only between calls, so a long poll never delays a shutdown.
fn run(mx: Weak<Matrix>, account: String, stop: Arc<Stop>, mut line: Line) {
    let mut since: Option<String> = None;
    // The stored cursor is read once, at the start (not again after the server refused it).
    let mut stored = true;
    let mut saved: Option<String> = None;
    let mut saved_at = Instant::now();
    let mut synced: HashSet<String> = HashSet::new();
    let mut limit = MAX_TIMELINE;
    // Set once an answer passed the cap at one event per room: the bound rooms only.
    let mut narrow = false;
    let mut backoff = Backoff::standard();
    loop {
        let Some(state) = mx.upgrade().and_then(|m| {
            if stop.is_stopped() {
                return None;
            }
            let Some(state) = m.account_state(&account) else {
                // Its rooms are gone or expired, or its token: a later binding starts a new loop.
                m.syncers.forget(&account);
                return None;
            };
            if std::mem::take(&mut stored) {
                since = m.stored_since(&account);
                saved.clone_from(&since);
            }
            Some(state)
        }) else {
            return;
        };
        let bound: Vec<String> = state.rooms.iter().map(|(_, r)| r.room_id.clone()).collect();
        let q = query(since.as_deref(), limit, narrow.then_some(bound.as_slice()));
        let api = match mx.upgrade() {
            Some(m) => m.api.clone(),
            None => return,
        };
        let polled = api.sync(&state.account(), &q);
        let Some(m) = mx.upgrade() else { return };
        if stop.is_stopped() {
            return;
        }
        // The rooms as they are now: one bound or unbound while the poll was under way is
        // taken as it is now (the next pass ends the loop if none is left).
        let Some(state) = m.account_state(&account) else {
            continue;
        };
        synced.retain(|r| state.room(r).is_some());
        let wait = match polled {
            Ok(o) => match event::read_sync(&o) {
                None => Some(fail(
                    &mut line,
                    "a /sync answer without a usable next_batch",
                    &mut backoff,
                )),
                Some(answer) => {
                    drop(o);
                    line.works("syncing");
                    backoff.reset();
                    limit = limit.saturating_mul(2).min(MAX_TIMELINE);
                    let next = answer.next_batch.clone();
                    match accept(
                        &m,
                        &stop,
                        &state,
                        &answer,
                        &mut synced,
                        saved.as_deref() != Some(next.as_str()),
                    ) {
                        Ok(Stored::Cursor) => {
                            saved = Some(next.clone());
                            saved_at = Instant::now();
                        }
                        Ok(Stored::Nothing) => {
                            if saved.is_none() || saved_at.elapsed() >= SAVE_EVERY {
                                m.save_since(&account, &next);
                                saved = Some(next.clone());
                                saved_at = Instant::now();
                            }
                        }
                        Err(Stopped(wait)) => {
                            drop(m);
                            if stop.pause(wait) {
                                return;
                            }
                            continue;
                        }
                    }
                    since = Some(next);
                    None
                }
            },
            Err(e) if super::api::token_gone(&e) => {
                m.token_revoked(&account);
                return;
            }
            Err(e) if e.status == 400 && since.is_some() => {
                // A cursor the server no longer takes (a restored backup, a migrated server):
                // start from now; every room is read back to its last stored message.
                log::warn!(
                    "matrix: account {account}: the homeserver refused the sync cursor ({e}); reading each room back from now"
                );
                since = None;
                saved = None;
                synced.clear();
                Some(backoff.failed())
            }
            Err(e) if e.too_large && limit > 1 => {
                limit /= 2;
                log::debug!("matrix: account {account}: a /sync answer too large; asking for {limit} events per room");
                None
            }
            Err(e) if e.too_large && !narrow => {
                narrow = true;
                log::warn!(
                    "matrix: account {account}: its rooms' /sync answers pass the cap even at one event per room; asking for its bound rooms only (rooms no binding names are no longer listed, and a new binding waits for the running poll)"
                );
                None
            }
            Err(e) => {
                let ours = fail(&mut line, &format!("/sync failed: {e}"), &mut backoff);
                Some(peer_wait::retry_after(e.retry_after, ours))
            }
        };
        drop(m);
        if let Some(wait) = wait {
            if stop.pause(wait) {
                return;
            }
        }
    }
}

/// Logs a failure once until it changes; the wait before the next try.
fn fail(line: &mut Line, why: &str, backoff: &mut Backoff) -> Duration {
    line.set(format!("{why}; retrying with backoff"), true);
    backoff.failed()
}

/// How an answer went when nothing stopped it.
enum Stored {
    /// A stored message carried the new cursor.
    Cursor,
    /// Nothing carried it (nothing was stored, or not last).
    Nothing,
}

/// The batch stopped at a message that could not be stored; sync again after the wait.
struct Stopped(Duration);

/// Stores what one answer brought: gaps first, then the timelines, the last stored message
/// carrying the new cursor. `moved`: the answer's cursor is not the stored one.
fn accept(
    m: &Matrix,
    stop: &Stop,
    state: &AccountState,
    answer: &event::SyncAnswer,
    synced: &mut HashSet<String>,
    moved: bool,
) -> Result<Stored, Stopped> {
    let mut stored_any = false;
    let mut todo: Vec<(&Source, &RoomInfo, &Event)> = Vec::new();
    for room in &answer.rooms {
        let Some((source, info)) = state.room(&room.room_id) else {
            m.unbound_room(state, room);
            continue;
        };
        m.learn(room);
        if room.encrypted {
            m.room_encrypted(source);
            continue;
        }
        if !synced.contains(&room.room_id) {
            continue;
        }
        // What an earlier try of this answer (stopped part-way) or the previous answer already
        // handled: the events after it are new.
        let last = m.last_stored(source);
        let known = room
            .events
            .iter()
            .rposition(|e| Some(e.event_id.as_str()) == last.as_deref() || m.handled(source, &e.event_id));
        if room.limited && known.is_none() {
            if let Some(prev) = &room.prev_batch {
                stored_any |= backfill(m, stop, state, source, info, prev)?;
            }
        }
        let new = &room.events[known.map_or(0, |i| i + 1)..];
        todo.extend(new.iter().filter(|e| wanted(state, e)).map(|e| (source, info, e)));
    }
    for room_id in answer.invited.iter().filter(|r| state.room(r).is_none()) {
        m.host.unbound_seen(super::NAME, room_id, "invite");
    }
    // Rooms this loop has not synced: read back from the answer's cursor to their last stored
    // message (their timeline in this answer is part of what is read back).
    let fresh: Vec<&(Source, RoomInfo)> = state
        .rooms
        .iter()
        .filter(|(_, i)| !synced.contains(&i.room_id))
        .collect();
    for (source, info) in fresh {
        if answer.rooms.iter().any(|r| r.room_id == info.room_id && r.encrypted) {
            continue;
        }
        stored_any |= backfill(m, stop, state, source, info, &answer.next_batch)?;
        synced.insert(info.room_id.clone());
    }
    let last = todo.len();
    let mut carried = false;
    for (n, (source, info, e)) in todo.into_iter().enumerate() {
        let mut cursors = vec![Cursor::Set(last_key(source), e.event_id.clone())];
        let carries = n + 1 == last && moved;
        if carries {
            cursors.push(Cursor::Set(since_key(&state.id), answer.next_batch.clone()));
        }
        if store(m, state, source, info, e, cursors)? {
            stored_any = true;
            carried |= carries;
        }
    }
    // Every room's newest event is handled now: a `limited` gap in the next answer is read
    // back to it at most.
    for room in &answer.rooms {
        if let (Some((source, _)), Some(newest)) = (state.room(&room.room_id), room.events.last()) {
            m.saw_newest(source, &newest.event_id);
        }
    }
    if carried {
        return Ok(Stored::Cursor);
    }
    if stored_any && moved {
        // Something was stored without the cursor (the last was stale): move it now, so a
        // restart does not read it all back.
        m.save_since(&state.id, &answer.next_batch);
        return Ok(Stored::Cursor);
    }
    Ok(Stored::Nothing)
}

/// Whether an event is one to store: a message (not a notice: bots answer no bot), not the
/// account's own. (What was said before the binding lies behind the room's last stored event,
/// which the binding set.)
fn wanted(state: &AccountState, e: &Event) -> bool {
    e.sender != state.user_id && e.message.as_ref().is_some_and(|msg| msg.kind != "notice")
}

/// Stores one message; `Ok(false)` when nothing was stored now: older than the TTL (counted
/// expired), stored lately already (its file is not fetched again), or its room unbound since.
fn store(
    m: &Matrix,
    state: &AccountState,
    source: &Source,
    info: &RoomInfo,
    e: &Event,
    cursors: Vec<Cursor>,
) -> Result<bool, Stopped> {
    let Some(msg) = &e.message else {
        return Ok(false);
    };
    if m.recent.seen(&e.event_id, &e.event_id) {
        return Ok(false);
    }
    match m.host.channels.bound_channel(source.as_str()) {
        Ok(Some(_)) => {}
        Ok(None) => return Ok(false),
        Err(err) => {
            log::debug!("matrix: {source}: cannot read the binding: {err}");
            return Err(Stopped(Duration::from_secs(1)));
        }
    }
    let inbound = m.inbound_of(info, e, msg);
    let fetched_for = source.to_string();
    let arrival = Arrival {
        source: source.clone(),
        file: msg.media.as_ref().map(|media| Fetch {
            kind: msg.kind.to_string(),
            fetch: Box::new(move || m.fetch(state, &fetched_for, media)),
        }),
        inbound,
        reply_ref: true,
        cursors,
        when_stale: WhenStale::CountExpired,
    };
    let ticket = match m.host.intake(arrival) {
        Intake::Stale => return Ok(false),
        Intake::Submitted(ticket) => ticket,
    };
    // reject_new: the homeserver keeps the messages; the cursor stays (backpressure).
    match m
        .host
        .committed(ticket, source, "leaving messages at the homeserver until there is room")
    {
        Committed::Stored => {
            m.recent.stored(e.event_id.clone(), e.event_id.clone());
            Ok(true)
        }
        Committed::Full => Err(Stopped(Duration::from_secs(5))),
        Committed::Failed => Err(Stopped(Duration::from_secs(1))),
    }
}

/// Reads a room's history back from `from` to its last stored message (or its binding, or the
/// TTL) and stores what lies after it, oldest first. One page is held at a time: the way back
/// keeps only the pages' tokens, and each newer page is read again on the way forward.
fn backfill(
    m: &Matrix,
    stop: &Stop,
    state: &AccountState,
    source: &Source,
    info: &RoomInfo,
    from: &str,
) -> Result<bool, Stopped> {
    // A long read-back ends with a shutdown or the account's last binding, between pages.
    let go_on = || match stop.is_stopped() {
        true => Err(Stopped(Duration::ZERO)),
        false => Ok(()),
    };
    let last = m.last_stored(source);
    let oldest_wanted = info.bound_at.max(crate::ids::now_ms().saturating_sub(m.host.ttl_ms()));
    let acct = state.account();
    // The way back: the tokens of the pages read (with the size each was read at), up to the
    // page that holds the edge.
    let mut tokens: Vec<(String, u64)> = Vec::new();
    let mut from = (from.to_string(), PAGE);
    let (oldest, edge) = loop {
        go_on()?;
        let Some((page, limit)) = page(m, &acct, info, &from.0, from.1)? else {
            return Ok(false);
        };
        tokens.push((std::mem::take(&mut from.0), limit));
        // The edge is an event already handled. A timestamp is the sending server's to choose,
        // so it ends the way back only when a whole page is older than what is wanted.
        let handled = page
            .events
            .iter()
            .position(|e| Some(e.event_id.as_str()) == last.as_deref() || m.handled(source, &e.event_id));
        if let Some(i) = handled {
            break (page, i);
        }
        if !page.events.is_empty() && page.events.iter().all(|e| e.ts < oldest_wanted) {
            break (page, 0);
        }
        let n = page.events.len();
        match page.end.clone() {
            Some(end) if n > 0 && tokens.len() < MAX_PAGES => from = (end, limit),
            Some(_) if n > 0 => {
                m.gap_too_long(source, MAX_PAGES as u64);
                break (page, n);
            }
            // The start of the room's history.
            _ => break (page, n),
        }
    };
    // The way forward: the oldest page (held), then each newer one read again.
    let mut stored = store_page(m, state, source, info, &oldest, edge)?;
    drop(oldest);
    for (token, limit) in tokens.iter().rev().skip(1) {
        go_on()?;
        let Some((p, fitted)) = page(m, &acct, info, token, *limit)? else {
            return Ok(stored);
        };
        if fitted != *limit {
            // Not the page read on the way back: the events between would be skipped.
            return Err(Stopped(Duration::from_secs(5)));
        }
        stored |= store_page(m, state, source, info, &p, p.events.len())?;
    }
    Ok(stored)
}

/// Stores the events of a page (newest first) before index `edge`, oldest first.
fn store_page(
    m: &Matrix,
    state: &AccountState,
    source: &Source,
    info: &RoomInfo,
    page: &Page,
    edge: usize,
) -> Result<bool, Stopped> {
    m.learn_names(&info.room_id, &page.names);
    let mut stored = false;
    let newer = &page.events[..edge.min(page.events.len())];
    for e in newer.iter().rev().filter(|e| wanted(state, e)) {
        stored |= store(
            m,
            state,
            source,
            info,
            e,
            vec![Cursor::Set(last_key(source), e.event_id.clone())],
        )?;
    }
    Ok(stored)
}

/// One page of the room's messages before `from`, newest first, of at most `limit` events:
/// fewer when the answer passes the cap. The page and the limit it was read at; `None` when the
/// server refuses the room's history for good (the account left it, the room is gone): the
/// room is skipped, not the account's other rooms with it.
fn page(
    m: &Matrix,
    acct: &Account,
    info: &RoomInfo,
    from: &str,
    mut limit: u64,
) -> Result<Option<(Page, u64)>, Stopped> {
    let filter = json::obj([
        ("types", json::strs(["m.room.message"])),
        ("lazy_load_members", json::b(true)),
    ]);
    let filter = crate::upstream::query_value(&json::to_string(&filter));
    loop {
        let path = format!(
            "/rooms/{}/messages?dir=b&limit={limit}&from={}&filter={filter}",
            seg(&info.room_id),
            crate::upstream::query_value(from),
        );
        match m.api.get(acct, &path, PAGE_DEADLINE) {
            Ok(o) => return Ok(Some((event::read_page(&o), limit))),
            Err(e) if e.too_large && limit > 1 => limit /= 2,
            Err(e) => {
                m.history_failed(&info.room_id, &e);
                if super::api::token_gone(&e) || crate::providers::Transient::temporary(&e) {
                    return Err(Stopped(peer_wait::retry_after(e.retry_after, Duration::from_secs(5))));
                }
                return Ok(None);
            }
        }
    }
}

impl Matrix {
    /// What the room's batch says about its members.
    fn learn(&self, room: &RoomBatch) {
        self.learn_names(&room.room_id, &room.names);
        if let Some(n) = room.members {
            self.set_members(&room.room_id, n);
        }
    }

    /// A room the account is in that no binding names: listed for the owner (`/status`
    /// `unbound_recent`) when someone else wrote in it, never stored.
    fn unbound_room(&self, state: &AccountState, room: &RoomBatch) {
        // Kept even without a message: a server names the count only when it changed.
        if let Some(n) = room.members {
            self.set_members(&room.room_id, n);
        }
        if !room.events.iter().any(|e| wanted(state, e)) {
            return;
        }
        let kind = match self.members_of(&room.room_id) {
            Some(2) => "dm",
            _ => "group",
        };
        self.host.unbound_seen(super::NAME, &room.room_id, kind);
    }
}
