//! The daemon's configuration: one TOML file, every field defaulted, command
//! line flags applied on top.
//!
//! ```toml
//! pool = "ferry-pool"            # relative to the working directory
//!
//! [nbd]
//! listen = "127.0.0.1:10809"     # "" turns the NBD listener off
//! max_connections = 1024         # then new clients get the greeting and a close
//! max_connections_per_peer = 512 # per client address
//! max_in_flight = 128            # requests per connection
//! max_queued_bytes = 67108864    # requests + replies held per connection
//! max_queued_bytes_total = 1073741824  # the same, all connections together
//! tls_dir = ""                   # ca-cert.pem, server-cert.pem, server-key.pem: TLS
//!                                # with client certificates, required off loopback
//! tls_clear_loopback = true      # false: loopback clients must use TLS too
//! extended_headers = true        # offer NBD extended headers (64-bit lengths)
//! sendfile_reads = "sole-reader" # large cached READs on plain connections go from
//!                                # the file by sendfile while one connection alone
//!                                # reads; true: always; false: never (docs/benchmarks.md)
//! mapped_tls_reads = true        # over TLS, such READs are encrypted from the mapped
//!                                # pages; false: copied into a buffer first
//!
//! [admin]
//! listen = "127.0.0.1:10880"     # "" turns the admin API off; beyond loopback it
//!                                # requires TLS with a pinned client certificate
//! insecure_plaintext = false     # true: serve plaintext beyond loopback, unauthenticated
//!
//! [storage]
//! direct_io = false
//! allowed_paths = []             # directories whose files may become volumes (--path);
//!                                # [] = none: only the pool's own files
//! max_volume_size = 17592186044416  # largest size a create or resize may ask (16 TiB)
//!
//! [index]
//! block_size = 4096              # fingerprint granularity, 512 B .. 64 KiB
//! refresh_interval_ms = 1000     # re-hash written blocks this often; 0 = never
//! shared_scan_secs = 60          # shared gateway: index the cluster's volumes the index lacks, remove images crashed creates left; 0 = never
//!
//! [migration]
//! listen = ""                    # e.g. "0.0.0.0:10900" accepts incoming migrations
//! advertise_nbd = ""             # NBD HOST:PORT clients are sent to; "" = derived
//! advertise_admin = ""           # admin HOST:PORT the volume's next move starts at; "" = derived
//! advertise_iscsi = ""           # iSCSI HOST:PORT initiators are redirected to; "" = derived
//! plaintext = false              # loopback only: no TLS (for tests)
//! buddies = []                   # ["10.0.0.5:10900"]: same-site daemons to take blocks from
//!
//! [iscsi]
//! listen = []                    # portals, e.g. ["0.0.0.0:3260"]; each is its own portal group
//! base_iqn = "iqn.2026-11.io.ferry"   # volume v is target "<base_iqn>:v", LUN 0
//! port_group = 0                 # ALUA target port group of this site's portals, 1..4095;
//!                                # 0 = derived from the host name and the pool's path
//! max_connections = 1024         # per portal; then logins get "out of resources"
//! max_connections_per_peer = 512
//! max_queued_bytes = 67108864    # Data-In one connection may hold unsent
//! max_queued_bytes_total = 1073741824  # the same, all connections together
//! acl = []                       # initiator IQNs allowed on every target ([] = any)
//! chap_user = ""                 # one-way CHAP for every target ("" = off)
//! chap_secret = ""
//! mutual_user = ""               # mutual CHAP: what the target answers with
//! mutual_secret = ""
//! site_portal = ""               # shared Ceph gateways: the site's IPv4:PORT, held by one live gateway
//! site_portal_device = ""        # the interface its address goes on while this gateway holds it
//! site_portal_prefix = 32
//! [iscsi.targets.VOLUME]         # per-target overrides of acl / chap_* / mutual_*
//! [iscsi.groups]
//! cluster1 = ["vm1", "vm2"]      # target "<base_iqn>:cluster1" with vm1 at LUN 0, vm2 at LUN 1
//! ```

use serde::Deserialize;
use std::path::{Path, PathBuf};
use thiserror::Error;

pub const DEFAULT_NBD_ADDR: &str = "127.0.0.1:10809";
pub const DEFAULT_ADMIN_ADDR: &str = "127.0.0.1:10880";

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("parsing {path}: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: toml::de::Error,
    },
    #[error("invalid size {0:?}: use bytes or a number with K, M, G, T (powers of 1024)")]
    Size(String),
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub pool: PathBuf,
    pub nbd: NbdConfig,
    pub admin: AdminConfig,
    pub storage: StorageConfig,
    pub index: IndexConfig,
    pub migration: MigrationConfig,
    pub iscsi: IscsiConfig,
}

/// Who may reach a target: an ACL of initiator names and CHAP secrets.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct IscsiAccess {
    pub acl: Vec<String>,
    pub chap_user: String,
    pub chap_secret: String,
    pub mutual_user: String,
    pub mutual_secret: String,
}

/// The iSCSI target.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct IscsiConfig {
    /// Portals (`HOST:PORT`); empty turns the target off.
    pub listen: Vec<String>,
    /// Targets are named `<base_iqn>:<volume>`.
    pub base_iqn: String,
    /// The ALUA target port group every portal of this daemon belongs to
    /// (1..=4095; at most 15 portals). Two sites a volume moves between
    /// must differ. 0: derived from the host name and the pool's path.
    pub port_group: u16,
    /// Open iSCSI connections at most, per portal.
    pub max_connections: usize,
    /// Connections one peer address may hold (0: no cap of its own).
    pub max_connections_per_peer: usize,
    /// Bytes of Data-In one connection may hold before they are sent; an
    /// initiator that does not read is not read further.
    pub max_queued_bytes: usize,
    /// The same, over all iSCSI connections together.
    pub max_queued_bytes_total: usize,
    /// Defaults for every target (and discovery).
    pub acl: Vec<String>,
    pub chap_user: String,
    pub chap_secret: String,
    pub mutual_user: String,
    pub mutual_secret: String,
    /// Per-target overrides (replace the defaults wholesale), by volume or
    /// group name.
    pub targets: std::collections::BTreeMap<String, IscsiAccess>,
    /// Targets with several LUNs: target `<base_iqn>:<group>` serves the
    /// listed volumes as LUN 0, 1, ... (at most 256).
    pub groups: std::collections::BTreeMap<String, Vec<String>>,
    /// The site's portal (`IPv4:PORT`), for shared gateways
    /// (`[storage.ceph] shared`): one address initiators are given for the
    /// whole site, answered by one live gateway at a time (a lease in the
    /// cluster); when that gateway dies another takes the address, and an
    /// initiator reconnecting to it finds the volume there. Empty: none.
    pub site_portal: String,
    /// The interface the site portal's address is added to while this
    /// gateway holds it.
    pub site_portal_device: String,
    /// The address's prefix length on that interface.
    pub site_portal_prefix: u8,
}

pub const DEFAULT_BASE_IQN: &str = "iqn.2026-11.io.ferry";

impl Default for IscsiConfig {
    fn default() -> Self {
        IscsiConfig {
            listen: Vec::new(),
            base_iqn: DEFAULT_BASE_IQN.into(),
            port_group: 0,
            max_connections: 1024,
            max_connections_per_peer: 512,
            max_queued_bytes: 64 << 20,
            max_queued_bytes_total: 1 << 30,
            acl: Vec::new(),
            chap_user: String::new(),
            chap_secret: String::new(),
            mutual_user: String::new(),
            mutual_secret: String::new(),
            targets: Default::default(),
            groups: Default::default(),
            site_portal: String::new(),
            site_portal_device: String::new(),
            site_portal_prefix: 32,
        }
    }
}

impl IscsiConfig {
    /// The access rules of `volume`'s target (its override, or the defaults).
    pub fn access(&self, volume: Option<&str>) -> IscsiAccess {
        if let Some(t) = volume.and_then(|v| self.targets.get(v)) {
            return t.clone();
        }
        IscsiAccess {
            acl: self.acl.clone(),
            chap_user: self.chap_user.clone(),
            chap_secret: self.chap_secret.clone(),
            mutual_user: self.mutual_user.clone(),
            mutual_secret: self.mutual_secret.clone(),
        }
    }
}

/// Incoming migrations (the destination side).
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct MigrationConfig {
    /// Where to accept migrations; "" turns the listener off.
    pub listen: String,
    /// The NBD `HOST:PORT` handed to clients after a switch. Empty: the NBD
    /// listen address, with an unspecified IP replaced by the address the
    /// migration arrived on.
    pub advertise_nbd: String,
    /// The admin API `HOST:PORT` handed back to a migration's source, so
    /// the hosts of a guest whose disk arrived here start its next move
    /// here. Empty: the admin listen address, with an unspecified IP
    /// replaced by the address the migration arrived on; none when the
    /// admin API listens on loopback and the migration came from beyond.
    pub advertise_admin: String,
    /// The iSCSI portal (`HOST:PORT`) a migration's source redirects
    /// initiators to once the volume lives here. Empty: the first iSCSI
    /// portal, derived as for NBD; none when it is loopback and the
    /// migration came from beyond.
    pub advertise_iscsi: String,
    /// Accept migrations without TLS. Refused unless `listen` is loopback.
    pub plaintext: bool,
    /// Migration listeners (`HOST:PORT`) of daemons on this site whose
    /// blocks an incoming migration may use before asking the source
    /// (buddy servers). Each must trust this daemon's certificate and be
    /// trusted by it.
    pub buddies: Vec<String>,
    /// Bytes the pool's file system keeps free: an incoming copy that would
    /// leave less is refused before anything is written.
    pub reserve_bytes: u64,
    /// An incomplete copy of an incoming migration that no migration has
    /// touched for this long is deleted (0: kept until deleted by hand). A
    /// migration of the same volume resumes into such a copy meanwhile.
    pub incomplete_ttl_secs: u64,
    /// How often a volume held in doubt (its migration's switch may have
    /// happened, and this daemon did not learn the answer) is settled by
    /// asking its destination; the first look comes after this long too,
    /// so an operator who runs the migration again goes first.
    pub in_doubt_check_secs: u64,
}

impl Default for MigrationConfig {
    fn default() -> Self {
        MigrationConfig {
            listen: String::new(),
            advertise_nbd: String::new(),
            advertise_admin: String::new(),
            advertise_iscsi: String::new(),
            plaintext: false,
            buddies: Vec::new(),
            reserve_bytes: 64 << 20,
            incomplete_ttl_secs: 24 * 3600,
            in_doubt_check_secs: 30,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct IndexConfig {
    /// Bytes per fingerprinted block.
    pub block_size: u32,
    /// How often written blocks are re-hashed into the index (0: never).
    pub refresh_interval_ms: u64,
    /// A shared gateway looks this often for the cluster's shared volumes
    /// its index lacks (made or written through other gateways) and scans
    /// them in the background, and removes the temporary images crashed
    /// creates left (0: never; `ferry index rebuild` still scans).
    pub shared_scan_secs: u64,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            block_size: 4096,
            refresh_interval_ms: 1000,
            shared_scan_secs: 60,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct NbdConfig {
    pub listen: String,
    pub max_connections: usize,
    /// Connections one peer address may hold (0: no cap of its own).
    pub max_connections_per_peer: usize,
    pub max_in_flight: usize,
    /// Bytes of requests and unsent replies one connection may hold; a
    /// client that does not read its replies is not read further.
    pub max_queued_bytes: usize,
    /// The same, over all connections together.
    pub max_queued_bytes_total: usize,
    /// TLS credentials in QEMU's x509 layout (`ca-cert.pem`,
    /// `server-cert.pem`, `server-key.pem`); "" = no TLS. With them every
    /// client not on loopback must use TLS and present a certificate
    /// signed by `ca-cert.pem`.
    pub tls_dir: PathBuf,
    /// With `tls_dir`: whether loopback clients may skip TLS (the default;
    /// `false` requires TLS of every client).
    pub tls_clear_loopback: bool,
    /// Offer extended headers (`NBD_OPT_EXTENDED_HEADERS`: 64-bit TRIM,
    /// WRITE_ZEROES and BLOCK_STATUS) to clients that ask.
    pub extended_headers: bool,
    /// When a READ of more than 128 KiB whose pages are all cached goes
    /// from the volume's file by `sendfile` (connections without TLS).
    pub sendfile_reads: SendfileReads,
    /// Whether such a READ over TLS is encrypted straight from the file's
    /// pages, mapped for the reply (true, the default: a fifth less of the
    /// server's CPU per byte), or copied into a buffer first.
    pub mapped_tls_reads: bool,
}

/// `nbd.sendfile_reads`: `false`, `true` or `"sole-reader"`.
///
/// `"sole-reader"` by default: on this project's 2-core bench sendfile
/// lifts one connection's 1 MiB reads by a tenth to twice and costs four
/// connections a quarter to a third, the clients' receive work doubling
/// when they share the server's cores (docs/benchmarks.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(try_from = "SendfileReadsSetting")]
pub enum SendfileReads {
    /// Every READ is copied out of the volume (`false`).
    Off,
    /// Every eligible READ goes by sendfile (`true`).
    Always,
    /// Only while one connection alone has been sending the daemon large
    /// READs (for `nbd::sole_reader::SOLE_FOR`).
    #[default]
    SoleReader,
}

/// How `nbd.sendfile_reads` may be written.
#[derive(Deserialize)]
#[serde(untagged)]
enum SendfileReadsSetting {
    Switch(bool),
    Word(String),
}

impl TryFrom<SendfileReadsSetting> for SendfileReads {
    type Error = String;

    fn try_from(s: SendfileReadsSetting) -> Result<Self, String> {
        match s {
            SendfileReadsSetting::Switch(false) => Ok(SendfileReads::Off),
            SendfileReadsSetting::Switch(true) => Ok(SendfileReads::Always),
            SendfileReadsSetting::Word(w) if w == "sole-reader" => Ok(SendfileReads::SoleReader),
            SendfileReadsSetting::Word(w) => Err(format!(
                "nbd.sendfile_reads: {w:?} is none of false, true, \"sole-reader\""
            )),
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    pub listen: String,
    /// Serve plaintext, unauthenticated calls beyond loopback (loudly
    /// logged; `--insecure-plaintext-api`).
    pub insecure_plaintext: bool,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct StorageConfig {
    pub direct_io: bool,
    /// Most bytes per second a SANITIZE writes or erases, so that one
    /// volume's sanitize leaves the disk to the others (0: no limit).
    pub sanitize_bytes_per_sec: u64,
    /// Directories whose regular files may be made volumes (`path` of a
    /// create); empty: none.
    pub allowed_paths: Vec<PathBuf>,
    /// The largest size a create or a resize (admin API, NBD RESIZE) may
    /// ask for.
    pub max_volume_size: u64,
    /// A Ceph pool whose RBD images hold volumes' data (`[storage.ceph]`).
    pub ceph: Option<CephConfig>,
}

/// How to reach the Ceph pool volumes may live in.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct CephConfig {
    /// The cluster's configuration file (its monitors).
    pub conf: PathBuf,
    /// The keyring holding the client's cephx key; empty: where `conf` says.
    pub keyring: PathBuf,
    /// The cephx client, without `client.`.
    pub client: String,
    /// The RBD pool.
    pub pool: String,
    /// New volumes go to Ceph unless created on a file (`--backing file`).
    pub default: bool,
    /// Seconds to wait for the monitors when the daemon starts.
    pub connect_timeout_secs: u32,
    /// This daemon is one of several gateways in front of the pool: its
    /// RBD volumes keep their metadata, bitmaps and holder in the cluster
    /// (image metadata), any gateway serves any of them, one at a time.
    /// Needs an NBD address other gateways reach (`migration.advertise_nbd`
    /// or a listener on a specific address).
    pub shared: bool,
}

impl Default for CephConfig {
    fn default() -> Self {
        CephConfig {
            conf: PathBuf::from("/etc/ceph/ceph.conf"),
            keyring: PathBuf::new(),
            client: "admin".into(),
            pool: "rbd".into(),
            default: true,
            connect_timeout_secs: 30,
            shared: false,
        }
    }
}

/// 16 TiB.
pub const DEFAULT_MAX_VOLUME_SIZE: u64 = 16 << 40;

impl Default for StorageConfig {
    fn default() -> Self {
        StorageConfig {
            direct_io: false,
            sanitize_bytes_per_sec: 256 << 20,
            allowed_paths: Vec::new(),
            max_volume_size: DEFAULT_MAX_VOLUME_SIZE,
            ceph: None,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            pool: PathBuf::from("ferry-pool"),
            nbd: NbdConfig::default(),
            admin: AdminConfig::default(),
            storage: StorageConfig::default(),
            index: IndexConfig::default(),
            migration: MigrationConfig::default(),
            iscsi: IscsiConfig::default(),
        }
    }
}

impl Default for NbdConfig {
    fn default() -> Self {
        NbdConfig {
            listen: DEFAULT_NBD_ADDR.into(),
            max_connections: 1024,
            max_connections_per_peer: 512,
            max_in_flight: 128,
            max_queued_bytes: 64 << 20,
            max_queued_bytes_total: 1 << 30,
            tls_dir: PathBuf::new(),
            tls_clear_loopback: true,
            extended_headers: true,
            sendfile_reads: SendfileReads::SoleReader,
            mapped_tls_reads: true,
        }
    }
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: DEFAULT_ADMIN_ADDR.into(),
            insecure_plaintext: false,
        }
    }
}

impl Config {
    /// Read a config file; missing fields take their defaults.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        Self::parse(&text).map_err(|source| ConfigError::Parse {
            path: path.into(),
            source,
        })
    }

    pub fn parse(text: &str) -> Result<Config, toml::de::Error> {
        toml::from_str(text)
    }
}

/// Parse "4096", "10G", "512MiB", "1.5T" into bytes (binary units).
pub fn parse_size(s: &str) -> Result<u64, ConfigError> {
    let t = s.trim();
    let err = || ConfigError::Size(s.into());
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(err()),
    };
    if num.contains('.') {
        let f: f64 = num.parse().map_err(|_| err())?;
        let v = f * mult as f64;
        if !(0.0..1.8e19).contains(&v) {
            return Err(err());
        }
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        return Ok(v as u64);
    }
    let n: u64 = num.parse().map_err(|_| err())?;
    n.checked_mul(mult).ok_or_else(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("10G").unwrap(), 10 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5k").unwrap(), 1536);
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn config_defaults_and_overrides() {
        let c = Config::parse("pool = \"/p\"\n[nbd]\nlisten = \"\"\n").unwrap();
        assert_eq!(c.pool, PathBuf::from("/p"));
        assert_eq!(c.nbd.listen, "");
        assert_eq!(c.nbd.max_in_flight, 128);
        assert_eq!(c.admin.listen, DEFAULT_ADMIN_ADDR);
        assert!(Config::parse("bogus = 1").is_err());
        let c = Config::parse(
            "[iscsi]\nlisten = [\"127.0.0.1:3260\"]\nchap_user = \"u\"\n[iscsi.targets.v]\nacl = [\"iqn.x\"]\n",
        )
        .unwrap();
        assert_eq!(c.iscsi.base_iqn, DEFAULT_BASE_IQN);
        assert_eq!(c.iscsi.access(Some("w")).chap_user, "u");
        assert_eq!(c.iscsi.targets["v"].acl, vec!["iqn.x".to_string()]);
    }

    #[test]
    fn sendfile_reads_is_a_switch_or_sole_reader() {
        let nbd = |v: &str| Config::parse(&format!("[nbd]\nsendfile_reads = {v}\n"));
        let default = Config::parse("").unwrap().nbd.sendfile_reads;
        assert_eq!(default, SendfileReads::SoleReader);
        assert_eq!(nbd("false").unwrap().nbd.sendfile_reads, SendfileReads::Off);
        assert_eq!(
            nbd("true").unwrap().nbd.sendfile_reads,
            SendfileReads::Always
        );
        let c = nbd("\"sole-reader\"").unwrap();
        assert_eq!(c.nbd.sendfile_reads, SendfileReads::SoleReader);
        assert!(Config::parse("").unwrap().nbd.mapped_tls_reads);
        let off = Config::parse("[nbd]\nmapped_tls_reads = false\n").unwrap();
        assert!(!off.nbd.mapped_tls_reads);
        let e = nbd("\"sometimes\"").unwrap_err().to_string();
        assert!(e.contains("sometimes") && e.contains("sole-reader"), "{e}");
        assert!(nbd("1").is_err());
    }
}
