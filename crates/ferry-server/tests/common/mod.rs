//! A real daemon on 127.0.0.1:0 for tests, and helpers to run real clients.
#![allow(dead_code)]

use ferry_server::config::Config;
use ferry_server::{Daemon, ServerState};
use ferry_storage::{CreateOptions, Volume};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

pub struct TestServer {
    pub nbd: SocketAddr,
    pub admin: SocketAddr,
    pub migration: Option<SocketAddr>,
    pub pool: PathBuf,
    pub state: Arc<ServerState>,
    shutdown: CancellationToken,
    rt: Option<tokio::runtime::Runtime>,
    task: Option<tokio::task::JoinHandle<Result<(), ferry_server::ServerError>>>,
}

impl TestServer {
    pub fn start(pool: &Path) -> TestServer {
        Self::start_with(pool, |_| {})
    }

    /// Start with the configuration adjusted by `f` (listeners default to
    /// 127.0.0.1:0).
    pub fn start_with(pool: &Path, f: impl FnOnce(&mut Config)) -> TestServer {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let mut config = Config {
            pool: pool.to_path_buf(),
            ..Default::default()
        };
        config.nbd.listen = "127.0.0.1:0".into();
        config.admin.listen = "127.0.0.1:0".into();
        f(&mut config);
        let daemon = rt.block_on(Daemon::bind(config)).unwrap();
        let a = daemon.addrs();
        let state = daemon.state();
        let shutdown = CancellationToken::new();
        let task = rt.spawn(daemon.run(shutdown.clone()));
        TestServer {
            nbd: a.nbd.unwrap(),
            admin: a.admin.unwrap(),
            migration: a.migration,
            pool: pool.to_path_buf(),
            state,
            shutdown,
            rt: Some(rt),
            task: Some(task),
        }
    }

    pub fn create(&self, name: &str, size: u64) -> Arc<Volume> {
        self.state
            .pool
            .create(
                name,
                &CreateOptions {
                    size,
                    ..Default::default()
                },
            )
            .unwrap()
    }

    pub fn uri(&self, export: &str) -> String {
        format!("nbd://{}/{}", self.nbd, export)
    }

    pub fn rt(&self) -> &tokio::runtime::Runtime {
        self.rt.as_ref().unwrap()
    }

    /// Clean shutdown: drain, flush, save bitmaps, remove in-use markers.
    /// Returns once nothing of the daemon is left (its volumes' files, and
    /// their locks, closed), as when a real daemon process exits: a daemon
    /// started next on the same pool must find every volume free.
    pub fn stop(mut self) {
        self.shutdown.cancel();
        let rt = self.rt.take().unwrap();
        rt.block_on(self.task.take().unwrap()).unwrap().unwrap();
        drop(rt);
        let gone = Arc::downgrade(&self.state);
        drop(self);
        let t = std::time::Instant::now();
        while gone.upgrade().is_some() {
            assert!(
                t.elapsed() < std::time::Duration::from_secs(30),
                "the stopped daemon's state is still held"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.shutdown.cancel();
        if let (Some(rt), Some(t)) = (self.rt.take(), self.task.take()) {
            let _ = rt.block_on(t);
        }
    }
}

/// Is an external program here? With FERRY_REQUIRE_TOOLS=1 (set by the test
/// command) a missing tool fails the test instead of skipping it.
pub fn have(tool: &str) -> bool {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !found {
        if std::env::var("FERRY_REQUIRE_TOOLS").as_deref() == Ok("1") {
            panic!("{tool} is required (FERRY_REQUIRE_TOOLS=1) but not installed");
        }
        eprintln!("SKIP: {tool} not installed");
    }
    found
}

/// A `qemu-io`, `qemu-img` or `qemu-nbd` of QEMU 9 or later (those
/// negotiate NBD extended headers): the system's if it is that new, else
/// the one `scripts/qemu-ext.sh` unpacked (`$FERRY_QEMU_EXT_DIR`, default
/// /opt/ferry/qemu-ext). Missing: `None`, or a failure under
/// FERRY_REQUIRE_TOOLS=1.
pub fn qemu_ext(tool: &str) -> Option<std::path::PathBuf> {
    let major = |bin: &std::path::Path| -> Option<u32> {
        let out = Command::new(bin).arg("--version").output().ok()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let v = text.split("version ").nth(1)?;
        v.split('.').next()?.trim().parse().ok()
    };
    let dir = std::env::var("FERRY_QEMU_EXT_DIR").unwrap_or_else(|_| "/opt/ferry/qemu-ext".into());
    let candidates = [
        std::path::PathBuf::from(tool),
        std::path::Path::new(&dir).join("usr/bin").join(tool),
    ];
    if let Some(found) = candidates
        .into_iter()
        .find(|b| major(b).is_some_and(|m| m >= 9))
    {
        return Some(found);
    }
    if std::env::var("FERRY_REQUIRE_TOOLS").as_deref() == Ok("1") {
        panic!("{tool} of QEMU >= 9 is required (FERRY_REQUIRE_TOOLS=1): run scripts/qemu-ext.sh");
    }
    eprintln!("SKIP: no {tool} of QEMU >= 9");
    None
}

/// Run a command; panic with its output if it fails. Returns stdout.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    stdout
}

/// A file of `mib` MiB mixing random data, text and zero runs.
pub fn make_image(path: &Path, mib: usize) {
    let mut data = vec![0u8; mib << 20];
    let mut x: u64 = 0x1234_5678_9abc_def1;
    for (i, chunk) in data.chunks_mut(256 << 10).enumerate() {
        if i % 4 == 3 {
            continue;
        }
        for b in chunk.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
    }
    std::fs::write(path, data).unwrap();
}

pub fn sha(path: &Path) -> String {
    run(Command::new("sha256sum").arg(path))
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// Resident memory of this process (the daemon runs in it), in bytes.
pub fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

/// Each daemon trusts the other's certificate.
pub fn trust_each_other(a: &Path, b: &Path) {
    let (sa, sb) = (
        ferry_migration_engine::tls::CertStore::new(a),
        ferry_migration_engine::tls::CertStore::new(b),
    );
    sa.ensure_identity().unwrap();
    sb.ensure_identity().unwrap();
    let name = |p: &Path| p.file_name().unwrap().to_string_lossy().into_owned();
    sa.trust(&sb.cert_path(), Some(&name(b)), None).unwrap();
    sb.trust(&sa.cert_path(), Some(&name(a)), None).unwrap();
}

/// The report of `run` once it has switched or failed, within `limit`.
pub fn wait_report(
    run: &ferry_migration_engine::MigrationRun,
    limit: std::time::Duration,
) -> ferry_migration_engine::Report {
    use ferry_migration_engine::Phase;
    let deadline = std::time::Instant::now() + limit;
    loop {
        if matches!(run.phase(), Phase::Switched | Phase::Failed) {
            if let Some(r) = run.report.lock().clone() {
                return r;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "migration did not end: {:?}",
            run.status()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
