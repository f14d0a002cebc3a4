//! The outbox as a user observes it: expiry at each enforcement point, caps with both overflow
//! policies, per-channel pause, counters in `/status`. Short TTLs, no long sleeps.

use std::time::{Duration, Instant};

use crate::common::*;
use serde_json::{json, Value};

fn start(tag: &str, queue: &str) -> Daemon {
    let dir = temp_dir(tag);
    let extra = format!("[webhook.ops]\nsecret = ops-secret-2\n\n[queue]\n{queue}");
    Daemon::start(&dir, &config_text(free_port(), &dir, None, &extra))
}

fn post(d: &Daemon, id: &str) -> (u16, Value) {
    d.post_hook(
        "alerts",
        &json!({"message_id": id, "sender_id": "u", "text": format!("text of {id}")}),
    )
}

fn channel_status(d: &Daemon) -> Value {
    get_json(&d.url("/status"))["channels"][0].clone()
}

fn bind(x: &mut Sim) -> String {
    x.hello("");
    let (cch, _) = x.open(None);
    assert_eq!(
        x.bind_webhook(&cch, "alerts", HOOK_SECRET)["payload"]["status"],
        "authenticated"
    );
    cch
}

fn pushed_ids(x: &mut Sim, quiet: Duration) -> Vec<String> {
    let mut ids = Vec::new();
    while let Some(p) = x.next_push(quiet) {
        ids.push(p["payload"]["message_id"].as_str().unwrap().to_string());
    }
    ids
}

#[test]
fn messages_that_expire_while_imgate_is_stopped_are_never_delivered_and_are_counted() {
    let mut d = start("expire-stopped", "ttl = 1s\n");
    let mut x = d.xagent();
    let cch = bind(&mut x);
    let connector_id = d.connector_id();
    x.close();
    std::thread::sleep(Duration::from_millis(100));
    for i in 0..3 {
        assert_eq!(post(&d, &format!("e{i}")).0, 202);
    }
    d.kill();
    std::thread::sleep(Duration::from_millis(1200));
    let d = d.restart();
    let s = channel_status(&d);
    assert_eq!(
        (s["pending"].as_u64(), s["expired"].as_u64()),
        (Some(0), Some(3)),
        "startup sweep: {s}"
    );
    let mut y = d.xagent();
    y.hello(&connector_id);
    y.open(Some(&cch));
    assert!(
        y.next_push(Duration::from_millis(800)).is_none(),
        "an expired message is never pushed"
    );
    assert!(d.log_shows("expired", Duration::from_secs(5)), "expiry is logged");
}

#[test]
fn a_message_that_expires_while_unbound_is_not_delivered_on_binding() {
    let d = start("expire-read", "ttl = 1s\ncleanup_interval = 1h\n");
    assert_eq!(post(&d, "late").0, 202);
    std::thread::sleep(Duration::from_millis(1100));
    let mut x = d.xagent();
    bind(&mut x);
    // The sweep has not run (cleanup_interval is clamped to 500ms, so it may have): either way
    // the read path skips it.
    assert!(x.next_push(Duration::from_millis(800)).is_none());
    // The next enqueue removes the expired head and counts it.
    assert_eq!(post(&d, "fresh").0, 202);
    assert_eq!(pushed_ids(&mut x, Duration::from_secs(2)), ["fresh"]);
    wait_until("the expired one is counted", || channel_status(&d)["expired"] == 1);
}

#[test]
fn expiries_at_the_senders_pace_are_one_line_a_minute_and_all_counted() {
    // Nobody reads the queue: each new message finds the one before it expired.
    let d = start("expire-quiet", "ttl = 1s\ncleanup_interval = 1h\n");
    for i in 0..3 {
        assert_eq!(post(&d, &format!("q{i}")).0, 202);
        std::thread::sleep(Duration::from_millis(1100));
    }
    assert_eq!(post(&d, "q3").0, 202);
    assert_eq!(get_json(&d.url("/status"))["unbound"]["expired"], 3);
    assert_eq!(
        d.log().matches("expired undelivered").count(),
        1,
        "one line for three expiries: {}",
        d.log()
    );
}

#[test]
fn periodic_maintenance_expires_undelivered_messages_within_the_cleanup_interval() {
    let d = start("expire-sweep", "ttl = 2s\ncleanup_interval = 1s\n");
    assert_eq!(post(&d, "s1").0, 202);
    assert_eq!(get_json(&d.url("/status"))["unbound"]["pending"], 1);
    wait_until("the sweep expires it", || {
        let u = get_json(&d.url("/status"))["unbound"].clone();
        u["pending"] == 0 && u["expired"] == 1
    });
}

#[test]
fn reject_new_answers_503_at_the_message_cap_and_stores_nothing() {
    let d = start("reject", "max_messages_per_channel = 2\noverflow = reject_new\n");
    assert_eq!(post(&d, "r1").0, 202);
    assert_eq!(post(&d, "r2").0, 202);
    assert_eq!(post(&d, "r3"), (503, json!({"error": "capacity_exceeded"})));
    assert_eq!(post(&d, "r4").0, 503);
    assert_eq!(get_json(&d.url("/status"))["unbound"]["pending"], 2);
    assert_eq!(
        d.log().matches("reject_new").count(),
        1,
        "refusals at the senders' rate are one line a minute: {}",
        d.log()
    );
    let mut x = d.xagent();
    bind(&mut x);
    assert_eq!(pushed_ids(&mut x, Duration::from_secs(2)), ["r1", "r2"]);
    // Once delivered there is room again, and r3 was never deduped.
    wait_until("delivery frees the queue", || channel_status(&d)["pending"] == 0);
    assert_eq!(post(&d, "r3").0, 202);
}

#[test]
fn reject_new_answers_503_at_the_byte_caps() {
    // Measure one stored record first, then set the caps in units of it.
    let probe = start("bytes-probe", "");
    assert_eq!(post(&probe, "b0").0, 202);
    let r = get_json(&probe.url("/status"))["unbound"]["pending_bytes"]
        .as_u64()
        .unwrap();
    drop(probe);
    let queue = format!(
        "max_bytes_per_channel = {}\nmax_bytes_total = {}\noverflow = reject_new\n",
        r * 5 / 2,
        r * 7 / 2
    );
    let d = start("reject-bytes", &queue);
    let ops = |id: &str| {
        http_post(
            &d.url("/hooks/ops"),
            &[("Authorization", "Bearer ops-secret-2")],
            &json!({"message_id": id, "sender_id": "u", "text": format!("text of {id}")}).to_string(),
        )
        .0
    };
    assert_eq!(post(&d, "b1").0, 202);
    assert_eq!(post(&d, "b2").0, 202);
    assert_eq!(post(&d, "b3").0, 503, "max_bytes_per_channel");
    assert_eq!(ops("o1"), 202);
    assert_eq!(ops("o2"), 503, "max_bytes_total");
    let s = get_json(&d.url("/status"));
    assert!(s["outbox"]["pending_bytes"].as_u64().unwrap() <= r * 7 / 2, "{s}");
    assert_eq!(s["unbound"]["pending"], 3);
}

#[test]
fn drop_oldest_evicts_the_oldest_pending_and_counts_it() {
    let d = start("drop", "max_messages_per_channel = 3\n");
    let mut x = d.xagent();
    let cch = bind(&mut x);
    x.request("channel.close", Some(&cch), json!({}));
    for i in 0..5 {
        assert_eq!(
            post(&d, &format!("d{i}")).0,
            202,
            "drop_oldest always accepts the new message"
        );
    }
    let s = channel_status(&d);
    assert_eq!(
        (s["pending"].as_u64(), s["evicted"].as_u64()),
        (Some(3), Some(2)),
        "{s}"
    );
    assert_eq!(
        d.log().matches("capacity_exceeded").count(),
        1,
        "a burst of evictions is one line a minute: {}",
        d.log()
    );
    x.open(Some(&cch));
    assert_eq!(pushed_ids(&mut x, Duration::from_secs(2)), ["d2", "d3", "d4"]);
    let (code, metrics) = http_get(&d.url("/metrics"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
    assert_eq!(code, 200);
    assert!(
        metrics.contains(&format!(
            "imgate_channel_evicted_total{{channel=\"{cch}\",provider=\"webhook\"}} 2"
        )),
        "{metrics}"
    );
}

#[test]
fn drop_oldest_evicts_at_the_channel_byte_cap() {
    let d = start("drop-bytes", "max_bytes_per_channel = 4KiB\n");
    let big = "y".repeat(700);
    for i in 0..6 {
        let (code, _) = d.post_hook(
            "alerts",
            &json!({"message_id": format!("y{i}"), "sender_id": "u", "text": big}),
        );
        assert_eq!(code, 202);
    }
    let u = get_json(&d.url("/status"))["unbound"].clone();
    assert!(u["pending_bytes"].as_u64().unwrap() <= 4096, "{u}");
    let (pending, evicted) = (u["pending"].as_u64().unwrap(), u["evicted"].as_u64().unwrap());
    assert!(
        evicted >= 1 && pending + evicted == 6,
        "every message is pending or counted evicted: {u}"
    );
}

#[test]
fn a_closed_channel_pauses_alone_while_another_channel_keeps_flowing() {
    let d = start("pause", "");
    let mut x = d.xagent();
    let alerts = bind(&mut x);
    let (ops, _) = x.open(None);
    assert_eq!(
        x.bind_webhook(&ops, "ops", "ops-secret-2")["payload"]["status"],
        "authenticated"
    );
    x.request("channel.close", Some(&alerts), json!({}));
    assert_eq!(post(&d, "a1").0, 202);
    let (code, _) = http_post(
        &d.url("/hooks/ops"),
        &[("Authorization", "Bearer ops-secret-2")],
        &json!({"message_id": "o1", "sender_id": "u"}).to_string(),
    );
    assert_eq!(code, 202);
    let p = x
        .next_push(Duration::from_secs(5))
        .expect("the open channel still flows");
    assert_eq!(
        (p["connector_channel_id"].as_str(), p["payload"]["message_id"].as_str()),
        (Some(ops.as_str()), Some("o1"))
    );
    assert!(
        x.next_push(Duration::from_millis(500)).is_none(),
        "the closed channel holds its head"
    );
    x.open(Some(&alerts));
    let p = x.next_push(Duration::from_secs(5)).unwrap();
    assert_eq!(p["payload"]["message_id"], "a1");
}

#[test]
fn a_batch_of_pushes_is_confirmed_by_one_ping() {
    let d = start("batch", "");
    for i in 0..10 {
        assert_eq!(post(&d, &format!("p{i}")).0, 202);
    }
    let mut x = d.xagent();
    x.auto_pong = false;
    bind(&mut x);
    let mut kinds = Vec::new();
    while let Some(v) = x.recv_within(Duration::from_millis(500)) {
        kinds.push(v["type"].as_str().unwrap().to_string());
    }
    let kinds: Vec<String> = x
        .inbox
        .drain(..)
        .map(|v| v["type"].as_str().unwrap().to_string())
        .chain(kinds)
        .collect();
    let pushes = kinds.iter().filter(|k| *k == "message.push").count();
    let pings = kinds.iter().filter(|k| *k == "ping").count();
    assert_eq!((pushes, pings), (10, 1), "{kinds:?}");
    assert_eq!(
        kinds.last().map(String::as_str),
        Some("ping"),
        "the ping follows the pushes"
    );
    assert_eq!(
        channel_status(&d)["pending"],
        10,
        "nothing is delivered before the pong"
    );
}

/// A checkpoint's commit may grow the database file, and redb syncs the longer file under the
/// lock every read transaction begins with. Accepts must not wait for that sync: while a
/// checkpoint is in flight the outbox reads from the snapshot taken when it started. Here the
/// database's syncs are held (a preloaded shim, as a slow SD card would hold them) from before
/// the first checkpoint until the messages after it have filled much of the other log file.
#[test]
fn accepts_go_on_while_a_checkpoint_waits_for_the_disk_and_nothing_is_lost() {
    let dir = temp_dir("held-checkpoint");
    let flag = dir.join("hold");
    let env = sync_hold_env("/imgate.redb", &flag);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let config = config_text(free_port(), &dir, None, "[queue]\nmax_messages_per_channel = 5000\n");
    let mut d = Daemon::start_program(bin(), &dir, &config, "warn", &env);
    let checkpoints = || {
        let (_, text) = http_get(&d.url("/metrics"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
        text.lines()
            .find_map(|l| l.strip_prefix("imgate_outbox_checkpoints_total "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .expect("the checkpoint count in /metrics")
    };
    let before = checkpoints();
    std::fs::write(&flag, "").unwrap();
    // 1,200 messages of 1 KiB from 4 senders: the checkpoint starts at 512 KiB of log (about
    // 380 of them); the rest go into the other file (1.1 of its 2 MiB) while it waits. Each
    // POST fails after 10 s.
    post_load(&d, 4, 300, &"x".repeat(1000), "held");
    assert!(
        dir.join("hold.held").exists(),
        "the checkpoint's sync was held while they were accepted (a dynamically linked imgate preloads the shim)"
    );
    std::fs::remove_file(&flag).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while checkpoints() == before {
        assert!(
            Instant::now() < deadline,
            "the held checkpoint ends once the disk syncs"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    d.kill();
    let d = d.restart();
    let status = get_json(&d.url("/status"));
    assert_eq!(
        status["unbound"]["pending"], 1200,
        "every message accepted is kept: {status}"
    );
}
