//! One `getupdates` long-poll per signed-in bot (a `Workers` thread), started with its binding
//! and stopped with it.
//!
//! Sending iLink the new sync buffer is the only acknowledgement, so the buffer is stored in the
//! outbox transaction of the batch's last stored message (a `Cursor::Set`), with the user's
//! latest context token in each: a crash before that commit asks again with the old buffer and
//! the messages already stored are duplicates by their ID; a crash after it has them all. A
//! message that cannot be stored (a full queue, the store) stops the batch before the buffer
//! moves. A batch that stores nothing moves the buffer on its own.

use std::sync::{Arc, Weak};
use std::time::Duration;

use super::update::{self, Batch};
use super::{buf_key, context_key, Wechat, NAME};
use crate::json::{obj, s};
use crate::outbox::Cursor;
use crate::providers::intake::{Arrival, Committed, Fetch, Intake, WhenStale};
use crate::providers::link::workers::{Stop, Worker};
use crate::providers::link::{Backoff, Line};
use crate::source::Source;

/// iLink holds a `getupdates` this long at most; the client waits a little longer.
const LONG_POLL: Duration = Duration::from_secs(40);

/// The loop. It holds the provider only between calls, so a long poll never delays a shutdown.
/// The receiver of `line`'s bot, on a thread of its own.
pub(super) fn start(wx: &Weak<Wechat>, line: Line) -> Option<Worker> {
    let bot = line.account().to_string();
    log::info!("wechat: receiving for bot {bot}");
    let wx = wx.clone();
    Worker::thread(format!("wx-{}", &bot[..bot.len().min(10)]), move |stop| {
        run(wx, bot, stop, line)
    })
}

fn run(wx: Weak<Wechat>, bot: String, stop: Arc<Stop>, mut line: Line) {
    let mut backoff = Backoff::standard();
    loop {
        let Some((api_base, token, buf)) = wx.upgrade().and_then(|w| {
            if stop.is_stopped() {
                return None;
            }
            let account = w.account(&bot)?;
            let buf = w.meta(&buf_key(&bot)).unwrap_or_else(|e| {
                log::debug!("wechat: cannot read the sync buffer: {e}");
                None
            });
            Some((w.base_of(&account), account.bot_token, buf.unwrap_or_default()))
        }) else {
            return;
        };
        let body = super::object(obj([("get_updates_buf", s(&buf))]));
        // The long poll holds no reference to the provider: a stop does not wait for it.
        let polled = match wx.upgrade() {
            Some(w) => {
                let api = w.api.clone();
                drop(w);
                api.post(&api_base, "ilink/bot/getupdates", &token, body, LONG_POLL)
            }
            None => return,
        };
        let wait = match polled {
            Ok(answer) => {
                backoff.reset();
                line.works("receiving");
                let Some(w) = wx.upgrade() else { return };
                if stop.is_stopped() {
                    return;
                }
                accept(&w, &bot, &buf, update::read_batch(&answer))
            }
            Err(e) if super::api::session_ended(&e) => {
                if let Some(w) = wx.upgrade() {
                    w.login_ended(&bot);
                }
                return;
            }
            // The client's own timeout on an idle long poll: ask again at once.
            Err(e) if e.timed_out => None,
            Err(e) => {
                line.set(format!("getupdates failed: {e}; retrying with backoff"), true);
                Some(backoff.failed())
            }
        };
        if let Some(wait) = wait {
            if stop.pause(wait) {
                return;
            }
        }
    }
}

/// Stores one batch; `Some(wait)` when it stopped at a message it could not store.
fn accept(wx: &Wechat, bot: &str, old_buf: &str, batch: Batch) -> Option<Duration> {
    let host = &wx.host;
    let source = Source::new(NAME, bot);
    let new_buf = batch.buf.filter(|b| b != old_buf);
    match host.channels.bound_channel(source.as_str()) {
        Ok(Some(_)) => {}
        Ok(None) => {
            wx.unbound_messages.add(batch.messages.len() as u64);
            log::debug!("wechat: bot {bot}: messages while no channel is bound to it");
            return new_buf.and_then(|b| move_buffer(wx, bot, &b));
        }
        Err(e) => {
            log::debug!("wechat: {source}: cannot read the binding: {e}");
            return Some(Duration::from_secs(1));
        }
    }
    let last = batch.messages.len();
    let mut buf_moved = false;
    for (i, m) in batch.messages.into_iter().enumerate() {
        let mut cursors = Vec::new();
        if let Some(c) = m.context_token {
            cursors.push(Cursor::Set(context_key(bot), c));
        }
        if i + 1 == last {
            if let Some(b) = &new_buf {
                cursors.push(Cursor::Set(buf_key(bot), b.clone()));
                buf_moved = true;
            }
        }
        let arrival = Arrival {
            source: source.clone(),
            inbound: m.inbound,
            file: m.media.map(|media| Fetch {
                kind: media.kind.to_string(),
                fetch: Box::new({
                    let source = source.clone();
                    move || wx.fetch_media(&source, &media)
                }),
            }),
            reply_ref: true,
            cursors,
            when_stale: WhenStale::CountExpired,
        };
        let ticket = match host.intake(arrival) {
            Intake::Submitted(ticket) => ticket,
            // A backlog older than the TTL: never pushed.
            Intake::Stale => {
                buf_moved &= i + 1 != last;
                continue;
            }
        };
        // reject_new: iLink keeps the batch while the buffer stays (backpressure).
        match host.committed(ticket, &source, "leaving messages at WeChat until there is room") {
            Committed::Stored => {}
            Committed::Full => return Some(Duration::from_secs(5)),
            Committed::Failed => return Some(Duration::from_secs(1)),
        }
    }
    match (buf_moved, new_buf) {
        (false, Some(b)) => move_buffer(wx, bot, &b),
        _ => None,
    }
}

/// Moves the sync buffer past a batch that stored nothing.
fn move_buffer(wx: &Wechat, bot: &str, buf: &str) -> Option<Duration> {
    let key = buf_key(bot);
    match wx.host.outbox.move_cursors(&[Cursor::Set(key, buf.to_string())]) {
        Ok(()) => None,
        Err(e) => {
            log::error!("wechat: cannot store the sync buffer: {e}");
            Some(Duration::from_secs(1))
        }
    }
}
