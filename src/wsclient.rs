//! Dialing out over WebSocket: `ws://` or `wss://` (rustls with the ring provider, the public web
//! roots plus an optional private CA). Used by the data plane's dial transport and by providers
//! whose IM system pushes events over a connection the app opens itself.

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_tungstenite::tungstenite::client::IntoClientRequest;
use async_tungstenite::tungstenite::handshake::client::Request;
use async_tungstenite::tungstenite::protocol::WebSocketConfig;
use async_tungstenite::WebSocketStream;
use smol::future::FutureExt;
use smol::io::{AsyncRead, AsyncWrite};
use smol::net::TcpStream;

use crate::cork::Corked;

/// The one WebSocket configuration of every socket imgate holds (its `/ws`, the dial-out, the
/// long connections of providers): frames and messages of at most `max_message` bytes, and what
/// waits to be written bounded too. A peer that sends pings and never reads would otherwise
/// have a pong queued for each, without end; with the bound, tungstenite keeps only the latest
/// pong once the buffer is full (RFC 6455 5.5.3: answering the most recent ping is enough).
pub fn bounded_config(max_message: usize) -> WebSocketConfig {
    let config = WebSocketConfig::default();
    // What tungstenite gathers before it writes (its default), one whole message past it, and
    // room for that message's frame header.
    let most = config.write_buffer_size.saturating_add(max_message).saturating_add(64);
    config
        .max_message_size(Some(max_message))
        .max_frame_size(Some(max_message))
        .max_write_buffer_size(most)
}

/// A parsed `ws://` or `wss://` URL.
#[derive(Debug, PartialEq)]
pub struct Target {
    pub tls: bool,
    pub host: String,
    pub port: u16,
}

pub fn parse_url(url: &str) -> Result<Target, String> {
    let (tls, rest) = if let Some(r) = url.strip_prefix("wss://") {
        (true, r)
    } else if let Some(r) = url.strip_prefix("ws://") {
        (false, r)
    } else {
        return Err("the URL must start with ws:// or wss://".into());
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    if authority.is_empty() || authority.contains('@') {
        return Err("the URL needs a host and no user info".into());
    }
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || authority.starts_with('[') => match p.parse::<u16>() {
            Ok(port) => (h, port),
            Err(_) => return Err(format!("bad port `{p}` in the URL")),
        },
        _ => (authority, if tls { 443 } else { 80 }),
    };
    Ok(Target {
        tls,
        host: host.trim_start_matches('[').trim_end_matches(']').to_string(),
        port,
    })
}

/// The request for `url`: the caller adds its headers before `connect`.
pub fn request(url: &str) -> Result<Request, String> {
    url.into_client_request().map_err(|e| format!("bad URL: {e}"))
}

/// A dialed WebSocket; its writer may hold the cork (`cork`).
pub type Ws = WebSocketStream<Corked<Stream>>;

/// The reading half of a `Ws`.
pub type Reader = async_tungstenite::WebSocketReceiver<Corked<Stream>>;

/// Dials `url` (a provider's long connection, public roots only) with frames of at most
/// `max_frame` bytes. Errors do not name the URL: it may hold a ticket.
pub async fn open(url: &str, max_frame: usize) -> Result<Ws, String> {
    let target = parse_url(url)?;
    connect(&target, request(url)?, None, bounded_config(max_frame)).await
}

/// A TCP connection, plain or inside TLS.
pub enum Stream {
    Plain(TcpStream),
    Tls(Box<futures_rustls::client::TlsStream<TcpStream>>),
}

/// The TCP connect, TLS and WebSocket handshakes together get this long: a server that takes
/// the connection and never answers must not hold a dialer forever.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);

/// Connects to `target`, runs TLS when it asks for it, then the WebSocket handshake of
/// `request`, all within `CONNECT_TIMEOUT`. Errors say which step failed, without the URL (it
/// may hold a credential).
pub async fn connect(
    target: &Target,
    request: Request,
    ca_file: Option<&Path>,
    config: WebSocketConfig,
) -> Result<Ws, String> {
    let timeout = async {
        smol::Timer::after(CONNECT_TIMEOUT).await;
        Err(format!("no connection within {CONNECT_TIMEOUT:?}"))
    };
    handshakes(target, request, ca_file, config).or(timeout).await
}

async fn handshakes(
    target: &Target,
    request: Request,
    ca_file: Option<&Path>,
    config: WebSocketConfig,
) -> Result<Ws, String> {
    let tcp = TcpStream::connect((target.host.as_str(), target.port))
        .await
        .map_err(|e| format!("TCP connect failed: {e}"))?;
    let _ = tcp.set_nodelay(true);
    let stream = if target.tls {
        let connector = futures_rustls::TlsConnector::from(tls_config(ca_file)?);
        let name = rustls::pki_types::ServerName::try_from(target.host.clone())
            .map_err(|_| format!("`{}` is not a valid TLS server name", target.host))?;
        let tls = connector
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS handshake failed: {e}"))?;
        Stream::Tls(Box::new(tls))
    } else {
        Stream::Plain(tcp)
    };
    let (ws, _) = async_tungstenite::client_async_with_config(request, Corked::new(stream), Some(config))
        .await
        .map_err(|e| format!("WebSocket handshake failed: {e}"))?;
    Ok(ws)
}

/// Public web roots plus the PEM certificates of `ca_file`, with the ring provider.
fn tls_config(ca_file: Option<&Path>) -> Result<Arc<rustls::ClientConfig>, String> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = ca_file {
        let certs = rustls::pki_types::CertificateDer::pem_file_iter(path)
            .map_err(|e| format!("cannot read ca_file {}: {e}", path.display()))?;
        for cert in certs {
            let cert = cert.map_err(|e| format!("bad certificate in ca_file {}: {e}", path.display()))?;
            roots
                .add(cert)
                .map_err(|e| format!("unusable certificate in ca_file: {e}"))?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup failed: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_close(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_close(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_host_port_and_tls() {
        let t = parse_url("wss://xagent.example:8443/connectors/ws").unwrap();
        assert_eq!((t.tls, t.host.as_str(), t.port), (true, "xagent.example", 8443));
        let t = parse_url("ws://127.0.0.1/ws").unwrap();
        assert_eq!((t.tls, t.port), (false, 80));
        let t = parse_url("wss://msg.example/ws/v2?device_id=1&service_id=2").unwrap();
        assert_eq!((t.host.as_str(), t.port), ("msg.example", 443));
        let t = parse_url("ws://[::1]:9000/ws").unwrap();
        assert_eq!((t.host.as_str(), t.port), ("::1", 9000));
        assert!(parse_url("http://x").is_err());
        assert!(parse_url("ws://user@x/").is_err());
        assert!(parse_url("ws://x:notaport/").is_err());
    }
}
