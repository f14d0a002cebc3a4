//! The packet engine: one WebSocket session, whoever dialled whom.
//!
//! Three tasks per session: the reader (this function's loop, answers requests), the writer
//! (the only one touching the socket's send half) and the delivery loop of the deployment's
//! profile (`deliver_v1`: `message.push` behind a ping/pong barrier; `deliver_v2`:
//! `chat.message` until its ack). Under v2, xAgent's own chat packets run per channel, in order,
//! on a worker of their own (`chat`), so a slow target holds up only its channel.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use async_tungstenite::tungstenite::protocol::CloseFrame;
use async_tungstenite::tungstenite::Error as WsError;
use async_tungstenite::tungstenite::Message;
use async_tungstenite::WebSocketStream;
use smol::future::FutureExt;
use smol::io::{AsyncRead, AsyncWrite};
use smol::stream::StreamExt;

use super::out::{self, Out, Outgoing};
use super::{blocking, SessionLink};
use crate::app::App;
use crate::channels::ChannelRecord;
use crate::ids;
use crate::json::{self, obj, s, Object, Value};
use crate::protocol::descriptor::{self, Target, ToolState};
use crate::protocol::{code, version_at_least, CardId, Packet, Profile, PROTOCOL_VERSION};
use crate::providers::Failure;
use crate::quiet;
use crate::source::Source;

/// Chat packets queued per channel at most; beyond it xAgent is told the channel is busy.
const CHAT_QUEUE: usize = 64;
/// Lines xAgent can cause at will, each logged at most once a minute: its `error` packets, a
/// hello naming another connector_id, failed auth flows and failed tool calls.
static PEER_ERRORS: quiet::Site = quiet::Site::new();
static OTHER_CONNECTOR_ID: quiet::Site = quiet::Site::new();
static AUTH_FAILURES: quiet::Site = quiet::Site::new();
static TOOL_FAILURES: quiet::Site = quiet::Site::new();

/// Per-session state shared by the reader and the delivery loop.
#[derive(Default)]
pub(super) struct State {
    /// Profiles enabled by `connector.hello` (intersection with the Card); `None` before hello.
    pub(super) profiles: Mutex<Option<Vec<String>>>,
    /// `ping` request IDs awaiting their `pong`.
    pub(super) barriers: Mutex<HashMap<String, smol::channel::Sender<()>>>,
    /// Messages sent but not yet past the boundary (v1) or acked (v2): (source, seqs).
    pub(super) in_flight: Mutex<Vec<(String, Vec<u64>)>>,
    /// Auth sessions of this connection: auth_session_id → (channel, flow_id, status, message).
    auth: Mutex<HashMap<String, AuthSession>>,
    /// v2: xAgent's chat packets per channel, each queue run in order by its worker.
    chat_workers: Mutex<HashMap<String, smol::channel::Sender<Packet>>>,
}

#[derive(Clone)]
struct AuthSession {
    cch: String,
    flow_id: String,
    status: &'static str,
    message: String,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs blocking store or network work off the async threads.
fn close_frame(code: CloseCode, reason: impl Into<String>) -> CloseFrame {
    CloseFrame {
        code,
        reason: reason.into().into(),
    }
}

/// The Close a read error calls for (RFC 6455 7.4.1): its code and a reason with no detail of
/// ours; `None` when the connection is already gone.
fn closing_error(e: &WsError) -> Option<CloseFrame> {
    match e {
        WsError::Protocol(_) | WsError::AttackAttempt => Some(close_frame(CloseCode::Protocol, "protocol error")),
        WsError::Utf8(_) => Some(close_frame(CloseCode::Invalid, "invalid UTF-8")),
        WsError::Capacity(_) => Some(close_frame(CloseCode::Size, "message too big")),
        _ => None,
    }
}

/// Serves one data-plane connection until it closes.
pub async fn run<S>(app: Arc<App>, ws: WebSocketStream<S>, peer: String)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut tx, mut rx) = ws.split();
    let (out_tx, out_rx) = out::queue();
    let (wake_tx, wake_rx) = smol::channel::bounded::<()>(1);
    let (stop_tx, stop_rx) = smol::channel::bounded::<String>(1);
    let id = app.hub.register(SessionLink {
        wake: wake_tx,
        out: out_tx.clone(),
        stop: stop_tx.clone(),
    });
    log::info!("data plane: session {id} with {peer} started");
    let state = Arc::new(State::default());

    let stop_writer = stop_tx.clone();
    let writer = crate::runtime::spawn(async move {
        while let Some(item) = out_rx.recv().await {
            match item {
                Outgoing::Frame { kind, text } => {
                    log::trace!("data plane: -> {kind}");
                    let n = text.len();
                    let deadline = out::write_deadline(n);
                    let sent = async { Some(tx.send(Message::text(text)).await.is_ok()) }
                        .or(async {
                            smol::Timer::after(deadline).await;
                            None
                        })
                        .await;
                    out_rx.done(n);
                    match sent {
                        Some(true) => {}
                        Some(false) => break,
                        None => {
                            // The peer stopped reading: end the session instead of queueing more.
                            let why = format!("the peer read nothing for {}s", deadline.as_secs());
                            let _ = stop_writer.try_send(why);
                            break;
                        }
                    }
                }
                Outgoing::Close(frame) => {
                    // After the peer's Close this sends the echo tungstenite queued.
                    let _ = async { tx.close(frame).await.is_ok() }
                        .or(async {
                            smol::Timer::after(out::WRITE_STALL).await;
                            false
                        })
                        .await;
                    break;
                }
            }
        }
    });
    let (ack_tx, ack_rx) = smol::channel::bounded::<super::deliver_v2::Ack>(CHAT_QUEUE);
    let delivery = match app.config.xagent.profile {
        Profile::V1 => crate::runtime::spawn(super::deliver_v1::run(
            app.clone(),
            id,
            state.clone(),
            out_tx.clone(),
            wake_rx,
            stop_tx.clone(),
        )),
        Profile::V2 => crate::runtime::spawn(super::deliver_v2::run(
            app.clone(),
            id,
            state.clone(),
            out_tx.clone(),
            wake_rx,
            ack_rx,
            stop_tx.clone(),
        )),
    };

    let (reason, close) = loop {
        // `Err`: the session was told to stop (shutdown, dead peer), with its reason.
        let next = async { Ok(rx.next().await) }
            .or(async { Err(stop_rx.recv().await.unwrap_or_else(|_| "stopped".to_string())) });
        let frame = match next.await {
            Ok(frame) => frame,
            Err(reason) => break (reason.clone(), Some(close_frame(CloseCode::Away, reason))),
        };
        match frame {
            None => break ("peer closed the connection".to_string(), None),
            Some(Err(e)) => break (format!("read error: {e}"), closing_error(&e)),
            Some(Ok(Message::Text(text))) => {
                // A large frame is parsed on the pool, as large request bodies are (front door).
                let parsed = if text.len() <= json::INLINE_PARSE {
                    Packet::parse(text.as_str())
                } else {
                    crate::runtime::unblock(move || Packet::parse(text.as_str())).await
                };
                let replies = handle(&app, id, &state, &out_tx, &ack_tx, parsed).await;
                for p in replies {
                    if out_tx.send(p).await.is_err() {
                        break;
                    }
                }
            }
            Some(Ok(Message::Binary(_))) => {
                let p = Packet::error_for(None, code::INVALID_PACKET, "data-plane packets are text frames");
                let _ = out_tx.send(p).await;
            }
            Some(Ok(Message::Close(_))) => {
                // tungstenite queued the echo (RFC 6455 5.5.1); the next read sends it (a close
                // on the sending half cannot once the peer has closed).
                let _ = async { rx.next().await.map(|_| ()) }
                    .or(async {
                        smol::Timer::after(Duration::from_secs(1)).await;
                        None
                    })
                    .await;
                break ("peer sent close".to_string(), None);
            }
            Some(Ok(_)) => {} // WebSocket-level ping/pong are answered by tungstenite.
        }
    };

    delivery.cancel().await;
    lock(&state.chat_workers).clear();
    if app.hub.unregister(id) {
        log::info!(
            "data plane: no xAgent connected; channels stay registered for the lease of {}",
            crate::config::fmt_duration(app.config.xagent.lease)
        );
        if let Err(e) = blocking(&app, |app| app.channels.set_offline_since(Some(ids::now_ms()))).await {
            log::error!("data plane: cannot record the start of the lease: {e}");
        }
    }
    out_tx.close(close).await;
    drop(out_tx);
    let _ = writer.await;
    // Whatever was pushed but not confirmed goes back to pending with one more attempt.
    let in_flight = std::mem::take(&mut *lock(&state.in_flight));
    if !in_flight.is_empty() {
        let why = format!("connection lost before the delivery barrier: {reason}");
        blocking(&app, move |app| {
            for (source, seqs) in in_flight {
                if let Err(e) = app.outbox.mark_attempt_failed(&source, &seqs, &why) {
                    log::error!("outbox: cannot record failed attempt for {source}: {e}");
                }
            }
        })
        .await;
    }
    log::info!("data plane: session {id} with {peer} ended: {reason}");
    drop(app);
    crate::runtime::released();
}

/// Answers one incoming text frame, parsed; returns the packets to send back.
async fn handle(
    app: &Arc<App>,
    id: u64,
    state: &Arc<State>,
    out: &Out,
    acks: &smol::channel::Sender<super::deliver_v2::Ack>,
    parsed: Result<Packet, String>,
) -> Vec<Packet> {
    let p = match parsed {
        Ok(p) => p,
        Err(why) => {
            log::debug!("data plane: session {id}: invalid packet: {why}");
            return vec![Packet::error_for(None, code::INVALID_PACKET, why)];
        }
    };
    log::trace!("data plane: <- {}", quiet::shown(&p.kind));
    let v2 = app.config.xagent.profile == Profile::V2 && lock(&state.profiles).is_some();
    match p.kind.as_str() {
        "connector.hello" => return vec![hello(app, id, state, &p).await],
        "ping" => return vec![Packet::answer(&p, "pong")],
        "pong" => {
            if let Some(tx) = p.request_id.as_ref().and_then(|r| lock(&state.barriers).remove(r)) {
                let _ = tx.try_send(());
            }
            return vec![];
        }
        "error" => {
            // xAgent may send these as fast as it likes: one line a minute, its text shown safely.
            if let Some(more) = PEER_ERRORS.admit() {
                let (c, m) = p.error.clone().unwrap_or_default();
                log::warn!(
                    "data plane: session {id}: peer reported error {}: {}{more}",
                    quiet::shown(&c),
                    quiet::shown(&m)
                );
            }
            return vec![];
        }
        // IM v2's packets; under v1 they stay unsupported, before hello they wait for it.
        "chat.message.ack" if v2 => {
            match super::deliver_v2::Ack::of(&p) {
                Some(a) => {
                    let _ = acks.try_send(a);
                }
                None => log::debug!("data plane: session {id}: an ack without reply_to, channel or message_id"),
            }
            return vec![];
        }
        "chat.message" | "chat.message.delta" | "chat.activity" if v2 => {
            return match open_channel_of(app, id, &p) {
                Ok(cch) => chat_in_turn(app, state, out, cch, p),
                Err(e) => vec![*e],
            };
        }
        _ => {}
    }
    let Some(profiles) = lock(&state.profiles).clone() else {
        return vec![Packet::error_for(
            Some(&p),
            code::HELLO_REQUIRED,
            "connector.hello must complete before any other packet",
        )];
    };
    match p.kind.as_str() {
        "channel.open" => vec![channel_open(app, id, &p, &profiles).await],
        "channel.close" => match p.channel_id() {
            None => vec![Packet::error_for(
                Some(&p),
                code::CHANNEL_ID_REQUIRED,
                "channel.close needs connector_channel_id",
            )],
            Some(cch) => {
                app.hub.close(cch, id);
                vec![Packet::answer(&p, "channel.close.ack").with_payload(obj([("status", s("ok"))]))]
            }
        },
        "connection.descriptor.get" | "auth.start" | "auth.status" | "auth.cancel" | "auth.logout" | "tool.invoke" => {
            let cch = match open_channel_of(app, id, &p) {
                Ok(c) => c,
                Err(e) => return vec![*e],
            };
            match p.kind.as_str() {
                "connection.descriptor.get" => {
                    let d = descriptor(app, &cch, &profiles).await;
                    vec![Packet::answer(&p, "connection.descriptor.get.ack")
                        .with_payload(obj([("connection_descriptor", d)]))]
                }
                "auth.start" => vec![auth_start(app, state, &p, &cch, &profiles).await],
                "auth.status" => vec![auth_status(app, state, &p, &cch, &profiles).await],
                "auth.cancel" => vec![auth_cancel(app, state, &p, &cch, &profiles).await],
                "auth.logout" => vec![auth_logout(app, &p, &cch, &profiles).await],
                _ => {
                    tool_invoke(app, &p, cch, out.clone());
                    vec![]
                }
            }
        }
        other => vec![Packet::error_for(
            Some(&p),
            code::UNSUPPORTED_PACKET,
            format!("packet type `{other}` is not supported by this connector"),
        )],
    }
}

/// Queues a chat packet to its channel's worker, started on first use; the worker ends with the
/// session. A full queue is answered at once: busy, try again.
fn chat_in_turn(app: &Arc<App>, state: &Arc<State>, out: &Out, cch: String, p: Packet) -> Vec<Packet> {
    let mut workers = lock(&state.chat_workers);
    let queue = workers.entry(cch.clone()).or_insert_with(|| {
        let (tx, rx) = smol::channel::bounded::<Packet>(CHAT_QUEUE);
        let (app, out, cch) = (app.clone(), out.clone(), cch.clone());
        crate::runtime::spawn(async move {
            while let Ok(p) = rx.recv().await {
                if let Some(reply) = super::chat::handle(&app, &cch, p).await {
                    if out.send(reply).await.is_err() {
                        break;
                    }
                }
            }
            drop(app);
            crate::runtime::released();
        })
        .detach();
        tx
    });
    match queue.try_send(p) {
        Ok(()) => vec![],
        Err(e) => {
            let p = e.into_inner();
            if p.kind != "chat.message" {
                return vec![];
            }
            let id = json::get_str(&p.payload, "message_id").unwrap_or_default().to_string();
            let ack = Packet::answer(&p, "chat.message.ack").with_payload(obj([
                ("message_id", s(id)),
                ("status", s("rejected")),
                ("code", s("busy")),
                ("message", s("too many messages waiting on this channel; try again")),
                ("retryable", json::b(true)),
            ]));
            vec![ack]
        }
    }
}

/// User-level packets need an envelope channel that is open on this session.
fn open_channel_of(app: &App, id: u64, p: &Packet) -> Result<String, Box<Packet>> {
    let Some(cch) = p.channel_id() else {
        return Err(Box::new(Packet::error_for(
            Some(p),
            code::CHANNEL_ID_REQUIRED,
            format!("{} needs connector_channel_id in the envelope", p.kind),
        )));
    };
    if !app.hub.is_open_on(cch, id) {
        return Err(Box::new(Packet::error_for(
            Some(p),
            code::CHANNEL_NOT_OPEN,
            format!("channel.open must complete on this connection before {}", p.kind),
        )));
    }
    Ok(cch.to_string())
}

async fn hello(app: &Arc<App>, id: u64, state: &State, p: &Packet) -> Packet {
    let pl = &p.payload;
    let ours = &app.config.server.card_id;
    let card_id = json::get_str(pl, "connector_card_id").unwrap_or_default();
    if card_id != ours.as_str() {
        // The named ID is the peer's: shown cut short, never echoed whole.
        let named: String = card_id.chars().take(CardId::MAX_LEN).collect();
        return Packet::error_for(
            Some(p),
            code::CARD_ID_MISMATCH,
            format!("this connector is {ours}, hello named `{}`", named.escape_debug()),
        );
    }
    match json::get_str(pl, "protocol_version") {
        Some(v) if version_at_least(v, PROTOCOL_VERSION) => {}
        Some(v) => {
            return Packet::error_for(
                Some(p),
                code::UNSUPPORTED_PROTOCOL_VERSION,
                format!("protocol_version {v} is below {PROTOCOL_VERSION}"),
            )
        }
        None => {
            return Packet::error_for(
                Some(p),
                code::UNSUPPORTED_PROTOCOL_VERSION,
                format!("hello must declare protocol_version (this connector speaks {PROTOCOL_VERSION})"),
            )
        }
    }
    let supported: Vec<String> = match json::get(pl, "supported_profiles") {
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|v| match v {
                Value::String(s) => Some(s.clone()),
                _ => None,
            })
            .collect(),
        _ => return Packet::error_for(Some(p), code::INVALID_PACKET, "hello must list supported_profiles"),
    };
    // The deployment speaks one profile (`[xagent] profile`): it is all hello can enable.
    let chosen = app.config.xagent.profile.as_str();
    let enabled: Vec<String> = supported.into_iter().filter(|s| s == chosen).take(1).collect();
    if enabled.is_empty() {
        return Packet::error_for(
            Some(p),
            "profile_not_supported",
            format!("this connector is configured for {chosen} ([xagent] profile), which hello did not list in supported_profiles"),
        );
    }
    if let Some(prev) = json::get_str(pl, "connector_id").filter(|c| !c.is_empty() && *c != app.connector_id) {
        if let Some(more) = OTHER_CONNECTOR_ID.admit() {
            log::info!(
                "data plane: xAgent knew connector_id {}; this device's state says {}{more}",
                quiet::shown(prev),
                app.connector_id
            );
        }
    }
    *lock(&state.profiles) = Some(enabled);
    if app.hub.authenticated(id) {
        // Back online within the lease: nothing will be unregistered. A commit: off the executor.
        if let Err(e) = blocking(app, |app| app.channels.set_offline_since(None)).await {
            log::error!("data plane: cannot record that xAgent is back: {e}");
        }
    }
    Packet::answer(p, "connector.hello.ack").with_payload(obj([
        ("connector_card_id", s(ours.as_str())),
        ("connector_id", s(&app.connector_id)),
        ("protocol_version", s(PROTOCOL_VERSION)),
    ]))
}

async fn descriptor(app: &Arc<App>, cch: &str, profiles: &[String]) -> Value {
    let (cch, profiles) = (cch.to_string(), profiles.to_vec());
    blocking(app, move |app| describe(app, &cch, &profiles)).await
}

/// The Connection Descriptor of a channel in its current state: the provider of its binding
/// describes it; every tool of the Card is listed, those its provider lacks as unavailable.
fn describe(app: &App, cch: &str, profiles: &[String]) -> Value {
    let target = |provider: &str, label: &str, display_name: String| Target {
        provider: provider.into(),
        label: label.into(),
        display_name,
        account_hint: None,
    };
    let rec = app.channels.channel(cch);
    let (status, target, tools) = match rec.as_ref().map(|r| r.as_ref().and_then(ChannelRecord::source)) {
        Err(e) => {
            log::debug!("data plane: cannot read channel {cch}: {e}");
            let why = "storage unavailable: try again later";
            (
                "error",
                target("imgate", "imgate", "imgate (storage unavailable)".into()),
                vec![("", ToolState::unavailable(why))],
            )
        }
        Ok(None) => (
            "created",
            target("imgate", "imgate", "imgate (not bound)".into()),
            vec![("", ToolState::unavailable("channel is not bound yet"))],
        ),
        Ok(Some(src)) => match app.providers.of(&src) {
            None => (
                "error",
                target(
                    src.provider(),
                    src.provider(),
                    format!("{} (provider not enabled)", src.provider()),
                ),
                vec![(
                    "",
                    ToolState::unavailable("the binding refers to a provider that is not enabled"),
                )],
            ),
            Some(p) => match p.describe(&src) {
                Ok(d) => (d.status, d.target, d.tools),
                Err(e) => {
                    log::debug!("data plane: cannot describe channel {cch}: {e}");
                    let label = p.label(&src);
                    let why = "storage unavailable: try again later";
                    (
                        "error",
                        target(p.name(), &label, format!("{label} (storage unavailable)")),
                        vec![("", ToolState::unavailable(why))],
                    )
                }
            },
        },
    };
    // The fallback state (tool "") applies to every Card tool the description does not name.
    let fallback = tools.iter().find(|(t, _)| t.is_empty()).map_or_else(
        || ToolState::unavailable("this channel cannot use it"),
        |(_, st)| st.clone(),
    );
    let states: Vec<(&str, ToolState)> = app
        .providers
        .tools()
        .into_iter()
        .map(|t| {
            let st = tools
                .iter()
                .find(|(id, _)| *id == t)
                .map_or_else(|| fallback.clone(), |(_, st)| st.clone());
            (t, st)
        })
        .collect();
    descriptor::build(
        app.config.server.card_id.as_str(),
        &app.connector_id,
        cch,
        profiles,
        status,
        &target,
        &states,
    )
}

async fn channel_open(app: &Arc<App>, id: u64, p: &Packet, profiles: &[String]) -> Packet {
    let requested = p.channel_id().map(str::to_string);
    let opened = blocking(app, move |app| app.channels.open_channel(requested.as_deref())).await;
    let (cch, reused) = match opened {
        Ok(v) => v,
        Err(e) => {
            log::error!("data plane: cannot persist channel: {e}");
            return Packet::error_for(
                Some(p),
                code::CHANNEL_UNAVAILABLE,
                "the connector cannot store channels right now",
            );
        }
    };
    if let Some(prev) = app.hub.open(&cch, id) {
        log::info!("data plane: channel {cch} moved from session {prev} to session {id}");
    }
    log::info!(
        "data plane: channel {cch} opened ({})",
        if reused { "reused" } else { "new" }
    );
    let d = descriptor(app, &cch, profiles).await;
    app.hub.wake_channel(&cch);
    let mut ack = Packet::answer(p, "channel.open.ack")
        .with_payload(obj([("connector_channel_id", s(&cch)), ("connection_descriptor", d)]));
    ack.channel = Some(cch);
    ack
}

fn auth_ack(p: &Packet, kind: &str, cch: &str, auth: &str, a: &AuthSession, d: Option<Value>) -> Packet {
    Packet::answer(p, kind).with_payload(obj([
        ("connector_channel_id", s(cch)),
        ("flow_id", s(&a.flow_id)),
        ("auth_session_id", s(auth)),
        ("status", s(a.status)),
        ("message", s(&a.message)),
        ("connection_descriptor", d.unwrap_or(Value::Null)),
    ]))
}

async fn auth_start(app: &Arc<App>, state: &State, p: &Packet, cch: &str, profiles: &[String]) -> Packet {
    let flow_id = json::get_str(&p.payload, "flow_id").unwrap_or_default().to_string();
    let input = json::get_obj(&p.payload, "input").cloned().unwrap_or_default();
    let auth_id = ids::short("auth_");
    let (cch_owned, flow) = (cch.to_string(), flow_id.clone());
    let result = blocking(app, move |app| -> Result<(Source, Option<String>), Failure> {
        let provider = app.providers.for_flow(&flow).ok_or_else(|| {
            Failure::new(
                code::INVALID_ARGUMENTS,
                format!("unknown auth flow `{flow}`; see the Connector Card's auth_flows"),
            )
        })?;
        let source = provider.bind(&flow, &input)?;
        let previous = app
            .channels
            .bind(&cch_owned, &source)
            .map_err(|e| Failure::new(code::TOOL_INVOKE_FAILED, format!("cannot store the binding: {e}")))?;
        Ok((source, previous))
    })
    .await;
    let session = match &result {
        Ok((source, previous)) => {
            log::info!("data plane: channel {cch} bound to {source}");
            if let Some(prev) = previous {
                log::info!("data plane: channel {prev} lost {source} to channel {cch}");
                let d = descriptor(app, prev, profiles).await;
                let push = Packet::new("connection.descriptor.push")
                    .with_channel(prev)
                    .with_payload(obj([("connection_descriptor", d)]));
                app.hub.send_to_channel(prev, push);
            }
            bindings_changed(app).await;
            app.hub.wake_channel(cch);
            AuthSession {
                cch: cch.to_string(),
                flow_id,
                status: "authenticated",
                message: format!("Bound to {source}"),
            }
        }
        Err(f) => {
            if let Some(more) = AUTH_FAILURES.admit() {
                log::info!(
                    "data plane: channel {cch}: auth flow `{}` failed: {}{more}",
                    quiet::shown(&flow_id),
                    quiet::shown(&f.message)
                );
            }
            AuthSession {
                cch: cch.to_string(),
                flow_id,
                status: "failed",
                message: f.message.clone(),
            }
        }
    };
    lock(&state.auth).insert(auth_id.clone(), session.clone());
    let d = descriptor(app, cch, profiles).await;
    auth_ack(p, "auth.start.ack", cch, &auth_id, &session, Some(d))
}

fn find_auth(state: &State, p: &Packet, cch: &str) -> Option<(String, AuthSession)> {
    let auth_id = json::get_str(&p.payload, "auth_session_id")?;
    let a = lock(&state.auth).get(auth_id).cloned()?;
    (a.cch == cch).then(|| (auth_id.to_string(), a))
}

async fn auth_status(app: &Arc<App>, state: &State, p: &Packet, cch: &str, profiles: &[String]) -> Packet {
    match find_auth(state, p, cch) {
        Some((auth_id, a)) => {
            let d = descriptor(app, cch, profiles).await;
            auth_ack(p, "auth.status.ack", cch, &auth_id, &a, Some(d))
        }
        None => Packet::answer(p, "auth.status.ack")
            .with_error(code::AUTH_SESSION_NOT_FOUND, "no such auth session on this channel"),
    }
}

async fn auth_cancel(app: &Arc<App>, state: &State, p: &Packet, cch: &str, profiles: &[String]) -> Packet {
    let auth_id = json::get_str(&p.payload, "auth_session_id")
        .unwrap_or_default()
        .to_string();
    // Form flows finish inside auth.start, so there is never anything left to cancel.
    let (status, auth_status, d) = match find_auth(state, p, cch) {
        Some((_, a)) if a.status == "authenticated" => {
            ("ignored", "authenticated", Some(descriptor(app, cch, profiles).await))
        }
        Some(_) => ("ignored", "unauthenticated", None),
        None => ("not_found", "unauthenticated", None),
    };
    Packet::answer(p, "auth.cancel.ack").with_payload(obj([
        ("connector_channel_id", s(cch)),
        ("auth_session_id", s(auth_id)),
        ("status", s(status)),
        ("auth_status", s(auth_status)),
        ("connection_descriptor", d.unwrap_or(Value::Null)),
    ]))
}

/// Providers follow the bindings (pollers, stored tokens).
async fn bindings_changed(app: &Arc<App>) {
    blocking(app, |app| app.providers.bindings_changed(&app.channels)).await;
}

async fn auth_logout(app: &Arc<App>, p: &Packet, cch: &str, profiles: &[String]) -> Packet {
    let c = cch.to_string();
    match blocking(app, move |app| app.channels.unbind(&c)).await {
        Ok(old) => {
            if let Some(src) = old {
                log::info!("data plane: channel {cch} unbound from {src}");
                bindings_changed(app).await;
            }
            let d = descriptor(app, cch, profiles).await;
            Packet::answer(p, "auth.logout.ack").with_payload(obj([("status", s("ok")), ("connection_descriptor", d)]))
        }
        Err(e) => {
            log::error!("data plane: cannot unbind {cch}: {e}");
            Packet::answer(p, "auth.logout.ack")
                .with_error(code::TOOL_INVOKE_FAILED, "cannot store the change right now")
        }
    }
}

/// Runs a tool in the background; its ack is queued when it finishes.
fn tool_invoke(app: &Arc<App>, p: &Packet, cch: String, out: Out) {
    let app = app.clone();
    let p = p.clone();
    crate::runtime::spawn(async move {
        let tool_id = json::get_str(&p.payload, "tool_id").unwrap_or_default().to_string();
        let args: Object = json::get_obj(&p.payload, "arguments").cloned().unwrap_or_default();
        let call_id = json::get_obj(&p.payload, "context")
            .and_then(|c| json::get_str(c, "tool_call_id"))
            .filter(|c| !c.is_empty())
            .map(str::to_string);
        let (t, c) = (tool_id.clone(), cch.clone());
        let outcome = blocking(&app, move |app| {
            super::tools::run(app, &c, &t, &args, call_id.as_deref())
        })
        .await;
        let ack = Packet::answer(&p, "tool.invoke.ack");
        let ack = match outcome {
            Ok(result) => ack.with_payload(obj([("tool_id", s(&tool_id)), ("result", result)])),
            Err(f) => {
                if let Some(more) = TOOL_FAILURES.admit() {
                    log::info!(
                        "data plane: channel {cch}: {} failed: {} ({}){more}",
                        quiet::shown(&tool_id),
                        f.code,
                        quiet::shown(&f.message)
                    );
                }
                ack.with_payload(obj([("tool_id", s(&tool_id))]))
                    .with_error(f.code, f.message)
            }
        };
        let _ = out.send(ack).await;
        drop(app);
        crate::runtime::released();
    })
    .detach();
}
