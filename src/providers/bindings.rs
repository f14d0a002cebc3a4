//! What each binding of a provider knows of its conversation (a chat's name and type, the
//! account it came through), one JSON row per source in the provider's own table: written when
//! a form binds, read by every send, Descriptor and inbound message.

use miniserde::Deserialize;
use redb::TableDefinition;

use crate::channels::Channels;
use crate::source::Source;
use crate::store::{self, Db, StoreError};

/// One provider's table of binding rows.
pub struct Rows {
    /// Whose rows: the provider part of their sources.
    pub provider: &'static str,
    pub table: TableDefinition<'static, &'static str, &'static str>,
    /// What a row is, for the error a corrupt one gives (`feishu chat`).
    pub what: &'static str,
}

/// A binding row that names the account (a bot, an app) its binding was made through: one
/// link of that account serves all of them.
pub trait Through: Deserialize {
    fn account(&self) -> &str;
}

impl Rows {
    /// The table `table` of `provider`'s rows, each a `what` (`feishu chat`).
    pub const fn new(provider: &'static str, table: &'static str, what: &'static str) -> Rows {
        Rows {
            provider,
            table: TableDefinition::new(table),
            what,
        }
    }

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

    /// The rows of the sources in `bound` that are this provider's. A row that cannot be read
    /// is left out, and said.
    pub fn of_bound<T: Deserialize>(&self, db: &Db, bound: &[Source]) -> Vec<(Source, T)> {
        let provider = self.provider;
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

    /// The accounts the sources in `bound` were bound through, each once: the links to run.
    pub fn accounts<T: Through>(&self, db: &Db, bound: &[Source]) -> Vec<String> {
        let mut accounts: Vec<String> = (self.of_bound::<T>(db, bound).into_iter())
            .map(|(_, row)| row.account().to_string())
            .collect();
        accounts.sort();
        accounts.dedup();
        accounts
    }

    /// The bound sources made through `account`, with their rows; `None` when the bindings
    /// cannot be read (said).
    pub fn through<T: Through>(&self, channels: &Channels, db: &Db, account: &str) -> Option<Vec<(Source, T)>> {
        let bound = match channels.bound_sources() {
            Ok(bound) => bound,
            Err(e) => {
                log::error!("{}: cannot read the bindings: {e}", self.provider);
                return None;
            }
        };
        let mut rows = self.of_bound::<T>(db, &bound);
        rows.retain(|(_, row)| row.account() == account);
        Some(rows)
    }
}
