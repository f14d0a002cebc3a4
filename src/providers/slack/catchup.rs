//! The catch-up: Slack keeps nothing for an app whose socket is down beyond its own retries
//! (three, over about five minutes), but a channel's history is readable. After every
//! connection's hello, and when a message could not be stored, a channel is read from its
//! high-water mark (`conversations.history`), oldest first, each message through the same
//! intake as the socket's (its commit moves the mark), so messages posted while imgate was off
//! arrive once (`CHANNEL:TS` dedupes what the socket brings too) and in order.
//!
//! The history answers newest first, so it is read twice: a first pass keeps only the `ts` of
//! each message after the mark (at most `MAX_CATCHUP`, the newest: 8 bytes each); the second
//! asks for them again in windows of `PAGE`, oldest window first (each window's pages followed
//! too: Slack may answer fewer than asked), and stores each window before the next. Memory is one answer (capped at 1 MiB; a window whose answer is larger is
//! asked for in halves) and the list of stamps.
//!
//! Thread replies are not in a channel's history (only their parents, and replies also sent to
//! the channel), but a parent there carries its `latest_reply`. The first pass reads on past the
//! mark (at least `LOOKBACK` messages) for parents whose latest reply passed it; the replies
//! after the mark of those threads (at most `MAX_THREADS`, those with the newest replies) are
//! listed with `conversations.replies` and join the stamps, each window asks for its threads'
//! replies again, and every window is stored in `ts` order before the mark moves to its end: a
//! crash reads from the mark again, the threads found again by their `latest_reply`. A thread
//! whose parent is further back is not found.

use std::time::{Duration, Instant};

use super::api::{ApiError, PLATFORM};
use super::event::{self, ts_micros, ts_of, Message};
use super::{high_water_key, ChannelInfo, Slack};
use crate::json::{self, Object, Value};
use crate::outbox::Cursor;
use crate::providers::{with_retry, Transient};
use crate::quiet::Site;
use crate::source::Source;

/// At most this many messages are read in one catch-up: the newest, when more were posted.
pub const MAX_CATCHUP: usize = 10_000;
/// Messages asked for in one call (halved while an answer passes `api::MAX_ANSWER`).
const PAGE: usize = 100;
/// One history call, its rate-limit waits included, gives up after this long; the channel stays
/// behind and is read again later.
const CALL_DEADLINE: Duration = Duration::from_secs(60);
/// A cursor longer than this is not Slack's.
const MAX_CURSOR: usize = 1024;
/// A first pass reads at most this many pages (10,000 messages in pages of 200 are 50; a server
/// that answers empty pages with `has_more` forever is stopped here).
const MAX_PAGES: usize = 200;
/// The first pass reads at least this many messages from before the mark (the rest of their
/// page too) for the threads among them with replies after it: one page when the gap holds
/// fewer top-level messages than a page has room for past these.
const LOOKBACK: usize = 100;
/// Threads whose replies one catch-up reads: each costs a call to list them and one for each
/// window they are in. With more, those with the newest replies.
pub const MAX_THREADS: usize = 20;
/// Replies of one thread one catch-up reads, the oldest after the mark: a thread with more
/// holds the catch-up at the last one read (the next goes on from there), so the mark never
/// passes a reply not stored.
const MAX_REPLIES: usize = 500;
/// Pages of one thread read to list its replies (Slack may answer fewer than asked).
const THREAD_PAGES: usize = 10;

/// More threads than `MAX_THREADS` had replies in a gap.
static THREADS_LOG: Site = Site::new();
/// A thread Slack would not let the bot read.
static THREAD_REFUSED_LOG: Site = Site::new();

/// One message to catch up: its `ts`, and its thread's parent when it is a reply read from the
/// thread (`0`: from the channel's history). In order, history first for the same `ts` (a reply
/// also sent to the channel is in both).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Stamp {
    ts: u64,
    thread: u64,
}

/// What the first pass found: the history's messages after the mark, oldest first, and the
/// parents of the threads with replies after it, the newest replies first.
struct Gap {
    stamps: Vec<u64>,
    threads: Vec<u64>,
}

/// Reads the channel of `source` from its high-water mark into the outbox; true when it is
/// caught up (every message after the mark stored or not to be stored). A channel another
/// catch-up is reading now is left to it.
pub fn run(slack: &Slack, source: &Source, info: &ChannelInfo) -> bool {
    let Some(mut reading) = slack.lag.start(source) else {
        return false;
    };
    let floor = reading.from;
    let key = high_water_key(source);
    let mark = match slack.host.outbox.cursor(&key) {
        Ok(mark) => mark.and_then(|m| m.parse::<u64>().ok()),
        Err(e) => {
            log::debug!("slack: {source}: cannot read the high-water mark: {e}");
            return false;
        }
    };
    // A binding always sets the mark; without one there is nothing to read from.
    let Some(from) = mark.map(|m| m.min(floor)) else {
        return reading.caught_up();
    };
    let Some(tokens) = slack.tokens(&info.bot_user) else {
        return false;
    };
    let token = tokens.bot.as_str();
    let gap = match newer_than(slack, token, &info.channel, from) {
        Ok(gap) => gap,
        Err(e) => {
            log::warn!("slack: {source}: cannot read the channel's history: {e}; trying again later");
            return false;
        }
    };
    let mut stamps: Vec<Stamp> = gap.stamps.iter().map(|&ts| Stamp { ts, thread: 0 }).collect();
    // Where a thread with more replies than read holds this catch-up: nothing after is stored
    // now, so the mark cannot pass the replies left.
    let mut held: Option<u64> = None;
    for &parent in &gap.threads {
        match thread_stamps(slack, token, &info.channel, parent, from) {
            Ok((replies, complete)) => {
                match (complete, replies.last().copied()) {
                    (true, _) => {}
                    (false, Some(last)) => held = Some(held.map_or(last, |h| h.min(last))),
                    // Pages on and on with no reply past the mark (a server that ignores
                    // `oldest`): holding at the mark would hold the channel behind for good.
                    (false, None) => {
                        if let Some(more) = THREAD_REFUSED_LOG.admit() {
                            log::warn!(
                                "slack: {source}: a thread's pages brought no reply past the mark; its replies posted while the socket was down are not caught up{more}"
                            );
                        }
                    }
                }
                stamps.extend(replies.into_iter().map(|ts| Stamp { ts, thread: parent }));
            }
            Err(e) if refused_thread(&e) => {
                if let Some(more) = THREAD_REFUSED_LOG.admit() {
                    log::warn!(
                        "slack: {source}: a thread's replies cannot be read ({}); those posted while the socket was down are not caught up{more}",
                        crate::quiet::shown(&e.to_string())
                    );
                }
            }
            Err(e) => {
                log::warn!("slack: {source}: cannot read a thread of the channel: {e}; trying again later");
                return false;
            }
        }
    }
    stamps.sort_unstable();
    stamps.dedup_by_key(|s| s.ts);
    if let Some(held) = held {
        stamps.retain(|s| s.ts <= held);
        log::debug!("slack: {source}: a thread has more replies than one catch-up reads; read on from its last");
    }
    if let Some(first) = stamps.first().map(|s| s.ts) {
        let replies = stamps.iter().filter(|s| s.thread != 0).count();
        log::info!(
            "slack: {source}: catching up {} message(s), {replies} of them thread replies, posted since {}",
            stamps.len(),
            ts_of(from)
        );
        let mut page = PAGE;
        let mut rest = &stamps[..];
        let mut after = first.saturating_sub(1);
        while let Some(window) = rest.get(..page.min(rest.len())).filter(|w| !w.is_empty()) {
            let last = window.last().map_or(after, |s| s.ts);
            let messages = match read_window(slack, token, &info.channel, (after, last), window) {
                Ok(messages) => messages,
                Err(e) if e.too_large && page > 1 => {
                    page /= 2;
                    continue;
                }
                Err(e) => {
                    log::warn!("slack: {source}: cannot read the channel's history: {e}; trying again later");
                    return false;
                }
            };
            let count = messages.len() as u64;
            // The messages move no mark themselves: one not stored must not be passed by a
            // later one that was. The window's end moves it once all are in (a crash before
            // reads the window again, its messages duplicates by their ID).
            let handled: Vec<_> = messages
                .into_iter()
                .map(|m| slack.prepare(source, info, token, m))
                .collect();
            let stored = handled.into_iter().map(|h| slack.finish(source, h));
            // Every one is waited for: one not stored leaves the channel behind from it.
            if stored.fold(true, |all, ok| all & ok) {
                slack.counts.caught_up.add(count);
            } else {
                return false;
            }
            if super::plausible(last) {
                match slack.host.outbox.move_cursors(&[Cursor::Forward(key.clone(), last)]) {
                    Ok(()) => reading.passed_mark(),
                    Err(e) => log::debug!("slack: {source}: cannot move the high-water mark: {e}"),
                }
            }
            after = last;
            rest = &rest[window.len()..];
        }
    }
    if held.is_some() {
        // Still behind: the next catch-up reads on from the mark.
        return false;
    }
    reading.caught_up()
}

/// The `ts` of every message after `from` (microseconds), oldest first: at most
/// `MAX_CATCHUP`, the newest when there are more; and the threads with replies after `from`
/// among them and the `LOOKBACK` before.
fn newer_than(slack: &Slack, token: &str, channel: &str, from: u64) -> Result<Gap, ApiError> {
    let mut stamps = Vec::new();
    // (its newest reply, the parent), at most `MAX_THREADS` kept.
    let mut threads: Vec<(u64, u64)> = Vec::new();
    let mut dropped = false;
    // Messages read from before the mark.
    let mut before = 0usize;
    let mut cursor = String::new();
    let mut limit = PAGE * 2;
    let mut pages = 0;
    loop {
        pages += 1;
        if pages > MAX_PAGES {
            return Err(PLATFORM.refused(400, "the history did not end after as many pages as a catch-up reads"));
        }
        let limit_text = limit.to_string();
        let mut params = vec![("channel", channel), ("limit", limit_text.as_str())];
        if !cursor.is_empty() {
            params.push(("cursor", cursor.as_str()));
        }
        let answer = match call(slack, token, "conversations.history", &params) {
            Err(e) if e.too_large && limit > 1 => {
                limit /= 2;
                continue;
            }
            other => other?,
        };
        for m in messages(&answer) {
            let Some(ts) = json::get_str(m, "ts").and_then(ts_micros) else {
                continue;
            };
            if ts > from {
                stamps.push(ts);
            } else {
                before += 1;
            }
            threads.extend(active_thread(m, ts, from));
        }
        dropped |= keep_newest(&mut threads);
        let more = matches!(answer.get("has_more"), Some(Value::Bool(true)));
        match next_cursor(&answer) {
            _ if before >= LOOKBACK => break,
            _ if stamps.len() >= MAX_CATCHUP => {
                if more {
                    log::warn!(
                        "slack: channel {channel}: more than {MAX_CATCHUP} messages to catch up; the oldest are not read"
                    );
                }
                break;
            }
            Some(next) if next != cursor => cursor = next.to_string(),
            // More, but no way to them: the channel stays behind rather than skip them (past
            // the mark, only threads would be missed).
            _ if more && before == 0 => {
                return Err(PLATFORM.refused(400, "the history has more pages but no usable cursor"))
            }
            _ => break,
        }
    }
    if dropped {
        if let Some(more) = THREADS_LOG.admit() {
            log::warn!(
                "slack: channel {channel}: more than {MAX_THREADS} threads had replies while the socket was down; the replies of those with the oldest are not read{more}"
            );
        }
    }
    stamps.sort_unstable();
    stamps.dedup();
    if stamps.len() > MAX_CATCHUP {
        let skipped = stamps.len() - MAX_CATCHUP;
        stamps.drain(..skipped);
    }
    Ok(Gap {
        stamps,
        threads: threads.into_iter().map(|(_, parent)| parent).collect(),
    })
}

/// The thread of a history message with a reply after `from`: (that reply's ts, the parent). A
/// parent says its newest reply (`latest_reply`); a reply also sent to the channel is one.
fn active_thread(m: &Object, ts: u64, from: u64) -> Option<(u64, u64)> {
    let parent = json::get_str(m, "thread_ts").and_then(ts_micros)?;
    let newest = if parent == ts {
        json::get_str(m, "latest_reply").and_then(ts_micros)?
    } else {
        ts
    };
    (newest > from).then_some((newest, parent))
}

/// Keeps each thread once, with its newest reply, and the `MAX_THREADS` with the newest;
/// whether any was dropped.
fn keep_newest(threads: &mut Vec<(u64, u64)>) -> bool {
    threads.sort_unstable_by_key(|&(newest, parent)| (parent, std::cmp::Reverse(newest)));
    threads.dedup_by_key(|t| t.1);
    threads.sort_unstable_by_key(|&(newest, _)| std::cmp::Reverse(newest));
    let dropped = threads.len() > MAX_THREADS;
    threads.truncate(MAX_THREADS);
    dropped
}

/// The `ts` of the replies after `from` of the thread of `parent`, oldest first (at most
/// `MAX_REPLIES`), and whether they are all of them.
fn thread_stamps(
    slack: &Slack,
    token: &str,
    channel: &str,
    parent: u64,
    from: u64,
) -> Result<(Vec<u64>, bool), ApiError> {
    let (thread, oldest) = (ts_of(parent), ts_of(from));
    let mut replies: Vec<u64> = Vec::new();
    let mut cursor = String::new();
    let mut limit = PAGE * 2;
    for _ in 0..THREAD_PAGES {
        let answer = loop {
            let limit_text = limit.to_string();
            let mut params = vec![
                ("channel", channel),
                ("ts", thread.as_str()),
                ("oldest", oldest.as_str()),
                ("limit", limit_text.as_str()),
            ];
            if !cursor.is_empty() {
                params.push(("cursor", cursor.as_str()));
            }
            match call(slack, token, "conversations.replies", &params) {
                Err(e) if e.too_large && limit > 1 => limit /= 2,
                other => break other?,
            }
        };
        // The parent heads the first page whatever `oldest` says: only its replies count.
        replies.extend(
            messages(&answer)
                .filter(|m| json::get_str(m, "thread_ts").and_then(ts_micros) == Some(parent))
                .filter_map(|m| json::get_str(m, "ts").and_then(ts_micros))
                .filter(|&ts| ts > from && ts != parent),
        );
        replies.sort_unstable();
        replies.dedup();
        if replies.len() >= MAX_REPLIES {
            replies.truncate(MAX_REPLIES);
            return Ok((replies, false));
        }
        let more = matches!(answer.get("has_more"), Some(Value::Bool(true)));
        match next_cursor(&answer) {
            Some(next) if next != cursor => cursor = next.to_string(),
            _ if more => return Err(PLATFORM.refused(400, "the thread has more pages but no usable cursor")),
            _ => return Ok((replies, true)),
        }
    }
    Ok((replies, false))
}

/// Slack refused to read one thread (it is gone, or the bot may not read threads): its replies
/// are left out, the rest of the channel is caught up. Passing trouble keeps the channel behind.
fn refused_thread(e: &ApiError) -> bool {
    e.from_peer && !e.temporary()
}

/// A window's messages, `after` < ts ≤ `last`, oldest first: the history's and its threads'
/// replies.
fn read_window(
    slack: &Slack,
    token: &str,
    channel: &str,
    (after, last): (u64, u64),
    window: &[Stamp],
) -> Result<Vec<Message>, ApiError> {
    let history = window.iter().filter(|s| s.thread == 0).count();
    let mut list = match history {
        0 => Vec::new(),
        n => window_of(slack, token, channel, (after, last), n)?,
    };
    let mut threads: Vec<u64> = window.iter().map(|s| s.thread).filter(|&t| t != 0).collect();
    threads.sort_unstable();
    threads.dedup();
    for parent in threads {
        let wanted: Vec<u64> = window.iter().filter(|s| s.thread == parent).map(|s| s.ts).collect();
        match replies_in(slack, token, channel, parent, (after, last), &wanted) {
            Ok(replies) => list.extend(replies),
            // Gone since it was listed (deleted): nothing of it to store.
            Err(e) if refused_thread(&e) => log::debug!("slack: channel {channel}: a thread is gone: {e}"),
            Err(e) => return Err(e),
        }
    }
    list.sort_by_key(|m| ts_micros(&m.ts));
    list.dedup_by(|a, b| a.ts == b.ts);
    Ok(list)
}

/// The replies of the thread of `parent` with `after` < ts ≤ `last`; its pages are followed
/// until every one of `wanted` is in (at most one page each, and one more).
fn replies_in(
    slack: &Slack,
    token: &str,
    channel: &str,
    parent: u64,
    (after, last): (u64, u64),
    wanted: &[u64],
) -> Result<Vec<Message>, ApiError> {
    let (thread, oldest, latest) = (ts_of(parent), ts_of(after), ts_of(last));
    // The parent comes first and may count toward the limit.
    let limit = wanted.len().saturating_add(1).to_string();
    let params = [
        ("channel", channel),
        ("ts", thread.as_str()),
        ("oldest", oldest.as_str()),
        ("latest", latest.as_str()),
        ("inclusive", "true"),
        ("limit", limit.as_str()),
    ];
    let mut list: Vec<Message> = Vec::new();
    let pages = wanted.len().saturating_add(1);
    paged(slack, token, "conversations.replies", &params, pages, |answer| {
        list.extend(
            messages(answer)
                .filter_map(|m| event::message_of(m).ok())
                .filter(|m| m.thread_ts.as_deref().and_then(ts_micros) == Some(parent))
                .filter(|m| ts_micros(&m.ts).is_some_and(|ts| ts > after && ts <= last && ts != parent)),
        );
        !wanted.iter().all(|w| list.iter().any(|m| ts_micros(&m.ts) == Some(*w)))
    })?;
    Ok(list)
}

/// Calls `method` page after page (Slack's `cursor`), at most `pages` times, handing each
/// answer to `take`, which says whether another page is wanted.
fn paged(
    slack: &Slack,
    token: &str,
    method: &str,
    params: &[(&str, &str)],
    pages: usize,
    mut take: impl FnMut(&Object) -> bool,
) -> Result<(), ApiError> {
    let mut cursor = String::new();
    for _ in 0..pages.max(1) {
        let answer = {
            let mut params = params.to_vec();
            if !cursor.is_empty() {
                params.push(("cursor", cursor.as_str()));
            }
            call(slack, token, method, &params)?
        };
        let more = take(&answer);
        match next_cursor(&answer) {
            Some(next) if more && next != cursor => cursor = next.to_string(),
            _ => break,
        }
    }
    Ok(())
}

/// The `count` messages with `after` < ts ≤ `last`, oldest first. Slack may answer fewer
/// than asked: the window's pages are followed until it has no more (at most `count` pages).
fn window_of(
    slack: &Slack,
    token: &str,
    channel: &str,
    (after, last): (u64, u64),
    count: usize,
) -> Result<Vec<Message>, ApiError> {
    let (oldest, latest, limit) = (ts_of(after), ts_of(last), count.to_string());
    // Both ends are in (`inclusive`): `after` is filtered out below, `last` is wanted.
    let params = [
        ("channel", channel),
        ("oldest", oldest.as_str()),
        ("latest", latest.as_str()),
        ("inclusive", "true"),
        ("limit", limit.as_str()),
    ];
    let mut list: Vec<Message> = Vec::new();
    paged(slack, token, "conversations.history", &params, count, |answer| {
        list.extend(
            messages(answer)
                .filter_map(|m| event::message_of(m).ok())
                .filter(|m| ts_micros(&m.ts).is_some_and(|ts| ts > after && ts <= last)),
        );
        list.len() < count
    })?;
    list.sort_by_key(|m| ts_micros(&m.ts));
    list.dedup_by(|a, b| a.ts == b.ts);
    Ok(list)
}

/// The cursor of the next page, when the answer says there is one.
fn next_cursor(answer: &Object) -> Option<&str> {
    let next = json::get_obj(answer, "response_metadata")
        .and_then(|r| json::get_str(r, "next_cursor"))
        .filter(|n| !n.is_empty() && n.len() <= MAX_CURSOR)?;
    matches!(answer.get("has_more"), Some(Value::Bool(true))).then_some(next)
}

/// One call of `method`, its rate limits and passing failures retried within `CALL_DEADLINE`.
fn call(slack: &Slack, token: &str, method: &str, params: &[(&str, &str)]) -> Result<Object, ApiError> {
    let deadline = Instant::now() + CALL_DEADLINE;
    with_retry(&format!("slack: {method}"), deadline, |left| {
        slack.api.call(token, method, params, left)
    })
}

fn messages(answer: &Object) -> impl Iterator<Item = &Object> {
    let list = match json::get(answer, "messages") {
        Some(Value::Array(list)) => &list[..],
        _ => &[],
    };
    list.iter().filter_map(json::as_object)
}
