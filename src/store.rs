//! The one redb file under `state_dir`, behind a reopenable handle (`Db`). `read` and `write`
//! are the only way in: each runs a closure in one transaction, classifies what went wrong
//! (`StoreError`) and keeps the outage bookkeeping, so no caller needs to know redb's rules.
//!
//! Every module owns its tables and creates them when it opens (`outbox`, `channels`, `files`,
//! the data plane's tool results, a provider's own state); the store owns only `meta`, a small
//! key-value table in which each module names its own keys, and the file's `format_version`.
//!
//! Invariants:
//! - After an I/O error redb refuses every transaction until the file is opened again, so any
//!   such error flags the handle and `recover` (called by the next failed outbox write and once a
//!   second by maintenance while flagged) closes and reopens it. A reopen that fails leaves no
//!   handle: no file stays open on a failed disk, which can then be unmounted and repaired.
//! - An outage is logged once when it starts and once when it ends, not per refused write.
//! - `format_version` is written when the file is created and checked at every open: a file
//!   written by a newer imgate is refused whole, never half-read.

use crate::atomic::AtomicU64;
use redb::{Database, Durability, ReadTransaction, ReadableDatabase, ReadableTable, TableDefinition, WriteTransaction};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// The layout of the tables this build reads and writes. Raise it with any change an older
/// imgate would misread, together with a migration from the previous value.
pub const FORMAT_VERSION: u64 = 1;

/// Small values by key; each module names its keys (`connector_id`, `telegram_offset:…`).
const META: TableDefinition<&str, &str> = TableDefinition::new("meta");
const FORMAT_KEY: &str = "format_version";

/// redb's page cache; the backlog lives on disk, so a small cache keeps RSS flat. It stays full
/// once a backlog passed through (the allocator can give back only what is free): 2 MiB left a
/// drained daemon 2.6 MiB over a fresh one's idle, 512 KiB leaves it 1 MiB over, at the same
/// bytes per message on the disk and a few percent less delivery rate (tests/budgets.rs
/// `idle_memory_after_backlogs_drain`, tests/bench.rs).
const CACHE_BYTES: usize = 512 << 10;
/// A failed reopen is tried again at most this often.
const REOPEN_EVERY: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, PartialEq)]
pub enum StoreError {
    /// The disk refused a read or a write (full, read-only, failing). The file is reopened; the
    /// same operation may work later.
    Io(String),
    /// No handle right now: the file is being reopened after an I/O error.
    Unavailable,
    /// Stored data this build cannot read.
    Corrupt(String),
    /// The file was written by a newer imgate.
    NewerFormat { found: u64 },
    /// Anything else redb reports; a bug rather than a disk problem.
    Internal(String),
}

impl StoreError {
    /// The disk is the problem: callers answer `503 storage_unavailable` and try again later.
    pub fn is_outage(&self) -> bool {
        matches!(self, StoreError::Io(_) | StoreError::Unavailable)
    }
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Io(e) => write!(f, "storage I/O error: {e}"),
            StoreError::Unavailable => f.write_str("storage unavailable: the database is being reopened"),
            StoreError::Corrupt(e) => write!(f, "stored data unreadable: {e}"),
            StoreError::NewerFormat { found } => write!(
                f,
                "the database has format_version {found}, written by a newer imgate (this one reads {FORMAT_VERSION}); run the newer imgate or move the file away"
            ),
            StoreError::Internal(e) => write!(f, "storage error: {e}"),
        }
    }
}

impl<E: Into<redb::Error>> From<E> for StoreError {
    fn from(e: E) -> Self {
        match e.into() {
            redb::Error::Io(e) => StoreError::Io(e.to_string()),
            redb::Error::PreviousIo => StoreError::Io("an earlier I/O error (reopening)".into()),
            redb::Error::Corrupted(e) => StoreError::Corrupt(e),
            e => StoreError::Internal(e.to_string()),
        }
    }
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// A stored value that does not parse: the caller names what it was.
pub fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(what.to_string())
}

/// The database handle, replaceable: after an I/O error redb answers every later transaction
/// with "previous I/O error" until the file is closed and opened again, so a full SD card would
/// otherwise keep imgate refusing messages long after space came back.
pub struct Db {
    path: PathBuf,
    cell: RwLock<Option<Arc<Database>>>,
    needs_reopen: AtomicBool,
    /// Told when an I/O error asks for a reopen (maintenance waits on it).
    trouble: (smol::channel::Sender<()>, smol::channel::Receiver<()>),
    last_attempt: Mutex<Option<Instant>>,
    /// The last reopen failure, logged once: a read-only disk would otherwise log every second.
    last_failure: Mutex<String>,
    /// While writes fail: the first error and how many writes failed since.
    outage: Mutex<Option<(String, u64)>>,
    /// Commits made since start (each one is pages and two fsyncs on the SD card).
    commits: AtomicU64,
}

fn open_file(path: &Path) -> Result<Database> {
    redb::Builder::new()
        .set_cache_size(CACHE_BYTES)
        .create(path)
        .map_err(|e| match StoreError::from(e) {
            StoreError::Io(e) => StoreError::Io(format!("cannot open {}: {e}", path.display())),
            other => other,
        })
}

impl Db {
    /// Opens (or creates) `state_dir/imgate.redb` and checks its format.
    pub fn open(state_dir: &Path) -> Result<Arc<Db>> {
        std::fs::create_dir_all(state_dir)
            .map_err(|e| StoreError::Io(format!("cannot create state_dir {}: {e}", state_dir.display())))?;
        let path = state_dir.join("imgate.redb");
        let db = Arc::new(Db {
            cell: RwLock::new(Some(Arc::new(open_file(&path)?))),
            path,
            needs_reopen: AtomicBool::new(false),
            trouble: smol::channel::bounded(1),
            last_attempt: Mutex::new(None),
            last_failure: Mutex::new(String::new()),
            outage: Mutex::new(None),
            commits: AtomicU64::new(0),
        });
        db.write(|txn| {
            let mut meta = txn.open_table(META)?;
            let found = meta.get(FORMAT_KEY)?.map(|v| v.value().to_string());
            match found.map(|v| v.parse::<u64>()) {
                None => {
                    // A new file, or one from before the key existed (the same layout, 1).
                    meta.insert(FORMAT_KEY, FORMAT_VERSION.to_string().as_str())?;
                    Ok(())
                }
                Some(Ok(v)) if v <= FORMAT_VERSION => Ok(()),
                Some(Ok(found)) => Err(StoreError::NewerFormat { found }),
                Some(Err(_)) => Err(corrupt("format_version")),
            }
        })?;
        Ok(db)
    }

    fn handle(&self) -> Result<Arc<Database>> {
        self.cell
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or(StoreError::Unavailable)
    }

    /// Remembers that an I/O error needs a reopen, and says so.
    fn seen(&self, e: StoreError) -> StoreError {
        if matches!(e, StoreError::Io(_)) && !self.needs_reopen.swap(true, Ordering::SeqCst) {
            let _ = self.trouble.0.try_send(());
            crate::changed::raise();
        }
        e
    }

    /// Commits made since start, for `/metrics`.
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// Receives a notice whenever an I/O error asks for a reopen.
    pub fn trouble(&self) -> smol::channel::Receiver<()> {
        self.trouble.1.clone()
    }

    /// Wakes whoever waits on `trouble` (a failure outside the database needs repair too).
    pub fn report_trouble(&self) {
        let _ = self.trouble.0.try_send(());
    }

    /// The directory the database lives in (`state_dir`).
    pub fn dir(&self) -> &Path {
        self.path.parent().unwrap_or(Path::new("."))
    }

    /// Runs `f` in a read transaction.
    pub fn read<T>(&self, f: impl FnOnce(&ReadTransaction) -> Result<T>) -> Result<T> {
        f(&self.snapshot()?).map_err(|e| self.seen(e))
    }

    /// A read transaction to keep: what the database holds now, however it changes later.
    pub fn snapshot(&self) -> Result<ReadTransaction> {
        let run = || -> Result<ReadTransaction> { Ok(self.handle()?.begin_read()?) };
        run().map_err(|e| self.seen(e))
    }

    /// Runs `f` in `snapshot` when given, else in a read transaction begun now.
    pub fn read_in<T>(
        &self,
        snapshot: Option<&ReadTransaction>,
        f: impl FnOnce(&ReadTransaction) -> Result<T>,
    ) -> Result<T> {
        match snapshot {
            Some(txn) => f(txn).map_err(|e| self.seen(e)),
            None => self.read(f),
        }
    }

    /// Runs `f` in a write transaction committed with fsync (`Durability::Immediate`); an `Err`
    /// from `f` aborts it. Nobody may be told of a change before this returns `Ok`.
    pub fn write<T>(&self, f: impl FnOnce(&WriteTransaction) -> Result<T>) -> Result<T> {
        // A commit waits for fsync: on the executor it would stall every session and client.
        debug_assert!(!crate::runtime::on_executor(), "a commit on the async executor thread");
        let run = || -> Result<T> {
            let mut txn = self.handle()?.begin_write()?;
            let v = f(&txn)?;
            // Commits are few (the outbox's checkpoints, bindings, tool results), so each can
            // afford to save redb's allocator state: a start after a crash then skips the walk
            // over the whole file (docs/benchmarks.md has what it saves).
            txn.set_quick_repair(true);
            txn.set_durability(Durability::Immediate)?;
            txn.commit()?;
            self.commits.fetch_add(1, Ordering::Relaxed);
            Ok(v)
        };
        self.noted(run())
    }

    /// Keeps the outage bookkeeping for a write made beside the database (the outbox's log):
    /// an I/O error asks for a reopen and starts an outage, a success ends one.
    pub fn noted<T>(&self, result: Result<T>) -> Result<T> {
        let result = result.map_err(|e| self.seen(e));
        match &result {
            Ok(_) => self.write_ok(),
            Err(e) if e.is_outage() => self.write_failed(e),
            Err(_) => {}
        }
        result
    }

    /// After an I/O error: closes and reopens the file (at most once a second). True when a
    /// fresh handle is in place.
    pub fn recover(&self) -> bool {
        if !self.needs_reopen.load(Ordering::SeqCst) {
            return false;
        }
        {
            let mut last = self.last_attempt.lock().unwrap_or_else(|e| e.into_inner());
            if last.is_some_and(|t| t.elapsed() < REOPEN_EVERY) {
                return false;
            }
            *last = Some(Instant::now());
        }
        let mut cell = self.cell.write().unwrap_or_else(|e| e.into_inner());
        // No old handle when an earlier reopen failed (a disk still read-only): just try again.
        if let Some(old) = cell.take() {
            // Operations that already hold the old handle finish first (each holds it briefly).
            let deadline = Instant::now() + Duration::from_secs(2);
            while Arc::strong_count(&old) > 1 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            if Arc::strong_count(&old) > 1 {
                *cell = Some(old);
                return false;
            }
            // Closing the file lets go of the disk, so it can be unmounted and repaired.
            drop(old);
        }
        match open_file(&self.path) {
            Ok(db) => {
                self.needs_reopen.store(false, Ordering::SeqCst);
                crate::changed::raise();
                *cell = Some(Arc::new(db));
                self.last_failure.lock().unwrap_or_else(|e| e.into_inner()).clear();
                log::debug!("store: database reopened after an I/O error");
                true
            }
            Err(e) => {
                let mut last = self.last_failure.lock().unwrap_or_else(|e| e.into_inner());
                let why = e.to_string();
                if *last != why {
                    log::error!("store: cannot reopen the database: {why}; retrying every second");
                    *last = why;
                }
                false
            }
        }
    }

    /// The first error of the writes failing now (from the first failed write to the next that
    /// works), if they are.
    pub fn outage(&self) -> Option<String> {
        let outage = self.outage.lock().unwrap_or_else(|e| e.into_inner());
        outage.as_ref().map(|(first, _)| first.clone())
    }

    /// True while an I/O error waits for `recover`.
    pub fn needs_recovery(&self) -> bool {
        self.needs_reopen.load(Ordering::SeqCst)
    }

    /// A write failed on the disk: logs the start of an outage, counts the rest.
    fn write_failed(&self, e: &StoreError) {
        let mut outage = self.outage.lock().unwrap_or_else(|e| e.into_inner());
        match &mut *outage {
            None => {
                log::error!("store: writes fail: {e}; answering 503 storage_unavailable until the disk works again");
                *outage = Some((e.to_string(), 1));
                crate::changed::raise();
            }
            Some((_, n)) => {
                *n += 1;
                log::debug!("store: write failed: {e}");
            }
        }
    }

    /// A write succeeded: logs the end of an outage, if there was one. An outage of a full
    /// disk ends only once `free_to_recover` is free: an append to the preallocated log works on
    /// a disk still too full for the database to grow, and "writes work again" followed a
    /// second later by "writes fail" helps nobody.
    fn write_ok(&self) {
        let mut outage = self.outage.lock().unwrap_or_else(|e| e.into_inner());
        let Some((first, n)) = outage.as_ref() else {
            return;
        };
        if is_disk_full(first) && self.space().is_some_and(|(free, total)| free < free_to_recover(total)) {
            return;
        }
        log::warn!("store: writes work again after {n} failed write(s) (first error: {first})");
        *outage = None;
        crate::changed::raise();
    }

    /// Bytes free for imgate on the database's file system, and its size.
    fn space(&self) -> Option<(u64, u64)> {
        let dir = self.path.parent()?;
        let v = rustix::fs::statvfs(dir).ok()?;
        Some((
            v.f_bavail.saturating_mul(v.f_frsize),
            v.f_blocks.saturating_mul(v.f_frsize),
        ))
    }
}

/// Free space a full disk must have again before its outage ends (`Db::write_ok`): 1 MiB, or
/// a thirty-second of a small file system (a tenth of one is what `fit` leaves the system).
fn free_to_recover(total: u64) -> u64 {
    (total / 32).min(1 << 20)
}

/// Whether an error is the disk's (or the user's quota's) being full: ENOSPC or EDQUOT.
fn is_disk_full(error: &str) -> bool {
    let full = [rustix::io::Errno::NOSPC, rustix::io::Errno::DQUOT];
    full.iter()
        .any(|e| error.contains(&format!("(os error {})", e.raw_os_error())))
}

/// A `meta` value in a read transaction.
pub fn meta(txn: &ReadTransaction, key: &str) -> Result<Option<String>> {
    let t = txn.open_table(META)?;
    let v = t.get(key)?.map(|v| v.value().to_string());
    Ok(v)
}

/// A `meta` value inside a write transaction (read before it is changed).
pub fn meta_in(txn: &WriteTransaction, key: &str) -> Result<Option<String>> {
    let t = txn.open_table(META)?;
    let v = t.get(key)?.map(|v| v.value().to_string());
    Ok(v)
}

/// Sets (`Some`) or removes (`None`) a `meta` value.
pub fn set_meta(txn: &WriteTransaction, key: &str, value: Option<&str>) -> Result<()> {
    let mut t = txn.open_table(META)?;
    match value {
        Some(v) => t.insert(key, v)?,
        None => t.remove(key)?,
    };
    Ok(())
}

/// A number kept in `meta`; a value that is not one is `Corrupt`.
pub fn parse_u64(key: &str, v: Option<String>) -> Result<Option<u64>> {
    v.map(|v| v.parse::<u64>().map_err(|_| corrupt(key))).transpose()
}

#[cfg(test)]
pub(crate) fn temp_db(tag: &str) -> (Arc<Db>, PathBuf) {
    let dir = crate::scratch::scratch_dir(tag);
    (Db::open(&dir).unwrap(), dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_from_a_newer_imgate_is_refused_whole() {
        let (db, dir) = temp_db("format");
        db.write(|txn| set_meta(txn, FORMAT_KEY, Some("99"))).unwrap();
        drop(db);
        let err = Db::open(&dir).err().expect("refused");
        assert_eq!(err, StoreError::NewerFormat { found: 99 });
        assert!(err.to_string().contains("newer imgate"), "{err}");
    }

    #[test]
    fn a_new_file_records_this_builds_format() {
        let (db, _dir) = temp_db("format-new");
        let v = db.read(|txn| meta(txn, FORMAT_KEY)).unwrap();
        assert_eq!(v, Some(FORMAT_VERSION.to_string()));
    }

    #[test]
    fn an_error_in_the_closure_commits_nothing() {
        let (db, _dir) = temp_db("abort");
        let r: Result<()> = db.write(|txn| {
            set_meta(txn, "k", Some("v"))?;
            Err(corrupt("on purpose"))
        });
        assert!(r.is_err());
        assert_eq!(db.read(|txn| meta(txn, "k")).unwrap(), None);
    }
}
