//! The wire: packet envelope, Card, Skill, health, Descriptor and payload builders.
//!
//! Everything here follows `reference/xagent/connector-common-protocol-3.0.md` and IM Profile v1;
//! nothing here knows about sockets or storage.

pub mod card;
pub mod descriptor;

use crate::ids;
use crate::json::{self, Object, Value};

pub const PACKET_SCHEMA: &str = "xagent.connector.packet/v1";
pub const SUBPROTOCOL: &str = "xagent.connector.packet.v1";
pub const PROTOCOL_VERSION: &str = "3.0";
/// The profile every `message.push` names (IM profile v1).
pub const PROFILE_V1: &str = "xagent.im.v1";
pub const PROFILE_V2: &str = "xagent.im.v2";

/// The IM profile a deployment speaks (`[xagent] profile`); the Card declares exactly it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Profile {
    /// `message.push` behind a ping/pong barrier; the agent answers with tools.
    V1,
    /// `chat.message` both ways with acks, assistant deltas and activity.
    V2,
}

impl Profile {
    pub fn as_str(self) -> &'static str {
        match self {
            Profile::V1 => PROFILE_V1,
            Profile::V2 => PROFILE_V2,
        }
    }

    pub fn parse(s: &str) -> Option<Profile> {
        match s {
            PROFILE_V1 => Some(Profile::V1),
            PROFILE_V2 => Some(Profile::V2),
            _ => None,
        }
    }
}
/// This device's `connector_card_id` (`[server] card_id`) and the Skill name derived from it.
///
/// xAgent keeps one Connector Server per card ID and lets a newer one replace an older one, so
/// two boards of one household need two IDs (`im.imgate.kitchen`, `im.imgate.garage`). The Skill
/// name follows the protocol's convention (section 4.2): `connector-` and the card ID with
/// periods and underscores as hyphens; the Skill header, the Card's `related_skill_ids` and every
/// message's `skill_id` use it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CardId {
    id: String,
    skill: String,
}

impl CardId {
    pub const DEFAULT: &'static str = "im.imgate";
    /// Long enough for a fleet's names, short enough for xAgent's lists and Skill names.
    pub const MAX_LEN: usize = 64;

    /// `[a-z0-9._-]`, 1 to 64 characters, starting with a letter or digit.
    pub fn parse(id: &str) -> Result<CardId, String> {
        let allowed = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-');
        if id.is_empty() || id.len() > Self::MAX_LEN {
            return Err(format!("must be 1 to {} characters", Self::MAX_LEN));
        }
        if !id.chars().all(allowed) {
            return Err("may only hold a-z, 0-9, `.`, `_` and `-`".into());
        }
        if !id.starts_with(|c: char| c.is_ascii_alphanumeric()) {
            return Err("must start with a letter or digit".into());
        }
        let skill = format!("connector-{}", id.replace(['.', '_'], "-"));
        Ok(CardId {
            id: id.to_string(),
            skill,
        })
    }

    pub fn as_str(&self) -> &str {
        &self.id
    }

    /// `connector-im-imgate` for `im.imgate`.
    pub fn skill_name(&self) -> &str {
        &self.skill
    }
}

impl Default for CardId {
    fn default() -> CardId {
        CardId {
            id: Self::DEFAULT.to_string(),
            skill: "connector-im-imgate".to_string(),
        }
    }
}

impl std::fmt::Display for CardId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.id)
    }
}

pub const TOOL_SEND: &str = "imgate_message_send";
pub const TOOL_REPLY: &str = "imgate_message_reply";
pub const TOOL_FILE_SEND: &str = "imgate_file_send";
/// Every tool a Card may declare, in the order it lists them.
pub const ALL_TOOLS: [&str; 3] = [TOOL_SEND, TOOL_REPLY, TOOL_FILE_SEND];

/// Protocol error codes (common protocol section 8.23) plus imgate's own stable ones.
pub mod code {
    pub const INVALID_PACKET: &str = "invalid_packet";
    pub const HELLO_REQUIRED: &str = "hello_required";
    pub const CARD_ID_MISMATCH: &str = "connector_card_id_mismatch";
    pub const UNSUPPORTED_PROTOCOL_VERSION: &str = "unsupported_protocol_version";
    pub const CHANNEL_NOT_OPEN: &str = "channel_not_open";
    pub const CHANNEL_ID_REQUIRED: &str = "connector_channel_id_required";
    pub const CHANNEL_UNAVAILABLE: &str = "connector_channel_unavailable";
    pub const CONNECTION_NOT_AUTHENTICATED: &str = "connection_not_authenticated";
    pub const AUTH_SESSION_NOT_FOUND: &str = "auth_session_not_found";
    pub const TOOL_INVOKE_FAILED: &str = "tool_invoke_failed";
    pub const UNSUPPORTED_PACKET: &str = "unsupported_packet";
    pub const UNKNOWN_TOOL: &str = "unknown_tool";
    pub const INVALID_ARGUMENTS: &str = "invalid_arguments";
    pub const REPLY_REF_INVALID: &str = "reply_ref_invalid";
    pub const FILE_REF_INVALID: &str = "file_ref_invalid";
    pub const UPSTREAM_REJECTED: &str = "upstream_rejected";
    pub const UPSTREAM_UNREACHABLE: &str = "upstream_unreachable";
    /// Too many tool calls in flight on the connection: the same call may be made again.
    pub const BUSY: &str = "busy";
}

/// The longest `packet_id`, `request_id`, `reply_to`, `type` or `connector_channel_id` a packet
/// may carry.
pub const MAX_ENVELOPE_FIELD: usize = 256;

/// One data-plane packet (common protocol section 7).
#[derive(Debug, Clone)]
pub struct Packet {
    pub packet_id: String,
    pub request_id: Option<String>,
    pub reply_to: Option<String>,
    pub channel: Option<String>,
    pub kind: String,
    pub time: Option<u64>,
    pub payload: Object,
    /// A payload serialized ahead of the packet (off the executor); sent instead of `payload`.
    pub rendered: Option<Rendered>,
    pub error: Option<(String, String)>,
}

/// A packet payload already serialized: a JSON object, as `json::ObjWriter` wrote it.
#[derive(Debug, Clone)]
pub struct Rendered(String);

impl Rendered {
    /// Bytes of the serialized payload.
    pub fn size(&self) -> usize {
        self.0.len()
    }
}

impl From<json::ObjWriter> for Rendered {
    fn from(w: json::ObjWriter) -> Rendered {
        Rendered(w.finish())
    }
}

impl Packet {
    /// A new packet from imgate with a fresh `packet_id` and the current time.
    pub fn new(kind: &str) -> Packet {
        Packet {
            packet_id: ids::short("pkt_"),
            request_id: None,
            reply_to: None,
            channel: None,
            kind: kind.to_string(),
            time: Some(ids::now_ms()),
            payload: Object::new(),
            rendered: None,
            error: None,
        }
    }

    /// The answer to `req`: `request_id` unchanged, `reply_to` its `packet_id`, same channel.
    pub fn answer(req: &Packet, kind: &str) -> Packet {
        let mut p = Packet::new(kind);
        p.request_id = req.request_id.clone();
        p.reply_to = Some(req.packet_id.clone());
        p.channel = req.channel.clone().filter(|c| !c.is_empty());
        p
    }

    /// A `type = error` packet answering `req` (protocol, identity, routing and order errors).
    pub fn error_for(req: Option<&Packet>, code: &str, message: impl Into<String>) -> Packet {
        let mut p = match req {
            Some(r) => Packet::answer(r, "error"),
            None => Packet::new("error"),
        };
        p.error = Some((code.to_string(), message.into()));
        p
    }

    pub fn with_channel(mut self, cch: &str) -> Packet {
        self.channel = Some(cch.to_string());
        self
    }

    pub fn with_payload(mut self, payload: Value) -> Packet {
        if let Value::Object(o) = payload {
            self.payload = o;
        }
        self
    }

    pub fn with_rendered(mut self, payload: Rendered) -> Packet {
        self.rendered = Some(payload);
        self
    }

    pub fn with_error(mut self, code: &str, message: impl Into<String>) -> Packet {
        self.error = Some((code.to_string(), message.into()));
        self
    }

    /// Parses one text frame; the `Err` is the message for an `invalid_packet` error.
    pub fn parse(text: &str) -> Result<Packet, String> {
        let v = json::parse(text).map_err(|e| match e.as_str() {
            json::NOT_JSON => "packet is not valid JSON".to_string(),
            _ => e,
        })?;
        let Value::Object(mut o) = v else {
            return Err("packet must be a JSON object".into());
        };
        if json::get_str(&o, "schema") != Some(PACKET_SCHEMA) {
            return Err(format!("schema must be {PACKET_SCHEMA}"));
        }
        // Envelope fields are IDs and names; answers echo some of them (`request_id`), so
        // each is bounded: a pong is never larger than a small, fixed size.
        let text_field = |o: &Object, k: &str| -> Result<Option<String>, String> {
            match o.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) if s.len() > MAX_ENVELOPE_FIELD => {
                    Err(format!("{k} is longer than {MAX_ENVELOPE_FIELD} bytes"))
                }
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(format!("{k} must be a string")),
            }
        };
        let packet_id = text_field(&o, "packet_id")?.filter(|s| !s.is_empty());
        let kind = text_field(&o, "type")?.filter(|s| !s.is_empty());
        let (Some(packet_id), Some(kind)) = (packet_id, kind) else {
            return Err("packet_id and type are required".into());
        };
        let payload = match o.remove("payload") {
            None | Some(Value::Null) => Object::new(),
            Some(Value::Object(p)) => p,
            Some(_) => return Err("payload must be an object".into()),
        };
        let error = json::get_obj(&o, "error").map(|e| {
            (
                json::get_str(e, "code").unwrap_or_default().to_string(),
                json::get_str(e, "message").unwrap_or_default().to_string(),
            )
        });
        Ok(Packet {
            request_id: text_field(&o, "request_id")?,
            reply_to: text_field(&o, "reply_to")?,
            channel: text_field(&o, "connector_channel_id")?,
            time: json::get_u64(&o, "time"),
            packet_id,
            kind,
            payload,
            rendered: None,
            error,
        })
    }

    /// The packet as sent, written field by field. It takes the packet: its payload moves
    /// into the envelope instead of being copied (a `message.push` is most of its bytes).
    pub fn into_json(self) -> String {
        let payload = match self.rendered {
            Some(Rendered(text)) => Some(text),
            None if !self.payload.is_empty() || self.error.is_none() => {
                Some(json::to_string(&Value::Object(self.payload)))
            }
            None => None,
        };
        let mut out = String::with_capacity(256 + payload.as_ref().map_or(0, String::len));
        fn field(out: &mut String, key: &str, value: &str) {
            out.push(if out.is_empty() { '{' } else { ',' });
            json::push_str(out, key);
            out.push(':');
            json::push_str(out, value);
        }
        field(&mut out, "schema", PACKET_SCHEMA);
        field(&mut out, "packet_id", &self.packet_id);
        for (key, value) in [
            ("request_id", &self.request_id),
            ("reply_to", &self.reply_to),
            ("connector_channel_id", &self.channel),
        ] {
            if let Some(v) = value {
                field(&mut out, key, v);
            }
        }
        field(&mut out, "type", &self.kind);
        if let Some(t) = self.time {
            out.push_str(",\"time\":");
            out.push_str(&t.to_string());
        }
        if let Some(p) = payload {
            out.push_str(",\"payload\":");
            out.push_str(&p);
        }
        if let Some((code, message)) = &self.error {
            out.push_str(",\"error\":");
            out.push_str(&json::to_string(&json::obj([
                ("code", json::s(code)),
                ("message", json::s(message)),
            ])));
        }
        out.push('}');
        out
    }

    /// The non-empty envelope channel, if any.
    pub fn channel_id(&self) -> Option<&str> {
        self.channel.as_deref().filter(|c| !c.is_empty())
    }
}

/// Compares dotted versions numerically: "3.0" < "3.1" < "10.0".
pub fn version_at_least(v: &str, floor: &str) -> bool {
    let parse = |s: &str| -> Option<Vec<u64>> { s.split('.').map(|p| p.trim().parse().ok()).collect() };
    match (parse(v), parse(floor)) {
        (Some(a), Some(b)) => {
            let len = a.len().max(b.len());
            let pad = |x: &Vec<u64>, i: usize| x.get(i).copied().unwrap_or(0);
            (0..len).map(|i| pad(&a, i).cmp(&pad(&b, i))).find(|o| o.is_ne()) != Some(std::cmp::Ordering::Less)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_rejects_each_broken_envelope_with_a_reason() {
        for bad in [
            "not json",
            "[]",
            r#"{"packet_id":"p","type":"ping"}"#,
            r#"{"schema":"xagent.connector.packet/v1","type":"ping"}"#,
            r#"{"schema":"xagent.connector.packet/v1","packet_id":"p"}"#,
            r#"{"schema":"xagent.connector.packet/v1","packet_id":"p","type":"ping","payload":3}"#,
            r#"{"schema":"xagent.connector.packet/v1","packet_id":7,"type":"ping"}"#,
        ] {
            assert!(Packet::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn answer_keeps_request_id_and_points_reply_to_at_the_request() {
        let req = Packet::parse(
            r#"{"schema":"xagent.connector.packet/v1","packet_id":"p1","request_id":"r1","connector_channel_id":"c","type":"ping"}"#,
        )
        .unwrap();
        let a = Packet::answer(&req, "pong");
        assert_eq!(a.request_id.as_deref(), Some("r1"));
        assert_eq!(a.reply_to.as_deref(), Some("p1"));
        let back = Packet::parse(&a.into_json()).unwrap();
        assert_eq!(back.kind, "pong");
        assert_eq!(back.channel.as_deref(), Some("c"));
    }

    #[test]
    fn a_written_packet_parses_back_field_for_field_whatever_its_ids_hold() {
        let odd = "r\"1\\\n\u{1}caf\u{e9}";
        let mut p = Packet::new("error")
            .with_channel("c\"h")
            .with_error("invalid_packet", "bad \"thing\"");
        p.request_id = Some(odd.into());
        p.reply_to = Some("p\t1".into());
        let back = Packet::parse(&p.clone().into_json()).unwrap();
        assert_eq!(back.packet_id, p.packet_id);
        assert_eq!(back.request_id.as_deref(), Some(odd));
        assert_eq!(back.reply_to.as_deref(), Some("p\t1"));
        assert_eq!(back.channel.as_deref(), Some("c\"h"));
        assert_eq!(back.kind, "error");
        assert_eq!(back.time, p.time);
        assert_eq!(back.error, p.error);
        assert!(back.payload.is_empty());

        let mut payload = json::ObjWriter::default();
        payload.str("text", "hi \"you\"").num("n", 3);
        let pushed = Packet::new("message.push").with_rendered(payload.into());
        let back = Packet::parse(&pushed.into_json()).unwrap();
        assert_eq!(json::get_str(&back.payload, "text"), Some("hi \"you\""));
        assert_eq!(json::get_u64(&back.payload, "n"), Some(3));
        assert!(back.error.is_none());
        let empty = Packet::parse(&Packet::new("pong").into_json()).unwrap();
        assert!(empty.payload.is_empty() && empty.request_id.is_none());
    }

    #[test]
    fn packet_parser_survives_thousands_of_malformed_packets() {
        let seeds: [&[u8]; 3] = [
            br#"{"schema":"xagent.connector.packet/v1","packet_id":"p1","request_id":"r1","type":"tool.invoke","connector_channel_id":"c","payload":{"tool_id":"t","arguments":{"text":"x"},"context":{"tool_call_id":"k"}}}"#,
            br#"{"schema":"xagent.connector.packet/v1","packet_id":"p","type":"connector.hello","payload":{"supported_profiles":["xagent.im.v1"],"protocol_version":"3.0"}}"#,
            br#"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["#,
        ];
        for input in crate::testutil::mutations(&seeds, 3000, 7) {
            let _ = Packet::parse(&String::from_utf8_lossy(&input));
        }
        let deep = "[".repeat(100_000);
        assert!(
            Packet::parse(&deep).is_err(),
            "deep nesting is an error, not a stack overflow"
        );
    }

    #[test]
    fn card_id_names_its_skill_by_the_protocol_convention() {
        let kitchen = CardId::parse("im.imgate.kitchen_pi").unwrap();
        assert_eq!(kitchen.as_str(), "im.imgate.kitchen_pi");
        assert_eq!(kitchen.skill_name(), "connector-im-imgate-kitchen-pi");
        assert_eq!(CardId::default(), CardId::parse(CardId::DEFAULT).unwrap());
        assert_eq!(CardId::default().skill_name(), "connector-im-imgate");
        assert!(CardId::parse(&"a".repeat(CardId::MAX_LEN)).is_ok());
    }

    #[test]
    fn card_id_outside_its_character_set_is_refused() {
        for bad in [
            "",
            "Im.imgate",
            "im imgate",
            "im/imgate",
            ".imgate",
            "-x",
            "im.imgäte",
            "a\n",
        ] {
            assert!(CardId::parse(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(CardId::parse(&"a".repeat(CardId::MAX_LEN + 1)).is_err());
    }

    #[test]
    fn envelope_ids_are_bounded_so_answers_cannot_grow_with_them() {
        let ping = |id: &str| {
            format!(r#"{{"schema":"xagent.connector.packet/v1","packet_id":"p","request_id":"{id}","type":"ping"}}"#)
        };
        assert!(Packet::parse(&ping(&"r".repeat(MAX_ENVELOPE_FIELD))).is_ok());
        let err = Packet::parse(&ping(&"r".repeat(MAX_ENVELOPE_FIELD + 1))).unwrap_err();
        assert_eq!(err, "request_id is longer than 256 bytes");
        let deep = format!(
            r#"{{"schema":"xagent.connector.packet/v1","packet_id":"p","type":"ping","payload":{}}}"#,
            "[".repeat(1000)
        );
        assert_eq!(Packet::parse(&deep).unwrap_err(), "JSON nested deeper than 64 levels");
    }

    #[test]
    fn versions_compare_numerically() {
        assert!(version_at_least("3.0", "3.0"));
        assert!(version_at_least("3.1", "3.0"));
        assert!(version_at_least("10.0", "3.0"));
        assert!(!version_at_least("2.9", "3.0"));
        assert!(!version_at_least("three", "3.0"));
    }
}
