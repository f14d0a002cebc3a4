//! The links of one provider, one per account (a bot, an app), shared by every binding made
//! through that account: a link (a long connection's task, a poll loop's thread) starts with
//! the account's first binding and stops with its last (`Links::sync`). Each link has a `Line`: its state, said once per change in the log,
//! and, when the IM system refuses the account, that refusal in its bindings' Descriptors and
//! `/status` until it takes the account again.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::workers::{Worker, Workers};
use crate::providers::bindings::{Rows, Through};
use crate::providers::Host;
use crate::runtime;

/// Tells xAgent that the Descriptors of the bindings made through an account changed (its
/// refusal began or ended). Cloned into each link; runs on a blocking thread (it reads the store).
pub type Followers = Arc<dyn Fn(&str) + Send + Sync>;

/// The `Followers` of a provider whose binding rows (`rows`, of type `T`) name their account.
pub fn followers<T: Through + 'static>(host: &Arc<Host>, rows: &'static Rows) -> Followers {
    let host = Arc::downgrade(host);
    Arc::new(move |account: &str| {
        let Some(host) = host.upgrade() else { return };
        for (source, _) in rows.through::<T>(&host.channels, &host.db, account).unwrap_or_default() {
            host.binding_state_changed(&source);
        }
    })
}

/// The running links of one provider, by account.
pub struct Links {
    running: Workers<String>,
    shared: Arc<Shared>,
    label: &'static str,
    link: &'static str,
    /// Whose Descriptors follow a refusal (none: a refusal is only logged).
    followers: Option<Followers>,
}

/// What the links tell the provider.
#[derive(Default)]
struct Shared {
    /// Connections open now.
    up: Arc<AtomicUsize>,
    /// Accounts the IM system refuses, and why.
    refused: Mutex<HashMap<String, String>>,
}

impl Shared {
    fn refusals(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        self.refused.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Links {
    /// `account` and `link` name them in log lines: `slack: bot`, `Socket Mode connection`.
    pub fn new(account: &'static str, link: &'static str) -> Links {
        Links {
            running: Workers::new(account, link),
            shared: Arc::default(),
            label: account,
            link,
            followers: None,
        }
    }

    /// The bindings' Descriptors follow their account's refusals (`followers`).
    pub fn followed_by(self, followers: Followers) -> Links {
        Links {
            followers: Some(followers),
            ..self
        }
    }

    /// Starts a link (`start`, given its `Line`) for every account in `wanted` that has none,
    /// and stops the others.
    pub fn sync(&self, wanted: &[String], start: impl Fn(Line) -> Option<Worker>) {
        self.running.sync(wanted, |account| {
            let line = Line {
                account: account.clone(),
                label: self.label,
                link: self.link,
                last: String::new(),
                failing: false,
                shared: self.shared.clone(),
                followers: self.followers.clone(),
            };
            start(line)
        });
        self.shared.refusals().retain(|account, _| wanted.contains(account));
    }

    /// Stops the link of `account` (a refused one bound again, a poll whose sign-in ended): the
    /// next `sync` starts anew. A refusal it clears changes the account's bindings'
    /// Descriptors: they are told (on the caller's thread, a blocking one).
    pub fn forget(&self, account: &str) {
        self.running.forget(&account.to_string());
        let cleared = self.shared.refusals().remove(account).is_some();
        if let Some(tell) = self.followers.as_ref().filter(|_| cleared) {
            tell(account);
        }
    }

    /// Whose Descriptors follow a refusal, for a link that tells them itself.
    pub fn followers(&self) -> Option<Followers> {
        self.followers.clone()
    }

    pub fn stop_all(&self) {
        self.running.stop_all();
    }

    /// Links running, one per bound account.
    pub fn count(&self) -> usize {
        self.running.count()
    }

    /// Connections open now.
    pub fn up(&self) -> usize {
        self.shared.up.load(Ordering::Relaxed)
    }

    /// `/metrics`: `family` (links running, `running` its help) and `{family}_up` (connections
    /// open, `up` its help).
    pub fn metrics(&self, out: &mut String, family: &str, running: &str, up: &str) {
        crate::metrics::single(out, family, "gauge", running, self.count());
        crate::metrics::single(out, &format!("{family}_up"), "gauge", up, self.up());
    }

    /// Why the IM system refuses `account`, if it does.
    pub fn refused(&self, account: &str) -> Option<String> {
        self.shared.refusals().get(account).cloned()
    }
}

/// One link's state: logged when it changes, and the account's refusal kept for its bindings.
pub struct Line {
    account: String,
    /// `slack: bot`
    label: &'static str,
    /// `Socket Mode connection`
    link: &'static str,
    last: String,
    /// The state said last was a failure (a warning).
    failing: bool,
    shared: Arc<Shared>,
    followers: Option<Followers>,
}

impl Line {
    pub fn account(&self) -> &str {
        &self.account
    }

    /// What the link is, for log lines: `Socket Mode connection`.
    pub fn link(&self) -> &'static str {
        self.link
    }

    /// The state is `now`: one log line when it was something else. (A poll loop's thread may
    /// call it too.)
    pub fn set(&mut self, now: String, warn: bool) {
        if now != self.last {
            match warn {
                true => log::warn!("{} {}: {now}", self.label, self.account),
                false => log::info!("{} {}: {now}", self.label, self.account),
            }
            self.last = now;
        }
        self.failing = warn;
    }

    /// `what` (a poll) works: said once after a failure (`{what} works again`), not before.
    pub fn works(&mut self, what: &str) {
        if self.failing {
            self.set(format!("{what} works again"), false);
        }
    }

    /// A line about the link that is not a change of its state.
    pub fn note(&self, what: &str) {
        log::info!("{} {}: {what}", self.label, self.account);
    }

    /// The IM system refuses the account for a reason only its owner can fix (`why`); `then`
    /// says what the link does next. Said once; the bindings' Descriptors change with it.
    pub async fn refused(&mut self, why: String, then: &str) {
        let changed = self
            .shared
            .refusals()
            .insert(self.account.clone(), why.clone())
            .as_ref()
            != Some(&why);
        self.set(format!("{why}; {then}"), true);
        if changed {
            self.tell().await;
        }
    }

    /// The IM system takes the account (again): a refusal ends, and its bindings are told.
    pub async fn accepted(&mut self) {
        let was = self.shared.refusals().remove(&self.account).is_some();
        if was {
            self.tell().await;
        }
    }

    /// The count of connections open now.
    pub fn counter(&self) -> Arc<AtomicUsize> {
        self.shared.up.clone()
    }

    async fn tell(&self) {
        tell(self.followers.clone(), &self.account).await;
    }
}

/// The Descriptors of the bindings made through `account` changed: xAgent is told (on the
/// pool: it reads the store).
pub async fn tell(followers: Option<Followers>, account: &str) {
    if let Some(tell) = followers {
        let account = account.to_string();
        runtime::unblock(move || tell(&account)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_is_kept_until_the_account_is_taken_again_or_has_no_binding_left() {
        let links = Links::new("test: bot", "test connection");
        let lines = Mutex::new(Vec::new());
        let start = |line: Line| {
            lines.lock().unwrap().push(line);
            Some(Worker::Task(runtime::spawn(std::future::pending())))
        };
        links.sync(&["a".into(), "b".into()], start);
        assert_eq!(links.count(), 2);
        let mut a = lines.lock().unwrap().remove(0);
        assert_eq!(a.account(), "a");
        smol::block_on(a.refused("the token is revoked".into(), "asking again in 10m"));
        assert_eq!(links.refused("a").as_deref(), Some("the token is revoked"));
        assert_eq!(links.refused("b"), None);
        smol::block_on(a.accepted());
        assert_eq!(links.refused("a"), None, "taken again");
        smol::block_on(a.refused("the token is revoked".into(), "asking again in 10m"));
        links.sync(&["b".into()], |_| unreachable!("b runs already"));
        assert_eq!((links.count(), links.refused("a")), (1, None), "unbound: forgotten");
        let mut b = lines.lock().unwrap().remove(0);
        smol::block_on(b.refused("the secret is wrong".into(), "not again until bound again"));
        links.forget("b");
        assert_eq!(
            (links.count(), links.refused("b")),
            (0, None),
            "bound again: asked anew"
        );
        let up = a.counter();
        let counted = crate::providers::socket::Up::new(&up);
        assert_eq!(links.up(), 1);
        drop(counted);
        assert_eq!(links.up(), 0);
    }
}
