//! The packet engine: one WebSocket session, whoever dialled whom. A router, not an owner.
//!
//! Three tasks per session: the reader (this module: it reads each packet once into a
//! `Request` and hands it to the module that owns its state), the writer (the only one
//! touching the socket's send half) and the profile's delivery (`delivery`). Under v2,
//! xAgent's own chat packets run per channel, in order, on a worker of their own (`chat`), so a
//! slow target holds up only its channel; tool calls run in the background and queue their ack.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use async_tungstenite::tungstenite::protocol::CloseFrame;
use async_tungstenite::tungstenite::Error as WsError;
use async_tungstenite::tungstenite::Message;
use async_tungstenite::WebSocketStream;
use smol::future::FutureExt;
use smol::io::{AsyncRead, AsyncWrite};
use smol::stream::StreamExt;

use super::delivery::Delivery;
use super::out::{self, Out, Outgoing};
use super::request::{Auth, OnChannel, Request};
use super::{auth, blocking, control, Plane};
use crate::cork::{Cork, Corked};
use crate::hub::{Link, SessionId};
use crate::ids;
use crate::json::{self, obj, s, Object};
use crate::protocol::{code, Packet};
use crate::providers::Failure;
use crate::quiet;

/// Chat packets queued per channel at most; beyond it xAgent is told the channel is busy.
const CHAT_QUEUE: usize = 64;
/// Lines xAgent can cause at will, each logged at most once a minute: its `error` packets and
/// failed tool calls.
static PEER_ERRORS: quiet::Site = quiet::Site::new();
static TOOL_FAILURES: quiet::Site = quiet::Site::new();

/// How the hub reaches this session.
struct SessionLink {
    /// Wakes the delivery (capacity 1: wake-ups coalesce).
    wake: smol::channel::Sender<()>,
    out: Out,
    stop: smol::channel::Sender<String>,
}

impl Link for SessionLink {
    fn wake(&self) {
        let _ = self.wake.try_send(());
    }

    fn push(&self, packet: Packet) -> bool {
        self.out.try_send(packet)
    }

    fn stop(&self, reason: &str) {
        let _ = self.stop.try_send(reason.to_string());
    }
}

/// What the reader holds for its connection.
struct Session {
    plane: Arc<Plane>,
    id: SessionId,
    out: Out,
    delivery: Delivery,
    /// `connector.hello` completed (it enables the deployment's one profile).
    hello_done: bool,
    /// v2: xAgent's chat packets per channel, each queue run in order by its worker.
    chat_workers: HashMap<String, smol::channel::Sender<Packet>>,
    /// Tool calls running now (each holds a blocking thread until its provider answers).
    tools_running: Arc<AtomicUsize>,
}

/// Tool calls one connection may have running at once; more are answered `busy` at once,
/// so a flood of `tool.invoke` costs neither threads nor memory past this.
const TOOLS_AT_ONCE: usize = 16;

/// A tool call is answered within this, whatever its thread does: a thread stuck or waiting for
/// the pool, or a send of several parts (a file, a long text) whose calls to the IM system take
/// their own time each (20 s at most). The send may still complete: a repeat with the same
/// `tool_call_id` is `busy` while it runs and gets its result after.
const TOOL_ANSWER_DEADLINE: Duration = Duration::from_secs(25);

/// One running tool call's place in `Session::tools_running`, given back when it answers.
struct ToolTurn(Arc<AtomicUsize>);

impl Drop for ToolTurn {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

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
pub async fn run<S>(plane: Arc<Plane>, ws: WebSocketStream<Corked<S>>, peer: String)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let cork = ws.get_ref().cork();
    let (tx, mut rx) = ws.split();
    let (out_tx, out_rx) = out::queue();
    let (wake_tx, wake_rx) = smol::channel::bounded::<()>(1);
    let (stop_tx, stop_rx) = smol::channel::bounded::<String>(1);
    let id = plane.hub.register(Box::new(SessionLink {
        wake: wake_tx,
        out: out_tx.clone(),
        stop: stop_tx.clone(),
    }));
    log::info!("data plane: session {id} with {peer} started");
    let started = std::time::Instant::now();
    let writer = crate::runtime::spawn(write(tx, cork, out_rx, stop_tx.clone()));
    let mut session = Session {
        delivery: Delivery::start(plane.clone(), id, out_tx.clone(), wake_rx, stop_tx),
        plane,
        id,
        out: out_tx,
        hello_done: false,
        chat_workers: HashMap::new(),
        tools_running: Arc::new(AtomicUsize::new(0)),
    };

    // A peer that keeps the socket full (a flood of pings) must not hold up other connections.
    let mut fair = crate::runtime::Fair::default();
    let (reason, close) = loop {
        fair.turn().await;
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
                let replies = match parsed {
                    Ok(p) => session.route(p).await,
                    Err(why) => {
                        log::debug!("data plane: session {id}: invalid packet: {why}");
                        vec![Packet::error_for(None, code::INVALID_PACKET, why)]
                    }
                };
                for p in replies {
                    if session.out.send(p).await.is_err() {
                        break;
                    }
                }
            }
            Some(Ok(Message::Binary(_))) => {
                let p = Packet::error_for(None, code::INVALID_PACKET, "data-plane packets are text frames");
                let _ = session.out.send(p).await;
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
    session.end(writer, &reason, close).await;
    log::info!(
        "data plane: session {id} with {peer} ended: {reason} (after {:.1} s)",
        started.elapsed().as_secs_f64()
    );
    crate::runtime::released();
}

/// The writer: the only user of the socket's send half. It ends the session when a frame is
/// not written by its deadline (the peer stopped reading). While another frame is already
/// queued it holds the cork, so a burst (pushes and their ping) leaves in one write; the last
/// frame's deadline then covers what was held with it (`cork::MAX_HELD`, 4 s at `MIN_RATE`).
async fn write<S>(
    mut tx: async_tungstenite::WebSocketSender<S>,
    cork: Cork,
    out_rx: out::OutRx,
    stop: smol::channel::Sender<String>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    while let Some(item) = out_rx.recv().await {
        cork.hold(matches!(item, Outgoing::Frame { .. }) && !out_rx.is_empty());
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
                        let _ = stop.try_send(why);
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
}

impl Session {
    /// Answers one packet; returns the packets to send back.
    async fn route(&mut self, p: Packet) -> Vec<Packet> {
        log::trace!("data plane: <- {}", quiet::shown(&p.kind));
        let request = Request::of(&p, self.plane.config.xagent.profile);
        if !self.hello_done && !request.before_hello() {
            return vec![Packet::error_for(
                Some(&p),
                code::HELLO_REQUIRED,
                "connector.hello must complete before any other packet",
            )];
        }
        match request {
            Request::Hello => vec![self.hello(&p).await],
            Request::Ping => vec![Packet::answer(&p, "pong")],
            Request::Pong(Some(request_id)) => {
                self.delivery.pong(request_id);
                vec![]
            }
            Request::Pong(None) => vec![],
            Request::PeerError => {
                // xAgent may send these as fast as it likes: one line a minute, its text shown safely.
                if let Some(more) = PEER_ERRORS.admit() {
                    let (c, m) = p.error.clone().unwrap_or_default();
                    log::warn!(
                        "data plane: session {}: peer reported error {}: {}{more}",
                        self.id,
                        quiet::shown(&c),
                        quiet::shown(&m)
                    );
                }
                vec![]
            }
            Request::ChannelOpen => vec![control::open(&self.plane, self.id, &p).await],
            Request::ChannelClose => vec![control::close(&self.plane, self.id, &p)],
            Request::OnChannel(r) => match self.open_channel_of(&p) {
                Ok(cch) => self.on_channel(r, p, cch).await,
                Err(e) => vec![*e],
            },
            Request::ChatAck(Some(ack)) => {
                self.delivery.ack(ack);
                vec![]
            }
            Request::ChatAck(None) => {
                log::debug!(
                    "data plane: session {}: an ack without reply_to, channel or message_id",
                    self.id
                );
                vec![]
            }
            Request::Unsupported => vec![Packet::error_for(
                Some(&p),
                code::UNSUPPORTED_PACKET,
                format!("packet type `{}` is not supported by this connector", p.kind),
            )],
        }
    }

    /// A packet on channel `cch`, open on this session.
    async fn on_channel(&mut self, r: OnChannel, p: Packet, cch: String) -> Vec<Packet> {
        match r {
            OnChannel::DescriptorGet => {
                let d = control::descriptor(&self.plane, &cch).await;
                vec![Packet::answer(&p, "connection.descriptor.get.ack")
                    .with_payload(obj([("connection_descriptor", d)]))]
            }
            OnChannel::Auth(a) => vec![self.auth(p, a, cch).await],
            OnChannel::ToolInvoke => {
                if self.tools_running.fetch_add(1, Ordering::SeqCst) >= TOOLS_AT_ONCE {
                    self.tools_running.fetch_sub(1, Ordering::SeqCst);
                    let tool_id = json::get_str(&p.payload, "tool_id").unwrap_or_default();
                    let busy = Packet::answer(&p, "tool.invoke.ack")
                        .with_payload(obj([("tool_id", s(tool_id))]))
                        .with_error(
                            code::BUSY,
                            format!("{TOOLS_AT_ONCE} tool calls are running on this connection; try again"),
                        );
                    return vec![busy];
                }
                let turn = ToolTurn(self.tools_running.clone());
                tool_invoke(&self.plane, p, cch, self.out.clone(), turn);
                vec![]
            }
            OnChannel::Chat => self.chat_in_turn(cch, p),
        }
    }

    async fn hello(&mut self, p: &Packet) -> Packet {
        if let Err(answer) = control::hello(&self.plane, p) {
            return *answer;
        }
        self.hello_done = true;
        self.delivery.ready();
        if self.plane.hub.authenticated(self.id) {
            // Back online within the lease: nothing will be unregistered. A commit: off the executor.
            if let Err(e) = blocking(&self.plane, |plane| plane.channels.set_offline_since(None)).await {
                log::error!("data plane: cannot record that xAgent is back: {e}");
            }
        }
        control::hello_ack(&self.plane, p)
    }

    /// User-level packets need an envelope channel that is open on this session.
    fn open_channel_of(&self, p: &Packet) -> Result<String, Box<Packet>> {
        let Some(cch) = p.channel_id() else {
            return Err(Box::new(Packet::error_for(
                Some(p),
                code::CHANNEL_ID_REQUIRED,
                format!("{} needs connector_channel_id in the envelope", p.kind),
            )));
        };
        if !self.plane.hub.is_open_on(cch, self.id) {
            return Err(Box::new(Packet::error_for(
                Some(p),
                code::CHANNEL_NOT_OPEN,
                format!("channel.open must complete on this connection before {}", p.kind),
            )));
        }
        Ok(cch.to_string())
    }

    /// An auth packet: the login state machine runs on the pool; then the hub, the providers
    /// and the channels that lost a source follow the change.
    async fn auth(&self, p: Packet, a: Auth, cch: String) -> Packet {
        let (packet, channel) = (p, cch.clone());
        let outcome = blocking(&self.plane, move |plane| auth::run(plane, &packet, &a, &channel)).await;
        if let Some(prev) = &outcome.moved_from {
            log::info!("data plane: channel {prev} lost its source to channel {cch}");
            self.plane.hub.bound(prev, None);
            control::push_descriptor(&self.plane, prev).await;
        }
        if let Some(source) = outcome.bound {
            self.plane.hub.bound(&cch, source);
            // Providers follow the bindings (pollers, stored tokens).
            blocking(&self.plane, |plane| plane.providers.bindings_changed(&plane.channels)).await;
            self.plane.hub.wake_channel(&cch);
        }
        let mut answer = outcome.answer;
        if auth::wants_descriptor(&answer) {
            let d = control::descriptor(&self.plane, &cch).await;
            answer.payload.insert("connection_descriptor".into(), d);
        }
        answer
    }

    /// Queues a chat packet to its channel's worker, started on first use; the worker ends with
    /// the session. A full queue is answered at once: busy, try again.
    fn chat_in_turn(&mut self, cch: String, p: Packet) -> Vec<Packet> {
        let queue = self.chat_workers.entry(cch.clone()).or_insert_with(|| {
            let (tx, rx) = smol::channel::bounded::<Packet>(CHAT_QUEUE);
            let (plane, out) = (self.plane.clone(), self.out.clone());
            crate::runtime::spawn(async move {
                while let Ok(p) = rx.recv().await {
                    if let Some(reply) = super::chat::handle(&plane, &cch, p).await {
                        if out.send(reply).await.is_err() {
                            break;
                        }
                    }
                }
                drop(plane);
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

    /// The connection ended: delivery stops (what it sent unconfirmed goes back to pending),
    /// the hub forgets the session (the lease may start), the writer sends the close.
    async fn end(self, writer: smol::Task<()>, reason: &str, close: Option<CloseFrame>) {
        let Session {
            plane,
            id,
            out,
            delivery,
            chat_workers,
            ..
        } = self;
        let unconfirmed = delivery.stop().await;
        drop(chat_workers);
        if plane.hub.unregister(id) {
            log::info!(
                "data plane: no xAgent connected; channels stay registered for the lease of {}",
                crate::config::fmt_duration(plane.config.xagent.lease)
            );
            if let Err(e) = blocking(&plane, |plane| plane.channels.set_offline_since(Some(ids::now_ms()))).await {
                log::error!("data plane: cannot record the start of the lease: {e}");
            }
        }
        out.close(close).await;
        drop(out);
        let _ = writer.await;
        unconfirmed.back_to_pending(&plane, reason).await;
    }
}

/// Runs a tool in the background; its ack is queued when it finishes.
fn tool_invoke(plane: &Arc<Plane>, p: Packet, cch: String, out: Out, turn: ToolTurn) {
    let plane = plane.clone();
    crate::runtime::spawn(async move {
        let tool_id = json::get_str(&p.payload, "tool_id").unwrap_or_default().to_string();
        let args: Object = json::get_obj(&p.payload, "arguments").cloned().unwrap_or_default();
        let call_id = json::get_obj(&p.payload, "context")
            .and_then(|c| json::get_str(c, "tool_call_id"))
            .filter(|c| !c.is_empty())
            .map(str::to_string);
        let (t, c) = (tool_id.clone(), cch.clone());
        // The turn goes with the thread: a call answered at the deadline below still holds
        // its place until its thread is free, so stuck calls cannot take more threads.
        let running = blocking(&plane, move |plane| {
            let _turn = turn;
            super::tools::run(plane, &c, &t, &args, call_id.as_deref())
        });
        let outcome = running
            .or(async {
                smol::Timer::after(TOOL_ANSWER_DEADLINE).await;
                Err(Failure::new(
                    code::TOOL_INVOKE_FAILED,
                    format!(
                        "no answer from the IM system within {} s; the message may still be sent \
                         (repeat it only with the same tool_call_id)",
                        TOOL_ANSWER_DEADLINE.as_secs()
                    ),
                ))
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
        drop(plane);
        crate::runtime::released();
    })
    .detach();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cork::recorder::Recorder;
    use async_tungstenite::tungstenite::protocol::Role;

    /// Runs the writer over a recording stream until the queue's senders are gone; what it
    /// wrote, write by write.
    fn written(frames: usize) -> Vec<Vec<u8>> {
        smol::block_on(async {
            let recorder = Recorder::default();
            let stream = Corked::new(recorder.clone());
            let cork = stream.cork();
            let (tx, _rx) = WebSocketStream::from_raw_socket(stream, Role::Server, None)
                .await
                .split();
            let (out, out_rx) = out::queue();
            for _ in 0..frames {
                out.send(Packet::new("message.push")).await.unwrap();
            }
            drop(out);
            let (stop, _stopped) = smol::channel::bounded(1);
            write(tx, cork, out_rx, stop).await;
            recorder.writes()
        })
    }

    #[test]
    fn frames_queued_together_leave_in_one_write_and_a_lone_frame_in_its_own() {
        let burst = written(5);
        assert_eq!(burst.len(), 1, "five queued frames, one write");
        assert_eq!(
            burst[0].windows(12).filter(|w| w == b"message.push").count(),
            5,
            "all five frames in it"
        );
        assert_eq!(written(1).len(), 1);
    }
}
