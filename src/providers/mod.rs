//! Providers: the IM systems imgate bridges, as plug-ins behind one trait.
//!
//! A provider is a folder here plus one line in `REGISTRATIONS`: its config sections (a
//! `config::Reader`), and a constructor that returns the running `Provider` when its config
//! enables it. Everything outside this folder asks the `Registry` and never names a provider:
//! the Card is the union of their targets, auth flows and tools; a channel's Descriptor, label
//! and outbound messages come from the provider named by its source; ingest routes are theirs.
//!
//! The trait is synchronous and object-safe. A provider's blocking work (its HTTP calls, long
//! polls) runs on its own threads or on the caller's blocking thread, never on the async
//! executor; `delivered` must return at once.

pub mod bindings;
#[cfg(feature = "dingtalk")]
pub mod dingtalk;
#[cfg(feature = "discord")]
pub mod discord;
#[cfg(feature = "feishu")]
pub mod feishu;
pub mod inbound;
pub mod intake;
pub mod keyfiles;
pub mod lag;
#[cfg(feature = "matrix")]
pub mod matrix;
#[cfg(feature = "slack")]
pub mod slack;
pub mod socket;
#[cfg(feature = "telegram")]
pub mod telegram;
pub mod webhook;
#[cfg(feature = "wechat")]
pub mod wechat;
pub mod workers;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::channels::Channels;
use crate::config::{self, Config};
use crate::files::{FileRecord, Files};
use crate::json::{arr, b, obj, s, Object, Value};
use crate::outbox::{Enqueued, Outbox, Ticket};
use crate::peer_wait;
use crate::protocol::code;
use crate::protocol::descriptor::{Target, ToolState};
use crate::source::Source;
use crate::store::{self, Db, StoreError};

/// Every provider imgate knows, in Card order. Adding a provider: its folder and one line here.
pub const REGISTRATIONS: &[Registration] = &[
    webhook::REGISTRATION,
    #[cfg(feature = "telegram")]
    telegram::REGISTRATION,
    #[cfg(feature = "feishu")]
    feishu::REGISTRATION,
    #[cfg(feature = "wechat")]
    wechat::REGISTRATION,
    #[cfg(feature = "slack")]
    slack::REGISTRATION,
    #[cfg(feature = "discord")]
    discord::REGISTRATION,
    #[cfg(feature = "dingtalk")]
    dingtalk::REGISTRATION,
    #[cfg(feature = "matrix")]
    matrix::REGISTRATION,
];

/// The providers this build left out (their Cargo feature off). Their sections are refused
/// with a reason that says so, rather than as unknown.
const LEFT_OUT: &[&str] = &[
    #[cfg(not(feature = "telegram"))]
    "telegram",
    #[cfg(not(feature = "feishu"))]
    "feishu",
    #[cfg(not(feature = "wechat"))]
    "wechat",
    #[cfg(not(feature = "slack"))]
    "slack",
    #[cfg(not(feature = "discord"))]
    "discord",
    #[cfg(not(feature = "dingtalk"))]
    "dingtalk",
    #[cfg(not(feature = "matrix"))]
    "matrix",
];

/// One provider's entry: how it reads the config, how it starts.
pub struct Registration {
    pub reader: config::Reader,
    /// The running provider, or `None` when the config leaves it disabled.
    pub start: StartFn,
}

/// Starts a provider on the layers below it.
pub type StartFn = fn(&Arc<Host>) -> Result<Option<Arc<dyn Provider>>, StoreError>;

/// The config readers of every provider, for `config::load`.
pub fn readers() -> Vec<config::Reader> {
    let left_out = LEFT_OUT.iter().map(|&name| config::Reader {
        provider: name,
        section: name,
        secrets: &[],
        read: refuse_left_out,
        left_out: true,
    });
    REGISTRATIONS.iter().map(|r| r.reader).chain(left_out).collect()
}

/// The reader of a left-out provider's section: an error naming the feature a build needs.
fn refuse_left_out(
    _: &Config,
    sections: &[&config::Section],
    problems: &mut config::Problems,
) -> Option<Arc<dyn config::Settings>> {
    for s in sections {
        problems.err(
            s.line,
            format_args!(
                "[{0}]: this imgate was built without the {0} provider (Cargo feature `{0}`); \
                 install a build that has it, or remove the section",
                s.name
            ),
        );
    }
    None
}

/// What a provider may use: the layers below it.
pub struct Host {
    pub config: Config,
    pub db: Arc<Db>,
    pub channels: Channels,
    pub outbox: Outbox,
    pub files: Files,
    /// Told when a binding's state changed at its IM system (a sign-in ended): the data plane
    /// pushes the channel's Descriptor. Set once by the data plane.
    pub state_changed: OnceLock<StateChanged>,
    /// Conversations that wrote to a bound account and have no binding (`unbound_seen`).
    pub unbound: Mutex<VecDeque<Unbound>>,
    /// Last, so that it drops last (fields drop in order): once it is dropped, the outbox's
    /// committer has made its final checkpoint and the database is closed.
    pub closed: Closed,
}

/// Set when the `Host` that holds it has been dropped whole. The last holder of a `Host` may be
/// any thread: shutdown waits on this, not on the count of references, which reaches zero
/// before the drop (and the final checkpoint) has run.
#[derive(Default)]
pub struct Closed(Arc<AtomicBool>);

impl Closed {
    /// Whether the `Host` has been dropped whole, readable after it is gone.
    pub fn watch(&self) -> Arc<AtomicBool> {
        self.0.clone()
    }
}

impl Drop for Closed {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
        crate::runtime::released();
    }
}

/// A conversation that wrote to a bound account without a binding of its own, as `/status`
/// lists it (`unbound_recent`) so an owner can find the ID to bind.
#[derive(Clone)]
pub struct Unbound {
    pub provider: &'static str,
    /// The IM system's ID of the conversation (checked by the provider: printable ASCII).
    pub conversation: String,
    /// `channel`, `dm`, `group`...
    pub kind: &'static str,
    /// Unix ms.
    pub last_seen: u64,
}

/// `/status` lists at most this many unbound conversations, the latest seen.
const UNBOUND_RECENT: usize = 16;

/// What `Host::binding_state_changed` calls.
pub type StateChanged = Box<dyn Fn(&Source) + Send + Sync>;

impl Host {
    /// A provider saw the state of `source`'s binding change on its own: xAgent is told.
    pub fn binding_state_changed(&self, source: &Source) {
        if let Some(tell) = self.state_changed.get() {
            tell(source);
        }
    }

    /// A conversation with no binding wrote to a bound account: listed (the latest
    /// `UNBOUND_RECENT`), never stored.
    pub fn unbound_seen(&self, provider: &'static str, conversation: &str, kind: &'static str) {
        let mut recent = self.unbound.lock().unwrap_or_else(|e| e.into_inner());
        recent.retain(|u| !(u.provider == provider && u.conversation == conversation));
        if recent.len() >= UNBOUND_RECENT {
            recent.pop_front();
        }
        recent.push_back(Unbound {
            provider,
            conversation: conversation.chars().take(64).collect(),
            kind,
            last_seen: crate::ids::now_ms(),
        });
    }

    pub fn ttl_ms(&self) -> u64 {
        self.config.queue.ttl.as_millis() as u64
    }

    /// `[server] public_url` as the base of `download_url`s ("" keeps them relative).
    pub fn public_base(&self) -> &str {
        self.config.server.public_url.as_deref().unwrap_or("")
    }
}

/// A failed tool call, binding or send: a stable code, a message without secrets, and whether
/// the same request may work later (a network error, a rate limit, a busy disk).
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    pub code: &'static str,
    pub message: String,
    pub retryable: bool,
}

impl Failure {
    /// A failure the same request would meet again.
    pub fn new(code: &'static str, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
            retryable: false,
        }
    }

    /// A failure that may pass: worth trying again after a while.
    pub fn temporary(code: &'static str, message: impl Into<String>) -> Failure {
        Failure {
            retryable: true,
            ..Failure::new(code, message)
        }
    }

    /// An IM system's API failed: `upstream_unreachable` or `upstream_rejected`, temporary when
    /// the same call may pass later. The error's text must hold no secret.
    pub fn upstream(e: &impl Transient) -> Failure {
        let code = match e.unreachable() {
            true => code::UPSTREAM_UNREACHABLE,
            false => code::UPSTREAM_REJECTED,
        };
        match e.temporary() {
            true => Failure::temporary(code, e.to_string()),
            false => Failure::new(code, e.to_string()),
        }
    }

    /// The store could not answer: a storage failure, never "not found".
    pub fn storage(e: StoreError) -> Failure {
        let message = format!("storage error: {e}");
        match e.is_outage() {
            true => Failure::temporary(code::TOOL_INVOKE_FAILED, message),
            false => Failure::new(code::TOOL_INVOKE_FAILED, message),
        }
    }
}

/// Where an auth flow stands after `auth_start` or `auth_poll`. The form flows of today's
/// providers only bind; the other steps are for logins completed elsewhere (a QR code), which
/// the auth tests drive with a stand-in provider.
#[cfg_attr(not(test), allow(dead_code))]
#[derive(Debug, Clone, PartialEq)]
pub enum AuthStep {
    /// Done: bind the channel to this source.
    Bound(Source),
    /// The user has something left to do (scan a QR code, confirm on the phone).
    Waiting(Prompt),
    /// The login's material ran out (a QR code nobody scanned) and it cannot go on.
    Expired(String),
}

/// What a waiting login shows the user, as `auth.start.ack` and `auth.status.ack` carry it
/// (common protocol 8.8).
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    /// The provider's own handle for this login (never shown to xAgent).
    pub login: String,
    pub stage: Stage,
    pub qr_code_text: Option<String>,
    pub qr_code_image: Option<String>,
    /// Unix ms after which this login is expired (bounded again by the auth sessions' own cap).
    pub expires_at: Option<u64>,
    pub poll_interval_millis: Option<u64>,
    pub message: String,
}

/// How far a waiting login got.
#[cfg_attr(not(test), allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Stage {
    /// Shown, not yet acted on.
    Pending,
    /// Scanned; waiting for the user to confirm.
    Scanned,
    /// The material must be renewed (`auth.status` with `refresh`).
    RefreshRequired,
}

/// A channel as its Descriptor shows it.
pub struct Description {
    /// `connected`, or `error` when the binding cannot work (the reason is in `tools`).
    pub status: &'static str,
    pub target: Target,
    /// The state of each of the provider's tools on this channel.
    pub tools: Vec<(&'static str, ToolState)>,
}

impl Description {
    /// A channel that works: each of `tools` available.
    pub fn connected(target: Target, tools: &[&'static str]) -> Description {
        Description {
            status: "connected",
            target,
            tools: tools.iter().map(|t| (*t, ToolState::available())).collect(),
        }
    }

    /// A channel that cannot work now (`status` `error`, or `expired` for a sign-in that
    /// ended): each of `tools` unavailable, and why.
    pub fn unusable(status: &'static str, target: Target, tools: &[&'static str], why: &str) -> Description {
        Description {
            status,
            target,
            tools: tools.iter().map(|t| (*t, ToolState::unavailable(why))).collect(),
        }
    }
}

/// One message to send to a bound conversation (a tool call, or xAgent's own message).
pub struct Outbound<'a> {
    /// The text (may be empty with files); with the file tool, the file's caption.
    pub text: &'a str,
    /// The provider's ID of the message answered, from a `reply_ref`.
    pub reply_to: Option<&'a str>,
    /// Files uploaded through `/files/uploads` for this channel, and where their bytes are.
    pub files: &'a [(FileRecord, PathBuf)],
    /// Names this send to the receiver, so a retried call can be recognised.
    pub idempotency_key: &'a str,
    /// An assistant message of IM profile v2: its `message_id`.
    pub message_id: Option<&'a str>,
    /// What `stream` returned for this message, when its deltas were shown: the final replaces
    /// them instead of arriving as a second message.
    pub streamed: Option<&'a str>,
}

/// One text delta of an assistant message (IM profile v2 section 6).
pub struct Delta<'a> {
    pub message_id: &'a str,
    pub sequence: u64,
    /// This delta's text.
    pub piece: &'a str,
    /// Everything so far, this delta included.
    pub text: &'a str,
}

/// What the agent is doing (IM profile v2 `chat.activity`), as a provider can show it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activity {
    /// Thinking or running a tool: "typing", or its equivalent.
    Busy,
    Idle,
}

/// An HTTP request to a provider's own route, already framed and bounded by the front door.
pub struct HttpRequest<'a> {
    /// The path below `public_url`'s prefix, without the query.
    pub path: &'a str,
    pub headers: &'a [(String, String)],
    pub body: &'a [u8],
}

impl HttpRequest<'_> {
    /// A header's value (names compare case-insensitively).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A JSON answer.
pub struct HttpAnswer {
    pub status: u16,
    pub body: Value,
}

impl HttpAnswer {
    pub fn new(status: u16, body: Value) -> HttpAnswer {
        HttpAnswer { status, body }
    }

    /// `{"error": code}`.
    pub fn error(status: u16, code: &str) -> HttpAnswer {
        HttpAnswer::new(status, crate::json::obj([("error", crate::json::s(code))]))
    }
}

/// How a provider answers its route.
pub enum Reply {
    Now(HttpAnswer),
    /// Once the message is committed; the caller waits without holding a thread if it can.
    AfterCommit(Ticket, Box<dyn FnOnce(store::Result<Enqueued>) -> HttpAnswer + Send>),
    /// Work that blocks (the provider's own API calls): run on a blocking thread.
    Blocking(Box<dyn FnOnce() -> HttpAnswer + Send>),
}

/// A route a provider answers: `POST /hooks/NAME` is `("POST", "/hooks/", true)`.
pub struct Route {
    pub method: &'static str,
    pub path: &'static str,
    /// `path` is a prefix (the rest names something of the provider's).
    pub prefix: bool,
}

impl Route {
    fn matches(&self, method: &str, path: &str) -> bool {
        self.method == method
            && if self.prefix {
                path.len() > self.path.len() && path.starts_with(self.path)
            } else {
                path == self.path
            }
    }
}

/// What a provider is, declared once: its name, its target in the Card, its flows' IDs and its
/// tools. Everything else reads these from here (`Provider::declaration`).
pub struct Declaration {
    /// The provider part of its sources and the Card's `target.provider`.
    pub name: &'static str,
    /// The target's label and description in the Card (`Declaration::target`).
    pub label: &'static str,
    pub description: &'static str,
    /// The IDs of its auth flows (unique across providers); `Provider::auth_flows` gives the
    /// flows themselves, built with `flow` and `field`.
    pub flow_ids: &'static [&'static str],
    /// The tools its channels can use (the Card declares the union over all providers).
    pub tools: &'static [&'static str],
}

impl Declaration {
    /// A channel's target: this provider, its label, the name shown and a redacted hint.
    pub fn target_of(&self, display_name: String, account_hint: Option<String>) -> Target {
        Target {
            provider: self.name.into(),
            label: self.label.into(),
            display_name,
            account_hint,
        }
    }

    /// Its entry in the Card's `supports.targets`.
    pub fn target(&self) -> Value {
        obj([
            ("target_type", s("im")),
            ("provider", s(self.name)),
            ("label", s(self.label)),
            ("description", s(self.description)),
        ])
    }
}

/// An auth flow as the Card lists it: `kind` is `form` (with its `fields`) or `qr_login`.
pub fn flow(id: &str, kind: &str, title: &str, description: &str, fields: Vec<Value>) -> Value {
    let mut o = vec![
        ("id", s(id)),
        ("target_type", s("im")),
        ("type", s(kind)),
        ("title", s(title)),
        ("description", s(description)),
    ];
    if !fields.is_empty() {
        o.push(("fields", arr(fields)));
    }
    obj(o)
}

/// What a form field takes: text, or a secret (typed as a password, never shown back).
#[derive(Clone, Copy, PartialEq)]
pub enum Input {
    Text,
    Secret,
}

/// A field of a form flow.
pub fn field(name: &str, label: &str, input: Input, required: bool, placeholder: Option<&str>, help: &str) -> Value {
    let secret = input == Input::Secret;
    obj([
        ("name", s(name)),
        ("label", s(label)),
        ("input_type", s(if secret { "password" } else { "text" })),
        ("required", b(required)),
        ("secret", if secret { b(true) } else { Value::Null }),
        ("placeholder", placeholder.map_or(Value::Null, s)),
        ("help_text", s(help)),
    ])
}

pub trait Provider: Send + Sync {
    /// What it is (see `Declaration`).
    fn declaration(&self) -> &'static Declaration;

    /// Its auth flows, as the Card lists them (`flow`), one per ID its declaration names.
    fn auth_flows(&self) -> Vec<Value>;

    /// Starts one of its auth flows: a form finishes here (`AuthStep::Bound`), a login the
    /// user completes elsewhere (a QR code) answers `AuthStep::Waiting` and is polled.
    fn auth_start(&self, flow_id: &str, input: &Object) -> Result<AuthStep, Failure>;

    /// Asks a waiting login again (`login` is what its `Prompt` named); `refresh`: new
    /// material (a new QR code) is wanted. Only flows that wait are ever polled.
    fn auth_poll(&self, _flow_id: &str, _login: &str, _refresh: bool) -> Result<AuthStep, Failure> {
        Err(Failure::new(
            code::AUTH_SESSION_NOT_FOUND,
            "this flow finishes in auth.start",
        ))
    }

    /// A waiting login is given up (cancelled, expired, or pushed out by newer ones): forget it.
    fn auth_cancel(&self, _flow_id: &str, _login: &str) {}

    /// `auth.logout`: the binding of `source` is gone; forget the credentials only it used.
    /// (Stored credentials no binding uses are also forgotten in `bindings_changed`.)
    fn logout(&self, _source: &Source) {}

    /// The Descriptor of a channel bound to `source`. `Err` only when the store cannot tell.
    fn describe(&self, source: &Source) -> Result<Description, StoreError>;

    /// The name the agent is shown as the message's source (`Alerts`, `Telegram`).
    fn label(&self, source: &Source) -> String;

    /// Sends to the conversation of `source`; the provider's ID of what it sent. Returns only
    /// after the target took all of it (text and files).
    fn send(&self, source: &Source, out: &Outbound) -> Result<String, Failure>;

    /// Shows an assistant message as it grows. `handle` is what the last call returned for the
    /// same message (`None` the first time); `Ok(None)`: this conversation shows only finals.
    fn stream(&self, _source: &Source, _delta: &Delta, _handle: Option<&str>) -> Result<Option<String>, Failure> {
        Ok(None)
    }

    /// Shows what the agent is doing. Must return at once; showing it has its own deadline and
    /// never affects a message.
    fn activity(&self, _source: &Source, _activity: Activity) {}

    /// The routes it answers itself (ingest webhooks).
    fn routes(&self) -> &'static [Route] {
        &[]
    }

    /// The answer a request to one of its routes gets from its head alone (an unknown name, a
    /// wrong secret), before its body is read or a `100 Continue` invites it; `None` when the
    /// body is needed (`req.body` is empty here).
    fn screen(&self, _req: &HttpRequest) -> Option<HttpAnswer> {
        None
    }

    /// Answers a request to one of its routes.
    fn handle(&self, _req: &HttpRequest) -> Reply {
        Reply::Now(HttpAnswer::error(404, "not_found"))
    }

    /// The set of bound sources changed (auth, logout, lease): start or stop background work,
    /// forget what no binding uses.
    fn bindings_changed(&self, _bound: &[Source]) {}

    /// Messages of `source` were delivered. Must return at once: anything it does (a typing
    /// indicator) runs elsewhere, with its own deadline.
    fn delivered(&self, _source: &Source) {}

    /// Its own lines of `/metrics` (Prometheus text).
    fn metrics(&self, _out: &mut String) {}

    /// Shutdown: background work stops.
    fn stop(&self) {}
}

/// The running providers.
pub struct Registry {
    providers: Vec<Arc<dyn Provider>>,
}

impl Registry {
    /// Starts every provider the config enables, in `REGISTRATIONS` order.
    pub fn start(host: &Arc<Host>) -> Result<Registry, StoreError> {
        let mut providers = Vec::new();
        for r in REGISTRATIONS {
            if let Some(p) = (r.start)(host)? {
                providers.push(p);
            }
        }
        Ok(Registry { providers })
    }

    /// A registry of the given providers (the unit tests' stand-ins).
    #[cfg(test)]
    pub fn of_providers(providers: Vec<Arc<dyn Provider>>) -> Registry {
        Registry { providers }
    }

    pub fn all(&self) -> &[Arc<dyn Provider>] {
        &self.providers
    }

    pub fn get(&self, name: &str) -> Option<&Arc<dyn Provider>> {
        self.providers.iter().find(|p| p.declaration().name == name)
    }

    /// The provider that owns `source`; `None` for one no enabled provider knows.
    pub fn of(&self, source: &Source) -> Option<&Arc<dyn Provider>> {
        self.get(source.provider())
    }

    /// The provider whose auth flow this is.
    pub fn for_flow(&self, flow_id: &str) -> Option<&Arc<dyn Provider>> {
        self.providers
            .iter()
            .find(|p| p.declaration().flow_ids.contains(&flow_id))
    }

    /// The provider answering `method path` itself.
    pub fn for_route(&self, method: &str, path: &str) -> Option<&Arc<dyn Provider>> {
        self.providers
            .iter()
            .find(|p| p.routes().iter().any(|r| r.matches(method, path)))
    }

    /// Whether `path` is some provider's route, whatever the method (for 405 answers).
    pub fn has_path(&self, path: &str) -> bool {
        self.providers
            .iter()
            .any(|p| p.routes().iter().any(|r| r.matches(r.method, path)))
    }

    /// The tools the Card declares: every tool some enabled provider serves, in `ALL_TOOLS` order.
    pub fn tools(&self) -> Vec<&'static str> {
        crate::protocol::ALL_TOOLS
            .iter()
            .copied()
            .filter(|t| self.providers.iter().any(|p| p.declaration().tools.contains(t)))
            .collect()
    }

    /// Tells every provider which sources are bound now.
    pub fn bindings_changed(&self, channels: &Channels) {
        match channels.bound_sources() {
            Ok(bound) => {
                for p in &self.providers {
                    p.bindings_changed(&bound);
                }
            }
            Err(e) => log::error!("providers: cannot read the bindings: {e}"),
        }
    }

    pub fn stop(&self) {
        for p in &self.providers {
            p.stop();
        }
    }
}

/// An error of a provider's API that may pass if the call is made again.
pub trait Transient: std::fmt::Display {
    /// The server could not be reached (or answered nothing readable).
    fn unreachable(&self) -> bool;
    /// Unreachable, rate limited or a server error.
    fn temporary(&self) -> bool;
    /// How long the server asked to wait before the next call, if it said.
    fn retry_after(&self) -> Option<Duration>;
}

/// Runs `attempt` (one API call, given the time left) until it succeeds, fails for good, or
/// `deadline` passes: rate limits and server errors are retried with backoff, and no attempt may
/// outlive the deadline, so a tool answers in time even when the IM system stalls.
pub fn with_retry<T, E: Transient>(
    what: &str,
    deadline: Instant,
    mut attempt: impl FnMut(Duration) -> Result<T, E>,
) -> Result<T, E> {
    let mut backoff = Duration::from_millis(500);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match attempt(left.max(Duration::from_millis(1))) {
            Err(e) if e.temporary() => {
                let wait = peer_wait::retry_after(e.retry_after(), backoff);
                if peer_wait::passes(deadline, wait) {
                    return Err(e);
                }
                log::info!("{what}: {e}; retrying in {wait:?}");
                std::thread::sleep(wait);
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
            other => return other,
        }
    }
}

/// A multipart/form-data body: text fields, then one file as `part`; its boundary and bytes.
pub fn multipart(fields: &[(&str, &str)], part: &str, filename: &str, mime: &str, bytes: &[u8]) -> (String, Vec<u8>) {
    let boundary = format!("imgate{}", crate::ids::random_hex(12));
    let mut body = Vec::with_capacity(bytes.len() + 512);
    for (name, value) in fields {
        body.extend_from_slice(
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n").as_bytes(),
        );
    }
    // The name comes from an upload (checked there), but a quote would still end the header value.
    let filename = filename.replace(['"', '\r', '\n'], "_");
    body.extend_from_slice(
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"{part}\"; filename=\"{filename}\"\r\nContent-Type: {mime}\r\n\r\n"
        )
        .as_bytes(),
    );
    body.extend_from_slice(bytes);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    (boundary, body)
}

/// A file from the cache to upload: its name, type, size and bytes on disk.
pub struct Upload<'a> {
    pub filename: &'a str,
    pub mime: &'a str,
    pub size: u64,
    pub path: &'a std::path::Path,
}

/// A multipart/form-data body read from disk as it is sent: text fields (each with its own
/// `Content-Type` when it has one), then the file as `part`. Memory does not grow with the file.
pub struct StreamedForm {
    pub boundary: String,
    /// The body's length in bytes, for `Content-Length`.
    pub length: u64,
    pub body: Box<dyn std::io::Read + Send>,
}

impl StreamedForm {
    pub fn new(fields: &[(&str, Option<&str>, &str)], part: &str, file: &Upload) -> std::io::Result<StreamedForm> {
        use std::io::Read;
        let boundary = format!("imgate{}", crate::ids::random_hex(12));
        let mut head = String::new();
        for (name, content_type, value) in fields {
            head.push_str(&format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n"
            ));
            if let Some(t) = content_type {
                head.push_str(&format!("Content-Type: {t}\r\n"));
            }
            head.push_str(&format!("\r\n{value}\r\n"));
        }
        // A quote or a line break would end the header's value: never in a name we send.
        let filename = file.filename.replace(['"', '\r', '\n', '\\'], "_");
        head.push_str(&format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"{part}\"; filename=\"{filename}\"\r\nContent-Type: {}\r\n\r\n",
            file.mime
        ));
        let tail = format!("\r\n--{boundary}--\r\n");
        let bytes = std::fs::File::open(file.path)?;
        let length = (head.len() as u64)
            .saturating_add(file.size)
            .saturating_add(tail.len() as u64);
        let body = std::io::Cursor::new(head.into_bytes())
            .chain(bytes.take(file.size))
            .chain(std::io::Cursor::new(tail.into_bytes()));
        Ok(StreamedForm {
            boundary,
            length,
            body: Box::new(body),
        })
    }
}

/// How long an access token the server says lives `expire` seconds is used: until five minutes
/// before its end, or half its life when that is shorter; a day at most, whatever the server says.
pub fn token_kept_for(expire: u64) -> Duration {
    const RENEW_EARLY: Duration = Duration::from_secs(300);
    let lifetime = Duration::from_secs(expire.min(86_400));
    lifetime.saturating_sub(RENEW_EARLY).max(lifetime / 2)
}

/// A name for part `part` of one send, the same whenever the call is retried, so the IM
/// system can tell a retry from a new message: `bytes` of SHA-256(idempotency key, part) in hex.
pub fn send_id(idempotency_key: &str, part: usize, bytes: usize) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, format!("{idempotency_key}:{part}").as_bytes());
    crate::ids::hex(&digest.as_ref()[..bytes.min(32)])
}

/// The type a downloaded file is stored as: the server's `Content-Type` when it names one (an
/// image may be a JPEG, not the PNG its message said), else what the message declared.
pub fn served_mime(served: Option<&str>, declared: &str) -> String {
    served
        .map(|c| c.split(';').next().unwrap_or_default().trim())
        .filter(|c| c.contains('/') && !c.starts_with("application/octet-stream"))
        .unwrap_or(declared)
        .to_string()
}

/// Splits text into parts of at most `max_chars` characters, preferring line breaks, never
/// inside a character.
pub fn split_text(text: &str, max_chars: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    // One scan per part: the byte offset of character `max_chars` exists only while too long.
    while let Some((cut, _)) = rest.char_indices().nth(max_chars) {
        let at = rest[..cut].rfind('\n').filter(|&i| i > cut / 2).map_or(cut, |i| i + 1);
        out.push(rest[..at].to_string());
        rest = &rest[at..];
    }
    if !rest.is_empty() || out.is_empty() {
        out.push(rest.to_string());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_renewed_five_minutes_before_it_expires_or_at_half_life() {
        assert_eq!(token_kept_for(7200), Duration::from_secs(6900), "two hours");
        assert_eq!(
            token_kept_for(400),
            Duration::from_secs(200),
            "a short token: half its life"
        );
        assert_eq!(
            token_kept_for(0),
            Duration::ZERO,
            "no lifetime: fetched again next time"
        );
        assert_eq!(token_kept_for(u64::MAX), Duration::from_secs(86_100), "a day at most");
    }

    #[test]
    fn long_text_is_split_at_the_limit_without_breaking_characters() {
        let text = "é".repeat(5000);
        let parts = split_text(&text, 4096);
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].chars().count(), 4096);
        assert_eq!(parts.concat(), text);
        let lines = format!("{}\n{}", "a".repeat(3000), "b".repeat(3000));
        let parts = split_text(&lines, 4096);
        assert_eq!(
            parts[0],
            format!("{}\n", "a".repeat(3000)),
            "a line break is the preferred cut"
        );
        assert_eq!(split_text("hi", 4096), ["hi"]);
    }

    #[test]
    fn a_section_of_a_provider_left_out_of_the_build_names_the_feature_it_needs() {
        let readers = [config::Reader {
            provider: "slack",
            section: "slack",
            secrets: &[],
            read: refuse_left_out,
            left_out: true,
        }];
        let text = "[server]\nlisten = 127.0.0.1:8787\n\n[slack]\napi_base = https://x\n";
        let err = config::parse(text, "t.conf", None, &readers)
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some(
                "t.conf:4: [slack]: this imgate was built without the slack provider (Cargo feature \
                 `slack`); install a build that has it, or remove the section"
            )
        );
        let fine = config::parse("[server]\nlisten = 127.0.0.1:8787\n", "t.conf", None, &readers);
        let summary = fine.map(|c| c.summary()).unwrap_or_default();
        assert!(
            summary.contains("\nslack:             not in this build\n"),
            "no section, no error; `check` says the provider is not built in: {summary}"
        );
    }
}
