//! The connection's own packets: `connector.hello`, `channel.open`, `channel.close`, and the
//! channel's Connection Descriptor (asked for, or pushed after a change).

use std::sync::Arc;

use super::{blocking, Plane};
use crate::channels::{ChannelRecord, MAX_CHANNELS};
use crate::hub::SessionId;
use crate::json::{self, obj, s, Value};
use crate::protocol::descriptor::{self, Target, ToolState};
use crate::protocol::{code, version_at_least, CardId, Packet, PROTOCOL_VERSION};
use crate::quiet;

/// A hello naming another connector_id: xAgent can send it at will, so one line a minute.
static OTHER_CONNECTOR_ID: quiet::Site = quiet::Site::new();
static OPENED: quiet::Site = quiet::Site::new();
static CHANNELS_FULL: quiet::Site = quiet::Site::new();

/// `connector.hello`: `Ok` when it enables the deployment's profile, or the error to answer.
pub(super) fn hello(plane: &Plane, p: &Packet) -> Result<(), Box<Packet>> {
    let pl = &p.payload;
    let ours = &plane.config.server.card_id;
    let card_id = json::get_str(pl, "connector_card_id").unwrap_or_default();
    if card_id != ours.as_str() {
        // The named ID is the peer's: shown cut short, never echoed whole.
        let named: String = card_id.chars().take(CardId::MAX_LEN).collect();
        return Err(Box::new(Packet::error_for(
            Some(p),
            code::CARD_ID_MISMATCH,
            format!("this connector is {ours}, hello named `{}`", named.escape_debug()),
        )));
    }
    let version = json::get_str(pl, "protocol_version");
    if !version.is_some_and(|v| version_at_least(v, PROTOCOL_VERSION)) {
        let why = match version {
            Some(v) => format!("protocol_version {v} is below {PROTOCOL_VERSION}"),
            None => format!("hello must declare protocol_version (this connector speaks {PROTOCOL_VERSION})"),
        };
        return Err(Box::new(Packet::error_for(
            Some(p),
            code::UNSUPPORTED_PROTOCOL_VERSION,
            why,
        )));
    }
    let Some(Value::Array(supported)) = json::get(pl, "supported_profiles") else {
        return Err(Box::new(Packet::error_for(
            Some(p),
            code::INVALID_PACKET,
            "hello must list supported_profiles",
        )));
    };
    // The deployment speaks one profile (`[xagent] profile`): it is all hello can enable.
    let chosen = plane.config.xagent.profile.as_str();
    if !supported.iter().any(|v| matches!(v, Value::String(s) if s == chosen)) {
        return Err(Box::new(Packet::error_for(
            Some(p),
            "profile_not_supported",
            format!("this connector is configured for {chosen} ([xagent] profile), which hello did not list in supported_profiles"),
        )));
    }
    if let Some(prev) = json::get_str(pl, "connector_id").filter(|c| !c.is_empty() && *c != plane.connector_id) {
        if let Some(more) = OTHER_CONNECTOR_ID.admit() {
            log::info!(
                "data plane: xAgent knew connector_id {}; this device's state says {}{more}",
                quiet::shown(prev),
                plane.connector_id
            );
        }
    }
    Ok(())
}

/// The ack of a hello that passed.
pub(super) fn hello_ack(plane: &Plane, p: &Packet) -> Packet {
    Packet::answer(p, "connector.hello.ack").with_payload(obj([
        ("connector_card_id", s(plane.config.server.card_id.as_str())),
        ("connector_id", s(&plane.connector_id)),
        ("protocol_version", s(PROTOCOL_VERSION)),
    ]))
}

/// `channel.open`: the channel stored (new or reused), held by `session`, its Descriptor.
pub(super) async fn open(plane: &Arc<Plane>, session: SessionId, p: &Packet) -> Packet {
    let requested = p.channel_id().map(str::to_string);
    let opened = blocking(plane, move |plane| {
        let Some((cch, reused)) = plane.channels.open_channel(requested.as_deref())? else {
            return Ok(None);
        };
        let source = plane.channels.channel(&cch)?.and_then(|r| r.source());
        Ok::<_, crate::store::StoreError>(Some((cch, reused, source)))
    })
    .await;
    let (cch, reused, source) = match opened {
        Ok(Some(v)) => v,
        Ok(None) => {
            if let Some(more) = CHANNELS_FULL.admit() {
                log::warn!(
                    "data plane: a new channel was refused: {MAX_CHANNELS} channels are kept already (the lease unregisters those of an xAgent gone for good){more}"
                );
            }
            return Packet::error_for(
                Some(p),
                code::CHANNEL_UNAVAILABLE,
                format!("the connector keeps at most {MAX_CHANNELS} channels; open a known one"),
            );
        }
        Err(e) => {
            log::error!("data plane: cannot persist channel: {e}");
            return Packet::error_for(
                Some(p),
                code::CHANNEL_UNAVAILABLE,
                "the connector cannot store channels right now",
            );
        }
    };
    if let Some(prev) = plane.hub.open(&cch, session, source) {
        log::info!("data plane: channel {cch} moved from session {prev} to session {session}");
    }
    // A peer may open channels as fast as it likes: one line a minute, with the count since.
    if let Some(more) = OPENED.admit() {
        log::info!(
            "data plane: channel {cch} opened ({}){more}",
            if reused { "reused" } else { "new" }
        );
    }
    let d = descriptor(plane, &cch).await;
    plane.hub.wake_channel(&cch);
    let mut ack = Packet::answer(p, "channel.open.ack")
        .with_payload(obj([("connector_channel_id", s(&cch)), ("connection_descriptor", d)]));
    ack.channel = Some(cch);
    ack
}

/// `channel.close`: the session lets go of the channel (its binding stays).
pub(super) fn close(plane: &Plane, session: SessionId, p: &Packet) -> Packet {
    match p.channel_id() {
        None => Packet::error_for(
            Some(p),
            code::CHANNEL_ID_REQUIRED,
            "channel.close needs connector_channel_id",
        ),
        Some(cch) => {
            plane.hub.close(cch, session);
            Packet::answer(p, "channel.close.ack").with_payload(obj([("status", s("ok"))]))
        }
    }
}

/// The channel's Descriptor, read on the pool.
pub(super) async fn descriptor(plane: &Arc<Plane>, cch: &str) -> Value {
    let cch = cch.to_string();
    blocking(plane, move |plane| describe(plane, &cch)).await
}

/// `connection.descriptor.push` to whichever session holds `cch`.
pub(super) async fn push_descriptor(plane: &Arc<Plane>, cch: &str) {
    let d = descriptor(plane, cch).await;
    let push = Packet::new("connection.descriptor.push")
        .with_channel(cch)
        .with_payload(obj([("connection_descriptor", d)]));
    plane.hub.send_to_channel(cch, push);
}

/// The Descriptor of the open channel bound to `source`, pushed to its session (blocking: a
/// provider's thread calls it).
pub(super) fn push_state(plane: &Plane, source: &crate::source::Source) {
    let Some(cch) = plane.hub.channel_of(source.as_str()) else {
        return;
    };
    let push = Packet::new("connection.descriptor.push")
        .with_channel(&cch)
        .with_payload(obj([("connection_descriptor", describe(plane, &cch))]));
    plane.hub.send_to_channel(&cch, push);
}

/// How a channel shows: status, target, and its tools' states.
struct Shown {
    status: &'static str,
    target: Target,
    /// The states the provider gave its own tools.
    tools: Vec<(&'static str, ToolState)>,
    /// The state of every Card tool `tools` does not name.
    others: ToolState,
}

impl Shown {
    /// A channel that cannot be used, for one reason.
    fn unusable(status: &'static str, provider: &str, label: &str, display_name: String, why: &str) -> Shown {
        Shown {
            status,
            target: Target {
                provider: provider.into(),
                label: label.into(),
                display_name,
                account_hint: None,
            },
            tools: Vec::new(),
            others: ToolState::unavailable(why),
        }
    }
}

/// The Connection Descriptor of a channel in its current state: the provider of its binding
/// describes it; every tool of the Card is listed, those its provider lacks as unavailable.
/// The profiles are the one the deployment speaks: all a hello can enable.
fn describe(plane: &Plane, cch: &str) -> Value {
    const STORAGE: &str = "storage unavailable: try again later";
    let shown = match plane
        .channels
        .channel(cch)
        .map(|r| r.as_ref().and_then(ChannelRecord::source))
    {
        Err(e) => {
            log::debug!("data plane: cannot read channel {cch}: {e}");
            Shown::unusable(
                "error",
                "imgate",
                "imgate",
                "imgate (storage unavailable)".into(),
                STORAGE,
            )
        }
        Ok(None) => Shown::unusable(
            "created",
            "imgate",
            "imgate",
            "imgate (not bound)".into(),
            "channel is not bound yet",
        ),
        Ok(Some(src)) => match plane.providers.of(&src) {
            None => Shown::unusable(
                "error",
                src.provider(),
                src.provider(),
                format!("{} (provider not enabled)", src.provider()),
                "the binding refers to a provider that is not enabled",
            ),
            Some(p) => match p.describe(&src) {
                Ok(d) => Shown {
                    status: d.status,
                    target: d.target,
                    tools: d.tools,
                    others: ToolState::unavailable("this channel cannot use it"),
                },
                Err(e) => {
                    log::debug!("data plane: cannot describe channel {cch}: {e}");
                    let label = p.label(&src);
                    Shown::unusable(
                        "error",
                        p.declaration().name,
                        &label,
                        format!("{label} (storage unavailable)"),
                        STORAGE,
                    )
                }
            },
        },
    };
    let states: Vec<(&str, ToolState)> = plane
        .providers
        .tools()
        .into_iter()
        .map(|t| {
            let st = shown
                .tools
                .iter()
                .find(|(id, _)| *id == t)
                .map_or_else(|| shown.others.clone(), |(_, st)| st.clone());
            (t, st)
        })
        .collect();
    descriptor::build(
        plane.config.server.card_id.as_str(),
        &plane.connector_id,
        cch,
        &[plane.config.xagent.profile.as_str().to_string()],
        shown.status,
        &shown.target,
        &states,
    )
}
