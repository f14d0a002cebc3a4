//! Stream mode frames (`SYSTEM` ping and disconnect, `CALLBACK` robot messages) and the robot
//! messages they carry. Everything here is outside input: every field optional until checked,
//! every text bounded, every ID checked before it names a key, a URL or a log line.

use crate::json::{self, ObjWriter, Object, Value};
use crate::providers::inbound::{bounded, printable, safe_id};

/// The topic of robot messages.
pub const ROBOT_TOPIC: &str = "/v1.0/im/bot/messages/get";
/// A message's text is cut at this many bytes (a packet must stay far below its 1 MiB).
pub const MAX_TEXT_BYTES: usize = 64 << 10;
/// Frame message IDs, msgIds, conversation and user IDs are short; longer is not DingTalk.
const MAX_ID: usize = 128;
/// A session webhook URL longer than this is not DingTalk's.
const MAX_URL: usize = 1024;
/// Names (a nick, a group's title, a file's name) are cut at this many bytes.
const MAX_NAME: usize = 256;
/// Rich-text parts read from one message.
const MAX_PARTS: usize = 256;

/// One text frame of the socket.
#[derive(Debug, PartialEq)]
pub enum Frame {
    /// A health check: answered at once, echoing `data`.
    Ping { message_id: String, data: String },
    /// The server closes this connection within about 10 s: open the next one.
    Disconnect { reason: String },
    /// A robot message, answered once it is stored.
    Robot {
        message_id: String,
        message: Box<RobotMessage>,
    },
    /// A robot callback whose message cannot be read: answered 400, nothing stored.
    Unreadable { message_id: String, why: &'static str },
    /// A frame for a topic imgate did not subscribe to: answered 404 (the protocol's "topic not
    /// found").
    Unwanted { message_id: String },
    /// Not a frame of the protocol: nothing to answer.
    Other(String),
}

/// A robot message, as DingTalk's callback gives it.
#[derive(Debug, PartialEq, Clone)]
pub struct RobotMessage {
    /// `msgId`: the `message_id` of the message.
    pub msg_id: String,
    /// `conversationId` (`cid…`).
    pub conversation: String,
    /// `conversationType` `2`; `1` is one-to-one.
    pub group: bool,
    /// `conversationTitle` (groups), bounded.
    pub title: String,
    /// `senderId`: who wrote it (the robot's own is `chatbotUserId`).
    pub sender_id: String,
    /// `senderStaffId`: the user ID a one-to-one send needs (empty for users of other
    /// organisations).
    pub staff_id: String,
    pub nick: String,
    /// `chatbotUserId`.
    pub robot_user: String,
    /// `msgtype`.
    pub kind: String,
    /// The readable text: rich text flattened, audio as its recognition.
    pub text: String,
    /// The first file of the message, before it is fetched.
    pub file: Option<DingFile>,
    /// `sessionWebhook` and `sessionWebhookExpiredTime` (Unix ms).
    pub webhook: Option<(String, u64)>,
    /// `createAt` (Unix ms).
    pub created_ms: Option<u64>,
}

/// A file of a message: fetched through `messageFiles/download` with its code.
#[derive(Debug, PartialEq, Clone)]
pub struct DingFile {
    pub download_code: String,
    pub name: String,
    /// What the message says it is (`image/jpeg` for pictures): the server's type wins.
    pub mime: String,
}

/// Reads one text frame of the socket.
pub fn read_frame(text: &str) -> Frame {
    let Ok(v) = json::parse(text) else {
        return Frame::Other("not JSON".into());
    };
    let Some(o) = json::as_object(&v) else {
        return Frame::Other("not an object".into());
    };
    let kind = json::get_str(o, "type").unwrap_or_default();
    let headers = json::get_obj(o, "headers");
    let header = |k: &str| headers.and_then(|h| json::get_str(h, k)).unwrap_or_default();
    let topic = header("topic");
    let data = json::get_str(o, "data").unwrap_or_default();
    let message_id = header("messageId");
    if kind == "SYSTEM" && topic == "disconnect" {
        let reason = json::parse(data)
            .ok()
            .and_then(|v| {
                json::as_object(&v)
                    .and_then(|d| json::get_str(d, "reason"))
                    .map(str::to_string)
            })
            .unwrap_or_default();
        return Frame::Disconnect {
            reason: bounded(&reason, MAX_NAME),
        };
    }
    // Every other frame is answered by its messageId: without a usable one, nothing can be.
    if !printable(message_id, MAX_ID) {
        return Frame::Other(format!("a {} frame without a usable messageId", bounded(kind, 16)));
    }
    let message_id = message_id.to_string();
    match (kind, topic) {
        ("SYSTEM", "ping") => Frame::Ping {
            message_id,
            // Echoed back: only a small JSON object is (the protocol's `{"opaque":…}`).
            data: match json::parse(data) {
                Ok(Value::Object(_)) if data.len() <= 1024 => data.to_string(),
                _ => "{}".into(),
            },
        },
        ("CALLBACK", ROBOT_TOPIC) => {
            let parsed = json::parse(data).ok();
            match parsed.as_ref().and_then(json::as_object).map(robot_message) {
                Some(Ok(m)) => Frame::Robot {
                    message_id,
                    message: Box::new(m),
                },
                Some(Err(why)) => Frame::Unreadable { message_id, why },
                None => Frame::Unreadable {
                    message_id,
                    why: "its data is not a JSON object",
                },
            }
        }
        ("SYSTEM" | "EVENT" | "CALLBACK", _) => Frame::Unwanted { message_id },
        _ => Frame::Other(format!("a frame of type {}", bounded(kind, 16))),
    }
}

/// The answer to a frame: `code` 200 with `data` for a ping or a stored message.
pub fn answer(message_id: &str, code: u64, message: &str, data: &str) -> String {
    let mut headers = ObjWriter::with_capacity(96);
    headers
        .str("contentType", "application/json")
        .str("messageId", message_id);
    let mut o = ObjWriter::with_capacity(160 + data.len());
    o.num("code", code)
        .obj("headers", headers)
        .str("message", message)
        .str("data", data);
    o.finish()
}

/// The answer to a robot message once it is stored (the protocol's fixed data).
pub fn stored(message_id: &str) -> String {
    answer(message_id, 200, "OK", "{\"response\":null}")
}

/// Reads a robot message. The `Err` says why it cannot be stored.
pub fn robot_message(m: &Object) -> Result<RobotMessage, &'static str> {
    let id = |k: &str| json::get_str(m, k).filter(|v| printable(v, MAX_ID));
    let msg_id = id("msgId").ok_or("no usable msgId")?;
    let conversation = json::get_str(m, "conversationId")
        .filter(|c| conversation_shaped(c))
        .ok_or("no usable conversationId")?;
    let group = match number_or_text(m, "conversationType") {
        Some(1) => false,
        Some(2) => true,
        _ => return Err("an unknown conversationType"),
    };
    let name = |k: &str| bounded(json::get_str(m, k).unwrap_or_default().trim(), MAX_NAME);
    let kind = json::get_str(m, "msgtype").unwrap_or_default();
    let content = json::get_obj(m, "content");
    let code = |o: Option<&Object>| {
        o.and_then(|c| json::get_str(c, "downloadCode"))
            .filter(|c| printable(c, 4096))
            .map(str::to_string)
    };
    let file = |name: &str, mime: &str| {
        code(content).map(|download_code| DingFile {
            download_code,
            name: name.to_string(),
            mime: mime.to_string(),
        })
    };
    let (text, file) = match kind {
        "text" => {
            let text = json::get_obj(m, "text").and_then(|t| json::get_str(t, "content"));
            (text.unwrap_or_default().trim().to_string(), None)
        }
        "richText" => rich_text(content),
        "picture" => (String::new(), file("image.jpg", "image/jpeg")),
        "file" => {
            let name = content
                .and_then(|c| json::get_str(c, "fileName"))
                .filter(|n| !n.trim().is_empty())
                .unwrap_or("file");
            (
                String::new(),
                file(&bounded(name, MAX_NAME), "application/octet-stream"),
            )
        }
        "audio" => {
            let said = content
                .and_then(|c| json::get_str(c, "recognition"))
                .unwrap_or_default();
            (said.trim().to_string(), file("voice.amr", "audio/amr"))
        }
        "video" => (String::new(), file("video.mp4", "video/mp4")),
        _ => (format!("[a {} message]", bounded(kind, 32)), None),
    };
    let webhook = json::get_str(m, "sessionWebhook")
        .filter(|u| webhook_shaped(u))
        .zip(number_or_text(m, "sessionWebhookExpiredTime"))
        .map(|(u, at)| (u.to_string(), at));
    Ok(RobotMessage {
        msg_id: msg_id.to_string(),
        conversation: conversation.to_string(),
        group,
        title: name("conversationTitle"),
        sender_id: id("senderId").unwrap_or_default().to_string(),
        staff_id: json::get_str(m, "senderStaffId")
            .filter(|s| safe_id(s, MAX_ID))
            .unwrap_or_default()
            .to_string(),
        nick: name("senderNick"),
        robot_user: id("chatbotUserId").unwrap_or_default().to_string(),
        kind: bounded(kind, 32),
        text: bounded(&text, MAX_TEXT_BYTES),
        file,
        webhook,
        created_ms: number_or_text(m, "createAt"),
    })
}

/// Rich text as one text, with its first picture as the file.
fn rich_text(content: Option<&Object>) -> (String, Option<DingFile>) {
    let parts = match content.and_then(|c| json::get(c, "richText")) {
        Some(Value::Array(parts)) => parts.as_slice(),
        _ => &[],
    };
    let (mut text, mut file) = (String::new(), None);
    for part in parts.iter().take(MAX_PARTS).filter_map(json::as_object) {
        if let Some(t) = json::get_str(part, "text") {
            if text.len() < MAX_TEXT_BYTES {
                text.push_str(t);
            }
        } else if file.is_none() {
            file = json::get_str(part, "downloadCode")
                .filter(|c| printable(c, 4096))
                .map(|c| DingFile {
                    download_code: c.to_string(),
                    name: "image.jpg".into(),
                    mime: "image/jpeg".into(),
                });
        }
    }
    (text.trim().to_string(), file)
}

/// A whole number given as a number or as its text (`"2"`, `1690362101894`).
fn number_or_text(o: &Object, key: &str) -> Option<u64> {
    json::get_u64(o, key).or_else(|| json::get_str(o, key).and_then(|s| s.parse().ok()))
}

/// A conversation ID as DingTalk gives them: `cid` and base64 (`+`, `/`, `=`).
pub fn conversation_shaped(id: &str) -> bool {
    id.starts_with("cid")
        && id.len() <= MAX_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'='))
}

/// A conversation ID as a key: `+` `/` `=` become `-` `_` `.` (one-to-one: a `cid` has none of
/// those), so it is safe wherever a key goes.
pub fn conversation_key(id: &str) -> String {
    id.chars()
        .map(|c| match c {
            '+' => '-',
            '/' => '_',
            '=' => '.',
            c => c,
        })
        .collect()
}

/// A session webhook: an HTTP(S) URL of printable characters.
fn webhook_shaped(url: &str) -> bool {
    (url.starts_with("https://") || url.starts_with("http://")) && printable(url, MAX_URL)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: &str, topic: &str, data: &str) -> String {
        json::to_string(&json::obj([
            ("specVersion", json::s("1.0")),
            ("type", json::s(kind)),
            (
                "headers",
                json::obj([
                    ("topic", json::s(topic)),
                    ("messageId", json::s("212ca9d7_974_1898c159aa6_1783b")),
                    ("contentType", json::s("application/json")),
                    ("time", json::s("1690362102194")),
                ]),
            ),
            ("data", json::s(data)),
        ]))
    }

    const TEXT: &str = r#"{"conversationId":"cidAsXSBLnA==","atUsers":[{"dingtalkId":"$:LWCP_v1:$4TgHFUDZ8Qi8qr3"}],"chatbotCorpId":"ding9f","chatbotUserId":"$:LWCP_v1:$x3vTgHFUDZ8Qi8qr3","msgId":"msgLICYeHgY4JtMQw==","senderNick":"Ann","isAdmin":true,"senderStaffId":"16650698","sessionWebhookExpiredTime":1690367502152,"createAt":1690362101894,"senderCorpId":"ding9","conversationType":"2","senderId":"$:LWCP_v1:$jqTgIfhRX9Q==","conversationTitle":"Ops","isInAtList":true,"sessionWebhook":"https://oapi.dingtalk.com/robot/sendBySession?session=76da36b48f59e8","text":{"content":" hello "},"robotCode":"dingabc","msgtype":"text"}"#;

    #[test]
    fn a_robot_message_is_read_with_its_session_webhook() {
        let Frame::Robot { message_id, message } = read_frame(&frame("CALLBACK", ROBOT_TOPIC, TEXT)) else {
            panic!("a robot message");
        };
        assert_eq!(message_id, "212ca9d7_974_1898c159aa6_1783b");
        assert_eq!(message.msg_id, "msgLICYeHgY4JtMQw==");
        assert_eq!(message.conversation, "cidAsXSBLnA==");
        assert!(message.group);
        assert_eq!((message.text.as_str(), message.nick.as_str()), ("hello", "Ann"));
        assert_eq!(message.staff_id, "16650698");
        assert_eq!(message.title, "Ops");
        assert_eq!(
            message.webhook,
            Some((
                "https://oapi.dingtalk.com/robot/sendBySession?session=76da36b48f59e8".into(),
                1690367502152
            ))
        );
        assert_eq!(message.created_ms, Some(1690362101894));
    }

    #[test]
    fn pings_disconnects_and_other_topics_are_told_apart() {
        let ping = read_frame(&frame("SYSTEM", "ping", r#"{"opaque":"123-dsfs"}"#));
        assert_eq!(
            ping,
            Frame::Ping {
                message_id: "212ca9d7_974_1898c159aa6_1783b".into(),
                data: r#"{"opaque":"123-dsfs"}"#.into()
            }
        );
        let bye = read_frame(&frame("SYSTEM", "disconnect", r#"{"reason":"connection is expired"}"#));
        assert_eq!(
            bye,
            Frame::Disconnect {
                reason: "connection is expired".into()
            }
        );
        assert!(matches!(read_frame(&frame("EVENT", "*", "{}")), Frame::Unwanted { .. }));
        assert!(matches!(
            read_frame(&frame("CALLBACK", "/v1.0/card/instances/callback", "{}")),
            Frame::Unwanted { .. }
        ));
        let answer = stored("m1");
        let v = json::parse(&answer).unwrap();
        let o = json::as_object(&v).unwrap();
        assert_eq!(json::get_u64(o, "code"), Some(200));
        assert_eq!(json::get_str(o, "data"), Some("{\"response\":null}"));
    }

    #[test]
    fn malformed_frames_and_messages_are_refused_with_a_reason() {
        for bad in [
            "",
            "[]",
            "{",
            "null",
            r#"{"type":"CALLBACK"}"#,
            r#"{"type":1,"headers":[]}"#,
        ] {
            assert!(matches!(read_frame(bad), Frame::Other(_)), "{bad}");
        }
        let no_id = frame("CALLBACK", ROBOT_TOPIC, TEXT).replace("212ca9d7_974_1898c159aa6_1783b", "a b");
        assert!(matches!(read_frame(&no_id), Frame::Other(_)));
        for (data, why) in [
            ("not json", "its data is not a JSON object"),
            (r#"{"conversationId":"cidA","conversationType":"2"}"#, "no usable msgId"),
            (
                r#"{"msgId":"m","conversationId":"x/../y","conversationType":"2"}"#,
                "no usable conversationId",
            ),
            (
                r#"{"msgId":"m","conversationId":"cidA","conversationType":"9"}"#,
                "an unknown conversationType",
            ),
        ] {
            match read_frame(&frame("CALLBACK", ROBOT_TOPIC, data)) {
                Frame::Unreadable { why: w, .. } => assert_eq!(w, why, "{data}"),
                other => panic!("{data}: {other:?}"),
            }
        }
        // A webhook that is not an HTTP URL is not kept; the message still is.
        let odd = TEXT.replace("https://oapi.dingtalk.com", "file:///etc");
        let Frame::Robot { message, .. } = read_frame(&frame("CALLBACK", ROBOT_TOPIC, &odd)) else {
            panic!("still a message");
        };
        assert_eq!(message.webhook, None);
    }

    #[test]
    fn rich_text_pictures_files_and_audio_become_text_and_a_file() {
        let m = |kind: &str, content: &str| {
            let text = format!(
                r#"{{"msgId":"m1","conversationId":"cidB","conversationType":1,"msgtype":"{kind}","content":{content}}}"#
            );
            let v = json::parse(&text).unwrap();
            robot_message(json::as_object(&v).unwrap()).unwrap()
        };
        let rich = m(
            "richText",
            r#"{"richText":[{"text":"look "},{"type":"picture","downloadCode":"dc1","pictureDownloadCode":"p"},{"text":"here"}]}"#,
        );
        assert_eq!(rich.text, "look here");
        assert_eq!(rich.file.map(|f| f.download_code), Some("dc1".into()));
        assert!(!rich.group);
        let file = m("file", r#"{"downloadCode":"dc2","fileName":"report.pdf"}"#);
        assert_eq!(file.file.map(|f| f.name), Some("report.pdf".into()));
        let audio = m(
            "audio",
            r#"{"downloadCode":"dc3","recognition":"call me","duration":3}"#,
        );
        assert_eq!(audio.text, "call me");
        assert_eq!(audio.file.map(|f| f.mime), Some("audio/amr".into()));
        assert_eq!(m("markdown", "{}").text, "[a markdown message]");
    }

    #[test]
    fn a_conversation_id_becomes_a_safe_key() {
        assert!(conversation_shaped("cid6KeBBLoveMJOGXoYKF5x7EeiodoA/dbs4x3jx2v0IQQ="));
        assert!(!conversation_shaped("cid../x y"));
        assert!(!conversation_shaped("abc"));
        let key = conversation_key("cid6Ke+BB/LoQQ=");
        assert_eq!(key, "cid6Ke-BB_LoQQ.");
        assert!(safe_id(&key, 128));
    }
}
