//! A 60 s soak: webhook senders, an xAgent that drops its connection every few seconds, tool
//! calls. It ends with every accepted message pushed, none after its expiry, and no growth of
//! RSS or open file descriptors once the load stops. Prints its figures.
//!
//!     cargo test --test soak -- --ignored --nocapture     (.ci/run runs it)

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::*;
use serde_json::json;

const SOAK: Duration = Duration::from_secs(60);

fn rss_kib(pid: u32) -> u64 {
    proc_field(pid, "status", "VmRSS:")
}

#[test]
#[ignore = "60 s soak: cargo test --test soak -- --ignored --nocapture"]
fn soak_with_flapping_xagent_loses_nothing_and_leaks_nothing() {
    let receiver = ReplyReceiver::start(200);
    let dir = temp_dir("soak");
    let d = Daemon::start_env(
        &dir,
        &config_text(free_port(), &dir, Some(&receiver.url), "[queue]\nttl = 10m\n"),
        "info",
        &[],
    );
    let pid = d.pid();
    let (x, cch) = d.bound_xagent();
    let connector_id = d.connector_id();
    x.close();
    let (fd0, rss0) = (fds(pid), rss_kib(pid));

    let stop = Arc::new(AtomicBool::new(false));
    let accepted: Arc<Mutex<Vec<String>>> = Arc::default();
    let senders: Vec<_> = (0..2)
        .map(|s| {
            let (stop, accepted, url) = (stop.clone(), accepted.clone(), d.url("/hooks/alerts"));
            std::thread::spawn(move || {
                let agent = load_agent();
                let mut i = 0;
                while !stop.load(Ordering::SeqCst) {
                    let id = format!("s{s}-{i:06}");
                    i += 1;
                    let body = json!({"message_id": id, "sender_id": "soak", "text": "load"}).to_string();
                    let r = agent
                        .post(&url)
                        .header("Authorization", &format!("Bearer {HOOK_SECRET}"))
                        .send(body);
                    if r.is_ok_and(|r| r.status().as_u16() == 202) {
                        accepted.lock().unwrap().push(id);
                    }
                    std::thread::sleep(Duration::from_millis(3));
                }
            })
        })
        .collect();

    let port = d.port;
    let pushed: Arc<Mutex<BTreeSet<String>>> = Arc::default();
    let late = Arc::new(Mutex::new(0u64));
    let xagent = {
        let (stop, pushed, late, cch, cid) = (
            stop.clone(),
            pushed.clone(),
            late.clone(),
            cch.clone(),
            connector_id.clone(),
        );
        std::thread::spawn(move || {
            let mut round = 0u64;
            while !stop.load(Ordering::SeqCst) {
                round += 1;
                let mut y = Sim::connect(port, Some(API_KEY));
                y.hello(&cid);
                y.open(Some(&cch));
                let until = Instant::now() + Duration::from_millis(1500 + (round % 4) * 700);
                let mut calls = 0;
                while Instant::now() < until {
                    if let Some(p) = y.next_push(Duration::from_millis(200)) {
                        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
                        if p["payload"]["expires_at"].as_u64().unwrap() <= now {
                            *late.lock().unwrap() += 1;
                        }
                        pushed
                            .lock()
                            .unwrap()
                            .insert(p["payload"]["message_id"].as_str().unwrap().to_string());
                        if calls < 3 {
                            let r = p["payload"]["reply"]["reply_ref"].as_str().unwrap().to_string();
                            y.tool(
                                &cch,
                                "imgate_message_reply",
                                json!({"reply_ref": r, "text": "ok"}),
                                &format!("soak-{round}-{calls}"),
                            );
                            calls += 1;
                        }
                    }
                }
                y.close(); // the flap: often before the barrier pong
            }
        })
    };

    std::thread::sleep(SOAK);
    stop.store(true, Ordering::SeqCst);
    for s in senders {
        s.join().unwrap();
    }
    xagent.join().unwrap();

    // Drain what is left.
    let mut z = d.xagent();
    z.hello(&connector_id);
    z.open(Some(&cch));
    // For as long as it drains (a new message pushed, fewer pending): a busy machine is slower.
    let mut progress = Progress::new(QUIET);
    loop {
        while let Some(p) = z.next_push(Duration::from_millis(300)) {
            pushed
                .lock()
                .unwrap()
                .insert(p["payload"]["message_id"].as_str().unwrap().to_string());
        }
        let pending = get_json(&d.url("/status"))["channels"][0]["pending"].clone();
        if pending == 0 {
            break;
        }
        assert!(
            progress.moving((pushed.lock().unwrap().len(), pending)),
            "the backlog never drained (none delivered for {QUIET:?})"
        );
    }
    z.close();
    std::thread::sleep(Duration::from_millis(500));
    let (fd1, rss1) = (fds(pid), rss_kib(pid));
    std::thread::sleep(Duration::from_secs(3));
    let (fd2, rss2) = (fds(pid), rss_kib(pid));

    let accepted = accepted.lock().unwrap();
    let pushed = pushed.lock().unwrap();
    let lost: Vec<&String> = accepted.iter().filter(|id| !pushed.contains(*id)).collect();
    let s = get_json(&d.url("/status"));
    println!(
        "soak: {} accepted, {} pushed, {} tool calls answered, attempts {}, fds {fd0} -> {fd1} -> {fd2}, RSS {rss0} -> {rss1} -> {rss2} KiB",
        accepted.len(),
        pushed.len(),
        receiver.rx.try_iter().count(),
        s["channels"][0]["attempts"]
    );
    assert!(accepted.len() > 1000, "the soak carried real traffic");
    assert!(
        lost.is_empty(),
        "{} accepted messages never pushed, e.g. {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
    assert_eq!(*late.lock().unwrap(), 0, "a message was pushed after its expiry");
    assert!(
        fd2 <= fd1 && fd1 <= fd0 + 4,
        "open files must not grow: {fd0} -> {fd1} -> {fd2}"
    );
    assert!(
        rss2 <= rss1 + 256,
        "RSS must not grow after the load: {rss1} -> {rss2} KiB"
    );
}
