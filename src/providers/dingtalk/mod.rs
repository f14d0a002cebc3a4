//! DingTalk: an enterprise app's robot in a group or a one-to-one chat. Messages come over
//! Stream mode, a WebSocket the app opens itself (`link`), so imgate works behind NAT with no
//! public URL; the tools answer through the conversation's session webhook while it is valid,
//! else through the robot OpenAPI (`api`).
//!
//! Source key: `{client_id}:{conversation}` (the conversation ID with `+/=` as `-_.`: one
//! Stream connection per app, shared by its conversations). A binding stores what it knows of
//! the conversation in its own table (`dingtalk_conversations`); the app's secret is kept in
//! `state_dir/dingtalk/{client_id}.secret` (mode 0600), never in the database, a packet or a
//! log line, and forgotten with the app's last binding.
//!
//! A robot message is answered `200` only after it is committed (or found a duplicate, or is
//! one imgate does not store). DingTalk sends robot messages once ("fire-and-forget"): what it
//! sent while imgate was down is not sent again and cannot be read back; what imgate received
//! is never lost. Each stored message also keeps, in the same outbox transaction (a
//! `Cursor::Set`), the conversation's latest session webhook with its expiry and the sender's
//! user ID, so replies work after a restart and one-to-one sends after the webhook expired.

pub mod api;
pub mod event;
pub mod link;

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use miniserde::{Deserialize, Serialize};

use self::api::{Api, ApiError, AppCreds, PLATFORM};
use self::event::{DingFile, RobotMessage};
use super::bindings::{Rows, Through};
use super::inbound::{self, FileItem, Inbound};
use super::intake::{Arrival, Committed, Fetch, Intake, Recent, WhenStale};
use super::keyfiles::KeyFiles;
use super::link::{followers, Links};
use super::{
    split_text, with_retry, Declaration, Description, Failure, Field, Flow, Host, Outbound, Provider, Registration,
    Transient, Upload,
};
use crate::config::{Config, Fields, Problems, Secret, Section, Settings};
use crate::json::{self, obj, s, Object, Value};
use crate::metrics::Counter;
use crate::outbox::{Cursor, Ticket};
use crate::protocol::code;
use crate::protocol::{TOOL_FILE_SEND, TOOL_REPLY, TOOL_SEND};
use crate::source::Source;
use crate::store::StoreError;
use crate::upstream::Kind;

const NAME: &str = "dingtalk";
/// source → `ConversationInfo`.
const CONVERSATIONS: Rows = Rows::new(NAME, "dingtalk_conversations", "dingtalk conversation");
const FLOW_ID: &str = "dingtalk_robot_binding";
const TOOLS: &[&str] = &[TOOL_SEND, TOOL_REPLY, TOOL_FILE_SEND];
/// A text is split at this many characters: a robot message's `msgParam` takes at most
/// 15,000 bytes, which 2,000 characters stay below even with every one escaped as `\uXXXX`.
const MAX_TEXT: usize = 2_000;
/// A tool call retries throttled calls for at most this long.
const TOOL_DEADLINE: Duration = Duration::from_secs(20);
/// A message's file is fetched for at most this long before the message goes on with a note.
const FETCH_DEADLINE: Duration = Duration::from_secs(30);
/// A session webhook is used until this long before DingTalk says it expires.
const HOOK_MARGIN_MS: u64 = 60_000;
/// Recently stored messages remembered (`Recent`).
const RECENT: usize = 256;
/// Conversations without a binding remembered with their kind and title (for the binding).
const SEEN: usize = 64;

pub const REGISTRATION: Registration = Registration::new(NAME, &[], read, start);

/// `[dingtalk]`.
#[derive(Clone)]
pub struct DingTalkSettings {
    pub api_base: String,
    pub oapi_base: String,
}

impl Settings for DingTalkSettings {
    fn summary(&self) -> String {
        format!(
            "dingtalk:          api_base {}, oapi_base {}\n",
            self.api_base, self.oapi_base
        )
    }
}

fn read(_cfg: &Config, sections: &[&Section], p: &mut Problems) -> Option<Arc<dyn Settings>> {
    let section = sections.first()?;
    let mut f = Fields::new(section, p, &[]);
    let settings = DingTalkSettings {
        api_base: f.url("api_base").unwrap_or_else(|| "https://api.dingtalk.com".into()),
        oapi_base: f.url("oapi_base").unwrap_or_else(|| "https://oapi.dingtalk.com".into()),
    };
    f.finish();
    Some(Arc::new(settings))
}

fn start(host: &Arc<Host>) -> Result<Option<Arc<dyn Provider>>, StoreError> {
    let Some(settings) = host.config.provider::<DingTalkSettings>(NAME).cloned() else {
        return Ok(None);
    };
    CONVERSATIONS.create(&host.db)?;
    Ok(Some(Arc::new_cyclic(|me| DingTalk {
        me: me.clone(),
        host: host.clone(),
        api: Api::new(&settings.api_base, &settings.oapi_base),
        links: Links::new("dingtalk: app", "Stream connection")
            .followed_by(followers::<ConversationInfo>(host, &CONVERSATIONS)),
        recent: Recent::new(RECENT),
        seen: Mutex::default(),
        dead_hooks: Mutex::default(),
        counts: Counts::default(),
    })))
}

/// What a binding knows about its app and conversation.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct ConversationInfo {
    pub client_id: String,
    /// The conversation ID as DingTalk gives it (`cid…`): a group send's `openConversationId`.
    pub conversation: String,
    /// The group's title, or empty.
    pub title: String,
    /// `p2p`, `group`, or empty until the conversation's first message says which.
    pub chat_type: String,
}

/// Where a conversation's replies go: its latest session webhook and the user a one-to-one
/// send names, kept with every stored message (the outbox cursor `dingtalk_reply:{source}`).
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
struct ReplyRoute {
    /// The session webhook: a credential (never logged or shown).
    hook: String,
    /// When it expires (Unix ms).
    hook_expires: u64,
    /// The last sender's user ID (`senderStaffId`).
    staff: String,
}

impl Through for ConversationInfo {
    fn account(&self) -> &str {
        &self.client_id
    }
}

pub fn source_of(client_id: &str, conversation: &str) -> Source {
    Source::new(NAME, &format!("{client_id}:{}", event::conversation_key(conversation)))
}

fn reply_key(source: &Source) -> String {
    format!("dingtalk_reply:{}", source.key())
}

/// Counters for `/metrics`.
struct Counts {
    unbound: Counter,
    skipped: Counter,
    openapi_sends: Counter,
}

impl Default for Counts {
    fn default() -> Counts {
        Counts {
            unbound: Counter::new(
                "imgate_dingtalk_unbound_messages_total",
                "Robot messages of conversations no channel is bound to.",
            ),
            skipped: Counter::new(
                "imgate_dingtalk_skipped_messages_total",
                "The robot's own messages, not stored.",
            ),
            openapi_sends: Counter::new(
                "imgate_dingtalk_openapi_sends_total",
                "Messages sent through the OpenAPI (files, and texts once the session webhook expired).",
            ),
        }
    }
}

pub struct DingTalk {
    me: Weak<DingTalk>,
    host: Arc<Host>,
    api: Api,
    links: Links,
    recent: Recent,
    /// `{client_id}:{conversation}` → (group, title) of conversations seen without a binding.
    seen: Mutex<VecDeque<(String, bool, String)>>,
    /// Sources whose kept session webhook DingTalk called expired before its time.
    dead_hooks: Mutex<HashSet<String>>,
    counts: Counts,
}

impl DingTalk {
    fn secret_files(&self) -> KeyFiles {
        KeyFiles::new(self.host.config.server.state_dir.join("dingtalk"), "", ".secret")
    }

    /// The credentials of app `client_id`, while a binding keeps them.
    pub fn creds(&self, client_id: &str) -> Option<AppCreds> {
        Some(AppCreds {
            client_id: client_id.to_string(),
            secret: Secret::new(self.secret_files().read(client_id)?),
        })
    }

    fn info(&self, source: &Source) -> Result<Option<ConversationInfo>, StoreError> {
        CONVERSATIONS.get(&self.host.db, source.as_str())
    }

    /// The binding of a source and its app's credentials.
    fn route(&self, source: &Source) -> Result<(ConversationInfo, AppCreds), Failure> {
        let info = self
            .info(source)
            .map_err(Failure::storage)?
            .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "the DingTalk binding is gone"))?;
        let creds = self
            .creds(&info.client_id)
            .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "the app's secret is no longer available"))?;
        Ok((info, creds))
    }

    /// Handles robot messages of one conversation of app `client_id`, in their order, on a
    /// blocking thread: each handed to the outbox without waiting, then every commit awaited,
    /// so a burst shares its commits. For each: true when it may be answered `200` (stored, a
    /// duplicate, or nothing imgate stores), false when it was not stored.
    pub fn accept(&self, client_id: &str, conversation: &str, messages: Vec<RobotMessage>) -> Vec<bool> {
        let source = source_of(client_id, conversation);
        let info = match CONVERSATIONS.while_bound(&self.host.channels, &self.host.db, source.as_str()) {
            Ok(Some(info)) => info,
            Ok(None) => {
                self.counts.unbound.add(messages.len() as u64);
                if let Some(m) = messages.last() {
                    self.seen_unbound(client_id, m);
                }
                return vec![true; messages.len()];
            }
            Err(e) => {
                log::debug!("dingtalk: {source}: cannot read the binding: {e}");
                return vec![false; messages.len()];
            }
        };
        if let Some(m) = messages.last() {
            self.learn(&source, &info, m);
        }
        let creds = self.creds(client_id);
        // Each message's route builds on the last: one without a webhook or a user ID (a user
        // of another organisation) keeps what the conversation had.
        let mut route = self.reply_route(&source).unwrap_or_default();
        let handled: Vec<Handled> = messages
            .into_iter()
            .map(|m| self.prepare(&source, &info, creds.as_ref(), &mut route, m))
            .collect();
        handled.into_iter().map(|h| self.finish(&source, h)).collect()
    }

    /// A conversation without a binding wrote to a bound app: counted, listed in `/status`,
    /// its kind and title remembered for its binding.
    fn seen_unbound(&self, client_id: &str, m: &RobotMessage) {
        let kind = if m.group { "group" } else { "dm" };
        self.host.unbound_seen(NAME, &m.conversation, kind);
        log::debug!("dingtalk: app {client_id}: a message from a conversation no channel is bound to");
        let key = format!("{client_id}:{}", m.conversation);
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.retain(|(k, _, _)| *k != key);
        if seen.len() >= SEEN {
            seen.pop_front();
        }
        seen.push_back((key, m.group, m.title.clone()));
    }

    /// A bound conversation's message tells its kind and title: kept in its row when they
    /// changed (a binding made before its first message knows neither), and xAgent is told,
    /// as its Descriptor names the conversation by them.
    fn learn(&self, source: &Source, info: &ConversationInfo, m: &RobotMessage) {
        let chat_type = if m.group { "group" } else { "p2p" };
        let title = if m.group { m.title.as_str() } else { "" };
        if info.chat_type == chat_type && info.title == title {
            return;
        }
        let row = ConversationInfo {
            chat_type: chat_type.into(),
            title: title.into(),
            ..info.clone()
        };
        match CONVERSATIONS.put(&self.host.db, source.as_str(), &row) {
            Ok(()) => self.host.binding_state_changed(source),
            Err(e) => log::debug!("dingtalk: {source}: cannot keep the conversation's kind: {e}"),
        }
    }

    /// One message up to its hand-over to the outbox.
    fn prepare(
        &self,
        source: &Source,
        info: &ConversationInfo,
        creds: Option<&AppCreds>,
        route: &mut ReplyRoute,
        m: RobotMessage,
    ) -> Handled {
        if !m.robot_user.is_empty() && m.sender_id == m.robot_user {
            self.counts.skipped.add(1);
            return Handled::Answer(true);
        }
        if self.recent.seen("", &m.msg_id) {
            return Handled::Answer(true);
        }
        let sender = if m.staff_id.is_empty() {
            &m.sender_id
        } else {
            &m.staff_id
        };
        let message_type = m.file.as_ref().map_or("text", |f| crate::files::kind_of(&f.mime));
        let inbound = Inbound {
            message_id: m.msg_id.clone(),
            sender_id: sender.clone(),
            sender_name: Some(match m.nick.is_empty() {
                true => inbound::redact(sender),
                false => m.nick.clone(),
            }),
            chat_id: Some(info.conversation.clone()),
            chat_type: if m.group { "group" } else { "p2p" }.into(),
            message_type: message_type.to_string(),
            text: m.text.clone(),
            event_time: m.created_ms,
            files: None,
        };
        let new_hook = m.webhook.as_ref().is_some_and(|(_, at)| *at >= route.hook_expires);
        if let Some((url, at)) = m.webhook.clone().filter(|_| new_hook) {
            (route.hook, route.hook_expires) = (url, at);
        }
        if !m.staff_id.is_empty() {
            route.staff = m.staff_id.clone();
        }
        let arrival = Arrival {
            source: source.clone(),
            file: m.file.clone().map(|file| Fetch {
                kind: crate::files::kind_of(&file.mime).to_string(),
                fetch: Box::new(move || self.fetch(creds, &file, source)),
            }),
            inbound,
            reply_ref: true,
            cursors: vec![Cursor::Set(reply_key(source), miniserde::json::to_string(&*route))],
            when_stale: WhenStale::CountExpired,
        };
        match self.host.intake(arrival) {
            Intake::Stale => Handled::Answer(true),
            Intake::Submitted(ticket) => Handled::Commit(ticket, m.msg_id, new_hook),
        }
    }

    /// Waits for a prepared message's commit: whether it may be answered.
    fn finish(&self, source: &Source, h: Handled) -> bool {
        let (ticket, msg_id, new_hook) = match h {
            Handled::Answer(done) => return done,
            Handled::Commit(ticket, msg_id, new_hook) => (ticket, msg_id, new_hook),
        };
        let then = "a message was not stored (DingTalk does not send it again)";
        if self.host.committed(ticket, source, then) != Committed::Stored {
            return false;
        }
        self.recent.stored(String::new(), msg_id);
        if new_hook {
            let mut dead = self.dead_hooks.lock().unwrap_or_else(|e| e.into_inner());
            dead.remove(source.as_str());
        }
        true
    }

    /// A message's file, through `messageFiles/download`, into the file cache.
    fn fetch(&self, creds: Option<&AppCreds>, file: &DingFile, source: &Source) -> Result<FileItem, String> {
        let creds = creds.ok_or("the app's secret is no longer available")?;
        let files = &self.host.files;
        let deadline = Instant::now() + FETCH_DEADLINE;
        // Each attempt writes a new `.part` (a failed one removes its bytes as it drops).
        let (part, content_type) = with_retry("dingtalk: file download", deadline, |left| {
            let mut part = files.begin(source.as_str(), "in").map_err(|e| PLATFORM.cache(e))?;
            let content_type = self.api.download(creds, &file.download_code, &mut part, left)?;
            Ok::<_, ApiError>((part, content_type))
        })
        .map_err(|e| e.to_string())?;
        let mime = super::served_mime(content_type.as_deref(), &file.mime);
        let (file_ref, rec) = files.commit(part, &file.name, &mime).map_err(|e| e.to_string())?;
        Ok(FileItem::cached(file_ref, rec))
    }

    /// Where the conversation's replies go, as its last stored message left it.
    fn reply_route(&self, source: &Source) -> Result<ReplyRoute, Failure> {
        self.host.kept(&reply_key(source)).map_err(Failure::storage)
    }

    /// The session webhook while it is valid.
    fn live_hook<'a>(&self, source: &Source, route: &'a ReplyRoute) -> Option<&'a str> {
        let dead = self.dead_hooks.lock().unwrap_or_else(|e| e.into_inner());
        let valid = route.hook_expires > crate::ids::now_ms().saturating_add(HOOK_MARGIN_MS);
        (valid && !route.hook.is_empty() && !dead.contains(source.as_str())).then_some(route.hook.as_str())
    }

    /// One robot message through the OpenAPI: to the group, or to the one-to-one chat's user.
    /// Its `processQueryKey`.
    fn send_openapi(
        &self,
        info: &ConversationInfo,
        creds: &AppCreds,
        staff: &str,
        (key, param): (&str, Value),
        deadline: Instant,
    ) -> Result<String, Failure> {
        let param = json::to_string(&param);
        let one_to_one = info.chat_type == "p2p";
        let (path, body) =
            match one_to_one {
                false => (
                    "/v1.0/robot/groupMessages/send",
                    obj([
                        ("robotCode", s(&creds.client_id)),
                        ("openConversationId", s(&info.conversation)),
                        ("msgKey", s(key)),
                        ("msgParam", s(param)),
                    ]),
                ),
                true if staff.is_empty() => return Err(Failure::new(
                    code::CHANNEL_UNAVAILABLE,
                    "the robot can write to this one-to-one chat only through its session webhook, which has expired, \
                     and no stored message names the user: send again after the user writes to the robot",
                )),
                true => (
                    "/v1.0/robot/oToMessages/batchSend",
                    obj([
                        ("robotCode", s(&creds.client_id)),
                        ("userIds", json::strs([staff])),
                        ("msgKey", s(key)),
                        ("msgParam", s(param)),
                    ]),
                ),
            };
        self.counts.openapi_sends.add(1);
        let listed = |sent: &Object, k: &str| match json::get(sent, k) {
            Some(Value::Array(ids)) => ids.iter().any(|v| matches!(v, Value::String(id) if id == staff)),
            _ => false,
        };
        // A message held back from its user reached no one: sent again, as a throttled call.
        let sent = once_sent("dingtalk: send", deadline, |left| {
            let sent = self.api.call(creds, path, &body, left)?;
            match one_to_one && listed(&sent, "flowControlledStaffIdList") {
                true => Err(api::flow_controlled()),
                false => Ok(sent),
            }
        })
        .map_err(|e| match api::is_flow_controlled(&e) {
            true => Failure::temporary(
                code::BUSY,
                "DingTalk is holding messages to this user back (flow control); nothing was sent: \
                 make the same call again in a minute",
            ),
            false => refusal(&e),
        })?;
        if one_to_one && listed(&sent, "invalidStaffIdList") {
            return Err(Failure::new(
                code::UPSTREAM_REJECTED,
                "DingTalk does not know the user of this one-to-one chat (invalidStaffIdList)",
            ));
        }
        Ok(json::get_str(&sent, "processQueryKey")
            .filter(|k| k.len() <= 256)
            .unwrap_or_default()
            .to_string())
    }

    /// One file: uploaded (an image as `image`, anything else as `file`), then sent.
    fn send_file(
        &self,
        info: &ConversationInfo,
        creds: &AppCreds,
        staff: &str,
        file: &(crate::files::FileRecord, std::path::PathBuf),
        deadline: Instant,
    ) -> Result<String, Failure> {
        let (rec, path) = file;
        let image = crate::files::kind_of(&rec.mime_type) == "image";
        let upload = Upload {
            filename: &rec.filename,
            mime: &rec.mime_type,
            size: rec.byte_size,
            path,
        };
        let kind = if image { "image" } else { "file" };
        let media = with_retry("dingtalk: upload", deadline, |left| {
            self.api.upload(creds, kind, &upload, left)
        })
        .map_err(|e| refusal(&e))?;
        let message = match image {
            true => ("sampleImageMsg", obj([("photoURL", s(&media))])),
            false => {
                let ext = rec.filename.rsplit_once('.').map_or("", |(_, e)| e);
                let ext = if ext.len() <= 8 && ext.bytes().all(|b| b.is_ascii_alphanumeric()) {
                    ext
                } else {
                    ""
                };
                (
                    "sampleFile",
                    obj([
                        ("mediaId", s(&media)),
                        ("fileName", s(&rec.filename)),
                        ("fileType", s(ext.to_ascii_lowercase())),
                    ]),
                )
            }
        };
        self.send_openapi(info, creds, staff, message, deadline)
    }
}

/// A send's call: retried only when DingTalk refused it for throttling. Its robot APIs take no
/// idempotency key, so a call whose answer was lost (a timeout, a reset, a 5xx) may have sent
/// the message; it is not made again, and fails (`retryable`) for the caller to decide.
fn once_sent<T>(
    what: &str,
    deadline: Instant,
    mut attempt: impl FnMut(Duration) -> Result<T, ApiError>,
) -> Result<T, ApiError> {
    struct Throttled(ApiError);
    impl std::fmt::Display for Throttled {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            self.0.fmt(f)
        }
    }
    impl Transient for Throttled {
        fn temporary(&self) -> bool {
            self.0.retry_after().is_some()
        }
        fn retry_after(&self) -> Option<Duration> {
            self.0.retry_after()
        }
    }
    with_retry(what, deadline, |left| attempt(left).map_err(Throttled)).map_err(|e| e.0)
}

/// One message after `prepare`: its answer, or the commit to wait for first (with its msgId
/// and whether it brought a session webhook).
enum Handled {
    Answer(bool),
    Commit(Ticket, String, bool),
}

/// An API refusal as a tool's failure, with what the owner can do about it.
fn refusal(e: &ApiError) -> Failure {
    if e.kind() == Kind::Auth {
        return Failure::new(
            code::CONNECTION_NOT_AUTHENTICATED,
            format!("DingTalk refused the app ({e}): check its permissions, or bind the conversation again"),
        );
    }
    Failure::api(e)
}

/// What a binding check met, as the reason the form shows.
fn bind_failure(what: &str, e: &ApiError) -> Failure {
    if e.temporary() {
        return Failure::temporary(code::UPSTREAM_UNREACHABLE, format!("cannot check the {what}: {e}"));
    }
    if !api::credentials_refused(e) {
        return Failure::new(code::UPSTREAM_REJECTED, format!("cannot check the {what}: {e}"));
    }
    let why = match what {
        "credentials" => format!("DingTalk rejected the Client ID or Client Secret ({e})"),
        _ => format!(
            "DingTalk refused a Stream connection ({e}): turn on Stream mode for the app's robot (message receiving mode: Stream)"
        ),
    };
    Failure::new(code::CONNECTION_NOT_AUTHENTICATED, why)
}

const DECLARATION: Declaration = Declaration {
    name: NAME,
    label: "DingTalk",
    description: "An enterprise app's robot in a DingTalk group or one-to-one chat, over Stream mode.",
    flows: &[FLOW],
    tools: TOOLS,
};

const FLOW: Flow = Flow::form(
    FLOW_ID,
    "Bind a DingTalk conversation",
    "Bind this channel to one DingTalk group or one-to-one chat of an app's robot; messages arrive over Stream mode.",
    &[
        Field::text(
            "client_id",
            "Client ID (AppKey)",
            Some("dingxxxxxxxxxxxxxxxx"),
            "The app's Client ID (Credentials & Basic Info in the developer console).",
        ),
        Field::secret(
            "client_secret",
            "Client Secret (AppSecret)",
            None,
            "The app's Client Secret. Its robot must receive messages in Stream mode.",
        ),
        Field::text(
            "conversation_id",
            "Conversation ID",
            Some("cid..."),
            "Write to the robot once (in a group: @ it), then copy the conversation ID from imgate's /status (unbound_recent).",
        ),
    ],
);

impl DingTalk {
    fn display_name(info: &ConversationInfo) -> String {
        match (info.chat_type.as_str(), info.title.is_empty()) {
            ("group", false) => info.title.chars().take(80).collect(),
            ("group", true) => "DingTalk group".into(),
            ("p2p", _) => "DingTalk one-to-one chat".into(),
            _ => "DingTalk conversation".into(),
        }
    }
}

impl Provider for DingTalk {
    fn declaration(&self) -> &'static Declaration {
        &DECLARATION
    }

    /// `dingtalk_robot_binding`: checks the credentials (an access token) and Stream mode (a
    /// connection ticket).
    fn bind(&self, input: &Object) -> Result<Source, Failure> {
        let given = |k: &str| json::get_str(input, k).map(str::trim).unwrap_or_default();
        let (client_id, secret, conversation) = (given("client_id"), given("client_secret"), given("conversation_id"));
        let invalid = |why: &str| Err(Failure::new(code::INVALID_ARGUMENTS, why.to_string()));
        if !inbound::safe_id(client_id, 64) {
            return invalid("client_id must be the app's Client ID (AppKey: letters and digits)");
        }
        if secret.is_empty() || secret.len() > 256 || !secret.bytes().all(|b| b.is_ascii_graphic()) {
            return invalid("client_secret must be the app's Client Secret");
        }
        if !event::conversation_shaped(conversation) {
            return invalid("conversation_id must be a conversation ID like cidAbC123== (see /status unbound_recent)");
        }
        let creds = AppCreds {
            client_id: client_id.to_string(),
            secret: Secret::new(secret),
        };
        // A cached token proves nothing of this secret.
        self.api.forget_token(client_id);
        self.api
            .token(&creds, TOOL_DEADLINE)
            .map_err(|e| bind_failure("credentials", &e))?;
        // The ticket is valid once and is not used: the check is that DingTalk gives one.
        self.api
            .open_stream(&creds, TOOL_DEADLINE)
            .map_err(|e| bind_failure("Stream connection", &e))?;
        let source = source_of(client_id, conversation);
        let known = self.info(&source).map_err(Failure::storage)?;
        let seen = {
            let key = format!("{client_id}:{conversation}");
            let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            seen.iter().find(|(k, _, _)| *k == key).map(|(_, g, t)| (*g, t.clone()))
        };
        let (chat_type, title) = match (seen, known) {
            (Some((group, title)), _) => (if group { "group" } else { "p2p" }.to_string(), title),
            (None, Some(k)) => (k.chat_type, k.title),
            (None, None) => (String::new(), String::new()),
        };
        self.secret_files()
            .store(client_id, secret)
            .map_err(|e| Failure::new(code::TOOL_INVOKE_FAILED, format!("cannot store the secret: {e}")))?;
        let row = ConversationInfo {
            client_id: client_id.to_string(),
            conversation: conversation.to_string(),
            title,
            chat_type,
        };
        CONVERSATIONS
            .put(&self.host.db, source.as_str(), &row)
            .map_err(Failure::storage)?;
        Ok(source)
    }

    fn describe(&self, source: &Source) -> Result<Description, StoreError> {
        Ok(match self.info(source)? {
            Some(info) if self.creds(&info.client_id).is_none() => {
                DECLARATION.lost("the app's secret is no longer available")
            }
            Some(info) => {
                // A conversation ID is no secret, and it is what tells two bindings apart
                // before their first message names them.
                let (name, hint) = (Self::display_name(&info), Some(info.conversation.clone()));
                match self.links.refused(&info.client_id) {
                    Some(why) => DECLARATION.unusable("error", name, hint, &why),
                    None => DECLARATION.connected(name, hint),
                }
            }
            None => DECLARATION.lost("the DingTalk binding is gone"),
        })
    }

    /// Text (split at 2,000 characters) and files. Through the session webhook while it is
    /// valid (text only), else the OpenAPI. Robots cannot quote: a reply is a message in the
    /// same conversation; in a group its first part @s the sender of the message answered, as
    /// the SDK's `reply_text` does (through the webhook only: the OpenAPI's texts take no @).
    fn send(&self, source: &Source, out: &Outbound) -> Result<String, Failure> {
        let (info, creds) = self.route(source)?;
        let deadline = Instant::now() + TOOL_DEADLINE;
        let route = self.reply_route(source)?;
        let mut hook = self.live_hook(source, &route);
        // A user ID (`senderStaffId`) can be @-ed; an outsider's opaque `senderId` (`$:…`)
        // cannot.
        let mut at = out
            .reply_sender
            .filter(|staff| info.chat_type == "group" && out.reply_to.is_some() && !staff.starts_with('$'));
        let mut last = String::new();
        if !out.text.is_empty() {
            for part in split_text(out.text, MAX_TEXT) {
                let at = at.take();
                if let Some(url) = hook {
                    let mut body = vec![("msgtype", s("text")), ("text", obj([("content", s(&part))]))];
                    if let Some(staff) = at {
                        body.push(("at", obj([("atUserIds", json::strs([staff]))])));
                    }
                    let body = obj(body);
                    let left = deadline.saturating_duration_since(Instant::now());
                    // One attempt (no idempotency here either); throttled, the OpenAPI sends it.
                    match self.api.post_webhook(url, &body, left) {
                        Ok(()) => continue,
                        Err(e) if e.kind() == Kind::Gone => {
                            log::info!("dingtalk: {source}: the session webhook expired; sending through the OpenAPI");
                            let mut dead = self.dead_hooks.lock().unwrap_or_else(|e| e.into_inner());
                            dead.insert(source.as_str().to_string());
                            hook = None;
                        }
                        Err(e) if e.kind() == Kind::RateLimited => {
                            log::debug!("dingtalk: {source}: the session webhook is throttled; this part goes through the OpenAPI");
                        }
                        Err(e) => return Err(refusal(&e)),
                    }
                }
                let text = ("sampleText", obj([("content", s(&part))]));
                last = self.send_openapi(&info, &creds, &route.staff, text, deadline)?;
            }
        }
        for file in out.files {
            last = self.send_file(&info, &creds, &route.staff, file, deadline)?;
        }
        Ok(last)
    }

    /// One Stream connection per app with a binding; secrets no binding uses are forgotten.
    fn bindings_changed(&self, bound: &[Source]) {
        let apps = CONVERSATIONS.accounts::<ConversationInfo>(&self.host.db, bound);
        self.links.sync(&apps, |line| link::start(&self.me, line));
        self.secret_files().forget_unused(&apps, "dingtalk: secret of app");
        let mut dead = self.dead_hooks.lock().unwrap_or_else(|e| e.into_inner());
        dead.retain(|s| bound.iter().any(|b| b.as_str() == s));
    }

    fn metrics(&self, out: &mut String) {
        self.links.metrics(
            out,
            "imgate_dingtalk_connections",
            "Stream connections running, one per bound app.",
            "Stream sockets open now.",
        );
        crate::metrics::counters(
            out,
            &[&self.counts.unbound, &self.counts.skipped, &self.counts.openapi_sends],
        );
    }

    fn stop(&self) {
        self.links.stop_all();
    }
}
