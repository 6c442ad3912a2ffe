//! `ferry`: the storage daemon, its admin commands, and the load generator.

mod control;
mod demo;
mod migrate;
mod nbd_certs;
mod transfer;
mod vm;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use ferry_api::{AdminClient, BitmapRequest, CreateVolume, Size};
use ferry_server::config::{parse_size, Config, DEFAULT_ADMIN_ADDR};
use std::path::PathBuf;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "ferry",
    version,
    about = "VM disk storage over NBD, migrated across WANs"
)]
struct Cli {
    /// An operator's TLS identity (cert.pem, key.pem, and trusted/ with the
    /// daemons' certificates; `ferry certs identity` makes one): every call
    /// to a daemon beyond loopback (or to an https:// address) goes over TLS
    /// with it.
    #[arg(long, global = true, env = "FERRY_TLS_DIR", value_name = "DIR")]
    tls_dir: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the storage daemon.
    Serve(ServeArgs),
    /// Manage volumes through the daemon's admin API.
    Volume {
        #[command(subcommand)]
        cmd: VolumeCmd,
        #[command(flatten)]
        admin: AdminArg,
    },
    /// Manage a volume's dirty bitmaps.
    Bitmap {
        #[command(subcommand)]
        cmd: BitmapCmd,
        #[command(flatten)]
        admin: AdminArg,
    },
    /// The fingerprint index: status, rebuild, and the similarity of images.
    Index {
        #[command(subcommand)]
        cmd: IndexCmd,
        #[command(flatten)]
        admin: AdminArg,
    },
    /// Move a live volume to another daemon (blocks until it ends).
    Migrate {
        #[command(flatten)]
        args: migrate::MigrateArgs,
        #[command(flatten)]
        admin: AdminArg,
    },
    /// Release a migration started with --hold-switch: pause the guest's
    /// writes and switch now (or as soon as it converges).
    MigrateSwitch {
        id: ferry_api::MigrationId,
        #[command(flatten)]
        admin: AdminArg,
    },
    /// The agent on a VM host: a stable local NBD endpoint for one volume
    /// that follows it when it migrates.
    Host {
        /// NBD HOST:PORT of the server that holds --volume now.
        #[arg(long, requires = "volume")]
        server: Option<String>,
        /// Volume (export) name to forward from the start.
        #[arg(long, requires = "server")]
        volume: Option<String>,
        /// Where the hypervisor connects: HOST:PORT or unix:PATH
        /// (repeatable; guests of --state-dir use its own socket).
        #[arg(long)]
        listen: Vec<String>,
        /// Control API (HTTP) for attaching and detaching more volumes,
        /// and for guests with --state-dir, e.g. 127.0.0.1:10890.
        #[arg(long)]
        control: Option<String>,
        /// Run QEMU guests, keeping their definitions here (also the
        /// host's TLS identity for moves: `ferry certs --pool DIR`).
        #[arg(long)]
        state_dir: Option<PathBuf>,
        /// Where other hosts send guests (TLS), HOST:PORT.
        #[arg(long, requires = "state_dir")]
        move_listen: Option<String>,
        /// Serve the control API in plaintext, with no authentication,
        /// beyond loopback (only on a network you trust; logged as
        /// insecure). Without it, beyond loopback needs --state-dir (the
        /// host's TLS identity) and callers with pinned certificates.
        #[arg(long)]
        insecure_plaintext_api: bool,
        /// A directory guests' kernels and initrds may come from
        /// (repeatable; default STATE_DIR/images). Any other boot file is
        /// refused.
        #[arg(long, value_name = "DIR", requires = "state_dir")]
        image_dir: Vec<PathBuf>,
        /// A storage daemon (NBD HOST:PORT) beyond this machine whose
        /// volumes guests here may use as disks (repeatable; those on this
        /// machine need not be named). A disk on any other server is
        /// refused at create, start and arrival.
        #[arg(long, value_name = "HOST:PORT", requires = "state_dir")]
        storage: Vec<String>,
        /// One site's gateways in front of one Ceph cluster (`ferry serve
        /// --ceph-shared`), comma-separated, each its NBD address and,
        /// after `@`, its admin API (repeatable, one per site): a disk
        /// whose gateway does not answer is looked for at the next one,
        /// its requests held and sent again there, and a move of it starts
        /// at the admin API of a gateway that answers. They count as
        /// --storage.
        #[arg(long, value_name = "NBD[@ADMIN],NBD[@ADMIN]...")]
        gateways: Vec<String>,
        /// Another host's move address (HOST:PORT) beyond this machine
        /// that `/v1/probe` may measure the link to (repeatable).
        #[arg(long, value_name = "HOST:PORT", requires = "state_dir")]
        peer: Vec<String>,
        /// The unprivileged user guests' QEMU runs as (`-runas`) when this
        /// daemon runs as root; "" runs them as root (logged).
        #[arg(long, default_value = ferry_vm_host::confine::DEFAULT_QEMU_USER)]
        qemu_user: String,
        /// Reach storage daemons' NBD over TLS with the credentials in DIR
        /// (QEMU's client layout: ca-cert.pem, client-cert.pem,
        /// client-key.pem; `ferry certs nbd` makes them). Needed for any
        /// storage daemon beyond this host.
        #[arg(long, value_name = "DIR")]
        nbd_tls_dir: Option<PathBuf>,
        /// Measure each running guest's memory every SECS seconds, for
        /// the controller's cost of moving it: how fast it dirties it
        /// (QEMU's calc-dirty-rate, one second of page sampling) and how
        /// much of it a move sends (a sample of its pages); 0: never.
        #[arg(long, value_name = "SECS", default_value_t = 30)]
        memory_sample_every: u64,
        /// What a stop of this daemon (SIGTERM, Ctrl-C) does to its
        /// guests: keep (they run on; their disk requests wait up to 30 s
        /// for the next daemon on this state directory, then fail) or
        /// stop (each is shut down, power button first, while its disk is
        /// still served; it stays stopped). SIGKILL always keeps them.
        #[arg(long, default_value = "keep", value_parser = str::parse::<ferry_vm_host::daemon::OnStop>)]
        on_stop: ferry_vm_host::daemon::OnStop,
        /// With --on-stop stop: how long a guest may take to power off
        /// before QEMU is ended.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        stop_timeout: Duration,
        /// A network guests' NICs may plug into (repeatable):
        /// NAME,bridge=BR[,vxlan=VNI|geneve=VNI,local=IP,peer=IP[,peer=IP..][,dev=IF][,port=N]].
        /// The bridge (and the VXLAN link, or one GENEVE link per peer,
        /// joining it to the same network at the peers; IPv4 or IPv6) is
        /// made at start if missing; every site's hosts give a network the
        /// same name, encapsulation and VNI.
        #[arg(long = "network", value_name = "NETWORK", requires = "state_dir")]
        networks: Vec<ferry_vm_host::network::Network>,
    },
    /// Placement: the controller (run, status, pause, resume), one-off
    /// plans and a simulator.
    Control {
        #[command(subcommand)]
        cmd: control::ControlCmd,
    },
    /// The sites the controller knows (its inventory).
    Site {
        #[command(subcommand)]
        cmd: control::SiteCmd,
    },
    /// Guests on a `ferry host` and their moves.
    Vm {
        #[command(subcommand)]
        cmd: vm::VmCmd,
        #[command(flatten)]
        host: vm::HostArg,
    },
    /// The daemon's migration certificate and the peers it trusts.
    Certs {
        #[command(subcommand)]
        cmd: migrate::CertsCmd,
        /// Pool directory of the daemon.
        #[arg(long, global = true, default_value = "ferry-pool")]
        pool: PathBuf,
    },
    /// Generate load on an NBD export and report IOPS, MB/s and latency.
    Bench(BenchArgs),
    /// Start a daemon on a temporary pool, import a disk image, run the
    /// benchmark profiles and print the table.
    Demo(demo::DemoArgs),
}

#[derive(Args)]
struct AdminArg {
    /// Admin API of the daemon.
    #[arg(long, global = true, env = "FERRY_ADMIN", default_value = DEFAULT_ADMIN_ADDR)]
    admin: String,
}

#[derive(Args)]
struct ServeArgs {
    /// TOML configuration file.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Pool directory (default ./ferry-pool).
    #[arg(long)]
    pool: Option<PathBuf>,
    /// NBD listen address; "" turns it off.
    #[arg(long)]
    nbd: Option<String>,
    /// NBD over TLS: a directory with ca-cert.pem, server-cert.pem and
    /// server-key.pem (QEMU's x509 layout; `ferry certs nbd` makes one).
    /// Clients not on loopback must then use TLS with a certificate signed
    /// by ca-cert.pem.
    #[arg(long, value_name = "DIR")]
    nbd_tls_dir: Option<PathBuf>,
    /// Admin API listen address; "" turns it off. Beyond loopback it
    /// requires TLS with a client certificate pinned in the pool.
    #[arg(long)]
    admin: Option<String>,
    /// Serve the admin API in plaintext, with no authentication, beyond
    /// loopback (only on a network you trust; logged as insecure).
    #[arg(long)]
    insecure_plaintext_api: bool,
    /// A directory whose files may be made volumes (`ferry volume create
    /// --path FILE`; repeatable). Without one, only the pool's own files.
    #[arg(long, value_name = "DIR")]
    allow_path: Vec<PathBuf>,
    /// Open backing files with O_DIRECT.
    #[arg(long)]
    direct_io: bool,
    /// Keep volumes' data in RBD images of a Ceph cluster: its
    /// configuration file (sets `[storage.ceph] conf`; new volumes go to
    /// Ceph unless created with `--backing file`).
    #[arg(long, value_name = "FILE")]
    ceph_conf: Option<PathBuf>,
    /// The Ceph pool for volumes (default rbd).
    #[arg(long, value_name = "POOL")]
    ceph_pool: Option<String>,
    /// The keyring with the cephx key (default: as the configuration says).
    #[arg(long, value_name = "FILE")]
    ceph_keyring: Option<PathBuf>,
    /// The cephx client name, without `client.` (default admin).
    #[arg(long, value_name = "NAME")]
    ceph_client: Option<String>,
    /// This daemon is one of several gateways in front of the Ceph pool
    /// (`[storage.ceph] shared`): volumes' state lives in the cluster and
    /// any gateway serves any volume, one at a time.
    #[arg(long)]
    ceph_shared: bool,
    /// Accept incoming migrations on this address (HOST:PORT).
    #[arg(long)]
    migrate: Option<String>,
    /// Accept migrations without TLS (the listener must be loopback).
    #[arg(long)]
    migrate_plaintext: bool,
    /// NBD HOST:PORT to send clients to after a migration arrives here.
    #[arg(long)]
    advertise_nbd: Option<String>,
    /// Admin HOST:PORT the hosts of a guest whose disk arrives here are
    /// told to start its next move at (default: derived from --admin).
    #[arg(long)]
    advertise_admin: Option<String>,
    /// Delete an incomplete incoming copy no migration has touched for
    /// this many seconds (0: never; default 86400).
    #[arg(long, value_name = "SECS")]
    incomplete_ttl: Option<u64>,
    /// Serve every volume as an iSCSI target on this portal (HOST:PORT);
    /// repeat for more portals (multipath). Without an ACL or CHAP in the
    /// config file, only loopback portals answer.
    #[arg(long = "iscsi", value_name = "ADDR")]
    iscsi: Vec<String>,
    /// Base IQN: volume V is target "<BASE>:V".
    #[arg(long)]
    iscsi_base_iqn: Option<String>,
    /// iSCSI HOST:PORT the source of a volume that arrives here redirects
    /// its initiators to (default: derived from the first --iscsi portal).
    #[arg(long)]
    advertise_iscsi: Option<String>,
    /// ALUA target port group of this daemon's portals, 1..4095 (default:
    /// derived from the host name and the pool's path); the sites a
    /// volume moves between must differ.
    #[arg(long, value_name = "N")]
    iscsi_port_group: Option<u16>,
    /// The site's iSCSI portal (IPv4:PORT) for shared Ceph gateways: the
    /// one live gateway holding its lease in the cluster adds the address
    /// to --iscsi-site-device and answers there; when it dies another
    /// takes it over, so initiators given this address follow.
    #[arg(long, value_name = "ADDR", requires = "iscsi_site_device")]
    iscsi_site_portal: Option<String>,
    /// The interface the site portal's address goes on.
    #[arg(long, value_name = "DEV")]
    iscsi_site_device: Option<String>,
}

#[derive(Subcommand)]
enum VolumeCmd {
    /// Create a volume.
    Create {
        name: String,
        #[arg(long)]
        size: Option<String>,
        #[arg(long, default_value_t = 512)]
        block_size: u32,
        /// Physical block size to report when larger than --block-size
        /// (512e: --block-size 512 --physical-block-size 4096).
        #[arg(long)]
        physical_block_size: Option<u32>,
        /// Allocate every block now (default: sparse).
        #[arg(long)]
        preallocate: bool,
        /// Use an existing file or block device as the backing store.
        #[arg(long)]
        path: Option<PathBuf>,
        /// Where the data lives: `ceph` (an RBD image of the daemon's
        /// `[storage.ceph]` pool) or `file` (the pool directory). Default:
        /// as the daemon's `storage.ceph.default` says.
        #[arg(long, value_parser = ["ceph", "file"])]
        backing: Option<String>,
        #[arg(long)]
        read_only: bool,
        /// Print the new volume as JSON.
        #[arg(long)]
        json: bool,
    },
    /// List volumes.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Show one volume as JSON.
    Info { name: String },
    /// Change a volume's size.
    Resize {
        name: String,
        size: String,
        #[arg(long)]
        allow_shrink: bool,
    },
    /// Delete a volume and its data.
    Delete {
        name: String,
        /// Delete even while NBD clients or iSCSI sessions use it (they get
        /// errors); never while it migrates.
        #[arg(long)]
        force: bool,
    },
    /// Copy a raw image into a volume (created to fit if missing).
    Import { name: String, file: PathBuf },
    /// Copy a volume out to a sparse raw image.
    Export { name: String, file: PathBuf },
}

#[derive(Subcommand)]
enum BitmapCmd {
    /// Add a dirty bitmap to a volume.
    Add {
        volume: String,
        name: String,
        #[arg(long, default_value = "64K")]
        granularity: String,
        #[arg(long)]
        persistent: bool,
    },
    /// List a volume's bitmaps.
    List { volume: String },
    /// Clear a bitmap.
    Clear { volume: String, name: String },
    /// Remove a bitmap.
    Remove { volume: String, name: String },
}

#[derive(Subcommand)]
enum IndexCmd {
    /// Entries, memory per entry, lookups and hits, per volume.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Re-hash one volume (or all) and rewrite its index run.
    Rebuild { volume: Option<String> },
    /// Share of TARGET's blocks already present in BASE, per block size
    /// (works on image files; no daemon needed).
    Similarity {
        base: PathBuf,
        target: PathBuf,
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "512,1K,2K,4K,8K,16K,32K,64K"
        )]
        block_sizes: Vec<String>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
struct BenchArgs {
    /// NBD server address.
    #[arg(long, default_value = ferry_server::config::DEFAULT_NBD_ADDR)]
    nbd: String,
    /// Export (volume) name.
    #[arg(long)]
    export: String,
    /// Named profile(s): oltp, oltp-2k, oltp-4k, fileserver, webserver,
    /// streaming(-read|-write), dd(-read|-write), all.
    #[arg(long)]
    profile: Vec<String>,
    /// Custom job instead of a profile: read, write, randread, randwrite, randrw, rw.
    #[arg(long)]
    rw: Option<String>,
    /// Block size of a custom job.
    #[arg(long, default_value = "4K")]
    bs: String,
    /// Read percentage of a mixed custom job.
    #[arg(long, default_value_t = 50)]
    rwmixread: u32,
    /// Requests in flight per connection.
    #[arg(long, default_value_t = 16)]
    iodepth: usize,
    /// Connections.
    #[arg(long, default_value_t = 1)]
    connections: usize,
    /// Seconds per profile.
    #[arg(long, default_value_t = 10.0)]
    runtime: f64,
    /// Use only the first SIZE bytes of the export.
    #[arg(long)]
    range: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Some(store) = ferry_trust::client::operator_store(cli.tls_dir.clone()) {
        // Daemons (`serve`, `host`, `control run`) set their own identity
        // first where they have one; for every other command this is the
        // operator's.
        if !matches!(
            cli.cmd,
            Cmd::Serve(_)
                | Cmd::Host { .. }
                | Cmd::Control {
                    cmd: control::ControlCmd::Run(_)
                }
        ) {
            ferry_api::client::set_process_identity(store);
        }
    }
    match cli.cmd {
        Cmd::Serve(a) => serve(a),
        Cmd::Volume { cmd, admin } => volume(cmd, &AdminClient::new(&admin.admin)),
        Cmd::Bitmap { cmd, admin } => bitmap(cmd, &AdminClient::new(&admin.admin)),
        Cmd::Index { cmd, admin } => index(cmd, &AdminClient::new(&admin.admin)),
        Cmd::Migrate { args, admin } => migrate::migrate(args, &AdminClient::new(&admin.admin)),
        Cmd::MigrateSwitch { id, admin } => migrate::release(&id, &AdminClient::new(&admin.admin)),
        Cmd::Certs { cmd, pool } => migrate::certs(cmd, pool, cli.tls_dir.clone()),
        Cmd::Host {
            server,
            volume,
            listen,
            control,
            state_dir,
            move_listen,
            insecure_plaintext_api,
            image_dir,
            storage,
            gateways,
            peer,
            qemu_user,
            nbd_tls_dir,
            memory_sample_every,
            on_stop,
            stop_timeout,
            networks,
        } => host(ferry_vm_host::daemon::HostOptions {
            networks,
            on_stop,
            stop_timeout,
            insecure_plaintext_api,
            // Absolute: guests' QEMU command lines and files name them.
            image_dirs: image_dir.into_iter().map(absolute).collect(),
            storage,
            gateways: {
                let mut gs = ferry_vm_host::gateways::GatewayGroups::default();
                for g in &gateways {
                    gs.add_group(g)
                        .map_err(|e| anyhow::anyhow!("--gateways: {e}"))?;
                }
                gs
            },
            peers: peer,
            qemu_user,
            volumes: server.zip(volume).into_iter().collect(),
            listen,
            control,
            state_dir: state_dir.map(absolute),
            move_listen,
            nbd_tls_dir,
            memory_sample_every: (memory_sample_every > 0)
                .then(|| std::time::Duration::from_secs(memory_sample_every)),
        }),
        Cmd::Control { cmd } => control::run(cmd, cli.tls_dir.clone()),
        Cmd::Site { cmd } => control::site(cmd),
        Cmd::Vm { cmd, host } => vm::run(cmd, &AdminClient::for_host(&host.host)),
        Cmd::Bench(a) => bench(a),
        Cmd::Demo(a) => demo::run(a),
    }
}

/// The UTC time of day of a unix time, `HH:MM:SSZ` ("-" for none).
pub(crate) fn clock_time(unix_s: f64) -> String {
    if unix_s <= 0.0 {
        return "-".into();
    }
    let t = std::time::UNIX_EPOCH + Duration::from_secs_f64(unix_s);
    let s = humantime::format_rfc3339_seconds(t).to_string();
    s.get(11..).unwrap_or("-").to_string()
}

/// `p` made absolute against the working directory (as it is if that fails).
fn absolute(p: PathBuf) -> PathBuf {
    std::path::absolute(&p).unwrap_or(p)
}

/// Logs on stderr, filtered by `FERRY_LOG`; colours only on a terminal (a
/// log file or journal gets plain text).
fn init_logging() {
    use std::io::IsTerminal;
    // rustls warns of every client that names an IP address as the TLS
    // server name (QEMU's and libnbd's NBD clients do, connecting to an
    // address): harmless, and not the operator's to fix.
    let filter = tracing_subscriber::EnvFilter::try_from_env("FERRY_LOG").unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,rustls::msgs::handshake=error")
    });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

fn serve(a: ServeArgs) -> Result<()> {
    init_logging();
    let mut config = match &a.config {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    if let Some(p) = a.pool {
        config.pool = p;
    }
    if let Some(n) = a.nbd {
        config.nbd.listen = n;
    }
    if let Some(d) = a.nbd_tls_dir {
        config.nbd.tls_dir = d;
    }
    if let Some(n) = a.admin {
        config.admin.listen = n;
    }
    if a.insecure_plaintext_api {
        config.admin.insecure_plaintext = true;
    }
    if a.direct_io {
        config.storage.direct_io = true;
    }
    config.storage.allowed_paths.extend(a.allow_path);
    if a.ceph_conf.is_some()
        || a.ceph_pool.is_some()
        || a.ceph_keyring.is_some()
        || a.ceph_client.is_some()
        || a.ceph_shared
    {
        let c = config.storage.ceph.get_or_insert_with(Default::default);
        if let Some(v) = a.ceph_conf {
            c.conf = v;
        }
        if let Some(v) = a.ceph_pool {
            c.pool = v;
        }
        if let Some(v) = a.ceph_keyring {
            c.keyring = v;
        }
        if let Some(v) = a.ceph_client {
            c.client = v;
        }
        if a.ceph_shared {
            c.shared = true;
        }
    }
    if let Some(m) = a.migrate {
        config.migration.listen = m;
    }
    if a.migrate_plaintext {
        config.migration.plaintext = true;
    }
    if let Some(n) = a.advertise_nbd {
        config.migration.advertise_nbd = n;
    }
    if let Some(n) = a.advertise_admin {
        config.migration.advertise_admin = n;
    }
    if let Some(t) = a.incomplete_ttl {
        config.migration.incomplete_ttl_secs = t;
    }
    if !a.iscsi.is_empty() {
        config.iscsi.listen = a.iscsi;
    }
    if let Some(b) = a.iscsi_base_iqn {
        config.iscsi.base_iqn = b;
    }
    if let Some(n) = a.advertise_iscsi {
        config.migration.advertise_iscsi = n;
    }
    if let Some(g) = a.iscsi_port_group {
        config.iscsi.port_group = g;
    }
    if let Some(p) = a.iscsi_site_portal {
        config.iscsi.site_portal = p;
    }
    if let Some(d) = a.iscsi_site_device {
        config.iscsi.site_portal_device = d;
    }
    let rt = runtime()?;
    let end = rt.block_on(async move {
        let daemon = ferry_server::Daemon::bind(config).await?;
        let stop = cancel_on_signal()?;
        // The daemon's own token: its fencing watch cancels it, and only a
        // signal cancels `stop`.
        let run = daemon.run(stop.child_token()).await;
        if matches!(run, Err(ferry_server::ServerError::Fenced)) && !stop.is_cancelled() {
            let wait = rejoin_wait();
            tracing::warn!(
                wait_s = wait.as_secs(),
                "rejoining the Ceph cluster as a new client: this gateway starts again"
            );
            // A stop asked for meanwhile is a stop, not a rejoin.
            tokio::select! {
                () = tokio::time::sleep(wait) => return anyhow::Ok(ServeEnd::Rejoin),
                () = stop.cancelled() => {}
            }
        }
        anyhow::Ok(ServeEnd::Stopped(run))
    })?;
    match end {
        ServeEnd::Rejoin => {
            // A call the fenced client still has in flight must not hold
            // the new start back.
            rt.shutdown_timeout(Duration::from_secs(5));
            Err(rejoin_after_fence())
        }
        ServeEnd::Stopped(run) => Ok(run?),
    }
}

/// How a `ferry serve` run ended.
enum ServeEnd {
    /// Fenced, and not asked to stop: start again as a new client.
    Rejoin,
    /// Stopped (asked to, or by an error): the daemon's result.
    Stopped(Result<(), ferry_server::ServerError>),
}

/// The environment variable that carries, across a rejoin, when this
/// gateway last rejoined (seconds since the epoch).
const LAST_REJOIN_ENV: &str = "FERRY_LAST_REJOIN";

/// How long a fenced gateway waits before it rejoins: 1 s, or 15 s if it
/// was fenced again within a minute of its last rejoin (an operator who
/// blocklisted the whole address, not one client).
fn rejoin_wait() -> Duration {
    let last: Option<u64> = std::env::var(LAST_REJOIN_ENV)
        .ok()
        .and_then(|v| v.parse().ok());
    match last {
        Some(t) if unix_now().saturating_sub(t) < 60 => Duration::from_secs(15),
        _ => Duration::from_secs(1),
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The cluster fenced this gateway and the daemon has stopped (its
/// listeners closed, its volumes given up): start it again as a new
/// client of the cluster, in the same process (`exec` of this program
/// with the same arguments), so that it stands by like any other
/// gateway without a supervisor. The cluster blocklists a client
/// instance, not the machine, so the new one is let in. Returns only if
/// the `exec` failed.
fn rejoin_after_fence() -> anyhow::Error {
    use std::os::unix::process::CommandExt;
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // The program at the path it was started from (an upgrade that
    // replaced it leaves this process's link saying "PATH (deleted)"),
    // else the one this process runs (`/proc/self/exe` reaches it even
    // deleted).
    let installed = std::env::current_exe().ok().map(|p| {
        let s = p.to_string_lossy();
        PathBuf::from(s.strip_suffix(" (deleted)").unwrap_or(&s).to_string())
    });
    let mut tried = Vec::new();
    for exe in installed
        .into_iter()
        .chain([PathBuf::from("/proc/self/exe")])
    {
        let mut cmd = std::process::Command::new(&exe);
        if let Some(argv0) = args.first() {
            cmd.arg0(argv0);
        }
        let err = cmd
            .args(args.iter().skip(1))
            .env(LAST_REJOIN_ENV, unix_now().to_string())
            .exec();
        tried.push(format!("{}: {err}", exe.display()));
    }
    anyhow::Error::new(ferry_server::ServerError::Fenced).context(format!(
        "starting again as a new client: {}",
        tried.join("; ")
    ))
}

/// A token cancelled on SIGINT or SIGTERM (call inside the runtime).
fn cancel_on_signal() -> Result<CancellationToken> {
    let shutdown = CancellationToken::new();
    let sd = shutdown.clone();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::spawn(async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {},
            _ = term.recv() => {},
        }
        tracing::info!("shutting down: draining connections");
        sd.cancel();
    });
    Ok(shutdown)
}

fn host(opts: ferry_vm_host::daemon::HostOptions) -> Result<()> {
    if opts.volumes.is_empty() && opts.control.is_none() {
        bail!("give --server and --volume, or --control to attach volumes later");
    }
    if opts.listen.is_empty() && opts.state_dir.is_none() {
        bail!("give --listen (where the hypervisor connects) or --state-dir (guests run here)");
    }
    init_logging();
    runtime()?.block_on(async move {
        let shutdown = cancel_on_signal()?;
        ferry_vm_host::daemon::run(opts, shutdown).await?;
        Ok(())
    })
}

fn print_json(v: &impl serde::Serialize) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

/// The state column of an incomplete incoming copy: where from, how old,
/// how long untouched (the daemon deletes it after
/// `migration.incomplete_ttl_secs` untouched), and the migration.
fn incomplete_copy(m: &ferry_api::IncomingMigration) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let age = |t: u64| {
        if t == 0 {
            "?".to_string()
        } else {
            ago(now.saturating_sub(t))
        }
    };
    format!(
        "incomplete copy from {}, begun {} ago, untouched {} (migration {})",
        m.source,
        age(m.started_unix),
        age(m.touched_unix),
        m.id.get(..12).unwrap_or(&m.id),
    )
}

/// A duration for people: 45s, 12m, 3h, 2d.
fn ago(secs: u64) -> String {
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 2 * 86_400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

fn human(bytes: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

fn volume(cmd: VolumeCmd, c: &AdminClient) -> Result<()> {
    match cmd {
        VolumeCmd::Create {
            name,
            size,
            block_size,
            physical_block_size,
            preallocate,
            path,
            backing,
            read_only,
            json,
        } => {
            let size = size.map(|s| parse_size(&s)).transpose()?;
            if size.is_none() && path.is_none() {
                bail!("--size is required unless --path names an existing file");
            }
            let path = path
                .map(|p| std::fs::canonicalize(&p).with_context(|| format!("{}", p.display())))
                .transpose()?;
            let v = c.create_volume(&CreateVolume {
                name,
                size: size.map(Size::Bytes),
                block_size: Some(block_size),
                physical_block_size,
                preallocate,
                path,
                read_only,
                ceph: backing.map(|b| b == "ceph"),
            })?;
            if json {
                return print_json(&v);
            }
            println!(
                "created volume {}: {} ({}), block size {}, {}{}",
                v.name,
                human(v.size),
                match &v.backing {
                    ferry_api::Backing::Sparse => "sparse".to_string(),
                    ferry_api::Backing::Preallocated => "preallocated".to_string(),
                    ferry_api::Backing::External { path } => format!("on {}", path.display()),
                    ferry_api::Backing::Rbd { pool, image } => format!("RBD image {pool}/{image}"),
                },
                v.block_size,
                v.wwn,
                if v.read_only { ", read-only" } else { "" }
            );
            Ok(())
        }
        VolumeCmd::List { json } => {
            let v = c.volumes()?;
            if json {
                return print_json(&v);
            }
            println!(
                "{:<24} {:>12} {:>12} {:>6} {:<13} {:<20} STATE",
                "NAME", "SIZE", "ALLOCATED", "BLOCK", "BACKING", "WWN"
            );
            for vol in &v {
                let backing = match &vol.backing {
                    ferry_api::Backing::Sparse => "sparse",
                    ferry_api::Backing::Preallocated => "preallocated",
                    ferry_api::Backing::External { .. } => "external",
                    ferry_api::Backing::Rbd { .. } => "rbd",
                };
                let state = volume_state(vol);
                println!(
                    "{:<24} {:>12} {:>12} {:>6} {:<13} {:<20} {state}",
                    vol.name,
                    human(vol.size),
                    human(vol.allocated_bytes),
                    vol.block_size,
                    backing,
                    vol.wwn,
                );
            }
            Ok(())
        }
        VolumeCmd::Info { name } => print_json(&c.get_volume(&name)?),
        VolumeCmd::Resize {
            name,
            size,
            allow_shrink,
        } => print_json(&c.resize_volume(&name, Size::Bytes(parse_size(&size)?), allow_shrink)?),
        VolumeCmd::Delete { name, force } => {
            c.delete_volume(&name, force)?;
            eprintln!("deleted {name}");
            Ok(())
        }
        VolumeCmd::Import { name, file } => {
            let len = std::fs::metadata(&file)
                .with_context(|| format!("{}", file.display()))?
                .len();
            match c.volume(&name)? {
                Some(v) if v.size < len => {
                    bail!(
                        "{} ({len} bytes) does not fit in volume {name} ({} bytes)",
                        file.display(),
                        v.size
                    )
                }
                Some(_) => {}
                None => {
                    let size = len.div_ceil(512) * 512;
                    c.create_volume(&CreateVolume {
                        name: name.clone(),
                        size: Some(Size::Bytes(size)),
                        ..CreateVolume::default()
                    })?;
                    eprintln!("created volume {name} of {}", human(size));
                }
            }
            let r = transfer::import(c, &name, &file)?;
            eprintln!(
                "imported {} into {name}: {} written, {} left as holes",
                human(r.bytes),
                human(r.written),
                human(r.zeroed)
            );
            Ok(())
        }
        VolumeCmd::Export { name, file } => {
            let n = transfer::export(c, &name, &file)?;
            eprintln!("exported {} from {name} to {}", human(n), file.display());
            Ok(())
        }
    }
}

/// What `ferry volume list` says of a volume's state.
fn volume_state(vol: &ferry_api::VolumeView) -> String {
    match (&vol.sanitize, &vol.moved_to, &vol.incoming) {
        (
            Some(ferry_api::SanitizeView::Running {
                op,
                done_bytes,
                total_bytes,
            }),
            ..,
        ) => format!(
            "sanitizing ({op}, {}%)",
            done_bytes * 100 / (*total_bytes).max(1)
        ),
        (Some(ferry_api::SanitizeView::Failed { op, error }), ..) => {
            format!("sanitize ({op}) failed: {error}")
        }
        (None, Some(to), _) => format!("moved to {to}"),
        (None, None, Some(m)) => incomplete_copy(m),
        (None, None, None) if vol.importing => "incomplete (import did not finish)".into(),
        (None, None, None) if vol.outgoing.is_some() => {
            format!(
                "migration to {} not finished",
                vol.outgoing.as_ref().map_or("", |o| &o.to)
            )
        }
        (None, None, None) if vol.shared && !vol.held_here => match &vol.gateway {
            Some(g) => format!("served by the gateway at {g}"),
            None => "ready (no gateway holds it)".into(),
        },
        (None, None, None) => "ready".into(),
    }
}

fn bitmap(cmd: BitmapCmd, c: &AdminClient) -> Result<()> {
    match cmd {
        BitmapCmd::Add {
            volume,
            name,
            granularity,
            persistent,
        } => {
            let granularity = u32::try_from(parse_size(&granularity)?)
                .context("granularity must be below 4 GiB")?;
            print_json(&c.create_bitmap(
                &volume,
                &BitmapRequest {
                    name,
                    granularity,
                    persistent,
                },
            )?)
        }
        BitmapCmd::List { volume } => print_json(&c.bitmaps(&volume)?),
        BitmapCmd::Clear { volume, name } => print_json(&c.clear_bitmap(&volume, &name)?),
        BitmapCmd::Remove { volume, name } => Ok(c.delete_bitmap(&volume, &name)?),
    }
}

fn index(cmd: IndexCmd, c: &AdminClient) -> Result<()> {
    match cmd {
        IndexCmd::Status { json } => {
            let s = c.index_status()?;
            if json {
                return print_json(&s);
            }
            println!(
                "block size {}  entries {}  RAM {} ({:.3} B/entry)  on disk {}  lookups {}  hits {}",
                s.block_size,
                s.entries,
                human(s.memory_bytes),
                s.memory_bytes_per_entry,
                human(s.disk_bytes),
                s.lookups,
                s.hits
            );
            for v in &s.volumes {
                println!(
                    "  {:<24} {:>12} entries  {:>10} RAM  {}",
                    v.volume,
                    v.entries,
                    human(v.memory_bytes),
                    if v.prints {
                        "prints in block order"
                    } else {
                        "no prints (a move reads it whole)"
                    }
                );
            }
            Ok(())
        }
        IndexCmd::Rebuild { volume } => {
            for v in c.index_rebuild(volume.as_deref())? {
                eprintln!(
                    "{}: {} blocks ({} zero) hashed in {:.2}s, {:.0} MB/s",
                    v.volume, v.blocks, v.zero_blocks, v.seconds, v.mb_per_s
                );
            }
            Ok(())
        }
        IndexCmd::Similarity {
            base,
            target,
            block_sizes,
            json,
        } => {
            let mut rows = Vec::new();
            for bs in &block_sizes {
                let bs = u32::try_from(parse_size(bs)?).context("block size too large")?;
                let p = ferry_index::similarity(&base, &target, bs)?;
                rows.push(serde_json::json!({
                    "block_size": bs, "target_blocks": p.target_blocks, "zero_blocks": p.target_zero_blocks,
                    "found": p.found, "found_share": p.share(), "saved_share": p.saved(),
                }));
                if !json {
                    println!(
                        "{:>6} B  found {:>6.2}% of non-zero blocks, {:>6.2}% of the image need not be sent",
                        bs,
                        p.share() * 100.0,
                        p.saved() * 100.0
                    );
                }
            }
            if json {
                print_json(&serde_json::Value::Array(rows))?;
            }
            Ok(())
        }
    }
}

fn bench(a: BenchArgs) -> Result<()> {
    let profiles = match (&a.rw, a.profile.is_empty()) {
        (Some(rw), true) => {
            let bs = u32::try_from(parse_size(&a.bs)?).context("--bs too large")?;
            vec![
                ferry_bench::Profile::custom(rw, bs, a.rwmixread).with_context(|| {
                    format!("unknown --rw {rw}: use read, write, randread, randwrite, randrw or rw")
                })?,
            ]
        }
        (Some(_), false) => bail!("give --profile or --rw, not both"),
        (None, true) => {
            ferry_bench::expand_profiles(&["oltp".into()]).map_err(anyhow::Error::msg)?
        }
        (None, false) => ferry_bench::expand_profiles(&a.profile).map_err(anyhow::Error::msg)?,
    };
    let range = a.range.as_deref().map(parse_size).transpose()?.unwrap_or(0);
    let rt = runtime()?;
    let mut reports = Vec::new();
    for p in profiles {
        let spec = ferry_bench::BenchSpec {
            addr: a.nbd.clone(),
            export: a.export.clone(),
            profile: p,
            connections: a.connections,
            queue_depth: a.iodepth,
            runtime: Duration::from_secs_f64(a.runtime),
            range,
        };
        reports.push(rt.block_on(ferry_bench::run(&spec))?);
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    } else {
        print!("{}", ferry_bench::table(&reports));
    }
    Ok(())
}
