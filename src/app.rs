//! The wiring below the layers that serve xAgent and the port: the layers below the providers
//! (`Host`), the running providers, the hub of data-plane sessions and the connector's identity.
//! The data plane, the HTTP routes and the front door each hold an `App`; nothing here knows
//! them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use crate::channels::Channels;
use crate::config::Config;
use crate::files::Files;
use crate::hub::Hub;
use crate::outbox::{Outbox, Policy};
use crate::providers::{Host, Registry};
use crate::store::{Db, StoreError};

pub struct App {
    pub host: Arc<Host>,
    pub providers: Registry,
    pub hub: Arc<Hub>,
    pub connector_id: String,
    /// Set on SIGTERM: workers finish what they hold and exit.
    stopping: AtomicBool,
}

impl std::ops::Deref for App {
    type Target = Host;

    fn deref(&self) -> &Host {
        &self.host
    }
}

impl App {
    /// Opens every layer on the database in `[server] state_dir` and starts the providers.
    pub fn open(config: Config) -> Result<Arc<App>, StoreError> {
        App::open_with(config, Registry::start)
    }

    /// `open`, with the providers `start` returns (the unit tests' stand-ins).
    pub(crate) fn open_with(
        config: Config,
        start: impl FnOnce(&Arc<Host>) -> Result<Registry, StoreError>,
    ) -> Result<Arc<App>, StoreError> {
        let db = Db::open(&config.server.state_dir)?;
        let q = &config.queue;
        let policy = Policy {
            max_messages_per_channel: q.max_messages_per_channel,
            max_bytes_per_channel: q.max_bytes_per_channel,
            max_bytes_total: q.max_bytes_total,
            overflow: q.overflow,
            log_file_bytes: q.log_file_size.unwrap_or(crate::outbox::wal::LOG_BYTES),
            max_delivered_ids: crate::outbox::MAX_DELIVERED_IDS,
        };
        let host = Arc::new(Host {
            channels: Channels::open(db.clone())?,
            outbox: Outbox::open(db.clone(), policy)?,
            files: Files::open(db.clone(), &config.server.state_dir, config.files.clone())?,
            db,
            config,
            state_changed: OnceLock::new(),
            unbound: Default::default(),
            closed: Default::default(),
        });
        let connector_id = host.channels.connector_id()?;
        let hub = Arc::new(Hub::default());
        // A committed message wakes the session that holds its channel (the hub answers from
        // memory: this runs on the committer thread).
        let wake = Arc::downgrade(&hub);
        host.outbox.on_accepted(move |source| {
            if let Some(hub) = wake.upgrade() {
                hub.notify_source(source);
            }
        });
        Ok(Arc::new(App {
            providers: start(&host)?,
            host,
            hub,
            connector_id,
            stopping: AtomicBool::new(false),
        }))
    }

    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.providers.stop();
    }
}
