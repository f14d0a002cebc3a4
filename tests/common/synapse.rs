//! A real Synapse homeserver for the Matrix provider's tests, and a small client-server API
//! client to play the human side of a room.
//!
//! Synapse runs from a Python venv: `IMGATE_SYNAPSE_PYTHON` names its python, else
//! `target/synapse-venv/bin/python` under the repository (`python3 -m venv target/synapse-venv
//! && target/synapse-venv/bin/pip install matrix-synapse`). Each `Synapse` is its own process on
//! a free loopback port with its SQLite database, media store and log in a scratch directory;
//! it reaches nothing outside (no federation listener, federation and key servers refused, no
//! stats), so it works with no network. Dropping it kills the process.
//!
//! Everything here blocks and panics with the request and Synapse's answer on failure.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::kit::{base64_unpadded, hex};

/// The homeserver's name: user IDs are `@alice:localhost`, aliases `#a:localhost`.
pub const SERVER_NAME: &str = "localhost";

/// Signs the admin registration API's requests (`register`); tests have no other way to make
/// users, since open registration is off.
const SHARED_SECRET: &str = "imgate-test-registration-secret";

/// A cold start takes about 2 s here; the bound only matters when something is wrong.
const STARTUP: Duration = Duration::from_secs(120);

/// How long a request of the harness keeps retrying Synapse's 429s (see `MatrixUser::ok`).
const RATE_LIMIT_PATIENCE: Duration = Duration::from_secs(60);

/// Lifts every client-facing rate limit of Synapse (each is a token bucket: `burst_count`
/// actions at once, refilled at `per_second`). `Synapse::start_relaxed` appends this to the
/// config; a caller can append it to its own `start_with` YAML too.
pub const RELAXED_RATE_LIMITS: &str = "\
rc_message: {per_second: 1000, burst_count: 10000}
rc_registration: {per_second: 1000, burst_count: 10000}
rc_login:
  address: {per_second: 1000, burst_count: 10000}
  account: {per_second: 1000, burst_count: 10000}
  failed_attempts: {per_second: 1000, burst_count: 10000}
rc_joins:
  local: {per_second: 1000, burst_count: 10000}
  remote: {per_second: 1000, burst_count: 10000}
rc_joins_per_room: {per_second: 1000, burst_count: 10000}
rc_invites:
  per_room: {per_second: 1000, burst_count: 10000}
  per_user: {per_second: 1000, burst_count: 10000}
  per_issuer: {per_second: 1000, burst_count: 10000}
rc_third_party_invite: {per_second: 1000, burst_count: 10000}
rc_room_creation: {per_second: 1000, burst_count: 10000}
rc_media_create: {per_second: 1000, burst_count: 10000}
rc_profile: {per_second: 1000, burst_count: 10000}
rc_presence:
  per_user: {per_second: 1000, burst_count: 10000}
rc_delayed_event_mgmt: {per_second: 1000, burst_count: 10000}
rc_admin_redaction: {per_second: 1000, burst_count: 10000}
rc_3pid_validation: {per_second: 1000, burst_count: 10000}
rc_key_requests: {per_second: 1000, burst_count: 10000}
rc_reports: {per_second: 1000, burst_count: 10000}
rc_user_directory: {per_second: 1000, burst_count: 10000}
";

/// `python -m synapse.app.homeserver`, which also exits when its stdin closes: the test
/// process holds the pipe's other end, so a Synapse does not outlive a test run that is
/// killed or aborts (Drop does not run then). A raw `os.read`, not `sys.stdin`: a thread
/// blocked in the buffered reader holds its lock and makes Python abort when it exits.
const LAUNCHER: &str = "\
import os, runpy, sys, threading
def watch():
    while os.read(0, 4096):
        pass
    os._exit(0)
threading.Thread(target=watch, daemon=True).start()
sys.argv = ['synapse.app.homeserver'] + sys.argv[1:]
runpy.run_module('synapse.app.homeserver', run_name='__main__', alter_sys=True)
";

/// A running Synapse. Dropping it kills the process.
pub struct Synapse {
    /// `http://127.0.0.1:PORT`, no trailing slash: the client-server API's base URL.
    pub base: String,
    pub server_name: String,
    /// The scratch directory: config, database, media store, `homeserver.log`.
    pub dir: PathBuf,
    /// How long it took to answer `/_matrix/client/versions`.
    pub startup: Duration,
    child: Child,
}

impl Synapse {
    /// Synapse with its default rate limits (a user may send 10 messages at once, then one per
    /// 5 s): what a real homeserver does to a chatty bot.
    pub fn start() -> Synapse {
        Self::start_with("")
    }

    /// Synapse with the rate limits lifted (`RELAXED_RATE_LIMITS`), for tests that send a lot.
    pub fn start_relaxed() -> Synapse {
        Self::start_with(RELAXED_RATE_LIMITS)
    }

    /// Synapse with `extra_yaml` appended to the harness's config. A top-level key given again
    /// replaces the harness's (Synapse reads the file with PyYAML, where the last one wins);
    /// a mapping is replaced whole, not merged.
    pub fn start_with(extra_yaml: &str) -> Synapse {
        let python = python();
        let dir = super::temp_dir("synapse");
        let port = super::free_port();
        let base = format!("http://127.0.0.1:{port}");
        write_signing_key(&dir.join("signing.key"));
        std::fs::write(dir.join("log.yaml"), log_config(&dir)).expect("the scratch dir takes Synapse's log config");
        let config = dir.join("homeserver.yaml");
        let text = format!("{}\n{extra_yaml}\n", homeserver_config(&dir, port));
        std::fs::write(&config, text).expect("the scratch dir takes homeserver.yaml");
        // Python's own output (a traceback before logging is set up, say) goes to a file too.
        let console = File::create(dir.join("console.log")).expect("the scratch dir takes console.log");
        let started = Instant::now();
        let child = Command::new(&python)
            .args(["-c", LAUNCHER, "-c"])
            .arg(&config)
            .current_dir(&dir)
            // Held open by `child` until it is dropped: see LAUNCHER.
            .stdin(Stdio::piped())
            .stdout(console.try_clone().expect("console.log opens twice"))
            .stderr(console)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
        let mut synapse = Synapse {
            base,
            server_name: SERVER_NAME.to_string(),
            dir,
            startup: Duration::ZERO,
            child,
        };
        synapse.wait_ready(started);
        synapse
    }

    /// Polls `/_matrix/client/versions` until it answers 200; panics with the log if Synapse
    /// exits or `STARTUP` passes first.
    fn wait_ready(&mut self, started: Instant) {
        let url = format!("{}/_matrix/client/versions", self.base);
        let probe: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(2)))
            .proxy(None)
            .build()
            .into();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("Synapse exited while starting ({status}):\n{}", self.log_tail(60));
            }
            if probe.get(&url).call().is_ok_and(|r| r.status() == 200) {
                self.startup = started.elapsed();
                return;
            }
            if started.elapsed() > STARTUP {
                panic!(
                    "Synapse did not answer {url} within {STARTUP:?}:\n{}",
                    self.log_tail(60)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Synapse's log (WARNING and above) and Python's console output so far.
    pub fn log(&self) -> String {
        let read = |name: &str| std::fs::read_to_string(self.dir.join(name)).unwrap_or_default();
        format!(
            "--- homeserver.log\n{}--- console\n{}",
            read("homeserver.log"),
            read("console.log")
        )
    }

    /// The last `n` lines of `log()`, for panic messages.
    pub fn log_tail(&self, n: usize) -> String {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// The full user ID of `localpart` on this server.
    pub fn user_id(&self, localpart: &str) -> String {
        format!("@{localpart}:{}", self.server_name)
    }

    /// Registers `localpart` (lower case, as Synapse keeps it) with the password
    /// `password(localpart)`: the shared-secret admin API, since open registration is off.
    /// That API is not rate limited and logs the new user in, so the user, device and token are
    /// those of its answer; `login` makes further sessions (and is rate limited per address:
    /// 5 at once by default).
    pub fn register(&self, localpart: &str) -> MatrixUser {
        self.register_as(localpart, false)
    }

    /// `register` of a server admin (the `/_synapse/admin` APIs answer its token).
    pub fn register_admin(&self, localpart: &str) -> MatrixUser {
        self.register_as(localpart, true)
    }

    fn register_as(&self, localpart: &str, admin: bool) -> MatrixUser {
        let url = format!("{}/_synapse/admin/v1/register", self.base);
        let (status, nonce) = json_call("GET", &url, None, None);
        assert_eq!(status, 200, "GET {url}: {nonce}");
        let nonce = nonce["nonce"].as_str().expect("the register API gives a nonce");
        let password = password(localpart);
        // HMAC-SHA1 over nonce NUL user NUL password NUL admin|notadmin (Synapse's admin API doc).
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA1_FOR_LEGACY_USE_ONLY, SHARED_SECRET.as_bytes());
        let role = if admin { "admin" } else { "notadmin" };
        let signed = format!("{nonce}\0{localpart}\0{password}\0{role}");
        let mac = hex(ring::hmac::sign(&key, signed.as_bytes()).as_ref());
        let body = json!({"nonce": nonce, "username": localpart, "password": password, "admin": admin, "mac": mac});
        let (status, v) = json_call("POST", &url, None, Some(&body));
        assert_eq!(status, 200, "registering {localpart}: {v}");
        MatrixUser::from_session(&self.base, &v)
    }

    /// A new session (device and token) of a registered user: `/login` with `m.login.password`.
    pub fn login(&self, localpart: &str) -> MatrixUser {
        let url = format!("{}/_matrix/client/v3/login", self.base);
        let body = json!({
            "type": "m.login.password",
            "identifier": {"type": "m.id.user", "user": localpart},
            "password": password(localpart),
        });
        let (status, v) = json_call("POST", &url, None, Some(&body));
        assert_eq!(status, 200, "logging {localpart} in: {v}");
        MatrixUser::from_session(&self.base, &v)
    }
}

impl Drop for Synapse {
    fn drop(&mut self) {
        // SIGKILL: the database is thrown away with the scratch dir, nothing needs a clean stop.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The password `register` gives `localpart`.
pub fn password(localpart: &str) -> String {
    format!("pw-{localpart}-imgate-test")
}

/// One session of a user on a `Synapse`.
#[derive(Clone, Debug)]
pub struct MatrixUser {
    pub user_id: String,
    pub access_token: String,
    pub device_id: String,
    /// The server's base URL, as `Synapse::base`.
    pub base: String,
}

impl MatrixUser {
    fn from_session(base: &str, v: &Value) -> MatrixUser {
        let field = |k: &str| {
            v[k].as_str()
                .unwrap_or_else(|| panic!("a session has a {k}: {v}"))
                .to_string()
        };
        MatrixUser {
            user_id: field("user_id"),
            access_token: field("access_token"),
            device_id: field("device_id"),
            base: base.to_string(),
        }
    }

    /// One request with this user's token: `path` is everything after the base URL
    /// (`/_matrix/client/v3/...`, already percent-encoded); the status and the JSON answer
    /// (`Null` if it is not JSON). No retry: tests that look at errors and limits use this.
    pub fn call(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        json_call(method, &format!("{}{path}", self.base), Some(&self.access_token), body)
    }

    /// `call` that must answer 200. A 429 (`M_LIMIT_EXCEEDED`) is waited out and retried for up
    /// to a minute: the harness plays people, whom the limits only slow down, and a test under
    /// the default limits should not fail on its own messages. Sends are idempotent per
    /// transaction ID, so a retry never doubles one.
    pub fn ok(&self, method: &str, path: &str, body: Option<&Value>) -> Value {
        let deadline = Instant::now() + RATE_LIMIT_PATIENCE;
        loop {
            let (status, v) = self.call(method, path, body);
            match status {
                200 => return v,
                429 if Instant::now() < deadline => {
                    let ms = v["retry_after_ms"].as_u64().unwrap_or(1000).clamp(50, 10_000);
                    std::thread::sleep(Duration::from_millis(ms));
                }
                _ => panic!("{} {method} {path}: {status} {v}", self.user_id),
            }
        }
    }

    /// A room with `preset: private_chat`, inviting `invite`; `direct` marks the invites as a
    /// DM (`is_direct`). The room ID.
    pub fn create_room(&self, invite: &[&str], direct: bool) -> String {
        let body = json!({"preset": "private_chat", "invite": invite, "is_direct": direct});
        self.create(body)
    }

    /// `create_room` (not direct) with Megolm encryption on from the start. The harness cannot
    /// encrypt or decrypt: its users' messages there are still plain `m.room.message` events.
    pub fn create_encrypted_room(&self, invite: &[&str]) -> String {
        let body = json!({
            "preset": "private_chat",
            "invite": invite,
            "initial_state": [{
                "type": "m.room.encryption",
                "state_key": "",
                "content": {"algorithm": "m.megolm.v1.aes-sha2"},
            }],
        });
        self.create(body)
    }

    fn create(&self, body: Value) -> String {
        let v = self.ok("POST", "/_matrix/client/v3/createRoom", Some(&body));
        v["room_id"]
            .as_str()
            .unwrap_or_else(|| panic!("createRoom answers a room_id: {v}"))
            .to_string()
    }

    /// Joins a room by ID or alias.
    pub fn join(&self, room: &str) {
        self.ok(
            "POST",
            &format!("/_matrix/client/v3/join/{}", enc(room)),
            Some(&json!({})),
        );
    }

    pub fn invite(&self, room: &str, user_id: &str) {
        let path = format!("/_matrix/client/v3/rooms/{}/invite", enc(room));
        self.ok("POST", &path, Some(&json!({"user_id": user_id})));
    }

    pub fn leave(&self, room: &str) {
        let path = format!("/_matrix/client/v3/rooms/{}/leave", enc(room));
        self.ok("POST", &path, Some(&json!({})));
    }

    /// Points `#alias_localpart:server` at `room_id`; the full alias.
    pub fn set_alias(&self, room_id: &str, alias_localpart: &str) -> String {
        let server = self.user_id.split_once(':').map_or(SERVER_NAME, |(_, s)| s);
        let alias = format!("#{alias_localpart}:{server}");
        let path = format!("/_matrix/client/v3/directory/room/{}", enc(&alias));
        self.ok("PUT", &path, Some(&json!({"room_id": room_id})));
        alias
    }

    /// Sends an `m.room.message` with `content`; the event ID.
    pub fn send(&self, room: &str, content: &Value) -> String {
        self.send_event(room, "m.room.message", content)
    }

    /// Sends an event of `event_type` with a fresh transaction ID; the event ID.
    pub fn send_event(&self, room: &str, event_type: &str, content: &Value) -> String {
        let path = format!(
            "/_matrix/client/v3/rooms/{}/send/{}/{}",
            enc(room),
            enc(event_type),
            txn_id()
        );
        let v = self.ok("PUT", &path, Some(content));
        v["event_id"]
            .as_str()
            .unwrap_or_else(|| panic!("a send answers an event_id: {v}"))
            .to_string()
    }

    pub fn send_text(&self, room: &str, body: &str) -> String {
        self.send(room, &json!({"msgtype": "m.text", "body": body}))
    }

    pub fn send_notice(&self, room: &str, body: &str) -> String {
        self.send(room, &json!({"msgtype": "m.notice", "body": body}))
    }

    /// Uploads `bytes` to the media repository; the `mxc://` URI.
    pub fn upload(&self, bytes: &[u8], filename: &str, mime: &str) -> String {
        let url = format!("{}/_matrix/media/v3/upload?filename={}", self.base, enc(filename));
        let (status, answer) = raw("POST", &url, Some(&self.access_token), Some((mime, bytes)));
        let v: Value = serde_json::from_slice(&answer).unwrap_or(Value::Null);
        assert_eq!(status, 200, "{} uploading {filename}: {v}", self.user_id);
        v["content_uri"]
            .as_str()
            .unwrap_or_else(|| panic!("an upload answers a content_uri: {v}"))
            .to_string()
    }

    /// Uploads `bytes` and sends them as an `m.image`; the event ID and the `mxc://` URI.
    pub fn send_image(&self, room: &str, bytes: &[u8], filename: &str, mime: &str) -> (String, String) {
        let mxc = self.upload(bytes, filename, mime);
        let content = json!({
            "msgtype": "m.image",
            "body": filename,
            "url": mxc,
            "info": {"mimetype": mime, "size": bytes.len()},
        });
        (self.send(room, &content), mxc)
    }

    /// The last `limit` events of `room` this user can see, oldest first (all types).
    pub fn events(&self, room: &str, limit: usize) -> Vec<Value> {
        self.history(room, limit, None)
    }

    /// The last `limit` `m.room.message` events of `room`, oldest first.
    pub fn messages(&self, room: &str, limit: usize) -> Vec<Value> {
        self.history(room, limit, Some(json!({"types": ["m.room.message"]})))
    }

    fn history(&self, room: &str, limit: usize, filter: Option<Value>) -> Vec<Value> {
        let mut path = format!("/_matrix/client/v3/rooms/{}/messages?dir=b&limit={limit}", enc(room));
        if let Some(f) = filter {
            path.push_str(&format!("&filter={}", enc(&f.to_string())));
        }
        let v = self.ok("GET", &path, None);
        let mut chunk = v["chunk"].as_array().cloned().unwrap_or_default();
        chunk.reverse(); // dir=b answers newest first
        chunk
    }

    /// Polls `messages` until one satisfies `pred`; panics with the last ones seen after
    /// `timeout`.
    pub fn wait_message(&self, room: &str, pred: impl Fn(&Value) -> bool, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let seen = self.messages(room, 50);
            if let Some(m) = seen.iter().find(|m| pred(m)) {
                return m.clone();
            }
            if Instant::now() > deadline {
                let lines: Vec<String> = seen.iter().map(|m| m.to_string()).collect();
                panic!(
                    "{} saw no matching message in {room} within {timeout:?}; the last ones:\n{}",
                    self.user_id,
                    lines.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The bytes of an `mxc://server/media_id` URI, through the authenticated media API.
    pub fn download(&self, mxc: &str) -> Vec<u8> {
        let (server, media_id) = mxc
            .strip_prefix("mxc://")
            .and_then(|rest| rest.split_once('/'))
            .unwrap_or_else(|| panic!("not an mxc:// URI: {mxc}"));
        let url = format!(
            "{}/_matrix/client/v1/media/download/{}/{}",
            self.base,
            enc(server),
            enc(media_id)
        );
        let (status, bytes) = raw("GET", &url, Some(&self.access_token), None);
        assert_eq!(
            status,
            200,
            "{} downloading {mxc}: {}",
            self.user_id,
            String::from_utf8_lossy(&bytes)
        );
        bytes
    }

    /// Ends this session: its token answers 401 `M_UNKNOWN_TOKEN` from now on.
    pub fn logout(&self) {
        self.ok("POST", "/_matrix/client/v3/logout", Some(&json!({})));
    }

    pub fn set_displayname(&self, name: &str) {
        let path = format!("/_matrix/client/v3/profile/{}/displayname", enc(&self.user_id));
        self.ok("PUT", &path, Some(&json!({"displayname": name})));
    }

    /// Starts (for 30 s) or stops this user's typing notice in `room`.
    pub fn set_typing(&self, room: &str, typing: bool) {
        let path = format!("/_matrix/client/v3/rooms/{}/typing/{}", enc(room), enc(&self.user_id));
        self.ok("PUT", &path, Some(&json!({"typing": typing, "timeout": 30_000})));
    }

    /// Whether `/sync` shows `user_id` typing in `room` (which this user has joined) before
    /// `timeout` passes: the first sync gives who types now, the later ones each change.
    pub fn typing_seen(&self, room: &str, user_id: &str, timeout: Duration) -> bool {
        let filter = json!({
            "presence": {"types": []},
            "account_data": {"types": []},
            "room": {
                "rooms": [room],
                "timeline": {"limit": 0},
                "state": {"types": []},
                "account_data": {"types": []},
                "ephemeral": {"types": ["m.typing"]},
            },
        });
        let filter = enc(&filter.to_string());
        let deadline = Instant::now() + timeout;
        let mut since: Option<String> = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            // A long poll, shorter than the HTTP client's own timeout.
            let wait = left.min(Duration::from_secs(5)).as_millis();
            let mut path = format!("/_matrix/client/v3/sync?filter={filter}&timeout={wait}");
            if let Some(s) = &since {
                path.push_str(&format!("&since={}", enc(s)));
            }
            let v = self.ok("GET", &path, None);
            let events = v["rooms"]["join"][room]["ephemeral"]["events"].as_array().cloned();
            let typing = events.unwrap_or_default().iter().any(|e| {
                e["type"] == "m.typing"
                    && e["content"]["user_ids"]
                        .as_array()
                        .is_some_and(|ids| ids.iter().any(|id| id == user_id))
            });
            if typing {
                return true;
            }
            since = v["next_batch"].as_str().map(str::to_string);
        }
    }

    /// The user IDs joined to `room` now.
    pub fn joined_members(&self, room: &str) -> Vec<String> {
        let path = format!("/_matrix/client/v3/rooms/{}/joined_members", enc(room));
        let v = self.ok("GET", &path, None);
        v["joined"]
            .as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Waits until `user_id` is (`joined`) or is not (`!joined`) a member of `room`; panics
    /// with the members after `timeout`.
    pub fn wait_joined(&self, room: &str, user_id: &str, joined: bool, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let members = self.joined_members(room);
            if members.iter().any(|m| m == user_id) == joined {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{user_id} {} in {room} within {timeout:?}; members: {members:?}",
                if joined { "did not join" } else { "did not leave" }
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The content of the state event `event_type`/`state_key` of `room`, `None` if unset.
    pub fn state(&self, room: &str, event_type: &str, state_key: &str) -> Option<Value> {
        let path = format!(
            "/_matrix/client/v3/rooms/{}/state/{}/{}",
            enc(room),
            enc(event_type),
            enc(state_key)
        );
        match self.call("GET", &path, None) {
            (200, v) => Some(v),
            (404, _) => None,
            (status, v) => panic!("{} GET {path}: {status} {v}", self.user_id),
        }
    }
}

// ---------- plumbing ----------

/// Synapse's python: `IMGATE_SYNAPSE_PYTHON`, else the repository's `target/synapse-venv`.
fn python() -> PathBuf {
    let (path, from) = match std::env::var_os("IMGATE_SYNAPSE_PYTHON") {
        Some(p) => (PathBuf::from(p), "IMGATE_SYNAPSE_PYTHON"),
        None => (
            Path::new(env!("CARGO_MANIFEST_DIR")).join("target/synapse-venv/bin/python"),
            "the default place",
        ),
    };
    assert!(
        path.exists(),
        "the Matrix tests need Synapse, and there is no python at {} ({from}). Install it from \
         the repository's root with `python3 -m venv target/synapse-venv && \
         target/synapse-venv/bin/pip install matrix-synapse`, or set IMGATE_SYNAPSE_PYTHON to a \
         python that can import synapse",
        path.display()
    );
    path
}

/// The harness's homeserver.yaml. Nothing in it reaches outside the machine: the one listener
/// serves the client-server API (with the admin and media APIs) on loopback; federation is
/// refused to every server (an empty whitelist) and no key server is trusted.
fn homeserver_config(dir: &Path, port: u16) -> String {
    let d = dir.display();
    format!(
        "\
server_name: \"{SERVER_NAME}\"
public_baseurl: \"http://127.0.0.1:{port}/\"
listeners:
  - port: {port}
    bind_addresses: [\"127.0.0.1\"]
    type: http
    tls: false
    x_forwarded: false
    resources:
      - names: [client]
        compress: false
database:
  name: sqlite3
  args:
    database: \"{d}/homeserver.db\"
log_config: \"{d}/log.yaml\"
media_store_path: \"{d}/media\"
signing_key_path: \"{d}/signing.key\"
registration_shared_secret: \"{SHARED_SECRET}\"
macaroon_secret_key: \"imgate-test-macaroon-secret\"
form_secret: \"imgate-test-form-secret\"
enable_registration: false
report_stats: false
trusted_key_servers: []
suppress_key_server_warning: true
federation_domain_whitelist: []
presence:
  enabled: false
enable_metrics: false
url_preview_enabled: false
"
    )
}

/// WARNING and above to `homeserver.log`, unbuffered (Synapse's sample buffers INFO lines).
fn log_config(dir: &Path) -> String {
    format!(
        "\
version: 1
formatters:
  precise:
    format: '%(asctime)s - %(name)s - %(lineno)d - %(levelname)s - %(request)s - %(message)s'
handlers:
  file:
    class: logging.FileHandler
    formatter: precise
    filename: \"{}/homeserver.log\"
    encoding: utf8
root:
  level: WARNING
  handlers: [file]
disable_existing_loggers: false
",
        dir.display()
    )
}

/// A fresh ed25519 signing key in Synapse's file format (`ed25519 <key id> <unpadded base64
/// of the 32-byte seed>`): any 32 random bytes are a seed, so no Python run is needed for it.
fn write_signing_key(path: &Path) {
    use ring::rand::SecureRandom;
    let mut seed = [0u8; 32];
    ring::rand::SystemRandom::new()
        .fill(&mut seed)
        .expect("the OS gives random bytes");
    std::fs::write(path, format!("ed25519 a_test {}\n", base64_unpadded(&seed)))
        .expect("the scratch dir takes the signing key");
}

/// Percent-encodes everything but RFC 3986's unreserved characters: room IDs (`!a:b`),
/// aliases (`#a:b`) and user IDs (`@a:b`) as path segments or query values.
pub fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A transaction ID no other send of this process uses (each `Synapse` is new per test).
fn txn_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("imgate-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

fn agent() -> &'static ureq::Agent {
    static AGENT: OnceLock<ureq::Agent> = OnceLock::new();
    AGENT.get_or_init(|| {
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            // Above typing_seen's 5 s long polls; Synapse on loopback answers the rest at once.
            .timeout_global(Some(Duration::from_secs(30)))
            // Loopback only: a proxy from the environment must not take the requests.
            .proxy(None)
            .build()
            .into()
    })
}

/// One request: the status and the whole body. `body` is (Content-Type, bytes).
fn raw(method: &str, url: &str, token: Option<&str>, body: Option<(&str, &[u8])>) -> (u16, Vec<u8>) {
    let mut request = ureq::http::Request::builder().method(method).uri(url);
    if let Some(t) = token {
        request = request.header("Authorization", format!("Bearer {t}"));
    }
    let sent = match body {
        Some((content_type, bytes)) => agent().run(
            request
                .header("Content-Type", content_type)
                .body(bytes.to_vec())
                .unwrap_or_else(|e| panic!("{method} {url}: a bad request: {e}")),
        ),
        None => agent().run(
            request
                .body(())
                .unwrap_or_else(|e| panic!("{method} {url}: a bad request: {e}")),
        ),
    };
    let mut response = sent.unwrap_or_else(|e| panic!("{method} {url}: no answer from Synapse: {e}"));
    let status = response.status().as_u16();
    let bytes = response
        .body_mut()
        .with_config()
        .limit(u64::MAX)
        .read_to_vec()
        .unwrap_or_else(|e| panic!("{method} {url}: the answer breaks off: {e}"));
    (status, bytes)
}

/// A JSON request: the status and the JSON answer (`Null` if it is not JSON).
fn json_call(method: &str, url: &str, token: Option<&str>, body: Option<&Value>) -> (u16, Value) {
    let text = body.map(|b| b.to_string());
    let body = text.as_deref().map(|t| ("application/json", t.as_bytes()));
    let (status, bytes) = raw(method, url, token, body);
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

// ---------- self-check ----------

/// Exercises the harness against a real Synapse (run from a test of its own: a module of
/// `tests/common` has no tests): users, rooms, aliases, messages, media, typing, logout, and
/// that the default limits bite while the relaxed ones do not.
pub fn self_check() {
    const WAIT: Duration = Duration::from_secs(20);
    let s = Synapse::start();
    eprintln!("Synapse at {} answered after {:?}", s.base, s.startup);

    let alice = s.register("alice");
    let bob = s.register("bob");
    assert_eq!(alice.user_id, "@alice:localhost");
    assert_eq!(bob.user_id, s.user_id("bob"));
    assert!(!bob.device_id.is_empty() && !bob.access_token.is_empty(), "{bob:?}");

    let room = alice.create_room(&[&bob.user_id], false);
    assert!(room.starts_with('!'), "{room}");
    bob.join(&room);
    alice.wait_joined(&room, &bob.user_id, true, WAIT);

    // An alias, and a join through it (a `#` in the path).
    let alias = alice.set_alias(&room, "selfcheck");
    assert_eq!(alias, "#selfcheck:localhost");
    let carol = s.register("carol");
    alice.invite(&room, &carol.user_id);
    carol.join(&alias);
    alice.wait_joined(&room, &carol.user_id, true, WAIT);

    let text = alice.send_text(&room, "hello bob");
    let notice = bob.send_notice(&room, "a notice");
    let image: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 251) as u8).collect();
    let (picture, mxc) = bob.send_image(&room, &image, "pixel 1.png", "image/png");
    assert!(mxc.starts_with("mxc://localhost/"), "{mxc}");

    let seen = alice.wait_message(&room, |m| m["event_id"] == picture.as_str(), WAIT);
    assert_eq!(seen["content"]["url"], mxc.as_str(), "{seen}");
    assert_eq!(seen["sender"], bob.user_id.as_str(), "{seen}");
    let history = carol.messages(&room, 10);
    let ids: Vec<&str> = history.iter().map(|m| m["event_id"].as_str().unwrap_or("?")).collect();
    assert_eq!(ids, [text.as_str(), notice.as_str(), picture.as_str()], "oldest first");
    assert_eq!(alice.download(&mxc), image, "the image downloads whole");

    bob.set_displayname("Bob B.");
    let profile = alice.ok(
        "GET",
        &format!("/_matrix/client/v3/profile/{}", enc(&bob.user_id)),
        None,
    );
    assert_eq!(profile["displayname"], "Bob B.", "{profile}");

    bob.set_typing(&room, true);
    assert!(alice.typing_seen(&room, &bob.user_id, WAIT), "alice sees bob typing");

    let secret = alice.create_encrypted_room(&[&bob.user_id]);
    let encryption = alice
        .state(&secret, "m.room.encryption", "")
        .expect("the room is encrypted");
    assert_eq!(encryption["algorithm"], "m.megolm.v1.aes-sha2", "{encryption}");
    assert!(alice.state(&room, "m.room.encryption", "").is_none());

    let dm = alice.create_room(&[&bob.user_id], true);
    let invite = alice.state(&dm, "m.room.member", &bob.user_id).expect("bob is invited");
    assert_eq!(invite["membership"], "invite", "{invite}");
    assert_eq!(invite["is_direct"], true, "{invite}");

    carol.leave(&room);
    alice.wait_joined(&room, &carol.user_id, false, WAIT);

    bob.logout();
    let (status, v) = bob.call("GET", "/_matrix/client/v3/account/whoami", None);
    assert_eq!((status, v["errcode"].as_str()), (401, Some("M_UNKNOWN_TOKEN")), "{v}");
    let bob2 = s.login("bob");
    assert_ne!(bob2.access_token, bob.access_token);
    let whoami = bob2.ok("GET", "/_matrix/client/v3/account/whoami", None);
    assert_eq!(whoami["user_id"], bob.user_id.as_str(), "{whoami}");

    // The default limits: a burst of 10 messages, then 429 M_LIMIT_EXCEEDED.
    let path = |n: usize| format!("/_matrix/client/v3/rooms/{}/send/m.room.message/burst-{n}", enc(&room));
    let limited = (0..30).find_map(|n| {
        let (status, v) = alice.call("PUT", &path(n), Some(&json!({"msgtype": "m.text", "body": "b"})));
        (status != 200).then_some((n, status, v))
    });
    let (n, status, v) = limited.expect("the default rate limit stops a burst of 30 messages");
    assert_eq!((status, v["errcode"].as_str()), (429, Some("M_LIMIT_EXCEEDED")), "{v}");
    eprintln!("the default rc_message limited alice after {n} sends");
    // `ok` (and so `send_text`) waits the limit out.
    let waited = Instant::now();
    alice.send_text(&room, "after the limit");
    eprintln!("a send under the limit went through after {:?}", waited.elapsed());
    drop(s);

    let r = Synapse::start_relaxed();
    eprintln!("relaxed Synapse answered after {:?}", r.startup);
    let dave = r.register("dave");
    let room = dave.create_room(&[], false);
    for n in 0..40 {
        let (status, v) = dave.call(
            "PUT",
            &format!("/_matrix/client/v3/rooms/{}/send/m.room.message/fast-{n}", enc(&room)),
            Some(&json!({"msgtype": "m.text", "body": format!("fast {n}")})),
        );
        assert_eq!(status, 200, "relaxed limits let message {n} through: {v}");
    }
    assert_eq!(dave.messages(&room, 100).len(), 40);
}
