//! `/status` (JSON, contract section 6) and `/metrics` (Prometheus text).

use crate::app::App;
use crate::json::{arr, n, obj, opt_s, s, Value};
use crate::outbox::Counters as SourceStats;
use crate::source::Source;
use crate::store::StoreError;

/// One row per channel plus the unbound sources, as both endpoints report them.
struct Snapshot {
    channels: Vec<ChannelRow>,
    unbound: SourceStats,
}

struct ChannelRow {
    cch: String,
    provider: String,
    status: &'static str,
    stats: SourceStats,
}

fn snapshot(app: &App) -> Result<Snapshot, StoreError> {
    let mut per_source = app.outbox.stats()?;
    let mut channels = Vec::new();
    for (cch, rec) in app.channels.channels()? {
        let stats = match &rec.source {
            Some(src) => per_source
                .iter()
                .position(|(s, _)| s == src)
                .map(|i| per_source.swap_remove(i).1)
                .unwrap_or_default(),
            None => SourceStats::default(),
        };
        // A binding whose sign-in the IM system ended, or that its IM system refuses, shows as
        // its provider describes it.
        let described = rec
            .source()
            .and_then(|src| app.providers.of(&src)?.describe(&src).ok())
            .map(|d| d.status);
        let status = match (&rec.source, app.hub.is_open(&cch)) {
            (None, _) => "created",
            (Some(_), _) if described == Some("expired") => "expired",
            (Some(_), _) if described == Some("error") => "error",
            (Some(_), true) => "connected",
            (Some(_), false) => "offline",
        };
        channels.push(ChannelRow {
            cch,
            // The provider part of the source ("none" while unbound).
            provider: rec
                .source()
                .map_or_else(|| "none".into(), |s: Source| s.provider().to_string()),
            status,
            stats,
        });
    }
    // What is left belongs to sources no channel is bound to.
    let mut unbound = SourceStats::default();
    for (_, st) in per_source {
        unbound.pending += st.pending;
        unbound.pending_bytes += st.pending_bytes;
        unbound.expired += st.expired;
        unbound.evicted += st.evicted;
    }
    Ok(Snapshot { channels, unbound })
}

pub fn status(app: &App) -> Result<Value, StoreError> {
    let snap = snapshot(app)?;
    let q = &app.config.queue;
    let log = app.outbox.log_report();
    Ok(obj([
        ("connector_id", s(&app.connector_id)),
        ("version", s(crate::protocol::card::VERSION)),
        ("profile", s(app.config.xagent.profile.as_str())),
        ("dataplane", obj([("connections", n(app.hub.connections() as u64))])),
        (
            "outbox",
            obj([
                ("pending_bytes", n(app.outbox.total_bytes())),
                ("log_replayed", n(log.replayed)),
                ("log_unreadable", n(log.unreadable)),
            ]),
        ),
        (
            "policy",
            obj([
                ("ttl_ms", n(q.ttl.as_millis() as u64)),
                ("max_messages_per_channel", n(q.max_messages_per_channel)),
                ("max_bytes_per_channel", n(q.max_bytes_per_channel)),
                ("max_bytes_total", n(q.max_bytes_total)),
                ("overflow", s(q.overflow.as_str())),
                ("cleanup_interval_ms", n(q.cleanup_interval.as_millis() as u64)),
            ]),
        ),
        (
            "channels",
            arr(snap.channels.iter().map(|c| {
                obj([
                    ("connector_channel_id", s(&c.cch)),
                    ("provider", s(&c.provider)),
                    ("status", s(c.status)),
                    ("pending", n(c.stats.pending)),
                    ("pending_bytes", n(c.stats.pending_bytes)),
                    ("delivered", n(c.stats.delivered)),
                    ("expired", n(c.stats.expired)),
                    ("evicted", n(c.stats.evicted)),
                    ("attempts", n(c.stats.attempts)),
                    ("failed", n(c.stats.failed)),
                ])
                .with_null_default("last_error", opt_s(c.stats.last_error.clone()))
                .with_null_default("last_failure", opt_s(c.stats.last_failure.clone()))
            })),
        ),
        (
            "lease",
            obj([
                ("lease_ms", n(app.config.xagent.lease.as_millis() as u64)),
                ("channels_unregistered", n(app.channels.lease_unregistered()?)),
            ]),
        ),
        (
            "unbound_recent",
            arr(app
                .unbound
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .rev()
                .map(|u| {
                    obj([
                        ("provider", s(u.provider)),
                        ("conversation_id", s(&u.conversation)),
                        ("kind", s(u.kind)),
                        ("last_seen", n(u.last_seen)),
                    ])
                })
                .collect::<Vec<_>>()),
        ),
        (
            "unbound",
            obj([
                ("pending", n(snap.unbound.pending)),
                ("pending_bytes", n(snap.unbound.pending_bytes)),
                ("expired", n(snap.unbound.expired)),
                ("evicted", n(snap.unbound.evicted)),
            ]),
        ),
    ]))
}

/// `obj` leaves `Null` out; the contract shows `last_error: null`, so it is set explicitly.
trait WithNull {
    fn with_null_default(self, key: &str, v: Value) -> Value;
}

impl WithNull for Value {
    fn with_null_default(mut self, key: &str, v: Value) -> Value {
        if let Value::Object(o) = &mut self {
            o.insert(key.to_string(), v);
        }
        self
    }
}

/// A metric name, its Prometheus type and how to read it from a source's stats.
type Series = (&'static str, &'static str, fn(&SourceStats) -> u64);

pub fn metrics(app: &App, more: super::MoreMetrics) -> Result<String, StoreError> {
    let snap = snapshot(app)?;
    let mut out = String::new();
    let q = &app.config.queue;
    out.push_str("# TYPE imgate_dataplane_connections gauge\n");
    out.push_str(&format!("imgate_dataplane_connections {}\n", app.hub.connections()));
    out.push_str("# TYPE imgate_outbox_bytes gauge\n");
    out.push_str(&format!("imgate_outbox_bytes {}\n", app.outbox.total_bytes()));
    more(&mut out);
    for p in app.providers.all() {
        p.metrics(&mut out);
    }
    out.push_str("# TYPE imgate_lease_unregistered_channels_total counter\n");
    out.push_str(&format!(
        "imgate_lease_unregistered_channels_total {}\n",
        app.channels.lease_unregistered()?
    ));
    let (commits, grouped) = app.outbox.commit_stats();
    out.push_str("# TYPE imgate_outbox_commits_total counter\n");
    out.push_str(&format!("imgate_outbox_commits_total {commits}\n"));
    out.push_str("# TYPE imgate_outbox_committed_messages_total counter\n");
    out.push_str(&format!("imgate_outbox_committed_messages_total {grouped}\n"));
    let log = app.outbox.log_report();
    out.push_str("# TYPE imgate_outbox_checkpoints_total counter\n");
    out.push_str(&format!("imgate_outbox_checkpoints_total {}\n", log.checkpoints));
    out.push_str("# TYPE imgate_outbox_log_replayed_total counter\n");
    out.push_str(&format!("imgate_outbox_log_replayed_total {}\n", log.replayed));
    out.push_str("# TYPE imgate_outbox_log_unreadable_total counter\n");
    out.push_str(&format!("imgate_outbox_log_unreadable_total {}\n", log.unreadable));
    out.push_str("# TYPE imgate_outbox_checkpointed_messages_total counter\n");
    out.push_str(&format!(
        "imgate_outbox_checkpointed_messages_total {}\n",
        log.checkpointed_messages
    ));
    out.push_str("# TYPE imgate_outbox_log_bytes gauge\n");
    out.push_str(&format!("imgate_outbox_log_bytes {}\n", log.log_bytes));
    out.push_str("# TYPE imgate_outbox_log_held_bytes gauge\n");
    out.push_str(&format!("imgate_outbox_log_held_bytes {}\n", log.held_bytes));
    out.push_str("# TYPE imgate_store_commits_total counter\n");
    out.push_str(&format!("imgate_store_commits_total {}\n", app.outbox.store_commits()));
    out.push_str("# TYPE imgate_queue_ttl_seconds gauge\n");
    out.push_str(&format!("imgate_queue_ttl_seconds {}\n", q.ttl.as_secs()));
    out.push_str(&format!(
        "imgate_queue_max_messages_per_channel {}\n",
        q.max_messages_per_channel
    ));
    out.push_str(&format!(
        "imgate_queue_max_bytes_per_channel {}\n",
        q.max_bytes_per_channel
    ));
    out.push_str(&format!("imgate_queue_max_bytes_total {}\n", q.max_bytes_total));
    out.push_str(&format!(
        "imgate_queue_cleanup_interval_seconds {}\n",
        q.cleanup_interval.as_secs()
    ));
    let series: [Series; 7] = [
        ("imgate_channel_pending", "gauge", |s| s.pending),
        ("imgate_channel_pending_bytes", "gauge", |s| s.pending_bytes),
        ("imgate_channel_delivered_total", "counter", |s| s.delivered),
        ("imgate_channel_expired_total", "counter", |s| s.expired),
        ("imgate_channel_evicted_total", "counter", |s| s.evicted),
        ("imgate_channel_attempts_total", "counter", |s| s.attempts),
        ("imgate_channel_failed_total", "counter", |s| s.failed),
    ];
    for (name, kind, get) in series {
        out.push_str(&format!("# TYPE {name} {kind}\n"));
        for c in &snap.channels {
            out.push_str(&format!(
                "{name}{{channel=\"{}\",provider=\"{}\"}} {}\n",
                c.cch,
                c.provider,
                get(&c.stats)
            ));
        }
        out.push_str(&format!(
            "{name}{{channel=\"unbound\",provider=\"none\"}} {}\n",
            get(&snap.unbound)
        ));
    }
    // The code of each channel's last message xAgent refused for good (IM v2); the message
    // itself is in /status.
    out.push_str("# TYPE imgate_channel_last_failure gauge\n");
    for c in &snap.channels {
        let code = c.stats.last_failure.as_deref().and_then(|f| f.split(": ").nth(1));
        if let Some(code) = code.filter(|c| c.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')) {
            out.push_str(&format!(
                "imgate_channel_last_failure{{channel=\"{}\",provider=\"{}\",code=\"{code}\"}} 1\n",
                c.cch, c.provider
            ));
        }
    }
    Ok(out)
}
