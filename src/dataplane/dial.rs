//! The dial transport: connect out to `[xagent] dial` (ws:// or wss://) and run the same session
//! as the listener does. Reconnects with capped exponential backoff and jitter; each change of
//! state is logged once, not once per retry. A session that ends within `STABLE` of starting
//! counts as a failure for the backoff: a far side that accepts and breaks every session is
//! redialled at most once a minute, and said so once a minute.

use std::sync::Arc;
use std::time::Duration;

use async_tungstenite::tungstenite::http::HeaderValue;

use super::Plane;
use crate::ids;
use crate::protocol::SUBPROTOCOL;
use crate::quiet;
use crate::wsclient;

const BACKOFF_START: Duration = Duration::from_secs(1);
const BACKOFF_CAP: Duration = Duration::from_secs(60);
/// A session that lasted this long resets the backoff.
const STABLE: Duration = Duration::from_secs(60);
static SHORT_SESSIONS: quiet::Site = quiet::Site::new();

/// Dials forever.
pub async fn run(plane: Arc<Plane>, url: String) {
    let mut backoff = BACKOFF_START;
    let mut last_failure: Option<String> = None;
    loop {
        match connect(&plane, &url).await {
            Ok(lasted) if lasted >= STABLE => {
                // A session ran; start the next attempt quickly.
                backoff = BACKOFF_START;
                last_failure = None;
            }
            Ok(_) => {
                if let Some(more) = SHORT_SESSIONS.admit() {
                    log::warn!(
                        "dial: sessions with {url} end within {STABLE:?} of starting; redialling with backoff up to {BACKOFF_CAP:?}{more}"
                    );
                }
            }
            Err(why) => {
                if last_failure.as_deref() != Some(why.as_str()) {
                    log::warn!("dial: cannot connect to {url}: {why}; retrying with backoff up to {BACKOFF_CAP:?}");
                    last_failure = Some(why);
                }
            }
        }
        let jitter = Duration::from_millis(ids::below(backoff.as_millis() as u64 / 2 + 1));
        smol::Timer::after(backoff + jitter).await;
        backoff = (backoff * 2).min(BACKOFF_CAP);
    }
}

/// One connection attempt; on success runs the session to its end and says how long it lasted.
async fn connect(plane: &Arc<Plane>, url: &str) -> Result<Duration, String> {
    let target = wsclient::parse_url(url)?;
    let mut request = wsclient::request(url)?;
    let headers = request.headers_mut();
    headers.insert("Sec-WebSocket-Protocol", HeaderValue::from_static(SUBPROTOCOL));
    if let Some(key) = &plane.config.xagent.dial_api_key {
        let value = HeaderValue::from_str(&format!("Bearer {}", key.expose()))
            .map_err(|_| "dial_api_key contains characters not allowed in a header".to_string())?;
        headers.insert("Authorization", value);
    }
    let ca_file = plane.config.xagent.ca_file.as_deref();
    let ws = wsclient::connect(&target, request, ca_file, super::ws_config()).await?;
    // The session's own lines say when it started and ended, and why.
    log::debug!("dial: connected to {url}");
    let started = std::time::Instant::now();
    super::session::run(plane.clone(), ws, url.to_string()).await;
    log::debug!("dial: disconnected from {url}");
    Ok(started.elapsed())
}
