//! Running under systemd: READY/STOPPING/WATCHDOG notifications, graceful SIGTERM, SIGHUP, the
//! unit file, journald-friendly logs.

use std::os::unix::net::UnixDatagram;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::*;
use serde_json::json;

/// A fake systemd notify socket collecting what imgate sends.
struct NotifySocket {
    sock: UnixDatagram,
    path: std::path::PathBuf,
}

impl NotifySocket {
    fn new(dir: &std::path::Path) -> NotifySocket {
        let path = dir.join("notify.sock");
        let sock = UnixDatagram::bind(&path).unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        NotifySocket { sock, path }
    }

    /// Waits for a datagram equal to `want`; returns how long it took.
    fn expect(&self, want: &str, timeout: Duration) -> Duration {
        let start = Instant::now();
        let mut buf = [0u8; 256];
        while start.elapsed() < timeout {
            if let Ok(n) = self.sock.recv(&mut buf) {
                if &buf[..n] == want.as_bytes() {
                    return start.elapsed();
                }
            }
        }
        panic!("no {want} on the notify socket within {timeout:?}");
    }

    /// Waits for a `STATUS=` datagram holding `part`; returns it.
    fn status_with(&self, part: &str, timeout: Duration) -> String {
        let start = Instant::now();
        let mut buf = [0u8; 512];
        while start.elapsed() < timeout {
            if let Ok(n) = self.sock.recv(&mut buf) {
                let got = String::from_utf8_lossy(&buf[..n]).to_string();
                if got.starts_with("STATUS=") && got.contains(part) {
                    return got;
                }
            }
        }
        panic!("no STATUS= with {part:?} on the notify socket within {timeout:?}");
    }
}

/// imgate started with a notify socket of its own (and `env` besides).
fn notified(tag: &str, env: &[(&str, &str)]) -> (Daemon, NotifySocket) {
    let dir = temp_dir(tag);
    let notify = NotifySocket::new(&dir);
    let path = notify.path.to_str().unwrap().to_string();
    let mut env = env.to_vec();
    env.push(("NOTIFY_SOCKET", &path));
    let d = Daemon::start_env(&dir, &config_text(free_port(), &dir, None, ""), "info", &env);
    (d, notify)
}

/// `systemctl status imgate` shows what imgate is doing: a `STATUS=` line whenever it changes,
/// with watchdog pings going on.
#[test]
fn systemd_hears_a_status_line_when_xagent_comes_and_goes() {
    let (d, notify) = notified("status-line", &[("WATCHDOG_USEC", "1000000")]);
    let first = notify.status_with("xAgent: not connected", Duration::from_secs(10));
    assert!(
        first.contains("storage: ok") && first.contains("listening on 127.0.0.1:"),
        "{first}"
    );
    let mut x = d.xagent();
    x.hello("");
    notify.status_with("xAgent: connected (1)", Duration::from_secs(10));
    notify.expect("WATCHDOG=1", Duration::from_secs(5));
    x.close();
    notify.status_with("xAgent: not connected", Duration::from_secs(10));
}

/// Without watchdog pings the status line is looked at every 30 s for its figures, but a
/// change of state is said at once.
#[test]
fn a_change_of_state_reaches_systemd_at_once_without_watchdog_pings() {
    let (d, notify) = notified("status-change", &[]);
    notify.status_with("xAgent: not connected", Duration::from_secs(10));
    let mut x = d.xagent();
    x.hello("");
    let took = Instant::now();
    notify.status_with("xAgent: connected (1)", Duration::from_secs(10));
    x.close();
    notify.status_with("xAgent: not connected", Duration::from_secs(10));
    println!("a connection and its end said within {:?}", took.elapsed());
}

#[test]
fn sigterm_closes_websockets_finishes_and_exits_0_after_ready_and_stopping() {
    let dir = temp_dir("sigterm");
    let notify = NotifySocket::new(&dir);
    let path = notify.path.to_str().unwrap().to_string();
    let mut d = Daemon::start_env(
        &dir,
        &config_text(free_port(), &dir, None, ""),
        "info",
        &[("NOTIFY_SOCKET", &path)],
    );
    notify.expect("READY=1", Duration::from_secs(5));

    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    x.bind_webhook(&cch, "alerts", HOOK_SECRET);
    assert_eq!(
        d.post_hook("alerts", &json!({"message_id": "before-stop", "sender_id": "u"}))
            .0,
        202
    );
    x.next_push(Duration::from_secs(5)).unwrap();

    let t = Instant::now();
    d.signal("TERM");
    notify.expect("STOPPING=1", Duration::from_secs(5));
    while x.close_reason.is_none() && t.elapsed() < Duration::from_secs(5) {
        x.recv_within(Duration::from_millis(100));
    }
    assert_eq!(
        x.close_reason.as_deref(),
        Some("imgate is stopping"),
        "a close frame with a reason"
    );
    let status = d.wait_exit(Duration::from_secs(5)).expect("exits within 5 s");
    assert!(status.success(), "exit 0, got {status:?}");
    println!("SIGTERM to exit: {:?}", t.elapsed());
    assert!(d.log_shows("stopped cleanly", Duration::from_secs(5)), "{}", d.log());

    // Nothing was lost: the restart still knows the channel and its state.
    let d = d.restart();
    let s = get_json(&d.url("/status"));
    assert_eq!(s["channels"][0]["connector_channel_id"], json!(cch));
}

#[test]
fn sighup_is_logged_and_changes_nothing() {
    let dir = temp_dir("sighup");
    let mut d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    d.signal("HUP");
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        d.wait_exit(Duration::from_millis(10)).is_none(),
        "SIGHUP does not stop imgate"
    );
    assert_eq!(http_get(&d.url("/connector-card.json"), &[]).0, 200);
    assert!(d.log_shows("SIGHUP", Duration::from_secs(5)), "{}", d.log());
    assert!(
        d.log_shows("service imgate restart` on OpenWrt and Alpine", Duration::from_secs(5)),
        "how to apply a change, whatever the init system: {}",
        d.log()
    );
}

#[test]
fn watchdog_pings_come_at_half_the_watchdog_interval() {
    let dir = temp_dir("watchdog");
    let notify = NotifySocket::new(&dir);
    let path = notify.path.to_str().unwrap().to_string();
    let env = [("NOTIFY_SOCKET", path.as_str()), ("WATCHDOG_USEC", "200000")];
    let _d = Daemon::start_env(&dir, &config_text(free_port(), &dir, None, ""), "info", &env);
    notify.expect("READY=1", Duration::from_secs(5));
    let first = notify.expect("WATCHDOG=1", Duration::from_secs(2));
    let second = notify.expect("WATCHDOG=1", Duration::from_secs(2));
    assert!(
        first < Duration::from_millis(400) && second < Duration::from_millis(400),
        "{first:?} {second:?}"
    );
}

/// A start that fails (the port is taken) logs info lines and an error: each mode writes them
/// as what reads it expects. journald: every line led by its priority, no time; procd's and
/// OpenRC's logger: info on stdout, the error on stderr, no time; a terminal: one stream with
/// the time. The module path only at debug level.
#[test]
fn log_lines_carry_their_priority_for_journald_and_go_to_two_streams_for_syslog() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port();
    let run = |tag: &str, env: &[(&str, &str)]| {
        let dir = temp_dir(tag);
        let conf = dir.join("imgate.conf");
        std::fs::write(&conf, config_text(port, &dir, None, "")).unwrap();
        let out = Command::new(bin())
            .args(["run", "--config"])
            .arg(&conf)
            .env_remove("JOURNAL_STREAM")
            .env_remove("IMGATE_LOG_FORMAT")
            .envs(env.iter().copied())
            .output()
            .unwrap();
        assert!(!out.status.success(), "the port is taken");
        assert!(
            !dir.join("state").exists(),
            "a start that cannot listen writes no state"
        );
        let text = |b: &[u8]| String::from_utf8_lossy(b).to_string();
        (text(&out.stdout), text(&out.stderr))
    };
    let (stdout, stderr) = run("log-journal", &[("JOURNAL_STREAM", "8:1234"), ("RUST_LOG", "info")]);
    assert!(stdout.is_empty(), "{stdout}");
    assert!(stderr.lines().any(|l| l.starts_with("<6>config: ")), "{stderr}");
    assert!(
        stderr.lines().any(|l| l.starts_with("<3>cannot listen on ")),
        "{stderr}"
    );
    assert!(
        stderr.lines().all(|l| l.starts_with("<6>") || l.starts_with("<3>")),
        "a priority on every line, no time, no module path: {stderr}"
    );
    let (_, stderr) = run(
        "log-journal-debug",
        &[("JOURNAL_STREAM", "8:1234"), ("RUST_LOG", "debug")],
    );
    assert!(
        stderr.lines().any(|l| l.starts_with("<6>imgate::cli: config: ")),
        "at debug level the module path shows: {stderr}"
    );

    let (stdout, stderr) = run("log-syslog", &[("IMGATE_LOG_FORMAT", "syslog"), ("RUST_LOG", "info")]);
    assert!(stdout.lines().any(|l| l.starts_with("INFO config: ")), "{stdout}");
    assert!(stdout.lines().all(|l| l.starts_with("INFO ")), "{stdout}");
    assert!(
        stderr.lines().any(|l| l.starts_with("ERROR cannot listen on ")),
        "{stderr}"
    );
    assert!(
        stderr
            .lines()
            .all(|l| l.starts_with("ERROR ") || l.starts_with("WARN ")),
        "{stderr}"
    );

    let (stdout, stderr) = run("log-plain", &[("RUST_LOG", "info")]);
    assert!(stdout.is_empty(), "{stdout}");
    let first = stderr.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("[20") && first.contains(" INFO") && !first.contains("imgate::"),
        "a time of its own at a terminal, no module path at info: {first}"
    );
    drop(busy);
}

#[test]
fn log_level_from_the_config_applies_and_rust_log_overrides_it() {
    let dir = temp_dir("loglevel");
    let conf = config_text(free_port(), &dir, None, "").replace("log_level = debug", "log_level = warn");
    // RUST_LOG set by the harness to "info" would override; run with an empty RUST_LOG instead.
    let d = Daemon::start_env(&dir, &conf, "", &[]);
    http_get(&d.url("/connector-card.json"), &[]);
    std::thread::sleep(Duration::from_millis(200));
    assert!(!d.log().contains("INFO"), "warn hides info: {}", d.log());
    drop(d);
    let dir = temp_dir("loglevel2");
    let conf = config_text(free_port(), &dir, None, "").replace("log_level = debug", "log_level = warn");
    let d = Daemon::start_env(&dir, &conf, "debug", &[]);
    http_get(&d.url("/connector-card.json"), &[]);
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        d.log_shows("DEBUG", Duration::from_secs(5)),
        "RUST_LOG wins: {}",
        d.log()
    );
}

#[test]
fn the_unit_file_passes_systemd_analyze_verify() {
    let unit = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/systemd/imgate.service")).unwrap();
    for key in [
        "Type=notify",
        "User=imgate",
        "Group=imgate",
        "StateDirectory=imgate",
        "RuntimeDirectory=imgate",
        "ConfigurationDirectory=imgate",
        "LoadCredential=",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "PrivateDevices=yes",
        "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX",
        "MemoryMax=",
        "Restart=on-failure",
        // A config error exits 2 and is not restarted; a crash loop stops after 60 starts.
        "RestartPreventExitStatus=2",
        "StartLimitBurst=60",
        "WatchdogSec=",
    ] {
        assert!(unit.contains(key), "the unit sets {key}");
    }
    // verify checks that ExecStart exists: point it at the binary under test.
    let dir = temp_dir("unit");
    let copy = dir.join("imgate.service");
    std::fs::write(&copy, unit.replace("/usr/bin/imgate", bin())).unwrap();
    // The man page Documentation= names is installed by the package, not on this machine.
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&copy)
        .output()
        .expect("systemd-analyze is installed");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.trim().is_empty(),
        "systemd-analyze verify: {err}"
    );
    // systemd's own rating of the sandbox: 0 is locked down, 10 is none; 3.0 or less is "OK".
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=true", "--no-pager"])
        .arg(&copy)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let level: f64 = text
        .lines()
        .find_map(|l| l.split_once("Overall exposure level for imgate.service: "))
        .and_then(|(_, rest)| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("systemd-analyze security printed no level: {text}"));
    assert!(level <= 3.0, "exposure {level}: {text}");
}

/// The system calls a set of systemd's `SystemCallFilter=` allows, sub-sets expanded, as this
/// machine's `systemd-analyze syscall-filter` lists them.
fn syscall_set(all: &str, name: &str, out: &mut std::collections::BTreeSet<String>) {
    let mut lines = all.lines().skip_while(|l| *l != name).skip(1);
    for line in lines.by_ref().take_while(|l| !l.trim().is_empty()) {
        let item = line.trim();
        if item.starts_with('#') {
            continue;
        }
        if item.starts_with('@') {
            syscall_set(all, item, out);
        } else {
            out.insert(item.to_string());
        }
    }
}

/// The unit's filter (`@system-service` less `@privileged`) is enforced by systemd alone, and
/// a call outside it kills imgate on every board at its first use: every call made by a run
/// that serves webhooks, the data plane, an upload, a download, /status and a SIGTERM is
/// traced here and must be in the set.
#[test]
fn every_system_call_imgate_makes_passes_the_units_filter() {
    let unit = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/systemd/imgate.service")).unwrap();
    assert!(unit.contains("SystemCallFilter=@system-service\nSystemCallFilter=~@privileged\n"));
    let Ok(strace) = Command::new("strace").arg("-V").output() else {
        panic!("strace is needed (apt-get install strace; .ci/run installs it)");
    };
    assert!(strace.status.success());
    let listed = Command::new("systemd-analyze").arg("syscall-filter").output().unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout).to_string();
    let (mut allowed, mut denied) = (Default::default(), Default::default());
    syscall_set(&listed, "@system-service", &mut allowed);
    syscall_set(&listed, "@privileged", &mut denied);
    assert!(allowed.contains("read") && denied.contains("setuid"), "{listed}");

    let dir = temp_dir("syscalls");
    let trace = dir.join("trace");
    let trace_arg = trace.to_str().unwrap().to_string();
    let mut d = Daemon::start_wrapped(
        &dir,
        &config_text(free_port(), &dir, None, ""),
        &["strace", "-f", "-qq", "-o", &trace_arg],
    );
    let (mut x, cch) = d.bound_xagent();
    let (code, _) = d.post_hook("alerts", &json!({"message_id": "s1", "sender_id": "u", "text": "hi"}));
    assert_eq!(code, 202);
    assert!(x.next_push(Duration::from_secs(20)).is_some());
    let (code, up) = upload_as(&d, &cch, "a.bin", "application/octet-stream", &patterned(100 << 10, 1));
    assert_eq!(code, 200, "{up}");
    assert_eq!(
        http_get(&d.url("/status"), &[("Authorization", &format!("Bearer {API_KEY}"))]).0,
        200
    );
    assert_eq!(http_get(&d.url("/files/refs/file_00"), &[]).0, 404);
    drop(x);
    // The child is strace; imgate is its child, and strace exits with imgate's status.
    let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", d.pid())).unwrap();
    let imgate = children.split_whitespace().next().expect("strace runs imgate");
    assert!(Command::new("kill").args(["-TERM", imgate]).status().unwrap().success());
    assert!(
        d.wait_exit(Duration::from_secs(20)).is_some_and(|s| s.success()),
        "{}",
        d.log()
    );

    let text = std::fs::read_to_string(&trace).unwrap();
    let mut made = std::collections::BTreeSet::new();
    for line in text.lines() {
        // "PID name(args) = result", or a call resumed after another thread's.
        let Some(call) = line.split_once(' ').map(|(_, rest)| rest.trim_start()) else {
            continue;
        };
        let name: String = call
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() && call[name.len()..].starts_with('(') {
            made.insert(name);
        }
    }
    // The exec that starts imgate is strace's, before the filter would apply.
    made.remove("execve");
    assert!(made.contains("epoll_wait") || made.contains("epoll_pwait"), "{made:?}");
    let outside: Vec<&String> = made
        .iter()
        .filter(|c| !allowed.contains(*c) || denied.contains(*c))
        .collect();
    assert!(
        outside.is_empty(),
        "calls the unit's filter refuses: {outside:?} (of {made:?})"
    );
}

#[test]
fn sigterm_lets_a_request_being_answered_finish_with_its_202() {
    use std::io::{Read, Write};
    let dir = temp_dir("inflight");
    let mut d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    let body = json!({"message_id": "in-flight", "sender_id": "u"}).to_string();
    let mut s = std::net::TcpStream::connect(("127.0.0.1", d.port)).unwrap();
    write!(
        s,
        "POST /hooks/alerts HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {HOOK_SECRET}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(300)); // the request is being handled, its body not yet sent
    d.signal("TERM");
    std::thread::sleep(Duration::from_millis(300));
    s.write_all(body.as_bytes()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    assert!(
        answer.starts_with("HTTP/1.1 202"),
        "the in-flight request is answered: {answer:?}\n{}",
        d.log()
    );
    let status = d.wait_exit(Duration::from_secs(5)).expect("exits within 5 s");
    assert!(status.success());
    // And it really was committed.
    let d = d.restart();
    assert_eq!(get_json(&d.url("/status"))["unbound"]["pending"], 1);
}

/// Writes a webhook request for `id` on a kept-alive connection.
fn send_hook(s: &mut std::net::TcpStream, id: &str) -> std::io::Result<()> {
    use std::io::Write;
    let body = json!({"message_id": id, "sender_id": "u"}).to_string();
    write!(
        s,
        "POST /hooks/alerts HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {HOOK_SECRET}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Reads one answer's status line and body off a kept-alive connection (`None`: closed first).
fn read_answer(s: &mut std::net::TcpStream) -> Option<String> {
    use std::io::Read;
    let mut got = Vec::new();
    let mut byte = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        match s.read(&mut byte) {
            Ok(1) => got.push(byte[0]),
            _ => return None,
        }
    }
    let head = String::from_utf8_lossy(&got).to_string();
    let length: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|n| n.trim().to_string())
        })
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    s.read_exact(&mut body).ok()?;
    Some(format!(
        "{} {}",
        head.lines().next().unwrap_or(""),
        String::from_utf8_lossy(&body)
    ))
}

/// A stop is clean only once the final checkpoint ran. Here the disk holds a request's commit
/// (a preloaded shim holds the log's syncs) past the stop's grace: the stop waits for it, then
/// says it stopped with work still busy, not "stopped cleanly", and the next start replays the
/// log and loses nothing. Meanwhile a request that arrives after SIGTERM on a kept-alive
/// connection is answered 503 at once: it never reaches the outbox the stop is closing.
#[test]
fn a_stop_is_clean_only_after_its_final_checkpoint_and_refuses_requests_that_come_after_it() {
    let dir = temp_dir("termrace");
    let flag = dir.join("hold");
    let env = sync_hold_env(".log", &flag);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut d = Daemon::start_env(&dir, &config_text(free_port(), &dir, None, ""), "debug", &env);
    let kept_alive = |id: &str| {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", d.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        send_hook(&mut s, id).unwrap();
        let answer = read_answer(&mut s);
        assert!(
            answer.as_deref().is_some_and(|a| a.starts_with("HTTP/1.1 202")),
            "{answer:?}"
        );
        s
    };
    let (mut first, mut second) = (kept_alive("warm-1"), kept_alive("warm-2"));
    std::fs::write(&flag, "").unwrap();
    send_hook(&mut first, "held").unwrap();
    wait_until("the request's commit waits for the disk", || {
        dir.join("hold.held").exists()
    });
    d.signal("TERM");
    assert!(d.log_shows("SIGTERM: stopping", Duration::from_secs(5)), "{}", d.log());
    send_hook(&mut second, "after-term").unwrap();
    let answer = read_answer(&mut second);
    assert!(
        answer
            .as_deref()
            .is_some_and(|a| a.starts_with("HTTP/1.1 503") && a.contains("stopping")),
        "a request after SIGTERM is refused at once: {answer:?}\n{}",
        d.log()
    );
    let status = d.wait_exit(Duration::from_secs(10)).expect("exits after the grace");
    assert!(status.success(), "{status:?}");
    assert!(d.log_shows("still busy", Duration::from_secs(5)), "{}", d.log());
    assert!(!d.log().contains("stopped cleanly"), "{}", d.log());
    std::fs::remove_file(&flag).unwrap();
    let d = d.restart_env(&[]);
    assert!(d.log_shows("replayed", Duration::from_secs(5)), "{}", d.log());
    // The held request's record was written before its sync: it is there; the refused one is not.
    assert_eq!(get_json(&d.url("/status"))["unbound"]["pending"], 3);
}

/// What `promtool check metrics` and the exposition format ask of `/metrics`, checked here
/// (Prometheus' text format 0.0.4 and its naming rules): every line a `# HELP`, a `# TYPE` or a
/// sample; each family's HELP and TYPE once, before its samples, which follow together; names
/// and label names of the allowed characters; a counter's name ends in `_total` and no other
/// type's does; every value a number; no sample twice. The problems found, one per line.
fn metrics_problems(text: &str) -> Vec<String> {
    use std::collections::{HashMap, HashSet};
    let name_ok = |n: &str| {
        !n.is_empty()
            && !n.starts_with(|c: char| c.is_ascii_digit())
            && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    };
    let (mut problems, mut helps, mut types) = (Vec::new(), HashSet::new(), HashMap::new());
    let (mut seen_samples, mut finished, mut current) = (HashSet::new(), HashSet::new(), String::new());
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            if !helps.insert(name.to_string()) || help.trim().is_empty() {
                problems.push(format!("HELP of {name} twice or empty"));
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind) {
                problems.push(format!("{name}: type `{kind}`"));
            }
            if types.insert(name.to_string(), kind.to_string()).is_some() {
                problems.push(format!("TYPE of {name} twice"));
            }
            if !helps.contains(name) {
                problems.push(format!("{name}: no HELP before its TYPE"));
            }
            if kind == "counter" && !name.ends_with("_total") {
                problems.push(format!("{name}: a counter's name ends in _total"));
            }
            if kind != "counter" && name.ends_with("_total") {
                problems.push(format!("{name}: a {kind}'s name does not end in _total"));
            }
            if !name_ok(name) {
                problems.push(format!("{name}: not a metric name"));
            }
            if !current.is_empty() {
                finished.insert(std::mem::take(&mut current));
            }
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            problems.push(format!("a line that is neither a HELP, a TYPE nor a sample: {line:?}"));
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or((line, ""));
        let name = series.split('{').next().unwrap_or_default();
        if value.parse::<f64>().is_err() {
            problems.push(format!("{series}: value `{value}` is not a number"));
        }
        if !types.contains_key(name) {
            problems.push(format!("{name}: a sample before its TYPE"));
        }
        if finished.contains(name) {
            problems.push(format!("{name}: its samples are not together"));
        }
        current = name.to_string();
        if let Some(labels) = series.strip_prefix(name).and_then(|l| l.strip_prefix('{')) {
            let labels = labels.strip_suffix('}').unwrap_or_else(|| {
                problems.push(format!("{series}: labels not closed"));
                ""
            });
            for pair in labels.split("\",").filter(|p| !p.is_empty()) {
                let (label, value) = pair.split_once('=').unwrap_or((pair, ""));
                if !name_ok(label) || label.contains(':') || !value.starts_with('"') {
                    problems.push(format!("{series}: label {label}"));
                }
            }
        }
        if !seen_samples.insert(series.to_string()) {
            problems.push(format!("{series}: twice"));
        }
    }
    problems
}

/// A sender with a wrong secret shows in `/metrics` under its provider: every refusal of a
/// provider route for what the sender sent is a `refused` message of that provider.
#[test]
fn webhook_posts_refused_for_their_secret_signature_body_or_size_are_counted_refused() {
    let dir = temp_dir("metrics-refused");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    let url = d.url("/hooks/alerts");
    let body = json!({"message_id": "m1", "sender_id": "u", "text": "hi"}).to_string();
    let wrong_secret = http_post(&url, &[("Authorization", "Bearer not-the-secret")], &body);
    assert_eq!(wrong_secret.0, 401, "{wrong_secret:?}");
    let wrong_signature = http_post(&url, &[("X-Imgate-Signature", "sha256=00")], &body);
    assert_eq!(wrong_signature.0, 401, "{wrong_signature:?}");
    let auth = format!("Bearer {HOOK_SECRET}");
    let malformed = http_post(&url, &[("Authorization", &auth)], "{\"message_id\":");
    assert_eq!(malformed.0, 400, "{malformed:?}");
    let huge = format!(
        "{{\"message_id\":\"m2\",\"sender_id\":\"u\",\"text\":\"{}\"}}",
        "x".repeat(1 << 21)
    );
    let too_large = http_post(&url, &[("Authorization", &auth)], &huge);
    assert_eq!(too_large.0, 413, "{too_large:?}");
    let stale = json!({"message_id": "m3", "sender_id": "u", "event_time": 1_000u64});
    assert_eq!(d.post_hook("alerts", &stale).0, 409, "stale");
    let (code, text) = http_get(&d.url("/metrics"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
    assert_eq!(code, 200);
    for (outcome, count) in [("refused", 4), ("stale", 1), ("accepted", 0)] {
        let line = format!("imgate_intake_messages_total{{provider=\"webhook\",outcome=\"{outcome}\"}} {count}\n");
        assert!(text.contains(&line), "{line}{text}");
    }
}

#[test]
fn metrics_follow_prometheus_rules_and_describe_the_build_and_the_process() {
    // Every provider whose section needs no account, so their families are in too.
    let extra = "[slack]\napi_base = http://127.0.0.1:9\n[discord]\napi_base = http://127.0.0.1:9\n\
                 [dingtalk]\napi_base = http://127.0.0.1:9\noapi_base = http://127.0.0.1:9\n[wechat]\n[matrix]\n\
                 [wecom]\nws_url = ws://127.0.0.1:9\n";
    let dir = temp_dir("metrics-lint");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, extra));
    let (mut x, _) = d.bound_xagent();
    let (code, _) = d.post_hook("alerts", &json!({"message_id": "m1", "sender_id": "u", "text": "hi"}));
    assert_eq!(code, 202);
    assert!(x.next_push(Duration::from_secs(20)).is_some());
    let (code, _) = d.post_hook("alerts", &json!({"message_id": "m1", "sender_id": "u", "text": "hi"}));
    assert_eq!(code, 200, "a duplicate");
    let stale = json!({"message_id": "m2", "sender_id": "u", "event_time": 1_000u64});
    assert_eq!(d.post_hook("alerts", &stale).0, 409, "stale");
    let (code, text) = http_get(&d.url("/metrics"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
    assert_eq!(code, 200);
    // How each provider's messages ended, every outcome from the first scrape.
    for (provider, outcome, count) in [
        ("webhook", "accepted", 1),
        ("webhook", "duplicate", 1),
        ("webhook", "stale", 1),
        ("webhook", "full", 0),
        ("webhook", "failed", 0),
        ("webhook", "refused", 0),
        ("matrix", "accepted", 0),
    ] {
        let line = format!("imgate_intake_messages_total{{provider=\"{provider}\",outcome=\"{outcome}\"}} {count}\n");
        assert!(text.contains(&line), "{line}{text}");
    }
    let problems = metrics_problems(&text);
    assert!(problems.is_empty(), "{}\n\n{text}", problems.join("\n"));
    for family in [
        "imgate_build_info",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_cpu_seconds_total",
        "process_start_time_seconds",
        "imgate_slack_connections",
        "imgate_discord_sessions",
        "imgate_dingtalk_connections",
        "imgate_wechat_receivers",
        "imgate_matrix_sync_loops",
        "imgate_wecom_connections",
        "imgate_channel_pending",
    ] {
        assert!(text.contains(&format!("# TYPE {family} ")), "{family} missing:\n{text}");
    }
    assert!(
        text.contains(&format!("imgate_build_info{{version=\"{}\"", env!("CARGO_PKG_VERSION"))),
        "{text}"
    );
    // The checker finds what it is for.
    let bad =
        "# TYPE a_total gauge\na_total 1\n# HELP b x\n# TYPE b counter\nb 1\nc 2\n# HELP d y\n# TYPE d gauge\nd one\n";
    let found = metrics_problems(bad);
    for want in [
        "a_total: no HELP before its TYPE",
        "a_total: a gauge's name does not end in _total",
        "b: a counter's name ends in _total",
        "c: a sample before its TYPE",
        "d: value `one` is not a number",
    ] {
        assert!(found.iter().any(|p| p == want), "{want}: {found:?}");
    }
}
