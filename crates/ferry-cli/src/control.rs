//! `ferry control`: the placement controller's first commands. `plan`
//! runs the policies on a cluster snapshot (sites, links, VMs with their
//! load and placement; JSON) and prints what it would do and why;
//! `simulate` drives the same policies over a simulated cluster.

use crate::print_json;
use anyhow::{Context, Result};
use clap::Subcommand;
use ferry_control::policy::{plan, Policy, Triggers};
use ferry_control::simulate::{compare, SimConfig};
use ferry_control::Cluster;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum ControlCmd {
    /// What the policies would do with a cluster snapshot (a dry run).
    Plan {
        /// The snapshot: {sites, links, vms} (docs/placement-model.md).
        #[arg(long)]
        cluster: PathBuf,
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
            policy,
            json,
        } => {
            let c: Cluster = read_json(&cluster, "cluster snapshot")?;
            c.validate()?;
            let p: Policy = match &policy {
                Some(f) => read_json(f, "policy")?,
                None => Policy::default(),
            };
            p.validate()?;
            let pl = plan(&c, &p, &mut Triggers::default(), 0.0)?;
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
