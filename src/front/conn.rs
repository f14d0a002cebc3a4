//! One client connection, request after request (RFC 9112 keep-alive): every head is read
//! within its deadline and parsed here, every body is read here under its route's cap and
//! deadline, every answer is written here. The service only sees framed requests.
//!
//! Bounds: the read buffer never holds more than a head (`MAX_HEAD`) plus one read; a body never
//! more than its cap; a head must arrive within `head` of its first byte (of the accept, for
//! the first request), a keep-alive connection may idle `idle` between requests, a body may
//! pause `body_idle` and must arrive whole by `body_idle` plus its size at `min_rate`.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use smol::future::FutureExt;
use smol::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::body::{BodyError, Dechunker};
use super::head::{self, Framing, Head, MAX_HEAD};
use super::relay::Relayed;

/// Bytes read from the socket at a time.
pub const READ_CHUNK: usize = 8 * 1024;
/// After an answer that refuses a body still arriving (413, 401), the rest is read and dropped
/// for at most this long and this many bytes before the connection closes: closing at once
/// would reset it, and the client would never read the answer.
const LINGER: Duration = Duration::from_secs(2);
const LINGER_BYTES: u64 = 16 << 20;

/// The time limits of a connection.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub head: Duration,
    pub idle: Duration,
    pub body_idle: Duration,
    /// Bytes per second a body must average (after `body_idle`).
    pub min_rate: u64,
    /// How long writing an answer may stall.
    pub write: Duration,
}

/// An answer to write.
pub struct Answer {
    pub status: u16,
    /// Headers besides `Content-Length` and `Connection`.
    pub headers: Vec<(&'static str, String)>,
    pub body: Body,
    /// Close the connection after this answer.
    pub close: bool,
}

pub enum Body {
    Bytes(Vec<u8>),
    /// Streamed from tiny_http.
    Relay(Box<Relayed>),
}

impl Answer {
    pub fn json(status: u16, body: String) -> Answer {
        Answer {
            status,
            headers: vec![("Content-Type", "application/json".into())],
            body: Body::Bytes(body.into_bytes()),
            close: false,
        }
    }

    /// `{"error": code}`.
    pub fn error(status: u16, code: &str) -> Answer {
        Answer::json(status, format!("{{\"error\":\"{code}\"}}"))
    }

    pub fn closing(mut self) -> Answer {
        self.close = true;
        self
    }
}

/// Whatever a request holds until its answer is written (a place in a count, a budget share).
pub type Hold = Box<dyn std::any::Any + Send>;

/// What to do with a request whose head passed.
pub enum Plan {
    /// Read its body (at most `cap` bytes), then `answer`.
    Read { cap: u64, hold: Hold },
    /// Hand its body (at most `cap` bytes) to `sink` piece by piece as it arrives; the sink
    /// gives the answer.
    Stream { cap: u64, hold: Hold, sink: Box<dyn Sink> },
    /// Answer without reading the body; the connection closes if one was announced.
    Answer(Answer),
    /// Hand the connection over (a WebSocket upgrade).
    Upgrade,
}

/// Why a connection ended without an answer of the service, for counting.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Refused {
    /// 400, 431, 501, 505, or the HTTP/2 preface (status 0).
    BadHead(u16),
    /// 400 or 413 for the body.
    BadBody(u16),
    /// 408: a head not complete in time.
    SlowHead,
    /// 408: a body that stalled or came too slowly.
    SlowBody,
}

pub type Reply<'a> = Pin<Box<dyn Future<Output = Answer> + Send + 'a>>;

/// A body taken as it arrives (an upload written to disk), never held whole.
pub trait Sink: Send {
    /// The next bytes of the body, in order. `Err`: the request ends with that answer, the
    /// rest of the body unread (the connection closes).
    fn feed<'a>(&'a mut self, bytes: &'a [u8]) -> Pin<Box<dyn Future<Output = Result<(), Answer>> + Send + 'a>>;
    /// The body is complete: the answer.
    fn finish(self: Box<Self>) -> Pin<Box<dyn Future<Output = Answer> + Send>>;
}

/// The routes behind the framing.
pub trait Service: Sync {
    fn plan(&self, head: &Head) -> Plan;
    fn answer<'a>(&'a self, head: &'a Head, body: Vec<u8>) -> Reply<'a>;
    /// A request refused by the framing itself.
    /// `head`: the request's, once it was read (a refused body).
    fn refused(&self, why: Refused, head: Option<&Head>);
}

/// What the front door follows of one connection (its slot, `front::slots`).
pub trait Lifecycle: Sync {
    /// Waiting between two requests (`true`: it may be closed to make room), or reading one.
    fn idle(&self, _idle: bool) {}
    /// Whether a request with this head may be served on this connection.
    fn admits(&self, _head: &Head) -> bool {
        true
    }
    /// The connection's socket, to wait on for the next request without reading; `None`: read
    /// at once (a TLS stream may hold a request already read from the socket).
    fn socket(&self) -> Option<&smol::Async<std::net::TcpStream>> {
        None
    }
    /// When the connection was accepted: the first head is due `head` after it (a TLS
    /// handshake counts against it); `None`: from when the loop starts.
    fn opened(&self) -> Option<Instant> {
        None
    }
}

/// A connection nobody follows (the fuzz target, tests).
pub struct Untracked;

impl Lifecycle for Untracked {}

/// How a connection ended.
pub enum Outcome<S> {
    Closed,
    /// The client asked for an upgrade: the head, the stream, and bytes already read after it.
    Upgrade(Head, S, Vec<u8>),
}

/// The buffered client stream.
struct Conn<S> {
    io: S,
    buf: Vec<u8>,
}

#[derive(Debug)]
enum ReadError {
    Closed,
    TimedOut,
    TooLarge,
    /// A head line ended in LF alone.
    BareLf,
}

/// Why a streamed body ended early.
enum StreamError {
    Read(ReadError),
    Body(BodyError),
    /// The sink refused it with this answer.
    Refused(Answer),
}

async fn within<T>(deadline: Instant, f: impl Future<Output = T>) -> Option<T> {
    async { Some(f.await) }
        .or(async {
            smol::Timer::at(deadline).await;
            None
        })
        .await
}

impl<S: AsyncRead + AsyncWrite + Unpin> Conn<S> {
    /// Reads more bytes into the buffer, by `deadline`.
    async fn fill(&mut self, deadline: Instant) -> Result<(), ReadError> {
        let mut chunk = [0u8; READ_CHUNK];
        match within(deadline, self.io.read(&mut chunk)).await {
            None => Err(ReadError::TimedOut),
            Some(Ok(0)) | Some(Err(_)) => Err(ReadError::Closed),
            Some(Ok(n)) => {
                self.buf.extend_from_slice(&chunk[..n]);
                debug_assert!(self.buf.len() <= MAX_HEAD + READ_CHUNK + 4, "head buffer bound");
                Ok(())
            }
        }
    }

    /// The next head: all of it within `head` (the first request of a connection), or its
    /// first byte within `idle` and the rest within `head` of that (a keep-alive request).
    async fn head(
        &mut self,
        first: bool,
        idle: Duration,
        head: Duration,
        life: &dyn Lifecycle,
    ) -> Result<Vec<u8>, ReadError> {
        let mut started = first || !self.buf.is_empty();
        let since = life.opened().filter(|_| first).unwrap_or_else(Instant::now);
        let mut deadline = since + if started { head } else { idle };
        if !started {
            life.idle(true);
            // A client sends its next request once it has read the last answer, so a read
            // now would nearly always come back empty: one wasted syscall a request. Waiting
            // for the socket to turn readable costs nothing more (the read after it arms the
            // same poll), and a pipelined request already there is reported at once.
            if let Some(socket) = life.socket() {
                if within(deadline, socket.readable()).await.is_none() {
                    return Err(ReadError::TimedOut);
                }
            }
        }
        let mut checked = 0;
        loop {
            if let Some((start, end)) = head::find_end(&self.buf) {
                let bytes = self.buf[start..end].to_vec();
                self.buf.drain(..end);
                return Ok(bytes);
            }
            if self.buf.len() > MAX_HEAD + 4 {
                return Err(ReadError::TooLarge);
            }
            if head::has_bare_lf(&self.buf, checked) {
                return Err(ReadError::BareLf);
            }
            checked = self.buf.len();
            self.fill(deadline).await?;
            if !started {
                started = true;
                life.idle(false);
                deadline = Instant::now() + head;
            }
        }
    }

    /// Exactly `n` body bytes (the caller checked `n` against the cap).
    async fn exact(&mut self, n: u64, limits: &Limits) -> Result<Vec<u8>, ReadError> {
        let n = usize::try_from(n).map_err(|_| ReadError::TooLarge)?;
        let end = body_deadline(n as u64, limits);
        let mut body = Vec::with_capacity(n.min(READ_CHUNK * 8));
        let take = n.min(self.buf.len());
        body.extend(self.buf.drain(..take));
        let mut chunk = [0u8; READ_CHUNK];
        while body.len() < n {
            let want = (n - body.len()).min(READ_CHUNK);
            let k = self.body_read(&mut chunk[..want], end, limits).await?;
            body.extend_from_slice(&chunk[..k]);
        }
        Ok(body)
    }

    /// One read of body bytes into `into`: by `end`, and within `body_idle` of the last one.
    async fn body_read(&mut self, into: &mut [u8], end: Instant, limits: &Limits) -> Result<usize, ReadError> {
        let deadline = end.min(Instant::now() + limits.body_idle);
        match within(deadline, self.io.read(into)).await {
            None => Err(ReadError::TimedOut),
            Some(Ok(0)) | Some(Err(_)) => Err(ReadError::Closed),
            Some(Ok(k)) => Ok(k),
        }
    }

    /// A chunked body, de-chunked, under `cap`.
    async fn chunked(&mut self, cap: u64, limits: &Limits) -> Result<Vec<u8>, Result<BodyError, ReadError>> {
        let end = body_deadline(cap, limits);
        let mut d = Dechunker::default();
        let mut body = Vec::new();
        loop {
            let used = d.feed(&self.buf, &mut body, cap).map_err(Ok)?;
            self.buf.drain(..used);
            if d.is_done() {
                return Ok(body);
            }
            let deadline = end.min(Instant::now() + limits.body_idle);
            self.fill(deadline).await.map_err(Err)?;
        }
    }

    /// Hands a body to `sink` as it arrives, under the deadlines of `exact` and `chunked`: the
    /// connection holds at most one read of it at a time.
    async fn stream(
        &mut self,
        body: Framing,
        cap: u64,
        limits: &Limits,
        sink: &mut dyn Sink,
    ) -> Result<(), StreamError> {
        match body {
            Framing::None => Ok(()),
            Framing::Length(n) => {
                let end = body_deadline(n, limits);
                let mut left = n;
                let take = usize::try_from(left).unwrap_or(usize::MAX).min(self.buf.len());
                if take > 0 {
                    let early: Vec<u8> = self.buf.drain(..take).collect();
                    sink.feed(&early).await.map_err(StreamError::Refused)?;
                    left -= take as u64;
                }
                let mut chunk = [0u8; READ_CHUNK];
                while left > 0 {
                    let want = usize::try_from(left).unwrap_or(usize::MAX).min(READ_CHUNK);
                    let k = self
                        .body_read(&mut chunk[..want], end, limits)
                        .await
                        .map_err(StreamError::Read)?;
                    sink.feed(&chunk[..k]).await.map_err(StreamError::Refused)?;
                    left -= k as u64;
                }
                Ok(())
            }
            Framing::Chunked => {
                let end = body_deadline(cap, limits);
                let mut d = Dechunker::default();
                let (mut got, mut data) = (0u64, Vec::with_capacity(READ_CHUNK));
                loop {
                    data.clear();
                    let used = d
                        .feed(&self.buf, &mut data, cap.saturating_sub(got))
                        .map_err(StreamError::Body)?;
                    self.buf.drain(..used);
                    got += data.len() as u64;
                    if !data.is_empty() {
                        sink.feed(&data).await.map_err(StreamError::Refused)?;
                    }
                    if d.is_done() {
                        return Ok(());
                    }
                    let deadline = end.min(Instant::now() + limits.body_idle);
                    self.fill(deadline).await.map_err(StreamError::Read)?;
                }
            }
        }
    }

    /// Ends the sending side, then drops what the client still sends, briefly (see `LINGER`).
    async fn linger(&mut self) {
        let _ = within(Instant::now() + LINGER, self.io.close()).await;
        let deadline = Instant::now() + LINGER;
        let mut chunk = [0u8; READ_CHUNK];
        let mut dropped = 0u64;
        while dropped < LINGER_BYTES {
            match within(deadline, self.io.read(&mut chunk)).await {
                Some(Ok(n)) if n > 0 => dropped += n as u64,
                _ => break,
            }
        }
    }

    async fn write(&mut self, bytes: &[u8], limits: &Limits) -> bool {
        within(Instant::now() + limits.write, self.io.write_all(bytes))
            .await
            .is_some_and(|r| r.is_ok())
    }
}

/// When a body of `n` bytes must be complete at the latest.
fn body_deadline(n: u64, limits: &Limits) -> Instant {
    Instant::now() + limits.body_idle + Duration::from_secs(n / limits.min_rate.max(1))
}

fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        101 => "Switching Protocols",
        200 => "OK",
        202 => "Accepted",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Content Too Large",
        417 => "Expectation Failed",
        426 => "Upgrade Required",
        431 => "Request Header Fields Too Large",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        _ => "Status",
    }
}

/// A whole JSON error answer that closes the connection, for the places that write one
/// outside a connection's loop.
pub fn error_bytes(status: u16, code: &str) -> Vec<u8> {
    let body = format!("{{\"error\":\"{code}\"}}");
    let mut out = head_bytes(
        status,
        &[("Content-Type", "application/json".into())],
        body.len() as u64,
        true,
    );
    out.extend_from_slice(body.as_bytes());
    out
}

/// The status line and headers of an answer.
pub fn head_bytes(status: u16, headers: &[(&str, String)], length: u64, close: bool) -> Vec<u8> {
    use std::fmt::Write;
    // One buffer, written in place, with room for a small body after it: every answer has a
    // head, and a webhook's answer is mostly head.
    let mut out = String::with_capacity(160 + length.min(1024) as usize);
    let _ = write!(out, "HTTP/1.1 {status} {}\r\n", reason(status));
    for (name, value) in headers {
        let _ = write!(out, "{name}: {value}\r\n");
    }
    let _ = write!(out, "Content-Length: {length}\r\n");
    if close {
        out.push_str("Connection: close\r\n");
    }
    out.push_str("\r\n");
    out.into_bytes()
}

/// Writes an answer; false when the connection must end (the write failed or `close`).
async fn write_answer<S>(conn: &mut Conn<S>, answer: Answer, head_only: bool, limits: &Limits) -> bool
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let close = answer.close;
    match answer.body {
        Body::Bytes(bytes) => {
            let mut out = head_bytes(answer.status, &answer.headers, bytes.len() as u64, close);
            if !head_only {
                out.extend_from_slice(&bytes);
            }
            conn.write(&out, limits).await && !close
        }
        Body::Relay(relayed) => {
            let out = head_bytes(answer.status, &answer.headers, relayed.length(), close);
            if !conn.write(&out, limits).await {
                return false;
            }
            if head_only {
                // The backend's body is not wanted: its connection is not reused.
                return !close;
            }
            relayed.copy_to(&mut conn.io, limits.write).await && !close
        }
    }
}

/// Serves requests on `io` until the client or a limit ends the connection, or it upgrades.
pub async fn serve<S, V>(io: S, service: &V, limits: &Limits, life: &dyn Lifecycle) -> Outcome<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
    V: Service,
{
    let mut conn = Conn {
        io,
        buf: Vec::with_capacity(1024),
    };
    let mut first = true;
    loop {
        let bytes = match conn.head(first, limits.idle, limits.head, life).await {
            Ok(b) => b,
            Err(ReadError::Closed) => return Outcome::Closed,
            Err(ReadError::TimedOut) => {
                // Silence between requests is a keep-alive ending, not a slow client.
                if conn.buf.is_empty() && !first {
                    log::debug!("front door: idle keep-alive connection closed after {:?}", limits.idle);
                } else {
                    service.refused(Refused::SlowHead, None);
                    write_answer(&mut conn, Answer::error(408, "timeout").closing(), false, limits).await;
                }
                return Outcome::Closed;
            }
            Err(ReadError::TooLarge) => {
                service.refused(Refused::BadHead(431), None);
                let a = Answer::error(431, "header_too_large").closing();
                write_answer(&mut conn, a, false, limits).await;
                return Outcome::Closed;
            }
            Err(ReadError::BareLf) => {
                service.refused(Refused::BadHead(400), None);
                write_answer(&mut conn, Answer::error(400, "bad_request").closing(), false, limits).await;
                return Outcome::Closed;
            }
        };
        first = false;
        let head = match head::parse(&bytes) {
            Ok(h) => h,
            Err(r) => {
                service.refused(Refused::BadHead(r.status), None);
                if r.status != 0 {
                    log::debug!("front door: refused a request head: {}", r.why);
                    let code = match r.status {
                        431 => "header_too_large",
                        501 => "not_implemented",
                        505 => "http_version_not_supported",
                        _ => "bad_request",
                    };
                    write_answer(&mut conn, Answer::error(r.status, code).closing(), false, limits).await;
                }
                return Outcome::Closed;
            }
        };
        if !life.admits(&head) {
            // Admitted past the slots for the data plane only (`front::slots`).
            let a = Answer::error(503, "too_many_connections").closing();
            write_answer(&mut conn, a, head.method == "HEAD", limits).await;
            return Outcome::Closed;
        }
        let head_only = head.method == "HEAD";
        let announced = head.body != Framing::None && head.body != Framing::Length(0);
        let (cap, _hold, sink) = match service.plan(&head) {
            Plan::Upgrade => {
                let rest = std::mem::take(&mut conn.buf);
                return Outcome::Upgrade(head, conn.io, rest);
            }
            Plan::Answer(mut a) => {
                // An unread body would be taken for the next request.
                a.close |= announced || head.close;
                if !write_answer(&mut conn, a, head_only, limits).await {
                    if announced {
                        conn.linger().await;
                    }
                    return Outcome::Closed;
                }
                continue;
            }
            Plan::Read { cap, hold } => (cap, hold, None),
            Plan::Stream { cap, hold, sink } => (cap, hold, Some(sink)),
        };
        if let Framing::Length(n) = head.body {
            if n > cap {
                service.refused(Refused::BadBody(413), Some(&head));
                write_answer(&mut conn, Answer::error(413, "too_large").closing(), head_only, limits).await;
                conn.linger().await;
                return Outcome::Closed;
            }
        }
        // The service accepted the head (routed, authenticated as far as a head can be, within
        // the cap): only now may the client send its body. Never to HTTP/1.0 (RFC 9110 15.2).
        let continue_wanted = head.expect_continue && announced && head.version == head::Version::Http11;
        if continue_wanted && !conn.write(b"HTTP/1.1 100 Continue\r\n\r\n", limits).await {
            return Outcome::Closed;
        }
        if let Some(mut sink) = sink {
            let answer = match conn.stream(head.body, cap, limits, &mut *sink).await {
                Ok(()) => Ok(sink.finish().await),
                Err(StreamError::Refused(answer)) => {
                    // The rest of the body is not read: the connection cannot carry another
                    // request, and the client reads the answer only if it is not reset.
                    write_answer(&mut conn, answer.closing(), head_only, limits).await;
                    conn.linger().await;
                    return Outcome::Closed;
                }
                Err(StreamError::Read(e)) => Err(Err(e)),
                Err(StreamError::Body(e)) => Err(Ok(e)),
            };
            match answer {
                Ok(mut answer) => {
                    answer.close |= head.close;
                    if !write_answer(&mut conn, answer, head_only, limits).await {
                        return Outcome::Closed;
                    }
                    continue;
                }
                Err(e) => return refuse_body(&mut conn, service, e, &head, limits).await,
            }
        }
        let body = match head.body {
            Framing::None => Ok(Vec::new()),
            Framing::Length(n) => conn.exact(n, limits).await.map_err(Err),
            Framing::Chunked => conn.chunked(cap, limits).await,
        };
        let body = match body {
            Ok(b) => b,
            Err(e) => return refuse_body(&mut conn, service, e, &head, limits).await,
        };
        let mut answer = service.answer(&head, body).await;
        answer.close |= head.close;
        if !write_answer(&mut conn, answer, head_only, limits).await {
            return Outcome::Closed;
        }
    }
}

/// Answers a body that could not be read (too large, malformed, too slow) and ends the
/// connection.
async fn refuse_body<S, V>(
    conn: &mut Conn<S>,
    service: &V,
    e: Result<BodyError, ReadError>,
    head: &Head,
    limits: &Limits,
) -> Outcome<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
    V: Service,
{
    let (status, code) = match e {
        Ok(BodyError::TooLarge) | Err(ReadError::TooLarge) => (413, "too_large"),
        Ok(BodyError::Malformed(why)) => {
            log::debug!("front door: refused a chunked body: {why}");
            (400, "bad_request")
        }
        // Only a head is checked for line ends; listed for completeness.
        Err(ReadError::BareLf) => (400, "bad_request"),
        Err(ReadError::TimedOut) => (408, "timeout"),
        Err(ReadError::Closed) => return Outcome::Closed,
    };
    let why = match status {
        408 => Refused::SlowBody,
        _ => Refused::BadBody(status),
    };
    service.refused(why, Some(head));
    write_answer(
        conn,
        Answer::error(status, code).closing(),
        head.method == "HEAD",
        limits,
    )
    .await;
    if status == 413 {
        conn.linger().await;
    }
    Outcome::Closed
}
