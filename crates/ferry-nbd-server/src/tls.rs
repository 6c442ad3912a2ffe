//! TLS for NBD clients, in the layout QEMU and qemu-nbd use for x509
//! credentials (`--object tls-creds-x509,dir=DIR,endpoint=server`): DIR
//! holds `server-cert.pem` (the certificate chain), `server-key.pem` and
//! `ca-cert.pem`, the authority whose certificates clients must present.
//! Clients authenticate too: a client without a certificate signed by that
//! authority fails the TLS handshake.
//!
//! Which clients must use TLS is decided per connection ([`NbdTls::mode`]):
//! every client from another address must, a loopback client may (or must
//! too, if the server says so).

use ferry_nbd::TlsMode;
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thiserror::Error;

/// Why the NBD TLS credentials cannot be used.
#[derive(Debug, Error)]
pub enum TlsSetupError {
    #[error("{path}: {detail}")]
    File { path: PathBuf, detail: String },
    #[error("{path}: no certificate in it")]
    NoCertificate { path: PathBuf },
    #[error("NBD TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("NBD TLS client verification: {0}")]
    Verifier(String),
}

/// The server's TLS credentials for NBD.
#[derive(Clone)]
pub struct NbdTls {
    acceptor: tokio_rustls::TlsAcceptor,
    dir: PathBuf,
    clear_loopback: bool,
}

impl std::fmt::Debug for NbdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdTls").field("dir", &self.dir).finish()
    }
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsSetupError> {
    let file_err = |detail: String| TlsSetupError::File {
        path: path.to_path_buf(),
        detail,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_err(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_err(e.to_string()))?;
    if certs.is_empty() {
        return Err(TlsSetupError::NoCertificate {
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

impl NbdTls {
    /// Load `ca-cert.pem`, `server-cert.pem` and `server-key.pem` from `dir`.
    pub fn from_dir(dir: &Path) -> Result<NbdTls, TlsSetupError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = RootCertStore::empty();
        for c in certs(&dir.join("ca-cert.pem"))? {
            roots.add(c)?;
        }
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()
                .map_err(|e| TlsSetupError::Verifier(e.to_string()))?;
        let chain = certs(&dir.join("server-cert.pem"))?;
        let key_path = dir.join("server-key.pem");
        let key = PrivateKeyDer::from_pem_file(&key_path).map_err(|e| TlsSetupError::File {
            path: key_path.clone(),
            detail: e.to_string(),
        })?;
        let config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)?;
        Ok(NbdTls {
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
            dir: dir.to_path_buf(),
            clear_loopback: true,
        })
    }

    /// Whether loopback (and unix-socket) clients may skip TLS.
    pub fn clear_on_loopback(mut self, allowed: bool) -> Self {
        self.clear_loopback = allowed;
        self
    }

    pub(crate) fn acceptor(&self) -> &tokio_rustls::TlsAcceptor {
        &self.acceptor
    }

    /// TLS is required of a client at `peer` (None: a unix socket) unless
    /// it is local and local clients may skip it.
    pub fn mode(&self, peer: Option<IpAddr>) -> TlsMode {
        let local = peer.is_none_or(|ip| ip.to_canonical().is_loopback());
        if local && self.clear_loopback {
            TlsMode::Optional
        } else {
            TlsMode::Forced
        }
    }
}
