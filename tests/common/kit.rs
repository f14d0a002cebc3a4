//! What every IM simulator needs and none is about: the server side of a WebSocket (the
//! thread that owns it, told what to send, telling what it heard), multipart bodies, base64,
//! URL decoding, the clock. Each simulator keeps only its platform's protocol.

use std::io::{ErrorKind, Read};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tungstenite::protocol::frame::coding::CloseCode;
use tungstenite::protocol::CloseFrame;
use tungstenite::{Message, WebSocket};

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

// ---------- a simulator's state ----------

/// A simulator's state and the condition variable its waiters sleep on.
pub type Watched<S> = (Mutex<S>, Condvar);

/// Changes a simulator's state and wakes whoever waits on it.
pub fn change<S, T>(state: &Watched<S>, f: impl FnOnce(&mut S) -> T) -> T {
    let t = f(&mut state.0.lock().unwrap());
    state.1.notify_all();
    t
}

/// Waits until `ready` holds of a simulator's state: evaluated again at every change (and at
/// least every 50 ms), never after a fixed sleep; false after `timeout`.
pub fn wait_for<S>(state: &Watched<S>, timeout: Duration, ready: impl Fn(&S) -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    let mut s = state.0.lock().unwrap();
    while !ready(&s) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        s = state.1.wait_timeout(s, left.min(Duration::from_millis(50))).unwrap().0;
    }
    true
}

// ---------- a simulator's threads ----------

/// Serves `server`'s requests on `workers` threads until `stopped`.
pub fn serve_http(
    server: &Arc<tiny_http::Server>,
    workers: usize,
    stopped: &Arc<AtomicBool>,
    serve: impl Fn(tiny_http::Request) + Send + Clone + 'static,
) {
    for _ in 0..workers {
        let (server, stopped, serve) = (server.clone(), stopped.clone(), serve.clone());
        std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                if let Ok(Some(req)) = server.recv_timeout(Duration::from_millis(100)) {
                    serve(req);
                }
            }
        });
    }
}

/// Takes `listener`'s connections until `stopped`, each to `each` on a thread of its own.
pub fn accept_each(
    listener: TcpListener,
    stopped: &Arc<AtomicBool>,
    each: impl Fn(TcpStream, &AtomicBool) + Send + Clone + 'static,
) {
    let stopped = stopped.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            if stopped.load(Ordering::Relaxed) {
                return;
            }
            let (stopped, each) = (stopped.clone(), each.clone());
            std::thread::spawn(move || each(stream, &stopped));
        }
    });
}

/// Runs `tick` every 25 ms until `stopped`: a simulator's clock (retries, expiries, timers).
pub fn tick_until(stopped: &Arc<AtomicBool>, mut tick: impl FnMut() + Send + 'static) {
    let stopped = stopped.clone();
    std::thread::spawn(move || {
        while !stopped.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(25));
            tick();
        }
    });
}

// ---------- the server side of a WebSocket ----------

/// What a simulator asks a socket's thread to do (the thread owns the WebSocket).
pub enum Out {
    Text(String),
    /// A close frame, then the TCP connection ends.
    Close(u16),
    /// TCP closed with no close frame.
    Drop,
    /// Read nothing more through tungstenite (no pongs), write nothing: a half-open link.
    Silent,
}

/// What a socket heard from the client.
pub enum Heard<'a> {
    Text(&'a str),
    /// Binary data, or a frame over tungstenite's caps.
    Binary,
    /// WebSocket pings (while silent, counted by their opcode in the raw bytes).
    Pings(usize),
}

fn would_block(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// Runs one server-side socket until it ends: sends what `rx` asks, hands what the client
/// says to `heard`. `None` when this side ended it (stopped, `Close`, `Drop`); else the client
/// did: `Some` of its close frame's code (1005 for none), or `Some(None)` when the link broke.
/// The socket's reads must time out (a short read timeout), so `rx` is looked at.
pub fn socket_loop(
    ws: &mut WebSocket<TcpStream>,
    rx: &mpsc::Receiver<Out>,
    stopped: &AtomicBool,
    mut heard: impl FnMut(Heard),
) -> Option<Option<u16>> {
    let mut silent: Option<Vec<u8>> = None;
    loop {
        if stopped.load(Ordering::Relaxed) {
            let _ = ws.get_mut().shutdown(Shutdown::Both);
            return None;
        }
        while let Ok(out) = rx.try_recv() {
            match out {
                Out::Text(_) if silent.is_some() => {}
                Out::Text(t) => {
                    if ws.send(Message::Text(t.into())).is_err() {
                        return Some(None);
                    }
                }
                Out::Close(code) => {
                    finish_close(ws, code);
                    return None;
                }
                Out::Drop => {
                    let _ = ws.get_mut().shutdown(Shutdown::Both);
                    return None;
                }
                Out::Silent => silent = Some(Vec::new()),
            }
        }
        if let Some(buf) = silent.as_mut() {
            // Raw reads so tungstenite never queues a pong; pings are counted by opcode.
            let mut chunk = [0u8; 4096];
            match ws.get_mut().read(&mut chunk) {
                Ok(0) => return Some(None),
                Ok(n) => {
                    buf.extend_from_slice(&chunk[..n]);
                    let pings = count_pings(buf);
                    if pings > 0 {
                        heard(Heard::Pings(pings));
                    }
                }
                Err(e) if would_block(&e) => {}
                Err(_) => return Some(None),
            }
            continue;
        }
        match ws.read() {
            Ok(Message::Text(t)) => heard(Heard::Text(t.as_str())),
            Ok(Message::Binary(_)) | Err(tungstenite::Error::Capacity(_)) => heard(Heard::Binary),
            Ok(Message::Ping(_)) => {
                heard(Heard::Pings(1));
                let _ = ws.flush(); // sends the pong tungstenite queued
            }
            Ok(Message::Close(f)) => {
                let _ = ws.flush();
                return Some(Some(f.map_or(1005, |f| u16::from(f.code))));
            }
            Ok(_) => {}
            Err(tungstenite::Error::Io(e)) if would_block(&e) => {
                let _ = ws.flush();
            }
            Err(_) => return Some(None),
        }
    }
}

/// Sends a close frame, waits a moment for the client's, then ends the TCP connection.
pub fn finish_close(ws: &mut WebSocket<TcpStream>, code: u16) {
    let _ = ws.close(Some(CloseFrame {
        code: CloseCode::from(code),
        reason: "".into(),
    }));
    let deadline = Instant::now() + Duration::from_secs(1);
    while Instant::now() < deadline {
        match ws.read() {
            Err(tungstenite::Error::Io(e)) if would_block(&e) => {}
            Err(_) => break,
            Ok(_) => {}
        }
    }
    let _ = ws.get_mut().shutdown(Shutdown::Both);
}

/// Consumes whole client frames from `buf`; how many were pings (opcode 9).
fn count_pings(buf: &mut Vec<u8>) -> usize {
    let mut pings = 0;
    loop {
        if buf.len() < 2 {
            return pings;
        }
        let (op, len7, masked) = (buf[0] & 0x0f, (buf[1] & 0x7f) as usize, buf[1] & 0x80 != 0);
        let (ext, len) = match len7 {
            126 if buf.len() >= 4 => (2, u16::from_be_bytes([buf[2], buf[3]]) as usize),
            127 if buf.len() >= 10 => (8, u64::from_be_bytes(buf[2..10].try_into().unwrap()) as usize),
            126 | 127 => return pings,
            n => (0, n),
        };
        let total = 2 + ext + (if masked { 4 } else { 0 }) + len;
        if buf.len() < total {
            return pings;
        }
        pings += usize::from(op == 9);
        buf.drain(..total);
    }
}

// ---------- bodies ----------

/// One part of a multipart/form-data body.
pub struct Part {
    pub name: String,
    pub filename: Option<String>,
    pub content_type: Option<String>,
    pub data: Vec<u8>,
}

/// Parts a body may have at most.
const MAX_PARTS: usize = 64;

pub fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len().max(1)).position(|w| w == needle)
}

/// multipart/form-data parts (RFC 7578) with the boundary from Content-Type; `None` when the
/// body is not well formed.
pub fn multipart(body: &[u8], ctype: &str) -> Option<Vec<Part>> {
    let b = ctype
        .split(';')
        .find_map(|p| p.trim().strip_prefix("boundary="))?
        .trim_matches('"');
    let delim = format!("--{b}").into_bytes();
    let close = [b"\r\n".as_slice(), delim.as_slice()].concat();
    let mut pos = find(body, &delim)? + delim.len();
    let mut parts = vec![];
    while !body[pos..].starts_with(b"--") {
        let rest = body[pos..].strip_prefix(b"\r\n").filter(|_| parts.len() < MAX_PARTS)?;
        let h = find(rest, b"\r\n\r\n")?;
        let head = String::from_utf8_lossy(&rest[..h]).into_owned();
        let data = &rest[h + 4..];
        let end = find(data, &close)?;
        let mut part = Part {
            name: String::new(),
            filename: None,
            content_type: None,
            data: data[..end].to_vec(),
        };
        for line in head.split("\r\n") {
            let Some((k, v)) = line.split_once(':') else { continue };
            if k.trim().eq_ignore_ascii_case("content-type") {
                part.content_type = Some(v.trim().to_string());
            } else if k.trim().eq_ignore_ascii_case("content-disposition") {
                for p in v.split(';').filter_map(|p| p.trim().split_once('=')) {
                    let value = p.1.trim().trim_matches('"').to_string();
                    match p.0.trim() {
                        "name" => part.name = value,
                        "filename" => part.filename = Some(value),
                        _ => {}
                    }
                }
            }
        }
        parts.push(part);
        pos = body.len() - data.len() + end + close.len();
    }
    Some(parts)
}

/// `application/x-www-form-urlencoded` and query strings: `+` is a space, `%XX` a byte.
pub fn url_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                match u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Standard base64 (RFC 4648 section 4), padded.
pub fn base64(bytes: &[u8]) -> String {
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |a, (i, b)| a | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            out.push(if i <= chunk.len() {
                B64[(n >> (18 - 6 * i) & 63) as usize] as char
            } else {
                '='
            });
        }
    }
    out
}

/// Standard base64 without its padding.
pub fn base64_unpadded(bytes: &[u8]) -> String {
    base64(bytes).trim_end_matches('=').to_string()
}

/// Standard base64, padded or not; decoding stops at the first byte outside the alphabet.
pub fn base64_decode(text: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for c in text.bytes().filter(|c| *c != b'=') {
        let Some(v) = B64.iter().position(|x| *x == c) else {
            break;
        };
        acc = acc << 6 | v as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

#[test]
fn base64_and_url_decoding_follow_their_rfcs() {
    assert_eq!(base64(b"foobar"), "Zm9vYmFy");
    assert_eq!(base64(b"fo"), "Zm8=");
    assert_eq!(base64_unpadded(b"f"), "Zg");
    assert_eq!(base64_decode("Zm9vYg=="), b"foob");
    assert_eq!(url_decode("a+b%2Fc%zz"), "a b/c%zz");
    let body = b"--x\r\nContent-Disposition: form-data; name=\"f\"; filename=\"a.txt\"\r\nContent-Type: text/plain\r\n\r\nhi\r\n--x--\r\n";
    let parts = multipart(body, "multipart/form-data; boundary=x").expect("well formed");
    assert_eq!(
        (
            parts[0].name.as_str(),
            parts[0].filename.as_deref(),
            parts[0].data.as_slice()
        ),
        ("f", Some("a.txt"), &b"hi"[..])
    );
    assert!(multipart(b"--x\r\nno end", "multipart/form-data; boundary=x").is_none());
}
