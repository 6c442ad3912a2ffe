//! TLS 1.3 with mutual authentication between daemons, by certificate
//! pinning: each daemon makes its own key and self-signed certificate in
//! `<pool>/tls/` on first start, and trusts exactly the peer certificates
//! copied into `<pool>/tls/trusted/` (`ferry certs trust FILE`). Both ends
//! present a certificate; an unknown one ends the handshake.
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
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> CertError + 'a {
    move |source| CertError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// The `<pool>/tls` directory and what is in it.
#[derive(Debug, Clone)]
pub struct CertStore {
    dir: PathBuf,
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
    pub fn new(pool_root: &Path) -> CertStore {
        CertStore {
            dir: pool_root.join("tls"),
        }
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
            format!("ferry daemon {host} {}", uuid::Uuid::new_v4()),
        );
        let cert = params.self_signed(&key)?;
        let kp = self.key_path();
        write_private(&kp, key.serialize_pem().as_bytes())?;
        let cp = self.cert_path();
        ferry_storage::meta::write_atomic(&cp, cert.pem().as_bytes()).map_err(|e| {
            CertError::Io {
                op: "write",
                path: cp.clone(),
                source: std::io::Error::other(e.to_string()),
            }
        })?;
        tracing::info!(cert = %cp.display(), "created this daemon's TLS certificate");
        Ok(())
    }

    /// This daemon's certificate (DER).
    pub fn own_cert(&self) -> Result<CertificateDer<'static>, CertError> {
        load_cert(&self.cert_path())
    }

    /// Copy a peer's certificate into the trusted directory; returns its
    /// fingerprint.
    pub fn trust(&self, peer_cert: &Path, name: Option<&str>) -> Result<String, CertError> {
        let der = load_cert(peer_cert)?;
        let fp = fingerprint(&der);
        std::fs::create_dir_all(self.trusted_dir()).map_err(io("mkdir", &self.dir))?;
        let file = match name {
            Some(n) => format!("{n}.pem"),
            None => format!("{}.pem", &fp[..16]),
        };
        let pem = std::fs::read(peer_cert).map_err(io("read", peer_cert))?;
        let dest = self.trusted_dir().join(file);
        std::fs::write(&dest, pem).map_err(io("write", &dest))?;
        Ok(fp)
    }

    /// `(file name, fingerprint)` of every trusted peer certificate.
    pub fn trusted(&self) -> Vec<(String, String)> {
        self.trusted_ders()
            .into_iter()
            .map(|(n, d)| (n, fingerprint(&d)))
            .collect()
    }

    fn trusted_ders(&self) -> Vec<(String, Vec<u8>)> {
        let Ok(rd) = std::fs::read_dir(self.trusted_dir()) else {
            return Vec::new();
        };
        let mut out: Vec<(String, Vec<u8>)> = rd
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "pem"))
            .filter_map(|e| {
                let p = e.path();
                match load_cert(&p) {
                    Ok(c) => Some((e.file_name().to_string_lossy().into_owned(), c.to_vec())),
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

    /// TLS for the listening (destination) side.
    pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>, CertError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let (chain, key) = self.chain_and_key()?;
        let verifier = Arc::new(Pinned {
            store: self.clone(),
            provider: provider.clone(),
        });
        let cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)?;
        Ok(Arc::new(cfg))
    }

    /// TLS for the connecting (source) side.
    pub fn client_config(&self) -> Result<Arc<rustls::ClientConfig>, CertError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let (chain, key) = self.chain_and_key()?;
        let verifier = Arc::new(Pinned {
            store: self.clone(),
            provider: provider.clone(),
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

/// Accepts exactly the certificates in the trusted directory, both as
/// client and as server, and checks the TLS 1.3 handshake signature.
#[derive(Debug)]
struct Pinned {
    store: CertStore,
    provider: Arc<CryptoProvider>,
}

impl Pinned {
    fn check(&self, cert: &CertificateDer<'_>) -> Result<(), TlsError> {
        if self
            .store
            .trusted_ders()
            .iter()
            .any(|(_, d)| d.as_slice() == cert.as_ref())
        {
            Ok(())
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
