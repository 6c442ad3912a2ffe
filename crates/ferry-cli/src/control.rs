//! `ferry control`: the placement controller's first commands. `plan`
//! runs the policies on a cluster snapshot (sites, links, VMs with their
//! load and placement; JSON) and prints what it would do and why;
//! `simulate` drives the same policies over a simulated cluster.

use crate::print_json;
use anyhow::{Context, Result};
use clap::Subcommand;
use ferry_api::{
    AdminClient, MigrationId, VmMigrateRequest, VmMovePhase, VmState as GuestState, VmView,
};
use ferry_control::inventory::Inventory;
use ferry_control::policy::{plan, Policy, Triggers};
use ferry_control::policy::{Action, Plan};
use ferry_control::simulate::{compare, SimConfig};
use ferry_control::{Cluster, Placement, VmLoad, VmState};
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum ControlCmd {
    /// What the policies would do with a cluster snapshot (a dry run).
    Plan {
        /// A snapshot: {sites, links, vms} (docs/placement-model.md).
        #[arg(
            long,
            required_unless_present = "inventory",
            conflicts_with = "inventory"
        )]
        cluster: Option<PathBuf>,
        /// Or the live sites: {sites: [{name, cpu_capacity, hosts:
        /// [{control, moves}], storage: [{nbd, migrate, admin}]}], links};
        /// the hosts are measured twice, --interval apart.
        #[arg(long)]
        inventory: Option<PathBuf>,
        #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
        interval: std::time::Duration,
        /// Act on the decisions (through the hosts' move API) and report.
        #[arg(long, requires = "inventory")]
        apply: bool,
        /// Write the measured snapshot here (for plan --cluster later).
        #[arg(long, requires = "inventory")]
        save_snapshot: Option<PathBuf>,
        /// Policy settings (JSON; defaults otherwise).
        #[arg(long)]
        policy: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Compare the policies on a simulated cluster.
    Simulate {
        #[arg(long, default_value_t = 4)]
        sites: usize,
        #[arg(long, default_value_t = 100)]
        vms: usize,
        #[arg(long, default_value_t = 30)]
        ticks: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long)]
        json: bool,
    },
}

fn read_json<T: serde::de::DeserializeOwned>(p: &PathBuf, what: &str) -> Result<T> {
    let text = std::fs::read_to_string(p).with_context(|| format!("{what} {}", p.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{what} {}", p.display()))
}

pub fn run(cmd: ControlCmd) -> Result<()> {
    match cmd {
        ControlCmd::Plan {
            cluster,
            inventory,
            interval,
            apply,
            save_snapshot,
            policy,
            json,
        } => {
            let inv: Option<Inventory> = match &inventory {
                Some(f) => {
                    let i: Inventory = read_json(f, "inventory")?;
                    i.validate().map_err(anyhow::Error::msg)?;
                    Some(i)
                }
                None => None,
            };
            let (c, running_on) = match (&cluster, &inv) {
                (Some(f), _) => (
                    read_json::<Cluster>(f, "cluster snapshot")?,
                    Default::default(),
                ),
                (None, Some(i)) => measure(i, interval)?,
                (None, None) => anyhow::bail!("give --cluster or --inventory"),
            };
            c.validate()?;
            if let Some(f) = &save_snapshot {
                std::fs::write(f, serde_json::to_vec_pretty(&c)?)
                    .with_context(|| format!("writing {}", f.display()))?;
            }
            let p: Policy = match &policy {
                Some(f) => read_json(f, "policy")?,
                None => Policy::default(),
            };
            p.validate()?;
            let pl = plan(&c, &p, &mut Triggers::default(), 0.0)?;
            if apply {
                let inv = inv.as_ref().context("--apply needs --inventory")?;
                let results = act(inv, &running_on, &pl);
                if json {
                    return print_json(&serde_json::json!({"plan": pl, "moves": results}));
                }
                for r in &results {
                    println!("{r}");
                }
                return Ok(());
            }
            if json {
                return print_json(&pl);
            }
            if pl.decisions.is_empty() {
                println!("nothing to do");
            }
            for d in &pl.decisions {
                println!(
                    "{} {:?}: {}/{} -> {}/{}: {}",
                    d.vm,
                    d.action,
                    d.from.host_site,
                    d.from.disk_site,
                    d.to.host_site,
                    d.to.disk_site,
                    d.reason
                );
            }
            for s in &pl.skipped {
                println!("{} left alone: {}", s.vm, s.reason);
            }
        }
        ControlCmd::Simulate {
            sites,
            vms,
            ticks,
            seed,
            json,
        } => {
            let cfg = SimConfig {
                sites,
                vms,
                ticks,
                seed,
                ..SimConfig::default()
            };
            let rs = compare(&cfg);
            if json {
                return print_json(&rs);
            }
            println!(
                "{} sites, {} VMs, {} ticks of {} s",
                cfg.sites, cfg.vms, cfg.ticks, cfg.tick_s
            );
            println!("| policy | guest-seconds lost | moves (VM / disk / teleport) | bytes moved | slowest cycle |");
            println!("|---|---|---|---|---|");
            for r in rs {
                println!(
                    "| {} | {:.0} | {} ({} / {} / {}) | {:.1} GB | {:.1} ms |",
                    r.policy,
                    r.lost_s,
                    r.moves,
                    r.vm_moves,
                    r.disk_moves,
                    r.teleports,
                    r.bytes_moved / 1e9,
                    r.max_cycle_ms
                );
            }
        }
    }
    Ok(())
}

/// Which host control address runs each VM.
type RunningOn = BTreeMap<String, String>;

fn sample(inv: &Inventory) -> Result<Vec<(String, String, VmView)>> {
    let mut out = Vec::new();
    for s in &inv.sites {
        for h in &s.hosts {
            let vms = AdminClient::new(&h.control)
                .vms()
                .with_context(|| format!("host {} of site {}", h.control, s.name))?;
            for v in vms {
                out.push((s.name.clone(), h.control.clone(), v));
            }
        }
    }
    Ok(out)
}

/// Measure every running guest twice and build the snapshot.
fn measure(inv: &Inventory, interval: std::time::Duration) -> Result<(Cluster, RunningOn)> {
    let t0 = std::time::Instant::now();
    let first = sample(inv)?;
    std::thread::sleep(interval);
    let second = sample(inv)?;
    let dt = t0.elapsed().as_secs_f64().max(1e-3);
    let mut vms = Vec::new();
    let mut running_on = RunningOn::new();
    for (site, control, v) in &second {
        if v.state != GuestState::Running {
            continue;
        }
        let Some(d) = v.disks.first() else { continue };
        let Some(disk_site) = inv.site_of_storage(&d.server) else {
            eprintln!(
                "{}: its disk is at {}, which no site of the inventory holds; left out",
                v.spec.name, d.server
            );
            continue;
        };
        let earlier = first
            .iter()
            .find(|(_, c, x)| c == control && x.spec.name == v.spec.name)
            .map(|(_, _, x)| x);
        let before = earlier
            .and_then(|x| x.disks.first().cloned())
            .unwrap_or_default();
        let reqs = |x: &ferry_api::DiskIo| x.reads + x.writes + x.flushes + x.other;
        let n = reqs(d).saturating_sub(reqs(&before));
        #[allow(clippy::cast_precision_loss)]
        let nf = n as f64;
        #[allow(clippy::cast_precision_loss)]
        let bytes = (d.read_bytes + d.write_bytes)
            .saturating_sub(before.read_bytes + before.write_bytes) as f64;
        #[allow(clippy::cast_precision_loss)]
        let lat_us = d.latency_sum_us.saturating_sub(before.latency_sum_us) as f64;
        #[allow(clippy::cast_precision_loss)]
        let writes = d.write_bytes.saturating_sub(before.write_bytes) as f64;
        let cpu_before = earlier.map_or(v.cpu_time_s, |x| x.cpu_time_s);
        let size = AdminClient::new(control)
            .host_volumes()
            .ok()
            .and_then(|vs| {
                vs.into_iter()
                    .find(|x| x.volume == d.volume)
                    .map(|x| x.size)
            })
            .unwrap_or(1 << 30);
        #[allow(clippy::cast_precision_loss)]
        let (memory_bytes, disk_bytes) = ((v.spec.memory_mib << 20) as f64, size as f64);
        running_on.insert(v.spec.name.clone(), control.clone());
        vms.push(VmState {
            name: v.spec.name.clone(),
            placement: Placement {
                host_site: site.clone(),
                disk_site: disk_site.name.clone(),
            },
            memory_bytes,
            disk_bytes,
            missing_at: Default::default(),
            load: VmLoad {
                iops: nf / dt,
                io_bytes: if n > 0 { bytes / nf } else { 4096.0 },
                latency_ms: if n > 0 { lat_us / nf / 1000.0 } else { 0.0 },
                cpu: (v.cpu_time_s - cpu_before).max(0.0) / dt,
                // Not measured yet: the disk write rate stands in.
                dirty_rate: writes / dt,
                write_rate: writes / dt,
            },
            since_move_s: f64::INFINITY,
        });
    }
    Ok((
        Cluster {
            sites: inv.sites(),
            links: inv.links.clone(),
            vms,
            local_rtt_ms: 0.1,
            link_index: Default::default(),
        },
        running_on,
    ))
}

/// Carry out a plan through the hosts; one line per move.
fn act(inv: &Inventory, running_on: &RunningOn, pl: &Plan) -> Vec<String> {
    let mut out = Vec::new();
    for d in &pl.decisions {
        let r = (|| -> Result<String> {
            let control = running_on
                .get(&d.vm)
                .context("not running on any known host")?;
            let to = inv.site(&d.to.host_site).context("unknown target site")?;
            let to_disk = inv.site(&d.to.disk_site).context("unknown target site")?;
            let mut req = VmMigrateRequest {
                id: Some(MigrationId::random()),
                ..Default::default()
            };
            if matches!(d.action, Action::MoveVm | Action::Teleport) {
                req.to_host = Some(
                    to.hosts
                        .first()
                        .context("target site has no host")?
                        .moves
                        .clone(),
                );
            }
            if matches!(d.action, Action::MoveDisk | Action::Teleport) {
                let st = to_disk
                    .storage
                    .first()
                    .context("target site has no storage")?;
                req.to_storage = Some(st.migrate.clone());
                req.to_storage_admin = Some(st.admin.clone());
            }
            let c = AdminClient::new(control);
            let started = c.migrate_vm(&d.vm, &req)?;
            let t = std::time::Instant::now();
            let end = loop {
                let s = c.vm_move(&started.id)?;
                if s.phase.is_terminal() {
                    break s;
                }
                anyhow::ensure!(
                    t.elapsed().as_secs() < 900,
                    "move {} still running after 15 min",
                    started.id
                );
                std::thread::sleep(std::time::Duration::from_millis(200));
            };
            let rep = end.report.context("no report")?;
            Ok(format!(
                "{} {:?} to {}/{}: {} in {:.1} s (predicted {:.1} s), {:.0} MB (predicted {:.0} MB){}",
                d.vm,
                d.action,
                d.to.host_site,
                d.to.disk_site,
                rep.result.as_str(),
                rep.total_s,
                d.cost.seconds,
                (rep.bytes.memory_link + rep.bytes.disk_link) as f64 / 1e6,
                d.cost.bytes / 1e6,
                if rep.result == VmMovePhase::Completed {
                    String::new()
                } else {
                    format!(": {}", rep.reason.unwrap_or_default())
                }
            ))
        })();
        out.push(r.unwrap_or_else(|e| format!("{}: not moved: {e:#}", d.vm)));
    }
    out
}
