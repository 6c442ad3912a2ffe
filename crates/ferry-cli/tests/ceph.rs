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
    let c = testing::cluster(0);
    let name = testing::unique(tag).replace('-', "_");
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
    (c, name)
}

impl Gateway {
    fn start(dir: &Path, ceph: &ferry_rbd::ClusterConfig, pool: &str, extra: &[&str]) -> Gateway {
        let nbd = format!("127.0.0.1:{}", free_port());
        let admin = format!("127.0.0.1:{}", free_port());
        let mut cmd = Command::new(FERRY);
        cmd.args(["serve", "--pool"])
            .arg(dir)
            .args(["--nbd", &nbd, "--admin", &admin, "--ceph-conf"])
            .arg(&ceph.conf)
            .args(["--ceph-pool", pool]);
        if let Some(k) = &ceph.keyring {
            cmd.arg("--ceph-keyring").arg(k);
        }
        let log = std::fs::File::create(dir.with_extension("log")).unwrap();
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
