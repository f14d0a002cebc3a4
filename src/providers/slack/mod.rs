//! Slack: a Slack app's bot in a channel, a private channel, a DM or a group DM. Events come over
//! Socket Mode, a WebSocket the app opens itself (`link`), so imgate works behind NAT with no
//! public URL; after every reconnect the channel's history fills what the socket missed
//! (`catchup`); the tools answer through the Web API (`api`).
//!
//! Source key: `{bot_user_id}:{channel_id}` (the bot's user ID names the app in its
//! workspace: one Socket Mode connection per bot, shared by its channels). A binding stores
//! what it knows of the channel in its own table (`slack_channels`); the two tokens are kept
//! in `state_dir/slack/{bot_user_id}.bot` and `.app` (mode 0600), never in the database, a
//! packet or a log line, and forgotten with the bot's last binding.
//!
//! An envelope is acknowledged only after its message is committed (or found a duplicate, or
//! is one imgate does not store): Slack delivers again whatever was not acknowledged within 3 s,
//! and the outbox's message-ID dedupe (`CHANNEL:TS`) makes the second delivery a duplicate.
//! Each channel's high-water `ts` is a `Cursor` moved once a batch's commits are done, to the
//! newest of its all-stored prefix (never past a message that was not stored); the catch-up
//! reads the history after it.

pub mod api;
pub mod catchup;
pub mod event;
pub mod link;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use miniserde::{Deserialize, Serialize};

use self::api::{Api, ApiError, PLATFORM};
use self::event::{Message, SlackFile};
use super::bindings::{Rows, Through};
use super::inbound::{self, FileItem, Inbound};
use super::intake::{Arrival, Committed, Fetch, Intake, Recent, WhenStale};
use super::keyfiles::KeyFiles;
use super::lag::Lag;
use super::link::{followers, Links};
use super::{
    split_text, with_retry, Declaration, Description, Failure, Field, Flow, Host, Outbound, Provider, Registration,
    Transient,
};
use crate::config::{Config, Fields, Problems, Section, Settings};
use crate::json::{self, Object, Value};
use crate::metrics::Counter;
use crate::outbox::{Cursor, Ticket};
use crate::protocol::code;
use crate::protocol::{TOOL_FILE_SEND, TOOL_REPLY, TOOL_SEND};
use crate::source::Source;
use crate::store::StoreError;
use crate::upstream::Kind;

const NAME: &str = "slack";
/// source → `ChannelInfo`.
const CHANNELS: Rows = Rows::new(NAME, "slack_channels", "slack channel");
const FLOW_ID: &str = "slack_app_binding";
const TOOLS: &[&str] = &[TOOL_SEND, TOOL_REPLY, TOOL_FILE_SEND];
/// A text is split at this many characters: Slack documents 40,000, but answers `msg_too_long`
/// well below that (about 4,000, its SDK maintainers report), and recommends 4,000.
const MAX_TEXT: usize = 4_000;
/// A tool call retries rate limits and 5xx answers for at most this long.
const TOOL_DEADLINE: Duration = Duration::from_secs(20);
/// A message's file is fetched for at most this long before the message goes on with a note.
pub const FETCH_DEADLINE: Duration = Duration::from_secs(30);
/// A user's display name is looked up for at most this long (else the redacted ID shows).
const NAME_DEADLINE: Duration = Duration::from_secs(5);
/// Display names kept, each for `NAME_TTL`.
const NAMES: usize = 512;
const NAME_TTL: Duration = Duration::from_secs(3600);
/// Users of one message whose names are looked up (its sender and its first mentions).
const MENTIONS: usize = 8;
/// Recently stored messages remembered (`Recent`).
const RECENT: usize = 256;
/// Messages whose thread is known (a reply goes to the thread's parent, never to a reply).
const THREADS: usize = 1024;

pub const REGISTRATION: Registration = Registration::new(NAME, &[], read, start);

/// `[slack]`.
#[derive(Clone)]
pub struct SlackSettings {
    pub api_base: String,
}

impl Settings for SlackSettings {
    fn summary(&self) -> String {
        format!("slack:             api_base {}\n", self.api_base)
    }
}

fn read(_cfg: &Config, sections: &[&Section], p: &mut Problems) -> Option<Arc<dyn Settings>> {
    let section = sections.first()?;
    let mut f = Fields::new(section, p, &[]);
    let settings = SlackSettings {
        api_base: f.url("api_base").unwrap_or_else(|| "https://slack.com/api".into()),
    };
    f.finish();
    Some(Arc::new(settings))
}

fn start(host: &Arc<Host>) -> Result<Option<Arc<dyn Provider>>, StoreError> {
    let Some(settings) = host.config.provider::<SlackSettings>(NAME).cloned() else {
        return Ok(None);
    };
    CHANNELS.create(&host.db)?;
    Ok(Some(Arc::new_cyclic(|me| Slack {
        me: me.clone(),
        host: host.clone(),
        api: Api::new(&settings.api_base),
        links: Links::new("slack: bot", "Socket Mode connection")
            .followed_by(followers::<ChannelInfo>(host, &CHANNELS)),
        recent: Recent::new(RECENT),
        names: Mutex::default(),
        threads: Mutex::default(),
        lag: Lag::default(),
        counts: Counts::default(),
    })))
}

/// What a binding knows about its bot and channel.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct ChannelInfo {
    /// The bot's user ID (`U…`): the account, and how its own messages are told apart.
    pub bot_user: String,
    pub bot_id: String,
    pub channel: String,
    pub channel_name: String,
    /// `p2p` (a DM) or `group`.
    pub chat_type: String,
}

impl Through for ChannelInfo {
    fn account(&self) -> &str {
        &self.bot_user
    }
}

pub fn source_of(bot_user: &str, channel: &str) -> Source {
    Source::new(NAME, &format!("{bot_user}:{channel}"))
}

/// The outbox cursor holding a channel's high-water `ts` (microseconds).
fn high_water_key(source: &Source) -> String {
    format!("slack_hw:{}", source.key())
}

/// Whether a `ts` may move a high-water mark: not more than a day ahead of this clock. The mark
/// only moves forward, so one message stamped years ahead would end every later catch-up.
fn plausible(ts_micros: u64) -> bool {
    ts_micros <= crate::ids::now_ms().saturating_add(86_400_000).saturating_mul(1000)
}

/// Agent text as Slack's message format takes it: `&`, `<` and `>` escaped, so no text can
/// become a mention (`<!channel>`) or a link.
fn escaped(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// Counters for `/metrics`.
struct Counts {
    unbound: Counter,
    skipped: Counter,
    caught_up: Counter,
}

impl Default for Counts {
    fn default() -> Counts {
        Counts {
            unbound: Counter::new(
                "imgate_slack_unbound_messages_total",
                "Messages of channels no channel is bound to.",
            ),
            skipped: Counter::new(
                "imgate_slack_skipped_messages_total",
                "Edits, deletes, notices and the bot's own messages, not stored.",
            ),
            caught_up: Counter::new(
                "imgate_slack_caught_up_messages_total",
                "Messages stored by a catch-up from the history.",
            ),
        }
    }
}

pub struct Slack {
    me: Weak<Slack>,
    host: Arc<Host>,
    api: Api,
    links: Links,
    recent: Recent,
    /// user ID → (display name, when looked up).
    names: Mutex<HashMap<String, (String, Instant)>>,
    /// message ID → its thread's parent ts, for replies.
    threads: Mutex<VecDeque<(String, String)>>,
    /// Channels whose history may hold messages not stored (the connection was down, a commit
    /// failed), from a `ts` on.
    lag: Lag,
    counts: Counts,
}

/// The two tokens of one bot.
#[derive(Clone)]
pub struct Tokens {
    pub bot: String,
    pub app: String,
}

impl Slack {
    fn token_files(&self, suffix: &'static str) -> KeyFiles {
        KeyFiles::new(self.host.config.server.state_dir.join("slack"), "", suffix)
    }

    /// The tokens of bot `bot_user`, while a binding keeps them.
    pub fn tokens(&self, bot_user: &str) -> Option<Tokens> {
        Some(Tokens {
            bot: self.token_files(".bot").read(bot_user)?,
            app: self.token_files(".app").read(bot_user)?,
        })
    }

    fn channel_info(&self, source: &str) -> Result<Option<ChannelInfo>, StoreError> {
        CHANNELS.get(&self.host.db, source)
    }

    /// The binding of a source and its bot token.
    fn route(&self, source: &Source) -> Result<(ChannelInfo, String), Failure> {
        let info = self
            .channel_info(source.as_str())
            .map_err(Failure::storage)?
            .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "the Slack binding is gone"))?;
        let tokens = self
            .tokens(&info.bot_user)
            .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "the bot's tokens are no longer available"))?;
        Ok((info, tokens.bot))
    }

    /// The bound channels of bot `bot_user`.
    pub fn channels_of(&self, bot_user: &str) -> Vec<(Source, ChannelInfo)> {
        (CHANNELS.through(&self.host.channels, &self.host.db, bot_user)).unwrap_or_default()
    }

    /// A connection of `bot_user` said hello: every bound channel is read from its high-water
    /// mark before its live messages move it again. Its bound channels.
    pub fn connected(&self, bot_user: &str) -> Vec<String> {
        let channels = self.channels_of(bot_user);
        for (source, _) in &channels {
            self.lag.fell_behind(source, u64::MAX, false);
        }
        channels.into_iter().map(|(_, i)| i.channel).collect()
    }

    /// Handles messages of one channel of `bot_user`'s connection, in their order, on a
    /// blocking thread: a catch-up first when the channel is behind (`catch_up`: run it even if
    /// one ran lately), then each message handed to the outbox without waiting, then every
    /// commit awaited, so a burst shares its commits. For each message: true when its envelope
    /// may be acknowledged (stored, a duplicate, or nothing imgate stores), false to have Slack
    /// deliver it again (the store failed or the queue is full).
    pub fn accept(&self, bot_user: &str, channel: &str, catch_up: bool, messages: Vec<Message>) -> Vec<bool> {
        let source = source_of(bot_user, channel);
        let info = match CHANNELS.while_bound(&self.host.channels, &self.host.db, source.as_str()) {
            Ok(Some(info)) => info,
            Ok(None) => {
                self.counts.unbound.add(messages.len() as u64);
                if let Some(m) = messages.first() {
                    let kind = if m.channel_type == "im" { "dm" } else { "group" };
                    self.host.unbound_seen(NAME, channel, kind);
                    log::debug!("slack: bot {bot_user}: a message from a channel no channel is bound to");
                }
                return vec![true; messages.len()];
            }
            Err(e) => {
                log::debug!("slack: {source}: cannot read the binding: {e}");
                return vec![false; messages.len()];
            }
        };
        if catch_up || self.lag.due(&source) {
            // Not caught up: the channel stays behind, and its live messages move no mark.
            let _ = catchup::run(self, &source, &info);
        }
        // Read once a batch: every message's name lookups and file need it.
        let tokens = self.tokens(&info.bot_user);
        let bot_token = tokens.as_ref().map_or("", |t| t.bot.as_str());
        let moves_mark = !self.lag.is_behind(&source);
        let handled: Vec<(u64, Handled)> = messages
            .into_iter()
            .map(|m| {
                (
                    event::ts_micros(&m.ts).unwrap_or(0),
                    self.prepare(&source, &info, bot_token, m),
                )
            })
            .collect();
        // The mark moves once the commits are done, to the newest of the run from the first
        // message on that is all stored: never past a message that was not.
        let (mut newest, mut all) = (0u64, true);
        let answers = handled
            .into_iter()
            .map(|(ts, h)| {
                let ok = self.finish(&source, h);
                all &= ok;
                if all {
                    newest = newest.max(ts);
                }
                ok
            })
            .collect();
        if moves_mark && newest > 0 && plausible(newest) {
            let moved = self
                .host
                .outbox
                .move_cursors(&[Cursor::Forward(high_water_key(&source), newest)]);
            if let Err(e) = moved {
                log::debug!("slack: {source}: cannot move the high-water mark: {e}");
            }
        }
        answers
    }

    /// One message up to its hand-over to the outbox.
    fn prepare(&self, source: &Source, info: &ChannelInfo, bot_token: &str, m: Message) -> Handled {
        if m.user == info.bot_user || m.bot_id.as_deref() == Some(info.bot_id.as_str()) {
            // The bot's own messages come back as events: never pushed to the agent.
            self.counts.skipped.add(1);
            return Handled::Answer(true);
        }
        let message_id = m.message_id_in(&info.channel);
        self.remember_thread(&message_id, m.thread());
        if self.recent.seen(&m.event_id, &message_id) {
            return Handled::Answer(true);
        }
        let names = self.names_of(bot_token, &m);
        let name_of = |u: &str| names.iter().find(|(id, _)| id == u).map(|(_, n)| n.clone());
        let ts = event::ts_micros(&m.ts).unwrap_or_default();
        let message_type = m.file.as_ref().map_or("text", |f| crate::files::kind_of(&f.mimetype));
        let inbound = Inbound {
            message_id: message_id.clone(),
            sender_id: m.user.clone(),
            sender_name: name_of(&m.user),
            chat_id: Some(info.channel.clone()),
            chat_type: info.chat_type.clone(),
            message_type: message_type.to_string(),
            // Names are longer than the IDs they replace: bounded again.
            text: event::bounded(&event::readable(&m.text, name_of), event::MAX_TEXT_BYTES),
            event_time: Some(ts / 1000),
            files: None,
        };
        let arrival = Arrival {
            source: source.clone(),
            file: m.file.clone().map(|file| Fetch {
                kind: crate::files::kind_of(&file.mimetype).to_string(),
                // The file's URL needs the bot token; our file cache does not.
                fetch: Box::new(move || self.fetch(bot_token, &file, source)),
            }),
            inbound,
            reply_ref: true,
            // The mark moves once the messages before it are stored too (`accept`).
            cursors: Vec::new(),
            // Older than the TTL (a catch-up after a long outage): counted expired.
            when_stale: WhenStale::CountExpired,
        };
        match self.host.intake(arrival) {
            // Older than the TTL: counted expired, never pushed.
            Intake::Stale => Handled::Answer(true),
            Intake::Submitted(ticket) => Handled::Commit(ticket, m.event_id, message_id, m.ts),
        }
    }

    /// Waits for a prepared message's commit: whether its envelope may be acknowledged. A
    /// message not stored leaves its channel behind, from just before it.
    fn finish(&self, source: &Source, h: Handled) -> bool {
        let (ticket, event_id, message_id, ts) = match h {
            Handled::Answer(done) => return done,
            Handled::Commit(ticket, event_id, message_id, ts) => (ticket, event_id, message_id, ts),
        };
        let then = "the message is read again from the history later";
        if self.host.committed(ticket, source, then) == Committed::Stored {
            self.recent.stored(event_id, message_id);
            return true;
        }
        log::debug!("slack: {source}: a message not stored; the channel is behind");
        let from = event::ts_micros(&ts).unwrap_or(1).saturating_sub(1);
        self.lag.fell_behind(source, from, true);
        false
    }

    fn remember_thread(&self, message_id: &str, thread: &str) {
        let mut threads = self.threads.lock().unwrap_or_else(|e| e.into_inner());
        if threads.iter().any(|(m, _)| m == message_id) {
            return;
        }
        if threads.len() >= THREADS {
            threads.pop_front();
        }
        threads.push_back((message_id.to_string(), thread.to_string()));
    }

    /// The display names of a message's sender and first mentions, from the cache or
    /// `users.info` (each lookup short; a failed one shows the redacted ID).
    fn names_of(&self, bot_token: &str, m: &Message) -> Vec<(String, String)> {
        let mut users = vec![m.user.clone()];
        for u in event::mentioned(&m.text, MENTIONS) {
            if !users.contains(&u) {
                users.push(u);
            }
        }
        users
            .into_iter()
            .filter(|u| event::safe_id(u, 64))
            .filter_map(|u| self.name_of(bot_token, &u).map(|n| (u, n)))
            .collect()
    }

    fn name_of(&self, bot_token: &str, user: &str) -> Option<String> {
        {
            let names = self.names.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((name, at)) = names.get(user).filter(|(_, at)| at.elapsed() < NAME_TTL) {
                let _ = at;
                return Some(name.clone());
            }
        }
        if bot_token.is_empty() {
            return None;
        }
        let answer = self.api.call(bot_token, "users.info", &[("user", user)], NAME_DEADLINE);
        let name = match answer {
            Ok(o) => json::get_obj(&o, "user").and_then(display_name)?,
            Err(e) => {
                log::debug!("slack: no display name for a user: {e}");
                return None;
            }
        };
        let mut names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        if names.len() >= NAMES {
            names.retain(|_, (_, at)| at.elapsed() < NAME_TTL);
            if names.len() >= NAMES {
                names.clear();
            }
        }
        names.insert(user.to_string(), (name.clone(), Instant::now()));
        Some(name)
    }

    /// A message's file, with the bot token, into the file cache.
    fn fetch(&self, bot_token: &str, file: &SlackFile, source: &Source) -> Result<FileItem, String> {
        if bot_token.is_empty() {
            return Err("the bot token is no longer available".into());
        }
        let files = &self.host.files;
        let deadline = Instant::now() + FETCH_DEADLINE;
        // Each attempt writes a new `.part` (a failed one removes its bytes as it drops).
        let (part, content_type) = with_retry("slack: file download", deadline, |left| {
            let mut part = files.begin(source.as_str(), "in").map_err(|e| PLATFORM.cache(e))?;
            let content_type = self.api.download(bot_token, &file.url, &mut part, left)?;
            Ok::<_, ApiError>((part, content_type))
        })
        .map_err(|e| e.to_string())?;
        let mime = super::served_mime(content_type.as_deref(), &file.mimetype);
        let (file_ref, rec) = files.commit(part, &file.name, &mime).map_err(|e| e.to_string())?;
        Ok(FileItem::cached(file_ref, rec))
    }

    /// The thread a reply to `message_id` goes to: the parent of its thread, from what this
    /// process saw, else from `conversations.replies`, else the message itself.
    fn thread_of(&self, bot_token: &str, channel: &str, ts: &str, message_id: &str, deadline: Instant) -> String {
        let known = self.threads.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, thread)) = known.iter().find(|(m, _)| m == message_id) {
            return thread.clone();
        }
        drop(known);
        let left = deadline.saturating_duration_since(Instant::now()).min(NAME_DEADLINE);
        let params = [("channel", channel), ("ts", ts), ("limit", "1")];
        match self.api.call(bot_token, "conversations.replies", &params, left) {
            Ok(o) => match json::get(&o, "messages") {
                Some(Value::Array(list)) => list
                    .iter()
                    .filter_map(json::as_object)
                    .find_map(|m| json::get_str(m, "thread_ts").or_else(|| json::get_str(m, "ts")))
                    .filter(|t| event::ts_micros(t).is_some())
                    .unwrap_or(ts)
                    .to_string(),
                _ => ts.to_string(),
            },
            Err(e) => {
                log::debug!("slack: the thread of a message is not known ({e}); replying to the message itself");
                ts.to_string()
            }
        }
    }

    /// One `chat.postMessage`; the new message's ts.
    fn post(
        &self,
        bot_token: &str,
        channel: &str,
        text: &str,
        thread: Option<&str>,
        deadline: Instant,
    ) -> Result<String, Failure> {
        let text = escaped(text);
        let mut params = vec![("channel", channel), ("text", text.as_str())];
        if let Some(t) = thread {
            params.push(("thread_ts", t));
        }
        let sent = with_retry("slack: send", deadline, |left| {
            self.api.call(bot_token, "chat.postMessage", &params, left)
        })
        .map_err(|e| refusal(&e))?;
        Ok(json::get_str(&sent, "ts").unwrap_or_default().to_string())
    }

    /// One file: an upload URL, the bytes, then the upload completed into the channel (with
    /// `comment` as its message); the file's ID.
    fn send_file(
        &self,
        bot_token: &str,
        channel: &str,
        file: &(crate::files::FileRecord, std::path::PathBuf),
        comment: Option<&str>,
        thread: Option<&str>,
        deadline: Instant,
    ) -> Result<String, Failure> {
        let (rec, path) = file;
        let length = rec.byte_size.to_string();
        let params = [("filename", rec.filename.as_str()), ("length", length.as_str())];
        let slot = with_retry("slack: upload URL", deadline, |left| {
            self.api.call(bot_token, "files.getUploadURLExternal", &params, left)
        })
        .map_err(|e| refusal(&e))?;
        let (Some(url), Some(file_id)) = (json::get_str(&slot, "upload_url"), json::get_str(&slot, "file_id")) else {
            return Err(Failure::new(
                code::UPSTREAM_REJECTED,
                "the upload URL answer is incomplete",
            ));
        };
        let (url, file_id) = (url.to_string(), file_id.to_string());
        with_retry("slack: upload", deadline, |left| {
            let bytes = std::fs::File::open(path)
                .map_err(|e| PLATFORM.cache(crate::files::FileError::Storage(e.to_string())))?;
            self.api.upload(&url, &bytes, left)
        })
        .map_err(|e| refusal(&e))?;
        let files = json::to_string(&json::arr([json::obj([
            ("id", json::s(&file_id)),
            ("title", json::s(&rec.filename)),
        ])]));
        let comment = comment.filter(|c| !c.is_empty()).map(escaped);
        let mut params = vec![("files", files.as_str()), ("channel_id", channel)];
        if let Some(c) = comment.as_deref() {
            params.push(("initial_comment", c));
        }
        if let Some(t) = thread {
            params.push(("thread_ts", t));
        }
        with_retry("slack: upload complete", deadline, |left| {
            self.api.call(bot_token, "files.completeUploadExternal", &params, left)
        })
        .map_err(|e| refusal(&e))?;
        Ok(file_id)
    }
}

/// One message after `prepare`: its answer, or the commit to wait for first (with its event
/// ID, message ID and ts).
enum Handled {
    Answer(bool),
    Commit(Ticket, String, String, String),
}

/// A user's name as Slack shows it: the display name, else the real name, else the handle.
fn display_name(user: &Object) -> Option<String> {
    fn pick<'a>(o: Option<&'a Object>, k: &str) -> Option<&'a str> {
        o.and_then(|o| json::get_str(o, k)).filter(|n| !n.trim().is_empty())
    }
    let profile = json::get_obj(user, "profile");
    let name = pick(profile, "display_name")
        .or_else(|| pick(profile, "real_name"))
        .or_else(|| pick(Some(user), "real_name"))
        .or_else(|| pick(Some(user), "name"))?;
    Some(name.chars().take(80).collect())
}

/// A Web API refusal as a tool's failure, with what the owner can do about it.
fn refusal(e: &ApiError) -> Failure {
    let refused = |why: String| Failure::new(code::UPSTREAM_REJECTED, why);
    match e.code.as_str() {
        "not_in_channel" | "channel_not_found" => {
            refused("the bot is not in this channel any more: invite it again".into())
        }
        "missing_scope" => refused(e.to_string()),
        _ if e.kind() == Kind::Auth => Failure::new(
            code::CONNECTION_NOT_AUTHENTICATED,
            format!("Slack refused the bot token ({}): bind the channel again", e.code),
        ),
        _ => Failure::api(e),
    }
}

/// What a binding check met, as the reason the form shows.
fn bind_failure(what: &str, e: &ApiError) -> Failure {
    let refused = |why: String| Failure::new(code::CONNECTION_NOT_AUTHENTICATED, why);
    if e.temporary() {
        return Failure::temporary(code::UPSTREAM_UNREACHABLE, format!("cannot check the {what}: {e}"));
    }
    match (what, api::error(e)) {
        (_, "missing_scope") => refused(format!(
            "the app lacks the scope {} (add it under OAuth & Permissions, reinstall the app, then bind again)",
            e.detail.as_deref().unwrap_or("the check needs")
        )),
        ("bot token", _) => refused(format!(
            "Slack rejected the bot token ({}): it looks like xoxb-...",
            api::error(e)
        )),
        ("app token", "not_allowed_token_type") => refused(
            "the app token is not an app-level token: create one with the connections:write scope (xapp-...)".into(),
        ),
        ("app token", "invalid_auth" | "not_authed" | "token_revoked") => {
            refused(format!("Slack rejected the app token ({})", api::error(e)))
        }
        ("app token", other) => refused(format!(
            "Slack refused a Socket Mode connection ({other}): turn on Socket Mode in the app's settings"
        )),
        (_, "channel_not_found") => refused("Slack does not know this channel, or the bot cannot see it".into()),
        (_, "not_in_channel") => {
            refused("the bot is not in this channel: invite it (/invite @your-app), then bind again".into())
        }
        (_, other) => refused(format!("Slack refused the {what} check ({other})")),
    }
}

const DECLARATION: Declaration = Declaration {
    name: NAME,
    label: "Slack",
    description: "A Slack app's bot in a channel, a private channel or a DM, over Socket Mode.",
    flows: &[FLOW],
    tools: TOOLS,
};

const FLOW: Flow = Flow::form(
    FLOW_ID,
    "Bind a Slack channel",
    "Bind this channel to one Slack channel or DM of an app's bot; events arrive over Socket Mode.",
    &[
        Field::secret(
            "bot_token",
            "Bot token",
            Some("xoxb-..."),
            "The app's Bot User OAuth Token (OAuth & Permissions).",
        ),
        Field::secret(
            "app_token",
            "App-level token",
            Some("xapp-..."),
            "An app-level token with the connections:write scope (Basic Information), with Socket Mode on.",
        ),
        Field::text(
            "channel_id",
            "Channel ID",
            Some("C0123456789"),
            "Invite the bot to the channel, then enter its ID (channel details, at the bottom).",
        ),
    ],
);

/// A token as Slack issues them: its prefix, then letters, digits and `-`.
fn token_shaped(token: &str, prefix: &str) -> bool {
    token.starts_with(prefix) && token.len() <= 512 && token.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

impl Provider for Slack {
    fn declaration(&self) -> &'static Declaration {
        &DECLARATION
    }

    /// `slack_app_binding`: checks the bot token (`auth.test`), the app token
    /// (`apps.connections.open`), the channel (`conversations.info`: the bot is in it) and its
    /// history (the catch-up reads it).
    fn bind(&self, input: &Object) -> Result<Source, Failure> {
        let given = |k: &str| json::get_str(input, k).map(str::trim).unwrap_or_default();
        let (bot_token, app_token, channel) = (given("bot_token"), given("app_token"), given("channel_id"));
        let invalid = |why: &str| Err(Failure::new(code::INVALID_ARGUMENTS, why.to_string()));
        if !token_shaped(bot_token, "xoxb-") {
            return invalid("bot_token must be a bot token (xoxb-...)");
        }
        if !token_shaped(app_token, "xapp-") {
            return invalid("app_token must be an app-level token (xapp-...)");
        }
        if !event::safe_id(channel, 32) || !channel.starts_with(['C', 'G', 'D']) {
            return invalid("channel_id must be a channel ID like C0123456789");
        }
        let deadline = || TOOL_DEADLINE;
        let me = self
            .api
            .call(bot_token, "auth.test", &[], deadline())
            .map_err(|e| bind_failure("bot token", &e))?;
        let id = |o: &Object, k: &str| {
            json::get_str(o, k)
                .filter(|v| event::safe_id(v, 64))
                .map(str::to_string)
        };
        let (Some(bot_user), Some(bot_id)) = (id(&me, "user_id"), id(&me, "bot_id")) else {
            return invalid("the bot token is not a bot's token (auth.test names no bot): use the xoxb- token");
        };
        // The URL is valid once and is not used: the check is that Slack gives one.
        self.api
            .call(app_token, "apps.connections.open", &[], deadline())
            .map_err(|e| bind_failure("app token", &e))?;
        let found = self
            .api
            .call(bot_token, "conversations.info", &[("channel", channel)], deadline())
            .map_err(|e| bind_failure("channel", &e))?;
        let info = json::get_obj(&found, "channel").cloned().unwrap_or_default();
        let flag = |k: &str| matches!(info.get(k), Some(Value::Bool(true)));
        let dm = flag("is_im");
        if !dm && matches!(info.get("is_member"), Some(Value::Bool(false))) {
            return Err(bind_failure(
                "channel",
                &ApiError {
                    code: "not_in_channel".into(),
                    ..PLATFORM.refused(400, "")
                },
            ));
        }
        // The catch-up reads the history: check it can, and start from its newest message.
        let newest = self
            .api
            .call(
                bot_token,
                "conversations.history",
                &[("channel", channel), ("limit", "1")],
                deadline(),
            )
            .map_err(|e| bind_failure("channel history", &e))?;
        let newest = match json::get(&newest, "messages") {
            Some(Value::Array(list)) => list
                .iter()
                .filter_map(json::as_object)
                .filter_map(|m| json::get_str(m, "ts").and_then(event::ts_micros))
                .max(),
            _ => None,
        };
        let name = json::get_str(&info, "name").filter(|n| !n.is_empty() && !dm);
        let source = source_of(&bot_user, channel);
        let binding = ChannelInfo {
            bot_user: bot_user.clone(),
            bot_id,
            channel: channel.to_string(),
            channel_name: name.map_or_else(
                || {
                    if dm {
                        "Slack DM".into()
                    } else {
                        inbound::redact(channel)
                    }
                },
                |n| format!("#{}", n.chars().take(80).collect::<String>()),
            ),
            chat_type: if dm { "p2p" } else { "group" }.into(),
        };
        let stored = self
            .token_files(".bot")
            .store(&bot_user, bot_token)
            .and_then(|_| self.token_files(".app").store(&bot_user, app_token));
        stored.map_err(|e| Failure::new(code::TOOL_INVOKE_FAILED, format!("cannot store the tokens: {e}")))?;
        // History from before the binding is never read: the mark starts at the channel's
        // newest message (or now, for an empty one), and never moves back. Bound again while
        // bound (new tokens), the channel keeps its mark, so what was posted meanwhile is
        // caught up.
        let bound = self
            .host
            .channels
            .bound_channel(source.as_str())
            .map_err(Failure::storage)?;
        let key = high_water_key(&source);
        let kept = bound.is_some() && self.host.outbox.cursor(&key).map_err(Failure::storage)?.is_some();
        if !kept {
            let now = crate::ids::now_ms().saturating_mul(1000);
            let from = newest.filter(|ts| plausible(*ts)).unwrap_or(now);
            self.host
                .outbox
                .move_cursors(&[Cursor::Forward(key, from)])
                .map_err(Failure::storage)?;
        }
        CHANNELS
            .put(&self.host.db, source.as_str(), &binding)
            .map_err(Failure::storage)?;
        // A socket already up for this bot acknowledged this channel's messages as unbound until
        // now: its next message starts with a catch-up from the mark (what an earlier binding of
        // the channel left behind is not read).
        if !kept {
            self.lag.forget(&source);
        }
        self.lag.fell_behind(&source, u64::MAX, false);
        Ok(source)
    }

    fn describe(&self, source: &Source) -> Result<Description, StoreError> {
        Ok(match self.channel_info(source.as_str())? {
            Some(info) if self.tokens(&info.bot_user).is_none() => {
                DECLARATION.lost("the bot's tokens are no longer available")
            }
            Some(info) => match self.links.refused(&info.bot_user) {
                Some(why) => DECLARATION.unusable("error", info.channel_name, None, &why),
                None => DECLARATION.connected(info.channel_name, Some(inbound::redact(&info.channel))),
            },
            None => DECLARATION.lost("the Slack binding is gone"),
        })
    }

    /// Text (split at 4,000 characters) and files, in the thread of the message answered.
    /// With files, the text is the first file's comment.
    fn send(&self, source: &Source, out: &Outbound) -> Result<String, Failure> {
        let (info, bot_token) = self.route(source)?;
        let deadline = Instant::now() + TOOL_DEADLINE;
        let thread = match out.reply_to {
            None => None,
            Some(m) => {
                let ts = m
                    .strip_prefix(info.channel.as_str())
                    .and_then(|r| r.strip_prefix(':'))
                    .filter(|ts| event::ts_micros(ts).is_some())
                    .ok_or_else(|| {
                        Failure::new(code::REPLY_REF_INVALID, "the message answered is not in this channel")
                    })?;
                Some(self.thread_of(&bot_token, &info.channel, ts, m, deadline))
            }
        };
        let thread = thread.as_deref();
        let parts = split_text(out.text, MAX_TEXT);
        // The text goes as the first file's comment when it fits in one.
        let comment = (!out.files.is_empty() && parts.len() == 1).then_some(out.text);
        let mut last = String::new();
        if comment.is_none() && !out.text.is_empty() {
            for part in &parts {
                last = self.post(&bot_token, &info.channel, part, thread, deadline)?;
            }
        }
        for (i, file) in out.files.iter().enumerate() {
            let comment = if i == 0 { comment } else { None };
            last = self.send_file(&bot_token, &info.channel, file, comment, thread, deadline)?;
        }
        Ok(last)
    }

    /// One Socket Mode connection per bot with a binding; tokens no binding uses are forgotten.
    fn bindings_changed(&self, bound: &[Source]) {
        let bots = CHANNELS.accounts::<ChannelInfo>(&self.host.db, bound);
        self.links.sync(&bots, |line| link::start(&self.me, line));
        self.token_files(".bot").forget_unused(&bots, "slack: bot token of");
        self.token_files(".app").forget_unused(&bots, "slack: app token of");
        self.lag.retain(bound);
    }

    fn metrics(&self, out: &mut String) {
        self.links.metrics(
            out,
            "imgate_slack_connections",
            "Socket Mode connections running, one per bound bot.",
            "Socket Mode sockets open now.",
        );
        crate::metrics::counters(
            out,
            &[&self.counts.unbound, &self.counts.skipped, &self.counts.caught_up],
        );
    }

    fn stop(&self) {
        self.links.stop_all();
    }
}
