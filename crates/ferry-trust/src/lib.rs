//! Who may call whom between ferry daemons.
//!
//! - [`store`]: each daemon's pinned identity and the certificates it
//!   trusts, each pinned as a [`Role`]; TLS configurations for migrations
//!   and moves (peers of one's own kind) and for the HTTP APIs (any role).
//! - [`api`]: serving an HTTP API: TLS with client certificates whenever
//!   it listens beyond loopback, bounded connections and handshakes, and
//!   the guards every request passes (the Host header and the Content-Type
//!   a browser cannot forge, and the caller's role for the route).
//! - [`client`]: calling another daemon's API with this store's identity.
//!
//! The model is written out in docs/security.md.

pub mod api;
pub mod client;
pub mod listen;
pub mod store;

pub use store::{CertError, CertStore, Peer};

/// What a pinned certificate is allowed to be. Each HTTP route names the
/// roles that may call it; [`Role::Operator`] may call every route.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// A person (the CLI): everything.
    Operator,
    /// `ferry control run`: reads, samples, probes, starts and cancels moves.
    Controller,
    /// `ferry host`: drives the migrations of its guests' volumes.
    Host,
    /// `ferry serve`: migrates volumes to its peers.
    Storage,
    /// Read only (dashboards, scrapers).
    Monitor,
}

impl Role {
    pub const ALL: [Role; 5] = [
        Role::Operator,
        Role::Controller,
        Role::Host,
        Role::Storage,
        Role::Monitor,
    ];

    /// The name of the `trusted/` subdirectory holding this role's peers.
    pub fn dir_name(self) -> &'static str {
        match self {
            Role::Operator => "operator",
            Role::Controller => "controller",
            Role::Host => "host",
            Role::Storage => "storage",
            Role::Monitor => "monitor",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.dir_name())
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Role, String> {
        Role::ALL
            .into_iter()
            .find(|r| r.dir_name() == s)
            .ok_or_else(|| {
                format!("unknown role {s:?}: operator, controller, host, storage or monitor")
            })
    }
}

/// The host part of an address: `HOST` of `HOST:PORT`, `V6` of
/// `[V6]:PORT`, or the address itself when it has no port.
pub fn host_of(addr: &str) -> &str {
    match addr.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => addr.rsplit_once(':').map_or(addr, |(h, _)| h),
    }
}

/// Whether `host` (a Host header's name, or an address) names this machine
/// over loopback.
pub fn is_loopback_name(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    h.eq_ignore_ascii_case("localhost")
        || h.to_ascii_lowercase().ends_with(".localhost")
        || h.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_parse_and_print_as_their_directory() {
        for r in Role::ALL {
            assert_eq!(r.to_string().parse::<Role>(), Ok(r));
        }
        assert!("root".parse::<Role>().unwrap_err().contains("operator"));
    }

    #[test]
    fn the_host_of_an_address() {
        assert_eq!(host_of("a.example:10880"), "a.example");
        assert_eq!(host_of("[::1]:1"), "::1");
        assert_eq!(host_of("localhost"), "localhost");
        assert_eq!(host_of("[::1"), "::1");
    }

    #[test]
    fn loopback_names() {
        for h in [
            "localhost",
            "127.0.0.1",
            "127.3.4.5",
            "[::1]",
            "a.localhost",
        ] {
            assert!(is_loopback_name(h), "{h}");
        }
        for h in [
            "evil.example",
            "10.0.0.1",
            "localhost.evil.example",
            "[::2]",
        ] {
            assert!(!is_loopback_name(h), "{h}");
        }
    }
}
