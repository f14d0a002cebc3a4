//! Reading what a homeserver sends: a `/sync` answer, a `/messages` page, a room event. Every
//! field is the server's (and, through federation, any server's) choice: IDs are checked before
//! they can name a key or a path, texts are bounded, and what is not understood is skipped, never
//! a failure of the whole answer. Public for the fuzz target.

use crate::json::{self, Object, Value};
use crate::providers::inbound::bounded;

/// Bytes of a message's text kept (an event is at most 65,536 bytes in all).
const MAX_BODY: usize = 64 * 1024;
/// Bytes of a display name or a file name kept.
const MAX_NAME: usize = 256;
/// Bytes of an opaque token (`next_batch`, `prev_batch`, `end`) taken; a longer one is refused.
const MAX_TOKEN: usize = 1024;

/// A room event we may store.
#[derive(Debug)]
pub struct Event {
    pub event_id: String,
    pub sender: String,
    /// `origin_server_ts`, Unix ms (0 when absent).
    pub ts: u64,
    /// `None`: not a message (another type, redacted, no `msgtype`).
    pub message: Option<Message>,
}

#[derive(Debug)]
pub struct Message {
    /// `text`, `notice`, `emote`, `image`, `file`, `audio`, `video`, `other`.
    pub kind: &'static str,
    pub body: String,
    pub media: Option<Media>,
}

/// A message's file, before it is fetched.
#[derive(Debug)]
pub struct Media {
    pub mxc: String,
    pub filename: String,
    pub mime: String,
    pub size: Option<u64>,
}

/// One joined room of a `/sync` answer.
#[derive(Debug, Default)]
pub struct RoomBatch {
    pub room_id: String,
    /// Oldest first, as the server sends them.
    pub events: Vec<Event>,
    /// Events between the last sync and these were left out: fill the gap from `prev_batch`.
    pub limited: bool,
    pub prev_batch: Option<String>,
    /// Display names from the room's member state: `(user ID, name)`.
    pub names: Vec<(String, String)>,
    /// `summary.m.joined_member_count`, when the server says.
    pub members: Option<u64>,
    /// The room turned on end-to-end encryption (an `m.room.encryption` state event): its
    /// messages can no longer be read.
    pub encrypted: bool,
}

#[derive(Debug)]
pub struct SyncAnswer {
    pub next_batch: String,
    /// Every joined room with news, bound or not: the account's loop sorts them.
    pub rooms: Vec<RoomBatch>,
    /// Rooms the account was invited to since the last sync.
    pub invited: Vec<String>,
}

/// One page of `/messages`.
#[derive(Debug, Default)]
pub struct Page {
    /// In the order asked for (`dir=b`: newest first).
    pub events: Vec<Event>,
    /// The token for the next page; `None` at the end of the room's history.
    pub end: Option<String>,
    pub names: Vec<(String, String)>,
}

/// An ID a server gives (`$event`, `@user:server`, `!room:server`): printable ASCII, no space,
/// 2 to 255 bytes, starting with its sigil. Anything else is not stored or used in a path.
pub fn valid_id(id: &str, sigil: u8) -> bool {
    id.len() >= 2 && id.len() <= 255 && id.as_bytes()[0] == sigil && id.bytes().all(|b| b.is_ascii_graphic())
}

fn token(o: &Object, key: &str) -> Option<String> {
    json::get_str(o, key)
        .filter(|t| !t.is_empty() && t.len() <= MAX_TOKEN && t.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_string)
}

/// Reads a `/sync` answer. `None` without a usable `next_batch` (nothing in it can be
/// confirmed).
pub fn read_sync(o: &Object) -> Option<SyncAnswer> {
    let next_batch = token(o, "next_batch")?;
    let section = |name| json::get_obj(o, "rooms").and_then(|r| json::get_obj(r, name));
    let invited = section("invite")
        .into_iter()
        .flatten()
        .map(|(room_id, _)| room_id)
        .filter(|id| valid_id(id, b'!'))
        .cloned()
        .collect();
    let mut rooms = Vec::new();
    for (room_id, room) in section("join").into_iter().flatten() {
        let Some(room) = json::as_object(room) else { continue };
        if !valid_id(room_id, b'!') {
            continue;
        }
        let timeline = json::get_obj(room, "timeline");
        let state = json::get_obj(room, "state").and_then(|s| array(s, "events"));
        let raw_timeline = timeline.and_then(|t| array(t, "events"));
        let encrypted = [state, raw_timeline]
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| json::as_object(e).and_then(|e| json::get_str(e, "type")) == Some("m.room.encryption"));
        let events = timeline
            .and_then(|t| array(t, "events"))
            .map(read_events)
            .unwrap_or_default();
        rooms.push(RoomBatch {
            room_id: room_id.clone(),
            events,
            limited: timeline.is_some_and(|t| matches!(t.get("limited"), Some(Value::Bool(true)))),
            prev_batch: timeline.and_then(|t| token(t, "prev_batch")),
            names: state.map(member_names).unwrap_or_default(),
            members: json::get_obj(room, "summary").and_then(|s| json::get_u64(s, "m.joined_member_count")),
            encrypted,
        });
    }
    Some(SyncAnswer {
        next_batch,
        rooms,
        invited,
    })
}

/// Reads a `/messages` page.
pub fn read_page(o: &Object) -> Page {
    Page {
        events: array(o, "chunk").map(read_events).unwrap_or_default(),
        end: token(o, "end"),
        names: array(o, "state").map(member_names).unwrap_or_default(),
    }
}

fn array<'a>(o: &'a Object, key: &str) -> Option<&'a [Value]> {
    match o.get(key) {
        Some(Value::Array(a)) => Some(a),
        _ => None,
    }
}

fn read_events(events: &[Value]) -> Vec<Event> {
    events
        .iter()
        .filter_map(json::as_object)
        .filter_map(read_event)
        .collect()
}

/// `m.room.member` state events as `(user ID, display name)`.
fn member_names(events: &[Value]) -> Vec<(String, String)> {
    events
        .iter()
        .filter_map(json::as_object)
        .filter(|e| json::get_str(e, "type") == Some("m.room.member"))
        .filter_map(|e| {
            let user = json::get_str(e, "state_key").filter(|u| valid_id(u, b'@'))?;
            let name = json::get_obj(e, "content").and_then(|c| json::get_str(c, "displayname"))?;
            let name = bounded(name.trim(), MAX_NAME);
            (!name.is_empty()).then(|| (user.to_string(), name))
        })
        .collect()
}

/// One room event; `None` without a valid `event_id` and `sender`.
pub fn read_event(e: &Object) -> Option<Event> {
    let event_id = json::get_str(e, "event_id").filter(|id| valid_id(id, b'$'))?;
    let sender = json::get_str(e, "sender").filter(|id| valid_id(id, b'@'))?;
    let message = (json::get_str(e, "type") == Some("m.room.message"))
        .then(|| json::get_obj(e, "content").and_then(read_message))
        .flatten();
    Some(Event {
        event_id: event_id.to_string(),
        sender: sender.to_string(),
        ts: json::get_u64(e, "origin_server_ts").unwrap_or(0),
        message,
    })
}

fn read_message(c: &Object) -> Option<Message> {
    let msgtype = json::get_str(c, "msgtype")?;
    let body = json::get_str(c, "body").unwrap_or_default();
    let kind = match msgtype {
        "m.text" => "text",
        "m.notice" => "notice",
        "m.emote" => "emote",
        "m.image" => "image",
        "m.file" => "file",
        "m.audio" => "audio",
        "m.video" => "video",
        _ => "other",
    };
    let media = matches!(kind, "image" | "file" | "audio" | "video")
        .then(|| {
            let mxc = json::get_str(c, "url").filter(|u| super::api::mxc_parts(u).is_some())?;
            let info = json::get_obj(c, "info");
            // Matrix 1.10: `filename` names the file and `body` is then its caption.
            let filename = json::get_str(c, "filename").unwrap_or(body);
            let filename = bounded(filename.trim(), MAX_NAME);
            Some(Media {
                mxc: mxc.to_string(),
                filename: if filename.is_empty() {
                    kind.to_string()
                } else {
                    filename
                },
                mime: info
                    .and_then(|i| json::get_str(i, "mimetype"))
                    .filter(|m| m.len() <= 100 && m.contains('/') && m.bytes().all(|b| b.is_ascii_graphic()))
                    .unwrap_or("application/octet-stream")
                    .to_string(),
                size: info.and_then(|i| json::get_u64(i, "size")),
            })
        })
        .flatten();
    let text = match (&media, json::get_str(c, "filename")) {
        // A caption only when the file has its own name; else `body` is the name.
        (Some(_), Some(name)) if name != body => body,
        (Some(_), _) => "",
        (None, _) => body,
    };
    Some(Message {
        kind,
        body: bounded(text, MAX_BODY),
        media,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Option<Object> {
        json::parse(text).ok().and_then(|v| json::as_object(&v).cloned())
    }

    #[test]
    fn a_sync_answer_gives_every_rooms_events_names_gap_and_invites() {
        let text = r#"{"next_batch":"s72_1","rooms":{"join":{
            "!a:hs":{"timeline":{"limited":true,"prev_batch":"t1","events":[
                {"type":"m.room.message","event_id":"$1","sender":"@ada:hs","origin_server_ts":5,"content":{"msgtype":"m.text","body":"hi"}},
                {"type":"m.room.message","event_id":"$2","sender":"@bob:hs","content":{"msgtype":"m.image","body":"look","filename":"cat.png","url":"mxc://hs/abc","info":{"mimetype":"image/png","size":9}}},
                {"type":"m.room.message","event_id":"$3","sender":"@bob:hs","content":{}},
                {"type":"m.reaction","event_id":"$4","sender":"@bob:hs","content":{}},
                {"type":"m.room.message","event_id":"no sigil","sender":"@bob:hs","content":{"msgtype":"m.text","body":"x"}}]},
             "state":{"events":[{"type":"m.room.member","state_key":"@ada:hs","content":{"displayname":" Ada "}}]},
             "summary":{"m.joined_member_count":2}},
            "!b:hs":{"timeline":{"events":[{"type":"m.room.message","event_id":"$9","sender":"@x:hs","content":{"msgtype":"m.text","body":"two"}}]}}},
            "invite":{"!c:hs":{"invite_state":{"events":[]}},"no sigil":{}}}}"#;
        let o = parse(text).expect("json");
        let s = read_sync(&o).expect("a next_batch");
        assert_eq!(s.next_batch, "s72_1");
        assert_eq!(s.invited, ["!c:hs"], "an invite with a valid room ID");
        let ids: Vec<&str> = s.rooms.iter().map(|r| r.room_id.as_str()).collect();
        assert_eq!(ids.len(), 2, "every joined room: {ids:?}");
        let r = s.rooms.iter().find(|r| r.room_id == "!a:hs").expect("room a");
        assert!(r.limited);
        assert_eq!(r.prev_batch.as_deref(), Some("t1"));
        assert_eq!(r.members, Some(2));
        assert_eq!(r.names, [("@ada:hs".to_string(), "Ada".to_string())]);
        assert_eq!(r.events.len(), 4, "the event without a valid ID is dropped");
        let m = r.events[0].message.as_ref().expect("a text");
        assert_eq!((m.kind, m.body.as_str(), r.events[0].ts), ("text", "hi", 5));
        let img = r.events[1].message.as_ref().expect("an image");
        let media = img.media.as_ref().expect("its file");
        assert_eq!((img.kind, img.body.as_str()), ("image", "look"), "body is the caption");
        assert_eq!(
            (media.filename.as_str(), media.mime.as_str(), media.size),
            ("cat.png", "image/png", Some(9))
        );
        assert!(r.events[2].message.is_none(), "no msgtype: not a message");
        assert!(r.events[3].message.is_none(), "a reaction is not a message");
        assert!(!r.encrypted);
        let turned = r#"{"next_batch":"s2","rooms":{"join":{"!a:hs":{"timeline":{"events":[
            {"type":"m.room.encryption","event_id":"$5","sender":"@ada:hs","state_key":"","content":{"algorithm":"m.megolm.v1.aes-sha2"}}]}}}}}"#;
        let s = read_sync(&parse(turned).expect("json")).expect("a next_batch");
        assert!(s.rooms[0].encrypted, "encryption turned on is seen");
    }

    #[test]
    fn a_hostile_mxc_or_token_is_refused() {
        assert!(super::super::api::mxc_parts("mxc://hs/../../etc").is_none());
        assert!(super::super::api::mxc_parts("mxc://hs/a?b").is_none());
        assert_eq!(
            super::super::api::mxc_parts("mxc://hs:8448/aB_-1"),
            Some(("hs:8448", "aB_-1"))
        );
        let long = format!(r#"{{"next_batch":"{}"}}"#, "a".repeat(2000));
        assert!(read_sync(&parse(&long).expect("json")).is_none());
        assert!(read_sync(&parse(r#"{"next_batch":"a b"}"#).expect("json")).is_none());
        let file = r#"{"type":"m.room.message","event_id":"$f","sender":"@a:hs","content":{"msgtype":"m.file","body":"x.pdf","url":"mxc://hs/../x"}}"#;
        let e = read_event(&parse(file).expect("json")).expect("an event");
        assert!(
            e.message.and_then(|m| m.media).is_none(),
            "a file with a bad URI has no media"
        );
    }

    #[test]
    fn malformed_sync_answers_never_panic_the_reader() {
        let seeds: [&[u8]; 3] = [
            br#"{"next_batch":"s1","rooms":{"join":{"!r:h":{"timeline":{"limited":true,"prev_batch":"p","events":[{"type":"m.room.message","event_id":"$e","sender":"@u:h","origin_server_ts":18446744073709551615,"content":{"msgtype":"m.file","body":"b","filename":"f","url":"mxc://h/i","info":{"size":1,"mimetype":"a/b"}}}]},"state":{"events":[{"type":"m.room.member","state_key":"@u:h","content":{"displayname":"U"}}]},"summary":{"m.joined_member_count":3}}}}}"#,
            br#"{"chunk":[{"type":"m.room.message","event_id":"$e","sender":"@u:h","content":{"msgtype":"m.text","body":"\u0000"}}],"end":"t","state":[]}"#,
            br#"{"next_batch":"","rooms":{"join":{"!":{}}}}"#,
        ];
        let mut read = 0;
        for input in crate::testutil::mutations(&seeds, 5000, 29) {
            let Some(o) = std::str::from_utf8(&input).ok().and_then(parse) else {
                continue;
            };
            let page = read_page(&o);
            if let Some(s) = read_sync(&o) {
                read += 1;
                assert!(s.invited.iter().all(|r| valid_id(r, b'!')));
                for r in &s.rooms {
                    assert!(valid_id(&r.room_id, b'!'));
                    assert!(r.events.iter().all(|e| valid_id(&e.event_id, b'$')));
                }
            }
            assert!(page
                .events
                .iter()
                .all(|e| e.message.as_ref().is_none_or(|m| m.body.len() <= MAX_BODY)));
        }
        assert!(read > 100, "only {read} mutations were still sync answers");
    }
}
