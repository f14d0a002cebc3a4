//! The front door: owns the one TCP port and frames every request on every connection itself
//! (`conn`, `head`, `body`). Behind the framing (`Service`):
//!
//! - `GET {prefix}/ws` is upgraded here (`upgrade`) and becomes a data-plane session;
//! - a provider's own routes (`POST /hooks/NAME`, `POST /telegram/webhook`) are answered here,
//!   on the executor, awaiting the group commit without a thread per waiting sender;
//! - every other route goes to tiny_http's handlers as a request written out again (`relay`).
//!
//! Limits: `max_connections` slots (clamped to the file descriptors the process may open), a
//! head, body, idle and write deadline per request, a cap per body, and two budgets of body
//! bytes held in memory at once (any route; uploads), so neither a slow client nor many of them
//! can hold the workers, the memory or the slots for long.

pub mod body;
pub mod conn;
pub mod head;
pub mod relay;
pub mod slots;
pub mod stats;
pub mod upgrade;
pub mod upload;

use crate::atomic::AtomicU64;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use smol::future::FutureExt;
use smol::io::AsyncWriteExt;
use smol::net::{TcpListener, TcpStream};

use self::conn::{Answer, Body, Limits, Plan, Refused, Reply, Service};
use self::head::{Framing, Head};
use self::relay::{Backend, Outgoing, RelayError};
use self::stats::Cause;
use self::upload::Upload;
use crate::dataplane::Plane;
use crate::ids;
use crate::json;
use crate::providers::{HttpRequest, Reply as ProviderReply};

/// A request head must arrive within this (slow clients are cut off: 408).
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// A body may pause this long; a write to a client may stall this long.
const STALL: Duration = Duration::from_secs(10);
/// An idle keep-alive connection is closed after this long, freeing its slot.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(60);
/// Bytes a second a body must average once it started (a large body may take its time, a
/// trickling one may not hold a slot for hours).
const MIN_RATE: u64 = 16 * 1024;
/// Bodies of any route held in memory at once: at least this, or four of `max_body`. Bodies
/// declared under `SMALL_BODY` need no share of it (all connections together hold at most
/// `max_connections` of them), so large bodies trickled by many clients can never keep an
/// ordinary webhook out.
const BODY_BUDGET: u64 = 16 << 20;
const SMALL_BODY: u64 = 64 * 1024;
/// Uploads streaming to the file cache at once (each holds `upload::HELD` bytes of memory).
const UPLOADS_AT_ONCE: u64 = 4;
/// Room for the multipart framing around an uploaded file.
const MULTIPART_ROOM: u64 = 64 * 1024;
// A provider route's body up to `INLINE_PARSE` is handled (parsed) on the executor: that takes
// microseconds. A larger one is handled on the blocking pool, so one client's parse never holds
// up another client, the data plane or a commit's answer.
use crate::json::INLINE_PARSE;
/// tiny_http answers up to this size are read whole and written with their head at once.
const INLINE_ANSWER: u64 = 64 * 1024;
/// File descriptors kept for everything but client connections (the database, the internal
/// hop, outbound calls, pollers).
const RESERVED_FDS: u64 = 64;

pub const LIMITS: Limits = Limits {
    head: HEAD_TIMEOUT,
    idle: KEEPALIVE_IDLE,
    body_idle: STALL,
    min_rate: MIN_RATE,
    write: STALL,
};

/// Requests between their head and their answer, over all connections. Shutdown waits for it
/// to reach zero before it lets go of the plane.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
/// Set when shutdown begins: a request that starts after it is answered 503 (a kept-alive
/// connection outlives the listener, and a request on it must not reach an outbox being closed).
static STOPPING: AtomicBool = AtomicBool::new(false);

pub fn requests_in_flight() -> usize {
    IN_FLIGHT.load(Ordering::SeqCst)
}

/// Shutdown's first step: no request starts after this returns; those already started are
/// counted in `requests_in_flight`.
pub fn stop_accepting() {
    STOPPING.store(true, Ordering::SeqCst);
}

fn stopping() -> bool {
    STOPPING.load(Ordering::SeqCst)
}

struct InFlight;

impl InFlight {
    /// `None` once shutdown began. Counted first and the flag read after (both `SeqCst`,
    /// shutdown sets the flag before it reads the count): a request is either seen by the
    /// shutdown's wait or sees the flag, never neither.
    fn start() -> Option<InFlight> {
        IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
        let counted = InFlight;
        (!stopping()).then_some(counted)
    }
}

fn stopping_answer() -> Answer {
    Answer::error(503, "stopping").closing()
}

impl Drop for InFlight {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
        crate::runtime::released();
    }
}

/// Bytes of bodies held in memory at once.
struct Budget {
    used: AtomicU64,
    limit: u64,
}

struct Taken(Arc<Budget>, u64);

impl Drop for Taken {
    fn drop(&mut self) {
        self.0.used.fetch_sub(self.1, Ordering::SeqCst);
    }
}

impl Budget {
    fn take(self: &Arc<Self>, n: u64) -> Option<Taken> {
        let mut used = self.used.load(Ordering::SeqCst);
        loop {
            if used.saturating_add(n) > self.limit {
                return None;
            }
            match self
                .used
                .compare_exchange(used, used + n, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return Some(Taken(self.clone(), n)),
                Err(now) => used = now,
            }
        }
    }
}

/// What a request holds until its answer is written: its place in the in-flight count and
/// its share of a body budget.
struct Hold(#[allow(dead_code)] InFlight, #[allow(dead_code)] Option<Taken>);

pub struct FrontDoor {
    /// Held weakly: a connection that is only reading never delays a shutdown.
    plane: Weak<Plane>,
    prefix: String,
    backend: Arc<Backend>,
    max_body: u64,
    upload_cap: u64,
    api_key: Option<crate::config::Secret>,
    bodies: Arc<Budget>,
    uploads: Arc<Budget>,
    /// TLS on the listener, when configured.
    tls: Option<Arc<crate::tls::ListenerTls>>,
}

impl FrontDoor {
    pub fn new(
        plane: &Arc<Plane>,
        backend: Arc<Backend>,
        prefix: String,
        tls: Option<Arc<crate::tls::ListenerTls>>,
    ) -> Arc<FrontDoor> {
        let s = &plane.config.server;
        let upload_cap = plane.config.files.max_file_bytes + MULTIPART_ROOM;
        Arc::new(FrontDoor {
            plane: Arc::downgrade(plane),
            prefix,
            backend,
            max_body: s.max_body,
            upload_cap,
            api_key: s.api_key.clone(),
            bodies: Arc::new(Budget {
                used: AtomicU64::new(0),
                limit: BODY_BUDGET.max(s.max_body.saturating_mul(4)),
            }),
            uploads: Arc::new(Budget {
                used: AtomicU64::new(0),
                limit: upload::HELD.saturating_mul(UPLOADS_AT_ONCE),
            }),
            tls,
        })
    }

    /// The path below `public_url`'s prefix.
    fn route<'a>(&self, path: &'a str) -> &'a str {
        path.strip_prefix(self.prefix.as_str())
            .filter(|r| !self.prefix.is_empty() && r.starts_with('/'))
            .unwrap_or(path)
    }

    fn authorized(&self, head: &Head) -> bool {
        match &self.api_key {
            None => true,
            Some(key) => head
                .header("Authorization")
                .and_then(ids::bearer)
                .is_some_and(|t| ids::secret_eq(t, key.expose())),
        }
    }

    /// A provider route's answer from the head alone (unknown endpoint, wrong secret), given
    /// before the body is read or invited by `100 Continue`.
    fn screen(&self, head: &Head, route: &str, client: IpAddr) -> Option<Answer> {
        let plane = self.plane.upgrade()?;
        let provider = plane.providers.for_route(&head.method, route)?;
        let refused = provider.screen(&HttpRequest {
            path: route,
            headers: &head.headers,
            body: &[],
        })?;
        if refused.status == 401 {
            stats::note(Cause::Unauthorized, Some(client), &format!("{} {route}", head.method));
        }
        count_refused(&plane, provider.declaration().name, refused.status);
        Some(Answer::json(refused.status, json::to_string(&refused.body)))
    }

    /// A provider route's request refused before the provider saw its body (too large).
    fn count_refusal(&self, head: &Head, route: &str, status: u16) {
        let Some(plane) = self.plane.upgrade() else { return };
        if let Some(provider) = plane.providers.for_route(&head.method, route) {
            count_refused(&plane, provider.declaration().name, status);
        }
    }

    /// Reads a body of at most `max_body` bytes, held against the bodies' budget.
    fn read(&self, head: &Head, client: IpAddr) -> Plan {
        let cap = self.max_body;
        let size = match head.body {
            Framing::None => 0,
            Framing::Length(n) if n < SMALL_BODY => 0,
            Framing::Length(n) => n.min(cap),
            Framing::Chunked => cap,
        };
        let taken = if size == 0 {
            None
        } else {
            match self.bodies.take(size) {
                Some(t) => Some(t),
                None => {
                    stats::note(Cause::Busy, Some(client), "too many request bodies in memory at once");
                    return Plan::Answer(Answer::error(503, "busy"));
                }
            }
        };
        let Some(in_flight) = InFlight::start() else {
            return Plan::Answer(stopping_answer());
        };
        Plan::Read {
            cap,
            hold: Box::new(Hold(in_flight, taken)),
        }
    }

    /// `POST /files/uploads`, authorized: the body streams to the file cache (`upload`), which
    /// checks the channel and the multipart boundary the head names before it keeps a byte.
    fn upload(&self, head: &Head, client: IpAddr) -> Plan {
        let Some(plane) = self.plane.upgrade() else {
            return Plan::Answer(stopping_answer());
        };
        let Some(in_flight) = InFlight::start() else {
            return Plan::Answer(stopping_answer());
        };
        let Some(taken) = self.uploads.take(upload::HELD) else {
            stats::note(Cause::Busy, Some(client), "too many uploads at once");
            return Plan::Answer(Answer::error(503, "busy"));
        };
        Plan::Stream {
            cap: self.upload_cap,
            hold: Box::new(Hold(in_flight, Some(taken))),
            sink: Box::new(Upload::new(
                plane.app.host.clone(),
                head.header("X-XAgent-Connector-Channel-ID"),
                head.header("Content-Type"),
            )),
        }
    }

    async fn provider_answer(
        &self,
        provider: Arc<dyn crate::providers::Provider>,
        head: &Head,
        route: &str,
        body: Vec<u8>,
        client: IpAddr,
    ) -> Answer {
        let name = provider.declaration().name;
        let handled = if body.len() <= INLINE_PARSE {
            provider.handle(&HttpRequest {
                path: route,
                headers: &head.headers,
                body: &body,
            })
        } else {
            // Parsing a large body takes milliseconds: on the pool, no other client waits for it.
            let (head, route) = (head.clone(), route.to_string());
            crate::runtime::unblock(move || {
                provider.handle(&HttpRequest {
                    path: &route,
                    headers: &head.headers,
                    body: &body,
                })
            })
            .await
        };
        let answer = match handled {
            ProviderReply::Now(a) => a,
            ProviderReply::AfterCommit(ticket, answer) => answer(ticket.outcome().await),
            ProviderReply::Blocking(work) => crate::runtime::unblock(work).await,
        };
        if answer.status == 401 {
            stats::note(Cause::Unauthorized, Some(client), &format!("{} {route}", head.method));
        }
        if let Some(plane) = self.plane.upgrade() {
            count_refused(&plane, name, answer.status);
        }
        Answer::json(answer.status, json::to_string(&answer.body))
    }

    async fn relay_answer(&self, head: &Head, body: Vec<u8>, client: IpAddr) -> Answer {
        // HEAD is GET without the body; the front door leaves the body out.
        let method = if head.method == "HEAD" {
            "GET"
        } else {
            head.method.as_str()
        };
        let with_body = !matches!(method, "GET" | "DELETE" | "OPTIONS");
        let req = Outgoing {
            method,
            target: &head.target,
            headers: &head.headers,
            body: if with_body { &body } else { &[] },
        };
        match self.backend.exchange(&req).await {
            Ok(mut r) => {
                if r.status == 401 {
                    stats::note(
                        Cause::Unauthorized,
                        Some(client),
                        &format!("{} {}", head.method, head.path),
                    );
                }
                let (status, headers) = (r.status, std::mem::take(&mut r.headers));
                // A small answer goes out in one write with its head; a file streams through.
                let body = if r.length() <= INLINE_ANSWER {
                    match r.read_all(INLINE_ANSWER).await {
                        Ok(bytes) => Body::Bytes(bytes),
                        Err(_) => return Answer::error(502, "unavailable").closing(),
                    }
                } else {
                    Body::Relay(Box::new(r))
                };
                Answer {
                    status,
                    headers,
                    body,
                    close: false,
                }
            }
            Err(RelayError::Busy) => {
                stats::note(Cause::Busy, Some(client), "every internal handler busy");
                Answer::error(503, "busy")
            }
            Err(RelayError::Unavailable) => {
                log::error!("front door: the internal HTTP server gave no usable answer");
                Answer::error(502, "unavailable").closing()
            }
            Err(RelayError::Timeout) => {
                log::warn!("front door: the internal HTTP server did not answer in time");
                Answer::error(504, "timeout").closing()
            }
        }
    }

    fn plan(&self, head: &Head, client: IpAddr) -> Plan {
        let route = self.route(&head.path);
        if route == "/ws" && matches!(head.method.as_str(), "GET" | "HEAD") {
            return ws_plan(head, client);
        }
        if route == "/files/uploads" && head.method == "POST" {
            // Authenticated before a byte of a file is read.
            if !self.authorized(head) {
                stats::note(Cause::Unauthorized, Some(client), "POST /files/uploads");
                return Plan::Answer(Answer::error(401, "unauthorized"));
            }
            return self.upload(head, client);
        }
        if let Some(refused) = self.screen(head, route, client) {
            return Plan::Answer(refused);
        }
        self.read(head, client)
    }

    fn answer<'a>(&'a self, head: &'a Head, body: Vec<u8>, client: IpAddr) -> Reply<'a> {
        Box::pin(async move {
            let Some(plane) = self.plane.upgrade() else {
                return stopping_answer();
            };
            let route = self.route(&head.path);
            if let Some(provider) = plane.providers.for_route(&head.method, route).cloned() {
                drop(plane);
                return self.provider_answer(provider, head, route, body, client).await;
            }
            drop(plane);
            self.relay_answer(head, body, client).await
        })
    }

    fn refused(&self, why: Refused, head: Option<&Head>, client: IpAddr) {
        if let (Refused::BadBody(status), Some(head)) = (why, head) {
            self.count_refusal(head, self.route(&head.path), status);
        }
        let (cause, detail) = match why {
            Refused::BadHead(0) => (Cause::BadRequest, "HTTP/2 connection preface closed".to_string()),
            Refused::BadHead(status) => (Cause::BadRequest, format!("malformed request head ({status})")),
            Refused::BadBody(status) => (Cause::BadBody, format!("request body refused ({status})")),
            Refused::SlowHead => (Cause::SlowHead, "request head not complete in time".to_string()),
            Refused::SlowBody => (Cause::SlowBody, "request body stalled or too slow".to_string()),
        };
        stats::note(cause, Some(client), &detail);
    }
}

/// A provider route's request refused for what the sender sent (a wrong secret or signature,
/// a malformed or too large body) is counted as the provider's `refused` message: an operator
/// sees a sender with a wrong secret in `/metrics`. (A stale message is counted `stale` by the
/// intake; an unknown endpoint names no message.)
fn count_refused(plane: &Plane, provider: &'static str, status: u16) {
    if matches!(status, 400 | 401 | 413) {
        plane.outbox.count_refused(provider);
    }
}

/// The front door as one connection sees it: what it refuses is logged with the client's
/// address.
struct ForClient<'a> {
    door: &'a FrontDoor,
    ip: IpAddr,
}

impl Service for ForClient<'_> {
    fn plan(&self, head: &Head) -> Plan {
        self.door.plan(head, self.ip)
    }

    fn answer<'a>(&'a self, head: &'a Head, body: Vec<u8>) -> Reply<'a> {
        self.door.answer(head, body, self.ip)
    }

    fn refused(&self, why: Refused, head: Option<&Head>) {
        self.door.refused(why, head, self.ip)
    }
}

/// A request to `/ws`: an upgrade only when it is a handshake by the RFCs. RFC 6455 4.2.1: a GET
/// of HTTP/1.1; RFC 9110 7.8: `Upgrade` means nothing in HTTP/1.0, and `HEAD` is answered as
/// the GET of a non-handshake would be (426). A handshake has no body: bytes after its head are
/// the client's first frames, so a body there would be run as frames (RFC 9112 6.3). Refused
/// before the `101`.
fn ws_plan(head: &Head, client: IpAddr) -> Plan {
    if head.method != "GET" || head.version != head::Version::Http11 {
        stats::note(
            Cause::WsRefused,
            Some(client),
            "a WebSocket handshake that is not a GET of HTTP/1.1",
        );
        let mut a = Answer::error(426, "websocket_upgrade_required").closing();
        a.headers.push(("Upgrade", "websocket".into()));
        return Plan::Answer(a);
    }
    if head.body != Framing::None && head.body != Framing::Length(0) {
        stats::note(
            Cause::WsRefused,
            Some(client),
            "a WebSocket handshake with a request body",
        );
        return Plan::Answer(Answer::error(400, "bad_request").closing());
    }
    Plan::Upgrade
}

/// `max_connections`, lowered to what the file descriptors carry.
pub fn connection_limit(configured: usize, fds: Option<u64>) -> usize {
    match fds {
        Some(fds) if (fds.saturating_sub(RESERVED_FDS) as usize) < configured => {
            let max = (fds.saturating_sub(RESERVED_FDS) as usize).max(1);
            log::warn!(
                "max_connections = {configured} needs more file descriptors than the limit of {fds} allows; serving at most {max} connections (raise LimitNOFILE)"
            );
            max
        }
        _ => configured,
    }
}

/// Accepts connections until the future is dropped (shutdown). `max` slots, shared as
/// `front::slots` says: at most `per_client` per address (`None`: no cap), idle connections
/// closed to make room, a reserve for the data plane.
pub async fn serve(door: Arc<FrontDoor>, listener: TcpListener, max: usize, per_client: Option<usize>) {
    let slots = slots::Slots::new(max, per_client);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(v) => v,
            Err(e) => {
                // Typically EMFILE: back off instead of spinning; the client waits in the backlog.
                stats::note(Cause::AcceptFailed, None, &e.to_string());
                smol::Timer::after(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Packets and answers are small writes; Nagle's delay would add ~40 ms to each.
        let _ = stream.set_nodelay(true);
        let held = match slots.admit(peer.ip(), &stream) {
            Ok(held) => held,
            Err(why) => {
                slots::note_refusal(&why, peer.ip(), max);
                crate::runtime::spawn(async move {
                    let mut s = stream;
                    let _ = s.write_all(&conn::error_bytes(503, "too_many_connections")).await;
                })
                .detach();
                continue;
            }
        };
        let door = door.clone();
        crate::runtime::spawn(async move {
            connection(door, stream, peer, held).await;
        })
        .detach();
    }
}

/// One connection as its slot follows it.
struct Tracked<'a> {
    held: &'a slots::Held,
    door: &'a FrontDoor,
    /// The stream's own socket (shared, not a second descriptor), for a plain connection.
    socket: Option<Arc<smol::Async<std::net::TcpStream>>>,
    accepted: std::time::Instant,
}

impl conn::Lifecycle for Tracked<'_> {
    fn idle(&self, idle: bool) {
        self.held.idle(idle);
    }

    /// A connection in the reserve is there for the data plane: an authenticated `/ws` only.
    fn admits(&self, head: &Head) -> bool {
        !self.held.in_reserve()
            || (head.method == "GET" && self.door.route(&head.path) == "/ws" && self.door.authorized(head))
    }

    fn socket(&self) -> Option<&smol::Async<std::net::TcpStream>> {
        self.socket.as_deref()
    }

    fn opened(&self) -> Option<std::time::Instant> {
        Some(self.accepted)
    }
}

async fn connection(door: Arc<FrontDoor>, stream: TcpStream, peer: SocketAddr, held: slots::Held) {
    let accepted = std::time::Instant::now();
    let Some(tls) = &door.tls else {
        let socket = Some(stream.clone().into());
        return serve_client(&door, stream, socket, accepted, peer, &held).await;
    };
    // The handshake is part of the first request's head: it must be done within the head's
    // deadline, and whatever a client sends before it is rustls's to refuse.
    let acceptor = futures_rustls::TlsAcceptor::from(tls.config());
    let handshake = async { Some(acceptor.accept(stream).await) }.or(async {
        smol::Timer::at(accepted + HEAD_TIMEOUT).await;
        None
    });
    match handshake.await {
        Some(Ok(tls_stream)) => serve_client(&door, tls_stream, None, accepted, peer, &held).await,
        Some(Err(e)) => stats::note(
            Cause::BadRequest,
            Some(peer.ip()),
            &format!("TLS handshake failed: {e}"),
        ),
        None => stats::note(Cause::SlowHead, Some(peer.ip()), "TLS handshake not complete in time"),
    }
}

/// Serves one client's requests on `stream`, plain or inside TLS, until it closes or upgrades.
async fn serve_client<S>(
    door: &Arc<FrontDoor>,
    stream: S,
    socket: Option<Arc<smol::Async<std::net::TcpStream>>>,
    accepted: std::time::Instant,
    peer: SocketAddr,
    held: &slots::Held,
) where
    S: smol::io::AsyncRead + smol::io::AsyncWrite + Unpin + Send + 'static,
{
    let life = Tracked {
        held,
        door,
        socket,
        accepted,
    };
    let client = ForClient { door, ip: peer.ip() };
    let (head, stream, early) = match conn::serve(stream, &client, &LIMITS, &life).await {
        conn::Outcome::Closed => return,
        conn::Outcome::Upgrade(head, stream, early) => (head, stream, early),
    };
    // The session owns the socket from here: its end closes it, not this function's.
    drop(life);
    let Some(plane) = door.plane.upgrade().filter(|a| !a.is_stopping() && !stopping()) else {
        let mut s = stream;
        let _ = s.write_all(&conn::error_bytes(503, "stopping")).await;
        return;
    };
    if let Some(why) = upgrade::upgrade(plane, head, stream, early, peer.to_string()).await {
        stats::note(Cause::WsRefused, Some(peer.ip()), why);
    }
}
