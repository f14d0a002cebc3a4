//! Telegram's updates read into imgate's inbound events: the parser of outside bytes (the fuzz
//! target's entry), with no store and no I/O.

use crate::json::{self, Value};
use crate::providers::inbound::Inbound;

/// One update as far as it can be read without the store.
pub struct Update {
    /// The offset that confirms this update to Telegram.
    pub after: u64,
    /// The message in it; `None` for updates of other kinds, which are only confirmed.
    pub message: Option<Message>,
}

/// A Telegram `Message` read into imgate's inbound event.
pub struct Message {
    pub chat_id: i64,
    pub inbound: Inbound,
    pub media: Option<Media>,
}

/// Reads one element of `getUpdates` (or one webhook body); `None` without an `update_id`,
/// which cannot even be confirmed. Public for the fuzz target.
pub fn read_update(u: &json::Object) -> Option<Update> {
    let after = json::get_u64(u, "update_id")?.checked_add(1)?;
    let message = json::get_obj(u, "message").and_then(|m| {
        let chat_id = json::get_obj(m, "chat").and_then(|c| json::get_i64(c, "id"))?;
        let (inbound, media) = inbound_of(m, chat_id);
        Some(Message {
            chat_id,
            inbound,
            media,
        })
    });
    Some(Update { after, message })
}

/// A file of a Telegram message, before it is fetched.
pub struct Media {
    pub file_id: String,
    pub kind: &'static str,
    pub filename: String,
    pub mime_type: String,
    pub file_size: Option<u64>,
}

fn media_of(m: &json::Object) -> Option<Media> {
    let file = |o: &json::Object, kind: &'static str, name: &str, mime: &str| -> Option<Media> {
        Some(Media {
            file_id: json::get_str(o, "file_id")?.to_string(),
            kind,
            filename: json::get_str(o, "file_name").unwrap_or(name).to_string(),
            mime_type: json::get_str(o, "mime_type").unwrap_or(mime).to_string(),
            file_size: json::get_u64(o, "file_size"),
        })
    };
    if let Some(Value::Array(sizes)) = m.get("photo") {
        // The largest size Telegram offers comes last.
        return sizes
            .iter()
            .filter_map(json::as_object)
            .next_back()
            .and_then(|p| file(p, "image", "photo.jpg", "image/jpeg"));
    }
    let kinds = [
        ("document", "file", "document", "application/octet-stream"),
        ("video", "video", "video.mp4", "video/mp4"),
        ("voice", "audio", "voice.ogg", "audio/ogg"),
        ("audio", "audio", "audio.mp3", "audio/mpeg"),
    ];
    kinds
        .iter()
        .find_map(|(field, kind, name, mime)| json::get_obj(m, field).and_then(|o| file(o, kind, name, mime)))
}

/// A Telegram `Message` as imgate's inbound event, and its file if it has one.
fn inbound_of(m: &json::Object, chat_id: i64) -> (Inbound, Option<Media>) {
    let chat = json::get_obj(m, "chat");
    let from = json::get_obj(m, "from");
    let message_id = json::get_i64(m, "message_id").unwrap_or(0);
    let sender_id = from.and_then(|f| json::get_i64(f, "id")).unwrap_or(chat_id).to_string();
    let sender_name = from.and_then(|f| {
        let first = json::get_str(f, "first_name").unwrap_or_default();
        let last = json::get_str(f, "last_name").unwrap_or_default();
        let full = format!("{first} {last}").trim().to_string();
        if full.is_empty() {
            json::get_str(f, "username").map(|u| format!("@{u}"))
        } else {
            Some(full)
        }
    });
    let kind = chat.and_then(|c| json::get_str(c, "type")).unwrap_or("private");
    let (message_type, text) = if let Some(t) = json::get_str(m, "text") {
        ("text", t.to_string())
    } else {
        let caption = json::get_str(m, "caption").unwrap_or_default().to_string();
        let kind = [
            ("photo", "image"),
            ("document", "file"),
            ("video", "video"),
            ("voice", "audio"),
            ("audio", "audio"),
        ]
        .iter()
        .find(|(field, _)| m.contains_key(*field))
        .map(|(_, t)| *t);
        match (kind, json::get_obj(m, "sticker")) {
            (Some(t), _) => (t, caption),
            (None, Some(st)) => ("sticker", json::get_str(st, "emoji").unwrap_or_default().to_string()),
            (None, None) => ("other", caption),
        }
    };
    let inbound = Inbound {
        message_id: format!("{chat_id}:{message_id}"),
        sender_id,
        sender_name,
        chat_id: Some(chat_id.to_string()),
        chat_type: if kind == "private" {
            "p2p".into()
        } else {
            "group".into()
        },
        message_type: message_type.to_string(),
        text,
        // Checked: a hostile `date` must not overflow into a time that looks current.
        event_time: json::get_u64(m, "date").and_then(|d| d.checked_mul(1000)),
        files: None,
    };
    (inbound, media_of(m))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_telegram_updates_never_panic_the_message_reader() {
        let seeds: [&[u8]; 4] = [
            br#"{"update_id":1001,"message":{"message_id":5,"from":{"id":4242,"first_name":"Ada","last_name":"L","username":"ada"},"chat":{"id":-1001234,"type":"supergroup","title":"Ops"},"date":1790000000,"text":"hi"}}"#,
            br#"{"update_id":1002,"message":{"message_id":6,"chat":{"id":77,"type":"private"},"date":1,"caption":"c","photo":[{"file_id":"a","file_size":10},{"file_id":"b","file_size":9999999999999999999}]}}"#,
            br#"{"update_id":1003,"message":{"message_id":7,"chat":{"id":77},"document":{"file_id":"d","file_name":"x.pdf","mime_type":"application/pdf"},"sticker":{"emoji":"\ud83d\ude00"}}}"#,
            br#"{"update_id":18446744073709551615,"message":{"message_id":-1,"chat":{"id":-9223372036854775808},"date":18446744073709551615}}"#,
        ];
        let mut read = 0;
        for input in crate::testutil::mutations(&seeds, 5000, 13) {
            let Ok(v) = std::str::from_utf8(&input)
                .map_err(|_| ())
                .and_then(|t| json::parse(t).map_err(|_| ()))
            else {
                continue;
            };
            let Some(u) = json::as_object(&v).and_then(read_update) else {
                continue;
            };
            if let Some(m) = u.message {
                assert!(m.inbound.message_id.starts_with(&m.chat_id.to_string()));
                read += 1;
            }
        }
        assert!(read > 500, "only {read} mutations were still updates");
    }
}
