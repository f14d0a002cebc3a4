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
//! asked for in halves) and the list of stamps. Thread replies are not in a channel's history
//! (only their parents, and replies also sent to the channel): a reply posted while imgate was
//! off is not caught up.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::api::ApiError;
use super::event::{self, ts_micros, ts_of, Message};
use super::{high_water_key, ChannelInfo, Slack};
use crate::json::{self, Object, Value};
use crate::outbox::Cursor;
use crate::providers::with_retry;
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
    let stamps = match newer_than(slack, &tokens.bot, &info.channel, from) {
        Ok(stamps) => stamps,
        Err(e) => {
            log::warn!("slack: {source}: cannot read the channel's history: {e}; trying again later");
            return false;
        }
    };
    if let Some(&first) = stamps.first() {
        log::info!(
            "slack: {source}: catching up {} message(s) posted since {}",
            stamps.len(),
            ts_of(from)
        );
        let mut page = PAGE;
        let mut rest = &stamps[..];
        let mut after = first.saturating_sub(1);
        while !rest.is_empty() {
            let window = &rest[..page.min(rest.len())];
            let last = window[window.len() - 1];
            let messages = match window_of(slack, &tokens.bot, &info.channel, (after, last), window.len()) {
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
                .map(|m| slack.prepare(source, info, &tokens.bot, m))
                .collect();
            let stored = handled.into_iter().map(|h| slack.finish(source, h));
            // Every one is waited for: one not stored leaves the channel behind from it.
            if stored.fold(true, |all, ok| all & ok) {
                slack.counts.caught_up.fetch_add(count, Ordering::Relaxed);
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
    reading.caught_up()
}

/// The `ts` of every message after `from` (microseconds), oldest first: at most
/// `MAX_CATCHUP`, the newest when there are more.
fn newer_than(slack: &Slack, token: &str, channel: &str, from: u64) -> Result<Vec<u64>, ApiError> {
    let oldest = ts_of(from);
    let mut stamps = Vec::new();
    let mut cursor = String::new();
    let mut limit = PAGE * 2;
    let mut pages = 0;
    loop {
        pages += 1;
        if pages > MAX_PAGES {
            return Err(ApiError::refused(
                400,
                "the history did not end after as many pages as a catch-up reads",
            ));
        }
        let limit_text = limit.to_string();
        let mut params = vec![
            ("channel", channel),
            ("oldest", oldest.as_str()),
            ("limit", limit_text.as_str()),
        ];
        if !cursor.is_empty() {
            params.push(("cursor", cursor.as_str()));
        }
        let answer = match call(slack, token, &params) {
            Err(e) if e.too_large && limit > 1 => {
                limit /= 2;
                continue;
            }
            other => other?,
        };
        for ts in messages(&answer).filter_map(|m| json::get_str(m, "ts").and_then(ts_micros)) {
            if ts > from {
                stamps.push(ts);
            }
        }
        let more = matches!(answer.get("has_more"), Some(Value::Bool(true)));
        match next_cursor(&answer) {
            _ if stamps.len() >= MAX_CATCHUP => {
                if more {
                    log::warn!(
                        "slack: channel {channel}: more than {MAX_CATCHUP} messages to catch up; the oldest are not read"
                    );
                }
                break;
            }
            Some(next) if next != cursor => cursor = next.to_string(),
            // More, but no way to them: the channel stays behind rather than skip them.
            _ if more => {
                return Err(ApiError::refused(
                    400,
                    "the history has more pages but no usable cursor",
                ))
            }
            _ => break,
        }
    }
    stamps.sort_unstable();
    stamps.dedup();
    if stamps.len() > MAX_CATCHUP {
        let skipped = stamps.len() - MAX_CATCHUP;
        stamps.drain(..skipped);
    }
    Ok(stamps)
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
    let mut list: Vec<Message> = Vec::new();
    let mut cursor = String::new();
    for _ in 0..count.max(1) {
        // Both ends are in (`inclusive`): `after` is filtered out below, `last` is wanted.
        let mut params = vec![
            ("channel", channel),
            ("oldest", oldest.as_str()),
            ("latest", latest.as_str()),
            ("inclusive", "true"),
            ("limit", limit.as_str()),
        ];
        if !cursor.is_empty() {
            params.push(("cursor", cursor.as_str()));
        }
        let answer = call(slack, token, &params)?;
        list.extend(
            messages(&answer)
                .filter_map(|m| event::message_of(m).ok())
                .filter(|m| ts_micros(&m.ts).is_some_and(|ts| ts > after && ts <= last)),
        );
        match next_cursor(&answer) {
            Some(next) if list.len() < count && next != cursor => cursor = next.to_string(),
            _ => break,
        }
    }
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

fn call(slack: &Slack, token: &str, params: &[(&str, &str)]) -> Result<Object, ApiError> {
    let deadline = Instant::now() + CALL_DEADLINE;
    with_retry("slack: conversations.history", deadline, |left| {
        slack.api.call(token, "conversations.history", params, left)
    })
}

fn messages(answer: &Object) -> impl Iterator<Item = &Object> {
    let list = match json::get(answer, "messages") {
        Some(Value::Array(list)) => &list[..],
        _ => &[],
    };
    list.iter().filter_map(json::as_object)
}
