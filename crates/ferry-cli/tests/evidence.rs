//! The evidence set (bench/evidence.py) still runs: every experiment at its
//! quick size, against this build of ferry, draws its figure and lands on the
//! page. The figures' numbers are not checked here (tests check correctness,
//! never timings); the full run is for people and docs/evidence.md.
//!
//! The four experiments on the Debian guest are left to the full run unless
//! `FERRY_EVIDENCE_ALL=1`: each boots the guest under TCG (1.5-2.5 minutes
//! here) before it measures anything, and what they drive is tested on its
//! own: a networked real guest teleported under its clients' load in
//! `network.rs`, the controller's threshold move (`threshold`, on the test
//! guest) here. The last of them, `db_threshold`, took 252 of this test's
//! 1,079 s (2026-12-01), the most of any experiment.

mod common;

use common::on_path;
use std::path::{Path, PathBuf};
use std::process::Command;

const EXPERIMENTS: [&str; 14] = [
    "rtt",
    "move_then_run",
    "threshold",
    "model",
    "similarity",
    "index",
    "migration",
    "pause",
    "workloads",
    "cpu",
    "sweeps",
    "drivers",
    "consolidation",
    "scale",
];

/// Run only with `FERRY_EVIDENCE_ALL=1` (see the module's comment).
const ON_THE_DEBIAN_GUEST: [&str; 4] = ["db_rtt", "db_move_then_run", "real_pause", "db_threshold"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Debian's python3 (where python3-matplotlib lives) first, then PATH's.
fn python() -> Option<&'static str> {
    ["/usr/bin/python3", "python3"].into_iter().find(|p| {
        Command::new(p)
            .args(["-c", "import matplotlib"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    })
}

#[test]
fn every_evidence_experiment_runs_and_draws_its_figure() {
    let all = std::env::var("FERRY_EVIDENCE_ALL").is_ok_and(|v| v == "1");
    let mut tools = vec![
        "fio",
        "toxiproxy-server",
        "qemu-storage-daemon",
        "rsync",
        "mke2fs",
        "qemu-system-x86_64",
        // cpu: nbdkit beside ferry; drivers: a loop device for the raw block device.
        "nbdkit",
        "losetup",
        // consolidation: each site's host pinned to its own core.
        "taskset",
    ];
    if all {
        // The Debian guest's database and its clients; real_pause, db_rtt:
        // jobs start in the guest over SSH.
        tools.extend(["sysbench", "mariadb", "ssh", "ssh-keygen"]);
    }
    let missing: Vec<&str> = tools.into_iter().filter(|t| !on_path(t)).collect();
    let py = python();
    if !missing.is_empty() || py.is_none() {
        assert!(
            std::env::var("FERRY_REQUIRE_TOOLS").is_err(),
            "the evidence run needs {missing:?} and python3 with matplotlib"
        );
        eprintln!("skipped: missing {missing:?} or matplotlib");
        return;
    }
    let mut names: Vec<&str> = EXPERIMENTS.to_vec();
    if all {
        names.extend(ON_THE_DEBIAN_GUEST);
    }
    let out = tempfile::tempdir().unwrap();
    let run = Command::new(py.unwrap())
        .arg(root().join("bench/evidence.py"))
        .args(["--quick", "--only", &names.join(","), "--out"])
        .arg(out.path())
        .env("FERRY_BIN", env!("CARGO_BIN_EXE_ferry"))
        .output()
        .unwrap();
    let log = format!(
        "{}\n{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        run.status.success(),
        "bench/evidence.py --quick failed:\n{log}"
    );
    let page = std::fs::read_to_string(out.path().join("evidence.md")).unwrap();
    for name in names {
        let png = out.path().join(format!("{name}.png"));
        let len = std::fs::metadata(&png).map(|m| m.len()).unwrap_or(0);
        assert!(
            len > 10_000,
            "{name}.png missing or empty ({len} bytes)\n{log}"
        );
        assert!(
            page.contains(&format!("({name}.png)")) || page.contains(&format!("/{name}.png)")),
            "the page shows {name}"
        );
        assert!(
            !page.contains(&format!("--only {name}`.")),
            "{name} marked not run"
        );
        let raw: serde_json::Value = serde_json::from_slice(
            &std::fs::read(out.path().join(format!("{name}.json"))).unwrap(),
        )
        .unwrap();
        assert!(
            raw["ours"].as_str().is_some_and(|s| !s.is_empty()),
            "{name} says what ferry did"
        );
    }
}
