//! Providers: what a channel is bound to, how it is described, how its tools act.
//!
//! The data plane calls only the functions here; each provider module owns its inbound
//! parsing, binding rules and outbound calls.

pub mod inbound;
pub mod telegram;
pub mod webhook;

use crate::app::App;
use crate::json::{self, Object, Value};
use crate::protocol::descriptor::{self, Target, ToolState};
use crate::protocol::{code, CARD_ID, TOOL_FILE_SEND, TOOL_REPLY, TOOL_SEND};
use crate::store::ChannelRecord;

/// A failed tool call or binding: a stable code and a message without secrets.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    pub code: &'static str,
    pub message: String,
}

impl Failure {
    pub fn new(code: &'static str, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
        }
    }
}

/// The Connection Descriptor of a channel in its current state.
pub fn describe(app: &App, cch: &str, rec: &ChannelRecord, profiles: &[String]) -> Value {
    let (status, target, tools) = match rec.source.as_deref() {
        Some(src) if telegram::is_source(src) => telegram::describe(app, src),
        Some(src) => match webhook::endpoint_of(src) {
            Some(name) => webhook::describe(app, name),
            None => unbound("error", "unknown source", "the binding refers to an unknown provider"),
        },
        None => unbound("created", "imgate (not bound)", "channel is not bound yet"),
    };
    let mut tools = tools;
    // The file tool is in the Card when Telegram is enabled; channels that cannot use it say so.
    if app.config.telegram.is_some() && !tools.iter().any(|(id, _)| *id == TOOL_FILE_SEND) {
        tools.push((TOOL_FILE_SEND, ToolState::unavailable("this channel cannot send files")));
    }
    descriptor::build(CARD_ID, &app.connector_id, cch, profiles, status, &target, &tools)
}

fn unbound(status: &'static str, name: &str, reason: &str) -> (&'static str, Target, Vec<(&'static str, ToolState)>) {
    (
        status,
        Target {
            provider: "imgate".into(),
            label: "imgate".into(),
            display_name: name.into(),
            account_hint: None,
        },
        vec![
            (TOOL_SEND, ToolState::unavailable(reason)),
            (TOOL_REPLY, ToolState::unavailable(reason)),
        ],
    )
}

/// The wire payload of a stored message of `source`.
pub fn render_push(app: &App, source: &str, stored: &crate::outbox::StoredMessage) -> Value {
    if telegram::is_source(source) {
        return telegram::render_push(app, stored);
    }
    match webhook::endpoint_of(source) {
        Some(name) => webhook::render_push(app, name, stored),
        None => {
            log::error!("outbox: message of unknown source {source}");
            json::obj([])
        }
    }
}

/// Runs an auth flow. On success returns the source to bind the channel to.
pub fn authenticate(app: &App, flow_id: &str, input: &Object) -> Result<String, Failure> {
    match flow_id {
        "webhook_binding" => webhook::check_binding(app, input),
        "telegram_bot_binding" if app.config.telegram.is_some() => telegram::check_binding(app, input),
        other => Err(Failure::new(
            code::INVALID_ARGUMENTS,
            format!("unknown auth flow `{other}`; see the Connector Card's auth_flows"),
        )),
    }
}

/// After bindings changed (auth, logout, lease): pollers follow, unused tokens are forgotten.
pub fn bindings_changed(app: &std::sync::Arc<App>) {
    telegram::poll::Pollers::sync(app);
    telegram::forget_unused_tokens(app);
}

/// After messages of `source` were delivered (best effort, never affects delivery).
pub fn delivered(app: &App, source: &str) {
    if telegram::is_source(source) {
        telegram::typing(app, source);
    }
}

/// Runs a tool on a bound channel. `idempotency_key` names the call to the provider.
pub fn invoke(app: &App, source: &str, tool_id: &str, args: &Object, idempotency_key: &str) -> Result<Value, Failure> {
    let text = || -> Result<&str, Failure> {
        json::get_str(args, "text")
            .filter(|t| !t.trim().is_empty())
            .ok_or_else(|| {
                Failure::new(
                    code::INVALID_ARGUMENTS,
                    "`text` is required and must be a non-empty string",
                )
            })
    };
    if tool_id == TOOL_FILE_SEND && app.config.telegram.is_some() {
        let file_ref = json::get_str(args, "file_ref")
            .ok_or_else(|| Failure::new(code::INVALID_ARGUMENTS, "`file_ref` is required"))?;
        if !telegram::is_source(source) {
            return Err(Failure::new(
                code::CHANNEL_UNAVAILABLE,
                "this channel cannot send files",
            ));
        }
        return telegram::send_file(app, source, file_ref, json::get_str(args, "caption"));
    }
    let reply_to = match tool_id {
        TOOL_SEND => None,
        TOOL_REPLY => {
            let reference = json::get_str(args, "reply_ref")
                .ok_or_else(|| Failure::new(code::INVALID_ARGUMENTS, "`reply_ref` is required"))?;
            let r = app
                .store
                .reply_ref(reference)
                .map_err(|e| Failure::new(code::TOOL_INVOKE_FAILED, format!("storage error: {e}")))?
                .filter(|r| r.source == source && r.expires_at > crate::ids::now_ms())
                .ok_or_else(|| {
                    Failure::new(
                        code::REPLY_REF_INVALID,
                        "reply_ref is unknown, expired or belongs to another channel",
                    )
                })?;
            Some(r.message_id)
        }
        other => {
            return Err(Failure::new(
                code::UNKNOWN_TOOL,
                format!("tool `{other}` is not declared by this connector"),
            ))
        }
    };
    if telegram::is_source(source) {
        return telegram::send(app, source, text()?, reply_to.as_deref());
    }
    match webhook::endpoint_of(source) {
        Some(name) => webhook::send(app, name, text()?, reply_to.as_deref(), idempotency_key),
        None => Err(Failure::new(
            code::CHANNEL_UNAVAILABLE,
            "channel is bound to an unknown provider",
        )),
    }
}
