//! Providers: what a channel is bound to, how it is described, how its tools act.
//!
//! The data plane calls only the functions here; each provider module owns its inbound
//! parsing, binding rules and outbound calls.

pub mod inbound;
pub mod webhook;

use crate::app::App;
use crate::json::{self, Object, Value};
use crate::protocol::descriptor::{self, Target, ToolState};
use crate::protocol::{code, CARD_ID, TOOL_REPLY, TOOL_SEND};
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
    let (status, target, tools) = match rec.source.as_deref().and_then(webhook::endpoint_of) {
        Some(name) => match app.config.webhooks.get(name) {
            Some(hook) => {
                let reply = if hook.reply_url.is_some() {
                    ToolState::available()
                } else {
                    ToolState::unavailable("this endpoint has no reply_url configured")
                };
                (
                    "connected",
                    Target {
                        provider: "webhook".into(),
                        label: hook.label.clone(),
                        display_name: format!("Webhook {}", hook.label),
                        account_hint: Some(name.to_string()),
                    },
                    vec![(TOOL_SEND, reply.clone()), (TOOL_REPLY, reply)],
                )
            }
            // Bound to an endpoint that was removed from the config.
            None => (
                "error",
                Target {
                    provider: "webhook".into(),
                    label: name.to_string(),
                    display_name: format!("Webhook {name} (no longer configured)"),
                    account_hint: None,
                },
                unbound_tools("the bound endpoint is no longer configured"),
            ),
        },
        None => (
            "created",
            Target {
                provider: "webhook".into(),
                label: "imgate".into(),
                display_name: "imgate (not bound)".into(),
                account_hint: None,
            },
            unbound_tools("channel is not bound yet"),
        ),
    };
    descriptor::build(CARD_ID, &app.connector_id, cch, profiles, status, &target, &tools)
}

fn unbound_tools(reason: &str) -> Vec<(&'static str, ToolState)> {
    vec![
        (TOOL_SEND, ToolState::unavailable(reason)),
        (TOOL_REPLY, ToolState::unavailable(reason)),
    ]
}

/// The wire payload of a stored message of `source`.
pub fn render_push(app: &App, source: &str, stored: &crate::outbox::StoredMessage) -> Value {
    match webhook::endpoint_of(source) {
        Some(name) => webhook::render_push(app, name, stored),
        None => {
            log::error!("outbox: message of unknown source {source}");
            json::obj([])
        }
    }
}

/// Runs an auth flow for `cch`. On success returns the source now bound to the channel.
pub fn authenticate(app: &App, flow_id: &str, input: &Object) -> Result<String, Failure> {
    match flow_id {
        "webhook_binding" => webhook::check_binding(app, input),
        other => Err(Failure::new(
            code::INVALID_ARGUMENTS,
            format!("unknown auth flow `{other}`; this connector offers webhook_binding"),
        )),
    }
}

/// Runs a tool on a bound channel. `call_key` dedupes repeated calls (channel + tool_call_id).
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
    let Some(name) = webhook::endpoint_of(source) else {
        return Err(Failure::new(
            code::CHANNEL_UNAVAILABLE,
            "channel is bound to an unknown provider",
        ));
    };
    match tool_id {
        TOOL_SEND => webhook::send(app, name, text()?, None, idempotency_key),
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
            webhook::send(app, name, text()?, Some(&r.message_id), idempotency_key)
        }
        other => Err(Failure::new(
            code::UNKNOWN_TOOL,
            format!("tool `{other}` is not declared by this connector"),
        )),
    }
}
