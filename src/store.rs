//! The one redb file under `state_dir`: connector identity, channels and their bindings,
//! reply references and tool-call results. The outbox (`crate::outbox`) shares the database.
//!
//! Invariants:
//! - A source (`webhook:NAME`, later `telegram:…`) is bound to at most one channel, and a channel
//!   to at most one source; `CHANNELS.source` and `BINDINGS` always agree (one transaction).
//! - Every write commits with redb's default durability (fsync) before anyone is told it happened.

use miniserde::{Deserialize, Serialize};
use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::ids;

pub(crate) const META: TableDefinition<&str, &str> = TableDefinition::new("meta");
/// META key: how many channels lease expiries have unregistered (for /status and /metrics).
const LEASE_UNREGISTERED: &str = "lease_unregistered_channels";
pub(crate) const CHANNELS: TableDefinition<&str, &str> = TableDefinition::new("channels");
pub(crate) const BINDINGS: TableDefinition<&str, &str> = TableDefinition::new("bindings");
pub(crate) const REPLY_REFS: TableDefinition<&str, &str> = TableDefinition::new("reply_refs");
pub(crate) const TOOL_CALLS: TableDefinition<&str, &str> = TableDefinition::new("tool_calls");

/// redb's page cache; the backlog lives on disk, so a small cache keeps RSS flat.
const CACHE_BYTES: usize = 2 << 20;

#[derive(Debug)]
pub struct StoreError(pub String);

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl<E: Into<redb::Error>> From<E> for StoreError {
    fn from(e: E) -> Self {
        let e = e.into();
        if matches!(e, redb::Error::Io(_) | redb::Error::PreviousIo) {
            // redb refuses every transaction after an I/O error until the file is reopened.
            NEEDS_REOPEN.store(true, Ordering::SeqCst);
        }
        StoreError(e.to_string())
    }
}

/// Set by any I/O error (a full or read-only disk); `Db::recover` then reopens the file.
static NEEDS_REOPEN: AtomicBool = AtomicBool::new(false);

/// The database handle, replaceable: after an I/O error redb answers every later transaction
/// with "previous I/O error" until the file is closed and opened again, so a full SD card would
/// otherwise keep imgate refusing messages long after space came back.
pub(crate) struct Db {
    path: PathBuf,
    cell: RwLock<Option<Arc<Database>>>,
    last_attempt: Mutex<Option<Instant>>,
    /// The last reopen failure, logged once: a read-only disk would otherwise log every second.
    last_failure: Mutex<String>,
    /// While writes fail: the first error and how many writes failed since. Only the start and
    /// the end of an outage are logged, not every refused message in between.
    outage: Mutex<Option<(String, u64)>>,
}

impl Db {
    /// The current handle. Callers take it once per operation and drop it at the end.
    pub fn get(&self) -> Result<Arc<Database>> {
        self.cell
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| StoreError("the database is being reopened".into()))
    }

    /// After an I/O error: closes and reopens the file (at most once a second). True when a
    /// fresh handle is in place.
    pub fn recover(&self) -> bool {
        if !NEEDS_REOPEN.load(Ordering::SeqCst) {
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
        match open_db(&self.path) {
            Ok(db) => {
                NEEDS_REOPEN.store(false, Ordering::SeqCst);
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

    /// A write failed: logs the start of an outage, counts the rest.
    pub fn write_failed(&self, e: &StoreError) {
        let mut outage = self.outage.lock().unwrap_or_else(|e| e.into_inner());
        match &mut *outage {
            None => {
                log::error!("store: writes fail: {e}; answering 503 storage_unavailable until the disk works again");
                *outage = Some((e.0.clone(), 1));
            }
            Some((_, n)) => {
                *n += 1;
                log::debug!("store: write failed: {e}");
            }
        }
    }

    /// A write succeeded: logs the end of an outage, if there was one.
    pub fn write_ok(&self) {
        let mut outage = self.outage.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((first, n)) = outage.take() {
            log::warn!("store: writes work again after {n} failed write(s) (first error: {first})");
        }
    }
}

const REOPEN_EVERY: Duration = Duration::from_secs(1);

fn open_db(path: &Path) -> Result<Database> {
    redb::Builder::new()
        .set_cache_size(CACHE_BYTES)
        .create(path)
        .map_err(|e| StoreError(format!("cannot open {}: {e}", path.display())))
}

pub type Result<T> = std::result::Result<T, StoreError>;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct ChannelRecord {
    /// The bound source, e.g. `webhook:alerts`; `None` until an auth flow succeeds.
    pub source: Option<String>,
    pub created_at: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct ReplyRef {
    pub source: String,
    pub message_id: String,
    pub expires_at: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug)]
struct ToolCall {
    result: String,
    expires_at: u64,
}

pub struct Store {
    pub(crate) db: Arc<Db>,
    pub(crate) outbox: std::sync::Arc<crate::outbox::Shared>,
    pub(crate) committer: crate::outbox::Committer,
}

impl Store {
    /// After a disk that was full or read-only: reopens the file if an I/O error asked for it.
    pub fn recover(&self) -> bool {
        self.db.recover()
    }

    /// Opens (or creates) `state_dir/imgate.redb` and makes sure every table exists.
    pub fn open(state_dir: &Path) -> Result<Store> {
        std::fs::create_dir_all(state_dir)
            .map_err(|e| StoreError(format!("cannot create state_dir {}: {e}", state_dir.display())))?;
        let path = state_dir.join("imgate.redb");
        let db = open_db(&path)?;
        let txn = db.begin_write()?;
        {
            txn.open_table(META)?;
            txn.open_table(CHANNELS)?;
            txn.open_table(BINDINGS)?;
            txn.open_table(REPLY_REFS)?;
            txn.open_table(TOOL_CALLS)?;
            txn.open_table(crate::providers::telegram::TG_CHATS)?;
            txn.open_table(crate::files::FILES)?;
            crate::outbox::create_tables(&txn)?;
        }
        txn.commit()?;
        let db = Arc::new(Db {
            path,
            cell: RwLock::new(Some(Arc::new(db))),
            last_attempt: Mutex::new(None),
            last_failure: Mutex::new(String::new()),
            outage: Mutex::new(None),
        });
        let (outbox, committer) = Store::start_outbox(db.clone())?;
        Ok(Store { db, outbox, committer })
    }

    /// The persistent `connector_id`, created on first use and then never changed.
    pub fn connector_id(&self) -> Result<String> {
        if let Some(id) = self.db.get()?.begin_read()?.open_table(META)?.get("connector_id")? {
            return Ok(id.value().to_string());
        }
        let txn = self.db.get()?.begin_write()?;
        let id = {
            let mut t = txn.open_table(META)?;
            let existing = t.get("connector_id")?.map(|v| v.value().to_string());
            match existing {
                Some(id) => id,
                None => {
                    let id = format!("conn_im_imgate_{}", ids::random_hex(8));
                    t.insert("connector_id", id.as_str())?;
                    id
                }
            }
        };
        txn.commit()?;
        Ok(id)
    }

    pub fn channel(&self, cch: &str) -> Result<Option<ChannelRecord>> {
        let t = self.db.get()?.begin_read()?.open_table(CHANNELS)?;
        let rec = t.get(cch)?.and_then(|v| miniserde::json::from_str(v.value()).ok());
        Ok(rec)
    }

    pub fn channels(&self) -> Result<Vec<(String, ChannelRecord)>> {
        let t = self.db.get()?.begin_read()?.open_table(CHANNELS)?;
        let mut out = Vec::new();
        for row in t.iter()? {
            let (k, v) = row?;
            if let Ok(rec) = miniserde::json::from_str(v.value()) {
                out.push((k.value().to_string(), rec));
            }
        }
        Ok(out)
    }

    /// `channel.open`: reuses a known channel, otherwise creates and persists a new one.
    /// Returns the channel ID, its record and whether it was reused.
    pub fn open_channel(&self, requested: Option<&str>) -> Result<(String, ChannelRecord, bool)> {
        if let Some(cch) = requested {
            if let Some(rec) = self.channel(cch)? {
                return Ok((cch.to_string(), rec, true));
            }
        }
        let cch = ids::token("cch_");
        let rec = ChannelRecord {
            source: None,
            created_at: ids::now_ms(),
        };
        let txn = self.db.get()?.begin_write()?;
        txn.open_table(CHANNELS)?
            .insert(cch.as_str(), miniserde::json::to_string(&rec).as_str())?;
        txn.commit()?;
        Ok((cch, rec, false))
    }

    /// Binds `cch` to `source`. A source has one channel: the previous holder (returned) loses it.
    pub fn bind(&self, cch: &str, source: &str) -> Result<Option<String>> {
        let txn = self.db.get()?.begin_write()?;
        let previous = {
            let mut channels = txn.open_table(CHANNELS)?;
            let mut bindings = txn.open_table(BINDINGS)?;
            let previous = bindings.get(source)?.map(|v| v.value().to_string());
            let previous = previous.filter(|p| p != cch);
            if let Some(p) = &previous {
                set_source(&mut channels, p, None)?;
            }
            // This channel's old source, if any, is released.
            let old = get_record(&channels, cch)?.and_then(|r| r.source);
            if let Some(old) = old.filter(|o| o != source) {
                bindings.remove(old.as_str())?;
            }
            set_source(&mut channels, cch, Some(source))?;
            bindings.insert(source, cch)?;
            previous
        };
        txn.commit()?;
        Ok(previous)
    }

    /// A provider's consumer cursor (e.g. a Telegram update offset).
    pub fn cursor(&self, key: &str) -> Result<Option<u64>> {
        let t = self.db.get()?.begin_read()?.open_table(META)?;
        let v = t.get(key)?.and_then(|v| v.value().parse().ok());
        Ok(v)
    }

    /// Moves a cursor forward (never back).
    pub fn set_cursor(&self, key: &str, value: u64) -> Result<()> {
        let txn = self.db.get()?.begin_write()?;
        {
            let mut t = txn.open_table(META)?;
            let current: u64 = t.get(key)?.and_then(|v| v.value().parse().ok()).unwrap_or(0);
            if value > current {
                t.insert(key, value.to_string().as_str())?;
            }
        }
        txn.commit()?;
        Ok(())
    }

    /// Since when no data plane has completed hello (`None` while one is connected).
    pub fn offline_since(&self) -> Result<Option<u64>> {
        self.meta_u64("offline_since")
    }

    /// Channels unregistered by lease expiries, over the device's life.
    pub fn lease_unregistered(&self) -> Result<u64> {
        Ok(self.meta_u64(LEASE_UNREGISTERED)?.unwrap_or(0))
    }

    fn meta_u64(&self, key: &str) -> Result<Option<u64>> {
        let t = self.db.get()?.begin_read()?.open_table(META)?;
        let v = t.get(key)?.and_then(|v| v.value().parse().ok());
        Ok(v)
    }

    pub fn set_offline_since(&self, since: Option<u64>) -> Result<()> {
        let txn = self.db.get()?.begin_write()?;
        {
            let mut t = txn.open_table(META)?;
            match since {
                Some(ms) => t.insert("offline_since", ms.to_string().as_str())?,
                None => t.remove("offline_since")?,
            };
        }
        txn.commit()?;
        Ok(())
    }

    /// When no xAgent has completed hello for `lease_ms`, unregisters every channel and binding
    /// (their pending messages stay, unbound, under the same TTL) and ends the lease. Returns how
    /// many channels went, `None` while the lease runs. One transaction, so a hello recorded at
    /// the same moment is never overtaken.
    pub fn expire_lease(&self, now: u64, lease_ms: u64) -> Result<Option<usize>> {
        let txn = self.db.get()?.begin_write()?;
        let gone = {
            let mut meta = txn.open_table(META)?;
            let since: Option<u64> = meta.get("offline_since")?.and_then(|v| v.value().parse().ok());
            match since {
                Some(s) if now >= s.saturating_add(lease_ms) => {
                    meta.remove("offline_since")?;
                    let mut channels = txn.open_table(CHANNELS)?;
                    let n = channels.len()? as usize;
                    let before: u64 = meta
                        .get(LEASE_UNREGISTERED)?
                        .and_then(|v| v.value().parse().ok())
                        .unwrap_or(0);
                    meta.insert(LEASE_UNREGISTERED, (before + n as u64).to_string().as_str())?;
                    channels.retain(|_, _| false)?;
                    txn.open_table(BINDINGS)?.retain(|_, _| false)?;
                    Some(n)
                }
                _ => None,
            }
        };
        match gone {
            Some(_) => txn.commit()?,
            None => txn.abort()?,
        }
        Ok(gone)
    }

    /// `auth.logout`: forgets the channel's binding; returns the source it had.
    pub fn unbind(&self, cch: &str) -> Result<Option<String>> {
        let txn = self.db.get()?.begin_write()?;
        let old = {
            let mut channels = txn.open_table(CHANNELS)?;
            let mut bindings = txn.open_table(BINDINGS)?;
            let old = get_record(&channels, cch)?.and_then(|r| r.source);
            if let Some(src) = &old {
                bindings.remove(src.as_str())?;
                set_source(&mut channels, cch, None)?;
            }
            old
        };
        txn.commit()?;
        Ok(old)
    }

    /// The channel bound to `source`, if any.
    pub fn bound_channel(&self, source: &str) -> Result<Option<String>> {
        let t = self.db.get()?.begin_read()?.open_table(BINDINGS)?;
        let v = t.get(source)?.map(|v| v.value().to_string());
        Ok(v)
    }

    pub fn reply_ref(&self, reference: &str) -> Result<Option<ReplyRef>> {
        let t = self.db.get()?.begin_read()?.open_table(REPLY_REFS)?;
        let v = t
            .get(reference)?
            .and_then(|v| miniserde::json::from_str(v.value()).ok());
        Ok(v)
    }

    /// The stored result of a tool call already made with this `tool_call_id`.
    pub fn tool_result(&self, call_id: &str) -> Result<Option<String>> {
        let t = self.db.get()?.begin_read()?.open_table(TOOL_CALLS)?;
        let rec: Option<ToolCall> = t.get(call_id)?.and_then(|v| miniserde::json::from_str(v.value()).ok());
        Ok(rec.filter(|r| r.expires_at > ids::now_ms()).map(|r| r.result))
    }

    pub fn save_tool_result(&self, call_id: &str, result: &str, expires_at: u64) -> Result<()> {
        let rec = ToolCall {
            result: result.to_string(),
            expires_at,
        };
        let txn = self.db.get()?.begin_write()?;
        txn.open_table(TOOL_CALLS)?
            .insert(call_id, miniserde::json::to_string(&rec).as_str())?;
        txn.commit()?;
        Ok(())
    }

    /// Drops reply references and tool-call results past their expiry; returns how many.
    pub fn sweep_refs(&self, now: u64) -> Result<u64> {
        let txn = self.db.get()?.begin_write()?;
        let mut n = 0;
        {
            let mut refs = txn.open_table(REPLY_REFS)?;
            refs.retain(|_, v| {
                let keep = miniserde::json::from_str::<ReplyRef>(v).is_ok_and(|r| r.expires_at > now);
                n += u64::from(!keep);
                keep
            })?;
            let mut calls = txn.open_table(TOOL_CALLS)?;
            calls.retain(|_, v| {
                let keep = miniserde::json::from_str::<ToolCall>(v).is_ok_and(|r| r.expires_at > now);
                n += u64::from(!keep);
                keep
            })?;
        }
        txn.commit()?;
        Ok(n)
    }
}

fn get_record(t: &redb::Table<&str, &str>, cch: &str) -> Result<Option<ChannelRecord>> {
    Ok(t.get(cch)?.and_then(|v| miniserde::json::from_str(v.value()).ok()))
}

fn set_source(t: &mut redb::Table<&str, &str>, cch: &str, source: Option<&str>) -> Result<()> {
    let mut rec = get_record(t, cch)?.unwrap_or(ChannelRecord {
        source: None,
        created_at: ids::now_ms(),
    });
    rec.source = source.map(str::to_string);
    t.insert(cch, miniserde::json::to_string(&rec).as_str())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_store(tag: &str) -> (Store, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("imgate-store-{tag}-{}", ids::random_hex(4)));
        (Store::open(&dir).unwrap(), dir)
    }

    #[test]
    fn connector_id_survives_reopen() {
        let (s, dir) = temp_store("cid");
        let id = s.connector_id().unwrap();
        drop(s);
        let s = Store::open(&dir).unwrap();
        assert_eq!(s.connector_id().unwrap(), id);
    }

    #[test]
    fn binding_a_source_moves_it_from_the_previous_channel() {
        let (s, _dir) = temp_store("bind");
        let (a, _, _) = s.open_channel(None).unwrap();
        let (b, _, _) = s.open_channel(None).unwrap();
        assert_eq!(s.bind(&a, "webhook:x").unwrap(), None);
        assert_eq!(s.bind(&b, "webhook:x").unwrap(), Some(a.clone()));
        assert_eq!(s.channel(&a).unwrap().unwrap().source, None);
        assert_eq!(s.bound_channel("webhook:x").unwrap(), Some(b.clone()));
        assert_eq!(s.unbind(&b).unwrap().as_deref(), Some("webhook:x"));
        assert_eq!(s.bound_channel("webhook:x").unwrap(), None);
    }

    #[test]
    fn open_channel_reuses_known_ids_and_replaces_unknown_ones() {
        let (s, _dir) = temp_store("open");
        let (a, _, reused) = s.open_channel(None).unwrap();
        assert!(!reused);
        let (again, _, reused) = s.open_channel(Some(&a)).unwrap();
        assert!(reused && again == a);
        let (fresh, _, reused) = s.open_channel(Some("cch_unknown")).unwrap();
        assert!(!reused && fresh != "cch_unknown");
    }
}
