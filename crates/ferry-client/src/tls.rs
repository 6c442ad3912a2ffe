//! TLS client credentials (NBD's `NBD_OPT_STARTTLS` here, and the
//! controller's etcd connections), from a directory
//! in QEMU's client layout: `ca-cert.pem` (the authority the server's
//! certificate must chain to) and, to authenticate to servers that ask,
//! `client-cert.pem` and `client-key.pem`.

use rustls::{ClientConfig, RootCertStore};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Client TLS credentials.
#[derive(Clone)]
pub struct ClientTls {
    connector: tokio_rustls::TlsConnector,
    config: Arc<ClientConfig>,
    dir: PathBuf,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls").field("dir", &self.dir).finish()
    }
}

fn file_err(path: &Path, e: impl std::fmt::Display) -> String {
    format!("{}: {e}", path.display())
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let v = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_err(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_err(path, e))?;
    if v.is_empty() {
        return Err(file_err(path, "no certificate in it"));
    }
    Ok(v)
}

impl ClientTls {
    /// Load `dir`'s credentials; the client certificate is optional.
    pub fn from_dir(dir: &Path) -> Result<ClientTls, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = RootCertStore::empty();
        for c in certs(&dir.join("ca-cert.pem"))? {
            roots
                .add(c)
                .map_err(|e| file_err(&dir.join("ca-cert.pem"), e))?;
        }
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots);
        let cert = dir.join("client-cert.pem");
        let config = if cert.exists() {
            let key = dir.join("client-key.pem");
            let k = PrivateKeyDer::from_pem_file(&key).map_err(|e| file_err(&key, e))?;
            builder
                .with_client_auth_cert(certs(&cert)?, k)
                .map_err(|e| file_err(&cert, e))?
        } else {
            builder.with_no_client_auth()
        };
        let config = Arc::new(config);
        Ok(ClientTls {
            connector: tokio_rustls::TlsConnector::from(config.clone()),
            config,
            dir: dir.to_path_buf(),
        })
    }

    pub(crate) fn connector(&self) -> &tokio_rustls::TlsConnector {
        &self.connector
    }

    /// The rustls configuration, for other clients with the same
    /// credentials (the controller's etcd client).
    pub fn rustls_config(&self) -> Arc<ClientConfig> {
        self.config.clone()
    }
}

/// The name a server's certificate must carry: the host of `HOST:PORT`.
pub(crate) fn server_name(addr: &str) -> Result<ServerName<'static>, String> {
    let host = match addr.rsplit_once(':') {
        Some((h, _)) => h.trim_start_matches('[').trim_end_matches(']'),
        None => addr,
    };
    ServerName::try_from(host.to_string()).map_err(|e| format!("server name {host:?}: {e}"))
}
