//! Gateway payloads (`{op, d, s, t}`) and Discord messages, from the Gateway's `MESSAGE_CREATE`
//! or from a channel's history. Everything here is outside input: every field is optional until
//! checked, every text bounded, every ID a snowflake (digits only) before it names a key, a file
//! or a URL path.

use crate::json::{self, Object, Value};
pub use crate::providers::inbound::bounded;
use crate::providers::inbound::safe_id;

/// A message's text is cut at this many bytes (Discord's own cap is 2,000 characters for a
/// person, 4,000 with Nitro).
pub const MAX_TEXT_BYTES: usize = 16 << 10;
/// Mentioned users whose names are kept from one message.
pub const MAX_MENTIONS: usize = 16;
/// Discord's epoch (2015-01-01), the zero of a snowflake's timestamp (reference.mdx).
const DISCORD_EPOCH_MS: u64 = 1_420_070_400_000;
/// A URL longer than this is not an attachment's.
const MAX_URL: usize = 2048;

/// One Gateway payload, as imgate reads it (gateway-events.mdx "Payload Structure").
#[derive(Debug, PartialEq)]
pub enum Frame {
    /// op 10: heartbeat every this many milliseconds.
    Hello { heartbeat_interval: u64 },
    /// op 11: the last heartbeat was received.
    HeartbeatAck,
    /// op 1: the server asks for a heartbeat now.
    Heartbeat,
    /// op 7: reconnect and resume.
    Reconnect,
    /// op 9: the session is invalid; `resumable` (its `d`) says whether RESUME may work.
    InvalidSession { resumable: bool },
    /// op 0: an event and its sequence number.
    Dispatch { seq: Option<u64>, event: Event },
    /// Another op, or a payload that cannot be read.
    Other(String),
}

/// A dispatched event, as imgate sees it.
#[derive(Debug, PartialEq)]
pub enum Event {
    /// The session is new: its ID, the URL to resume it on, and the bot's user ID.
    Ready {
        session_id: String,
        resume_url: String,
        user_id: String,
    },
    /// A RESUME ended: the missed events were replayed.
    Resumed,
    Message(Box<Message>),
    /// `MESSAGE_CREATE` that cannot be read (no ID or channel): why.
    Unreadable(&'static str),
    /// Any other event (edits, deletes, typing, guilds): only its sequence number matters.
    Other,
}

/// A message as Discord shows it in `MESSAGE_CREATE` or in a channel's history.
#[derive(Debug, PartialEq, Clone)]
pub struct Message {
    /// The snowflake: the message's ID and its place in the channel's order.
    pub id: u64,
    pub channel: String,
    /// Absent in DMs.
    pub guild: Option<String>,
    /// 0 (a message) or 19 (a reply) are people's messages; the others are notices.
    pub kind: u64,
    pub author_id: String,
    /// The member's nickname, else the global name, else the username.
    pub author_name: String,
    pub author_bot: bool,
    /// Posted by a webhook (an integration), not by a user.
    pub webhook: bool,
    pub content: String,
    /// (user ID, name) of the users it mentions, at most `MAX_MENTIONS`.
    pub mentions: Vec<(String, String)>,
    /// The first attachment.
    pub attachment: Option<Attachment>,
    /// The message it answers, in the same channel.
    pub reply_to: Option<u64>,
}

/// A message's attachment before it is fetched: its URL is signed and expires.
#[derive(Debug, PartialEq, Clone)]
pub struct Attachment {
    pub filename: String,
    pub content_type: String,
    pub url: String,
    pub size: u64,
}

impl Message {
    /// Unix ms of its creation, from its snowflake.
    pub fn created_ms(&self) -> u64 {
        created_ms(self.id)
    }

    /// A person's message (or an integration's), not a notice (a join, a pin, a thread made).
    pub fn is_post(&self) -> bool {
        matches!(self.kind, 0 | 19)
    }
}

/// Unix ms of a snowflake's creation.
pub fn created_ms(snowflake: u64) -> u64 {
    (snowflake >> 22).saturating_add(DISCORD_EPOCH_MS)
}

/// The smallest snowflake minted at Unix ms `ms` (a history read `after` it starts there).
pub fn snowflake_at(ms: u64) -> u64 {
    ms.saturating_sub(DISCORD_EPOCH_MS).min(u64::MAX >> 22) << 22
}

/// A snowflake: 1 to 20 digits that fit a `u64`.
pub fn snowflake(id: &str) -> Option<u64> {
    if id.is_empty() || id.len() > 20 || !id.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    id.parse().ok().filter(|&n| n > 0)
}

/// Reads one text frame of the Gateway.
pub fn read_frame(text: &str) -> Frame {
    let Ok(v) = json::parse(text) else {
        return Frame::Other("not JSON".into());
    };
    let Some(o) = json::as_object(&v) else {
        return Frame::Other("not an object".into());
    };
    let Some(op) = json::get_u64(o, "op") else {
        return Frame::Other("no op".into());
    };
    let d = json::get(o, "d");
    match op {
        0 => {
            let seq = json::get_u64(o, "s");
            let event = match (json::get_str(o, "t"), d.and_then(json::as_object)) {
                (Some("READY"), Some(d)) => ready_of(d),
                (Some("RESUMED"), _) => Event::Resumed,
                (Some("MESSAGE_CREATE"), Some(d)) => match message_of(d) {
                    Ok(m) => Event::Message(Box::new(m)),
                    Err(why) => Event::Unreadable(why),
                },
                _ => Event::Other,
            };
            Frame::Dispatch { seq, event }
        }
        1 => Frame::Heartbeat,
        7 => Frame::Reconnect,
        9 => Frame::InvalidSession {
            resumable: matches!(d, Some(Value::Bool(true))),
        },
        10 => match d
            .and_then(json::as_object)
            .and_then(|d| json::get_u64(d, "heartbeat_interval"))
        {
            Some(heartbeat_interval) => Frame::Hello { heartbeat_interval },
            None => Frame::Other("a hello without heartbeat_interval".into()),
        },
        11 => Frame::HeartbeatAck,
        other => Frame::Other(format!("op {other}")),
    }
}

fn ready_of(d: &Object) -> Event {
    let session_id = json::get_str(d, "session_id").filter(|s| safe_id(s, 128));
    let resume_url = json::get_str(d, "resume_gateway_url")
        .filter(|u| u.len() <= MAX_URL && (u.starts_with("wss://") || u.starts_with("ws://")));
    let user_id = json::get_obj(d, "user")
        .and_then(|u| json::get_str(u, "id"))
        .filter(|id| snowflake(id).is_some());
    match (session_id, resume_url, user_id) {
        (Some(s), Some(r), Some(u)) => Event::Ready {
            session_id: s.to_string(),
            resume_url: r.to_string(),
            user_id: u.to_string(),
        },
        _ => Event::Unreadable("a READY without its session ID, resume URL or user"),
    }
}

/// Reads one message (`MESSAGE_CREATE`'s `d`, or an element of a history answer). The `Err`
/// says why it cannot be stored.
pub fn message_of(m: &Object) -> Result<Message, &'static str> {
    let id = json::get_str(m, "id").and_then(snowflake).ok_or("no usable ID")?;
    let channel = json::get_str(m, "channel_id")
        .filter(|c| snowflake(c).is_some())
        .ok_or("no usable channel")?;
    let guild = json::get_str(m, "guild_id").filter(|g| snowflake(g).is_some());
    let author = json::get_obj(m, "author");
    let author_id = author
        .and_then(|a| json::get_str(a, "id"))
        .filter(|a| snowflake(a).is_some())
        .unwrap_or_default();
    let nick = json::get_obj(m, "member").and_then(|member| name_in(member, &["nick"]));
    let author_name = nick
        .or_else(|| author.and_then(|a| name_in(a, &["global_name", "username"])))
        .unwrap_or_default();
    let mentions = match json::get(m, "mentions") {
        Some(Value::Array(list)) => list
            .iter()
            .filter_map(json::as_object)
            .filter_map(|u| {
                let id = json::get_str(u, "id").filter(|i| snowflake(i).is_some())?;
                let nick = json::get_obj(u, "member").and_then(|member| name_in(member, &["nick"]));
                let name = nick.or_else(|| name_in(u, &["global_name", "username"]))?;
                Some((id.to_string(), name))
            })
            .take(MAX_MENTIONS)
            .collect(),
        _ => Vec::new(),
    };
    let attachment = match json::get(m, "attachments") {
        Some(Value::Array(list)) => list.iter().filter_map(json::as_object).find_map(attachment_of),
        _ => None,
    };
    let reply_to = json::get_obj(m, "message_reference")
        .filter(|r| json::get_str(r, "channel_id").is_none_or(|c| c == channel))
        .and_then(|r| json::get_str(r, "message_id"))
        .and_then(snowflake);
    Ok(Message {
        id,
        channel: channel.to_string(),
        guild: guild.map(str::to_string),
        kind: json::get_u64(m, "type").unwrap_or(0),
        author_id: author_id.to_string(),
        author_name,
        author_bot: author.is_some_and(|a| matches!(a.get("bot"), Some(Value::Bool(true)))),
        webhook: json::get_str(m, "webhook_id").is_some(),
        content: bounded(json::get_str(m, "content").unwrap_or_default(), MAX_TEXT_BYTES),
        mentions,
        attachment,
        reply_to,
    })
}

/// The first non-empty name among `keys`, at most 80 characters, without control characters.
fn name_in(o: &Object, keys: &[&str]) -> Option<String> {
    keys.iter()
        .filter_map(|k| json::get_str(o, k))
        .find(|n| !n.trim().is_empty())
        .map(|n| n.chars().filter(|c| !c.is_control()).take(80).collect())
}

fn attachment_of(a: &Object) -> Option<Attachment> {
    let url = json::get_str(a, "url")?;
    if url.len() > MAX_URL || !(url.starts_with("https://") || url.starts_with("http://")) {
        return None;
    }
    Some(Attachment {
        filename: bounded(json::get_str(a, "filename").unwrap_or("file"), 255),
        content_type: bounded(
            json::get_str(a, "content_type").unwrap_or("application/octet-stream"),
            128,
        ),
        url: url.to_string(),
        size: json::get_u64(a, "size").unwrap_or(0),
    })
}

/// Discord's markup as a person reads it: `<@123>` and `<@!123>` as `@name` (from the
/// message's mentions), `<@&123>` as `@role`, `<#123>` as `#channel`, a custom emoji
/// `<:name:123>` as `:name:`; the rest as written.
pub fn readable(text: &str, mentions: &[(String, String)]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(open) = rest.find('<') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let token = after.find('>').map(|close| &after[..close]).filter(|t| t.len() <= 64);
        let shown = token.and_then(|t| token_shown(t, mentions));
        match (token, shown) {
            (Some(t), Some(shown)) => {
                out.push_str(&shown);
                rest = &after[t.len() + 1..];
            }
            _ => {
                out.push('<');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

fn token_shown(token: &str, mentions: &[(String, String)]) -> Option<String> {
    if let Some(role) = token.strip_prefix("@&") {
        return snowflake(role).map(|_| "@role".to_string());
    }
    if let Some(user) = token.strip_prefix('@') {
        let user = user.strip_prefix('!').unwrap_or(user);
        snowflake(user)?;
        let name = mentions.iter().find(|(id, _)| id == user).map(|(_, n)| n.as_str());
        return Some(format!("@{}", name.unwrap_or("user")));
    }
    if let Some(channel) = token.strip_prefix('#') {
        return snowflake(channel).map(|_| "#channel".to_string());
    }
    let emoji = token.strip_prefix("a:").or_else(|| token.strip_prefix(':'))?;
    let (name, id) = emoji.split_once(':')?;
    let plain = !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    (plain && snowflake(id).is_some()).then(|| format!(":{name}:"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(v: serde_json::Value) -> Frame {
        read_frame(&v.to_string())
    }

    #[test]
    fn gateway_payloads_are_read_by_their_op() {
        assert_eq!(
            frame(serde_json::json!({"op": 10, "d": {"heartbeat_interval": 41250}, "s": null, "t": null})),
            Frame::Hello {
                heartbeat_interval: 41250
            }
        );
        assert_eq!(frame(serde_json::json!({"op": 11})), Frame::HeartbeatAck);
        assert_eq!(frame(serde_json::json!({"op": 1, "d": null})), Frame::Heartbeat);
        assert_eq!(frame(serde_json::json!({"op": 7, "d": null})), Frame::Reconnect);
        assert_eq!(
            frame(serde_json::json!({"op": 9, "d": false})),
            Frame::InvalidSession { resumable: false }
        );
        assert_eq!(
            frame(serde_json::json!({"op": 9, "d": true})),
            Frame::InvalidSession { resumable: true }
        );
        let ready = frame(serde_json::json!({"op": 0, "s": 1, "t": "READY", "d": {
            "v": 10, "session_id": "abc123", "resume_gateway_url": "wss://gateway-us-east1-b.discord.gg",
            "user": {"id": "1098765432109876543", "username": "bot", "bot": true}, "guilds": []}}));
        assert_eq!(
            ready,
            Frame::Dispatch {
                seq: Some(1),
                event: Event::Ready {
                    session_id: "abc123".into(),
                    resume_url: "wss://gateway-us-east1-b.discord.gg".into(),
                    user_id: "1098765432109876543".into()
                }
            }
        );
        let bad_ready = frame(serde_json::json!({"op": 0, "s": 1, "t": "READY", "d": {
            "session_id": "a\"b", "resume_gateway_url": "https://x", "user": {"id": "x"}}}));
        assert!(matches!(
            bad_ready,
            Frame::Dispatch {
                event: Event::Unreadable(_),
                ..
            }
        ));
    }

    #[test]
    fn malformed_frames_are_other_and_never_a_message() {
        for text in [
            "",
            "{",
            "[]",
            "null",
            "{\"op\":\"0\"}",
            "{\"op\":-1}",
            "{\"op\":10,\"d\":{}}",
            "{\"op\":0,\"t\":\"MESSAGE_CREATE\",\"d\":[]}",
        ] {
            let f = read_frame(text);
            assert!(
                !matches!(
                    f,
                    Frame::Dispatch {
                        event: Event::Message(_),
                        ..
                    } | Frame::Hello { .. }
                ),
                "{text}: {f:?}"
            );
        }
        let no_channel = frame(serde_json::json!({"op": 0, "s": 5, "t": "MESSAGE_CREATE", "d": {"id": "12"}}));
        assert_eq!(
            no_channel,
            Frame::Dispatch {
                seq: Some(5),
                event: Event::Unreadable("no usable channel")
            }
        );
    }

    #[test]
    fn a_message_keeps_its_snowflake_author_mentions_first_attachment_and_reply() {
        let d = serde_json::json!({
            "id": "1180000000000000001", "channel_id": "222", "guild_id": "333", "type": 19,
            "author": {"id": "444", "username": "ann", "global_name": "Ann B"},
            "member": {"nick": "annie"},
            "content": "hi <@555> and <@!666> in <#777> <@&888> <:blob:999> <a:dance:123> <notatoken",
            "mentions": [{"id": "555", "username": "bob"}, {"id": "666", "username": "cy", "global_name": "Cy"}],
            "attachments": [{"id": "1", "filename": "a.png", "content_type": "image/png", "size": 10,
                             "url": "https://cdn.discordapp.com/attachments/1/2/a.png?ex=1&is=2&hm=3"}],
            "message_reference": {"message_id": "1170000000000000000", "channel_id": "222"}
        });
        let m = message_of(json::as_object(&json::parse(&d.to_string()).unwrap()).unwrap()).unwrap();
        assert_eq!(m.id, 1_180_000_000_000_000_001);
        assert_eq!((m.channel.as_str(), m.guild.as_deref()), ("222", Some("333")));
        assert_eq!(m.author_name, "annie", "the member's nickname first");
        assert_eq!(m.reply_to, Some(1_170_000_000_000_000_000));
        assert!(m.is_post() && !m.author_bot && !m.webhook);
        assert_eq!(m.attachment.as_ref().map(|a| a.filename.as_str()), Some("a.png"));
        assert_eq!(
            readable(&m.content, &m.mentions),
            "hi @bob and @Cy in #channel @role :blob: :dance: <notatoken"
        );
        assert_eq!(m.created_ms(), (1_180_000_000_000_000_001u64 >> 22) + DISCORD_EPOCH_MS);
        assert_eq!(created_ms(snowflake_at(1_700_000_000_000)), 1_700_000_000_000);
    }

    #[test]
    fn ids_that_are_not_snowflakes_are_refused() {
        for bad in [
            "",
            "0",
            "-1",
            "12a",
            "123456789012345678901",
            "99999999999999999999",
            "1 2",
        ] {
            assert_eq!(snowflake(bad), None, "{bad}");
        }
        assert_eq!(snowflake("18446744073709551615"), Some(u64::MAX));
        let d = serde_json::json!({"id": "../x", "channel_id": "1"});
        assert!(message_of(json::as_object(&json::parse(&d.to_string()).unwrap()).unwrap()).is_err());
        let long = "é".repeat(MAX_TEXT_BYTES);
        let d = serde_json::json!({"id": "5", "channel_id": "1", "content": long});
        let m = message_of(json::as_object(&json::parse(&d.to_string()).unwrap()).unwrap()).unwrap();
        assert!(m.content.len() <= MAX_TEXT_BYTES);
    }
}
