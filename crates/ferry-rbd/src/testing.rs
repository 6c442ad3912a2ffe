//! Ceph clusters for tests: the ones the test command started (named by
//! `FERRY_TEST_CEPH_CONF` / `FERRY_TEST_CEPH_B_CONF`), or else clusters this
//! test process starts with `scripts/ceph-cluster.sh` and stops when it
//! exits. Tests never skip for want of Ceph: if none can start, they fail
//! saying why.

use crate::ClusterConfig;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// Clusters this process started: their directories, stopped at exit.
static STARTED: Mutex<Vec<(usize, PathBuf)>> = Mutex::new(Vec::new());

extern "C" fn stop_started() {
    let dirs = STARTED.lock().map(|g| g.clone()).unwrap_or_default();
    for (_, d) in dirs {
        let _ = Command::new("bash")
            .arg(script())
            .arg("stop")
            .arg(&d)
            .status();
        let _ = std::fs::remove_dir_all(&d);
    }
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-cluster.sh")
}

/// The pool tests use in every cluster.
pub const POOL: &str = "rbd";

/// Test cluster `which` (0: site A's, 1: site B's): its configuration,
/// started on first use if the test command did not start it.
///
/// # Panics
///
/// If no cluster runs and none can be started (Ceph's daemons missing).
pub fn cluster(which: usize) -> ClusterConfig {
    let var = if which == 0 {
        "FERRY_TEST_CEPH_CONF"
    } else {
        "FERRY_TEST_CEPH_B_CONF"
    };
    if let Some(conf) = std::env::var_os(var) {
        let conf = PathBuf::from(conf);
        let keyring = conf.with_file_name("keyring");
        return ClusterConfig {
            keyring: keyring.exists().then_some(keyring),
            conf,
            client: "admin".into(),
        };
    }
    let mut started = STARTED.lock().unwrap_or_else(|e| e.into_inner());
    let dir = if let Some((_, d)) = started.iter().find(|(w, _)| *w == which) {
        d.clone()
    } else {
        let d = std::env::temp_dir().join(format!("ferry-ceph-{}-{which}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        if started.is_empty() {
            // SAFETY: registering a plain extern "C" function with no
            // captured state; it runs once at process exit.
            unsafe { libc::atexit(stop_started) };
        }
        started.push((which, d.clone()));
        let out = Command::new("bash")
            .arg(script())
            .arg("start")
            .arg(&d)
            .output()
            .expect("run scripts/ceph-cluster.sh");
        assert!(
            out.status.success(),
            "no Ceph cluster for the tests: scripts/ceph-cluster.sh start failed \
             (install ceph-mon ceph-osd ceph-mgr: bash scripts/install-deps.sh --test): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        d
    };
    ClusterConfig {
        conf: dir.join("ceph.conf"),
        keyring: Some(dir.join("keyring")),
        client: "admin".into(),
    }
}

/// A name no other test of this run uses.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}
