//! What every IM provider's inbound message becomes: the stored event (`Inbound`, the outbox
//! payload of every provider) and its rendering as a `message.push` payload with every field of
//! IM profile v1 section 5.

use crate::json::ObjWriter;
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

/// At most `max` bytes of `s`, cut at a character boundary: every text an IM system sends is
/// bounded with it before it is stored or shown.
pub fn bounded(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// 1 to `max` printable ASCII characters but a quote or a backslash: an ID from an IM system
/// that may go in a key, a log line or a frame (DingTalk's are base64 and `$:LWCP_v1:$…`).
pub fn printable(id: &str, max: usize) -> bool {
    !id.is_empty() && id.len() <= max && id.bytes().all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\')
}

/// 1 to `max` letters, digits and `.`, `_`, `-`: an ID from an IM system that may name a file,
/// a key or a URL parameter, with nothing that could escape one.
pub fn safe_id(id: &str, max: usize) -> bool {
    !id.is_empty()
        && id.len() <= max
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
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

/// The `message.push` payload (IM profile v1 sections 5, 6 and 9) of one stored message,
/// written straight to its JSON: a push is made for every message delivered.
pub fn render(origin: &Origin, m: &Inbound, stored: &StoredMessage) -> ObjWriter {
    let h = &stored.header;
    let (label, provider, base) = (origin.label, origin.provider, origin.base);
    let sender = m.sender_name.clone().unwrap_or_else(|| redact(&m.sender_id));
    let user_text = if m.text.is_empty() { "none" } else { m.text.as_str() };
    let text = format!(
        "User message from {}:\nSender: {}\nConversation type: {}\nMessage type: {}\nUser text: {}",
        label, sender, m.chat_type, m.message_type, user_text
    );
    let mut skill = ObjWriter::default();
    skill
        .str("skill_id", origin.skill)
        .str("name", origin.skill)
        .strs("tool_ids", origin.tools.iter().copied());
    let mut w = ObjWriter::with_capacity(640 + 2 * m.text.len());
    w.str("provider", provider)
        .str("profile", PROFILE_V1)
        .str("event_kind", "im.message.received")
        .str("message_id", &m.message_id)
        .str("source", label)
        .str("sender_id", &m.sender_id)
        .str("sender_name", &sender)
        .str("display_name", &sender)
        .opt_str("chat_id", m.chat_id.as_deref())
        .str("chat_type", &m.chat_type)
        .str("message_type", &m.message_type)
        .str("raw_text", &m.text)
        .str("text", &text);
    if let Some(r) = h.reply_ref.as_deref() {
        let mut reply = ObjWriter::default();
        reply
            .bool("required", true)
            .str("tool_id", TOOL_REPLY)
            .str("reply_ref", r);
        w.obj("reply", reply);
    }
    let files = m.files.as_deref().unwrap_or_default();
    w.objs("files", files.iter().map(|f| file_json(f, base)))
        .obj("skill", skill);
    if let Some(t) = m.event_time {
        w.num("event_time", t);
    }
    w.num("accepted_at", h.accepted_at).num("expires_at", h.expires_at);
    w
}

/// One file as both profiles show it: the file cache's reference and where to download it.
pub fn file_json(f: &FileItem, base: &str) -> ObjWriter {
    let mut w = ObjWriter::default();
    w.str("type", &f.kind)
        .str("file_ref", &f.file_ref)
        .str("filename", &f.filename)
        .str("mime_type", &f.mime_type)
        .num("byte_size", f.byte_size)
        .num("expires_at", f.expires_at)
        .str("download_url", &format!("{base}/files/refs/{}", f.file_ref));
    w
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
