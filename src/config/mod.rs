//! The one config file: an INI dialect with durations, sizes and `*_file` secrets.
//!
//! Every problem is reported as `FILE:LINE: message` and all problems are collected, so a
//! user fixes a broken file in one pass. No file at all means the embedded defaults, which are
//! exactly what `imgate init` writes (the template is parsed to get them).
//!
//! `ini` splits the text into sections, `fields` reads a section's keys, `core` the core
//! sections (`server`, `xagent`, `queue`, `files`); every other section belongs to a provider,
//! which reads it with the same `Fields` through its `Reader` (the registry in `providers` lists
//! them) and keeps its own typed `Settings`.

use std::any::Any;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::protocol::{CardId, Profile};

mod core;
mod fields;
mod ini;

use self::core::{read_files, read_queue, read_server, read_xagent};
pub use self::fields::{approx_size, fmt_duration, fmt_size, Fields};
pub use self::ini::{Problems, Section};

/// The commented default config; `imgate init` writes it and `systemd/imgate.conf` is a copy.
pub const TEMPLATE: &str = include_str!("../../systemd/imgate.conf");

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

/// Parses config text. `dir` resolves relative `*_file` paths when no credentials directory
/// applies; `readers` are the providers' parts of the file.
pub fn parse(text: &str, name: &str, dir: Option<&Path>, readers: &[Reader]) -> Result<Config, ConfigError> {
    let mut p = Problems::new(name, dir);
    let all = ini::sections(text, &mut p);
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
    p.into_result(cfg)
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
            .and_then(|s| (s as &dyn Any).downcast_ref::<T>())
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
