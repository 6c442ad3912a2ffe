//! `ferry vm`: guests on a `ferry host` (through its control API) and
//! their moves between hosts.

use crate::{human, print_json};
use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use ferry_api::{
    Accel, AdminClient, Boot, MigrationId, VmDisk, VmMigrateRequest, VmMovePhase, VmMoveReport,
    VmSpec, VmView,
};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The default control address of `ferry host`.
pub const DEFAULT_HOST_CONTROL: &str = "127.0.0.1:10890";

#[derive(Args)]
pub struct HostArg {
    /// Control API of the `ferry host` that runs the guest.
    #[arg(long = "host", global = true, env = "FERRY_HOST", default_value = DEFAULT_HOST_CONTROL)]
    pub host: String,
}

#[derive(Subcommand)]
pub enum VmCmd {
    /// Define a guest and start it.
    Create(CreateArgs),
    /// Start a stopped guest.
    Start { name: String },
    /// Stop a guest (QEMU quits; the definition stays).
    Stop { name: String },
    /// Guests on the host.
    List {
        #[arg(long)]
        json: bool,
    },
    /// One guest, with its disk I/O.
    Show {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Stop a guest and forget it (its volumes stay).
    Delete { name: String },
    /// Change a guest's definition where it is safe: the admin address of
    /// a disk's storage daemon at any time but during a move, memory and
    /// CPUs while it is stopped.
    Set(SetArgs),
    /// Move a guest: memory to another host (--to-host), its disks to
    /// another storage daemon (--to-storage), or both at once (teleport).
    Migrate(MigrateVmArgs),
    /// The moves this host ran or runs (kept across its restarts), with
    /// how each ended.
    Moves {
        #[arg(long)]
        json: bool,
    },
    /// Write the cloud-init seed disk `create` would attach (NoCloud,
    /// label CIDATA) to a file, for a guest QEMU or libvirt runs without a
    /// host daemon; no host is asked.
    Seed(SeedArgs),
}

#[derive(Args)]
pub struct SeedArgs {
    /// The guest's name (its cloud-init instance id).
    pub name: String,
    /// The disk image to write (raw).
    #[arg(long)]
    pub out: PathBuf,
    /// The MAC of the guest's next card, in order (for --address).
    #[arg(long = "mac")]
    pub macs: Vec<String>,
    #[command(flatten)]
    pub cloud_init: CloudInitArgs,
}

#[derive(Args)]
pub struct CreateArgs {
    pub name: String,
    /// Memory, e.g. 256M or 2G.
    #[arg(long, default_value = "256M")]
    pub memory: String,
    #[arg(long, default_value_t = 1)]
    pub vcpus: u32,
    /// VOLUME@NBD_HOST:PORT[@ADMIN_HOST:PORT] (repeatable; the admin
    /// address lets the disk move with the guest).
    #[arg(long = "disk")]
    pub disks: Vec<String>,
    /// Direct kernel boot: the kernel file on the host.
    #[arg(long, conflicts_with = "boot_disk")]
    pub kernel: Option<PathBuf>,
    #[arg(long, requires = "kernel")]
    pub initrd: Option<PathBuf>,
    #[arg(long, default_value = "console=ttyS0", requires = "kernel")]
    pub cmdline: String,
    /// Boot from the first disk.
    #[arg(long)]
    pub boot_disk: bool,
    /// auto (KVM where /dev/kvm works, TCG otherwise), kvm or tcg.
    #[arg(long, default_value = "auto")]
    pub accel: String,
    /// A network card on NETWORK (one of the host's --network), with
    /// this MAC or a new one (repeatable; the guest sees them in order).
    /// It keeps its MAC wherever the guest moves.
    #[arg(long = "nic", value_name = "NETWORK[,mac=MAC]", value_parser = parse_nic)]
    pub nics: Vec<ferry_api::VmNic>,
    #[command(flatten)]
    pub cloud_init: CloudInitArgs,
    /// Define only; do not start.
    #[arg(long)]
    pub no_start: bool,
    #[arg(long)]
    pub json: bool,
}

/// What the guest configures itself from at first boot, through
/// cloud-init's NoCloud seed disk (which any of these flags attaches).
#[derive(Args, Default)]
pub struct CloudInitArgs {
    /// cloud-init user-data: a `#cloud-config` file or a script (`#!`).
    #[arg(long = "cloud-init", value_name = "FILE", conflicts_with_all = ["ssh_keys", "first_boot"])]
    pub user_data: Option<PathBuf>,
    /// cloud-init network-config (version 1 or 2), as it is.
    #[arg(
        long = "cloud-init-network",
        value_name = "FILE",
        conflicts_with = "addresses"
    )]
    pub network_config: Option<PathBuf>,
    /// The guest's host name (default: its name).
    #[arg(long)]
    pub hostname: Option<String>,
    /// A public key allowed to log in over SSH, as root and as the
    /// image's default user (repeatable).
    #[arg(long = "ssh-key", value_name = "FILE")]
    pub ssh_keys: Vec<PathBuf>,
    /// A shell command the guest runs once, at its first boot, after its
    /// services are up (repeatable; in order).
    #[arg(long = "first-boot", value_name = "COMMAND")]
    pub first_boot: Vec<String>,
    /// A static address for the next --nic, in order (repeatable).
    #[arg(long = "address", value_name = "ADDR/PREFIX[,gateway=IP]", value_parser = parse_address)]
    pub addresses: Vec<ferry_api::NicAddress>,
}

impl CloudInitArgs {
    /// The spec's cloud-init part: none unless a flag asks for it.
    pub fn to_spec(&self) -> Result<Option<ferry_api::CloudInit>> {
        let read = |p: &PathBuf, what: &str| {
            std::fs::read_to_string(p).with_context(|| format!("{what} {}", p.display()))
        };
        let user_data = match &self.user_data {
            Some(p) => read(p, "cloud-init user-data")?,
            None => {
                if self.hostname.is_none()
                    && self.ssh_keys.is_empty()
                    && self.first_boot.is_empty()
                    && self.addresses.is_empty()
                    && self.network_config.is_none()
                {
                    return Ok(None);
                }
                let keys = self
                    .ssh_keys
                    .iter()
                    .map(|p| read(p, "SSH key").map(|k| k.trim().to_string()))
                    .collect::<Result<Vec<_>>>()?;
                let mut doc = serde_json::Map::new();
                if !keys.is_empty() {
                    doc.insert("ssh_authorized_keys".into(), keys.into());
                    doc.insert("disable_root".into(), false.into());
                }
                if !self.first_boot.is_empty() {
                    doc.insert("runcmd".into(), self.first_boot.clone().into());
                }
                // JSON is YAML: cloud-init reads it under its header.
                format!("#cloud-config\n{}\n", serde_json::Value::Object(doc))
            }
        };
        Ok(Some(ferry_api::CloudInit {
            hostname: self.hostname.clone(),
            user_data,
            network_config: self
                .network_config
                .as_ref()
                .map(|p| read(p, "cloud-init network-config"))
                .transpose()?,
            addresses: self.addresses.clone(),
        }))
    }
}

/// `ferry vm seed`: the seed disk `create` would attach, to a file.
fn write_seed(a: &SeedArgs) -> Result<()> {
    let Some(ci) = a.cloud_init.to_spec()? else {
        bail!(
            "nothing to seed: give --cloud-init, --ssh-key, --first-boot, --address or --hostname"
        );
    };
    for m in &a.macs {
        ferry_vm_host::network::check_mac(m)?;
    }
    let bytes = ferry_vm_host::seed::image(&a.name, &ci, &a.macs)?;
    std::fs::write(&a.out, &bytes).with_context(|| format!("{}", a.out.display()))?;
    println!(
        "cloud-init seed for {} in {} ({})",
        a.name,
        a.out.display(),
        human(bytes.len() as u64)
    );
    Ok(())
}

/// `ferry vm show`'s line for the guest's cloud-init seed.
fn cloud_init_line(name: &str, ci: &ferry_api::CloudInit) -> String {
    let kind = if ci.user_data.starts_with("#!") {
        "script"
    } else {
        "cloud-config"
    };
    let mut line = format!(
        "cloud-init: host name {}, user-data {kind} of {} bytes",
        ci.hostname.as_deref().unwrap_or(name),
        ci.user_data.len()
    );
    if ci.network_config.is_some() {
        line.push_str(", network-config given");
    }
    for (i, a) in ci.addresses.iter().enumerate() {
        line.push_str(&format!(", nic {i} {}", a.address));
        if let Some(g) = &a.gateway {
            line.push_str(&format!(" via {g}"));
        }
    }
    line
}

fn parse_address(s: &str) -> std::result::Result<ferry_api::NicAddress, String> {
    let (address, rest) = s.split_once(',').unwrap_or((s, ""));
    let gateway = match rest.split_once('=') {
        None if rest.is_empty() => None,
        Some(("gateway", g)) if !g.is_empty() => Some(g.to_string()),
        _ => return Err(format!("{rest:?}: only gateway=IP may follow the address")),
    };
    if !address.contains('/') {
        return Err(format!("{address:?}: expected ADDR/PREFIX"));
    }
    Ok(ferry_api::NicAddress {
        address: address.into(),
        gateway,
    })
}

#[derive(Args)]
pub struct SetArgs {
    pub name: String,
    /// VOLUME=ADMIN_HOST:PORT: where the disk's storage daemon takes admin
    /// calls (its next move starts there); VOLUME= forgets it. Repeatable.
    #[arg(long = "disk-admin", value_name = "VOLUME=HOST:PORT", value_parser = volume_admin)]
    pub disk_admin: Vec<(String, String)>,
    /// Memory, e.g. 512M (stopped guests only).
    #[arg(long)]
    pub memory: Option<String>,
    /// CPUs (stopped guests only).
    #[arg(long)]
    pub vcpus: Option<u32>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct MigrateVmArgs {
    pub name: String,
    /// Move listener of the destination `ferry host` (--move-listen), HOST:PORT.
    #[arg(long)]
    pub to_host: Option<String>,
    /// Move the disks too (needs --to-storage).
    #[arg(long, requires = "to_storage")]
    pub with_disk: bool,
    /// Migration listener of the destination storage daemon, HOST:PORT.
    #[arg(long)]
    pub to_storage: Option<String>,
    /// Admin API of the destination storage daemon (recorded in the spec).
    #[arg(long)]
    pub to_storage_admin: Option<String>,
    /// VM-only move: the destination host reaches disk VOLUME at this NBD
    /// address (e.g. the storage is local there), VOLUME=HOST:PORT; repeatable.
    #[arg(long = "disk-server", value_name = "VOLUME=HOST:PORT", value_parser = volume_server)]
    pub disk_servers: Vec<(String, String)>,
    /// The longest pause the guest may see.
    #[arg(long, default_value = "300ms", value_parser = humantime::parse_duration)]
    pub max_downtime: Duration,
    /// Disk and memory together must finish within this.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    pub deadline: Duration,
    /// Switch to post-copy when pre-copy cannot converge.
    #[arg(long)]
    pub postcopy: bool,
    /// Do not compress the memory stream.
    #[arg(long)]
    pub no_compress: bool,
    /// Memory over this many parallel channels besides the main one
    /// (QEMU's multifd, each its own TLS link; not with --postcopy).
    #[arg(long, default_value_t = 0)]
    pub multifd: u8,
    /// Send pages dirtied again as XOR deltas (QEMU's xbzrle) with a cache
    /// of this many MiB at the source; not with --multifd.
    #[arg(long, default_value_t = 0)]
    pub xbzrle_cache_mib: u32,
    /// Storage link without TLS (both storage daemons on loopback only).
    #[arg(long)]
    pub disk_plaintext: bool,
    /// Name the move (a UUID).
    #[arg(long)]
    pub id: Option<MigrationId>,
    /// Print the report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

fn parse_memory(s: &str) -> Result<u64> {
    let bytes = ferry_server::config::parse_size(s).with_context(|| format!("memory {s:?}"))?;
    Ok(bytes >> 20)
}

fn parse_nic(s: &str) -> std::result::Result<ferry_api::VmNic, String> {
    let mut parts = s.split(',');
    let network = parts.next().unwrap_or_default().to_string();
    if network.is_empty() || network.contains('=') {
        return Err("NETWORK[,mac=MAC]: the network's name first".into());
    }
    let mut mac = String::new();
    for kv in parts {
        match kv.split_once('=') {
            Some(("mac", m)) => mac = m.to_string(),
            _ => return Err(format!("{kv:?}: only mac=MAC may follow the network")),
        }
    }
    Ok(ferry_api::VmNic { network, mac })
}

fn parse_disk(s: &str) -> Result<VmDisk> {
    let mut it = s.splitn(3, '@');
    let (Some(volume), Some(server)) = (it.next(), it.next()) else {
        bail!("--disk {s:?}: expected VOLUME@NBD_HOST:PORT[@ADMIN_HOST:PORT]");
    };
    if volume.is_empty() || server.is_empty() {
        bail!("--disk {s:?}: volume and server must not be empty");
    }
    Ok(VmDisk {
        volume: volume.into(),
        server: server.into(),
        admin: it.next().map(str::to_string),
    })
}

fn accel(s: &str) -> Result<Accel> {
    Ok(match s {
        "auto" => Accel::Auto,
        "kvm" => Accel::Kvm,
        "tcg" => Accel::Tcg,
        _ => bail!("--accel {s:?}: auto, kvm or tcg"),
    })
}

fn show_line(v: &VmView) -> String {
    let io: (u64, u64) = v.disks.iter().fold((0, 0), |a, d| {
        (a.0 + d.reads + d.writes, a.1 + d.read_bytes + d.write_bytes)
    });
    format!(
        "{:<16} {:<9} {:<4} {:>6} {:>3} {:>8.1} {:>10} {:>10}  {}",
        v.spec.name,
        v.state.as_str(),
        v.accel.as_deref().unwrap_or("-"),
        format!("{}M", v.spec.memory_mib),
        v.spec.vcpus,
        v.cpu_time_s,
        io.0,
        human(io.1),
        v.spec
            .disks
            .iter()
            .map(|d| format!("{}@{}", d.volume, d.server))
            .collect::<Vec<_>>()
            .join(",")
    )
}

/// The guest `ferry vm create` describes (files resolved on this machine).
pub fn spec_from(a: &CreateArgs) -> Result<VmSpec> {
    let boot = match (&a.kernel, a.boot_disk) {
        (Some(k), _) => Boot::Kernel {
            kernel: std::fs::canonicalize(k).with_context(|| format!("kernel {}", k.display()))?,
            initrd: a
                .initrd
                .as_ref()
                .map(|i| {
                    std::fs::canonicalize(i).with_context(|| format!("initrd {}", i.display()))
                })
                .transpose()?,
            cmdline: a.cmdline.clone(),
        },
        (None, true) => Boot::Disk,
        (None, false) => bail!("say how the guest boots: --kernel FILE or --boot-disk"),
    };
    let spec = VmSpec {
        name: a.name.clone(),
        memory_mib: parse_memory(&a.memory)?,
        vcpus: a.vcpus,
        disks: a
            .disks
            .iter()
            .map(|d| parse_disk(d))
            .collect::<Result<_>>()?,
        boot,
        accel: accel(&a.accel)?,
        nics: a.nics.clone(),
        cloud_init: a.cloud_init.to_spec()?,
    };
    Ok(spec)
}

const HEADER: &str =
    "NAME             STATE     ACC  MEMORY CPU  CPU(s)   REQUESTS      BYTES  DISKS";

pub fn run(cmd: VmCmd, c: &AdminClient) -> Result<()> {
    match cmd {
        VmCmd::Create(a) => {
            let spec = spec_from(&a)?;
            let v = c.create_vm(&spec, !a.no_start)?;
            if a.json {
                return print_json(&v);
            }
            println!(
                "guest {} {} ({}), serial console in {}",
                v.spec.name,
                v.state.as_str(),
                v.accel.as_deref().unwrap_or("not started"),
                v.serial_log.display()
            );
        }
        VmCmd::Start { name } => {
            let v = c.start_vm(&name)?;
            println!(
                "guest {name} {} ({})",
                v.state.as_str(),
                v.accel.unwrap_or_default()
            );
        }
        VmCmd::Stop { name } => {
            let v = c.stop_vm(&name)?;
            println!("guest {name} {}", v.state.as_str());
        }
        VmCmd::Set(a) => {
            let u = ferry_api::UpdateVm {
                disk_admin: a.disk_admin.iter().cloned().collect(),
                memory_mib: a.memory.as_deref().map(parse_memory).transpose()?,
                vcpus: a.vcpus,
            };
            if u == ferry_api::UpdateVm::default() {
                bail!("nothing to change: give --disk-admin, --memory or --vcpus");
            }
            let v = c.set_vm(&a.name, &u)?;
            if a.json {
                return print_json(&v);
            }
            println!(
                "guest {} {}: {} MiB, {} CPU(s); disks {}",
                v.spec.name,
                v.state.as_str(),
                v.spec.memory_mib,
                v.spec.vcpus,
                disk_list(&v.spec.disks)
            );
        }
        VmCmd::Delete { name } => {
            c.delete_vm(&name)?;
            println!("guest {name} deleted (its volumes stay)");
        }
        VmCmd::List { json } => {
            let vs = c.vms()?;
            if json {
                return print_json(&vs);
            }
            println!("{HEADER}");
            for v in &vs {
                println!("{}", show_line(v));
            }
        }
        VmCmd::Show { name, json } => {
            let v = c.vm(&name)?;
            if json {
                return print_json(&v);
            }
            println!("{HEADER}\n{}", show_line(&v));
            for d in &v.disks {
                let n = d.latency_us.last().map_or(0, |x| x.1).max(1);
                #[allow(clippy::cast_precision_loss)]
                let mean = d.latency_sum_us as f64 / n as f64;
                let admin = admin_words(
                    v.spec
                        .disks
                        .iter()
                        .find(|s| s.volume == d.volume)
                        .and_then(|s| s.admin.as_deref()),
                );
                println!(
                    "  disk {} at {} ({admin}): {} reads ({}), {} writes ({}), {} flushes, {} errors, mean latency {:.0} µs, {} switches",
                    d.volume, d.server, d.reads, human(d.read_bytes), d.writes, human(d.write_bytes),
                    d.flushes, d.errors, mean, d.switches
                );
            }
            for n in &v.nics {
                let bridge = if n.bridge.is_empty() {
                    "no such network on this host".to_string()
                } else {
                    format!("bridge {}", n.bridge)
                };
                let packets =
                    |p: Option<u64>| p.map(|p| format!(" ({p} packets)")).unwrap_or_default();
                let traffic = match (n.to_guest_bytes, n.from_guest_bytes) {
                    (Some(i), Some(o)) => format!(
                        ", {} in{}, {} out{}",
                        human(i),
                        packets(n.to_guest_packets),
                        human(o),
                        packets(n.from_guest_packets)
                    ),
                    _ => String::new(),
                };
                println!(
                    "  nic {} on {} (tap {}, {bridge}{}){traffic}",
                    n.mac,
                    n.network,
                    n.tap,
                    n.overlay
                        .as_ref()
                        .map(|o| format!(", {o}"))
                        .unwrap_or_default()
                );
            }
            if let Some(ci) = &v.spec.cloud_init {
                println!("  {}", cloud_init_line(&v.spec.name, ci));
            }
        }
        VmCmd::Migrate(a) => return migrate(a, c),
        VmCmd::Seed(a) => write_seed(&a)?,
        VmCmd::Moves { json } => {
            let ms = c.vm_moves()?;
            if json {
                return print_json(&ms);
            }
            println!(
                "{:<9} {:<32}  {:<12} {:<9} {:<16} {:>8}  ERROR",
                "STARTED", "ID", "VM", "KIND", "PHASE", "SECONDS"
            );
            for m in &ms {
                println!(
                    "{:<9} {:<32}  {:<12} {:<9} {:<16} {:>8.1}  {}",
                    crate::clock_time(m.started_unix),
                    m.id,
                    m.vm,
                    m.kind.as_str(),
                    m.phase.as_str(),
                    m.elapsed_s,
                    m.error.as_deref().unwrap_or("")
                );
            }
        }
    }
    Ok(())
}

fn volume_admin(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((v, a)) if !v.is_empty() && (a.is_empty() || a.contains(':')) => {
            Ok((v.to_string(), a.to_string()))
        }
        _ => Err(format!(
            "expected VOLUME=HOST:PORT (or VOLUME= to forget), got {s:?}"
        )),
    }
}

/// `volume@nbd (admin ADDR)` for each disk.
fn disk_list(disks: &[VmDisk]) -> String {
    disks
        .iter()
        .map(|d| {
            format!(
                "{}@{} ({})",
                d.volume,
                d.server,
                admin_words(d.admin.as_deref())
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A disk's admin address as `vm show` and `vm set` print it.
fn admin_words(admin: Option<&str>) -> String {
    admin.map_or_else(
        || "no admin address: its disk cannot move".to_string(),
        |a| format!("admin {a}"),
    )
}

fn volume_server(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((v, a)) if !v.is_empty() && a.contains(':') => Ok((v.to_string(), a.to_string())),
        _ => Err(format!("expected VOLUME=HOST:PORT, got {s:?}")),
    }
}

fn migrate(a: MigrateVmArgs, c: &AdminClient) -> Result<()> {
    if a.to_host.is_none() && a.to_storage.is_none() {
        bail!("say where to: --to-host, --with-disk --to-storage, or both");
    }
    if a.to_host.is_some() && a.to_storage.is_some() && !a.with_disk {
        bail!("--to-storage with --to-host moves the disks too: add --with-disk");
    }
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let req = VmMigrateRequest {
        id: a.id.clone(),
        to_host: a.to_host.clone(),
        to_storage: a.to_storage.clone(),
        to_storage_admin: a.to_storage_admin.clone(),
        max_downtime_ms: Some(ms(a.max_downtime)),
        deadline_s: Some(a.deadline.as_secs().max(1)),
        postcopy: a.postcopy,
        compress: Some(!a.no_compress),
        multifd: a.multifd,
        xbzrle_cache_mib: a.xbzrle_cache_mib,
        disk_plaintext: a.disk_plaintext,
        disk_servers: a.disk_servers.iter().cloned().collect(),
    };
    let started = c.migrate_vm(&a.name, &req)?;
    let id = started.id.clone();
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let i = interrupted.clone();
        // A second Ctrl-C ends the CLI at once; the first cancels the move.
        let _ = ctrlc::set_handler(move || {
            if i.swap(true, Ordering::SeqCst) {
                std::process::exit(130);
            }
        });
    }
    eprintln!(
        "move {id} of {} started ({})",
        a.name,
        started.kind.as_str()
    );
    let mut cancelled = false;
    let mut last_phase = started.phase;
    let status = loop {
        if interrupted.load(Ordering::SeqCst) && !cancelled {
            cancelled = true;
            eprintln!("interrupted: cancelling the move (the guest stays where it runs)");
            let _ = c.cancel_vm_move(&id);
        }
        let s = c.vm_move(&id)?;
        if s.phase != last_phase {
            eprintln!("  {:>7.1} s  {}", s.elapsed_s, s.phase.as_str());
            last_phase = s.phase;
        }
        if s.phase.is_terminal() {
            break s;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let Some(r) = status.report.clone() else {
        bail!("move {id} ended without a report");
    };
    if a.json {
        print_json(&r)?;
    } else {
        print_report(&r);
    }
    match r.result {
        VmMovePhase::Completed => Ok(()),
        _ => bail!(
            "move {} {}: {}",
            id,
            r.result.as_str(),
            r.reason.clone().unwrap_or_default()
        ),
    }
}

fn print_report(r: &VmMoveReport) {
    println!(
        "move {} of {} ({}): {}",
        r.id,
        r.vm,
        r.kind.as_str(),
        r.result.as_str()
    );
    if let Some(why) = &r.reason {
        println!("  reason: {why}");
    }
    if r.running_at.contains(':') {
        println!(
            "  running at: {} (its host's control API: ferry vm --host {} ...)",
            r.running_at, r.running_at
        );
    } else {
        println!("  running at: {}", r.running_at);
    }
    println!(
        "  total {:.2} s; {}",
        r.total_s,
        r.phases
            .iter()
            .map(|p| format!("{} {:.2} s", p.phase.as_str(), p.seconds))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "  memory: {} from QEMU, {} on the link{}; {} rounds",
        human(r.bytes.memory_raw),
        human(r.bytes.memory_link),
        if r.compress { " (compressed)" } else { "" },
        r.memory_rounds
    );
    println!(
        "  disk: {} data, {} fingerprints, {} on the link; {} rounds",
        human(r.bytes.disk_data),
        human(r.bytes.disk_fingerprints),
        human(r.bytes.disk_link),
        r.disk_rounds
    );
    let ms = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.0} ms"));
    #[allow(clippy::cast_precision_loss)]
    let qemu = r.downtime_ms_qemu.map(|x| x as f64);
    println!(
        "  pause: guest {} (QEMU's STOP to RESUME), QEMU downtime {}, disk forwarders {}, disk switch {} (maximum allowed {} ms)",
        ms(r.guest_pause_ms),
        ms(qemu),
        ms(r.disk_gap_ms),
        ms(r.disk_pause_ms),
        r.max_downtime_ms
    );
    println!(
        "  longest disk request of the guest here during the move: {}",
        ms(r.guest_io_longest_ms)
    );
    for c in &r.convergence {
        println!("  - {c}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cloud_init_flags_make_a_cloud_config() {
        assert_eq!(CloudInitArgs::default().to_spec().unwrap(), None);
        let d = tempfile::tempdir().unwrap();
        let key = d.path().join("id.pub");
        std::fs::write(&key, "ssh-ed25519 AAAA test@ferry\n").unwrap();
        let a = CloudInitArgs {
            hostname: Some("db".into()),
            ssh_keys: vec![key],
            first_boot: vec!["systemctl restart mariadb".into()],
            addresses: vec![parse_address("10.9.0.5/24,gateway=10.9.0.1").unwrap()],
            ..Default::default()
        };
        let ci = a.to_spec().unwrap().unwrap();
        let (head, body) = ci.user_data.split_once('\n').unwrap();
        assert_eq!(head, "#cloud-config");
        let doc: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(doc["ssh_authorized_keys"][0], "ssh-ed25519 AAAA test@ferry");
        assert_eq!(doc["disable_root"], false);
        assert_eq!(doc["runcmd"][0], "systemctl restart mariadb");
        assert_eq!(ci.addresses[0].gateway.as_deref(), Some("10.9.0.1"));
        assert_eq!(
            cloud_init_line("g", &ci),
            format!(
                "cloud-init: host name db, user-data cloud-config of {} bytes, nic 0 10.9.0.5/24 via 10.9.0.1",
                ci.user_data.len()
            )
        );
        // A user-data file is taken as it is.
        let ud = d.path().join("user-data");
        std::fs::write(&ud, "#!/bin/sh\necho hi\n").unwrap();
        let a = CloudInitArgs {
            user_data: Some(ud),
            ..Default::default()
        };
        assert_eq!(
            a.to_spec().unwrap().unwrap().user_data,
            "#!/bin/sh\necho hi\n"
        );
        let a = CloudInitArgs {
            user_data: Some(d.path().join("missing")),
            ..Default::default()
        };
        assert!(format!("{:#}", a.to_spec().unwrap_err()).contains("cloud-init user-data"));
    }

    #[test]
    fn addresses_are_parsed_with_their_gateway() {
        let a = parse_address("fd00::5/64").unwrap();
        assert_eq!((a.address.as_str(), a.gateway), ("fd00::5/64", None));
        assert!(parse_address("10.0.0.5")
            .unwrap_err()
            .contains("ADDR/PREFIX"));
        assert!(parse_address("10.0.0.5/24,gw=1.2.3.4")
            .unwrap_err()
            .contains("only gateway=IP"));
        assert!(parse_address("10.0.0.5/24,gateway=").is_err());
    }
}
