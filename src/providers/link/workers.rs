//! One background worker per account (a bot's poller, an app's long connection), shared by
//! every channel bound through that account: it starts with the account's first binding and
//! stops with its last (`Workers::sync`, called from `Provider::bindings_changed`).
//!
//! A worker is a thread (blocking long polls; told to stop through its `Stop`) or a task on the
//! executor (stopped by dropping it). Either way, dropping the `Worker` stops it.

use std::collections::HashMap;
use std::fmt::Display;
use std::hash::Hash;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Tells one worker thread to stop; its pauses wait on it, so a stop is seen at once.
#[derive(Default)]
pub struct Stop {
    stopped: Mutex<bool>,
    wake: Condvar,
}

impl Stop {
    pub fn stop(&self) {
        *self.stopped.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.wake.notify_all();
    }

    pub fn is_stopped(&self) -> bool {
        *self.stopped.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sleeps for `wait` unless stopped first; true when stopped.
    pub fn pause(&self, wait: Duration) -> bool {
        let g = self.stopped.lock().unwrap_or_else(|e| e.into_inner());
        let (g, _) = self
            .wake
            .wait_timeout_while(g, wait, |stopped| !*stopped)
            .unwrap_or_else(|e| e.into_inner());
        *g
    }
}

/// A running worker; dropped, it stops.
pub enum Worker {
    Thread(Arc<Stop>),
    /// Held only to be dropped: dropping a task cancels it.
    Task(#[allow(dead_code)] smol::Task<()>),
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Worker::Thread(stop) = self {
            stop.stop();
        }
    }
}

impl Worker {
    /// Starts `run` on a thread of its own named `name`; `None` when no thread can be made.
    pub fn thread(name: String, run: impl FnOnce(Arc<Stop>) + Send + 'static) -> Option<Worker> {
        let stop = Arc::new(Stop::default());
        let theirs = stop.clone();
        match std::thread::Builder::new().name(name).spawn(move || run(theirs)) {
            Ok(_) => Some(Worker::Thread(stop)),
            Err(e) => {
                log::error!("cannot start a worker thread: {e}");
                None
            }
        }
    }
}

/// The running workers of one provider, by account.
pub struct Workers<K> {
    running: Mutex<HashMap<K, Worker>>,
    /// How log lines name an account (`feishu: app`) and its worker (`long connection`).
    account: &'static str,
    worker: &'static str,
}

impl<K: Hash + Eq + Clone + Display> Workers<K> {
    pub fn new(account: &'static str, worker: &'static str) -> Workers<K> {
        Workers {
            running: Mutex::new(HashMap::new()),
            account,
            worker,
        }
    }

    /// Starts a worker (`start`) for every account in `wanted` that has none, and stops the
    /// workers of the accounts not in it.
    pub fn sync(&self, wanted: &[K], mut start: impl FnMut(&K) -> Option<Worker>) {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        running.retain(|key, _| {
            let keep = wanted.contains(key);
            if !keep {
                log::info!("{} {key} has no binding left; its {} stops", self.account, self.worker);
            }
            keep
        });
        for key in wanted {
            if running.contains_key(key) {
                continue;
            }
            if let Some(w) = start(key) {
                running.insert(key.clone(), w);
            }
        }
    }

    /// Forgets the worker of `key` (it ended on its own, or must): a later `sync` starts a new one.
    pub fn forget(&self, key: &K) {
        self.running.lock().unwrap_or_else(|e| e.into_inner()).remove(key);
    }

    /// Shutdown: every worker stops (a thread in a long poll leaves when it returns).
    pub fn stop_all(&self) {
        self.running.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    pub fn count(&self) -> usize {
        self.running.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_follow_the_wanted_accounts_and_a_dropped_thread_worker_is_told_to_stop() {
        let workers: Workers<u64> = Workers::new("test: account", "worker");
        let stops = Mutex::new(Vec::new());
        let start = |_: &u64| {
            let stop = Arc::new(Stop::default());
            stops.lock().unwrap().push(stop.clone());
            Some(Worker::Thread(stop))
        };
        workers.sync(&[1, 2], start);
        assert_eq!(workers.count(), 2);
        workers.sync(&[2, 3], |_| {
            let stop = Arc::new(Stop::default());
            Some(Worker::Thread(stop))
        });
        assert_eq!(workers.count(), 2);
        let stopped: Vec<bool> = stops.lock().unwrap().iter().map(|s| s.is_stopped()).collect();
        assert_eq!(
            stopped.iter().filter(|s| **s).count(),
            1,
            "only account 1's worker stopped"
        );
        workers.stop_all();
        assert!(stops.lock().unwrap().iter().all(|s| s.is_stopped()));
        assert!(
            !Stop::default().pause(Duration::from_millis(1)),
            "not stopped: it slept"
        );
    }
}
