//! Credentials given in an auth form (a bot token, an app secret) kept as files of their own
//! under `state_dir`, mode 0600, written through a temporary file and fsync: never in the
//! database, a packet or a log line. A credential no binding uses any more is deleted.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

/// The credential files of one provider: `{dir}/{prefix}{id}{suffix}`.
pub struct KeyFiles {
    pub dir: PathBuf,
    pub prefix: &'static str,
    pub suffix: &'static str,
}

impl KeyFiles {
    /// The files `{dir}/{prefix}{id}{suffix}`.
    pub fn new(dir: PathBuf, prefix: &'static str, suffix: &'static str) -> KeyFiles {
        KeyFiles { dir, prefix, suffix }
    }

    /// `id` must be safe as a file name (the provider checked it: digits, or letters, digits
    /// and `_`).
    pub fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{}{id}{}", self.prefix, self.suffix))
    }

    pub fn read(&self, id: &str) -> Option<String> {
        std::fs::read_to_string(self.path(id))
            .ok()
            .map(|t| t.trim().to_string())
    }

    pub fn store(&self, id: &str, value: &str) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        let path = self.path(id);
        let tmp = path.with_extension("tmp");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(value.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(tmp, path)
    }

    /// Deletes the files of every ID not in `in_use`; `what` names them in the log.
    pub fn forget_unused(&self, in_use: &[String], what: &str) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let id = name.strip_prefix(self.prefix).and_then(|n| n.strip_suffix(self.suffix));
            if let Some(id) = id.filter(|id| !in_use.iter().any(|u| u == id)) {
                let _ = std::fs::remove_file(e.path());
                log::info!("{what} {id} forgotten (no binding uses it)");
            }
        }
    }
}
