//! A process-wide signal that something `systemctl status` shows has changed (a session came or
//! went, the storage started or stopped failing), so the one listener (`service`'s informer)
//! says it at once instead of at its next tick. Memory only; raising it never blocks, and
//! raises coalesce until the listener has run.

use std::sync::OnceLock;

type Pair = (smol::channel::Sender<()>, smol::channel::Receiver<()>);

fn pair() -> &'static Pair {
    static SIGNAL: OnceLock<Pair> = OnceLock::new();
    SIGNAL.get_or_init(|| smol::channel::bounded(1))
}

/// Something shown changed; callable from any thread, holding any lock.
pub fn raise() {
    // Full means a raise is waiting already: this one is part of it.
    let _ = pair().0.try_send(());
}

/// Resolves at the next raise (or at once if one is waiting).
pub async fn raised() {
    let _ = pair().1.recv().await;
}
