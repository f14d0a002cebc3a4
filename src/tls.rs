//! TLS on the listener (`[server] tls_cert_file`, `tls_key_file`): the certificate chain and
//! its key from PEM files, rustls with the ring provider (the one dial-out already uses), TLS
//! 1.2 and 1.3, HTTP/1.1 by ALPN. The files are read again on SIGHUP, so a renewed certificate
//! needs no restart; a renewal that cannot be read keeps the certificate in use.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;

/// The longest PEM file read: a chain of a few certificates is a few KiB.
const MAX_PEM: u64 = 1 << 20;

/// The listener's TLS settings, as of the last (re)load.
pub struct ListenerTls {
    cert: PathBuf,
    key: PathBuf,
    current: Mutex<Arc<ServerConfig>>,
}

fn read_pem(path: &Path, what: &str) -> Result<Vec<u8>, String> {
    let size = std::fs::metadata(path)
        .map_err(|e| format!("cannot read {what} `{}`: {e}", path.display()))?
        .len();
    if size > MAX_PEM {
        return Err(format!("{what} `{}` is over 1 MiB: not a PEM file", path.display()));
    }
    std::fs::read(path).map_err(|e| format!("cannot read {what} `{}`: {e}", path.display()))
}

/// A server configuration from the PEM files: the chain (leaf first) and its private key.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&read_pem(cert, "tls_cert_file")?)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("tls_cert_file `{}`: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!("tls_cert_file `{}` holds no certificate", cert.display()));
    }
    let private = PrivateKeyDer::from_pem_slice(&read_pem(key, "tls_key_file")?)
        .map_err(|e| format!("tls_key_file `{}`: no private key in it ({e})", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup failed: {e}"))?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(|e| format!("tls_cert_file and tls_key_file do not make a usable pair: {e}"))?;
    // HTTP/1.1 only: a client that offers nothing else (h2 alone) is refused in the handshake.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

impl ListenerTls {
    pub fn open(cert: &Path, key: &Path) -> Result<Arc<ListenerTls>, String> {
        Ok(Arc::new(ListenerTls {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            current: Mutex::new(server_config(cert, key)?),
        }))
    }

    /// The configuration new connections are accepted with.
    pub fn config(&self) -> Arc<ServerConfig> {
        self.current.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Reads the files again (blocking: call it off the executor). Connections already open
    /// keep the certificate they were accepted with.
    pub fn reload(&self) {
        match server_config(&self.cert, &self.key) {
            Ok(config) => {
                *self.current.lock().unwrap_or_else(|e| e.into_inner()) = config;
                log::info!("TLS: certificate read again from {}", self.cert.display());
            }
            Err(e) => log::error!("TLS: {e}; the certificate in use is kept"),
        }
    }
}
