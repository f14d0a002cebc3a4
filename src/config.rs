//! The one config file: an INI dialect with durations, sizes and `*_file` secrets.
//!
//! Every problem is reported as `FILE:LINE: message` and all problems are collected, so a
//! user fixes a broken file in one pass. No file at all means the embedded defaults, which are
//! exactly what `imgate init` writes (the template is parsed to get them).
//!
//! The core sections (`server`, `xagent`, `queue`, `files`) are read here; every other section
//! belongs to a provider, which reads it with the same `Fields` through its `Reader` (the
//! registry in `providers` lists them) and keeps its own typed `Settings`.

use std::any::Any;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::protocol::{CardId, Profile, PROFILE_V1, PROFILE_V2};

/// The commented default config; `imgate init` writes it and `systemd/imgate.conf` is a copy.
pub const TEMPLATE: &str = include_str!("../systemd/imgate.conf");

/// Where the effective config came from, for logs and `imgate check`.
pub const EMBEDDED: &str = "<embedded defaults>";

#[derive(Clone)]
pub struct Config {
    pub source: String,
    pub server: Server,
    pub xagent: Xagent,
    pub queue: Queue,
    pub files: Files,
    /// Each provider's settings by provider name; `None`: the provider is not enabled.
    providers: Vec<(&'static str, Option<Arc<dyn Settings>>)>,
    /// Providers this build left out (their Cargo feature off), for `check`.
    left_out: Vec<&'static str>,
}

#[derive(Clone)]
pub struct Server {
    pub listen: SocketAddr,
    pub api_key: Option<Secret>,
    pub state_dir: PathBuf,
    /// Where `state_dir` came from, as `check` and the start log say it.
    pub state_dir_from: String,
    pub public_url: Option<String>,
    pub max_connections: usize,
    /// Connections one client address may hold: `None` a quarter of `max_connections`,
    /// `Some(0)` no cap (a reverse proxy in front).
    pub max_connections_per_client: Option<usize>,
    pub max_body: u64,
    pub log_level: String,
    /// `connector_card_id`: one per device in a fleet.
    pub card_id: CardId,
    /// No `api_key` on a port other machines reach, on purpose (`allow_unauthenticated`).
    pub allow_unauthenticated: bool,
    /// TLS on the listener: the PEM certificate chain and key (`tls_cert_file`, `tls_key_file`).
    pub tls: Option<TlsFiles>,
}

#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// How a port is reachable from other machines.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Exposure {
    /// `listen` is not a loopback address.
    Listen,
    /// `public_url` names a host other than a loopback one (a reverse proxy or tunnel).
    PublicUrl,
}

/// Whether a URL's host is this machine alone (`localhost`, `127.0.0.0/8`, `[::1]`).
fn loopback_url(url: &str) -> bool {
    let authority = url.split("://").nth(1).unwrap_or("").split('/').next().unwrap_or("");
    let host = authority.rsplit('@').next().unwrap_or("");
    let host = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.split(':').next().unwrap_or(""),
    };
    host.eq_ignore_ascii_case("localhost") || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

impl Server {
    /// How other machines can reach the port, if they can.
    pub fn exposure(&self) -> Option<Exposure> {
        if !self.listen.ip().is_loopback() {
            Some(Exposure::Listen)
        } else if self.public_url.as_deref().is_some_and(|u| !loopback_url(u)) {
            Some(Exposure::PublicUrl)
        } else {
            None
        }
    }

    /// The connections one client address may hold when `max` are served: a quarter of them
    /// unless configured; `None` when the cap is off (`max_connections_per_client = 0`).
    pub fn per_client_cap(&self, max: usize) -> Option<usize> {
        match self.max_connections_per_client {
            None => Some((max / 4).max(1)),
            Some(0) => None,
            Some(n) => Some(n),
        }
    }
}

#[derive(Clone)]
pub struct Xagent {
    pub dial: Option<String>,
    pub dial_api_key: Option<Secret>,
    pub ca_file: Option<PathBuf>,
    pub lease: Duration,
    /// The IM profile of this deployment; the Card declares exactly it.
    pub profile: Profile,
}

#[derive(Clone)]
pub struct Queue {
    pub ttl: Duration,
    pub max_messages_per_channel: u64,
    pub max_bytes_per_channel: u64,
    pub max_bytes_total: u64,
    pub overflow: Overflow,
    /// Already clamped to at most `ttl / 2`.
    pub cleanup_interval: Duration,
    /// The size of each of the outbox's two log files; `None` (`auto`): fitted to the state
    /// file system at start (`fit.rs`).
    pub log_file_size: Option<u64>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Overflow {
    DropOldest,
    RejectNew,
}

impl Overflow {
    pub fn as_str(self) -> &'static str {
        match self {
            Overflow::DropOldest => "drop_oldest",
            Overflow::RejectNew => "reject_new",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Files {
    pub ttl: Duration,
    pub max_file_bytes: u64,
    pub max_bytes_total: u64,
}

/// A provider's typed settings, as its `Reader` made them.
pub trait Settings: Any + Send + Sync {
    /// Lines for `imgate check`; secrets only as set or not set.
    fn summary(&self) -> String;
    fn as_any(&self) -> &dyn Any;
}

/// How a provider reads its part of the file.
#[derive(Clone, Copy)]
pub struct Reader {
    /// The provider's name; its settings are found under it.
    pub provider: &'static str,
    /// The section it owns (`telegram`), or with a trailing dot a family of them (`webhook.`
    /// for `[webhook.NAME]`).
    pub section: &'static str,
    /// Keys that hold secrets: each also accepts `KEY_file`.
    pub secrets: &'static [&'static str],
    /// Reads its sections (none when the file has none) with the core already read; `None`
    /// leaves the provider disabled.
    pub read: ReadFn,
    /// A provider this build left out (its Cargo feature off): `check` says so, not "off".
    pub left_out: bool,
}

/// A provider's reader of its sections.
pub type ReadFn = fn(&Config, &[&Section], &mut Problems) -> Option<Arc<dyn Settings>>;

impl Reader {
    fn owns(&self, section: &str) -> bool {
        match self.section.strip_suffix('.') {
            Some(family) => section.strip_prefix(family).is_some_and(|r| r.starts_with('.')),
            None => section == self.section,
        }
    }

    /// The section as help text names it: `webhook.NAME`, `telegram`.
    fn shown(&self) -> String {
        if self.section.ends_with('.') {
            format!("{}NAME", self.section)
        } else {
            self.section.to_string()
        }
    }
}

/// A secret value. `Debug` and `Display` never show it, so it cannot slip into a log line.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Secret {
        Secret(s.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// All problems found in one file, each already formatted as `FILE:LINE: message`.
#[derive(Debug)]
pub struct ConfigError(pub Vec<String>);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join("\n"))
    }
}

/// Finds the config by the contract's lookup order; `None` means the embedded defaults.
pub fn locate(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_path_buf());
    }
    if let Some(p) = std::env::var_os("IMGATE_CONFIG").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let etc = Path::new("/etc/imgate/imgate.conf");
    etc.exists().then(|| etc.to_path_buf())
}

/// Loads the file at `path`, or the embedded defaults when `path` is `None`.
pub fn load(path: Option<&Path>, readers: &[Reader]) -> Result<Config, ConfigError> {
    match path {
        None => parse(TEMPLATE, EMBEDDED, None, readers),
        Some(p) => {
            let name = p.display().to_string();
            let text = std::fs::read_to_string(p).map_err(|e| {
                ConfigError(vec![format!(
                    "{name}:0: cannot read config file: {e}{}",
                    denied_hint(&e)
                )])
            })?;
            parse(&text, &name, p.parent(), readers)
        }
    }
}

/// What to do about a file the user may not read: the packages make the config and the key
/// readable by the `imgate` group, so `imgate status` and `check` work for its members.
fn denied_hint(e: &std::io::Error) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::PermissionDenied => {
            " (members of the `imgate` group may read it: `sudo usermod -aG imgate $USER`, then log in again; or use sudo)"
        }
        _ => "",
    }
}

/// One `[section]` of the file with its `key = value` lines, in order.
pub struct Section {
    pub name: String,
    pub line: usize,
    entries: Vec<Entry>,
}

struct Entry {
    key: String,
    value: String,
    line: usize,
}

/// Where problems are collected; also resolves `*_file` paths.
pub struct Problems<'a> {
    file: &'a str,
    dir: Option<&'a Path>,
    errors: Vec<String>,
}

impl Problems<'_> {
    pub fn err(&mut self, line: usize, msg: impl fmt::Display) {
        self.errors.push(format!("{}:{line}: {msg}", self.file));
    }

    fn resolve(&self, value: &str) -> PathBuf {
        let p = Path::new(value);
        match self.dir {
            Some(d) if p.is_relative() => d.join(p),
            _ => p.to_path_buf(),
        }
    }
}

/// Splits the text into sections; reports lines that are neither and repeated sections or keys.
fn sections(text: &str, p: &mut Problems) -> Vec<Section> {
    let mut out: Vec<Section> = Vec::new();
    for (idx, raw) in text.lines().enumerate() {
        let line_no = idx + 1;
        let line = strip_comment(raw).trim();
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix('[') {
            let Some(inner) = rest.strip_suffix(']') else {
                p.err(line_no, format!("section header `{line}` lacks a closing `]`"));
                continue;
            };
            let name = inner.trim().to_string();
            if out.iter().any(|s| s.name == name) {
                p.err(line_no, format!("section [{name}] appears twice"));
            }
            out.push(Section {
                name,
                line: line_no,
                entries: Vec::new(),
            });
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            p.err(line_no, format!("expected `key = value`, found `{line}`"));
            continue;
        };
        let key = key.trim();
        let Some(section) = out.last_mut() else {
            p.err(line_no, format!("key `{key}` appears before any [section]"));
            continue;
        };
        if section.entries.iter().any(|e| e.key == key) {
            p.err(line_no, format!("key `{key}` is set twice in [{}]", section.name));
            continue;
        }
        section.entries.push(Entry {
            key: key.to_string(),
            value: unquote(value.trim()).to_string(),
            line: line_no,
        });
    }
    out
}

/// Reads the keys of one section; `finish` reports the ones nobody took.
pub struct Fields<'s, 'p> {
    section: &'s Section,
    problems: &'s mut Problems<'p>,
    secrets: &'s [&'s str],
    used: Vec<bool>,
    /// Every key the section's reader asked for: what a misspelt key may have meant.
    asked: Vec<String>,
}

impl<'s, 'p> Fields<'s, 'p> {
    pub fn new(section: &'s Section, problems: &'s mut Problems<'p>, secrets: &'s [&'s str]) -> Fields<'s, 'p> {
        let used = vec![false; section.entries.len()];
        Fields {
            section,
            problems,
            secrets,
            used,
            asked: Vec::new(),
        }
    }

    fn take(&mut self, key: &str) -> Option<(String, usize)> {
        if !self.asked.iter().any(|k| k == key) {
            self.asked.push(key.to_string());
        }
        let i = self.section.entries.iter().position(|e| e.key == key)?;
        self.used[i] = true;
        let e = &self.section.entries[i];
        Some((e.value.clone(), e.line))
    }

    /// Reports a problem at `line`.
    pub fn err_at(&mut self, line: usize, msg: impl fmt::Display) {
        self.problems.err(line, msg);
    }

    /// Reports a problem of the section as a whole, at its header.
    pub fn err(&mut self, msg: impl fmt::Display) {
        self.problems.err(self.section.line, msg);
    }

    /// A file's path, relative to the config file's directory unless absolute; empty is unset.
    pub fn path(&mut self, key: &str) -> Option<(PathBuf, usize)> {
        let (value, line) = self.take(key)?;
        (!value.is_empty()).then(|| (self.problems.resolve(&value), line))
    }

    /// The line `key` is on, without taking it.
    pub fn line_of(&self, key: &str) -> Option<usize> {
        self.section.entries.iter().find(|e| e.key == key).map(|e| e.line)
    }

    /// The value as written, empty included.
    pub fn raw(&mut self, key: &str) -> Option<(String, usize)> {
        self.take(key)
    }

    /// A non-empty value; an empty one means unset.
    pub fn text(&mut self, key: &str) -> Option<String> {
        self.take(key).map(|(v, _)| v).filter(|v| !v.is_empty())
    }

    /// A secret, from `key = value` or from the file named by `key_file = PATH` (a bare name
    /// is looked up in `$CREDENTIALS_DIRECTORY`, a relative path next to the config file).
    pub fn secret(&mut self, key: &str) -> Option<Secret> {
        debug_assert!(self.secrets.contains(&key), "{key} is declared secret");
        let file_key = format!("{key}_file");
        let direct = self.take(key);
        let from_file = self.take(&file_key);
        match (direct, from_file) {
            (Some(_), Some((_, line))) => {
                self.err_at(line, format!("`{key}` and `{file_key}` are both set; keep one"));
                None
            }
            (Some((v, _)), None) => Some(Secret::new(v)).filter(|s| !s.expose().is_empty()),
            (None, Some((v, line))) => self.read_secret_file(&v, &file_key, line),
            (None, None) => None,
        }
    }

    fn read_secret_file(&mut self, value: &str, key: &str, line: usize) -> Option<Secret> {
        if value.is_empty() {
            self.err_at(line, format!("{key} is empty"));
            return None;
        }
        let bare = !value.contains('/');
        let path = match std::env::var_os("CREDENTIALS_DIRECTORY") {
            Some(dir) if bare => Path::new(&dir).join(value),
            _ => self.problems.resolve(value),
        };
        match std::fs::read_to_string(&path) {
            Ok(s) => {
                let s = s.trim_end_matches(['\r', '\n']).to_string();
                if s.is_empty() {
                    self.err_at(line, format!("{key}: `{}` is empty", path.display()));
                    None
                } else {
                    Some(Secret::new(s))
                }
            }
            Err(e) => {
                let hint = denied_hint(&e);
                self.err_at(line, format!("{key}: cannot read `{}`: {e}{hint}", path.display()));
                None
            }
        }
    }

    /// An `http://` or `https://` URL with a host, without a trailing slash; empty is unset.
    pub fn url(&mut self, key: &str) -> Option<String> {
        let (value, line) = self.take(key)?;
        if value.is_empty() {
            return None;
        }
        let ok = (value.starts_with("http://") || value.starts_with("https://"))
            && value
                .split("://")
                .nth(1)
                .is_some_and(|rest| !rest.is_empty() && !rest.starts_with('/'));
        if ok {
            Some(value.trim_end_matches('/').to_string())
        } else {
            self.err_at(line, format!("{key}: `{value}` is not an http:// or https:// URL"));
            None
        }
    }

    /// One of `choices`.
    pub fn choice(&mut self, key: &str, choices: &[&'static str]) -> Option<&'static str> {
        let (value, line) = self.take(key)?;
        let found = choices.iter().find(|c| **c == value).copied();
        if found.is_none() {
            self.err_at(line, format!("{key}: `{value}` is not one of {}", choices.join(", ")));
        }
        found
    }

    /// `true` or `false`.
    pub fn bool(&mut self, key: &str) -> Option<bool> {
        self.choice(key, &["true", "false"]).map(|v| v == "true")
    }

    pub fn duration(&mut self, key: &str) -> Option<Duration> {
        let (value, line) = self.take(key)?;
        match parse_duration(&value) {
            Some(d) if !d.is_zero() => Some(d),
            _ => {
                self.err_at(line, not_a_duration(key, &value));
                None
            }
        }
    }

    pub fn size(&mut self, key: &str) -> Option<u64> {
        let (value, line) = self.take(key)?;
        match parse_size(&value) {
            Some(n) if n > 0 => Some(n),
            _ => {
                self.err_at(
                    line,
                    format!("{key}: `{value}` is not a size like 512KiB, 8MiB or 1GiB"),
                );
                None
            }
        }
    }

    pub fn count(&mut self, key: &str, min: u64, max: u64) -> Option<u64> {
        let (value, line) = self.take(key)?;
        match value.parse::<u64>() {
            Ok(n) if (min..=max).contains(&n) => Some(n),
            _ => {
                self.err_at(
                    line,
                    format!("{key}: `{value}` is not a whole number from {min} to {max}"),
                );
                None
            }
        }
    }

    /// Reports every key no getter took.
    pub fn finish(self) {
        for (e, used) in self.section.entries.iter().zip(&self.used) {
            if !used {
                let hint = closest(&e.key, &self.asked)
                    .map(|k| format!(" (did you mean `{k}`?)"))
                    .unwrap_or_default();
                self.problems.err(
                    e.line,
                    format!("unknown key `{}` in [{}]{hint}", e.key, self.section.name),
                );
            }
        }
    }
}

/// The known key nearest to a misspelt `key`: at most two edits away (one for short keys).
fn closest<'k>(key: &str, known: &'k [String]) -> Option<&'k str> {
    let limit = if key.chars().count() <= 4 { 1 } else { 2 };
    known
        .iter()
        .map(|k| (edit_distance(key, k), k))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k.as_str())
}

/// Levenshtein distance between two short strings (config keys), by characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (diagonal + usize::from(ca != *cb)).min(row[j] + 1).min(row[j + 1] + 1);
            diagonal = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// Parses config text. `dir` resolves relative `*_file` paths when no credentials directory
/// applies; `readers` are the providers' parts of the file.
pub fn parse(text: &str, name: &str, dir: Option<&Path>, readers: &[Reader]) -> Result<Config, ConfigError> {
    let mut p = Problems {
        file: name,
        dir,
        errors: Vec::new(),
    };
    let all = sections(text, &mut p);
    let mut cfg = Config::defaults(name);
    for section in &all {
        match section.name.as_str() {
            "server" => read_server(&mut cfg.server, section, &mut p),
            "xagent" => read_xagent(&mut cfg.xagent, section, &mut p),
            "queue" => read_queue(&mut cfg.queue, section, &mut p),
            "files" => read_files(&mut cfg.files, section, &mut p),
            other if readers.iter().any(|r| r.owns(other)) => {}
            other => {
                let mut known = vec!["server".to_string(), "xagent".into(), "queue".into(), "files".into()];
                known.extend(readers.iter().map(Reader::shown));
                p.err(
                    section.line,
                    format!("unknown section [{other}] (known: {})", known.join(", ")),
                );
            }
        }
    }
    if let Ok(dir) = std::env::var("STATE_DIRECTORY") {
        // systemd may pass several colon-separated directories; the first is ours.
        if let Some(first) = dir.split(':').next().filter(|d| !d.is_empty()) {
            let over = PathBuf::from(first);
            if over != cfg.server.state_dir {
                cfg.server.state_dir_from = format!(
                    "$STATE_DIRECTORY (systemd's StateDirectory=), over {} from {}",
                    cfg.server.state_dir.display(),
                    cfg.server.state_dir_from
                );
            } else {
                cfg.server.state_dir_from.push_str(" and $STATE_DIRECTORY");
            }
            cfg.server.state_dir = over;
        }
    }
    let half = cfg.queue.ttl / 2;
    if cfg.queue.cleanup_interval > half {
        cfg.queue.cleanup_interval = half;
    }
    // The providers read after the core: some of their rules depend on it (public_url).
    for r in readers {
        let mine: Vec<&Section> = all.iter().filter(|s| r.owns(&s.name)).collect();
        let settings = (r.read)(&cfg, &mine, &mut p);
        if r.left_out {
            cfg.left_out.push(r.provider);
        } else {
            cfg.providers.push((r.provider, settings));
        }
    }
    if p.errors.is_empty() {
        Ok(cfg)
    } else {
        Err(ConfigError(p.errors))
    }
}

fn read_server(s: &mut Server, section: &Section, p: &mut Problems) {
    let mut f = Fields::new(section, p, &["api_key"]);
    let mut listen_line = None;
    if let Some((value, line)) = f.raw("listen") {
        match value.parse::<SocketAddr>() {
            Ok(a) => (s.listen, listen_line) = (a, Some(line)),
            Err(_) => f.err_at(line, format!("listen: `{value}` is not an address like 127.0.0.1:8787")),
        }
    }
    s.api_key = f.secret("api_key");
    let public_url_line = f.line_of("public_url");
    if let Some((value, line)) = f.raw("state_dir") {
        if value.is_empty() {
            f.err_at(line, "state_dir must not be empty");
        } else {
            s.state_dir = PathBuf::from(value);
            s.state_dir_from = format!("the config, line {line}");
        }
    }
    s.public_url = f.url("public_url");
    if let Some(n) = f.count("max_connections", 1, 65_535) {
        s.max_connections = n as usize;
    }
    if let Some(n) = f.count("max_connections_per_client", 0, 65_535) {
        s.max_connections_per_client = Some(n as usize);
    }
    if let Some(n) = f.size("max_body") {
        s.max_body = n;
    }
    if let Some(level) = f.choice("log_level", &["off", "error", "warn", "info", "debug", "trace"]) {
        s.log_level = level.to_string();
    }
    if let Some((value, line)) = f.raw("card_id") {
        match CardId::parse(&value) {
            Ok(id) => s.card_id = id,
            Err(why) => f.err_at(line, format!("card_id: `{value}` {why}")),
        }
    }
    s.tls = match (f.path("tls_cert_file"), f.path("tls_key_file")) {
        (None, None) => None,
        (Some((cert, line)), Some((key, _))) => match crate::tls::server_config(&cert, &key) {
            Ok(_) => Some(TlsFiles { cert, key }),
            Err(e) => {
                f.err_at(line, e);
                None
            }
        },
        (Some((_, line)), None) | (None, Some((_, line))) => {
            f.err_at(line, "tls_cert_file and tls_key_file go together: set both, or neither");
            None
        }
    };
    s.allow_unauthenticated = f.bool("allow_unauthenticated").unwrap_or(false);
    if s.api_key.is_none() && !s.allow_unauthenticated {
        // Anyone who reaches the port could open `/ws` and read every message: refused
        // unless said explicitly, like an MQTT broker's anonymous listener.
        let exposed = match (s.exposure(), listen_line, public_url_line) {
            (Some(Exposure::Listen), Some(line), _) => {
                Some((line, format!("listen = {} is reachable from other machines", s.listen)))
            }
            (Some(Exposure::PublicUrl), _, Some(line)) => Some((
                line,
                "public_url makes the port reachable from other machines".to_string(),
            )),
            _ => None,
        };
        if let Some((line, what)) = exposed {
            f.err_at(
                line,
                format!(
                    "{what} but no api_key is set: anyone there could read every message. Set api_key \
                     or api_key_file (`imgate init` writes a config with a fresh key), listen on 127.0.0.1, \
                     or set allow_unauthenticated = true to accept that"
                ),
            );
        }
    }
    f.finish();
}

fn read_xagent(x: &mut Xagent, section: &Section, p: &mut Problems) {
    let mut f = Fields::new(section, p, &["dial_api_key"]);
    if let Some((value, line)) = f.raw("dial") {
        if value.is_empty() {
            x.dial = None;
        } else if value.starts_with("ws://") || value.starts_with("wss://") {
            x.dial = Some(value);
        } else {
            f.err_at(line, format!("dial: `{value}` must start with ws:// or wss://"));
        }
    }
    x.dial_api_key = f.secret("dial_api_key");
    if let Some((value, line)) = f.raw("ca_file").filter(|(v, _)| !v.is_empty()) {
        let path = f.problems.resolve(&value);
        if path.is_file() {
            x.ca_file = Some(path);
        } else {
            f.err_at(line, format!("ca_file: `{}` does not exist", path.display()));
        }
    }
    if let Some(d) = f.duration("lease") {
        x.lease = d;
    }
    if let Some(p) = f.choice("profile", &[PROFILE_V1, PROFILE_V2]).and_then(Profile::parse) {
        x.profile = p;
    }
    f.finish();
}

fn read_queue(q: &mut Queue, section: &Section, p: &mut Problems) {
    let mut f = Fields::new(section, p, &[]);
    if let Some((value, line)) = f.raw("ttl") {
        match parse_duration(&value) {
            Some(d) if d >= Duration::from_secs(1) => q.ttl = d,
            Some(_) => f.err_at(line, "ttl must be at least 1s"),
            None => f.err_at(line, not_a_duration("ttl", &value)),
        }
    }
    if let Some(n) = f.count("max_messages_per_channel", 1, 10_000_000) {
        q.max_messages_per_channel = n;
    }
    if let Some(n) = f.size("max_bytes_per_channel") {
        q.max_bytes_per_channel = n;
    }
    if let Some(n) = f.size("max_bytes_total") {
        q.max_bytes_total = n;
    }
    match f.choice("overflow", &["drop_oldest", "reject_new"]) {
        Some("drop_oldest") => q.overflow = Overflow::DropOldest,
        Some(_) => q.overflow = Overflow::RejectNew,
        None => {}
    }
    if let Some(d) = f.duration("cleanup_interval") {
        q.cleanup_interval = d;
    }
    if let Some((value, line)) = f.take("log_file_size") {
        let (min, max) = (crate::outbox::wal::MIN_LOG_BYTES, crate::outbox::wal::MAX_LOG_BYTES);
        match parse_size(&value) {
            _ if value == "auto" => q.log_file_size = None,
            Some(n) if (min..=max).contains(&n) => q.log_file_size = Some(n),
            _ => f.err_at(
                line,
                format!(
                    "log_file_size: `{value}` is not `auto` or a size from {} to {}",
                    fmt_size(min),
                    fmt_size(max)
                ),
            ),
        }
    }
    f.finish();
}

fn read_files(files: &mut Files, section: &Section, p: &mut Problems) {
    let mut f = Fields::new(section, p, &[]);
    if let Some(d) = f.duration("ttl") {
        files.ttl = d;
    }
    if let Some(n) = f.size("max_file_bytes") {
        files.max_file_bytes = n;
    }
    if let Some(n) = f.size("max_bytes_total") {
        files.max_bytes_total = n;
    }
    f.finish();
}

/// `#` starts a comment at the line start or after whitespace, so `a#b` stays a value.
fn strip_comment(line: &str) -> &str {
    let bytes = line.as_bytes();
    let mut in_quotes = false;
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'"' => in_quotes = !in_quotes,
            b'#' if !in_quotes && (i == 0 || bytes[i - 1].is_ascii_whitespace()) => return &line[..i],
            _ => {}
        }
    }
    line
}

fn unquote(v: &str) -> &str {
    if v.len() >= 2 && v.starts_with('"') && v.ends_with('"') {
        &v[1..v.len() - 1]
    } else {
        v
    }
}

/// Why `value` is not a duration: a bare number names no unit (`lease = 90` could mean seconds
/// or minutes), anything else is not one.
fn not_a_duration(key: &str, value: &str) -> String {
    let v = value.trim();
    match !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
        true => format!("{key}: `{v}` needs a unit: `{v}s` for seconds (or ms, m, h, d)"),
        false => format!("{key}: `{value}` is not a duration like 250ms, 30s, 5m or 1h"),
    }
}

/// `250ms`, `30s`, `5m`, `1h`, `2d`: a number and its unit.
pub fn parse_duration(v: &str) -> Option<Duration> {
    let v = v.trim();
    let split = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (num, unit) = v.split_at(split);
    let n: u64 = num.parse().ok()?;
    let ms = match unit.trim() {
        "ms" => n,
        "s" => n.checked_mul(1000)?,
        "m" | "min" => n.checked_mul(60_000)?,
        "h" => n.checked_mul(3_600_000)?,
        "d" => n.checked_mul(86_400_000)?,
        _ => return None,
    };
    Some(Duration::from_millis(ms))
}

/// `512KiB`, `8MiB`, `1GiB` (also KB/MB/GB as powers of ten, and plain bytes).
pub fn parse_size(v: &str) -> Option<u64> {
    let v = v.trim();
    let split = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (num, unit) = v.split_at(split);
    let n: u64 = num.parse().ok()?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        _ => return None,
    };
    n.checked_mul(mult)
}

/// Human form of a duration for `imgate check` and logs.
pub fn fmt_duration(d: Duration) -> String {
    let ms = d.as_millis() as u64;
    if ms % 3_600_000 == 0 {
        format!("{}h", ms / 3_600_000)
    } else if ms % 60_000 == 0 {
        format!("{}m", ms / 60_000)
    } else if ms % 1000 == 0 {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

/// A byte count as a person reads it, one decimal (`1.2 GiB`): status lines and warnings, where
/// `fmt_size`'s exact form would be a long number.
pub fn approx_size(b: u64) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if b >= 1 << shift {
            return format!("{:.1} {unit}", b as f64 / (1u64 << shift) as f64);
        }
    }
    format!("{b} B")
}

/// Human form of a byte size.
pub fn fmt_size(n: u64) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if n >= 1 << shift && n % (1 << shift) == 0 {
            return format!("{}{}", n >> shift, unit);
        }
    }
    format!("{n}B")
}

impl Config {
    fn defaults(source: &str) -> Config {
        Config {
            source: source.to_string(),
            server: Server {
                listen: SocketAddr::from(([127, 0, 0, 1], 8787)),
                api_key: None,
                state_dir: PathBuf::from("./imgate-data"),
                state_dir_from: "the default".into(),
                public_url: None,
                max_connections: 64,
                max_connections_per_client: None,
                max_body: 1 << 20,
                log_level: "info".into(),
                card_id: CardId::default(),
                allow_unauthenticated: false,
                tls: None,
            },
            xagent: Xagent {
                dial: None,
                dial_api_key: None,
                ca_file: None,
                lease: Duration::from_secs(3600),
                profile: Profile::V1,
            },
            queue: Queue {
                ttl: Duration::from_secs(3600),
                max_messages_per_channel: 1000,
                max_bytes_per_channel: 8 << 20,
                max_bytes_total: 64 << 20,
                overflow: Overflow::DropOldest,
                cleanup_interval: Duration::from_secs(300),
                log_file_size: None,
            },
            files: Files {
                ttl: Duration::from_secs(7200),
                max_file_bytes: 20 << 20,
                max_bytes_total: 256 << 20,
            },
            providers: Vec::new(),
            left_out: Vec::new(),
        }
    }

    /// The settings of provider `name`, when it is enabled and its settings are a `T`.
    pub fn provider<T: Settings>(&self, name: &str) -> Option<&T> {
        self.providers
            .iter()
            .find(|(n, _)| *n == name)
            .and_then(|(_, s)| s.as_deref())
            .and_then(|s| s.as_any().downcast_ref::<T>())
    }

    /// Whether provider `name` is enabled.
    pub fn has_provider(&self, name: &str) -> bool {
        self.providers.iter().any(|(n, s)| *n == name && s.is_some())
    }

    /// The effective policy as `imgate check` prints it. Secrets show only whether they are set.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        let set = |s: &Option<Secret>| if s.is_some() { "set" } else { "not set" };
        out.push_str(&format!("config:            {}\n", self.source));
        out.push_str(&format!("listen:            {}\n", self.server.listen));
        out.push_str(&format!("card_id:           {}\n", self.server.card_id));
        out.push_str(&format!("api_key:           {}\n", set(&self.server.api_key)));
        let tls = match &self.server.tls {
            Some(t) => format!("on ({})", t.cert.display()),
            None => "off".to_string(),
        };
        out.push_str(&format!("tls:               {tls}\n"));
        out.push_str(&format!(
            "state_dir:         {} (from {})\n",
            self.server.state_dir.display(),
            self.server.state_dir_from
        ));
        out.push_str(&format!("max_connections:   {}\n", self.server.max_connections));
        let per_client = match self.server.per_client_cap(self.server.max_connections) {
            None => "off".to_string(),
            Some(n) if self.server.max_connections_per_client.is_none() => {
                format!("{n} (a quarter of max_connections)")
            }
            Some(n) => n.to_string(),
        };
        out.push_str(&format!("per client:        {per_client}\n"));
        out.push_str(&format!("max_body:          {}\n", fmt_size(self.server.max_body)));
        out.push_str(&format!(
            "dial:              {}\n",
            self.xagent.dial.as_deref().unwrap_or("off")
        ));
        out.push_str(&format!("lease:             {}\n", fmt_duration(self.xagent.lease)));
        out.push_str(&format!("profile:           {}\n", self.xagent.profile.as_str()));
        let q = &self.queue;
        out.push_str(&format!("queue ttl:         {}\n", fmt_duration(q.ttl)));
        out.push_str(&format!(
            "queue caps:        {} messages or {} per channel, {} total\n",
            q.max_messages_per_channel,
            fmt_size(q.max_bytes_per_channel),
            fmt_size(q.max_bytes_total)
        ));
        out.push_str(&format!("overflow:          {}\n", q.overflow.as_str()));
        out.push_str(&format!("cleanup_interval:  {}\n", fmt_duration(q.cleanup_interval)));
        out.push_str(&format!(
            "log files:         2 x {}\n",
            q.log_file_size.map_or("auto".into(), fmt_size)
        ));
        out.push_str(&format!(
            "file cache:        {}, files up to {}\n",
            fmt_size(self.files.max_bytes_total),
            fmt_size(self.files.max_file_bytes)
        ));
        for (name, settings) in &self.providers {
            match settings {
                Some(s) => out.push_str(&s.summary()),
                None => out.push_str(&format!("{:<19}off\n", format!("{name}:"))),
            }
        }
        for name in &self.left_out {
            out.push_str(&format!("{:<19}not in this build\n", format!("{name}:")));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A provider part for these tests: `[thing]` with a secret and a URL, `[family.NAME]`.
    struct Thing(String);

    impl Settings for Thing {
        fn summary(&self) -> String {
            format!("thing:             {}\n", self.0)
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    fn read_thing(_: &Config, sections: &[&Section], p: &mut Problems) -> Option<Arc<dyn Settings>> {
        let section = sections.first()?;
        let mut f = Fields::new(section, p, &["token"]);
        let token = f.secret("token").map(|t| t.expose().to_string()).unwrap_or_default();
        f.url("base");
        f.finish();
        Some(Arc::new(Thing(token)))
    }

    fn read_family(_: &Config, sections: &[&Section], p: &mut Problems) -> Option<Arc<dyn Settings>> {
        for s in sections {
            let mut f = Fields::new(s, p, &[]);
            if f.text("key").is_none() {
                f.err(format!("[{}] needs `key`", s.name));
            }
            f.finish();
        }
        None
    }

    const READERS: [Reader; 2] = [
        Reader {
            provider: "thing",
            section: "thing",
            secrets: &["token"],
            read: read_thing,
            left_out: false,
        },
        Reader {
            provider: "family",
            section: "family.",
            secrets: &[],
            read: read_family,
            left_out: false,
        },
    ];

    #[test]
    fn only_a_loopback_host_keeps_a_public_url_on_this_machine() {
        for url in [
            "http://127.0.0.1:8787",
            "http://localhost/x",
            "https://[::1]:9/",
            "http://127.9.9.9",
        ] {
            assert!(loopback_url(url), "{url}");
        }
        for url in [
            "https://pi.example.net",
            "http://127.0.0.1.example.net",
            "http://localhost@evil.example",
            "http://[::2]:1",
            "http://192.168.1.2",
            "http://",
        ] {
            assert!(!loopback_url(url), "{url}");
        }
    }

    fn errors(text: &str) -> Vec<String> {
        match parse(text, "t.conf", None, &READERS) {
            Ok(_) => vec![],
            Err(e) => e.0,
        }
    }

    #[test]
    fn the_log_file_size_is_auto_or_a_size_within_its_bounds() {
        let size = |v: &str| {
            parse(&format!("[queue]\nlog_file_size = {v}\n"), "t.conf", None, &[]).map(|c| c.queue.log_file_size)
        };
        assert_eq!(size("auto").unwrap(), None);
        assert_eq!(size("512KiB").unwrap(), Some(512 << 10));
        assert_eq!(size("128KiB").unwrap(), Some(128 << 10));
        assert_eq!(size("64MiB").unwrap(), Some(64 << 20));
        for bad in ["64KiB", "65MiB", "big", "0"] {
            let e = errors(&format!("[queue]\nlog_file_size = {bad}\n"));
            assert!(
                e.iter()
                    .any(|l| l.starts_with("t.conf:2: log_file_size: ") && l.contains("128KiB to 64MiB")),
                "{bad}: {e:?}"
            );
        }
        assert_eq!(parse(TEMPLATE, "tpl", None, &[]).unwrap().queue.log_file_size, None);
    }

    #[test]
    fn template_parses_to_the_documented_defaults() {
        let c = parse(TEMPLATE, "tpl", None, &[]).expect("template must parse");
        assert_eq!(c.server.listen.to_string(), "127.0.0.1:8787");
        assert_eq!(c.queue.ttl, Duration::from_secs(3600));
        assert_eq!(c.queue.max_bytes_total, 64 << 20);
        assert_eq!(c.queue.overflow, Overflow::DropOldest);
        assert_eq!(c.server.card_id.as_str(), "im.imgate");
    }

    #[test]
    fn the_cap_per_client_is_a_quarter_of_the_slots_unless_set_and_0_turns_it_off() {
        let cap = |text: &str, max| parse(text, "t.conf", None, &[]).unwrap().server.per_client_cap(max);
        assert_eq!(cap("", 64), Some(16));
        assert_eq!(cap("", 3), Some(1), "at least one");
        assert_eq!(cap("[server]\nmax_connections_per_client = 0\n", 64), None);
        assert_eq!(cap("[server]\nmax_connections_per_client = 5\n", 64), Some(5));
    }

    #[test]
    fn card_id_is_read_and_a_bad_one_is_refused_with_its_line() {
        let c = parse("[server]\ncard_id = im.imgate.kitchen\n", "t.conf", None, &[]).unwrap();
        assert_eq!(c.server.card_id.skill_name(), "connector-im-imgate-kitchen");
        let e = errors("[server]\nlisten = 127.0.0.1:1\ncard_id = Im.Kitchen\n");
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(e[0].starts_with("t.conf:3: card_id: `Im.Kitchen`"), "{e:?}");
        assert_eq!(errors("[server]\ncard_id =\n").len(), 1);
    }

    #[test]
    fn durations_and_sizes_parse_with_units() {
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("5m"), Some(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_duration("5 parsecs"), None);
        assert_eq!(parse_duration("90"), None, "a bare number names no unit");
        assert_eq!(edit_distance("ttll", "ttl"), 1);
        assert_eq!(edit_distance("max_bytes_totl", "max_bytes_total"), 1);
        let known = ["ttl".to_string(), "overflow".to_string(), "max_bytes_total".to_string()];
        assert_eq!(closest("overfow", &known), Some("overflow"));
        assert_eq!(closest("tl", &known), Some("ttl"));
        assert_eq!(closest("frobnicate", &known), None);
        assert_eq!(
            not_a_duration("lease", " 90 "),
            "lease: `90` needs a unit: `90s` for seconds (or ms, m, h, d)"
        );
        assert_eq!(
            not_a_duration("ttl", "soon"),
            "ttl: `soon` is not a duration like 250ms, 30s, 5m or 1h"
        );
        assert_eq!(parse_size("512KiB"), Some(512 << 10));
        assert_eq!(parse_size("1GiB"), Some(1 << 30));
        assert_eq!(parse_size("99999999999999999999GiB"), None);
        assert_eq!(parse_size("-1"), None);
    }

    #[test]
    fn a_misspelt_key_and_a_bare_duration_say_what_was_meant() {
        let e = errors("[queue]\noverfow = reject_new\nttl = 600\n[xagent]\nlease = 90\n");
        let has = |line: &str| e.iter().any(|l| l == line);
        assert!(
            has("t.conf:2: unknown key `overfow` in [queue] (did you mean `overflow`?)"),
            "{e:?}"
        );
        assert!(
            has("t.conf:3: ttl: `600` needs a unit: `600s` for seconds (or ms, m, h, d)"),
            "{e:?}"
        );
        assert!(
            has("t.conf:5: lease: `90` needs a unit: `90s` for seconds (or ms, m, h, d)"),
            "{e:?}"
        );
    }

    #[test]
    fn each_kind_of_bad_line_names_its_line() {
        let text = "[server]\nlisten = nowhere\n\n[bogus]\n[queue]\nttl = soon\nmax_bytes_total = lots\nfrobnicate = 1\njust words\n[family.a]\n[thing]\nbase = ftp://x\n";
        let e = errors(text);
        let has = |prefix: &str| e.iter().any(|l| l.starts_with(prefix));
        assert!(has("t.conf:2: listen"), "{e:?}");
        assert!(
            has("t.conf:4: unknown section [bogus] (known: server, xagent, queue, files, thing, family.NAME)"),
            "{e:?}"
        );
        assert!(has("t.conf:6: ttl"), "{e:?}");
        assert!(has("t.conf:7: max_bytes_total"), "{e:?}");
        assert!(has("t.conf:8: unknown key `frobnicate`"), "{e:?}");
        assert!(has("t.conf:9: expected `key = value`"), "{e:?}");
        assert!(has("t.conf:10: [family.a] needs `key`"), "{e:?}");
        assert!(has("t.conf:12: base: `ftp://x` is not an http"), "{e:?}");
    }

    #[test]
    fn cleanup_interval_is_clamped_to_half_the_ttl() {
        let c = parse("[queue]\nttl = 10m\ncleanup_interval = 1h\n", "t", None, &[]).unwrap();
        assert_eq!(c.queue.cleanup_interval, Duration::from_secs(300));
    }

    #[test]
    fn secret_file_with_bare_name_reads_credentials_directory() {
        let dir = crate::scratch::scratch_dir("cred");
        std::fs::write(dir.join("token"), "s3cret\n").unwrap();
        let text = format!("[thing]\ntoken_file = {}\n", dir.join("token").display());
        let c = parse(&text, "t", None, &READERS).unwrap();
        assert_eq!(c.provider::<Thing>("thing").unwrap().0, "s3cret");
        let e = errors("[thing]\ntoken_file = /nonexistent/x\n");
        assert!(
            e.iter().any(|l| l.starts_with("t.conf:2: token_file: cannot read")),
            "{e:?}"
        );
        let e = errors("[thing]\ntoken = x\ntoken_file = /y\n");
        assert!(e.iter().any(|l| l.starts_with("t.conf:3:")), "{e:?}");
        let e = errors("[thing]\nbase_file = /y\n");
        assert!(e.iter().any(|l| l.contains("unknown key `base_file`")), "{e:?}");
    }

    #[test]
    fn secrets_never_print_and_a_disabled_provider_shows_off() {
        let c = parse("[server]\napi_key = topsecret\n", "t", None, &READERS).unwrap();
        assert!(!c.summary().contains("topsecret"));
        assert!(c.summary().contains("thing:             off"), "{}", c.summary());
        assert!(!c.has_provider("thing"));
        assert_eq!(format!("{:?}", c.server.api_key), "Some(<redacted>)");
    }

    #[test]
    fn inline_comments_need_whitespace_before_the_hash() {
        let c = parse("[thing]\ntoken = ab#cd   # comment\n", "t", None, &READERS).unwrap();
        assert_eq!(c.provider::<Thing>("thing").unwrap().0, "ab#cd");
    }

    #[test]
    fn config_parser_survives_thousands_of_mutated_files() {
        let seeds: [&[u8]; 2] = [
            TEMPLATE.as_bytes(),
            b"[family.a]\nkey = \"x # y\"\n[queue]\nttl = 5m\nmax_bytes_total = 1GiB\n[thing]\ntoken = t\n",
        ];
        for input in crate::testutil::mutations(&seeds, 1500, 3) {
            let _ = parse(&String::from_utf8_lossy(&input), "fuzz", None, &READERS);
        }
    }

    #[test]
    fn malformed_input_never_panics() {
        for text in [
            "[",
            "]",
            "=",
            "[family.]",
            "[server]\n=",
            "\u{0}\u{ff}",
            "[server]\nlisten=\u{1F600}",
        ] {
            let _ = parse(text, "t", None, &READERS);
        }
    }
}
