//! Fault points for the crash and disk-fault tests, in debug builds only: a release build
//! compiles every call here to nothing, so no environment variable can crash an appliance.
//!
//! - `IMGATE_TEST_CRASH=POINT:N` kills the process with SIGKILL the N-th time it passes `POINT`
//!   (a crash exactly there, as the kernel would leave the files).
//! - `IMGATE_TEST_FAULT=POINT:PATH` makes `POINT` fail with ENOSPC while `PATH` exists (a disk
//!   that is full for a while, then is not).

#[cfg(debug_assertions)]
mod armed {
    use crate::atomic::AtomicU64;
    use std::sync::atomic::Ordering;
    use std::sync::OnceLock;

    fn crash_plan() -> &'static Option<(String, u64)> {
        static PLAN: OnceLock<Option<(String, u64)>> = OnceLock::new();
        PLAN.get_or_init(|| {
            let v = std::env::var("IMGATE_TEST_CRASH").ok()?;
            let (point, n) = v.rsplit_once(':')?;
            Some((point.to_string(), n.parse().ok()?))
        })
    }

    pub fn crash_due(point: &str) -> bool {
        static HITS: AtomicU64 = AtomicU64::new(0);
        match crash_plan() {
            Some((p, n)) if p == point => HITS.fetch_add(1, Ordering::SeqCst) + 1 == *n,
            _ => false,
        }
    }

    pub fn crash(point: &str) -> ! {
        eprintln!("imgate: IMGATE_TEST_CRASH: killed at {point}");
        let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
        std::process::abort()
    }

    pub fn fail(point: &str) -> std::io::Result<()> {
        static PLAN: OnceLock<Option<(String, String)>> = OnceLock::new();
        let plan = PLAN.get_or_init(|| {
            let v = std::env::var("IMGATE_TEST_FAULT").ok()?;
            let (p, path) = v.split_once(':')?;
            Some((p.to_string(), path.to_string()))
        });
        match plan {
            Some((p, path)) if p == point && std::path::Path::new(path).exists() => {
                Err(std::io::Error::from_raw_os_error(28)) // ENOSPC
            }
            _ => Ok(()),
        }
    }
}

/// True the one time a planned crash at `point` is due (the caller then does what a crash in
/// the middle of its work would leave behind, and calls `crash`).
#[inline]
pub fn crash_due(_point: &str) -> bool {
    #[cfg(debug_assertions)]
    return armed::crash_due(_point);
    #[cfg(not(debug_assertions))]
    false
}

/// Kills the process (only ever reached after `crash_due`).
pub fn crash(_point: &str) {
    #[cfg(debug_assertions)]
    armed::crash(_point);
}

/// Kills the process here if a crash at `point` is planned for this pass.
#[inline]
pub fn crash_at(point: &str) {
    if crash_due(point) {
        crash(point);
    }
}

/// An injected I/O error at `point`, while one is planned.
#[inline]
pub fn fail(_point: &str) -> std::io::Result<()> {
    #[cfg(debug_assertions)]
    return armed::fail(_point);
    #[cfg(not(debug_assertions))]
    Ok(())
}
