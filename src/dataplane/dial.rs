//! The dial transport: connect out to `[xagent] dial` (ws:// or wss://) and run the same session
//! as the listener does. Reconnects with capped exponential backoff and jitter; each change of
//! state is logged once, not once per retry.

use std::sync::Arc;
use std::time::Duration;

use async_tungstenite::tungstenite::client::IntoClientRequest;
use async_tungstenite::tungstenite::http::HeaderValue;
use smol::net::TcpStream;

use crate::app::App;
use crate::ids;
use crate::protocol::SUBPROTOCOL;

const BACKOFF_START: Duration = Duration::from_secs(1);
const BACKOFF_CAP: Duration = Duration::from_secs(60);

/// A parsed dial URL.
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
        return Err("dial URL must start with ws:// or wss://".into());
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    if authority.is_empty() || authority.contains('@') {
        return Err("dial URL needs a host and no user info".into());
    }
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || authority.starts_with('[') => match p.parse::<u16>() {
            Ok(port) => (h, port),
            Err(_) => return Err(format!("bad port `{p}` in dial URL")),
        },
        _ => (authority, if tls { 443 } else { 80 }),
    };
    Ok(Target {
        tls,
        host: host.trim_start_matches('[').trim_end_matches(']').to_string(),
        port,
    })
}

/// Dials forever.
pub async fn run(app: Arc<App>, url: String) {
    let mut backoff = BACKOFF_START;
    let mut last_failure: Option<String> = None;
    loop {
        match connect(&app, &url).await {
            Ok(()) => {
                // A session ran; start the next attempt quickly.
                backoff = BACKOFF_START;
                last_failure = None;
            }
            Err(why) => {
                if last_failure.as_deref() != Some(why.as_str()) {
                    log::warn!("dial: cannot connect to {url}: {why}; retrying with backoff up to {BACKOFF_CAP:?}");
                    last_failure = Some(why);
                }
            }
        }
        let jitter = Duration::from_millis(ids::below(backoff.as_millis() as u64 / 2 + 1));
        smol::Timer::after(backoff + jitter).await;
        backoff = (backoff * 2).min(BACKOFF_CAP);
    }
}

/// One connection attempt; on success runs the session to its end.
async fn connect(app: &Arc<App>, url: &str) -> Result<(), String> {
    let target = parse_url(url)?;
    let mut request = url.into_client_request().map_err(|e| format!("bad dial URL: {e}"))?;
    let headers = request.headers_mut();
    headers.insert("Sec-WebSocket-Protocol", HeaderValue::from_static(SUBPROTOCOL));
    if let Some(key) = &app.config.xagent.dial_api_key {
        let value = HeaderValue::from_str(&format!("Bearer {}", key.expose()))
            .map_err(|_| "dial_api_key contains characters not allowed in a header".to_string())?;
        headers.insert("Authorization", value);
    }
    let tcp = TcpStream::connect((target.host.as_str(), target.port))
        .await
        .map_err(|e| format!("TCP connect failed: {e}"))?;
    let _ = tcp.set_nodelay(true);
    let config = Some(super::ws_config());
    if target.tls {
        let connector = futures_rustls::TlsConnector::from(tls_config(app)?);
        let name = rustls::pki_types::ServerName::try_from(target.host.clone())
            .map_err(|_| format!("`{}` is not a valid TLS server name", target.host))?;
        let tls = connector
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS handshake failed: {e}"))?;
        let (ws, _) = async_tungstenite::client_async_with_config(request, tls, config)
            .await
            .map_err(|e| format!("WebSocket handshake failed: {e}"))?;
        log::info!("dial: connected to {url}");
        super::session::run(app.clone(), ws, url.to_string()).await;
    } else {
        let (ws, _) = async_tungstenite::client_async_with_config(request, tcp, config)
            .await
            .map_err(|e| format!("WebSocket handshake failed: {e}"))?;
        log::info!("dial: connected to {url}");
        super::session::run(app.clone(), ws, url.to_string()).await;
    }
    log::info!("dial: disconnected from {url}");
    Ok(())
}

/// Public web roots plus the PEM certificates of `ca_file`, with the ring provider.
fn tls_config(app: &App) -> Result<Arc<rustls::ClientConfig>, String> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = &app.config.xagent.ca_file {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dial_urls_parse_host_port_and_tls() {
        let t = parse_url("wss://xagent.example:8443/connectors/ws").unwrap();
        assert_eq!((t.tls, t.host.as_str(), t.port), (true, "xagent.example", 8443));
        let t = parse_url("ws://127.0.0.1/ws").unwrap();
        assert_eq!((t.tls, t.port), (false, 80));
        let t = parse_url("ws://[::1]:9000/ws").unwrap();
        assert_eq!((t.host.as_str(), t.port), ("::1", 9000));
        assert!(parse_url("http://x").is_err());
        assert!(parse_url("ws://user@x/").is_err());
        assert!(parse_url("ws://x:notaport/").is_err());
    }
}
