//! Pinned identities: each daemon (and each operator's CLI) has its own key
//! and self-signed certificate in a store directory (`<pool>/tls/` for a
//! storage daemon, `<state>/tls/` for a host or controller, any directory
//! for an operator), and trusts exactly the certificates copied into its
//! `trusted/` directory (`ferry certs trust FILE [--role R]`). Both ends of
//! every connection present a certificate; an unknown one ends the
//! handshake.
//!
//! A pinned certificate is tied to what it is: one in `trusted/<role>/` is
//! a peer of that [`Role`]; one directly in `trusted/` is a peer of this
//! store's own kind (two storage daemons that migrate to each other, two
//! hosts that move guests). The migration and move listeners accept only
//! peers of their own kind; the HTTP APIs accept any pinned role and check
//! it per route (`crate::api`).
//!
//! The trusted directory is read at every handshake, so trusting a new peer
//! needs no restart.

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls13_signature, CryptoProvider};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, Error as TlsError, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thiserror::Error;

use crate::Role;

#[derive(Debug, Error)]
pub enum CertError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a PEM certificate or key: {detail}")]
    Pem { path: PathBuf, detail: String },
    #[error("generating the daemon certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("TLS configuration: {0}")]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Write(#[from] ferry_state_file::StateFileError),
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> CertError + 'a {
    move |source| CertError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// A store directory and what is in it.
#[derive(Debug, Clone)]
pub struct CertStore {
    dir: PathBuf,
    kind: Role,
}

/// A pinned certificate: its file name, what it was pinned as, and its
/// fingerprint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub name: String,
    pub role: Role,
    pub fingerprint: String,
}

/// SHA-256 of a certificate's DER, as colon-free lowercase hex (what
/// `openssl x509 -fingerprint -sha256` prints, without colons).
pub fn fingerprint(der: &[u8]) -> String {
    use std::fmt::Write;
    let d = ring::digest::digest(&ring::digest::SHA256, der);
    d.as_ref().iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

impl CertStore {
    /// A storage daemon's store, `<pool>/tls`.
    pub fn new(pool_root: &Path) -> CertStore {
        CertStore::at(&pool_root.join("tls"), Role::Storage)
    }

    /// The store in `dir` of a daemon (or operator) of `kind`.
    pub fn at(dir: &Path, kind: Role) -> CertStore {
        CertStore {
            dir: dir.to_path_buf(),
            kind,
        }
    }

    /// What this store's owner is.
    pub fn kind(&self) -> Role {
        self.kind
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn cert_path(&self) -> PathBuf {
        self.dir.join("cert.pem")
    }

    fn key_path(&self) -> PathBuf {
        self.dir.join("key.pem")
    }

    pub fn trusted_dir(&self) -> PathBuf {
        self.dir.join("trusted")
    }

    /// Create the key and certificate if they do not exist yet.
    pub fn ensure_identity(&self) -> Result<(), CertError> {
        if self.cert_path().exists() && self.key_path().exists() {
            return Ok(());
        }
        std::fs::create_dir_all(self.trusted_dir()).map_err(io("mkdir", &self.dir))?;
        let host = std::fs::read_to_string("/etc/hostname")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let key = rcgen::KeyPair::generate()?;
        let mut params = rcgen::CertificateParams::new(vec!["ferry".to_string(), host.clone()])?;
        params.distinguished_name.push(
            rcgen::DnType::CommonName,
            format!("ferry {} {host} {}", self.kind, uuid::Uuid::new_v4()),
        );
        let cert = params.self_signed(&key)?;
        let kp = self.key_path();
        write_private(&kp, key.serialize_pem().as_bytes())?;
        let cp = self.cert_path();
        ferry_state_file::write_durably(&cp, cert.pem().as_bytes())?;
        tracing::info!(cert = %cp.display(), "created this daemon's TLS certificate");
        Ok(())
    }

    /// This daemon's certificate (DER).
    pub fn own_cert(&self) -> Result<CertificateDer<'static>, CertError> {
        load_cert(&self.cert_path())
    }

    /// Copy a peer's certificate into the trusted directory; returns its
    /// fingerprint. Without a role it is a peer of this store's own kind
    /// (kept directly in `trusted/`); with one, in `trusted/<role>/`.
    pub fn trust(
        &self,
        peer_cert: &Path,
        name: Option<&str>,
        role: Option<Role>,
    ) -> Result<String, CertError> {
        let der = load_cert(peer_cert)?;
        let fp = fingerprint(&der);
        let dir = match role {
            Some(r) => self.trusted_dir().join(r.dir_name()),
            None => self.trusted_dir(),
        };
        std::fs::create_dir_all(&dir).map_err(io("mkdir", &dir))?;
        let file = match name {
            Some(n) if !n.is_empty() && !n.contains('/') && n != ".." => format!("{n}.pem"),
            Some(n) => {
                return Err(CertError::Pem {
                    path: peer_cert.to_path_buf(),
                    detail: format!("{n:?} is not a file name to keep a certificate under"),
                })
            }
            None => format!("{}.pem", &fp[..16]),
        };
        let pem = std::fs::read(peer_cert).map_err(io("read", peer_cert))?;
        let dest = dir.join(file);
        ferry_state_file::write_durably(&dest, &pem)?;
        Ok(fp)
    }

    /// Every pinned certificate, with what it was pinned as.
    pub fn trusted(&self) -> Vec<Peer> {
        self.trusted_ders()
            .into_iter()
            .map(|(name, role, d)| Peer {
                name,
                role,
                fingerprint: fingerprint(&d),
            })
            .collect()
    }

    /// The pinned peer whose certificate is `der`, if any. A certificate
    /// pinned twice counts as the first role found (its own kind first).
    pub fn peer(&self, der: &[u8]) -> Option<Peer> {
        self.trusted_ders()
            .into_iter()
            .find(|(_, _, d)| d.as_slice() == der)
            .map(|(name, role, d)| Peer {
                name,
                role,
                fingerprint: fingerprint(&d),
            })
    }

    fn trusted_ders(&self) -> Vec<(String, Role, Vec<u8>)> {
        let mut out = pems_in(&self.trusted_dir(), self.kind);
        for r in Role::ALL {
            out.extend(pems_in(&self.trusted_dir().join(r.dir_name()), r));
        }
        out
    }

    fn chain_and_key(
        &self,
    ) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), CertError> {
        self.ensure_identity()?;
        let kp = self.key_path();
        let key = PrivateKeyDer::from_pem_file(&kp).map_err(|e| CertError::Pem {
            path: kp.clone(),
            detail: e.to_string(),
        })?;
        Ok((vec![self.own_cert()?], key))
    }

    /// TLS for an HTTP API: a client certificate of any pinned role is
    /// accepted (the API checks the role per route); the caller is found
    /// again with [`CertStore::peer`].
    pub fn api_server_config(&self) -> Result<Arc<rustls::ServerConfig>, CertError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let (chain, key) = self.chain_and_key()?;
        let verifier = Arc::new(Pinned {
            store: self.clone(),
            provider: provider.clone(),
            accept: Accept::AnyRole,
        });
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)?;
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(cfg))
    }

    /// TLS for calling another daemon's HTTP API: this store's identity,
    /// and the server's certificate must be pinned here as one of `roles`.
    pub fn api_client_config(
        &self,
        roles: &[Role],
    ) -> Result<Arc<rustls::ClientConfig>, CertError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let (chain, key) = self.chain_and_key()?;
        let verifier = Arc::new(Pinned {
            store: self.clone(),
            provider: provider.clone(),
            accept: Accept::Roles(roles.to_vec()),
        });
        let cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_auth_cert(chain, key)?;
        Ok(Arc::new(cfg))
    }

    /// TLS for the listening (destination) side of a migration or move:
    /// only peers of this store's own kind.
    pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>, CertError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let (chain, key) = self.chain_and_key()?;
        let verifier = Arc::new(Pinned {
            store: self.clone(),
            provider: provider.clone(),
            accept: Accept::OwnKind,
        });
        let cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)?;
        Ok(Arc::new(cfg))
    }

    /// TLS for the connecting (source) side of a migration or move.
    pub fn client_config(&self) -> Result<Arc<rustls::ClientConfig>, CertError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let (chain, key) = self.chain_and_key()?;
        let verifier = Arc::new(Pinned {
            store: self.clone(),
            provider: provider.clone(),
            accept: Accept::OwnKind,
        });
        let cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_auth_cert(chain, key)?;
        Ok(Arc::new(cfg))
    }
}

/// The name the source puts in its ClientHello (certificates are pinned, so
/// the name is not what is checked).
pub fn server_name() -> ServerName<'static> {
    ServerName::DnsName(rustls::pki_types::DnsName::try_from("ferry").expect("valid DNS name"))
}

/// The certificates of one directory, sorted by file name.
fn pems_in(dir: &Path, role: Role) -> Vec<(String, Role, Vec<u8>)> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(String, Role, Vec<u8>)> = rd
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "pem"))
        .filter_map(|e| {
            let p = e.path();
            match load_cert(&p) {
                Ok(c) => Some((
                    e.file_name().to_string_lossy().into_owned(),
                    role,
                    c.to_vec(),
                )),
                Err(err) => {
                    tracing::warn!(error = %err, "ignoring unreadable trusted certificate");
                    None
                }
            }
        })
        .collect();
    out.sort();
    out
}

fn load_cert(path: &Path) -> Result<CertificateDer<'static>, CertError> {
    CertificateDer::from_pem_file(path).map_err(|e| CertError::Pem {
        path: path.to_path_buf(),
        detail: e.to_string(),
    })
}

fn write_private(path: &Path, data: &[u8]) -> Result<(), CertError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(io("create", path))?;
    f.write_all(data).map_err(io("write", path))?;
    f.sync_all().map_err(io("fsync", path))
}

/// Only TLS 1.3 is configured; a 1.2 signature never reaches a verifier.
fn tls12_refused() -> TlsError {
    TlsError::General("TLS 1.2 is not accepted between ferry daemons".into())
}

/// Which pinned certificates a verifier accepts.
#[derive(Debug)]
enum Accept {
    /// Peers of the store's own kind (migrations, moves).
    OwnKind,
    /// Any pinned role (an HTTP API, which checks roles per route).
    AnyRole,
    /// Peers pinned as one of these roles.
    Roles(Vec<Role>),
}

/// Accepts exactly the certificates in the trusted directory, pinned as a
/// role it accepts, both as client and as server, and checks the TLS 1.3
/// handshake signature.
#[derive(Debug)]
struct Pinned {
    store: CertStore,
    provider: Arc<CryptoProvider>,
    accept: Accept,
}

impl Pinned {
    fn check(&self, cert: &CertificateDer<'_>) -> Result<(), TlsError> {
        let found: Vec<Role> = self
            .store
            .trusted_ders()
            .into_iter()
            .filter(|(_, _, d)| d.as_slice() == cert.as_ref())
            .map(|(_, r, _)| r)
            .collect();
        let ok = match &self.accept {
            Accept::OwnKind => found.contains(&self.store.kind),
            Accept::AnyRole => !found.is_empty(),
            Accept::Roles(roles) => found.iter().any(|r| roles.contains(r)),
        };
        if ok {
            Ok(())
        } else if !found.is_empty() {
            tracing::warn!(
                fingerprint = %fingerprint(cert),
                pinned_as = ?found,
                wanted = ?self.accept,
                "refused a pinned certificate of the wrong kind"
            );
            Err(TlsError::InvalidCertificate(
                rustls::CertificateError::ApplicationVerificationFailure,
            ))
        } else {
            tracing::warn!(
                fingerprint = %fingerprint(cert),
                "refused a peer certificate that is not in the trusted directory"
            );
            Err(TlsError::InvalidCertificate(
                rustls::CertificateError::UnknownIssuer,
            ))
        }
    }

    fn schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }

    fn tls13(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, TlsError> {
        self.check(end_entity)
            .map(|()| ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        Err(tls12_refused())
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        self.tls13(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.schemes()
    }
}

impl ClientCertVerifier for Pinned {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, TlsError> {
        self.check(end_entity)
            .map(|()| ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        Err(tls12_refused())
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        self.tls13(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.schemes()
    }
}

/// A TLS error that means "not trusted" (our verdict on the peer's
/// certificate, or the peer's on ours), as opposed to a damaged link.
pub fn is_trust_failure(e: &TlsError) -> bool {
    use rustls::AlertDescription as A;
    match e {
        TlsError::InvalidCertificate(_) | TlsError::NoCertificatesPresented => true,
        TlsError::AlertReceived(a) => matches!(
            a,
            A::BadCertificate
                | A::UnsupportedCertificate
                | A::CertificateRevoked
                | A::CertificateExpired
                | A::CertificateUnknown
                | A::UnknownCA
                | A::AccessDenied
                | A::CertificateRequired
        ),
        _ => false,
    }
}
