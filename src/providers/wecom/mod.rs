//! WeCom (企业微信): an intelligent robot (智能机器人) in a group or a one-to-one chat, over the
//! long connection the robot opens itself (`link`), so imgate works behind NAT with no public
//! URL. Replies and sends go out on the same connection (`api`).
//!
//! Source key: `{bot_id}:{chat}`, the chat a group's `chatid` or, for a one-to-one chat (which
//! has none), the user's `userid`. A binding keeps what it knows of the chat in its own table
//! (`wecom_chats`); the robot's secret is kept in `state_dir/wecom/{bot_id}.secret` (mode
//! 0600), never in the database, a packet or a log line, and forgotten with the robot's last
//! binding.
//!
//! WeCom sends a robot message once and wants no acknowledgement: what it sent while imgate was
//! not connected is gone, and there is no history to read it back from. What imgate received
//! is never lost (stored before anything else, each `msgid` pushed once), and each stored
//! message keeps, in the same outbox transaction (a `Cursor::Set`), the `req_id` a reply to it
//! names, so a reply after a restart still goes out as a reply while WeCom takes it (six
//! minutes); after that, or to an older message, a reply is a proactive message.

pub mod api;
pub mod event;
pub mod link;
pub mod media;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use miniserde::{Deserialize, Serialize};

use self::api::Answer;
use self::event::{Media, RobotMessage};
use super::bindings::{Rows, Through};
use super::inbound::{self, FileItem, Inbound};
use super::intake::{Arrival, Committed, Fetch, Intake, Recent, WhenStale};
use super::keyfiles::KeyFiles;
use super::link::calls::{CallError, Calls};
use super::link::{followers, Links};
use super::{
    send_id, split_text, Declaration, Description, Failure, Field, Flow, Host, Outbound, Provider, Registration,
};
use crate::config::{Config, Fields, Problems, Section, Settings};
use crate::json::{self, Object};
use crate::metrics::Counter;
use crate::outbox::{Cursor, Ticket};
use crate::protocol::code;
use crate::protocol::{TOOL_FILE_SEND, TOOL_REPLY, TOOL_SEND};
use crate::source::Source;
use crate::store::StoreError;

const NAME: &str = "wecom";
/// source → `ChatInfo`.
const CHATS: Rows = Rows::new(NAME, "wecom_chats", "wecom chat");
const FLOW_ID: &str = "wecom_bot_binding";
const TOOLS: &[&str] = &[TOOL_SEND, TOOL_REPLY, TOOL_FILE_SEND];
/// A part of a text is at most this many characters: `api::MAX_CONTENT` bytes of UTF-8.
const MAX_TEXT: usize = api::MAX_CONTENT / 4;
/// A tool call waits this long for WeCom's answer.
const TOOL_DEADLINE: Duration = Duration::from_secs(20);
/// WeCom takes a reply on a message this long after it (846608 after); a reply sent later is
/// a proactive message. A minute is left for the way there.
const REPLY_WINDOW_MS: u64 = 5 * 60 * 1000;
/// A message's file is fetched for at most this long before the message goes on with a note.
const FETCH_DEADLINE: Duration = Duration::from_secs(60);
/// Recently stored messages remembered (`Recent`).
const RECENT: usize = 256;

pub const REGISTRATION: Registration = Registration::new(NAME, &[], read, start);

/// `[wecom]`.
#[derive(Clone)]
pub struct WeComSettings {
    pub ws_url: String,
    /// A connection that brought no message for this long is replaced (`link::DEAF`).
    pub replace_quiet: Duration,
}

impl Settings for WeComSettings {
    fn summary(&self) -> String {
        format!(
            "wecom:             ws_url {}, replace_quiet {}\n",
            self.ws_url,
            crate::config::fmt_duration(self.replace_quiet)
        )
    }
}

fn read(_cfg: &Config, sections: &[&Section], p: &mut Problems) -> Option<Arc<dyn Settings>> {
    let section = sections.first()?;
    let mut f = Fields::new(section, p, &[]);
    let ws_url = match f.text("ws_url") {
        Some(u) if u.starts_with("wss://") || u.starts_with("ws://") => u,
        Some(u) => {
            f.err(format!("ws_url: `{u}` is not a ws:// or wss:// URL"));
            String::new()
        }
        None => "wss://openws.work.weixin.qq.com".into(),
    };
    let settings = WeComSettings {
        ws_url,
        replace_quiet: f.duration("replace_quiet").unwrap_or(link::DEAF),
    };
    f.finish();
    Some(Arc::new(settings))
}

fn start(host: &Arc<Host>) -> Result<Option<Arc<dyn Provider>>, StoreError> {
    let Some(settings) = host.config.provider::<WeComSettings>(NAME).cloned() else {
        return Ok(None);
    };
    CHATS.create(&host.db)?;
    Ok(Some(Arc::new_cyclic(|me| WeCom {
        me: me.clone(),
        host: host.clone(),
        settings,
        links: Links::new("wecom: robot", "long connection").followed_by(followers::<ChatInfo>(host, &CHATS)),
        calls: Mutex::default(),
        files: crate::upstream::agent(FETCH_DEADLINE),
        recent: Recent::new(RECENT),
        unbound: Counter::new(
            "imgate_wecom_unbound_messages_total",
            "Robot messages of chats no channel is bound to.",
        ),
    })))
}

/// What a binding knows about its robot and chat.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct ChatInfo {
    pub bot_id: String,
    /// A group's `chatid`, or the user's `userid` of a one-to-one chat.
    pub chat: String,
    /// `group`, `single`, or empty until the chat's first message says which.
    pub chat_type: String,
}

/// Where a reply to the chat's latest message goes: its `req_id`, kept with every stored
/// message (the outbox cursor `wecom_reply:{source}`).
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
struct ReplyRoute {
    msgid: String,
    req_id: String,
    /// When the message arrived (Unix ms).
    at_ms: u64,
}

impl Through for ChatInfo {
    fn account(&self) -> &str {
        &self.bot_id
    }
}

pub fn source_of(bot_id: &str, chat: &str) -> Source {
    Source::new(NAME, &format!("{bot_id}:{chat}"))
}

fn reply_key(source: &Source) -> String {
    format!("wecom_reply:{}", source.key())
}

/// A chat ID imgate can name a source by: letters, digits, `.`, `_`, `-`, `@`.
fn chat_ok(chat: &str) -> bool {
    !chat.is_empty()
        && chat.len() <= event::MAX_ID
        && chat
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'@'))
}

pub struct WeCom {
    me: Weak<WeCom>,
    host: Arc<Host>,
    settings: WeComSettings,
    links: Links,
    /// Each robot's replies and sends waiting for WeCom's answers.
    calls: Mutex<HashMap<String, Arc<Calls<Answer>>>>,
    /// Media downloads: a slow link's 20 MB in one call.
    files: ureq::Agent,
    recent: Recent,
    unbound: Counter,
}

/// One message after `prepare`: the commit to wait for, with its msgid, or nothing to wait for.
enum Handled {
    Done,
    Commit(Ticket, String),
}

impl WeCom {
    fn secret_files(&self) -> KeyFiles {
        KeyFiles::new(self.host.config.server.state_dir.join("wecom"), "", ".secret")
    }

    /// The secret of robot `bot_id`, while a binding keeps it.
    pub fn secret(&self, bot_id: &str) -> Option<String> {
        self.secret_files().read(bot_id)
    }

    fn calls_of(&self, bot_id: &str) -> Arc<Calls<Answer>> {
        let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        calls.entry(bot_id.to_string()).or_default().clone()
    }

    fn info(&self, source: &Source) -> Result<Option<ChatInfo>, StoreError> {
        CHATS.get(&self.host.db, source.as_str())
    }

    /// Stores one run of a chat's robot messages of robot `bot_id`, in their order, on a
    /// blocking thread: the binding read once, each message handed to the outbox without
    /// waiting, then every commit awaited, so a burst shares its commits.
    pub fn accept(&self, bot_id: &str, chat: &str, messages: Vec<(RobotMessage, String)>) {
        let Some((last, _)) = messages.last() else { return };
        let source = source_of(bot_id, chat);
        let usable = chat_ok(chat);
        let bound = match usable {
            true => CHATS.while_bound::<ChatInfo>(&self.host.channels, &self.host.db, source.as_str()),
            false => Ok(None),
        };
        let info = match bound {
            Ok(Some(info)) => info,
            Ok(None) => {
                self.unbound.add(messages.len() as u64);
                if usable {
                    let kind = if last.group { "group" } else { "dm" };
                    self.host.unbound_seen(NAME, chat, kind);
                }
                log::debug!("wecom: robot {bot_id}: a message from a chat no channel is bound to");
                return;
            }
            Err(e) => {
                // The store logs the outage once; one line per message would flood the log.
                log::debug!("wecom: {source}: cannot read the binding; messages were not stored: {e}");
                return;
            }
        };
        self.learn(&source, &info, last);
        let handled: Vec<Handled> = messages
            .into_iter()
            .filter_map(|(m, req_id)| self.prepare(&source, &info, m, req_id))
            .collect();
        for h in handled {
            self.finish(&source, h);
        }
    }

    /// One message up to its hand-over to the outbox (`None`: stored already).
    fn prepare(&self, source: &Source, info: &ChatInfo, m: RobotMessage, req_id: String) -> Option<Handled> {
        if self.recent.seen("", &m.msgid) {
            return None;
        }
        let message_type = match &m.media {
            Some(media) if m.text.is_empty() => media.kind,
            _ => "text",
        };
        let inbound = Inbound {
            message_id: m.msgid.clone(),
            sender_id: m.sender.clone(),
            sender_name: Some(inbound::redact(&m.sender)),
            chat_id: Some(info.chat.clone()),
            chat_type: if m.group { "group" } else { "p2p" }.into(),
            message_type: message_type.to_string(),
            text: m.text.clone(),
            event_time: m.created_ms,
            files: None,
        };
        let route = ReplyRoute {
            msgid: m.msgid.clone(),
            req_id,
            at_ms: crate::ids::now_ms(),
        };
        let arrival = Arrival {
            source: source.clone(),
            file: m.media.clone().map(|media| {
                let at = source.clone();
                Fetch {
                    kind: media.kind.to_string(),
                    fetch: Box::new(move || self.fetch(&media, &at)),
                }
            }),
            inbound,
            reply_ref: true,
            cursors: vec![Cursor::Set(reply_key(source), miniserde::json::to_string(&route))],
            when_stale: WhenStale::CountExpired,
        };
        Some(match self.host.intake(arrival) {
            Intake::Stale => Handled::Done,
            Intake::Submitted(ticket) => Handled::Commit(ticket, m.msgid),
        })
    }

    /// A message's image or file, downloaded and decrypted into the file cache.
    fn fetch(&self, media: &Media, source: &Source) -> Result<FileItem, String> {
        let files = &self.host.files;
        let mut part = files.begin(source.as_str(), "in").map_err(|e| e.to_string())?;
        let (name, served) = media::download(&self.files, &media.url, &media.aeskey, &mut part, FETCH_DEADLINE)?;
        let (default_name, default_mime) = match media.kind {
            "image" => ("image.jpg", "image/jpeg"),
            _ => ("file", "application/octet-stream"),
        };
        let mime = super::served_mime(served.as_deref(), default_mime);
        let name = name.unwrap_or_else(|| default_name.to_string());
        let (file_ref, rec) = files.commit(part, &name, &mime).map_err(|e| e.to_string())?;
        Ok(FileItem::cached(file_ref, rec))
    }

    /// Waits for a prepared message's commit.
    fn finish(&self, source: &Source, h: Handled) {
        let Handled::Commit(ticket, msgid) = h else { return };
        let then = "a message was not stored (WeCom does not send it again)";
        if self.host.committed(ticket, source, then) == Committed::Stored {
            self.recent.stored(String::new(), msgid);
        }
    }

    /// A bound chat's message tells its kind: kept in its row when it changed, and xAgent is
    /// told, as its Descriptor names the chat by it.
    fn learn(&self, source: &Source, info: &ChatInfo, m: &RobotMessage) {
        let chat_type = if m.group { "group" } else { "single" };
        if info.chat_type == chat_type {
            return;
        }
        let row = ChatInfo {
            chat_type: chat_type.into(),
            ..info.clone()
        };
        match CHATS.put(&self.host.db, source.as_str(), &row) {
            Ok(()) => self.host.binding_state_changed(source),
            Err(e) => log::debug!("wecom: {source}: cannot keep the chat's kind: {e}"),
        }
    }

    /// Where a reply to the chat's latest message goes, as its last stored message left it.
    fn reply_route(&self, source: &Source) -> Result<ReplyRoute, Failure> {
        self.host.kept(&reply_key(source)).map_err(Failure::storage)
    }

    /// One frame on the robot's connection, answered 0 within the tool's deadline.
    fn call(
        &self,
        bot_id: &str,
        req_id: &str,
        frame: async_tungstenite::tungstenite::Message,
    ) -> Result<Answer, Failure> {
        let deadline = Instant::now() + TOOL_DEADLINE;
        match self.calls_of(bot_id).call(req_id, frame, deadline) {
            Ok(a) => Ok(a),
            Err(CallError::NotConnected) => Err(Failure::temporary(
                code::UPSTREAM_UNREACHABLE,
                "the robot's long connection is not up: nothing was sent; try again",
            )),
            Err(CallError::Busy) => Err(Failure::temporary(
                code::BUSY,
                "too many messages wait for WeCom's answer: nothing was sent; try again",
            )),
            Err(CallError::NoAnswer) => Err(Failure::temporary(
                code::UPSTREAM_UNREACHABLE,
                "WeCom did not answer in time: the message may have been sent",
            )),
        }
    }

    /// One answer that must be 0.
    fn call_ok(
        &self,
        bot_id: &str,
        req_id: &str,
        frame: async_tungstenite::tungstenite::Message,
    ) -> Result<Answer, Failure> {
        let answer = self.call(bot_id, req_id, frame)?;
        match answer.errcode {
            0 => Ok(answer),
            code => Err(rejected(code, &answer.errmsg)),
        }
    }

    /// One file: uploaded in chunks (init, chunks, finish), then sent as a media message. An
    /// image past WeCom's image limit goes as a file.
    fn send_file(
        &self,
        info: &ChatInfo,
        rec: &crate::files::FileRecord,
        path: &std::path::Path,
    ) -> Result<String, Failure> {
        use md5::Digest;
        use std::io::Read;
        let size = rec.byte_size;
        let kind = match crate::files::kind_of(&rec.mime_type) {
            "image" if size <= api::MAX_IMAGE => "image",
            _ => "file",
        };
        let chunks = size.div_ceil(api::MAX_CHUNK as u64).max(1);
        if size > api::MAX_FILE || chunks > api::MAX_CHUNKS {
            return Err(Failure::new(
                code::INVALID_ARGUMENTS,
                format!("WeCom takes files of at most {} bytes", api::MAX_FILE),
            ));
        }
        let unreadable =
            |e: std::io::Error| Failure::new(code::TOOL_INVOKE_FAILED, format!("cannot read the file: {e}"));
        let open = || std::fs::File::open(path).map_err(unreadable);
        // The digest first (the init names it), then the chunks: two reads of the file, one
        // chunk in memory at a time.
        let mut digest = md5::Md5::new();
        let mut piece = vec![0u8; api::MAX_CHUNK];
        let mut file = open()?;
        loop {
            let n = file.read(&mut piece).map_err(unreadable)?;
            if n == 0 {
                break;
            }
            digest.update(&piece[..n]);
        }
        let md5 = crate::ids::hex(&digest.finalize());
        let bot = &info.bot_id;
        let req_id = api::req_id("aibot_upload_media_init");
        let init = api::upload_init(&req_id, kind, &rec.filename, size, chunks as usize, &md5);
        let upload_id = self
            .call_ok(bot, &req_id, init)?
            .upload_id
            .ok_or_else(|| rejected(0, "no upload_id in the upload's answer"))?;
        let mut file = open()?;
        for index in 0..chunks as usize {
            let mut filled = 0;
            while filled < piece.len() {
                match file.read(&mut piece[filled..]).map_err(unreadable)? {
                    0 => break,
                    n => filled += n,
                }
            }
            let req_id = api::req_id("aibot_upload_media_chunk");
            self.call_ok(
                bot,
                &req_id,
                api::upload_chunk(&req_id, &upload_id, index, &piece[..filled]),
            )?;
        }
        let req_id = api::req_id("aibot_upload_media_finish");
        let media_id = self
            .call_ok(bot, &req_id, api::upload_finish(&req_id, &upload_id))?
            .media_id
            .ok_or_else(|| rejected(0, "no media_id in the upload's answer"))?;
        let req_id = api::req_id("aibot_send_msg");
        self.call_ok(bot, &req_id, api::send_media(&req_id, &info.chat, kind, &media_id))?;
        Ok(req_id)
    }

    /// A subscribe with `bot_id` and `secret`, answered 0.
    fn check(&self, bot_id: &str, secret: &str) -> Result<(), Failure> {
        match smol::block_on(api::subscribe(&self.settings.ws_url, bot_id, secret)) {
            Ok(ws) => {
                drop(ws);
                Ok(())
            }
            Err(api::Refusal::Refused(_, why)) => Err(Failure::new(
                code::CONNECTION_NOT_AUTHENTICATED,
                format!("{why}: check the robot's Bot ID and Secret, and that it uses the long connection"),
            )),
            Err(api::Refusal::Failed(why)) => Err(Failure::temporary(
                code::UPSTREAM_UNREACHABLE,
                format!("cannot reach WeCom's long connection: {why}"),
            )),
        }
    }

    /// The links of the robots bound now (the binding being made joins at `bindings_changed`).
    fn relink(&self) {
        let bound = self.host.channels.bound_sources().unwrap_or_default();
        self.sync_links(&CHATS.accounts::<ChatInfo>(&self.host.db, &bound));
    }

    /// One long connection for each of `robots`, and none for any other.
    fn sync_links(&self, robots: &[String]) {
        let quiet = self.settings.replace_quiet;
        self.links.sync(robots, |line| {
            link::start(&self.me, self.calls_of(line.account()), quiet, line)
        });
    }

    /// Keeps a checked binding: the secret's file and the chat's row.
    fn keep(&self, bot_id: &str, secret: &str, chat: &str) -> Result<Source, Failure> {
        self.secret_files()
            .store(bot_id, secret)
            .map_err(|e| Failure::new(code::TOOL_INVOKE_FAILED, format!("cannot store the secret: {e}")))?;
        let source = source_of(bot_id, chat);
        let known = self.info(&source).map_err(Failure::storage)?;
        let row = ChatInfo {
            bot_id: bot_id.to_string(),
            chat: chat.to_string(),
            chat_type: known.map(|k| k.chat_type).unwrap_or_default(),
        };
        CHATS
            .put(&self.host.db, source.as_str(), &row)
            .map_err(Failure::storage)?;
        Ok(source)
    }
}

const DECLARATION: Declaration = Declaration {
    name: NAME,
    label: "WeCom",
    description: "A WeCom (企业微信) intelligent robot in a group or a one-to-one chat, over the long connection.",
    flows: &[FLOW],
    tools: TOOLS,
};

const FLOW: Flow = Flow::form(
    FLOW_ID,
    "Bind a WeCom chat",
    "Bind this channel to one WeCom group or one-to-one chat of an intelligent robot; messages arrive over its long connection.",
    &[
        Field::text(
            "bot_id",
            "Bot ID",
            None,
            "The intelligent robot's Bot ID (its API settings: receive messages by long connection).",
        ),
        Field::secret("secret", "Secret", None, "The robot's Secret, shown beside its Bot ID."),
        Field::text(
            "chat_id",
            "Chat ID",
            None,
            "A group's chatid, or the user ID of a one-to-one chat: write to the robot once (in a group: @ it), then copy it from imgate's /status (unbound_recent).",
        ),
    ],
);

impl Provider for WeCom {
    fn declaration(&self) -> &'static Declaration {
        &DECLARATION
    }

    /// `wecom_bot_binding`: checks the robot's ID and secret (a subscribe answered 0).
    fn bind(&self, input: &Object) -> Result<Source, Failure> {
        let given = |k: &str| json::get_str(input, k).map(str::trim).unwrap_or_default();
        let (bot_id, secret, chat) = (given("bot_id"), given("secret"), given("chat_id"));
        let invalid = |why: &str| Err(Failure::new(code::INVALID_ARGUMENTS, why.to_string()));
        if !inbound::safe_id(bot_id, 64) {
            return invalid("bot_id must be the robot's Bot ID (letters, digits, `_`, `-`)");
        }
        if secret.is_empty() || secret.len() > 256 || !secret.bytes().all(|b| b.is_ascii_graphic()) {
            return invalid("secret must be the robot's Secret");
        }
        if !chat_ok(chat) {
            return invalid("chat_id must be a group's chatid or a user's userid (see /status unbound_recent)");
        }
        // The check is a subscribe, and WeCom keeps one connection per robot: a robot whose
        // connection is up with this secret is not asked again (that would close it).
        let proven = self.secret(bot_id).as_deref() == Some(secret) && self.calls_of(bot_id).connected_now();
        if proven {
            return self.keep(bot_id, secret, chat);
        }
        // The check takes the robot's connection over: its link stops first (it must not take
        // the takeover for another client's) and starts again, whatever the check says.
        self.links.forget(bot_id);
        let kept = self
            .check(bot_id, secret)
            .and_then(|()| self.keep(bot_id, secret, chat));
        self.relink();
        kept
    }

    fn describe(&self, source: &Source) -> Result<Description, StoreError> {
        Ok(match self.info(source)? {
            Some(info) if self.secret(&info.bot_id).is_none() => {
                DECLARATION.lost("the robot's secret is no longer available")
            }
            Some(info) => {
                let name = match info.chat_type.as_str() {
                    "group" => "WeCom group",
                    "single" => "WeCom one-to-one chat",
                    _ => "WeCom chat",
                };
                let hint = Some(inbound::redact(&info.chat));
                match self.links.refused(&info.bot_id) {
                    Some(why) => DECLARATION.unusable("error", name.into(), hint, &why),
                    None => DECLARATION.connected(name.into(), hint),
                }
            }
            None => DECLARATION.lost("the WeCom binding is gone"),
        })
    }

    /// Markdown, split at `api::MAX_CONTENT` bytes. A reply to the chat's latest message within
    /// its window goes on that message's `req_id` (the same stream ID for the same tool call,
    /// so a repeated call updates the one reply); anything else is a proactive message.
    fn send(&self, source: &Source, out: &Outbound) -> Result<String, Failure> {
        let info = self
            .info(source)
            .map_err(Failure::storage)?
            .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "the WeCom binding is gone"))?;
        let route = self.reply_route(source)?;
        let in_window = crate::ids::now_ms().saturating_sub(route.at_ms) < REPLY_WINDOW_MS;
        let mut reply_on = (out.reply_to == Some(route.msgid.as_str()) && in_window && !route.req_id.is_empty())
            .then_some(route.req_id.as_str());
        let mut last = String::new();
        let parts = match out.text.is_empty() {
            true => Vec::new(),
            false => split_text(out.text, MAX_TEXT),
        };
        for (i, part) in parts.iter().enumerate() {
            if let Some(req_id) = reply_on.take() {
                let stream = send_id(out.idempotency_key, i, 16);
                let answer = self.call(&info.bot_id, req_id, api::reply(req_id, &stream, part))?;
                match answer.errcode {
                    0 => {
                        last = req_id.to_string();
                        continue;
                    }
                    // The window closed on the way, or WeCom no longer knows the req_id: the
                    // part goes as a message.
                    api::REPLY_EXPIRED | api::REPLY_UNKNOWN => {}
                    code => return Err(rejected(code, &answer.errmsg)),
                }
            }
            let req_id = api::req_id("aibot_send_msg");
            let answer = self.call(&info.bot_id, &req_id, api::send(&req_id, &info.chat, part))?;
            if answer.errcode != 0 {
                return Err(rejected(answer.errcode, &answer.errmsg));
            }
            last = req_id;
        }
        for (rec, path) in out.files {
            last = self.send_file(&info, rec, path)?;
        }
        Ok(last)
    }

    /// One long connection per robot with a binding; secrets no binding uses are forgotten.
    fn bindings_changed(&self, bound: &[Source]) {
        let robots = CHATS.accounts::<ChatInfo>(&self.host.db, bound);
        self.sync_links(&robots);
        self.secret_files().forget_unused(&robots, "wecom: secret of robot");
        let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        calls.retain(|robot, _| robots.contains(robot));
    }

    fn metrics(&self, out: &mut String) {
        self.links.metrics(
            out,
            "imgate_wecom_connections",
            "Long connections running, one per bound robot.",
            "Long connections subscribed now.",
        );
        crate::metrics::counters(out, &[&self.unbound]);
    }

    fn stop(&self) {
        self.links.stop_all();
    }
}

/// WeCom's refusal of a reply or a send, as a tool's failure.
fn rejected(errcode: i64, errmsg: &str) -> Failure {
    Failure::new(
        code::UPSTREAM_REJECTED,
        format!("WeCom answered {errcode}: {}", crate::quiet::shown(errmsg)),
    )
}
