//! The async side of the daemon: one executor, run by the main thread inside `block_on`. Every
//! task (front door, sessions, the dial loop, timers) is spawned here, so the async side costs
//! one thread and wakes only for I/O and timers. Blocking work (commits, provider calls, the
//! internal HTTP handlers) leaves it through `unblock` for a small pool of threads that sleep
//! without a timeout while there is work to wait for and exit after `IDLE_EXIT` without any:
//! an idle daemon has no pool threads and nothing that wakes on its own.
//!
//! Invariant: nothing blocking runs on the executor thread. `on_executor` lets the store assert
//! it for every commit in debug builds.

use std::cell::Cell;
use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

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

/// Blocking jobs running at once at most; more wait in the queue.
const MAX_THREADS: usize = 128;
/// A pool thread with nothing to do for this long exits.
const IDLE_EXIT: Duration = Duration::from_secs(2);

type Job = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    idle: usize,
    threads: usize,
}

fn pool() -> &'static (Mutex<Queue>, Condvar) {
    static POOL: OnceLock<(Mutex<Queue>, Condvar)> = OnceLock::new();
    POOL.get_or_init(Default::default)
}

fn submit(job: Job) {
    let (queue, wake) = pool();
    let mut q = queue.lock().unwrap_or_else(|e| e.into_inner());
    q.jobs.push_back(job);
    if q.jobs.len() > q.idle && q.threads < MAX_THREADS {
        q.threads += 1;
        let spawned = std::thread::Builder::new().name("blocking".into()).spawn(work);
        if let Err(e) = spawned {
            q.threads -= 1;
            log::error!("runtime: cannot start a blocking thread: {e}");
        }
    }
    wake.notify_one();
}

fn work() {
    let (queue, wake) = pool();
    let mut q = queue.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if let Some(job) = q.jobs.pop_front() {
            drop(q);
            // A panicking job (debug builds; release aborts) leaves its waiter an error and the
            // thread in the pool.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            q = queue.lock().unwrap_or_else(|e| e.into_inner());
            continue;
        }
        q.idle += 1;
        let (woken, waited) = wake.wait_timeout(q, IDLE_EXIT).unwrap_or_else(|e| e.into_inner());
        q = woken;
        q.idle -= 1;
        if waited.timed_out() && q.jobs.is_empty() {
            q.threads -= 1;
            return;
        }
    }
}

/// Runs blocking `f` on a pool thread; the executor waits for it without blocking.
pub async fn unblock<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = smol::channel::bounded(1);
    submit(Box::new(move || {
        let _ = tx.try_send(f());
    }));
    match rx.recv().await {
        Ok(v) => v,
        Err(_) => panic!("a blocking job panicked"),
    }
}

/// Fairness for a loop whose reads may all be ready at once (a peer flooding frames): the
/// executor runs a task until it waits, so such a loop would hold up every other connection.
/// `turn` lets the others run every `FAIR_TURNS` passes.
#[derive(Default)]
pub struct Fair(u32);

/// Passes of a `Fair` loop between two yields.
const FAIR_TURNS: u32 = 32;

impl Fair {
    pub async fn turn(&mut self) {
        self.0 = self.0.wrapping_add(1);
        if self.0 % FAIR_TURNS == 0 {
            smol::future::yield_now().await;
        }
    }
}

/// Runs blocking `f` on a pool thread; nobody waits for it.
pub fn spawn_blocking(f: impl FnOnce() + Send + 'static) {
    submit(Box::new(f));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocking_jobs_run_concurrently_and_give_their_results() {
        let started = Instant::now();
        let results: Vec<u32> = smol::block_on(async {
            let jobs: Vec<_> = (0..8u32)
                .map(|i| {
                    smol::spawn(unblock(move || {
                        std::thread::sleep(Duration::from_millis(200));
                        i * 2
                    }))
                })
                .collect();
            let mut out = Vec::new();
            for j in jobs {
                out.push(j.await);
            }
            out
        });
        assert_eq!(results, (0..8).map(|i| i * 2).collect::<Vec<_>>());
        assert!(started.elapsed() < Duration::from_millis(1500), "they ran side by side");
    }
}
