//! SIGKILL at random moments while webhook traffic flows and xAgent receives: every message that
//! got a 202 is eventually pushed, none after its expiry, and per channel the pushes of every
//! connection come in acceptance order.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::common::*;
use serde_json::{json, Value};

const ROUNDS: usize = 24;
const OPS_SECRET: &str = "ops-secret-crash";

/// A small deterministic generator; the seed is printed so a failure can be replayed.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// Everything the simulated xAgent saw: per connection, the pushes in arrival order.
#[derive(Default)]
struct Seen {
    connections: Vec<Vec<(String, String)>>, // (channel, message_id)
    late: Vec<String>,                       // pushed at or after expires_at
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

/// Connects, reopens both channels and records pushes until the connection dies or `stop`.
fn receive(port: u16, connector_id: String, channels: Vec<String>, seen: Arc<Mutex<Seen>>, stop: Arc<AtomicBool>) {
    let Ok(ws) = std::panic::catch_unwind(|| Sim::connect(port, Some(API_KEY))) else {
        return;
    };
    let mut x = ws;
    let idx = {
        let mut s = seen.lock().unwrap();
        s.connections.push(Vec::new());
        s.connections.len() - 1
    };
    let setup = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        x.hello(&connector_id);
        for c in &channels {
            x.open(Some(c));
        }
    }));
    if setup.is_err() {
        return;
    }
    let record = |p: &Value| {
        let mut s = seen.lock().unwrap();
        let id = p["payload"]["message_id"].as_str().unwrap().to_string();
        if now_ms() >= p["payload"]["expires_at"].as_u64().unwrap() {
            s.late.push(id.clone());
        }
        s.connections[idx].push((p["connector_channel_id"].as_str().unwrap().to_string(), id));
    };
    for p in std::mem::take(&mut x.inbox) {
        if p["type"] == "message.push" {
            record(&p);
        }
    }
    while !stop.load(Ordering::SeqCst) {
        let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            x.recv_within(Duration::from_millis(200))
        }));
        match got {
            Ok(Some(p)) if p["type"] == "message.push" => record(&p),
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => {
                // recv_within returns None on timeout as well as on close; probe the socket.
                if std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
                    return;
                }
            }
        }
    }
}

/// Posts numbered messages to one endpoint until the daemon dies; returns the 202-ed IDs.
fn send(
    port: u16,
    endpoint: &str,
    secret: &str,
    prefix: &str,
    start: u64,
    stop: Arc<AtomicBool>,
) -> (Vec<String>, u64) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(2)))
        .build()
        .into();
    let url = format!("http://127.0.0.1:{port}/hooks/{endpoint}");
    let mut accepted = Vec::new();
    let mut n = start;
    while !stop.load(Ordering::SeqCst) {
        let id = format!("{prefix}{n:06}");
        n += 1;
        let body = json!({"message_id": id, "sender_id": "crash", "text": "x"}).to_string();
        match agent
            .post(&url)
            .header("Authorization", &format!("Bearer {secret}"))
            .send(body)
        {
            Ok(r) if r.status().as_u16() == 202 => accepted.push(id),
            Ok(r) => panic!("unexpected answer {} for {id}", r.status()),
            Err(_) => break, // killed mid-request: this one may or may not be stored
        }
    }
    (accepted, n)
}

#[test]
fn sigkill_at_random_points_loses_no_accepted_message_and_keeps_order() {
    let seed = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64;
    println!("crash test seed {seed}");
    let mut rng = Lcg(seed);
    let dir = temp_dir("crash");
    let extra = format!("[webhook.ops]\nsecret = {OPS_SECRET}\n\n[queue]\nttl = 10m\n");
    let mut d = Daemon::start(&dir, &config_text(free_port(), &dir, None, &extra));
    let port = d.port;

    let mut x = d.xagent();
    x.hello("");
    let (alerts, _) = x.open(None);
    assert_eq!(
        x.bind_webhook(&alerts, "alerts", HOOK_SECRET)["payload"]["status"],
        "authenticated"
    );
    let (ops, _) = x.open(None);
    assert_eq!(
        x.bind_webhook(&ops, "ops", OPS_SECRET)["payload"]["status"],
        "authenticated"
    );
    let connector_id = d.connector_id();
    x.close();

    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut accepted: HashMap<&str, Vec<String>> = HashMap::new();
    let (mut next_a, mut next_o) = (0u64, 0u64);
    let spawn_receiver = |stop: &Arc<AtomicBool>| {
        let (seen, stop, cid) = (seen.clone(), stop.clone(), connector_id.clone());
        let chans = vec![alerts.clone(), ops.clone()];
        std::thread::spawn(move || receive(port, cid, chans, seen, stop))
    };
    for round in 0..ROUNDS {
        if round > 0 {
            d = d.restart();
        }
        let stop = Arc::new(AtomicBool::new(false));
        let receiver = spawn_receiver(&stop);
        let a = {
            let stop = stop.clone();
            std::thread::spawn(move || send(port, "alerts", HOOK_SECRET, "a", next_a, stop))
        };
        let o = {
            let stop = stop.clone();
            std::thread::spawn(move || send(port, "ops", OPS_SECRET, "o", next_o, stop))
        };
        std::thread::sleep(Duration::from_millis(20 + rng.below(300)));
        d.kill();
        stop.store(true, Ordering::SeqCst);
        let (acc_a, n_a) = a.join().unwrap();
        let (acc_o, n_o) = o.join().unwrap();
        receiver.join().unwrap();
        next_a = n_a;
        next_o = n_o;
        accepted.entry("a").or_default().extend(acc_a);
        accepted.entry("o").or_default().extend(acc_o);
    }

    // Last start: let everything drain.
    let d = d.restart();
    let stop = Arc::new(AtomicBool::new(false));
    let receiver = spawn_receiver(&stop);
    // For as long as the backlog shrinks: a busy machine drains it late, not never.
    let mut progress = Progress::new(QUIET);
    loop {
        let s = get_json(&d.url("/status"));
        let pending: u64 = s["channels"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["pending"].as_u64().unwrap())
            .sum();
        if pending == 0 {
            break;
        }
        assert!(
            progress.moving(pending),
            "backlog never drained (none delivered for {QUIET:?}): {s}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::SeqCst);
    receiver.join().unwrap();

    let seen = seen.lock().unwrap();
    let pushed: BTreeSet<&str> = seen.connections.iter().flatten().map(|(_, id)| id.as_str()).collect();
    let total: usize = accepted.values().map(Vec::len).sum();
    assert!(total > 100, "the test must actually accept traffic (got {total})");
    for ids in accepted.values() {
        for id in ids {
            assert!(
                pushed.contains(id.as_str()),
                "accepted message {id} was never pushed (seed {seed})"
            );
        }
    }
    assert!(seen.late.is_empty(), "pushed after expiry: {:?}", seen.late);
    for (i, conn) in seen.connections.iter().enumerate() {
        for ch in [&alerts, &ops] {
            let ids: Vec<&str> = conn
                .iter()
                .filter(|(c, _)| c == ch)
                .map(|(_, id)| id.as_str())
                .collect();
            assert!(
                ids.windows(2).all(|w| w[0] < w[1]),
                "connection {i}: out of order on {ch}: {ids:?} (seed {seed})"
            );
        }
    }
    let redelivered = seen.connections.iter().flatten().count() - pushed.len();
    println!(
        "crash test: {ROUNDS} kills, {total} accepted, {} distinct pushed, {redelivered} redeliveries, {} connections",
        pushed.len(),
        seen.connections.len()
    );
}
