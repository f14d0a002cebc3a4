//! `/metrics` in Prometheus' text format, the way its tools check it (`promtool check
//! metrics`): every family has its `# HELP` and `# TYPE` lines before its samples, a counter's
//! name ends in `_total` and no other's does, units are in the name (`_bytes`, `_seconds`).
//! Every part of imgate writes its families through here; `process` adds the standard
//! `process_*` families from `/proc/self`.

use std::fmt::Display;
use std::sync::OnceLock;

/// One family with one sample and no labels: name, `counter` or `gauge`, help, value.
pub type Single<'a> = (&'a str, &'a str, &'a str, u64);

/// A family's `# HELP` and `# TYPE` lines; its samples follow.
pub fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
}

/// A family of one sample.
pub fn single(out: &mut String, name: &str, kind: &str, help: &str, value: impl Display) {
    family(out, name, kind, help);
    out.push_str(&format!("{name} {value}\n"));
}

/// A counter kept where it counts, with its family's name and help beside it.
pub struct Counter {
    name: &'static str,
    help: &'static str,
    count: crate::atomic::AtomicU64,
}

impl Counter {
    /// `name` ends in `_total`.
    pub const fn new(name: &'static str, help: &'static str) -> Counter {
        Counter {
            name,
            help,
            count: crate::atomic::AtomicU64::new(0),
        }
    }

    pub fn add(&self, n: u64) {
        self.count.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.count.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The families of `counters`.
pub fn counters(out: &mut String, counters: &[&Counter]) {
    for c in counters {
        single(out, c.name, "counter", c.help, c.get());
    }
}

/// Families of one sample each.
pub fn singles(out: &mut String, families: &[Single]) {
    for (name, kind, help, value) in families {
        single(out, name, kind, help, value);
    }
}

/// When the process started (Unix seconds): set once, at the start of `run`.
static STARTED: OnceLock<u64> = OnceLock::new();

pub fn mark_start() {
    let _ = STARTED.set(crate::ids::now_ms() / 1000);
}

/// When the process started (unix seconds), once `mark_start` ran.
pub fn started_at() -> Option<u64> {
    STARTED.get().copied()
}

/// Linux's `USER_HZ`: `/proc` counts CPU time in these ticks on every architecture.
const TICKS_PER_SECOND: f64 = 100.0;

/// The standard process families: resident memory, open file descriptors, CPU time and the
/// start time. A figure `/proc/self` does not give (another OS, a hardened `/proc`) is left out.
pub fn process(out: &mut String) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let rss_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
    if let Some(kib) = rss_kib {
        let help = "Resident memory size in bytes.";
        single(
            out,
            "process_resident_memory_bytes",
            "gauge",
            help,
            kib.saturating_mul(1024),
        );
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        // The directory's own descriptor, open while it is read, is not imgate's.
        let open = fds.count().saturating_sub(1);
        single(
            out,
            "process_open_fds",
            "gauge",
            "Number of open file descriptors.",
            open,
        );
    }
    if let Some(ticks) = cpu_ticks(&std::fs::read_to_string("/proc/self/stat").unwrap_or_default()) {
        let help = "Total user and system CPU time spent in seconds.";
        let seconds = ticks as f64 / TICKS_PER_SECOND;
        single(
            out,
            "process_cpu_seconds_total",
            "counter",
            help,
            format!("{seconds:.2}"),
        );
    }
    if let Some(started) = STARTED.get() {
        let help = "Start time of the process since unix epoch in seconds.";
        single(out, "process_start_time_seconds", "gauge", help, started);
    }
}

/// User plus system CPU ticks from `/proc/self/stat` (fields 14 and 15, counted after the
/// command's closing parenthesis: the command may hold spaces).
fn cpu_ticks(stat: &str) -> Option<u64> {
    let after = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // After the command: field 3 (state) is index 0, so fields 14 and 15 are 11 and 12.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime.saturating_add(stime))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_carry_help_and_type_before_their_samples() {
        let mut out = String::new();
        singles(
            &mut out,
            &[
                ("imgate_x_total", "counter", "Things.", 3),
                ("imgate_y", "gauge", "Level.", 1),
            ],
        );
        assert_eq!(
            out,
            "# HELP imgate_x_total Things.\n# TYPE imgate_x_total counter\nimgate_x_total 3\n\
             # HELP imgate_y Level.\n# TYPE imgate_y gauge\nimgate_y 1\n"
        );
    }

    #[test]
    fn process_figures_come_from_proc_self() {
        assert_eq!(cpu_ticks("42 (im gate) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0"), Some(300));
        assert_eq!(cpu_ticks("42 (x) S 1"), None);
        assert_eq!(cpu_ticks("no parenthesis"), None);
        mark_start();
        let mut out = String::new();
        process(&mut out);
        for name in [
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_cpu_seconds_total",
            "process_start_time_seconds",
        ] {
            assert!(out.contains(&format!("# TYPE {name} ")), "{name}: {out}");
        }
    }
}
