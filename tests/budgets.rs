//! Edge budgets of a (cross-)built binary: size, peak RSS idle and with a 50 MiB backlog, cold
//! start to READY=1. Prints figures; asserts nothing about them.
//!
//!     cross/budgets.sh     (builds x86_64-unknown-linux-musl, then runs this with IMGATE_BIN)

mod common;

use std::os::unix::net::UnixDatagram;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Starts the binary under a fake systemd notify socket; returns the time to READY=1.
fn time_to_ready(dir: &std::path::Path, config: &std::path::Path) -> (std::process::Child, Duration) {
    let path = dir.join(format!("notify-{}.sock", ids()));
    let sock = UnixDatagram::bind(&path).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let start = Instant::now();
    let mut child = Command::new(bin())
        .args(["run", "--config"])
        .arg(config)
        .env("NOTIFY_SOCKET", &path)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut buf = [0u8; 64];
    loop {
        match sock.recv(&mut buf) {
            Ok(n) if &buf[..n] == b"READY=1" => return (child, start.elapsed()),
            Ok(_) => {}
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("no READY=1 from {}: {e}", bin());
            }
        }
    }
}

fn ids() -> u64 {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    N.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
}

fn term(mut child: std::process::Child) {
    Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status()
        .unwrap();
    child.wait().unwrap();
}

#[test]
#[ignore = "budgets: cross/budgets.sh"]
fn edge_budgets() {
    println!("binary under test: {}", bin());
    let aarch64 = concat!(env!("CARGO_MANIFEST_DIR"), "/dist/imgate-aarch64-unknown-linux-musl");
    match std::fs::metadata(aarch64) {
        Ok(m) => println!(
            "{:<52} {} KiB",
            "stripped aarch64-unknown-linux-musl binary",
            m.len() / 1024
        ),
        Err(_) => println!("aarch64 binary not built (cross/build.sh aarch64-unknown-linux-musl)"),
    }
    let dir = temp_dir("budgets");
    let port = free_port();
    let config = dir.join("imgate.conf");
    let queue =
        "[queue]\nmax_messages_per_channel = 10000000\nmax_bytes_per_channel = 512MiB\nmax_bytes_total = 512MiB\n";
    std::fs::write(
        &config,
        config_text(port, &dir, None, queue).replace("log_level = debug", "log_level = info"),
    )
    .unwrap();

    let (child, ready) = time_to_ready(&dir, &config);
    println!(
        "{:<52} {:.1} ms",
        "cold start to READY, empty state dir",
        ready.as_secs_f64() * 1000.0
    );
    term(child);

    let d = Daemon::start_env(&dir, &std::fs::read_to_string(&config).unwrap(), "warn", &[]);
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    x.bind_webhook(&cch, "alerts", HOOK_SECRET);
    let idle = Instant::now();
    while idle.elapsed() < Duration::from_secs(30) {
        x.recv_within(Duration::from_millis(500));
    }
    println!(
        "{:<52} {} KiB",
        "peak RSS, one bound channel, idle 30 s (VmHWM)",
        hwm_kib(d.pid())
    );
    // Then 30 s more: how often the idle daemon wakes (xAgent connected, keepalive pings).
    // Threads are sampled twice a second: most of the time, and at most.
    let (before, from) = (wakeups(d.pid()), Instant::now());
    let mut threads = std::collections::BTreeMap::<u64, u32>::new();
    while from.elapsed() < Duration::from_secs(30) {
        x.recv_within(Duration::from_millis(500));
        *threads.entry(proc_field(d.pid(), "status", "Threads:")).or_default() += 1;
    }
    let usual = threads.iter().max_by_key(|(_, seen)| **seen).map_or(0, |(n, _)| *n);
    let most = threads.keys().last().copied().unwrap_or(0);
    let per_second = (wakeups(d.pid()) - before) as f64 / from.elapsed().as_secs_f64();
    println!(
        "{:<52} {per_second:.2}",
        "wake-ups a second, all threads, idle (budget 2)"
    );
    println!(
        "{:<52} {usual} most of the time, at most {most}",
        "threads, idle (budget 8)"
    );
    x.close();
    std::thread::sleep(Duration::from_millis(200));

    let text = "b".repeat(1000);
    let mut round = 0;
    while get_json(&d.url("/status"))["outbox"]["pending_bytes"].as_u64().unwrap() < 50 << 20 {
        post_load(&d, 16, 250, &text, &format!("fill{round}"));
        round += 1;
    }
    println!(
        "{:<52} {} KiB",
        "peak RSS while holding a 50 MiB backlog",
        hwm_kib(d.pid())
    );
    let pid = d.pid();
    println!(
        "{:<52} anon {} KiB, file {} KiB, threads {}",
        "  RSS now",
        proc_field(pid, "status", "RssAnon:"),
        proc_field(pid, "status", "RssFile:"),
        proc_field(pid, "status", "Threads:")
    );
    d.signal("TERM");
    let mut d = d;
    d.wait_exit(Duration::from_secs(10)).expect("clean stop");

    let (child, ready) = time_to_ready(&dir, &config);
    println!(
        "{:<52} {:.1} ms",
        "cold start to READY, 50 MiB backlog (after SIGTERM)",
        ready.as_secs_f64() * 1000.0
    );
    std::thread::sleep(Duration::from_secs(2));
    println!("{:<52} {} KiB", "peak RSS after that start, idle", hwm_kib(child.id()));
    let _ = Command::new("kill").arg("-KILL").arg(child.id().to_string()).status();
    let mut child = child;
    let _ = child.wait();
    let (child, ready) = time_to_ready(&dir, &config);
    println!(
        "{:<52} {:.1} ms",
        "start to READY after SIGKILL, 50 MiB backlog",
        ready.as_secs_f64() * 1000.0
    );
    term(child);
}
