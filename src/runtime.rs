//! The async side of the daemon: one executor, run by the main thread inside `block_on`. Every
//! task (front door, sessions, the dial loop, timers) is spawned here, so the async side costs
//! one thread and wakes only for I/O and timers. Blocking work leaves it through
//! `smol::unblock`, whose pool threads exit when idle.
//!
//! Invariant: nothing blocking runs on the executor thread. `on_executor` lets the store assert
//! it for every commit in debug builds.

use std::cell::Cell;
use std::future::Future;
use std::sync::OnceLock;
use std::time::Instant;

use smol::channel::{Receiver, Sender};
use smol::future::FutureExt;
use smol::{Executor, Task};

static EXECUTOR: Executor<'static> = Executor::new();

thread_local! {
    static RUNNING: Cell<bool> = const { Cell::new(false) };
}

/// Spawns a task on the executor; it runs while `block_on` runs.
pub fn spawn<T: Send + 'static>(future: impl Future<Output = T> + Send + 'static) -> Task<T> {
    EXECUTOR.spawn(future)
}

/// Runs the executor on this thread until `future` completes.
pub fn block_on<T>(future: impl Future<Output = T>) -> T {
    struct Running;
    impl Drop for Running {
        fn drop(&mut self) {
            RUNNING.with(|r| r.set(false));
        }
    }
    RUNNING.with(|r| r.set(true));
    let _running = Running;
    smol::block_on(EXECUTOR.run(future))
}

/// True on the thread that runs the executor: it must never block.
pub fn on_executor() -> bool {
    RUNNING.with(|r| r.get())
}

fn releases() -> &'static (Sender<()>, Receiver<()>) {
    static RELEASES: OnceLock<(Sender<()>, Receiver<()>)> = OnceLock::new();
    // One slot: notices coalesce, so nothing piles up while no shutdown is waiting.
    RELEASES.get_or_init(|| smol::channel::bounded(1))
}

/// Something that held the app let go of it (a session, a tool call, an answered request, a
/// worker): a shutdown waiting for the app looks again.
pub fn released() {
    let _ = releases().0.try_send(());
}

/// Waits until `done()` holds, looking again at each `released`, or until `deadline`; returns
/// whether it holds.
pub async fn until(deadline: Instant, done: impl Fn() -> bool) -> bool {
    let notices = releases().1.clone();
    while !done() {
        let notice = async { notices.recv().await.is_ok() }.or(async {
            smol::Timer::at(deadline).await;
            false
        });
        if !notice.await {
            return done();
        }
    }
    true
}
