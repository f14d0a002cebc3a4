//! The port as a hostile client sees it: raw TCP against a real imgate. Each numbered finding of
//! the HTTP-edge review is a test here; none of them may crash the process, leak a slot, grow
//! its memory or starve the clients that behave.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;
use serde_json::json;

/// Everything the daemon answers to `bytes` on a fresh connection until it closes it or
/// `wait` passes; and whether it closed it.
fn exchange(port: u16, bytes: &[u8], wait: Duration) -> (String, bool) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let _ = s.write_all(bytes);
    read_until_closed(&mut s, wait)
}

fn read_until_closed(s: &mut TcpStream, wait: Duration) -> (String, bool) {
    let deadline = Instant::now() + wait;
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return (String::from_utf8_lossy(&got).into_owned(), false);
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut chunk) {
            Ok(0) => return (String::from_utf8_lossy(&got).into_owned(), true),
            Ok(n) => got.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut => {
                return (String::from_utf8_lossy(&got).into_owned(), false)
            }
            Err(_) => return (String::from_utf8_lossy(&got).into_owned(), true),
        }
    }
}

fn rss_kib(d: &Daemon) -> u64 {
    proc_field(d.pid(), "status", "VmRSS:")
}

fn metric(d: &Daemon, line_start: &str) -> u64 {
    let (_, text) = http_get(&d.url("/metrics"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
    text.lines()
        .find_map(|l| l.strip_prefix(line_start))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no `{line_start}` in /metrics:\n{text}"))
}

fn alive(d: &Daemon) {
    let (status, _) = http_get(&d.url("/health"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
    assert_eq!(status, 200, "the daemon still answers:\n{}", d.log());
}

fn daemon(tag: &str) -> Daemon {
    let dir = temp_dir(tag);
    Daemon::start(&dir, &config_text(free_port(), &dir, None, ""))
}

// ---------- 1. a hostile Content-Length ----------

fn huge_content_lengths_are_413(d: &Daemon) {
    let key = format!("Authorization: Bearer {API_KEY}\r\n");
    // With the secret: a head without it is refused (401) before its length matters.
    let hook = format!("Authorization: Bearer {HOOK_SECRET}\r\n");
    for length in ["1000000000000000", "18446744073709551615", "2147483648"] {
        for (line, auth) in [
            ("GET /skill.md", ""),
            ("GET /health", ""),
            ("GET /nowhere", ""),
            ("POST /hooks/alerts", hook.as_str()),
            ("POST /files/uploads", key.as_str()),
        ] {
            let req = format!("{line} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {length}\r\n\r\n");
            let (answer, closed) = exchange(d.port, req.as_bytes(), Duration::from_secs(5));
            assert!(answer.starts_with("HTTP/1.1 413"), "{line} with {length}: {answer:?}");
            assert!(closed, "{line} with {length}: the connection closes");
        }
    }
    let (answer, _) = exchange(
        d.port,
        b"GET /skill.md HTTP/1.1\r\nHost: x\r\nContent-Length: 18446744073709551616\r\n\r\n",
        Duration::from_secs(5),
    );
    assert!(answer.starts_with("HTTP/1.1 400"), "past u64: {answer:?}");
    alive(d);
}

#[test]
fn finding_1_a_huge_declared_content_length_is_413_and_the_process_lives() {
    huge_content_lengths_are_413(&daemon("edge-1"));
}

// ---------- 2. HTTP/2 ----------

fn http2_is_refused_without_holding_a_slot(d: &Daemon) {
    // More than max_connections (64): each must give its slot back.
    for i in 0..70 {
        let (req, want): (&[u8], &str) = if i % 2 == 0 {
            (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", "HTTP/1.1 505")
        } else {
            (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "")
        };
        let (answer, closed) = exchange(d.port, req, Duration::from_secs(5));
        assert!(closed, "closed at once: {answer:?}");
        assert!(answer.starts_with(want), "{answer:?}");
    }
    let mut x = d.xagent();
    x.hello("");
    x.close();
    alive(d);
}

#[test]
fn finding_2_http_2_requests_get_505_the_preface_is_closed_and_no_slot_leaks() {
    http2_is_refused_without_holding_a_slot(&daemon("edge-2"));
}

// ---------- 3. every request on a connection is framed ----------

#[test]
fn finding_3_a_second_request_on_a_connection_gets_its_own_head_deadline() {
    let d = daemon("edge-3");
    let port = d.port;
    // 70 connections: one request each, then a second head trickled a byte a second.
    let trickle = |port: u16| {
        std::thread::spawn(move || {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.write_all(b"GET /skill.md HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut first = [0u8; 12];
            if s.read_exact(&mut first).is_err() {
                return None; // refused with 503: all slots taken by the others
            }
            std::thread::sleep(Duration::from_millis(300)); // the rest of the first answer
            let started = Instant::now();
            for b in b"GET /skill.md HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n" {
                if s.write_all(&[*b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_secs(1));
            }
            Some(started.elapsed())
        })
    };
    let threads: Vec<_> = (0..70).map(|_| trickle(port)).collect();
    let cut: Vec<Duration> = threads.into_iter().filter_map(|t| t.join().unwrap()).collect();
    assert!(!cut.is_empty());
    for c in &cut {
        assert!(
            *c < Duration::from_secs(14),
            "a trickled second head is cut at 10 s: {c:?}"
        );
    }
    alive(&d);
}

#[test]
fn finding_3_requests_pipelined_and_sent_while_an_answer_goes_out_are_each_answered_in_order() {
    let d = daemon("edge-3-pipelined");
    let post = |id: &str, last: bool| {
        let body = format!(r#"{{"message_id":"{id}","sender_id":"u","text":"{id}"}}"#);
        let close = if last { "Connection: close\r\n" } else { "" };
        format!(
            "POST /hooks/alerts HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {HOOK_SECRET}\r\n{close}Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let mut s = TcpStream::connect(("127.0.0.1", d.port)).unwrap();
    // One answered alone, so the connection is waiting for its next request when the rest come.
    s.write_all(post("p1", false).as_bytes()).unwrap();
    let mut first = [0u8; 12];
    s.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"HTTP/1.1 202");
    std::thread::sleep(Duration::from_millis(100));
    // Two in one write (the second waits in imgate's buffer), then a third in its own write
    // while their answers go out (it waits in the kernel's).
    s.write_all(format!("{}{}", post("p2", false), post("p3", false)).as_bytes())
        .unwrap();
    s.write_all(post("p4", true).as_bytes()).unwrap();
    let (rest, closed) = read_until_closed(&mut s, Duration::from_secs(10));
    assert!(closed, "the last request asked to close: {rest:?}");
    let statuses: Vec<&str> = rest.split("HTTP/1.1 ").skip(1).map(|a| &a[..3]).collect();
    assert_eq!(statuses, ["202", "202", "202"], "{rest:?}");
    for id in ["p1", "p2", "p3", "p4"] {
        let (status, answer) = d.post_hook("alerts", &json!({"message_id": id, "sender_id": "u", "text": id}));
        assert_eq!(
            (status, answer["status"].as_str()),
            (200, Some("duplicate")),
            "{id} was kept"
        );
    }
}

// ---------- 4. memory ----------

/// Writes up to `total` bytes of `pattern` after `start`; stops when the daemon closes.
fn flood(port: u16, start: &[u8], pattern: &[u8], total: usize) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(start);
    let block = pattern.repeat(64 * 1024 / pattern.len());
    let mut sent = 0;
    while sent < total {
        if s.write_all(&block).is_err() {
            break;
        }
        sent += block.len();
    }
    read_until_closed(&mut s, Duration::from_secs(5)).0
}

/// Floods of every kind, each answered; memory grows by no more than a few MiB. The first round
/// only warms up (the allocator's arenas and the blocking pool's threads a busy machine makes
/// the daemon start): the rounds after it must leave memory where it was.
fn floods_leave_memory_flat(d: &Daemon) {
    floods(d);
    let before = rss_kib(d);
    floods(d);
    floods(d);
    let after = rss_kib(d);
    assert!(after < before + 4096, "RSS went from {before} KiB to {after} KiB");
}

fn floods(d: &Daemon) {
    let big = 64 << 20;
    let answer = flood(
        d.port,
        b"GET /skill.md HTTP/1.1\r\nHost: x\r\n\r\nGET /skill.md HTTP/1.1\r\nX: ",
        b"a",
        big,
    );
    assert!(
        answer.contains("HTTP/1.1 431"),
        "a second head over 16 KiB: {:?}",
        &answer[..answer.len().min(200)]
    );
    let answer = flood(d.port, b"GET /skill.md HTTP/1.1\r\nHost: x\r\n", b"X-A: b\r\n", big);
    assert!(answer.starts_with("HTTP/1.1 431"), "many small headers: {answer:?}");
    let answer = flood(
        d.port,
        format!("POST /hooks/alerts HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {HOOK_SECRET}\r\nTransfer-Encoding: chunked\r\n\r\n1").as_bytes(),
        b"0",
        big,
    );
    assert!(
        answer.starts_with("HTTP/1.1 400"),
        "an endless chunk-size line: {answer:?}"
    );
}

#[test]
fn finding_4_big_heads_many_headers_and_endless_chunk_lines_leave_memory_flat() {
    floods_leave_memory_flat(&daemon("edge-4"));
}

// ---------- 5. slow bodies ----------

#[test]
fn finding_5_slow_bodies_never_hold_up_a_real_webhook() {
    let d = daemon("edge-5");
    let port = d.port;
    let (_x, cch) = d.bound_xagent();
    let stop = Arc::new(Mutex::new(false));
    // More slow senders than any pool of handler threads: each declares a large body (a webhook,
    // an upload) and trickles it.
    let slow: Vec<_> = (0..24)
        .map(|i| {
            let (stop, cch) = (stop.clone(), cch.clone());
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
                let head = if i % 2 == 0 {
                    format!("POST /hooks/alerts HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {HOOK_SECRET}\r\nContent-Length: 1000000\r\n\r\n")
                } else {
                    format!(
                        "POST /files/uploads HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\nX-XAgent-Connector-Channel-ID: {cch}\r\nContent-Type: multipart/form-data; boundary=b\r\nContent-Length: 1000000\r\n\r\n"
                    )
                };
                let _ = s.write_all(head.as_bytes());
                while !*stop.lock().unwrap() {
                    if s.write_all(b"a").is_err() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(500));
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    for i in 0..5 {
        let started = Instant::now();
        let (code, body) = d.post_hook("alerts", &json!({"message_id": format!("real-{i}"), "sender_id": "u"}));
        let took = started.elapsed();
        assert_eq!(code, 202, "{body}");
        assert!(
            took < Duration::from_secs(2),
            "a real webhook waited {took:?} behind slow bodies"
        );
    }
    *stop.lock().unwrap() = true;
    for t in slow {
        t.join().unwrap();
    }
}

// ---------- 6. file descriptors ----------

#[test]
fn finding_6_a_burst_of_connections_under_a_low_open_file_limit_is_refused_not_fatal() {
    let dir = temp_dir("edge-6");
    let config = config_text(free_port(), &dir, None, "");
    let d = Daemon::start_wrapped(&dir, &config, &["prlimit", "--nofile=100:100", "--"]);
    assert!(
        d.log_shows("serving at most 36 connections", Duration::from_secs(2)),
        "max_connections is clamped to the descriptors: {}",
        d.log()
    );
    let mut held = Vec::new();
    for _ in 0..300 {
        if let Ok(s) = TcpStream::connect(("127.0.0.1", d.port)) {
            held.push(s);
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match std::panic::catch_unwind(|| http_get(&d.url("/skill.md"), &[]).0) {
            Ok(200) => break,
            _ if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(200)),
            other => panic!("the daemon did not recover: {other:?}\n{}", d.log()),
        }
    }
    alive(&d);
}

// ---------- 7. the smaller findings ----------

fn status_of(d: &Daemon, req: &[u8]) -> String {
    let (answer, _) = exchange(d.port, req, Duration::from_secs(5));
    answer.get(..12).unwrap_or(&answer).to_string()
}

fn small_findings(d: &Daemon) {
    let k = API_KEY;
    let cases: Vec<(String, &str, &str)> = vec![
        (
            format!("POST /hooks/alerts HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {HOOK_SECRET}\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n"),
            "HTTP/1.1 400",
            "a malformed chunk size is 400, not 413",
        ),
        (
            "GET /skill.md HTTP/1.1\r\nHost: x\r\nX-A: b\r\n c\r\n\r\n".into(),
            "HTTP/1.1 400",
            "a header line that starts with a space",
        ),
        (
            "GET /skill.md HTTP/1.1\r\nHost : x\r\n\r\n".into(),
            "HTTP/1.1 400",
            "whitespace before a colon",
        ),
        (
            format!("GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: bearer {k}\r\n\r\n"),
            "HTTP/1.1 200",
            "the Bearer scheme in lower case",
        ),
        (
            format!(
                "GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {k}\r\nAuthorization: Bearer nope\r\n\r\n"
            ),
            "HTTP/1.1 400",
            "two Authorization headers",
        ),
        (
            "GET /skill.md HTTP/1.1\r\nHost: x\r\nX-Name: caf\u{e9}\r\n\r\n".into(),
            "HTTP/1.1 200",
            "a non-ASCII header value still gets its answer",
        ),
        (
            "POST /skill.md HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n".into(),
            "HTTP/1.1 501",
            "a transfer coding other than chunked",
        ),
        (
            "GET /skill.md HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx".into(),
            "HTTP/1.1 400",
            "a duplicate Content-Length",
        ),
        (
            "POST /hooks/alerts HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n".into(),
            "HTTP/1.1 400",
            "Transfer-Encoding with Content-Length",
        ),
    ];
    for (req, want, what) in cases {
        assert_eq!(status_of(d, req.as_bytes()), want, "{what}");
    }
    // HEAD on every GET route: the GET's status and length, no body.
    for (path, auth) in [("/connector-card.json", false), ("/skill.md", false), ("/health", true)] {
        let a = if auth {
            format!("Authorization: Bearer {k}\r\n")
        } else {
            String::new()
        };
        let (answer, _) = exchange(
            d.port,
            format!("HEAD {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{a}\r\n").as_bytes(),
            Duration::from_secs(5),
        );
        let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
        assert!(head.starts_with("HTTP/1.1 200"), "HEAD {path}: {answer:?}");
        assert!(head.contains("Content-Length: "), "HEAD {path}: {head}");
        assert!(body.is_empty(), "HEAD {path} has no body: {body:?}");
    }
    // A chunked webhook is de-chunked by the front door.
    let body = json!({"message_id": "chunked-1", "sender_id": "u"}).to_string();
    let (half, rest) = body.split_at(10);
    let req = format!(
        "POST /hooks/alerts HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {HOOK_SECRET}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n{:x}\r\n{half}\r\n{:x};ext=1\r\n{rest}\r\n0\r\n\r\n",
        half.len(),
        rest.len()
    );
    assert_eq!(status_of(d, req.as_bytes()), "HTTP/1.1 202", "chunked webhook");
}

#[test]
fn finding_7_malformed_heads_are_400_501_bearer_is_any_case_and_head_works() {
    small_findings(&daemon("edge-7"));
}

/// A masked client frame.
fn frame(first: u8, payload: &[u8]) -> Vec<u8> {
    assert!(payload.len() < 126);
    let mask = [1u8, 2, 3, 4];
    let mut out = vec![first, 0x80 | payload.len() as u8];
    out.extend_from_slice(&mask);
    out.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    out
}

/// The close code and reason of the first Close frame the server sends.
fn close_from_server(s: &mut TcpStream) -> Option<(u16, String)> {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    loop {
        let mut h = [0u8; 2];
        s.read_exact(&mut h).ok()?;
        let len = (h[1] & 0x7f) as usize;
        let len = match len {
            126 => {
                let mut l = [0u8; 2];
                s.read_exact(&mut l).ok()?;
                u16::from_be_bytes(l) as usize
            }
            127 => return None,
            n => n,
        };
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).ok()?;
        if h[0] & 0x0f == 0x8 {
            let code = u16::from_be_bytes([payload[0], payload[1]]);
            return Some((code, String::from_utf8_lossy(&payload[2..]).into_owned()));
        }
    }
}

#[test]
fn finding_7_websocket_close_is_answered_and_errors_close_with_their_codes() {
    let d = daemon("edge-7-ws");
    let auth = format!("bearer {API_KEY}");
    // A client's Close gets a Close back (RFC 6455 5.5.1).
    let mut s = raw_upgrade(d.port, &auth);
    s.write_all(&frame(0x88, &1000u16.to_be_bytes())).unwrap();
    assert_eq!(close_from_server(&mut s).map(|c| c.0), Some(1000));
    // A frame with a reserved bit set: 1002.
    let mut s = raw_upgrade(d.port, &auth);
    s.write_all(&frame(0xC1, b"{}")).unwrap();
    assert_eq!(close_from_server(&mut s), Some((1002, "protocol error".into())));
    // A text frame that is not UTF-8: 1007.
    let mut s = raw_upgrade(d.port, &auth);
    s.write_all(&frame(0x81, b"\xff\xfe")).unwrap();
    assert_eq!(close_from_server(&mut s), Some((1007, "invalid UTF-8".into())));
    alive(&d);
}

#[test]
fn finding_7_refusals_are_counted_and_each_cause_logged_at_most_once_a_minute() {
    let d = daemon("edge-7-log");
    for i in 0..30 {
        let (code, _) = http_post(
            &d.url("/hooks/alerts"),
            &[("Authorization", "Bearer wrong")],
            &json!({"message_id": format!("w{i}"), "sender_id": "u"}).to_string(),
        );
        assert_eq!(code, 401);
        assert_eq!(status_of(&d, b"GET / HTTP/1.1\r\n\r\n"), "HTTP/1.1 400");
        assert_eq!(try_connect(d.port, Some("wrong"), Some(SUBPROTOCOL)).err(), Some(401));
    }
    assert_eq!(metric(&d, "imgate_http_refused_total{cause=\"unauthorized\"} "), 30);
    assert_eq!(metric(&d, "imgate_http_refused_total{cause=\"bad_request\"} "), 30);
    assert_eq!(metric(&d, "imgate_http_refused_total{cause=\"ws_refused\"} "), 30);
    let log = d.log();
    for cause in ["unauthorized", "bad_request", "ws_refused"] {
        let lines = log.matches(&format!("front door: {cause}")).count();
        assert_eq!(lines, 1, "{cause} logged {lines} times:\n{log}");
        // The client's address, for fail2ban and the like.
        assert!(
            log.contains(&format!("front door: {cause} from 127.0.0.1: ")),
            "{cause} names no client:\n{log}"
        );
    }
}

// ---------- the suite against one daemon ----------

#[test]
fn after_the_attacks_no_slot_is_held_and_memory_is_back_within_4_mib() {
    let d = daemon("edge-all");
    alive(&d);
    let start = rss_kib(&d);
    huge_content_lengths_are_413(&d);
    http2_is_refused_without_holding_a_slot(&d);
    floods_leave_memory_flat(&d);
    small_findings(&d);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        metric(&d, "imgate_http_connections "),
        1,
        "only the request asking is connected"
    );
    let end = rss_kib(&d);
    println!("RSS before the attacks {start} KiB, after {end} KiB");
    assert!(end < start + 4096, "RSS went from {start} KiB to {end} KiB");
}

// ---------- peers holding a credential (a webhook secret, the API key) ----------

fn connections(d: &Daemon) -> u64 {
    let status = get_json_with(&d.url("/status"));
    status["dataplane"]["connections"].as_u64().unwrap()
}

fn get_json_with(url: &str) -> serde_json::Value {
    let (code, body) = http_get(url, &[("Authorization", &format!("Bearer {API_KEY}"))]);
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

#[test]
fn peer_1_a_json_bomb_is_refused_with_its_detail_and_costs_a_small_multiple_of_its_size() {
    let d = daemon("peer-bomb");
    alive(&d);
    let before = hwm_kib(d.pid());
    let bomb = "[".repeat((1 << 20) - 64);
    let (status, body) = http_post(
        &d.url("/hooks/alerts"),
        &[
            ("Authorization", &format!("Bearer {HOOK_SECRET}")),
            ("Content-Type", "application/json"),
        ],
        &bomb,
    );
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"], "invalid_payload");
    assert_eq!(body["detail"], "JSON nested deeper than 64 levels");

    // The same over the data plane: an invalid_packet with the same detail, the session lives.
    let mut ws = raw_upgrade(d.port, &format!("Bearer {API_KEY}"));
    ws.write_all(&hello_frame()).unwrap();
    assert!(next_text(&mut ws).contains("connector.hello.ack"));
    ws.write_all(&text_frame(bomb.as_bytes())).unwrap();
    let answer = next_text(&mut ws);
    assert!(
        answer.contains("invalid_packet") && answer.contains("JSON nested deeper than 64 levels"),
        "{answer}"
    );
    let flat = format!("[{}0]", "0,".repeat(200_000));
    ws.write_all(&text_frame(flat.as_bytes())).unwrap();
    let answer = next_text(&mut ws);
    assert!(answer.contains("JSON with more than 100000 values"), "{answer}");

    let (status, _) = d.post_hook("alerts", &json!({"message_id": "after-bomb", "sender_id": "u"}));
    assert_eq!(status, 202, "a legitimate webhook is accepted after the bombs");
    let grew = hwm_kib(d.pid()).saturating_sub(before);
    println!("peak RSS grew {grew} KiB for 1 MiB bombs (a webhook body and a packet)");
    assert!(grew < 8 * 1024, "peak RSS grew {grew} KiB for a 1 MiB body");
}

#[test]
fn peer_2_a_websocket_client_that_stops_reading_is_disconnected_within_its_write_deadline() {
    let d = daemon("peer-noread");
    alive(&d);
    let before = hwm_kib(d.pid());
    let mut ws = raw_upgrade(d.port, &format!("Bearer {API_KEY}"));
    ws.write_all(&hello_frame()).unwrap();
    assert!(next_text(&mut ws).contains("connector.hello.ack"));
    assert_eq!(connections(&d), 1);
    // Pings with the longest request_id allowed, each answered by a pong nobody reads, until the
    // daemon stops reading too (its queue is full) or the pongs reach 40 MB.
    let id = "r".repeat(256);
    let ping = text_frame(
        json!({"schema": "xagent.connector.packet/v1", "packet_id": "p", "request_id": id, "type": "ping"})
            .to_string()
            .as_bytes(),
    );
    ws.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut sent = 0usize;
    while sent < 100_000 && ws.write_all(&ping).is_ok() {
        sent += 1;
    }
    let stalled = Instant::now();
    let deadline = stalled + Duration::from_secs(60);
    while connections(&d) > 0 {
        assert!(
            Instant::now() < deadline,
            "the session is still open 60 s after its peer stopped reading"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let grew = hwm_kib(d.pid()).saturating_sub(before);
    println!(
        "{sent} pings sent; the session ended {:?} after the client stalled; peak RSS grew {grew} KiB",
        stalled.elapsed()
    );
    assert!(
        d.log_shows("the peer read nothing for", Duration::from_secs(5)),
        "{}",
        d.log()
    );
    assert!(grew < 16 * 1024, "peak RSS grew {grew} KiB");
    drop(ws);
    alive(&d);
}

/// WebSocket ping frames from a peer that never reads: each asks for a pong, and a pong that
/// cannot be written once waited in tungstenite's write buffer, which had no bound (1 GiB in
/// 6 s). The buffer is capped now and pongs beyond it are coalesced (RFC 6455 5.5.3: the latest
/// ping is the one answered).
#[test]
fn peer_8_ping_frames_from_a_client_that_never_reads_cost_bounded_memory() {
    let d = daemon("peer-pingflood");
    alive(&d);
    let before = hwm_kib(d.pid());
    let mut ws = raw_upgrade(d.port, &format!("Bearer {API_KEY}"));
    ws.write_all(&hello_frame()).unwrap();
    assert!(next_text(&mut ws).contains("connector.hello.ack"));
    ping_flood(&d, &mut ws, &frame(0x89, &[b'p'; 125]), before);
    drop(ws);
}

/// The same from the xAgent imgate dials: the server's ping frames (unmasked) on the dial-out.
#[test]
fn peer_8_ping_frames_from_a_dialled_xagent_that_never_reads_cost_bounded_memory() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let dir = temp_dir("peer-pingflood-dial");
    let extra = format!("[xagent]\ndial = ws://127.0.0.1:{port}/ws\n");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, &extra));
    let (mut x, _) = accept_dial(&listener);
    let before = hwm_kib(d.pid());
    let mut ping = vec![0x89u8, 125];
    ping.extend_from_slice(&[b'p'; 125]);
    ping_flood(&d, x.socket(), &ping, before);
}

/// Writes 200,000 copies of the ping frame `ping` (their pongs, queued, would be 26 MB) and
/// reads nothing; imgate must go on reading, its peak RSS `before` growing by under 8 MiB.
fn ping_flood(d: &Daemon, socket: &mut TcpStream, ping: &[u8], before: u64) {
    let burst: Vec<u8> = ping.iter().copied().cycle().take(ping.len() * 1000).collect();
    // Generous: a busy machine reads slowly, but a reader that stopped never takes this long.
    socket.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut sent = 0;
    while sent < 200 && socket.write_all(&burst).is_ok() {
        sent += 1;
    }
    let grew = hwm_kib(d.pid()).saturating_sub(before);
    println!("{} ping frames sent; peak RSS grew {grew} KiB", sent * 1000);
    assert_eq!(sent, 200, "imgate went on reading the pings");
    assert!(grew < 8 * 1024, "peak RSS grew {grew} KiB");
    alive(d);
}

/// A dialled or connected xAgent sending `tool.invoke`s as fast as it can, to a `reply_url`
/// that accepts connections and never answers: each call once took a thread of its own (136
/// threads, 435 MiB). At most 16 run at once now; the rest are answered `busy` at once.
#[test]
fn peer_9_a_tool_call_flood_runs_16_at_once_and_answers_the_rest_busy() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let reply_url = format!("http://127.0.0.1:{}/reply", silent.local_addr().unwrap().port());
    let dir = temp_dir("peer-toolflood");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, Some(&reply_url), ""));
    let (mut x, cch) = d.bound_xagent();
    let threads = || proc_field(d.pid(), "status", "Threads:");
    let (before, rss_before) = (threads(), proc_field(d.pid(), "status", "VmRSS:"));
    const CALLS: usize = 2000;
    for i in 0..CALLS {
        x.send(
            "tool.invoke",
            Some(&cch),
            json!({"tool_id": "imgate_message_send", "arguments": {"text": format!("flood {i}")},
                   "context": {"session_id": "s1", "tool_call_id": format!("flood-{i}")}}),
        );
    }
    let (mut busy, mut most_threads) = (0, 0);
    let mut quiet_since = Instant::now();
    while busy < CALLS - 16 && quiet_since.elapsed() < Duration::from_secs(15) {
        most_threads = most_threads.max(threads());
        if let Some(p) = x.recv_within(Duration::from_millis(200)) {
            if p["type"] == "tool.invoke.ack" && p["error"]["code"] == "busy" {
                busy += 1;
                quiet_since = Instant::now();
            }
        }
    }
    let rss_grew = proc_field(d.pid(), "status", "VmRSS:").saturating_sub(rss_before);
    println!("{busy} busy answers; threads {before} -> at most {most_threads}; RSS grew {rss_grew} KiB");
    assert!(busy >= CALLS - 16, "{busy} of {CALLS} answered busy");
    assert!(most_threads <= before + 16 + 2, "threads {before} -> {most_threads}");
    assert!(rss_grew < 12 * 1024, "RSS grew {rss_grew} KiB");
    alive(&d);
    drop(silent);
}

/// A `reply_url` that accepts and never answers: each call is answered `upstream_unreachable`
/// (README's 15 s, from when its thread starts), and a repeat of a call still running is
/// answered `busy` instead of sending the same message a second time.
#[test]
fn peer_11_a_silent_reply_url_answers_unreachable_and_a_repeat_of_a_running_call_is_busy() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let reply_url = format!("http://127.0.0.1:{}/reply", silent.local_addr().unwrap().port());
    let dir = temp_dir("peer-silent-reply");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, Some(&reply_url), ""));
    let (mut x, cch) = d.bound_xagent();
    let call = json!({"tool_id": "imgate_message_send", "arguments": {"text": "hello"},
                      "context": {"session_id": "s1", "tool_call_id": "same-call"}});
    let (first, _) = x.send("tool.invoke", Some(&cch), call.clone());
    // The first call's connection arrives at the silent receiver: it is running.
    silent.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let _held = loop {
        match silent.accept() {
            Ok((held, _)) => break held,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("the first call never reached the reply_url: {e}"),
        }
    };
    let (repeat, _) = x.send("tool.invoke", Some(&cch), call);
    let mut acks = std::collections::HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(90);
    while acks.len() < 2 && Instant::now() < deadline {
        if let Some(p) = x.recv_within(Duration::from_millis(500)) {
            if p["type"] == "tool.invoke.ack" {
                acks.insert(p["reply_to"].as_str().unwrap_or_default().to_string(), p);
            }
        }
    }
    assert_eq!(acks[&repeat]["error"]["code"], "busy", "{:?}", acks.get(&repeat));
    assert_eq!(
        acks[&first]["error"]["code"],
        "upstream_unreachable",
        "{:?}",
        acks.get(&first)
    );
    assert!(silent.accept().is_err(), "the repeat sent nothing");
    alive(&d);
}

/// A flood of `channel.open` once stored every channel and logged a line for each (38,711 lines,
/// 4.88 MB of log in 50 s). At most 1,024 channels are kept now, a new one past that is refused
/// with a protocol error, and opens are logged one line a minute with the count since.
#[test]
fn peer_10_a_channel_open_flood_is_capped_and_logged_once_a_minute() {
    let d = daemon("peer-channelflood");
    let mut x = d.xagent();
    x.hello("");
    let first = x.open(None).0;
    const OPENS: usize = 1100;
    for _ in 1..OPENS {
        x.send("channel.open", None, json!({}));
    }
    let (mut opened, mut refused) = (1, 0);
    let mut quiet_since = Instant::now();
    while opened + refused < OPENS && quiet_since.elapsed() < Duration::from_secs(15) {
        if let Some(p) = x.recv_within(Duration::from_millis(200)) {
            quiet_since = Instant::now();
            if p["type"] == "channel.open.ack" {
                opened += 1;
            } else if p["error"]["code"] == "connector_channel_unavailable" {
                refused += 1;
            }
        }
    }
    assert_eq!((opened, refused), (1024, OPENS - 1024));
    // A known channel still opens.
    let (again, _) = x.open(Some(&first));
    assert_eq!(again, first);
    let log = d.log();
    let lines = log.matches("data plane: channel cch_").count();
    assert!(lines <= 2, "{lines} lines for {opened} opens");
    assert_eq!(log.matches("a new channel was refused").count(), 1, "{log}");
}

fn upgrade_head(method: &str, version: &str, extra: &str) -> String {
    format!(
        "{method} /ws {version}\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Protocol: {SUBPROTOCOL}\r\nAuthorization: Bearer {API_KEY}\r\n{extra}\r\n"
    )
}

#[test]
fn peer_5_only_a_bodiless_get_of_http_1_1_upgrades_to_the_data_plane() {
    let d = daemon("peer-upgrade");
    // The body is a masked connector.hello: it must not be run as frames.
    let hello = hello_frame();
    let mut smuggled = upgrade_head("GET", "HTTP/1.1", &format!("Content-Length: {}\r\n", hello.len())).into_bytes();
    smuggled.extend_from_slice(&hello);
    let (answer, closed) = exchange(d.port, &smuggled, Duration::from_secs(5));
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(
        closed && !answer.contains("101") && !answer.contains("hello.ack"),
        "{answer}"
    );
    let mut chunked = upgrade_head("GET", "HTTP/1.1", "Transfer-Encoding: chunked\r\n").into_bytes();
    chunked.extend_from_slice(b"0\r\n\r\n");
    let (answer, _) = exchange(d.port, &chunked, Duration::from_secs(5));
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");

    for (method, version) in [("HEAD", "HTTP/1.1"), ("GET", "HTTP/1.0")] {
        let (answer, closed) = exchange(
            d.port,
            upgrade_head(method, version, "").as_bytes(),
            Duration::from_secs(5),
        );
        assert!(answer.starts_with("HTTP/1.1 426"), "{method} {version}: {answer}");
        assert!(answer.contains("Upgrade: websocket"), "{method} {version}: {answer}");
        assert!(closed && !answer.contains("101"), "{method} {version}: {answer}");
    }
    // The handshake by the RFCs still works.
    let mut ws = raw_upgrade(d.port, &format!("Bearer {API_KEY}"));
    ws.write_all(&hello).unwrap();
    assert!(next_text(&mut ws).contains("connector.hello.ack"));
}

/// Sends a head with `Expect: 100-continue`, then what the server said before any body, within
/// `wait`: an answer that is due returns as soon as it comes; silence takes the whole wait.
fn expect_continue(port: u16, head: &str, wait: Duration) -> (TcpStream, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let said = send_and_read_head(&mut s, head.as_bytes(), wait);
    (s, said)
}

/// Long enough for a loaded machine to answer a head.
const DUE: Duration = Duration::from_secs(10);

#[test]
fn peer_6_100_continue_only_after_an_accepted_head_and_never_to_http_1_0() {
    let d = daemon("peer-continue");
    let body = json!({"message_id": "c-1", "sender_id": "u"}).to_string();
    let head = |target: &str, version: &str, secret: &str| {
        format!(
            "POST {target} {version}\r\nHost: x\r\nAuthorization: Bearer {secret}\r\nContent-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
    };
    let (_, wrong) = expect_continue(d.port, &head("/hooks/alerts", "HTTP/1.1", "not-the-secret"), DUE);
    assert!(
        wrong.starts_with("HTTP/1.1 401"),
        "a wrong secret is refused before the body: {wrong}"
    );
    let (_, unknown) = expect_continue(d.port, &head("/hooks/nope", "HTTP/1.1", HOOK_SECRET), DUE);
    assert!(
        unknown.starts_with("HTTP/1.1 404"),
        "an unknown endpoint is refused before the body: {unknown}"
    );

    let (mut s, first) = expect_continue(d.port, &head("/hooks/alerts", "HTTP/1.1", HOOK_SECRET), DUE);
    assert_eq!(first, "HTTP/1.1 100 Continue\r\n\r\n");
    let answer = send_and_read_head(&mut s, body.as_bytes(), DUE);
    assert!(answer.starts_with("HTTP/1.1 202"), "{answer}");

    let (mut s, first) = expect_continue(
        d.port,
        &head("/hooks/alerts", "HTTP/1.0", HOOK_SECRET).replace("c-1", "c-2"),
        Duration::from_secs(3),
    );
    assert_eq!(first, "", "nothing, and no 100, to an HTTP/1.0 client before its body");
    // HTTP/1.0: the answer closes the connection.
    s.write_all(body.replace("c-1", "c-2").as_bytes()).unwrap();
    let (answer, _) = read_until_closed(&mut s, DUE);
    assert!(
        answer.starts_with("HTTP/1.1 202") && !answer.contains("100 Continue"),
        "{answer}"
    );
}

#[test]
fn peer_7_bare_lf_heads_are_400_at_once_405_names_allow_and_a_malformed_host_is_400() {
    let d = daemon("peer-small");
    let started = Instant::now();
    let (answer, closed) = exchange(d.port, b"GET /health HTTP/1.1\nHost: x\n\n", Duration::from_secs(5));
    assert!(answer.starts_with("HTTP/1.1 400") && closed, "{answer}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered without waiting for the head deadline"
    );

    let (answer, _) = exchange(
        d.port,
        b"PUT /connector-card.json HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    );
    assert!(
        answer.starts_with("HTTP/1.1 405") && answer.contains("Allow: GET, HEAD"),
        "{answer}"
    );
    let (answer, _) = exchange(
        d.port,
        b"GET /hooks/alerts HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    );
    assert!(
        answer.starts_with("HTTP/1.1 405") && answer.contains("Allow: POST"),
        "{answer}"
    );

    for host in ["a b", "a/b", "a@b"] {
        let req = format!("GET /connector-card.json HTTP/1.1\r\nHost: {host}\r\n\r\n");
        let (answer, closed) = exchange(d.port, req.as_bytes(), Duration::from_secs(5));
        assert!(answer.starts_with("HTTP/1.1 400") && closed, "Host: {host}: {answer}");
    }
    for host in ["imgate.local:8787", "[::1]:8787", "127.0.0.1"] {
        let req = format!("GET /connector-card.json HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        let (answer, _) = exchange(d.port, req.as_bytes(), Duration::from_secs(5));
        assert!(answer.starts_with("HTTP/1.1 200"), "Host: {host}: {answer}");
    }
}

#[test]
fn peer_3_peer_text_cannot_forge_log_lines_and_repeats_log_one_line_a_minute() {
    let dir = temp_dir("peer-logs");
    let d = Daemon::start_logging(&dir, &config_text(free_port(), &dir, None, ""), "info");
    alive(&d);
    let forged = "m\n[2026-12-03T00:00:00Z ERROR imgate] forged\u{1b}]0;owned\u{7}\u{1b}[31m";
    for i in 0..1000 {
        let (status, _) = d.post_hook(
            "alerts",
            &json!({"message_id": format!("{forged}{i}"), "sender_id": "u", "event_time": 1}),
        );
        assert_eq!(status, 409);
    }
    let mut ws = raw_upgrade(d.port, &format!("Bearer {API_KEY}"));
    ws.write_all(&hello_frame()).unwrap();
    assert!(next_text(&mut ws).contains("connector.hello.ack"));
    let error = text_frame(
        json!({"schema": "xagent.connector.packet/v1", "packet_id": "e", "type": "error",
               "error": {"code": forged, "message": "x".repeat(100_000)}})
        .to_string()
        .as_bytes(),
    );
    for _ in 0..200 {
        ws.write_all(&error).unwrap();
    }
    // The session answers packets in order: its pong means every error before it was read.
    ws.write_all(&text_frame(
        br#"{"schema":"xagent.connector.packet/v1","packet_id":"p","request_id":"after","type":"ping"}"#,
    ))
    .unwrap();
    assert!(next_text(&mut ws).contains("\"after\""));

    let log = d.log();
    assert!(
        !log.contains('\u{1b}') && !log.contains('\u{7}'),
        "raw terminal escapes reached the log"
    );
    assert!(
        !log.lines().any(|l| l.starts_with("[2026-12-03T00:00:00Z")),
        "a peer forged a log line:\n{log}"
    );
    assert_eq!(log.matches("is stale").count(), 1, "{log}");
    assert_eq!(log.matches("peer reported error").count(), 1, "{log}");
    println!(
        "log after 1,000 stale webhooks and 200 error packets of 100 KB: {} bytes",
        log.len()
    );
    assert!(log.len() < 16 * 1024, "the log grew to {} bytes", log.len());
}

/// A keep-alive connection that has had one answer and now waits: idle.
fn idle_connection(port: u16) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /connector-card.json HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    // The Card is one JSON object: its answer ends with the closing brace.
    while !got.ends_with(b"}") {
        let n = s.read(&mut chunk).unwrap();
        assert!(n > 0, "the answer comes");
        got.extend_from_slice(&chunk[..n]);
    }
    s
}

fn closed_by_server(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    matches!(s.read(&mut [0u8; 64]), Ok(0) | Err(_))
}

#[test]
fn peer_4_idle_keep_alive_connections_make_room_and_one_address_holds_only_its_share() {
    let dir = temp_dir("peer-slots");
    let conf = config_text(free_port(), &dir, None, "").replace(
        "max_connections_per_client = 0",
        "max_connections = 4\nmax_connections_per_client = 0",
    );
    let d = Daemon::start(&dir, &conf);
    wait_until_alone(&d);
    let mut idle: Vec<TcpStream> = Vec::new();
    for _ in 0..4 {
        idle.push(idle_connection(d.port));
        std::thread::sleep(Duration::from_millis(20)); // each waits a little longer than the next
    }
    // Every slot is held by an idle client: a newcomer is served, the longest idle closed.
    let (status, _) = http_get(&d.url("/connector-card.json"), &[]);
    assert_eq!(status, 200, "a new client is served while idle ones hold every slot");
    assert!(closed_by_server(&mut idle[0]), "the longest-idle connection made room");
    assert!(metric(&d, "imgate_http_idle_closed_total ") >= 1);
    drop(idle);
    drop(d);

    // One address holds at most its share; the default share is a quarter of the slots.
    let dir = temp_dir("peer-per-client");
    let conf =
        config_text(free_port(), &dir, None, "").replace("max_connections_per_client = 0\n", "max_connections = 8\n");
    let d = Daemon::start(&dir, &conf);
    wait_until_alone(&d);
    // Each has had an answer: admitted for certain.
    let held: Vec<TcpStream> = (0..2).map(|_| idle_connection(d.port)).collect();
    let (answer, closed) = exchange(d.port, b"", Duration::from_secs(5));
    assert!(
        answer.starts_with("HTTP/1.1 503") && closed,
        "a third connection from one address: {answer:?}"
    );
    assert!(metric_after_release(&d, held) >= 1);
}

/// `imgate_http_refused_total{cause="too_many_from_client"}` once `held` let go of their slots.
fn metric_after_release(d: &Daemon, held: Vec<TcpStream>) -> u64 {
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (status, text) = http_get(&d.url("/metrics"), &[("Authorization", &format!("Bearer {API_KEY}"))]);
        if status == 200 {
            return text
                .lines()
                .find_map(|l| l.strip_prefix("imgate_http_refused_total{cause=\"too_many_from_client\"} "))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
        }
        assert!(
            Instant::now() < deadline,
            "/metrics answers once the held slots are free"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
