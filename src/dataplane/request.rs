//! xAgent's packets, read once into what the session routes on: the packet type as an enum,
//! and the payload fields its owner acts on. Every string here came from the peer; envelope
//! fields are bounded by `Packet::parse`, payload strings are only compared or shown through
//! `quiet::shown`.

use crate::json::{self, Object, Value};
use crate::protocol::{Packet, Profile};

/// What a packet asks for.
#[derive(Debug)]
pub(super) enum Request {
    Hello,
    Ping,
    Pong(Option<String>),
    /// The peer's `error` packet: logged, never answered.
    PeerError,
    ChannelOpen,
    ChannelClose,
    /// Acts on the envelope's channel, which must be open on this connection.
    OnChannel(OnChannel),
    /// IM v2: xAgent's ack of one of our messages (`None`: it lacks what matching needs).
    ChatAck(Option<Ack>),
    /// A type this connector does not serve (or the other profile's).
    Unsupported,
}

/// The packets that act on an open channel.
#[derive(Debug)]
pub(super) enum OnChannel {
    DescriptorGet,
    Auth(Auth),
    ToolInvoke,
    /// IM v2: xAgent's own `chat.message`, `chat.message.delta` or `chat.activity`.
    Chat,
}

/// The auth packets (common protocol 8.7–8.14).
#[derive(Debug)]
pub(super) enum Auth {
    Start { flow_id: String, input: Object },
    Status { auth_session_id: String, refresh: bool },
    Cancel { auth_session_id: String },
    Logout,
}

/// xAgent's `chat.message.ack` for one of our messages.
#[derive(Debug, PartialEq)]
pub(crate) struct Ack {
    pub reply_to: String,
    pub channel: String,
    pub message_id: String,
    pub status: String,
    pub code: String,
    pub message: String,
    pub retryable: bool,
}

impl Ack {
    fn of(p: &Packet) -> Option<Ack> {
        let pl = &p.payload;
        Some(Ack {
            reply_to: p.reply_to.clone()?,
            channel: p.channel_id()?.to_string(),
            message_id: json::get_str(pl, "message_id")?.to_string(),
            status: json::get_str(pl, "status")?.to_string(),
            code: json::get_str(pl, "code").unwrap_or("rejected").to_string(),
            message: json::get_str(pl, "message").unwrap_or_default().to_string(),
            retryable: matches!(pl.get("retryable"), Some(Value::Bool(true))),
        })
    }
}

fn text(pl: &Object, key: &str) -> String {
    json::get_str(pl, key).unwrap_or_default().to_string()
}

impl Request {
    /// Reads a packet of a deployment speaking `profile`.
    pub fn of(p: &Packet, profile: Profile) -> Request {
        let pl = &p.payload;
        let v2 = profile == Profile::V2;
        match p.kind.as_str() {
            "connector.hello" => Request::Hello,
            "ping" => Request::Ping,
            "pong" => Request::Pong(p.request_id.clone()),
            "error" => Request::PeerError,
            "channel.open" => Request::ChannelOpen,
            "channel.close" => Request::ChannelClose,
            "connection.descriptor.get" => Request::OnChannel(OnChannel::DescriptorGet),
            "auth.start" => Request::OnChannel(OnChannel::Auth(Auth::Start {
                flow_id: text(pl, "flow_id"),
                input: json::get_obj(pl, "input").cloned().unwrap_or_default(),
            })),
            "auth.status" => Request::OnChannel(OnChannel::Auth(Auth::Status {
                auth_session_id: text(pl, "auth_session_id"),
                refresh: matches!(pl.get("refresh"), Some(Value::Bool(true))),
            })),
            "auth.cancel" => Request::OnChannel(OnChannel::Auth(Auth::Cancel {
                auth_session_id: text(pl, "auth_session_id"),
            })),
            "auth.logout" => Request::OnChannel(OnChannel::Auth(Auth::Logout)),
            "tool.invoke" => Request::OnChannel(OnChannel::ToolInvoke),
            "chat.message.ack" if v2 => Request::ChatAck(Ack::of(p)),
            "chat.message" | "chat.message.delta" | "chat.activity" if v2 => Request::OnChannel(OnChannel::Chat),
            _ => Request::Unsupported,
        }
    }

    /// Answered before `connector.hello` too.
    pub fn before_hello(&self) -> bool {
        matches!(
            self,
            Request::Hello | Request::Ping | Request::Pong(_) | Request::PeerError
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::json::{b, obj, s};

    fn packet(kind: &str, payload: Value) -> Packet {
        let mut p = Packet::new(kind).with_payload(payload);
        p.channel = Some("cch_1".into());
        p
    }

    #[test]
    fn packets_are_read_once_into_their_request_and_the_other_profile_is_unsupported() {
        let status = packet(
            "auth.status",
            obj([("auth_session_id", s("auth_1")), ("refresh", b(true))]),
        );
        assert!(matches!(
            Request::of(&status, Profile::V1),
            Request::OnChannel(OnChannel::Auth(Auth::Status { auth_session_id, refresh: true })) if auth_session_id == "auth_1"
        ));
        let chat = packet("chat.message", obj([]));
        assert!(matches!(Request::of(&chat, Profile::V1), Request::Unsupported));
        let v2 = Request::of(&chat, Profile::V2);
        assert!(!v2.before_hello());
        assert!(matches!(v2, Request::OnChannel(OnChannel::Chat)));
        let mut ack = packet(
            "chat.message.ack",
            obj([("message_id", s("m")), ("status", s("accepted"))]),
        );
        assert!(
            matches!(Request::of(&ack, Profile::V2), Request::ChatAck(None)),
            "no reply_to"
        );
        ack.reply_to = Some("pkt_1".into());
        let Request::ChatAck(Some(a)) = Request::of(&ack, Profile::V2) else {
            panic!("a whole ack is read")
        };
        assert_eq!(
            (a.channel.as_str(), a.code.as_str(), a.retryable),
            ("cch_1", "rejected", false)
        );
        assert!(matches!(
            Request::of(&packet("made.up", obj([])), Profile::V2),
            Request::Unsupported
        ));
    }
}
