//! What the front door refused, counted for `/metrics` and logged at most once a minute per
//! cause with the count since the last line: a scanner on the LAN must not fill an SD card
//! with log lines, and the operator still sees that it happened.

use crate::atomic::AtomicU64;
use crate::quiet::Quiet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Cause {
    /// More connections than `max_connections`, none idle, the reserve full: 503.
    TooManyConnections,
    /// One address over `max_connections_per_client`: 503.
    TooManyFromClient,
    /// `accept` failed (no file descriptors left): the listener backs off.
    AcceptFailed,
    /// A malformed request head (400, 431, 501, 505) or the HTTP/2 preface.
    BadRequest,
    /// A body over its cap or malformed (413, 400).
    BadBody,
    /// A head not complete in time (408).
    SlowHead,
    /// A body that stalled or came too slowly (408).
    SlowBody,
    /// A missing or wrong key, secret or signature (401).
    Unauthorized,
    /// A `/ws` upgrade refused.
    WsRefused,
    /// Too many bodies in memory at once, or tiny_http busy (503).
    Busy,
}

const CAUSES: [Cause; 10] = [
    Cause::TooManyConnections,
    Cause::TooManyFromClient,
    Cause::AcceptFailed,
    Cause::BadRequest,
    Cause::BadBody,
    Cause::SlowHead,
    Cause::SlowBody,
    Cause::Unauthorized,
    Cause::WsRefused,
    Cause::Busy,
];

impl Cause {
    fn index(self) -> usize {
        CAUSES.iter().position(|c| *c == self).unwrap_or(0)
    }

    fn label(self) -> &'static str {
        match self {
            Cause::TooManyConnections => "too_many_connections",
            Cause::TooManyFromClient => "too_many_from_client",
            Cause::AcceptFailed => "accept_failed",
            Cause::BadRequest => "bad_request",
            Cause::BadBody => "bad_body",
            Cause::SlowHead => "slow_head",
            Cause::SlowBody => "slow_body",
            Cause::Unauthorized => "unauthorized",
            Cause::WsRefused => "ws_refused",
            Cause::Busy => "busy",
        }
    }
}

static COUNTS: [AtomicU64; CAUSES.len()] = [const { AtomicU64::new(0) }; CAUSES.len()];
/// Per cause: when it was last logged and how many happened since.
static LOGGED: Mutex<[Quiet; CAUSES.len()]> = Mutex::new([Quiet::new(); CAUSES.len()]);
/// Connections open now (on a slot of `max_connections`, or in the reserve for `/ws`).
pub static CONNECTIONS: AtomicUsize = AtomicUsize::new(0);
/// Idle keep-alive connections closed to admit a new one.
pub static IDLE_CLOSED: AtomicU64 = AtomicU64::new(0);

/// Counts one refusal and logs it unless its cause was logged within the last minute. The
/// line names the client's address (`from ADDR`) when there is one, so fail2ban and the like
/// can act on it.
pub fn note(cause: Cause, client: Option<std::net::IpAddr>, detail: &str) {
    let i = cause.index();
    COUNTS[i].fetch_add(1, Ordering::Relaxed);
    let more = match LOGGED.lock().unwrap_or_else(|e| e.into_inner())[i].admit() {
        Some(more) => more,
        None => return,
    };
    let from = client.map(|ip| format!(" from {ip}")).unwrap_or_default();
    match cause {
        Cause::TooManyConnections | Cause::TooManyFromClient | Cause::AcceptFailed | Cause::Busy => {
            log::warn!("front door: {}{from}: {detail}{more}", cause.label())
        }
        _ => log::info!("front door: {}{from}: {detail}{more}", cause.label()),
    }
}

/// The front door's lines of `/metrics`.
pub fn metrics(out: &mut String) {
    crate::metrics::singles(
        out,
        &[
            (
                "imgate_http_connections",
                "gauge",
                "HTTP connections open now.",
                CONNECTIONS.load(Ordering::Relaxed) as u64,
            ),
            (
                "imgate_http_idle_closed_total",
                "counter",
                "HTTP connections closed for idling.",
                IDLE_CLOSED.load(Ordering::Relaxed),
            ),
        ],
    );
    let help = "Requests and connections the front door refused, by cause.";
    crate::metrics::family(out, "imgate_http_refused_total", "counter", help);
    for c in CAUSES {
        out.push_str(&format!(
            "imgate_http_refused_total{{cause=\"{}\"}} {}\n",
            c.label(),
            COUNTS[c.index()].load(Ordering::Relaxed)
        ));
    }
}
