//! What the guest tests share: storage and host daemons as processes,
//! two sites joined by toxiproxy, the test guest (its acks on the serial
//! console, its records on the volume) and the checks made from outside.
#![allow(dead_code)]

use crate::common::{free_port, have, required};
use crate::toxiproxy;
use serde_json::Value;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub const FERRY: &str = env!("CARGO_BIN_EXE_ferry");
/// One guest test at a time: each runs two TCG guests at its peak.
pub static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

pub fn addr() -> String {
    format!("127.0.0.1:{}", free_port())
}

/// The guest kernel and initramfs (scripts/guest-image.sh), or None to skip.
pub fn guest_dir() -> PathBuf {
    std::env::var_os("FERRY_GUEST_DIR")
        .map_or_else(|| PathBuf::from("/var/cache/ferry-guest"), PathBuf::from)
}

pub fn guest_files() -> Option<(PathBuf, PathBuf)> {
    let dir = guest_dir();
    let (k, i) = (dir.join("vmlinuz"), dir.join("initrd.img"));
    if k.is_file() && i.is_file() && have("qemu-system-x86_64") && have("debugfs") {
        return Some((k, i));
    }
    assert!(
        !required(),
        "guest image missing in {}: run scripts/guest-image.sh",
        dir.display()
    );
    None
}

pub fn ferry(args: &[&str]) -> std::process::Output {
    Command::new(FERRY).args(args).output().unwrap()
}

pub fn ok(args: &[&str]) -> String {
    ok_cmd(Command::new(FERRY).args(args))
}

/// Run `c`; its stdout if it succeeded, else fail with both outputs.
pub fn ok_cmd(c: &mut Command) -> String {
    let o = c.output().unwrap();
    assert!(
        o.status.success(),
        "{c:?}: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Spawn a daemon (its stderr appended to `log`) and wait for its API at
/// `url`. If it exits first, `Err` with what it logged this time (a port
/// taken between choosing it and binding it is retried by the callers
/// that chose their ports).
fn spawn_and_wait(cmd: &mut Command, url: &str, what: &str, log: &Path) -> Result<Child, String> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    let from = file.metadata().map_or(0, |m| m.len());
    let mut child = cmd.stdout(Stdio::null()).stderr(file).spawn().unwrap();
    let t = Instant::now();
    let said = || {
        let all = std::fs::read(log).unwrap_or_default();
        String::from_utf8_lossy(all.get(usize::try_from(from).unwrap_or(0)..).unwrap_or(&[]))
            .into_owned()
    };
    while ureq::get(url).call().is_err() {
        if child.try_wait().ok().flatten().is_some() {
            return Err(said());
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{what} did not start; its log:\n{}",
            said()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(child)
}

/// Start a daemon on the ports `start` chooses, again on new ones when one
/// was taken meanwhile (`free_port` only knows a port was free when it
/// asked).
fn start_on_free_ports<T>(what: &str, mut start: impl FnMut() -> Result<T, String>) -> T {
    let mut last = String::new();
    for _ in 0..4 {
        match start() {
            Ok(t) => return t,
            Err(log) if log.contains("Address already in use") => last = log,
            Err(log) => panic!("{what} did not start; its log:\n{log}"),
        }
    }
    panic!("{what} did not start on four sets of free ports; its log:\n{last}")
}

/// Wait for a daemon's API; if it does not come up, say so with its log.
pub fn wait_http(url: &str, what: &str, log: Option<&Path>) {
    let t = Instant::now();
    while ureq::get(url).call().is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{what} did not start; its log:\n{}",
            log.and_then(|l| std::fs::read_to_string(l).ok())
                .unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A storage daemon.
pub struct Storage {
    pub child: Child,
    pub pool: PathBuf,
    pub nbd: String,
    pub admin: String,
    pub mig: String,
}

impl Storage {
    pub fn start(pool: &Path) -> Storage {
        start_on_free_ports("ferry serve", || {
            Self::try_start(pool, addr(), addr(), addr(), &[])
        })
    }

    pub fn start_on(pool: &Path, nbd: String, admin: String, mig: String) -> Storage {
        Self::start_with(pool, nbd, admin, mig, &[])
    }

    /// A storage daemon with more `ferry serve` arguments (`--iscsi ...`).
    pub fn start_with(
        pool: &Path,
        nbd: String,
        admin: String,
        mig: String,
        extra: &[String],
    ) -> Storage {
        Self::try_start(pool, nbd, admin, mig, extra)
            .unwrap_or_else(|log| panic!("ferry serve did not start; its log:\n{log}"))
    }

    /// Its log beside the pool (appended across restarts), for a test
    /// that fails to show.
    fn try_start(
        pool: &Path,
        nbd: String,
        admin: String,
        mig: String,
        extra: &[String],
    ) -> Result<Storage, String> {
        let child = spawn_and_wait(
            Command::new(FERRY)
                .args(["serve", "--pool"])
                .arg(pool)
                .args(["--nbd", &nbd, "--admin", &admin, "--migrate", &mig])
                .args(extra)
                .env("FERRY_LOG", "info"),
            &format!("http://{admin}/v1/server"),
            "ferry serve",
            &pool.with_extension("log"),
        )?;
        Ok(Storage {
            child,
            pool: pool.into(),
            nbd,
            admin,
            mig,
        })
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Kill the daemon (SIGKILL) and start another on the same pool and
    /// addresses.
    pub fn restart(&mut self) {
        self.kill9();
        std::thread::sleep(Duration::from_millis(500));
        let next = Storage::start_on(
            &self.pool,
            self.nbd.clone(),
            self.admin.clone(),
            self.mig.clone(),
        );
        // The old value, its daemon already dead, is dropped here.
        let _ = std::mem::replace(self, next);
    }
}

impl Drop for Storage {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A VM host daemon.
pub struct Host {
    pub child: Child,
    pub state: PathBuf,
    pub control: String,
    pub moves: String,
}

impl Host {
    pub fn start(state: &Path) -> Host {
        start_on_free_ports("ferry host", || Self::try_start(state, addr(), addr(), &[]))
    }

    pub fn start_on(state: &Path, control: String, moves: String) -> Host {
        Self::start_with(state, control, moves, &[])
    }

    /// With more `ferry host` arguments.
    pub fn start_with(state: &Path, control: String, moves: String, extra: &[&str]) -> Host {
        Self::try_start(state, control, moves, extra)
            .unwrap_or_else(|log| panic!("ferry host did not start; its log:\n{log}"))
    }

    fn try_start(
        state: &Path,
        control: String,
        moves: String,
        extra: &[&str],
    ) -> Result<Host, String> {
        let child = spawn_and_wait(
            Command::new(FERRY)
                .args(["host", "--state-dir"])
                .arg(state)
                .args(["--control", &control, "--move-listen", &moves])
                // Where the test guest's kernel and initramfs are.
                .arg("--image-dir")
                .arg(guest_dir())
                // Often, so that every test's moves run beside a measurement.
                .args(["--memory-sample-every", "2"])
                .args(extra)
                .env("FERRY_LOG", "info,ferry_forwarder=debug"),
            &format!("http://{control}/v1/vms"),
            "ferry host",
            &state.with_extension("log"),
        )?;
        Ok(Host {
            child,
            state: state.into(),
            control,
            moves,
        })
    }

    /// The last `n` lines of the daemon's log, for a failure's message.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(self.state.with_extension("log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    pub fn vm(&self, args: &[&str]) -> std::process::Output {
        let mut a = vec!["vm", "--host", &self.control];
        a.extend_from_slice(args);
        ferry(&a)
    }

    /// `ferry vm ARGS` fails and its error says `says`.
    pub fn vm_refused(&self, args: &[&str], says: &str) {
        let out = self.vm(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "ferry vm {args:?} should fail saying {says:?}: {err}"
        );
    }

    pub fn vm_ok(&self, args: &[&str]) -> String {
        let out = self.vm(args);
        assert!(
            out.status.success(),
            "ferry vm {args:?}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn list(&self) -> Vec<Value> {
        serde_json::from_str::<Value>(&self.vm_ok(&["list", "--json"]))
            .unwrap()
            .as_array()
            .unwrap()
            .clone()
    }

    /// The guest's state here, or None if this host does not have it.
    pub fn state_of(&self, name: &str) -> Option<String> {
        self.list()
            .iter()
            .find(|v| v["spec"]["name"] == name)
            .map(|v| v["state"].as_str().unwrap().to_string())
    }

    pub fn serial(&self, name: &str) -> PathBuf {
        self.state.join("vms").join(name).join("serial.log")
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Stop the daemon as an operator does (SIGTERM); its exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        self.child.wait().unwrap()
    }

    /// Kill the daemon (SIGKILL) and start another on the same state and
    /// addresses; its guests' QEMUs run on meanwhile.
    pub fn restart(&mut self) {
        self.kill9();
        std::thread::sleep(Duration::from_millis(500));
        let mut next = Host::start_on(&self.state, self.control.clone(), self.moves.clone());
        std::mem::swap(&mut self.child, &mut next.child);
        // `next` now holds the dead daemon: forget it, or its drop would
        // end the guests.
        std::mem::forget(next);
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.kill9();
        // The guests outlive their daemon by design; tests end them.
        for v in std::fs::read_dir(self.state.join("vms"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if let Ok(pid) = std::fs::read_to_string(v.path().join("qemu.pid")) {
                let _ = Command::new("kill").args(["-9", pid.trim()]).status();
            }
        }
        // And any QEMU of this host a failed test left without a pid file
        // in a guest directory (its command line names the state
        // directory: its serial log and pid file live there).
        let _ = Command::new("pkill")
            .arg("-9")
            .arg("-f")
            .arg(format!("qemu-system.*{}/", self.state.display()))
            .status();
    }
}

/// A process killed when the test ends, however it ends (a panicking
/// test must not leave a controller moving guests behind it).
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `ferry control run` with its state in `state`, its API on `listen`, and
/// `args` after those (cadence, inventory, `--paused`); killed when the
/// handle is dropped.
pub fn start_controller(state: &Path, listen: &str, args: &[&OsStr]) -> KillOnDrop {
    KillOnDrop(
        Command::new(FERRY)
            .args(["control", "run", "--state-dir"])
            .arg(state)
            .args(["--listen", listen])
            .args(args)
            .env("FERRY_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

pub fn trust(a: &Path, b: &Path) {
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    ok(&["certs", "show", "--pool", a]);
    ok(&["certs", "show", "--pool", b]);
    ok(&["certs", "trust", &format!("{b}/tls/cert.pem"), "--pool", a]);
    ok(&["certs", "trust", &format!("{a}/tls/cert.pem"), "--pool", b]);
}

/// A volume holding an empty ext4 file system.
pub fn ext4_volume(st: &Storage, dir: &Path, name: &str) {
    let img = dir.join(format!("{name}.img"));
    let f = std::fs::File::create(&img).unwrap();
    f.set_len(64 << 20).unwrap();
    let s = Command::new("mke2fs")
        .args(["-q", "-t", "ext4", "-F"])
        .arg(&img)
        .status()
        .unwrap();
    assert!(s.success());
    ok(&[
        "volume", "create", name, "--size", "64M", "--admin", &st.admin,
    ]);
    ok(&[
        "volume",
        "import",
        name,
        img.to_str().unwrap(),
        "--admin",
        &st.admin,
    ]);
}

/// The acks on a serial log: `(n, uptime)` of every complete line.
pub fn acks(serial: &Path) -> Vec<(u64, String)> {
    let text = std::fs::read_to_string(serial).unwrap_or_default();
    let complete = match text.rfind('\n') {
        Some(i) => &text[..i],
        None => "",
    };
    complete
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            match (it.next(), it.next(), it.next(), it.next()) {
                (Some("ack"), Some(n), Some(up), None) => Some((n.parse().ok()?, up.to_string())),
                _ => None,
            }
        })
        .collect()
}

pub fn boots(serial: &Path) -> usize {
    std::fs::read_to_string(serial)
        .unwrap_or_default()
        .matches("ferry-guest: boot")
        .count()
}

/// Wait until the guest has acknowledged `more` records past what it had.
pub fn wait_acks(serial: &Path, more: u64) -> u64 {
    let start = acks(serial).last().map_or(0, |a| a.0);
    let t = Instant::now();
    loop {
        let last = acks(serial).last().map_or(0, |a| a.0);
        if last >= start + more {
            return last;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "guest stopped acknowledging at {last} ({})",
            serial.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Start the guest on `host` with its disk `volume` on `st`.
pub fn create_guest(host: &Host, st: &Storage, name: &str, volume: &str, heavy: bool) {
    let (k, i) = guest_files().unwrap();
    let disk = format!("{volume}@{}@{}", st.nbd, st.admin);
    let cmdline = if heavy {
        "console=ttyS0 quiet ferry.load=heavy"
    } else {
        "console=ttyS0 quiet"
    };
    host.vm_ok(&[
        "create",
        name,
        "--memory",
        "128M",
        "--disk",
        &disk,
        "--kernel",
        k.to_str().unwrap(),
        "--initrd",
        i.to_str().unwrap(),
        "--cmdline",
        cmdline,
        "--accel",
        "tcg",
    ]);
    wait_acks(&host.serial(name), 20);
}

/// Every ack in `serials` names a record on the volume, intact; returns
/// how many records were checked.
pub fn check_records(st: &Storage, volume: &str, dir: &Path, serials: &[PathBuf]) -> usize {
    let out = dir.join(format!("{volume}-check.img"));
    ok(&[
        "volume",
        "export",
        volume,
        out.to_str().unwrap(),
        "--admin",
        &st.admin,
    ]);
    // The guest never unmounted: replay its journal on the copy first, as
    // a recovering system would (debugfs alone reads around the journal).
    let fsck = Command::new("e2fsck")
        .args(["-fy"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        fsck.status.code().is_some_and(|c| c <= 1),
        "e2fsck: {}",
        String::from_utf8_lossy(&fsck.stdout)
    );
    let o = Command::new("debugfs")
        .args(["-R", "cat /records"])
        .arg(&out)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("rec 1 "),
        "no records in the exported volume: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let mut records = std::collections::BTreeMap::new();
    for l in text.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if let ["rec", n, up, sum] = f.as_slice() {
            let n: u64 = n.parse().unwrap();
            // The checksum covers "N UPTIME\n".
            let mut md5 = Command::new("md5sum")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            use std::io::Write;
            md5.stdin
                .take()
                .unwrap()
                .write_all(format!("{n} {up}\n").as_bytes())
                .unwrap();
            let got = String::from_utf8(md5.wait_with_output().unwrap().stdout).unwrap();
            assert!(got.starts_with(sum), "record {n} corrupt: {l}");
            records.insert(n, up.to_string());
        }
    }
    let mut checked = 0;
    for s in serials {
        for (n, up) in acks(s) {
            assert_eq!(
                records.get(&n),
                Some(&up),
                "acknowledged record {n} (uptime {up}) missing from the volume ({} records there)",
                records.len()
            );
            checked += 1;
        }
    }
    assert!(checked > 0);
    checked
}

/// The counter went on across a move: no reboot at the destination, and
/// it picked up where the source stopped.
pub fn check_continued(from: &Path, to: &Path) {
    assert_eq!(boots(to), 0, "the guest booted again at the destination");
    let last_src = acks(from).last().unwrap().0;
    let first_dst = acks(to).first().expect("no acks at the destination").0;
    assert!(
        first_dst > 1 && first_dst <= last_src + 2,
        "counter did not go on: source ended at {last_src}, destination began at {first_dst}"
    );
}

pub fn migrate(host: &Host, args: &[&str]) -> (bool, Value) {
    let mut a = vec!["migrate"];
    a.extend_from_slice(args);
    a.push("--json");
    let out = host.vm(&a);
    let text = String::from_utf8_lossy(&out.stdout);
    let r: Value = serde_json::from_str(&text).unwrap_or_else(|_| {
        panic!(
            "no report: {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.success(), r)
}

/// Two sites joined by toxiproxy (10 ms each way: 20 ms RTT, and a
/// bandwidth cap), for the hosts' move link and the storage link.
pub struct Sites {
    pub _dir: tempfile::TempDir,
    pub dir: PathBuf,
    pub tp: toxiproxy::Toxiproxy,
    pub sa: Storage,
    pub sb: Storage,
    pub ha: Host,
    pub hb: Host,
    /// The WAN addresses of B's move listener and B's storage migration
    /// listener (toxiproxy names "hosts" and "storage").
    pub hb_wan: String,
    pub sb_wan: String,
}

impl Sites {
    /// An inventory of site "home" (host A; storage A, which the other
    /// site reaches at `nbd_a_wan`) with `home_cpus` CPUs, and site
    /// "cloud" (host B, storage B) with 8, 20 ms apart.
    pub fn home_cloud_inventory(&self, nbd_a_wan: &str, home_cpus: f64) -> Value {
        serde_json::json!({
            "sites": [
                {"name": "home", "cpu_capacity": home_cpus,
                 "hosts": [{"control": self.ha.control, "moves": self.ha.moves}],
                 "storage": [{"nbd": nbd_a_wan, "nbd_local": self.sa.nbd, "migrate": self.sa.mig,
                              "admin": self.sa.admin}]},
                {"name": "cloud", "cpu_capacity": 8,
                 "hosts": [{"control": self.hb.control, "moves": self.hb_wan}],
                 "storage": [{"nbd": self.sb.nbd, "migrate": self.sb_wan, "admin": self.sb.admin}]}],
            "links": [{"a": "home", "b": "cloud", "rtt_ms": 20, "bandwidth": 12.5e6}]})
    }
}

pub fn two_sites(kbytes_per_s: u64) -> Sites {
    two_sites_with(kbytes_per_s, &[], &[])
}

/// The same, each site's storage daemon started with more arguments
/// (its volumes on a Ceph cluster: `--ceph-conf ...`).
pub fn two_sites_with(kbytes_per_s: u64, extra_a: &[String], extra_b: &[String]) -> Sites {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().to_path_buf();
    let sa = Storage::start_with(&p.join("sa"), addr(), addr(), addr(), extra_a);
    let sb = Storage::start_with(&p.join("sb"), addr(), addr(), addr(), extra_b);
    trust(&sa.pool, &sb.pool);
    std::fs::create_dir_all(p.join("ha")).unwrap();
    std::fs::create_dir_all(p.join("hb")).unwrap();
    trust(&p.join("ha"), &p.join("hb"));
    let ha = Host::start(&p.join("ha"));
    let hb = Host::start(&p.join("hb"));
    let tp = toxiproxy::Toxiproxy::start();
    let hb_wan = tp.proxy("hosts", &hb.moves);
    let sb_wan = tp.proxy("storage", &sb.mig);
    for proxy in ["hosts", "storage"] {
        tp.add_latency(proxy, 10);
        tp.add_toxic(
            proxy,
            "bw",
            "bandwidth",
            "upstream",
            serde_json::json!({"rate": kbytes_per_s}),
        );
    }
    Sites {
        dir: p,
        _dir: dir,
        tp,
        sa,
        sb,
        ha,
        hb,
        hb_wan,
        sb_wan,
    }
}

/// The serial log a host kept of a guest that moved away (the latest).
pub fn archived_serial(host: &Host, name: &str) -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(host.state.join("moved"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&format!("{name}.")))
        })
        .collect();
    dirs.sort_by_key(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok());
    dirs.pop().expect("no archived guest").join("serial.log")
}

/// Start `ferry vm migrate --json` on `host` in the background.
pub fn migrate_child(host: &Host, args: &[&str]) -> Child {
    Command::new(FERRY)
        .args(["vm", "--host", &host.control, "migrate"])
        .args(args)
        .arg("--json")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Wait until the host's only running move is copying memory, and a
/// little more of it is done.
pub fn wait_memory_copy(host: &Host) {
    let t = Instant::now();
    loop {
        let moves: Value = ureq::get(&format!("http://{}/v1/vm-moves", host.control))
            .call()
            .unwrap()
            .into_json()
            .unwrap();
        let copying = moves
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["phase"] == "memory_precopy");
        if copying {
            std::thread::sleep(Duration::from_millis(1500));
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no memory copy: {moves}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The failed move's report; the guest runs at `at` only, and goes on.
pub fn check_aborted(child: Child, at: &Host, not_at: &Host, says: &str) {
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "the move should have failed: {text}");
    let r: Value = serde_json::from_str(&text)
        .unwrap_or_else(|_| panic!("{text}\n{}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(r["result"], "aborted", "{r}");
    let reason = r["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains(says),
        "reason {reason:?} should say {says:?}"
    );
    assert_eq!(at.state_of("g1").as_deref(), Some("running"));
    let t = Instant::now();
    while not_at.state_of("g1").is_some() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the destination kept the guest"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let serial = at.serial("g1");
    wait_acks(&serial, 10);
    assert_eq!(boots(&serial), 1);
}
