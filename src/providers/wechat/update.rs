//! `getupdates` answers read into imgate's inbound events: the user's messages (the bot's own
//! are skipped), their text, what kind they are, and the context token a reply needs. Every
//! string is bounded; a message without an ID cannot be deduplicated and is skipped.
//! Public for the fuzz target.

use super::cdn::{self, MediaRef};
use crate::json::{self, Number, Object, Value};
use crate::providers::inbound::Inbound;

/// iLink's `message_type` of a user's message (2 is the bot's own).
const FROM_USER: u64 = 1;
/// Longest ID kept (iLink's are a uint64, user IDs like `o9cq…@im.wechat`).
const MAX_ID: usize = 128;
/// Longest text kept from one message; the rest is cut with a note.
pub const MAX_TEXT: usize = 16 * 1024;
/// Longest context token or sync buffer kept.
pub const MAX_TOKEN: usize = 4096;

/// One answer of `getupdates`.
#[derive(Debug, Default, PartialEq)]
pub struct Batch {
    /// The buffer that confirms this batch (send it on the next call); `None` when absent.
    pub buf: Option<String>,
    pub messages: Vec<Message>,
}

/// One user's message.
#[derive(Debug, PartialEq)]
pub struct Message {
    pub inbound: Inbound,
    /// The token a send in this user's context carries.
    pub context_token: Option<String>,
    /// The message's first media item, to fetch into the file cache.
    pub media: Option<MediaRef>,
}

/// A uint64 ID kept exact, whether JSON carries it as a number or a string.
fn id(o: &Object, key: &str) -> Option<String> {
    let id = match o.get(key)? {
        Value::Number(Number::U64(n)) => n.to_string(),
        Value::Number(Number::I64(n)) => n.to_string(),
        Value::String(s) => s.clone(),
        _ => return None,
    };
    (!id.is_empty() && id.len() <= MAX_ID && id.chars().all(|c| c.is_ascii_graphic())).then_some(id)
}

fn bounded(s: Option<&str>, max: usize) -> Option<String> {
    s.filter(|s| !s.is_empty() && s.len() <= max).map(str::to_string)
}

/// Reads one `getupdates` answer.
pub fn read_batch(o: &Object) -> Batch {
    let messages = match o.get("msgs") {
        Some(Value::Array(a)) => a
            // No cut here: the buffer confirms the whole batch. The answer's size cap and the
            // JSON shape check bound it.
            .iter()
            .filter_map(json::as_object)
            .filter_map(read_message)
            .collect(),
        _ => Vec::new(),
    };
    Batch {
        buf: bounded(json::get_str(o, "get_updates_buf"), MAX_TOKEN),
        messages,
    }
}

/// One message of the batch; `None` for the bot's own, and for one without an ID or sender.
pub fn read_message(m: &Object) -> Option<Message> {
    if json::get_u64(m, "message_type").is_some_and(|t| t != FROM_USER) {
        return None;
    }
    let message_id = id(m, "message_id")?;
    let sender_id = id(m, "from_user_id")?;
    let mut texts = Vec::new();
    let mut kind = "text";
    let mut media = None;
    if let Some(Value::Array(items)) = m.get("item_list") {
        for item in items.iter().filter_map(json::as_object).take(16) {
            let (k, text) = item_text(item);
            if k != "text" {
                kind = k;
            }
            match (media.is_none(), cdn::media_of(item)) {
                // The first media item is fetched; a voice message keeps its transcription.
                (true, Some(found)) => {
                    if found.kind == "audio" {
                        texts.extend(text);
                    }
                    media = Some(found);
                }
                _ => texts.extend(text),
            }
        }
    }
    let mut text = texts.join("\n");
    if text.len() > MAX_TEXT {
        let mut cut = MAX_TEXT;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push_str(" [cut: the message was longer]");
    }
    Some(Message {
        inbound: Inbound {
            message_id,
            sender_id,
            sender_name: None,
            chat_id: None,
            chat_type: "p2p".into(),
            message_type: kind.into(),
            text,
            event_time: json::get_u64(m, "create_time_ms"),
            files: None,
        },
        context_token: bounded(json::get_str(m, "context_token"), MAX_TOKEN),
        media,
    })
}

/// An item's kind and the words it carries: its text, a voice message's transcription; a media
/// item that is not fetched (only the first is) is named in brackets.
fn item_text(item: &Object) -> (&'static str, Option<String>) {
    let sub = |k: &str| json::get_obj(item, k);
    match json::get_u64(item, "type").unwrap_or(0) {
        1 => (
            "text",
            sub("text_item")
                .and_then(|t| json::get_str(t, "text"))
                .map(str::to_string),
        ),
        2 => ("image", Some("[image]".into())),
        3 => {
            let said = sub("voice_item")
                .and_then(|v| json::get_str(v, "text"))
                .filter(|t| !t.is_empty());
            (
                "audio",
                Some(said.map_or_else(|| "[voice message]".into(), |t| format!("[voice] {t}"))),
            )
        }
        4 => {
            let name = sub("file_item")
                .and_then(|f| json::get_str(f, "file_name"))
                .unwrap_or("file");
            let name: String = name.chars().take(128).collect();
            ("file", Some(format!("[file {name}]")))
        }
        5 => ("video", Some("[video]".into())),
        _ => ("other", None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Object {
        match json::parse(text).unwrap() {
            Value::Object(o) => o,
            _ => panic!("object"),
        }
    }

    #[test]
    fn a_batch_keeps_user_messages_exact_ids_and_the_buffer() {
        let b = read_batch(&parse(
            r#"{"ret":0,"get_updates_buf":"YnVmMQ==","msgs":[
              {"message_id":18446744073709551615,"from_user_id":"u1@im.wechat","message_type":1,
               "create_time_ms":1700000000000,"context_token":"ctx-1",
               "item_list":[{"type":1,"text_item":{"text":"hello"}}]},
              {"message_id":"7","from_user_id":"bot@im.bot","message_type":2,"item_list":[]},
              {"message_id":"8","from_user_id":"u1@im.wechat","message_type":1,
               "item_list":[{"type":3,"voice_item":{"text":"call me"}}]},
              {"from_user_id":"u1@im.wechat","message_type":1}
            ]}"#,
        ));
        assert_eq!(b.buf.as_deref(), Some("YnVmMQ=="));
        assert_eq!(b.messages.len(), 2, "the bot's own and the ID-less are skipped");
        let m = &b.messages[0];
        assert_eq!(m.inbound.message_id, "18446744073709551615", "beyond 2^53, exact");
        assert_eq!(
            (m.inbound.text.as_str(), m.inbound.event_time),
            ("hello", Some(1_700_000_000_000))
        );
        assert_eq!(m.context_token.as_deref(), Some("ctx-1"));
        assert_eq!(
            (
                b.messages[1].inbound.message_type.as_str(),
                b.messages[1].inbound.text.as_str()
            ),
            ("audio", "[voice] call me")
        );
    }

    #[test]
    fn the_first_media_item_is_fetched_and_the_others_are_named_in_the_text() {
        let b = read_batch(&parse(
            r#"{"msgs":[{"message_id":"9","from_user_id":"u","item_list":[
              {"type":1,"text_item":{"text":"look"}},
              {"type":2,"image_item":{"aeskey":"00","media":{"encrypt_query_param":"q1"}}},
              {"type":4,"file_item":{"file_name":"a.pdf","media":{"encrypt_query_param":"q2"}}}]}]}"#,
        ));
        let m = &b.messages[0];
        assert_eq!(
            m.media.as_ref().map(|r| (r.kind, r.query.as_deref())),
            Some(("image", Some("q1")))
        );
        assert_eq!(m.inbound.text, "look\n[file a.pdf]");
    }

    #[test]
    fn malformed_batches_read_as_nothing_without_a_panic() {
        for text in [
            r#"{}"#,
            r#"{"msgs":7}"#,
            r#"{"msgs":[1,"x",null,{"message_id":{}}]}"#,
            r#"{"get_updates_buf":5,"msgs":[{"message_id":"1","from_user_id":""}]}"#,
        ] {
            assert_eq!(read_batch(&parse(text)), Batch::default(), "{text}");
        }
        let long = format!(
            r#"{{"msgs":[{{"message_id":"1","from_user_id":"u","item_list":[{{"type":1,"text_item":{{"text":"{}"}}}}]}}]}}"#,
            "é".repeat(MAX_TEXT)
        );
        let b = read_batch(&parse(&long));
        assert!(b.messages[0].inbound.text.len() < MAX_TEXT + 64);
        for bytes in crate::testutil::mutations(&[long.as_bytes()], 2000, 7) {
            if let Ok(Value::Object(o)) = std::str::from_utf8(&bytes)
                .map_err(|_| ())
                .and_then(|t| json::parse(t).map_err(|_| ()))
            {
                let _ = read_batch(&o);
            }
        }
    }
}
