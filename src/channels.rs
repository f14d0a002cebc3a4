//! What xAgent registered with this device: the persistent `connector_id`, the channels, the
//! binding of each channel to a source, and the `connector_id` lease.
//!
//! Invariants:
//! - A source is bound to at most one channel, and a channel to at most one source;
//!   `channels.source` and `bindings` always agree (one transaction changes both).
//! - The lease (common protocol 8.2) starts when the last session that completed hello ends (or
//!   at startup) and is persisted; one transaction checks and expires it, so a hello recorded at
//!   the same moment is never overtaken.

use std::sync::Arc;

use miniserde::{Deserialize, Serialize};
use redb::{ReadableTable, ReadableTableMetadata, TableDefinition};

use crate::ids;
use crate::source::Source;
use crate::store::{self, corrupt, Db, Result};

/// channel ID → `ChannelRecord` JSON.
const CHANNELS: TableDefinition<&str, &str> = TableDefinition::new("channels");
/// source → channel ID.
const BINDINGS: TableDefinition<&str, &str> = TableDefinition::new("bindings");

/// Channels kept at most: past it a new channel is refused (a peer that opens channels without
/// end cannot grow the store without end); opening a known one still works.
pub const MAX_CHANNELS: u64 = 1024;
const CONNECTOR_ID: &str = "connector_id";
const OFFLINE_SINCE: &str = "offline_since";
/// How many channels lease expiries have unregistered (for /status and /metrics).
const LEASE_UNREGISTERED: &str = "lease_unregistered_channels";

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct ChannelRecord {
    /// The bound source, e.g. `webhook:alerts`; `None` until an auth flow succeeds.
    pub source: Option<String>,
    pub created_at: u64,
}

impl ChannelRecord {
    /// The bound source, if the stored one is well formed.
    pub fn source(&self) -> Option<Source> {
        self.source.as_deref().and_then(Source::parse)
    }
}

pub struct Channels {
    db: Arc<Db>,
}

fn decode(cch: &str, v: &str) -> Result<ChannelRecord> {
    miniserde::json::from_str(v).map_err(|_| corrupt(&format!("channel record {cch}")))
}

fn get_record(t: &impl ReadableTable<&'static str, &'static str>, cch: &str) -> Result<Option<ChannelRecord>> {
    t.get(cch)?.map(|v| decode(cch, v.value())).transpose()
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

impl Channels {
    pub fn open(db: Arc<Db>) -> Result<Channels> {
        db.write(|txn| {
            txn.open_table(CHANNELS)?;
            txn.open_table(BINDINGS)?;
            Ok(())
        })?;
        Ok(Channels { db })
    }

    /// The persistent `connector_id`, created on first use and then never changed.
    pub fn connector_id(&self) -> Result<String> {
        if let Some(id) = self.db.read(|txn| store::meta(txn, CONNECTOR_ID))? {
            return Ok(id);
        }
        self.db.write(|txn| match store::meta_in(txn, CONNECTOR_ID)? {
            Some(id) => Ok(id),
            None => {
                let id = format!("conn_im_imgate_{}", ids::random_hex(8));
                store::set_meta(txn, CONNECTOR_ID, Some(&id))?;
                Ok(id)
            }
        })
    }

    pub fn channel(&self, cch: &str) -> Result<Option<ChannelRecord>> {
        self.db.read(|txn| get_record(&txn.open_table(CHANNELS)?, cch))
    }

    pub fn channels(&self) -> Result<Vec<(String, ChannelRecord)>> {
        self.db.read(|txn| {
            let mut out = Vec::new();
            for row in txn.open_table(CHANNELS)?.iter()? {
                let (k, v) = row?;
                out.push((k.value().to_string(), decode(k.value(), v.value())?));
            }
            Ok(out)
        })
    }

    /// Every bound source.
    pub fn bound_sources(&self) -> Result<Vec<Source>> {
        self.db.read(|txn| {
            let mut out = Vec::new();
            for row in txn.open_table(BINDINGS)?.iter()? {
                let (k, _) = row?;
                out.extend(Source::parse(k.value()));
            }
            Ok(out)
        })
    }

    /// `channel.open`: reuses a known channel, otherwise creates and persists a new one.
    /// Returns the channel ID and whether it was reused; `None` when a new one would pass
    /// `MAX_CHANNELS`.
    pub fn open_channel(&self, requested: Option<&str>) -> Result<Option<(String, bool)>> {
        if let Some(cch) = requested {
            if self.channel(cch)?.is_some() {
                return Ok(Some((cch.to_string(), true)));
            }
        }
        let cch = ids::token("cch_");
        let rec = ChannelRecord {
            source: None,
            created_at: ids::now_ms(),
        };
        let made = self.db.write(|txn| {
            let mut t = txn.open_table(CHANNELS)?;
            if t.len()? >= MAX_CHANNELS {
                return Ok(false);
            }
            t.insert(cch.as_str(), miniserde::json::to_string(&rec).as_str())?;
            Ok(true)
        })?;
        Ok(made.then_some((cch, false)))
    }

    /// Binds `cch` to `source`. A source has one channel: the previous holder (returned) loses it.
    pub fn bind(&self, cch: &str, source: &Source) -> Result<Option<String>> {
        let source = source.as_str();
        self.db.write(|txn| {
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
            Ok(previous)
        })
    }

    /// `auth.logout`: forgets the channel's binding; returns the source it had.
    pub fn unbind(&self, cch: &str) -> Result<Option<String>> {
        self.db.write(|txn| {
            let mut channels = txn.open_table(CHANNELS)?;
            let mut bindings = txn.open_table(BINDINGS)?;
            let old = get_record(&channels, cch)?.and_then(|r| r.source);
            if let Some(src) = &old {
                bindings.remove(src.as_str())?;
                set_source(&mut channels, cch, None)?;
            }
            Ok(old)
        })
    }

    /// The channel bound to `source`, if any.
    pub fn bound_channel(&self, source: &str) -> Result<Option<String>> {
        self.db.read(|txn| {
            let v = txn.open_table(BINDINGS)?.get(source)?.map(|v| v.value().to_string());
            Ok(v)
        })
    }

    /// Since when no data plane has completed hello (`None` while one is connected).
    pub fn offline_since(&self) -> Result<Option<u64>> {
        self.db
            .read(|txn| store::parse_u64(OFFLINE_SINCE, store::meta(txn, OFFLINE_SINCE)?))
    }

    pub fn set_offline_since(&self, since: Option<u64>) -> Result<()> {
        let v = since.map(|ms| ms.to_string());
        self.db.write(|txn| store::set_meta(txn, OFFLINE_SINCE, v.as_deref()))
    }

    /// Channels unregistered by lease expiries, over the device's life.
    pub fn lease_unregistered(&self) -> Result<u64> {
        let n = self
            .db
            .read(|txn| store::parse_u64(LEASE_UNREGISTERED, store::meta(txn, LEASE_UNREGISTERED)?))?;
        Ok(n.unwrap_or(0))
    }

    /// When no xAgent has completed hello for `lease_ms`, unregisters every channel and binding
    /// (their pending messages stay, unbound, under the same TTL) and ends the lease. Returns how
    /// many channels went, `None` while the lease runs.
    pub fn expire_lease(&self, now: u64, lease_ms: u64) -> Result<Option<usize>> {
        let due = |since: Option<u64>| since.is_some_and(|s| now >= s.saturating_add(lease_ms));
        // Most checks find the lease running: answered by a read, no commit.
        if !due(self.offline_since()?) {
            return Ok(None);
        }
        self.db.write(|txn| {
            let since = store::parse_u64(OFFLINE_SINCE, store::meta_in(txn, OFFLINE_SINCE)?)?;
            if !due(since) {
                return Ok(None); // a hello came in between: an empty commit, nothing expires
            }
            store::set_meta(txn, OFFLINE_SINCE, None)?;
            let mut channels = txn.open_table(CHANNELS)?;
            let n = channels.len()? as usize;
            let before = store::parse_u64(LEASE_UNREGISTERED, store::meta_in(txn, LEASE_UNREGISTERED)?)?;
            let total = (before.unwrap_or(0) + n as u64).to_string();
            store::set_meta(txn, LEASE_UNREGISTERED, Some(&total))?;
            channels.retain(|_, _| false)?;
            txn.open_table(BINDINGS)?.retain(|_, _| false)?;
            Ok(Some(n))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn channels(tag: &str) -> (Channels, std::path::PathBuf) {
        let (db, dir) = store::temp_db(tag);
        (Channels::open(db).unwrap(), dir)
    }

    #[test]
    fn connector_id_survives_reopen() {
        let (c, dir) = channels("cid");
        let id = c.connector_id().unwrap();
        drop(c);
        let c = Channels::open(Db::open(&dir).unwrap()).unwrap();
        assert_eq!(c.connector_id().unwrap(), id);
    }

    #[test]
    fn binding_a_source_moves_it_from_the_previous_channel() {
        let (c, _dir) = channels("bind");
        let x = Source::new("hook", "x");
        let (a, _) = c.open_channel(None).unwrap().unwrap();
        let (b, _) = c.open_channel(None).unwrap().unwrap();
        assert_eq!(c.bind(&a, &x).unwrap(), None);
        assert_eq!(c.bind(&b, &x).unwrap(), Some(a.clone()));
        assert_eq!(c.channel(&a).unwrap().unwrap().source, None);
        assert_eq!(c.bound_channel("hook:x").unwrap(), Some(b.clone()));
        assert_eq!(c.bound_sources().unwrap(), vec![x]);
        assert_eq!(c.unbind(&b).unwrap().as_deref(), Some("hook:x"));
        assert_eq!(c.bound_channel("hook:x").unwrap(), None);
    }

    #[test]
    fn open_channel_reuses_known_ids_and_replaces_unknown_ones() {
        let (c, _dir) = channels("open");
        let (a, reused) = c.open_channel(None).unwrap().unwrap();
        assert!(!reused);
        let (again, reused) = c.open_channel(Some(&a)).unwrap().unwrap();
        assert!(reused && again == a);
        let (fresh, reused) = c.open_channel(Some("cch_unknown")).unwrap().unwrap();
        assert!(!reused && fresh != "cch_unknown");
    }

    #[test]
    fn past_max_channels_a_new_channel_is_refused_and_a_known_one_still_opens() {
        let (c, _dir) = channels("full");
        let first = c.open_channel(None).unwrap().unwrap().0;
        for _ in 1..MAX_CHANNELS {
            assert!(c.open_channel(None).unwrap().is_some());
        }
        assert_eq!(c.open_channel(None).unwrap(), None, "one more than the cap");
        assert_eq!(c.open_channel(Some("cch_unknown")).unwrap(), None);
        assert_eq!(c.open_channel(Some(&first)).unwrap(), Some((first, true)));
    }

    #[test]
    fn the_lease_unregisters_every_channel_once_it_runs_out() {
        let (c, _dir) = channels("lease");
        let (a, _) = c.open_channel(None).unwrap().unwrap();
        c.bind(&a, &Source::new("hook", "x")).unwrap();
        c.set_offline_since(Some(1000)).unwrap();
        assert_eq!(c.expire_lease(1999, 1000).unwrap(), None);
        assert_eq!(c.expire_lease(2000, 1000).unwrap(), Some(1));
        assert_eq!(c.channel(&a).unwrap(), None);
        assert_eq!(c.bound_channel("hook:x").unwrap(), None);
        assert_eq!(c.lease_unregistered().unwrap(), 1);
        assert_eq!(c.expire_lease(9999, 1000).unwrap(), None, "ended with the expiry");
    }

    #[test]
    fn a_damaged_channel_record_is_an_error_not_an_unbound_channel() {
        let (c, _dir) = channels("corrupt");
        c.db.write(|txn| {
            txn.open_table(CHANNELS)?.insert("cch_x", "{not json")?;
            Ok(())
        })
        .unwrap();
        assert!(matches!(c.channel("cch_x"), Err(crate::store::StoreError::Corrupt(_))));
    }
}
