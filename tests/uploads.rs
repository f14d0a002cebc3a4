//! `POST /files/uploads` streamed to the file cache by the front door: files of
//! `max_file_bytes` in bounded memory, one or two at once, chunked or with a length; bodies that
//! are malformed, over the cap or cut short say why and leave no bytes behind.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::common::*;
use serde_json::Value;

const BOUNDARY: &str = "upl0adB0undary";

/// A multipart body around `bytes` as the `file` part, with a text part before it.
fn multipart_body(name: &str, bytes: &[u8]) -> Vec<u8> {
    let mut body = format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"note\"\r\n\r\nnot the file\r\n\
         --{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\nContent-Type: application/pdf\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(bytes);
    body.extend_from_slice(format!("\r\n--{BOUNDARY}--\r\n").as_bytes());
    body
}

/// Sends an upload over raw TCP, `Content-Length` or chunked, in writes of `piece` bytes;
/// the answer's status line and body.
fn raw_upload(d: &Daemon, channel: Option<&str>, body: &[u8], chunked: bool) -> (String, Value) {
    let mut s = TcpStream::connect(("127.0.0.1", d.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let channel = channel
        .map(|c| format!("X-XAgent-Connector-Channel-ID: {c}\r\n"))
        .unwrap_or_default();
    let framing = if chunked {
        "Transfer-Encoding: chunked\r\n".to_string()
    } else {
        format!("Content-Length: {}\r\n", body.len())
    };
    write!(
        s,
        "POST /files/uploads HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n{channel}\
         Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n{framing}Connection: close\r\n\r\n"
    )
    .unwrap();
    let written = if chunked {
        body.chunks(100_000)
            .try_for_each(|c| {
                write!(s, "{:x}\r\n", c.len())?;
                s.write_all(c)?;
                s.write_all(b"\r\n")
            })
            .and_then(|_| s.write_all(b"0\r\n\r\n"))
    } else {
        body.chunks(100_000).try_for_each(|c| s.write_all(c))
    };
    // An early answer (400, 413) may close the connection before the whole body is written.
    let _ = written;
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    let (head, json) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head.lines().next().unwrap_or_default().to_string();
    (status, serde_json::from_str(json).unwrap_or(Value::Null))
}

/// The names in the file cache's directory.
fn cached(d: &Daemon) -> Vec<String> {
    std::fs::read_dir(d.dir.join("state/files"))
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn two_uploads_of_max_file_bytes_at_once_stream_to_disk_in_bounded_memory() {
    let dir = temp_dir("upload-20mib");
    // The default max_file_bytes: 20 MiB.
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    let (_x, cch) = d.bound_xagent();
    let before = hwm_kib(d.pid());
    let max = 20 << 20;
    let files: Vec<Vec<u8>> = (0..2).map(|i| patterned(max, i)).collect();
    let answers: Vec<(String, Value)> = std::thread::scope(|scope| {
        let sends: Vec<_> = files
            .iter()
            .enumerate()
            .map(|(i, bytes)| {
                let (d, cch) = (&d, cch.as_str());
                scope.spawn(move || raw_upload(d, Some(cch), &multipart_body("big.pdf", bytes), i == 1))
            })
            .collect();
        sends.into_iter().map(|s| s.join().unwrap()).collect()
    });
    let grown = hwm_kib(d.pid()).saturating_sub(before);
    for ((status, answer), bytes) in answers.iter().zip(&files) {
        assert!(status.starts_with("HTTP/1.1 200"), "{status} {answer}");
        assert_eq!(answer["byte_size"], max, "{answer}");
        assert_eq!(answer["filename"], "big.pdf");
        let file_ref = answer["file_ref"].as_str().unwrap();
        let stored = std::fs::read(d.dir.join("state/files").join(file_ref)).unwrap();
        assert_same_bytes(&stored, bytes, "an uploaded file");
    }
    // Read whole, each would have cost its size two or three times over (about 120 MiB).
    assert!(
        grown < 8 * 1024,
        "two 20 MiB uploads grew the peak RSS by {grown} KiB (from {before} KiB)"
    );
    assert!(!cached(&d).iter().any(|n| n.ends_with(".part")));
}

#[test]
fn uploads_that_are_malformed_over_the_cap_or_cut_short_say_why_and_leave_nothing() {
    let dir = temp_dir("upload-bad");
    let d = Daemon::start(
        &dir,
        &config_text(free_port(), &dir, None, "[files]\nmax_file_bytes = 1MiB\n"),
    );
    let (_x, cch) = d.bound_xagent();
    let small = multipart_body("a.pdf", &patterned(300 << 10, 3));

    let (status, answer) = raw_upload(&d, None, &small, false);
    assert!(status.starts_with("HTTP/1.1 400"), "{status}");
    assert_eq!(answer["detail"], "X-XAgent-Connector-Channel-ID is required");
    let (status, answer) = raw_upload(&d, Some("cch_nobody"), &small, true);
    assert!(status.starts_with("HTTP/1.1 404"), "{status}");
    assert_eq!(answer["error"], "connection_not_found");

    // Framing broken in the middle: the delimiter's line goes on with garbage.
    let mut broken = small.clone();
    let end = format!("\r\n--{BOUNDARY}--\r\n");
    broken.truncate(broken.len() - end.len());
    broken.extend_from_slice(format!("\r\n--{BOUNDARY}garbage\r\n").as_bytes());
    let (status, answer) = raw_upload(&d, Some(&cch), &broken, false);
    assert!(status.starts_with("HTTP/1.1 400"), "{status} {answer}");
    assert_eq!(answer["error"], "invalid_upload", "{answer}");
    assert!(answer["detail"].as_str().is_some_and(|d| !d.is_empty()), "{answer}");

    // No `file` part, and a body that never closes its last part.
    let (status, answer) = raw_upload(
        &d,
        Some(&cch),
        format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"note\"\r\n\r\nhi\r\n--{BOUNDARY}--\r\n")
            .as_bytes(),
        false,
    );
    assert!(status.starts_with("HTTP/1.1 400"), "{status}");
    assert_eq!(answer["detail"], "the multipart body has no `file` part");
    let (status, _) = raw_upload(&d, Some(&cch), &small[..small.len() - 10], true);
    assert!(status.starts_with("HTTP/1.1 400"), "{status}");

    // Over max_file_bytes, chunked (no length to refuse it by): 413 once the file passes it.
    let (status, answer) = raw_upload(&d, Some(&cch), &multipart_body("big.pdf", &patterned(2 << 20, 4)), true);
    assert!(status.starts_with("HTTP/1.1 413"), "{status} {answer}");

    // The client goes away in the middle of a file: its bytes are removed.
    let mut s = TcpStream::connect(("127.0.0.1", d.port)).unwrap();
    write!(
        s,
        "POST /files/uploads HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\nX-XAgent-Connector-Channel-ID: {cch}\r\n\
         Content-Type: multipart/form-data; boundary={BOUNDARY}\r\nContent-Length: {}\r\n\r\n",
        small.len()
    )
    .unwrap();
    s.write_all(&small[..200 << 10]).unwrap();
    wait_until("the upload's bytes reach the disk", || {
        cached(&d).iter().any(|n| n.ends_with(".part"))
    });
    drop(s);
    wait_until("the cut upload's .part is removed", || cached(&d).is_empty());

    // Nothing of any of them stayed; a good upload still works, with a length and chunked.
    assert!(cached(&d).is_empty(), "{:?}", cached(&d));
    for chunked in [false, true] {
        let (status, answer) = raw_upload(&d, Some(&cch), &small, chunked);
        assert!(status.starts_with("HTTP/1.1 200"), "{status} {answer}");
        assert_eq!(answer["byte_size"], 300 << 10);
    }
    assert_eq!(cached(&d).len(), 2);
}

/// Four uploads stream at once (each holds about 80 KiB); a fifth is answered `503 busy` from
/// its head, and the room comes back when one of them ends.
#[test]
fn a_fifth_upload_at_once_is_busy_until_one_ends() {
    let dir = temp_dir("upload-busy");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, ""));
    let (_x, cch) = d.bound_xagent();
    let body = multipart_body("a.pdf", &patterned(1 << 20, 5));
    let head = format!(
        "POST /files/uploads HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\nX-XAgent-Connector-Channel-ID: {cch}\r\n\
         Content-Type: multipart/form-data; boundary={BOUNDARY}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    // Four uploads under way: their heads and a first part of their bodies, the rest held back.
    let mut held: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", d.port)).unwrap();
            s.write_all(head.as_bytes()).unwrap();
            s.write_all(&body[..64 << 10]).unwrap();
            s
        })
        .collect();
    wait_until("the four uploads write to the cache", || {
        cached(&d).iter().filter(|n| n.ends_with(".part")).count() == 4
    });
    let (status, answer) = raw_upload(&d, Some(&cch), &body, false);
    assert!(status.starts_with("HTTP/1.1 503"), "{status} {answer}");
    assert_eq!(answer["error"], "busy");
    // One of them completes: a new upload is taken again.
    let mut first = held.remove(0);
    first.write_all(&body[64 << 10..]).unwrap();
    let mut answer = String::new();
    let _ = first.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let (status, answer) = raw_upload(&d, Some(&cch), &body, false);
    assert!(status.starts_with("HTTP/1.1 200"), "{status} {answer}");
    drop(held);
}
