//! The front door: owns the one TCP port. It reads each connection's request head, completes
//! WebSocket upgrades for `{prefix}/ws` itself and relays every other connection to the
//! tiny_http server on a private Unix socket (tiny_http cannot hand over an upgraded socket).

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use async_tungstenite::tungstenite::handshake::server::{Request, Response};
use async_tungstenite::tungstenite::http::HeaderValue;
use smol::future::FutureExt;
use smol::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use smol::net::unix::UnixStream;
use smol::net::{TcpListener, TcpStream};

use crate::app::App;
use crate::ids;
use crate::protocol::SUBPROTOCOL;

/// Longest request head accepted; beyond it the answer is 431.
const MAX_HEAD: usize = 16 * 1024;
/// A client must finish its request head within this time (slow clients are cut off).
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// A request whose client sends nothing for this long is cut off (slowloris).
const BODY_IDLE: Duration = Duration::from_secs(10);
/// An idle keep-alive connection is closed after this long, freeing its slot.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(60);
/// Largest data-plane packet; a bigger frame closes that connection, not the process.
pub const MAX_PACKET: usize = 1 << 20;

/// Accepts connections until the future is dropped (shutdown).
pub async fn serve(app: Arc<App>, listener: TcpListener, backend: PathBuf, prefix: String) {
    let active = Arc::new(AtomicUsize::new(0));
    let backend = Arc::new(backend);
    let prefix = Arc::new(prefix);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(v) => v,
            Err(e) => {
                // Typically EMFILE: wait a moment instead of spinning.
                log::warn!("listener: accept failed: {e}");
                smol::Timer::after(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Packets and answers are small writes; Nagle's delay would add ~40 ms to each.
        let _ = stream.set_nodelay(true);
        let max = app.config.server.max_connections;
        if active.fetch_add(1, Ordering::SeqCst) >= max {
            active.fetch_sub(1, Ordering::SeqCst);
            log::warn!("listener: {max} connections open; refusing {peer} with 503");
            crate::runtime::spawn(async move {
                let mut s = stream;
                let _ = s
                    .write_all(&plain(
                        503,
                        "Service Unavailable",
                        "{\"error\":\"too_many_connections\"}",
                    ))
                    .await;
            })
            .detach();
            continue;
        }
        let guard = Slot(active.clone());
        // A connection holds the app only once it becomes a data-plane session, so waiting
        // clients never hold up a shutdown.
        let (app, backend, prefix) = (Arc::downgrade(&app), backend.clone(), prefix.clone());
        crate::runtime::spawn(async move {
            let _guard = guard;
            handle(app, stream, peer.to_string(), &backend, &prefix).await;
        })
        .detach();
    }
}

/// Frees a connection slot when the connection ends, however it ends.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn plain(status: u16, reason: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// The parts of a request head the front door decides on.
pub struct Head {
    method: String,
    path: String,
    upgrade_websocket: bool,
    authorization: Option<String>,
    protocols: Vec<String>,
}

/// Reads the head at the start of `buf`; `None` for anything that is not an HTTP/1 head (answered
/// 400). Public for the fuzz target.
pub fn parse_head(buf: &[u8]) -> Option<Head> {
    // The buffer may already hold body bytes (binary uploads): read only the head.
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(buf.len());
    let text = std::str::from_utf8(&buf[..end]).ok()?;
    let mut lines = text.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let method = first.next()?.to_string();
    let target = first.next()?;
    let path = target.split('?').next().unwrap_or(target).to_string();
    let mut head = Head {
        method,
        path,
        upgrade_websocket: false,
        authorization: None,
        protocols: Vec::new(),
    };
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match name.trim().to_ascii_lowercase().as_str() {
            "upgrade" => head.upgrade_websocket = value.eq_ignore_ascii_case("websocket"),
            "authorization" => head.authorization = Some(value.to_string()),
            "sec-websocket-protocol" => head.protocols.extend(value.split(',').map(|p| p.trim().to_string())),
            _ => {}
        }
    }
    Some(head)
}

/// Reads until the end of the request head; `None` on timeout, EOF or an oversized head.
async fn read_head(stream: &mut TcpStream) -> Result<Vec<u8>, u16> {
    let mut buf = Vec::with_capacity(1024);
    let read = async {
        let mut chunk = [0u8; 2048];
        loop {
            let n = stream.read(&mut chunk).await.map_err(|_| 0u16)?;
            if n == 0 {
                return Err(0);
            }
            buf.extend_from_slice(&chunk[..n]);
            if buf.windows(4).any(|w| w == b"\r\n\r\n") {
                return Ok(());
            }
            if buf.len() > MAX_HEAD {
                return Err(431);
            }
        }
    };
    let outcome: Result<(), u16> = read
        .or(async {
            smol::Timer::after(HEAD_TIMEOUT).await;
            Err(408)
        })
        .await;
    outcome.map(|()| buf)
}

async fn handle(app: Weak<App>, mut stream: TcpStream, peer: String, backend: &PathBuf, prefix: &str) {
    let buf = match read_head(&mut stream).await {
        Ok(b) => b,
        Err(0) => return,
        Err(431) => {
            let _ = stream
                .write_all(&plain(
                    431,
                    "Request Header Fields Too Large",
                    "{\"error\":\"header_too_large\"}",
                ))
                .await;
            return;
        }
        Err(code) => {
            log::debug!("listener: {peer}: request head not finished in time");
            let _ = stream
                .write_all(&plain(code, "Request Timeout", "{\"error\":\"timeout\"}"))
                .await;
            return;
        }
    };
    let Some(head) = parse_head(&buf) else {
        let _ = stream
            .write_all(&plain(400, "Bad Request", "{\"error\":\"bad_request\"}"))
            .await;
        return;
    };
    let route = head
        .path
        .strip_prefix(prefix)
        .filter(|r| r.starts_with('/'))
        .unwrap_or(&head.path);
    if route == "/ws" && head.method == "GET" {
        match app.upgrade().filter(|a| !a.is_stopping()) {
            Some(app) => upgrade(app, stream, buf, head, peer).await,
            None => {
                let _ = stream
                    .write_all(&plain(503, "Service Unavailable", "{\"error\":\"stopping\"}"))
                    .await;
            }
        }
    } else {
        relay(stream, buf, backend, &peer).await;
    }
}

async fn upgrade(app: Arc<App>, mut stream: TcpStream, buf: Vec<u8>, head: Head, peer: String) {
    if !head.upgrade_websocket {
        let _ = stream
            .write_all(&plain(
                426,
                "Upgrade Required",
                "{\"error\":\"websocket_upgrade_required\"}",
            ))
            .await;
        return;
    }
    if let Some(key) = &app.config.server.api_key {
        let given = head
            .authorization
            .as_deref()
            .and_then(|a| a.strip_prefix("Bearer "))
            .unwrap_or("");
        if !ids::secret_eq(given.trim(), key.expose()) {
            log::warn!("data plane: {peer}: /ws refused: missing or wrong API key");
            let _ = stream
                .write_all(&plain(401, "Unauthorized", "{\"error\":\"unauthorized\"}"))
                .await;
            return;
        }
    }
    if !head.protocols.iter().any(|p| p == SUBPROTOCOL) {
        log::warn!("data plane: {peer}: /ws refused: subprotocol {SUBPROTOCOL} not offered");
        let body = format!("{{\"error\":\"subprotocol_required\",\"detail\":\"offer {SUBPROTOCOL}\"}}");
        let _ = stream.write_all(&plain(400, "Bad Request", &body)).await;
        return;
    }
    // tungstenite's callback signature fixes the large error type.
    #[allow(clippy::result_large_err)]
    let callback = |_req: &Request, mut resp: Response| {
        resp.headers_mut()
            .insert("Sec-WebSocket-Protocol", HeaderValue::from_static(SUBPROTOCOL));
        Ok(resp)
    };
    let stream = Replay {
        head: buf,
        pos: 0,
        inner: stream,
    };
    match async_tungstenite::accept_hdr_async_with_config(stream, callback, Some(ws_config())).await {
        Ok(ws) => super::session::run(app, ws, peer).await,
        Err(e) => log::info!("data plane: {peer}: WebSocket handshake failed: {e}"),
    }
}

/// WebSocket limits shared by both transports.
pub fn ws_config() -> async_tungstenite::tungstenite::protocol::WebSocketConfig {
    async_tungstenite::tungstenite::protocol::WebSocketConfig::default()
        .max_message_size(Some(MAX_PACKET))
        .max_frame_size(Some(MAX_PACKET))
}

/// Passes the connection to tiny_http, bytes both ways, until either side is done.
async fn relay(client: TcpStream, head: Vec<u8>, backend: &PathBuf, peer: &str) {
    let mut server = match UnixStream::connect(backend).await {
        Ok(s) => s,
        Err(e) => {
            log::error!("listener: internal HTTP server unreachable: {e}");
            let mut c = client;
            let _ = c
                .write_all(&plain(503, "Service Unavailable", "{\"error\":\"unavailable\"}"))
                .await;
            return;
        }
    };
    // The head just read is a request in flight until the answer starts to flow back.
    let state = InFlight::started();
    if server.write_all(&head).await.is_err() {
        return;
    }
    let (mut c_read, mut c_write) = (client.clone(), client);
    let (mut s_read, mut s_write) = (server.clone(), server);
    let upstream = async {
        match pump_client(&mut c_read, &mut s_write, &state).await {
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                log::info!("listener: {peer}: {e}; connection closed");
                return; // ends the relay: both sockets close
            }
            _ => {
                // The client finished sending: let tiny_http see EOF, keep relaying its answer.
                let _ = s_write.shutdown(std::net::Shutdown::Write);
            }
        }
        std::future::pending::<()>().await;
    };
    let downstream = async {
        let _ = pump(&mut s_read, &mut c_write, || None, || state.answered()).await;
        let _ = c_write.shutdown(std::net::Shutdown::Both);
    };
    downstream.or(upstream).await;
    log::trace!("listener: {peer}: HTTP connection done");
}

/// Requests relayed to tiny_http whose answer has not started yet, over all connections.
/// Shutdown waits for this to reach zero before it stops the HTTP workers, because tiny_http
/// reads small bodies itself before a worker sees the request.
static REQUESTS_IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

pub fn requests_in_flight() -> usize {
    REQUESTS_IN_FLIGHT.load(Ordering::SeqCst)
}

/// One relayed connection's share of `REQUESTS_IN_FLIGHT`: client bytes start a request,
/// server bytes answer it (keep-alive connections alternate).
struct InFlight(AtomicBool);

impl InFlight {
    fn started() -> InFlight {
        REQUESTS_IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
        InFlight(AtomicBool::new(true))
    }
    fn request(&self) {
        if !self.0.swap(true, Ordering::SeqCst) {
            REQUESTS_IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
        }
    }
    fn answered(&self) {
        if self.0.swap(false, Ordering::SeqCst) {
            REQUESTS_IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
            crate::runtime::released();
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.answered();
    }
}

/// Client to tiny_http, with the slow-client limits: while a request is in flight its bytes must
/// keep coming (a sender trickling its body is cut off after `BODY_IDLE` of silence); between
/// requests a keep-alive connection may stay idle for `KEEPALIVE_IDLE`, then its slot is freed.
async fn pump_client<R, W>(from: &mut R, to: &mut W, state: &InFlight) -> std::io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let limit = || {
        Some(if state.0.load(Ordering::SeqCst) {
            (BODY_IDLE, "request body stalled")
        } else {
            (KEEPALIVE_IDLE, "idle keep-alive connection")
        })
    };
    pump(from, to, limit, || state.request()).await
}

/// Copies bytes until EOF or an error, calling `on_data` before each chunk is passed on. When
/// `limit` names a duration, a read that waits longer than the limit of that moment ends the
/// copy with `TimedOut`.
async fn pump<R, W>(
    from: &mut R,
    to: &mut W,
    limit: impl Fn() -> Option<(Duration, &'static str)>,
    on_data: impl Fn(),
) -> std::io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = [0u8; 8192];
    loop {
        let started = std::time::Instant::now();
        let n = async { from.read(&mut buf).await }
            .or(async {
                // Checked again whenever it runs out: the limit may have changed during the
                // wait (an answer went out, so the connection went from busy to keep-alive).
                loop {
                    let Some((limit, what)) = limit() else {
                        return std::future::pending().await;
                    };
                    match limit.checked_sub(started.elapsed()) {
                        Some(left) if !left.is_zero() => smol::Timer::after(left).await,
                        _ => {
                            let e = format!("{what} for {limit:?}");
                            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, e));
                        }
                    };
                }
            })
            .await?;
        if n == 0 {
            return Ok(());
        }
        on_data();
        to.write_all(&buf[..n]).await?;
    }
}

/// A stream that first yields the bytes already read, then the socket.
struct Replay<S> {
    head: Vec<u8>,
    pos: usize,
    inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Replay<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, out: &mut [u8]) -> Poll<std::io::Result<usize>> {
        if self.pos < self.head.len() {
            let n = (self.head.len() - self.pos).min(out.len());
            let start = self.pos;
            out[..n].copy_from_slice(&self.head[start..start + n]);
            self.pos += n;
            if self.pos == self.head.len() {
                self.head = Vec::new();
                self.pos = 0;
            }
            return Poll::Ready(Ok(n));
        }
        Pin::new(&mut self.inner).poll_read(cx, out)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Replay<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_close(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_head_parses_even_when_binary_body_bytes_follow_it() {
        let mut buf = b"POST /files/uploads?x=1 HTTP/1.1\r\nAuthorization: Bearer k\r\nUpgrade: websocket\r\nSec-WebSocket-Protocol: a, xagent.connector.packet.v1\r\n\r\n".to_vec();
        buf.extend_from_slice(&[0x89, 0xff, 0xfe, 0x00]);
        let h = parse_head(&buf).expect("parses");
        assert_eq!((h.method.as_str(), h.path.as_str()), ("POST", "/files/uploads"));
        assert_eq!(h.authorization.as_deref(), Some("Bearer k"));
        assert!(h.upgrade_websocket && h.protocols.contains(&SUBPROTOCOL.to_string()));
        assert!(parse_head(b"\xff\xfe\r\n\r\n").is_none());
        for input in crate::testutil::mutations(&[&buf], 3000, 9) {
            let _ = parse_head(&input);
        }
    }
}
