//! What every part of the daemon above the providers shares: the layers below (`Host`), the
//! running providers, the data-plane hub and the connector's identity.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::channels::Channels;
use crate::config::Config;
use crate::dataplane::tools::ToolResults;
use crate::dataplane::Hub;
use crate::files::Files;
use crate::outbox::{Outbox, Policy};
use crate::providers::{Host, Registry};
use crate::store::{Db, StoreError};

pub struct App {
    pub host: Arc<Host>,
    pub providers: Registry,
    pub hub: Arc<Hub>,
    pub connector_id: String,
    pub tool_results: ToolResults,
    /// IM profile v2: xAgent's completed messages and streams.
    pub chats: crate::dataplane::chat::Chats,
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
        let db = Db::open(&config.server.state_dir)?;
        let q = &config.queue;
        let policy = Policy {
            max_messages_per_channel: q.max_messages_per_channel,
            max_bytes_per_channel: q.max_bytes_per_channel,
            max_bytes_total: q.max_bytes_total,
            overflow: q.overflow,
        };
        let host = Arc::new(Host {
            channels: Channels::open(db.clone())?,
            outbox: Outbox::open(db.clone(), policy)?,
            files: Files::open(db.clone(), &config.server.state_dir, config.files.clone())?,
            db: db.clone(),
            config,
        });
        let connector_id = host.channels.connector_id()?;
        let hub = Arc::new(Hub::default());
        // A committed message wakes the session that holds its channel.
        let (wake, weak_host) = (Arc::downgrade(&hub), Arc::downgrade(&host));
        host.outbox.on_accepted(move |source| {
            if let (Some(hub), Some(host)) = (wake.upgrade(), weak_host.upgrade()) {
                hub.notify_source(&host.channels, source);
            }
        });
        Ok(Arc::new(App {
            providers: Registry::start(&host)?,
            tool_results: ToolResults::open(db.clone())?,
            chats: crate::dataplane::chat::Chats::open(db)?,
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
