//! `ferry control` and `ferry site`: the placement controller. `run` is
//! the controller service (ferry-controller); `status`, `pause`, `resume`
//! and `ferry site` talk to it; `plan` runs the policies once on a
//! snapshot file or on live sites (a dry run, or `--apply`); `simulate`
//! drives the same policies over a simulated cluster.

use crate::print_json;
use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use ferry_controller::client::ControllerClient;
use ferry_placement::cycle::{drive, ControllerCore};
use ferry_placement::estimate::{estimate, Asked, Estimate};
use ferry_placement::inventory::{HostRef, Inventory, SiteInventory, StorageRef};
use ferry_placement::policy::{place_new, plan, Action, NewGuest, Policy, Triggers};
use ferry_placement::simulate::{compare, SimConfig};
use ferry_placement::{Cluster, Link};
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(Args, Clone)]
pub struct ControllerArg {
    /// The controller's API (`ferry control run --listen`).
    #[arg(
        long,
        env = "FERRY_CONTROLLER",
        default_value = "127.0.0.1:10870",
        global = true
    )]
    pub controller: String,
}

/// `ferry control run`: where the controller keeps its state, how it
/// serves its API, and how often it measures and decides.
#[derive(Args)]
pub struct RunArgs {
    /// Where its state lives (settings.json, journal.jsonl) when it runs
    /// alone.
    #[arg(long, required_unless_present = "etcd", conflicts_with = "etcd")]
    pub state_dir: Option<PathBuf>,
    /// Keep the state in etcd (URL[,URL...]); controllers sharing it
    /// elect one leader, the others follow and take over if it goes.
    #[arg(long, value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Keys in etcd start with this.
    #[arg(long, default_value = "/ferry/control/")]
    pub etcd_prefix: String,
    /// Reach etcd over TLS with the credentials in DIR: ca-cert.pem
    /// (etcd's authority), client-cert.pem and client-key.pem (this
    /// controller's; `ferry certs nbd` makes such a set). Bare
    /// HOST:PORT endpoints are then https.
    #[arg(long, value_name = "DIR")]
    pub etcd_tls_dir: Option<PathBuf>,
    /// This controller's name among those sharing etcd (default: this
    /// machine's name, the --listen address and a random part).
    #[arg(long)]
    pub name: Option<String>,
    /// The leader's lease in etcd: a leader that cannot renew it stops
    /// acting within two thirds of it; another takes over after it.
    #[arg(long, default_value = "6s", value_parser = humantime::parse_duration)]
    pub lease: std::time::Duration,
    /// The API and page. Beyond loopback it requires TLS with a pinned
    /// client certificate (the controller's identity is --tls-dir, or
    /// STATE_DIR/tls).
    #[arg(long, default_value = "127.0.0.1:10870")]
    pub listen: String,
    /// Serve the API in plaintext, with no authentication, beyond
    /// loopback (only on a network you trust; logged as insecure).
    #[arg(long)]
    pub insecure_plaintext_api: bool,
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub interval: std::time::Duration,
    /// Between the two readings of each measurement.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub sample: std::time::Duration,
    #[command(flatten)]
    pub loads: PrometheusArg,
    /// Start from this inventory (replaces the saved one).
    #[arg(long)]
    pub inventory: Option<PathBuf>,
    /// Policy settings (JSON; replaces the saved policy).
    #[arg(long)]
    pub policy: Option<PathBuf>,
    /// Start with automation paused (decisions shown, not acted on).
    #[arg(long)]
    pub paused: bool,
}

#[derive(Subcommand)]
pub enum ControlCmd {
    /// Run the controller: measure, plan and move every --interval; API,
    /// /metrics and a live page on --listen.
    Run(RunArgs),
    /// What the controller sees and decided last, and its journal.
    Status {
        #[command(flatten)]
        to: ControllerArg,
        /// Journal entries to show.
        #[arg(long, default_value_t = 20)]
        journal: usize,
        #[arg(long)]
        json: bool,
    },
    /// Stop acting on decisions (they are still made and shown).
    Pause {
        #[command(flatten)]
        to: ControllerArg,
    },
    /// Act on decisions again.
    Resume {
        #[command(flatten)]
        to: ControllerArg,
    },
    /// Cloud bursting: a site whose guests use more than --above of its
    /// CPUs sends CPU-bound guests (VM only) to the linked site with room.
    Burst {
        #[arg(value_parser = ["on", "off"])]
        state: String,
        /// Share of a site's CPUs above which it bursts (0 to 1].
        #[arg(long)]
        above: Option<f64>,
        /// How long a site must stay above it before a guest goes
        /// (default 30s).
        #[arg(long, value_parser = humantime::parse_duration)]
        hold: Option<std::time::Duration>,
        #[command(flatten)]
        to: ControllerArg,
    },
    /// What the policies would do with a cluster snapshot (a dry run).
    Plan {
        #[command(flatten)]
        from: SnapshotArgs,
        /// Act on the decisions and report each move's end. By default
        /// the controller runs one cycle that acts (even while paused),
        /// journaled and fenced as its own; with --inventory, this
        /// command acts itself, journaling in --state-dir (which it holds
        /// while it runs, so a controller of that directory cannot act at
        /// the same time).
        #[arg(long, conflicts_with = "cluster")]
        apply: bool,
        /// The state directory whose journal a standalone --apply writes
        /// (a controller's, or one of its own).
        #[arg(long, requires_all = ["apply", "inventory"])]
        state_dir: Option<PathBuf>,
        /// Write the measured snapshot here (for plan --cluster later).
        #[arg(long, requires = "inventory")]
        save_snapshot: Option<PathBuf>,
        /// Policy settings (JSON; defaults otherwise).
        #[arg(long)]
        policy: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Start a new guest where it fits: at its disk's site, or, when that
    /// site is full and bursting is on (or it is being drained), at the
    /// linked site with the most room, its disk staying home.
    Place {
        #[command(flatten)]
        guest: Box<crate::vm::CreateArgs>,
        /// CPUs the guest is expected to keep busy (default: its vCPUs).
        #[arg(long)]
        cpu: Option<f64>,
        /// The live sites (as for plan --inventory); or --controller.
        #[arg(long, required_unless_present = "controller")]
        inventory: Option<PathBuf>,
        /// Take the sites and the policy (bursting, maintenance) from this
        /// running controller (its --listen address).
        #[arg(long, conflicts_with_all = ["inventory", "policy"])]
        controller: Option<String>,
        /// Policy settings (JSON; defaults otherwise: no bursting).
        #[arg(long)]
        policy: Option<PathBuf>,
        #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
        interval: std::time::Duration,
        #[command(flatten)]
        loads: PrometheusArg,
        /// Say where it would start and why; start nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// The pre-flight estimate of one move (time, bytes, pause) and the
    /// guest's disk access before and after it; or, with only --rtt-ms,
    /// its access behind a link of that RTT. Nothing moves.
    Estimate {
        /// The guest.
        vm: String,
        /// Move the VM (its memory) to this site; the disk stays.
        #[arg(long, group = "move", value_name = "SITE")]
        vm_to: Option<String>,
        /// Move the disk to this site; the VM stays.
        #[arg(long, group = "move", value_name = "SITE")]
        disk_to: Option<String>,
        /// Move both to this site (disk pre-copy, then memory).
        #[arg(long, group = "move", value_name = "SITE")]
        teleport_to: Option<String>,
        /// The RTT (ms) of the link between where the guest runs and where
        /// its disk lives afterwards, instead of the measured one.
        #[arg(long)]
        rtt_ms: Option<f64>,
        #[command(flatten)]
        from: SnapshotArgs,
        /// Seconds over which the access cost is counted.
        #[arg(long, default_value_t = 600.0)]
        horizon_s: f64,
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
        /// Share of VMs whose disk starts at another site.
        #[arg(long, default_value_t = 0.5)]
        remote_share: f64,
        /// CPU each guest of the first site needs in the middle third of
        /// the run (1 for no spike).
        #[arg(long, default_value_t = 3.0)]
        spike_cpu: f64,
        /// Instead of the generated cluster, replay this snapshot (`plan
        /// --save-snapshot`) under one policy, each guest's I/O following
        /// its placement, and print what happens at every tick.
        #[arg(long, value_name = "SNAPSHOT")]
        replay: Option<PathBuf>,
        /// The replay's policy (JSON, as `ferry control run` takes it).
        #[arg(long, requires = "replay")]
        policy: Option<PathBuf>,
        /// Seconds per tick of the replay (the controller's interval).
        #[arg(long, default_value_t = 2.0, requires = "replay")]
        tick_s: f64,
        /// A link's RTT changes during the replay: SECONDS:SITE-SITE=MS
        /// (repeatable).
        #[arg(long, value_name = "T:A-B=MS", requires = "replay")]
        rtt_at: Vec<ferry_placement::replay::RttChange>,
        #[arg(long)]
        json: bool,
    },
}

fn read_json<T: serde::de::DeserializeOwned>(p: &PathBuf, what: &str) -> Result<T> {
    let text = std::fs::read_to_string(p).with_context(|| format!("{what} {}", p.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{what} {}", p.display()))
}

/// The cluster a command plans on: a snapshot file or the live sites.
#[derive(Args)]
pub struct SnapshotArgs {
    /// A snapshot: {sites, links, vms} (docs/placement-model.md).
    #[arg(long, conflicts_with_all = ["inventory", "controller"])]
    cluster: Option<PathBuf>,
    /// Or the live sites: {sites: [{name, cpu_capacity, hosts:
    /// [{control, moves}], storage: [{nbd, migrate, admin}]}], links}
    /// (`ferry site list --json` prints a controller's in this format);
    /// the hosts are measured twice, --interval apart.
    #[arg(long, conflicts_with = "controller")]
    inventory: Option<PathBuf>,
    /// Or the live sites a controller knows (its inventory, measured here
    /// the same way); the default when neither --cluster nor --inventory
    /// is given: $FERRY_CONTROLLER, else 127.0.0.1:10870.
    #[arg(long, env = "FERRY_CONTROLLER")]
    controller: Option<String>,
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    interval: std::time::Duration,
    #[command(flatten)]
    loads: PrometheusArg,
}

/// Where the guests' loads come from: the hosts (default) or Prometheus.
#[derive(clap::Args, Debug)]
pub struct PrometheusArg {
    /// Read the guests' loads (disk requests, bytes, latency, CPU) from
    /// this Prometheus server, which scrapes the hosts' /metrics, instead
    /// of reading every host twice; the hosts are still asked which guests
    /// run where. If it does not answer, the hosts are read as without it.
    #[arg(long, value_name = "URL")]
    prometheus: Option<String>,
    /// The window Prometheus' rates are taken over.
    #[arg(long, default_value = "1m", value_parser = humantime::parse_duration)]
    prometheus_window: std::time::Duration,
}

impl PrometheusArg {
    fn source(&self) -> ferry_controller::measure::LoadSource {
        match &self.prometheus {
            Some(url) => ferry_controller::measure::LoadSource::Prometheus(
                ferry_controller::prometheus::PrometheusSource {
                    url: if url.contains("://") {
                        url.clone()
                    } else {
                        format!("http://{url}")
                    },
                    window: self.prometheus_window,
                },
            ),
            None => ferry_controller::measure::LoadSource::Hosts,
        }
    }
}

/// A controller's name among those sharing etcd when none is given: this
/// machine's name, the API address, and a random part, so that two
/// controllers started with the same defaults on two machines (or one
/// restarted) never share a name.
fn default_name(listen: &str) -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "controller".into());
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!("{host}/{listen}/{}", &id[..8])
}

/// `ferry control plan`: one dry run of the policy over the live sites or
/// a snapshot, or (`--apply`) one round of its moves carried out.
fn plan_once(
    from: SnapshotArgs,
    apply: Option<PathBuf>,
    save_snapshot: Option<PathBuf>,
    policy: Option<PathBuf>,
    json: bool,
) -> Result<()> {
    let Snapshot {
        inventory: inv,
        cluster: c,
        running_on,
        ..
    } = snapshot(&from)?;
    if let Some(f) = &save_snapshot {
        std::fs::write(f, serde_json::to_vec_pretty(&c)?)
            .with_context(|| format!("writing {}", f.display()))?;
    }
    let p: Policy = match &policy {
        Some(f) => read_json(f, "policy")?,
        None => Policy::default(),
    };
    p.validate()?;
    if let Some(dir) = apply {
        // Through the controller's own core: the moves start together
        // (within the policy's limits) and are followed until all ended,
        // each decision, start and end journaled before it is acted on.
        let inv = inv.context("--apply needs --inventory")?;
        let store = std::sync::Arc::new(ferry_controller::store::Store::dir(&dir)?);
        let journal = std::sync::Arc::new(ferry_controller::journal::Journal::open(store)?);
        let open = journal.unfinished();
        if let Some((id, _, o)) = open.first() {
            anyhow::bail!(
                "{}'s journal has {} move(s) started and not seen to end (move {id} of {}); \
                 run `ferry control run --state-dir {}` to follow them first",
                dir.display(),
                open.len(),
                o.vm,
                dir.display()
            );
        }
        let cycle = journal.last_cycle() + 1;
        journal.record(
            cycle,
            ferry_controller::journal::Event::Settings {
                what: "ferry control plan --apply: one cycle, standalone".into(),
            },
        )?;
        let mut core = ControllerCore::default();
        let mut world = ferry_controller::act::OneShot::new(inv, c, running_on)
            .journaled(journal.clone(), cycle);
        let mut sink = ferry_controller::journal::JournalDecisions {
            journal: &journal,
            cycle,
        };
        let pl = drive(&mut core, &mut world, &mut sink, &p, 0.0, true)?;
        while !core.in_flight().is_empty() {
            let Some(e) = world.wait() else { break };
            core.ended(&e);
        }
        let results: Vec<String> = world.outcomes.iter().map(|o| o.line()).collect();
        if json {
            return print_json(&serde_json::json!({"plan": pl, "moves": results}));
        }
        for r in &results {
            println!("{r}");
        }
        return Ok(());
    }
    let pl = plan(&c, &p, &mut Triggers::default(), 0.0)?;
    if json {
        return print_json(&pl);
    }
    if pl.decisions.is_empty() {
        println!("nothing to do");
    }
    for d in &pl.decisions {
        println!(
            "{} {}: {} -> {}: {}",
            d.vm, d.action, d.from, d.to, d.reason
        );
    }
    for s in &pl.skipped {
        println!("{} left alone: {}", s.vm, s.reason);
    }
    Ok(())
}

/// `ferry control plan --apply` on a controller's sites: the controller
/// runs one cycle that acts (journaled and fenced as its own); its moves
/// are then followed in its journal until each ended.
fn apply_through_controller(
    from: &SnapshotArgs,
    policy: Option<&PathBuf>,
    json: bool,
) -> Result<()> {
    use ferry_controller::journal::Event;
    if policy.is_some() {
        anyhow::bail!(
            "the controller acts with its own policy; change it with `ferry control policy`, or give --inventory to act here"
        );
    }
    let addr = from.controller.as_deref().unwrap_or("127.0.0.1:10870");
    let c = ControllerClient::new(addr);
    let applied = c
        .apply()
        .with_context(|| format!("asking the controller at {addr} to act once"))?;
    let cycle = applied["cycle"].as_u64().unwrap_or(0);
    for p in applied["problems"].as_array().into_iter().flatten() {
        eprintln!("{}", p.as_str().unwrap_or_default());
    }
    let decisions = applied["plan"]["decisions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if !json {
        if decisions.is_empty() {
            println!("nothing to do (cycle {cycle})");
        }
        for d in &decisions {
            println!(
                "{} {}: {}",
                d["vm"].as_str().unwrap_or_default(),
                d["action"].as_str().unwrap_or_default(),
                d["reason"].as_str().unwrap_or_default()
            );
        }
    }
    // The cycle's moves: started (an id) or refused at once (an end with
    // no id); followed until each has its end in the journal.
    let until = std::time::Instant::now()
        + ferry_controller::act::MOVE_LIMIT
        + std::time::Duration::from_secs(60);
    let ends = loop {
        let entries = c.journal(2000)?;
        let mine: Vec<_> = entries.iter().filter(|e| e.cycle == cycle).collect();
        let started: Vec<&str> = mine
            .iter()
            .filter_map(|e| match &e.event {
                Event::Started { id, .. } => Some(id.as_str()),
                _ => None,
            })
            .collect();
        let mut ended = 0;
        let ends: Vec<ferry_controller::act::MoveOutcome> = entries
            .iter()
            .filter_map(|e| match &e.event {
                Event::Finished { id, outcome } if id.is_empty() && e.cycle == cycle => {
                    Some(outcome.clone())
                }
                Event::Finished { id, outcome } if started.contains(&id.as_str()) => {
                    ended += 1;
                    Some(outcome.clone())
                }
                _ => None,
            })
            .collect();
        if ended >= started.len() {
            break ends;
        }
        if std::time::Instant::now() > until {
            anyhow::bail!(
                "{} of the {} moves of cycle {cycle} have not ended after {} s; see `ferry control status`",
                started.len() - ended,
                started.len(),
                (ferry_controller::act::MOVE_LIMIT.as_secs() + 60)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    };
    let lines: Vec<String> = ends.iter().map(|o| o.line()).collect();
    if json {
        return print_json(&serde_json::json!({"applied": applied, "moves": lines}));
    }
    for l in &lines {
        println!("{l}");
    }
    Ok(())
}

/// `ferry control run`: the controller service until the process ends.
fn run_controller(a: RunArgs, tls_dir: Option<PathBuf>) -> Result<()> {
    let RunArgs {
        insecure_plaintext_api,
        state_dir,
        etcd,
        etcd_prefix,
        etcd_tls_dir,
        name,
        lease,
        listen,
        interval,
        sample,
        loads,
        inventory,
        policy,
        paused,
    } = a;
    crate::init_logging();
    let tls = match &etcd_tls_dir {
        Some(d) => Some(
            ferry_client::ClientTls::from_dir(d)
                .map_err(|e| anyhow::anyhow!("etcd TLS credentials: {e}"))?
                .rustls_config(),
        ),
        None => None,
    };
    let etcd = (!etcd.is_empty()).then(|| {
        let mut prefix = etcd_prefix;
        if !prefix.ends_with('/') {
            prefix.push('/');
        }
        ferry_controller::service::EtcdOptions {
            endpoints: etcd,
            prefix,
            name: name.unwrap_or_else(|| default_name(&listen)),
            lease,
            tls,
        }
    });
    let saved = match (&etcd, &state_dir) {
        (Some(e), _) => {
            let c = e.client()?;
            let l = std::sync::Arc::new(ferry_controller::leader::Leadership::new(
                c.clone(),
                &e.prefix,
                &e.name,
                e.lease,
            ));
            ferry_controller::store::Store::etcd(c, &e.prefix, l, 1).load_settings()?
        }
        (None, Some(d)) => ferry_controller::settings::SettingsFile::new(d).load()?,
        (None, None) => anyhow::bail!("give --state-dir or --etcd"),
    };
    let mut s = saved.clone().unwrap_or_default();
    if let Some(f) = &inventory {
        s.inventory = read_json(f, "inventory")?;
    }
    if let Some(f) = &policy {
        s.policy = read_json(f, "policy")?;
    }
    if paused {
        s.policy.paused = true;
    }
    // Settings are "given" only when a flag gave some and they
    // differ from what is saved: controllers started together on
    // a fresh etcd with no settings all come up (one leads).
    let given = inventory.is_some() || policy.is_some() || paused;
    let initial = (given && Some(&s) != saved.as_ref()).then_some(s);
    if let Some(s) = &initial {
        s.validate()?;
    }
    // The controller's identity: --tls-dir, else its state
    // directory's tls/. Its calls to hosts and storage daemons
    // beyond loopback go with it.
    let identity = tls_dir
        .or_else(|| state_dir.as_ref().map(|d| d.join("tls")))
        .map(|d| ferry_trust::CertStore::at(&d, ferry_trust::Role::Controller));
    if let Some(id) = &identity {
        id.ensure_identity()?;
        ferry_api::client::set_process_identity(id.clone());
    }
    let opts = ferry_controller::service::Options {
        identity,
        insecure_plaintext_api,
        listen,
        state_dir: state_dir.unwrap_or_default(),
        etcd,
        interval,
        sample,
        loads: loads.source(),
        initial,
    };
    crate::runtime()?.block_on(ferry_controller::service::run(opts))?;
    Ok(())
}

pub fn run(cmd: ControlCmd, tls_dir: Option<PathBuf>) -> Result<()> {
    match cmd {
        ControlCmd::Run(a) => run_controller(a, tls_dir)?,
        ControlCmd::Status { to, journal, json } => status(&to.controller, journal, json)?,
        ControlCmd::Pause { to } => {
            ControllerClient::new(&to.controller).pause()?;
            println!("automation paused");
        }
        ControlCmd::Resume { to } => {
            ControllerClient::new(&to.controller).resume()?;
            println!("automation resumed");
        }
        ControlCmd::Burst {
            state,
            above,
            hold,
            to,
        } => {
            let c = ControllerClient::new(&to.controller);
            let mut p = c.settings()?.policy;
            p.burst = state == "on";
            if let Some(a) = above {
                p.burst_above = a;
            }
            if let Some(h) = hold {
                p.burst_hold_s = h.as_secs_f64();
            }
            c.put_policy(&p)?;
            println!(
                "bursting {} (above {:.0}% of a site's CPUs for {:.0} s)",
                state,
                p.burst_above * 100.0,
                p.burst_hold_s
            );
        }
        ControlCmd::Plan {
            from,
            apply,
            state_dir,
            save_snapshot,
            policy,
            json,
        } => match (apply, &from.inventory) {
            (true, None) => apply_through_controller(&from, policy.as_ref(), json)?,
            (true, Some(_)) => {
                let dir = state_dir.context(
                    "--apply --inventory needs --state-dir DIR: its journal keeps what was done",
                )?;
                plan_once(from, Some(dir), save_snapshot, policy, json)?
            }
            (false, _) => plan_once(from, None, save_snapshot, policy, json)?,
        },
        ControlCmd::Place {
            guest,
            cpu,
            inventory,
            controller,
            policy,
            interval,
            loads,
            dry_run,
        } => place(
            &guest,
            cpu,
            inventory.as_ref(),
            controller.as_deref(),
            policy.as_ref(),
            interval,
            &loads,
            dry_run,
        )?,
        ControlCmd::Estimate {
            vm,
            vm_to,
            disk_to,
            teleport_to,
            rtt_ms,
            from,
            horizon_s,
            json,
        } => estimate_one(
            &vm,
            (vm_to, disk_to, teleport_to),
            rtt_ms,
            &from,
            horizon_s,
            json,
        )?,
        ControlCmd::Simulate {
            sites,
            vms,
            ticks,
            seed,
            remote_share,
            spike_cpu,
            replay,
            policy,
            tick_s,
            rtt_at,
            json,
        } => {
            if let Some(f) = &replay {
                return replay_snapshot(f, policy.as_ref(), ticks, tick_s, &rtt_at, json);
            }
            let spike_ok = spike_cpu > 0.0 && spike_cpu <= 64.0;
            if !(0.0..=1.0).contains(&remote_share) || !spike_ok {
                anyhow::bail!(
                    "--remote-share must be 0 to 1 and --spike-cpu above 0 and at most 64"
                );
            }
            simulate_generated(
                &SimConfig {
                    sites,
                    vms,
                    ticks,
                    seed,
                    remote_share,
                    spike_cpu,
                    ..SimConfig::default()
                },
                json,
            )?;
        }
    }
    Ok(())
}

/// `ferry control estimate`: one move (or staying) priced on the live sites
/// or a snapshot; each link's figures with where they came from.
fn estimate_one(
    vm: &str,
    (vm_to, disk_to, teleport_to): (Option<String>, Option<String>, Option<String>),
    rtt_ms: Option<f64>,
    from: &SnapshotArgs,
    horizon_s: f64,
    json: bool,
) -> Result<()> {
    if !(horizon_s.is_finite() && horizon_s > 0.0) {
        anyhow::bail!("--horizon-s must be above 0");
    }
    let (asked, to) = match (vm_to, disk_to, teleport_to) {
        (Some(s), _, _) => (Asked::Move(Action::MoveVm), s),
        (_, Some(s), _) => (Asked::Move(Action::MoveDisk), s),
        (_, _, Some(s)) => (Asked::Move(Action::Teleport), s),
        _ if rtt_ms.is_some() => (Asked::Stay, String::new()),
        _ => anyhow::bail!("give --vm-to, --disk-to or --teleport-to SITE, or --rtt-ms"),
    };
    let snap = snapshot(from)?;
    let e = estimate(&snap.cluster, vm, asked, &to, rtt_ms, horizon_s)?;
    if json {
        // The estimate's fields, and each link as declared and probed.
        let mut v = serde_json::to_value(&e)?;
        v["links"] = serde_json::to_value(&snap.links)?;
        return print_json(&v);
    }
    print_estimate(&e, &snap.links);
    Ok(())
}

/// `ferry control simulate` on a generated cluster: every policy, a table.
fn simulate_generated(cfg: &SimConfig, json: bool) -> Result<()> {
    let rs = compare(cfg);
    if json {
        return print_json(&rs);
    }
    println!(
        "{} sites of {:.0} CPUs, {} VMs (1 CPU each; {:.0} on the spiking sites s0, s10, ... in ticks {} to {}), {} ticks of {} s",
        cfg.sites,
        ferry_placement::simulate::site_capacity(cfg),
        cfg.vms,
        cfg.spike_cpu,
        cfg.ticks / 3,
        2 * cfg.ticks / 3 - 1,
        cfg.ticks,
        cfg.tick_s
    );
    println!("| policy | guest-seconds lost | of which CPU contention | moves (VM / disk / teleport) | bytes moved | slowest cycle | drained at tick |");
    println!("|---|---|---|---|---|---|---|");
    for r in &rs {
        println!(
            "| {} | {:.0} | {:.0} | {} ({} / {} / {}) | {:.1} GB | {:.1} ms | {} |",
            r.policy,
            r.lost_s,
            r.cpu_lost_s,
            r.moves,
            r.vm_moves,
            r.disk_moves,
            r.teleports,
            r.bytes_moved / 1e9,
            r.max_cycle_ms,
            match (r.drained_at_tick, r.drain_left) {
                (Some(t), _) => t.to_string(),
                (None, 0) => "-".to_string(),
                (None, n) => format!("not by the end: {n} guests or disks left"),
            }
        );
    }
    let peak = rs.iter().map(|r| r.peak_cpu_share).fold(0.0, f64::max);
    if peak > 1.0 {
        println!(
            "\nThe guests asked for up to {:.0}% of all the sites' CPUs: no placement avoids that contention, and every policy loses it alike.",
            peak * 100.0
        );
    }
    Ok(())
}

/// `ferry control simulate --replay`: the snapshot under one policy.
fn replay_snapshot(
    snapshot: &PathBuf,
    policy: Option<&PathBuf>,
    ticks: usize,
    tick_s: f64,
    changes: &[ferry_placement::replay::RttChange],
    json: bool,
) -> Result<()> {
    if !(tick_s.is_finite() && tick_s > 0.0) {
        anyhow::bail!("--tick-s must be above 0");
    }
    let c: Cluster = read_json(snapshot, "cluster snapshot")?;
    let p: Policy = match policy {
        Some(f) => read_json(f, "policy")?,
        None => Policy::default(),
    };
    p.validate().map_err(anyhow::Error::msg)?;
    let r = ferry_placement::replay::replay(&c, &p, ticks, tick_s, changes)?;
    if json {
        return print_json(&r);
    }
    println!(
        "| t (s) | guest | host site | disk site | requests/s | vs snapshot | ms per request |"
    );
    println!("|---|---|---|---|---|---|---|");
    for t in &r.ticks {
        for g in &t.guests {
            println!(
                "| {:.0} | {} | {} | {} | {:.1} | {:.2} | {:.2} |",
                t.t_s,
                g.vm,
                g.placement.host_site,
                g.placement.disk_site,
                g.iops,
                g.rate_vs_snapshot,
                g.latency_ms
            );
        }
    }
    for m in &r.moves {
        println!(
            "at {:.0} s: {} {}: {} -> {}, {:.1} MB in {:.1} s, pause {:.0} ms: {}",
            m.decided_s,
            m.vm,
            m.action,
            m.from,
            m.to,
            m.bytes / 1e6,
            m.seconds,
            m.pause_s * 1000.0,
            m.reason
        );
    }
    if r.moves.is_empty() {
        println!("no moves");
    }
    Ok(())
}

/// The cluster to plan on: a snapshot file, or the live sites of an
/// inventory measured now (with where each guest runs). Problems met while
/// measuring go to stderr.
/// A cluster to plan or estimate on, and where its figures came from.
struct Snapshot {
    inventory: Option<Inventory>,
    cluster: Cluster,
    running_on: BTreeMap<String, String>,
    /// Each link as declared and as probed (empty for a saved snapshot).
    links: Vec<ferry_controller::measure::LinkMeasure>,
}

fn snapshot(from: &SnapshotArgs) -> Result<Snapshot> {
    if let Some(f) = &from.cluster {
        let c = read_json::<Cluster>(f, "cluster snapshot")?;
        c.validate()?;
        return Ok(Snapshot {
            inventory: None,
            cluster: c,
            running_on: BTreeMap::new(),
            links: Vec::new(),
        });
    }
    let inv: Inventory = match &from.inventory {
        Some(f) => read_json(f, "inventory")?,
        None => {
            let addr = from.controller.as_deref().unwrap_or("127.0.0.1:10870");
            ControllerClient::new(addr)
                .settings()
                .with_context(|| {
                    format!(
                        "asking the controller at {addr} for its sites (or give --inventory FILE or --cluster FILE)"
                    )
                })?
                .inventory
        }
    };
    inv.validate().map_err(anyhow::Error::msg)?;
    let m = ferry_controller::measure::measure(
        &inv,
        from.interval,
        &from.loads.source(),
        &BTreeMap::new(),
        &mut Default::default(),
        &mut Default::default(),
    );
    for p in &m.problems {
        eprintln!("{p}");
    }
    m.cluster.validate()?;
    Ok(Snapshot {
        inventory: Some(inv),
        cluster: m.cluster,
        running_on: m.running_on,
        links: m.links,
    })
}

/// `ferry control place`: decide where a new guest starts and start it
/// there, its disks reached the way that site reaches them.
#[allow(clippy::too_many_arguments)]
fn place(
    guest: &crate::vm::CreateArgs,
    cpu: Option<f64>,
    inventory: Option<&PathBuf>,
    controller: Option<&str>,
    policy: Option<&PathBuf>,
    interval: std::time::Duration,
    loads: &PrometheusArg,
    dry_run: bool,
) -> Result<()> {
    let mut spec = crate::vm::spec_from(guest)?;
    let (inv, p) = match controller {
        Some(addr) => {
            let s = ControllerClient::new(addr).settings()?;
            (s.inventory, s.policy)
        }
        None => {
            let f = inventory.context("give --inventory or --controller")?;
            let i: Inventory = read_json(f, "inventory")?;
            i.validate().map_err(anyhow::Error::msg)?;
            let p: Policy = match policy {
                Some(f) => read_json(f, "policy")?,
                None => Policy::default(),
            };
            (i, p)
        }
    };
    p.validate()?;
    let first = spec
        .disks
        .first()
        .context("a placed guest needs a disk (--disk VOLUME@NBD[@ADMIN]): its site decides")?;
    let disk_site = inv
        .site_of_storage(&first.server)
        .with_context(|| {
            format!(
                "its disk's server {} is at no site of the inventory",
                first.server
            )
        })?
        .name
        .clone();
    let m = ferry_controller::measure::measure(
        &inv,
        interval,
        &loads.source(),
        &BTreeMap::new(),
        &mut Default::default(),
        &mut Default::default(),
    );
    for pr in &m.problems {
        eprintln!("{pr}");
    }
    let need = cpu.unwrap_or(f64::from(spec.vcpus));
    let at = place_new(
        &m.cluster,
        &p,
        &NewGuest {
            name: spec.name.clone(),
            cpu: need,
            disk_site,
            memory_bytes: (spec.memory_mib as f64) * 1048576.0,
        },
    )?;
    // The host the placement chose by its room; else (a site whose hosts
    // the snapshot does not list) the site's first.
    let host = inv
        .chosen_host(&at.site, at.host.as_deref())
        .map_err(anyhow::Error::msg)?;
    for d in &mut spec.disks {
        if let Some((s, st)) = inv.storage_at(&d.server) {
            d.server = st.nbd_from(&s.name, &at.site).to_string();
        }
    }
    if dry_run {
        if guest.json {
            return print_json(
                &serde_json::json!({"placement": at, "host": host.control, "spec": spec}),
            );
        }
        println!(
            "{} would start at site {} (host {}): {}",
            spec.name, at.site, host.control, at.reason
        );
        return Ok(());
    }
    let v = ferry_api::AdminClient::for_host(&host.control).create_vm(&spec, !guest.no_start)?;
    if guest.json {
        return print_json(&serde_json::json!({"placement": at, "host": host.control, "vm": v}));
    }
    println!(
        "guest {} {} at site {} (host {}): {}",
        v.spec.name,
        v.state.as_str(),
        at.site,
        host.control,
        at.reason
    );
    Ok(())
}

fn print_estimate(e: &Estimate, links: &[ferry_controller::measure::LinkMeasure]) {
    let what = match e.asked {
        Asked::Stay => "stay where it is".to_string(),
        Asked::Move(a) => a.describe().to_string(),
    };
    println!(
        "{}: {what}: VM at {}, disk at {} -> VM at {}, disk at {}",
        e.vm, e.from.host_site, e.from.disk_site, e.to.host_site, e.to.disk_site,
    );
    let (a, b) = &e.link_sites;
    let m = links
        .iter()
        .find(|l| (&l.a == a && &l.b == b) || (&l.a == b && &l.b == a));
    let (rtt_from, bw_from) = match m {
        Some(m) => (m.rtt_used().1, m.bandwidth_used().1),
        None if a == b => ("within a site".into(), "within a site".into()),
        None => ("from the snapshot".into(), "from the snapshot".into()),
    };
    println!(
        "  link {a} <-> {b}: RTT {:.1} ms ({rtt_from}), {:.1} MB/s ({bw_from})",
        e.link_rtt_ms,
        e.link_bandwidth / 1e6
    );
    if let Some(m) = &e.cost {
        println!(
            "  move: {:.1} s, {:.1} MB on the link, pause {:.0} ms{}",
            m.seconds,
            m.bytes / 1e6,
            m.pause_s * 1000.0,
            if m.converges {
                ""
            } else {
                " (does not converge without throttling or post-copy)"
            }
        );
    }
    println!(
        "  disk I/O: {:.2} ms per request now ({:.2} of local speed), {:.2} ms then ({:.2}); {:.0} s of {:.0} lost then",
        e.access_now.latency_s * 1000.0,
        e.access_now.rate,
        e.access_then.latency_s * 1000.0,
        e.access_then.rate,
        e.access_then.lost_s,
        e.horizon_s
    );
    if e.clients_now_s > 0.0 || e.clients_then_s > 0.0 {
        println!(
            "  clients: {:.0} client-seconds of {:.0} lost to the guest's distance from them now, {:.0} then",
            e.clients_now_s, e.horizon_s, e.clients_then_s
        );
    }
}

/// An action as the API or the journal spells it (`move_disk`,
/// `MoveDisk`), in words.
fn action_words(v: &serde_json::Value) -> &'static str {
    match v.as_str().unwrap_or_default() {
        "move_vm" | "MoveVm" => "VM move",
        "move_disk" | "MoveDisk" => "disk move",
        "teleport" | "Teleport" => "teleport",
        _ => "move",
    }
}

fn status(controller: &str, journal: usize, json: bool) -> Result<()> {
    let c = ControllerClient::new(controller);
    let st = c.status()?;
    let set = c.settings()?;
    let jr = serde_json::to_value(c.journal(journal)?)?;
    if json {
        return print_json(&serde_json::json!({"status": st, "settings": set, "journal": jr}));
    }
    println!(
        "cycle {}, automation {}, {} site(s), {} link(s)",
        st["cycle"],
        if st["paused"].as_bool().unwrap_or(false) {
            "paused"
        } else {
            "on"
        },
        set.inventory.sites.len(),
        set.inventory.links.len()
    );
    if !set.policy.maintenance.is_empty() {
        println!("in maintenance: {}", set.policy.maintenance.join(", "));
    }
    if set.policy.burst {
        println!(
            "bursting: on, above {:.0}% of a site's CPUs for {:.0} s",
            set.policy.burst_above * 100.0,
            set.policy.burst_hold_s
        );
    }
    if st["role"] != "alone" {
        println!(
            "controller {} is {}; the leader is {}",
            st["name"].as_str().unwrap_or("?"),
            st["role"].as_str().unwrap_or("?"),
            st["leader"].as_str().unwrap_or("nobody right now")
        );
    }
    for p in st["problems"].as_array().into_iter().flatten() {
        println!("problem: {}", p.as_str().unwrap_or_default());
    }
    let measured: Vec<ferry_controller::measure::LinkMeasure> =
        serde_json::from_value(st["links"].clone()).unwrap_or_default();
    for l in &set.inventory.links {
        match measured.iter().find(|m| m.a == l.a && m.b == l.b) {
            Some(m) => {
                let ((rtt, rtt_from), (bw, bw_from)) = (m.rtt_used(), m.bandwidth_used());
                println!(
                    "link {} <-> {}: RTT {rtt:.1} ms ({rtt_from}), {:.1} MB/s ({bw_from})",
                    l.a,
                    l.b,
                    bw / 1e6
                );
            }
            None => println!(
                "link {} <-> {}: RTT {:.1} ms, {:.1} MB/s (declared; not measured yet)",
                l.a,
                l.b,
                l.rtt_ms,
                l.bandwidth / 1e6
            ),
        }
    }
    for h in st["held_back"].as_array().into_iter().flatten() {
        println!(
            "held back: {} {} to {}: failed {} times in a row, next try in {:.0} s (last: {})",
            h["vm"].as_str().unwrap_or("?"),
            h["action"].as_str().unwrap_or("?"),
            h["to"].as_str().unwrap_or("?"),
            h["failures"],
            h["retry_in_s"].as_f64().unwrap_or(0.0),
            h["reason"].as_str().unwrap_or("")
        );
    }
    if let Some(from) = st["loads_from"].as_str() {
        println!("guest loads from {from}");
    }
    for v in st["cluster"]["vms"].as_array().into_iter().flatten() {
        println!(
            "guest {} runs at {}, disk at {}: {:.0} IOPS, {:.2} ms, CPU {:.2}",
            v["name"].as_str().unwrap_or_default(),
            v["placement"]["host_site"].as_str().unwrap_or_default(),
            v["placement"]["disk_site"].as_str().unwrap_or_default(),
            v["load"]["iops"].as_f64().unwrap_or(0.0),
            v["load"]["latency_ms"].as_f64().unwrap_or(0.0),
            v["load"]["cpu"].as_f64().unwrap_or(0.0)
        );
    }
    for d in st["plan"]["decisions"].as_array().into_iter().flatten() {
        println!(
            "decided: {} {}: {}",
            d["vm"].as_str().unwrap_or_default(),
            action_words(&d["action"]),
            d["reason"].as_str().unwrap_or_default()
        );
    }
    for o in st["in_flight"].as_array().into_iter().flatten() {
        println!(
            "in flight: {} {} to VM at {}, disk at {} (predicted {:.0} s)",
            o["vm"].as_str().unwrap_or_default(),
            action_words(&o["action"]),
            o["to_host_site"].as_str().unwrap_or_default(),
            o["to_disk_site"].as_str().unwrap_or_default(),
            o["predicted_seconds"].as_f64().unwrap_or(0.0)
        );
    }
    // Every move weighed and refused, with the filter that refused it.
    for c in st["plan"]["candidates"].as_array().into_iter().flatten() {
        if !c["refused"].is_null() {
            println!("weighed: {}", c["line"].as_str().unwrap_or_default());
        }
    }
    for e in jr.as_array().into_iter().flatten() {
        let what = match e["event"].as_str().unwrap_or_default() {
            "finished" => format!(
                "{} {}: {} in {:.1} s (predicted {:.1} s){}",
                e["outcome"]["vm"].as_str().unwrap_or_default(),
                action_words(&e["outcome"]["action"]),
                e["outcome"]["result"].as_str().unwrap_or_default(),
                e["outcome"]["seconds"].as_f64().unwrap_or(0.0),
                e["outcome"]["predicted_seconds"].as_f64().unwrap_or(0.0),
                e["outcome"]["reason"]
                    .as_str()
                    .map(|r| format!(": {r}"))
                    .unwrap_or_default()
            ),
            "decided" => format!(
                "{} {}: {}",
                e["vm"].as_str().unwrap_or_default(),
                action_words(&e["action"]),
                e["reason"].as_str().unwrap_or_default()
            ),
            "started" => format!(
                "{} move {}",
                e["vm"].as_str().unwrap_or_default(),
                e["id"].as_str().unwrap_or_default()
            ),
            _ => e["what"].as_str().unwrap_or_default().to_string(),
        };
        println!(
            "journal #{} (cycle {}) {}: {what}",
            e["seq"],
            e["cycle"],
            e["event"].as_str().unwrap_or_default()
        );
    }
    Ok(())
}

#[derive(Subcommand)]
pub enum SiteCmd {
    /// Add a site to the controller's inventory.
    Add {
        name: String,
        /// CPUs the site's hosts offer guests.
        #[arg(long)]
        cpu_capacity: f64,
        /// A host: control=HOST:PORT,moves=HOST:PORT[,cpus=N][,memory_mib=M]
        /// (repeatable; cpus defaults to the site's CPUs split evenly, memory
        /// to unlimited). Guests moved to the site go to the host with the
        /// most room.
        #[arg(long = "host", value_parser = host_ref)]
        hosts: Vec<HostRef>,
        /// A storage daemon: nbd=..,migrate=..,admin=..[,nbd_local=..][,cluster=NAME]
        /// (repeatable). Daemons naming the same cluster are the shared
        /// gateways of one Ceph cluster (`ferry serve --ceph-shared`): a
        /// disk moved to the site goes through whichever of them answers.
        #[arg(long = "storage", value_parser = storage_ref)]
        storage: Vec<StorageRef>,
        /// A guest network whose clients are at this site (repeatable): a
        /// guest on it running at another site makes them wait across the
        /// link, which the policies count as a cost of that placement.
        #[arg(long = "clients", value_name = "NETWORK")]
        clients: Vec<String>,
        /// Change an existing site to this description (its links stay).
        #[arg(long)]
        replace: bool,
        #[command(flatten)]
        to: ControllerArg,
    },
    /// Remove a site (and its links).
    Remove {
        name: String,
        #[command(flatten)]
        to: ControllerArg,
    },
    /// Set the link between two sites (replaces it if present).
    Link {
        a: String,
        b: String,
        #[arg(long)]
        rtt_ms: f64,
        /// Megabits per second.
        #[arg(long)]
        mbit: f64,
        #[command(flatten)]
        to: ControllerArg,
    },
    /// Drain a site: move every guest off it (and every disk stored
    /// there) and move nothing in, until --off.
    Maintenance {
        name: String,
        #[arg(long)]
        off: bool,
        #[command(flatten)]
        to: ControllerArg,
    },
    /// The sites and links the controller knows.
    List {
        #[command(flatten)]
        to: ControllerArg,
        #[arg(long)]
        json: bool,
    },
}

fn pairs(s: &str) -> Result<BTreeMap<String, String>, String> {
    s.split(',')
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .ok_or_else(|| format!("expected KEY=VALUE, got {kv:?}"))
        })
        .collect()
}

fn take(m: &mut BTreeMap<String, String>, k: &str) -> Result<String, String> {
    m.remove(k).ok_or_else(|| format!("{k}= is missing"))
}

fn host_ref(s: &str) -> Result<HostRef, String> {
    let mut m = pairs(s)?;
    let cpus = match m.remove("cpus") {
        Some(c) => match c.parse::<f64>() {
            Ok(c) if c.is_finite() && c > 0.0 => Some(c),
            _ => return Err(format!("cpus={c}: expected a positive number")),
        },
        None => None,
    };
    let memory_mib = match m.remove("memory_mib") {
        Some(x) => Some(
            x.parse::<u64>()
                .map_err(|_| format!("memory_mib={x}: expected a whole number of MiB"))?,
        ),
        None => None,
    };
    let h = HostRef {
        control: take(&mut m, "control")?,
        moves: take(&mut m, "moves")?,
        cpus,
        memory_mib,
    };
    match m.keys().next() {
        Some(k) => Err(format!(
            "unknown key {k} (control, moves, cpus, memory_mib)"
        )),
        None => Ok(h),
    }
}

fn storage_ref(s: &str) -> Result<StorageRef, String> {
    let mut m = pairs(s)?;
    let st = StorageRef {
        nbd: take(&mut m, "nbd")?,
        migrate: take(&mut m, "migrate")?,
        admin: take(&mut m, "admin")?,
        nbd_local: m.remove("nbd_local"),
        cluster: m.remove("cluster").filter(|c| !c.is_empty()),
    };
    match m.keys().next() {
        Some(k) => Err(format!(
            "unknown key {k} (nbd, migrate, admin, nbd_local, cluster)"
        )),
        None => Ok(st),
    }
}

pub fn site(cmd: SiteCmd) -> Result<()> {
    match cmd {
        SiteCmd::Add {
            name,
            cpu_capacity,
            hosts,
            storage,
            clients,
            replace,
            to,
        } => {
            let site = SiteInventory {
                name: name.clone(),
                cpu_capacity,
                hosts,
                storage,
                clients,
            };
            let c = ControllerClient::new(&to.controller);
            if replace {
                c.replace_site(&site)?;
                println!("site {name} replaced (its links stay)");
            } else {
                c.add_site(&site)?;
                println!("site {name} added");
            }
        }
        SiteCmd::Remove { name, to } => {
            ControllerClient::new(&to.controller).remove_site(&name)?;
            println!("site {name} removed");
        }
        SiteCmd::Link {
            a,
            b,
            rtt_ms,
            mbit,
            to,
        } => {
            let c = ControllerClient::new(&to.controller);
            let mut links: Vec<Link> = c
                .settings()?
                .inventory
                .links
                .into_iter()
                .filter(|l| !((l.a == a && l.b == b) || (l.a == b && l.b == a)))
                .collect();
            links.push(Link {
                a: a.clone(),
                b: b.clone(),
                rtt_ms,
                bandwidth: mbit * 1e6 / 8.0,
            });
            c.put_links(&links)?;
            println!("link {a} <-> {b}: {rtt_ms} ms, {mbit} Mbit/s");
        }
        SiteCmd::Maintenance { name, off, to } => {
            let c = ControllerClient::new(&to.controller);
            let set = c.settings()?;
            if set.inventory.site(&name).is_none() {
                anyhow::bail!("no site {name}");
            }
            let mut p = set.policy;
            p.maintenance.retain(|m| m != &name);
            if !off {
                p.maintenance.push(name.clone());
            }
            c.put_policy(&p)?;
            if off {
                println!("site {name}: back in service");
            } else {
                println!("site {name}: in maintenance (its guests and disks move off)");
            }
        }
        SiteCmd::List { to, json } => {
            let set = ControllerClient::new(&to.controller).settings()?;
            if json {
                return print_json(&set.inventory);
            }
            for s in &set.inventory.sites {
                println!(
                    "{}: {} CPUs, hosts {}, storage {}{}",
                    s.name,
                    s.cpu_capacity,
                    s.hosts
                        .iter()
                        .map(|h| h.control.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                    s.storage
                        .iter()
                        .map(|x| x.nbd.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                    if s.clients.is_empty() {
                        String::new()
                    } else {
                        format!(", clients of {}", s.clients.join(", "))
                    }
                );
            }
            for l in &set.inventory.links {
                println!(
                    "{} <-> {}: {} ms, {:.0} Mbit/s",
                    l.a,
                    l.b,
                    l.rtt_ms,
                    l.bandwidth * 8.0 / 1e6
                );
            }
        }
    }
    Ok(())
}
