//! Limits and takeovers: the connector_id lease, max_connections, oversized packets, slow and
//! idle clients, a second data-plane connection taking a channel over.

use std::io::Read;
use std::time::{Duration, Instant};

use crate::common::*;
use serde_json::json;

#[test]
fn channels_are_unregistered_after_a_continuous_offline_lease_and_pending_messages_expire_after() {
    let dir = temp_dir("lease");
    let conf = "[xagent]\nlease = 1s\n[queue]\nttl = 3s\n";
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, conf));
    let (x, cch) = d.bound_xagent();
    x.close();
    assert_eq!(
        d.post_hook("alerts", &json!({"message_id": "while-away", "sender_id": "u"}))
            .0,
        202
    );
    let deadline = Instant::now() + Duration::from_secs(6);
    loop {
        let s = get_json(&d.url("/status"));
        if s["channels"].as_array().unwrap().is_empty() {
            assert_eq!(
                s["unbound"]["pending"], 1,
                "the pending message stays, unbound, under its TTL: {s}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "lease never expired: {s}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        d.log_shows("channel(s) unregistered", Duration::from_secs(5)),
        "the unregistration is logged"
    );
    let s = get_json(&d.url("/status"));
    assert_eq!(s["lease"]["channels_unregistered"], 1, "and counted: {s}");
    let (_, metrics) = http_get(&d.url("/metrics"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
    assert!(
        metrics.contains("imgate_lease_unregistered_channels_total 1"),
        "{metrics}"
    );
    // Still nobody there: the message expires by its TTL, counted, and is never pushed.
    let deadline = Instant::now() + Duration::from_secs(8);
    loop {
        let s = get_json(&d.url("/status"));
        if s["unbound"]["expired"] == 1 {
            assert_eq!(s["unbound"]["pending"], 0, "{s}");
            break;
        }
        assert!(Instant::now() < deadline, "the message never expired: {s}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut y = d.xagent();
    y.hello("");
    let (fresh, open) = y.open(Some(&cch));
    assert_ne!(fresh, cch, "the old channel is unknown now");
    assert_eq!(
        open["payload"]["connection_descriptor"]["connection"]["status"],
        "created"
    );
}

#[test]
fn a_reconnect_within_the_lease_keeps_every_channel() {
    let dir = temp_dir("lease-kept");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, "[xagent]\nlease = 3s\n"));
    let (x, cch) = d.bound_xagent();
    x.close();
    std::thread::sleep(Duration::from_millis(1500));
    let mut y = d.xagent();
    y.hello("");
    std::thread::sleep(Duration::from_millis(2500)); // past the first lease, but it was cancelled
    let (again, _) = y.open(Some(&cch));
    assert_eq!(again, cch);
}

#[test]
fn a_second_connection_takes_a_channel_over() {
    let dir = temp_dir("takeover");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    let (mut x, cch) = d.bound_xagent();
    let mut y = d.xagent();
    y.hello("");
    assert_eq!(y.open(Some(&cch)).0, cch);
    d.post_hook("alerts", &json!({"message_id": "t1", "sender_id": "u"}));
    assert_eq!(
        y.next_push(Duration::from_secs(5)).unwrap()["payload"]["message_id"],
        "t1"
    );
    assert!(
        x.next_push(Duration::from_millis(500)).is_none(),
        "the old connection no longer gets pushes"
    );
    let a = x.request("connection.descriptor.get", Some(&cch), json!({}));
    assert_eq!(a["error"]["code"], "channel_not_open", "nor answers for the channel");
}

#[test]
fn past_max_connections_only_an_authenticated_ws_upgrade_gets_in_and_then_503() {
    let dir = temp_dir("maxconn");
    let conf =
        config_text(free_port(), &dir, None, "").replace("log_level = debug", "log_level = debug\nmax_connections = 2");
    let d = Daemon::start(&dir, &conf);
    wait_until_alone(&d);
    // Two clients in the middle of a request (no head yet): not idle, nothing to close. The
    // daemon accepts in the order of the connects, so they hold the slots.
    let _a = std::net::TcpStream::connect(("127.0.0.1", d.port)).unwrap();
    let _b = std::net::TcpStream::connect(("127.0.0.1", d.port)).unwrap();
    let connect = || std::net::TcpStream::connect(("127.0.0.1", d.port)).unwrap();
    let card = "GET /connector-card.json HTTP/1.1\r\nHost: x\r\n\r\n";
    let answer = send_and_read_head(&mut connect(), card.as_bytes(), Duration::from_secs(5));
    assert!(
        answer.starts_with("HTTP/1.1 503"),
        "past the slots, a webhook or a card is refused: {answer:?}"
    );
    let ws = |key: &str| {
        format!(
            "GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Protocol: xagent.connector.packet.v1\r\nAuthorization: Bearer {key}\r\n\r\n"
        )
    };
    let answer = send_and_read_head(&mut connect(), ws("wrong-key").as_bytes(), Duration::from_secs(5));
    assert!(
        answer.starts_with("HTTP/1.1 503"),
        "a /ws without the key is refused: {answer:?}"
    );
    let mut xagent = connect();
    let answer = send_and_read_head(&mut xagent, ws(API_KEY).as_bytes(), Duration::from_secs(5));
    assert!(
        answer.starts_with("HTTP/1.1 101"),
        "xAgent's /ws gets in past the slots: {answer:?}"
    );
    // Past the reserve too: 503 at once.
    let _reserve: Vec<_> = (0..3).map(|_| connect()).collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut c = connect();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut answer = String::new();
    let _ = c.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer:?}\n{}", d.log());
    drop((_a, _b, _reserve));
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(http_get(&d.url("/connector-card.json"), &[]).0, 200, "slots come back");
}

#[test]
fn an_oversized_packet_closes_that_connection_not_the_process() {
    let dir = temp_dir("bigpacket");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    let mut x = d.xagent();
    x.hello("");
    let big = format!(
        r#"{{"schema":"xagent.connector.packet/v1","packet_id":"p","type":"ping","payload":{{"x":"{}"}}}}"#,
        "a".repeat(2 << 20)
    );
    x.send_raw(&big);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !d.log().contains("ended: read error") {
        assert!(
            Instant::now() < deadline,
            "the session ends on the oversized frame: {}",
            d.log()
        );
        let _ = x.recv_within(Duration::from_millis(50));
    }
    assert_eq!(
        http_get(&d.url("/connector-card.json"), &[]).0,
        200,
        "the process is fine"
    );
    let mut y = d.xagent();
    y.hello("");
    assert_eq!(
        y.request("ping", None, json!({}))["type"],
        "pong",
        "and so is the data plane"
    );
}

#[test]
fn slow_clients_are_cut_off_by_the_head_and_body_timeouts() {
    use std::io::Write;
    let dir = temp_dir("slowloris");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    let port = d.port;
    // One trickles its request head, one stalls in the middle of its body.
    let head = std::thread::spawn(move || {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let start = Instant::now();
        for b in b"POST /hooks/alerts HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n" {
            if s.write_all(&[*b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_secs(1));
        }
        start.elapsed()
    });
    let body = std::thread::spawn(move || {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(s, "POST /hooks/alerts HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {HOOK_SECRET}\r\nContent-Length: 100\r\n\r\n{{\"mess").unwrap();
        let start = Instant::now();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        start.elapsed()
    });
    // Meanwhile everyone else is served.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(http_get(&d.url("/connector-card.json"), &[]).0, 200);
    let head_cut = head.join().unwrap();
    let body_cut = body.join().unwrap();
    assert!(
        head_cut < Duration::from_secs(14),
        "a trickled head is cut at the 10 s head timeout: {head_cut:?}"
    );
    assert!(
        body_cut < Duration::from_secs(14),
        "a stalled body is cut after 10 s of silence: {body_cut:?}"
    );
    assert!(
        d.log_shows("request body stalled", Duration::from_secs(2)),
        "{}",
        d.log()
    );
    assert!(
        d.log_shows("request head not complete in time", Duration::from_secs(5)),
        "{}",
        d.log()
    );
}

#[test]
fn an_idle_keep_alive_connection_is_closed_after_60_s_and_its_slot_freed() {
    use std::io::Write;
    let dir = temp_dir("keepalive");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    let mut s = std::net::TcpStream::connect(("127.0.0.1", d.port)).unwrap();
    s.write_all(b"GET /connector-card.json HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut answer = [0u8; 12];
    s.read_exact(&mut answer).unwrap();
    assert_eq!(&answer, b"HTTP/1.1 200");
    // The rest of the answer, then nothing: the connection idles between requests.
    s.set_read_timeout(Some(Duration::from_secs(90))).unwrap();
    let idle_from = Instant::now();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    let idle = idle_from.elapsed();
    assert!(
        idle >= Duration::from_secs(50) && idle < Duration::from_secs(75),
        "closed after {idle:?}; an idle keep-alive connection gets 60 s, not the 10 s of a stalled body"
    );
    assert!(
        d.log_shows("idle keep-alive connection", Duration::from_secs(2)),
        "{}",
        d.log()
    );
}
