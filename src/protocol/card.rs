//! Connector Card, Skill and health object (common protocol section 4).

use super::{CardId, Profile, PROTOCOL_VERSION, TOOL_FILE_SEND, TOOL_REPLY, TOOL_SEND};
use crate::json::{arr, b, obj, s, strs, Value};

pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const GIT_REV: &str = env!("IMGATE_GIT_REV");
/// The protocol's form (`YYMMDDHHMM`, UTC), for the Card and `/health`.
pub const BUILD_TIME: &str = env!("IMGATE_BUILD_TIME");
/// The same time as a person reads it (`2026-12-07 07:25`, UTC).
const BUILT: &str = env!("IMGATE_BUILT");

/// `imgate --version`.
pub fn version_line() -> String {
    format!("imgate {VERSION} (git {GIT_REV}, built {BUILT} UTC)")
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

/// What every tool of one Card shares: the profile it belongs to and the Skill it relates to.
struct ToolContext<'a> {
    profile: Profile,
    skill: &'a str,
}

fn tool(cx: &ToolContext, id: &str, title: &str, description: &str, schema: Value) -> Value {
    obj([
        ("tool_id", s(id)),
        ("profile", s(cx.profile.as_str())),
        ("title", s(title)),
        ("description", s(description)),
        ("related_skill_ids", strs([cx.skill])),
        ("input_schema", schema),
        ("output_schema", sent_schema()),
    ])
}

/// The tool a Card declares under `id`.
fn tool_entry(cx: &ToolContext, id: &str) -> Value {
    match id {
        TOOL_SEND => tool(
            cx,
            TOOL_SEND,
            "Send a Message",
            "Send text to the conversation bound to the current channel.",
            input_schema(&["text"], vec![("text", "Text to send.")]),
        ),
        TOOL_REPLY => tool(
            cx,
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
        _ => tool(
            cx,
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
        ),
    }
}

/// What the enabled providers bring to the Card: their targets, auth flows and the tools their
/// channels can use.
pub struct Parts {
    pub targets: Vec<Value>,
    pub auth_flows: Vec<Value>,
    pub tools: Vec<&'static str>,
}

/// The Connector Card. `api_key_required` reflects whether `[server] api_key` is set; the Card
/// declares exactly the deployment's `profile` (IM profile v1 section 3).
pub fn card(card_id: &CardId, api_key_required: bool, profile: Profile, parts: Parts) -> Value {
    let cx = ToolContext {
        profile,
        skill: card_id.skill_name(),
    };
    obj([
        ("schema", s("xagent.connector/v1")),
        ("protocol_version", s(PROTOCOL_VERSION)),
        ("build", build()),
        ("connector_card_id", s(card_id.as_str())),
        (
            "connector",
            obj([
                ("name", s("imgate")),
                ("version", s(VERSION)),
                ("vendor", s("imgate")),
                (
                    "description",
                    s("Bridges instant-messaging systems into xAgent from an edge device."),
                ),
            ]),
        ),
        (
            "supports",
            obj([
                ("user_channel_mode", s("multiple")),
                ("target_types", strs(["im"])),
                ("targets", arr(parts.targets)),
                ("profiles", strs([profile.as_str()])),
            ]),
        ),
        ("tools", arr(parts.tools.iter().map(|t| tool_entry(&cx, t)))),
        ("auth_flows", arr(parts.auth_flows)),
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

/// `GET /health` (section 4.3).
pub fn health(card_id: &CardId) -> Value {
    obj([
        ("status", s("ok")),
        ("connector_card_id", s(card_id.as_str())),
        ("connector_card_version", s(VERSION)),
        ("protocol_version", s(PROTOCOL_VERSION)),
        ("build", build()),
    ])
}

/// `GET /skill.md`: how the agent reads `message.push` and which tool answers (IM v1).
pub const SKILL: &str = include_str!("skill.md");
/// The same for IM v2: `chat.message` in, replies as messages.
pub const SKILL_V2: &str = include_str!("skill_v2.md");

/// The header line both Skill files are written with, for the default card ID.
const SKILL_NAME_LINE: &str = "\nname: connector-im-imgate\n";

/// The Skill of the deployment's profile, named after its card ID (section 4.2).
pub fn skill(card_id: &CardId, profile: Profile) -> String {
    let text = match profile {
        Profile::V1 => SKILL,
        Profile::V2 => SKILL_V2,
    };
    text.replacen(SKILL_NAME_LINE, &format!("\nname: {}\n", card_id.skill_name()), 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `name` of the Skill's front matter (between its first two `---` lines).
    fn header_name(skill: &str) -> Option<&str> {
        skill
            .lines()
            .skip(1)
            .take_while(|l| *l != "---")
            .find_map(|l| l.strip_prefix("name: "))
    }

    #[test]
    fn skill_header_card_tools_and_health_follow_the_card_id() {
        let id = CardId::parse("im.imgate.garage").unwrap();
        for profile in [Profile::V1, Profile::V2] {
            assert_eq!(header_name(&skill(&id, profile)), Some("connector-im-imgate-garage"));
            assert_eq!(
                header_name(&skill(&CardId::default(), profile)),
                Some("connector-im-imgate")
            );
            let parts = Parts {
                targets: vec![],
                auth_flows: vec![],
                tools: vec![TOOL_SEND, TOOL_REPLY, TOOL_FILE_SEND],
            };
            let text = crate::json::to_string(&card(&id, true, profile, parts));
            assert!(text.contains(r#""connector_card_id":"im.imgate.garage""#), "{text}");
            assert_eq!(
                text.matches(r#""related_skill_ids":["connector-im-imgate-garage"]"#)
                    .count(),
                3
            );
        }
        assert!(crate::json::to_string(&health(&id)).contains(r#""connector_card_id":"im.imgate.garage""#));
    }
}
