//! The kill matrix (issue 32): a teleport and a VM-only move, each
//! participant killed with SIGKILL at each phase, with real daemons, real
//! QEMU guests and toxiproxy between two sites on this machine.
//!
//! Each case starts a move of the test guest from the site it runs at to
//! the other, holds the move at the phase (a slow link for the memory
//! copy, a fail point of the source host for the others: `ferry_vm_host::fault`),
//! kills one participant, starts it again on the same state, and then
//! checks what an operator would: the guest runs at exactly one site (the
//! other host does not list it), it goes on acknowledging records with no
//! second boot, and the next move of the same guest completes with
//! nothing done by hand. At the end every record the guest acknowledged,
//! at either site, is on its volume, intact.
//!
//! `FERRY_FAULT_CASES=teleport/source-host` (a substring of the case
//! names) runs some cases only, for a developer; the test command runs
//! them all.
// Test fixtures: sizes the test itself chooses.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

#[path = "../../ferry-server/tests/common/toxiproxy.rs"]
#[allow(dead_code)]
mod toxiproxy;

mod common;
mod guests;

use common::have;
use guests::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// One site: its storage daemon and its host, and the addresses the other
/// site reaches them at (through toxiproxy).
struct Site {
    name: &'static str,
    st: Storage,
    host: Host,
    /// The toxiproxy name and listen address of this site's move
    /// listener, and the listen address of its storage migration listener.
    hosts_proxy: String,
    hosts_wan: String,
    storage_wan: String,
}

struct World {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    tp: toxiproxy::Toxiproxy,
    sites: [Site; 2],
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Teleport,
    VmOnly,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Who {
    DestinationHost,
    DestinationStorage,
    SourceHost,
    SourceStorage,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    DiskPrecopy,
    MemoryPrecopy,
    Switchover,
    AfterSwitch,
}

/// How long a fail point holds the move: time to kill and look.
const HOLD_MS: u64 = 8000;

fn world() -> World {
    let mut tmp = tempfile::tempdir().unwrap();
    // A developer's run may keep the daemons' logs and state to read.
    if std::env::var_os("FERRY_FAULT_KEEP").is_some() {
        tmp.disable_cleanup(true);
        eprintln!("keeping {}", tmp.path().display());
    }
    let dir = tmp.path().to_path_buf();
    let tp = toxiproxy::Toxiproxy::start();
    let mk = |name: &'static str| {
        let st = Storage::start(&dir.join(format!("s{name}")));
        std::fs::create_dir_all(dir.join(format!("h{name}"))).unwrap();
        (name, st)
    };
    let (a, sa) = mk("a");
    let (b, sb) = mk("b");
    trust(&sa.pool, &sb.pool);
    trust(&dir.join("ha"), &dir.join("hb"));
    let site = |name: &'static str, st: Storage| {
        let host = Host::start(&dir.join(format!("h{name}")));
        let hosts_proxy = format!("hosts_{name}");
        let storage_proxy = format!("storage_{name}");
        let hosts_wan = tp.proxy(&hosts_proxy, &host.moves);
        let storage_wan = tp.proxy(&storage_proxy, &st.mig);
        for p in [&hosts_proxy, &storage_proxy] {
            tp.add_latency(p, 10);
        }
        Site {
            name,
            st,
            host,
            hosts_proxy,
            hosts_wan,
            storage_wan,
        }
    };
    let sites = [site(a, sa), site(b, sb)];
    World {
        _tmp: tmp,
        dir,
        tp,
        sites,
    }
}

impl World {
    /// The site whose host runs the guest (exactly one may list it).
    fn running_at(&self) -> usize {
        let states: Vec<Option<String>> =
            self.sites.iter().map(|s| s.host.state_of("g1")).collect();
        match states.as_slice() {
            [Some(a), None] if a == "running" => 0,
            [None, Some(b)] if b == "running" => 1,
            other => panic!("the guest must run at exactly one site: {other:?}"),
        }
    }

    /// Wait (bounded) until the guest runs at exactly one site and the
    /// other host does not list it; returns that site.
    fn settle(&self, case: &str) -> usize {
        let t = Instant::now();
        loop {
            let states: Vec<Option<String>> =
                self.sites.iter().map(|s| s.host.state_of("g1")).collect();
            match states.as_slice() {
                [Some(a), None] if a == "running" => return 0,
                [None, Some(b)] if b == "running" => return 1,
                other => assert!(
                    t.elapsed() < Duration::from_secs(120),
                    "{case}: the guest does not run at exactly one site: {other:?}"
                ),
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Where the volume is served (not moved away, not an incomplete copy).
    fn volume_at(&self) -> Vec<usize> {
        (0..2)
            .filter(|&i| {
                let list: Value = serde_json::from_str(&ok(&[
                    "volume",
                    "list",
                    "--json",
                    "--admin",
                    &self.sites[i].st.admin,
                ]))
                .unwrap();
                list.as_array().unwrap().iter().any(|v| {
                    v["name"] == "root"
                        && v["moved_to"].is_null()
                        && v["incoming"].is_null()
                        && v["importing"] == false
                })
            })
            .collect()
    }

    /// Every serial log the guest wrote, at either host, moved or not.
    fn serials(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for s in &self.sites {
            let live = s.host.serial("g1");
            if live.exists() {
                out.push(live);
            }
            for d in std::fs::read_dir(s.host.state.join("moved"))
                .into_iter()
                .flatten()
                .flatten()
            {
                let p = d.path().join("serial.log");
                if p.exists() {
                    out.push(p);
                }
            }
        }
        out
    }

    fn set_slow(&self, proxy: &str, slow: bool) {
        if slow {
            self.tp.add_toxic(
                proxy,
                "bw",
                "bandwidth",
                "upstream",
                serde_json::json!({"rate": 1_500}),
            );
        } else {
            self.tp.remove_toxic(proxy, "bw");
        }
    }

    /// Move the guest from `from` to the other site and expect it to
    /// complete: a teleport, or a VM-only move when its disk is already
    /// there.
    fn next_move(&self, from: usize, case: &str) {
        let to = 1 - from;
        let disk_there = self.volume_at() == vec![to];
        let (src, dst) = (&self.sites[from], &self.sites[to]);
        let mut args = vec!["g1", "--to-host", &dst.hosts_wan];
        if !disk_there {
            args.extend([
                "--with-disk",
                "--to-storage",
                &dst.storage_wan,
                "--to-storage-admin",
                &dst.st.admin,
            ]);
        }
        let (done, r) = migrate(&src.host, &args);
        assert!(
            done,
            "{case}: the next move failed: {r}\nsource host's log:\n{}\ndestination host's log:\n{}",
            src.host.log_tail(30),
            dst.host.log_tail(30)
        );
        assert_eq!(r["result"], "completed", "{case}: {r}");
        assert_eq!(self.settle(case), to, "{case}: after the next move");
        wait_acks(&dst.host.serial("g1"), 5);
    }
}

fn set_failpoint(host: &Host, name: &str, actions: &str) {
    ureq::put(&format!("http://{}/v1/failpoints/{name}", host.control))
        .send_json(serde_json::json!({ "actions": actions }))
        .unwrap_or_else(|e| panic!("fail point {name}: {e} (is the failpoints feature on?)"));
}

/// The phase of the host's running move, if one runs.
fn move_phase(host: &Host) -> Option<String> {
    let moves: Value = ureq::get(&format!("http://{}/v1/vm-moves", host.control))
        .call()
        .ok()?
        .into_json()
        .ok()?;
    moves
        .as_array()?
        .iter()
        .filter_map(|m| m["phase"].as_str())
        .find(|p| !["completed", "aborted", "failed", "cancelled"].contains(p))
        .map(str::to_string)
}

fn wait_phase(host: &Host, want: &str, case: &str) {
    let t = Instant::now();
    loop {
        if move_phase(host).as_deref() == Some(want) {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(90),
            "{case}: the move never reached {want} (at {:?})",
            move_phase(host)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Wait (bounded) until move `id` at `host` has ended; its phase and why.
fn wait_move_end(host: &Host, id: &str, case: &str) -> (String, String) {
    let t = Instant::now();
    loop {
        let m: Value = ureq::get(&format!("http://{}/v1/vm-moves/{id}", host.control))
            .call()
            .ok()
            .and_then(|r| r.into_json().ok())
            .unwrap_or(Value::Null);
        let phase = m["phase"].as_str().unwrap_or("").to_string();
        if ["completed", "aborted", "failed"].contains(&phase.as_str()) {
            let why = m["error"]
                .as_str()
                .or_else(|| m["convergence"].as_array()?.last()?.as_str())
                .unwrap_or("")
                .to_string();
            return (phase, why);
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "{case}: the restarted daemon did not end move {id}: {m}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// SIGKILL every QEMU the host's state directory records.
fn kill_qemus(state: &Path) {
    for v in std::fs::read_dir(state.join("vms"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(pid) = std::fs::read_to_string(v.path().join("qemu.pid")) {
            let _ = Command::new("kill").args(["-9", pid.trim()]).status();
        }
    }
}

/// One case: start the move, hold it at `phase`, kill `who`, start it
/// again, and check the outcome. Returns a line for the record.
fn run_case(w: &mut World, kind: Kind, who: Who, phase: Phase) -> String {
    let case = format!("{kind:?}/{who:?}/{phase:?}");
    let from = w.running_at();
    let to = 1 - from;
    let volume_before = w.volume_at();
    assert_eq!(
        volume_before,
        vec![from],
        "{case}: the disk starts with the guest"
    );
    let dst_host_state = w.sites[to].host.state.clone();
    // Hold the move at the phase.
    match phase {
        Phase::DiskPrecopy => set_failpoint(
            &w.sites[from].host,
            "move.disk_precopy",
            &format!("1*return({HOLD_MS})"),
        ),
        Phase::MemoryPrecopy => w.set_slow(&w.sites[to].hosts_proxy, true),
        Phase::Switchover => {
            let point = if kind == Kind::Teleport {
                "move.switchover"
            } else {
                "move.finish"
            };
            set_failpoint(&w.sites[from].host, point, &format!("1*return({HOLD_MS})"));
        }
        Phase::AfterSwitch => set_failpoint(
            &w.sites[from].host,
            "move.switched",
            &format!("1*return({HOLD_MS})"),
        ),
    }
    let (src, dst) = (&w.sites[from], &w.sites[to]);
    let mut args = vec!["g1".to_string(), "--to-host".into(), dst.hosts_wan.clone()];
    if kind == Kind::Teleport {
        args.extend([
            "--with-disk".into(),
            "--to-storage".into(),
            dst.storage_wan.clone(),
            "--to-storage-admin".into(),
            dst.st.admin.clone(),
        ]);
    }
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let child = migrate_child(&src.host, &a);
    let want = match phase {
        Phase::DiskPrecopy => "disk_precopy",
        Phase::MemoryPrecopy => "memory_precopy",
        Phase::Switchover | Phase::AfterSwitch => "switchover",
    };
    wait_phase(&src.host, want, &case);
    // Well inside the hold (or the slow copy).
    std::thread::sleep(Duration::from_millis(match phase {
        Phase::MemoryPrecopy => 1500,
        Phase::DiskPrecopy => 500,
        Phase::Switchover | Phase::AfterSwitch => 1500,
    }));
    // The kill, then the same daemon on the same state and addresses.
    match who {
        Who::DestinationHost => {
            w.sites[to].host.kill9();
            // Its QEMU too, while it is only a waiting copy; after the
            // switch it is the guest itself.
            if phase != Phase::AfterSwitch {
                kill_qemus(&dst_host_state);
            }
            std::thread::sleep(Duration::from_millis(500));
            w.sites[to].host.restart();
        }
        Who::SourceHost => {
            w.sites[from].host.restart();
        }
        Who::DestinationStorage => w.sites[to].st.restart(),
        Who::SourceStorage => w.sites[from].st.restart(),
    }
    let out = child.wait_with_output().unwrap();
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    let r: Value = serde_json::from_str(&report).unwrap_or(Value::Null);
    let said = if r.is_null() {
        let err = String::from_utf8_lossy(&out.stderr);
        format!(
            "ended for the CLI: {}",
            err.lines().find(|l| l.starts_with("Error:")).unwrap_or("")
        )
    } else {
        format!(
            "{} ({})",
            r["result"].as_str().unwrap_or("?"),
            r["reason"].as_str().unwrap_or("")
        )
    };
    if phase == Phase::MemoryPrecopy {
        w.set_slow(&w.sites[to].hosts_proxy, false);
    }
    // A restarted source daemon finds the move unfinished: it reads as
    // resolving, and ends once the daemon knows how it went.
    let resolved = if who == Who::SourceHost {
        let err = String::from_utf8_lossy(&out.stderr);
        let id = err
            .split_whitespace()
            .skip_while(|w| *w != "move")
            .nth(1)
            .unwrap_or_default()
            .to_string();
        let (phase, why) = wait_move_end(&w.sites[from].host, &id, &case);
        format!("; the restarted source daemon ended it {phase}: {why}")
    } else {
        String::new()
    };
    let at = w.settle(&case);
    let serial = w.sites[at].host.serial("g1");
    wait_acks(&serial, 5);
    let disk = w.volume_at();
    assert_eq!(disk.len(), 1, "{case}: the volume is served at {disk:?}");
    let line = format!(
        "{case}: move {said}{resolved}; guest at {}, disk at {}",
        w.sites[at].name, w.sites[disk[0]].name
    );
    eprintln!("{line}");
    w.next_move(at, &case);
    // Leave the guest and its disk together for the next case.
    let now = w.running_at();
    if w.volume_at() != vec![now] {
        w.next_move(now, &case);
        let back = w.running_at();
        assert_eq!(w.volume_at(), vec![back], "{case}: disk and guest apart");
    }
    line
}

fn selected(case: &str) -> bool {
    std::env::var("FERRY_FAULT_CASES").map_or(true, |f| {
        f.split(',')
            .any(|part| case.to_lowercase().contains(&part.to_lowercase()))
    })
}

fn run_matrix(kind: Kind, phases: &[Phase], who: &[Who]) {
    let Some(_) = guest_files() else { return };
    assert!(
        have("toxiproxy-server"),
        "the test command installs toxiproxy"
    );
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut w = world();
    ext4_volume(&w.sites[0].st, &w.dir, "root");
    create_guest(&w.sites[0].host, &w.sites[0].st, "g1", "root", false);
    let mut lines = Vec::new();
    for &phase in phases {
        for &p in who {
            let name = format!("{kind:?}/{p:?}/{phase:?}");
            if !selected(&name) {
                continue;
            }
            lines.push(run_case(&mut w, kind, p, phase));
        }
    }
    eprintln!("\n{}", lines.join("\n"));
    let at = w.running_at();
    w.sites[at].host.vm_ok(&["stop", "g1"]);
    let serials = w.serials();
    let booted: usize = serials.iter().map(|s| boots(s)).sum();
    assert_eq!(booted, 1, "the guest booted again: {serials:?}");
    let disk = w.volume_at();
    assert_eq!(disk.len(), 1);
    check_records(&w.sites[disk[0]].st, "root", &w.dir, &serials);
}

#[test]
fn a_teleport_survives_the_death_of_any_participant_at_any_phase() {
    run_matrix(
        Kind::Teleport,
        &[
            Phase::DiskPrecopy,
            Phase::MemoryPrecopy,
            Phase::Switchover,
            Phase::AfterSwitch,
        ],
        &[
            Who::DestinationHost,
            Who::DestinationStorage,
            Who::SourceHost,
            Who::SourceStorage,
        ],
    );
}

#[test]
fn a_vm_only_move_survives_the_death_of_any_participant_at_any_phase() {
    // The disk stays at the source site: its storage daemon is the one
    // storage participant.
    run_matrix(
        Kind::VmOnly,
        &[Phase::MemoryPrecopy, Phase::Switchover, Phase::AfterSwitch],
        &[Who::DestinationHost, Who::SourceHost, Who::SourceStorage],
    );
}
