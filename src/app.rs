//! What every part of the daemon shares: the config, the store and the data-plane hub.

use std::sync::Arc;

use crate::config::Config;
use crate::dataplane::Hub;
use crate::store::Store;

pub struct App {
    pub config: Config,
    pub store: Store,
    pub hub: Hub,
    pub connector_id: String,
    /// One HTTP client for every outbound call (reply_url, provider APIs).
    pub http: ureq::Agent,
    /// Telegram long-poll loops, one per bot with a binding.
    pub telegram: crate::providers::telegram::poll::Pollers,
    /// Set on SIGTERM: workers finish what they hold and exit.
    pub stopping: std::sync::atomic::AtomicBool,
}

impl App {
    pub fn new(config: Config, store: Store) -> Result<Arc<App>, crate::store::StoreError> {
        let connector_id = store.connector_id()?;
        let http_config = ureq::Agent::config_builder()
            .timeout_global(Some(std::time::Duration::from_secs(15)))
            .timeout_connect(Some(std::time::Duration::from_secs(5)))
            .http_status_as_error(false)
            .user_agent(format!("imgate/{}", crate::protocol::card::VERSION))
            .build();
        Ok(Arc::new(App {
            config,
            store,
            hub: Hub::default(),
            connector_id,
            http: ureq::Agent::new_with_config(http_config),
            stopping: std::sync::atomic::AtomicBool::new(false),
            telegram: Default::default(),
        }))
    }

    /// The outbox caps from `[queue]`.
    pub fn policy(&self) -> crate::outbox::Policy {
        let q = &self.config.queue;
        crate::outbox::Policy {
            max_messages_per_channel: q.max_messages_per_channel,
            max_bytes_per_channel: q.max_bytes_per_channel,
            max_bytes_total: q.max_bytes_total,
            overflow: q.overflow,
        }
    }

    pub fn is_stopping(&self) -> bool {
        self.stopping.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn ttl_ms(&self) -> u64 {
        self.config.queue.ttl.as_millis() as u64
    }
}
