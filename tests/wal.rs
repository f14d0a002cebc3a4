//! The outbox's write-ahead log under crashes at each step of its write path and under a log
//! that cannot be written: nothing that got a 202 is lost, the order holds, a torn record is
//! counted in /status, and a failed log answers 503 until it works again. The crash and fault
//! points are compiled into debug builds only (src/faults.rs), as `cargo test` builds.

use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use serde_json::json;

/// Posts numbered messages to `alerts` until the daemon stops answering (or `limit`); returns
/// the IDs that got a 202.
fn post_until_dead(d: &Daemon, prefix: &str, limit: usize) -> Vec<String> {
    let agent = load_agent();
    let mut accepted = Vec::new();
    for i in 0..limit {
        let id = format!("{prefix}{i:05}");
        let body = json!({"message_id": id, "sender_id": "u", "text": "t"}).to_string();
        match agent
            .post(&d.url("/hooks/alerts"))
            .header("Authorization", &format!("Bearer {HOOK_SECRET}"))
            .send(body)
        {
            Ok(r) if r.status().as_u16() == 202 => accepted.push(id),
            Ok(r) => panic!("unexpected {} for {id}", r.status()),
            Err(_) => break,
        }
    }
    accepted
}

/// Collects pushes on `channel` in arrival order until `want` are all seen, or none came for
/// 15 s: a slow (busy) machine delivers late, not never, so progress is waited on, not a clock.
fn pushes_until(d: &Daemon, channel: &str, want: &BTreeSet<String>) -> Vec<String> {
    let mut x = d.xagent();
    x.hello("");
    x.open(Some(channel));
    let mut got = Vec::new();
    let mut quiet_since = Instant::now();
    while !want.iter().all(|id| got.contains(id)) && quiet_since.elapsed() < Duration::from_secs(15) {
        if let Some(p) = x.next_push(Duration::from_secs(2)) {
            got.push(p["payload"]["message_id"].as_str().unwrap_or_default().to_string());
            quiet_since = Instant::now();
        }
    }
    got
}

fn assert_nothing_lost_and_in_order(pushed: &[String], accepted: &[String], point: &str) {
    let lost: Vec<_> = accepted.iter().filter(|id| !pushed.contains(id)).collect();
    assert!(
        lost.is_empty(),
        "{point}: {} of {} accepted never pushed, the first {:?}",
        lost.len(),
        accepted.len(),
        lost.first()
    );
    let firsts: Vec<&String> = pushed
        .iter()
        .enumerate()
        .filter(|(i, id)| !pushed[..*i].contains(id))
        .map(|(_, id)| id)
        .collect();
    assert!(
        firsts.windows(2).all(|w| w[0] < w[1]),
        "{point}: pushed out of acceptance order: {firsts:?}"
    );
}

fn log_status(d: &Daemon) -> (u64, u64) {
    let s = get_json(&d.url("/status"));
    (
        s["outbox"]["log_replayed"].as_u64().unwrap(),
        s["outbox"]["log_unreadable"].as_u64().unwrap(),
    )
}

#[test]
fn a_crash_at_each_step_of_the_write_path_loses_no_accepted_message() {
    // (fault point, which pass, whether the crash leaves a torn record behind)
    let points = [
        ("outbox-log-torn", 25, true),
        ("outbox-log-appended", 25, false),
        // Messages only in the log and in memory, then a checkpoint that writes the pending
        // ones: before it, inside its commit, and after it.
        ("outbox-checkpoint", 1, false),
        ("outbox-checkpoint-writing", 1, false),
        ("outbox-checkpoint-committed", 1, false),
    ];
    for (point, n, torn) in points {
        let dir = temp_dir("crashpoint");
        let plan = format!("{point}:{n}");
        // Caps that evict nothing: a checkpoint comes after 512 KiB of log.
        let queue =
            "[queue]\nmax_messages_per_channel = 1000000\nmax_bytes_per_channel = 1GiB\nmax_bytes_total = 1GiB\n";
        let mut d = Daemon::start_env(
            &dir,
            &config_text(free_port(), &dir, None, queue),
            "info",
            &[("IMGATE_TEST_CRASH", &plan)],
        );
        let (x, cch) = d.bound_xagent();
        x.close();
        let accepted = post_until_dead(&d, "m", 5000);
        assert!(
            d.wait_exit(Duration::from_secs(5)).is_some(),
            "{point}: the planned crash did not happen (fault points need a debug build)"
        );
        assert!(
            d.log_shows(&format!("killed at {point}"), Duration::from_secs(5)),
            "{point}: {}",
            d.log()
        );
        assert!(accepted.len() >= 10, "{point}: only {} accepted", accepted.len());

        let d = d.restart_env(&[]);
        let (_, unreadable) = log_status(&d);
        assert_eq!(unreadable, u64::from(torn), "{point}: unreadable records counted");
        let want: BTreeSet<String> = accepted.iter().cloned().collect();
        let pushed = pushes_until(&d, &cch, &want);
        assert_nothing_lost_and_in_order(&pushed, &accepted, point);
        if torn {
            assert!(
                d.log_shows("is unreadable", Duration::from_secs(5)),
                "{point}: the torn record is logged"
            );
        }
    }
}

#[test]
fn a_crash_during_replay_replays_again_and_loses_nothing() {
    let dir = temp_dir("crashreplay");
    let mut d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    let (x, cch) = d.bound_xagent();
    x.close();
    let accepted = post_until_dead(&d, "r", 40);
    assert_eq!(accepted.len(), 40);
    d.kill();
    // The next start dies right after its replay committed, before the log starts again.
    let status = Command::new(bin())
        .args(["run", "--config"])
        .arg(dir.join("imgate.conf"))
        .env("IMGATE_TEST_CRASH", "outbox-replayed:1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success(), "killed during startup");
    let d = d.restart_env(&[]);
    let (replayed, unreadable) = log_status(&d);
    assert_eq!((replayed, unreadable), (0, 0), "the first replay was committed whole");
    let want: BTreeSet<String> = accepted.iter().cloned().collect();
    let pushed = pushes_until(&d, &cch, &want);
    assert_nothing_lost_and_in_order(&pushed, &accepted, "replay");
}

#[test]
fn a_log_that_cannot_be_written_answers_503_loses_nothing_and_recovers() {
    log_fault_answers_503_loses_nothing_and_recovers("outbox-log-write");
}

/// The record reaches the file but its sync fails: refused and taken back like a failed write.
#[test]
fn a_log_that_cannot_be_synced_answers_503_loses_nothing_and_recovers() {
    log_fault_answers_503_loses_nothing_and_recovers("outbox-log-sync");
}

/// ENOSPC at `point` while a flag file exists: the senders hear 503, nothing refused is
/// stored, nothing accepted is lost, and the log recovers once the flag is gone.
fn log_fault_answers_503_loses_nothing_and_recovers(point: &str) {
    let dir = temp_dir("logfault");
    let flag = dir.join("log-fails");
    let fault = format!("{point}:{}", flag.display());
    let d = Daemon::start_env(
        &dir,
        &config_text(free_port(), &dir, None, ""),
        "info",
        &[("IMGATE_TEST_FAULT", &fault)],
    );
    let (x, cch) = d.bound_xagent();
    x.close();
    let mut accepted = post_until_dead(&d, "a", 30);
    assert_eq!(accepted.len(), 30);

    std::fs::write(&flag, b"").unwrap();
    for i in 0..10 {
        let (code, body) = d.post_hook("alerts", &json!({"message_id": format!("x{i}"), "sender_id": "u"}));
        assert_eq!(
            (code, body),
            (503, json!({"error": "storage_unavailable"})),
            "{point}: ENOSPC on the log"
        );
    }
    std::fs::remove_file(&flag).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (code, _) = d.post_hook("alerts", &json!({"message_id": "after", "sender_id": "u"}));
        if code == 202 {
            accepted.push("after".into());
            break;
        }
        assert_eq!(code, 503);
        assert!(Instant::now() < deadline, "{point}: the log never recovered");
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = d.log();
    assert_eq!(
        log.matches("store: writes fail").count(),
        1,
        "{point}: one line for the outage:\n{log}"
    );
    assert!(d.log_shows("store: writes work again", Duration::from_secs(5)), "{log}");

    let want: BTreeSet<String> = accepted.iter().cloned().collect();
    let pushed = pushes_until(&d, &cch, &want);
    assert_nothing_lost_and_in_order(&pushed, &accepted, point);
    for i in 0..10 {
        assert!(
            !pushed.contains(&format!("x{i}")),
            "{point}: a refused message was not stored"
        );
    }
}
