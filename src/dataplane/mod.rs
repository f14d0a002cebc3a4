//! The data plane: one packet engine (`session`) behind two transports: xAgent dials our `/ws`
//! (upgraded by the front door, `crate::front::upgrade`), or we dial out (`dial`). The `Hub`
//! knows which session holds which channel.
//!
//! Invariant: a channel is open on at most one session; the newest `channel.open` takes it over.

pub mod chat;
mod deliver_v1;
mod deliver_v2;
pub mod dial;
pub mod out;
pub mod session;
pub mod tools;

/// Largest data-plane packet; a bigger message closes that connection (1009), not the process.
pub const MAX_PACKET: usize = 1 << 20;

/// WebSocket limits shared by both transports.
pub fn ws_config() -> async_tungstenite::tungstenite::protocol::WebSocketConfig {
    async_tungstenite::tungstenite::protocol::WebSocketConfig::default()
        .max_message_size(Some(MAX_PACKET))
        .max_frame_size(Some(MAX_PACKET))
}

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::app::App;
use crate::channels::Channels;
use crate::protocol::Packet;

/// What the hub needs to reach a session.
#[derive(Clone)]
pub struct SessionLink {
    /// Wakes the session's delivery loop (capacity 1: wake-ups coalesce).
    pub wake: smol::channel::Sender<()>,
    /// The session's outgoing packet queue.
    pub out: out::Out,
    /// Ends the session, with the reason to log and put in the close frame.
    pub stop: smol::channel::Sender<String>,
}

#[derive(Default)]
pub struct Hub {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    next_id: u64,
    sessions: HashMap<u64, SessionLink>,
    /// Sessions that completed `connector.hello`: the `connector_id` lease runs while none do.
    authenticated: std::collections::HashSet<u64>,
    /// channel ID → session holding it open.
    open: HashMap<String, u64>,
}

impl Hub {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic elsewhere must not take the data plane down with a poisoned lock.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn register(&self, link: SessionLink) -> u64 {
        let mut g = self.lock();
        g.next_id += 1;
        let id = g.next_id;
        g.sessions.insert(id, link);
        id
    }

    /// Removes a session and every channel it held open. True when it was the last session
    /// that had completed hello (the lease starts).
    pub fn unregister(&self, session: u64) -> bool {
        let mut g = self.lock();
        g.sessions.remove(&session);
        g.open.retain(|_, s| *s != session);
        g.authenticated.remove(&session) && g.authenticated.is_empty()
    }

    /// A session completed hello. True when it is the first one (the lease is cancelled).
    pub fn authenticated(&self, session: u64) -> bool {
        let mut g = self.lock();
        let first = g.authenticated.is_empty();
        g.authenticated.insert(session) && first
    }

    /// Opens `cch` on `session`; returns the session that held it before, if another one did.
    pub fn open(&self, cch: &str, session: u64) -> Option<u64> {
        let mut g = self.lock();
        g.open.insert(cch.to_string(), session).filter(|s| *s != session)
    }

    pub fn close(&self, cch: &str, session: u64) -> bool {
        let mut g = self.lock();
        if g.open.get(cch) == Some(&session) {
            g.open.remove(cch);
            true
        } else {
            false
        }
    }

    pub fn is_open_on(&self, cch: &str, session: u64) -> bool {
        self.lock().open.get(cch) == Some(&session)
    }

    pub fn is_open(&self, cch: &str) -> bool {
        self.lock().open.contains_key(cch)
    }

    pub fn channels_of(&self, session: u64) -> Vec<String> {
        let g = self.lock();
        let mut v: Vec<String> = g
            .open
            .iter()
            .filter(|(_, s)| **s == session)
            .map(|(c, _)| c.clone())
            .collect();
        v.sort();
        v
    }

    /// Ends every session (shutdown): each sends a close frame and stops.
    pub fn close_all(&self, reason: &str) {
        for link in self.lock().sessions.values() {
            let _ = link.stop.try_send(reason.to_string());
        }
    }

    pub fn connections(&self) -> usize {
        self.lock().sessions.len()
    }

    /// Wakes the delivery loop of the session that holds `cch`.
    pub fn wake_channel(&self, cch: &str) {
        let g = self.lock();
        if let Some(link) = g.open.get(cch).and_then(|s| g.sessions.get(s)) {
            let _ = link.wake.try_send(());
        }
    }

    /// A message was accepted for `source`: wake whoever delivers it.
    pub fn notify_source(&self, channels: &Channels, source: &str) {
        if let Ok(Some(cch)) = channels.bound_channel(source) {
            self.wake_channel(&cch);
        }
    }

    /// Queues a packet to the session holding `cch`; false when the channel is not open anywhere.
    pub fn send_to_channel(&self, cch: &str, packet: Packet) -> bool {
        let g = self.lock();
        match g.open.get(cch).and_then(|s| g.sessions.get(s)) {
            Some(link) => link.out.try_send(packet),
            None => false,
        }
    }
}

/// Runs `f` with the app on the blocking pool: the data plane's store reads and commits never
/// run on the executor.
async fn blocking<T: Send + 'static>(app: &Arc<App>, f: impl FnOnce(&App) -> T + Send + 'static) -> T {
    let app = app.clone();
    crate::runtime::unblock(move || f(&app)).await
}
