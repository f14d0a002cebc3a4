//! One `getUpdates` long-poll loop per distinct bot, shared by every channel bound to a chat of
//! that bot: it starts with the first binding and stops with the last (`Pollers::sync`).
//!
//! The update offset is written in the same transaction that accepts a message, so a crash
//! between `getUpdates` and the commit re-reads the update (never skips it) and the commit
//! that took a message also moved the offset past it (never accepts it twice).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::api::{Api, ApiError, FETCH_DEADLINE, PLATFORM, POLL_SECONDS};
use super::{source_of, ChatInfo, Telegram};
use crate::json::{self, obj, strs, Value};
use crate::outbox::{Cursor, Enqueued};
use crate::peer_wait;
use crate::providers::inbound::{FileItem, Inbound};
use crate::providers::intake::{Arrival, Fetch, Intake, WhenStale};
use crate::providers::link::Backoff;
use crate::providers::workers::{Stop, Worker, Workers};

/// The running poll loops, by bot ID.
pub struct Pollers(Workers<u64>);

impl Default for Pollers {
    fn default() -> Pollers {
        Pollers(Workers::new("telegram: bot", "poller"))
    }
}

pub(super) fn offset_key(bot_id: u64) -> String {
    format!("telegram_offset:{bot_id}")
}

impl Pollers {
    /// Starts a loop for every bot in `wanted` and stops the loops of the others.
    pub(super) fn sync(&self, tg: &Arc<Telegram>, wanted: HashMap<u64, ChatInfo>) {
        let bots: Vec<u64> = wanted.keys().copied().collect();
        self.0.sync(&bots, |bot| {
            let info = wanted.get(bot)?.clone();
            log::info!(
                "telegram: polling bot @{} ({bot})",
                crate::quiet::shown(&info.bot_username)
            );
            let weak = Arc::downgrade(tg);
            Worker::thread(format!("tg-poll-{bot}"), move |stop| run(weak, info, stop))
        });
    }

    /// Shutdown: every loop stops (one in a long poll leaves when it returns).
    pub(super) fn stop_all(&self) {
        self.0.stop_all();
    }

    pub fn count(&self) -> usize {
        self.0.count()
    }
}

/// Updates one `getUpdates` asks for at most (Telegram's own default and maximum).
const MAX_BATCH: u64 = 100;

/// The loop. It holds the provider only between calls, so a long poll never delays a shutdown.
fn run(tg: Weak<Telegram>, info: ChatInfo, stop: Arc<Stop>) {
    let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
    let mut last_error = String::new();
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
                if !last_error.is_empty() {
                    log::info!("telegram: bot {}: polling works again", info.bot_id);
                    last_error.clear();
                }
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
                let why = e.to_string();
                if why != last_error {
                    log::warn!(
                        "telegram: bot {}: getUpdates failed: {why}; retrying with backoff",
                        info.bot_id
                    );
                    last_error = why;
                }
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
                tg.unbound_updates.fetch_add(1, Ordering::Relaxed);
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
        match ticket.wait() {
            Ok(Enqueued::Accepted { .. } | Enqueued::Duplicate) => {}
            Ok(Enqueued::CapacityExceeded) => {
                // reject_new: Telegram keeps the update; stop advancing the offset (backpressure).
                log::warn!("telegram: {source}: queue full; leaving updates at Telegram until there is room");
                return Batch::Stopped {
                    wait: Duration::from_secs(5),
                };
            }
            Err(e) => {
                log::debug!("telegram: {source}: cannot store the update before offset {after}: {e}");
                return Batch::Stopped {
                    wait: Duration::from_secs(1),
                };
            }
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

/// One update as far as it can be read without the store.
pub struct Update {
    /// The offset that confirms this update to Telegram.
    pub after: u64,
    /// The message in it; `None` for updates of other kinds, which are only confirmed.
    pub message: Option<Message>,
}

/// A Telegram `Message` read into imgate's inbound event.
pub struct Message {
    pub chat_id: i64,
    pub inbound: Inbound,
    pub media: Option<Media>,
}

/// Reads one element of `getUpdates` (or one webhook body); `None` without an `update_id`,
/// which cannot even be confirmed. Public for the fuzz target.
pub fn read_update(u: &json::Object) -> Option<Update> {
    let after = json::get_u64(u, "update_id")?.checked_add(1)?;
    let message = json::get_obj(u, "message").and_then(|m| {
        let chat_id = json::get_obj(m, "chat").and_then(|c| json::get_i64(c, "id"))?;
        let (inbound, media) = inbound_of(m, chat_id);
        Some(Message {
            chat_id,
            inbound,
            media,
        })
    });
    Some(Update { after, message })
}

/// A Telegram integer ID (chats are negative for groups); `None` beyond `i64`.
/// A file of a Telegram message, before it is fetched.
pub struct Media {
    file_id: String,
    kind: &'static str,
    filename: String,
    mime_type: String,
    file_size: Option<u64>,
}

fn media_of(m: &json::Object) -> Option<Media> {
    let file = |o: &json::Object, kind: &'static str, name: &str, mime: &str| -> Option<Media> {
        Some(Media {
            file_id: json::get_str(o, "file_id")?.to_string(),
            kind,
            filename: json::get_str(o, "file_name").unwrap_or(name).to_string(),
            mime_type: json::get_str(o, "mime_type").unwrap_or(mime).to_string(),
            file_size: json::get_u64(o, "file_size"),
        })
    };
    if let Some(Value::Array(sizes)) = m.get("photo") {
        // The largest size Telegram offers comes last.
        return sizes
            .iter()
            .filter_map(json::as_object)
            .next_back()
            .and_then(|p| file(p, "image", "photo.jpg", "image/jpeg"));
    }
    let kinds = [
        ("document", "file", "document", "application/octet-stream"),
        ("video", "video", "video.mp4", "video/mp4"),
        ("voice", "audio", "voice.ogg", "audio/ogg"),
        ("audio", "audio", "audio.mp3", "audio/mpeg"),
    ];
    kinds
        .iter()
        .find_map(|(field, kind, name, mime)| json::get_obj(m, field).and_then(|o| file(o, kind, name, mime)))
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

/// A Telegram `Message` as imgate's inbound event, and its file if it has one.
fn inbound_of(m: &json::Object, chat_id: i64) -> (Inbound, Option<Media>) {
    let chat = json::get_obj(m, "chat");
    let from = json::get_obj(m, "from");
    let message_id = json::get_i64(m, "message_id").unwrap_or(0);
    let sender_id = from.and_then(|f| json::get_i64(f, "id")).unwrap_or(chat_id).to_string();
    let sender_name = from.and_then(|f| {
        let first = json::get_str(f, "first_name").unwrap_or_default();
        let last = json::get_str(f, "last_name").unwrap_or_default();
        let full = format!("{first} {last}").trim().to_string();
        if full.is_empty() {
            json::get_str(f, "username").map(|u| format!("@{u}"))
        } else {
            Some(full)
        }
    });
    let kind = chat.and_then(|c| json::get_str(c, "type")).unwrap_or("private");
    let (message_type, text) = if let Some(t) = json::get_str(m, "text") {
        ("text", t.to_string())
    } else {
        let caption = json::get_str(m, "caption").unwrap_or_default().to_string();
        let kind = [
            ("photo", "image"),
            ("document", "file"),
            ("video", "video"),
            ("voice", "audio"),
            ("audio", "audio"),
        ]
        .iter()
        .find(|(field, _)| m.contains_key(*field))
        .map(|(_, t)| *t);
        match (kind, json::get_obj(m, "sticker")) {
            (Some(t), _) => (t, caption),
            (None, Some(st)) => ("sticker", json::get_str(st, "emoji").unwrap_or_default().to_string()),
            (None, None) => ("other", caption),
        }
    };
    let inbound = Inbound {
        message_id: format!("{chat_id}:{message_id}"),
        sender_id,
        sender_name,
        chat_id: Some(chat_id.to_string()),
        chat_type: if kind == "private" {
            "p2p".into()
        } else {
            "group".into()
        },
        message_type: message_type.to_string(),
        text,
        // Checked: a hostile `date` must not overflow into a time that looks current.
        event_time: json::get_u64(m, "date").and_then(|d| d.checked_mul(1000)),
        files: None,
    };
    (inbound, media_of(m))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_telegram_updates_never_panic_the_message_reader() {
        let seeds: [&[u8]; 4] = [
            br#"{"update_id":1001,"message":{"message_id":5,"from":{"id":4242,"first_name":"Ada","last_name":"L","username":"ada"},"chat":{"id":-1001234,"type":"supergroup","title":"Ops"},"date":1790000000,"text":"hi"}}"#,
            br#"{"update_id":1002,"message":{"message_id":6,"chat":{"id":77,"type":"private"},"date":1,"caption":"c","photo":[{"file_id":"a","file_size":10},{"file_id":"b","file_size":9999999999999999999}]}}"#,
            br#"{"update_id":1003,"message":{"message_id":7,"chat":{"id":77},"document":{"file_id":"d","file_name":"x.pdf","mime_type":"application/pdf"},"sticker":{"emoji":"\ud83d\ude00"}}}"#,
            br#"{"update_id":18446744073709551615,"message":{"message_id":-1,"chat":{"id":-9223372036854775808},"date":18446744073709551615}}"#,
        ];
        let mut read = 0;
        for input in crate::testutil::mutations(&seeds, 5000, 13) {
            let Ok(v) = std::str::from_utf8(&input)
                .map_err(|_| ())
                .and_then(|t| json::parse(t).map_err(|_| ()))
            else {
                continue;
            };
            let Some(u) = json::as_object(&v).and_then(read_update) else {
                continue;
            };
            if let Some(m) = u.message {
                assert!(m.inbound.message_id.starts_with(&m.chat_id.to_string()));
                read += 1;
            }
        }
        assert!(read > 500, "only {read} mutations were still updates");
    }
}
