//! Connector Card, Skill and health object (common protocol section 4).

use super::{CARD_ID, PROFILE, PROTOCOL_VERSION, SKILL_NAME, TOOL_FILE_SEND, TOOL_REPLY, TOOL_SEND};
use crate::json::{arr, b, obj, s, strs, Value};

pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const GIT_REV: &str = env!("IMGATE_GIT_REV");
pub const BUILD_TIME: &str = env!("IMGATE_BUILD_TIME");

/// `imgate --version`.
pub fn version_line() -> String {
    format!("imgate {VERSION} (git {GIT_REV}, built {BUILD_TIME} UTC)")
}

/// The `build` object; identical in the Card and `/health` so xAgent sees one build.
pub fn build() -> Value {
    obj([
        ("version", s(VERSION)),
        ("git_tag", s(format!("v{VERSION}"))),
        ("git_rev", s(GIT_REV)),
        ("build_time", s(BUILD_TIME)),
    ])
}

/// Adds the reserved `connector_channel_id` argument every Card tool must require (section 10).
fn input_schema(required: &[&str], props: Vec<(&'static str, &'static str)>) -> Value {
    let mut properties = vec![(
        "connector_channel_id",
        obj([
            ("type", s("string")),
            (
                "description",
                s("Target user-level Connector channel ID. Pass the opaque ID from the inbound message or connector_channels_list unchanged."),
            ),
        ]),
    )];
    for (name, desc) in props {
        properties.push((name, obj([("type", s("string")), ("description", s(desc))])));
    }
    let mut req = vec!["connector_channel_id"];
    req.extend_from_slice(required);
    obj([
        ("type", s("object")),
        ("required", strs(req)),
        ("properties", obj(properties)),
    ])
}

fn sent_schema() -> Value {
    obj([
        ("type", s("object")),
        (
            "properties",
            obj([
                ("status", obj([("type", s("string"))])),
                ("message_id", obj([("type", s("string"))])),
            ]),
        ),
    ])
}

fn tool(id: &str, title: &str, description: &str, schema: Value) -> Value {
    obj([
        ("tool_id", s(id)),
        ("profile", s(PROFILE)),
        ("title", s(title)),
        ("description", s(description)),
        ("related_skill_ids", strs([SKILL_NAME])),
        ("input_schema", schema),
        ("output_schema", sent_schema()),
    ])
}

/// The Connector Card. `api_key_required` reflects whether `[server] api_key` is set;
/// `telegram` is `Some(default bot configured)` when `[telegram]` is enabled.
pub fn card(api_key_required: bool, telegram: Option<bool>) -> Value {
    let mut targets = vec![obj([
        ("target_type", s("im")),
        ("provider", s("webhook")),
        ("label", s("Webhook")),
        ("description", s("Any system that can POST JSON to an HTTP endpoint.")),
    ])];
    let mut flows = vec![webhook_flow()];
    let mut tools = vec![
        tool(
            TOOL_SEND,
            "Send a Message",
            "Send text to the conversation bound to the current channel.",
            input_schema(&["text"], vec![("text", "Text to send.")]),
        ),
        tool(
            TOOL_REPLY,
            "Reply to a Message",
            "Reply to an inbound message, using the reply_ref that came with it.",
            input_schema(
                &["reply_ref", "text"],
                vec![
                    (
                        "reply_ref",
                        "The opaque reply.reply_ref of the inbound message, unchanged.",
                    ),
                    ("text", "Reply text."),
                ],
            ),
        ),
    ];
    if let Some(default_bot) = telegram {
        tools.push(tool(
            TOOL_FILE_SEND,
            "Send a File",
            "Send a file (photo or document) uploaded for the current channel, with an optional caption.",
            input_schema(
                &["file_ref"],
                vec![
                    ("file_ref", "The file to send, as a unified file_ref."),
                    ("caption", "Optional caption."),
                ],
            ),
        ));
        targets.push(obj([
            ("target_type", s("im")),
            ("provider", s("telegram")),
            ("label", s("Telegram")),
            ("description", s("A Telegram bot in a private chat or a group.")),
        ]));
        flows.push(telegram_flow(default_bot));
    }
    obj([
        ("schema", s("xagent.connector/v1")),
        ("protocol_version", s(PROTOCOL_VERSION)),
        ("build", build()),
        ("connector_card_id", s(CARD_ID)),
        (
            "connector",
            obj([
                ("name", s("imgate")),
                ("version", s(VERSION)),
                ("vendor", s("imgate")),
                ("description", s("Bridges instant-messaging systems (webhook senders, Telegram) into xAgent from an edge device.")),
            ]),
        ),
        (
            "supports",
            obj([
                ("user_channel_mode", s("multiple")),
                ("target_types", strs(["im"])),
                ("targets", arr(targets)),
                ("profiles", strs([PROFILE])),
            ]),
        ),
        ("tools", arr(tools)),
        ("auth_flows", arr(flows)),
        (
            "security",
            obj([
                ("trust_level", s("third_party")),
                ("api_key_required", b(api_key_required)),
                ("data_classes", strs(["message"])),
            ]),
        ),
    ])
}

fn webhook_flow() -> Value {
    obj([
        ("id", s("webhook_binding")),
        ("target_type", s("im")),
        ("type", s("form")),
        ("title", s("Bind a Webhook Endpoint")),
        (
            "description",
            s("Bind this channel to a [webhook.NAME] endpoint configured on the imgate device."),
        ),
        (
            "fields",
            arr([
                obj([
                    ("name", s("endpoint")),
                    ("label", s("Endpoint name")),
                    ("input_type", s("text")),
                    ("required", b(true)),
                    ("placeholder", s("alerts")),
                    ("help_text", s("The NAME of a [webhook.NAME] section in imgate.conf.")),
                ]),
                obj([
                    ("name", s("secret")),
                    ("label", s("Endpoint secret")),
                    ("input_type", s("password")),
                    ("required", b(true)),
                    ("secret", b(true)),
                    (
                        "help_text",
                        s("The secret of that endpoint, proving you administer the device."),
                    ),
                ]),
            ]),
        ),
    ])
}

/// `telegram_bot_binding` (contract section 5): the token field is required only when the
/// device has no default bot.
fn telegram_flow(default_bot: bool) -> Value {
    obj([
        ("id", s("telegram_bot_binding")),
        ("target_type", s("im")),
        ("type", s("form")),
        ("title", s("Bind a Telegram Bot")),
        ("description", s("Bind this channel to one Telegram chat of a bot.")),
        (
            "fields",
            arr([
                obj([
                    ("name", s("bot_token")),
                    ("label", s("Bot Token")),
                    ("input_type", s("password")),
                    ("required", b(!default_bot)),
                    ("secret", b(true)),
                    ("placeholder", s("123456:ABC-DEF...")),
                    (
                        "help_text",
                        s(if default_bot {
                            "Leave empty to use the device's bot, or enter another bot's token from BotFather."
                        } else {
                            "Create a bot with BotFather and enter its token."
                        }),
                    ),
                ]),
                obj([
                    ("name", s("chat_id")),
                    ("label", s("Chat ID")),
                    ("input_type", s("text")),
                    ("required", b(true)),
                    ("placeholder", s("For example, 123456789")),
                    (
                        "help_text",
                        s("Start a conversation with the bot (or add it to the group), then enter the chat ID."),
                    ),
                ]),
            ]),
        ),
    ])
}

/// `GET /health` (section 4.3).
pub fn health() -> Value {
    obj([
        ("status", s("ok")),
        ("connector_card_id", s(CARD_ID)),
        ("connector_card_version", s(VERSION)),
        ("protocol_version", s(PROTOCOL_VERSION)),
        ("build", build()),
    ])
}

/// `GET /skill.md`: how the agent reads `message.push` and which tool answers.
pub const SKILL: &str = include_str!("skill.md");
