//! The data plane: one packet engine (`session`) behind two transports: xAgent dials our `/ws`
//! (upgraded by the front door, `crate::front::upgrade`), or we dial out (`dial`).
//!
//! The session is a router: it reads each packet once (`request`) and hands it to the module
//! that owns its state: `control` (hello, channels, Descriptors), `auth` (the login state
//! machine), `tools`, `chat` (IM v2, xAgent's own messages), `delivery` (the outbox to xAgent,
//! one handle per profile). `Plane` holds what outlives a connection: the app below, the tool
//! results, xAgent's completed messages, the auth sessions.

pub(crate) mod auth;
pub(crate) mod chat;
mod control;
mod delivery;
pub mod dial;
pub(crate) mod out;
mod request;
pub mod session;
#[cfg(test)]
mod testing;
pub(crate) mod tools;

use std::sync::{Arc, Mutex};

use crate::app::App;
use crate::store::StoreError;

/// Largest data-plane packet; a bigger message closes that connection (1009), not the process.
pub const MAX_PACKET: usize = 1 << 20;

/// WebSocket limits shared by both transports.
pub fn ws_config() -> async_tungstenite::tungstenite::protocol::WebSocketConfig {
    crate::wsclient::bounded_config(MAX_PACKET)
}

/// The data plane's state across connections, over the app it serves.
pub struct Plane {
    pub app: Arc<App>,
    /// Answers of tool calls, for repeated `tool_call_id`s (`tool_calls`, owned by `tools`).
    pub(crate) tool_results: tools::ToolResults,
    /// IM profile v2: xAgent's completed messages and streams (`chat_completed`, owned by `chat`).
    pub(crate) chats: chat::Chats,
    /// Auth sessions, kept across reconnects.
    pub(crate) logins: auth::Logins,
}

impl std::ops::Deref for Plane {
    type Target = App;

    fn deref(&self) -> &App {
        &self.app
    }
}

impl Plane {
    /// Opens the data plane's tables on the app's database.
    pub fn open(app: Arc<App>) -> Result<Arc<Plane>, StoreError> {
        let plane = Arc::new(Plane {
            tool_results: tools::ToolResults::open(app.db.clone())?,
            chats: chat::Chats::open(app.db.clone())?,
            logins: auth::Logins::default(),
            app,
        });
        // A binding that changed at its IM system (a sign-in ended) is pushed to xAgent. The
        // provider calls this on its own thread: the Descriptor's store read is fine there.
        let weak = Arc::downgrade(&plane);
        let _ = plane.host.state_changed.set(Box::new(move |source| {
            if let Some(plane) = weak.upgrade() {
                control::push_state(&plane, source);
            }
        }));
        Ok(plane)
    }

    /// The periodic sweep of the data plane's tables.
    pub fn sweep(&self, now: u64) {
        if let Err(e) = self.tool_results.sweep(now) {
            log::error!("data plane: tool result sweep failed: {e}");
        }
        if let Err(e) = self.chats.sweep(now) {
            log::error!("data plane: completed-message sweep failed: {e}");
        }
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic elsewhere must not take the data plane down with a poisoned lock.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f` on the blocking pool: the data plane's store reads, commits and provider calls
/// never run on the executor.
async fn blocking<T: Send + 'static>(plane: &Arc<Plane>, f: impl FnOnce(&Plane) -> T + Send + 'static) -> T {
    let plane = plane.clone();
    crate::runtime::unblock(move || f(&plane)).await
}
