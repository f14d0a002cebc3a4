//! `/status` (JSON, contract section 6) and `/metrics` (Prometheus text).

use crate::app::App;
use crate::json::{arr, b, n, obj, opt_s, s, Value};
use crate::outbox::{Counters as SourceStats, Outcome};
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
    /// What the provider calls its conversation (the Descriptor's `display_name`).
    name: Option<String>,
    status: &'static str,
    /// Why the provider describes it as not connected, when it says.
    reason: Option<String>,
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
        let description = rec.source().and_then(|src| app.providers.of(&src)?.describe(&src).ok());
        let described = description.as_ref().map(|d| d.status);
        let reason = description
            .as_ref()
            .filter(|d| d.status != "connected")
            .and_then(|d| d.tools.iter().find_map(|(_, t)| t.reason.clone()));
        let status = match (&rec.source, app.hub.is_open(&cch)) {
            (None, _) => "created",
            (Some(_), _) if described == Some("expired") => "expired",
            (Some(_), _) if described == Some("error") => "error",
            (Some(_), _) if described == Some("degraded") => "degraded",
            (Some(_), true) => "connected",
            (Some(_), false) => "offline",
        };
        channels.push(ChannelRow {
            cch,
            // The provider part of the source ("none" while unbound).
            provider: rec
                .source()
                .map_or_else(|| "none".into(), |s: Source| s.provider().to_string()),
            name: description.map(|d| d.target.display_name),
            status,
            reason,
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

/// The state file system as imgate sees it, from memory and one `statvfs`: never the
/// database, so it answers during an outage.
pub struct Storage {
    /// Writes work (no outage, nothing waiting for a reopen).
    pub up: bool,
    /// Bytes free for imgate on the state dir's file system.
    pub free_bytes: Option<u64>,
    /// The first error of the outage, while there is one.
    pub last_error: Option<String>,
}

pub fn storage(app: &App) -> Storage {
    let last_error = app.db.outage();
    let free_bytes = rustix::fs::statvfs(&app.config.server.state_dir)
        .ok()
        .map(|v| v.f_bavail.saturating_mul(v.f_frsize));
    Storage {
        up: last_error.is_none() && !app.outbox.needs_recovery(),
        free_bytes,
        last_error,
    }
}

fn storage_json(st: &Storage) -> Value {
    obj([("state", s(if st.up { "ok" } else { "failing" }))])
        .with_null_default("free_bytes", st.free_bytes.map_or(Value::Null, n))
        .with_null_default("last_error", opt_s(st.last_error.clone()))
}

/// `/status`: what the database holds, and when it cannot be read (a failed disk) what memory
/// holds, with the reason, so monitoring sees the outage instead of a 503.
pub fn status(app: &App) -> Value {
    match full_status(app) {
        Ok(v) => v,
        Err(e) => obj([
            ("connector_id", s(&app.connector_id)),
            ("version", s(crate::protocol::card::VERSION)),
            ("profile", s(app.config.xagent.profile.as_str())),
            ("uptime_s", n(uptime_s())),
            ("xagent", obj([("connected", b(app.hub.xagent_connected()))])),
            ("storage", storage_json(&storage(app))),
            ("dataplane", obj([("connections", n(app.hub.connections() as u64))])),
            ("outbox", obj([("pending_bytes", n(app.outbox.total_bytes()))])),
            ("unreadable", s(format!("channels and counters: {e}"))),
        ]),
    }
}

/// Seconds since the process started.
fn uptime_s() -> u64 {
    let started = crate::metrics::started_at().unwrap_or(0);
    (crate::ids::now_ms() / 1000).saturating_sub(started)
}

fn full_status(app: &App) -> Result<Value, StoreError> {
    let snap = snapshot(app)?;
    let q = &app.config.queue;
    let log = app.outbox.log_report();
    let connected = app.hub.xagent_connected();
    // The lease runs from when the last xAgent session ended (kept across restarts).
    let lease_ms = app.config.xagent.lease.as_millis() as u64;
    let offline_since = if connected { None } else { app.channels.offline_since()? };
    let lease_left = offline_since.map(|since| since.saturating_add(lease_ms).saturating_sub(crate::ids::now_ms()));
    Ok(obj([
        ("connector_id", s(&app.connector_id)),
        ("version", s(crate::protocol::card::VERSION)),
        ("profile", s(app.config.xagent.profile.as_str())),
        ("uptime_s", n(uptime_s())),
        (
            "xagent",
            obj([("connected", b(connected))])
                .with_null_default("offline_since_ms", offline_since.map_or(Value::Null, n)),
        ),
        ("storage", storage_json(&storage(app))),
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
                    ("name", opt_s(c.name.clone())),
                    ("status", s(c.status)),
                    // Left out (`Null`) unless the provider says why the channel is not connected.
                    ("reason", opt_s(c.reason.clone())),
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
                ("lease_ms", n(lease_ms)),
                ("channels_unregistered", n(app.channels.lease_unregistered()?)),
            ])
            // While no xAgent is connected: how long until every channel is unregistered.
            .with_null_default("expires_in_ms", lease_left.map_or(Value::Null, n)),
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

/// A metric name, its Prometheus type, its help and how to read it from a source's stats.
type Series = (&'static str, &'static str, &'static str, fn(&SourceStats) -> u64);

/// `/metrics`: every family; during a failed disk those that need the database are left out
/// (`imgate_storage_up` says why).
pub fn metrics(app: &App, more: super::MoreMetrics) -> String {
    let mut out = String::new();
    let st = storage(app);
    crate::metrics::single(
        &mut out,
        "imgate_storage_up",
        "gauge",
        "Whether writes to the state dir work (1) or fail (0).",
        u64::from(st.up),
    );
    if let Some(free) = st.free_bytes {
        let help = "Bytes free for imgate on the state dir's file system.";
        crate::metrics::single(&mut out, "imgate_storage_free_bytes", "gauge", help, free);
    }
    let providers: Vec<&str> = crate::providers::REGISTRATIONS
        .iter()
        .map(|r| r.reader.provider)
        .collect();
    crate::metrics::family(
        &mut out,
        "imgate_build_info",
        "gauge",
        "The build: its version, git revision and the providers it carries (always 1).",
    );
    out.push_str(&format!(
        "imgate_build_info{{version=\"{}\",revision=\"{}\",providers=\"{}\"}} 1\n",
        crate::protocol::card::VERSION,
        crate::protocol::card::GIT_REV,
        providers.join(",")
    ));
    crate::metrics::process(&mut out);
    crate::metrics::single(
        &mut out,
        "imgate_dataplane_connections",
        "gauge",
        "xAgent data-plane connections open now.",
        app.hub.connections(),
    );
    crate::metrics::single(
        &mut out,
        "imgate_outbox_bytes",
        "gauge",
        "Bytes of messages the outbox holds.",
        app.outbox.total_bytes(),
    );
    more(&mut out);
    intake_metrics(app, &mut out);
    for p in app.providers.all() {
        p.metrics(&mut out);
    }
    if let Err(e) = stored_metrics(app, &mut out) {
        log::debug!("http: /metrics without what the database holds: {e}");
    }
    out
}

/// How each enabled provider's messages ended since start (every outcome, zeros included, so
/// a rate is there from the first scrape).
fn intake_metrics(app: &App, out: &mut String) {
    crate::metrics::family(
        out,
        "imgate_intake_messages_total",
        "counter",
        "Messages each provider handed to the outbox, by outcome: accepted (stored), duplicate \
         (its message_id was known), full (refused by reject_new caps), failed (the store could \
         not write), stale (older than the TTL on arrival), refused (a wrong secret or signature, \
         a malformed or too large body).",
    );
    for p in app.providers.all() {
        let name = p.declaration().name;
        let counts = app.outbox.intake_counts(name);
        for (outcome, count) in Outcome::ALL.iter().zip(counts) {
            out.push_str(&format!(
                "imgate_intake_messages_total{{provider=\"{name}\",outcome=\"{}\"}} {count}\n",
                outcome.label()
            ));
        }
    }
}

fn stored_metrics(app: &App, out: &mut String) -> Result<(), StoreError> {
    let snap = snapshot(app)?;
    let q = &app.config.queue;
    let (commits, grouped) = app.outbox.commit_stats();
    let log = app.outbox.log_report();
    let (ids, index_bytes, id_reads) = app.outbox.index_report();
    crate::metrics::singles(
        out,
        &[
            (
                "imgate_lease_unregistered_channels_total",
                "counter",
                "Channels whose lease ran out and were unregistered.",
                app.channels.lease_unregistered()?,
            ),
            (
                "imgate_outbox_commits_total",
                "counter",
                "Group commits of the outbox.",
                commits,
            ),
            (
                "imgate_outbox_committed_messages_total",
                "counter",
                "Messages stored by the outbox's group commits.",
                grouped,
            ),
            (
                "imgate_outbox_checkpoints_total",
                "counter",
                "Checkpoints of the outbox's log into the database.",
                log.checkpoints,
            ),
            (
                "imgate_outbox_log_replayed_total",
                "counter",
                "Log records replayed at start.",
                log.replayed,
            ),
            (
                "imgate_outbox_log_unreadable_total",
                "counter",
                "Log records found unreadable at start.",
                log.unreadable,
            ),
            (
                "imgate_outbox_checkpointed_messages_total",
                "counter",
                "Messages written to the database by checkpoints.",
                log.checkpointed_messages,
            ),
            (
                "imgate_outbox_log_bytes",
                "gauge",
                "Bytes of the outbox's log files.",
                log.log_bytes,
            ),
            (
                "imgate_outbox_log_held_bytes",
                "gauge",
                "Bytes of log records not checkpointed yet.",
                log.held_bytes,
            ),
            (
                "imgate_outbox_known_ids",
                "gauge",
                "Message IDs the dedupe index knows (pending and delivered).",
                ids,
            ),
            (
                "imgate_outbox_index_bytes",
                "gauge",
                "Bytes of memory the dedupe index takes.",
                index_bytes,
            ),
            (
                "imgate_outbox_id_reads_total",
                "counter",
                "Stored message IDs read to confirm a candidate of the dedupe index (a duplicate's, \
                 or another ID's that shares its bits).",
                id_reads,
            ),
            (
                "imgate_store_commits_total",
                "counter",
                "Durable commits of the database.",
                app.outbox.store_commits(),
            ),
            (
                "imgate_queue_ttl_seconds",
                "gauge",
                "Configured time a message is kept for xAgent.",
                q.ttl.as_secs(),
            ),
            (
                "imgate_queue_max_messages_per_channel",
                "gauge",
                "Configured cap on the messages one channel holds.",
                q.max_messages_per_channel,
            ),
            (
                "imgate_queue_max_bytes_per_channel",
                "gauge",
                "Configured cap on the bytes one channel holds.",
                q.max_bytes_per_channel,
            ),
            (
                "imgate_queue_max_bytes",
                "gauge",
                "Configured cap on the bytes all channels hold.",
                q.max_bytes_total,
            ),
            (
                "imgate_queue_cleanup_interval_seconds",
                "gauge",
                "Configured interval of the expiry sweep.",
                q.cleanup_interval.as_secs(),
            ),
        ],
    );
    let series: [Series; 7] = [
        ("imgate_channel_pending", "gauge", "Messages waiting for xAgent.", |s| {
            s.pending
        }),
        (
            "imgate_channel_pending_bytes",
            "gauge",
            "Bytes of messages waiting for xAgent.",
            |s| s.pending_bytes,
        ),
        (
            "imgate_channel_delivered_total",
            "counter",
            "Messages xAgent acknowledged.",
            |s| s.delivered,
        ),
        (
            "imgate_channel_expired_total",
            "counter",
            "Messages expired after their TTL.",
            |s| s.expired,
        ),
        (
            "imgate_channel_evicted_total",
            "counter",
            "Messages evicted by the caps.",
            |s| s.evicted,
        ),
        (
            "imgate_channel_attempts_total",
            "counter",
            "Deliveries attempted.",
            |s| s.attempts,
        ),
        (
            "imgate_channel_failed_total",
            "counter",
            "Messages xAgent refused for good.",
            |s| s.failed,
        ),
    ];
    for (name, kind, help, get) in series {
        crate::metrics::family(out, name, kind, help);
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
    crate::metrics::family(
        out,
        "imgate_channel_last_failure",
        "gauge",
        "The code of the last message xAgent refused for good, per channel (always 1).",
    );
    for c in &snap.channels {
        let code = c.stats.last_failure.as_deref().and_then(|f| f.split(": ").nth(1));
        if let Some(code) = code.filter(|c| c.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')) {
            out.push_str(&format!(
                "imgate_channel_last_failure{{channel=\"{}\",provider=\"{}\",code=\"{code}\"}} 1\n",
                c.cch, c.provider
            ));
        }
    }
    Ok(())
}
