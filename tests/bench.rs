//! Throughput, latency, memory and disk figures of a release `imgate` over loopback.
//! Prints figures; asserts nothing about speed.
//!
//!     cargo test --release --test bench -- --ignored --nocapture

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

/// `(commits, messages)` from `/metrics`.
fn commits(d: &Daemon) -> (u64, u64) {
    let (_, text) = http_get(&d.url("/metrics"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
    let get = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    (
        get("imgate_outbox_commits_total "),
        get("imgate_outbox_committed_messages_total "),
    )
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn pending(d: &Daemon) -> u64 {
    get_json(&d.url("/status"))["channels"][0]["pending"]
        .as_u64()
        .unwrap_or(0)
}

#[test]
#[ignore = "benchmark: cargo test --release --test bench -- --ignored --nocapture"]
fn bench_outbox_and_data_plane() {
    let dir = temp_dir("bench");
    let queue =
        "[queue]\nmax_messages_per_channel = 10000000\nmax_bytes_per_channel = 512MiB\nmax_bytes_total = 512MiB\n";
    let d = Daemon::start_logging(&dir, &config_text(free_port(), &dir, None, queue), "warn");
    let pid = d.pid();
    let mut figures: Vec<(String, String)> = Vec::new();
    let mut fig = |k: &str, v: String| {
        println!("{k:<46} {v}");
        figures.push((k.to_string(), v));
    };
    if cfg!(debug_assertions) {
        println!("note: debug build; run with --release for real figures");
    }

    // Idle with one bound channel.
    let mut x = d.xagent();
    x.hello("");
    let (cch, _) = x.open(None);
    x.bind_webhook(&cch, "alerts", HOOK_SECRET);
    let connector_id = d.connector_id();
    std::thread::sleep(Duration::from_secs(2));
    fig(
        "peak RSS idle, one bound channel (VmHWM)",
        format!("{} KiB", hwm_kib(pid)),
    );
    x.close();
    std::thread::sleep(Duration::from_millis(200));

    // Acceptance without delivery (the backlog builds on disk).
    let w0 = written(pid);
    let rate1 = post_load(&d, 1, 2000, "hello", "one");
    let w1 = written(pid);
    fig("accepted/s, 1 sender (202 after commit)", format!("{rate1:.0}"));
    fig(
        "disk bytes written per message, 1 sender",
        format!("{}", (w1 - w0) / 2000),
    );
    let (c0, m0) = commits(&d);
    let rate16 = post_load(&d, 16, 500, "hello", "sixteen");
    let w2 = written(pid);
    let (c1, m1) = commits(&d);
    fig(
        "messages per group commit, 16 senders",
        format!("{:.1}", (m1 - m0) as f64 / (c1 - c0).max(1) as f64),
    );
    fig("accepted/s, 16 senders (group commit)", format!("{rate16:.0}"));
    fig(
        "disk bytes written per message, 16 senders",
        format!("{}", (w2 - w1) / 8000),
    );

    // Delivery of the 10,000-message backlog.
    let backlog = pending(&d);
    let start = Instant::now();
    let mut y = d.xagent();
    y.hello(&connector_id);
    y.open(Some(&cch));
    let mut got = 0;
    while got < backlog {
        if y.next_push(Duration::from_secs(5)).is_none() {
            break;
        }
        got += 1;
    }
    while pending(&d) > 0 {
        y.recv_within(Duration::from_millis(20));
    }
    let secs = start.elapsed().as_secs_f64();
    fig(
        "delivered/s (backlog, push + ping/pong + commit)",
        format!("{:.0} ({got} messages)", got as f64 / secs),
    );

    // End-to-end latency POST -> message.push, one message at a time.
    let arrivals: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let receiver = {
        let (arrivals, stop) = (arrivals.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                if let Some(p) = y.recv_within(Duration::from_millis(50)) {
                    if p["type"] == "message.push" {
                        let id = p["payload"]["message_id"].as_str().unwrap().to_string();
                        arrivals.lock().unwrap().insert(id, Instant::now());
                    }
                }
            }
            y
        })
    };
    let agent = load_agent();
    let mut sent = Vec::new();
    for i in 0..500 {
        let id = format!("lat-{i}");
        let t = Instant::now();
        let r = agent
            .post(&d.url("/hooks/alerts"))
            .header("Authorization", &format!("Bearer {HOOK_SECRET}"))
            .send(json!({"message_id": id, "sender_id": "bench", "text": "ping"}).to_string())
            .unwrap();
        assert_eq!(r.status().as_u16(), 202);
        sent.push((id, t));
        std::thread::sleep(Duration::from_millis(2));
    }
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::SeqCst);
    let y = receiver.join().unwrap();
    let arrivals = arrivals.lock().unwrap();
    let mut lat: Vec<Duration> = sent
        .iter()
        .filter_map(|(id, t)| arrivals.get(id).map(|a| *a - *t))
        .collect();
    lat.sort();
    fig(
        "latency POST -> message.push p50 / p99",
        format!(
            "{:.2} ms / {:.2} ms ({} samples)",
            ms(percentile(&lat, 0.5)),
            ms(percentile(&lat, 0.99)),
            lat.len()
        ),
    );
    y.close();
    std::thread::sleep(Duration::from_millis(200));

    // A 50 MiB backlog.
    let text = "b".repeat(1000);
    let mut rounds = 0;
    while get_json(&d.url("/status"))["outbox"]["pending_bytes"].as_u64().unwrap() < 50 << 20 {
        post_load(&d, 16, 250, &text, &format!("backlog{rounds}"));
        rounds += 1;
    }
    let bytes = get_json(&d.url("/status"))["outbox"]["pending_bytes"].as_u64().unwrap();
    fig(
        "peak RSS while filling a 50 MiB backlog",
        format!("{} KiB ({} MiB held)", hwm_kib(pid), bytes >> 20),
    );
    let db = std::fs::metadata(dir.join("state/imgate.redb"))
        .map(|m| m.len())
        .unwrap_or(0);
    fig("database file with the backlog", format!("{} MiB", db >> 20));

    // Restart onto the backlog.
    let mut d = d;
    d.kill();
    let t = Instant::now();
    let d = d.restart();
    fig(
        "restart to listening with the 50 MiB backlog",
        format!("{:.0} ms", ms(t.elapsed())),
    );
    std::thread::sleep(Duration::from_secs(2));
    fig(
        "peak RSS after restart, backlog held, idle",
        format!("{} KiB", hwm_kib(d.pid())),
    );

    println!("\nfigures:");
    for (k, v) in &figures {
        println!("  {k}: {v}");
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
