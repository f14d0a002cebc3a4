//! Feishu / Lark (its international edition): a self-built app's bot in a chat. Events come
//! over the long connection the app opens itself (`link`), so imgate works behind NAT with no
//! public URL; the tools answer through the Open Platform's message APIs (`api`).
//!
//! Source key: `{app_id}:{chat_id}`. A binding stores what it knows of the chat in its own
//! table (`feishu_chats`); an app secret given in the auth form is kept in
//! `state_dir/feishu/{app_id}.secret` (mode 0600), never in the database, a packet or a log
//! line. The device's default app (`[feishu] app_id` / `app_secret`) is used when the form
//! leaves them empty.
//!
//! An event is answered on the long connection only after its commit (`accept`): Feishu
//! delivers again whatever was not answered, and the outbox's message-ID dedupe makes the
//! second delivery a duplicate.

pub mod api;
pub mod event;
pub mod frame;
pub mod link;
pub mod longconn;

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use miniserde::{Deserialize, Serialize};

use self::api::{Api, ApiError, AppCreds, PLATFORM};
use super::bindings::{Rows, Through};
use super::inbound::{self, FileItem};
use super::intake::{Arrival, Committed, Fetch, Intake, Recent, WhenStale};
use super::keyfiles::KeyFiles;
use super::link::Links;
use super::{
    multipart, split_text, with_retry, Declaration, Description, Failure, Field, Flow, Host, Outbound, Provider,
    Registration, Transient,
};
use crate::config::{Config, Fields, Problems, Secret, Section, Settings};
use crate::files::FileRecord;
use crate::json::{self, obj, s, Object, Value};
use crate::metrics::Counter;
use crate::outbox::Ticket;
use crate::protocol::code;
use crate::protocol::{TOOL_FILE_SEND, TOOL_REPLY, TOOL_SEND};
use crate::quiet::Site;
use crate::source::Source;
use crate::store::StoreError;

const NAME: &str = "feishu";
/// source → `ChatInfo`.
const CHATS: Rows = Rows::new(NAME, "feishu_chats", "feishu chat");
const FLOW_ID: &str = "feishu_app_binding";
const TOOLS: &[&str] = &[TOOL_SEND, TOOL_REPLY, TOOL_FILE_SEND];
/// A text message is split at this many characters (Feishu takes request bodies up to 150 KB).
const MAX_TEXT: usize = 20_000;
/// Feishu's limit for an image upload; larger images go as files.
const MAX_IMAGE: u64 = 10 << 20;
/// A tool call retries rate limits and 5xx answers for at most this long.
const TOOL_DEADLINE: Duration = Duration::from_secs(20);
/// A message's file is fetched for at most this long before the message goes on with a note.
const FETCH_DEADLINE: Duration = Duration::from_secs(20);
/// Recently stored events remembered (`Recent`).
const RECENT: usize = 256;

pub const REGISTRATION: Registration = Registration::new(NAME, &["app_secret"], read, start);

/// `[feishu]`.
#[derive(Clone)]
pub struct FeishuSettings {
    /// `feishu` (open.feishu.cn) or `lark` (open.larksuite.com).
    pub domain: &'static str,
    pub api_base: String,
    pub app_id: Option<String>,
    pub app_secret: Option<Secret>,
}

impl Settings for FeishuSettings {
    fn summary(&self) -> String {
        let set = if self.app_secret.is_some() { "set" } else { "not set" };
        format!(
            "feishu:            domain {}, app_id {}, app_secret {set}, api_base {}\n",
            self.domain,
            self.app_id.as_deref().unwrap_or("not set"),
            self.api_base
        )
    }
}

/// An app ID, chat ID or message ID fit for a file name or a URL path (`event::safe_id`).
fn safe_id(id: &str) -> bool {
    event::safe_id(id, 128)
}

fn read(_cfg: &Config, sections: &[&Section], p: &mut Problems) -> Option<Arc<dyn Settings>> {
    let section = sections.first()?;
    let mut f = Fields::new(section, p, &["app_secret"]);
    let domain = f.choice("domain", &["feishu", "lark"]).unwrap_or("feishu");
    let default_base = match domain {
        "lark" => "https://open.larksuite.com",
        _ => "https://open.feishu.cn",
    };
    let settings = FeishuSettings {
        domain,
        api_base: f.url("api_base").unwrap_or_else(|| default_base.into()),
        app_id: f.text("app_id").filter(|a| !a.is_empty()),
        app_secret: f.secret("app_secret"),
    };
    if settings.app_id.as_deref().is_some_and(|a| !safe_id(a)) {
        f.err("[feishu] app_id: letters, digits, `_` and `-` only (it looks like cli_a1b2c3...)");
    }
    if settings.app_id.is_some() != settings.app_secret.is_some() {
        f.err("[feishu] app_id and app_secret (or app_secret_file) go together: set both or neither");
    }
    f.finish();
    Some(Arc::new(settings))
}

fn start(host: &Arc<Host>) -> Result<Option<Arc<dyn Provider>>, StoreError> {
    let Some(settings) = host.config.provider::<FeishuSettings>(NAME).cloned() else {
        return Ok(None);
    };
    CHATS.create(&host.db)?;
    Ok(Some(Arc::new_cyclic(|me| Feishu {
        me: me.clone(),
        host: host.clone(),
        api: Api::new(&settings.api_base),
        settings,
        links: Links::new("feishu: app", "long connection"),
        recent: Recent::new(RECENT),
        unbound_events: Counter::new(
            "imgate_feishu_unbound_events_total",
            "Events of chats no channel is bound to.",
        ),
        unreadable_events: Counter::new(
            "imgate_feishu_unreadable_events_total",
            "Events that could not be read.",
        ),
        unreadable_log: Site::new(),
    })))
}

/// What a binding knows about its app and chat.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct ChatInfo {
    pub app_id: String,
    pub chat_id: String,
    pub chat_name: String,
    /// `p2p` or `group`.
    pub chat_type: String,
    /// The secret is in `state_dir/feishu/{app_id}.secret` (else the configured default).
    pub own_secret: bool,
}

impl Through for ChatInfo {
    fn account(&self) -> &str {
        &self.app_id
    }
}

pub fn source_of(app_id: &str, chat_id: &str) -> Source {
    Source::new(NAME, &format!("{app_id}:{chat_id}"))
}

pub struct Feishu {
    me: Weak<Feishu>,
    host: Arc<Host>,
    settings: FeishuSettings,
    api: Api,
    links: Links,
    recent: Recent,
    unbound_events: Counter,
    unreadable_events: Counter,
    unreadable_log: Site,
}

/// A name Feishu will not dedupe against another message: at most 50 characters.
fn send_uuid(idempotency_key: &str, part: usize) -> String {
    super::send_id(idempotency_key, part, 16)
}

impl Feishu {
    fn secret_files(&self) -> KeyFiles {
        KeyFiles::new(self.host.config.server.state_dir.join("feishu"), "", ".secret")
    }

    /// The credentials that speak for `app_id`: its own secret file, else the device default.
    fn creds_of(&self, app_id: &str) -> Option<AppCreds> {
        let secret = match self.secret_files().read(app_id) {
            Some(own) => Secret::new(own),
            None if self.settings.app_id.as_deref() == Some(app_id) => self.settings.app_secret.clone()?,
            None => return None,
        };
        Some(AppCreds {
            app_id: app_id.to_string(),
            secret,
        })
    }

    fn chat_info(&self, source: &str) -> Result<Option<ChatInfo>, StoreError> {
        CHATS.get(&self.host.db, source)
    }

    /// The binding of a source and the credentials it sends with.
    fn route(&self, source: &Source) -> Result<(ChatInfo, AppCreds), Failure> {
        let info = self
            .chat_info(source.as_str())
            .map_err(Failure::storage)?
            .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "the Feishu binding is gone"))?;
        let creds = self
            .creds_of(&info.app_id)
            .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "the app secret is no longer available"))?;
        Ok((info, creds))
    }

    /// Handles events of one chat of `app_id`'s long connection, in their order, on a blocking
    /// thread: each is handed to the outbox without waiting, then every commit is awaited, so a
    /// burst in one chat shares its commits. For each event: true when it may be answered as
    /// done (stored, a duplicate, or nothing imgate stores), false to have Feishu deliver it
    /// again (the store failed or the queue is full).
    fn accept(&self, app_id: &str, reads: Vec<Result<event::Event, event::Unreadable>>) -> Vec<bool> {
        let handled: Vec<Handled> = reads.into_iter().map(|r| self.prepare(app_id, r)).collect();
        handled
            .into_iter()
            .map(|h| match h {
                Handled::Answer(done) => done,
                Handled::Commit(ticket, source, event_id, message_id) => {
                    let then = "Feishu will deliver the message again";
                    let stored = self.host.committed(ticket, &source, then) == Committed::Stored;
                    if stored {
                        self.recent.stored(event_id, message_id);
                    }
                    stored
                }
            })
            .collect()
    }

    /// One event up to its hand-over to the outbox.
    fn prepare(&self, app_id: &str, read: Result<event::Event, event::Unreadable>) -> Handled {
        let ev = match read {
            Ok(ev) => ev,
            Err(why) => {
                self.unreadable_events.add(1);
                let admitted = self.unreadable_log.admit();
                if let Some(more) = admitted {
                    log::warn!("feishu: app {app_id}: an event was dropped: {why}{more}");
                }
                return Handled::Answer(true);
            }
        };
        let Some(message) = ev.message else {
            log::debug!(
                "feishu: app {app_id}: event {} not stored (imgate stores messages only)",
                ev.event_type
            );
            return Handled::Answer(true);
        };
        let source = source_of(app_id, &message.chat_id);
        let inbound = message.inbound;
        if self.recent.seen(&ev.event_id, &inbound.message_id) {
            return Handled::Answer(true);
        }
        match self.host.channels.bound_channel(source.as_str()) {
            Ok(Some(_)) => {}
            Ok(None) => {
                self.unbound_events.add(1);
                let kind = if inbound.chat_type == "p2p" { "dm" } else { "group" };
                self.host.unbound_seen(NAME, &message.chat_id, kind);
                log::debug!("feishu: app {app_id}: a message from a chat no channel is bound to");
                return Handled::Answer(true);
            }
            Err(e) => {
                log::debug!("feishu: {source}: cannot read the binding: {e}");
                return Handled::Answer(false);
            }
        }
        let message_id = inbound.message_id.clone();
        let (of_message, of_source) = (message_id.clone(), source.clone());
        let arrival = Arrival {
            source: source.clone(),
            file: message.resource.map(|res| Fetch {
                kind: res.kind.to_string(),
                // The resource API needs the app's token; our file cache does not.
                fetch: Box::new(move || self.fetch(app_id, &of_message, &res, &of_source)),
            }),
            inbound,
            reply_ref: true,
            cursors: Vec::new(),
            when_stale: WhenStale::CountExpired,
        };
        match self.host.intake(arrival) {
            // Delivered again after a long outage: older than the TTL, never pushed.
            Intake::Stale => Handled::Answer(true),
            Intake::Submitted(ticket) => Handled::Commit(ticket, source, ev.event_id, message_id),
        }
    }

    /// A message's file, through the message-resource API, into the file cache.
    fn fetch(
        &self,
        app_id: &str,
        message_id: &str,
        res: &event::Resource,
        source: &Source,
    ) -> Result<FileItem, String> {
        if !safe_id(message_id) {
            return Err("the message ID cannot be used in a request".into());
        }
        let creds = self.creds_of(app_id).ok_or("the app secret is no longer available")?;
        let path = format!(
            "/open-apis/im/v1/messages/{message_id}/resources/{}?type={}",
            res.file_key, res.api_type
        );
        let deadline = Instant::now() + FETCH_DEADLINE;
        let files = &self.host.files;
        // Each attempt writes a new `.part` (a failed one removes its bytes as it drops).
        let (part, content_type) = with_retry("feishu: message resource", deadline, |left| {
            let mut part = files.begin(source.as_str(), "in").map_err(|e| PLATFORM.cache(e))?;
            let content_type = self.api.download(&creds, &path, &mut part, left)?;
            Ok::<_, ApiError>((part, content_type))
        })
        .map_err(|e| e.to_string())?;
        let mime = super::served_mime(content_type.as_deref(), res.mime_type);
        let (file_ref, rec) = files.commit(part, &res.filename, &mime).map_err(|e| e.to_string())?;
        Ok(FileItem::cached(file_ref, rec))
    }

    /// Sends one message (`msg_type` with its JSON `content`), as a reply when asked.
    fn post_message(
        &self,
        to: &Sending,
        msg_type: &str,
        content: &Value,
        reply_to: Option<&str>,
        uuid: String,
    ) -> Result<String, Failure> {
        let content = json::to_string(content);
        let (path, body) = match reply_to {
            Some(m) => (
                format!("/open-apis/im/v1/messages/{m}/reply"),
                obj([("msg_type", s(msg_type)), ("content", s(content)), ("uuid", s(uuid))]),
            ),
            None => (
                "/open-apis/im/v1/messages?receive_id_type=chat_id".to_string(),
                obj([
                    ("receive_id", s(&to.info.chat_id)),
                    ("msg_type", s(msg_type)),
                    ("content", s(content)),
                    ("uuid", s(uuid)),
                ]),
            ),
        };
        let sent = with_retry("feishu: send", to.deadline, |left| {
            self.api.call(to.creds, "POST", &path, Some(&body), left)
        })
        .map_err(|e| Failure::api(&e))?;
        Ok(json::as_object(&sent)
            .and_then(|o| json::get_str(o, "message_id"))
            .unwrap_or_default()
            .to_string())
    }

    /// Uploads a file for this channel (an image, else a file) and sends it.
    fn send_file(
        &self,
        to: &Sending,
        file: &(FileRecord, std::path::PathBuf),
        uuid: String,
    ) -> Result<String, Failure> {
        let (rec, path) = file;
        let bytes = std::fs::read(path)
            .map_err(|e| Failure::new(code::TOOL_INVOKE_FAILED, format!("cannot read the file: {e}")))?;
        let image = goes_as_image(rec);
        let (api_path, fields, part, key, msg_type) = if image {
            (
                "/open-apis/im/v1/images",
                vec![("image_type", "message")],
                "image",
                "image_key",
                "image",
            )
        } else {
            let file_type = file_type_of(&rec.filename);
            let fields = vec![("file_type", file_type), ("file_name", rec.filename.as_str())];
            ("/open-apis/im/v1/files", fields, "file", "file_key", "file")
        };
        let (boundary, body) = multipart(&fields, part, &rec.filename, &rec.mime_type, &bytes);
        let uploaded = with_retry("feishu: upload", to.deadline, |left| {
            self.api.upload(to.creds, api_path, &boundary, &body, left)
        })
        .map_err(|e| Failure::api(&e))?;
        let file_key = json::as_object(&uploaded)
            .and_then(|o| json::get_str(o, key))
            .filter(|k| !k.is_empty())
            .ok_or_else(|| Failure::new(code::UPSTREAM_REJECTED, format!("the upload answer has no {key}")))?
            .to_string();
        self.post_message(to, msg_type, &obj([(key, s(file_key))]), None, uuid)
    }
}

/// One event after `prepare`: its answer, or the commit to wait for first (with the source,
/// event ID and message ID it stores).
enum Handled {
    Answer(bool),
    Commit(Ticket, Source, String, String),
}

/// One tool call's sends: to which chat, as which app, until when.
struct Sending<'a> {
    info: &'a ChatInfo,
    creds: &'a AppCreds,
    deadline: Instant,
}

/// An image within Feishu's image-upload limit goes through the image API; anything else as a
/// file.
fn goes_as_image(rec: &FileRecord) -> bool {
    rec.kind == "image" && rec.byte_size <= MAX_IMAGE
}

/// The upload API's `file_type` for a file name.
fn file_type_of(filename: &str) -> &'static str {
    let ext = filename
        .rsplit_once('.')
        .map(|(_, e)| e.to_ascii_lowercase())
        .unwrap_or_default();
    match ext.as_str() {
        "opus" => "opus",
        "mp4" => "mp4",
        "pdf" => "pdf",
        "doc" | "docx" => "doc",
        "xls" | "xlsx" => "xls",
        "ppt" | "pptx" => "ppt",
        _ => "stream",
    }
}

/// What the binding checks met, as the reason the form shows.
fn chat_failure(e: &ApiError) -> Failure {
    let refused = |why: &str| Failure::new(code::CONNECTION_NOT_AUTHENTICATED, why.to_string());
    match e.code.as_str() {
        "232011" | "230002" => refused("the app's bot is not in this chat: add the bot to the chat, then bind again"),
        "232006" | "232001" => refused("Feishu does not know this chat ID (it looks like oc_...)"),
        "232025" | "230006" => refused("the app has no bot: enable the bot ability in the developer console and publish the app"),
        "232034" => refused("the app is not installed or not enabled in this tenant"),
        "99991672" | "99991679" => Failure::new(
            code::CONNECTION_NOT_AUTHENTICATED,
            format!("the app lacks a permission scope the chat check needs ({}): add im:chat:readonly and im:message, then publish", e.message),
        ),
        _ => Failure::api(e),
    }
}

/// One provider, shown by the name of the domain it is configured for.
const FEISHU: Declaration = Declaration {
    name: NAME,
    label: "Feishu",
    description: "A Feishu / Lark self-built app's bot in a private chat or a group.",
    flows: &[FLOW],
    tools: TOOLS,
};
const LARK: Declaration = Declaration {
    label: "Lark",
    ..FEISHU
};

const FLOW: Flow = Flow::form(
    FLOW_ID,
    "Bind a Feishu / Lark chat",
    "Bind this channel to one chat of a self-built app's bot; events arrive over the app's long connection.",
    &[
        Field::text(
            "app_id",
            "App ID",
            None,
            "The App ID of a self-built app with the bot ability (Credentials & Basic Info).",
        )
        .or_device("Leave empty to use the device's app, or enter another self-built app's App ID."),
        Field::secret(
            "app_secret",
            "App Secret",
            None,
            "The app's App Secret (needed with another app's App ID).",
        )
        .or_device("The app's App Secret (needed with another app's App ID)."),
        Field::text(
            "chat_id",
            "Chat ID",
            None,
            "Add the bot to the chat, then enter the chat's ID (oc_...).",
        ),
    ],
);

impl Provider for Feishu {
    fn declaration(&self) -> &'static Declaration {
        match self.settings.domain {
            "lark" => &LARK,
            _ => &FEISHU,
        }
    }

    /// `feishu_app_binding`: checks the credentials (a fresh token), that the app may open a
    /// long connection (the endpoint request), and the chat (the bot must be in it).
    fn bind(&self, input: &Object) -> Result<Source, Failure> {
        let given = |k: &str| json::get_str(input, k).map(str::trim).filter(|v| !v.is_empty());
        let default_id = self.settings.app_id.as_deref();
        let app_id = given("app_id").or(default_id).ok_or_else(|| {
            Failure::new(
                code::INVALID_ARGUMENTS,
                "an App ID is required (none is configured on the device)",
            )
        })?;
        if !safe_id(app_id) {
            return Err(Failure::new(
                code::INVALID_ARGUMENTS,
                "the App ID has characters an App ID never has",
            ));
        }
        let own = given("app_secret");
        let secret = match (own, self.settings.app_secret.as_ref()) {
            (Some(secret), _) => secret.to_string(),
            (None, Some(default)) if Some(app_id) == default_id => default.expose().to_string(),
            _ => {
                return Err(Failure::new(
                    code::INVALID_ARGUMENTS,
                    "an App Secret is required for an app that is not the device's",
                ))
            }
        };
        let chat_id = given("chat_id").unwrap_or_default();
        if !safe_id(chat_id) {
            return Err(Failure::new(
                code::INVALID_ARGUMENTS,
                "chat_id must be a chat ID like oc_...",
            ));
        }
        let creds = AppCreds {
            app_id: app_id.to_string(),
            secret: Secret::new(secret.clone()),
        };
        // A cached token would pass the check whatever the secret given now.
        self.api.forget_token(app_id);
        self.api.token(&creds, TOOL_DEADLINE).map_err(|e| match e.temporary() {
            true => Failure::temporary(code::UPSTREAM_UNREACHABLE, format!("cannot check the app: {e}")),
            false => Failure::new(
                code::CONNECTION_NOT_AUTHENTICATED,
                format!("Feishu rejected the App ID or App Secret ({})", e.message),
            ),
        })?;
        let endpoint = self
            .api
            .endpoint(&creds, longconn::ENDPOINT_PATH, TOOL_DEADLINE)
            .map_err(|e| Failure::temporary(code::UPSTREAM_UNREACHABLE, format!("cannot check the long connection: {e}")))
            .and_then(|body| {
                longconn::read_endpoint(&body, longconn::ClientConfig::default()).map_err(|e| match e {
                    longconn::EndpointError::Refused { code: c, msg } => Failure::new(
                        code::CONNECTION_NOT_AUTHENTICATED,
                        format!("Feishu refused the app a long connection (code {c}: {msg}): in the developer console, choose to receive events through the long connection and subscribe to im.message.receive_v1"),
                    ),
                    longconn::EndpointError::Retry(why) => Failure::temporary(
                        code::UPSTREAM_UNREACHABLE,
                        format!("cannot check the long connection: {why}"),
                    ),
                })
            });
        endpoint?;
        let chat = self
            .api
            .call(
                &creds,
                "GET",
                &format!("/open-apis/im/v1/chats/{chat_id}"),
                None,
                TOOL_DEADLINE,
            )
            .map_err(|e| chat_failure(&e))?;
        let chat = json::as_object(&chat).cloned().unwrap_or_default();
        let name = json::get_str(&chat, "name").filter(|n| !n.is_empty());
        let p2p = json::get_str(&chat, "chat_mode") == Some("p2p");
        // A secret from the form is kept, unless it is the device's own app and secret again.
        let device_app = Some(app_id) == default_id && self.settings.app_secret.as_ref().map(|d| d.expose()) == own;
        let own_secret = own.is_some() && !device_app;
        if own_secret {
            self.secret_files()
                .store(app_id, &secret)
                .map_err(|e| Failure::new(code::TOOL_INVOKE_FAILED, format!("cannot store the app secret: {e}")))?;
        }
        let info = ChatInfo {
            app_id: app_id.to_string(),
            chat_id: chat_id.to_string(),
            chat_name: name.map_or_else(|| inbound::redact(chat_id), |n| n.chars().take(128).collect()),
            chat_type: if p2p { "p2p" } else { "group" }.into(),
            own_secret,
        };
        let source = source_of(app_id, chat_id);
        CHATS
            .put(&self.host.db, source.as_str(), &info)
            .map_err(Failure::storage)?;
        Ok(source)
    }

    fn device_account(&self) -> bool {
        self.settings.app_id.is_some()
    }

    fn describe(&self, source: &Source) -> Result<Description, StoreError> {
        let info = self.chat_info(source.as_str())?;
        Ok(match info.filter(|i| self.creds_of(&i.app_id).is_some()) {
            Some(info) => {
                let hint = Some(inbound::redact(&info.chat_id));
                self.declaration().connected(info.chat_name.clone(), hint)
            }
            None => self.declaration().lost("the app secret is no longer available"),
        })
    }

    /// Text (split at 20,000 characters, the first part replying when asked), then each file
    /// as an image or a file message.
    fn send(&self, source: &Source, out: &Outbound) -> Result<String, Failure> {
        let (info, creds) = self.route(source)?;
        let reply_to = match out.reply_to {
            Some(m) if !safe_id(m) => {
                return Err(Failure::new(
                    code::REPLY_REF_INVALID,
                    "the message to answer has an unusable ID",
                ))
            }
            other => other,
        };
        let to = Sending {
            info: &info,
            creds: &creds,
            deadline: Instant::now() + TOOL_DEADLINE,
        };
        let mut last = String::new();
        let mut part = 0;
        if !out.text.is_empty() {
            for (i, chunk) in split_text(out.text, MAX_TEXT).into_iter().enumerate() {
                let content = obj([("text", s(chunk))]);
                let reply = if i == 0 { reply_to } else { None };
                last = self.post_message(&to, "text", &content, reply, send_uuid(out.idempotency_key, part))?;
                part += 1;
            }
        }
        for file in out.files {
            last = self.send_file(&to, file, send_uuid(out.idempotency_key, part))?;
            part += 1;
        }
        Ok(last)
    }

    /// One long connection per app with a binding; secrets no binding uses are forgotten.
    fn bindings_changed(&self, bound: &[Source]) {
        let chats = CHATS.of_bound::<ChatInfo>(&self.host.db, bound);
        let apps = CHATS.accounts::<ChatInfo>(&self.host.db, bound);
        // A refusal is only logged: the binding checked the same credentials.
        self.links.sync(&apps, |line| link::start(&self.me, line));
        let own: Vec<String> = chats
            .iter()
            .filter(|(_, c)| c.own_secret)
            .map(|(_, c)| c.app_id.clone())
            .collect();
        self.secret_files().forget_unused(&own, "feishu: secret of app");
    }

    fn metrics(&self, out: &mut String) {
        self.links.metrics(
            out,
            "imgate_feishu_connections",
            "Long connections running, one per bound app.",
            "Long connections open now.",
        );
        crate::metrics::counters(out, &[&self.unbound_events, &self.unreadable_events]);
    }

    fn stop(&self) {
        self.links.stop_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_over_ten_mib_and_other_files_go_through_the_file_api() {
        let rec = |kind: &str, byte_size: u64| FileRecord {
            source: "feishu:a:b".into(),
            kind: kind.into(),
            filename: "x".into(),
            mime_type: "image/png".into(),
            byte_size,
            expires_at: 0,
            direction: "out".into(),
            shared: None,
        };
        assert!(goes_as_image(&rec("image", MAX_IMAGE)));
        assert!(!goes_as_image(&rec("image", MAX_IMAGE + 1)));
        assert!(!goes_as_image(&rec("file", 10)));
        assert_eq!(file_type_of("Report.PDF"), "pdf");
        assert_eq!(file_type_of("notes.docx"), "doc");
        assert_eq!(file_type_of("archive.tar.gz"), "stream");
    }
}
