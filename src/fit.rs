//! The disk caps fitted to the state file system, at start: a router's overlay of a few MiB
//! cannot hold the defaults (a 64 MiB queue whose database grows to about 2.5 times that, a
//! 256 MiB file cache, two 2 MiB log files). Rather than fill the flash and fail at 3 a.m., imgate
//! says so once at start (and in `imgate check`) and uses caps the file system can hold.
//!
//! The room is what is free plus what imgate's own files take already (they are reused), less
//! a tenth left for the rest of the system. The queue's and the file cache's totals shrink in
//! proportion until the database, the two log files and the cache fit in it; the per-channel
//! and per-file caps never exceed their totals.

use std::path::Path;

use crate::config::{approx_size as approx, fmt_size, Config};
use crate::outbox::wal;

/// A state file system smaller than this, or with less room than `SMALL_ROOM`, gets the small
/// log files unless `log_file_size` is set.
const SMALL_FILE_SYSTEM: u64 = 256 << 20;
const SMALL_ROOM: u64 = 64 << 20;
/// What the database takes besides the messages: its header, tables and free pages.
const DB_BASE: u64 = 1 << 20;
/// The database of a full queue, as the month-like run measured it (2 to 2.5 times the
/// queue's bytes: pages kept for readers, the overlay's checkpoints).
const fn db_need(queue_total: u64) -> u64 {
    queue_total.saturating_mul(5) / 2
}
/// The smallest totals imgate goes down to: below them it would refuse most messages.
const MIN_QUEUE: u64 = 1 << 20;
const MIN_CACHE: u64 = 1 << 20;

/// The state file system as measured at start.
#[derive(Clone, Copy, Debug)]
pub struct Room {
    /// Its size.
    pub total: u64,
    /// Free for imgate (what an unprivileged writer may use).
    pub free: u64,
    /// What imgate's files in the state dir take now (database, logs, file cache).
    pub held: u64,
    /// The database's and the logs' part of `held`: every pending message is in one of them,
    /// so a queue cap this large drops nothing already accepted.
    pub stored: u64,
}

/// Measures the file system of `state_dir` (or of its nearest existing parent, before the
/// first start made it). `None` when it cannot be asked.
pub fn measure(state_dir: &Path) -> Option<Room> {
    // A relative state_dir's last ancestor is "": the working directory.
    let existing = state_dir
        .ancestors()
        .map(|p| if p.as_os_str().is_empty() { Path::new(".") } else { p })
        .find(|p| p.exists())?;
    let v = rustix::fs::statvfs(existing).ok()?;
    let stored = ["imgate.redb", wal::FILES[0], wal::FILES[1]]
        .iter()
        .map(|f| file_bytes(&state_dir.join(f)))
        .fold(0u64, u64::saturating_add);
    Some(Room {
        total: v.f_blocks.saturating_mul(v.f_frsize),
        free: v.f_bavail.saturating_mul(v.f_frsize),
        held: stored.saturating_add(tree_bytes(&state_dir.join("files"), 2)),
        stored,
    })
}

fn file_bytes(p: &Path) -> u64 {
    std::fs::symlink_metadata(p).map_or(0, |m| if m.is_file() { m.len() } else { 0 })
}

/// The bytes of the regular files under `dir`, `depth` levels down at most (the file cache is
/// a directory of files; a bound on the walk keeps a start quick whatever lies there).
fn tree_bytes(dir: &Path, depth: u32) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut sum = 0u64;
    for e in entries.flatten().take(100_000) {
        let Ok(m) = e.metadata() else { continue };
        if m.is_file() {
            sum = sum.saturating_add(m.len());
        } else if m.is_dir() && depth > 0 {
            sum = sum.saturating_add(tree_bytes(&e.path(), depth - 1));
        }
    }
    sum
}

/// Sets the log files' size (when the config leaves it to imgate) and lowers the caps that do
/// not fit `room`; the warning to give when any cap was lowered.
pub fn fit(cfg: &mut Config, room: Room) -> Option<String> {
    let budget = room.free.saturating_add(room.held) / 10 * 9;
    let small = room.total < SMALL_FILE_SYSTEM || budget < SMALL_ROOM;
    let log = *cfg
        .queue
        .log_file_size
        .get_or_insert(if small { wal::SMALL_LOG_BYTES } else { wal::LOG_BYTES });
    let (queue, cache) = (cfg.queue.max_bytes_total, cfg.files.max_bytes_total);
    let fixed = log.saturating_mul(2).saturating_add(DB_BASE);
    let need = fixed.saturating_add(db_need(queue)).saturating_add(cache);
    if need <= budget {
        return None;
    }
    // Both totals shrink by the same factor: what is left after the fixed part, over what
    // they would take.
    let left = u128::from(budget.saturating_sub(fixed));
    let wanted = u128::from(db_need(queue)) + u128::from(cache);
    let scaled = |v: u64, min: u64| ((u128::from(v) * left / wanted.max(1)) as u64).clamp(min.min(v), v);
    // Never below what may be pending already: a cap lowered at a restart would evict
    // messages the senders were told were accepted.
    let (new_queue, new_cache) = (
        scaled(queue, MIN_QUEUE).max(room.stored.min(queue)),
        scaled(cache, MIN_CACHE),
    );
    cfg.queue.max_bytes_total = new_queue;
    cfg.queue.max_bytes_per_channel = cfg.queue.max_bytes_per_channel.min(new_queue);
    cfg.files.max_bytes_total = new_cache;
    cfg.files.max_file_bytes = cfg.files.max_file_bytes.min(new_cache);
    let short = match fixed.saturating_add(db_need(new_queue)).saturating_add(new_cache) > budget {
        true => " (even these do not fit: free space on it, or move state_dir to a larger disk)",
        false => "",
    };
    Some(format!(
        "state_dir {}: its file system has room for {} ({} free plus {} in imgate's own files, less a tenth for the system), \
         but the caps need {} (a queue of {} in a database of up to {}, a file cache of {}, two log files of {}); \
         using [queue] max_bytes_total = {} and [files] max_bytes_total = {} instead{short}. \
         Set these (or smaller) in the config to silence this",
        cfg.server.state_dir.display(),
        approx(budget),
        approx(room.free),
        approx(room.held),
        approx(need),
        fmt_size(queue),
        approx(db_need(queue).saturating_add(DB_BASE)),
        fmt_size(cache),
        fmt_size(log),
        approx_down(new_queue),
        approx_down(new_cache),
    ))
}

/// A size the config accepts, at most `b`: whole KiB.
fn approx_down(b: u64) -> String {
    format!("{}KiB", b >> 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        crate::config::parse("", "t", None, &[]).unwrap()
    }

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_large_disk_changes_nothing_and_gets_the_large_log() {
        let mut c = config();
        let before = (c.queue.max_bytes_total, c.files.max_bytes_total);
        let room = Room {
            total: 32 << 30,
            free: 20 << 30,
            held: 0,
            stored: 0,
        };
        assert_eq!(fit(&mut c, room), None);
        assert_eq!((c.queue.max_bytes_total, c.files.max_bytes_total), before);
        assert_eq!(c.queue.log_file_size, Some(wal::LOG_BYTES));
    }

    #[test]
    fn a_small_overlay_gets_caps_that_fit_and_small_logs() {
        let mut c = config();
        let room = Room {
            total: 24 * MIB,
            free: 12 * MIB,
            held: 0,
            stored: 0,
        };
        let warning = fit(&mut c, room).expect("the defaults do not fit 12 MiB");
        assert_eq!(c.queue.log_file_size, Some(wal::SMALL_LOG_BYTES));
        let need = 2 * wal::SMALL_LOG_BYTES + DB_BASE + db_need(c.queue.max_bytes_total) + c.files.max_bytes_total;
        assert!(need <= 12 * MIB / 10 * 9, "{need}");
        assert!(c.queue.max_bytes_total >= MIN_QUEUE && c.files.max_bytes_total >= MIN_CACHE);
        assert!(c.queue.max_bytes_per_channel <= c.queue.max_bytes_total);
        assert!(c.files.max_file_bytes <= c.files.max_bytes_total);
        // The ratio of the two totals is kept (64 MiB : 256 MiB).
        let ratio = c.files.max_bytes_total as f64 / c.queue.max_bytes_total as f64;
        assert!((3.9..4.1).contains(&ratio), "{ratio}");
        assert!(
            warning.contains("but the caps need ") && warning.contains("[queue] max_bytes_total = "),
            "{warning}"
        );
        assert!(!warning.contains("even these"), "{warning}");
    }

    #[test]
    fn what_imgate_holds_counts_as_room_and_a_set_log_size_is_kept() {
        let mut c = config();
        c.queue.log_file_size = Some(wal::LOG_BYTES);
        let room = Room {
            total: 100 * MIB,
            free: 10 * MIB,
            held: 90 * MIB,
            stored: 0,
        };
        fit(&mut c, room).expect("the defaults need about 420 MiB");
        assert_eq!(c.queue.log_file_size, Some(wal::LOG_BYTES));
        let need = 2 * wal::LOG_BYTES + DB_BASE + db_need(c.queue.max_bytes_total) + c.files.max_bytes_total;
        assert!(need <= 100 * MIB / 10 * 9 && need > 80 * MIB, "{need}");
    }

    #[test]
    fn a_disk_with_no_room_gets_the_least_and_says_it_is_not_enough() {
        let mut c = config();
        let room = Room {
            total: 8 * MIB,
            free: 0,
            held: 0,
            stored: 0,
        };
        let warning = fit(&mut c, room).unwrap();
        assert_eq!(
            (c.queue.max_bytes_total, c.files.max_bytes_total),
            (MIN_QUEUE, MIN_CACHE)
        );
        assert!(warning.contains("even these do not fit"), "{warning}");
    }

    #[test]
    fn what_may_be_pending_is_never_cut() {
        let mut c = config();
        let room = Room {
            total: 100 * MIB,
            free: MIB,
            held: 30 * MIB,
            stored: 30 * MIB,
        };
        fit(&mut c, room).unwrap();
        assert_eq!(
            c.queue.max_bytes_total,
            30 * MIB,
            "all that the database and the logs hold"
        );
    }

    #[test]
    fn a_large_disk_nearly_full_gets_the_small_logs() {
        let mut c = config();
        let room = Room {
            total: 32 << 30,
            free: 20 * MIB,
            held: 0,
            stored: 0,
        };
        fit(&mut c, room);
        assert_eq!(c.queue.log_file_size, Some(wal::SMALL_LOG_BYTES));
    }

    #[test]
    fn the_state_dir_is_measured_before_it_exists() {
        let dir = crate::scratch::scratch_dir("fit");
        let room = measure(&dir.join("not/yet")).unwrap();
        assert!(room.total > 0 && room.held == 0);
        assert!(
            measure(Path::new("imgate-data-not-yet")).is_some(),
            "a relative state_dir"
        );
        std::fs::create_dir_all(dir.join("files/ab")).unwrap();
        std::fs::write(dir.join("files/ab/x"), vec![0u8; 5000]).unwrap();
        std::fs::write(dir.join("imgate.redb"), vec![0u8; 3000]).unwrap();
        let room = measure(&dir).unwrap();
        assert_eq!((room.held, room.stored), (8000, 3000));
    }
}
