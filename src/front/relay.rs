//! The hop to tiny_http over a private Unix socket. The front door writes each request out
//! again in canonical form (its own request line, `Host`, `Content-Length`, a few listed
//! headers, the body it has already read whole), one request at a time per internal
//! connection, with a deadline on every read and write; tiny_http never reads a client's bytes.
//! Its answer's head is read and bounded here; its body (a file download) streams through.
//!
//! At most `CONCURRENT` exchanges run at once, each on one of at most as many pooled internal
//! connections: tiny_http keeps a thread per open connection and four at least, so four
//! connections kept open never make it start (or end) a thread. A small answer gives its
//! turn back before it is written to the client; a file streaming to a client keeps it.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use smol::future::FutureExt;
use smol::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use smol::lock::{Semaphore, SemaphoreGuardArc};
use smol::net::unix::UnixStream;

use crate::http::Dispatch;

/// Exchanges with tiny_http at once; more wait (up to `WAIT`) for a turn.
const CONCURRENT: usize = 4;
/// Idle internal connections kept for the next request.
const POOLED: usize = CONCURRENT;
/// How long a request waits for a turn before it is answered 503.
const WAIT: Duration = Duration::from_secs(10);
/// How long tiny_http may take to start its answer (a handler reading the store on a slow disk).
const ANSWER: Duration = Duration::from_secs(60);
/// How long any single read or write on the internal socket may stall.
const STALL: Duration = Duration::from_secs(10);
/// Longest answer head accepted from tiny_http.
const MAX_HEAD: usize = 16 * 1024;
/// Request headers tiny_http's routes read; nothing else is passed on.
const PASSED: [&str; 3] = ["Authorization", "Content-Type", "X-XAgent-Connector-Channel-ID"];
/// Answer headers passed back to the client.
const RETURNED: [&str; 3] = ["Content-Type", "Content-Disposition", "Allow"];

/// Why tiny_http gave no usable answer.
#[derive(Debug, PartialEq)]
pub enum RelayError {
    /// Every turn was taken for too long: 503.
    Busy,
    /// No connection, a broken one or a malformed answer: 502.
    Unavailable,
    /// No answer in time: 504.
    Timeout,
}

pub struct Backend {
    socket: PathBuf,
    turns: Arc<Semaphore>,
    idle: Mutex<Vec<UnixStream>>,
    dispatch: Dispatch,
}

/// A request as tiny_http will see it.
pub struct Outgoing<'a> {
    pub method: &'a str,
    pub target: &'a str,
    pub headers: &'a [(String, String)],
    pub body: &'a [u8],
}

/// tiny_http's answer, its body not read yet.
pub struct Relayed {
    pub status: u16,
    pub headers: Vec<(&'static str, String)>,
    length: u64,
    /// Body bytes read with the head.
    early: Vec<u8>,
    conn: UnixStream,
    reusable: bool,
    backend: Arc<Backend>,
    _turn: SemaphoreGuardArc,
}

async fn within<T>(limit: Duration, f: impl std::future::Future<Output = std::io::Result<T>>) -> Result<T, RelayError> {
    async { f.await.map_err(|_| RelayError::Unavailable) }
        .or(async {
            smol::Timer::after(limit).await;
            Err(RelayError::Timeout)
        })
        .await
}

fn visible(v: &str) -> bool {
    v.bytes().all(|b| b == b'\t' || (0x20..0x7f).contains(&b))
}

/// The canonical request bytes.
fn request_bytes(req: &Outgoing) -> Vec<u8> {
    let mut out = format!("{} {} HTTP/1.1\r\nHost: imgate\r\n", req.method, req.target);
    for name in PASSED {
        if let Some((_, v)) = req.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)) {
            if visible(v) {
                out.push_str(&format!("{name}: {v}\r\n"));
            }
        }
    }
    out.push_str(&format!("Content-Length: {}\r\n\r\n", req.body.len()));
    let mut bytes = out.into_bytes();
    bytes.extend_from_slice(req.body);
    bytes
}

/// An answer head: its status, the headers kept, the body length, whether the connection
/// may carry another request.
type AnswerHead = (u16, Vec<(&'static str, String)>, u64, bool);

fn parse_answer(head: &[u8]) -> Option<AnswerHead> {
    let text = std::str::from_utf8(head).ok()?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next()?;
    let status: u16 = status_line.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()?;
    let (mut headers, mut length, mut reusable) = (Vec::new(), None, true);
    for line in lines.filter(|l| !l.is_empty()) {
        let (name, value) = line.split_once(':')?;
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            length = Some(value.parse().ok()?);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            return None; // every answer of ours has a known length
        } else if name.eq_ignore_ascii_case("connection") {
            reusable &= !value.eq_ignore_ascii_case("close");
        } else if let Some(kept) = RETURNED.iter().find(|k| k.eq_ignore_ascii_case(name)) {
            headers.push((*kept, value.to_string()));
        }
    }
    Some((status, headers, length?, reusable))
}

impl Backend {
    pub fn new(socket: PathBuf, dispatch: Dispatch) -> Arc<Backend> {
        Arc::new(Backend {
            socket,
            turns: Arc::new(Semaphore::new(CONCURRENT)),
            idle: Mutex::new(Vec::new()),
            dispatch,
        })
    }

    fn pooled(&self) -> Option<UnixStream> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop()
    }

    fn give_back(&self, conn: UnixStream) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < POOLED {
            idle.push(conn);
        }
    }

    /// Sends `req` to tiny_http and reads its answer's head.
    pub async fn exchange(self: &Arc<Self>, req: &Outgoing<'_>) -> Result<Relayed, RelayError> {
        let turn = async { Some(self.turns.acquire_arc().await) }
            .or(async {
                smol::Timer::after(WAIT).await;
                None
            })
            .await
            .ok_or(RelayError::Busy)?;
        let bytes = request_bytes(req);
        // A pooled connection may have been closed by tiny_http meanwhile: then a fresh one.
        let mut attempt = 0;
        loop {
            attempt += 1;
            let (mut conn, fresh) = match self.pooled() {
                Some(c) => (c, false),
                None => (within(STALL, UnixStream::connect(&self.socket)).await?, true),
            };
            (self.dispatch)();
            match self.round_trip(&mut conn, &bytes).await {
                Ok((status, headers, length, early, reusable)) => {
                    return Ok(Relayed {
                        status,
                        headers,
                        length,
                        early,
                        conn,
                        reusable,
                        backend: self.clone(),
                        _turn: turn,
                    })
                }
                Err(RelayError::Unavailable) if !fresh && attempt < 3 => continue,
                Err(e) => return Err(e),
            }
        }
    }

    #[allow(clippy::type_complexity)]
    async fn round_trip(
        &self,
        conn: &mut UnixStream,
        bytes: &[u8],
    ) -> Result<(u16, Vec<(&'static str, String)>, u64, Vec<u8>, bool), RelayError> {
        within(STALL, conn.write_all(bytes)).await?;
        let deadline = Instant::now() + ANSWER;
        let mut buf = Vec::with_capacity(1024);
        let mut chunk = [0u8; 4096];
        let end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            if buf.len() > MAX_HEAD {
                return Err(RelayError::Unavailable);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let n = within(left, conn.read(&mut chunk)).await?;
            if n == 0 {
                return Err(RelayError::Unavailable);
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let (status, headers, length, reusable) = parse_answer(&buf[..end]).ok_or(RelayError::Unavailable)?;
        let mut early = buf.split_off(end);
        early.truncate(usize::try_from(length).unwrap_or(usize::MAX));
        Ok((status, headers, length, early, reusable))
    }
}

impl Relayed {
    pub fn length(&self) -> u64 {
        self.length
    }

    /// The whole body, for answers the front door looks at (small JSON).
    pub async fn read_all(mut self, limit: u64) -> Result<Vec<u8>, RelayError> {
        if self.length > limit {
            return Err(RelayError::Unavailable);
        }
        let mut body = std::mem::take(&mut self.early);
        let mut chunk = [0u8; 8192];
        while (body.len() as u64) < self.length {
            let want = ((self.length - body.len() as u64) as usize).min(chunk.len());
            let n = within(STALL, self.conn.read(&mut chunk[..want])).await?;
            if n == 0 {
                return Err(RelayError::Unavailable);
            }
            body.extend_from_slice(&chunk[..n]);
        }
        if self.reusable {
            self.backend.give_back(self.conn);
        }
        Ok(body)
    }

    /// Streams the body to the client; a stall of `write` on either side ends it. The internal
    /// connection goes back to the pool when the body went through whole.
    pub async fn copy_to<W: AsyncWrite + Unpin>(mut self, client: &mut W, write: Duration) -> bool {
        let mut sent = 0u64;
        if !self.early.is_empty() {
            if within(write, client.write_all(&self.early)).await.is_err() {
                return false;
            }
            sent = self.early.len() as u64;
        }
        let mut chunk = [0u8; 16 * 1024];
        while sent < self.length {
            let want = ((self.length - sent) as usize).min(chunk.len());
            let n = match within(STALL, self.conn.read(&mut chunk[..want])).await {
                Ok(n) if n > 0 => n,
                _ => return false,
            };
            if within(write, client.write_all(&chunk[..n])).await.is_err() {
                return false;
            }
            sent += n as u64;
        }
        if self.reusable {
            self.backend.give_back(self.conn);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_written_canonically_with_only_the_listed_headers() {
        let headers = vec![
            ("authorization".to_string(), "Bearer k".to_string()),
            ("X-Smuggle".to_string(), "1".to_string()),
            ("Content-Type".to_string(), "caf\u{e9}".to_string()),
        ];
        let req = Outgoing {
            method: "POST",
            target: "/files/uploads",
            headers: &headers,
            body: b"abc",
        };
        assert_eq!(
            String::from_utf8(request_bytes(&req)).unwrap(),
            "POST /files/uploads HTTP/1.1\r\nHost: imgate\r\nAuthorization: Bearer k\r\nContent-Length: 3\r\n\r\nabc"
        );
    }

    #[test]
    fn answers_need_a_length_and_keep_only_their_content_headers() {
        let (status, headers, length, reusable) = parse_answer(
            b"HTTP/1.1 200 OK\r\nServer: tiny-http\r\nContent-Type: text/plain\r\nContent-Length: 5\r\nConnection: close\r\n\r\n",
        )
        .unwrap();
        assert_eq!((status, length, reusable), (200, 5, false));
        assert_eq!(headers, vec![("Content-Type", "text/plain".to_string())]);
        assert!(parse_answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n").is_none());
        assert!(parse_answer(b"HTTP/1.1 200 OK\r\n\r\n").is_none());
    }
}
