//! The WebSocket handshake on `{prefix}/ws` (RFC 6455 4.2), done here on the head the front door
//! already parsed, so tungstenite never parses a client's HTTP bytes: it gets the stream after
//! the `101`, with whatever frames the client sent early.

use std::sync::Arc;

use async_tungstenite::tungstenite::protocol::Role;
use async_tungstenite::WebSocketStream;
use smol::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::conn::{head_bytes, Answer, Body};
use super::head::Head;
use crate::cork::Corked;
use crate::dataplane::Plane;
use crate::ids;
use crate::protocol::SUBPROTOCOL;

/// RFC 6455 1.3.
const GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

/// A `Sec-WebSocket-Key`: base64 of 16 bytes (24 characters, two of them padding).
fn valid_key(key: &str) -> bool {
    key.len() == 24
        && key.ends_with("==")
        && key.as_bytes()[..22]
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || *b == b'+' || *b == b'/')
}

/// `Sec-WebSocket-Accept` for a key.
pub fn accept_key(key: &str) -> String {
    let digest = ring::digest::digest(
        &ring::digest::SHA1_FOR_LEGACY_USE_ONLY,
        format!("{key}{GUID}").as_bytes(),
    );
    ids::base64(digest.as_ref())
}

/// Why an upgrade is refused, as its answer and the cause counted.
fn check(plane: &Plane, head: &Head) -> Result<String, Box<(Answer, &'static str)>> {
    let refuse = |a: Answer, why| Err(Box::new((a.closing(), why)));
    if !head.has_token("Upgrade", "websocket") || !head.has_token("Connection", "upgrade") {
        // RFC 9110 15.5.22: a 426 names the protocol to upgrade to.
        let mut a = Answer::error(426, "websocket_upgrade_required");
        a.headers.push(("Upgrade", "websocket".into()));
        return refuse(a, "not a WebSocket upgrade");
    }
    if let Some(key) = &plane.config.server.api_key {
        let given = head.header("Authorization").and_then(ids::bearer).unwrap_or("");
        if !ids::secret_eq(given, key.expose()) {
            return refuse(Answer::error(401, "unauthorized"), "missing or wrong API key");
        }
    }
    if !head.has_token("Sec-WebSocket-Protocol", SUBPROTOCOL) {
        let body = format!("{{\"error\":\"subprotocol_required\",\"detail\":\"offer {SUBPROTOCOL}\"}}");
        return refuse(Answer::json(400, body), "packet subprotocol not offered");
    }
    if head.header("Sec-WebSocket-Version") != Some("13") {
        let mut a = Answer::error(426, "websocket_version_13_required");
        a.headers.push(("Sec-WebSocket-Version", "13".into()));
        return refuse(a, "not WebSocket version 13");
    }
    match head.header("Sec-WebSocket-Key").filter(|k| valid_key(k)) {
        Some(key) => Ok(accept_key(key)),
        None => refuse(Answer::error(400, "bad_websocket_key"), "malformed Sec-WebSocket-Key"),
    }
}

/// Completes (or refuses) an upgrade and runs the data-plane session on it. The refusal's
/// cause is returned for counting.
pub async fn upgrade<S>(
    plane: Arc<Plane>,
    head: Head,
    mut stream: S,
    early: Vec<u8>,
    peer: String,
) -> Option<&'static str>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let accept = match check(&plane, &head) {
        Ok(accept) => accept,
        Err(refused) => {
            let (answer, why) = *refused;
            if let Body::Bytes(body) = &answer.body {
                let mut out = head_bytes(answer.status, &answer.headers, body.len() as u64, true);
                out.extend_from_slice(body);
                let _ = stream.write_all(&out).await;
            }
            return Some(why);
        }
    };
    let switching = format!(
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\nSec-WebSocket-Protocol: {SUBPROTOCOL}\r\n\r\n"
    );
    if stream.write_all(switching.as_bytes()).await.is_err() {
        return None;
    }
    let ws = WebSocketStream::from_partially_read(
        Corked::new(stream),
        early,
        Role::Server,
        Some(crate::dataplane::ws_config()),
    )
    .await;
    crate::dataplane::session::run(plane, ws, peer).await;
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_accept_key_is_the_one_rfc_6455_gives() {
        // RFC 6455 1.3's example.
        assert_eq!(accept_key("dGhlIHNhbXBsZSBub25jZQ=="), "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=");
        assert!(valid_key("dGhlIHNhbXBsZSBub25jZQ=="));
        assert!(!valid_key("dGhlIHNhbXBsZSBub25jZQ") && !valid_key("dGhlIHNhbXBsZSBub25jZ\u{0}=="));
    }
}
