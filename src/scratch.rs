//! Scratch directories for tests: the lib's, and the integration tests' (which include this
//! file by its path). Each lies under one directory of the test process's own,
//! `imgate-test-<pid>` in the system's temp dir; the first one a process makes removes the
//! directories of test processes that have ended. So runs do not pile up state dirs, and what
//! a failed run left behind stays to be looked at until the next one.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Once;

const PREFIX: &str = "imgate-test-";

/// A new, empty directory named after `tag`.
pub fn scratch_dir(tag: &str) -> PathBuf {
    static SWEEP: Once = Once::new();
    static MADE: AtomicU32 = AtomicU32::new(0);
    let tmp = std::env::temp_dir();
    SWEEP.call_once(|| sweep(&tmp));
    let n = MADE.fetch_add(1, Ordering::Relaxed);
    let dir = tmp
        .join(format!("{PREFIX}{}", std::process::id()))
        .join(format!("{tag}-{n}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("cannot make {}: {e}", dir.display()));
    dir
}

/// Removes the directories of test processes that no longer run.
fn sweep(tmp: &Path) {
    let Ok(entries) = std::fs::read_dir(tmp) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(PREFIX)) else {
            continue;
        };
        if pid.parse::<u32>().is_ok() && !Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}
