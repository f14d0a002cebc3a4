//! The long connection's frames and the robot messages they carry
//! (docs/providers/wecom-protocol.md). Everything here is outside input: every field optional
//! until checked, every text bounded, every ID checked before it names a key or a log line.

use crate::json::{self, Object, Value};
use crate::providers::inbound::{bounded, printable};

/// A message's text is cut at this many bytes (a packet must stay far below its 1 MiB).
pub const MAX_TEXT_BYTES: usize = 64 << 10;
/// Request IDs, msgids, chat and user IDs are short; longer is not WeCom.
pub const MAX_ID: usize = 128;
/// A media URL longer than this is not WeCom's.
const MAX_URL: usize = 2048;
/// An error message or a name is cut at this many bytes.
const MAX_NAME: usize = 256;
/// Parts read from one mixed message.
const MAX_PARTS: usize = 64;

/// One text frame of the connection.
#[derive(Debug, PartialEq)]
pub enum Frame {
    /// The answer to a frame imgate sent (no `cmd`): its `req_id`, `errcode` and `errmsg`, and
    /// what an upload's answers carry (`body.upload_id`, `body.media_id`).
    Answer {
        req_id: String,
        errcode: i64,
        errmsg: String,
        upload_id: Option<String>,
        media_id: Option<String>,
    },
    /// A robot message; its `req_id` is what a reply names.
    Message { req_id: String, message: Box<RobotMessage> },
    /// `disconnected_event`: a newer connection took the robot; this one is closed.
    Kicked,
    /// Another event (`enter_chat`, a card's click, feedback): nothing to store.
    Event(String),
    /// A callback whose message cannot be read: nothing stored.
    Unreadable(&'static str),
    /// Not a frame of the protocol.
    Other(String),
}

/// A robot message, as the callback gives it.
#[derive(Debug, PartialEq, Clone)]
pub struct RobotMessage {
    /// `msgid`: the `message_id` of the message.
    pub msgid: String,
    /// `chatid` for a group; for a one-to-one chat (which has none) the user's `userid`.
    pub chat: String,
    pub group: bool,
    /// `from.userid`.
    pub sender: String,
    /// `msgtype`.
    pub kind: String,
    /// The readable text: a voice message's recognised text, a mixed message's text parts.
    pub text: String,
    /// The first image or file, before it is fetched.
    pub media: Option<Media>,
    /// `create_time` (Unix ms).
    pub created_ms: Option<u64>,
}

/// An image or a file of a message: its URL (valid a few minutes) and the key its bytes are
/// encrypted with.
#[derive(PartialEq, Clone)]
pub struct Media {
    pub kind: &'static str,
    pub url: String,
    pub aeskey: String,
}

/// Without the key (and the URL, which reaches the encrypted bytes): a `{:?}` of a message
/// never shows them.
impl std::fmt::Debug for Media {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Media")
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

/// Reads one text frame.
pub fn read_frame(text: &str) -> Frame {
    let Ok(v) = json::parse(text) else {
        return Frame::Other("not JSON".into());
    };
    let Some(o) = json::as_object(&v) else {
        return Frame::Other("not an object".into());
    };
    let req_id = json::get_obj(o, "headers")
        .and_then(|h| json::get_str(h, "req_id"))
        .filter(|r| printable(r, MAX_ID))
        .unwrap_or_default()
        .to_string();
    let body = json::get_obj(o, "body");
    let body_id = |k: &str| {
        body.and_then(|b| json::get_str(b, k))
            .filter(|v| printable(v, MAX_URL))
            .map(str::to_string)
    };
    match json::get_str(o, "cmd") {
        None if !req_id.is_empty() => Frame::Answer {
            req_id,
            errcode: json::get_i64(o, "errcode").unwrap_or(-1),
            errmsg: bounded(json::get_str(o, "errmsg").unwrap_or_default(), MAX_NAME),
            upload_id: body_id("upload_id"),
            media_id: body_id("media_id"),
        },
        None => Frame::Other("an answer without a req_id".into()),
        Some("aibot_msg_callback") => match body.map(robot_message) {
            // A message without a req_id can still be stored; only its reply goes proactive.
            Some(Ok(m)) => Frame::Message {
                req_id,
                message: Box::new(m),
            },
            Some(Err(why)) => Frame::Unreadable(why),
            None => Frame::Unreadable("a callback without a body"),
        },
        Some("aibot_event_callback") => {
            let event = body.and_then(|b| json::get_obj(b, "event"));
            match event.and_then(|e| json::get_str(e, "eventtype")).unwrap_or_default() {
                "disconnected_event" => Frame::Kicked,
                other => Frame::Event(bounded(other, 64)),
            }
        }
        Some(cmd) => Frame::Other(format!("a frame of cmd {}", bounded(cmd, 32))),
    }
}

/// A callback's message, checked.
fn robot_message(b: &Object) -> Result<RobotMessage, &'static str> {
    let id = |k: &str| json::get_str(b, k).filter(|v| printable(v, MAX_ID));
    let msgid = id("msgid").ok_or("no usable msgid")?.to_string();
    let sender = json::get_obj(b, "from")
        .and_then(|f| json::get_str(f, "userid"))
        .filter(|u| printable(u, MAX_ID))
        .ok_or("no usable from.userid")?
        .to_string();
    let group = json::get_str(b, "chattype") == Some("group");
    let chat = match group {
        true => id("chatid")
            .ok_or("a group message without a usable chatid")?
            .to_string(),
        false => sender.clone(),
    };
    let kind = bounded(json::get_str(b, "msgtype").unwrap_or_default(), 32);
    let part = json::get_obj(b, &kind);
    let content = |o: Option<&Object>| {
        o.and_then(|p| json::get_str(p, "content"))
            .unwrap_or_default()
            .to_string()
    };
    let (text, media) = match kind.as_str() {
        "text" | "voice" => (content(part), None),
        "image" | "file" | "video" => (String::new(), part.and_then(|p| media(p, &kind))),
        "mixed" => mixed(part),
        _ => (String::new(), None),
    };
    Ok(RobotMessage {
        msgid,
        chat,
        group,
        sender,
        kind,
        text: bounded(&text, MAX_TEXT_BYTES),
        media,
        created_ms: json::get_u64(b, "create_time").and_then(|s| s.checked_mul(1000)),
    })
}

/// A mixed message's text parts, joined, and its first image.
fn mixed(part: Option<&Object>) -> (String, Option<Media>) {
    let items = match part.and_then(|p| json::get(p, "msg_item")) {
        Some(Value::Array(items)) => items.as_slice(),
        _ => &[],
    };
    let mut texts: Vec<String> = Vec::new();
    let mut first = None;
    for item in items.iter().take(MAX_PARTS).filter_map(json::as_object) {
        match json::get_str(item, "msgtype") {
            Some("text") => {
                let t = json::get_obj(item, "text").and_then(|t| json::get_str(t, "content"));
                texts.extend(t.map(str::to_string));
            }
            Some("image") if first.is_none() => {
                first = json::get_obj(item, "image").and_then(|i| media(i, "image"));
            }
            _ => {}
        }
    }
    (texts.join("\n"), first)
}

fn media(o: &Object, kind: &str) -> Option<Media> {
    let url = json::get_str(o, "url").filter(|u| u.len() <= MAX_URL && u.starts_with("http"))?;
    // Without a key the SDK takes the bytes as they come.
    let aeskey = json::get_str(o, "aeskey").filter(|k| k.len() <= 64).unwrap_or_default();
    Some(Media {
        kind: if kind == "image" { "image" } else { "file" },
        url: url.to_string(),
        aeskey: aeskey.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn callbacks_answers_and_the_kick_are_read_and_bad_input_is_refused_readably() {
        let text = r#"{"cmd":"aibot_msg_callback","headers":{"req_id":"r1"},"body":{"msgid":"m1","aibotid":"b","chattype":"group","chatid":"wrc1","from":{"userid":"zhang"},"create_time":1790000000,"msgtype":"text","text":{"content":"@bot hi"}}}"#;
        let Frame::Message { req_id, message } = read_frame(text) else {
            panic!("{:?}", read_frame(text))
        };
        assert_eq!(
            (req_id.as_str(), message.chat.as_str(), message.group),
            ("r1", "wrc1", true)
        );
        assert_eq!(
            (message.text.as_str(), message.created_ms),
            ("@bot hi", Some(1_790_000_000_000))
        );
        let single = r#"{"cmd":"aibot_msg_callback","headers":{"req_id":"r2"},"body":{"msgid":"m2","chattype":"single","from":{"userid":"li"},"msgtype":"mixed","mixed":{"msg_item":[{"msgtype":"text","text":{"content":"look"}},{"msgtype":"image","image":{"url":"https://x/1","aeskey":"the-media-key"}}]}}}"#;
        let Frame::Message { message, .. } = read_frame(single) else {
            panic!()
        };
        let shown = format!("{message:?}");
        assert!(
            !shown.contains("the-media-key") && !shown.contains("https://x/1"),
            "{shown}"
        );
        assert_eq!((message.chat.as_str(), message.text.as_str()), ("li", "look"));
        assert_eq!(message.media.map(|m| m.url), Some("https://x/1".into()));
        let kicked = r#"{"cmd":"aibot_event_callback","headers":{"req_id":"e"},"body":{"msgtype":"event","event":{"eventtype":"disconnected_event"}}}"#;
        assert_eq!(read_frame(kicked), Frame::Kicked);
        let answer = r#"{"headers":{"req_id":"ping_1"},"errcode":0,"errmsg":"ok"}"#;
        assert!(matches!(read_frame(answer), Frame::Answer { errcode: 0, .. }));
        for bad in [
            "",
            "[]",
            r#"{"cmd":"aibot_msg_callback","headers":{"req_id":"r"},"body":{"msgid":"m","chattype":"group","from":{"userid":"u"}}}"#,
            r#"{"cmd":"aibot_msg_callback","headers":{"req_id":"r"},"body":{"msgid":"a\"b","from":{"userid":"u"}}}"#,
            r#"{"errcode":0}"#,
        ] {
            assert!(
                matches!(read_frame(bad), Frame::Unreadable(_) | Frame::Other(_)),
                "{bad}: {:?}",
                read_frame(bad)
            );
        }
    }

    #[test]
    fn malformed_frames_never_panic_the_reader() {
        let seeds: [&[u8]; 3] = [
            br#"{"cmd":"aibot_msg_callback","headers":{"req_id":"r1"},"body":{"msgid":"m1","chattype":"group","chatid":"c","from":{"userid":"u"},"create_time":18446744073709551615,"msgtype":"voice","voice":{"content":"x"}}}"#,
            br#"{"cmd":"aibot_msg_callback","headers":{"req_id":"r2"},"body":{"msgid":"m2","chattype":"single","from":{"userid":"u"},"msgtype":"mixed","mixed":{"msg_item":[{"msgtype":"image","image":{"url":"http://a","aeskey":"k"}}]}}}"#,
            br#"{"headers":{"req_id":"aibot_upload_media_finish_1"},"errcode":0,"errmsg":"ok","body":{"media_id":"x"}}"#,
        ];
        let mut read = 0;
        for input in crate::testutil::mutations(&seeds, 5000, 29) {
            if let Ok(t) = std::str::from_utf8(&input) {
                if matches!(read_frame(t), Frame::Message { .. } | Frame::Answer { .. }) {
                    read += 1;
                }
            }
        }
        assert!(read > 500, "only {read} mutations were still frames");
    }
}
