//! Requests a provider makes over its account's long connection, answered on the same
//! connection by an ID (WeCom's replies, sends and uploads): a tool's blocking thread hands its
//! frame to the connection up now and waits for the answer with its ID, within its deadline.
//! At most `MAX_PENDING` wait at once; an answer nobody waits for is dropped.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Instant;

use async_tungstenite::tungstenite::Message;
use smol::channel::Sender;
use smol::future::FutureExt;

use crate::atomic::AtomicU64;
use crate::providers::socket::Out;

/// Calls waiting for their answers at once, per account.
const MAX_PENDING: usize = 64;

/// Why a call got no answer.
#[derive(Debug, PartialEq)]
pub enum CallError {
    /// No connection is up to take it.
    NotConnected,
    /// `MAX_PENDING` calls wait already, or one with the same ID does.
    Busy,
    /// The frame was written (or queued) and no answer came within the deadline, or the
    /// connection ended first: it may have been done.
    NoAnswer,
}

/// The calls of one account.
pub struct Calls<A> {
    /// The writer's queue of the connection up now.
    out: Mutex<Option<Sender<Out>>>,
    /// By ID: the waiting call's number (`next`) and where its answer goes.
    pending: Mutex<HashMap<String, (u64, Sender<A>)>>,
    next: AtomicU64,
}

impl<A> Default for Calls<A> {
    fn default() -> Calls<A> {
        Calls {
            out: Mutex::new(None),
            pending: Mutex::default(),
            next: AtomicU64::new(0),
        }
    }
}

impl<A: Send + 'static> Calls<A> {
    /// The connection whose writer is `out` takes the calls from now on.
    pub fn connected(&self, out: Sender<Out>) {
        *self.out.lock().unwrap_or_else(|e| e.into_inner()) = Some(out);
    }

    /// The connection whose writer is `out` ended: no answer comes on it, so the calls
    /// waiting end at once (`NoAnswer`), and new ones wait for the next connection.
    pub fn ended(&self, out: &Sender<Out>) {
        let mut current = self.out.lock().unwrap_or_else(|e| e.into_inner());
        if current.as_ref().is_some_and(|c| c.same_channel(out)) {
            *current = None;
            self.pending.lock().unwrap_or_else(|e| e.into_inner()).clear();
        }
    }

    /// Whether a connection takes calls now.
    pub fn connected_now(&self) -> bool {
        let out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        out.as_ref().is_some_and(|o| !o.is_closed())
    }

    /// Writes `frame` on the connection up now and waits, until `deadline`, for the answer
    /// named `id`. On a blocking thread only.
    pub fn call(&self, id: &str, frame: Message, deadline: Instant) -> Result<A, CallError> {
        let out = self.out.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let out = out.filter(|o| !o.is_closed()).ok_or(CallError::NotConnected)?;
        let (tx, rx) = smol::channel::bounded(1);
        // The call's number, not a sender of its own: once its entry is gone (`ended`), nothing
        // can answer it and its wait ends.
        let number = self.next.fetch_add(1, Ordering::Relaxed);
        {
            let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            if pending.len() >= MAX_PENDING || pending.contains_key(id) {
                return Err(CallError::Busy);
            }
            pending.insert(id.to_string(), (number, tx));
        }
        let answered = smol::block_on(
            async {
                out.send((frame, None)).await.map_err(|_| CallError::NotConnected)?;
                rx.recv().await.map_err(|_| CallError::NoAnswer)
            }
            .or(async {
                smol::Timer::at(deadline).await;
                Err(CallError::NoAnswer)
            }),
        );
        // Only this call's entry: after an `ended`, another call may wait under the same ID.
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if pending.get(id).is_some_and(|(n, _)| *n == number) {
            pending.remove(id);
        }
        answered
    }

    /// The answer named `id` came: whether a call waited for it.
    pub fn answered(&self, id: &str, answer: A) -> bool {
        let waiting = self.pending.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
        waiting.is_some_and(|(_, tx)| tx.try_send(answer).is_ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_call_gets_the_answer_with_its_id_and_none_without_a_connection_or_in_time() {
        let calls: Arc<Calls<u32>> = Arc::default();
        let soon = || Instant::now() + Duration::from_millis(200);
        assert_eq!(
            calls.call("a", Message::Text("x".into()), soon()),
            Err(CallError::NotConnected)
        );
        let (out, written) = smol::channel::bounded::<Out>(4);
        let _kept = written.clone();
        calls.connected(out.clone());
        let answerer = {
            let calls = calls.clone();
            std::thread::spawn(move || {
                let (frame, _) = smol::block_on(written.recv()).unwrap();
                assert_eq!(frame, Message::Text("x".into()));
                assert!(!calls.answered("other", 1), "nobody waits for it");
                assert!(calls.answered("a", 7));
            })
        };
        assert_eq!(
            calls.call("a", Message::Text("x".into()), Instant::now() + Duration::from_secs(10)),
            Ok(7)
        );
        answerer.join().unwrap();
        assert_eq!(
            calls.call("b", Message::Text("y".into()), soon()),
            Err(CallError::NoAnswer)
        );
        calls.ended(&out);
        assert_eq!(
            calls.call("c", Message::Text("z".into()), soon()),
            Err(CallError::NotConnected)
        );
    }

    #[test]
    fn a_second_call_with_the_same_id_is_busy_a_full_table_too_and_an_ended_connection_ends_the_waits() {
        let calls: Arc<Calls<u32>> = Arc::default();
        let (out, written) = smol::channel::bounded::<Out>(4);
        calls.connected(out.clone());
        let later = || Instant::now() + Duration::from_secs(30);
        let waiting: Vec<_> = (0..MAX_PENDING)
            .map(|i| {
                let calls = calls.clone();
                std::thread::spawn(move || calls.call(&format!("id{i}"), Message::Text("x".into()), later()))
            })
            .collect();
        // Every call's frame is written: each one waits for its answer now.
        for _ in 0..MAX_PENDING {
            smol::block_on(written.recv()).unwrap();
        }
        assert_eq!(
            calls.call("id0", Message::Text("y".into()), later()),
            Err(CallError::Busy),
            "its ID waits already"
        );
        assert_eq!(
            calls.call("new", Message::Text("y".into()), later()),
            Err(CallError::Busy),
            "the table is full"
        );
        let started = Instant::now();
        calls.ended(&out);
        for w in waiting {
            assert_eq!(w.join().unwrap(), Err(CallError::NoAnswer));
        }
        assert!(
            started.elapsed() < Duration::from_secs(25),
            "ended at once, not at their deadlines"
        );
    }
}
