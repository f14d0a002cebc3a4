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
    make_server_cert(dir);
}

/// A `localhost` server certificate with a fresh key, signed by the CA, as `srv.pem` and
/// `srv.key` (a renewal when they exist already).
fn make_server_cert(dir: &Path) {
    std::fs::write(
        dir.join("srv.ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
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

// ---------- TLS on imgate's own listener ----------

type TlsClient = rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream>;

/// A daemon serving TLS with the test CA's `localhost` certificate.
fn tls_daemon(tag: &str) -> (Daemon, std::path::PathBuf) {
    let dir = temp_dir(tag);
    make_certs(&dir);
    let port = free_port();
    let conf = config_text(port, &dir, None, "").replace(
        "log_level = debug",
        &format!(
            "log_level = debug\ntls_cert_file = {}\ntls_key_file = {}\npublic_url = https://localhost:{port}",
            dir.join("srv.pem").display(),
            dir.join("srv.key").display()
        ),
    );
    (Daemon::start(&dir, &conf), dir)
}

/// A TLS client trusting only the test CA, done with its handshake.
fn tls_connect(port: u16, dir: &Path) -> TlsClient {
    let tls = tls_handshake(port, dir, &[b"h2", b"http/1.1"]).expect("the TLS handshake succeeds");
    assert_eq!(tls.conn.alpn_protocol(), Some(&b"http/1.1"[..]), "HTTP/1.1, never h2");
    tls
}

/// A TLS handshake trusting only the test CA, offering the ALPN protocols `alpn`.
fn tls_handshake(port: u16, dir: &Path, alpn: &[&[u8]]) -> std::io::Result<TlsClient> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(dir.join("ca.pem")).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
    let tcp = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    while tls.conn.is_handshaking() {
        tls.conn.complete_io(&mut tls.sock)?;
    }
    Ok(tls)
}

/// One request over TLS: the whole answer (the request asks the server to close).
fn https(port: u16, dir: &Path, request: &str) -> String {
    use std::io::{Read, Write};
    let mut tls = tls_connect(port, dir);
    tls.write_all(request.as_bytes()).unwrap();
    let mut answer = Vec::new();
    let _ = tls.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

/// The DER of the certificate a new connection is served.
fn served_certificate(port: u16, dir: &Path) -> Vec<u8> {
    let tls = tls_connect(port, dir);
    tls.conn.peer_certificates().unwrap()[0].to_vec()
}

fn pem_der(path: &Path) -> Vec<u8> {
    CertificateDer::pem_file_iter(path)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .to_vec()
}

#[test]
fn the_listener_serves_http_and_the_data_plane_over_tls_and_reads_a_renewed_certificate_on_sighup() {
    let (d, dir) = tls_daemon("tls-listener");
    let health = format!(
        "GET /health HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {API_KEY}\r\nConnection: close\r\n\r\n"
    );
    let answer = https(d.port, &dir, &health);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // The front door's limits hold under TLS as they do without it.
    let huge = format!(
        "POST /hooks/alerts HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {HOOK_SECRET}\r\nContent-Length: 1000000000000\r\n\r\n"
    );
    let answer = https(d.port, &dir, &huge);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    let card = https(
        d.port,
        &dir,
        "GET /connector-card.json HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
    );
    assert!(card.starts_with("HTTP/1.1 200"), "{card}");

    // /ws over TLS: the handshake, then hello and its ack.
    let mut request =
        tungstenite::client::IntoClientRequest::into_client_request(format!("wss://localhost:{}/ws", d.port)).unwrap();
    request
        .headers_mut()
        .insert("Authorization", format!("Bearer {API_KEY}").parse().unwrap());
    request
        .headers_mut()
        .insert("Sec-WebSocket-Protocol", SUBPROTOCOL.parse().unwrap());
    let (mut ws, _) = tungstenite::client(request, tls_connect(d.port, &dir)).expect("the upgrade over TLS succeeds");
    let hello = json!({
        "schema": "xagent.connector.packet/v1", "packet_id": "p1", "request_id": "r1", "type": "connector.hello",
        "payload": {"connector_card_id": "im.imgate", "protocol_version": "3.0", "supported_profiles": ["xagent.im.v1"]}
    });
    ws.send(tungstenite::Message::text(hello.to_string())).unwrap();
    let ack = loop {
        if let tungstenite::Message::Text(t) = ws.read().expect("a packet from imgate") {
            break serde_json::from_str::<Value>(t.as_str()).unwrap();
        }
    };
    assert_eq!(ack["type"], "connector.hello.ack", "{ack}");

    // A renewal: new certificate and key in the same files, then SIGHUP.
    let old = pem_der(&dir.join("srv.pem"));
    assert_eq!(served_certificate(d.port, &dir), old);
    make_server_cert(&dir);
    let new = pem_der(&dir.join("srv.pem"));
    assert_ne!(old, new);
    d.signal("HUP");
    assert!(
        d.log_shows("certificate read again", Duration::from_secs(10)),
        "{}",
        d.log()
    );
    assert_eq!(
        served_certificate(d.port, &dir),
        new,
        "new connections get the renewed certificate"
    );
    // The session opened before it goes on.
    ws.send(tungstenite::Message::text(hello.to_string())).unwrap();
    // A renewal that cannot be read keeps the certificate in use.
    std::fs::write(dir.join("srv.pem"), "not a certificate").unwrap();
    d.signal("HUP");
    assert!(
        d.log_shows("the certificate in use is kept", Duration::from_secs(10)),
        "{}",
        d.log()
    );
    assert_eq!(served_certificate(d.port, &dir), new);
}

#[test]
fn hostile_bytes_and_a_stalled_handshake_are_refused_within_the_head_deadline() {
    use std::io::{Read, Write};
    let (d, dir) = tls_daemon("tls-hostile");
    // Plain HTTP to the TLS port: no HTTP answer, nothing held, logged with the client.
    let mut plain = std::net::TcpStream::connect(("127.0.0.1", d.port)).unwrap();
    plain.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    plain.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut got = Vec::new();
    let _ = plain.read_to_end(&mut got);
    assert!(!got.starts_with(b"HTTP/"), "{}", String::from_utf8_lossy(&got));
    assert!(
        d.log_shows("TLS handshake failed", Duration::from_secs(5)),
        "{}",
        d.log()
    );
    assert!(
        d.log().contains("bad_request from 127.0.0.1: TLS handshake failed"),
        "{}",
        d.log()
    );
    // Random bytes, then a TLS record header that never goes on.
    for opening in [&[0u8, 1, 2, 3, 0xff, 0xfe][..], &[0x16, 0x03, 0x01, 0x02]] {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", d.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(opening).unwrap();
        let mut buf = [0u8; 64];
        // Closed by imgate (an alert may come first), by the head deadline at the latest.
        let closed = loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break true,
                Ok(_) => continue,
            }
        };
        assert!(closed);
    }
    assert!(
        d.log_shows("TLS handshake not complete in time", Duration::from_secs(5)),
        "{}",
        d.log()
    );
    // A client that speaks only HTTP/2 is refused in the handshake: the front door frames
    // HTTP/1.1 alone.
    assert!(tls_handshake(d.port, &dir, &[b"h2"]).is_err(), "h2 alone is refused");
    // Still serving.
    let health = format!(
        "GET /health HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {API_KEY}\r\nConnection: close\r\n\r\n"
    );
    assert!(https(d.port, &dir, &health).starts_with("HTTP/1.1 200"));
}

#[test]
fn tls_files_that_cannot_be_used_are_refused_with_their_line() {
    let dir = temp_dir("tls-config");
    make_certs(&dir);
    let conf = dir.join("t.conf");
    let check = |text: String| {
        std::fs::write(&conf, text).unwrap();
        std::process::Command::new(bin())
            .args(["check", "--config", conf.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let (pem, key) = (dir.join("srv.pem"), dir.join("srv.key"));
    let ok = check(format!(
        "[server]\ntls_cert_file = {}\ntls_key_file = {}\n",
        pem.display(),
        key.display()
    ));
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    assert!(String::from_utf8_lossy(&ok.stdout).contains("tls:               on"));
    let name = conf.display().to_string();
    for (text, line, says) in [
        (
            format!("[server]\ntls_cert_file = {}\n", pem.display()),
            2,
            "go together",
        ),
        (
            format!(
                "[server]\ntls_cert_file = {}\ntls_key_file = {}\n",
                key.display(),
                key.display()
            ),
            2,
            "no certificate",
        ),
        (
            format!(
                "[server]\ntls_cert_file = {}\ntls_key_file = {}\n",
                pem.display(),
                pem.display()
            ),
            2,
            "no private key",
        ),
        (
            format!(
                "[server]\ntls_cert_file = {}/nope.pem\ntls_key_file = {}\n",
                dir.display(),
                key.display()
            ),
            2,
            "cannot read",
        ),
    ] {
        let out = check(text.clone());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{text}");
        assert!(
            err.contains(&format!("{name}:{line}: ")) && err.contains(says),
            "{text}: {err}"
        );
    }
    // A key of another certificate.
    std::fs::copy(&key, dir.join("old.key")).unwrap();
    make_server_cert(&dir);
    let out = check(format!(
        "[server]\ntls_cert_file = {}\ntls_key_file = {}/old.key\n",
        pem.display(),
        dir.display()
    ));
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("usable pair"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
