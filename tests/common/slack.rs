//! A Slack simulator written from public material, not from imgate's code: the Web API methods
//! the provider calls (shapes and error strings from Slack's method reference as kept in
//! `slack-ruby/slack-api-ref`), Socket Mode as Slack's SDKs see it (`slackapi/python-slack-sdk`:
//! `socket_mode/request.py`, `response.py`, `tests/.../mock_socket_mode_server.py`;
//! `slackapi/node-slack-sdk`: `SocketModeClient.ts`) and the external upload flow
//! (`files.getUploadURLExternal`, a POST of the bytes, `files.completeUploadExternal`).
//!
//! Shape: tiny_http serves the Web API (`{base}/{method}`), the upload URLs and the private file
//! URLs; a std listener + sync tungstenite serves `/link/?ticket=…`, one thread per socket.
//! Everything lives in one `State` behind a mutex with a condvar, so tests wait on conditions.
//! A ticker thread redelivers unacknowledged envelopes and closes sockets after a disconnect's
//! grace. Choices where the sources are silent are marked "Chosen:".

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};

use super::kit::{self, base64, finish_close, multipart, socket_loop, url_decode, Heard, Out};
use tungstenite::Message;

pub const TEAM_ID: &str = "T0TEAM";
const TEAM_NAME: &str = "Sim Team";
/// Every scope a new app's bot token holds; `remove_scope` takes them away one by one.
pub const ALL_SCOPES: &[&str] = &[
    "channels:read",
    "groups:read",
    "im:read",
    "mpim:read",
    "channels:history",
    "groups:history",
    "im:history",
    "mpim:history",
    "chat:write",
    "users:read",
    "files:read",
    "files:write",
    "app_mentions:read",
];

/// An installed app: its two tokens and its bot's identities.
#[derive(Clone, Debug)]
pub struct App {
    pub bot_token: String,
    pub app_token: String,
    pub bot_user_id: String,
    pub bot_id: String,
    pub team_id: String,
    pub app_id: String,
    pub socket_mode: bool,
    pub scopes: Vec<String>,
}

struct Channel {
    name: String,
    kind: String,
    members: Vec<String>,
    /// Every message, replies included, oldest first (ts only ever grows).
    messages: Vec<Value>,
}

struct Sock {
    app: String,
    tx: mpsc::Sender<Out>,
    open: bool,
    hello: bool,
    closing: bool,
    close_at: Option<Instant>,
    silent: bool,
    pings: usize,
}

struct Delivery {
    envelope_id: String,
    event_id: String,
    ts: String,
}

/// An events_api envelope Slack will send again until one of its deliveries is acked.
struct Pending {
    app: String,
    event_id: String,
    envelope: Value,
    ts: String,
    last_sent: Instant,
    attempt: u32,
}

struct Call {
    method: String,
    params: Map<String, Value>,
    auth: String,
}

struct Upload {
    filename: String,
    length: usize,
    bytes: Option<Vec<u8>>,
}

#[derive(Default)]
struct State {
    http: String,
    ws_port: u16,
    apps: Vec<App>,
    users: HashMap<String, String>,
    channels: HashMap<String, Channel>,
    /// ticket → app token; a ticket works once.
    tickets: HashMap<String, String>,
    sockets: Vec<Sock>,
    connections: HashMap<String, u64>,
    hellos: HashMap<String, u64>,
    max_sockets: usize,
    disconnect_grace: Duration,
    deliveries: Vec<Delivery>,
    pending: Vec<Pending>,
    retry_after: Duration,
    max_retries: u32,
    acked: Vec<String>,
    ack_frames: Vec<Value>,
    client_frames: Vec<String>,
    calls: Vec<Call>,
    rate_limits: Vec<(String, u64)>,
    failures: Vec<(String, String)>,
    posted: Vec<(String, Value)>,
    uploads_pending: HashMap<String, Upload>,
    uploads: Vec<Value>,
    /// file id → (name, mimetype, bytes), served under /files-pri/.
    files: HashMap<String, (String, String, Vec<u8>)>,
    downloads: Vec<Value>,
    history_page_cap: usize,
    /// A misbehaving server: conversations.replies answers as if no `oldest` was given.
    replies_ignore_oldest: bool,
    max_text_len: usize,
    /// history cursors handed out → the ts the next page starts below (history) or above (replies).
    cursors: HashMap<String, String>,
    last_ts: u64,
    next_id: u64,
}

type Shared = Arc<(Mutex<State>, Condvar)>;

pub struct SlackSim {
    /// The Web API base: methods at `{base}/{method}`.
    pub base: String,
    state: Shared,
    stopped: Arc<AtomicBool>,
}

impl SlackSim {
    pub fn start() -> SlackSim {
        let http = Arc::new(tiny_http::Server::http("127.0.0.1:0").unwrap());
        let port = http.server_addr().to_ip().unwrap().port();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let ws_port = listener.local_addr().unwrap().port();
        let state: Shared = Arc::default();
        {
            let mut s = state.0.lock().unwrap();
            s.http = format!("http://127.0.0.1:{port}");
            s.ws_port = ws_port;
            // Slack's numbers: acks within 3 s, 3 retries (Socket Mode guide), 10 sockets per
            // app (node-slack-sdk#1654, bolt-js#2225), a warning ~10 s before the close.
            s.retry_after = Duration::from_secs(3);
            s.max_retries = 3;
            s.max_sockets = 10;
            s.disconnect_grace = Duration::from_secs(10);
            s.max_text_len = 40_000;
        }
        let stopped = Arc::new(AtomicBool::new(false));
        let st = state.clone();
        kit::serve_http(&http, 3, &stopped, move |req| serve(&st, req));
        let st = state.clone();
        kit::accept_each(listener, &stopped, move |stream, stop| link(&st, stream, stop));
        let st = state.clone();
        kit::tick_until(&stopped, move || tick(&st));
        SlackSim {
            base: format!("http://127.0.0.1:{port}/api"),
            state,
            stopped,
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        super::kit::change(&self.state, f)
    }

    /// Waits until `ready` holds; false after `timeout`.
    fn wait(&self, timeout: Duration, ready: impl Fn(&State) -> bool) -> bool {
        super::kit::wait_for(&self.state, timeout, ready)
    }

    // ---------- workspace setup ----------

    /// An app in team T0TEAM with Socket Mode on and every scope of `ALL_SCOPES`.
    pub fn add_app(&self, bot_token: &str, app_token: &str, bot_user_id: &str, bot_id: &str) {
        self.with(|s| {
            let app_id = format!("A0APP{}", s.apps.len() + 1);
            s.apps.push(App {
                bot_token: bot_token.into(),
                app_token: app_token.into(),
                bot_user_id: bot_user_id.into(),
                bot_id: bot_id.into(),
                team_id: TEAM_ID.into(),
                app_id,
                socket_mode: true,
                scopes: ALL_SCOPES.iter().map(|x| x.to_string()).collect(),
            });
        });
    }

    /// The app one of whose tokens (or bot user ID) is `key`.
    pub fn app(&self, key: &str) -> App {
        self.with(|s| s.apps[app_index(s, key).expect("a known app")].clone())
    }

    /// Off: apps.connections.open answers `socket_mode_not_enabled` and every open socket of
    /// the app gets `disconnect` with reason `link_disabled`, then a close (as Slack does when
    /// the toggle is turned off).
    pub fn set_socket_mode(&self, app_token: &str, on: bool) {
        self.with(|s| {
            let i = app_index(s, app_token).expect("a known app");
            s.apps[i].socket_mode = on;
            if !on {
                for k in 0..s.sockets.len() {
                    if s.sockets[k].app == s.apps[i].app_token && s.sockets[k].open && !s.sockets[k].closing {
                        let _ = s.sockets[k].tx.send(Out::Text(disconnect_msg("link_disabled", k)));
                        close_socket(s, k, 1000);
                    }
                }
            }
        });
    }

    pub fn remove_scope(&self, bot_token: &str, scope: &str) {
        self.with(|s| {
            let i = app_index(s, bot_token).expect("a known app");
            s.apps[i].scopes.retain(|x| x != scope);
        });
    }

    pub fn add_user(&self, id: &str, display_name: &str) {
        self.with(|s| s.users.insert(id.into(), display_name.into()));
    }

    /// `kind`: "channel" (public), "group" (private), "im" or "mpim"; `members` are user IDs,
    /// bot user IDs included.
    pub fn add_channel(&self, id: &str, name: &str, kind: &str, members: &[&str]) {
        assert!(
            ["channel", "group", "im", "mpim"].contains(&kind),
            "unknown kind {kind}"
        );
        self.with(|s| {
            let members = members.iter().map(|m| m.to_string()).collect();
            s.channels.insert(
                id.into(),
                Channel {
                    name: name.into(),
                    kind: kind.into(),
                    members,
                    messages: vec![],
                },
            );
        });
    }

    // ---------- what users (and the bot) do ----------

    /// A user posts: the message joins the history with a fresh ts and goes, as an events_api
    /// envelope, to every app whose bot is a member and has a socket up (no socket: Slack keeps
    /// nothing for it). Returns the ts.
    pub fn post(&self, channel: &str, user: &str, text: &str, thread_ts: Option<&str>) -> String {
        self.with(|s| {
            let ts = next_ts(s);
            let mut m = json!({"type": "message", "user": user, "text": text, "ts": ts, "team": TEAM_ID,
                               "client_msg_id": uuid(s)});
            if let Some(t) = thread_ts {
                m["thread_ts"] = json!(t);
            }
            append(s, channel, m);
            ts
        })
    }

    /// A user replies in the thread of `thread_ts` and ticks "Also send to #channel": the reply
    /// (subtype `thread_broadcast`, its parent as `root`) is in the thread and in the channel's
    /// history. Returns the ts.
    pub fn post_broadcast(&self, channel: &str, user: &str, text: &str, thread_ts: &str) -> String {
        self.with(|s| {
            let ts = next_ts(s);
            let root = s.channels[channel]
                .messages
                .iter()
                .find(|m| m["ts"] == thread_ts)
                .cloned()
                .expect("a known parent");
            let m = json!({"type": "message", "subtype": "thread_broadcast", "user": user, "text": text,
                           "ts": ts, "thread_ts": thread_ts, "root": root, "team": TEAM_ID,
                           "client_msg_id": uuid(s)});
            append(s, channel, m);
            ts
        })
    }

    /// A user posts `text` with one file (subtype `file_share`, `files: [..]`); the file is
    /// served at its `url_private_download` to a Bearer bot token holding files:read.
    pub fn post_file(
        &self,
        channel: &str,
        user: &str,
        text: &str,
        filename: &str,
        mimetype: &str,
        bytes: &[u8],
    ) -> String {
        self.with(|s| {
            let ts = next_ts(s);
            let file = new_file(s, channel, user, filename, filename, mimetype, bytes.to_vec());
            let m = json!({"type": "message", "subtype": "file_share", "user": user, "text": text, "ts": ts,
                           "team": TEAM_ID, "files": [file], "upload": false, "display_as_bot": false});
            append(s, channel, m);
            ts
        })
    }

    /// A message by an app's bot (`bot` is its bot token or bot user ID), shaped as
    /// chat.postMessage makes them: `user` the bot user, `bot_id`, `app_id`, `bot_profile`.
    pub fn post_as_bot(&self, channel: &str, bot: &str, text: &str, thread_ts: Option<&str>) -> String {
        self.with(|s| {
            let app = s.apps[app_index(s, bot).expect("a known app")].clone();
            let ts = next_ts(s);
            let mut m = bot_message(&app, text, &ts);
            if let Some(t) = thread_ts {
                m["thread_ts"] = json!(t);
            }
            append(s, channel, m);
            ts
        })
    }

    /// The author edits the message: history changes and a `message_changed` event goes out.
    /// Returns the event's own ts.
    pub fn edit(&self, channel: &str, ts: &str, text: &str) -> String {
        self.with(|s| {
            let ets = next_ts(s);
            let ch = s.channels.get_mut(channel).expect("a known channel");
            let m = ch.messages.iter_mut().find(|m| m["ts"] == ts).expect("a known message");
            let previous = m.clone();
            m["text"] = json!(text);
            m["edited"] = json!({"user": previous["user"], "ts": ets});
            let message = m.clone();
            let ev = json!({"type": "message", "subtype": "message_changed", "hidden": true, "message": message,
                            "previous_message": previous, "channel": channel, "ts": ets, "event_ts": ets});
            broadcast(s, channel, ev);
            ets
        })
    }

    /// The message is deleted (a thread parent with replies stays as a tombstone, as in Slack);
    /// a `message_deleted` event goes out. Returns the event's own ts.
    pub fn delete(&self, channel: &str, ts: &str) -> String {
        self.with(|s| {
            let ets = next_ts(s);
            let ch = s.channels.get_mut(channel).expect("a known channel");
            let i = ch.messages.iter().position(|m| m["ts"] == ts).expect("a known message");
            let previous = ch.messages[i].clone();
            if previous["reply_count"].as_u64().unwrap_or(0) > 0 {
                let m = &mut ch.messages[i];
                m["subtype"] = json!("tombstone");
                m["text"] = json!("This message was deleted.");
                m["user"] = json!("USLACKBOT");
            } else {
                ch.messages.remove(i);
            }
            let ev = json!({"type": "message", "subtype": "message_deleted", "hidden": true, "deleted_ts": ts,
                            "previous_message": previous, "channel": channel, "ts": ets, "event_ts": ets});
            broadcast(s, channel, ev);
            ets
        })
    }

    // ---------- Socket Mode control ----------

    /// Sends `envelope` as it is on the app's current socket (app_rate_limited, malformed …).
    pub fn send_envelope(&self, app_token: &str, envelope: Value) {
        self.with(|s| {
            if let Some(k) = current_socket(s, app_token) {
                if let Some(id) = envelope["envelope_id"].as_str() {
                    let ts = envelope
                        .pointer("/payload/event/ts")
                        .and_then(Value::as_str)
                        .unwrap_or("");
                    s.deliveries.push(Delivery {
                        envelope_id: id.into(),
                        event_id: String::new(),
                        ts: ts.into(),
                    });
                }
                let _ = s.sockets[k].tx.send(Out::Text(envelope.to_string()));
            }
        });
    }

    /// A raw text frame (garbage) on the app's current socket.
    pub fn send_text(&self, app_token: &str, text: &str) {
        self.with(|s| {
            if let Some(k) = current_socket(s, app_token) {
                let _ = s.sockets[k].tx.send(Out::Text(text.into()));
            }
        });
    }

    /// Envelopes not acked within `retry_after` go out again (retry_attempt 1..=max_retries,
    /// retry_reason "timeout") on the app's socket of that moment. Slack: 3 s, 3 retries.
    pub fn set_redelivery(&self, retry_after: Duration, max_retries: u32) {
        self.with(|s| {
            s.retry_after = retry_after;
            s.max_retries = max_retries;
        });
    }

    /// Envelope IDs acked, in order.
    pub fn acked(&self) -> Vec<String> {
        self.with(|s| s.acked.clone())
    }

    /// The ack frames as the client sent them (`{"envelope_id", "payload"?}`).
    pub fn ack_frames(&self) -> Vec<Value> {
        self.with(|s| s.ack_frames.clone())
    }

    /// Text frames from the client that were not acks.
    pub fn client_frames(&self) -> Vec<String> {
        self.with(|s| s.client_frames.clone())
    }

    /// Envelope IDs of every delivery of the event whose `ts` is `ts` (retries have new IDs
    /// and the same `event_id`). For edits and deletions that is the ts `edit`/`delete` returned.
    pub fn envelopes_of(&self, ts: &str) -> Vec<String> {
        self.with(|s| {
            s.deliveries
                .iter()
                .filter(|d| d.ts == ts)
                .map(|d| d.envelope_id.clone())
                .collect()
        })
    }

    /// The event_id of the deliveries of `ts` (one per event, kept across retries).
    pub fn event_id_of(&self, ts: &str) -> Option<String> {
        self.with(|s| s.deliveries.iter().find(|d| d.ts == ts).map(|d| d.event_id.clone()))
    }

    /// Waits until some delivery of the event with this ts was acked.
    pub fn wait_acked_ts(&self, ts: &str, timeout: Duration) -> bool {
        self.wait(timeout, |s| {
            s.deliveries
                .iter()
                .any(|d| d.ts == ts && s.acked.contains(&d.envelope_id))
        })
    }

    /// Waits until `n` sockets of the app said hello (were greeted), counted since the start.
    pub fn wait_connected(&self, app_token: &str, n: u64, timeout: Duration) -> bool {
        self.wait(timeout, |s| s.hellos.get(app_token).copied().unwrap_or(0) >= n)
    }

    /// Sockets opened so far (handshakes completed), refused ones included.
    pub fn connections(&self, app_token: &str) -> u64 {
        self.with(|s| s.connections.get(app_token).copied().unwrap_or(0))
    }

    /// Sockets open now (a socket being closed counts no more).
    pub fn open_sockets(&self, app_token: &str) -> usize {
        self.with(|s| {
            s.sockets
                .iter()
                .filter(|k| k.app == app_token && k.open && !k.closing)
                .count()
        })
    }

    pub fn wait_open_sockets(&self, app_token: &str, n: usize, timeout: Duration) -> bool {
        self.wait(timeout, |s| {
            s.sockets
                .iter()
                .filter(|k| k.app == app_token && k.open && !k.closing)
                .count()
                == n
        })
    }

    /// How long after a `warning`/`refresh_requested` disconnect the socket is closed (10 s).
    pub fn set_disconnect_grace(&self, grace: Duration) {
        self.with(|s| s.disconnect_grace = grace);
    }

    /// Sockets allowed open per app; the next one gets `too_many_websockets` (Slack: 10).
    pub fn set_max_sockets(&self, n: usize) {
        self.with(|s| s.max_sockets = n);
    }

    /// `{"type":"disconnect","reason":reason,"debug_info":{"host":..}}` on the newest socket.
    /// "warning"/"refresh_requested": that socket closes after the grace; "link_disabled" is
    /// `set_socket_mode(false)`; other reasons: sent, nothing more.
    pub fn disconnect(&self, app_token: &str, reason: &str) {
        if reason == "link_disabled" {
            return self.set_socket_mode(app_token, false);
        }
        self.with(|s| {
            if let Some(k) = current_socket(s, app_token) {
                let _ = s.sockets[k].tx.send(Out::Text(disconnect_msg(reason, k)));
                if reason == "warning" || reason == "refresh_requested" {
                    s.sockets[k].close_at = Some(Instant::now() + s.disconnect_grace);
                }
            }
        });
    }

    /// The newest socket's TCP connection ends without a close frame.
    pub fn drop_connection(&self, app_token: &str) {
        self.with(|s| {
            if let Some(k) = newest_open(s, app_token) {
                let _ = s.sockets[k].tx.send(Out::Drop);
                s.sockets[k].open = false;
            }
        });
    }

    /// The newest socket stays open but sends nothing and answers no ping (its pings are still
    /// counted): a half-open link behind NAT. Envelopes routed to it are lost.
    pub fn go_silent(&self, app_token: &str) {
        self.with(|s| {
            if let Some(k) = newest_open(s, app_token) {
                let _ = s.sockets[k].tx.send(Out::Silent);
                s.sockets[k].silent = true;
            }
        });
    }

    /// WebSocket pings received from the client on every socket of the app.
    pub fn pings(&self, app_token: &str) -> usize {
        self.with(|s| s.sockets.iter().filter(|k| k.app == app_token).map(|k| k.pings).sum())
    }

    // ---------- Web API control and records ----------

    /// The next `times` calls of `method` answer HTTP 429, `Retry-After`, `{"ok":false,"error":"ratelimited"}`.
    pub fn rate_limit_next(&self, method: &str, times: usize, retry_after_secs: u64) {
        self.with(|s| (0..times).for_each(|_| s.rate_limits.push((method.into(), retry_after_secs))));
    }

    /// The next `times` calls of `method` answer 200 `{"ok":false,"error":error}`.
    pub fn fail_next(&self, method: &str, error: &str, times: usize) {
        self.with(|s| (0..times).for_each(|_| s.failures.push((method.into(), error.into()))));
    }

    /// The params of each call of `method` (query, form, multipart or JSON, as strings), in order.
    pub fn calls(&self, method: &str) -> Vec<Map<String, Value>> {
        self.with(|s| {
            s.calls
                .iter()
                .filter(|c| c.method == method)
                .map(|c| c.params.clone())
                .collect()
        })
    }

    /// The Authorization header of each call of `method` ("" when absent).
    pub fn auth_header_of_calls(&self, method: &str) -> Vec<String> {
        self.with(|s| {
            s.calls
                .iter()
                .filter(|c| c.method == method)
                .map(|c| c.auth.clone())
                .collect()
        })
    }

    /// chat.postMessage messages in `channel`: `{text, thread_ts (as sent), ts, thread_ts_was_reply, ..}`.
    pub fn posted(&self, channel: &str) -> Vec<Value> {
        self.with(|s| {
            s.posted
                .iter()
                .filter(|(c, _)| c == channel)
                .map(|(_, v)| v.clone())
                .collect()
        })
    }

    /// Completed external uploads: `{file_id, filename, title, length, bytes_len, length_mismatch,
    /// channel_id, thread_ts, initial_comment}`.
    pub fn uploads(&self) -> Vec<Value> {
        self.with(|s| s.uploads.clone())
    }

    /// The bytes POSTed to the upload URL of `file_id` (empty if none came).
    pub fn uploaded_bytes(&self, file_id: &str) -> Vec<u8> {
        self.with(|s| {
            s.uploads_pending
                .get(file_id)
                .and_then(|u| u.bytes.clone())
                .or_else(|| s.files.get(file_id).map(|f| f.2.clone()))
                .unwrap_or_default()
        })
    }

    /// GETs of private file URLs: `{path, auth, status}`.
    pub fn downloads(&self) -> Vec<Value> {
        self.with(|s| s.downloads.clone())
    }

    /// Every message of the channel, replies included, oldest first.
    pub fn history(&self, channel: &str) -> Vec<Value> {
        self.with(|s| s.channels.get(channel).map(|c| c.messages.clone()).unwrap_or_default())
    }

    /// conversations.history and conversations.replies return at most `n` messages a page
    /// whatever `limit` says (Slack "may return fewer"); 0 lifts the cap.
    pub fn set_history_page_cap(&self, n: usize) {
        self.with(|s| s.history_page_cap = n);
    }

    /// Not Slack's behaviour, a hostile server's: conversations.replies ignores `oldest`.
    pub fn set_replies_ignore_oldest(&self, on: bool) {
        self.with(|s| s.replies_ignore_oldest = on);
    }

    /// chat.postMessage answers `msg_too_long` above this many characters (default 40,000).
    pub fn set_max_text_len(&self, n: usize) {
        self.with(|s| s.max_text_len = n);
    }
}

impl Drop for SlackSim {
    /// Every thread ends: sockets close, HTTP workers and the ticker see the flag, the accept
    /// loop is woken by one last connection.
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::Relaxed);
        let port = self.with(|s| {
            for k in s.sockets.iter().filter(|k| k.open) {
                let _ = k.tx.send(Out::Drop);
            }
            s.ws_port
        });
        let _ = TcpStream::connect(("127.0.0.1", port));
    }
}

// ---------- ids and timestamps ----------

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

/// A message ts: wall-clock microseconds, strictly increasing, "1700000000.000100" style.
fn next_ts(s: &mut State) -> String {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as u64;
    s.last_ts = now.max(s.last_ts + 1);
    format!("{}.{:06}", s.last_ts / 1_000_000, s.last_ts % 1_000_000)
}

/// A ts (or "0", or "1700000000") as microseconds, for comparisons.
fn ts_key(ts: &str) -> Option<u64> {
    let (secs, frac) = ts.split_once('.').unwrap_or((ts, "0"));
    let frac = format!("{:0<6}", frac);
    Some(secs.parse::<u64>().ok()? * 1_000_000 + frac.get(..6)?.parse::<u64>().ok()?)
}

fn uuid(s: &mut State) -> String {
    s.next_id += 1;
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(s.next_id);
    let (a, b) = (
        h.finish(),
        h.finish().rotate_left(29) ^ s.next_id.wrapping_mul(0x9E37_79B9_7F4A_7C15),
    );
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        0x8000 | ((b >> 48) & 0x3fff),
        b & 0xffff_ffff_ffff
    )
}

fn app_index(s: &State, key: &str) -> Option<usize> {
    s.apps
        .iter()
        .position(|a| a.bot_token == key || a.app_token == key || a.bot_user_id == key)
}

// ---------- messages and events ----------

fn bot_message(app: &App, text: &str, ts: &str) -> Value {
    json!({"type": "message", "user": app.bot_user_id, "bot_id": app.bot_id, "app_id": app.app_id,
           "text": text, "ts": ts, "team": app.team_id,
           "bot_profile": {"id": app.bot_id, "app_id": app.app_id, "name": "imgate", "team_id": app.team_id,
                           "deleted": false}})
}

/// A hosted file (Slack's file object) stored for download.
fn new_file(
    s: &mut State,
    channel: &str,
    user: &str,
    name: &str,
    title: &str,
    mimetype: &str,
    bytes: Vec<u8>,
) -> Value {
    s.next_id += 1;
    let id = format!("F0SIM{:05}", s.next_id);
    let ext = name
        .rsplit_once('.')
        .map(|(_, e)| e.to_ascii_lowercase())
        .unwrap_or_else(|| "binary".into());
    let public = s.channels.get(channel).is_some_and(|c| c.kind == "channel");
    let url = format!("{}/files-pri/{TEAM_ID}-{id}/{name}", s.http);
    let download = format!("{}/files-pri/{TEAM_ID}-{id}/download/{name}", s.http);
    let file = json!({"id": id, "created": now_secs(), "timestamp": now_secs(), "name": name, "title": title,
        "mimetype": mimetype, "filetype": ext, "pretty_type": ext.to_uppercase(), "user": user, "user_team": TEAM_ID,
        "editable": false, "size": bytes.len(), "mode": "hosted", "is_external": false, "external_type": "",
        "is_public": public, "public_url_shared": false, "display_as_bot": false, "username": "",
        "url_private": url, "url_private_download": download,
        "permalink": format!("https://sim.slack.com/files/{user}/{id}/{name}"),
        "permalink_public": format!("https://slack-files.com/{TEAM_ID}-{id}-0000"), "file_access": "visible"});
    s.files.insert(id, (name.into(), mimetype.into(), bytes));
    file
}

/// Appends a message to the history (keeping the parent's thread fields up to date) and sends
/// it as a `message` event.
fn append(s: &mut State, channel: &str, mut m: Value) {
    let ch = s
        .channels
        .get_mut(channel)
        .unwrap_or_else(|| panic!("unknown channel {channel}"));
    let ts = m["ts"].as_str().unwrap().to_string();
    if let Some(parent_ts) = m["thread_ts"].as_str().map(str::to_string).filter(|t| *t != ts) {
        if let Some(p) = ch.messages.iter_mut().find(|p| p["ts"] == parent_ts.as_str()) {
            m["parent_user_id"] = p["user"].clone();
            let user = m["user"].clone();
            p["thread_ts"] = json!(parent_ts);
            p["reply_count"] = json!(p["reply_count"].as_u64().unwrap_or(0) + 1);
            let mut users = p["reply_users"].as_array().cloned().unwrap_or_default();
            if !users.contains(&user) {
                users.push(user);
            }
            p["reply_users_count"] = json!(users.len());
            p["reply_users"] = json!(users);
            p["latest_reply"] = json!(ts);
        }
    }
    ch.messages.push(m.clone());
    m["channel"] = json!(channel);
    m["event_ts"] = json!(ts);
    broadcast(s, channel, m);
}

/// Sends `event` to every app whose bot is a member of `channel`.
fn broadcast(s: &mut State, channel: &str, mut event: Value) {
    let ch = &s.channels[channel];
    event["channel_type"] = json!(ch.kind);
    let apps: Vec<usize> = (0..s.apps.len())
        .filter(|&i| ch.members.contains(&s.apps[i].bot_user_id))
        .collect();
    for i in apps {
        deliver(s, i, channel, event.clone());
    }
}

/// One events_api envelope, shaped as in python-slack-sdk's mock_socket_mode_server.py, on the
/// app's current socket, kept for redelivery until acked. No socket: nothing is kept.
fn deliver(s: &mut State, app: usize, channel: &str, event: Value) {
    let app = s.apps[app].clone();
    let Some(k) = current_socket(s, &app.app_token) else {
        return;
    };
    s.next_id += 1;
    let event_id = format!("Ev0SIM{:06}", s.next_id);
    let envelope_id = uuid(s);
    let ts = event["ts"].as_str().unwrap_or_default().to_string();
    let envelope = json!({
        "envelope_id": envelope_id,
        "payload": {
            "token": "verification-token", "team_id": app.team_id, "api_app_id": app.app_id,
            "event": event, "type": "event_callback", "event_id": event_id, "event_time": now_secs(),
            "authorizations": [{"enterprise_id": null, "team_id": app.team_id, "user_id": app.bot_user_id,
                                "is_bot": true, "is_enterprise_install": false}],
            "is_ext_shared_channel": false, "event_context": format!("4-message-{}-{channel}", app.team_id),
        },
        "type": "events_api", "accepts_response_payload": false, "retry_attempt": 0, "retry_reason": "",
    });
    let _ = s.sockets[k].tx.send(Out::Text(envelope.to_string()));
    s.deliveries.push(Delivery {
        envelope_id,
        event_id: event_id.clone(),
        ts: ts.clone(),
    });
    s.pending.push(Pending {
        app: app.app_token,
        event_id,
        envelope,
        ts,
        last_sent: Instant::now(),
        attempt: 0,
    });
}

/// The socket events go to: the newest open one that was greeted.
fn current_socket(s: &State, app_token: &str) -> Option<usize> {
    s.sockets
        .iter()
        .rposition(|k| k.app == app_token && k.open && k.hello && !k.closing)
}

fn newest_open(s: &State, app_token: &str) -> Option<usize> {
    s.sockets
        .iter()
        .rposition(|k| k.app == app_token && k.open && !k.closing)
}

fn disconnect_msg(reason: &str, k: usize) -> String {
    json!({"type": "disconnect", "reason": reason, "debug_info": {"host": format!("applink-sim-{k}")}}).to_string()
}

fn close_socket(s: &mut State, k: usize, code: u16) {
    let _ = s.sockets[k].tx.send(Out::Close(code));
    s.sockets[k].closing = true;
}

/// Redelivery and the closes a disconnect announced.
fn tick(state: &Shared) {
    let mut s = state.0.lock().unwrap();
    let now = Instant::now();
    for k in 0..s.sockets.len() {
        if s.sockets[k].open && !s.sockets[k].closing && s.sockets[k].close_at.is_some_and(|t| t <= now) {
            close_socket(&mut s, k, 1000);
        }
    }
    let (retry_after, max) = (s.retry_after, s.max_retries);
    let mut pending = std::mem::take(&mut s.pending);
    pending.retain_mut(|p| {
        if now.duration_since(p.last_sent) < retry_after {
            return true;
        }
        if p.attempt >= max {
            return false;
        }
        // Chosen: each retry is a new envelope (new envelope_id), same event_id, on the socket
        // of that moment; with no socket the attempt is spent.
        p.attempt += 1;
        p.last_sent = now;
        let envelope_id = uuid(&mut s);
        p.envelope["envelope_id"] = json!(envelope_id);
        p.envelope["retry_attempt"] = json!(p.attempt);
        p.envelope["retry_reason"] = json!("timeout");
        if let Some(k) = current_socket(&s, &p.app) {
            let _ = s.sockets[k].tx.send(Out::Text(p.envelope.to_string()));
            s.deliveries.push(Delivery {
                envelope_id,
                event_id: p.event_id.clone(),
                ts: p.ts.clone(),
            });
        }
        true
    });
    s.pending = pending;
    drop(s);
    state.1.notify_all();
}

// ---------- the WebSocket side ----------

/// One `/link/?ticket=…` connection: the ticket must come from apps.connections.open, unused,
/// and the app must still be in Socket Mode; otherwise the handshake is refused with 403.
#[allow(clippy::result_large_err)] // tungstenite fixes the callback's error type
fn link(state: &Shared, stream: TcpStream, stopped: &AtomicBool) {
    let app = Arc::new(Mutex::new(None::<String>));
    let (seen, st) = (app.clone(), state.clone());
    let callback = move |req: &tungstenite::handshake::server::Request, resp| {
        let query = req.uri().query().unwrap_or_default().to_string();
        let ticket = query
            .split('&')
            .find_map(|kv| kv.strip_prefix("ticket="))
            .unwrap_or_default()
            .to_string();
        let mut s = st.0.lock().unwrap();
        let found = s.tickets.remove(&ticket).filter(|a| {
            req.uri().path().starts_with("/link") && s.apps.iter().any(|x| x.app_token == *a && x.socket_mode)
        });
        match found {
            Some(a) => {
                *seen.lock().unwrap() = Some(a);
                Ok(resp)
            }
            None => {
                let mut refused = tungstenite::handshake::server::ErrorResponse::new(Some("invalid ticket".into()));
                *refused.status_mut() = tungstenite::http::StatusCode::FORBIDDEN;
                Err(refused)
            }
        }
    };
    let Ok(mut ws) = tungstenite::accept_hdr(stream, callback) else {
        return;
    };
    let Some(app) = app.lock().unwrap().clone() else { return };
    let (tx, rx) = mpsc::channel::<Out>();
    let (k, first) = {
        let mut s = state.0.lock().unwrap();
        *s.connections.entry(app.clone()).or_default() += 1;
        let open = s
            .sockets
            .iter()
            .filter(|k| k.app == app && k.open && k.hello && !k.closing)
            .count();
        let app_id = s
            .apps
            .iter()
            .find(|a| a.app_token == app)
            .map(|a| a.app_id.clone())
            .unwrap_or_default();
        let k = s.sockets.len();
        let admitted = open < s.max_sockets;
        s.sockets.push(Sock {
            app: app.clone(),
            tx,
            open: true,
            hello: admitted,
            closing: !admitted,
            close_at: None,
            silent: false,
            pings: 0,
        });
        // Slack refuses an 11th socket with a disconnect, not a hello (bolt-js#2021).
        let first = if admitted {
            *s.hellos.entry(app.clone()).or_default() += 1;
            json!({"type": "hello", "num_connections": open + 1,
                   "debug_info": {"host": format!("applink-sim-{k}"), "build_number": 1,
                                  "approximate_connection_time": 18060},
                   "connection_info": {"app_id": app_id}})
            .to_string()
        } else {
            disconnect_msg("too_many_websockets", k)
        };
        state.1.notify_all();
        (k, (first, admitted))
    };
    let _ = ws.get_ref().set_read_timeout(Some(Duration::from_millis(10)));
    let _ = ws.get_ref().set_write_timeout(Some(Duration::from_secs(10)));
    let _ = ws.send(Message::Text(first.0.into()));
    if !first.1 {
        finish_close(&mut ws, 1000);
    } else {
        socket_loop(&mut ws, &rx, stopped, |heard| {
            let mut s = state.0.lock().unwrap();
            match heard {
                Heard::Text(t) => on_client_text(&mut s, t),
                Heard::Pings(n) => s.sockets[k].pings += n,
                Heard::Binary => {}
            }
            drop(s);
            state.1.notify_all();
        });
    }
    state.0.lock().unwrap().sockets[k].open = false;
    state.1.notify_all();
}

/// An ack is `{"envelope_id": …}` (maybe with "payload"), as SocketModeResponse.to_dict makes it.
fn on_client_text(s: &mut State, text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or(Value::Null);
    let Some(id) = v["envelope_id"].as_str() else {
        s.client_frames.push(text.into());
        return;
    };
    s.acked.push(id.into());
    s.ack_frames.push(v.clone());
    if let Some(d) = s.deliveries.iter().find(|d| d.envelope_id == id) {
        let event = d.event_id.clone();
        s.pending.retain(|p| p.event_id != event);
    }
}

// ---------- the HTTP side ----------

struct Answer {
    status: u16,
    body: Vec<u8>,
    headers: Vec<(String, String)>,
}

fn answer(status: u16, v: Value) -> Answer {
    Answer {
        status,
        body: v.to_string().into_bytes(),
        headers: vec![("Content-Type".into(), "application/json; charset=utf-8".into())],
    }
}

fn ok(mut v: Value) -> Answer {
    v["ok"] = json!(true);
    answer(200, v)
}

fn err(e: &str) -> Answer {
    answer(200, json!({"ok": false, "error": e}))
}

const SIGN_IN: &str =
    "<!DOCTYPE html><html lang=\"en-US\"><head><title>Sign in | Slack</title></head><body>Sign in</body></html>";

fn serve(state: &Shared, mut req: tiny_http::Request) {
    let mut body = Vec::new();
    let _ = req.as_reader().read_to_end(&mut body);
    let header = |name: &'static str| {
        req.headers()
            .iter()
            .find(|h| h.field.equiv(name))
            .map(|h| h.value.to_string())
            .unwrap_or_default()
    };
    let (auth, ctype) = (header("Authorization"), header("Content-Type"));
    let url = req.url().to_string();
    let (path, query) = url.split_once('?').unwrap_or((&url, ""));
    let http_method = req.method().as_str().to_string();
    let a = {
        let mut s = state.0.lock().unwrap();
        let a = if let Some(method) = path.strip_prefix("/api/") {
            let params = params_of(query, &body, &ctype);
            web_api(&mut s, method, &http_method, params, &auth)
        } else if let Some(id) = path.strip_prefix("/upload/") {
            upload(&mut s, id, &body, &ctype)
        } else if path.starts_with("/files-pri/") {
            download(&mut s, path, &auth)
        } else if path == "/" {
            Answer {
                status: 200,
                body: SIGN_IN.into(),
                headers: vec![("Content-Type".into(), "text/html; charset=utf-8".into())],
            }
        } else {
            Answer {
                status: 404,
                body: b"Not Found".to_vec(),
                headers: vec![],
            }
        };
        drop(s);
        state.1.notify_all();
        a
    };
    let mut resp = tiny_http::Response::from_data(a.body).with_status_code(a.status);
    for (k, v) in a.headers {
        resp = resp.with_header(tiny_http::Header::from_bytes(k.as_bytes(), v.as_bytes()).unwrap());
    }
    let _ = req.respond(resp);
}

fn form_pairs(s: &str, into: &mut Map<String, Value>) {
    for kv in s.split('&').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        into.insert(url_decode(k), json!(url_decode(v)));
    }
}

/// Query, then the body: JSON (values other than strings kept as their JSON text), multipart,
/// or form-urlencoded.
fn params_of(query: &str, body: &[u8], ctype: &str) -> Map<String, Value> {
    let mut m = Map::new();
    form_pairs(query, &mut m);
    let trimmed = body
        .iter()
        .position(|c| !c.is_ascii_whitespace())
        .map_or(&body[..0], |i| &body[i..]);
    if ctype.starts_with("application/json") || trimmed.starts_with(b"{") {
        if let Ok(Value::Object(o)) = serde_json::from_slice::<Value>(body) {
            for (k, v) in o {
                let v = match v {
                    Value::String(s) => s,
                    other => other.to_string(),
                };
                m.insert(k, json!(v));
            }
        }
    } else if ctype.starts_with("multipart/form-data") {
        for part in multipart(body, ctype).unwrap_or_default() {
            m.insert(part.name, json!(String::from_utf8_lossy(&part.data)));
        }
    } else {
        form_pairs(&String::from_utf8_lossy(body), &mut m);
    }
    m
}

fn param<'a>(p: &'a Map<String, Value>, k: &str) -> Option<&'a str> {
    p.get(k).and_then(Value::as_str).filter(|v| !v.is_empty())
}

enum Token {
    Bot(usize),
    AppLevel(usize),
    Unknown,
    Missing,
}

fn web_api(s: &mut State, method: &str, http_method: &str, p: Map<String, Value>, auth: &str) -> Answer {
    s.calls.push(Call {
        method: method.into(),
        params: p.clone(),
        auth: auth.into(),
    });
    if let Some(i) = s.rate_limits.iter().position(|(m, _)| m == method) {
        let (_, secs) = s.rate_limits.remove(i);
        let mut a = answer(429, json!({"ok": false, "error": "ratelimited"}));
        a.headers.push(("Retry-After".into(), secs.to_string()));
        return a;
    }
    if let Some(i) = s.failures.iter().position(|(m, _)| m == method) {
        let (_, e) = s.failures.remove(i);
        return err(&e);
    }
    // apps.connections.open takes its token from the header only (its method page says a POST
    // parameter "will result in an error"); other methods also accept a `token` parameter.
    let bearer = auth.strip_prefix("Bearer ").map(str::to_string);
    let raw = if method == "apps.connections.open" {
        bearer
    } else {
        bearer.or_else(|| param(&p, "token").map(str::to_string))
    };
    let token = match raw {
        None => Token::Missing,
        Some(t) => match s.apps.iter().position(|a| a.bot_token == t) {
            Some(i) => Token::Bot(i),
            None => s
                .apps
                .iter()
                .position(|a| a.app_token == t)
                .map_or(Token::Unknown, Token::AppLevel),
        },
    };
    let app = match (method, token) {
        (_, Token::Missing) => return err("not_authed"),
        (_, Token::Unknown) => return err("invalid_auth"),
        ("apps.connections.open", Token::Bot(_)) => return err("not_allowed_token_type"),
        ("apps.connections.open", Token::AppLevel(i)) => return connections_open(s, i, http_method),
        // Chosen: bot-token methods given the app-level token answer not_allowed_token_type.
        (_, Token::AppLevel(_)) => return err("not_allowed_token_type"),
        (_, Token::Bot(i)) => s.apps[i].clone(),
    };
    match method {
        "auth.test" => ok(
            json!({"url": "https://sim-team.slack.com/", "team": TEAM_NAME, "user": "imgate",
            "team_id": app.team_id, "user_id": app.bot_user_id, "bot_id": app.bot_id, "is_enterprise_install": false}),
        ),
        "conversations.info" => conversations_info(s, &app, &p),
        "conversations.history" => history(s, &app, &p),
        "conversations.replies" => replies(s, &app, &p),
        "users.info" => users_info(s, &app, &p),
        "chat.postMessage" => post_message(s, &app, &p),
        "files.getUploadURLExternal" => upload_url(s, &app, &p),
        "files.completeUploadExternal" => complete_upload(s, &app, &p),
        _ => err("unknown_method"),
    }
}

/// `{"ok":false,"error":"missing_scope","needed":…,"provided":"a,b,…"}` unless the bot holds `scope`.
fn need(app: &App, scope: &str) -> Option<Answer> {
    (!app.scopes.iter().any(|x| x == scope)).then(|| {
        answer(
            200,
            json!({"ok": false, "error": "missing_scope", "needed": scope, "provided": app.scopes.join(",")}),
        )
    })
}

fn connections_open(s: &mut State, i: usize, http_method: &str) -> Answer {
    if http_method != "POST" {
        return err("insecure_request");
    }
    if !s.apps[i].socket_mode {
        // Chosen: not in apps.connections.open's documented errors; Slack's code for it elsewhere
        // (apps.manifest.create: "Socket mode is not enabled in manifest.").
        return err("socket_mode_not_enabled");
    }
    let ticket = uuid(s);
    let app = &s.apps[i];
    s.tickets.insert(ticket.clone(), app.app_token.clone());
    let url = format!(
        "ws://127.0.0.1:{}/link/?ticket={ticket}&app_id={}",
        s.ws_port, app.app_id
    );
    ok(json!({"url": url}))
}

/// The channel the bot may see: unknown, or private and not a member → channel_not_found.
fn visible<'a>(s: &'a State, app: &App, p: &Map<String, Value>) -> Result<(&'a str, &'a Channel), Answer> {
    let Some(id) = param(p, "channel") else {
        return Err(err("channel_not_found"));
    };
    match s.channels.get_key_value(id) {
        Some((id, c)) if c.kind == "channel" || c.members.contains(&app.bot_user_id) => Ok((id.as_str(), c)),
        _ => Err(err("channel_not_found")),
    }
}

fn scope_for(kind: &str, what: &str) -> String {
    let prefix = match kind {
        "channel" => "channels",
        "group" => "groups",
        k => k,
    };
    format!("{prefix}:{what}")
}

fn conversations_info(s: &State, app: &App, p: &Map<String, Value>) -> Answer {
    let (id, c) = match visible(s, app, p) {
        Ok(x) => x,
        Err(a) => return a,
    };
    if let Some(a) = need(app, &scope_for(&c.kind, "read")) {
        return a;
    }
    let mut ch = json!({"id": id, "created": 1_700_000_000u64, "is_channel": c.kind == "channel",
        "is_group": c.kind == "group",
        "is_im": c.kind == "im", "is_mpim": c.kind == "mpim", "is_private": c.kind != "channel", "is_archived": false,
        "is_general": false, "is_member": c.members.contains(&app.bot_user_id), "context_team_id": TEAM_ID});
    if c.kind == "im" {
        // IMs have no name; they name the other party.
        ch["user"] = json!(c.members.iter().find(|m| **m != app.bot_user_id));
    } else {
        ch["name"] = json!(c.name);
        ch["name_normalized"] = json!(c.name);
    }
    ok(json!({"channel": ch}))
}

/// `limit`: default 100, at most 999; `set_history_page_cap` may make pages shorter.
fn page_len(s: &State, p: &Map<String, Value>, cap: bool) -> usize {
    let limit = param(p, "limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0)
        .unwrap_or(100)
        .min(999);
    if cap && s.history_page_cap > 0 {
        limit.min(s.history_page_cap)
    } else {
        limit
    }
}

/// (oldest, latest, inclusive) as microseconds, or the invalid_ts_* error.
fn range(p: &Map<String, Value>) -> Result<(u64, u64, bool), Answer> {
    let oldest = match param(p, "oldest") {
        Some(o) => ts_key(o).ok_or_else(|| err("invalid_ts_oldest"))?,
        None => 0,
    };
    let latest = match param(p, "latest") {
        Some(l) => ts_key(l).ok_or_else(|| err("invalid_ts_latest"))?,
        None => u64::MAX,
    };
    Ok((oldest, latest, matches!(param(p, "inclusive"), Some("true" | "1"))))
}

fn in_range(ts: &str, (oldest, latest, inclusive): (u64, u64, bool)) -> bool {
    let t = ts_key(ts).unwrap_or(0);
    if inclusive {
        t >= oldest && t <= latest
    } else {
        t > oldest && t < latest
    }
}

/// One page of `msgs` (already in page order), the cursor continuing after it, and has_more.
fn paginate(
    s: &mut State,
    msgs: Vec<Value>,
    p: &Map<String, Value>,
    newest_first: bool,
    cap: bool,
) -> Result<Value, Answer> {
    let mut msgs = msgs;
    if let Some(c) = param(p, "cursor") {
        let after = ts_key(s.cursors.get(c).ok_or_else(|| err("invalid_cursor"))?).unwrap_or(0);
        msgs.retain(|m| {
            let t = ts_key(m["ts"].as_str().unwrap_or("0")).unwrap_or(0);
            if newest_first {
                t < after
            } else {
                t > after
            }
        });
    }
    let n = page_len(s, p, cap);
    let has_more = msgs.len() > n;
    msgs.truncate(n);
    let next = if has_more {
        let last = msgs.last().and_then(|m| m["ts"].as_str()).unwrap_or("0").to_string();
        // Opaque, but shaped like Slack's ("bmV4dF90czo…" is base64 of "next_ts:…").
        let cursor = base64(format!("next_ts:{}", last.replace('.', "")).as_bytes());
        s.cursors.insert(cursor.clone(), last);
        cursor
    } else {
        String::new()
    };
    Ok(json!({"messages": msgs, "has_more": has_more, "response_metadata": {"next_cursor": next}}))
}

/// Newest first; top-level messages and thread parents only (replies only when broadcast).
fn history(s: &mut State, app: &App, p: &Map<String, Value>) -> Answer {
    let msgs = {
        let (_, c) = match visible(s, app, p) {
            Ok(x) => x,
            Err(a) => return a,
        };
        if let Some(a) = need(app, &scope_for(&c.kind, "history")) {
            return a;
        }
        if !c.members.contains(&app.bot_user_id) {
            return err("not_in_channel");
        }
        let r = match range(p) {
            Ok(r) => r,
            Err(a) => return a,
        };
        let top = |m: &&Value| m.get("thread_ts").is_none_or(|t| *t == m["ts"]) || m["subtype"] == "thread_broadcast";
        c.messages
            .iter()
            .rev()
            .filter(top)
            .filter(|m| in_range(m["ts"].as_str().unwrap_or("0"), r))
            .cloned()
            .collect()
    };
    match paginate(s, msgs, p, true, true) {
        Ok(mut v) => {
            v["pin_count"] = json!(0);
            if let Some(l) = param(p, "latest") {
                v["latest"] = json!(l);
            }
            ok(v)
        }
        Err(a) => a,
    }
}

/// The thread of `ts` (a parent or a reply), oldest first, `oldest`/`latest`/`inclusive` as the
/// history takes them ("The earliest messages in the time range are returned first"). The
/// parent heads the first page even when the range leaves it out (Slack's clients read
/// `messages[0]` as the parent; a page reached with a cursor does not repeat it). Replies also
/// sent to the channel are in the thread too, with their `thread_broadcast` subtype. Chosen: the
/// parent counts toward `limit`.
fn replies(s: &mut State, app: &App, p: &Map<String, Value>) -> Answer {
    let (parent, thread) = {
        let (_, c) = match visible(s, app, p) {
            Ok(x) => x,
            Err(a) => return a,
        };
        if let Some(a) = need(app, &scope_for(&c.kind, "history")) {
            return a;
        }
        if !c.members.contains(&app.bot_user_id) {
            return err("not_in_channel");
        }
        let r = match range(p) {
            Ok((_, latest, _)) if s.replies_ignore_oldest => (0, latest, true),
            Ok(r) => r,
            Err(a) => return a,
        };
        let Some(m) = param(p, "ts").and_then(|ts| c.messages.iter().find(|m| m["ts"] == ts)) else {
            return err("thread_not_found");
        };
        let root = m["thread_ts"]
            .as_str()
            .or(m["ts"].as_str())
            .unwrap_or_default()
            .to_string();
        let parent = c.messages.iter().find(|m| m["ts"] == root.as_str()).cloned();
        let thread: Vec<Value> = c
            .messages
            .iter()
            .filter(|m| m["ts"] != root.as_str() && m["thread_ts"] == root.as_str())
            .filter(|m| in_range(m["ts"].as_str().unwrap_or("0"), r))
            .cloned()
            .collect();
        (parent, thread)
    };
    // Not filtered by the range: the parent heads the first page; a cursor's page goes on
    // after it.
    let all = match param(p, "cursor") {
        None => parent.into_iter().chain(thread).collect(),
        Some(_) => thread,
    };
    match paginate(s, all, p, false, true) {
        Ok(v) => ok(v),
        Err(a) => a,
    }
}

fn users_info(s: &State, app: &App, p: &Map<String, Value>) -> Answer {
    if let Some(a) = need(app, "users:read") {
        return a;
    }
    let id = param(p, "user").unwrap_or_default();
    let bot = s.apps.iter().find(|a| a.bot_user_id == id);
    let name = match (s.users.get(id), bot) {
        (Some(n), _) => n.clone(),
        (None, Some(_)) => "imgate".to_string(),
        (None, None) => return err("user_not_found"),
    };
    let handle = name.to_lowercase().replace(' ', ".");
    let mut profile = json!({"display_name": name, "display_name_normalized": name, "real_name": name,
                             "real_name_normalized": name, "team": TEAM_ID});
    if let Some(b) = bot {
        profile["bot_id"] = json!(b.bot_id);
    }
    ok(
        json!({"user": {"id": id, "team_id": TEAM_ID, "name": handle, "deleted": false, "real_name": name,
                       "is_bot": bot.is_some(), "is_app_user": false, "profile": profile}}),
    )
}

fn post_message(s: &mut State, app: &App, p: &Map<String, Value>) -> Answer {
    if let Some(a) = need(app, "chat:write") {
        return a;
    }
    let id = {
        let (id, c) = match visible(s, app, p) {
            Ok(x) => x,
            Err(a) => return a,
        };
        if !c.members.contains(&app.bot_user_id) {
            return err("not_in_channel");
        }
        id.to_string()
    };
    let text = param(p, "text").unwrap_or_default().to_string();
    if text.is_empty() && param(p, "blocks").is_none() && param(p, "attachments").is_none() {
        return err("no_text");
    }
    if text.chars().count() > s.max_text_len {
        return err("msg_too_long");
    }
    let ts = next_ts(s);
    let mut m = bot_message(app, &text, &ts);
    if let Some(b) = param(p, "blocks") {
        m["blocks"] = serde_json::from_str(b).unwrap_or(Value::Null);
    }
    // A reply's ts is filed under its parent (the method page: "Avoid using a reply's ts value;
    // use its parent instead"). Chosen: accepted and re-parented, and recorded as such.
    let asked = param(p, "thread_ts").map(str::to_string);
    let mut was_reply = false;
    if let Some(t) = &asked {
        let parent = s.channels[&id]
            .messages
            .iter()
            .find(|m| m["ts"] == t.as_str())
            .and_then(|m| m["thread_ts"].as_str().filter(|r| *r != t.as_str()).map(str::to_string));
        was_reply = parent.is_some();
        m["thread_ts"] = json!(parent.unwrap_or_else(|| t.clone()));
        if matches!(param(p, "reply_broadcast"), Some("true" | "1")) {
            m["subtype"] = json!("thread_broadcast");
        }
    }
    s.posted.push((
        id.clone(),
        json!({"text": text, "thread_ts": asked, "ts": ts, "thread_ts_was_reply": was_reply,
                                      "blocks": m.get("blocks").cloned()}),
    ));
    append(s, &id, m);
    let message = s.channels[&id]
        .messages
        .iter()
        .find(|m| m["ts"] == ts.as_str())
        .cloned();
    ok(json!({"channel": id, "ts": ts, "message": message}))
}

fn upload_url(s: &mut State, app: &App, p: &Map<String, Value>) -> Answer {
    if let Some(a) = need(app, "files:write") {
        return a;
    }
    let length = param(p, "length").and_then(|l| l.parse::<usize>().ok()).unwrap_or(0);
    let Some(filename) = param(p, "filename").filter(|_| length > 0) else {
        return err("missing_argument");
    };
    s.next_id += 1;
    let id = format!("F0SIM{:05}", s.next_id);
    s.uploads_pending.insert(
        id.clone(),
        Upload {
            filename: filename.into(),
            length,
            bytes: None,
        },
    );
    ok(json!({"upload_url": format!("{}/upload/{id}", s.http), "file_id": id}))
}

/// The bytes, raw or as the `file` part of a multipart body; no token needed. Chosen answer:
/// 200 "OK - <bytes>" (Slack's SDK checks only the status).
fn upload(s: &mut State, id: &str, body: &[u8], ctype: &str) -> Answer {
    let Some(u) = s.uploads_pending.get_mut(id) else {
        return Answer {
            status: 404,
            body: b"Not Found".to_vec(),
            headers: vec![],
        };
    };
    let bytes = if ctype.starts_with("multipart/form-data") {
        let parts = multipart(body, ctype).unwrap_or_default();
        parts
            .iter()
            .find(|p| p.name == "file")
            .or(parts.first())
            .map(|p| p.data.clone())
            .unwrap_or_default()
    } else {
        body.to_vec()
    };
    let len = bytes.len();
    u.bytes = Some(bytes);
    Answer {
        status: 200,
        body: format!("OK - {len}").into_bytes(),
        headers: vec![("Content-Type".into(), "text/plain".into())],
    }
}

fn complete_upload(s: &mut State, app: &App, p: &Map<String, Value>) -> Answer {
    if let Some(a) = need(app, "files:write") {
        return a;
    }
    let list: Vec<Value> = param(p, "files")
        .and_then(|f| serde_json::from_str(f).ok())
        .unwrap_or_default();
    if list.is_empty() {
        return err("invalid_arguments");
    }
    let channel = param(p, "channel_id")
        .or_else(|| param(p, "channels").and_then(|c| c.split(',').next()))
        .map(str::to_string);
    if let Some(c) = &channel {
        let mut q = p.clone();
        q.insert("channel".into(), json!(c));
        match visible(s, app, &q) {
            Err(a) => return a,
            Ok((_, ch)) if !ch.members.contains(&app.bot_user_id) => return err("not_in_channel"),
            Ok(_) => {}
        }
    }
    let mut files = vec![];
    for f in &list {
        let id = f["id"].as_str().unwrap_or_default();
        match s.uploads_pending.get(id) {
            Some(u) if u.bytes.is_some() => {}
            _ => return err("file_not_found"),
        }
    }
    for f in &list {
        let id = f["id"].as_str().unwrap_or_default();
        let u = s.uploads_pending.remove(id).unwrap();
        let title = f["title"].as_str().unwrap_or(&u.filename).to_string();
        let bytes = u.bytes.unwrap_or_default();
        s.uploads.push(
            json!({"file_id": id, "filename": u.filename, "title": title, "length": u.length,
            "bytes_len": bytes.len(), "length_mismatch": bytes.len() != u.length, "channel_id": channel,
            "thread_ts": param(p, "thread_ts"), "initial_comment": param(p, "initial_comment")}),
        );
        // The hosted file keeps the upload's ID (new_file made a fresh one; move it back).
        let mime = guess_mime(&u.filename);
        let mut file = new_file(
            s,
            channel.as_deref().unwrap_or(""),
            &app.bot_user_id,
            &u.filename,
            &title,
            mime,
            bytes,
        );
        let fresh = file["id"].as_str().unwrap().to_string();
        let stored = s.files.remove(&fresh).unwrap();
        s.files.insert(id.into(), stored);
        for k in [
            "id",
            "url_private",
            "url_private_download",
            "permalink",
            "permalink_public",
        ] {
            file[k] = json!(file[k].as_str().unwrap().replace(&fresh, id));
        }
        files.push(file);
    }
    if let Some(c) = &channel {
        let ts = next_ts(s);
        let mut m = bot_message(app, param(p, "initial_comment").unwrap_or(""), &ts);
        m["subtype"] = json!("file_share");
        m["files"] = json!(files.clone());
        m["upload"] = json!(true);
        m["display_as_bot"] = json!(false);
        if let Some(t) = param(p, "thread_ts") {
            m["thread_ts"] = json!(t);
        }
        append(s, c, m);
    }
    ok(json!({"files": files.iter().map(|f| json!({"id": f["id"], "title": f["title"]})).collect::<Vec<_>>()}))
}

/// Slack sniffs an uploaded file's type; by extension is close enough here.
fn guess_mime(name: &str) -> &'static str {
    match name.rsplit_once('.').map(|(_, e)| e.to_ascii_lowercase()).as_deref() {
        Some("png") => "image/png",
        Some("jpg" | "jpeg") => "image/jpeg",
        Some("gif") => "image/gif",
        Some("pdf") => "application/pdf",
        Some("txt" | "md" | "log") => "text/plain",
        Some("json") => "application/json",
        _ => "application/octet-stream",
    }
}

/// GET /files-pri/<team>-<file>/[download/]<name>. A bot token with files:read gets the bytes;
/// a valid token without files:read gets Slack's sign-in page with 200 (vercel/eve#1531); no or
/// a bad token gets 302 Found to `/?redir=…` (deno-slack-sdk#285), whose page is that same HTML.
fn download(s: &mut State, path: &str, auth: &str) -> Answer {
    let id = path
        .trim_start_matches("/files-pri/")
        .split('/')
        .next()
        .unwrap_or_default()
        .split_once('-')
        .map(|(_, f)| f.to_string())
        .unwrap_or_default();
    let app = auth
        .strip_prefix("Bearer ")
        .and_then(|t| s.apps.iter().find(|a| a.bot_token == t));
    let a = match (s.files.get(&id), app) {
        (None, _) => Answer {
            status: 404,
            body: b"Not Found".to_vec(),
            headers: vec![],
        },
        (Some(_), None) => {
            let to = format!("{}/?redir={}", s.http, path.replace('/', "%2F"));
            Answer {
                status: 302,
                body: format!("<a href=\"{to}\">Found</a>.").into_bytes(),
                headers: vec![
                    ("Location".into(), to),
                    ("Content-Type".into(), "text/html; charset=utf-8".into()),
                ],
            }
        }
        (Some(_), Some(a)) if !a.scopes.iter().any(|x| x == "files:read") => Answer {
            status: 200,
            body: SIGN_IN.into(),
            headers: vec![("Content-Type".into(), "text/html; charset=utf-8".into())],
        },
        (Some((_, mime, bytes)), Some(_)) => Answer {
            status: 200,
            body: bytes.clone(),
            headers: vec![("Content-Type".into(), mime.clone())],
        },
    };
    s.downloads
        .push(json!({"path": path, "auth": auth, "status": a.status}));
    a
}
