//! Reads an event payload of the long connection (event schema 2.0): its header, and for
//! `im.message.receive_v1` the message as imgate's inbound event, with the file to fetch if it
//! has one. Everything here is outside input: every field is optional until checked, every
//! text bounded.

use crate::json::{self, Object, Value};
use crate::providers::inbound::{bounded, Inbound};

/// The one event type imgate stores.
pub const MESSAGE_RECEIVED: &str = "im.message.receive_v1";
/// A message's text is cut at this many bytes (a packet must stay far below its 1 MiB cap).
pub const MAX_TEXT_BYTES: usize = 64 << 10;

/// An event as far as it can be read.
#[derive(Debug, PartialEq)]
pub struct Event {
    pub event_id: String,
    pub event_type: String,
    pub app_id: String,
    /// For `im.message.receive_v1`: the message.
    pub message: Option<Message>,
}

/// A received message.
#[derive(Debug, PartialEq)]
pub struct Message {
    pub chat_id: String,
    pub inbound: Inbound,
    /// A file to fetch through the message-resource API.
    pub resource: Option<Resource>,
}

/// A file of a message, before it is fetched.
#[derive(Debug, PartialEq)]
pub struct Resource {
    pub file_key: String,
    /// The resource API's `type`: `image` for images, `file` for everything else.
    pub api_type: &'static str,
    /// imgate's kind: image, file, audio, video.
    pub kind: &'static str,
    pub filename: String,
    pub mime_type: &'static str,
}

/// Why a payload is not an event.
pub type Unreadable = &'static str;

/// Reads one event payload.
pub fn read(payload: &[u8]) -> Result<Event, Unreadable> {
    let text = std::str::from_utf8(payload).map_err(|_| "the payload is not UTF-8")?;
    let v = json::parse(text).map_err(|_| "the payload is not JSON")?;
    let o = json::as_object(&v).ok_or("the payload is not an object")?;
    let header = json::get_obj(o, "header").ok_or("the payload has no header (not schema 2.0)")?;
    let field = |k: &str| bounded(json::get_str(header, k).unwrap_or_default(), 256);
    let event_type = field("event_type");
    let message = match event_type.as_str() {
        MESSAGE_RECEIVED => {
            let event = json::get_obj(o, "event").ok_or("the event has no body")?;
            Some(message_of(event).ok_or("the message has no chat_id or message_id")?)
        }
        _ => None,
    };
    Ok(Event {
        event_id: field("event_id"),
        event_type,
        app_id: field("app_id"),
        message,
    })
}

fn message_of(event: &Object) -> Option<Message> {
    let m = json::get_obj(event, "message")?;
    let id = |k: &str| json::get_str(m, k).filter(|v| !v.is_empty() && v.len() <= 128);
    let chat_id = id("chat_id")?.to_string();
    let message_id = id("message_id")?.to_string();
    let sender = json::get_obj(event, "sender");
    let sender_id = sender
        .and_then(|s| json::get_obj(s, "sender_id"))
        .and_then(|ids| json::get_str(ids, "open_id").or_else(|| json::get_str(ids, "user_id")))
        .map_or_else(String::new, |s| bounded(s, 128));
    let chat_type = match json::get_str(m, "chat_type") {
        Some("p2p") => "p2p",
        _ => "group",
    };
    let message_type = json::get_str(m, "message_type").unwrap_or_default();
    // `content` is a JSON document in a string.
    let content = json::get_str(m, "content")
        .and_then(|c| json::parse(c).ok())
        .and_then(|v| json::as_object(&v).cloned())
        .unwrap_or_default();
    let mentions = mentions_of(m);
    let (kind, text, resource) = match message_type {
        "text" => (
            "text",
            json::get_str(&content, "text").unwrap_or_default().to_string(),
            None,
        ),
        "post" => ("text", flatten_post(&content), None),
        "image" => ("image", String::new(), resource(&content, "image_key", "image")),
        "file" => ("file", String::new(), resource(&content, "file_key", "file")),
        "audio" => ("audio", String::new(), resource(&content, "file_key", "audio")),
        "media" => ("video", String::new(), resource(&content, "file_key", "video")),
        "sticker" => ("sticker", String::new(), None),
        _ => ("other", format!("[{} message]", bounded(message_type, 32)), None),
    };
    // Cut before names are put in, so a hostile text cannot grow while they are.
    let long = text.len() > MAX_TEXT_BYTES;
    let mut text = with_names(&bounded(&text, MAX_TEXT_BYTES), &mentions);
    if long || text.len() > MAX_TEXT_BYTES {
        text = format!(
            "{} [cut at {} KiB]",
            bounded(&text, MAX_TEXT_BYTES),
            MAX_TEXT_BYTES >> 10
        );
    }
    let inbound = Inbound {
        message_id,
        sender_id,
        sender_name: None,
        chat_id: Some(chat_id.clone()),
        chat_type: chat_type.into(),
        message_type: kind.into(),
        text,
        event_time: json::get_str(m, "create_time").and_then(|t| t.parse::<u64>().ok()),
        files: None,
    };
    Some(Message {
        chat_id,
        inbound,
        resource,
    })
}

/// `@_user_1` placeholders and the names they stand for.
fn mentions_of(m: &Object) -> Vec<(String, String)> {
    let Some(Value::Array(list)) = m.get("mentions") else {
        return Vec::new();
    };
    list.iter()
        .filter_map(json::as_object)
        .take(64)
        .filter_map(|x| {
            let key = json::get_str(x, "key").filter(|k| k.starts_with('@') && k.len() <= 32)?;
            let name = bounded(json::get_str(x, "name").unwrap_or("someone"), 128);
            Some((key.to_string(), format!("@{name}")))
        })
        .collect()
}

/// The text with mention placeholders replaced by names, longest placeholder first so that
/// `@_user_1` never eats into `@_user_10`.
fn with_names(text: &str, mentions: &[(String, String)]) -> String {
    let mut sorted: Vec<&(String, String)> = mentions.iter().collect();
    sorted.sort_by_key(|(k, _)| std::cmp::Reverse(k.len()));
    let mut out = text.to_string();
    for (key, name) in sorted {
        if out.len() > MAX_TEXT_BYTES * 2 {
            break;
        }
        out = out.replace(key.as_str(), name);
    }
    out
}

fn resource(content: &Object, key: &str, kind: &'static str) -> Option<Resource> {
    let file_key = json::get_str(content, key).filter(|k| safe_id(k, 256))?;
    let (default_name, mime_type) = match kind {
        "image" => ("image.png", "image/png"),
        "audio" => ("audio.opus", "audio/ogg"),
        "video" => ("video.mp4", "video/mp4"),
        _ => ("file", "application/octet-stream"),
    };
    let filename = json::get_str(content, "file_name")
        .filter(|n| !n.is_empty())
        .map_or_else(|| default_name.to_string(), |n| bounded(n, 255));
    Some(Resource {
        file_key: file_key.to_string(),
        api_type: if kind == "image" { "image" } else { "file" },
        kind,
        filename,
        mime_type,
    })
}

/// An app ID, or a chat, message or file key: it goes into file names and URL paths, so it is
/// 1 to `max` letters, digits, `_` and `-`.
pub fn safe_id(id: &str, max: usize) -> bool {
    !id.is_empty() && id.len() <= max && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A rich-text message as plain text: the title, then each paragraph on its line. Links keep
/// their address, mentions their name, images and videos a marker. Accepts the content with
/// or without a language wrapper (`{"zh_cn": {...}}`).
fn flatten_post(content: &Object) -> String {
    let post = if content.contains_key("content") {
        Some(content)
    } else {
        content
            .values()
            .filter_map(json::as_object)
            .find(|o| o.contains_key("content"))
    };
    let Some(post) = post else { return String::new() };
    let mut lines = Vec::new();
    if let Some(title) = json::get_str(post, "title").filter(|t| !t.is_empty()) {
        lines.push(title.to_string());
    }
    let Some(Value::Array(paragraphs)) = post.get("content") else {
        return lines.join("\n");
    };
    let mut size = 0;
    for p in paragraphs {
        let Value::Array(elements) = p else { continue };
        let mut line = String::new();
        for e in elements.iter().filter_map(json::as_object) {
            let text = json::get_str(e, "text").unwrap_or_default();
            match json::get_str(e, "tag").unwrap_or_default() {
                "text" | "md" | "code_block" => line.push_str(text),
                "a" => match json::get_str(e, "href") {
                    Some(href) if href != text => line.push_str(&format!("{text} ({href})")),
                    _ => line.push_str(text),
                },
                "at" => line.push_str(&format!("@{}", json::get_str(e, "user_name").unwrap_or("someone"))),
                "img" => line.push_str("[image]"),
                "media" => line.push_str("[video]"),
                "emotion" => line.push_str(&format!(":{}:", json::get_str(e, "emoji_type").unwrap_or("emoji"))),
                "hr" => line.push_str("---"),
                _ => {}
            }
        }
        size += line.len();
        lines.push(line);
        if size > MAX_TEXT_BYTES {
            break;
        }
    }
    lines.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn receive(message: &str) -> String {
        format!(
            r#"{{"schema":"2.0","header":{{"event_id":"ev1","event_type":"im.message.receive_v1","create_time":"1700000000000","app_id":"cli_a","tenant_key":"t"}},"event":{{"sender":{{"sender_id":{{"open_id":"ou_1","union_id":"on_1"}},"sender_type":"user"}},"message":{message}}}}}"#
        )
    }

    #[test]
    fn a_text_message_becomes_the_inbound_event_with_mentions_named() {
        let p = receive(
            r#"{"message_id":"om_1","chat_id":"oc_9","chat_type":"group","message_type":"text","create_time":"1700000000123","content":"{\"text\":\"@_user_1 hi @_user_10\"}","mentions":[{"key":"@_user_1","name":"Bot"},{"key":"@_user_10","name":"Ada"}]}"#,
        );
        let e = read(p.as_bytes()).unwrap();
        assert_eq!((e.event_id.as_str(), e.app_id.as_str()), ("ev1", "cli_a"));
        let m = e.message.unwrap();
        assert_eq!(m.chat_id, "oc_9");
        assert_eq!(m.inbound.message_id, "om_1");
        assert_eq!(m.inbound.text, "@Bot hi @Ada");
        assert_eq!(m.inbound.sender_id, "ou_1");
        assert_eq!(m.inbound.event_time, Some(1700000000123));
        assert_eq!(m.inbound.chat_type, "group");
    }

    #[test]
    fn rich_text_is_flattened_with_or_without_a_language_wrapper() {
        let post = r#"{\"title\":\"Release\",\"content\":[[{\"tag\":\"text\",\"text\":\"v2 is out, \"},{\"tag\":\"a\",\"text\":\"notes\",\"href\":\"https://x.example/n\"}],[{\"tag\":\"at\",\"user_name\":\"Ada\"},{\"tag\":\"img\",\"image_key\":\"img_1\"}]]}"#;
        let p = receive(&format!(
            r#"{{"message_id":"om_2","chat_id":"oc_9","chat_type":"p2p","message_type":"post","content":"{post}"}}"#
        ));
        let m = read(p.as_bytes()).unwrap().message.unwrap();
        assert_eq!(
            m.inbound.text,
            "Release\nv2 is out, notes (https://x.example/n)\n@Ada[image]"
        );
        assert_eq!(m.inbound.message_type, "text");
        let wrapped = receive(
            r#"{"message_id":"om_3","chat_id":"oc_9","message_type":"post","content":"{\"en_us\":{\"title\":\"\",\"content\":[[{\"tag\":\"text\",\"text\":\"hello\"}]]}}"}"#,
        );
        assert_eq!(read(wrapped.as_bytes()).unwrap().message.unwrap().inbound.text, "hello");
    }

    #[test]
    fn files_name_the_resource_to_fetch_and_unsafe_keys_are_refused() {
        let p = receive(
            r#"{"message_id":"om_4","chat_id":"oc_9","message_type":"file","content":"{\"file_key\":\"file_v3_abc\",\"file_name\":\"report.pdf\"}"}"#,
        );
        let r = read(p.as_bytes()).unwrap().message.unwrap().resource.unwrap();
        assert_eq!(
            (r.file_key.as_str(), r.api_type, r.kind),
            ("file_v3_abc", "file", "file")
        );
        assert_eq!(r.filename, "report.pdf");
        let p = receive(
            r#"{"message_id":"om_5","chat_id":"oc_9","message_type":"image","content":"{\"image_key\":\"../../etc\"}"}"#,
        );
        assert_eq!(read(p.as_bytes()).unwrap().message.unwrap().resource, None);
    }

    #[test]
    fn other_events_are_read_without_a_message_and_garbage_is_unreadable() {
        let other = r#"{"schema":"2.0","header":{"event_id":"e","event_type":"im.chat.updated_v1"},"event":{}}"#;
        let e = read(other.as_bytes()).unwrap();
        assert_eq!((e.event_type.as_str(), e.message), ("im.chat.updated_v1", None));
        assert!(read(b"\xff").is_err());
        assert!(read(b"[]").is_err());
        assert!(read(br#"{"uuid":"v1 schema"}"#).is_err());
        assert!(read(receive(r#"{"chat_id":"oc"}"#).as_bytes()).is_err());
    }

    #[test]
    fn malformed_events_never_panic_the_reader() {
        let seeds = [
            receive(
                r#"{"message_id":"om_1","chat_id":"oc_9","chat_type":"group","message_type":"text","content":"{\"text\":\"@_user_1 hi\"}","mentions":[{"key":"@_user_1","name":"Bot"}]}"#,
            ),
            receive(
                r#"{"message_id":"om_2","chat_id":"oc_9","message_type":"post","content":"{\"title\":\"t\",\"content\":[[{\"tag\":\"a\",\"text\":\"x\",\"href\":\"h\"}]]}"}"#,
            ),
            receive(
                r#"{"message_id":"om_3","chat_id":"oc_9","message_type":"media","content":"{\"file_key\":\"k\",\"image_key\":\"i\"}"}"#,
            ),
        ];
        let seeds: Vec<&[u8]> = seeds.iter().map(|s| s.as_bytes()).collect();
        let mut read_ok = 0;
        for input in crate::testutil::mutations(&seeds, 5000, 21) {
            if let Ok(Event { message: Some(m), .. }) = read(&input) {
                assert!(m.inbound.text.len() <= MAX_TEXT_BYTES + 64);
                read_ok += 1;
            }
        }
        assert!(read_ok > 300, "only {read_ok} mutations were still messages");
    }
}
