//! How an outbox change becomes durable: the index, the overlay and the write-ahead log under
//! one lock, the one `write` every change goes through, checkpoints, and replay.
//!
//! Invariants (the log's format is in `wal.rs`, the redo records in `tx.rs`, the overlay in
//! `overlay.rs`):
//! - A change is made to the overlay (memory) and its redo record appended to the log under the
//!   same lock; nobody sees the change before its record is in the log, and a change whose
//!   record could not be logged is taken back (`Undo`). The hot path never writes redb.
//! - Accepts are appended with `fdatasync` (a `202` means the record is on the disk). Deliveries,
//!   attempts, sweeps and cursor moves are appended without one: the log holds their records in
//!   memory for the next sync (at most `wal::HOLD`, then the committer writes them and the
//!   kernel's writeback takes them to the disk), so a power cut or a crash can at worst deliver
//!   such a message once more, with the same `message_id`.
//! - A checkpoint writes the overlay into redb in one commit with `Durability::Immediate`,
//!   naming the last record it contains (`outbox_log_applied`). What was accepted and delivered
//!   since the last checkpoint is no longer in the overlay, so it never reaches redb.
//! - The log is two files (`wal::FILES`). A checkpoint due by the log's size runs on a thread of
//!   its own: the file is sealed (synced whole), appends move to the other file, and the
//!   overlay is handed to the thread and a new, empty one takes its place. Until the commit
//!   returns, reads see three layers (`Base::under`: the new overlay, the one being written,
//!   redb), and a remove of a key the one being written holds leaves `Gone`. Then the sealed
//!   file is free again. A failure loses nothing: the overlay written goes back under the new
//!   one, and the next checkpoint is made in place (the other file is not free), writes the
//!   whole overlay and frees both files, as do the checkpoints at shutdown, for a record that
//!   does not fit, and in recovery.
//! - Checkpoints run only when they pay: when the log holds `checkpoint_bytes` (which bounds
//!   the overlay's memory and replay's work), at clean shutdown (so the next start replays
//!   nothing), and when a record does not fit in the log (that change is then made durable by
//!   the checkpoint itself). No timer: an idle outbox, or one whose messages are all delivered,
//!   writes nothing more.
//! - Replay (at start) reads both files, the older first, each from offset 0, applies the
//!   records past `outbox_log_applied` to the overlay through the same `Tx` methods, then
//!   checkpoints (no commit at all when there were none, as after a clean stop). It stops at
//!   the first gap in the sequence or unreadable record not made good by the other file,
//!   counted and logged once.
//! - When the log fails, or a checkpoint cannot write redb (a full or failing disk), the outbox
//!   refuses writes (`503`) until `recover` has checkpointed the overlay and started the log
//!   again: it never accepts a message it could not make durable, and one outage is one outage
//!   (no accepts between failed checkpoints flapping the store's outage log).

use std::sync::atomic::Ordering;

use crate::atomic::AtomicU64;
use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use redb::{ReadTransaction, WriteTransaction};

use super::index::Index;
use super::overlay::{Overlay, Which};
use super::queue::Queue;
use super::record;
use super::tx::{Base, Reader, Tx};
use super::wal::{self, Log, NoRoom};
use super::{AcceptHook, Policy};
use crate::store::{self, Db, Result, StoreError};

/// `meta` key: the last log record redb's tables contain.
const APPLIED_KEY: &str = "outbox_log_applied";
/// A checkpoint is due once the log holds this much: a quarter of its file. It bounds what a
/// start after a crash replays (this plus one group, `Policy::group_bytes`; once after
/// `log_file_size` changed, the old file's whole size) and the overlay's memory; what it no
/// longer sets is a pace: at an appliance's message a second the log takes many minutes to
/// fill, and every message delivered meanwhile never reaches redb.
pub fn checkpoint_bytes(log: &Log) -> u64 {
    log.size() / 4
}
/// After a checkpoint failed for a reason that is not the disk, wait this long to try again.
const CHECKPOINT_RETRY: Duration = Duration::from_secs(1);

/// What replays and checkpoints did, for `/status` and `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LogReport {
    /// Records applied by replays since start.
    pub replayed: u64,
    /// Unreadable records replays stopped at (torn by a crash during their write, or corrupt).
    pub unreadable: u64,
    pub checkpoints: u64,
    /// Message records checkpoints wrote to redb (those still pending at their checkpoint).
    pub checkpointed_messages: u64,
    /// Bytes of records in the log since the last checkpoint.
    pub log_bytes: u64,
    /// Of those, bytes held in memory for a sync (`wal::HOLD`).
    pub held_bytes: u64,
}

pub(super) struct State {
    pub index: Index,
    overlay: Overlay,
    /// The log file appends go to.
    log: Log,
    /// The other file: it holds only records redb has (`spare_free`), or those the checkpoint
    /// in flight is writing into it.
    spare: Log,
    spare_free: bool,
    inflight: Option<Inflight>,
    /// The sequence number of the next record.
    next_seq: u64,
    /// The log failed, or a checkpoint could not write redb: writes are refused until
    /// `recover` has checkpointed and started the log again.
    stalled: bool,
    retry_checkpoint_at: Option<Instant>,
    report: LogReport,
}

/// A checkpoint running on a thread of its own: the overlay it writes into redb (reads see it
/// under the new one, through `Base::under`), and where its outcome arrives.
struct Inflight {
    writing: Arc<Overlay>,
    done: Receiver<Result<()>>,
    /// redb as the checkpoint found it, for every read until it ends: a read begun meanwhile
    /// would wait for the checkpoint's disk syncs whenever its commit grows the file (redb
    /// syncs the longer file under the lock a read begins with), and hold up every accept with
    /// it. `None` if it could not be taken: reads then begin their own.
    base: Option<ReadTransaction>,
}

impl Inflight {
    /// The layers a read sees under the overlay: what is being written, and redb under it.
    fn layers(inflight: Option<&Inflight>) -> (Option<&Overlay>, Option<&ReadTransaction>) {
        (inflight.map(|i| &*i.writing), inflight.and_then(|i| i.base.as_ref()))
    }
}

impl State {
    /// Bytes of records in the log since the last checkpoint.
    #[cfg(test)]
    pub fn log_used(&self) -> u64 {
        self.log.used()
    }
}

/// The database, the overlay and the in-memory index, shared with the committer thread.
pub(super) struct Shared {
    pub db: Arc<Db>,
    state: Mutex<State>,
    pub policy: Policy,
    pub on_accept: OnceLock<AcceptHook>,
    /// The committer's queue: told when the log needs upkeep (a checkpoint, held records).
    pub queue: Arc<Queue>,
    /// The index's pending bytes after the last change, readable without the lock (which a
    /// commit holds through its fsync), so the executor may ask.
    pending_bytes: AtomicU64,
    /// Tests: held, a checkpoint in flight waits before it writes; `true` in it, it fails.
    #[cfg(test)]
    pub checkpoint_gate: Arc<Mutex<bool>>,
}

impl Shared {
    /// Replays the log left by the last run and starts the log again.
    pub fn open(db: Arc<Db>, policy: Policy, queue: Arc<Queue>) -> Result<Shared> {
        let [log, spare] = wal::FILES.map(|name| Log::new(db.dir().join(name), policy.log_file_bytes));
        let shared = Shared {
            db,
            state: Mutex::new(State {
                index: Index::default(),
                overlay: Overlay::default(),
                log,
                spare,
                spare_free: true,
                inflight: None,
                next_seq: 1,
                stalled: false,
                retry_checkpoint_at: None,
                report: LogReport::default(),
            }),
            policy,
            on_accept: OnceLock::new(),
            queue,
            pending_bytes: AtomicU64::new(0),
            #[cfg(test)]
            checkpoint_gate: Arc::default(),
        };
        shared.replay(&mut shared.lock())?;
        Ok(shared)
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tests: no size-driven checkpoint from now on, so the log keeps every record.
    #[cfg(test)]
    pub fn hold_checkpoints(&self) {
        self.lock().retry_checkpoint_at = Some(Instant::now() + Duration::from_secs(3600));
    }

    /// Tests: the held log records written, as `wal::HOLD` after the last would.
    #[cfg(test)]
    pub fn flush_log(&self) {
        self.lock().log.flush().unwrap();
    }

    /// Tests: whether a checkpoint runs on its own thread now.
    #[cfg(test)]
    pub fn checkpoint_in_flight(&self) -> bool {
        self.lock().inflight.is_some()
    }

    /// Tests: message records the overlay holds (what the next checkpoint would write).
    #[cfg(test)]
    pub fn overlay_messages(&self) -> u64 {
        self.lock().overlay.message_puts()
    }

    pub fn report(&self) -> LogReport {
        let st = self.lock();
        LogReport {
            log_bytes: st.log.used(),
            held_bytes: st.log.held(),
            ..st.report
        }
    }

    /// Bytes of pending messages in all sources, as of the last change.
    pub fn pending_bytes(&self) -> u64 {
        self.pending_bytes.load(Ordering::Relaxed)
    }

    fn publish(&self, st: &State) {
        self.pending_bytes.store(st.index.total_bytes(), Ordering::Relaxed);
    }

    /// Runs `f` over what the outbox holds now (the overlay over redb), with the index.
    pub fn view<T>(&self, f: impl FnOnce(&Reader, &mut Index) -> Result<T>) -> Result<T> {
        let mut guard = self.lock();
        let st = &mut *guard;
        let (writing, snapshot) = Inflight::layers(st.inflight.as_ref());
        let (overlay, index) = (&st.overlay, &mut st.index);
        self.db.read_in(snapshot, |txn| {
            let base = Base::under(txn, writing);
            f(&Reader::new(&base, overlay), index)
        })
    }

    /// Runs `f` in one transaction with the index and logs what it changed (synced to the disk
    /// with `sync`). On any failure the change is taken back and the index rebuilt.
    pub fn write<T>(&self, sync: bool, f: impl FnOnce(&mut Tx, &mut Index) -> Result<T>) -> Result<T> {
        let mut guard = self.lock();
        let st = &mut *guard;
        if st.stalled {
            return Err(StoreError::Unavailable);
        }
        let result = self.write_locked(st, sync, f);
        if result.is_err() {
            let (writing, snapshot) = Inflight::layers(st.inflight.as_ref());
            let fresh = self.db.read_in(snapshot, |txn| {
                load_index(&Reader::new(&Base::under(txn, writing), &st.overlay))
            });
            match fresh {
                Ok(fresh) => st.index.reload(fresh),
                // Rebuilt on the next failure; the outage itself is logged once.
                Err(e) => log::debug!("outbox: cannot reload the index: {e}"),
            }
        }
        self.publish(st);
        match result {
            // Nothing changed, so nothing reached the disk: no news about an outage.
            Ok((v, false)) => Ok(v),
            Ok((v, true)) => self.db.noted(Ok(v)),
            Err(e) => self.db.noted(Err(e)),
        }
    }

    /// The change's value, and whether it wrote anything.
    fn write_locked<T>(
        &self,
        st: &mut State,
        sync: bool,
        f: impl FnOnce(&mut Tx, &mut Index) -> Result<T>,
    ) -> Result<(T, bool)> {
        let (writing, snapshot) = Inflight::layers(st.inflight.as_ref());
        let (overlay, index) = (&mut st.overlay, &mut st.index);
        let (out, redo, undo) = self.db.read_in(snapshot, |txn| {
            let base = Base::under(txn, writing);
            let mut tx = Tx::new(&base, overlay);
            let out = f(&mut tx, index);
            let (redo, undo) = tx.finish();
            Ok((out, redo, undo))
        })?;
        let v = match out {
            Ok(v) => v,
            Err(e) => {
                st.overlay.undo(undo);
                return Err(e);
            }
        };
        if redo.is_empty() {
            return Ok((v, false));
        }
        let held_before = st.log.held_until().is_some();
        match st.log.append(st.next_seq, &redo, sync) {
            Ok(Ok(())) => {
                st.next_seq += 1;
                // Upkeep has news: a checkpoint is due, or held records start their wait.
                // (One in flight wakes the committer itself when it ends.)
                let due = st.inflight.is_none() && st.log.used() >= checkpoint_bytes(&st.log);
                if due || (!held_before && st.log.held_until().is_some()) {
                    self.queue.wake();
                }
                Ok((v, true))
            }
            // Too large for the log: the checkpoint makes it durable instead.
            Ok(Err(NoRoom)) => match self.checkpoint_locked(st, st.next_seq) {
                Ok(()) => {
                    st.next_seq += 1;
                    Ok((v, true))
                }
                Err(e) => {
                    st.overlay.undo(undo);
                    if e.is_outage() {
                        self.stall(st);
                    }
                    Err(e)
                }
            },
            Err(e) => {
                // The disk under the log fails: closed (so the disk can be repaired) until
                // `recover` checkpoints and starts it again.
                st.overlay.undo(undo);
                Err(self.close_log(st, &e))
            }
        }
    }

    /// How long until `upkeep` has work (zero: now): a checkpoint, or held log records to
    /// write; `None` while there is none, or none is possible.
    pub fn upkeep_due(&self) -> Option<Duration> {
        let st = self.lock();
        if st.stalled || self.db.needs_recovery() {
            return None;
        }
        let now = Instant::now();
        [Self::checkpoint_at(&st, now), st.log.held_until()]
            .into_iter()
            .flatten()
            .min()
            .map(|at| at.saturating_duration_since(now))
    }

    /// When the next checkpoint is due: once the log holds `checkpoint_bytes`, or when a
    /// failed one is retried (not before, however full the log); never while one is in flight
    /// (its end wakes the committer).
    fn checkpoint_at(st: &State, now: Instant) -> Option<Instant> {
        match st.retry_checkpoint_at {
            _ if st.inflight.is_some() => None,
            Some(at) => Some(at),
            None => (st.log.used() >= checkpoint_bytes(&st.log)).then_some(now),
        }
    }

    /// Does what `upkeep_due` says is due now (a checkpoint, or writing the held log records),
    /// and takes in the outcome of a checkpoint in flight that has ended.
    pub fn upkeep(&self) {
        let now = Instant::now();
        let due = |at: Option<Instant>| at.is_some_and(|at| at <= now);
        let mut guard = self.lock();
        let st = &mut *guard;
        self.settle(st, false);
        if due(Self::checkpoint_at(st, now)) {
            return self.start_checkpoint(st);
        }
        if due(st.log.held_until()) {
            if let Err(e) = st.log.flush() {
                self.log_failed(st, &e);
            }
        }
    }

    /// The disk under the log fails: the log is closed (so the disk can be repaired) and
    /// writes wait until `recover` checkpoints the overlay and starts it again.
    fn log_failed(&self, st: &mut State, e: &std::io::Error) {
        let error = self.close_log(st, e);
        // The outage's bookkeeping (logged once, recovery woken), as for a failed append.
        let _ = self.db.noted::<()>(Err(error));
    }

    /// Writes wait for `recover`, which is woken now: a stall the database did not see (the
    /// reopen it waits for was under way, or the log failed) must not wait for the next sweep.
    fn stall(&self, st: &mut State) {
        st.stalled = true;
        crate::changed::raise();
        self.db.report_trouble();
    }

    /// Closes both files, so nothing of the outbox holds the failing disk.
    fn close_log(&self, st: &mut State, e: &std::io::Error) -> StoreError {
        st.log.close();
        st.spare.close();
        self.stall(st);
        StoreError::Io(format!("{}: {e}", st.log.path().display()))
    }

    /// Starts a checkpoint on a thread of its own, so that accepts go on meanwhile: the log is
    /// sealed, appends move to the other file, and the overlay is handed to the thread (reads
    /// see it under the new, empty one until `settle` hears the commit returned). When the other
    /// file still holds records redb lacks (the last checkpoint failed), the checkpoint is made
    /// here instead.
    fn start_checkpoint(&self, st: &mut State) {
        if !st.spare_free || st.stalled {
            return self.checkpoint_here(st);
        }
        crate::faults::crash_at("outbox-checkpoint");
        if let Err(e) = st.log.seal() {
            return self.log_failed(st, &e);
        }
        // The other file is readied first: when it cannot be (a full disk), nothing has moved
        // yet, and the checkpoint is made here with the one file.
        if let Err(e) = st.spare.restart() {
            log::debug!("outbox: cannot ready {}: {e}", st.spare.path().display());
            st.spare.close();
            return self.checkpoint_here(st);
        }
        let last = st.next_seq - 1;
        // Taken before the checkpoint's write begins: redb as of the last checkpoint, the layer
        // under what this one writes.
        let base = match self.db.snapshot() {
            Ok(txn) => Some(txn),
            Err(e) => {
                log::debug!("outbox: no snapshot for the checkpoint's reads: {e}");
                None
            }
        };
        let writing = Arc::new(std::mem::take(&mut st.overlay));
        std::mem::swap(&mut st.log, &mut st.spare);
        st.spare_free = false;
        let (tell, done) = mpsc::sync_channel(1);
        let (db, queue, written) = (self.db.clone(), self.queue.clone(), writing.clone());
        #[cfg(test)]
        let gate = self.checkpoint_gate.clone();
        let spawned = std::thread::Builder::new()
            .name("outbox-checkpoint".into())
            .spawn(move || {
                #[cfg(test)]
                if *gate.lock().unwrap_or_else(|e| e.into_inner()) {
                    let _ = tell.send(Err(StoreError::Internal("failed by the test".into())));
                    return queue.wake();
                }
                let _ = tell.send(write_checkpoint(&db, &written, last));
                queue.wake();
            });
        // Without the thread its sender is gone: `settle` counts a failed checkpoint, and the
        // next one is made on the committer's thread.
        if let Err(e) = spawned {
            log::debug!("outbox: cannot start a checkpoint thread: {e}");
        }
        st.inflight = Some(Inflight { writing, done, base });
    }

    /// Takes in the outcome of the checkpoint in flight, once it has one (waiting for it with
    /// `wait`): a failure is retried, or is an outage `recover` ends.
    fn settle(&self, st: &mut State, wait: bool) {
        match self.end_inflight(st, wait) {
            // An outage (logged once by the store): writes wait until `recover` has checkpointed.
            Some(Err(e)) if e.is_outage() => self.stall(st),
            Some(Err(e)) => {
                log::debug!("outbox: checkpoint failed: {e}");
                st.retry_checkpoint_at = Some(Instant::now() + CHECKPOINT_RETRY);
            }
            Some(Ok(())) | None => {}
        }
    }

    /// The outcome of the checkpoint in flight, once it has one. On success what it wrote is
    /// redb's and the other file is free; on failure its overlay goes back under the overlay,
    /// and the next checkpoint (made on the committer's thread, as the other file still holds
    /// records redb lacks) writes it all.
    fn end_inflight(&self, st: &mut State, wait: bool) -> Option<Result<()>> {
        let inflight = st.inflight.as_ref()?;
        let outcome = match wait {
            true => inflight.done.recv().map_err(|_| TryRecvError::Disconnected),
            false => inflight.done.try_recv(),
        };
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(TryRecvError::Empty) => return None,
            Err(TryRecvError::Disconnected) => {
                Err(StoreError::Internal("the checkpoint thread gave no outcome".into()))
            }
        };
        let done = st.inflight.take()?;
        match &outcome {
            Ok(()) => {
                st.report.checkpoints += 1;
                st.report.checkpointed_messages += done.writing.message_puts();
                st.spare_free = true;
                st.retry_checkpoint_at = None;
            }
            Err(_) => st.overlay.absorb(&done.writing),
        }
        Some(outcome)
    }

    /// Writes what the log holds into redb and recycles the log, here and now (at clean
    /// shutdown, after the checkpoint in flight); nothing when nothing was logged since.
    pub fn checkpoint(&self) {
        let mut guard = self.lock();
        let st = &mut *guard;
        self.settle(st, true);
        self.checkpoint_here(st);
    }

    fn checkpoint_here(&self, st: &mut State) {
        if (st.log.used() == 0 && st.spare_free) || st.stalled {
            return;
        }
        let last = st.next_seq - 1;
        match self.checkpoint_locked(st, last) {
            Ok(()) => st.retry_checkpoint_at = None,
            // An outage (logged once by the store): writes wait until `recover` has checkpointed.
            Err(e) if e.is_outage() => self.stall(st),
            Err(e) => {
                log::debug!("outbox: checkpoint failed: {e}");
                st.retry_checkpoint_at = Some(Instant::now() + CHECKPOINT_RETRY);
            }
        }
    }

    /// One durable commit of the overlay on this thread (after the checkpoint in flight),
    /// naming `last` as the last record it contains; then the overlay is empty, both files hold
    /// only what redb has, and the log starts again.
    fn checkpoint_locked(&self, st: &mut State, last: u64) -> Result<()> {
        // Whether it failed does not matter: the overlay holds all it wrote, and more.
        if let Some(Err(e)) = self.end_inflight(st, true) {
            log::debug!("outbox: checkpoint failed: {e}");
        }
        crate::faults::crash_at("outbox-checkpoint");
        write_checkpoint(&self.db, &st.overlay, last)?;
        st.report.checkpointed_messages += st.overlay.message_puts();
        st.overlay = Overlay::default();
        st.spare_free = true;
        self.restart_log(st);
        Ok(())
    }

    /// After a checkpoint: the log starts again from offset 0.
    fn restart_log(&self, st: &mut State) {
        st.report.checkpoints += 1;
        if let Err(e) = st.log.restart() {
            log::debug!("outbox: cannot restart the log: {e}");
            st.log.close();
            st.spare.close();
            self.stall(st);
        }
    }

    /// Whether `recover` has work to do.
    pub fn needs_recovery(&self) -> bool {
        self.lock().stalled || self.db.needs_recovery()
    }

    /// After a failing disk: reopens the database if an I/O error asked for it (it holds only
    /// checkpoints, so a reopen loses nothing), then checkpoints what the overlay holds and
    /// starts the log again.
    pub fn recover(&self) {
        let mut guard = self.lock();
        let st = &mut *guard;
        self.db.recover();
        if !st.stalled || self.db.needs_recovery() {
            return;
        }
        if let Err(e) = st.log.probe() {
            log::debug!("outbox: the log still fails: {e}");
            return;
        }
        st.stalled = false;
        let last = st.next_seq - 1;
        if let Err(e) = self.checkpoint_locked(st, last) {
            st.stalled = true;
            log::debug!("outbox: checkpoint after a log error failed: {e}");
        }
        crate::changed::raise();
    }

    /// Applies the log past what redb holds to the overlay (both files, the older first: the
    /// records of one follow on from the other's, or are all in redb already), checkpoints it,
    /// starts the log again and builds the index.
    fn replay(&self, st: &mut State) -> Result<()> {
        let mut files = Vec::new();
        for log in [&st.log, &st.spare] {
            let reader = log
                .reader()
                .map_err(|e| StoreError::Io(format!("cannot read {}: {e}", log.path().display())))?;
            if let Some(f) = reader {
                files.push((wal::first_seq(&f), log.path().display().to_string(), f));
            }
        }
        // A file without a readable first record comes last: a torn first write is the newest.
        files.sort_by_key(|(first, _, _)| (first.is_none(), *first));
        let overlay = &mut st.overlay;
        let replayed = self.db.read(|txn| {
            let applied = store::parse_u64(APPLIED_KEY, store::meta(txn, APPLIED_KEY)?)?.unwrap_or(0);
            let base = Base::new(txn);
            let mut tx = Tx::new(&base, overlay);
            let (mut next, mut applied_now) = (applied + 1, 0u64);
            // Why replay stopped before the log's end, if it did.
            let mut stopped: Option<String> = None;
            let mut unreadable: Option<String> = None;
            for (_, path, f) in &files {
                let before = applied_now;
                let found = wal::scan(f, wal::replay_capacity(f), |seq, payload| {
                    if seq < next || stopped.is_some() {
                        return Ok(()); // already in redb, or past a stop
                    }
                    if seq > next {
                        stopped = Some(format!("{path}: records {next} to {} are missing", seq - 1));
                        return Ok(());
                    }
                    match tx.apply(payload) {
                        Ok(()) => {
                            next += 1;
                            applied_now += 1;
                            Ok(())
                        }
                        Err(StoreError::Corrupt(why)) => {
                            stopped = Some(format!("{path}: record {seq}: {why}"));
                            Ok(())
                        }
                        Err(e) => Err(e),
                    }
                })?;
                if applied_now > before {
                    unreadable = None; // this file went on where the older one stopped
                }
                if let Some(u) = found.unreadable {
                    unreadable = Some(format!(
                        "{path}: the record at offset {} is unreadable ({})",
                        u.offset, u.why
                    ));
                }
            }
            Ok((applied_now, next - 1, stopped.or(unreadable)))
        });
        let (found, last, stopped) = match replayed {
            Ok(r) => r,
            Err(e) => {
                st.overlay = Overlay::default();
                return Err(e);
            }
        };
        if let Some(why) = &stopped {
            st.report.unreadable += 1;
            log::warn!(
                "outbox: {why}; replay stopped there ({found} record(s) replayed). A record cut by a crash during its write was never acknowledged; anything after a corrupt one is lost"
            );
        } else if found > 0 {
            log::info!("outbox: replayed {found} record(s) from the log");
        }
        st.report.replayed += found;
        st.next_seq = last + 1;
        if found > 0 {
            let result = self.checkpoint_locked(st, last);
            crate::faults::crash_at("outbox-replayed");
            if let Err(e) = result {
                st.overlay = Overlay::default();
                return Err(e);
            }
        } else {
            // Nothing past what redb holds (a start after a clean stop): no commit to sync.
            self.restart_log(st);
        }
        // Appends start in the first file. What the other holds is all in redb now, numbered
        // below anything appended next, so it is left as it is; except after a stop at a
        // missing or unreadable record, when it may hold records numbered past it: then it is
        // cleared. At the first start it is made (its zeros written once, like the first's);
        // one that cannot be made (a full disk) leaves checkpoints in place until it can be.
        let existed = st.spare.path().exists();
        if stopped.is_some() || !existed {
            if let Err(e) = st.spare.clear() {
                let path = st.spare.path().display();
                if existed {
                    return Err(StoreError::Io(format!("cannot clear {path}: {e}")));
                }
                log::warn!("outbox: cannot make {path}: {e}; checkpoints are made in place until it can be");
                st.spare.close();
            }
        }
        let fresh = self
            .db
            .read(|txn| load_index(&Reader::new(&Base::new(txn), &st.overlay)))?;
        st.index.reload(fresh);
        self.publish(st);
        Ok(())
    }
}

/// One durable redb commit of `overlay`, naming `last` as the last log record redb contains.
fn write_checkpoint(db: &Db, overlay: &Overlay, last: u64) -> Result<()> {
    db.write(|txn| {
        overlay.write_to(txn)?;
        store::set_meta(txn, APPLIED_KEY, Some(&last.to_string()))?;
        // A crash inside the commit: redb keeps the last checkpoint whole.
        crate::faults::crash_at("outbox-checkpoint-writing");
        Ok(())
    })?;
    crate::faults::crash_at("outbox-checkpoint-committed");
    Ok(())
}

/// Builds the index from what the outbox holds (startup, and after a failed change).
pub(super) fn load_index(read: &Reader) -> Result<Index> {
    let mut idx = Index::default();
    read.all_seq(Which::Messages, |src, seq, value| {
        match record::header(value) {
            Some(h) => {
                let hash = idx.hash(&h.message_id);
                idx.source(src).add_pending(seq, hash, record::bytes(src, value));
            }
            None => log::error!("outbox: unreadable record {src}/{seq} left in place"),
        }
        true
    })?;
    read.all_seq(Which::Delivered, |src, seq, value| {
        if let Some((exp, _, id)) = record::parse_delivered(value) {
            let hash = idx.hash(id);
            idx.source(src).load_delivered(seq, hash, exp);
        }
        true
    })?;
    Ok(idx)
}

/// The tables exist before anything reads them.
pub(super) fn create_tables(txn: &WriteTransaction) -> Result<()> {
    use super::tables::{COUNTERS, DELIVERED, MESSAGES, REPLY_REFS};
    txn.open_table(MESSAGES)?;
    txn.open_table(DELIVERED)?;
    txn.open_table(COUNTERS)?;
    txn.open_table(REPLY_REFS)?;
    Ok(())
}
