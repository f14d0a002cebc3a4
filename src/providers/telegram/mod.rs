//! The Telegram provider: bot binding, long-poll inbound, send and reply tools.
//!
//! Source key: `telegram:{bot_id}:{chat_id}`. A binding stores display names in `TG_CHATS`;
//! a bot token given in the auth form is kept in `state_dir/telegram/bot{id}.token` (mode 0600),
//! never in the database, a packet or a log line. The default bot of `[telegram] bot_token` is
//! used when the form leaves the token empty.

pub mod api;
pub mod poll;

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use miniserde::{Deserialize, Serialize};
use redb::{ReadableDatabase, TableDefinition};

use self::api::{Api, ApiError};
use super::inbound::{self, Inbound};
use super::Failure;
use crate::app::App;
use crate::json::{self, obj, s, Object, Value};
use crate::outbox::StoredMessage;
use crate::protocol::code;
use crate::protocol::descriptor::{Target, ToolState};
use crate::protocol::{TOOL_FILE_SEND, TOOL_REPLY, TOOL_SEND};

const SOURCE_PREFIX: &str = "telegram:";
/// source → `ChatInfo` JSON.
pub(crate) const TG_CHATS: TableDefinition<&str, &str> = TableDefinition::new("telegram_chats");
/// Telegram's limit for one message's text.
const MAX_TEXT: usize = 4096;
/// A tool call retries 429 and 5xx answers for at most this long, and no single call outlives it.
const TOOL_DEADLINE: Duration = Duration::from_secs(20);

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

pub fn source_of(bot_id: u64, chat_id: i64) -> String {
    format!("{SOURCE_PREFIX}{bot_id}:{chat_id}")
}

pub fn is_source(source: &str) -> bool {
    source.starts_with(SOURCE_PREFIX)
}

pub fn api(app: &App) -> Option<Api> {
    app.config.telegram.as_ref().map(|t| Api::new(&t.api_base))
}

fn token_path(app: &App, bot_id: u64) -> PathBuf {
    app.config
        .server
        .state_dir
        .join("telegram")
        .join(format!("bot{bot_id}.token"))
}

/// The token that speaks for a binding.
pub fn token_for(app: &App, info: &ChatInfo) -> Option<String> {
    if info.own_token {
        std::fs::read_to_string(token_path(app, info.bot_id))
            .ok()
            .map(|t| t.trim().to_string())
    } else {
        app.config
            .telegram
            .as_ref()?
            .bot_token
            .as_ref()
            .map(|t| t.expose().to_string())
    }
}

pub fn chat_info(app: &App, source: &str) -> Option<ChatInfo> {
    let db = app.store.db.get().ok()?;
    let txn = db.begin_read().ok()?;
    let t = txn.open_table(TG_CHATS).ok()?;
    let v = t.get(source).ok()??;
    miniserde::json::from_str(v.value()).ok()
}

fn save_chat_info(app: &App, source: &str, info: &ChatInfo) -> Result<(), Failure> {
    let write = || -> crate::store::Result<()> {
        let db = app.store.db.get()?;
        let txn = db.begin_write()?;
        txn.open_table(TG_CHATS)?
            .insert(source, miniserde::json::to_string(info).as_str())?;
        txn.commit()?;
        Ok(())
    };
    write().map_err(|e| Failure::new(code::TOOL_INVOKE_FAILED, format!("cannot store the binding: {e}")))
}

/// Every binding whose source is still bound to a channel, with its source key.
pub fn bound_chats(app: &App) -> Vec<(String, ChatInfo)> {
    let Ok(channels) = app.store.channels() else {
        return vec![];
    };
    channels
        .into_iter()
        .filter_map(|(_, rec)| rec.source)
        .filter(|s| is_source(s))
        .filter_map(|s| chat_info(app, &s).map(|i| (s, i)))
        .collect()
}

fn redact_id(id: i64) -> String {
    inbound::redact(&id.to_string())
}

/// `telegram_bot_binding`: checks the token (`getMe`) and the chat (`getChat`).
pub fn check_binding(app: &App, input: &Object) -> Result<String, Failure> {
    let Some(api) = api(app) else {
        return Err(Failure::new(
            code::INVALID_ARGUMENTS,
            "Telegram is not enabled on this device ([telegram] is missing)",
        ));
    };
    let given = json::get_str(input, "bot_token")
        .map(str::trim)
        .filter(|t| !t.is_empty());
    let default = app
        .config
        .telegram
        .as_ref()
        .and_then(|t| t.bot_token.as_ref())
        .map(|t| t.expose());
    let Some(token) = given.or(default) else {
        return Err(Failure::new(
            code::INVALID_ARGUMENTS,
            "a bot token is required (none is configured on the device)",
        ));
    };
    let chat_raw = json::get_str(input, "chat_id").map(str::trim).unwrap_or_default();
    let chat_param = match chat_raw.parse::<i64>() {
        Ok(n) => json::Value::Number(json::Number::I64(n)),
        Err(_) if chat_raw.starts_with('@') && chat_raw.len() > 1 => s(chat_raw),
        Err(_) => {
            return Err(Failure::new(
                code::INVALID_ARGUMENTS,
                "chat_id must be a number or an @channelname",
            ))
        }
    };
    let me = api.call(token, "getMe", &obj([])).map_err(|e| match e.code {
        401 | 404 => Failure::new(code::CONNECTION_NOT_AUTHENTICATED, "Telegram rejected the bot token"),
        _ => Failure::new(code::UPSTREAM_UNREACHABLE, format!("cannot check the bot token: {e}")),
    })?;
    let me = json::as_object(&me).cloned().unwrap_or_default();
    let bot_id =
        json::get_u64(&me, "id").ok_or_else(|| Failure::new(code::UPSTREAM_REJECTED, "getMe returned no bot id"))?;
    let bot_username = json::get_str(&me, "username").unwrap_or("bot").to_string();
    let chat = api.call(token, "getChat", &obj([("chat_id", chat_param)])).map_err(|e| match e.code {
        400 => Failure::new(
            code::CONNECTION_NOT_AUTHENTICATED,
            "Telegram does not know this chat for the bot: check the chat ID, add the bot to the group, or send the bot a message first",
        ),
        403 => Failure::new(code::CONNECTION_NOT_AUTHENTICATED, "the bot is not a member of this chat (blocked or removed)"),
        _ => Failure::new(code::UPSTREAM_UNREACHABLE, format!("cannot check the chat: {e}")),
    })?;
    let chat = json::as_object(&chat).cloned().unwrap_or_default();
    let chat_id =
        poll::int(&chat, "id").ok_or_else(|| Failure::new(code::UPSTREAM_REJECTED, "getChat returned no chat id"))?;
    let kind = json::get_str(&chat, "type").unwrap_or("private");
    let title = json::get_str(&chat, "title")
        .or_else(|| json::get_str(&chat, "first_name"))
        .or_else(|| json::get_str(&chat, "username"))
        .map_or_else(|| redact_id(chat_id), str::to_string);
    let own_token = given.is_some() && Some(token) != default;
    if own_token {
        store_token(app, bot_id, token)
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
    let source = source_of(bot_id, chat_id);
    save_chat_info(app, &source, &info)?;
    Ok(source)
}

fn store_token(app: &App, bot_id: u64, token: &str) -> std::io::Result<()> {
    let path = token_path(app, bot_id);
    std::fs::create_dir_all(path.parent().expect("a parent"))?;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(token.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(tmp, path)
}

/// After `auth.logout` or a lease expiry: forgets tokens no binding uses any more.
pub fn forget_unused_tokens(app: &App) {
    let in_use: Vec<u64> = bound_chats(app)
        .iter()
        .filter(|(_, i)| i.own_token)
        .map(|(_, i)| i.bot_id)
        .collect();
    let dir = app.config.server.state_dir.join("telegram");
    let Ok(entries) = std::fs::read_dir(&dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let id = name
            .strip_prefix("bot")
            .and_then(|n| n.strip_suffix(".token"))
            .and_then(|n| n.parse::<u64>().ok());
        if let Some(id) = id.filter(|id| !in_use.contains(id)) {
            let _ = std::fs::remove_file(e.path());
            log::info!("telegram: token of bot {id} forgotten (no binding uses it)");
        }
    }
}

/// The default bot's ID when `mode = webhook` (Telegram tokens start with the bot's ID).
pub fn webhook_bot(app: &App) -> Option<u64> {
    let t = app.config.telegram.as_ref().filter(|t| t.mode == "webhook")?;
    t.bot_token.as_ref()?.expose().split(':').next()?.parse().ok()
}

/// Webhook mode: tells Telegram where to push the default bot's updates (once at start).
pub fn register_webhook(app: &App) {
    let (Some(t), Some(base)) = (app.config.telegram.as_ref(), app.config.server.public_url.as_deref()) else {
        return;
    };
    let (Some(token), Some(secret)) = (t.bot_token.as_ref(), t.webhook_secret.as_ref()) else {
        return;
    };
    if t.mode != "webhook" {
        return;
    }
    let params = obj([
        ("url", s(format!("{base}/telegram/webhook"))),
        ("secret_token", s(secret.expose())),
        ("allowed_updates", crate::json::strs(["message"])),
    ]);
    match Api::new(&t.api_base).call(token.expose(), "setWebhook", &params) {
        Ok(_) => log::info!("telegram: webhook registered at {base}/telegram/webhook"),
        Err(e) => log::error!("telegram: setWebhook failed: {e}; updates will not arrive until it succeeds"),
    }
}

/// `POST /telegram/webhook`: one Update, answered 200 only after its commit (Telegram retries
/// anything else).
pub fn webhook_update(app: &App, secret_header: Option<&str>, body: &[u8]) -> (u16, Value) {
    let Some(t) = app.config.telegram.as_ref().filter(|t| t.mode == "webhook") else {
        return (404, obj([("error", s("not_found"))]));
    };
    let expected = t.webhook_secret.as_ref().map(|s| s.expose()).unwrap_or_default();
    if expected.is_empty() || !crate::ids::secret_eq(secret_header.unwrap_or(""), expected) {
        log::info!("telegram: webhook call with a missing or wrong secret refused");
        return (401, obj([("error", s("unauthorized"))]));
    }
    let update = std::str::from_utf8(body).ok().and_then(|b| json::parse(b).ok());
    let Some(update) = update.filter(|u| json::as_object(u).is_some()) else {
        return (400, obj([("error", s("invalid_payload"))]));
    };
    let (Some(bot_id), Some(token)) = (webhook_bot(app), t.bot_token.as_ref()) else {
        return (404, obj([("error", s("not_found"))]));
    };
    let info = ChatInfo {
        bot_id,
        bot_username: String::new(),
        chat_id: 0,
        chat_title: String::new(),
        chat_type: String::new(),
        own_token: false,
    };
    match poll::accept(app, &Api::new(&t.api_base), token.expose(), &info, &[update]) {
        None => (200, obj([("ok", json::b(true))])),
        Some(_) => (503, obj([("error", s("storage_unavailable"))])),
    }
}

/// Descriptor parts of a Telegram channel.
pub fn describe(app: &App, source: &str) -> (&'static str, Target, Vec<(&'static str, ToolState)>) {
    let tools = [TOOL_SEND, TOOL_REPLY, TOOL_FILE_SEND];
    match chat_info(app, source).filter(|i| token_for(app, i).is_some()) {
        Some(info) => (
            "connected",
            Target {
                provider: "telegram".into(),
                label: "Telegram".into(),
                display_name: format!("@{} in {}", info.bot_username, info.chat_title),
                account_hint: Some(redact_id(info.chat_id)),
            },
            tools.map(|t| (t, ToolState::available())).to_vec(),
        ),
        None => (
            "error",
            Target {
                provider: "telegram".into(),
                label: "Telegram".into(),
                display_name: "Telegram (binding lost: bind again)".into(),
                account_hint: None,
            },
            tools
                .map(|t| (t, ToolState::unavailable("the bot token is no longer available")))
                .to_vec(),
        ),
    }
}

pub fn render_push(app: &App, stored: &StoredMessage) -> Value {
    match miniserde::json::from_str::<Inbound>(&stored.payload) {
        Ok(m) => {
            let h = &stored.header;
            let base = app.config.server.public_url.as_deref().unwrap_or("");
            inbound::render(
                "telegram",
                "Telegram",
                &m,
                h.reply_ref.as_deref(),
                h.accepted_at,
                h.expires_at,
                base,
            )
        }
        Err(_) => obj([]),
    }
}

/// Splits text at Telegram's limit, preferring line breaks, never inside a character.
pub fn split_text(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    // One scan per part: the byte offset of character MAX_TEXT exists only while too long.
    while let Some((cut, _)) = rest.char_indices().nth(MAX_TEXT) {
        let at = rest[..cut].rfind('\n').filter(|&i| i > cut / 2).map_or(cut, |i| i + 1);
        out.push(rest[..at].to_string());
        rest = &rest[at..];
    }
    if !rest.is_empty() || out.is_empty() {
        out.push(rest.to_string());
    }
    out
}

/// Runs `attempt` (one Bot API call, given the time left) until it succeeds, fails for good, or
/// `deadline` passes: rate limits and server errors are retried with backoff, and no attempt may
/// outlive the deadline, so a tool answers in time even when Telegram stalls.
pub(super) fn with_retry<T>(
    method: &str,
    deadline: Instant,
    mut attempt: impl FnMut(Duration) -> Result<T, ApiError>,
) -> Result<T, ApiError> {
    let mut backoff = Duration::from_millis(500);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match attempt(left.max(Duration::from_millis(1))) {
            Err(e) if e.temporary() => {
                let wait = e.retry_after.map_or(backoff, Duration::from_secs);
                if Instant::now() + wait >= deadline {
                    return Err(e);
                }
                log::info!("telegram: {method}: {e}; retrying in {wait:?}");
                std::thread::sleep(wait);
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
            other => return other,
        }
    }
}

/// `imgate_message_send` / `imgate_message_reply` on a Telegram channel.
pub fn send(app: &App, source: &str, text: &str, reply_to: Option<&str>) -> Result<Value, Failure> {
    let (api, info, token) = route(app, source)?;
    let reply_to_id = reply_to
        .and_then(|r| r.rsplit(':').next())
        .and_then(|m| m.parse::<u64>().ok());
    let deadline = Instant::now() + TOOL_DEADLINE;
    let mut last_id = String::new();
    for (i, chunk) in split_text(text).into_iter().enumerate() {
        let reply = match reply_to_id {
            Some(m) if i == 0 => obj([
                ("message_id", json::n(m)),
                ("allow_sending_without_reply", json::b(true)),
            ]),
            _ => Value::Null,
        };
        let params = obj([
            ("chat_id", Value::Number(json::Number::I64(info.chat_id))),
            ("text", s(chunk)),
            ("reply_parameters", reply),
        ]);
        let sent = with_retry("sendMessage", deadline, |left| {
            api.call_within(&token, "sendMessage", &params, left)
        })
        .map_err(|e| failure(&e))?;
        let id = json::as_object(&sent)
            .and_then(|o| json::get_u64(o, "message_id"))
            .unwrap_or(0);
        last_id = format!("{}:{id}", info.chat_id);
    }
    Ok(obj([("status", s("sent")), ("message_id", s(last_id))]))
}

/// `imgate_file_send`: a file uploaded for this channel goes as a photo or a document.
pub fn send_file(app: &App, source: &str, file_ref: &str, caption: Option<&str>) -> Result<Value, Failure> {
    let (rec, path) = crate::files::get(app, file_ref)
        .filter(|(r, _)| r.direction == "out" && r.source == source)
        .ok_or_else(|| {
            Failure::new(
                code::FILE_REF_INVALID,
                "file_ref is unknown, expired or was uploaded for another channel",
            )
        })?;
    let (api, info, token) = route(app, source)?;
    let bytes = std::fs::read(&path)
        .map_err(|e| Failure::new(code::TOOL_INVOKE_FAILED, format!("cannot read the file: {e}")))?;
    let (method, field) = if rec.kind == "image" {
        ("sendPhoto", "photo")
    } else {
        ("sendDocument", "document")
    };
    let boundary = format!("imgate{}", crate::ids::random_hex(12));
    let mut body = Vec::with_capacity(bytes.len() + 512);
    let mut text_part = |name: &str, value: &str| {
        body.extend_from_slice(
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n").as_bytes(),
        );
    };
    text_part("chat_id", &info.chat_id.to_string());
    if let Some(c) = caption.filter(|c| !c.is_empty()) {
        text_part("caption", c);
    }
    body.extend_from_slice(
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"{field}\"; filename=\"{}\"\r\nContent-Type: {}\r\n\r\n",
            rec.filename, rec.mime_type
        )
        .as_bytes(),
    );
    body.extend_from_slice(&bytes);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    let deadline = Instant::now() + TOOL_DEADLINE;
    let sent = with_retry(method, deadline, |left| {
        api.call_multipart(&token, method, &boundary, body.clone(), left)
    })
    .map_err(|e| failure(&e))?;
    let id = json::as_object(&sent)
        .and_then(|o| json::get_u64(o, "message_id"))
        .unwrap_or(0);
    Ok(obj([
        ("status", s("sent")),
        ("message_id", s(format!("{}:{id}", info.chat_id))),
    ]))
}

fn route(app: &App, source: &str) -> Result<(Api, ChatInfo, String), Failure> {
    let api =
        api(app).ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "Telegram is not enabled on this device"))?;
    let info = chat_info(app, source)
        .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "the Telegram binding is gone"))?;
    let token = token_for(app, &info)
        .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "the bot token is no longer available"))?;
    Ok((api, info, token))
}

fn failure(e: &ApiError) -> Failure {
    if e.code == 0 {
        Failure::new(code::UPSTREAM_UNREACHABLE, e.to_string())
    } else {
        Failure::new(code::UPSTREAM_REJECTED, e.to_string())
    }
}

/// After a message was delivered: show "typing" in the chat (best effort; Telegram clears it
/// after 5 s or with the reply).
pub fn typing(app: &App, source: &str) {
    if let Ok((api, info, token)) = route(app, source) {
        let params = obj([
            ("chat_id", Value::Number(json::Number::I64(info.chat_id))),
            ("action", s("typing")),
        ]);
        if let Err(e) = api.call(&token, "sendChatAction", &params) {
            log::debug!("telegram: typing indicator failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_text_is_split_at_the_limit_without_breaking_characters() {
        let text = "é".repeat(5000);
        let parts = split_text(&text);
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].chars().count(), 4096);
        assert_eq!(parts.concat(), text);
        let lines = format!("{}\n{}", "a".repeat(3000), "b".repeat(3000));
        let parts = split_text(&lines);
        assert_eq!(
            parts[0],
            format!("{}\n", "a".repeat(3000)),
            "a line break is the preferred cut"
        );
        assert_eq!(split_text("hi"), ["hi"]);
    }
}
