//! Calling another daemon's HTTP API with this store's identity: the
//! server's certificate must be pinned here (as one of the roles the
//! caller expects), and this store's certificate is presented as the
//! client's.

use crate::{CertError, CertStore, Role};
use std::path::PathBuf;
use std::time::Duration;

/// The environment variable naming an operator's store directory (the
/// CLI's `--tls-dir`).
pub const TLS_DIR_ENV: &str = "FERRY_TLS_DIR";

/// Whether a call to `url` (`HOST:PORT` or a URL) goes over TLS when the
/// caller has an identity: `https://` always, `http://` never, a bare
/// address unless it is a loopback one (where plaintext is the local
/// operator's).
pub fn wants_tls(url: &str) -> bool {
    if url.starts_with("https://") {
        return true;
    }
    if url.starts_with("http://") {
        return false;
    }
    let host = url.split('/').next().unwrap_or("");
    !crate::is_loopback_name(crate::host_of(host))
}

/// `url` as a base URL with the scheme the call uses.
pub fn base_url(url: &str, tls: bool) -> String {
    let bare = url
        .trim_start_matches("https://")
        .trim_start_matches("http://")
        .trim_end_matches('/');
    format!("{}://{bare}", if tls { "https" } else { "http" })
}

/// A ureq agent that calls over TLS with `store`'s identity, accepting
/// servers pinned as one of `roles`.
pub fn agent(
    store: &CertStore,
    roles: &[Role],
    timeout: Option<Duration>,
) -> Result<ureq::Agent, CertError> {
    let cfg = store.api_client_config(roles)?;
    let mut b = ureq::AgentBuilder::new().tls_config(cfg);
    if let Some(t) = timeout {
        b = b.timeout_connect(t.min(Duration::from_secs(5))).timeout(t);
    }
    Ok(b.build())
}

/// The operator's store named by `--tls-dir` or [`TLS_DIR_ENV`], if any.
pub fn operator_store(dir: Option<PathBuf>) -> Option<CertStore> {
    dir.or_else(|| std::env::var_os(TLS_DIR_ENV).map(PathBuf::from))
        .filter(|d| !d.as_os_str().is_empty())
        .map(|d| CertStore::at(&d, Role::Operator))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_unless_loopback_or_told() {
        assert!(wants_tls("10.0.0.1:10880"));
        assert!(wants_tls("st-b.example:10880"));
        assert!(wants_tls("https://127.0.0.1:1"));
        assert!(!wants_tls("127.0.0.1:10880"));
        assert!(!wants_tls("localhost:1"));
        assert!(!wants_tls("[::1]:1"));
        assert!(!wants_tls("http://10.0.0.1:1"));
        assert_eq!(base_url("http://a:1/", true), "https://a:1");
        assert_eq!(base_url("a:1", false), "http://a:1");
    }
}
