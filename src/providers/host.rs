//! `Host`: what a provider may use of the layers below it (config, database, channels, outbox,
//! file cache), and what it tells them (a binding's state changed, an unbound conversation).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::channels::Channels;
use crate::config::Config;
use crate::files::Files;
use crate::outbox::Outbox;
use crate::source::Source;
use crate::store::Db;

/// What a provider may use: the layers below it.
pub struct Host {
    pub config: Config,
    pub db: Arc<Db>,
    pub channels: Channels,
    pub outbox: Outbox,
    pub files: Files,
    /// Told when a binding's state changed at its IM system (a sign-in ended): the data plane
    /// pushes the channel's Descriptor. Set once by the data plane.
    pub state_changed: OnceLock<StateChanged>,
    /// Conversations that wrote to a bound account and have no binding (`unbound_seen`).
    pub unbound: Mutex<VecDeque<Unbound>>,
    /// Last, so that it drops last (fields drop in order): once it is dropped, the outbox's
    /// committer has made its final checkpoint and the database is closed.
    pub closed: Closed,
}

/// Set when the `Host` that holds it has been dropped whole. The last holder of a `Host` may be
/// any thread: shutdown waits on this, not on the count of references, which reaches zero
/// before the drop (and the final checkpoint) has run.
#[derive(Default)]
pub struct Closed(Arc<AtomicBool>);

impl Closed {
    /// Whether the `Host` has been dropped whole, readable after it is gone.
    pub fn watch(&self) -> Arc<AtomicBool> {
        self.0.clone()
    }
}

impl Drop for Closed {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
        crate::runtime::released();
    }
}

/// A conversation that wrote to a bound account without a binding of its own, as `/status`
/// lists it (`unbound_recent`) so an owner can find the ID to bind.
#[derive(Clone)]
pub struct Unbound {
    pub provider: &'static str,
    /// The IM system's ID of the conversation (checked by the provider: printable ASCII).
    pub conversation: String,
    /// `channel`, `dm`, `group`...
    pub kind: &'static str,
    /// Unix ms.
    pub last_seen: u64,
}

/// `/status` lists at most this many unbound conversations, the latest seen.
const UNBOUND_RECENT: usize = 16;
/// Characters of an unbound conversation's ID kept.
const MAX_ID: usize = 255;

/// What `Host::binding_state_changed` calls.
pub type StateChanged = Box<dyn Fn(&Source) + Send + Sync>;

impl Host {
    /// What a provider keeps beside its messages as JSON in the outbox cursor `key` (a
    /// `Cursor::Set` of their commits: a reply's route), or the default when nothing (readable)
    /// is kept.
    pub fn kept<T: miniserde::Deserialize + Default>(&self, key: &str) -> Result<T, crate::store::StoreError> {
        let kept = self.outbox.cursor(key)?;
        Ok(kept
            .and_then(|v| miniserde::json::from_str::<T>(&v).ok())
            .unwrap_or_default())
    }

    /// A provider saw the state of `source`'s binding change on its own: xAgent is told.
    pub fn binding_state_changed(&self, source: &Source) {
        if let Some(tell) = self.state_changed.get() {
            tell(source);
        }
    }

    /// A conversation with no binding wrote to a bound account: listed (the latest
    /// `UNBOUND_RECENT`), never stored.
    pub fn unbound_seen(&self, provider: &'static str, conversation: &str, kind: &'static str) {
        // Whole, as the owner must bind it (a Matrix room ID may take 255 bytes); longer is
        // no ID of any provider's.
        let conversation: String = conversation.chars().take(MAX_ID).collect();
        let mut recent = self.unbound.lock().unwrap_or_else(|e| e.into_inner());
        recent.retain(|u| !(u.provider == provider && u.conversation == conversation));
        if recent.len() >= UNBOUND_RECENT {
            recent.pop_front();
        }
        recent.push_back(Unbound {
            provider,
            conversation,
            kind,
            last_seen: crate::ids::now_ms(),
        });
    }

    pub fn ttl_ms(&self) -> u64 {
        self.config.queue.ttl.as_millis() as u64
    }

    /// `[server] public_url` as the base of `download_url`s ("" keeps them relative).
    pub fn public_base(&self) -> &str {
        self.config.server.public_url.as_deref().unwrap_or("")
    }
}
