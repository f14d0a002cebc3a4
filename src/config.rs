//! The one config file: an INI dialect with durations, sizes and `*_file` secrets.
//!
//! Every problem is reported as `FILE:LINE: message` and all problems are collected, so a
//! user fixes a broken file in one pass. No file at all means the embedded defaults, which are
//! exactly what `imgate init` writes (the template is parsed to get them).

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

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
    pub webhooks: BTreeMap<String, Webhook>,
    pub telegram: Option<Telegram>,
}

#[derive(Clone)]
pub struct Server {
    pub listen: SocketAddr,
    pub api_key: Option<Secret>,
    pub state_dir: PathBuf,
    pub public_url: Option<String>,
    pub max_connections: usize,
    pub max_body: u64,
    pub log_level: String,
}

#[derive(Clone)]
pub struct Xagent {
    pub dial: Option<String>,
    pub dial_api_key: Option<Secret>,
    pub ca_file: Option<PathBuf>,
    pub lease: Duration,
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

#[derive(Clone)]
pub struct Files {
    pub ttl: Duration,
    pub max_file_bytes: u64,
    pub max_bytes_total: u64,
}

#[derive(Clone)]
pub struct Webhook {
    pub secret: Secret,
    pub reply_url: Option<String>,
    pub label: String,
}

#[derive(Clone)]
pub struct Telegram {
    pub bot_token: Option<Secret>,
    pub mode: String,
    pub webhook_secret: Option<Secret>,
    pub api_base: String,
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
pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
    match path {
        None => parse(TEMPLATE, EMBEDDED, None),
        Some(p) => {
            let name = p.display().to_string();
            let text = std::fs::read_to_string(p)
                .map_err(|e| ConfigError(vec![format!("{name}:0: cannot read config file: {e}")]))?;
            parse(&text, &name, p.parent())
        }
    }
}

/// Parses config text. `dir` resolves relative `*_file` paths when no credentials directory applies.
pub fn parse(text: &str, name: &str, dir: Option<&Path>) -> Result<Config, ConfigError> {
    let mut p = Parser {
        name,
        dir,
        errors: Vec::new(),
        seen: BTreeMap::new(),
    };
    let mut cfg = Config::defaults(name);
    let mut section = String::new();
    let mut section_line = 0;
    // Webhook sections are validated once complete, so a missing `secret` is reported at the header.
    let mut webhook_headers: Vec<(String, usize)> = Vec::new();
    let mut raw_webhooks: BTreeMap<String, RawWebhook> = BTreeMap::new();
    let mut telegram_line = None;

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
            section = inner.trim().to_string();
            section_line = line_no;
            if !p.seen.entry(format!("[{section}]")).or_default().is_empty() {
                p.err(line_no, format!("section [{section}] appears twice"));
            }
            p.seen.insert(format!("[{section}]"), "x".into());
            match section.as_str() {
                "server" | "xagent" | "queue" | "files" => {}
                "telegram" => telegram_line = Some(line_no),
                s => match s.strip_prefix("webhook.") {
                    Some(n) if valid_endpoint_name(n) => {
                        webhook_headers.push((n.to_string(), line_no));
                        raw_webhooks.insert(n.to_string(), RawWebhook::default());
                    }
                    Some(n) => p.err(
                        line_no,
                        format!("webhook name `{n}` must be 1-64 characters of A-Z a-z 0-9 _ -"),
                    ),
                    None => p.err(
                        line_no,
                        format!("unknown section [{s}] (known: server, xagent, queue, files, webhook.NAME, telegram)"),
                    ),
                },
            }
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            p.err(line_no, format!("expected `key = value`, found `{line}`"));
            continue;
        };
        let key = key.trim();
        let value = unquote(value.trim());
        if section.is_empty() {
            p.err(line_no, format!("key `{key}` appears before any [section]"));
            continue;
        }
        let dup_key = format!("{section}.{key}");
        if p.seen.insert(dup_key, String::new()).is_some() {
            p.err(line_no, format!("key `{key}` is set twice in [{section}]"));
            continue;
        }
        let _ = section_line;
        p.apply(
            &mut cfg,
            &section,
            key,
            value,
            line_no,
            &mut raw_webhooks,
            telegram_line,
        );
    }

    for (name_, header_line) in webhook_headers {
        let raw = raw_webhooks.remove(&name_).unwrap_or_default();
        match raw.secret {
            Some(secret) if !secret.expose().is_empty() => {
                cfg.webhooks.insert(
                    name_.clone(),
                    Webhook {
                        secret,
                        reply_url: raw.reply_url,
                        label: raw.label.unwrap_or_else(|| name_.clone()),
                    },
                );
            }
            _ => p.err(
                header_line,
                format!("[webhook.{name_}] needs `secret` (or `secret_file`): senders must authenticate"),
            ),
        }
    }
    if let (Some(line), Some(t)) = (telegram_line, &cfg.telegram) {
        if t.mode == "webhook" && t.webhook_secret.is_none() {
            p.err(line, "[telegram] mode = webhook needs `webhook_secret`".to_string());
        }
        if t.mode == "webhook" && t.bot_token.is_none() {
            p.err(
                line,
                "[telegram] mode = webhook needs the default bot's `bot_token`".to_string(),
            );
        }
        if t.mode == "webhook" && cfg.server.public_url.is_none() {
            p.err(
                line,
                "[telegram] mode = webhook needs [server] public_url (Telegram must reach /telegram/webhook)"
                    .to_string(),
            );
        }
    }
    if let Ok(dir) = std::env::var("STATE_DIRECTORY") {
        // systemd may pass several colon-separated directories; the first is ours.
        if let Some(first) = dir.split(':').next().filter(|d| !d.is_empty()) {
            cfg.server.state_dir = PathBuf::from(first);
        }
    }
    let half = cfg.queue.ttl / 2;
    if cfg.queue.cleanup_interval > half {
        cfg.queue.cleanup_interval = half;
    }
    if p.errors.is_empty() {
        Ok(cfg)
    } else {
        Err(ConfigError(p.errors))
    }
}

#[derive(Default)]
struct RawWebhook {
    secret: Option<Secret>,
    reply_url: Option<String>,
    label: Option<String>,
}

struct Parser<'a> {
    name: &'a str,
    dir: Option<&'a Path>,
    errors: Vec<String>,
    seen: BTreeMap<String, String>,
}

impl Parser<'_> {
    fn err(&mut self, line: usize, msg: String) {
        self.errors.push(format!("{}:{}: {}", self.name, line, msg));
    }

    #[allow(clippy::too_many_arguments)]
    fn apply(
        &mut self,
        cfg: &mut Config,
        section: &str,
        key: &str,
        value: &str,
        line: usize,
        webhooks: &mut BTreeMap<String, RawWebhook>,
        telegram_line: Option<usize>,
    ) {
        // `X_file` is accepted for every secret key `X`.
        let (base, from_file) = match key.strip_suffix("_file") {
            Some(b) if is_secret_key(section, b) => (b, true),
            _ => (key, false),
        };
        if from_file {
            let other = format!("{section}.{base}");
            if self.seen.contains_key(&other) {
                self.err(line, format!("`{key}` and `{base}` are both set; keep one"));
                return;
            }
            self.seen.insert(other, String::new());
        } else if is_secret_key(section, key) && self.seen.contains_key(&format!("{section}.{key}_file")) {
            self.err(line, format!("`{key}` and `{key}_file` are both set; keep one"));
            return;
        }
        let secret = |this: &mut Self| -> Option<Option<Secret>> {
            if from_file {
                this.read_secret_file(value, key, line).map(Some)
            } else if value.is_empty() {
                Some(None)
            } else {
                Some(Some(Secret::new(value)))
            }
        };
        let unknown = |this: &mut Self| this.err(line, format!("unknown key `{key}` in [{section}]"));
        match section {
            "server" => match base {
                "listen" => match value.parse::<SocketAddr>() {
                    Ok(a) => cfg.server.listen = a,
                    Err(_) => self.err(line, format!("listen: `{value}` is not an address like 127.0.0.1:8787")),
                },
                "api_key" => {
                    if let Some(s) = secret(self) {
                        cfg.server.api_key = s;
                    }
                }
                "state_dir" => {
                    if value.is_empty() {
                        self.err(line, "state_dir must not be empty".into());
                    } else {
                        cfg.server.state_dir = PathBuf::from(value);
                    }
                }
                "public_url" => {
                    if value.is_empty() {
                        cfg.server.public_url = None;
                    } else if let Some(u) = self.http_url(value, key, line) {
                        cfg.server.public_url = Some(u.trim_end_matches('/').to_string());
                    }
                }
                "max_connections" => {
                    if let Some(n) = self.count(value, key, line, 1, 65_535) {
                        cfg.server.max_connections = n as usize;
                    }
                }
                "max_body" => {
                    if let Some(n) = self.size(value, key, line) {
                        cfg.server.max_body = n;
                    }
                }
                "log_level" => match value {
                    "off" | "error" | "warn" | "info" | "debug" | "trace" => cfg.server.log_level = value.into(),
                    _ => self.err(
                        line,
                        format!("log_level: `{value}` is not one of off, error, warn, info, debug, trace"),
                    ),
                },
                _ => unknown(self),
            },
            "xagent" => match base {
                "dial" => {
                    if value.is_empty() {
                        cfg.xagent.dial = None;
                    } else if value.starts_with("ws://") || value.starts_with("wss://") {
                        cfg.xagent.dial = Some(value.to_string());
                    } else {
                        self.err(line, format!("dial: `{value}` must start with ws:// or wss://"));
                    }
                }
                "dial_api_key" => {
                    if let Some(s) = secret(self) {
                        cfg.xagent.dial_api_key = s;
                    }
                }
                "ca_file" => {
                    if value.is_empty() {
                        cfg.xagent.ca_file = None;
                    } else {
                        let path = self.resolve(value);
                        if path.is_file() {
                            cfg.xagent.ca_file = Some(path);
                        } else {
                            self.err(line, format!("ca_file: `{}` does not exist", path.display()));
                        }
                    }
                }
                "lease" => {
                    if let Some(d) = self.duration(value, key, line) {
                        cfg.xagent.lease = d;
                    }
                }
                _ => unknown(self),
            },
            "queue" => match base {
                "ttl" => {
                    if let Some(d) = self.duration(value, key, line) {
                        if d < Duration::from_secs(1) {
                            self.err(line, "ttl must be at least 1s".into());
                        } else {
                            cfg.queue.ttl = d;
                        }
                    }
                }
                "max_messages_per_channel" => {
                    if let Some(n) = self.count(value, key, line, 1, 10_000_000) {
                        cfg.queue.max_messages_per_channel = n;
                    }
                }
                "max_bytes_per_channel" => {
                    if let Some(n) = self.size(value, key, line) {
                        cfg.queue.max_bytes_per_channel = n;
                    }
                }
                "max_bytes_total" => {
                    if let Some(n) = self.size(value, key, line) {
                        cfg.queue.max_bytes_total = n;
                    }
                }
                "overflow" => match value {
                    "drop_oldest" => cfg.queue.overflow = Overflow::DropOldest,
                    "reject_new" => cfg.queue.overflow = Overflow::RejectNew,
                    _ => self.err(line, format!("overflow: `{value}` is not drop_oldest or reject_new")),
                },
                "cleanup_interval" => {
                    if let Some(d) = self.duration(value, key, line) {
                        cfg.queue.cleanup_interval = d;
                    }
                }
                _ => unknown(self),
            },
            "files" => match base {
                "ttl" => {
                    if let Some(d) = self.duration(value, key, line) {
                        cfg.files.ttl = d;
                    }
                }
                "max_file_bytes" => {
                    if let Some(n) = self.size(value, key, line) {
                        cfg.files.max_file_bytes = n;
                    }
                }
                "max_bytes_total" => {
                    if let Some(n) = self.size(value, key, line) {
                        cfg.files.max_bytes_total = n;
                    }
                }
                _ => unknown(self),
            },
            "telegram" => {
                let _ = telegram_line;
                let t = cfg.telegram.get_or_insert_with(Telegram::defaults);
                match base {
                    "bot_token" => {
                        if let Some(s) = secret(self) {
                            // Re-borrow: `secret` needed `self` mutably.
                            cfg.telegram.as_mut().expect("inserted above").bot_token = s;
                        }
                    }
                    "mode" => match value {
                        "poll" => t.mode = value.into(),
                        "webhook" => t.mode = value.into(),
                        _ => self.err(line, format!("mode: `{value}` is not poll or webhook")),
                    },
                    "webhook_secret" => {
                        if let Some(s) = secret(self) {
                            cfg.telegram.as_mut().expect("inserted above").webhook_secret = s;
                        }
                    }
                    "api_base" => {
                        if let Some(u) = self.http_url(value, key, line) {
                            cfg.telegram.as_mut().expect("inserted above").api_base =
                                u.trim_end_matches('/').to_string();
                        }
                    }
                    _ => unknown(self),
                }
            }
            s => {
                let Some(name) = s.strip_prefix("webhook.") else { return };
                let Some(w) = webhooks.get_mut(name) else { return };
                match base {
                    "secret" => {
                        if let Some(s) = secret(self) {
                            webhooks.get_mut(name).expect("present").secret = s;
                        }
                    }
                    "reply_url" => {
                        if value.is_empty() {
                            w.reply_url = None;
                        } else if let Some(u) = self.http_url(value, key, line) {
                            webhooks.get_mut(name).expect("present").reply_url = Some(u);
                        }
                    }
                    "label" => {
                        if value.is_empty() {
                            self.err(line, "label must not be empty".into());
                        } else {
                            w.label = Some(value.to_string());
                        }
                    }
                    _ => unknown(self),
                }
            }
        }
    }

    fn resolve(&self, value: &str) -> PathBuf {
        let p = Path::new(value);
        match self.dir {
            Some(d) if p.is_relative() => d.join(p),
            _ => p.to_path_buf(),
        }
    }

    /// Reads a secret from a file; a bare name is looked up in `$CREDENTIALS_DIRECTORY` (systemd).
    fn read_secret_file(&mut self, value: &str, key: &str, line: usize) -> Option<Secret> {
        if value.is_empty() {
            self.err(line, format!("{key} is empty"));
            return None;
        }
        let bare = !value.contains('/');
        let path = match std::env::var_os("CREDENTIALS_DIRECTORY") {
            Some(dir) if bare => Path::new(&dir).join(value),
            _ => self.resolve(value),
        };
        match std::fs::read_to_string(&path) {
            Ok(s) => {
                let s = s.trim_end_matches(['\r', '\n']).to_string();
                if s.is_empty() {
                    self.err(line, format!("{key}: `{}` is empty", path.display()));
                    None
                } else {
                    Some(Secret::new(s))
                }
            }
            Err(e) => {
                self.err(line, format!("{key}: cannot read `{}`: {e}", path.display()));
                None
            }
        }
    }

    fn duration(&mut self, value: &str, key: &str, line: usize) -> Option<Duration> {
        match parse_duration(value) {
            Some(d) if !d.is_zero() => Some(d),
            _ => {
                self.err(
                    line,
                    format!("{key}: `{value}` is not a duration like 250ms, 30s, 5m or 1h"),
                );
                None
            }
        }
    }

    fn size(&mut self, value: &str, key: &str, line: usize) -> Option<u64> {
        match parse_size(value) {
            Some(n) if n > 0 => Some(n),
            _ => {
                self.err(
                    line,
                    format!("{key}: `{value}` is not a size like 512KiB, 8MiB or 1GiB"),
                );
                None
            }
        }
    }

    fn count(&mut self, value: &str, key: &str, line: usize, min: u64, max: u64) -> Option<u64> {
        match value.parse::<u64>() {
            Ok(n) if (min..=max).contains(&n) => Some(n),
            _ => {
                self.err(
                    line,
                    format!("{key}: `{value}` is not a whole number from {min} to {max}"),
                );
                None
            }
        }
    }

    fn http_url(&mut self, value: &str, key: &str, line: usize) -> Option<String> {
        let ok = (value.starts_with("http://") || value.starts_with("https://"))
            && value
                .split("://")
                .nth(1)
                .is_some_and(|rest| !rest.is_empty() && !rest.starts_with('/'));
        if ok {
            Some(value.to_string())
        } else {
            self.err(line, format!("{key}: `{value}` is not an http:// or https:// URL"));
            None
        }
    }
}

fn is_secret_key(section: &str, key: &str) -> bool {
    matches!(
        (section, key),
        ("server", "api_key") | ("xagent", "dial_api_key") | ("telegram", "bot_token") | ("telegram", "webhook_secret")
    ) || (section.starts_with("webhook.") && key == "secret")
}

/// Endpoint names appear in URLs (`/hooks/NAME`) and in auth input, so keep them plain.
pub fn valid_endpoint_name(n: &str) -> bool {
    !n.is_empty() && n.len() <= 64 && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
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

/// `250ms`, `30s`, `5m`, `1h`, `2d`; a bare number is seconds.
pub fn parse_duration(v: &str) -> Option<Duration> {
    let v = v.trim();
    let split = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (num, unit) = v.split_at(split);
    let n: u64 = num.parse().ok()?;
    let ms = match unit.trim() {
        "ms" => n,
        "" | "s" => n.checked_mul(1000)?,
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

/// Human form of a byte size.
pub fn fmt_size(n: u64) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if n >= 1 << shift && n % (1 << shift) == 0 {
            return format!("{}{}", n >> shift, unit);
        }
    }
    format!("{n}B")
}

impl Telegram {
    fn defaults() -> Telegram {
        Telegram {
            bot_token: None,
            mode: "poll".into(),
            webhook_secret: None,
            api_base: "https://api.telegram.org".into(),
        }
    }
}

impl Config {
    fn defaults(source: &str) -> Config {
        Config {
            source: source.to_string(),
            server: Server {
                listen: SocketAddr::from(([127, 0, 0, 1], 8787)),
                api_key: None,
                state_dir: PathBuf::from("./imgate-data"),
                public_url: None,
                max_connections: 64,
                max_body: 1 << 20,
                log_level: "info".into(),
            },
            xagent: Xagent {
                dial: None,
                dial_api_key: None,
                ca_file: None,
                lease: Duration::from_secs(3600),
            },
            queue: Queue {
                ttl: Duration::from_secs(3600),
                max_messages_per_channel: 1000,
                max_bytes_per_channel: 8 << 20,
                max_bytes_total: 64 << 20,
                overflow: Overflow::DropOldest,
                cleanup_interval: Duration::from_secs(300),
            },
            files: Files {
                ttl: Duration::from_secs(7200),
                max_file_bytes: 20 << 20,
                max_bytes_total: 256 << 20,
            },
            webhooks: BTreeMap::new(),
            telegram: None,
        }
    }

    /// The effective policy as `imgate check` prints it. Secrets show only whether they are set.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        let set = |s: &Option<Secret>| if s.is_some() { "set" } else { "not set" };
        out.push_str(&format!("config:            {}\n", self.source));
        out.push_str(&format!("listen:            {}\n", self.server.listen));
        out.push_str(&format!("api_key:           {}\n", set(&self.server.api_key)));
        out.push_str(&format!("state_dir:         {}\n", self.server.state_dir.display()));
        out.push_str(&format!("max_connections:   {}\n", self.server.max_connections));
        out.push_str(&format!("max_body:          {}\n", fmt_size(self.server.max_body)));
        out.push_str(&format!(
            "dial:              {}\n",
            self.xagent.dial.as_deref().unwrap_or("off")
        ));
        out.push_str(&format!("lease:             {}\n", fmt_duration(self.xagent.lease)));
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
        if self.webhooks.is_empty() {
            out.push_str("webhooks:          none\n");
        }
        for (name, w) in &self.webhooks {
            out.push_str(&format!(
                "webhook {name}:  label \"{}\", reply_url {}\n",
                w.label,
                w.reply_url.as_deref().unwrap_or("none (send/reply tools unavailable)")
            ));
        }
        match &self.telegram {
            None => out.push_str("telegram:          off\n"),
            Some(t) => out.push_str(&format!(
                "telegram:          mode {}, bot_token {}, api_base {}\n",
                t.mode,
                set(&t.bot_token),
                t.api_base
            )),
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors(text: &str) -> Vec<String> {
        match parse(text, "t.conf", None) {
            Ok(_) => vec![],
            Err(e) => e.0,
        }
    }

    #[test]
    fn template_parses_to_the_documented_defaults() {
        let c = parse(TEMPLATE, "tpl", None).expect("template must parse");
        assert_eq!(c.server.listen.to_string(), "127.0.0.1:8787");
        assert_eq!(c.queue.ttl, Duration::from_secs(3600));
        assert_eq!(c.queue.max_bytes_total, 64 << 20);
        assert_eq!(c.queue.overflow, Overflow::DropOldest);
        assert!(c.webhooks.is_empty() && c.telegram.is_none());
    }

    #[test]
    fn durations_and_sizes_parse_with_units() {
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("5m"), Some(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_duration("5 parsecs"), None);
        assert_eq!(parse_size("512KiB"), Some(512 << 10));
        assert_eq!(parse_size("1GiB"), Some(1 << 30));
        assert_eq!(parse_size("99999999999999999999GiB"), None);
        assert_eq!(parse_size("-1"), None);
    }

    #[test]
    fn each_kind_of_bad_line_names_its_line() {
        let text = "[server]\nlisten = nowhere\n\n[bogus]\n[queue]\nttl = soon\nmax_bytes_total = lots\nfrobnicate = 1\njust words\n[webhook.a]\n";
        let e = errors(text);
        assert!(e.iter().any(|l| l.starts_with("t.conf:2: listen")), "{e:?}");
        assert!(e.iter().any(|l| l.starts_with("t.conf:4: unknown section")), "{e:?}");
        assert!(e.iter().any(|l| l.starts_with("t.conf:6: ttl")), "{e:?}");
        assert!(e.iter().any(|l| l.starts_with("t.conf:7: max_bytes_total")), "{e:?}");
        assert!(
            e.iter().any(|l| l.starts_with("t.conf:8: unknown key `frobnicate`")),
            "{e:?}"
        );
        assert!(
            e.iter().any(|l| l.starts_with("t.conf:9: expected `key = value`")),
            "{e:?}"
        );
        assert!(
            e.iter().any(|l| l.starts_with("t.conf:10: [webhook.a] needs `secret`")),
            "{e:?}"
        );
    }

    #[test]
    fn cleanup_interval_is_clamped_to_half_the_ttl() {
        let c = parse("[queue]\nttl = 10m\ncleanup_interval = 1h\n", "t", None).unwrap();
        assert_eq!(c.queue.cleanup_interval, Duration::from_secs(300));
    }

    #[test]
    fn secret_file_with_bare_name_reads_credentials_directory() {
        let dir = std::env::temp_dir().join(format!("imgate-cred-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("hook_secret"), "s3cret\n").unwrap();
        let text = format!("[webhook.a]\nsecret_file = {}\n", dir.join("hook_secret").display());
        let c = parse(&text, "t", None).unwrap();
        assert_eq!(c.webhooks["a"].secret.expose(), "s3cret");
        let e = errors("[webhook.a]\nsecret_file = /nonexistent/x\n");
        assert!(
            e.iter().any(|l| l.starts_with("t.conf:2: secret_file: cannot read")),
            "{e:?}"
        );
        let e = errors("[webhook.a]\nsecret = x\nsecret_file = /y\n");
        assert!(e.iter().any(|l| l.starts_with("t.conf:3:")), "{e:?}");
    }

    #[test]
    fn secrets_never_print() {
        let c = parse("[server]\napi_key = topsecret\n", "t", None).unwrap();
        assert!(!c.summary().contains("topsecret"));
        assert_eq!(format!("{:?}", c.server.api_key), "Some(<redacted>)");
    }

    #[test]
    fn inline_comments_need_whitespace_before_the_hash() {
        let c = parse("[webhook.a]\nsecret = ab#cd   # comment\n", "t", None).unwrap();
        assert_eq!(c.webhooks["a"].secret.expose(), "ab#cd");
    }

    #[test]
    fn config_parser_survives_thousands_of_mutated_files() {
        let seeds: [&[u8]; 2] = [
            TEMPLATE.as_bytes(),
            b"[webhook.a]\nsecret = \"x # y\"\n[queue]\nttl = 5m\nmax_bytes_total = 1GiB\n",
        ];
        for input in crate::testutil::mutations(&seeds, 1500, 3) {
            let _ = parse(&String::from_utf8_lossy(&input), "fuzz", None);
        }
    }

    #[test]
    fn malformed_input_never_panics() {
        for text in [
            "[",
            "]",
            "=",
            "[webhook.]",
            "[server]\n=",
            "\u{0}\u{ff}",
            "[server]\nlisten=\u{1F600}",
        ] {
            let _ = parse(text, "t", None);
        }
    }
}
