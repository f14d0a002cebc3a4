//! Discord: a bot in a server's text channel or in a DM. Messages come over the Gateway, a
//! WebSocket the bot opens itself (`link`), so imgate works behind NAT with no public URL.
//! The Gateway has no acknowledgements: a dropped connection is resumed (Discord replays what
//! was missed), and whenever a session is new (nothing replayed: after a refused RESUME, at
//! start) every bound channel's history is read from its cursor (`catchup`). The tools answer
//! through the REST API (`api`).
//!
//! Source key: `{bot_user_id}:{channel_id}` (one Gateway session per bot, shared by its
//! channels). A binding stores what it knows of the channel in its own table
//! (`discord_channels`); the bot token is kept in `state_dir/discord/{bot_user_id}.token` (mode
//! 0600), never in the database, a packet or a log line, and forgotten with the bot's last
//! binding.
//!
//! Each channel's cursor is the snowflake up to which every message is stored: moved (a
//! `Cursor`) once a batch's commits are all done, never past a message that was not stored,
//! which leaves the channel behind until a catch-up stored it. The cursor is only where a
//! catch-up starts: the Gateway has nothing to acknowledge. A RESUME's replay and a catch-up
//! that overlap are harmless: the snowflake is the `message_id`, and the outbox dedupes by it.

pub mod api;
pub mod catchup;
pub mod event;
pub mod link;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use miniserde::{Deserialize, Serialize};

use self::api::{Api, ApiError, PLATFORM};
use self::event::{Attachment, Message};
use super::bindings::{Rows, Through};
use super::inbound::{self, FileItem, Inbound};
use super::intake::{Arrival, Committed, Fetch, Intake, Recent, WhenStale};
use super::keyfiles::KeyFiles;
use super::lag::Lag;
use super::link::followers;
use super::{
    send_id, split_text, with_retry, Activity, Declaration, Description, Failure, Field, Flow, Host, Outbound,
    Provider, Registration, Transient, Upload,
};
use crate::config::{Config, Fields, Problems, Section, Settings};
use crate::json::{self, Object, Value};
use crate::metrics::Counter;
use crate::outbox::{Cursor, Ticket};
use crate::protocol::code;
use crate::protocol::{TOOL_FILE_SEND, TOOL_REPLY, TOOL_SEND};
use crate::quiet::Site;
use crate::source::Source;
use crate::store::StoreError;

const NAME: &str = "discord";
/// source → `ChannelInfo`.
const CHANNELS: Rows = Rows::new(NAME, "discord_channels", "discord channel");
const FLOW_ID: &str = "discord_bot_binding";
const TOOLS: &[&str] = &[TOOL_SEND, TOOL_REPLY, TOOL_FILE_SEND];
/// A message's content is at most this many characters (message.mdx, Create Message).
const MAX_TEXT: usize = 2_000;
/// A tool call retries rate limits and 5xx answers for at most this long.
const TOOL_DEADLINE: Duration = Duration::from_secs(20);
/// A message's attachment is fetched for at most this long before the message goes on with a
/// note.
pub const FETCH_DEADLINE: Duration = Duration::from_secs(30);
/// Recently stored messages remembered (`Recent`).
const RECENT: usize = 256;
/// A channel shows typing at most this often (Discord shows it for about 10 s).
const TYPING_EVERY: Duration = Duration::from_secs(8);
/// `GET /applications/@me` `flags`: the Message Content intent, on (verified apps) or limited
/// (unverified ones under 100 servers); application.mdx "Application Flags".
const MESSAGE_CONTENT_FLAGS: u64 = (1 << 18) | (1 << 19);
/// Channel types whose messages a bot reads (channel.mdx "Channel Types"): text, DM, voice
/// text, announcement, and the three thread types.
const TEXT_CHANNELS: [u64; 7] = [0, 1, 2, 5, 10, 11, 12];

pub const REGISTRATION: Registration = Registration::new(NAME, &[], read, start);

/// `[discord]`.
#[derive(Clone)]
pub struct DiscordSettings {
    pub api_base: String,
    /// Messages of other bots and of webhooks are stored too (off: only people's).
    pub accept_bots: bool,
}

impl Settings for DiscordSettings {
    fn summary(&self) -> String {
        format!(
            "discord:           api_base {}, accept_bots {}\n",
            self.api_base, self.accept_bots
        )
    }
}

fn read(_cfg: &Config, sections: &[&Section], p: &mut Problems) -> Option<Arc<dyn Settings>> {
    let section = sections.first()?;
    let mut f = Fields::new(section, p, &[]);
    let settings = DiscordSettings {
        api_base: f
            .url("api_base")
            .unwrap_or_else(|| "https://discord.com/api/v10".into()),
        accept_bots: f.bool("accept_bots").unwrap_or(false),
    };
    f.finish();
    Some(Arc::new(settings))
}

fn start(host: &Arc<Host>) -> Result<Option<Arc<dyn Provider>>, StoreError> {
    let Some(settings) = host.config.provider::<DiscordSettings>(NAME).cloned() else {
        return Ok(None);
    };
    CHANNELS.create(&host.db)?;
    Ok(Some(Arc::new_cyclic(|me| Discord {
        me: me.clone(),
        host: host.clone(),
        api: Api::new(&settings.api_base),
        accept_bots: settings.accept_bots,
        sessions: link::Sessions::new(followers::<ChannelInfo>(host, &CHANNELS)),
        recent: Recent::new(RECENT),
        lag: Lag::default(),
        typing: Mutex::default(),
        storing: Storing::default(),
        counts: Counts::default(),
        history_log: Site::new(),
    })))
}

/// What a binding knows about its bot and channel.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct ChannelInfo {
    /// The bot's user ID: the account, and how its own messages are told apart.
    pub bot_user: String,
    pub channel: String,
    /// `#general`, or `DM with ann`.
    pub channel_name: String,
    /// `p2p` (a DM) or `group`.
    pub chat_type: String,
    /// The snowflake the binding started the cursor at (0: the channel was empty). Stored with
    /// the binding (a durable commit), while a cursor reaches the disk with the next sync: a
    /// catch-up after a power cut right after the binding reads from here.
    pub from: u64,
}

impl Through for ChannelInfo {
    fn account(&self) -> &str {
        &self.bot_user
    }
}

pub fn source_of(bot_user: &str, channel: &str) -> Source {
    Source::new(NAME, &format!("{bot_user}:{channel}"))
}

/// The outbox cursor holding the snowflake of a channel's last stored message.
fn cursor_key(source: &Source) -> String {
    format!("discord_last:{}", source.key())
}

/// A message as `Recent` remembers it: by source, so two bots in one channel each store their
/// copy.
fn recent_key(source: &Source, id: u64) -> String {
    format!("{}/{id}", source.key())
}

/// Whether a snowflake may move a cursor: minted not more than a day ahead of this clock. A
/// cursor only moves forward, so one message stamped years ahead would end every later
/// catch-up.
fn plausible(snowflake: u64) -> bool {
    event::created_ms(snowflake) <= crate::ids::now_ms().saturating_add(86_400_000)
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
                "imgate_discord_unbound_messages_total",
                "Messages of channels no channel is bound to.",
            ),
            skipped: Counter::new(
                "imgate_discord_skipped_messages_total",
                "Notices, the bot's own and other bots' messages, not stored.",
            ),
            caught_up: Counter::new(
                "imgate_discord_caught_up_messages_total",
                "Messages stored by a catch-up from the history.",
            ),
        }
    }
}

pub struct Discord {
    me: Weak<Discord>,
    host: Arc<Host>,
    api: Api,
    accept_bots: bool,
    sessions: link::Sessions,
    recent: Recent,
    /// Channels whose history may hold messages not stored (a new session, a failed commit),
    /// after a snowflake.
    lag: Lag,
    /// Channel → when it last showed typing.
    typing: Mutex<HashMap<Source, Instant>>,
    /// Channels an `accept` is storing now: one at a time per channel, so two sets of lanes (a
    /// bot's session started again while the old one's lanes drain) neither reorder a channel
    /// nor move its cursor past what the other failed to store.
    storing: Storing,
    counts: Counts,
    /// Histories that cannot be read (a permission gone, a deleted channel), logged once a
    /// minute: a catch-up is tried again at every heartbeat 30 s apart.
    history_log: Site,
}

impl Discord {
    fn token_files(&self) -> KeyFiles {
        KeyFiles::new(self.host.config.server.state_dir.join("discord"), "", ".token")
    }

    /// The token of bot `bot_user`, while a binding keeps it.
    pub fn token(&self, bot_user: &str) -> Option<String> {
        self.token_files().read(bot_user)
    }

    fn channel_info(&self, source: &str) -> Result<Option<ChannelInfo>, StoreError> {
        CHANNELS.get(&self.host.db, source)
    }

    /// The binding of a source and its bot token.
    fn route(&self, source: &Source) -> Result<(ChannelInfo, String), Failure> {
        let info = self
            .channel_info(source.as_str())
            .map_err(Failure::storage)?
            .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "the Discord binding is gone"))?;
        let token = self
            .token(&info.bot_user)
            .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "the bot's token is no longer available"))?;
        Ok((info, token))
    }

    /// The bound channels of bot `bot_user`; `None` when the bindings cannot be read.
    fn try_channels_of(&self, bot_user: &str) -> Option<Vec<(Source, ChannelInfo)>> {
        CHANNELS.through(&self.host.channels, &self.host.db, bot_user)
    }

    /// The bound channels of bot `bot_user` (none when the bindings cannot be read).
    pub fn channels_of(&self, bot_user: &str) -> Vec<(Source, ChannelInfo)> {
        self.try_channels_of(bot_user).unwrap_or_default()
    }

    /// A new Gateway session of `bot_user` is ready (nothing was replayed): every bound
    /// channel is read from its cursor before its live messages move it again. Its bound
    /// channels; `None` when they cannot be read (the session must not go on without them).
    pub fn session_started(&self, bot_user: &str) -> Option<Vec<String>> {
        let channels = self.try_channels_of(bot_user)?;
        for (source, _) in &channels {
            self.lag.fell_behind(source, u64::MAX, false);
        }
        Some(channels.into_iter().map(|(_, i)| i.channel).collect())
    }

    /// The channels of `bot_user` that are behind and due for another catch-up.
    pub fn due(&self, bot_user: &str) -> Vec<String> {
        self.lag.due_under(&format!("{bot_user}:"))
    }

    /// Handles messages of one channel of `bot_user`'s session, in their order, on a blocking
    /// thread: a catch-up first when the channel is behind and due (`catch_up`: run it even if
    /// one ran lately), then each message handed to the outbox without waiting, then every
    /// commit awaited, so a burst shares its commits. A message not stored leaves the channel
    /// behind: the next catch-up reads it from the history.
    pub fn accept(&self, bot_user: &str, channel: &str, catch_up: bool, messages: Vec<Message>) {
        let source = source_of(bot_user, channel);
        let _claim = self.storing.claim(&source);
        let info = match CHANNELS.while_bound(&self.host.channels, &self.host.db, source.as_str()) {
            Ok(Some(info)) => info,
            Ok(None) => {
                self.counts.unbound.add(messages.len() as u64);
                if let Some(m) = messages.iter().find(|m| m.author_id != bot_user) {
                    let kind = if m.guild.is_none() { "dm" } else { "channel" };
                    self.host.unbound_seen(NAME, channel, kind);
                    log::debug!("discord: bot {bot_user}: a message from a channel no channel is bound to");
                }
                return;
            }
            Err(e) => {
                log::debug!("discord: {source}: cannot read the binding: {e}");
                if let Some(first) = messages.iter().map(|m| m.id).min() {
                    self.lag.fell_behind(&source, first.saturating_sub(1), true);
                }
                return;
            }
        };
        if catch_up || self.lag.due(&source) {
            // Not caught up: the channel stays behind, and its live messages move no cursor.
            let _ = catchup::run(self, &source, &info);
        }
        let moves_cursor = !self.lag.is_behind(&source);
        if let (Some(stored), true) = (self.store_in_order(&source, &info, messages).0, moves_cursor) {
            let _ = self.move_cursor(&source, stored);
        }
    }

    /// Hands messages to the outbox without waiting, then waits for every commit, so a batch
    /// shares its commits. The newest snowflake of the run from the first message on that is
    /// all stored (or not to be stored), and whether all were; a message not stored leaves the
    /// channel behind.
    fn store_in_order(&self, source: &Source, info: &ChannelInfo, messages: Vec<Message>) -> (Option<u64>, bool) {
        let handled: Vec<(u64, Handled)> = messages
            .into_iter()
            .map(|m| (m.id, self.prepare(source, info, m)))
            .collect();
        let (mut newest, mut all) = (0u64, true);
        for (id, h) in handled {
            // Every one is waited for, also past a failure.
            all &= self.finish(source, h);
            if all {
                newest = newest.max(id);
            }
        }
        ((newest > 0).then_some(newest), all)
    }

    /// Moves the channel's cursor to `to`, once every message up to it is stored. A cursor is
    /// only where a catch-up starts: one that did not reach the disk (it is logged without a
    /// sync) reads some messages again, which their snowflakes make duplicates. Whether it
    /// moved.
    fn move_cursor(&self, source: &Source, to: u64) -> bool {
        if !plausible(to) {
            return false;
        }
        let moved = self
            .host
            .outbox
            .move_cursors(&[Cursor::Forward(cursor_key(source), to)]);
        if let Err(e) = &moved {
            log::debug!("discord: {source}: cannot move the cursor: {e}");
        }
        moved.is_ok()
    }

    /// Whether a message is one imgate stores: not the bot's own, a post and not a notice, a
    /// person's unless other bots are accepted.
    fn wanted(&self, info: &ChannelInfo, m: &Message) -> bool {
        m.author_id != info.bot_user && m.is_post() && (self.accept_bots || !(m.author_bot || m.webhook))
    }

    /// One message up to its hand-over to the outbox.
    fn prepare(&self, source: &Source, info: &ChannelInfo, m: Message) -> Handled {
        if !self.wanted(info, &m) {
            self.counts.skipped.add(1);
            return Handled::Done;
        }
        let message_id = m.id.to_string();
        // By source: two bots in one channel each store their copy.
        if self.recent.seen("", &recent_key(source, m.id)) {
            return Handled::Done;
        }
        let message_type = m
            .attachment
            .as_ref()
            .map_or("text", |a| crate::files::kind_of(&a.content_type));
        let inbound = Inbound {
            message_id: message_id.clone(),
            sender_id: m.author_id.clone(),
            sender_name: Some(m.author_name.clone()).filter(|n| !n.is_empty()),
            chat_id: Some(info.channel.clone()),
            chat_type: info.chat_type.clone(),
            message_type: message_type.to_string(),
            // Names are longer than the IDs they replace: bounded again.
            text: event::bounded(&event::readable(&m.content, &m.mentions), event::MAX_TEXT_BYTES),
            event_time: Some(m.created_ms()),
            files: None,
        };
        let arrival = Arrival {
            source: source.clone(),
            file: m.attachment.clone().map(|a| Fetch {
                kind: crate::files::kind_of(&a.content_type).to_string(),
                // The attachment's URL is signed and expires: fetched now, into our cache.
                fetch: Box::new(move || self.fetch(&a, source)),
            }),
            inbound,
            reply_ref: true,
            // The cursor moves once the messages before it are stored too (`move_cursor`).
            cursors: Vec::new(),
            // Older than the TTL (a catch-up after a long outage): counted expired.
            when_stale: WhenStale::CountExpired,
        };
        match self.host.intake(arrival) {
            Intake::Stale => Handled::Done,
            Intake::Submitted(ticket) => Handled::Commit(ticket, m.id),
        }
    }

    /// Waits for a prepared message's commit: whether it is stored (or a duplicate, or not to
    /// be stored). A message not stored leaves its channel behind, from just before it.
    fn finish(&self, source: &Source, h: Handled) -> bool {
        let (ticket, id) = match h {
            Handled::Done => return true,
            Handled::Commit(ticket, id) => (ticket, id),
        };
        let then = "the message is read again from the history later";
        if self.host.committed(ticket, source, then) == Committed::Stored {
            self.recent.stored(String::new(), recent_key(source, id));
            return true;
        }
        log::debug!("discord: {source}: a message not stored; the channel is behind");
        self.lag.fell_behind(source, id.saturating_sub(1), true);
        false
    }

    /// A message's attachment, from its signed URL, into the file cache.
    fn fetch(&self, a: &Attachment, source: &Source) -> Result<FileItem, String> {
        let files = &self.host.files;
        let deadline = Instant::now() + FETCH_DEADLINE;
        // Each attempt writes a new `.part` (a failed one removes its bytes as it drops).
        let (part, content_type) = with_retry("discord: attachment download", deadline, |left| {
            let mut part = files.begin(source.as_str(), "in").map_err(|e| PLATFORM.cache(e))?;
            let content_type = self.api.download(&a.url, &mut part, left)?;
            Ok::<_, ApiError>((part, content_type))
        })
        .map_err(|e| e.to_string())?;
        let mime = super::served_mime(content_type.as_deref(), &a.content_type);
        let (file_ref, rec) = files.commit(part, &a.filename, &mime).map_err(|e| e.to_string())?;
        Ok(FileItem::cached(file_ref, rec))
    }

    /// One message created: `content`, the reply's reference, a nonce that makes a retried
    /// call one message; its ID.
    fn post(
        &self,
        token: &str,
        channel: &str,
        payload: &str,
        file: Option<&Upload>,
        deadline: Instant,
    ) -> Result<String, Failure> {
        let path = format!("/channels/{channel}/messages");
        let sent = with_retry("discord: send", deadline, |left| match file {
            None => self.api.post(token, &path, Some(payload), left),
            Some(f) => self.api.post_file(token, &path, payload, f, left),
        })
        .map_err(|e| refusal(&e))?;
        Ok(json::as_object(&sent)
            .and_then(|o| json::get_str(o, "id"))
            .unwrap_or_default()
            .to_string())
    }

    /// Shows the bot typing in the channel of `source`: best effort, on the pool, at most every
    /// `TYPING_EVERY` (Discord shows it for about 10 s). The throttle is checked first, so a
    /// burst of deliveries costs no thread, store read or call.
    fn show_typing(&self, source: &Source) {
        {
            let mut typing = self.typing.lock().unwrap_or_else(|e| e.into_inner());
            if typing.get(source).is_some_and(|t| t.elapsed() < TYPING_EVERY) {
                return;
            }
            if typing.len() >= 1024 {
                typing.retain(|_, t| t.elapsed() < TYPING_EVERY);
            }
            typing.insert(source.clone(), Instant::now());
        }
        let Some(me) = self.me.upgrade() else { return };
        let source = source.clone();
        crate::runtime::spawn_blocking(move || {
            let Ok((info, token)) = me.route(&source) else { return };
            let path = format!("/channels/{}/typing", info.channel);
            if let Err(e) = me.api.post(&token, &path, None, Duration::from_secs(5)) {
                log::debug!("discord: {source}: typing not shown: {e}");
            }
        });
    }
}

/// The channels being stored now, and a wake-up for an `accept` waiting its turn.
#[derive(Default)]
struct Storing {
    now: Mutex<std::collections::HashSet<Source>>,
    done: std::sync::Condvar,
}

impl Storing {
    /// Waits (on the pool) until no other `accept` stores `source`, then holds it until the
    /// claim drops.
    fn claim(&self, source: &Source) -> Claim<'_> {
        let mut now = self.now.lock().unwrap_or_else(|e| e.into_inner());
        while now.contains(source) {
            now = self.done.wait(now).unwrap_or_else(|e| e.into_inner());
        }
        now.insert(source.clone());
        Claim {
            storing: self,
            source: source.clone(),
        }
    }
}

struct Claim<'a> {
    storing: &'a Storing,
    source: Source,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let mut now = self.storing.now.lock().unwrap_or_else(|e| e.into_inner());
        now.remove(&self.source);
        self.storing.done.notify_all();
    }
}

/// One message after `prepare`: nothing to wait for, or the commit to wait for first (with its
/// snowflake).
enum Handled {
    Done,
    Commit(Ticket, u64),
}

/// The JSON of one message to create: its content, a nonce Discord checks for uniqueness (a
/// retried call returns the first message), no mention pinging anyone, the reply's reference
/// (a message deleted meanwhile makes it a plain message).
fn message_payload(content: &str, nonce: &str, reply_to: Option<&str>) -> String {
    let mut fields = vec![
        ("content", json::s(content)),
        ("nonce", json::s(nonce)),
        ("enforce_nonce", json::b(true)),
        ("allowed_mentions", json::obj([("parse", json::arr([]))])),
    ];
    if let Some(id) = reply_to {
        fields.push((
            "message_reference",
            json::obj([("message_id", json::s(id)), ("fail_if_not_exists", json::b(false))]),
        ));
    }
    json::to_string(&json::obj(fields))
}

/// A REST refusal as a tool's failure, with what the owner can do about it.
fn refusal(e: &ApiError) -> Failure {
    let refused = |why: &str| Failure::new(code::UPSTREAM_REJECTED, why.to_string());
    match (e.status, e.code.as_str()) {
        (401, _) => Failure::new(
            code::CONNECTION_NOT_AUTHENTICATED,
            "Discord refused the bot token: bind the channel again with a new token",
        ),
        (_, "10003") => refused("Discord does not know this channel any more"),
        (403, _) | (_, "50001" | "50013") => {
            refused("the bot lacks a permission in this channel (View Channel, Send Messages, Attach Files)")
        }
        (413, _) | (_, "40005") => refused("the file is larger than Discord takes from this bot"),
        _ => Failure::api(e),
    }
}

/// What a binding check met, as the reason the form shows.
fn bind_failure(what: &str, e: &ApiError) -> Failure {
    let refused = |why: String| Failure::new(code::CONNECTION_NOT_AUTHENTICATED, why);
    if e.temporary() {
        return Failure::temporary(code::UPSTREAM_UNREACHABLE, format!("cannot check the {what}: {e}"));
    }
    match (e.status, e.code.as_str()) {
        (401, _) => refused("Discord rejected the bot token (copy it again from the Developer Portal, Bot page)".into()),
        (_, "10003") | (404, _) => refused("Discord does not know this channel (copy its ID with Developer Mode on)".into()),
        (_, "50001") | (403, _) => refused(format!(
            "the bot cannot see this channel: invite it to the server and give it View Channel and Read Message History ({e})"
        )),
        _ => refused(format!("Discord refused the {what} check ({e})")),
    }
}

const DECLARATION: Declaration = Declaration {
    name: NAME,
    label: "Discord",
    description: "A Discord bot in a server's text channel or a DM, over the Gateway.",
    flows: &[FLOW],
    tools: TOOLS,
};

const FLOW: Flow = Flow::form(
    FLOW_ID,
    "Bind a Discord channel",
    "Bind this channel to one Discord text channel or DM of a bot; messages arrive over the Gateway.",
    &[
        Field::secret(
            "bot_token",
            "Bot token",
            None,
            "The bot's token (Developer Portal, your application, Bot, Reset Token); turn on the Message Content Intent there.",
        ),
        Field::text(
            "channel_id",
            "Channel ID",
            Some("1098765432109876543"),
            "Invite the bot to the server; with Developer Mode on, right-click the channel and Copy Channel ID.",
        ),
    ],
);

/// A name from Discord as a Descriptor shows it: at most 80 characters, no control characters.
fn shown_name(name: &str) -> String {
    name.chars().filter(|c| !c.is_control()).take(80).collect()
}

/// A token as Discord issues them: three base64url parts joined by dots.
fn token_shaped(token: &str) -> bool {
    (30..=200).contains(&token.len())
        && token.split('.').count() == 3
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl Provider for Discord {
    fn declaration(&self) -> &'static Declaration {
        &DECLARATION
    }

    /// `discord_bot_binding`: checks the token (`/users/@me`), the Message Content intent
    /// (`/applications/@me`), the channel and its history.
    fn bind(&self, input: &Object) -> Result<Source, Failure> {
        let given = |k: &str| json::get_str(input, k).map(str::trim).unwrap_or_default();
        let token = given("bot_token");
        let token = token.strip_prefix("Bot ").unwrap_or(token).trim();
        let channel = given("channel_id");
        let invalid = |why: &str| Err(Failure::new(code::INVALID_ARGUMENTS, why.to_string()));
        if !token_shaped(token) {
            return invalid("bot_token must be a Discord bot token (three parts joined by dots)");
        }
        if event::snowflake(channel).is_none() {
            return invalid("channel_id must be a channel's ID: digits only, like 1098765432109876543");
        }
        let deadline = || TOOL_DEADLINE;
        let me = self
            .api
            .get(token, "/users/@me", deadline())
            .map_err(|e| bind_failure("bot token", &e))?;
        let me = json::as_object(&me).cloned().unwrap_or_default();
        let Some(bot_user) = json::get_str(&me, "id").filter(|id| event::snowflake(id).is_some()) else {
            return invalid("Discord's answer names no user for this token");
        };
        if !matches!(me.get("bot"), Some(Value::Bool(true))) {
            return invalid("this is not a bot's token: use the token of the application's bot");
        }
        let bot_user = bot_user.to_string();
        // Without the Message Content intent a bot's messages arrive empty (and the Gateway
        // closes with 4014 when it is asked for): said now, not after the binding.
        match self.api.get(token, "/applications/@me", deadline()) {
            Ok(app) => {
                let flags = json::as_object(&app)
                    .and_then(|a| json::get_u64(a, "flags"))
                    .unwrap_or(0);
                if flags & MESSAGE_CONTENT_FLAGS == 0 {
                    return Err(Failure::new(
                        code::CONNECTION_NOT_AUTHENTICATED,
                        "the bot's Message Content Intent is off: turn it on (Developer Portal, Bot, Privileged Gateway Intents), then bind again",
                    ));
                }
            }
            Err(e) if e.temporary() => return Err(bind_failure("application", &e)),
            // The Gateway's 4014 still tells, later.
            Err(e) => log::debug!("discord: the application's intents cannot be read: {e}"),
        }
        let found = self
            .api
            .get(token, &format!("/channels/{channel}"), deadline())
            .map_err(|e| bind_failure("channel", &e))?;
        let found = json::as_object(&found).cloned().unwrap_or_default();
        let kind = json::get_u64(&found, "type").unwrap_or(u64::MAX);
        if !TEXT_CHANNELS.contains(&kind) {
            return invalid(
                "this channel holds no messages a bot reads (a category, a forum or a stage): bind a text channel",
            );
        }
        let dm = kind == 1;
        // The catch-up reads the history: check it can, and start from its newest message.
        let newest = self
            .api
            .get(token, &format!("/channels/{channel}/messages?limit=1"), deadline())
            .map_err(|e| bind_failure("channel history", &e))?;
        let newest = match newest {
            Value::Array(list) => list
                .iter()
                .filter_map(json::as_object)
                .filter_map(|m| json::get_str(m, "id").and_then(event::snowflake))
                .max(),
            _ => None,
        };
        let channel_name = if dm {
            let with = match json::get(&found, "recipients") {
                Some(Value::Array(r)) => r
                    .iter()
                    .filter_map(json::as_object)
                    .find_map(|u| json::get_str(u, "global_name").or_else(|| json::get_str(u, "username")))
                    .map(shown_name),
                _ => None,
            };
            with.map_or_else(|| "Discord DM".into(), |n| format!("DM with {n}"))
        } else {
            let name = match json::get_str(&found, "name").filter(|n| !n.is_empty()) {
                Some(n) => format!("#{}", shown_name(n)),
                None => inbound::redact(channel),
            };
            // The server's name tells two `#general`s apart; without it, the channel's alone.
            let guild = json::get_str(&found, "guild_id")
                .filter(|g| event::snowflake(g).is_some())
                .and_then(|g| self.api.get(token, &format!("/guilds/{g}"), deadline()).ok())
                .and_then(|g| {
                    json::as_object(&g)
                        .and_then(|g| json::get_str(g, "name"))
                        .map(shown_name)
                })
                .filter(|g| !g.is_empty());
            match guild {
                Some(g) => format!("{name} ({g})"),
                None => name,
            }
        };
        let source = source_of(&bot_user, channel);
        // History from before the first binding is never read: the cursor starts at the
        // channel's newest message (an empty channel has nothing before), and never moves back.
        // Bound again while bound (a new token after a refusal), the channel keeps its start, so
        // what was posted meanwhile is caught up.
        let bound = self
            .host
            .channels
            .bound_channel(source.as_str())
            .map_err(Failure::storage)?;
        let earlier = match bound {
            Some(_) => self.channel_info(source.as_str()).map_err(Failure::storage)?,
            None => None,
        };
        let kept = earlier.is_some();
        let from = match earlier {
            Some(e) => e.from,
            None => newest.filter(|id| plausible(*id)).unwrap_or(0),
        };
        let binding = ChannelInfo {
            bot_user: bot_user.clone(),
            channel: channel.to_string(),
            channel_name,
            chat_type: if dm { "p2p" } else { "group" }.into(),
            from,
        };
        // The bot's first binding: no session of it runs yet to ask for its session budget.
        let first_of_bot = self.channels_of(&bot_user).is_empty();
        self.token_files()
            .store(&bot_user, token)
            .map_err(|e| Failure::new(code::TOOL_INVOKE_FAILED, format!("cannot store the token: {e}")))?;
        self.host
            .outbox
            .move_cursors(&[Cursor::Forward(cursor_key(&source), from)])
            .map_err(Failure::storage)?;
        CHANNELS
            .put(&self.host.db, source.as_str(), &binding)
            .map_err(Failure::storage)?;
        // A session up for this bot took this channel's messages as unbound until now: its next
        // message starts with a catch-up from the cursor (what an earlier binding of the channel
        // left behind is not read).
        if !kept {
            self.lag.forget(&source);
        }
        self.lag.fell_behind(&source, u64::MAX, false);
        // A bot Discord refused (a token, the intent) is tried again now that it is bound again.
        if self.sessions.refused(&bot_user).is_some() {
            self.sessions.forget(&bot_user);
        }
        // Bound whatever the daily budget of new sessions (sends work, and what is posted until a
        // session starts is caught up), but a spent one is said in the first binding's
        // Descriptor at once, not when the session asks (best effort: the session asks anyway).
        // A bot with a session running already knows its own state.
        if first_of_bot {
            match self.api.get(token, "/gateway/bot", deadline()) {
                Ok(answer) => self.sessions.budget_seen(&bot_user, &answer),
                Err(e) => log::debug!("discord: bot {bot_user}: the session budget cannot be read: {e}"),
            }
        }
        Ok(source)
    }

    fn describe(&self, source: &Source) -> Result<Description, StoreError> {
        Ok(match self.channel_info(source.as_str())? {
            Some(info) if self.token(&info.bot_user).is_none() => {
                DECLARATION.lost("the bot's token is no longer available")
            }
            Some(info) => match self.sessions.refused(&info.bot_user) {
                Some(why) => DECLARATION.unusable("error", info.channel_name, None, &why),
                None => {
                    let hint = Some(inbound::redact(&info.channel));
                    let mut d = DECLARATION.connected(info.channel_name, hint);
                    // No session: nothing arrives, but the tools work (sends are REST calls).
                    if let Some(at) = self.sessions.spent_until(&info.bot_user) {
                        let why = format!(
                            "Discord's daily budget of new sessions is used up: no messages arrive until it resets at {} (then what was posted meanwhile is read from the history); sending works",
                            crate::ids::utc(at)
                        );
                        d.status = "degraded";
                        for (_, tool) in &mut d.tools {
                            tool.reason = Some(why.clone());
                        }
                    }
                    d
                }
            },
            None => DECLARATION.lost("the Discord binding is gone"),
        })
    }

    /// Text (split at 2,000 characters) and files, the first part as a reply to the message
    /// answered. With one file and a short text, the text is the file's message.
    fn send(&self, source: &Source, out: &Outbound) -> Result<String, Failure> {
        let (info, token) = self.route(source)?;
        let deadline = Instant::now() + TOOL_DEADLINE;
        let reply_to = match out.reply_to {
            Some(id) if event::snowflake(id).is_none() => {
                return Err(Failure::new(
                    code::REPLY_REF_INVALID,
                    "the message answered is not Discord's",
                ))
            }
            other => other,
        };
        let parts = split_text(out.text, MAX_TEXT);
        // The text goes with the first file when it fits in one message.
        let caption = !out.files.is_empty() && parts.len() == 1;
        let mut last = String::new();
        let mut part = 0;
        let mut reply = reply_to;
        if !caption && !out.text.is_empty() {
            for text in &parts {
                let payload = message_payload(text, &send_id(out.idempotency_key, part, 12), reply.take());
                last = self.post(&token, &info.channel, &payload, None, deadline)?;
                part += 1;
            }
        }
        for (i, (rec, path)) in out.files.iter().enumerate() {
            let text = if caption && i == 0 { out.text } else { "" };
            let payload = message_payload(text, &send_id(out.idempotency_key, part, 12), reply.take());
            let upload = Upload {
                filename: &rec.filename,
                mime: &rec.mime_type,
                size: rec.byte_size,
                path,
            };
            last = self.post(&token, &info.channel, &payload, Some(&upload), deadline)?;
            part += 1;
        }
        Ok(last)
    }

    /// One Gateway session per bot with a binding; tokens no binding uses are forgotten.
    fn bindings_changed(&self, bound: &[Source]) {
        let bots = CHANNELS.accounts::<ChannelInfo>(&self.host.db, bound);
        self.sessions.sync(&self.me, &bots);
        self.token_files().forget_unused(&bots, "discord: bot token of");
        self.lag.retain(bound);
    }

    /// Messages were delivered: the channel shows the bot typing (best effort, at most every
    /// `TYPING_EVERY`).
    fn delivered(&self, source: &Source) {
        self.show_typing(source);
    }

    /// The agent is busy (v2 `chat.activity`): the channel shows the bot typing. Discord has no
    /// way to end it early; it ends by itself after about 10 s, or with the bot's next message.
    fn activity(&self, source: &Source, activity: Activity) {
        if activity == Activity::Busy {
            self.show_typing(source);
        }
    }

    fn metrics(&self, out: &mut String) {
        self.sessions.links().metrics(
            out,
            "imgate_discord_sessions",
            "Gateway sessions running, one per bound bot.",
            "Gateway sessions ready now.",
        );
        let lines = [(
            "imgate_discord_identifies_total",
            "counter",
            "New Gateway sessions started (IDENTIFY).",
            self.sessions.identifies(),
        )];
        crate::metrics::singles(out, &lines);
        crate::metrics::counters(
            out,
            &[&self.counts.unbound, &self.counts.skipped, &self.counts.caught_up],
        );
    }

    fn stop(&self) {
        self.sessions.stop_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_payload_pings_nobody_and_names_its_nonce_and_reply() {
        let p = message_payload("hi @everyone", "abc", Some("123"));
        let v: serde_json::Value = serde_json::from_str(&p).unwrap();
        assert_eq!(v["content"], "hi @everyone");
        assert_eq!(v["nonce"], "abc");
        assert_eq!(v["enforce_nonce"], true);
        assert_eq!(v["allowed_mentions"]["parse"], serde_json::json!([]));
        assert_eq!(v["message_reference"]["message_id"], "123");
        assert_eq!(v["message_reference"]["fail_if_not_exists"], false);
        let p: serde_json::Value = serde_json::from_str(&message_payload("x", "n", None)).unwrap();
        assert!(p.get("message_reference").is_none());
    }

    #[test]
    fn tokens_are_checked_for_their_shape_only() {
        assert!(token_shaped(
            "MTA5ODc2NTQzMjEwOTg3NjU0.GsimTk.discord-simulator-bot-token-000"
        ));
        assert!(!token_shaped("short.a.b"));
        assert!(!token_shaped(
            "MTA5ODc2NTQzMjEwOTg3NjU0GsimTkdiscord-simulator-bot-token"
        ));
        assert!(!token_shaped(
            "MTA5ODc2NTQzMjEwOTg3NjU0.GsimTk.discord simulator bot token"
        ));
    }
}
