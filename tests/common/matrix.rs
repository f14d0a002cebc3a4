//! A Matrix homeserver simulator written from the client-server API (`matrix-org/matrix-spec`,
//! `data/api/client-server/`: sync.yaml, message_pagination.yaml, room_send.yaml, typing.yaml,
//! joining.yaml, list_joined_rooms.yaml, directory.yaml, room_state.yaml, whoami.yaml,
//! versions.yaml, content-repo.yaml, authed-content-repo.yaml, errors/rate_limited.yaml),
//! not from imgate's code. It does what a real Synapse cannot be steered to do on demand:
//! gaps in /sync, failing or oversized /sync answers, rate-limited sends.
//!
//! Shape: tiny_http on 127.0.0.1:0, one thread per request (a /sync long-poll must not starve
//! the sends and uploads of the same client). Everything lives in one `State` behind a mutex
//! with a condvar: a /sync waits on it for new events, tests wait on it for what the client did.
//! Every event is on one stream; its position is its index + 1, and a token names a position:
//! `s{N}` (a /sync `next_batch` or `prev_batch`: "after event N") or `t{N}` (a /messages `end`).
//! Choices where the spec is silent are marked "Chosen:".

use std::collections::hash_map::{DefaultHasher, RandomState};
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use super::kit::now_ms;

/// The server name of media URIs (`mxc://sim/…`).
pub const SERVER: &str = "sim";
/// Longest a /sync is held, whatever its `timeout` asks.
const MAX_SYNC_WAIT: Duration = Duration::from_secs(30);

struct Room {
    members: Vec<String>,
    invited: Vec<String>,
    encrypted: bool,
}

/// An event of the stream: its room, its client JSON (without `room_id`), and for an event a
/// client sent, the (access token, txnId) it came with.
struct Ev {
    room: String,
    json: Value,
    txn: Option<(String, String)>,
}

struct Media {
    ctype: String,
    filename: Option<String>,
    bytes: Vec<u8>,
}

#[derive(Default)]
struct State {
    /// access token → (user ID, device ID)
    tokens: HashMap<String, (String, String)>,
    names: HashMap<String, String>,
    rooms: BTreeMap<String, Room>,
    aliases: HashMap<String, String>,
    events: Vec<Ev>,
    /// (token, room, event type, txnId) → event ID: the spec scopes transaction IDs to a
    /// device and an endpoint.
    txns: HashMap<(String, String, String, String), String>,
    sent: Vec<(String, Value)>,
    send_calls: Vec<(String, String)>,
    filters: Vec<Value>,
    syncs: usize,
    sinces: Vec<Option<String>>,
    /// /syncs being held right now.
    polling: usize,
    paginations: Vec<(String, BTreeMap<String, String>)>,
    typing: Vec<(String, String, bool)>,
    media: HashMap<String, Media>,
    uploads: Vec<(String, String, Vec<u8>)>,
    downloads: Vec<String>,
    max_upload: usize,
    pad: usize,
    /// (how many more, status, errcode)
    sync_failures: (usize, u16, String),
    /// (how many more, retry_after_ms)
    send_limits: (usize, u64),
    hold: bool,
    stopped: bool,
    next_id: u64,
}

type Shared = Arc<(Mutex<State>, Condvar)>;

pub struct MatrixSim {
    /// `http://127.0.0.1:PORT`, the homeserver's base URL.
    pub base: String,
    state: Shared,
}

impl MatrixSim {
    pub fn start() -> MatrixSim {
        let http = tiny_http::Server::http("127.0.0.1:0").unwrap();
        let port = http.server_addr().to_ip().unwrap().port();
        let state: Shared = Arc::default();
        state.0.lock().unwrap().max_upload = 50 << 20; // Synapse's default max_upload_size
        let st = state.clone();
        std::thread::spawn(move || loop {
            match http.recv_timeout(Duration::from_millis(100)) {
                Ok(Some(req)) => {
                    let st = st.clone();
                    std::thread::spawn(move || serve(&st, req));
                }
                Ok(None) => {}
                Err(_) => return,
            }
            if st.0.lock().unwrap().stopped {
                return; // drops the server: its port closes
            }
        });
        MatrixSim {
            base: format!("http://127.0.0.1:{port}"),
            state,
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        super::kit::change(&self.state, f)
    }

    /// Waits until `ready` holds; false after `timeout`.
    fn wait(&self, timeout: Duration, ready: impl Fn(&State) -> bool) -> bool {
        super::kit::wait_for(&self.state, timeout, ready)
    }

    // ---------- setup ----------

    /// A user whose requests carry `Authorization: Bearer {token}`; display name = localpart.
    pub fn add_user(&self, user_id: &str, token: &str) {
        self.with(|s| {
            let device = format!("SIMDEV{}", s.tokens.len() + 1);
            s.tokens.insert(token.into(), (user_id.into(), device));
        });
    }

    /// The token answers 401 M_UNKNOWN_TOKEN from now on.
    pub fn revoke(&self, token: &str) {
        self.with(|s| s.tokens.remove(token));
    }

    pub fn set_display_name(&self, user: &str, name: &str) {
        self.with(|s| s.names.insert(user.into(), name.into()));
    }

    /// A room that already existed: its members joined before any event of the stream.
    pub fn add_room(&self, room_id: &str, members: &[&str], encrypted: bool) {
        let members = members.iter().map(|m| m.to_string()).collect();
        self.with(|s| {
            let room = Room {
                members,
                invited: Vec::new(),
                encrypted,
            };
            s.rooms.insert(room_id.into(), room)
        });
    }

    /// An invite by the room's first member: an `m.room.member` event on the stream, shown to
    /// `user` under `rooms.invite` by the next /sync.
    pub fn invite(&self, room: &str, user: &str) {
        self.with(|s| {
            let r = s.rooms.get_mut(room).expect("invite to a known room");
            r.invited.push(user.into());
            let by = r.members.first().cloned().unwrap_or_else(|| format!("@admin:{SERVER}"));
            append(
                s,
                room,
                &by,
                "m.room.member",
                json!({"membership": "invite"}),
                Some(user),
                None,
            );
        });
    }

    pub fn add_alias(&self, alias: &str, room_id: &str) {
        self.with(|s| s.aliases.insert(alias.into(), room_id.into()));
    }

    /// `sender` posts an `m.room.message`; its event ID.
    pub fn post_message(&self, room: &str, sender: &str, content: Value) -> String {
        self.post_event(room, sender, "m.room.message", content)
    }

    /// `post_message` of `{"msgtype":"m.text","body":body}`.
    pub fn post_text(&self, room: &str, sender: &str, body: &str) -> String {
        self.post_message(room, sender, json!({"msgtype": "m.text", "body": body}))
    }

    /// Any message event (`m.room.encrypted`, `m.reaction`…); its event ID.
    pub fn post_event(&self, room: &str, sender: &str, kind: &str, content: Value) -> String {
        self.with(|s| append(s, room, sender, kind, content, None, None))
    }

    /// `n` texts `burst 1`…`burst n` appended under one lock, so a /sync held right now wakes
    /// once to all of them: more than the timeline limit makes a gap (`limited: true`).
    pub fn post_burst(&self, room: &str, sender: &str, n: usize) -> Vec<String> {
        self.with(|s| {
            (1..=n)
                .map(|i| {
                    let content = json!({"msgtype": "m.text", "body": format!("burst {i}")});
                    append(s, room, sender, "m.room.message", content, None, None)
                })
                .collect()
        })
    }

    /// Every event of the room, oldest first, as /messages shows them (with `room_id`).
    pub fn timeline(&self, room: &str) -> Vec<Value> {
        self.with(|s| {
            let evs = s.events.iter().filter(|e| e.room == room);
            evs.map(|e| with_room(e.json.clone(), room)).collect()
        })
    }

    /// The current stream position as a /sync token (what `next_batch` would be now).
    pub fn token_now(&self) -> String {
        self.with(|s| format!("s{}", s.events.len()))
    }

    // ---------- steering ----------

    /// Every /sync answer carries `bytes` of junk in an extra top-level field.
    pub fn pad_sync_answers(&self, bytes: usize) {
        self.with(|s| s.pad = bytes);
    }

    /// The next `n` /syncs answer `status` with `{"errcode": errcode}`.
    pub fn fail_next_syncs(&self, n: usize, status: u16, errcode: &str) {
        self.with(|s| s.sync_failures = (n, status, errcode.into()));
    }

    /// While on, /syncs answer nothing new (held until their timeout, then empty with the
    /// position unchanged), so events pile up while the client keeps polling.
    pub fn set_sync_hold(&self, on: bool) {
        self.with(|s| s.hold = on);
    }

    /// The next `n` sends answer 429 M_LIMIT_EXCEEDED with `retry_after_ms` and `Retry-After`.
    pub fn rate_limit_next_sends(&self, n: usize, retry_after_ms: u64) {
        self.with(|s| s.send_limits = (n, retry_after_ms));
    }

    /// Uploads above `bytes` answer 413 M_TOO_LARGE; /media/config reports it.
    pub fn set_max_upload(&self, bytes: usize) {
        self.with(|s| s.max_upload = bytes);
    }

    /// Media someone else uploaded; its `mxc://` URI.
    pub fn add_media(&self, bytes: &[u8], content_type: &str, filename: &str) -> String {
        self.with(|s| {
            let id = random_id(s, 24);
            let m = Media {
                ctype: content_type.into(),
                filename: Some(filename.into()),
                bytes: bytes.to_vec(),
            };
            s.media.insert(id.clone(), m);
            format!("mxc://{SERVER}/{id}")
        })
    }

    // ---------- what the client did ----------

    /// Every inline `filter` of a /sync, parsed (a filter ID shows as a JSON string).
    pub fn filters(&self) -> Vec<Value> {
        self.with(|s| s.filters.clone())
    }

    pub fn syncs(&self) -> usize {
        self.with(|s| s.syncs)
    }

    /// The `since` of every /sync, in order (`None`: an initial sync).
    pub fn sinces(&self) -> Vec<Option<String>> {
        self.with(|s| s.sinces.clone())
    }

    /// Every /messages call: (room, query parameters).
    pub fn paginations(&self) -> Vec<(String, BTreeMap<String, String>)> {
        self.with(|s| s.paginations.clone())
    }

    /// The content of every event sent into `room` (once per transaction).
    pub fn sent(&self, room: &str) -> Vec<Value> {
        self.with(|s| {
            s.sent
                .iter()
                .filter(|(r, _)| r == room)
                .map(|(_, c)| c.clone())
                .collect()
        })
    }

    /// Every send call, rate-limited and repeated ones too: (room, txnId).
    pub fn send_calls(&self) -> Vec<(String, String)> {
        self.with(|s| s.send_calls.clone())
    }

    pub fn typing_calls(&self) -> Vec<(String, String, bool)> {
        self.with(|s| s.typing.clone())
    }

    /// Every upload: (filename, Content-Type, bytes).
    pub fn uploads(&self) -> Vec<(String, String, Vec<u8>)> {
        self.with(|s| s.uploads.clone())
    }

    /// The `mxc://` URI of every successful authenticated download.
    pub fn downloads(&self) -> Vec<String> {
        self.with(|s| s.downloads.clone())
    }

    /// Waits until the latest /sync's filter is one `wanted` takes.
    pub fn wait_filter(&self, timeout: Duration, wanted: impl Fn(&Value) -> bool) -> bool {
        self.wait(timeout, |s| s.filters.last().is_some_and(&wanted))
    }

    pub fn wait_syncs(&self, n: usize, timeout: Duration) -> bool {
        self.wait(timeout, |s| s.syncs >= n)
    }

    /// Waits until a /sync is being held (the client is long-polling with nothing to get).
    pub fn wait_polling(&self, timeout: Duration) -> bool {
        self.wait(timeout, |s| s.polling > 0)
    }

    pub fn wait_sent(&self, room: &str, n: usize, timeout: Duration) -> bool {
        self.wait(timeout, |s| s.sent.iter().filter(|(r, _)| r == room).count() >= n)
    }

    pub fn wait_typing(&self, n: usize, timeout: Duration) -> bool {
        self.wait(timeout, |s| s.typing.len() >= n)
    }
}

impl Drop for MatrixSim {
    /// Held /syncs return and the accept loop ends.
    fn drop(&mut self) {
        self.with(|s| s.stopped = true);
    }
}

// ---------- the stream ----------

fn random_id(s: &mut State, len: usize) -> String {
    // URL-safe base64's alphabet, as event IDs of room versions 4 and up use.
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    while out.len() < len {
        s.next_id += 1;
        let mut h = RandomState::new().build_hasher();
        h.write_u64(s.next_id);
        let mut x = h.finish();
        for _ in 0..10 {
            out.push(A[(x % 64) as usize] as char);
            x /= 64;
        }
    }
    out.truncate(len);
    out
}

/// Appends an event to `room`'s timeline; its event ID (`$` + 43 characters, the shape of room
/// versions 4 and up, which carry no server name).
fn append(
    s: &mut State,
    room: &str,
    sender: &str,
    kind: &str,
    content: Value,
    state_key: Option<&str>,
    txn: Option<(String, String)>,
) -> String {
    let id = format!("${}", random_id(s, 43));
    let mut json = json!({"event_id": id, "type": kind, "sender": sender,
                          "origin_server_ts": now_ms(), "content": content});
    if let Some(k) = state_key {
        json["state_key"] = json!(k);
    }
    s.events.push(Ev {
        room: room.into(),
        json,
        txn,
    });
    id
}

fn display_name(s: &State, user: &str) -> String {
    // Synapse's default display name is the localpart.
    let local = user.trim_start_matches('@').split(':').next().unwrap_or(user);
    s.names.get(user).cloned().unwrap_or_else(|| local.into())
}

/// The room's events with their stream positions, oldest first.
fn room_events<'a>(s: &'a State, room: &'a str) -> impl Iterator<Item = (u64, &'a Ev)> + 'a {
    let evs = s.events.iter().enumerate().map(|(i, e)| (i as u64 + 1, e));
    evs.filter(move |(_, e)| e.room == room)
}

/// An event as the client `token` sees it: `unsigned.transaction_id` only for the device that
/// sent it (spec: "if the client being given the event is the same one which sent it").
fn for_client(e: &Ev, token: &str) -> Value {
    let mut v = e.json.clone();
    if let Some((t, txn)) = &e.txn {
        if t == token {
            v["unsigned"] = json!({"transaction_id": txn});
        }
    }
    v
}

fn with_room(mut v: Value, room: &str) -> Value {
    v["room_id"] = json!(room);
    v
}

/// A member's current `m.room.member` state event.
fn member_event(s: &State, room: &str, user: &str) -> Value {
    let mut h = DefaultHasher::new();
    (room, user).hash(&mut h);
    json!({"event_id": format!("$member{:016x}", h.finish()), "type": "m.room.member", "state_key": user,
           "sender": user, "origin_server_ts": 0,
           "content": {"membership": "join", "displayname": display_name(s, user)}})
}

fn joined(s: &State, room: &str, user: &str) -> bool {
    s.rooms.get(room).is_some_and(|r| r.members.iter().any(|m| m == user))
}

/// A token's position: `s{N}` always, `t{N}` where /messages tokens are welcome.
fn token_pos(t: &str, messages: bool) -> Option<u64> {
    let n = t
        .strip_prefix('s')
        .or_else(|| t.strip_prefix('t').filter(|_| messages))?;
    n.parse().ok()
}

// ---------- /sync ----------

struct Filter {
    rooms: Option<Vec<String>>,
    limit: usize,
}

fn sync_body(s: &State, token: &str, user: &str, since: Option<u64>, f: &Filter) -> Value {
    let now = s.events.len() as u64;
    let after = since.unwrap_or(0);
    let (mut join, mut invite) = (Map::new(), Map::new());
    for (id, room) in &s.rooms {
        if f.rooms.as_ref().is_some_and(|r| !r.contains(id)) {
            continue;
        }
        if room.members.iter().any(|m| m == user) {
            let evs: Vec<(u64, &Ev)> = room_events(s, id).filter(|(p, _)| *p > after).collect();
            // An initial sync shows every joined room; an incremental one those with news.
            if since.is_some() && evs.is_empty() {
                continue;
            }
            let cut = evs.len().saturating_sub(f.limit);
            let shown = &evs[cut..];
            // prev_batch: just before the first event shown, so /messages?dir=b&from=prev_batch
            // returns the gap (or older history) and nothing shown here.
            let prev = shown.first().map_or(now, |(p, _)| p - 1);
            let mut senders: Vec<&str> = Vec::new();
            for (_, e) in shown {
                let who = e.json["sender"].as_str().unwrap_or_default();
                if !senders.contains(&who) {
                    senders.push(who);
                }
            }
            // Chosen: like lazy-loading members, state carries the member events of the
            // timeline's senders (for their display names), not the room's whole state.
            let state: Vec<Value> = senders.iter().map(|u| member_event(s, id, u)).collect();
            let events: Vec<Value> = shown.iter().map(|(_, e)| for_client(e, token)).collect();
            join.insert(
                id.clone(),
                json!({
                    "timeline": {"events": events, "limited": cut > 0, "prev_batch": format!("s{prev}")},
                    "state": {"events": state},
                    "summary": {"m.joined_member_count": room.members.len(),
                                "m.invited_member_count": room.invited.len()},
                    "ephemeral": {"events": []},
                    "account_data": {"events": []},
                }),
            );
        } else if room.invited.iter().any(|m| m == user) {
            let is_invite = |e: &Ev| e.json["state_key"] == user && e.json["content"]["membership"] == "invite";
            let ev = room_events(s, id).filter(|(p, e)| *p > after && is_invite(e)).last();
            if let Some((_, e)) = ev {
                // Stripped state: the invite event itself.
                let stripped = json!({"type": "m.room.member", "state_key": user,
                                      "sender": e.json["sender"], "content": e.json["content"]});
                invite.insert(id.clone(), json!({"invite_state": {"events": [stripped]}}));
            }
        }
    }
    json!({"next_batch": format!("s{now}"), "rooms": {"join": join, "invite": invite, "leave": {}}})
}

fn has_news(body: &Value) -> bool {
    ["join", "invite"]
        .iter()
        .any(|k| body["rooms"][k].as_object().is_some_and(|m| !m.is_empty()))
}

fn sync(mut s: MutexGuard<State>, cv: &Condvar, token: &str, user: &str, q: &BTreeMap<String, String>) -> Answer {
    s.syncs += 1;
    s.sinces.push(q.get("since").cloned());
    let mut filter = Filter {
        rooms: None,
        limit: 10, // the spec's default timeline limit
    };
    if let Some(text) = q.get("filter") {
        if !text.starts_with('{') {
            s.filters.push(json!(text));
            // Chosen: filter IDs (POST /user/{userId}/filter) are not simulated.
            return err(400, "M_INVALID_PARAM", "the simulator takes inline JSON filters only");
        }
        let Ok(v) = serde_json::from_str::<Value>(text) else {
            return err(400, "M_NOT_JSON", "filter is not JSON");
        };
        if let Some(r) = v["room"]["rooms"].as_array() {
            filter.rooms = Some(r.iter().filter_map(|x| x.as_str().map(String::from)).collect());
        }
        if let Some(l) = v["room"]["timeline"]["limit"].as_u64() {
            filter.limit = l as usize;
        }
        s.filters.push(v);
    }
    cv.notify_all(); // for wait_syncs
    if s.sync_failures.0 > 0 {
        s.sync_failures.0 -= 1;
        let (status, code) = (s.sync_failures.1, s.sync_failures.2.clone());
        return err(status, &code, "simulated failure");
    }
    let since = match q.get("since") {
        None => None,
        Some(t) => match token_pos(t, false) {
            Some(p) => Some(p),
            None => return err(400, "M_INVALID_PARAM", "Invalid stream token"),
        },
    };
    let wait = Duration::from_millis(q.get("timeout").and_then(|t| t.parse().ok()).unwrap_or(0));
    let deadline = Instant::now() + wait.min(MAX_SYNC_WAIT);
    let mut held = false;
    let body = loop {
        let body = (!s.hold).then(|| sync_body(&s, token, user, since, &filter));
        // An initial sync answers at once; an incremental one when there is news.
        if let Some(b) = body.filter(|b| since.is_none() || has_news(b)) {
            break b;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || s.stopped {
            break match s.hold {
                // Nothing new was shown: the client stays where it was.
                true => {
                    json!({"next_batch": format!("s{}", since.unwrap_or(0)), "rooms": {"join": {}, "invite": {}, "leave": {}}})
                }
                false => sync_body(&s, token, user, since, &filter),
            };
        }
        if !held {
            held = true;
            s.polling += 1;
            cv.notify_all(); // for wait_polling
        }
        s = cv.wait_timeout(s, left).unwrap().0;
    };
    if held {
        s.polling -= 1;
    }
    let mut body = body;
    if s.pad > 0 {
        body["sim_padding"] = json!("x".repeat(s.pad));
    }
    ok(body)
}

// ---------- the other endpoints ----------

fn messages(s: &mut State, token: &str, user: &str, room: &str, q: &BTreeMap<String, String>) -> Answer {
    s.paginations.push((room.into(), q.clone()));
    if !joined(s, room, user) {
        return err(403, "M_FORBIDDEN", "You aren't a member of the room");
    }
    let back = match q.get("dir").map(String::as_str) {
        Some("b") => true,
        Some("f") => false,
        _ => return err(400, "M_INVALID_PARAM", "dir must be b or f"),
    };
    let limit = q.get("limit").and_then(|l| l.parse().ok()).unwrap_or(10usize);
    let parse = |k: &str| q.get(k).map(|t| token_pos(t, true).ok_or(()));
    let (Ok(from), Ok(to)) = (parse("from").transpose(), parse("to").transpose()) else {
        return err(400, "M_INVALID_PARAM", "Invalid pagination token");
    };
    // No `from`: from the newest event backwards, from the oldest forwards.
    let from = from.unwrap_or(if back { s.events.len() as u64 } else { 0 });
    let mut evs: Vec<(u64, &Ev)> = room_events(s, room)
        .filter(|(p, _)| match back {
            true => *p <= from && to.is_none_or(|t| *p > t),
            false => *p > from && to.is_none_or(|t| *p <= t),
        })
        .collect();
    if back {
        evs.reverse();
    }
    let more = evs.len() > limit;
    evs.truncate(limit);
    let chunk: Vec<Value> = evs.iter().map(|(_, e)| with_room(for_client(e, token), room)).collect();
    let start = q.get("from").cloned().unwrap_or_else(|| format!("t{from}"));
    let mut out = json!({"start": start, "chunk": chunk});
    // `end` is left out when nothing further is available (the spec's end-of-history signal).
    if let (true, Some((last, _))) = (more, evs.last()) {
        out["end"] = json!(format!("t{}", if back { last - 1 } else { *last }));
    }
    ok(out)
}

fn send(s: &mut State, token: &str, user: &str, room: &str, kind: &str, txn: &str, body: &[u8]) -> Answer {
    s.send_calls.push((room.into(), txn.into()));
    if s.send_limits.0 > 0 {
        s.send_limits.0 -= 1;
        let ms = s.send_limits.1;
        let mut a = answer(
            429,
            json!({"errcode": "M_LIMIT_EXCEEDED", "error": "Too Many Requests", "retry_after_ms": ms}),
        );
        // MSC4041 (spec v1.10): the header in seconds alongside the deprecated body field.
        a.headers.push(("Retry-After".into(), ms.div_ceil(1000).to_string()));
        return a;
    }
    if !joined(s, room, user) {
        return err(403, "M_FORBIDDEN", "User not in room");
    }
    let Ok(content @ Value::Object(_)) = serde_json::from_slice::<Value>(body) else {
        return err(400, "M_NOT_JSON", "Content not JSON.");
    };
    let key = (token.to_string(), room.to_string(), kind.to_string(), txn.to_string());
    if let Some(id) = s.txns.get(&key) {
        return ok(json!({"event_id": id})); // a retry: the same event, nothing new
    }
    let id = append(
        s,
        room,
        user,
        kind,
        content.clone(),
        None,
        Some((token.into(), txn.into())),
    );
    s.txns.insert(key, id.clone());
    s.sent.push((room.into(), content));
    ok(json!({"event_id": id}))
}

fn join(s: &mut State, user: &str, target: &str) -> Answer {
    let room = match target.starts_with('#') {
        true => match s.aliases.get(target) {
            Some(r) => r.clone(),
            None => return err(404, "M_NOT_FOUND", "Room alias not found"),
        },
        false => target.to_string(),
    };
    let Some(r) = s.rooms.get_mut(&room) else {
        return err(404, "M_NOT_FOUND", "No known servers");
    };
    if !r.members.iter().any(|m| m == user) {
        let Some(i) = r.invited.iter().position(|m| m == user) else {
            return err(403, "M_FORBIDDEN", "You are not invited to this room.");
        };
        r.invited.remove(i);
        r.members.push(user.into());
        let content = json!({"membership": "join", "displayname": display_name(s, user)});
        append(s, &room, user, "m.room.member", content, Some(user), None);
    }
    ok(json!({"room_id": room}))
}

fn state_event(s: &State, user: &str, room: &str, kind: &str, key: &str) -> Answer {
    if !joined(s, room, user) {
        return err(403, "M_FORBIDDEN", "You aren't a member of the room");
    }
    match (kind, key) {
        ("m.room.encryption", "") if s.rooms[room].encrypted => ok(json!({"algorithm": "m.megolm.v1.aes-sha2"})),
        ("m.room.member", u) if joined(s, room, u) => ok(member_event(s, room, u)["content"].clone()),
        _ => err(404, "M_NOT_FOUND", "Event not found."),
    }
}

fn download(s: &mut State, server: &str, id: &str, name: Option<&str>) -> Answer {
    let Some(m) = s.media.get(id).filter(|_| server == SERVER) else {
        return err(404, "M_NOT_FOUND", "Not found");
    };
    // Chosen: images inline, everything else as an attachment (the spec's SHOULD, simplified).
    let kind = if m.ctype.starts_with("image/") {
        "inline"
    } else {
        "attachment"
    };
    let disposition = match name.or(m.filename.as_deref()) {
        Some(n) => format!("{kind}; filename=\"{n}\""),
        None => kind.to_string(),
    };
    let a = Answer {
        status: 200,
        body: m.bytes.clone(),
        headers: vec![
            ("Content-Type".into(), m.ctype.clone()),
            ("Content-Disposition".into(), disposition),
        ],
    };
    s.downloads.push(format!("mxc://{server}/{id}"));
    a
}

// ---------- HTTP ----------

struct Answer {
    status: u16,
    body: Vec<u8>,
    headers: Vec<(String, String)>,
}

fn answer(status: u16, v: Value) -> Answer {
    Answer {
        status,
        body: v.to_string().into_bytes(),
        headers: vec![("Content-Type".into(), "application/json".into())],
    }
}

fn ok(v: Value) -> Answer {
    answer(200, v)
}

/// The spec's standard error response.
fn err(status: u16, errcode: &str, error: &str) -> Answer {
    answer(status, json!({"errcode": errcode, "error": error}))
}

/// Percent-decoding; `+` is a space in a query, itself in a path.
fn decode(s: &str, query: bool) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = b
            .get(i + 1..i + 3)
            .and_then(|h| u8::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok());
        match (b[i], hex) {
            (b'%', Some(v)) => {
                out.push(v);
                i += 2;
            }
            (b'+', _) if query => out.push(b' '),
            (c, _) => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn serve(shared: &Shared, mut req: tiny_http::Request) {
    let mut body = Vec::new();
    let _ = req.as_reader().read_to_end(&mut body);
    let header = |name: &'static str| {
        let h = req.headers().iter().find(|h| h.field.equiv(name));
        h.map(|h| h.value.to_string())
    };
    let (auth, ctype) = (header("Authorization"), header("Content-Type").unwrap_or_default());
    let url = req.url().to_string();
    let (path, query) = url.split_once('?').unwrap_or((&url, ""));
    let q: BTreeMap<String, String> = query
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| kv.split_once('=').unwrap_or((kv, "")))
        .map(|(k, v)| (decode(k, true), decode(v, true)))
        .collect();
    let segs: Vec<String> = path.split('/').skip(1).map(|p| decode(p, false)).collect();
    let segs: Vec<&str> = segs.iter().map(String::as_str).collect();
    let method = req.method().as_str().to_string();
    let a = route(shared, &method, &segs, &q, auth.as_deref(), &ctype, &body);
    shared.1.notify_all(); // new events wake held /syncs; records wake the tests' waits
    let mut resp = tiny_http::Response::from_data(a.body).with_status_code(a.status);
    for (k, v) in a.headers {
        resp = resp.with_header(tiny_http::Header::from_bytes(k.as_bytes(), v.as_bytes()).unwrap());
    }
    let _ = req.respond(resp);
}

fn route(
    shared: &Shared,
    method: &str,
    segs: &[&str],
    q: &BTreeMap<String, String>,
    auth: Option<&str>,
    ctype: &str,
    body: &[u8],
) -> Answer {
    let mut s = shared.0.lock().unwrap();
    match segs {
        ["_matrix", "client", "versions"] => {
            let versions = [
                "r0.6.1", "v1.1", "v1.2", "v1.3", "v1.4", "v1.5", "v1.6", "v1.7", "v1.8", "v1.9", "v1.10", "v1.11",
                "v1.12",
            ];
            return ok(json!({"versions": versions, "unstable_features": {}}));
        }
        // Synapse with authenticated media serves new media only under /_matrix/client/v1.
        ["_matrix", "media", "v3", "download" | "thumbnail", ..] => return err(404, "M_NOT_FOUND", "Not found"),
        _ => {}
    }
    // Chosen: the Authorization header only; `?access_token=` (deprecated in v1.11) is ignored.
    let Some(token) = auth.and_then(|a| a.strip_prefix("Bearer ")).map(str::to_string) else {
        return err(401, "M_MISSING_TOKEN", "Missing access token");
    };
    let Some((user, device)) = s.tokens.get(&token).cloned() else {
        return answer(
            401,
            json!({"errcode": "M_UNKNOWN_TOKEN", "error": "Unknown access token", "soft_logout": false}),
        );
    };
    let (user, token) = (user.as_str(), token.as_str());
    match (method, segs) {
        ("GET", ["_matrix", "client", "v3", "sync"]) => sync(s, &shared.1, token, user, q),
        ("GET", ["_matrix", "client", "v3", "account", "whoami"]) => {
            ok(json!({"user_id": user, "device_id": device, "is_guest": false}))
        }
        ("GET", ["_matrix", "client", "v3", "joined_rooms"]) => {
            let rooms: Vec<&String> = s.rooms.keys().filter(|r| joined(&s, r, user)).collect();
            ok(json!({"joined_rooms": rooms}))
        }
        ("GET", ["_matrix", "client", "v3", "directory", "room", alias]) => match s.aliases.get(*alias) {
            Some(room) => ok(json!({"room_id": room, "servers": [SERVER]})),
            None => err(404, "M_NOT_FOUND", "Room alias not found"),
        },
        ("POST", ["_matrix", "client", "v3", "join", target]) => join(&mut s, user, target),
        ("POST", ["_matrix", "client", "v3", "rooms", room, "join"]) => join(&mut s, user, room),
        ("GET", ["_matrix", "client", "v3", "rooms", room, "joined_members"]) => {
            if !joined(&s, room, user) {
                return err(403, "M_FORBIDDEN", "You aren't a member of the room");
            }
            let members = s.rooms[*room].members.iter();
            let joined: Map<String, Value> = members
                .map(|m| (m.clone(), json!({"display_name": display_name(&s, m)})))
                .collect();
            ok(json!({"joined": joined}))
        }
        ("GET", ["_matrix", "client", "v3", "rooms", room, "state", kind]) => state_event(&s, user, room, kind, ""),
        ("GET", ["_matrix", "client", "v3", "rooms", room, "state", kind, key]) => {
            state_event(&s, user, room, kind, key)
        }
        ("GET", ["_matrix", "client", "v3", "rooms", room, "messages"]) => messages(&mut s, token, user, room, q),
        ("PUT", ["_matrix", "client", "v3", "rooms", room, "send", kind, txn]) => {
            send(&mut s, token, user, room, kind, txn, body)
        }
        ("PUT", ["_matrix", "client", "v3", "rooms", room, "typing", who]) => {
            if *who != user || !joined(&s, room, user) {
                return err(403, "M_FORBIDDEN", "Cannot set another user's typing state");
            }
            let v: Value = serde_json::from_slice(body).unwrap_or_default();
            let Some(on) = v["typing"].as_bool() else {
                return err(400, "M_BAD_JSON", "typing is required");
            };
            s.typing.push((room.to_string(), user.into(), on));
            ok(json!({}))
        }
        ("POST", ["_matrix", "media", "v3", "upload"]) => {
            if body.len() > s.max_upload {
                return err(413, "M_TOO_LARGE", "Upload request body is too large");
            }
            let id = random_id(&mut s, 24);
            let filename = q.get("filename").cloned();
            let name = filename.clone().unwrap_or_default();
            s.uploads.push((name, ctype.into(), body.to_vec()));
            let m = Media {
                ctype: ctype.into(),
                filename,
                bytes: body.to_vec(),
            };
            s.media.insert(id.clone(), m);
            ok(json!({"content_uri": format!("mxc://{SERVER}/{id}")}))
        }
        ("GET", ["_matrix", "client", "v1", "media", "config"]) => ok(json!({"m.upload.size": s.max_upload})),
        ("GET", ["_matrix", "client", "v1", "media", "download", server, id, rest @ ..]) => {
            download(&mut s, server, id, rest.first().copied())
        }
        _ => err(404, "M_UNRECOGNIZED", "Unrecognized request"),
    }
}

// ---------- self check ----------

struct Resp {
    status: u16,
    headers: ureq::http::HeaderMap,
    body: Vec<u8>,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
    fn header(&self, name: &str) -> String {
        let h = self.headers.get(name).map(|v| v.to_str().unwrap_or_default());
        h.unwrap_or_default().to_string()
    }
}

fn call(method: &str, url: &str, token: Option<&str>, ctype: &str, body: &[u8]) -> Resp {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(40)))
        .build()
        .into();
    let auth = token.map(|t| format!("Bearer {t}"));
    let r = match method {
        "GET" => {
            let mut b = agent.get(url);
            if let Some(a) = &auth {
                b = b.header("Authorization", a);
            }
            b.call()
        }
        m => {
            let mut b = if m == "PUT" { agent.put(url) } else { agent.post(url) };
            if let Some(a) = &auth {
                b = b.header("Authorization", a);
            }
            b.header("Content-Type", ctype).send(body)
        }
    };
    let mut r = r.expect("the simulator answers");
    let (status, headers) = (r.status().as_u16(), r.headers().clone());
    let body = r.body_mut().with_config().limit(u64::MAX).read_to_vec().unwrap();
    Resp { status, headers, body }
}

/// Exercises every endpoint and steering knob through plain HTTP.
pub fn self_check() {
    let m = MatrixSim::start();
    let (bot, tok, alice) = ("@bot:sim", "bot-token", "@alice:sim");
    m.add_user(bot, tok);
    m.add_user(alice, "alice-token");
    m.set_display_name(alice, "Alice A.");
    m.add_room("!plain:sim", &[bot, alice], false);
    m.add_room("!enc:sim", &[bot, alice], true);
    m.add_room("!other:sim", &[alice], false);
    m.add_alias("#lobby:sim", "!other:sim");
    let c = |p: &str| format!("{}/_matrix/client/v3{p}", m.base);
    let get = |url: &str| call("GET", url, Some(tok), "", b"");
    let put = |url: &str, v: Value| call("PUT", url, Some(tok), "application/json", v.to_string().as_bytes());
    let post = |url: &str| call("POST", url, Some(tok), "application/json", b"{}");

    // Discovery and auth.
    let r = call("GET", &format!("{}/_matrix/client/versions", m.base), None, "", b"");
    assert!(r.status == 200 && r.json()["versions"].as_array().unwrap().contains(&json!("v1.11")));
    let r = call("GET", &c("/account/whoami"), None, "", b"");
    assert_eq!((r.status, r.json()["errcode"].clone()), (401, json!("M_MISSING_TOKEN")));
    let r = call("GET", &c("/account/whoami"), Some("nope"), "", b"");
    assert_eq!((r.status, r.json()["errcode"].clone()), (401, json!("M_UNKNOWN_TOKEN")));
    assert_eq!(get(&c("/account/whoami")).json()["user_id"], bot);

    // Rooms, aliases, joins, members, encryption state.
    let rooms = get(&c("/joined_rooms")).json();
    assert_eq!(rooms["joined_rooms"], json!(["!enc:sim", "!plain:sim"]), "{rooms}");
    assert_eq!(
        get(&c("/directory/room/%23lobby%3Asim")).json()["room_id"],
        "!other:sim"
    );
    assert_eq!(get(&c("/directory/room/%23nope%3Asim")).status, 404);
    assert_eq!(post(&c("/join/%23lobby%3Asim")).status, 403);
    let members = get(&c("/rooms/%21plain%3Asim/joined_members")).json();
    assert_eq!(members["joined"][alice]["display_name"], "Alice A.", "{members}");
    assert_eq!(get(&c("/rooms/%21other%3Asim/joined_members")).status, 403);
    let r = get(&c("/rooms/%21enc%3Asim/state/m.room.encryption/"));
    assert_eq!(
        (r.status, r.json()["algorithm"].clone()),
        (200, json!("m.megolm.v1.aes-sha2"))
    );
    assert_eq!(get(&c("/rooms/%21enc%3Asim/state/m.room.encryption")).status, 200);
    assert_eq!(
        get(&c("/rooms/!plain:sim/state/m.room.encryption/")).json()["errcode"],
        "M_NOT_FOUND"
    );
    assert_eq!(get(&c("/rooms/%21other%3Asim/state/m.room.encryption/")).status, 403);

    // Initial sync, then an invite and a join.
    let first = m.post_text("!plain:sim", alice, "hello");
    let r = get(&c("/sync?timeout=0"));
    let b = r.json();
    let tl = &b["rooms"]["join"]["!plain:sim"]["timeline"];
    assert_eq!(
        (tl["events"][0]["event_id"].as_str(), tl["limited"].clone()),
        (Some(first.as_str()), json!(false))
    );
    let state = &b["rooms"]["join"]["!plain:sim"]["state"]["events"][0];
    assert_eq!(state["content"]["displayname"], "Alice A.", "{b}");
    assert!(
        b["rooms"]["join"]["!enc:sim"].is_object(),
        "an initial sync shows every joined room"
    );
    let mut since = b["next_batch"].as_str().unwrap().to_string();
    m.invite("!other:sim", bot);
    let b = get(&c(&format!("/sync?since={since}&timeout=5000"))).json();
    assert!(
        b["rooms"]["invite"]["!other:sim"]["invite_state"]["events"].is_array(),
        "{b}"
    );
    assert_eq!(post(&c("/join/%23lobby%3Asim")).json()["room_id"], "!other:sim");
    assert_eq!(
        post(&c("/rooms/%21other%3Asim/join")).status,
        200,
        "joining again is fine"
    );
    assert_ne!(
        b["next_batch"].as_str(),
        Some(m.token_now().as_str()),
        "the join is an event"
    );
    since = m.token_now();

    // A long-poll woken by a new event, not by its timeout.
    std::thread::scope(|sc| {
        let url = c(&format!("/sync?since={since}&timeout=20000"));
        let h = sc.spawn(move || get(&url));
        assert!(m.wait_polling(Duration::from_secs(10)));
        let started = Instant::now();
        m.post_text("!other:sim", alice, "wake");
        let b = h.join().unwrap().json();
        assert!(started.elapsed() < Duration::from_secs(5));
        let evs = b["rooms"]["join"]["!other:sim"]["timeline"]["events"]
            .as_array()
            .unwrap()
            .clone();
        assert_eq!(evs.last().unwrap()["content"]["body"], "wake", "{b}");
        since = b["next_batch"].as_str().unwrap().into();
    });

    // A gap during a long-poll: the newest `limit` events, limited, and /messages fills it.
    let filter = r#"{"room":{"rooms":["!plain:sim"],"timeline":{"limit":5}}}"#;
    let fq = encode(filter);
    std::thread::scope(|sc| {
        let url = c(&format!("/sync?since={since}&timeout=20000&filter={fq}"));
        let h = sc.spawn(move || get(&url));
        assert!(m.wait_polling(Duration::from_secs(10)));
        m.post_text("!other:sim", alice, "filtered out");
        let ids = m.post_burst("!plain:sim", alice, 12);
        let b = h.join().unwrap().json();
        assert!(b["rooms"]["join"]["!other:sim"].is_null(), "room filter: {b}");
        let tl = &b["rooms"]["join"]["!plain:sim"]["timeline"];
        assert_eq!(tl["limited"], true, "{b}");
        let shown: Vec<&str> = tl["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["event_id"].as_str().unwrap())
            .collect();
        assert_eq!(shown, ids[7..].iter().map(String::as_str).collect::<Vec<_>>());
        let mut from = tl["prev_batch"].as_str().unwrap().to_string();
        let mut back = Vec::new();
        loop {
            let p = get(&c(&format!("/rooms/%21plain%3Asim/messages?dir=b&limit=4&from={from}"))).json();
            back.extend(
                p["chunk"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|e| e["event_id"].as_str().unwrap().to_string()),
            );
            match p["end"].as_str() {
                Some(e) => from = e.into(),
                None => break,
            }
        }
        let mut want: Vec<String> = ids[..7].to_vec();
        want.insert(0, first.clone());
        want.reverse();
        assert_eq!(back, want, "dir=b pages newest first down to the first event");
        since = b["next_batch"].as_str().unwrap().into();
    });
    assert_eq!(m.filters()[0]["room"]["timeline"]["limit"], 5);
    let f = get(&c("/rooms/%21plain%3Asim/messages?dir=f&limit=100")).json();
    assert_eq!(f["chunk"].as_array().unwrap().len(), 13);
    assert!(f["end"].is_null() && !m.paginations().is_empty());

    // Sends: idempotent per txnId, rate limited on demand, echoed with transaction_id.
    let url = c("/rooms/%21plain%3Asim/send/m.room.message/txn1");
    let e1 = put(&url, json!({"msgtype": "m.text", "body": "hi"})).json()["event_id"].clone();
    let e2 = put(&url, json!({"msgtype": "m.text", "body": "hi"})).json()["event_id"].clone();
    assert_eq!(e1, e2);
    assert_eq!(m.sent("!plain:sim").len(), 1);
    m.rate_limit_next_sends(1, 1500);
    let r = put(
        &c("/rooms/%21plain%3Asim/send/m.room.message/txn2"),
        json!({"body": "x"}),
    );
    assert_eq!(
        (r.status, r.json()["retry_after_ms"].clone(), r.header("Retry-After")),
        (429, json!(1500), "2".into())
    );
    assert_eq!(
        put(&c("/rooms/%21other%3Asim/send/m.room.message/t"), json!({})).status,
        200
    );
    assert!(m.wait_sent("!other:sim", 1, Duration::from_secs(1)));
    let b = get(&c(&format!("/sync?since={since}&timeout=1000"))).json();
    let echo = &b["rooms"]["join"]["!plain:sim"]["timeline"]["events"][0];
    assert_eq!(
        (echo["event_id"].clone(), echo["unsigned"]["transaction_id"].clone()),
        (e1, json!("txn1"))
    );
    since = b["next_batch"].as_str().unwrap().into();

    // Typing.
    let r = put(
        &c("/rooms/%21plain%3Asim/typing/%40bot%3Asim"),
        json!({"typing": true, "timeout": 30000}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        put(
            &c("/rooms/%21plain%3Asim/typing/%40alice%3Asim"),
            json!({"typing": true})
        )
        .status,
        403
    );
    assert!(m.wait_typing(1, Duration::from_secs(1)));
    assert_eq!(m.typing_calls(), vec![("!plain:sim".into(), bot.into(), true)]);

    // Media: upload, authenticated download, no legacy download.
    let up = call(
        "POST",
        &format!("{}/_matrix/media/v3/upload?filename=a%20b.png", m.base),
        Some(tok),
        "image/png",
        b"PNG!",
    );
    let mxc = up.json()["content_uri"].as_str().unwrap().to_string();
    let path = mxc.strip_prefix("mxc://").unwrap();
    let dl = format!("{}/_matrix/client/v1/media/download/{path}", m.base);
    let r = get(&dl);
    assert_eq!(
        (r.status, r.body.as_slice(), r.header("Content-Type")),
        (200, &b"PNG!"[..], "image/png".into())
    );
    assert!(r.header("Content-Disposition").contains("a b.png"));
    assert_eq!(call("GET", &dl, None, "", b"").status, 401);
    assert_eq!(get(&format!("{}/_matrix/media/v3/download/{path}", m.base)).status, 404);
    assert_eq!(
        m.uploads(),
        vec![("a b.png".into(), "image/png".into(), b"PNG!".to_vec())]
    );
    let other = m.add_media(b"doc", "application/pdf", "d.pdf");
    let r = get(&format!(
        "{}/_matrix/client/v1/media/download/{}/x.pdf",
        m.base,
        &other[6..]
    ));
    assert_eq!(
        (r.body.as_slice(), r.header("Content-Disposition")),
        (&b"doc"[..], "attachment; filename=\"x.pdf\"".into())
    );

    // Failing, padded and held /syncs; revocation.
    m.fail_next_syncs(1, 502, "M_UNKNOWN");
    assert_eq!(get(&c(&format!("/sync?since={since}"))).status, 502);
    m.pad_sync_answers(100_000);
    assert!(get(&c(&format!("/sync?since={since}"))).body.len() > 100_000);
    m.pad_sync_answers(0);
    m.set_sync_hold(true);
    m.post_text("!plain:sim", alice, "held");
    let b = get(&c(&format!("/sync?since={since}&timeout=300"))).json();
    assert_eq!(
        (b["next_batch"].as_str(), b["rooms"]["join"].as_object().unwrap().len()),
        (Some(since.as_str()), 0)
    );
    m.set_sync_hold(false);
    let b = get(&c(&format!("/sync?since={since}&timeout=300"))).json();
    assert_eq!(
        b["rooms"]["join"]["!plain:sim"]["timeline"]["events"][0]["content"]["body"],
        "held"
    );
    assert_eq!(
        get(&c("/sync?since=t3")).status,
        400,
        "a /messages token is no /sync token"
    );
    assert!(m.syncs() >= 9 && m.sinces()[0].is_none() && m.wait_syncs(9, Duration::ZERO));
    m.revoke(tok);
    assert_eq!(get(&c("/account/whoami")).json()["errcode"], "M_UNKNOWN_TOKEN");
}

/// A query value percent-encoded (only what a filter's JSON needs).
fn encode(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        match c {
            'A'..='Z' | 'a'..='z' | '0'..='9' | '-' | '_' | '.' | '~' => out.push(c),
            c => out.extend(c.to_string().bytes().map(|b| format!("%{b:02X}"))),
        }
    }
    out
}
