//! Which data-plane session holds which channel, and the bindings of the open channels as the
//! sessions last read them. Below the data plane: the outbox's commit hook and `/status` ask it;
//! sessions register a `Link` and keep it current.
//!
//! Invariant: a channel is open on at most one session; the newest `channel.open` takes it over.
//! The commit hook runs on the outbox's committer thread, so `notify_source` reads memory only,
//! never the store: the source of each open channel is told to the hub when the channel opens
//! and whenever an auth flow binds or unbinds it.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use crate::protocol::Packet;
use crate::source::Source;

/// What the hub needs to reach a session.
pub trait Link: Send + Sync {
    /// Wakes the session's delivery (wake-ups coalesce).
    fn wake(&self);
    /// Queues a packet to the session; false when its queue is full or gone.
    fn push(&self, packet: Packet) -> bool;
    /// Ends the session, with the reason to log and put in the close frame.
    fn stop(&self, reason: &str);
}

/// A registered session's number.
pub type SessionId = u64;

#[derive(Default)]
pub struct Hub {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    next_id: SessionId,
    sessions: HashMap<SessionId, Box<dyn Link>>,
    /// Sessions that completed `connector.hello`: the `connector_id` lease runs while none do.
    authenticated: HashSet<SessionId>,
    /// channel ID → the session holding it open and the source bound to it.
    open: HashMap<String, Open>,
    /// Why every session was ended (shutdown): a session registered after it stops at once.
    closed: Option<String>,
}

struct Open {
    session: SessionId,
    source: Option<Source>,
}

impl Hub {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic elsewhere must not take the data plane down with a poisoned lock.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn register(&self, link: Box<dyn Link>) -> SessionId {
        let mut g = self.lock();
        g.next_id += 1;
        let id = g.next_id;
        // An upgrade that was under way when shutdown ended every session.
        if let Some(reason) = &g.closed {
            link.stop(reason);
        }
        g.sessions.insert(id, link);
        crate::changed::raise();
        id
    }

    /// Removes a session and every channel it held open. True when it was the last session
    /// that had completed hello (the lease starts).
    pub fn unregister(&self, session: SessionId) -> bool {
        let mut g = self.lock();
        g.sessions.remove(&session);
        crate::changed::raise();
        g.open.retain(|_, o| o.session != session);
        g.authenticated.remove(&session) && g.authenticated.is_empty()
    }

    /// A session completed hello. True when it is the first one (the lease is cancelled).
    pub fn authenticated(&self, session: SessionId) -> bool {
        let mut g = self.lock();
        let first = g.authenticated.is_empty();
        g.authenticated.insert(session) && first
    }

    /// Opens `cch` on `session`, bound to `source`; returns the session that held it before,
    /// if another one did.
    pub fn open(&self, cch: &str, session: SessionId, source: Option<Source>) -> Option<SessionId> {
        let mut g = self.lock();
        g.open
            .insert(cch.to_string(), Open { session, source })
            .map(|o| o.session)
            .filter(|s| *s != session)
    }

    /// `cch` is now bound to `source` (`None`: unbound), if it is open.
    pub fn bound(&self, cch: &str, source: Option<Source>) {
        if let Some(o) = self.lock().open.get_mut(cch) {
            o.source = source;
        }
    }

    pub fn close(&self, cch: &str, session: SessionId) -> bool {
        let mut g = self.lock();
        if g.open.get(cch).is_some_and(|o| o.session == session) {
            g.open.remove(cch);
            true
        } else {
            false
        }
    }

    pub fn is_open_on(&self, cch: &str, session: SessionId) -> bool {
        self.lock().open.get(cch).is_some_and(|o| o.session == session)
    }

    pub fn is_open(&self, cch: &str) -> bool {
        self.lock().open.contains_key(cch)
    }

    /// The channels open on `session` and bound, with their sources, in channel order.
    pub fn bound_on(&self, session: SessionId) -> Vec<(String, Source)> {
        let g = self.lock();
        let mut v: Vec<(String, Source)> = g
            .open
            .iter()
            .filter(|(_, o)| o.session == session)
            .filter_map(|(c, o)| Some((c.clone(), o.source.clone()?)))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// The open channel bound to `source`, if one is.
    pub fn channel_of(&self, source: &str) -> Option<String> {
        let g = self.lock();
        g.open
            .iter()
            .find(|(_, o)| o.source.as_ref().is_some_and(|s| s.as_str() == source))
            .map(|(c, _)| c.clone())
    }

    /// Ends every session (shutdown), and every one registered after: each sends a close frame
    /// and stops.
    pub fn close_all(&self, reason: &str) {
        let mut g = self.lock();
        g.closed = Some(reason.to_string());
        for link in g.sessions.values() {
            link.stop(reason);
        }
    }

    /// Whether an xAgent is connected: a session completed hello.
    pub fn xagent_connected(&self) -> bool {
        !self.lock().authenticated.is_empty()
    }

    pub fn connections(&self) -> usize {
        self.lock().sessions.len()
    }

    /// Wakes the delivery of the session that holds `cch`.
    pub fn wake_channel(&self, cch: &str) {
        let g = self.lock();
        if let Some(link) = g.open.get(cch).and_then(|o| g.sessions.get(&o.session)) {
            link.wake();
        }
    }

    /// A message was accepted for `source`: wake whoever delivers it. Memory only (this runs
    /// on the committer thread, between one commit group and the next).
    pub fn notify_source(&self, source: &str) {
        let g = self.lock();
        for o in g
            .open
            .values()
            .filter(|o| o.source.as_ref().is_some_and(|s| s.as_str() == source))
        {
            if let Some(link) = g.sessions.get(&o.session) {
                link.wake();
            }
        }
    }

    /// Queues a packet to the session holding `cch`; false when the channel is not open anywhere.
    pub fn send_to_channel(&self, cch: &str, packet: Packet) -> bool {
        let g = self.lock();
        match g.open.get(cch).and_then(|o| g.sessions.get(&o.session)) {
            Some(link) => link.push(packet),
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[derive(Default)]
    struct Counting {
        wakes: AtomicUsize,
        stops: AtomicUsize,
    }

    struct Probe(Arc<Counting>);

    impl Link for Probe {
        fn wake(&self) {
            self.0.wakes.fetch_add(1, Ordering::SeqCst);
        }
        fn push(&self, _: Packet) -> bool {
            true
        }
        fn stop(&self, _: &str) {
            self.0.stops.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn close_all_ends_every_session_and_every_one_registered_after_it() {
        let hub = Hub::default();
        let (before, after) = (Arc::new(Counting::default()), Arc::new(Counting::default()));
        hub.register(Box::new(Probe(before.clone())));
        hub.close_all("imgate is stopping");
        // An upgrade that was under way when shutdown began.
        hub.register(Box::new(Probe(after.clone())));
        assert_eq!(before.stops.load(Ordering::SeqCst), 1);
        assert_eq!(after.stops.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn an_accepted_message_wakes_only_the_session_holding_its_source_without_the_store() {
        let hub = Hub::default();
        let (a, b) = (Arc::new(Counting::default()), Arc::new(Counting::default()));
        let sa = hub.register(Box::new(Probe(a.clone())));
        let sb = hub.register(Box::new(Probe(b.clone())));
        let src = Source::parse("webhook:alerts");
        hub.open("cch_a", sa, src.clone());
        hub.open("cch_b", sb, None);
        hub.notify_source("webhook:alerts");
        assert_eq!((a.wakes.load(Ordering::SeqCst), b.wakes.load(Ordering::SeqCst)), (1, 0));
        // The binding moves to the other channel: the wake follows it.
        hub.bound("cch_a", None);
        hub.bound("cch_b", src);
        hub.notify_source("webhook:alerts");
        assert_eq!((a.wakes.load(Ordering::SeqCst), b.wakes.load(Ordering::SeqCst)), (1, 1));
        assert_eq!(hub.bound_on(sb).len(), 1);
        assert!(hub.bound_on(sa).is_empty());
    }

    #[test]
    fn the_newest_open_takes_a_channel_over_and_the_last_hello_session_starts_the_lease() {
        let hub = Hub::default();
        let c = Arc::new(Counting::default());
        let s1 = hub.register(Box::new(Probe(c.clone())));
        let s2 = hub.register(Box::new(Probe(c)));
        assert!(hub.authenticated(s1));
        assert!(!hub.authenticated(s2));
        assert_eq!(hub.open("cch", s1, None), None);
        assert_eq!(hub.open("cch", s2, None), Some(s1));
        assert!(hub.is_open_on("cch", s2) && !hub.is_open_on("cch", s1));
        assert!(!hub.close("cch", s1), "only its holder closes it");
        assert!(!hub.unregister(s1));
        assert!(hub.unregister(s2));
        assert!(!hub.is_open("cch"));
    }
}
