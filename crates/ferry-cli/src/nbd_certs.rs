//! `ferry certs nbd`: a small certificate authority and the certificates
//! NBD over TLS needs, in the directory layout QEMU, qemu-nbd and ferry
//! read (`ca-cert.pem` plus `server-cert.pem`/`server-key.pem` or
//! `client-cert.pem`/`client-key.pem`). The same set serves etcd with
//! client certificates for `ferry control run --etcd-tls-dir`.

use anyhow::{bail, Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use std::path::Path;

fn write_private(path: &Path, text: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    f.write_all(text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

fn write_public(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Make `out/ca-cert.pem` + `out/ca-key.pem`, `out/server/` for
/// `ferry serve --nbd-tls-dir` (certificate valid for `server_names`,
/// DNS names or IP addresses), and `out/client-NAME/` for each client
/// (QEMU: `--object tls-creds-x509,dir=out/client-NAME,endpoint=client`;
/// nbdinfo/nbdcopy: `nbds://HOST/VOLUME?tls-certificates=out/client-NAME`).
pub fn make(out: &Path, server_names: &[String], clients: &[String]) -> Result<()> {
    if server_names.is_empty() {
        bail!("name the server: --server-name HOST (DNS name or IP address; repeatable)");
    }
    if out.join("ca-key.pem").exists() {
        bail!(
            "{} already holds a certificate authority; choose another directory",
            out.display()
        );
    }
    for c in clients {
        if c.is_empty() || c.contains('/') || c.starts_with('.') {
            bail!("client name {c:?}: use letters, digits, '-' or '_'");
        }
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;

    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name
        .push(DnType::CommonName, "ferry NBD certificate authority");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca.self_signed(&ca_key)?;
    write_public(&out.join("ca-cert.pem"), &ca_cert.pem())?;
    write_private(&out.join("ca-key.pem"), &ca_key.serialize_pem())?;

    let leaf = |dir: &Path,
                kind: &str,
                names: Vec<String>,
                cn: &str,
                purposes: Vec<ExtendedKeyUsagePurpose>|
     -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::new(names)?;
        p.distinguished_name.push(DnType::CommonName, cn);
        p.is_ca = IsCa::ExplicitNoCa;
        p.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        p.extended_key_usages = purposes;
        p.use_authority_key_identifier_extension = true;
        let cert = p.signed_by(&key, &ca_cert, &ca_key)?;
        write_public(&dir.join("ca-cert.pem"), &ca_cert.pem())?;
        write_public(&dir.join(format!("{kind}-cert.pem")), &cert.pem())?;
        write_private(&dir.join(format!("{kind}-key.pem")), &key.serialize_pem())
    };
    leaf(
        &out.join("server"),
        "server",
        server_names.to_vec(),
        &server_names[0],
        // Client use too: etcd's JSON gateway dials its own listener with
        // its server certificate when client certificates are required.
        vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ],
    )?;
    for c in clients {
        leaf(
            &out.join(format!("client-{c}")),
            "client",
            Vec::new(),
            c,
            vec![ExtendedKeyUsagePurpose::ClientAuth],
        )?;
    }
    Ok(())
}
