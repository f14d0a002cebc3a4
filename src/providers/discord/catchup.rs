//! The catch-up: the Gateway keeps nothing for a bot whose session could not be resumed, but a
//! channel's history is readable. Whenever a session is new (after IDENTIFY: nothing was
//! replayed) and when a message could not be stored, a channel is read from its cursor
//! (`GET /channels/{id}/messages?after=CURSOR&limit=100`: the oldest 100 after it, listed
//! newest first), oldest first, each page through the same intake as the Gateway's; once a
//! page is stored its newest snowflake moves the cursor. Messages posted while imgate was off
//! arrive once (the snowflake dedupes what the Gateway brings too) and in order.
//!
//! Bounds: one answer (at most `api::MAX_ANSWER`, a page asked for in halves while larger);
//! `MAX_PAGES` pages (10,000 messages) per run, the rest in the next run (at a heartbeat 30 s
//! or more later); chunks of `CHUNK` messages handed to the outbox at once, each stored before
//! the next (a full queue costs one chunk's attachments, not a page's); and nothing older than
//! the TTL is read (it would only be counted expired).

use std::time::{Duration, Instant};

use super::api::{ApiError, PLATFORM};
use super::event::{self, Message};
use super::{cursor_key, ChannelInfo, Discord};
use crate::json::{self, Value};
use crate::providers::with_retry;
use crate::source::Source;

/// Messages asked for in one call (Discord's maximum).
const PAGE: usize = 100;
/// Messages of a page handed to the outbox at once.
const CHUNK: usize = 20;
/// Pages read in one run: 10,000 messages. More are read by the next run (30 s later).
const MAX_PAGES: usize = 100;
/// One history call, its rate-limit waits included, gives up after this long; the channel stays
/// behind and is read again later.
const CALL_DEADLINE: Duration = Duration::from_secs(60);

/// Reads the channel of `source` from its cursor into the outbox; true when it is caught up
/// (every message after the cursor stored, or not to be stored). A channel another catch-up
/// is reading now is left to it.
pub fn run(discord: &Discord, source: &Source, info: &ChannelInfo) -> bool {
    let Some(mut reading) = discord.lag.start(source) else {
        return false;
    };
    let key = cursor_key(source);
    let cursor = match discord.host.outbox.cursor(&key) {
        Ok(c) => c.and_then(|c| c.parse::<u64>().ok()),
        Err(e) => {
            log::debug!("discord: {source}: cannot read the cursor: {e}");
            return false;
        }
    };
    // The binding's start when the cursor did not reach the disk (a power cut right after).
    let cursor = cursor.map_or(info.from, |c| c.max(info.from)).min(reading.from);
    let Some(token) = discord.token(&info.bot_user) else {
        return false;
    };
    // What is older than the TTL would only be counted expired: not read at all.
    let oldest_kept = event::snowflake_at(crate::ids::now_ms().saturating_sub(discord.host.ttl_ms()));
    let mut after = cursor.max(oldest_kept.saturating_sub(1));
    log::debug!("discord: {source}: reading the channel's history after {after}");
    let mut limit = PAGE;
    let mut total = 0u64;
    for _ in 0..MAX_PAGES {
        let page = match page_after(discord, &token, &info.channel, after, limit) {
            Ok(page) => page,
            Err(e) if e.too_large && limit > 1 => {
                limit /= 2;
                continue;
            }
            Err(e) => {
                if let Some(more) = discord.history_log.admit() {
                    log::warn!("discord: {source}: cannot read the channel's history: {e}; trying again later{more}");
                }
                return false;
            }
        };
        let (got, newest) = (page.len(), page.last().map(|m| m.id));
        let Some(newest) = newest else {
            if total > 0 {
                log::info!("discord: {source}: caught up {total} message(s) from the channel's history");
            }
            return reading.caught_up();
        };
        // In chunks, each stored before the next is read from the page: a full queue refuses
        // the first chunk, and the others' attachments are not fetched for nothing. The page's
        // newest moves the cursor once all are in (a crash before reads the page again, its
        // messages duplicates by their ID).
        let mut rest = page;
        while !rest.is_empty() {
            let tail = rest.split_off(rest.len().min(CHUNK));
            let chunk = std::mem::replace(&mut rest, tail);
            if !discord.store_in_order(source, info, chunk).1 {
                return false;
            }
        }
        total += got as u64;
        discord.counts.caught_up.add(got as u64);
        if discord.move_cursor(source, newest) {
            reading.passed_mark();
        }
        after = newest;
    }
    log::info!(
        "discord: {source}: caught up {total} message(s); the rest at a heartbeat {} or more from now",
        crate::config::fmt_duration(crate::providers::lag::AGAIN)
    );
    false
}

/// The (at most `limit`) messages after snowflake `after`, oldest first; an empty page when
/// there are none (or the server answers only messages at or before `after`, which would never
/// end).
fn page_after(
    discord: &Discord,
    token: &str,
    channel: &str,
    after: u64,
    limit: usize,
) -> Result<Vec<Message>, ApiError> {
    let path = format!("/channels/{channel}/messages?after={after}&limit={limit}");
    let deadline = Instant::now() + CALL_DEADLINE;
    let answer = with_retry("discord: channel history", deadline, |left| {
        discord.api.get(token, &path, left)
    })?;
    let Value::Array(list) = answer else {
        return Err(PLATFORM.refused(200, "the history answer is not a list"));
    };
    let mut page: Vec<Message> = list
        .iter()
        .filter_map(json::as_object)
        .filter_map(|m| event::message_of(m).ok())
        .filter(|m| m.id > after && m.channel == channel)
        .collect();
    page.sort_by_key(|m| m.id);
    page.dedup_by_key(|m| m.id);
    page.truncate(limit);
    Ok(page)
}
