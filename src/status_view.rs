//! `imgate status`: asks the running daemon for `/status` and prints it for a person at a
//! terminal. Everything in the answer is treated as outside text: names come from IM systems,
//! so they are escaped and cut before they reach the terminal.

use std::process::ExitCode;

use crate::config::{approx_size, Config};
use crate::json::{self, Object, Value};

/// Characters of a conversation's name the table shows.
const NAME_WIDTH: usize = 24;
/// The longest answer read from the daemon (a thousand channels fit well within it).
const MAX_ANSWER: u64 = 4 << 20;

pub fn status(cfg: &Config) -> ExitCode {
    let listen = cfg.server.listen;
    let host = if listen.ip().is_unspecified() {
        "127.0.0.1".to_string()
    } else {
        listen.ip().to_string()
    };
    let host = if host.contains(':') { format!("[{host}]") } else { host };
    let url = format!("http://{host}:{}/status", listen.port());
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(std::time::Duration::from_secs(5)))
        .http_status_as_error(false)
        .build()
        .into();
    let mut req = agent.get(&url);
    if let Some(k) = &cfg.server.api_key {
        req = req.header("Authorization", &format!("Bearer {}", k.expose()));
    }
    let mut resp = match req.call() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("imgate: cannot reach the daemon at {url}: {e} (is it running? `systemctl status imgate`)");
            return ExitCode::from(1);
        }
    };
    let code = resp.status().as_u16();
    let body = resp
        .body_mut()
        .with_config()
        .limit(MAX_ANSWER)
        .read_to_string()
        .unwrap_or_default();
    if code != 200 {
        eprintln!("imgate: {url} answered HTTP {code}: {}", crate::quiet::shown(&body));
        return ExitCode::from(1);
    }
    match json::parse(&body) {
        Ok(v) => {
            print!("{}", render(&v, crate::ids::now_ms()));
            ExitCode::SUCCESS
        }
        Err(_) => {
            eprintln!("imgate: {url} did not answer JSON");
            ExitCode::from(1)
        }
    }
}

/// The summary lines and the table of channels, as of `now_ms`.
pub fn render(v: &Value, now_ms: u64) -> String {
    let Some(o) = json::as_object(v) else {
        return String::new();
    };
    let mut out = String::new();
    let text = |o: &Object, k: &str| cell(json::get_str(o, k).unwrap_or("?"), 64);
    out.push_str(&format!(
        "imgate {} · profile {} · up {} · connector_id {}\n",
        text(o, "version"),
        text(o, "profile"),
        json::get_u64(o, "uptime_s").map_or("?".into(), |s| span(s.saturating_mul(1000))),
        text(o, "connector_id"),
    ));
    out.push_str(&format!("xAgent   {}\n", xagent_line(o, now_ms)));
    out.push_str(&format!("storage  {}\n", storage_line(o)));
    if let Some(e) = json::get_str(o, "unreadable") {
        out.push_str(&format!("         the database cannot be read: {}\n", cell(e, 200)));
    }
    out.push('\n');
    out.push_str(&format!(
        "{:<38} {:<NAME_WIDTH$} {:<9} {:<10} {:>7} {:>10} {:>9} {:>7} {:>7} {:>8}  last_error\n",
        "channel", "name", "provider", "status", "pending", "bytes", "delivered", "expired", "evicted", "attempts"
    ));
    if let Some(Value::Array(chs)) = o.get("channels") {
        for c in chs.iter().filter_map(json::as_object) {
            let num = |k: &str| json::get_u64(c, k).unwrap_or(0);
            out.push_str(&format!(
                "{:<38} {} {:<9} {:<10} {:>7} {:>10} {:>9} {:>7} {:>7} {:>8}  {}\n",
                cell(json::get_str(c, "connector_channel_id").unwrap_or("?"), 38),
                padded(json::get_str(c, "name").unwrap_or("-"), NAME_WIDTH),
                cell(json::get_str(c, "provider").unwrap_or("?"), 9),
                cell(json::get_str(c, "status").unwrap_or("?"), 10),
                num("pending"),
                num("pending_bytes"),
                num("delivered"),
                num("expired"),
                num("evicted"),
                num("attempts"),
                cell(json::get_str(c, "last_error").unwrap_or("-"), 120),
            ));
        }
    }
    if let Some(u) = json::get_obj(o, "unbound") {
        let num = |k: &str| json::get_u64(u, k).unwrap_or(0);
        out.push_str(&format!(
            "{:<38} {:<NAME_WIDTH$} {:<9} {:<10} {:>7} {:>10} {:>9} {:>7} {:>7}\n",
            "(unbound)",
            "-",
            "-",
            "-",
            num("pending"),
            num("pending_bytes"),
            "-",
            num("expired"),
            num("evicted")
        ));
    }
    out
}

/// Whether xAgent is connected; when not, since when and how long the lease has left.
fn xagent_line(o: &Object, now_ms: u64) -> String {
    let conns = json::get_obj(o, "dataplane")
        .and_then(|d| json::get_u64(d, "connections"))
        .unwrap_or(0);
    let x = json::get_obj(o, "xagent");
    if matches!(x.and_then(|x| x.get("connected")), Some(Value::Bool(true))) {
        return format!("connected ({conns} data-plane connection(s))");
    }
    let mut line = match x.and_then(|x| json::get_u64(x, "offline_since_ms")) {
        Some(since) => format!("not connected for {}", span(now_ms.saturating_sub(since))),
        None => "not connected".to_string(),
    };
    let lease = json::get_obj(o, "lease");
    if let Some(left) = lease.and_then(|l| json::get_u64(l, "expires_in_ms")) {
        let whole = lease.and_then(|l| json::get_u64(l, "lease_ms"));
        line.push_str(&format!(
            "; channels are unregistered in {} (lease {})",
            span(left),
            whole.map_or("?".into(), span)
        ));
    }
    line
}

fn storage_line(o: &Object) -> String {
    let Some(st) = json::get_obj(o, "storage") else {
        return "?".into();
    };
    let free =
        json::get_u64(st, "free_bytes").map_or("free space unknown".into(), |b| format!("{} free", approx_size(b)));
    let pending = json::get_obj(o, "outbox")
        .and_then(|x| json::get_u64(x, "pending_bytes"))
        .map_or(String::new(), |b| format!(", {} waiting for xAgent", approx_size(b)));
    match json::get_str(st, "state") {
        Some("ok") => format!("ok, {free}{pending}"),
        state => format!(
            "{} ({}), {free}{pending}",
            cell(state.unwrap_or("?"), 16),
            cell(json::get_str(st, "last_error").unwrap_or("no error given"), 200)
        ),
    }
}

/// `text` fit for one table cell: control and reordering characters escaped (a name from an
/// IM system must not move the cursor or recolour the terminal), at most `width` columns of a
/// terminal (a Chinese or Japanese character takes two).
fn cell(text: &str, width: usize) -> String {
    let shown = crate::quiet::shown(text);
    if shown.chars().map(columns).sum::<usize>() <= width {
        return shown;
    }
    let mut cut = String::new();
    let mut used = 0;
    for c in shown.chars() {
        if used + columns(c) > width.saturating_sub(1) {
            break;
        }
        used += columns(c);
        cut.push(c);
    }
    cut.push('…');
    cut
}

/// `cell`, then spaces to `width` columns: `format!`'s padding counts characters, and a
/// conversation's name is often Chinese.
fn padded(text: &str, width: usize) -> String {
    let mut out = cell(text, width);
    let used: usize = out.chars().map(columns).sum();
    out.extend(std::iter::repeat_n(' ', width.saturating_sub(used)));
    out
}

/// The columns a character takes at a terminal: two for East Asian wide and fullwidth
/// characters (the CJK blocks, Hangul, fullwidth forms, emoji), one for the rest.
fn columns(c: char) -> usize {
    let wide = matches!(c as u32,
        0x1100..=0x115F | 0x2E80..=0x303E | 0x3041..=0x33FF | 0x3400..=0x4DBF | 0x4E00..=0x9FFF
        | 0xA000..=0xA4CF | 0xAC00..=0xD7A3 | 0xF900..=0xFAFF | 0xFE30..=0xFE4F | 0xFF00..=0xFF60
        | 0xFFE0..=0xFFE6 | 0x1F300..=0x1F64F | 0x1F900..=0x1F9FF | 0x20000..=0x3FFFD);
    if wide {
        2
    } else {
        1
    }
}

/// A span of time as a person reads it: `45s`, `12m`, `3h12m`, `2d4h`.
fn span(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m", s / 60),
        3600..=86_399 => two(s / 3600, "h", s % 3600 / 60, "m"),
        _ => two(s / 86_400, "d", s % 86_400 / 3600, "h"),
    }
}

/// `3h12m`, or `3h` when the smaller unit is 0.
fn two(big: u64, big_unit: &str, small: u64, small_unit: &str) -> String {
    match small {
        0 => format!("{big}{big_unit}"),
        _ => format!("{big}{big_unit}{small}{small_unit}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(text: &str) -> Value {
        json::parse(text).unwrap()
    }

    #[test]
    fn shows_names_uptime_xagent_the_lease_and_storage() {
        let v = answer(
            r#"{"connector_id":"cid_1","version":"1.2.3","profile":"xagent.im.v1","uptime_s":11520,
            "xagent":{"connected":false,"offline_since_ms":1000000},
            "storage":{"state":"ok","free_bytes":1288490188,"last_error":null},
            "dataplane":{"connections":0},"outbox":{"pending_bytes":2048},
            "lease":{"lease_ms":3600000,"channels_unregistered":0,"expires_in_ms":2820000},
            "channels":[{"connector_channel_id":"cch_a","name":"Ops \u001b[31mroom","provider":"telegram",
              "status":"offline","pending":2,"pending_bytes":2048,"delivered":5,"expired":0,"evicted":0,
              "attempts":1,"last_error":null}],
            "unbound":{"pending":0,"pending_bytes":0,"expired":0,"evicted":0}}"#,
        );
        let out = render(&v, 1_000_000 + 780_000);
        assert!(
            out.starts_with("imgate 1.2.3 · profile xagent.im.v1 · up 3h12m · connector_id cid_1\n"),
            "{out}"
        );
        assert!(
            out.contains("xAgent   not connected for 13m")
                && out.contains("channels are unregistered in 47m (lease 1h)"),
            "{out}"
        );
        assert!(
            out.contains("storage  ok, 1.2 GiB free, 2.0 KiB waiting for xAgent"),
            "{out}"
        );
        assert!(out.contains("cch_a") && out.contains("Ops \\u{1b}[31mroom"), "{out}");
        assert!(
            !out.contains('\u{1b}'),
            "an escape from a chat's name reached the terminal"
        );
    }

    #[test]
    fn a_connected_agent_and_a_failing_disk_read_plainly() {
        let v = answer(
            r#"{"connector_id":"cid_1","version":"1","profile":"xagent.im.v2","uptime_s":5,
            "xagent":{"connected":true},"dataplane":{"connections":1},
            "storage":{"state":"failing","free_bytes":0,"last_error":"No space left on device"},
            "unreadable":"channels and counters: the database is being reopened"}"#,
        );
        let out = render(&v, 0);
        assert!(out.contains("xAgent   connected (1 data-plane connection(s))"), "{out}");
        assert!(
            out.contains("storage  failing (No space left on device), 0 B free")
                && out.contains("the database cannot be read: channels and counters"),
            "{out}"
        );
    }

    #[test]
    fn a_chinese_name_keeps_the_columns_in_line() {
        let row = |cch: &str, name: &str| {
            format!(r#"{{"connector_channel_id":"{cch}","name":"{name}","provider":"feishu","status":"connected"}}"#)
        };
        let v = answer(&format!(
            r#"{{"channels":[{},{}]}}"#,
            row("cch_a", "Ops"),
            row("cch_b", "运维告警群")
        ));
        let out = render(&v, 0);
        let at = |cch: &str| {
            let line = out.lines().find(|l| l.starts_with(cch)).unwrap();
            let before = &line[..line.find("feishu").unwrap()];
            before.chars().map(columns).sum::<usize>()
        };
        assert_eq!(at("cch_a"), at("cch_b"), "{out}");
    }

    #[test]
    fn long_names_are_cut_and_odd_answers_do_not_panic() {
        assert_eq!(cell(&"x".repeat(40), 10), format!("{}…", "x".repeat(9)));
        // Chinese names take two columns a character: cut and padded by columns.
        assert_eq!(cell("运维告警群组名称很长", 9), "运维告警…");
        assert_eq!(padded("运维群", 8), "运维群  ");
        assert_eq!(padded("ops", 5), "ops  ");
        assert_eq!(span(59_999), "59s");
        assert_eq!(span(90_061_000), "1d1h");
        assert_eq!(approx_size(1023), "1023 B");
        for odd in ["[]", "{}", r#"{"channels":[1,"x",{}],"xagent":7,"lease":{}}"#] {
            render(&answer(odd), 0);
        }
    }
}
