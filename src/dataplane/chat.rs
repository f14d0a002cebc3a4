//! xAgent's side of IM profile v2 (sections 5 to 9): its `chat.message`s go to the bound
//! conversation and are acked only once the target took them; its deltas stream there (or wait
//! for the final); its activity shows as typing. The session runs these per channel, in
//! arrival order, one at a time (`session`'s chat workers).
//!
//! State, all bounded:
//! - completed messages, `(channel, message_id)` → fingerprint of text and files, kept
//!   `COMPLETED_TTL` and at most `COMPLETED_PER_CHANNEL` per channel, on disk (`chat_completed`,
//!   owned here): the same `message_id` again is `duplicate` and sends nothing, across restarts;
//!   another text or file list under it is `rejected` `message_conflict`;
//! - streams of deltas, in memory: `STREAM_TTL` since the last delta, `STREAMS_PER_CHANNEL` per
//!   channel, `STREAMS_TOTAL` in all, `STREAM_TEXT` bytes each. A restart forgets them: the
//!   final then arrives as a message of its own, still once.

use super::blocking;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redb::{ReadableTable, TableDefinition};

use super::Plane;
use crate::ids;
use crate::json::{self, b, obj, s, Object, Value};
use crate::protocol::{code, Packet};
use crate::providers::{Activity, Delta, Failure, Outbound};

/// xAgent's messages that a provider could not deliver: one line a minute (xAgent sends at will).
static UNDELIVERED: crate::quiet::Site = crate::quiet::Site::new();
use crate::source::Source;
use crate::store::{self, Db};

/// `(channel, message_id)` → `"completed_at fingerprint"`.
const COMPLETED: TableDefinition<(&str, &str), &str> = TableDefinition::new("chat_completed");
/// How long a completed `message_id` is answered `duplicate`.
pub const COMPLETED_TTL: Duration = Duration::from_secs(24 * 3600);
/// Completed `message_id`s remembered per channel at most (the oldest go first).
pub const COMPLETED_PER_CHANNEL: usize = 1000;
/// A stream of deltas with no news for this long is forgotten.
pub const STREAM_TTL: Duration = Duration::from_secs(600);
/// Streams kept at once per channel and in all (the oldest go first).
pub const STREAMS_PER_CHANNEL: usize = 8;
pub const STREAMS_TOTAL: usize = 64;
/// Text of one stream at most; later deltas are refused (the final carries it all).
pub const STREAM_TEXT: usize = 64 * 1024;
/// Longest `message_id`, and most files, of a `chat.message`.
const MAX_ID: usize = 256;
const MAX_FILES: usize = 16;

/// A validated `chat.message` from xAgent.
#[derive(Debug, PartialEq)]
pub struct ChatMessage {
    pub message_id: String,
    pub text: String,
    pub file_refs: Vec<String>,
}

/// A validated `chat.message.delta`.
#[derive(Debug, PartialEq)]
pub struct DeltaIn {
    pub message_id: String,
    pub sequence: u64,
    pub text: String,
}

fn message_id(o: &Object) -> Result<String, String> {
    match json::get_str(o, "message_id") {
        Some(id) if !id.is_empty() && id.len() <= MAX_ID => Ok(id.to_string()),
        _ => Err(format!("`message_id` must be a string of 1 to {MAX_ID} bytes")),
    }
}

/// Reads a `chat.message` payload (section 5); the `Err` names the problem.
pub fn parse_message(o: &Object) -> Result<ChatMessage, String> {
    let message_id = message_id(o)?;
    let text = match o.get("text") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(t)) => t.clone(),
        Some(_) => return Err("`text` must be a string".into()),
    };
    let mut file_refs: Vec<String> = Vec::new();
    match o.get("files") {
        None | Some(Value::Null) => {}
        Some(Value::Array(files)) => {
            if files.len() > MAX_FILES {
                return Err(format!("at most {MAX_FILES} files in one message"));
            }
            for f in files {
                let f = json::as_object(f).ok_or("each file must be an object")?;
                match json::get_str(f, "type") {
                    Some("image" | "video" | "audio" | "file") => {}
                    _ => return Err("`files[].type` must be image, video, audio or file".into()),
                }
                let r = json::get_str(f, "file_ref")
                    .filter(|r| !r.is_empty())
                    .ok_or("each file needs a `file_ref`")?;
                if file_refs.iter().any(|x| x == r) {
                    return Err("a `file_ref` appears twice in one message".into());
                }
                file_refs.push(r.to_string());
            }
        }
        Some(_) => return Err("`files` must be an array".into()),
    }
    if text.is_empty() && file_refs.is_empty() {
        return Err("a message needs `text` or `files`".into());
    }
    Ok(ChatMessage {
        message_id,
        text,
        file_refs,
    })
}

/// Reads a `chat.message.delta` payload (section 6).
pub fn parse_delta(o: &Object) -> Result<DeltaIn, String> {
    let message_id = message_id(o)?;
    let sequence = json::get_u64(o, "sequence")
        .filter(|n| *n >= 1)
        .ok_or("`sequence` must be an integer from 1")?;
    let text = json::get_str(o, "text").ok_or("`text` must be a string")?.to_string();
    Ok(DeltaIn {
        message_id,
        sequence,
        text,
    })
}

/// Reads a `chat.activity` payload (section 8).
pub fn parse_activity(o: &Object) -> Result<Activity, String> {
    let tool = json::get(o, "tool_name");
    match (json::get_str(o, "status"), tool) {
        (Some("thinking"), None) => Ok(Activity::Busy),
        (Some("tool"), Some(Value::String(t))) if !t.is_empty() && t.len() <= 256 => Ok(Activity::Busy),
        (Some("tool"), _) => Err("`tool_name` (1 to 256 bytes) is required with status tool".into()),
        (Some("idle"), None) => Ok(Activity::Idle),
        (Some("thinking" | "idle"), Some(_)) => Err("`tool_name` is only allowed with status tool".into()),
        _ => Err("`status` must be thinking, tool or idle".into()),
    }
}

/// What identifies a message's content: its text and its files, in order.
fn fingerprint(m: &ChatMessage) -> String {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(&(m.text.len() as u64).to_le_bytes());
    ctx.update(m.text.as_bytes());
    for r in &m.file_refs {
        ctx.update(b"\0");
        ctx.update(r.as_bytes());
    }
    ids::hex(&ctx.finish().as_ref()[..16])
}

struct Stream {
    /// Each delta's text, by sequence (1 first).
    pieces: Vec<String>,
    text: String,
    /// What the provider returned when it showed the stream.
    handle: Option<String>,
    touched: Instant,
}

/// IM v2's per-channel state on xAgent's side: completed messages (disk), streams (memory).
pub struct Chats {
    db: Arc<Db>,
    streams: Mutex<HashMap<(String, String), Stream>>,
}

/// How a `chat.message` ended, for its ack.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    Accepted,
    Duplicate,
    Rejected(Failure),
}

/// What a delta does: nothing (a retransmission), or show the text so far.
enum Applied {
    Repeat,
    Show { text: String, handle: Option<String> },
}

impl Chats {
    pub fn open(db: Arc<Db>) -> store::Result<Chats> {
        db.write(|txn| {
            txn.open_table(COMPLETED)?;
            Ok(())
        })?;
        Ok(Chats {
            db,
            streams: Mutex::new(HashMap::new()),
        })
    }

    fn completed(&self, cch: &str, id: &str) -> store::Result<Option<String>> {
        self.db.read(|txn| {
            let v = txn
                .open_table(COMPLETED)?
                .get((cch, id))?
                .map(|v| v.value().to_string());
            Ok(v.and_then(|v| v.split_once(' ').map(|(_, fp)| fp.to_string())))
        })
    }

    /// Remembers a completed message; the channel keeps its newest `COMPLETED_PER_CHANNEL`.
    fn complete(&self, cch: &str, id: &str, fp: &str) -> store::Result<()> {
        let value = format!("{} {fp}", ids::now_ms());
        self.db.write(|txn| {
            let mut t = txn.open_table(COMPLETED)?;
            t.insert((cch, id), value.as_str())?;
            let mut mine: Vec<(u64, String)> = Vec::new();
            for row in t.range((cch, "")..)? {
                let (k, v) = row?;
                if k.value().0 != cch {
                    break;
                }
                let at = v.value().split(' ').next().and_then(|n| n.parse().ok()).unwrap_or(0);
                mine.push((at, k.value().1.to_string()));
            }
            if mine.len() > COMPLETED_PER_CHANNEL {
                mine.sort();
                for (_, old) in &mine[..mine.len() - COMPLETED_PER_CHANNEL] {
                    t.remove((cch, old.as_str()))?;
                }
            }
            Ok(())
        })
    }

    /// Forgets completed messages past `COMPLETED_TTL`; returns how many.
    pub fn sweep(&self, now: u64) -> store::Result<u64> {
        let cutoff = now.saturating_sub(COMPLETED_TTL.as_millis() as u64);
        self.db.write(|txn| {
            let mut n = 0;
            txn.open_table(COMPLETED)?.retain(|_, v| {
                let at: u64 = v.split(' ').next().and_then(|n| n.parse().ok()).unwrap_or(0);
                let keep = at > cutoff;
                n += u64::from(!keep);
                keep
            })?;
            Ok(n)
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Stream>> {
        self.streams.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies a delta to its stream (section 6): the next sequence extends it, a repeated one
    /// with the same text changes nothing, a gap or another text is refused with its code.
    fn apply(&self, cch: &str, d: &DeltaIn) -> Result<Applied, &'static str> {
        let mut streams = self.lock();
        streams.retain(|_, st| st.touched.elapsed() < STREAM_TTL);
        let key = (cch.to_string(), d.message_id.clone());
        if !streams.contains_key(&key) {
            if d.sequence != 1 {
                return Err("delta_sequence_gap");
            }
            // Room: the oldest stream of this channel, or of all, goes.
            let oldest = |streams: &HashMap<(String, String), Stream>, channel: Option<&str>| {
                streams
                    .iter()
                    .filter(|((c, _), _)| channel.is_none_or(|ch| ch == c))
                    .min_by_key(|(_, st)| st.touched)
                    .map(|(k, _)| k.clone())
            };
            if streams.keys().filter(|(c, _)| c == cch).count() >= STREAMS_PER_CHANNEL {
                if let Some(k) = oldest(&streams, Some(cch)) {
                    streams.remove(&k);
                }
            }
            if streams.len() >= STREAMS_TOTAL {
                if let Some(k) = oldest(&streams, None) {
                    streams.remove(&k);
                }
            }
            streams.insert(
                key.clone(),
                Stream {
                    pieces: Vec::new(),
                    text: String::new(),
                    handle: None,
                    touched: Instant::now(),
                },
            );
        }
        let Some(st) = streams.get_mut(&key) else {
            return Err("delta_sequence_gap");
        };
        let next = st.pieces.len() as u64 + 1;
        if d.sequence < next {
            let same = st.pieces.get((d.sequence - 1) as usize).is_some_and(|p| *p == d.text);
            return if same {
                Ok(Applied::Repeat)
            } else {
                Err("delta_conflict")
            };
        }
        if d.sequence > next {
            return Err("delta_sequence_gap");
        }
        if st.text.len() + d.text.len() > STREAM_TEXT {
            return Err("delta_too_large");
        }
        st.pieces.push(d.text.clone());
        st.text.push_str(&d.text);
        st.touched = Instant::now();
        Ok(Applied::Show {
            text: st.text.clone(),
            handle: st.handle.clone(),
        })
    }

    fn set_handle(&self, cch: &str, id: &str, handle: String) {
        if let Some(st) = self.lock().get_mut(&(cch.to_string(), id.to_string())) {
            st.handle = Some(handle);
        }
    }

    /// The final arrived: the stream ends; what the provider showed of it, if anything.
    fn end(&self, cch: &str, id: &str) -> Option<String> {
        self.lock()
            .remove(&(cch.to_string(), id.to_string()))
            .and_then(|st| st.handle)
    }

    fn handle_of(&self, cch: &str, id: &str) -> Option<String> {
        self.lock()
            .get(&(cch.to_string(), id.to_string()))
            .and_then(|st| st.handle.clone())
    }

    /// Streams held now.
    #[cfg(test)]
    fn streams(&self) -> usize {
        self.lock().len()
    }
}

/// The bound source of a channel and its provider, or the rejection that says why not.
fn binding(plane: &Plane, cch: &str) -> Result<(Source, Arc<dyn crate::providers::Provider>), Failure> {
    let rec = plane.channels.channel(cch).map_err(Failure::storage)?;
    let source = rec.and_then(|r| r.source()).ok_or_else(|| {
        Failure::new(
            code::CONNECTION_NOT_AUTHENTICATED,
            "the channel is not bound; complete an auth flow first",
        )
    })?;
    let provider = plane
        .providers
        .of(&source)
        .cloned()
        .ok_or_else(|| Failure::new(code::CHANNEL_UNAVAILABLE, "the channel's provider is not enabled"))?;
    Ok((source, provider))
}

/// Sends xAgent's message to the conversation (blocking: the provider's call).
fn deliver(plane: &Plane, cch: &str, m: &ChatMessage) -> Outcome {
    let fp = fingerprint(m);
    match plane.chats.completed(cch, &m.message_id) {
        Ok(Some(known)) if known == fp => return Outcome::Duplicate,
        Ok(Some(_)) => {
            return Outcome::Rejected(Failure::new(
                "message_conflict",
                "this message_id was completed with another text or file list",
            ))
        }
        Ok(None) => {}
        Err(e) => return Outcome::Rejected(Failure::storage(e)),
    }
    let (source, provider) = match binding(plane, cch) {
        Ok(b) => b,
        Err(f) => return Outcome::Rejected(f),
    };
    let mut files = Vec::with_capacity(m.file_refs.len());
    for r in &m.file_refs {
        match plane.files.get(r) {
            Ok(Some(f)) if f.0.direction == "out" && f.0.source == source.as_str() => files.push(f),
            Ok(_) => {
                return Outcome::Rejected(Failure::new(
                    code::FILE_REF_INVALID,
                    "a file_ref is unknown, expired or was uploaded for another channel",
                ))
            }
            Err(e) => return Outcome::Rejected(Failure::storage(e)),
        }
    }
    let streamed = plane.chats.handle_of(cch, &m.message_id);
    let out = Outbound {
        text: &m.text,
        reply_to: None,
        reply_sender: None,
        files: &files,
        idempotency_key: &m.message_id,
        message_id: Some(&m.message_id),
        streamed: streamed.as_deref(),
    };
    match provider.send(&source, &out) {
        Ok(_) => {
            plane.chats.end(cch, &m.message_id);
            provider.activity(&source, Activity::Idle);
            // Remembered before the ack: a message acked `accepted` is never sent again. (Should
            // this write fail, the ack still says accepted; a retransmission could repeat it.)
            if let Err(e) = plane.chats.complete(cch, &m.message_id, &fp) {
                log::error!("data plane: cannot remember completed message on {cch}: {e}");
            }
            Outcome::Accepted
        }
        Err(f) => Outcome::Rejected(f),
    }
}

/// The ack of a `chat.message` (section 7).
fn ack(p: &Packet, message_id: &str, outcome: &Outcome) -> Packet {
    let payload = match outcome {
        Outcome::Accepted => obj([("message_id", s(message_id)), ("status", s("accepted"))]),
        Outcome::Duplicate => obj([("message_id", s(message_id)), ("status", s("duplicate"))]),
        Outcome::Rejected(f) => obj([
            ("message_id", s(message_id)),
            ("status", s("rejected")),
            ("code", s(f.code)),
            ("message", s(&f.message)),
            ("retryable", b(f.retryable)),
        ]),
    };
    Packet::answer(p, "chat.message.ack").with_payload(payload)
}

/// One chat packet of channel `cch`, in its turn; the packet to send back, if any.
pub async fn handle(plane: &Arc<Plane>, cch: &str, p: Packet) -> Option<Packet> {
    match p.kind.as_str() {
        "chat.message" => Some(message(plane, cch, &p).await),
        "chat.message.delta" => delta(plane, cch, &p).await,
        "chat.activity" => {
            let activity = match parse_activity(&p.payload) {
                Ok(a) => a,
                Err(why) => return Some(Packet::error_for(Some(&p), code::INVALID_PACKET, why)),
            };
            let cch = cch.to_string();
            blocking(plane, move |plane| {
                if let Ok((source, provider)) = binding(plane, &cch) {
                    provider.activity(&source, activity);
                }
            })
            .await;
            None
        }
        _ => None,
    }
}

/// `chat.message`: delivered to the conversation (on the pool), then acked.
async fn message(plane: &Arc<Plane>, cch: &str, p: &Packet) -> Packet {
    let m = match parse_message(&p.payload) {
        Ok(m) => m,
        Err(why) => {
            return match json::get_str(&p.payload, "message_id") {
                Some(id) => ack(p, id, &Outcome::Rejected(Failure::new(code::INVALID_PACKET, why))),
                None => Packet::error_for(Some(p), code::INVALID_PACKET, why),
            }
        }
    };
    let (id, cch) = (m.message_id.clone(), cch.to_string());
    let outcome = blocking(plane, move |plane| deliver(plane, &cch, &m)).await;
    if let Outcome::Rejected(f) = &outcome {
        if let Some(more) = UNDELIVERED.admit() {
            let (id, why) = (crate::quiet::shown(&id), crate::quiet::shown(&f.message));
            log::info!("data plane: message {id} not delivered: {} ({why}){more}", f.code);
        }
    }
    ack(p, &id, &outcome)
}

/// `chat.message.delta`: the message so far, shown where the conversation can show it.
async fn delta(plane: &Arc<Plane>, cch: &str, p: &Packet) -> Option<Packet> {
    let d = match parse_delta(&p.payload) {
        Ok(d) => d,
        Err(why) => return Some(Packet::error_for(Some(p), code::INVALID_PACKET, why)),
    };
    let cch = cch.to_string();
    // A delta after the final (or a restart) must not start a second message.
    let (c, id) = (cch.clone(), d.message_id.clone());
    if matches!(
        blocking(plane, move |plane| plane.chats.completed(&c, &id)).await,
        Ok(Some(_))
    ) {
        return None;
    }
    let (text, handle) = match plane.chats.apply(&cch, &d) {
        Err(code) => {
            let why = format!("delta {} of message {} refused", d.sequence, d.message_id);
            return Some(Packet::error_for(Some(p), code, why));
        }
        Ok(Applied::Repeat) => return None,
        Ok(Applied::Show { text, handle }) => (text, handle),
    };
    blocking(plane, move |plane| {
        let Ok((source, provider)) = binding(plane, &cch) else {
            return;
        };
        let delta = Delta {
            message_id: &d.message_id,
            sequence: d.sequence,
            piece: &d.text,
            text: &text,
        };
        match provider.stream(&source, &delta, handle.as_deref()) {
            Ok(Some(h)) => {
                if handle.is_none() {
                    // Visible text replaces the activity.
                    provider.activity(&source, Activity::Idle);
                }
                plane.chats.set_handle(&cch, &d.message_id, h);
            }
            Ok(None) => {}
            Err(f) => log::debug!("data plane: a delta could not be shown: {} ({})", f.code, f.message),
        }
    })
    .await;
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn o(v: &str) -> Object {
        match json::parse(v).unwrap() {
            Value::Object(o) => o,
            _ => panic!("object"),
        }
    }

    #[test]
    fn chat_messages_need_an_id_and_text_or_files() {
        let m = parse_message(&o(
            r#"{"message_id":"m1","text":"hi","files":[{"type":"image","file_ref":"file_1"}]}"#,
        ))
        .unwrap();
        assert_eq!((m.text.as_str(), m.file_refs.len()), ("hi", 1));
        for bad in [
            r#"{"text":"hi"}"#,
            r#"{"message_id":"m1"}"#,
            r#"{"message_id":"m1","text":""}"#,
            r#"{"message_id":"m1","files":[{"type":"pdf","file_ref":"f"}]}"#,
            r#"{"message_id":"m1","files":[{"type":"file","file_ref":"f"},{"type":"file","file_ref":"f"}]}"#,
            r#"{"message_id":"m1","text":5}"#,
        ] {
            assert!(parse_message(&o(bad)).is_err(), "{bad}");
        }
        assert_eq!(
            parse_activity(&o(r#"{"status":"tool","tool_name":"search"}"#)),
            Ok(Activity::Busy)
        );
        assert!(parse_activity(&o(r#"{"status":"idle","tool_name":"x"}"#)).is_err());
        assert!(parse_activity(&o(r#"{"status":"tool"}"#)).is_err());
        assert!(parse_delta(&o(r#"{"message_id":"m","sequence":0,"text":"a"}"#)).is_err());
    }

    #[test]
    fn thousands_of_mutated_chat_payloads_never_panic_the_readers() {
        let seeds: [&[u8]; 3] = [
            br#"{"message_id":"m1","text":"hi","files":[{"type":"image","file_ref":"file_ab","filename":"a.png"}],"created_at":1}"#,
            br#"{"message_id":"m1","sequence":3,"text":" more"}"#,
            br#"{"status":"tool","tool_name":"web_search"}"#,
        ];
        for input in crate::testutil::mutations(&seeds, 3000, 17) {
            let Ok(Value::Object(o)) = json::parse(&String::from_utf8_lossy(&input)) else {
                continue;
            };
            let _ = parse_message(&o);
            let _ = parse_delta(&o);
            let _ = parse_activity(&o);
        }
    }

    #[test]
    fn deltas_extend_in_order_repeat_harmlessly_and_refuse_gaps_and_conflicts() {
        let (db, _) = store::temp_db("chat");
        let chats = Chats::open(db).unwrap();
        let d = |seq, text: &str| DeltaIn {
            message_id: "a1".into(),
            sequence: seq,
            text: text.into(),
        };
        assert!(matches!(chats.apply("c", &d(2, "x")), Err("delta_sequence_gap")));
        assert!(matches!(chats.apply("c", &d(1, "Hel")), Ok(Applied::Show { ref text, .. }) if text == "Hel"));
        assert!(matches!(chats.apply("c", &d(2, "lo")), Ok(Applied::Show { ref text, .. }) if text == "Hello"));
        assert!(matches!(chats.apply("c", &d(2, "lo")), Ok(Applied::Repeat)));
        assert!(matches!(chats.apply("c", &d(1, "Xel")), Err("delta_conflict")));
        assert!(matches!(chats.apply("c", &d(4, "!")), Err("delta_sequence_gap")));
        chats.set_handle("c", "a1", "h".into());
        assert_eq!(chats.end("c", "a1").as_deref(), Some("h"));
        assert_eq!(chats.streams(), 0);
    }

    #[test]
    fn streams_are_bounded_per_channel_and_in_all() {
        let (db, _) = store::temp_db("chat-caps");
        let chats = Chats::open(db).unwrap();
        for i in 0..(STREAMS_TOTAL * 2) {
            let channel = format!("c{}", i % 20);
            let d = DeltaIn {
                message_id: format!("m{i}"),
                sequence: 1,
                text: "x".into(),
            };
            assert!(chats.apply(&channel, &d).is_ok());
        }
        assert!(chats.streams() <= STREAMS_TOTAL);
        let big = DeltaIn {
            message_id: "big".into(),
            sequence: 1,
            text: "y".repeat(STREAM_TEXT + 1),
        };
        assert!(matches!(chats.apply("c", &big), Err("delta_too_large")));
    }

    #[test]
    fn completed_messages_are_kept_per_channel_up_to_the_cap() {
        let (db, _) = store::temp_db("chat-done");
        let chats = Chats::open(db).unwrap();
        for i in 0..(COMPLETED_PER_CHANNEL + 5) {
            chats.complete("c", &format!("m{i:05}"), "fp").unwrap();
        }
        chats.complete("d", "other", "fp").unwrap();
        let kept = chats
            .db
            .read(|txn| {
                let mut n = 0;
                for row in txn.open_table(COMPLETED)?.iter()? {
                    n += usize::from(row?.0.value().0 == "c");
                }
                Ok(n)
            })
            .unwrap();
        assert_eq!(kept, COMPLETED_PER_CHANNEL);
        assert_eq!(chats.completed("d", "other").unwrap().as_deref(), Some("fp"));
        assert_eq!(
            chats
                .sweep(ids::now_ms() + COMPLETED_TTL.as_millis() as u64 + 1)
                .unwrap() as usize,
            COMPLETED_PER_CHANNEL + 1
        );
    }
}
