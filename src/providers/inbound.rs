//! What every IM provider's inbound message becomes: the stored event (`Inbound`, the outbox
//! payload of every provider) and its rendering as a `message.push` payload with every field of
//! IM profile v1 section 5.

use crate::json::{self, arr, b, obj, opt_s, s, strs, Value};
use crate::outbox::StoredMessage;
use crate::protocol::{PROFILE_V1, TOOL_REPLY};

/// A validated inbound message; stored as is in the outbox and rendered at push time.
#[derive(Debug, PartialEq, miniserde::Serialize, miniserde::Deserialize)]
pub struct Inbound {
    pub message_id: String,
    pub sender_id: String,
    pub sender_name: Option<String>,
    pub chat_id: Option<String>,
    pub chat_type: String,
    pub message_type: String,
    pub text: String,
    pub event_time: Option<u64>,
    /// Files of the message, already in imgate's file cache.
    pub files: Option<Vec<FileItem>>,
}

/// One file of an inbound message (IM profile v1 section 9).
#[derive(Debug, Clone, PartialEq, miniserde::Serialize, miniserde::Deserialize)]
pub struct FileItem {
    pub file_ref: String,
    pub kind: String,
    pub filename: String,
    pub mime_type: String,
    pub byte_size: u64,
    pub expires_at: u64,
}

impl FileItem {
    /// A file just stored in the cache, as a message lists it.
    pub fn cached(file_ref: String, rec: crate::files::FileRecord) -> FileItem {
        FileItem {
            file_ref,
            kind: rec.kind,
            filename: rec.filename,
            mime_type: rec.mime_type,
            byte_size: rec.byte_size,
            expires_at: rec.expires_at,
        }
    }
}

impl Inbound {
    /// The event a stored message carries; `None` for a record this build cannot read.
    pub fn of(stored: &StoredMessage) -> Option<Inbound> {
        miniserde::json::from_str(&stored.payload).ok()
    }
}

/// Who the message is from and what the agent may do with it: the parts of a push that come
/// from the provider of its source, not from the message.
pub struct Origin<'a> {
    pub provider: &'a str,
    /// The source's name as the agent sees it (`Alerts`, `Telegram`).
    pub label: &'a str,
    /// The tools the agent may use on this channel.
    pub tools: &'a [&'static str],
    /// `[server] public_url` (empty: `download_url` stays relative, xAgent resolves it).
    pub base: &'a str,
    /// The Skill that tells the agent how to answer (named after `[server] card_id`).
    pub skill: &'a str,
}

/// Shows a few characters of an identifier, enough to tell senders apart.
pub fn redact(id: &str) -> String {
    let chars: Vec<char> = id.chars().collect();
    if chars.len() <= 6 {
        "***".into()
    } else {
        let head: String = chars[..2].iter().collect();
        let tail: String = chars[chars.len() - 2..].iter().collect();
        format!("{head}***{tail}")
    }
}

/// The `message.push` payload (IM profile v1 sections 5, 6 and 9) of one stored message.
pub fn render(origin: &Origin, m: &Inbound, stored: &StoredMessage) -> Value {
    let h = &stored.header;
    let (label, provider, base) = (origin.label, origin.provider, origin.base);
    let sender = m.sender_name.clone().unwrap_or_else(|| redact(&m.sender_id));
    let user_text = if m.text.is_empty() { "none" } else { m.text.as_str() };
    let text = format!(
        "User message from {}:\nSender: {}\nConversation type: {}\nMessage type: {}\nUser text: {}",
        label, sender, m.chat_type, m.message_type, user_text
    );
    let reply = h.reply_ref.as_deref().map_or(Value::Null, |r| {
        obj([("required", b(true)), ("tool_id", s(TOOL_REPLY)), ("reply_ref", s(r))])
    });
    obj([
        ("provider", s(provider)),
        ("profile", s(PROFILE_V1)),
        ("event_kind", s("im.message.received")),
        ("message_id", s(&m.message_id)),
        ("source", s(label)),
        ("sender_id", s(&m.sender_id)),
        ("sender_name", s(&sender)),
        ("display_name", s(&sender)),
        ("chat_id", opt_s(m.chat_id.clone())),
        ("chat_type", s(&m.chat_type)),
        ("message_type", s(&m.message_type)),
        ("raw_text", s(&m.text)),
        ("text", s(text)),
        ("reply", reply),
        (
            "files",
            m.files
                .as_ref()
                .filter(|f| !f.is_empty())
                .map_or(Value::Null, |f| arr(f.iter().map(|f| file_json(f, base)))),
        ),
        (
            "skill",
            obj([
                ("skill_id", s(origin.skill)),
                ("name", s(origin.skill)),
                ("tool_ids", strs(origin.tools.iter().copied())),
            ]),
        ),
        ("event_time", m.event_time.map_or(Value::Null, json::n)),
        ("accepted_at", json::n(h.accepted_at)),
        ("expires_at", json::n(h.expires_at)),
    ])
}

/// One file as both profiles show it: the file cache's reference and where to download it.
pub fn file_json(f: &FileItem, base: &str) -> Value {
    obj([
        ("type", s(&f.kind)),
        ("file_ref", s(&f.file_ref)),
        ("filename", s(&f.filename)),
        ("mime_type", s(&f.mime_type)),
        ("byte_size", json::n(f.byte_size)),
        ("expires_at", json::n(f.expires_at)),
        ("download_url", s(format!("{base}/files/refs/{}", f.file_ref))),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_hides_the_middle_of_an_id() {
        assert_eq!(redact("1234567890"), "12***90");
        assert_eq!(redact("abc"), "***");
    }
}
