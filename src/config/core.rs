//! The core sections: `[server]`, `[xagent]`, `[queue]`, `[files]`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::fields::{fmt_size, not_a_duration, parse_duration, parse_size};
use super::{Exposure, Fields, Files, Overflow, Problems, Queue, Section, Server, TlsFiles, Xagent};
use crate::protocol::{CardId, Profile, PROFILE_V1, PROFILE_V2};

pub(super) fn read_server(s: &mut Server, section: &Section, p: &mut Problems) {
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

pub(super) fn read_xagent(x: &mut Xagent, section: &Section, p: &mut Problems) {
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

pub(super) fn read_queue(q: &mut Queue, section: &Section, p: &mut Problems) {
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

pub(super) fn read_files(files: &mut Files, section: &Section, p: &mut Problems) {
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
