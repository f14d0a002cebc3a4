//! Delivery under IM profile v1 (section 7.3, the boundary this deployment publishes): pending
//! messages go out as `message.push`, in batches per channel, then one `ping`; a message leaves
//! the outbox as delivered only in the commit that follows the `pong` to a `ping` sent after
//! its push on the same connection. If the session ends first, the batch stays pending with
//! `attempts + 1` and the next connection pushes it again. The barrier doubles as keepalive.

use std::sync::Arc;
use std::time::{Duration, Instant};

use smol::future::FutureExt;

use super::blocking;
use super::out::{Missed, Out};
use super::session::{lock, State};
use crate::app::App;
use crate::ids;
use crate::json::{obj, Value};
use crate::outbox::StoredMessage;
use crate::protocol::Packet;
use crate::providers::inbound::{self, Inbound, Origin};
use crate::source::Source;

/// Pushes per channel per delivery round.
const BATCH: usize = 64;
/// A `ping` is sent at least this often, pushed or not, to notice dead peers.
const KEEPALIVE: Duration = Duration::from_secs(30);
/// How long a `pong` may take before the connection is considered dead.
const BARRIER_TIMEOUT: Duration = Duration::from_secs(20);

/// Pushes pending messages of every open bound channel, then runs the delivery barrier.
pub(super) async fn run(
    app: Arc<App>,
    id: u64,
    state: Arc<State>,
    out: Out,
    wake: smol::channel::Receiver<()>,
    stop: smol::channel::Sender<String>,
) {
    let mut pushed_last_round = false;
    loop {
        // After a round that pushed, look again at once: more may be pending.
        let mut woken = true;
        if !pushed_last_round {
            woken = async {
                let _ = wake.recv().await;
                true
            }
            .or(async {
                smol::Timer::after(KEEPALIVE).await;
                false
            })
            .await;
            if woken && lock(&state.profiles).is_none() {
                continue;
            }
        }
        let hello_done = lock(&state.profiles).is_some();
        let mut round: Vec<(String, Vec<u64>)> = Vec::new();
        // A keepalive round with nothing pending anywhere only pings: no read, so an idle
        // appliance starts no pool thread every 30 s.
        if hello_done && (woken || app.outbox.total_bytes() > 0) {
            let channels = app.hub.channels_of(id);
            let batches = blocking(&app, move |app| {
                let now = ids::now_ms();
                let mut out = Vec::new();
                for cch in channels {
                    let rec = match app.channels.channel(&cch) {
                        Ok(Some(rec)) => rec,
                        Ok(None) => continue,
                        Err(e) => {
                            log::debug!("data plane: cannot read channel {cch}: {e}");
                            continue;
                        }
                    };
                    let Some(source) = rec.source() else { continue };
                    match app.outbox.pending(source.as_str(), BATCH, now) {
                        Ok(p) if !p.is_empty() => out.push((cch, source, p)),
                        Ok(_) => {}
                        Err(e) => log::error!("outbox: cannot read {source}: {e}"),
                    }
                }
                out
            })
            .await;
            for (cch, source, pending) in batches {
                let mut seqs = Vec::with_capacity(pending.len());
                for p in pending {
                    let payload = render_push(&app, &source, &p.message);
                    let packet = Packet::new("message.push").with_channel(&cch).with_payload(payload);
                    if out.send(packet).await.is_err() {
                        return;
                    }
                    seqs.push(p.seq);
                }
                round.push((source.to_string(), seqs));
            }
        }
        pushed_last_round = !round.is_empty();
        if round.is_empty() && woken {
            // Nothing to confirm and no keepalive due.
            continue;
        }
        *lock(&state.in_flight) = round.clone();

        // The barrier doubles as keepalive: one ping per round, answered by one pong. Its timer
        // runs from now, while the ping waits in a full queue too.
        let request_id = ids::short("req_");
        let (tx, rx) = smol::channel::bounded::<()>(1);
        lock(&state.barriers).insert(request_id.clone(), tx);
        let mut ping = Packet::new("ping");
        ping.request_id = Some(request_id.clone());
        let due = Instant::now() + BARRIER_TIMEOUT;
        let answered = match out.send_by(ping, due).await {
            Err(Missed::Ended) => return,
            Err(Missed::Late) => false,
            Ok(()) => {
                async { rx.recv().await.is_ok() }
                    .or(async {
                        smol::Timer::at(due).await;
                        false
                    })
                    .await
            }
        };
        lock(&state.barriers).remove(&request_id);
        if !answered {
            log::warn!("data plane: session {id}: no pong within {BARRIER_TIMEOUT:?}; closing the connection");
            let _ = stop.try_send(format!("no pong within {BARRIER_TIMEOUT:?}"));
            return;
        }
        if !round.is_empty() {
            let n: usize = round.iter().map(|(_, s)| s.len()).sum();
            let done = round.clone();
            let recorded = blocking(&app, move |app| {
                let mut all = true;
                for (source, seqs) in done {
                    match app.outbox.mark_delivered(&source, &seqs) {
                        Ok(_) => {
                            let source = Source::parse(&source);
                            if let Some((p, src)) = source.as_ref().and_then(|s| Some((app.providers.of(s)?, s))) {
                                p.delivered(src);
                            }
                        }
                        Err(e) => {
                            log::error!("outbox: cannot record delivery for {source}: {e}");
                            all = false;
                        }
                    }
                }
                all
            })
            .await;
            lock(&state.in_flight).clear();
            if !recorded {
                // The messages stay pending and will be pushed again; do not spin on a failing disk.
                smol::Timer::after(Duration::from_secs(1)).await;
            }
            log::debug!("data plane: session {id}: {n} message(s) delivered");
        }
    }
}

/// The wire payload of a stored message: the provider names its origin, the profile renders.
fn render_push(app: &App, source: &Source, stored: &StoredMessage) -> Value {
    let Some(m) = Inbound::of(stored) else {
        log::error!(
            "outbox: stored message {} of {source} is unreadable",
            crate::quiet::shown(&stored.header.message_id)
        );
        return obj([]);
    };
    let provider = app.providers.of(source);
    let label = provider.map_or_else(|| source.key().to_string(), |p| p.label(source));
    let origin = Origin {
        provider: source.provider(),
        label: &label,
        tools: provider.map_or(&[], |p| p.tools()),
        base: app.public_base(),
        skill: app.config.server.card_id.skill_name(),
    };
    inbound::render(&origin, &m, stored)
}
