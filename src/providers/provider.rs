//! The `Provider` trait and what crosses it: the declaration (Card label, flows, tools), auth
//! steps, Descriptors, outbound messages, ingest routes' requests and answers, `Failure`.

use std::path::PathBuf;

use crate::files::FileRecord;
use crate::json::{arr, b, obj, s, Object, Value};
use crate::outbox::{Enqueued, Ticket};
use crate::protocol::code;
use crate::protocol::descriptor::{Target, ToolState};
use crate::source::Source;
use crate::store::{self, StoreError};
use crate::upstream::{ApiError, Kind};

use super::kit::Transient;

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

    /// An IM system's API failed, the same code for the same kind on every provider:
    /// `connection_not_authenticated` when it refused the credential, `upstream_unreachable`
    /// with no answer, else `upstream_rejected`; temporary when the same call may pass later.
    /// The error's text holds no secret.
    pub fn api(e: &ApiError) -> Failure {
        let (code, message) = match e.kind() {
            Kind::Auth => (
                code::CONNECTION_NOT_AUTHENTICATED,
                format!("{e} (the credentials were refused: bind the channel again)"),
            ),
            Kind::Unreachable => (code::UPSTREAM_UNREACHABLE, e.to_string()),
            _ => (code::UPSTREAM_REJECTED, e.to_string()),
        };
        match e.temporary() {
            true => Failure::temporary(code, message),
            false => Failure::new(code, message),
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
    /// Who sent the message answered (the provider's user ID), when its `reply_ref` knew.
    pub reply_sender: Option<&'a str>,
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
    pub(super) fn matches(&self, method: &str, path: &str) -> bool {
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
    /// Its auth flows (their IDs unique across providers), as the Card lists them.
    pub flows: &'static [Flow],
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

    /// A channel of this provider that works, shown as `name` (with a redacted `hint`).
    pub fn connected(&self, name: String, hint: Option<String>) -> Description {
        Description::connected(self.target_of(name, hint), self.tools)
    }

    /// A channel of this provider that cannot work now (`status` `error` or `expired`), and why.
    pub fn unusable(&self, status: &'static str, name: String, hint: Option<String>, why: &str) -> Description {
        Description::unusable(status, self.target_of(name, hint), self.tools, why)
    }

    /// A binding whose row or credentials are gone: it is bound again.
    pub fn lost(&self, why: &str) -> Description {
        self.unusable("error", format!("{} (binding lost: bind again)", self.label), None, why)
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

/// An auth flow, declared once: a `form` (with its `fields`) that `Provider::bind` checks, or a
/// `qr_login` the provider runs itself.
pub struct Flow {
    pub id: &'static str,
    pub kind: &'static str,
    pub title: &'static str,
    pub description: &'static str,
    pub fields: &'static [Field],
}

impl Flow {
    /// A form flow.
    pub const fn form(
        id: &'static str,
        title: &'static str,
        description: &'static str,
        fields: &'static [Field],
    ) -> Flow {
        Flow {
            id,
            kind: "form",
            title,
            description,
            fields,
        }
    }

    /// The flow as the Card lists it; `device_account`: the config names the device's own
    /// account, so fields that have an `or_device` help may be left empty.
    pub fn card(&self, device_account: bool) -> Value {
        let mut o = vec![
            ("id", s(self.id)),
            ("target_type", s("im")),
            ("type", s(self.kind)),
            ("title", s(self.title)),
            ("description", s(self.description)),
        ];
        if !self.fields.is_empty() {
            o.push(("fields", arr(self.fields.iter().map(|f| f.card(device_account)))));
        }
        obj(o)
    }
}

/// What a form field takes: text, or a secret (typed as a password, never shown back).
#[derive(Clone, Copy, PartialEq)]
pub enum Input {
    Text,
    Secret,
}

/// A field of a form flow; every field is required, except one with an `or_device` help when
/// the device has its own account.
pub struct Field {
    pub name: &'static str,
    pub label: &'static str,
    pub input: Input,
    pub placeholder: Option<&'static str>,
    pub help: &'static str,
    /// The help shown when the device has its own account and the field may be left empty.
    pub or_device: Option<&'static str>,
}

impl Field {
    pub const fn text(
        name: &'static str,
        label: &'static str,
        placeholder: Option<&'static str>,
        help: &'static str,
    ) -> Field {
        Field {
            name,
            label,
            input: Input::Text,
            placeholder,
            help,
            or_device: None,
        }
    }

    pub const fn secret(
        name: &'static str,
        label: &'static str,
        placeholder: Option<&'static str>,
        help: &'static str,
    ) -> Field {
        Field {
            input: Input::Secret,
            ..Field::text(name, label, placeholder, help)
        }
    }

    /// May be left empty when the device has its own account; `help` says so.
    pub const fn or_device(self, help: &'static str) -> Field {
        Field {
            or_device: Some(help),
            ..self
        }
    }

    fn card(&self, device_account: bool) -> Value {
        let secret = self.input == Input::Secret;
        let optional = self.or_device.filter(|_| device_account);
        obj([
            ("name", s(self.name)),
            ("label", s(self.label)),
            ("input_type", s(if secret { "password" } else { "text" })),
            ("required", b(optional.is_none())),
            ("secret", if secret { b(true) } else { Value::Null }),
            ("placeholder", self.placeholder.map_or(Value::Null, s)),
            ("help_text", s(optional.unwrap_or(self.help))),
        ])
    }
}

pub trait Provider: Send + Sync {
    /// What it is (see `Declaration`).
    fn declaration(&self) -> &'static Declaration;

    /// The config names the device's own account (a default bot or app): form fields with an
    /// `or_device` help may be left empty.
    fn device_account(&self) -> bool {
        false
    }

    /// Its auth flows, as the Card lists them.
    fn auth_flows(&self) -> Vec<Value> {
        let device_account = self.device_account();
        self.declaration()
            .flows
            .iter()
            .map(|f| f.card(device_account))
            .collect()
    }

    /// Starts one of its auth flows: a form finishes here (`AuthStep::Bound`, through
    /// `bind`), a login the user completes elsewhere (a QR code) answers `AuthStep::Waiting`
    /// and is polled.
    fn auth_start(&self, _flow_id: &str, input: &Object) -> Result<AuthStep, Failure> {
        self.bind(input).map(AuthStep::Bound)
    }

    /// Its form flow: checks what the user filled in (credentials, the conversation), keeps
    /// it, and names the source to bind.
    fn bind(&self, _input: &Object) -> Result<Source, Failure> {
        Err(Failure::new(code::INVALID_ARGUMENTS, "this flow has no form"))
    }

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

    /// The name the agent is shown as the message's source (`Alerts`, `Telegram`): its
    /// declaration's label unless a conversation has its own.
    fn label(&self, _source: &Source) -> String {
        self.declaration().label.into()
    }

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::json;

    #[test]
    fn a_field_with_an_or_device_help_is_optional_only_when_the_device_has_its_account() {
        const FLOW: Flow = Flow::form(
            "test_binding",
            "Bind",
            "Bind a test chat.",
            &[
                Field::secret("token", "Token", None, "Enter the token.").or_device("Leave empty for the device's."),
                Field::text("chat_id", "Chat", Some("123"), "The chat."),
            ],
        );
        let fields = |device: bool| match json::get(json::as_object(&FLOW.card(device)).unwrap(), "fields") {
            Some(Value::Array(f)) => f.clone(),
            other => panic!("{other:?}"),
        };
        // A field's value as JSON text.
        let shown = |f: &Value, k: &str| json::as_object(f).and_then(|o| json::get(o, k)).map(json::to_string);
        let [token, chat] = &fields(false)[..] else {
            panic!("two fields")
        };
        assert_eq!(shown(token, "required"), Some("true".to_string()));
        assert_eq!(shown(token, "help_text"), Some(json::to_string(&s("Enter the token."))));
        assert_eq!(shown(token, "input_type"), Some(json::to_string(&s("password"))));
        assert_eq!(shown(chat, "placeholder"), Some(json::to_string(&s("123"))));
        let [token, chat] = &fields(true)[..] else {
            panic!("two fields")
        };
        assert_eq!(shown(token, "required"), Some("false".to_string()));
        assert_eq!(
            shown(token, "help_text"),
            Some(json::to_string(&s("Leave empty for the device's.")))
        );
        assert_eq!(
            shown(chat, "required"),
            Some("true".to_string()),
            "a field without one stays required"
        );
    }
}
