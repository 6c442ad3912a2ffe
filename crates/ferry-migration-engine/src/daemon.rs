//! What the engine needs from the daemon that runs it: the pool and its
//! fingerprint index, a few settings, the registry of runs, and two
//! notifications. `ferry-server`'s `ServerState` implements it; a test or
//! another daemon can implement it with nothing else of the server.

use crate::Registry;
use ferry_api::Report;
use ferry_index::PoolIndex;
use ferry_storage::{Pool, Volume};
use std::net::SocketAddr;
use std::sync::Arc;

pub trait StorageDaemon: Send + Sync + 'static {
    /// The volumes: sources are read from it, copies created in it.
    fn pool(&self) -> &Arc<Pool>;
    /// Where the destination looks for blocks it already holds.
    fn index(&self) -> &Arc<PoolIndex>;
    /// The migrations this daemon started (source side).
    fn registry(&self) -> &Registry;
    /// Bytes per fingerprinted chunk (the index's block size).
    fn chunk_size(&self) -> u32;
    /// Plaintext migration links (loopback only) instead of TLS.
    fn plaintext(&self) -> bool;
    /// Migration listeners of same-site daemons to ask for blocks.
    fn buddies(&self) -> &[String];
    /// Bytes the pool must keep free after an incoming copy is complete.
    fn reserve_bytes(&self) -> u64 {
        64 << 20
    }
    /// The NBD `HOST:PORT` clients are sent to once a volume arrived here;
    /// `local` is the address the migration connection came in on.
    fn advertised_nbd(&self, local: Option<SocketAddr>) -> String;
    /// The admin API `HOST:PORT` a volume's next migration from here is
    /// started at ("" if this daemon advertises none).
    fn advertised_admin(&self, _local: Option<SocketAddr>) -> String {
        String::new()
    }
    /// How this daemon exports a volume to SCSI initiators: the portal it
    /// advertises and its target port group (nothing if it has no iSCSI).
    /// `local` is the address of the migration connection on this side.
    fn iscsi_port(&self, _local: Option<SocketAddr>) -> ferry_migration::IscsiPort {
        ferry_migration::IscsiPort::default()
    }
    /// A volume this daemon sent away has switched: it is marked moved, and
    /// its clients here should be told to go (iSCSI sessions).
    fn volume_moved(&self, _vol: &Arc<Volume>) {}
    /// A migration this daemon started has ended (metrics, logs).
    fn migration_finished(&self, _report: &Report) {}
    /// A volume arrived here complete (index it so it can be a base).
    fn volume_arrived(&self, _vol: &Arc<Volume>) {}
    /// The copy that just arrived rebuilt `bytes` of blocks this daemon
    /// already held in `seconds` of its own work (found, copied or shared,
    /// their writeback included but for its last step): what a move here
    /// costs per byte it need not send ([`crate::destination`] reports
    /// a copy that rebuilt at least [`crate::destination::MIN_MEASURED_REBUILD`]).
    fn local_rebuild_measured(&self, _bytes: u64, _seconds: f64) {}
    /// A switch this daemon made as a migration's source held the
    /// volume's writes `hold`, over a link whose round trip the migration
    /// timed at `rtt` (its fastest `Ping`): what a move from here pauses
    /// writes for besides the link. Told only for a switch made on the
    /// migration's first connection and not held for its caller.
    fn switch_hold_measured(&self, _hold: std::time::Duration, _rtt: std::time::Duration) {}
    /// A migration this daemon sent as the source, on one connection and
    /// not held for its caller, that went from its first pass (at most
    /// 4 MiB on the wire) to the pause took `fixed` besides its round
    /// trips and pause: the daemons' own work (TLS, the copy's opening,
    /// the prints' scan and answer, the digest), what a small move from
    /// here costs besides its link.
    fn move_setup_measured(&self, _fixed: std::time::Duration) {}
    /// A copy here is committed (its metadata says `arrived`), and its
    /// clients go to `location` (NBD) and `admin` from now: the `Done`
    /// the source is about to read. A host at this site waiting for the
    /// volume may use it at once.
    fn copy_committed(&self, _vol: &Arc<Volume>, _location: &str, _admin: &str) {}
}
