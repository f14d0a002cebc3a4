//! The command line (`run check init status --version`) and the daemon's wiring: logging, the
//! app, the data plane, the listener, shutdown.

use crate::{app, config, dataplane, front, http, ids, maintenance, protocol, providers, runtime, service, tls, y2038};

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use smol::future::FutureExt;

const USAGE: &str = "usage:
  imgate [run] [--config FILE]   run the daemon in the foreground
  imgate check [--config FILE]   validate the config and print the effective policy
  imgate init [FILE|-]           write the commented default config with a fresh api_key
                                 (mode 0600, never overwrites; `-`: the template, no key)
  imgate status [--config FILE]  show channels and queues of the running daemon
  imgate --version               name, version, git rev, build time, providers built in";

/// Runs the command the arguments name; the process's exit code.
pub fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (cmd, rest) = match args.first().map(String::as_str) {
        None => ("run", &args[..]),
        Some(a) if a.starts_with('-') && a != "--version" && a != "-V" && a != "--help" && a != "-h" => {
            ("run", &args[..])
        }
        Some(a) => (a, &args[1..]),
    };
    match cmd {
        "--version" | "-V" | "version" => {
            println!("{}", version_and_providers());
            ExitCode::SUCCESS
        }
        "--help" | "-h" | "help" => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        "init" => init(rest),
        "run" | "check" | "status" => {
            let explicit = match config_flag(rest) {
                Ok(p) => p,
                Err(msg) => {
                    eprintln!("imgate: {msg}\n{USAGE}");
                    return ExitCode::from(2);
                }
            };
            let path = config::locate(explicit.as_deref());
            let mut cfg = match config::load(path.as_deref(), &providers::readers()) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::from(2);
                }
            };
            // Before anything reads the time, which aborts a 32-bit build past 2038.
            let too_late = y2038::refusal();
            match cmd {
                "check" => {
                    let fitted =
                        crate::fit::measure(&cfg.server.state_dir).and_then(|room| crate::fit::fit(&mut cfg, room));
                    print!("{}", cfg.summary());
                    let memory = crate::memory::Allowed::of(cfg.queue.max_bytes_total);
                    println!("memory:            {}", memory.line());
                    print!("{}", crate::probe::report(cfg.server.listen, &cfg.server.state_dir));
                    if let Some(w) = fitted {
                        eprintln!("imgate: warning: {w}");
                    }
                    if let Some(w) = memory.warning() {
                        eprintln!("imgate: warning: {w}");
                    }
                    if let Some(w) = service::volatile_state_warning(&cfg.server.state_dir) {
                        eprintln!("imgate: warning: {w}");
                    }
                    if let Some(why) = too_late {
                        eprintln!("imgate: warning: `imgate run` will refuse to start: {why}");
                    }
                    println!("config is valid");
                    ExitCode::SUCCESS
                }
                _ if too_late.is_some() => {
                    eprintln!("imgate: {}", too_late.unwrap_or_default());
                    ExitCode::from(1)
                }
                "status" => crate::status_view::status(&cfg),
                _ => run(cfg),
            }
        }
        other => {
            eprintln!("imgate: unknown command `{other}`\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn config_flag(rest: &[String]) -> Result<Option<PathBuf>, String> {
    match rest {
        [] => Ok(None),
        [flag, file] if flag == "--config" || flag == "-c" => Ok(Some(PathBuf::from(file))),
        [one] if one.starts_with("--config=") => Ok(Some(PathBuf::from(&one["--config=".len()..]))),
        _ => Err(format!("unexpected arguments: {}", rest.join(" "))),
    }
}

fn init(rest: &[String]) -> ExitCode {
    let target = rest.first().map(String::as_str).unwrap_or("imgate.conf");
    // An option is not a file name: `imgate init --help` must not write a config named `--help`.
    match target {
        "--help" | "-h" => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        option if option.starts_with('-') && option != "-" => {
            eprintln!("imgate init: unknown option {}\n{USAGE}", crate::quiet::shown(option));
            return ExitCode::from(2);
        }
        _ => {}
    }
    if target == "-" {
        // Standard output may end up in a log or a terminal's scrollback: no key there.
        print!("{}", config::TEMPLATE);
        return ExitCode::SUCCESS;
    }
    let path = Path::new(target);
    // The file holds secrets: only its owner reads it, from the moment it exists.
    let file = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
    };
    match file.and_then(|mut f| f.write_all(with_fresh_key(config::TEMPLATE).as_bytes())) {
        Ok(()) => {
            println!(
                "wrote {} (readable by you alone) with a fresh api_key for xAgent; edit it, then `imgate check --config {}`",
                path.display(),
                path.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            eprintln!("imgate: {} already exists; not overwriting it", path.display());
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("imgate: cannot write {}: {e}", path.display());
            ExitCode::from(1)
        }
    }
}

/// The template with `api_key` set to 32 random bytes in hex, so a config written by `init`
/// is safe on any listener.
fn with_fresh_key(template: &str) -> String {
    template.replacen("\napi_key =\n", &format!("\napi_key = {}\n", ids::random_hex(32)), 1)
}

/// How log lines are written, for whatever reads them.
#[derive(Clone, Copy, PartialEq, Debug)]
enum LogFormat {
    /// A terminal or a file: `[time LEVEL] message`, all on stderr.
    Plain,
    /// journald (`JOURNAL_STREAM` set): each line led by its syslog priority (`<3>`…`<7>`),
    /// no time of its own (journald stamps it).
    Journal,
    /// procd's or OpenRC's logger (`IMGATE_LOG_FORMAT=syslog`, set by their scripts): info
    /// and below on stdout, warnings and errors on stderr (which they log at `daemon.err`), no
    /// time of its own.
    Syslog,
}

impl LogFormat {
    fn from_env() -> LogFormat {
        match std::env::var("IMGATE_LOG_FORMAT").as_deref() {
            Ok("syslog") => LogFormat::Syslog,
            Ok("journal") => LogFormat::Journal,
            Ok("plain") => LogFormat::Plain,
            _ if std::env::var_os("JOURNAL_STREAM").is_some() => LogFormat::Journal,
            _ => LogFormat::Plain,
        }
    }
}

/// A record's syslog priority (RFC 5424: 3 error, 4 warning, 6 informational, 7 debug).
fn syslog_priority(level: log::Level) -> u8 {
    match level {
        log::Level::Error => 3,
        log::Level::Warn => 4,
        log::Level::Info => 6,
        log::Level::Debug | log::Level::Trace => 7,
    }
}

/// One line as `format` writes it; the module path only when debugging (`with_target`).
fn log_line(
    format: LogFormat,
    level: log::Level,
    target: &str,
    with_target: bool,
    args: &std::fmt::Arguments,
) -> String {
    let target = if with_target {
        format!("{target}: ")
    } else {
        String::new()
    };
    match format {
        LogFormat::Journal => format!("<{}>{target}{args}", syslog_priority(level)),
        LogFormat::Syslog | LogFormat::Plain => format!("{level} {target}{args}"),
    }
}

/// Logs warnings and errors through one logger (stderr) and the rest through the other.
struct SplitLogger {
    quiet: env_logger::Logger,
    loud: env_logger::Logger,
}

impl log::Log for SplitLogger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        self.quiet.enabled(metadata)
    }

    fn log(&self, record: &log::Record) {
        match record.level() <= log::Level::Warn {
            true => self.loud.log(record),
            false => self.quiet.log(record),
        }
    }

    fn flush(&self) {
        self.quiet.flush();
        self.loud.flush();
    }
}

fn init_logging(level: &str) {
    let format = LogFormat::from_env();
    let builder = |target: env_logger::Target| {
        let mut b = env_logger::Builder::new();
        match std::env::var("RUST_LOG") {
            Ok(filters) if !filters.trim().is_empty() => b.parse_filters(&filters),
            _ => b.parse_filters(level),
        };
        // Dependencies log whole packets and request heads (with Bearer keys) at debug and
        // trace; only their warnings and errors get through, whatever RUST_LOG says.
        for noisy in [
            "tungstenite",
            "async_tungstenite",
            "tiny_http",
            "ureq",
            "ureq_proto",
            "rustls",
            "redb",
        ] {
            b.filter_module(noisy, log::LevelFilter::Warn);
        }
        b.target(target);
        b
    };
    let mut stderr = builder(env_logger::Target::Stderr);
    // Which module said it matters when debugging; at info it is noise on an SD card.
    let debugging = stderr.build().filter() >= log::LevelFilter::Debug;
    let mut stderr = builder(env_logger::Target::Stderr);
    if format == LogFormat::Plain {
        stderr.format_target(debugging).init();
        return;
    }
    let write = move |buf: &mut env_logger::fmt::Formatter, record: &log::Record| {
        use std::io::Write;
        let line = log_line(format, record.level(), record.target(), debugging, record.args());
        writeln!(buf, "{line}")
    };
    stderr.format(write);
    if format == LogFormat::Journal {
        stderr.init();
        return;
    }
    let mut stdout = builder(env_logger::Target::Stdout);
    stdout.format(write);
    let (quiet, loud) = (stdout.build(), stderr.build());
    let max = quiet.filter();
    if log::set_boxed_logger(Box::new(SplitLogger { quiet, loud })).is_ok() {
        log::set_max_level(max);
    }
}

fn run(mut cfg: config::Config) -> ExitCode {
    crate::metrics::mark_start();
    init_logging(&cfg.server.log_level);
    // First of all, so an early SIGTERM or SIGHUP is handled rather than fatal.
    let signals = match service::signals() {
        Ok(s) => s,
        Err(e) => {
            log::error!("cannot install signal handlers: {e}");
            return ExitCode::from(1);
        }
    };
    if cfg.source == config::EMBEDDED {
        log::info!("no config file found; running with the embedded defaults");
    } else {
        log::info!("config: {}", cfg.source);
    }
    log::info!("{}", version_and_providers());
    let state_dir = cfg.server.state_dir.clone();
    log::info!(
        "state_dir: {} (from {})",
        state_dir.display(),
        cfg.server.state_dir_from
    );
    if let Some(w) = service::volatile_state_warning(&state_dir) {
        log::warn!("{w}");
    }
    match crate::fit::measure(&state_dir) {
        Some(room) => {
            if let Some(w) = crate::fit::fit(&mut cfg, room) {
                log::warn!("{w}");
            }
        }
        None => log::warn!(
            "state_dir {}: cannot measure its file system; the caps are used as configured",
            state_dir.display()
        ),
    }
    let memory = crate::memory::Allowed::of(cfg.queue.max_bytes_total);
    match memory.warning() {
        Some(w) => log::warn!("{w}"),
        None => log::info!("memory: {}", memory.line()),
    }
    // The port first: a start that cannot serve writes nothing to the state dir.
    let listener = match std::net::TcpListener::bind(cfg.server.listen) {
        Ok(l) => l,
        Err(e) => {
            log::error!("cannot listen on {}: {e}", cfg.server.listen);
            return ExitCode::from(1);
        }
    };
    let opening = std::time::Instant::now();
    let opened = app::App::open(cfg).and_then(|app| Ok((dataplane::Plane::open(app.clone())?, app)));
    let (plane, app) = match opened {
        Ok(a) => a,
        Err(e) => {
            log::error!("cannot open the database in {}: {e}", state_dir.display());
            return ExitCode::from(1);
        }
    };
    log::debug!("store opened and outbox index loaded in {:?}", opening.elapsed());
    // Expiry is enforced at startup, not only by the periodic sweep.
    match app.outbox.sweep_expired(ids::now_ms()) {
        Ok(0) => {}
        Ok(n) => log::warn!("outbox: {n} message(s) expired while imgate was stopped"),
        Err(e) => log::error!("outbox: startup sweep failed: {e}"),
    }
    // No xAgent has said hello to this process yet: the lease runs from now unless it already
    // ran while imgate was stopped.
    if let Ok(None) = app.channels.offline_since() {
        if let Err(e) = app.channels.set_offline_since(Some(ids::now_ms())) {
            log::error!("lease: {e}");
        }
    }
    let socket = internal_socket(&state_dir);
    let dispatch = match http::start(&app, &socket, front::stats::metrics) {
        Ok(d) => d,
        Err(e) => {
            log::error!("{e}");
            return ExitCode::from(1);
        }
    };
    // Every connection needs a descriptor: as many as the hard limit allows, and no more
    // connections than they carry.
    let max_connections = front::connection_limit(app.config.server.max_connections, service::raise_fd_limit());
    let names: Vec<&str> = app.providers.all().iter().map(|p| p.declaration().name).collect();
    log::info!(
        "listening on {} (connector_id {}, providers: {})",
        app.config.server.listen,
        app.connector_id,
        names.join(", ")
    );
    if app.config.server.api_key.is_none() && app.config.server.exposure().is_some() {
        // Only with allow_unauthenticated = true: the config is refused otherwise.
        log::warn!(
            "no api_key on a port other machines reach (allow_unauthenticated = true): anyone who reaches it can act as xAgent and read every message"
        );
    }
    runtime::spawn(maintenance::run(Arc::downgrade(&plane))).detach();
    app.providers.bindings_changed(&app.channels);
    let dial = app
        .config
        .xagent
        .dial
        .clone()
        .map(|url| runtime::spawn(dataplane::dial::run(plane.clone(), url)));
    if std::env::var_os("NOTIFY_SOCKET").is_some() {
        // Weak: the summary must not keep the app (and its final checkpoint) from a clean stop.
        let weak = Arc::downgrade(&app);
        let summary = move || {
            let Some(a) = weak.upgrade() else {
                return "stopping".to_string();
            };
            let xagent = match a.hub.connections() {
                0 => "not connected".to_string(),
                n => format!("connected ({n})"),
            };
            let storage = match crate::http::ops::storage(&a).up {
                true => "ok",
                false => "failing (503 storage_unavailable)",
            };
            format!(
                "listening on {}; xAgent: {xagent}; outbox: {} bytes; storage: {storage}",
                a.config.server.listen,
                a.outbox.total_bytes()
            )
        };
        runtime::spawn(service::keep_systemd_informed(service::watchdog_interval(), summary)).detach();
    }
    let prefix = http::base_path(&app);
    let listener = match smol::net::TcpListener::try_from(listener) {
        Ok(l) => l,
        Err(e) => {
            log::error!("cannot use the listener: {e}");
            return ExitCode::from(1);
        }
    };
    let tls = match &app.config.server.tls {
        None => None,
        Some(files) => match tls::ListenerTls::open(&files.cert, &files.key) {
            Ok(t) => Some(t),
            Err(e) => {
                log::error!("TLS: {e}");
                return ExitCode::from(1);
            }
        },
    };
    let on_hup = tls.clone();
    let door = front::FrontDoor::new(
        &plane,
        front::relay::Backend::new(socket.clone(), dispatch),
        prefix,
        tls,
    );
    // Listener bound, outbox open, internal HTTP server running: ready.
    service::notify("READY=1");
    let why = runtime::block_on(async {
        let per_client = app.config.server.per_client_cap(max_connections);
        // Both run as tasks, polled only when their own I/O wakes them. The future `block_on`
        // is given is polled at every wake of the executor thread, and a pending accept or
        // signal read polled again tries its syscall again (for accept, one the kernel pays
        // by allocating a socket): once per wake, thousands a second under load.
        let mut serve = runtime::spawn(async move {
            front::serve(door, listener, max_connections, per_client).await;
            "listener stopped"
        });
        // SIGHUP reads the TLS certificate again (a renewal); files are read on the pool.
        let stop = runtime::spawn(service::stop_signal(signals, move || {
            if let Some(tls) = on_hup.clone() {
                runtime::spawn_blocking(move || tls.reload());
                true
            } else {
                false
            }
        }));
        let why = (&mut serve).or(stop).await;
        // The listener closes here, before the stop begins: no connection is accepted after.
        serve.cancel().await;
        why
    });
    shutdown(plane, app, dial, why, &socket)
}

/// Graceful stop: no new connections, WebSockets closed with a close frame, requests being
/// answered are finished, then the database is closed cleanly (next start needs no repair).
fn shutdown(
    plane: Arc<dataplane::Plane>,
    app: Arc<app::App>,
    dial: Option<smol::Task<()>>,
    why: &str,
    socket: &Path,
) -> ExitCode {
    // Kept-alive connections outlive the listener: a request they bring from now on is refused,
    // so the wait below sees every request that can still reach the outbox.
    front::stop_accepting();
    log::info!("{why}: stopping");
    service::notify("STOPPING=1");
    // The outbox lives as long as the layers below the providers: its final checkpoint runs when
    // the last holder of them lets go and the drop has run, and only then is the stop clean.
    let closed = app.host.closed.watch();
    let deadline = std::time::Instant::now() + SHUTDOWN_GRACE;
    // The executor keeps running while the sessions close and the answers go out.
    runtime::block_on(async {
        drop(dial);
        app.hub.close_all("imgate is stopping");
        runtime::until(deadline, || front::requests_in_flight() == 0).await;
        app.stop();
        // Every session and task holds the plane or the app; the last one out closes the
        // database.
        runtime::until(deadline, || Arc::strong_count(&plane) == 1).await;
        drop(plane);
        runtime::until(deadline, || Arc::strong_count(&app) == 1).await;
    });
    let _ = std::fs::remove_file(socket);
    let busy = match Arc::try_unwrap(app) {
        Ok(app) => {
            let below = Arc::downgrade(&app.host);
            drop(app);
            // A provider's request or thread may still hold the layers below (a commit the
            // disk is slow to sync); the last of them drops them, checkpoint included.
            runtime::block_on(runtime::until(deadline, || closed.load(Ordering::SeqCst)));
            below.strong_count()
        }
        Err(app) => Arc::strong_count(&app) - 1,
    };
    match closed.load(Ordering::SeqCst) {
        true => log::info!("stopped cleanly"),
        false => log::warn!(
            "stopping with {} task(s) still busy, before the final checkpoint: every accepted message is on disk, and the next start replays the log",
            busy.max(1)
        ),
    }
    ExitCode::SUCCESS
}

/// systemd's default stop timeout is 90 s; the contract promises an exit within 5 s.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_millis(4500);

/// The Unix socket between the front door and tiny_http. Under systemd it lives in
/// `$RUNTIME_DIRECTORY` (a tmpfs): a bound socket pins its file system, and the state disk must be
/// free to be unmounted, repaired and mounted again while imgate answers 503. Otherwise it is in
/// the state dir when its path fits `sun_path` (108 bytes), else in the temp dir.
fn internal_socket(state_dir: &Path) -> PathBuf {
    let dir = std::env::var_os("RUNTIME_DIRECTORY")
        .map(PathBuf::from)
        .unwrap_or_else(|| state_dir.to_path_buf());
    let p = dir.join("http.sock");
    if p.as_os_str().len() < 100 {
        p
    } else {
        std::env::temp_dir().join(format!("imgate-{}.sock", std::process::id()))
    }
}

/// The version line and the providers this build carries (each is a Cargo feature).
fn version_and_providers() -> String {
    let names: Vec<&str> = providers::REGISTRATIONS.iter().map(|r| r.reader.provider).collect();
    format!("{}; providers: {}", protocol::card::version_line(), names.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_level_is_written_as_each_reader_expects() {
        let line = |format, level| log_line(format, level, "imgate::app", false, &format_args!("m"));
        for (level, priority) in [
            (log::Level::Error, 3),
            (log::Level::Warn, 4),
            (log::Level::Info, 6),
            (log::Level::Debug, 7),
            (log::Level::Trace, 7),
        ] {
            assert_eq!(line(LogFormat::Journal, level), format!("<{priority}>m"));
            assert_eq!(line(LogFormat::Syslog, level), format!("{level} m"));
        }
        let debugging = log_line(
            LogFormat::Journal,
            log::Level::Debug,
            "imgate::app",
            true,
            &format_args!("m"),
        );
        assert_eq!(debugging, "<7>imgate::app: m");
    }
}
