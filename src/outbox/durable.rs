//! How an outbox change becomes durable: the index and the write-ahead log under one lock, the
//! one `write` every change goes through, checkpoints, and replay.
//!
//! Invariants (the log's format is in `wal.rs`, the redo records in `tx.rs`):
//! - A change is applied to redb in a transaction committed with `Durability::None` (visible,
//!   not yet on disk), and its redo record is appended to the log *inside* that transaction,
//!   before the commit: nobody can see a change whose record is not in the log, and a record
//!   whose transaction did not commit is taken back (`unappend`).
//! - Every such transaction also stores its record's sequence number in `meta`
//!   (`outbox_log_applied`), so whatever redb holds durably names the last record it contains.
//! - Accepts are appended with `fdatasync` (a `202` means the record is on the disk). Deliveries,
//!   attempts and sweeps are appended without one: the next sync or checkpoint carries them, so
//!   a power cut can at worst deliver such a message once more, with the same `message_id`.
//! - A checkpoint is a redb commit with `Durability::Immediate` (which makes every earlier
//!   non-durable commit durable too); only after it returns is the log recycled from offset 0.
//!   It runs when the log holds `CHECKPOINT_BYTES`, when its oldest record is `CHECKPOINT_EVERY`
//!   old, at clean shutdown, and whenever a record does not fit (that transaction is then
//!   committed durably instead of logged).
//! - Replay (at start, and after redb was reopened, which drops non-durable commits) reads the
//!   log from offset 0, applies the records past `outbox_log_applied` in one transaction that
//!   is itself a checkpoint (none when there are none, as after a clean stop), and stops at the
//!   first unreadable record, counted and logged once.
//! - While the log or the database needs repair, the outbox refuses writes (`503`), and
//!   `recover` repairs both: it never accepts a message it could not make durable.

use std::io::BufReader;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use redb::{Durability, ReadTransaction, ReadableTable, WriteTransaction};

use super::index::Index;
use super::record;
use super::tx::{Tx, DELIVERED, MESSAGES};
use super::wal::{self, Log, NoRoom};
use super::{AcceptHook, Policy, Work};
use crate::store::{self, Db, Result, StoreError};

/// `meta` key: the last log record redb's tables contain.
const APPLIED_KEY: &str = "outbox_log_applied";
/// A checkpoint is due once the log holds this much...
const CHECKPOINT_BYTES: u64 = wal::LOG_BYTES / 4;
/// ...or its oldest record is this old. Replay after a crash is bounded by the log's size, not
/// by this; what it sets is how many messages share one checkpoint at an appliance's usual pace
/// (measured on ext4, one message a second: 98 KB per message at 500 ms, 31 KB at 5 s, 18 KB at
/// 30 s), and how long a delivery waits for a sync when no accept follows it.
const CHECKPOINT_EVERY: Duration = Duration::from_secs(30);
/// After a checkpoint failed for a reason that is not the disk, wait this long to try again.
const CHECKPOINT_RETRY: Duration = Duration::from_secs(1);

/// What replays found, for `/status`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LogReport {
    /// Records applied by replays since start.
    pub replayed: u64,
    /// Unreadable records replays stopped at (torn by a crash during their write, or corrupt).
    pub unreadable: u64,
    pub checkpoints: u64,
}

pub(super) struct State {
    pub index: Index,
    log: Log,
    /// The sequence number of the next record.
    next_seq: u64,
    /// When the oldest record since the last checkpoint was written.
    oldest: Option<Instant>,
    /// redb was (re)opened: its non-durable commits are gone, the log must be replayed.
    needs_replay: bool,
    /// The log failed: it must be checkpointed and started again.
    log_broken: bool,
    retry_checkpoint_at: Option<Instant>,
    report: LogReport,
}

impl State {
    /// Bytes of records in the log since the last checkpoint.
    #[cfg(test)]
    pub fn log_used(&self) -> u64 {
        self.log.used()
    }
}

/// The database and the in-memory index, shared with the committer thread.
pub(super) struct Shared {
    pub db: Arc<Db>,
    state: Mutex<State>,
    pub policy: Policy,
    pub on_accept: OnceLock<AcceptHook>,
    /// The committer's queue: told when the log gets its first record since a checkpoint.
    pub work: mpsc::Sender<Work>,
    /// The index's pending bytes after the last change, readable without the lock (which a
    /// commit holds through its fsync), so the executor may ask.
    pending_bytes: AtomicU64,
}

impl Shared {
    /// Replays the log left by the last run and starts the log again.
    pub fn open(db: Arc<Db>, policy: Policy, work: mpsc::Sender<Work>) -> Result<Shared> {
        let log = Log::new(db.dir());
        let shared = Shared {
            db,
            state: Mutex::new(State {
                index: Index::default(),
                log,
                next_seq: 1,
                oldest: None,
                needs_replay: true,
                log_broken: false,
                retry_checkpoint_at: None,
                report: LogReport::default(),
            }),
            policy,
            on_accept: OnceLock::new(),
            work,
            pending_bytes: AtomicU64::new(0),
        };
        shared.replay(&mut shared.lock())?;
        Ok(shared)
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tests: no timed or size-driven checkpoint from now on, so the log keeps every record.
    #[cfg(test)]
    pub fn hold_checkpoints(&self) {
        self.lock().retry_checkpoint_at = Some(Instant::now() + Duration::from_secs(3600));
    }

    pub fn report(&self) -> LogReport {
        self.lock().report
    }

    /// Bytes of pending messages in all sources, as of the last change.
    pub fn pending_bytes(&self) -> u64 {
        self.pending_bytes.load(Ordering::Relaxed)
    }

    fn publish(&self, st: &State) {
        self.pending_bytes.store(st.index.total_bytes(), Ordering::Relaxed);
    }

    /// Runs `f` in one transaction with the index, logs what it changed (synced to the disk
    /// with `sync`) and commits. On any failure the index is rebuilt from what the database
    /// really holds.
    pub fn write<T>(&self, sync: bool, f: impl FnOnce(&mut Tx, &mut Index) -> Result<T>) -> Result<T> {
        let mut guard = self.lock();
        let st = &mut *guard;
        if st.needs_replay || st.log_broken {
            return Err(StoreError::Unavailable);
        }
        // What the transaction did to the log: appended a record of this length, or (`None`
        // with `durable`) committed durably instead.
        let mut appended = None;
        let mut durable = false;
        let result = self.db.write_as(|txn| {
            let mut tx = Tx::open(txn)?;
            let v = f(&mut tx, &mut st.index)?;
            let redo = tx.into_redo();
            if redo.is_empty() {
                return Ok((v, Durability::None));
            }
            store::set_meta(txn, APPLIED_KEY, Some(&st.next_seq.to_string()))?;
            match st.log.append(st.next_seq, &redo, sync) {
                Ok(Ok(())) => {
                    appended = Some(redo.len());
                    Ok((v, Durability::None))
                }
                Ok(Err(NoRoom)) => {
                    durable = true;
                    Ok((v, Durability::Immediate))
                }
                Err(e) => {
                    // The disk under the log fails: closed like the database (which this error
                    // asks the store to reopen), so the disk can be repaired.
                    st.log.close();
                    st.log_broken = true;
                    Err(StoreError::Io(format!("{}: {e}", st.log.path().display())))
                }
            }
        });
        match &result {
            Ok(_) if durable => {
                st.next_seq += 1;
                self.restart_log(st);
            }
            Ok(_) if appended.is_some() => {
                st.next_seq += 1;
                if st.oldest.is_none() {
                    st.oldest = Some(Instant::now());
                    self.wake_committer();
                } else if st.log.used() >= CHECKPOINT_BYTES {
                    self.wake_committer();
                }
            }
            Ok(_) => {}
            Err(_) => {
                if let Some(len) = appended {
                    st.log.unappend(len);
                }
                self.recover_locked(st);
                if !st.needs_replay {
                    match self.db.read(load_index) {
                        Ok(fresh) => st.index = fresh,
                        // Rebuilt on the next failure or reopen; the outage itself is logged once.
                        Err(e) => log::debug!("outbox: cannot reload the index: {e}"),
                    }
                }
            }
        }
        self.publish(st);
        result
    }

    fn wake_committer(&self) {
        let _ = self.work.send(Work::Wake);
    }

    /// How long until a checkpoint is due (zero: now); `None` while none is needed or possible.
    pub fn checkpoint_due(&self) -> Option<Duration> {
        let st = self.lock();
        let oldest = st.oldest?;
        if st.needs_replay || st.log_broken || self.db.needs_recovery() {
            return None;
        }
        if let Some(at) = st.retry_checkpoint_at {
            return Some(at.saturating_duration_since(Instant::now()));
        }
        if st.log.used() >= CHECKPOINT_BYTES {
            return Some(Duration::ZERO);
        }
        Some(CHECKPOINT_EVERY.saturating_sub(oldest.elapsed()))
    }

    /// Makes everything durable in redb and recycles the log (also at clean shutdown).
    pub fn checkpoint(&self) {
        let mut guard = self.lock();
        let st = &mut *guard;
        if st.oldest.is_none() || st.needs_replay || st.log_broken {
            return;
        }
        match self.checkpoint_locked(st) {
            Ok(()) => st.retry_checkpoint_at = None,
            Err(e) => {
                // An I/O error is an outage (logged once by the store, repaired by `recover`).
                log::debug!("outbox: checkpoint failed: {e}");
                st.retry_checkpoint_at = Some(Instant::now() + CHECKPOINT_RETRY);
            }
        }
    }

    fn checkpoint_locked(&self, st: &mut State) -> Result<()> {
        crate::faults::crash_at("outbox-checkpoint");
        let last = st.next_seq - 1;
        self.db.write_as(|txn| {
            store::set_meta(txn, APPLIED_KEY, Some(&last.to_string()))?;
            Ok(((), Durability::Immediate))
        })?;
        crate::faults::crash_at("outbox-checkpoint-committed");
        self.restart_log(st);
        Ok(())
    }

    /// After a durable commit: the log starts again from offset 0.
    fn restart_log(&self, st: &mut State) {
        st.oldest = None;
        st.report.checkpoints += 1;
        if let Err(e) = st.log.restart() {
            log::debug!("outbox: cannot restart the log: {e}");
            st.log.close();
            st.log_broken = true;
            self.db.report_trouble();
        }
    }

    /// Whether `recover` has work to do.
    pub fn needs_recovery(&self) -> bool {
        let st = self.lock();
        st.needs_replay || st.log_broken || self.db.needs_recovery()
    }

    /// After a failing disk: reopens the database if an I/O error asked for it, then replays
    /// the log into it, or starts a broken log again after a checkpoint.
    pub fn recover(&self) {
        let mut guard = self.lock();
        self.recover_locked(&mut guard);
    }

    fn recover_locked(&self, st: &mut State) {
        if self.db.recover() {
            st.needs_replay = true;
        }
        if (st.needs_replay || st.log_broken) && !self.db.needs_recovery() {
            if let Err(e) = st.log.probe() {
                log::debug!("outbox: the log still fails: {e}");
                return;
            }
        }
        if st.needs_replay {
            if let Err(e) = self.replay(st) {
                log::debug!("outbox: replay failed: {e}");
            }
        } else if st.log_broken && !self.db.needs_recovery() {
            // redb still holds every logged change (it was not reopened): a checkpoint makes
            // them durable and the log starts again.
            st.log_broken = false;
            if let Err(e) = self.checkpoint_locked(st) {
                st.log_broken = true;
                log::debug!("outbox: checkpoint after a log error failed: {e}");
            }
        }
    }

    /// Applies the log past what redb holds durably, in one durable transaction, then starts
    /// the log again and rebuilds the index.
    fn replay(&self, st: &mut State) -> Result<()> {
        st.needs_replay = true;
        let reader = st
            .log
            .reader()
            .map_err(|e| StoreError::Io(format!("cannot read {}: {e}", st.log.path().display())))?;
        let (found, last, stopped) = self.db.write_as(|txn| {
            let applied = store::parse_u64(APPLIED_KEY, store::meta_in(txn, APPLIED_KEY)?)?.unwrap_or(0);
            let mut tx = Tx::open(txn)?;
            let (mut next, mut applied_now) = (applied + 1, 0u64);
            // Why replay stopped before the log's end, if it did.
            let mut stopped: Option<String> = None;
            let found = match reader {
                None => wal::Scanned::default(),
                Some(f) => wal::scan(&mut BufReader::new(f), wal::LOG_BYTES, |seq, payload| {
                    if seq < next || stopped.is_some() {
                        return Ok(()); // already in redb, or past a stop
                    }
                    if seq > next {
                        stopped = Some(format!("records {next} to {} are missing", seq - 1));
                        return Ok(());
                    }
                    match tx.apply(payload) {
                        Ok(()) => {
                            next += 1;
                            applied_now += 1;
                            Ok(())
                        }
                        Err(StoreError::Corrupt(why)) => {
                            stopped = Some(format!("record {seq}: {why}"));
                            Ok(())
                        }
                        Err(e) => Err(e),
                    }
                })?,
            };
            drop(tx);
            let last = next - 1;
            let unreadable = found
                .unreadable
                .map(|u| format!("the record at offset {} is unreadable ({})", u.offset, u.why));
            // Nothing past what redb holds durably (a start after a clean stop): no commit to
            // sync, and the log may start again all the same.
            if applied_now == 0 {
                return Ok(((0, last, stopped.or(unreadable)), Durability::None));
            }
            store::set_meta(txn, APPLIED_KEY, Some(&last.to_string()))?;
            Ok(((applied_now, last, stopped.or(unreadable)), Durability::Immediate))
        })?;
        crate::faults::crash_at("outbox-replayed");
        if let Some(why) = &stopped {
            st.report.unreadable += 1;
            log::warn!(
                "outbox: {}: {why}; replay stopped there ({found} record(s) replayed). A record cut by a crash during its write was never acknowledged; anything after a corrupt one is lost",
                st.log.path().display()
            );
        } else if found > 0 {
            log::info!("outbox: replayed {found} record(s) from {}", st.log.path().display());
        }
        st.report.replayed += found;
        st.next_seq = last + 1;
        st.needs_replay = false;
        st.log_broken = false;
        self.restart_log(st);
        st.index = self.db.read(load_index)?;
        self.publish(st);
        Ok(())
    }
}

/// Builds the index from the tables (startup, and after a failed commit).
pub(super) fn load_index(txn: &ReadTransaction) -> Result<Index> {
    let mut idx = Index::default();
    for row in txn.open_table(MESSAGES)?.iter()? {
        let (k, v) = row?;
        let (src, seq) = k.value();
        let value = v.value();
        match record::header(value) {
            Some(h) => {
                let hash = idx.hash(&h.message_id);
                idx.source(src)
                    .add_pending(seq, hash, h.expires_at, record::bytes(src, value));
            }
            None => log::error!("outbox: unreadable record {src}/{seq} left in place"),
        }
    }
    for row in txn.open_table(DELIVERED)?.iter()? {
        let (k, v) = row?;
        let (src, seq) = k.value();
        if let Some((exp, _, id)) = record::parse_delivered(v.value()) {
            let hash = idx.hash(id);
            idx.source(src).load_delivered(seq, hash, exp);
        }
    }
    Ok(idx)
}

/// The tables exist before anything reads them.
pub(super) fn create_tables(txn: &WriteTransaction) -> Result<()> {
    Tx::open(txn).map(drop)
}
