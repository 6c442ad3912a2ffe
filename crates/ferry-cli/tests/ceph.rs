//! `ferry serve` in front of a real Ceph cluster, as an operator runs it:
//! volumes created on RBD from the command line, served over NBD and
//! iSCSI to QEMU's clients, and a gateway killed with `kill -9` and
//! started again at once: every acknowledged write is there, and the lock
//! the dead process left is broken (and that process fenced) instead of
//! waited out.

mod common;

use common::{free_port, have};
use ferry_rbd::testing;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

struct Gateway {
    child: Child,
    nbd: String,
    admin: String,
}

/// A Ceph pool of this test's own.
fn pool(tag: &str) -> (ferry_rbd::ClusterConfig, String) {
    let name = testing::unique(tag).replace('-', "_");
    (pool_in(0, &name), name)
}

/// Pool `name` made in test cluster `which`.
fn pool_in(which: usize, name: &str) -> ferry_rbd::ClusterConfig {
    let c = testing::cluster(which);
    let conf = c.conf.display().to_string();
    for args in [
        vec![
            "ceph", "-c", &conf, "osd", "pool", "create", &name, "8", "8",
        ],
        vec!["rbd", "-c", &conf, "pool", "init", &name],
    ] {
        let o = Command::new(args[0]).args(&args[1..]).output().unwrap();
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    c
}

impl Gateway {
    fn start(dir: &Path, ceph: &ferry_rbd::ClusterConfig, pool: &str, extra: &[&str]) -> Gateway {
        let nbd = format!("127.0.0.1:{}", free_port());
        let admin = format!("127.0.0.1:{}", free_port());
        Self::start_on(dir, ceph, pool, &nbd, &admin, extra)
    }

    fn start_on(
        dir: &Path,
        ceph: &ferry_rbd::ClusterConfig,
        pool: &str,
        nbd: &str,
        admin: &str,
        extra: &[&str],
    ) -> Gateway {
        let (nbd, admin) = (nbd.to_string(), admin.to_string());
        let mut cmd = Command::new(FERRY);
        cmd.args(["serve", "--pool"])
            .arg(dir)
            .args(["--nbd", &nbd, "--admin", &admin, "--ceph-conf"])
            .arg(&ceph.conf)
            .args(["--ceph-pool", pool]);
        if let Some(k) = &ceph.keyring {
            cmd.arg("--ceph-keyring").arg(k);
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.with_extension("log"))
            .unwrap();
        let child = cmd
            .args(extra)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let t = Instant::now();
        while ureq::get(&format!("http://{admin}/v1/server"))
            .call()
            .is_err()
        {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "ferry serve did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Gateway { child, nbd, admin }
    }

    fn ferry(&self, args: &[&str]) -> String {
        let out = Command::new(FERRY)
            .args(args)
            .env("FERRY_ADMIN", &self.admin)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "ferry {args:?}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn qemu_io(target: &str, read_only: bool, ops: &[&str]) -> (bool, String) {
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw"]);
    if read_only {
        cmd.arg("-r");
    }
    cmd.arg(target);
    for op in ops {
        cmd.args(["-c", op]);
    }
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (
        out.status.success() && !text.contains("verification failed") && !text.contains("error"),
        text,
    )
}

#[test]
fn a_killed_gateway_restarts_at_once_with_every_acknowledged_write() {
    assert!(have("qemu-io"));
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("gw");
    let (ceph, pool) = pool("kill");
    let g = Gateway::start(&dir, &ceph, &pool, &[]);
    let made = g.ferry(&["volume", "create", "k", "--size", "64M"]);
    assert!(made.contains(&format!("RBD image {pool}/k")), "{made}");
    assert!(g.ferry(&["volume", "list"]).contains("rbd"));
    g.ferry(&["bitmap", "add", "k", "b", "--persistent"]);
    let uri = format!("nbd://{}/k", g.nbd);
    let (ok, text) = qemu_io(
        &uri,
        false,
        &[
            "write -f -P 0x61 0 64k",
            "write -P 0x62 1M 64k",
            "flush",
            "write -P 0x63 40M 4k",
        ],
    );
    assert!(ok, "{text}");
    g.kill9();

    // Started again on the same pool directory: the lock its predecessor
    // left is broken, the volume is served, the writes are there (also
    // the last one, acknowledged without a flush: no cache in between).
    let g = Gateway::start(&dir, &ceph, &pool, &[]);
    let list = g.ferry(&["volume", "list"]);
    assert!(
        list.contains("k "),
        "the volume is served again: {list}\n{}",
        std::fs::read_to_string(dir.with_extension("log")).unwrap_or_default()
    );
    let uri = format!("nbd://{}/k", g.nbd);
    let (ok, text) = qemu_io(
        &uri,
        true,
        &[
            "read -P 0x61 0 64k",
            "read -P 0x62 1M 64k",
            "read -P 0x63 40M 4k",
        ],
    );
    assert!(ok, "{text}");
    // It was not closed cleanly: the persistent bitmap reads all dirty.
    let b: serde_json::Value = serde_json::from_str(&g.ferry(&["bitmap", "list", "k"])).unwrap();
    assert_eq!(b[0]["dirty_bytes"], 64 << 20);
    // The dead process is fenced: the cluster lists it as blocklisted.
    let bl = Command::new("ceph")
        .arg("-c")
        .arg(&ceph.conf)
        .args(["osd", "blocklist", "ls"])
        .output()
        .unwrap();
    let listed =
        String::from_utf8_lossy(&bl.stdout).to_string() + &String::from_utf8_lossy(&bl.stderr);
    assert!(listed.contains("127.0.0.1"), "{listed}");

    // A second daemon on the same pool directory is refused.
    let out = Command::new(FERRY)
        .args(["serve", "--pool"])
        .arg(&dir)
        .args(["--nbd", "", "--admin", "", "--ceph-conf"])
        .arg(&ceph.conf)
        .args(["--ceph-pool", &pool])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("another ferry daemon"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    g.ferry(&["volume", "delete", "k"]);
    assert!(!g.ferry(&["volume", "list"]).contains(" k "));
}

#[test]
fn iscsi_initiators_read_and_write_an_rbd_volume() {
    assert!(have("qemu-io") && have("iscsi-ls"));
    let d = tempfile::tempdir().unwrap();
    let (ceph, pool) = pool("iscsi");
    let portal = format!("127.0.0.1:{}", free_port());
    let g = Gateway::start(&d.path().join("gw"), &ceph, &pool, &["--iscsi", &portal]);
    g.ferry(&["volume", "create", "lun", "--size", "32M"]);
    let url = format!("iscsi://{portal}/iqn.2026-11.io.ferry:lun/0");
    let (ok, text) = qemu_io(
        &url,
        false,
        &[
            "write -f -P 0x71 0 64k",
            "write -P 0x72 8M 128k",
            "write -z 8M 4k",
            "flush",
        ],
    );
    assert!(ok, "{text}");
    let (ok, text) = qemu_io(
        &url,
        true,
        &[
            "read -P 0x71 0 64k",
            "read -P 0 8M 4k",
            "read -P 0x72 8196k 124k",
        ],
    );
    assert!(ok, "{text}");
    // The same bytes through NBD.
    let (ok, text) = qemu_io(
        &format!("nbd://{}/lun", g.nbd),
        true,
        &["read -P 0x71 0 64k"],
    );
    assert!(ok, "{text}");
}

/// Each gateway's pool directory trusts the other's migration certificate.
fn trust_each_other(pa: &Path, pb: &Path) {
    let (pa, pb) = (pa.display().to_string(), pb.display().to_string());
    let certs = |args: &[&str]| {
        let out = Command::new(FERRY)
            .arg("certs")
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    certs(&["show", "--pool", &pa]);
    certs(&["show", "--pool", &pb]);
    certs(&["trust", &format!("{pb}/tls/cert.pem"), "--pool", &pa]);
    certs(&["trust", &format!("{pa}/tls/cert.pem"), "--pool", &pb]);
}

fn allocated(admin: &str, volume: &str) -> u64 {
    ureq::get(&format!("http://{admin}/v1/volumes/{volume}"))
        .call()
        .ok()
        .and_then(|r| r.into_json::<serde_json::Value>().ok())
        .and_then(|j| j["allocated_bytes"].as_u64())
        .unwrap_or(0)
}

/// A volume moves from cluster A to cluster B through `ferry migrate`; the
/// destination gateway is killed with -9 in the middle and started again:
/// it takes its incomplete image back (its dead predecessor's lock broken),
/// the migration resumes without resending what arrived, and the copy in
/// cluster B is the source's, byte for byte.
#[test]
fn a_migration_between_clusters_resumes_after_the_destination_gateway_is_killed() {
    assert!(have("qemu-img"));
    let d = tempfile::tempdir().unwrap();
    let name = testing::unique("mig").replace('-', "_");
    let (ca, cb) = (pool_in(0, &name), pool_in(1, &name));
    let (pa, pb) = (d.path().join("a"), d.path().join("b"));
    let mig = format!("127.0.0.1:{}", free_port());
    let (nbd_b, admin_b) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let src = Gateway::start(&pa, &ca, &name, &[]);
    let dst = Gateway::start_on(&pb, &cb, &name, &nbd_b, &admin_b, &["--migrate", &mig]);
    trust_each_other(&pa, &pb);
    let img = d.path().join("img.raw");
    let mut data = vec![0u8; 24 << 20];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for b in data.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x.to_le_bytes()[3];
    }
    std::fs::write(&img, &data).unwrap();
    src.ferry(&["volume", "create", "vm", "--size", "32M"]);
    src.ferry(&["volume", "import", "vm", img.to_str().unwrap()]);

    let migrate = Command::new(FERRY)
        .args([
            "migrate",
            "vm",
            "--to",
            &mig,
            "--bwlimit",
            "6M",
            "--no-compress",
            "--json",
        ])
        .env("FERRY_ADMIN", &src.admin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while allocated(&admin_b, "vm") < 6 << 20 {
        assert!(t.elapsed() < Duration::from_secs(90), "no progress");
        std::thread::sleep(Duration::from_millis(20));
    }
    dst.kill9();
    std::thread::sleep(Duration::from_millis(500));
    let dst = Gateway::start_on(&pb, &cb, &name, &nbd_b, &admin_b, &["--migrate", &mig]);
    let out = migrate.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(pb.with_extension("log")).unwrap_or_default()
    );
    let r: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(r["result"], "switched");
    assert!(r["attempts"].as_u64().unwrap() >= 2, "{r}");
    assert!(r["chunks"]["resumed"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(r["digest"]["matches"], true);
    // The copy is an image in cluster B with the source's bytes.
    let info: serde_json::Value =
        serde_json::from_str(&dst.ferry(&["volume", "info", "vm"])).unwrap();
    assert_eq!(info["backing"]["kind"], "rbd", "{info}");
    assert!(info.get("incoming").is_none());
    let st = Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&img)
        .arg(format!("nbd://{nbd_b}/vm"))
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stdout)
    );
    let images = ferry_rbd::Cluster::connect(&cb, 30)
        .unwrap()
        .pool(&name)
        .unwrap()
        .list()
        .unwrap();
    assert_eq!(images, vec!["vm".to_string()]);
}
