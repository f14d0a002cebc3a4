//! Test harness: a real `imgate` child process, an xAgent simulator written from xAgent's public
//! Connector Protocol 3.0 documents, a `reply_url` receiver, and JSON Schema validation of
//! everything imgate emits against the reference schemas kept in `tests/fixtures/xagent/`.
#![allow(dead_code)]

pub mod botapi;
pub mod dingtalk;
pub mod discord;
pub mod ext4;
pub mod feishu;
pub mod ilink;
pub mod kit;
pub mod matrix;
#[path = "../../src/scratch.rs"]
mod scratch;
pub mod slack;
pub mod synapse;
pub mod wecom;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tungstenite::{Message, WebSocket};

pub const SUBPROTOCOL: &str = "xagent.connector.packet.v1";

// ---------- schemas ----------

fn schema_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/xagent/schemas")
}

fn validator(name: &str) -> &'static jsonschema::Validator {
    static CACHE: OnceLock<Mutex<Vec<(String, &'static jsonschema::Validator)>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(Vec::new()));
    let mut g = cache.lock().unwrap();
    if let Some((_, v)) = g.iter().find(|(n, _)| n == name) {
        return v;
    }
    let path = schema_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "reference schema {} must exist (tests/fixtures/xagent/schemas): {e}",
            path.display()
        )
    });
    let schema: Value = serde_json::from_str(&text).unwrap();
    let v: &'static jsonschema::Validator = Box::leak(Box::new(jsonschema::validator_for(&schema).unwrap()));
    g.push((name.to_string(), v));
    v
}

pub fn assert_valid(schema: &str, instance: &Value) {
    let v = validator(schema);
    let errors: Vec<String> = v
        .iter_errors(instance)
        .map(|e| format!("{e} at {}", e.instance_path()))
        .collect();
    assert!(errors.is_empty(), "{schema} rejects {instance}:\n{}", errors.join("\n"));
}

pub fn assert_card(card: &Value) {
    assert_valid("xagent.connector.v1.schema.json", card);
}

pub fn assert_descriptor(d: &Value) {
    assert_valid("xagent.connection.v2.schema.json", d);
}

/// Every packet is checked against the envelope schema; every Descriptor inside one too.
pub fn assert_packet(p: &Value) {
    assert_valid("xagent.connector.packet.v1.schema.json", p);
    if let Some(d) = p.pointer("/payload/connection_descriptor") {
        assert_descriptor(d);
    }
}

/// Fails naming the first line of `text` that contains any of `secrets`.
pub fn assert_no_secret(text: &str, secrets: &[&str], what: &str) {
    if let Some(line) = text.lines().find(|l| secrets.iter().any(|s| l.contains(s))) {
        panic!("a secret reached {what}: {line}");
    }
}

// ---------- the daemon ----------

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub fn temp_dir(tag: &str) -> PathBuf {
    scratch::scratch_dir(tag)
}

/// The binary under test: `IMGATE_BIN` (a cross-built one, for budgets) or cargo's own build.
pub fn bin() -> &'static str {
    static BIN: OnceLock<String> = OnceLock::new();
    BIN.get_or_init(|| std::env::var("IMGATE_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_imgate").to_string()))
}

/// A running `imgate run` child with its stderr collected.
pub struct Daemon {
    pub child: Child,
    pub port: u16,
    pub dir: PathBuf,
    pub config: PathBuf,
    pub log: Arc<Mutex<String>>,
    pub rust_log: String,
    pub env: Vec<(String, String)>,
    /// A command the daemon runs under (`prlimit --nofile=…`), empty for none.
    pub wrapper: Vec<String>,
    /// The binary: `bin()`, or another build (a benchmark's baseline).
    pub program: String,
}

pub const API_KEY: &str = "test-api-key-7f3a";
pub const HOOK_SECRET: &str = "hook-secret-91bc";

/// `/metrics` once it has a line starting with `line` (a connection is counted up a moment
/// after the far side saw it open); panics with the last text after `timeout`.
pub fn metrics_once(d: &Daemon, line: &str, timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let (_, text) = http_get(&d.url("/metrics"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
        if text.lines().any(|l| l.starts_with(line)) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "no `{line}` in /metrics within {timeout:?}:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A config with an API key, one webhook endpoint `alerts` (with `reply_url` when given) and `extra`.
/// Every client of a test is 127.0.0.1, one address: the cap per client is off here and tested
/// on its own (`edge::peer_4_…`).
pub fn config_text(port: u16, dir: &Path, reply_url: Option<&str>, extra: &str) -> String {
    let reply = reply_url.map(|u| format!("reply_url = {u}\n")).unwrap_or_default();
    format!(
        "[server]\nlisten = 127.0.0.1:{port}\napi_key = {API_KEY}\nstate_dir = {}\nlog_level = debug\nmax_connections_per_client = 0\n\n\
         [webhook.alerts]\nsecret = {HOOK_SECRET}\nlabel = Alerts\n{reply}\n{extra}",
        dir.join("state").display()
    )
}

impl Daemon {
    pub fn start(dir: &Path, config: &str) -> Daemon {
        Self::start_logging(dir, config, "trace")
    }

    /// Like `start` with another `RUST_LOG` (benchmarks measure imgate, not its trace log).
    pub fn start_logging(dir: &Path, config: &str, rust_log: &str) -> Daemon {
        Self::start_env(dir, config, rust_log, &[])
    }

    /// Like `start_logging` with extra environment variables (systemd's, for example).
    pub fn start_env(dir: &Path, config: &str, rust_log: &str, env: &[(&str, &str)]) -> Daemon {
        let (path, port) = Self::write_config(dir, config);
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Self::spawn(dir, path, port, rust_log, env, Vec::new(), bin())
    }

    /// Like `start_env` with another build of imgate (a benchmark's baseline).
    pub fn start_program(program: &str, dir: &Path, config: &str, rust_log: &str, env: &[(&str, &str)]) -> Daemon {
        let (path, port) = Self::write_config(dir, config);
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Self::spawn(dir, path, port, rust_log, env, Vec::new(), program)
    }

    /// Like `start`, run under `wrapper` (a command that ends by running its arguments).
    pub fn start_wrapped(dir: &Path, config: &str, wrapper: &[&str]) -> Daemon {
        let (path, port) = Self::write_config(dir, config);
        let wrapper = wrapper.iter().map(|w| w.to_string()).collect();
        Self::spawn(dir, path, port, "debug", Vec::new(), wrapper, bin())
    }

    /// Writes `config` to `dir/imgate.conf`; its path and the port it listens on.
    fn write_config(dir: &Path, config: &str) -> (PathBuf, u16) {
        let path = dir.join("imgate.conf");
        std::fs::write(&path, config).unwrap();
        let port = config
            .lines()
            .find_map(|l| l.trim().strip_prefix("listen = 127.0.0.1:"))
            .and_then(|p| p.trim().parse().ok())
            .expect("test configs listen on 127.0.0.1:PORT");
        (path, port)
    }

    /// Starts again on the same config and state (after `kill`).
    pub fn restart(self) -> Daemon {
        let (dir, config, port, log) = (self.dir.clone(), self.config.clone(), self.port, self.log.clone());
        let (rust_log, env, wrapper) = (self.rust_log.clone(), self.env.clone(), self.wrapper.clone());
        let program = self.program.clone();
        drop(self);
        let d = Self::spawn(&dir, config, port, &rust_log, env, wrapper, &program);
        let old = log.lock().unwrap().clone();
        d.log.lock().unwrap().insert_str(0, &old);
        d
    }

    /// Like `restart`, with `env` instead of the environment it was started with.
    pub fn restart_env(mut self, env: &[(&str, &str)]) -> Daemon {
        self.env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        self.restart()
    }

    fn spawn(
        dir: &Path,
        config: PathBuf,
        port: u16,
        rust_log: &str,
        env: Vec<(String, String)>,
        wrapper: Vec<String>,
        program: &str,
    ) -> Daemon {
        let mut command = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(program);
                c
            }
            None => Command::new(program),
        };
        let mut child = command
            .envs(env.iter().map(|(k, v)| (k, v)))
            .args(["run", "--config"])
            .arg(&config)
            .env_remove("RUST_LOG")
            .env("RUST_LOG", rust_log)
            .env_remove("IMGATE_CONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("imgate starts");
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().unwrap();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut g = sink.lock().unwrap();
                g.push_str(&line);
                g.push('\n');
            }
        });
        let d = Daemon {
            child,
            port,
            dir: dir.to_path_buf(),
            config,
            log,
            rust_log: rust_log.to_string(),
            env,
            wrapper,
            program: program.to_string(),
        };
        d.wait_ready();
        d
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("imgate did not listen on {} in time; log:\n{}", self.port, self.log());
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Waits up to `timeout` for `needle` in the log: lines reach it through a reader thread,
    /// a moment after what they report has happened.
    pub fn log_shows(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while !self.log().contains(needle) {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// Sends a signal by name (`TERM`, `HUP`) with kill(1).
    pub fn signal(&self, name: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(ok.success(), "kill -{name} failed");
    }

    /// Waits for the process to exit by itself; `None` if it is still running after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Connects an xAgent simulator to `/ws` with the API key.
    pub fn xagent(&self) -> Sim {
        Sim::connect(self.port, Some(API_KEY))
    }

    /// The daemon's persistent `connector_id`, from `/status`.
    pub fn connector_id(&self) -> String {
        get_json(&self.url("/status"))["connector_id"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// An xAgent simulator past hello with a new channel bound to the `alerts` endpoint.
    pub fn bound_xagent(&self) -> (Sim, String) {
        let mut x = self.xagent();
        x.hello("");
        let (cch, _) = x.open(None);
        let a = x.bind_webhook(&cch, "alerts", HOOK_SECRET);
        assert_eq!(a["payload"]["status"], "authenticated", "{a}");
        (x, cch)
    }

    /// POSTs a webhook message authenticated with the endpoint's Bearer secret.
    pub fn post_hook(&self, name: &str, body: &Value) -> (u16, Value) {
        http_post(
            &self.url(&format!("/hooks/{name}")),
            &[("Authorization", &format!("Bearer {HOOK_SECRET}"))],
            &body.to_string(),
        )
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// SIGTERM: imgate exits 0 and logs that its final checkpoint ran, so nothing (a provider's long
/// poll, a connection) held the outbox past the stop; the next start replays nothing.
pub fn assert_stops_cleanly(mut d: Daemon) {
    d.signal("TERM");
    let status = d.wait_exit(Duration::from_secs(10)).expect("exits after SIGTERM");
    assert!(status.success(), "{status:?}");
    assert!(d.log_shows("stopped cleanly", Duration::from_secs(5)), "{}", d.log());
    let d = d.restart();
    let status = get_json(&d.url("/status"));
    assert_eq!(status["outbox"]["log_replayed"], 0, "{status}");
}

// ---------- plain HTTP ----------

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into()
}

/// A pushed file's bytes from its `download_url`, and the status.
pub fn download(d: &Daemon, file: &Value) -> (u16, Vec<u8>) {
    download_url(d, file["download_url"].as_str().expect("a file has a download_url"))
}

/// `GET` of a file's path below imgate's base URL: (status, the whole body, however large).
pub fn download_url(d: &Daemon, path: &str) -> (u16, Vec<u8>) {
    let mut r = load_agent().get(&d.url(path)).call().unwrap();
    let status = r.status().as_u16();
    let body = r.body_mut().with_config().limit(u64::MAX).read_to_vec().unwrap();
    (status, body)
}

/// `[files] max_file_bytes` of the tests of files of every size.
pub const MAX_FILE: usize = 6 << 20;
/// Their config section.
pub const MAX_FILE_CONF: &str = "[files]\nmax_file_bytes = 6MiB\n";

/// The sizes every media path is tested at: a photo (100 KiB), a document (5 MiB) and a file
/// of exactly `max_file_bytes`, each past tiny_http's 32 KiB switch to chunked answers.
pub fn file_sizes() -> [usize; 3] {
    [100 << 10, 5 << 20, MAX_FILE]
}

/// Waits for `done` (polled every 50 ms), failing after 20 s with what never happened.
pub fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

// ---------- waits on many events: progress, not a clock ----------

/// How long a wait on many events (pushes, answers, polls, a backlog draining) goes on with no
/// new one before it gives up. Such a wait has no total deadline: a busy machine delivers late,
/// not never, so it is slower there, not red; only a quiet this long means nothing is coming.
pub const QUIET: Duration = Duration::from_secs(60);

/// The clock of a wait on many events: it starts again whenever the figure it is shown (a
/// count of pushes, the messages still pending...) changes, and runs out after `quiet` without
/// a change. The figure must move only with real progress and be bounded (a count of distinct
/// messages, what is left to drain), or the wait could go on for ever.
pub struct Progress<P> {
    quiet: Duration,
    last: Option<P>,
    since: Instant,
}

impl<P: PartialEq> Progress<P> {
    pub fn new(quiet: Duration) -> Progress<P> {
        Progress {
            quiet,
            last: None,
            since: Instant::now(),
        }
    }

    /// Notes the figure `now`; false once it has not changed for `quiet` (the wait gives up).
    pub fn moving(&mut self, now: P) -> bool {
        if self.last.as_ref() != Some(&now) {
            self.last = Some(now);
            self.since = Instant::now();
        }
        self.since.elapsed() < self.quiet
    }
}

/// For each of `file_sizes()`, `send(i, bytes)` has a provider's user send a file of that size
/// (`i` picks the kind: 0 a photo); the message is pushed and its file downloads whole.
pub fn every_size_downloads_whole(d: &Daemon, x: &mut Sim, mut send: impl FnMut(usize, &[u8])) {
    for (i, n) in file_sizes().into_iter().enumerate() {
        let bytes = patterned(n, i as u8);
        send(i, &bytes);
        let push = x
            .next_push(Duration::from_secs(30))
            .expect("the file's message is pushed");
        let file = &push["payload"]["files"][0];
        assert_eq!(file["byte_size"], n, "{push}");
        let (status, got) = download(d, file);
        assert_eq!(status, 200, "a {n}-byte file");
        assert_same_bytes(&got, &bytes, &format!("a {n}-byte file"));
    }
}

/// `n` bytes that differ from those of any other `seed` and repeat only every 251 bytes, so a
/// dropped, repeated or reordered block shows.
pub fn patterned(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| ((i % 251) as u8).wrapping_add(seed.wrapping_mul(31)))
        .collect()
}

/// Asserts that `got` is `want`, naming the first differing offset rather than dumping MiBs.
pub fn assert_same_bytes(got: &[u8], want: &[u8], what: &str) {
    let first = got.iter().zip(want).position(|(a, b)| a != b);
    assert!(
        got.len() == want.len() && first.is_none(),
        "{what}: {} bytes where {} were sent, first difference at {first:?}",
        got.len(),
        want.len()
    );
}

pub fn http_get(url: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let mut req = agent().get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let mut resp = req.call().expect("GET reaches imgate");
    let status = resp.status().as_u16();
    (status, resp.body_mut().read_to_string().unwrap_or_default())
}

pub fn http_post(url: &str, headers: &[(&str, &str)], body: &str) -> (u16, Value) {
    let mut req = agent().post(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let mut resp = req
        .header("Content-Type", "application/json")
        .send(body)
        .expect("POST reaches imgate");
    let status = resp.status().as_u16();
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

pub fn get_json(url: &str) -> Value {
    let (status, body) = http_get(url, &[("Authorization", &format!("Bearer {API_KEY}"))]);
    assert_eq!(status, 200, "{url}: {body}");
    serde_json::from_str(&body).unwrap()
}

/// The `/status` `unbound_recent` entries of `provider` for `conversations`, once each is
/// listed or `timeout` passed (then `None` where one is missing); the last `/status` too.
pub fn unbound_listed(
    d: &Daemon,
    provider: &str,
    conversations: &[&str],
    timeout: Duration,
) -> (Vec<Option<Value>>, Value) {
    let find = |status: &Value, id: &str| {
        status["unbound_recent"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|u| u["provider"] == provider && u["conversation_id"] == id)
            .cloned()
    };
    let deadline = Instant::now() + timeout;
    loop {
        let status = get_json(&d.url("/status"));
        let found: Vec<Option<Value>> = conversations.iter().map(|c| find(&status, c)).collect();
        if found.iter().all(Option::is_some) || Instant::now() > deadline {
            return (found, status);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

// ---------- load and /proc figures (benchmarks, budgets) ----------

pub fn proc_field(pid: u32, file: &str, key: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/{file}")).unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Times all threads of `pid` went to sleep and were woken, so far (voluntary context switches).
pub fn wakeups(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| {
            tasks
                .flatten()
                .map(|t| {
                    let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
                    status
                        .lines()
                        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                        .and_then(|v| v.trim().parse::<u64>().ok())
                        .unwrap_or(0)
                })
                .sum()
        })
        .unwrap_or(0)
}

/// Open file descriptors of `pid`.
pub fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

pub fn hwm_kib(pid: u32) -> u64 {
    proc_field(pid, "status", "VmHWM:")
}

pub fn written(pid: u32) -> u64 {
    proc_field(pid, "io", "write_bytes:")
}

pub fn load_agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into()
}

/// `senders` threads each POST `per_sender` messages; returns accepted per second.
pub fn post_load(d: &Daemon, senders: usize, per_sender: usize, text: &str, tag: &str) -> f64 {
    let url = d.url("/hooks/alerts");
    let start = Instant::now();
    let threads: Vec<_> = (0..senders)
        .map(|s| {
            let (url, text, tag) = (url.clone(), text.to_string(), tag.to_string());
            std::thread::spawn(move || {
                let agent = load_agent();
                for i in 0..per_sender {
                    let body = json!({"message_id": format!("{tag}-{s}-{i}"), "sender_id": "bench", "text": text});
                    let r = agent
                        .post(&url)
                        .header("Authorization", &format!("Bearer {HOOK_SECRET}"))
                        .send(body.to_string())
                        .expect("POST");
                    assert_eq!(r.status().as_u16(), 202);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    (senders * per_sender) as f64 / start.elapsed().as_secs_f64()
}

/// `tests/fixtures/sync_shim.c` built with the system's cc (once a process): preloaded into a
/// dynamically linked imgate (`LD_PRELOAD`), its environment makes fsync and fdatasync skip,
/// wait, or wait while a flag file exists (see the file).
pub fn sync_shim() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let lib = temp_dir("sync-shim").join("sync_shim.so");
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sync_shim.c");
        let built = Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&lib)
            .arg(&source)
            .arg("-ldl")
            .status()
            .expect("cc runs (it links every Rust test binary here)");
        assert!(built.success(), "cc builds {}", source.display());
        lib
    })
}

/// The environment that holds imgate's syncs of a file whose path ends in `suffix` while
/// `flag` exists (the first wait creates `flag` + ".held").
pub fn sync_hold_env(suffix: &str, flag: &Path) -> Vec<(String, String)> {
    [
        ("LD_PRELOAD", sync_shim().display().to_string()),
        ("IMGATE_FSYNC_HOLD_SUFFIX", suffix.to_string()),
        ("IMGATE_FSYNC_HOLD_FLAG", flag.display().to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

// ---------- the reply_url receiver ----------

/// One outbound request imgate made to a `reply_url`.
#[derive(Debug, Clone)]
pub struct Outbound {
    pub signature: Option<String>,
    pub body: String,
}

pub struct ReplyReceiver {
    pub url: String,
    pub rx: mpsc::Receiver<Outbound>,
}

impl ReplyReceiver {
    /// Answers every POST with `status` (200 → `{"message_id":"out-N"}`).
    pub fn start(status: u16) -> ReplyReceiver {
        let server = tiny_http::Server::http("127.0.0.1:0").unwrap();
        let port = server.server_addr().to_ip().unwrap().port();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut n = 0;
            for mut req in server.incoming_requests() {
                n += 1;
                let mut body = String::new();
                let _ = std::io::Read::read_to_string(req.as_reader(), &mut body);
                let signature = req
                    .headers()
                    .iter()
                    .find(|h| h.field.equiv("X-Imgate-Signature"))
                    .map(|h| h.value.to_string());
                let _ = tx.send(Outbound { signature, body });
                let answer = json!({"message_id": format!("out-{n}")}).to_string();
                let _ = req.respond(tiny_http::Response::from_string(answer).with_status_code(status));
            }
        });
        ReplyReceiver {
            url: format!("http://127.0.0.1:{port}/reply"),
            rx,
        }
    }
}

// ---------- the xAgent simulator ----------

/// xAgent's side of the data plane, as the protocol documents describe it.
pub struct Sim {
    ws: WebSocket<TcpStream>,
    n: u64,
    /// Answer imgate's `ping` with `pong` (the delivery barrier) automatically.
    pub auto_pong: bool,
    /// Unsolicited packets (pushes, descriptor pushes) seen while waiting for something else.
    pub inbox: Vec<Value>,
    /// Every packet received, for secret scans.
    pub seen: Vec<Value>,
    /// Check every packet against the schema and keep it in `seen` (the default). A
    /// benchmark's taker turns it off: its CPU is taken from the machine imgate runs on.
    pub checked: bool,
    /// The reason of the close frame imgate sent, once one arrived.
    pub close_reason: Option<String>,
}

impl Sim {
    pub fn connect(port: u16, api_key: Option<&str>) -> Sim {
        let ws = try_connect(port, api_key, Some(SUBPROTOCOL)).expect("the /ws upgrade succeeds");
        Sim::from_ws(ws)
    }

    pub fn from_ws(ws: WebSocket<TcpStream>) -> Sim {
        ws.get_ref().set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        Sim {
            ws,
            n: 0,
            auto_pong: true,
            inbox: Vec::new(),
            seen: Vec::new(),
            checked: true,
            close_reason: None,
        }
    }

    /// The socket under the WebSocket, for bytes no well-behaved peer sends.
    pub fn socket(&mut self) -> &mut TcpStream {
        self.ws.get_mut()
    }

    fn next_id(&mut self, prefix: &str) -> String {
        self.n += 1;
        format!("{prefix}_sim_{}", self.n)
    }

    /// Sends a packet; returns its `(packet_id, request_id)`.
    pub fn send(&mut self, kind: &str, cch: Option<&str>, payload: Value) -> (String, String) {
        let packet_id = self.next_id("pkt");
        let request_id = self.next_id("req");
        let mut p = json!({
            "schema": "xagent.connector.packet/v1",
            "packet_id": packet_id,
            "request_id": request_id,
            "type": kind,
            "time": 1_790_000_000_000u64,
            "payload": payload,
        });
        if let Some(c) = cch {
            p["connector_channel_id"] = json!(c);
        }
        self.send_raw(&p.to_string());
        (packet_id, request_id)
    }

    pub fn send_raw(&mut self, text: &str) {
        self.ws.send(Message::text(text.to_string())).expect("send to imgate");
    }

    /// The next packet from imgate, answering pings on the way; `None` after `timeout`.
    pub fn recv_within(&mut self, timeout: Duration) -> Option<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.ws.read() {
                Ok(Message::Text(t)) => {
                    let v: Value = serde_json::from_str(t.as_str()).expect("imgate sends JSON");
                    if self.checked {
                        assert_packet(&v);
                        self.seen.push(v.clone());
                    }
                    if v["type"] == "ping" && self.auto_pong {
                        let mut pong = json!({
                            "schema": "xagent.connector.packet/v1",
                            "packet_id": self.next_id("pkt"),
                            "type": "pong",
                            "reply_to": v["packet_id"],
                        });
                        if let Some(r) = v.get("request_id") {
                            pong["request_id"] = r.clone();
                        }
                        self.send_raw(&pong.to_string());
                        continue;
                    }
                    return Some(v);
                }
                Ok(Message::Close(frame)) => {
                    self.close_reason = Some(frame.map(|f| f.reason.to_string()).unwrap_or_default());
                    return None;
                }
                Ok(_) => {}
                Err(tungstenite::Error::Io(e))
                    if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut =>
                {
                    if Instant::now() >= deadline {
                        return None;
                    }
                }
                Err(_) => return None,
            }
        }
    }

    /// Waits for the answer to `request_id`, keeping pushes aside.
    pub fn answer_to(&mut self, request_id: &str) -> Value {
        self.answer_within(request_id, Duration::from_secs(10))
    }

    /// Like `answer_to` with another patience.
    pub fn answer_within(&mut self, request_id: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            let Some(v) = self.recv_within(Duration::from_secs(1)) else {
                continue;
            };
            if v["request_id"] == request_id {
                return v;
            }
            self.inbox.push(v);
        }
        panic!("no answer to {request_id}");
    }

    /// Sends a request and returns its answer, checking `request_id` and `reply_to`.
    pub fn request(&mut self, kind: &str, cch: Option<&str>, payload: Value) -> Value {
        let (packet_id, request_id) = self.send(kind, cch, payload);
        let a = self.answer_to(&request_id);
        assert_eq!(
            a["reply_to"],
            json!(packet_id),
            "answers point reply_to at the request: {a}"
        );
        a
    }

    pub fn hello(&mut self, connector_id: &str) -> Value {
        self.hello_to("im.imgate", connector_id)
    }

    /// `connector.hello` to the Connector whose Card says `card_id`.
    pub fn hello_to(&mut self, card_id: &str, connector_id: &str) -> Value {
        let a = self.request(
            "connector.hello",
            None,
            json!({
                "connector_card_id": card_id,
                "connector_id": connector_id,
                "protocol_version": "3.0",
                "supported_profiles": ["xagent.im.v1", "xagent.im.v2"],
            }),
        );
        assert_eq!(a["type"], "connector.hello.ack", "{a}");
        a
    }

    /// `channel.open`; returns the channel ID and the ack.
    pub fn open(&mut self, cch: Option<&str>) -> (String, Value) {
        let a = self.request("channel.open", cch, json!({}));
        assert_eq!(a["type"], "channel.open.ack", "{a}");
        let cch = a["payload"]["connector_channel_id"].as_str().unwrap().to_string();
        assert_eq!(a["connector_channel_id"], json!(cch));
        (cch, a)
    }

    pub fn bind_webhook(&mut self, cch: &str, endpoint: &str, secret: &str) -> Value {
        self.request(
            "auth.start",
            Some(cch),
            json!({"flow_id": "webhook_binding", "input": {"endpoint": endpoint, "secret": secret}}),
        )
    }

    /// The next `message.push`, from the kept-aside ones first.
    pub fn next_push(&mut self, timeout: Duration) -> Option<Value> {
        self.next_of("message.push", timeout)
    }

    /// The next packet of type `kind`, from the kept-aside ones first; others are kept aside.
    pub fn next_of(&mut self, kind: &str, timeout: Duration) -> Option<Value> {
        if let Some(i) = self.inbox.iter().position(|v| v["type"] == kind) {
            return Some(self.inbox.remove(i));
        }
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(v) = self.recv_within(Duration::from_millis(300)) {
                if v["type"] == kind {
                    return Some(v);
                }
                self.inbox.push(v);
            }
        }
        None
    }

    pub fn tool(&mut self, cch: &str, tool_id: &str, args: Value, call_id: &str) -> Value {
        self.request(
            "tool.invoke",
            Some(cch),
            json!({"tool_id": tool_id, "arguments": args, "context": {"session_id": "s1", "tool_call_id": call_id}}),
        )
    }

    /// Invokes a tool and waits up to `timeout` for its answer; returns it and how long it took.
    pub fn timed_tool(&mut self, cch: &str, tool_id: &str, args: Value, timeout: Duration) -> (Value, Duration) {
        let started = Instant::now();
        let call_id = self.next_id("call");
        let (_, request_id) = self.send(
            "tool.invoke",
            Some(cch),
            json!({"tool_id": tool_id, "arguments": args, "context": {"session_id": "s1", "tool_call_id": call_id}}),
        );
        let a = self.answer_within(&request_id, timeout);
        (a, started.elapsed())
    }

    pub fn close(mut self) {
        let _ = self.ws.close(None);
        let _ = self.ws.flush();
    }

    // ---------- IM profile v2 (written from the v2 document, sections 5 to 8) ----------

    /// The next `chat.message` from imgate (user input under v2).
    pub fn next_chat(&mut self, timeout: Duration) -> Option<Value> {
        self.next_of("chat.message", timeout)
    }

    /// Acknowledges a `chat.message` imgate sent: `reply_to` its packet, same channel and
    /// `message_id` (section 7).
    pub fn ack_chat(&mut self, msg: &Value, status: &str, code: Option<&str>, retryable: bool) {
        let mut payload = json!({"message_id": msg["payload"]["message_id"], "status": status});
        if status == "rejected" {
            payload["code"] = json!(code.unwrap_or("rejected"));
            payload["message"] = json!("refused by the simulator");
            payload["retryable"] = json!(retryable);
        }
        let ack = json!({
            "schema": "xagent.connector.packet/v1",
            "packet_id": self.next_id("pkt"),
            "reply_to": msg["packet_id"],
            "connector_channel_id": msg["connector_channel_id"],
            "type": "chat.message.ack",
            "time": 1_790_000_000_000u64,
            "payload": payload,
        });
        self.send_raw(&ack.to_string());
    }

    /// Sends an assistant message (`text`, `files` of `{type, file_ref}`) and waits for its ack.
    pub fn say(&mut self, cch: &str, message_id: &str, text: &str, files: Value) -> Value {
        let mut payload = json!({"message_id": message_id, "created_at": 1_790_000_000_000u64});
        if !text.is_empty() {
            payload["text"] = json!(text);
        }
        if files.as_array().is_some_and(|f| !f.is_empty()) {
            payload["files"] = files;
        }
        let (packet_id, request_id) = self.send("chat.message", Some(cch), payload);
        let ack = self.answer_within(&request_id, Duration::from_secs(30));
        assert_eq!(ack["type"], "chat.message.ack", "{ack}");
        assert_eq!(ack["reply_to"], json!(packet_id), "the ack answers the message: {ack}");
        assert_eq!(ack["connector_channel_id"], json!(cch));
        assert_eq!(ack["payload"]["message_id"], json!(message_id));
        ack
    }

    /// Sends one text delta of an assistant message; returns its request ID.
    pub fn delta(&mut self, cch: &str, message_id: &str, sequence: u64, text: &str) -> String {
        let payload = json!({"message_id": message_id, "sequence": sequence, "text": text});
        self.send("chat.message.delta", Some(cch), payload).1
    }

    /// Sends an activity snapshot (`thinking`, `tool` with a name, `idle`).
    pub fn activity(&mut self, cch: &str, status: &str, tool_name: Option<&str>) {
        let mut payload = json!({"status": status});
        if let Some(t) = tool_name {
            payload["tool_name"] = json!(t);
        }
        self.send("chat.activity", Some(cch), payload);
    }
}

/// A raw upgrade attempt: `Err` carries the HTTP status imgate answered.
pub fn try_connect(port: u16, api_key: Option<&str>, protocol: Option<&str>) -> Result<WebSocket<TcpStream>, u16> {
    use tungstenite::client::IntoClientRequest;
    let mut req = format!("ws://127.0.0.1:{port}/ws").into_client_request().unwrap();
    if let Some(k) = api_key {
        req.headers_mut()
            .insert("Authorization", format!("Bearer {k}").parse().unwrap());
    }
    if let Some(p) = protocol {
        req.headers_mut().insert("Sec-WebSocket-Protocol", p.parse().unwrap());
    }
    let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_nodelay(true).unwrap(); // as xAgent's own client does
    match tungstenite::client(req, stream) {
        Ok((ws, resp)) => {
            let proto = resp
                .headers()
                .get("Sec-WebSocket-Protocol")
                .map(|v| v.to_str().unwrap().to_string());
            assert_eq!(
                proto.as_deref(),
                Some(SUBPROTOCOL),
                "imgate selects the packet subprotocol"
            );
            Ok(ws)
        }
        Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(resp))) => Err(resp.status().as_u16()),
        Err(e) => panic!("unexpected handshake error: {e}"),
    }
}

/// xAgent's listening side for imgate's dial transport: accepts one connection, checking the
/// subprotocol and returning the Authorization header imgate sent.
pub fn accept_dial(listener: &TcpListener) -> (Sim, Option<String>) {
    let (stream, _) = listener.accept().unwrap();
    stream.set_nodelay(true).unwrap();
    let auth = Arc::new(Mutex::new(None));
    let seen = auth.clone();
    #[allow(clippy::result_large_err)] // tungstenite fixes the callback's error type
    let callback = move |req: &tungstenite::handshake::server::Request,
                         mut resp: tungstenite::handshake::server::Response| {
        *seen.lock().unwrap() = req
            .headers()
            .get("Authorization")
            .map(|v| v.to_str().unwrap().to_string());
        let offered = req
            .headers()
            .get("Sec-WebSocket-Protocol")
            .map(|v| v.to_str().unwrap().to_string());
        assert_eq!(
            offered.as_deref(),
            Some(SUBPROTOCOL),
            "imgate offers the packet subprotocol when dialling"
        );
        resp.headers_mut()
            .insert("Sec-WebSocket-Protocol", SUBPROTOCOL.parse().unwrap());
        Ok(resp)
    };
    let ws = tungstenite::accept_hdr(stream, callback).expect("imgate completes the dial handshake");
    let auth = auth.lock().unwrap().clone();
    (Sim::from_ws(ws), auth)
}

/// `POST /files/uploads` of one file for `channel` with Bearer `key`: (status, JSON answer).
pub fn upload(d: &Daemon, channel: &str, key: &str, filename: &str, mime: &str, bytes: &[u8]) -> (u16, Value) {
    let boundary = "XyZb0undary";
    let mut body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\nContent-Type: {mime}\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(bytes);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    let mut r = load_agent()
        .post(&d.url("/files/uploads"))
        .header("Authorization", &format!("Bearer {key}"))
        .header("X-XAgent-Connector-Channel-ID", channel)
        .header("Content-Type", &format!("multipart/form-data; boundary={boundary}"))
        .send(&body[..])
        .unwrap();
    let status = r.status().as_u16();
    let text = r.body_mut().read_to_string().unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// `upload` with the right key.
pub fn upload_as(d: &Daemon, channel: &str, filename: &str, mime: &str, bytes: &[u8]) -> (u16, Value) {
    upload(d, channel, API_KEY, filename, mime, bytes)
}

// ---------- the data plane over raw TCP, for clients that misbehave ----------

/// A WebSocket upgrade over raw TCP; returns the stream after the 101.
pub fn raw_upgrade(port: u16, authorization: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Protocol: {SUBPROTOCOL}\r\nAuthorization: {authorization}\r\n\r\n"
    )
    .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut byte).unwrap();
        head.push(byte[0]);
    }
    let head = String::from_utf8(head).unwrap();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(
        head.contains("Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo="),
        "{head}"
    );
    s
}

/// A masked client text frame of any length (RFC 6455 5.2).
pub fn text_frame(payload: &[u8]) -> Vec<u8> {
    let mask = [9u8, 8, 7, 6];
    let mut out = vec![0x81];
    match payload.len() {
        n if n < 126 => out.push(0x80 | n as u8),
        n if n <= 0xffff => {
            out.push(0x80 | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(0x80 | 127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(&mask);
    out.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    out
}

/// The payload of the next text frame the server sends (unmasked).
pub fn next_text(s: &mut TcpStream) -> String {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut h = [0u8; 2];
    s.read_exact(&mut h).unwrap();
    let len = match h[1] & 0x7f {
        126 => {
            let mut l = [0u8; 2];
            s.read_exact(&mut l).unwrap();
            u16::from_be_bytes(l) as usize
        }
        127 => {
            let mut l = [0u8; 8];
            s.read_exact(&mut l).unwrap();
            u64::from_be_bytes(l) as usize
        }
        n => n as usize,
    };
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload).unwrap();
    String::from_utf8(payload).unwrap()
}

pub fn hello_frame() -> Vec<u8> {
    text_frame(
        json!({"schema": "xagent.connector.packet/v1", "packet_id": "h", "request_id": "h", "type": "connector.hello",
               "payload": {"connector_card_id": "im.imgate", "protocol_version": "3.0", "supported_profiles": ["xagent.im.v1"]}})
        .to_string()
        .as_bytes(),
    )
}

/// Waits until the daemon has no connection but the one asking (`/metrics`): the harness's own
/// probes have let go of their slots.
pub fn wait_until_alone(d: &Daemon) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, text) = http_get(&d.url("/metrics"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
        if status == 200 && text.lines().any(|l| l == "imgate_http_connections 1") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the daemon still holds other connections:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until the outbox log holds no record in memory only: deliveries, attempts and moved
/// cursors wait there (at most 5 s) for an accept's sync, and a SIGKILL before that would make
/// them happen again. Tests that pin what survives a SIGKILL wait for this first.
pub fn wait_log_written(d: &Daemon) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (_, text) = http_get(&d.url("/metrics"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
        if text.lines().any(|l| l == "imgate_outbox_log_held_bytes 0") {
            return;
        }
        assert!(Instant::now() < deadline, "log records still held:\n{text}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Writes `bytes` on `s`, then reads until an answer's head is complete, `s` closes, or `wait`
/// passes with nothing more: what arrived by then.
pub fn send_and_read_head(s: &mut TcpStream, bytes: &[u8], wait: Duration) -> String {
    let _ = s.write_all(bytes);
    s.set_read_timeout(Some(wait)).unwrap();
    let mut got = Vec::new();
    let mut chunk = [0u8; 1024];
    while let Ok(n) = s.read(&mut chunk) {
        if n == 0 {
            break;
        }
        got.extend_from_slice(&chunk[..n]);
        if got.windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}
