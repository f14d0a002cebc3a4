//! The dial transport over wss:// with a private CA (`[xagent] ca_file`), against a real rustls
//! server with a certificate made by the openssl command line for this test.

use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::{json, Value};

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl is installed");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA and a `localhost` server certificate signed by it.
fn make_certs(dir: &Path) {
    std::fs::write(
        dir.join("srv.ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    let mut ca = vec!["req", "-x509"];
    ca.extend(ec);
    ca.extend([
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=imgate test CA",
    ]);
    ca.extend([
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign",
    ]);
    openssl(dir, &ca);
    let mut csr = vec!["req"];
    csr.extend(ec);
    csr.extend(["-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=localhost"]);
    openssl(dir, &csr);
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "srv.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "srv.pem",
            "-days",
            "2",
            "-extfile",
            "srv.ext",
        ],
    );
}

fn server_config(dir: &Path) -> Arc<rustls::ServerConfig> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(dir.join("srv.pem"))
        .unwrap()
        .map(|c| c.unwrap())
        .collect();
    let key = PrivateKeyDer::from_pem_file(dir.join("srv.key")).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    Arc::new(config)
}

type TlsWs = tungstenite::WebSocket<rustls::StreamOwned<rustls::ServerConnection, std::net::TcpStream>>;

/// Accepts imgate's wss:// dial: TLS, then the WebSocket upgrade with the packet subprotocol.
fn accept_tls(listener: &TcpListener, config: &Arc<rustls::ServerConfig>) -> Result<TlsWs, String> {
    let (tcp, _) = listener.accept().unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let conn = rustls::ServerConnection::new(config.clone()).unwrap();
    let stream = rustls::StreamOwned::new(conn, tcp);
    #[allow(clippy::result_large_err)] // tungstenite fixes the callback's error type
    let callback = |_: &tungstenite::handshake::server::Request, mut resp: tungstenite::handshake::server::Response| {
        resp.headers_mut()
            .insert("Sec-WebSocket-Protocol", SUBPROTOCOL.parse().unwrap());
        Ok(resp)
    };
    tungstenite::accept_hdr(stream, callback).map_err(|e| e.to_string())
}

fn next_json(ws: &mut TlsWs) -> Value {
    loop {
        match ws.read().expect("a packet from imgate") {
            tungstenite::Message::Text(t) => {
                let v: Value = serde_json::from_str(t.as_str()).unwrap();
                assert_packet(&v);
                return v;
            }
            _ => continue,
        }
    }
}

#[test]
fn dial_over_wss_trusts_the_private_ca_from_ca_file() {
    let dir = temp_dir("wss");
    make_certs(&dir);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let extra = format!(
        "[xagent]\ndial = wss://localhost:{port}/ws\nca_file = {}\n",
        dir.join("ca.pem").display()
    );
    let _d = Daemon::start(&dir, &config_text(free_port(), &dir, None, &extra));
    let config = server_config(&dir);
    let mut ws = accept_tls(&listener, &config).expect("TLS and WebSocket handshakes succeed");
    let hello = json!({
        "schema": "xagent.connector.packet/v1", "packet_id": "p1", "request_id": "r1", "type": "connector.hello",
        "payload": {"connector_card_id": "im.imgate", "protocol_version": "3.0", "supported_profiles": ["xagent.im.v1"]}
    });
    ws.send(tungstenite::Message::text(hello.to_string())).unwrap();
    let ack = next_json(&mut ws);
    assert_eq!(ack["type"], "connector.hello.ack");
    assert_eq!(ack["request_id"], "r1");
}

#[test]
fn dial_over_wss_refuses_an_unknown_ca_and_logs_it_once() {
    let dir = temp_dir("wss-untrusted");
    make_certs(&dir);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let extra = format!("[xagent]\ndial = wss://localhost:{port}/ws\n");
    let d = Daemon::start(&dir, &config_text(free_port(), &dir, None, &extra));
    let config = server_config(&dir);
    // Two attempts (backoff 1 s, then 2 s): both fail the handshake on imgate's side.
    for _ in 0..2 {
        assert!(
            accept_tls(&listener, &config).is_err(),
            "an untrusted certificate is refused"
        );
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    while !d.log().contains("TLS handshake failed") {
        assert!(Instant::now() < deadline, "{}", d.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let failures = d.log().matches("dial: cannot connect").count();
    assert_eq!(
        failures,
        1,
        "one log line for the same failure, not one per retry:\n{}",
        d.log()
    );
}
