//! What imgate says to WeCom over the long connection (docs/providers/wecom-protocol.md): the
//! subscribe, pings, replies on a message's `req_id`, proactive sends. Every frame is
//! `{cmd, headers: {req_id}, body}` and is answered by its `req_id` (`event::Frame::Answer`).

use std::time::Duration;

use async_tungstenite::tungstenite::Message as WsMessage;
use smol::future::FutureExt;
use smol::stream::StreamExt;

use super::event::{self, Frame};
use crate::json::{self, obj, s, Value};
use crate::wsclient;

/// A frame larger than this ends the connection (robot messages are far smaller).
pub const MAX_FRAME: usize = 1 << 20;
/// A reply's or a send's Markdown is at most this many bytes.
pub const MAX_CONTENT: usize = 20_480;
/// The subscribe's answer must come this soon after the handshake.
const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(10);
/// WeCom's answers to a reply after the message's window closed, and on a `req_id` it does
/// not know (a reply after a reconnect may meet it): the reply goes as a send.
pub const REPLY_EXPIRED: i64 = 846_608;
pub const REPLY_UNKNOWN: i64 = 846_605;
/// Subscribe codes that say the robot's ID or secret is wrong (the SDKs name none; these are
/// WeCom's "invalid credential" and "invalid bot_id"): only they stop the link as a refusal,
/// anything else is retried with backoff.
pub const CREDENTIALS_REFUSED: [i64; 2] = [40_001, 93_019];

/// The answer to a frame imgate sent.
#[derive(Debug, Clone)]
pub struct Answer {
    pub errcode: i64,
    pub errmsg: String,
    pub upload_id: Option<String>,
    pub media_id: Option<String>,
}

/// A new `req_id` for `cmd`, as the SDK makes them: `{cmd}_{ms}_{8 hex}`.
pub fn req_id(cmd: &str) -> String {
    format!("{cmd}_{}_{:08x}", crate::ids::now_ms(), crate::ids::below(1 << 32))
}

/// A command frame.
pub fn frame(cmd: &str, req_id: &str, body: Option<Value>) -> WsMessage {
    let mut parts = vec![("cmd", s(cmd)), ("headers", obj([("req_id", s(req_id))]))];
    if let Some(body) = body {
        parts.push(("body", body));
    }
    WsMessage::Text(json::to_string(&obj(parts)).into())
}

pub fn ping(req_id: &str) -> WsMessage {
    frame("ping", req_id, None)
}

/// A reply on a message: one stream frame, finished, with `content` as its Markdown.
pub fn reply(req_id: &str, stream_id: &str, content: &str) -> WsMessage {
    let stream = obj([
        ("id", s(stream_id)),
        ("finish", Value::Bool(true)),
        ("content", s(content)),
    ]);
    let body = obj([("msgtype", s("stream")), ("stream", stream)]);
    frame("aibot_respond_msg", req_id, Some(body))
}

/// A proactive Markdown message to `chat` (a group's chatid, or a user's userid).
pub fn send(req_id: &str, chat: &str, content: &str) -> WsMessage {
    let body = obj([
        ("chatid", s(chat)),
        ("msgtype", s("markdown")),
        ("markdown", obj([("content", s(content))])),
    ]);
    frame("aibot_send_msg", req_id, Some(body))
}

/// A proactive media message (`file` or `image`) to `chat`, of an uploaded `media_id`.
pub fn send_media(req_id: &str, chat: &str, kind: &str, media_id: &str) -> WsMessage {
    let body = obj([
        ("chatid", s(chat)),
        ("msgtype", s(kind)),
        (kind, obj([("media_id", s(media_id))])),
    ]);
    frame("aibot_send_msg", req_id, Some(body))
}

/// The first of an upload's three steps: what comes, in how many chunks.
pub fn upload_init(req_id: &str, kind: &str, filename: &str, size: u64, chunks: usize, md5: &str) -> WsMessage {
    let body = obj([
        ("type", s(kind)),
        ("filename", s(filename)),
        ("total_size", json::n(size)),
        ("total_chunks", json::n(chunks as u64)),
        ("md5", s(md5)),
    ]);
    frame("aibot_upload_media_init", req_id, Some(body))
}

/// One chunk (at most `MAX_CHUNK` bytes), numbered from 0 as the SDK's code does.
pub fn upload_chunk(req_id: &str, upload_id: &str, index: usize, bytes: &[u8]) -> WsMessage {
    let body = obj([
        ("upload_id", s(upload_id)),
        ("chunk_index", json::n(index as u64)),
        ("base64_data", s(crate::ids::base64(bytes))),
    ]);
    frame("aibot_upload_media_chunk", req_id, Some(body))
}

pub fn upload_finish(req_id: &str, upload_id: &str) -> WsMessage {
    frame(
        "aibot_upload_media_finish",
        req_id,
        Some(obj([("upload_id", s(upload_id))])),
    )
}

/// An upload's chunk is at most this many bytes, and an upload at most `MAX_CHUNKS` chunks.
pub const MAX_CHUNK: usize = 512 << 10;
pub const MAX_CHUNKS: u64 = 100;
/// What WeCom takes of an image and of any other file.
pub const MAX_IMAGE: u64 = 10_000_000;
pub const MAX_FILE: u64 = 20_000_000;

/// Why a subscribe did not give a connection.
pub enum Refusal {
    /// WeCom answered the subscribe with an error code: the code, and why, for the owner.
    Refused(i64, String),
    /// Could not ask now.
    Failed(String),
}

/// Opens the long connection at `url` and subscribes as `bot`: the socket, once WeCom answered
/// the subscribe with 0.
pub async fn subscribe(url: &str, bot: &str, secret: &str) -> Result<wsclient::Ws, Refusal> {
    let mut ws = wsclient::open(url, MAX_FRAME).await.map_err(Refusal::Failed)?;
    let id = req_id("aibot_subscribe");
    let body = obj([("bot_id", s(bot)), ("secret", s(secret))]);
    ws.send(frame("aibot_subscribe", &id, Some(body)))
        .await
        .map_err(|e| Refusal::Failed(e.to_string()))?;
    let answered = async {
        while let Some(frame) = ws.next().await {
            match frame {
                Ok(WsMessage::Text(t)) if t.len() <= json::INLINE_PARSE => match event::read_frame(t.as_str()) {
                    Frame::Answer {
                        req_id,
                        errcode,
                        errmsg,
                        ..
                    } if req_id == id => return Ok((errcode, errmsg)),
                    _ => {}
                },
                Ok(WsMessage::Close(_)) => return Err("closed before the subscribe was answered".to_string()),
                Ok(_) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
        Err("closed before the subscribe was answered".to_string())
    };
    let late = async {
        smol::Timer::after(SUBSCRIBE_TIMEOUT).await;
        Err(format!("no answer to the subscribe within {SUBSCRIBE_TIMEOUT:?}"))
    };
    match answered.or(late).await {
        Ok((0, _)) => Ok(ws),
        Ok((code, msg)) => Err(Refusal::Refused(
            code,
            format!(
                "WeCom refused the robot's subscribe ({code}: {})",
                crate::quiet::shown(&msg)
            ),
        )),
        Err(why) => Err(Refusal::Failed(crate::quiet::shown(&why))),
    }
}
