//! Periodic work, as one task on the executor that sleeps until something is due: the expiry
//! sweeps every `cleanup_interval`, the `connector_id` lease when it could run out, and the
//! database's reopen after an I/O error (each second while one is pending, woken by the store
//! when one happens). The work runs on a blocking thread; an idle daemon is not woken for it.
//! Each sweep also gives the heap's free memory back to the system.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use smol::future::FutureExt;

use crate::dataplane::Plane;
use crate::{config, ids};

/// A pending reopen is tried this often.
const RECOVER_EVERY: Duration = Duration::from_secs(1);

pub async fn run(plane: Weak<Plane>) {
    let Some((every, trouble)) = plane
        .upgrade()
        .map(|a| (a.config.queue.cleanup_interval, a.db.trouble()))
    else {
        return;
    };
    let mut next_sweep = Instant::now() + every;
    loop {
        let Some(a) = plane.upgrade().filter(|a| !a.is_stopping()) else {
            return;
        };
        let sweep = Instant::now() >= next_sweep;
        if sweep {
            next_sweep = Instant::now() + every;
        }
        let (lease_left, recovering) = crate::runtime::unblock(move || work(&a, sweep)).await;
        let mut wait = next_sweep.saturating_duration_since(Instant::now()).min(lease_left);
        if recovering {
            wait = wait.min(RECOVER_EVERY);
        }
        let _ = async { trouble.recv().await.is_ok() }
            .or(async {
                smol::Timer::after(wait).await;
                false
            })
            .await;
    }
}

/// One round: reopen after an I/O error, the lease, the sweeps when due. Returns how long the
/// lease has left at least, and whether a reopen is still pending.
fn work(plane: &Arc<Plane>, sweep: bool) -> (Duration, bool) {
    // A disk that was full or read-only may be back.
    plane.outbox.recover();
    let lease_left = check_lease(plane);
    if sweep {
        let now = ids::now_ms();
        if let Err(e) = plane.outbox.sweep_expired(now) {
            log::error!("outbox: sweep failed: {e}");
        }
        if let Err(e) = plane.outbox.sweep_reply_refs(now) {
            log::error!("outbox: reply reference sweep failed: {e}");
        }
        plane.sweep(now);
        plane.files.sweep(now);
        // Bursts delivery does not see (uploads, webhooks piling up while xAgent is away)
        // leave free memory in the heap too; the sweep already woke the daemon for this.
        crate::heap::give_back();
    }
    (lease_left, plane.outbox.needs_recovery())
}

/// Common protocol 8.2: one continuous offline `lease` unregisters the `connector_id`'s
/// channels. Returns how long until the lease could run out (at the soonest).
fn check_lease(plane: &Arc<Plane>) -> Duration {
    let lease = plane.config.xagent.lease;
    let now = ids::now_ms();
    match plane.channels.expire_lease(now, lease.as_millis() as u64) {
        Ok(None) | Ok(Some(0)) => {}
        Ok(Some(n)) => {
            log::warn!(
                "lease: no xAgent for {}; {n} channel(s) unregistered (their pending messages stay unbound until their TTL)",
                config::fmt_duration(lease)
            );
            plane.providers.bindings_changed(&plane.channels);
        }
        // The store logged the outage once; each recovery round need not say it again.
        Err(e) if e.is_outage() => log::debug!("lease: cannot unregister channels: {e}"),
        Err(e) => log::error!("lease: cannot unregister channels: {e}"),
    }
    match plane.channels.offline_since() {
        // Running: it ends at `since + lease`. Not running (xAgent connected): a lease that
        // starts later ends later than a whole lease from now.
        Ok(Some(since)) => Duration::from_millis(since.saturating_add(lease.as_millis() as u64).saturating_sub(now)),
        Ok(None) => lease,
        Err(_) => RECOVER_EVERY,
    }
}
