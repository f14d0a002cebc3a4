//! One `getUpdates` long-poll loop per distinct bot, shared by every channel bound to a chat of
//! that bot: it starts with the first binding and stops with the last (`Pollers::sync`).
//!
//! The update offset is written in the same transaction that accepts a message, so a crash
//! between `getUpdates` and the commit re-reads the update (never skips it) and the commit
//! that took a message also moved the offset past it (never accepts it twice).

use std::sync::{Arc, Weak};
use std::time::Duration;

use super::api::{Api, ApiError, FETCH_DEADLINE, PLATFORM, POLL_SECONDS};
use super::event::{read_update, Media};
use super::{source_of, ChatInfo, Telegram};
use crate::json::{self, obj, strs, Value};
use crate::outbox::Cursor;
use crate::peer_wait;
use crate::providers::inbound::FileItem;
use crate::providers::intake::{Arrival, Committed, Fetch, Intake, WhenStale};
use crate::providers::link::workers::{Stop, Worker};
use crate::providers::link::Backoff;
use crate::providers::link::Line;

pub(super) fn offset_key(bot_id: u64) -> String {
    format!("telegram_offset:{bot_id}")
}

/// The poll loop of `info`'s bot, on a thread of its own.
pub(super) fn start(tg: &Weak<Telegram>, info: ChatInfo, line: Line) -> Option<Worker> {
    log::info!(
        "telegram: polling bot @{} ({})",
        crate::quiet::shown(&info.bot_username),
        info.bot_id
    );
    let tg = tg.clone();
    Worker::thread(format!("tg-poll-{}", info.bot_id), move |stop| {
        run(tg, info, stop, line)
    })
}

/// Updates one `getUpdates` asks for at most (Telegram's own default and maximum).
const MAX_BATCH: u64 = 100;

/// The loop. It holds the provider only between calls, so a long poll never delays a shutdown.
fn run(tg: Weak<Telegram>, info: ChatInfo, stop: Arc<Stop>, mut line: Line) {
    let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
    // Updates asked for at once: halved while answers pass `MAX_ANSWER`, doubled back after.
    let mut batch = MAX_BATCH;
    loop {
        let Some((token, offset)) = tg.upgrade().and_then(|t| {
            if stop.is_stopped() {
                return None;
            }
            let offset = t.offset(info.bot_id).unwrap_or_else(|e| {
                log::debug!("telegram: cannot read the update offset: {e}");
                None
            });
            Some((t.token_for(&info)?, offset.unwrap_or(0)))
        }) else {
            return;
        };
        let params = obj([
            ("offset", json::n(offset)),
            ("timeout", json::n(POLL_SECONDS)),
            ("limit", json::n(batch)),
            ("allowed_updates", strs(["message"])),
        ]);
        let polled = match tg.upgrade() {
            Some(t) => {
                let api = t.api.clone();
                drop(t);
                api.call(&token, "getUpdates", &params)
            }
            None => return,
        };
        let wait = match polled {
            Ok(Value::Array(updates)) => {
                backoff.reset();
                batch = batch.saturating_mul(2).min(MAX_BATCH);
                line.works("polling");
                let Some(t) = tg.upgrade() else { return };
                if stop.is_stopped() {
                    return;
                }
                match accept(&t, &token, info.bot_id, &updates) {
                    Batch::Confirmed => None,
                    Batch::Stopped { wait } => Some(wait),
                }
            }
            Ok(_) => Some(backoff.failed()),
            Err(e) if e.too_large && batch > 1 => {
                batch /= 2;
                log::debug!(
                    "telegram: bot {}: an answer too large; asking for {batch} updates",
                    info.bot_id
                );
                None
            }
            Err(e) => {
                line.set(format!("getUpdates failed: {e}; retrying with backoff"), true);
                let ours = backoff.failed();
                Some(match e.status {
                    401 => Duration::from_secs(60),
                    _ => peer_wait::retry_after(e.retry_after, ours),
                })
            }
        };
        if let Some(wait) = wait {
            if stop.pause(wait) {
                return;
            }
        }
    }
}

/// How a batch of updates went.
pub(super) enum Batch {
    /// Every update was stored or needs nothing stored: the offset moved past all of them.
    Confirmed,
    /// Stopped at an update that could not be stored (a full queue, the store): Telegram keeps
    /// it and the rest; ask again after `wait`.
    Stopped { wait: Duration },
}

/// Accepts one batch of updates of bot `bot_id`.
pub(super) fn accept(tg: &Telegram, token: &str, bot_id: u64, updates: &[Value]) -> Batch {
    let host = &tg.host;
    let key = offset_key(bot_id);
    let mut next = 0;
    for update in updates.iter().filter_map(json::as_object).filter_map(read_update) {
        let after = update.after;
        let Some(message) = update.message else {
            next = next.max(after);
            continue;
        };
        let source = source_of(bot_id, message.chat_id);
        match host.channels.bound_channel(source.as_str()) {
            Ok(Some(_)) => {}
            Err(e) => {
                // The store cannot tell: leave the update at Telegram and try again.
                log::debug!("telegram: {source}: cannot read the binding: {e}");
                return Batch::Stopped {
                    wait: Duration::from_secs(1),
                };
            }
            Ok(None) => {
                tg.unbound_updates.add(1);
                let kind = if message.inbound.chat_type == "p2p" {
                    "dm"
                } else {
                    "group"
                };
                host.unbound_seen("telegram", &message.chat_id.to_string(), kind);
                log::debug!("telegram: bot {}: update from a chat no channel is bound to", bot_id);
                next = next.max(after);
                continue;
            }
        }
        let fetched_for = source.to_string();
        let arrival = Arrival {
            source: source.clone(),
            file: message.media.map(|media| Fetch {
                kind: media.kind.to_string(),
                fetch: Box::new(move || fetch(tg, token, &fetched_for, &media)),
            }),
            inbound: message.inbound,
            reply_ref: true,
            cursors: vec![Cursor::Forward(key.clone(), after)],
            when_stale: WhenStale::CountExpired,
        };
        let ticket = match host.intake(arrival) {
            // A backlog after a long outage: older than the TTL, never pushed.
            Intake::Stale => {
                next = next.max(after);
                continue;
            }
            Intake::Submitted(ticket) => ticket,
        };
        // reject_new: Telegram keeps the update; the offset stays (backpressure).
        let wait = match host.committed(ticket, &source, "leaving updates at Telegram until there is room") {
            Committed::Stored => Duration::ZERO,
            Committed::Full => Duration::from_secs(5),
            Committed::Failed => Duration::from_secs(1),
        };
        if !wait.is_zero() {
            return Batch::Stopped { wait };
        }
        next = next.max(after);
    }
    if next > 0 {
        // Updates that stored nothing (other kinds, unbound chats, expired) are confirmed too.
        let moved = host.outbox.move_cursors(&[Cursor::Forward(key.clone(), next)]);
        if let Err(e) = moved {
            log::error!("telegram: cannot store the update offset: {e}");
        }
    }
    Batch::Confirmed
}

/// `getFile` and the download, into the file cache.
fn fetch(tg: &Telegram, token: &str, source: &str, media: &Media) -> Result<FileItem, String> {
    let api: &Api = &tg.api;
    let limit = tg.host.config.files.max_file_bytes;
    if media.file_size.is_some_and(|s| s > limit) {
        return Err("larger than [files] max_file_bytes".into());
    }
    let deadline = std::time::Instant::now() + FETCH_DEADLINE;
    let params = obj([("file_id", json::s(&media.file_id))]);
    let info = super::with_retry("getFile", deadline, |left| {
        api.call_within(token, "getFile", &params, left)
    })
    .map_err(|e| e.to_string())?;
    let path = json::as_object(&info)
        .and_then(|o| json::get_str(o, "file_path"))
        .ok_or("getFile gave no file_path")?
        .to_string();
    let files = &tg.host.files;
    // Each attempt writes a new `.part` (a failed one removes its bytes as it drops).
    let part = super::with_retry("file download", deadline, |left| {
        let mut part = files.begin(source, "in").map_err(|e| PLATFORM.cache(e))?;
        api.download(token, &path, &mut part, left)?;
        Ok::<_, ApiError>(part)
    })
    .map_err(|e| e.to_string())?;
    let (file_ref, rec) = files
        .commit(part, &media.filename, &media.mime_type)
        .map_err(|e| e.to_string())?;
    Ok(FileItem::cached(file_ref, rec))
}
