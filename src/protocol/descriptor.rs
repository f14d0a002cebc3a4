//! Connection Descriptor `xagent.connection/v2` (common protocol section 9).

use crate::json::{arr, obj, opt_s, s, strs, Value};

/// Display-level target information; only redacted hints, never credentials.
pub struct Target {
    pub provider: String,
    pub label: String,
    pub display_name: String,
    pub account_hint: Option<String>,
}

#[derive(Clone)]
pub struct ToolState {
    pub available: bool,
    pub reason: Option<String>,
}

impl ToolState {
    pub fn available() -> ToolState {
        ToolState {
            available: true,
            reason: None,
        }
    }
    pub fn unavailable(reason: &str) -> ToolState {
        ToolState {
            available: false,
            reason: Some(reason.to_string()),
        }
    }
}

pub fn build(
    card_id: &str,
    connector_id: &str,
    cch: &str,
    profiles: &[String],
    status: &str,
    target: &Target,
    tools: &[(&str, ToolState)],
) -> Value {
    obj([
        ("schema", s("xagent.connection/v2")),
        (
            "connection",
            obj([
                ("connector_card_id", s(card_id)),
                ("connector_id", s(connector_id)),
                ("connector_channel_id", s(cch)),
                ("target_type", s("im")),
                ("profiles", strs(profiles.iter().map(String::as_str))),
                ("status", s(status)),
            ]),
        ),
        (
            "target",
            obj([
                ("provider", s(&target.provider)),
                ("label", s(&target.label)),
                ("display_name", s(&target.display_name)),
                ("account_hint", opt_s(target.account_hint.clone())),
            ]),
        ),
        (
            "tools",
            arr(tools.iter().map(|(id, st)| {
                obj([
                    ("tool_id", s(*id)),
                    ("status", s(if st.available { "available" } else { "unavailable" })),
                    (
                        "target_permission_state",
                        s(if st.available { "granted" } else { "unknown" }),
                    ),
                    ("reason", opt_s(st.reason.clone())),
                ])
            })),
        ),
    ])
}
