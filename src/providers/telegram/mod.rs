//! The Telegram provider: bot binding, long-poll (or webhook) inbound, send, reply and file tools.
//!
//! Source key: `{bot_id}:{chat_id}`. A binding stores display names in its own table
//! (`telegram_chats`); a bot token given in the auth form is kept in
//! `state_dir/telegram/bot{id}.token` (mode 0600), never in the database, a packet or a log
//! line. The default bot of `[telegram] bot_token` is used when the form leaves the token empty.

pub mod api;
pub mod event;
pub mod link;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use miniserde::{Deserialize, Serialize};

use self::api::{Api, ApiError};
use super::bindings::Rows;
use super::keyfiles::KeyFiles;
use super::link::Links;
use super::{inbound, multipart, with_retry};
use super::{
    Activity, Declaration, Delta, Description, Failure, Field, Flow, Host, HttpAnswer, HttpRequest, Outbound, Provider,
    Registration, Reply, Route,
};
use crate::config::{Config, Fields, Problems, Secret, Section, Settings};
use crate::json::{self, b, obj, s, Object, Value};
use crate::metrics::Counter;
use crate::protocol::code;
use crate::protocol::{TOOL_FILE_SEND, TOOL_REPLY, TOOL_SEND};
use crate::source::Source;
use crate::store::{self, StoreError};

const NAME: &str = "telegram";
/// source → `ChatInfo`.
const CHATS: Rows = Rows::new(NAME, "telegram_chats", "telegram chat");
const FLOW_ID: &str = "telegram_bot_binding";
const TOOLS: &[&str] = &[TOOL_SEND, TOOL_REPLY, TOOL_FILE_SEND];
/// Telegram's limit for one message's text.
const MAX_TEXT: usize = 4096;
/// A tool call retries 429 and 5xx answers for at most this long, and no single call outlives it.
const TOOL_DEADLINE: Duration = Duration::from_secs(20);
/// A typing indicator that Telegram does not take within this is dropped.
const TYPING_DEADLINE: Duration = Duration::from_secs(5);
/// Telegram shows "typing" for 5 s: while the agent is busy it is sent again this often...
const TYPING_EVERY: Duration = Duration::from_secs(4);
/// ...for at most this long without news (a lost `idle` must not type forever).
const TYPING_LIMIT: Duration = Duration::from_secs(60);
/// A streamed message is edited at most this often (Telegram's limits are about one edit a
/// second per chat); the final edit always goes out.
const EDIT_EVERY: Duration = Duration::from_secs(1);

pub const REGISTRATION: Registration = Registration::new(NAME, &["bot_token", "webhook_secret"], read, start);

/// `[telegram]`.
#[derive(Clone)]
pub struct TelegramSettings {
    pub bot_token: Option<Secret>,
    /// `poll` or `webhook`.
    pub mode: &'static str,
    pub webhook_secret: Option<Secret>,
    pub api_base: String,
}

impl Settings for TelegramSettings {
    fn summary(&self) -> String {
        let set = if self.bot_token.is_some() { "set" } else { "not set" };
        format!(
            "telegram:          mode {}, bot_token {set}, api_base {}\n",
            self.mode, self.api_base
        )
    }
}

fn read(cfg: &Config, sections: &[&Section], p: &mut Problems) -> Option<Arc<dyn Settings>> {
    let section = sections.first()?;
    let mut f = Fields::new(section, p, &["bot_token", "webhook_secret"]);
    let t = TelegramSettings {
        bot_token: f.secret("bot_token"),
        mode: f.choice("mode", &["poll", "webhook"]).unwrap_or("poll"),
        webhook_secret: f.secret("webhook_secret"),
        api_base: f.url("api_base").unwrap_or_else(|| "https://api.telegram.org".into()),
    };
    if t.mode == "webhook" {
        if t.webhook_secret.is_none() {
            f.err("[telegram] mode = webhook needs `webhook_secret`");
        }
        if t.bot_token.is_none() {
            f.err("[telegram] mode = webhook needs the default bot's `bot_token`");
        }
        if cfg.server.public_url.is_none() {
            f.err("[telegram] mode = webhook needs [server] public_url (Telegram must reach /telegram/webhook)");
        }
    }
    f.finish();
    Some(Arc::new(t))
}

fn start(host: &Arc<Host>) -> Result<Option<Arc<dyn Provider>>, StoreError> {
    let Some(settings) = host.config.provider::<TelegramSettings>(NAME).cloned() else {
        return Ok(None);
    };
    CHATS.create(&host.db)?;
    let tg = Arc::new_cyclic(|me| Telegram {
        me: me.clone(),
        host: host.clone(),
        api: Api::new(&settings.api_base),
        settings,
        pollers: Links::new("telegram: bot", "poller"),
        typing: Mutex::new(HashMap::new()),
        edits: Mutex::new(HashMap::new()),
        unbound_updates: Counter::new(
            "imgate_telegram_unbound_updates_total",
            "Updates of chats no channel is bound to.",
        ),
    });
    if tg.webhook_bot().is_some() {
        // setWebhook blocks on Telegram; the start does not wait for it.
        let t = tg.clone();
        let spawned = std::thread::Builder::new()
            .name("tg-setwebhook".into())
            .spawn(move || t.register_webhook());
        if let Err(e) = spawned {
            log::error!("telegram: cannot register the webhook: {e}");
        }
    }
    Ok(Some(tg))
}

/// What a binding knows about its bot and chat, for the Descriptor and for routing.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct ChatInfo {
    pub bot_id: u64,
    pub bot_username: String,
    pub chat_id: i64,
    pub chat_title: String,
    /// `p2p` or `group`.
    pub chat_type: String,
    /// The token is in `state_dir/telegram/bot{bot_id}.token` (else the configured default).
    pub own_token: bool,
}

pub fn source_of(bot_id: u64, chat_id: i64) -> Source {
    Source::new(NAME, &format!("{bot_id}:{chat_id}"))
}

pub struct Telegram {
    me: Weak<Telegram>,
    host: Arc<Host>,
    settings: TelegramSettings,
    /// One client for every Bot API call, so connections are reused.
    api: Api,
    pollers: Links,
    /// Chats showing "typing": the loop that refreshes it, at most one each.
    typing: Mutex<HashMap<i64, Arc<Typing>>>,
    /// Streamed messages (`chat:message`) and when each was last edited.
    edits: Mutex<HashMap<String, Instant>>,
    unbound_updates: Counter,
}

fn redact_id(id: i64) -> String {
    inbound::redact(&id.to_string())
}

/// "typing" kept up in one chat while the agent is busy.
struct Typing {
    until: Mutex<Instant>,
    stop: crate::providers::link::workers::Stop,
}

/// The first `MAX_TEXT` characters: what a streamed message can show.
fn shown(text: &str) -> &str {
    text.char_indices().nth(MAX_TEXT).map_or(text, |(i, _)| &text[..i])
}

/// Telegram's answer to an edit that changes nothing; not a failure.
fn unchanged(e: &ApiError) -> bool {
    e.status == 400 && e.message.contains("not modified")
}

/// Splits text at Telegram's limit.
pub fn split_text(text: &str) -> Vec<String> {
    super::split_text(text, MAX_TEXT)
}

impl Telegram {
    fn token_files(&self) -> KeyFiles {
        KeyFiles::new(self.host.config.server.state_dir.join("telegram"), "bot", ".token")
    }

    /// The token that speaks for a binding.
    fn token_for(&self, info: &ChatInfo) -> Option<String> {
        if info.own_token {
            self.token_files().read(&info.bot_id.to_string())
        } else {
            self.settings.bot_token.as_ref().map(|t| t.expose().to_string())
        }
    }

    fn chat_info(&self, source: &str) -> Result<Option<ChatInfo>, StoreError> {
        CHATS.get(&self.host.db, source)
    }

    fn save_chat_info(&self, source: &str, info: &ChatInfo) -> Result<(), Failure> {
        CHATS.put(&self.host.db, source, info).map_err(Failure::storage)
    }

    /// The update offset of a bot: every update before it is confirmed to Telegram.
    fn offset(&self, bot_id: u64) -> Result<Option<u64>, StoreError> {
        let key = link::offset_key(bot_id);
        store::parse_u64(&key, self.host.outbox.cursor(&key)?)
    }

    /// Forgets tokens no binding uses any more.
    fn forget_unused_tokens(&self, chats: &[(Source, ChatInfo)]) {
        let in_use: Vec<String> = chats
            .iter()
            .filter(|(_, i)| i.own_token)
            .map(|(_, i)| i.bot_id.to_string())
            .collect();
        self.token_files().forget_unused(&in_use, "telegram: token of bot");
    }

    /// The default bot's ID when `mode = webhook` (Telegram tokens start with the bot's ID).
    fn webhook_bot(&self) -> Option<u64> {
        if self.settings.mode != "webhook" {
            return None;
        }
        self.settings
            .bot_token
            .as_ref()?
            .expose()
            .split(':')
            .next()?
            .parse()
            .ok()
    }

    /// Webhook mode: tells Telegram where to push the default bot's updates (once at start).
    fn register_webhook(&self) {
        let base = self.host.public_base();
        let (Some(token), Some(secret)) = (&self.settings.bot_token, &self.settings.webhook_secret) else {
            return;
        };
        let params = obj([
            ("url", s(format!("{base}/telegram/webhook"))),
            ("secret_token", s(secret.expose())),
            ("allowed_updates", json::strs(["message"])),
        ]);
        match self.api.call(token.expose(), "setWebhook", &params) {
            Ok(_) => log::info!("telegram: webhook registered at {base}/telegram/webhook"),
            Err(e) => log::error!("telegram: setWebhook failed: {e}; updates will not arrive until it succeeds"),
        }
    }

    /// What the head of a webhook call alone refuses: webhook mode off (404), a missing or wrong
    /// secret token (401).
    fn webhook_refusal(&self, req: &HttpRequest) -> Option<HttpAnswer> {
        if self.webhook_bot().is_none() || self.settings.bot_token.is_none() {
            return Some(HttpAnswer::error(404, "not_found"));
        }
        let expected = self
            .settings
            .webhook_secret
            .as_ref()
            .map(|s| s.expose())
            .unwrap_or_default();
        let given = req.header("X-Telegram-Bot-Api-Secret-Token").unwrap_or("");
        if expected.is_empty() || !crate::ids::secret_eq(given, expected) {
            log::debug!("telegram: webhook call with a missing or wrong secret refused");
            return Some(HttpAnswer::error(401, "unauthorized"));
        }
        None
    }

    /// `POST /telegram/webhook`: one Update, answered 200 only after its commit (Telegram retries
    /// anything else).
    fn webhook_update(&self, req: &HttpRequest) -> Reply {
        if let Some(refused) = self.webhook_refusal(req) {
            return Reply::Now(refused);
        }
        let (Some(bot_id), Some(token)) = (self.webhook_bot(), self.settings.bot_token.clone()) else {
            return Reply::Now(HttpAnswer::error(404, "not_found"));
        };
        let update = std::str::from_utf8(req.body).ok().and_then(|b| json::parse(b).ok());
        let Some(update) = update.filter(|u| json::as_object(u).is_some()) else {
            return Reply::Now(HttpAnswer::error(400, "invalid_payload"));
        };
        let Some(tg) = self.me.upgrade() else {
            return Reply::Now(HttpAnswer::error(503, "stopping"));
        };
        // Media is fetched from Telegram before the commit: blocking work.
        Reply::Blocking(Box::new(move || {
            match link::accept(&tg, token.expose(), bot_id, &[update]) {
                link::Batch::Confirmed => HttpAnswer::new(200, obj([("ok", b(true))])),
                link::Batch::Stopped { .. } => HttpAnswer::error(503, "storage_unavailable"),
            }
        }))
    }

    /// The API, the binding and its token for a bound source.
    fn route(&self, source: &Source) -> Result<(ChatInfo, String), Failure> {
        let info = self
            .chat_info(source.as_str())
            .map_err(Failure::storage)?
            .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "the Telegram binding is gone"))?;
        let token = self
            .token_for(&info)
            .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "the bot token is no longer available"))?;
        Ok((info, token))
    }

    fn send_text(&self, info: &ChatInfo, token: &str, text: &str, reply_to: Option<&str>) -> Result<String, Failure> {
        let reply_to_id = reply_to
            .and_then(|r| r.rsplit(':').next())
            .and_then(|m| m.parse::<u64>().ok());
        let deadline = Instant::now() + TOOL_DEADLINE;
        let mut last_id = String::new();
        for (i, chunk) in split_text(text).into_iter().enumerate() {
            let reply = match reply_to_id {
                Some(m) if i == 0 => obj([("message_id", json::n(m)), ("allow_sending_without_reply", b(true))]),
                _ => Value::Null,
            };
            let params = obj([
                ("chat_id", Value::Number(json::Number::I64(info.chat_id))),
                ("text", s(chunk)),
                ("reply_parameters", reply),
            ]);
            let sent = with_retry("sendMessage", deadline, |left| {
                self.api.call_within(token, "sendMessage", &params, left)
            })
            .map_err(|e| Failure::api(&e))?;
            let id = json::as_object(&sent)
                .and_then(|o| json::get_u64(o, "message_id"))
                .unwrap_or(0);
            last_id = format!("{}:{id}", info.chat_id);
        }
        Ok(last_id)
    }

    /// A file uploaded for this channel goes as a photo or a document.
    fn send_file(
        &self,
        info: &ChatInfo,
        token: &str,
        file: &(crate::files::FileRecord, PathBuf),
        caption: &str,
    ) -> Result<String, Failure> {
        let (rec, path) = file;
        let bytes = std::fs::read(path)
            .map_err(|e| Failure::new(code::TOOL_INVOKE_FAILED, format!("cannot read the file: {e}")))?;
        let (method, field) = if rec.kind == "image" {
            ("sendPhoto", "photo")
        } else {
            ("sendDocument", "document")
        };
        let chat_id = info.chat_id.to_string();
        let mut fields = vec![("chat_id", chat_id.as_str())];
        if !caption.is_empty() {
            fields.push(("caption", caption));
        }
        let (boundary, body) = multipart(&fields, field, &rec.filename, &rec.mime_type, &bytes);
        let deadline = Instant::now() + TOOL_DEADLINE;
        let sent = with_retry(method, deadline, |left| {
            self.api.call_multipart(token, method, &boundary, body.clone(), left)
        })
        .map_err(|e| Failure::api(&e))?;
        let id = json::as_object(&sent)
            .and_then(|o| json::get_u64(o, "message_id"))
            .unwrap_or(0);
        Ok(format!("{}:{id}", info.chat_id))
    }
}

impl Telegram {
    fn edited(&self, handle: &str) {
        let mut edits = self.edits.lock().unwrap_or_else(|e| e.into_inner());
        // Streams that ended long ago need no throttle any more.
        edits.retain(|_, t| t.elapsed() < TYPING_LIMIT);
        edits.insert(handle.to_string(), Instant::now());
    }

    /// Replaces the text of a message the bot sent (`chat:message` handle).
    fn edit(&self, info: &ChatInfo, token: &str, handle: &str, text: &str) -> Result<(), Failure> {
        let id = handle
            .rsplit(':')
            .next()
            .and_then(|m| m.parse::<u64>().ok())
            .unwrap_or(0);
        let params = obj([
            ("chat_id", Value::Number(json::Number::I64(info.chat_id))),
            ("message_id", json::n(id)),
            ("text", s(text)),
        ]);
        let deadline = Instant::now() + TOOL_DEADLINE;
        match with_retry("editMessageText", deadline, |left| {
            self.api.call_within(token, "editMessageText", &params, left)
        }) {
            Ok(_) => {}
            Err(e) if unchanged(&e) => {}
            Err(e) => return Err(Failure::api(&e)),
        }
        self.edited(handle);
        Ok(())
    }

    /// The final text of a streamed message: its first part replaces what the stream showed,
    /// any further parts follow as messages of their own.
    fn finish_stream(&self, info: &ChatInfo, token: &str, handle: &str, text: &str) -> Result<String, Failure> {
        let mut parts = split_text(text).into_iter();
        let first = parts.next().unwrap_or_default();
        if !first.is_empty() {
            self.edit(info, token, handle, &first)?;
        }
        self.edits.lock().unwrap_or_else(|e| e.into_inner()).remove(handle);
        let mut last = handle.to_string();
        for part in parts {
            last = self.send_text(info, token, &part, None)?;
        }
        Ok(last)
    }

    /// Sends "typing" now and, while `t.until` lies ahead and nobody stopped it, every 4 s.
    fn keep_typing(&self, info: &ChatInfo, token: &str, t: &Typing) {
        let params = obj([
            ("chat_id", Value::Number(json::Number::I64(info.chat_id))),
            ("action", s("typing")),
        ]);
        loop {
            if let Err(e) = self.api.call_within(token, "sendChatAction", &params, TYPING_DEADLINE) {
                log::debug!("telegram: typing indicator failed: {e}");
            }
            let until = *t.until.lock().unwrap_or_else(|e| e.into_inner());
            if Instant::now() + TYPING_EVERY > until || t.stop.pause(TYPING_EVERY) {
                break;
            }
        }
        let mut typing = self.typing.lock().unwrap_or_else(|e| e.into_inner());
        if typing.get(&info.chat_id).is_some_and(|cur| std::ptr::eq(&**cur, t)) {
            typing.remove(&info.chat_id);
        }
    }
}

const DECLARATION: Declaration = Declaration {
    name: NAME,
    label: "Telegram",
    description: "A Telegram bot in a private chat or a group.",
    flows: &[FLOW],
    tools: TOOLS,
};

const FLOW: Flow = Flow::form(
    FLOW_ID,
    "Bind a Telegram Bot",
    "Bind this channel to one Telegram chat of a bot.",
    &[
        Field::secret(
            "bot_token",
            "Bot Token",
            Some("123456:ABC-DEF..."),
            "Create a bot with BotFather and enter its token.",
        )
        .or_device("Leave empty to use the device's bot, or enter another bot's token from BotFather."),
        Field::text(
            "chat_id",
            "Chat ID",
            Some("For example, 123456789"),
            "Start a conversation with the bot (or add it to the group), then enter the chat ID.",
        ),
    ],
);

impl Provider for Telegram {
    fn declaration(&self) -> &'static Declaration {
        &DECLARATION
    }

    /// `telegram_bot_binding`: checks the token (`getMe`) and the chat (`getChat`).
    fn bind(&self, input: &Object) -> Result<Source, Failure> {
        let given = json::get_str(input, "bot_token")
            .map(str::trim)
            .filter(|t| !t.is_empty());
        let default = self.settings.bot_token.as_ref().map(|t| t.expose());
        let Some(token) = given.or(default) else {
            return Err(Failure::new(
                code::INVALID_ARGUMENTS,
                "a bot token is required (none is configured on the device)",
            ));
        };
        let chat_raw = json::get_str(input, "chat_id").map(str::trim).unwrap_or_default();
        let chat_param = match chat_raw.parse::<i64>() {
            Ok(n) => Value::Number(json::Number::I64(n)),
            Err(_) if chat_raw.starts_with('@') && chat_raw.len() > 1 => s(chat_raw),
            Err(_) => {
                return Err(Failure::new(
                    code::INVALID_ARGUMENTS,
                    "chat_id must be a number or an @channelname",
                ))
            }
        };
        let me = self.api.call(token, "getMe", &obj([])).map_err(|e| match e.status {
            401 | 404 => Failure::new(code::CONNECTION_NOT_AUTHENTICATED, "Telegram rejected the bot token"),
            _ => Failure::new(code::UPSTREAM_UNREACHABLE, format!("cannot check the bot token: {e}")),
        })?;
        let me = json::as_object(&me).cloned().unwrap_or_default();
        let bot_id = json::get_u64(&me, "id")
            .ok_or_else(|| Failure::new(code::UPSTREAM_REJECTED, "getMe returned no bot id"))?;
        let bot_username = json::get_str(&me, "username").unwrap_or("bot").to_string();
        let chat = self
            .api
            .call(token, "getChat", &obj([("chat_id", chat_param)]))
            .map_err(|e| match e.status {
                400 => Failure::new(
                    code::CONNECTION_NOT_AUTHENTICATED,
                    "Telegram does not know this chat for the bot: check the chat ID, add the bot to the group, or send the bot a message first",
                ),
                403 => Failure::new(
                    code::CONNECTION_NOT_AUTHENTICATED,
                    "the bot is not a member of this chat (blocked or removed)",
                ),
                _ => Failure::new(code::UPSTREAM_UNREACHABLE, format!("cannot check the chat: {e}")),
            })?;
        let chat = json::as_object(&chat).cloned().unwrap_or_default();
        let chat_id = json::get_i64(&chat, "id")
            .ok_or_else(|| Failure::new(code::UPSTREAM_REJECTED, "getChat returned no chat id"))?;
        let kind = json::get_str(&chat, "type").unwrap_or("private");
        let title = json::get_str(&chat, "title")
            .or_else(|| json::get_str(&chat, "first_name"))
            .or_else(|| json::get_str(&chat, "username"))
            .map_or_else(|| redact_id(chat_id), str::to_string);
        let own_token = given.is_some() && Some(token) != default;
        if own_token {
            self.token_files()
                .store(&bot_id.to_string(), token)
                .map_err(|e| Failure::new(code::TOOL_INVOKE_FAILED, format!("cannot store the bot token: {e}")))?;
        }
        let info = ChatInfo {
            bot_id,
            bot_username,
            chat_id,
            chat_title: title,
            chat_type: if kind == "private" {
                "p2p".into()
            } else {
                "group".into()
            },
            own_token,
        };
        let source = Source::new(NAME, &format!("{bot_id}:{chat_id}"));
        self.save_chat_info(source.as_str(), &info)?;
        Ok(source)
    }

    fn device_account(&self) -> bool {
        self.settings.bot_token.is_some()
    }

    fn describe(&self, source: &Source) -> Result<Description, StoreError> {
        Ok(
            match self.chat_info(source.as_str())?.filter(|i| self.token_for(i).is_some()) {
                Some(info) => {
                    let shown = format!("@{} in {}", info.bot_username, info.chat_title);
                    DECLARATION.connected(shown, Some(redact_id(info.chat_id)))
                }
                None => DECLARATION.lost("the bot token is no longer available"),
            },
        )
    }

    /// Text (split at 4,096 characters, the first part replying when asked), then each file as
    /// a photo or a document. A tool's file takes the text as its caption; a streamed assistant
    /// message has its shown text replaced by the final one (never a second message).
    fn send(&self, source: &Source, out: &Outbound) -> Result<String, Failure> {
        let (info, token) = self.route(source)?;
        let chat = &info;
        let mut last = String::new();
        let tool_file = out.message_id.is_none() && out.files.len() == 1;
        if let Some(handle) = out.streamed {
            last = self.finish_stream(chat, &token, handle, out.text)?;
        } else if !out.text.is_empty() && !tool_file {
            last = self.send_text(chat, &token, out.text, out.reply_to)?;
        }
        for file in out.files {
            let caption = if tool_file { out.text } else { "" };
            last = self.send_file(chat, &token, file, caption)?;
        }
        Ok(last)
    }

    /// The first delta sends a message, later ones edit it (at most one edit a second).
    fn stream(&self, source: &Source, delta: &Delta, handle: Option<&str>) -> Result<Option<String>, Failure> {
        let (info, token) = self.route(source)?;
        let text = shown(delta.text);
        let Some(handle) = handle else {
            let id = self.send_text(&info, &token, text, None)?;
            self.edited(&id);
            return Ok(Some(id));
        };
        let due = self
            .edits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(handle)
            .is_none_or(|t| t.elapsed() >= EDIT_EVERY);
        if due {
            self.edit(&info, &token, handle, text)?;
        }
        Ok(Some(handle.to_string()))
    }

    /// Busy: "typing", sent again every 4 s for up to a minute without news. Idle: stopped.
    fn activity(&self, source: &Source, activity: Activity) {
        let Some(me) = self.me.upgrade() else { return };
        let Ok((info, token)) = self.route(source) else { return };
        let mut typing = self.typing.lock().unwrap_or_else(|e| e.into_inner());
        match activity {
            Activity::Idle => {
                if let Some(t) = typing.remove(&info.chat_id) {
                    t.stop.stop();
                }
            }
            Activity::Busy => {
                if let Some(t) = typing.get(&info.chat_id) {
                    *t.until.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now() + TYPING_LIMIT;
                    return;
                }
                let t = Arc::new(Typing {
                    until: Mutex::new(Instant::now() + TYPING_LIMIT),
                    stop: crate::providers::link::workers::Stop::default(),
                });
                typing.insert(info.chat_id, t.clone());
                crate::runtime::spawn_blocking(move || me.keep_typing(&info, &token, &t));
            }
        }
    }

    fn routes(&self) -> &'static [Route] {
        &[Route {
            method: "POST",
            path: "/telegram/webhook",
            prefix: false,
        }]
    }

    fn screen(&self, req: &HttpRequest) -> Option<HttpAnswer> {
        self.webhook_refusal(req)
    }

    fn handle(&self, req: &HttpRequest) -> Reply {
        self.webhook_update(req)
    }

    /// Pollers follow the bindings; tokens no binding uses are forgotten.
    fn bindings_changed(&self, bound: &[Source]) {
        let chats = CHATS.of_bound::<ChatInfo>(&self.host.db, bound);
        let pushed = self.webhook_bot();
        let mut wanted: HashMap<String, ChatInfo> = HashMap::new();
        for (_, info) in &chats {
            // The default bot in webhook mode gets its updates from POST /telegram/webhook.
            if pushed == Some(info.bot_id) && !info.own_token {
                continue;
            }
            wanted.entry(info.bot_id.to_string()).or_insert_with(|| info.clone());
        }
        let bots: Vec<String> = wanted.keys().cloned().collect();
        self.pollers.sync(&bots, |line| {
            let info = wanted.get(line.account())?.clone();
            link::start(&self.me, info, line)
        });
        self.forget_unused_tokens(&chats);
    }

    /// Shows "typing" in the chat after a delivery (IM profile v1): once, on a blocking thread
    /// with its own deadline, unless it is shown already, so a stalled Bot API never holds up
    /// delivery.
    fn delivered(&self, source: &Source) {
        let Some(me) = self.me.upgrade() else { return };
        let source = source.clone();
        crate::runtime::spawn_blocking(move || {
            let Ok((info, token)) = me.route(&source) else { return };
            let t = Arc::new(Typing {
                until: Mutex::new(Instant::now()),
                stop: crate::providers::link::workers::Stop::default(),
            });
            {
                let mut typing = me.typing.lock().unwrap_or_else(|e| e.into_inner());
                if typing.contains_key(&info.chat_id) {
                    return;
                }
                typing.insert(info.chat_id, t.clone());
            }
            me.keep_typing(&info, &token, &t);
        });
    }

    fn metrics(&self, out: &mut String) {
        crate::metrics::singles(
            out,
            &[(
                "imgate_telegram_pollers",
                "gauge",
                "Bots polled, one per bound bot.",
                self.pollers.count() as u64,
            )],
        );
        crate::metrics::counters(out, &[&self.unbound_updates]);
    }

    fn stop(&self) {
        self.pollers.stop_all();
    }
}
