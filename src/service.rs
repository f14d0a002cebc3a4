//! Running as a service: `sd_notify` datagrams (READY, STOPPING, WATCHDOG), the signals that
//! stop the daemon, its open-file limit and whether its state dir survives a reboot. The notify
//! protocol is one datagram to `$NOTIFY_SOCKET`; no libsystemd.

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::time::{Duration, Instant};

/// Sends one state line (`READY=1`, `STOPPING=1`, `WATCHDOG=1`, `STATUS=...`) to systemd.
/// Does nothing outside systemd; a failure is logged once and never stops the daemon.
pub fn notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let sent = (|| -> std::io::Result<()> {
        let sock = UnixDatagram::unbound()?;
        let bytes = std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str());
        match bytes.strip_prefix(b"@") {
            // Abstract socket namespace.
            Some(name) => {
                use std::os::linux::net::SocketAddrExt;
                let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
                sock.send_to_addr(state.as_bytes(), &addr)?;
            }
            None => {
                sock.send_to(state.as_bytes(), &path)?;
            }
        }
        Ok(())
    })();
    if let Err(e) = sent {
        log::warn!("systemd: cannot send {state} to NOTIFY_SOCKET: {e}");
    }
}

/// The watchdog interval to ping at (half of `WatchdogSec`), when systemd asks for pings.
pub fn watchdog_interval() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Some(pid) = std::env::var("WATCHDOG_PID").ok().and_then(|p| p.parse::<u32>().ok()) {
        if pid != std::process::id() {
            return None;
        }
    }
    (usec > 0).then(|| Duration::from_micros(usec / 2))
}

/// How often the status line is looked at besides its changes (for the figures in it, such as
/// the outbox's bytes) when systemd asks for no watchdog pings.
const STATUS_EVERY: Duration = Duration::from_secs(30);
/// Two status lines are at least this far apart: a client that connects and leaves in a loop
/// costs systemd one datagram a second at most.
const STATUS_GAP: Duration = Duration::from_secs(1);

/// Keeps systemd informed, from the async executor: `WATCHDOG=1` every `watchdog` when it asks
/// for pings (so a stuck event loop stops them), and a `STATUS=` line (`systemctl status`
/// shows it) whenever `summary` says something new: at once when a state it shows changed
/// (`changed::raise`), and on the ticks for its figures. `summary` must not block: it reads
/// counters, not the database.
pub async fn keep_systemd_informed(watchdog: Option<Duration>, summary: impl Fn() -> String) {
    let every = watchdog.unwrap_or(STATUS_EVERY);
    let mut said = String::new();
    // The next tick stays where it is when a change wakes the loop: pings keep their pace.
    let mut tick = Instant::now() + every;
    loop {
        let now = summary();
        if now != said {
            notify(&format!("STATUS={now}"));
            said = now;
        }
        // What changes within the gap is said after it (the raise waits in the channel); a
        // ping due meanwhile is not held up by it.
        smol::Timer::at((Instant::now() + STATUS_GAP).min(tick)).await;
        if Instant::now() < tick {
            smol::future::or(smol::Timer::at(tick), async {
                crate::changed::raised().await;
                Instant::now()
            })
            .await;
        }
        if Instant::now() >= tick {
            tick = Instant::now() + every;
            if watchdog.is_some() {
                notify("WATCHDOG=1");
            }
        }
    }
}

/// Resolves when SIGTERM or SIGINT arrives. SIGHUP calls `on_hup` (the TLS certificate is read
/// again; it returns whether there was anything to read) and says that the config is read once
/// at start: a restart (whatever the init system) applies a change and loses nothing.
pub async fn stop_signal(mut signals: async_signal::Signals, on_hup: impl Fn() -> bool) -> &'static str {
    use async_signal::Signal;
    use smol::stream::StreamExt;
    while let Some(sig) = signals.next().await {
        match sig {
            Ok(Signal::Term) => return "SIGTERM",
            Ok(Signal::Int) => return "SIGINT",
            Ok(Signal::Hup) => {
                let reloaded = if on_hup() {
                    "the TLS certificate is read again; "
                } else {
                    ""
                };
                log::warn!("SIGHUP: {reloaded}imgate reads its config once; restart it to apply changes (`systemctl restart imgate`, or `service imgate restart` on OpenWrt and Alpine; accepted messages are kept on disk)")
            }
            Ok(_) => {}
            Err(e) => log::warn!("signal handling: {e}"),
        }
    }
    "signal stream ended"
}

/// Raises the soft open-file limit to the hard one (each connection needs a descriptor); returns
/// the limit in force, `None` when there is none.
pub fn raise_fd_limit() -> Option<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        limit.current = limit.maximum;
        if let Err(e) = setrlimit(Resource::Nofile, limit) {
            log::debug!("cannot raise the open-file limit: {e}");
        }
    }
    getrlimit(Resource::Nofile).current
}

/// The memory-backed file system (`tmpfs`, `ramfs`) that `dir`, or its nearest existing parent,
/// lives on: accepted messages kept there are gone after a reboot (OpenWrt's `/var`, `/tmp`,
/// `/run`). `None` for a disk, or when nothing on the path can be examined.
pub fn volatile_fs(dir: &Path) -> Option<&'static str> {
    const TMPFS_MAGIC: u64 = 0x0102_1994;
    const RAMFS_MAGIC: u64 = 0x8584_58f6;
    let here = Path::new(".");
    let st = dir
        .ancestors()
        .map(|p| if p.as_os_str().is_empty() { here } else { p })
        .find_map(|p| rustix::fs::statfs(p).ok())?;
    // f_type is 32 bits wide on some targets and signed on others.
    match st.f_type as u64 & 0xffff_ffff {
        TMPFS_MAGIC => Some("tmpfs"),
        RAMFS_MAGIC => Some("ramfs"),
        _ => None,
    }
}

/// The warning `imgate check` prints and `imgate run` logs for a state dir on RAM.
pub fn volatile_state_warning(dir: &Path) -> Option<String> {
    volatile_fs(dir).map(|fs| {
        format!(
            "state_dir {} is on {fs}: accepted messages do not survive a reboot (choose a directory on disk to keep them)",
            dir.display()
        )
    })
}

pub fn signals() -> std::io::Result<async_signal::Signals> {
    use async_signal::Signal;
    async_signal::Signals::new([Signal::Term, Signal::Int, Signal::Hup])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notify_reaches_a_datagram_socket_named_by_notify_socket() {
        let dir = crate::scratch::scratch_dir("notify");
        let path = dir.join("notify.sock");
        let server = UnixDatagram::bind(&path).unwrap();
        // SAFETY-free: tests in this module are the only users of NOTIFY_SOCKET in this process.
        std::env::set_var("NOTIFY_SOCKET", &path);
        notify("READY=1");
        std::env::remove_var("NOTIFY_SOCKET");
        let mut buf = [0u8; 64];
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
    }
}
