//! What each binding of a provider knows of its conversation (a chat's name and type, the
//! account it came through), one JSON row per source in the provider's own table: written when
//! a form binds, read by every send, Descriptor and inbound message.

use redb::TableDefinition;

use crate::channels::Channels;
use crate::source::Source;
use crate::store::{self, Db, StoreError};

/// One provider's table of binding rows.
pub struct Rows {
    pub table: TableDefinition<'static, &'static str, &'static str>,
    /// What a row is, for the error a corrupt one gives (`feishu chat`).
    pub what: &'static str,
}

impl Rows {
    /// Creates the table (a provider's start).
    pub fn create(&self, db: &Db) -> Result<(), StoreError> {
        db.write(|txn| {
            txn.open_table(self.table)?;
            Ok(())
        })
    }

    /// The row of `source`, if it has one.
    pub fn get<T: miniserde::Deserialize>(&self, db: &Db, source: &str) -> Result<Option<T>, StoreError> {
        db.read(|txn| {
            let Some(v) = txn.open_table(self.table)?.get(source)? else {
                return Ok(None);
            };
            let row = miniserde::json::from_str(v.value()).map_err(|_| store::corrupt(self.what))?;
            Ok(Some(row))
        })
    }

    /// Writes the row of `source`.
    pub fn put<T: miniserde::Serialize>(&self, db: &Db, source: &str, row: &T) -> Result<(), StoreError> {
        db.write(|txn| {
            txn.open_table(self.table)?
                .insert(source, miniserde::json::to_string(row).as_str())?;
            Ok(())
        })
    }

    /// The row of `source` while it is bound: a row outlives its binding (an unbound
    /// conversation may be bound again), the channel registry says whether it is bound now.
    pub fn while_bound<T: miniserde::Deserialize>(
        &self,
        channels: &Channels,
        db: &Db,
        source: &str,
    ) -> Result<Option<T>, StoreError> {
        match channels.bound_channel(source)? {
            Some(_) => self.get(db, source),
            None => Ok(None),
        }
    }

    /// The rows of the sources in `bound` that are `provider`'s. A row that cannot be read is
    /// left out, and said.
    pub fn of_bound<T: miniserde::Deserialize>(&self, db: &Db, bound: &[Source], provider: &str) -> Vec<(Source, T)> {
        bound
            .iter()
            .filter(|s| s.provider() == provider)
            .filter_map(|s| match self.get(db, s.as_str()) {
                Ok(row) => row.map(|row| (s.clone(), row)),
                Err(e) => {
                    log::error!("{provider}: cannot read the binding of {s}: {e}");
                    None
                }
            })
            .collect()
    }
}
