//! `ferry serve` in front of a real Ceph cluster, as an operator runs it:
//! volumes created on RBD from the command line, served over NBD and
//! iSCSI to QEMU's clients, and a gateway killed with `kill -9` and
//! started again at once: every acknowledged write is there, and the lock
//! the dead process left is broken (and that process fenced) instead of
//! waited out.

#[path = "../../ferry-server/tests/common/toxiproxy.rs"]
#[allow(dead_code)]
mod toxiproxy;

mod common;
mod guests;

use common::{free_port, have, sh, trust_each_other, Ns, Serve, FERRY};
use ferry_rbd::testing;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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

/// The `ferry serve` arguments that put its volumes in `pool` of `ceph`.
fn ceph_args(ceph: &ferry_rbd::ClusterConfig, pool: &str) -> Vec<String> {
    let mut a = vec![
        "--ceph-conf".to_string(),
        ceph.conf.display().to_string(),
        "--ceph-pool".to_string(),
        pool.to_string(),
    ];
    if let Some(k) = &ceph.keyring {
        a.push("--ceph-keyring".into());
        a.push(k.display().to_string());
    }
    a
}

/// A gateway: `ferry serve` on `ceph`'s `pool`, on `addrs` (NBD, admin)
/// or fresh ports, with `extra` arguments.
fn gateway(
    dir: &Path,
    ceph: &ferry_rbd::ClusterConfig,
    pool: &str,
    addrs: Option<(&str, &str)>,
    extra: &[&str],
) -> Serve {
    let mut args = ceph_args(ceph, pool);
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match addrs {
        Some((nbd, admin)) => Serve::start_on(dir, nbd, admin, &args),
        None => {
            let nbd = format!("127.0.0.1:{}", free_port());
            let admin = format!("127.0.0.1:{}", free_port());
            Serve::start_on(dir, &nbd, &admin, &args)
        }
    }
}

/// What `ceph osd blocklist ls` says: the clients the cluster fenced.
fn blocklist(ceph: &ferry_rbd::ClusterConfig) -> String {
    let bl = Command::new("ceph")
        .arg("-c")
        .arg(&ceph.conf)
        .args(["osd", "blocklist", "ls"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&bl.stdout).to_string() + &String::from_utf8_lossy(&bl.stderr)
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
    let g = gateway(&dir, &ceph, &pool, None, &[]);
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
    let g = gateway(&dir, &ceph, &pool, None, &[]);
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
    let listed = blocklist(&ceph);
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
    let g = gateway(
        &d.path().join("gw"),
        &ceph,
        &pool,
        None,
        &["--iscsi", &portal],
    );
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
    let src = gateway(&pa, &ca, &name, None, &[]);
    let dst = gateway(
        &pb,
        &cb,
        &name,
        Some((&nbd_b, &admin_b)),
        &["--migrate", &mig],
    );
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
    let dst = gateway(
        &pb,
        &cb,
        &name,
        Some((&nbd_b, &admin_b)),
        &["--migrate", &mig],
    );
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

/// `ferry ARGS` against the admin API at `admin`: (success, stdout+stderr).
fn ferry_at(admin: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(FERRY)
        .args(args)
        .env("FERRY_ADMIN", admin)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// The image metadata keys of `pool/image`.
fn image_meta(ceph: &ferry_rbd::ClusterConfig, pool: &str, image: &str) -> String {
    let o = Command::new("rbd")
        .arg("-c")
        .arg(&ceph.conf)
        .args(["image-meta", "list", &format!("{pool}/{image}")])
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Whether a TCP listener answers at `addr`.
fn answers(addr: &str) -> bool {
    std::net::TcpStream::connect(addr).is_ok()
}

/// The forwarder of a VM host for one volume, knowing both gateways.
struct Forwarder {
    child: std::process::Child,
    addr: String,
}

impl Forwarder {
    fn start(server: &str, volume: &str, gateways: &str) -> Forwarder {
        let addr = format!("127.0.0.1:{}", free_port());
        let child = Command::new(FERRY)
            .args(["host", "--server", server, "--volume", volume])
            .args(["--listen", &addr, "--gateways", gateways])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let t = Instant::now();
        while !answers(&addr) {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "ferry host did not listen"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Forwarder { child, addr }
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn shared_gateways_serve_a_volume_one_at_a_time_and_stand_in_for_a_dead_one() {
    assert!(have("qemu-io"));
    let d = tempfile::tempdir().unwrap();
    let (ceph, pool) = pool("shared");
    let (nbd1, adm1) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let (portal1, portal2) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let g1 = gateway(
        &d.path().join("g1"),
        &ceph,
        &pool,
        Some((&nbd1, &adm1)),
        &["--ceph-shared", "--iscsi", &portal1],
    );
    let g2 = gateway(
        &d.path().join("g2"),
        &ceph,
        &pool,
        None,
        &["--ceph-shared", "--iscsi", &portal2],
    );
    g1.ferry(&["volume", "create", "s", "--size", "64M"]);
    g1.ferry(&["bitmap", "add", "s", "b", "--persistent"]);
    // Nothing of the volume is on the gateway's disk: its state is in the
    // cluster, with the image.
    assert!(!d.path().join("g1/volumes/s").exists());
    let keys = image_meta(&ceph, &pool, "s");
    assert!(
        keys.contains("ferry.meta") && keys.contains("ferry.holder"),
        "{keys}"
    );

    let gws = format!("{nbd1},{}", g2.nbd);
    let fwd = Forwarder::start(&nbd1, "s", &gws);
    let uri = format!("nbd://{}/s", fwd.addr);
    let (ok, text) = qemu_io(
        &uri,
        false,
        &["write -P 0x61 0 64k", "flush", "write -P 0x62 1M 64k"],
    );
    assert!(ok, "{text}");
    // One writer: while g1 holds it, g2 sends its clients to g1.
    let (ok, text) = ferry_at(&g2.admin, &["volume", "info", "s"]);
    assert!(!ok && text.contains(&nbd1), "{text}");
    let (ok, text) = qemu_io(&format!("nbd://{}/s", g2.nbd), true, &["read 0 4k"]);
    assert!(!ok && text.contains(&nbd1), "{text}");
    // An initiator logging in at g2 is redirected to g1's portal.
    let (ok, text) = qemu_io(
        &format!("iscsi://{portal2}/iqn.2026-11.io.ferry:s/0"),
        true,
        &["read -P 0x61 0 64k"],
    );
    assert!(ok, "{text}");

    // g1 dies under its client: the forwarder goes to g2, which breaks the
    // dead gateway's lock (fencing it) and serves the volume with every
    // acknowledged write.
    g1.kill9();
    let (ok, text) = qemu_io(
        &uri,
        false,
        &[
            "read -P 0x61 0 64k",
            "read -P 0x62 1M 64k",
            "write -P 0x63 2M 4k",
        ],
    );
    assert!(ok, "{text}");
    let show = g2.ferry(&["volume", "info", "s"]);
    assert!(show.contains("rbd"), "{show}");
    // g1 did not release it: g2 cannot know what its last writes were, so
    // the persistent bitmap reads all dirty.
    let b: serde_json::Value = serde_json::from_str(&g2.ferry(&["bitmap", "list", "s"])).unwrap();
    assert_eq!(b[0]["dirty_bytes"], 64 << 20);
    let listed = blocklist(&ceph);
    assert!(listed.contains("127.0.0.1"), "{listed}");

    // g1 comes back at its address: g2 holds the volume now, so g1 sends
    // clients there instead of taking it back.
    let g1 = gateway(
        &d.path().join("g1"),
        &ceph,
        &pool,
        Some((&nbd1, &adm1)),
        &["--ceph-shared", "--iscsi", &portal1],
    );
    let (ok, text) = ferry_at(&g1.admin, &["volume", "info", "s"]);
    assert!(!ok && text.contains(&g2.nbd), "{text}");
    // Every gateway lists every volume of the cluster and who serves it.
    let list = g1.ferry(&["volume", "list"]);
    assert!(
        list.contains(&format!("served by the gateway at {}", g2.nbd)),
        "{list}"
    );
    let l: serde_json::Value =
        serde_json::from_str(&g2.ferry(&["volume", "list", "--json"])).unwrap();
    assert_eq!(l[0]["held_here"], true, "{l}");
    assert_eq!(l[0]["gateway"], g2.nbd.as_str(), "{l}");

    // The client goes: g2 releases the volume (state saved, lock let go)
    // and g1 takes it without breaking anything.
    drop(fwd);
    let t = Instant::now();
    while image_meta(&ceph, &pool, "s").contains("ferry.holder") {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "g2 never released the volume"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let (ok, text) = qemu_io(
        &format!("nbd://{}/s", g1.nbd),
        false,
        &[
            "read -P 0x61 0 64k",
            "read -P 0x62 1M 64k",
            "read -P 0x63 2M 4k",
        ],
    );
    assert!(ok, "{text}");
    g1.ferry(&["volume", "delete", "s"]);
    assert!(!image_meta(&ceph, &pool, "s").contains("ferry.meta"));
    g2.terminate();
    g1.terminate();
}

#[test]
fn a_guest_writes_on_when_its_gateway_is_killed() {
    if guests::guest_files().is_none() {
        return;
    }
    let _one = guests::ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let d = tempfile::tempdir().unwrap();
    let (ceph, pool) = pool("guest");
    let mut extra = ceph_args(&ceph, &pool);
    extra.push("--ceph-shared".into());
    let a = guests::addr;
    // A third daemon, on a file pool, that the disk moves to at the end.
    let pools = ["g1", "g2", "s3"].map(|n| d.path().join(n));
    for p in &pools[..2] {
        guests::trust(p, &pools[2]);
    }
    let mut g1 = guests::Storage::start_with(&pools[0], a(), a(), a(), &extra);
    let g2 = guests::Storage::start_with(&pools[1], a(), a(), a(), &extra);
    guests::ext4_volume(&g1, d.path(), "root");
    let gws = format!("{}@{},{}@{}", g1.nbd, g1.admin, g2.nbd, g2.admin);
    let host = guests::Host::start_with(&d.path().join("h"), a(), a(), &["--gateways", &gws]);
    guests::create_guest(&host, &g1, "g", "root", false);
    let serial = host.serial("g");
    let before = guests::acks(&serial).last().unwrap().0;

    // The gateway under the running guest dies; the host's forwarder
    // takes the guest's requests to the other gateway, which claims the
    // volume from the dead one. The guest sees no error and goes on.
    g1.kill9();
    let after = guests::wait_acks(&serial, 30);
    assert!(after > before);
    let acks = guests::acks(&serial);
    let uptime = |s: &str| s.parse::<f64>().unwrap_or(0.0);
    let gap = acks
        .windows(2)
        .filter(|w| w[1].0 > before)
        .map(|w| uptime(&w[1].1) - uptime(&w[0].1))
        .fold(0.0, f64::max);
    eprintln!("longest gap between acks after the kill: {gap:.2} s of guest time");
    let info: serde_json::Value =
        serde_json::from_str(&host.vm_ok(&["show", "g", "--json"])).unwrap();
    let text = info.to_string();
    assert!(
        text.contains(&g2.nbd),
        "the disk is served by g2 now: {text}"
    );
    assert!(
        !std::fs::read_to_string(&serial)
            .unwrap()
            .contains("I/O error"),
        "the guest saw an I/O error"
    );

    // The guest's spec still names g1 (its forwarder found g2 by itself):
    // a move of its disk starts at g2's admin API instead, which the
    // host knows from --gateways, and the guest writes on afterwards.
    let s3 = guests::Storage::start(&pools[2]);
    let (done, r) = guests::migrate(&host, &["g", "--to-storage", &s3.mig]);
    assert!(done && r["result"] == "completed", "{r}");
    assert!(r.to_string().contains("stands in"), "{r}");
    let moved = guests::wait_acks(&serial, 10);
    host.vm_ok(&["stop", "g"]);
    let n = guests::check_records(&s3, "root", d.path(), &[serial]);
    assert!(n as u64 >= moved);
}

#[test]
fn a_guest_on_ceph_teleports_to_another_cluster_and_keeps_every_record() {
    if guests::guest_files().is_none() {
        return;
    }
    let _one = guests::ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let name = testing::unique("tele").replace('-', "_");
    let (ca, cb) = (pool_in(0, &name), pool_in(1, &name));
    let mut extra_b = ceph_args(&cb, &name);
    extra_b.push("--ceph-shared".into());
    // 100 Mbit/s, 20 ms RTT between the sites.
    let s = guests::two_sites_with(12_500, &ceph_args(&ca, &name), &extra_b);
    guests::ext4_volume(&s.sa, &s.dir, "root");
    guests::create_guest(&s.ha, &s.sa, "g1", "root", false);
    let (done, r) = guests::migrate(
        &s.ha,
        &[
            "g1",
            "--to-host",
            &s.hb_wan,
            "--with-disk",
            "--to-storage",
            &s.sb_wan,
        ],
    );
    assert!(done, "{r}");
    assert_eq!(r["kind"], "teleport");
    assert_eq!(r["result"], "completed");
    let first = guests::archived_serial(&s.ha, "g1");
    let second = s.hb.serial("g1");
    guests::wait_acks(&second, 20);
    guests::check_continued(&first, &second);
    // The disk is an RBD image of cluster B now, held by its gateway.
    let info: serde_json::Value =
        serde_json::from_str(&ferry_at(&s.sb.admin, &["volume", "info", "root"]).1).unwrap();
    assert_eq!(info["backing"]["kind"], "rbd", "{info}");
    assert_eq!(info["held_here"], true, "{info}");
    s.hb.vm_ok(&["stop", "g1"]);
    guests::check_records(&s.sb, "root", &s.dir, &[first, second]);
}

/// A host's network namespace, joined to this one by a veth pair whose
/// near end carries the gateways' addresses `near` and whose far end
/// `far`; deleted (with its end of the pair) when dropped.
fn host_net(near: &[&str], far: &str) -> Ns {
    let id = std::process::id() % 100_000;
    let (a, b) = (format!("fpa{id}"), format!("fpb{id}"));
    // One a killed run left behind keeps its near end, and with it the
    // gateways' addresses, alive while its processes run.
    let listed = sh(Command::new("ip").args(["netns", "list"]));
    for old in listed
        .split_whitespace()
        .filter(|w| w.starts_with("ferry-part-"))
    {
        Ns(old.to_string()).remove();
    }
    let net = Ns::new(format!("ferry-part-{id}"));
    sh(Command::new("ip").args([
        "link", "add", &a, "type", "veth", "peer", "name", &b, "netns", &net.0,
    ]));
    for addr in near {
        sh(Command::new("ip").args(["addr", "add", &format!("{addr}/24"), "dev", &a]));
    }
    sh(Command::new("ip").args(["link", "set", &a, "up"]));
    net.ip(&["addr", "add", &format!("{far}/24"), "dev", &b]);
    net.ip(&["link", "set", &b, "up"]);
    net
}

/// Whether something listens at `port` of namespace `ns`'s loopback.
fn answers_in(ns: &Ns, port: u16) -> bool {
    ns.exec("bash")
        .args(["-c", &format!("exec 3<>/dev/tcp/127.0.0.1/{port}")])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A gateway that stays alive but that the host can no longer reach (a
/// partition between the two, not a crash): the host's forwarder goes to
/// the other gateway, the cut-off gateway finds its client gone (TCP
/// keepalive) and lets the volume go, and the other claims it; the
/// guest's writes stop for seconds, not for the forwarder's two-minute
/// hold, and none fails. Needs root (a network namespace for the host).
#[test]
fn a_gateway_cut_off_from_its_host_lets_the_volume_go_to_another() {
    assert!(have("qemu-io") && have("ip"));
    let mut d = tempfile::tempdir().unwrap();
    if std::env::var_os("FERRY_TEST_KEEP").is_some() {
        d.disable_cleanup(true);
        eprintln!("keeping {}", d.path().display());
    }
    let (ceph, pool) = pool("partition");
    let (g1_ip, g2_ip, host_ip) = ("10.77.0.1", "10.77.0.2", "10.77.0.10");
    let net = host_net(&[g1_ip, g2_ip], host_ip);
    let nbd1 = format!("{g1_ip}:{}", free_port());
    let nbd2 = format!("{g2_ip}:{}", free_port());
    let adm1 = format!("127.0.0.1:{}", free_port());
    let adm2 = format!("127.0.0.1:{}", free_port());
    let g1 = gateway(
        &d.path().join("g1"),
        &ceph,
        &pool,
        Some((&nbd1, &adm1)),
        &["--ceph-shared"],
    );
    let g2 = gateway(
        &d.path().join("g2"),
        &ceph,
        &pool,
        Some((&nbd2, &adm2)),
        &["--ceph-shared"],
    );
    g1.ferry(&["volume", "create", "s", "--size", "64M"]);

    // The host's forwarder and the guest's client, in the host's namespace.
    let port = free_port();
    let mut fwd = net
        .exec(FERRY)
        .args(["host", "--server", &nbd1, "--volume", "s"])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--gateways", &format!("{nbd1},{nbd2}")])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(d.path().join("forwarder.log")).unwrap())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !answers_in(&net, port) {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "ferry host did not listen"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The guest's client: a write and a flush, a pause during which the
    // partition comes, then more writes and reads on the same connection.
    let io_err = d.path().join("qemu-io.err");
    let mut io = net
        .exec("stdbuf")
        // A line at a time: the test follows qemu-io's answers as they come.
        .args(["-oL", "qemu-io", "-f", "raw"])
        .arg(format!("nbd://127.0.0.1:{port}/s"))
        .args([
            "-c",
            "write -P 0x61 0 64k",
            "-c",
            "flush",
            "-c",
            "sleep 5000",
        ])
        .args(["-c", "write -P 0x62 1M 64k", "-c", "flush"])
        .args(["-c", "read -P 0x61 0 64k", "-c", "read -P 0x62 1M 64k"])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&io_err).unwrap())
        .spawn()
        .unwrap();
    let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let (out, l) = (io.stdout.take().unwrap(), lines.clone());
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            l.lock().unwrap().push(line);
        }
    });
    let t = Instant::now();
    while !lines
        .lock()
        .unwrap()
        .iter()
        .any(|l| l.contains("wrote 65536"))
    {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the first write did not end: {:?}",
            lines.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (ok, text) = ferry_at(&g2.admin, &["volume", "info", "s"]);
    assert!(!ok && text.contains(&nbd1), "g1 holds the volume: {text}");

    // The partition: nothing between the host and g1 any more, either
    // way; g1 itself runs on and g2 still reaches it.
    net.ip(&["route", "add", "blackhole", &format!("{g1_ip}/32")]);
    let cut = Instant::now();
    // Well within the forwarder's hold (120 s, then errors).
    let status = loop {
        if let Some(s) = io.try_wait().unwrap() {
            break s;
        }
        if cut.elapsed() > Duration::from_secs(100) {
            let _ = io.kill();
            panic!(
                "the client's requests did not end in 100 s: {:?}",
                lines.lock().unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let took = cut.elapsed();
    reader.join().unwrap();
    let err = std::fs::read_to_string(&io_err).unwrap_or_default();
    let text = lines.lock().unwrap().join("\n");
    assert!(
        status.success()
            && text.matches("wrote 65536").count() == 2
            && text.matches("read 65536").count() == 2
            && !text.contains("failed")
            && err.is_empty(),
        "{text}\n{err}"
    );
    // g2 serves it now; g1 let it go when it found its client gone,
    // instead of keeping it for a connection no one will use again.
    let l: serde_json::Value =
        serde_json::from_str(&g2.ferry(&["volume", "list", "--json"])).unwrap();
    assert_eq!(l[0]["held_here"], true, "{l}");
    assert!(answers(&g1.admin), "g1 is alive");
    eprintln!("the client's requests went on {took:?} after the partition");
    let _ = fwd.kill();
    let _ = fwd.wait();
    g2.terminate();
    g1.terminate();
}

/// An interface of the test's own, one end of a veth pair (both removed
/// when dropped).
struct SiteLink(String);

impl SiteLink {
    /// Link `n` of this test process (tests run side by side).
    fn new(n: u32) -> SiteLink {
        let name = format!("fsp{}x{n}", std::process::id() % 100_000);
        let peer = format!("{name}p");
        let _ = Command::new("ip")
            .args(["link", "del", &name])
            .stderr(Stdio::null())
            .status();
        sh(Command::new("ip").args(["link", "add", &name, "type", "veth", "peer", "name", &peer]));
        for n in [&name, &peer] {
            sh(Command::new("ip").args(["link", "set", n, "up"]));
        }
        SiteLink(name)
    }
}

impl Drop for SiteLink {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", &self.0]).status();
    }
}

/// Gateway log `path` from byte `from` on, once that part says `needle`
/// (polled every 100 ms); what it says instead after `limit` is the error.
fn wait_for_log(path: &Path, from: usize, needle: &str, limit: Duration) -> Result<String, String> {
    let t = Instant::now();
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let tail = text.get(from..).unwrap_or_default();
        if tail.contains(needle) {
            return Ok(tail.to_string());
        }
        if t.elapsed() > limit {
            return Err(format!("no {needle:?} in {limit:?}; the log says: {tail}"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Which of the gateways' logs says it holds the site portal (waits).
fn site_portal_holder(logs: &[&Path], addr: &str) -> usize {
    let t = Instant::now();
    loop {
        let holding: Vec<usize> = logs
            .iter()
            .enumerate()
            .filter(|(_, l)| {
                let text = std::fs::read_to_string(l).unwrap_or_default();
                let taken = text.rfind("this gateway holds the site portal");
                let given = text.rfind("site portal given back");
                taken.is_some() && given.is_none_or(|g| Some(g) < taken)
            })
            .map(|(i, _)| i)
            .collect();
        if holding.len() == 1 && std::net::TcpStream::connect(addr).is_ok() {
            return holding[0];
        }
        assert!(
            holding.len() <= 1,
            "two gateways hold the site portal: {holding:?}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no gateway took the site portal"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Gateways of one site taking turns at a site portal on a link of the
/// test's own, initiators logging in with CHAP.
struct SiteRig {
    dir: tempfile::TempDir,
    ceph: ferry_rbd::ClusterConfig,
    pool: String,
    link: SiteLink,
    /// The site portal, `IP:PORT`.
    site: String,
}

impl SiteRig {
    fn new(tag: &str) -> SiteRig {
        assert!(have("qemu-io") && have("ip"));
        let mut dir = tempfile::tempdir().unwrap();
        if std::env::var_os("FERRY_TEST_KEEP").is_some() {
            dir.disable_cleanup(true);
            eprintln!("keeping {}", dir.path().display());
        }
        let (ceph, pool) = pool(tag);
        // Rigs of one process differ in link and address.
        static RIGS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = RIGS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let site = format!(
            "10.213.{}.{}:{}",
            std::process::id() % 250 + 1,
            (std::process::id() + n * 37) % 200 + 20,
            free_port()
        );
        std::fs::write(
            dir.path().join("iscsi.toml"),
            "[iscsi]\nchap_user = \"site\"\nchap_secret = \"site-portal-secret\"\n",
        )
        .unwrap();
        SiteRig {
            dir,
            ceph,
            pool,
            link: SiteLink::new(n),
            site,
        }
    }

    /// Gateway `name`, taking part in the site portal; its log is
    /// [`SiteRig::log`]`(name)`.
    fn gateway(&self, name: &str) -> Serve {
        let portal = format!("127.0.0.1:{}", free_port());
        let cfg = self.dir.path().join("iscsi.toml");
        gateway(
            &self.dir.path().join(name),
            &self.ceph,
            &self.pool,
            None,
            &[
                "--ceph-shared",
                "--config",
                cfg.to_str().unwrap(),
                "--iscsi",
                &portal,
                "--iscsi-site-portal",
                &self.site,
                "--iscsi-site-device",
                &self.link.0,
            ],
        )
    }

    fn log(&self, name: &str) -> std::path::PathBuf {
        self.dir.path().join(format!("{name}.log"))
    }

    /// Volume `name`'s LUN at the site portal.
    fn url(&self, volume: &str) -> String {
        format!(
            "iscsi://site%site-portal-secret@{}/iqn.2026-11.io.ferry:{volume}/0",
            self.site
        )
    }

    /// qemu-io at volume `s` through the site portal: a write and a flush,
    /// a pause of `pause_ms` (when the test breaks the holder), then a
    /// read of it, another write, a flush and its read. qemu-io's times
    /// for the read after the pause are the initiator's stall.
    fn initiator_across_a_fault(&self, pause_ms: u32) -> std::process::Child {
        Command::new("qemu-io")
            .args(["-f", "raw", &self.url("s")])
            .args(["-c", "write -P 0x61 0 64k", "-c", "flush"])
            .args(["-c", &format!("sleep {pause_ms}")])
            .args(["-c", "read -P 0x61 0 64k", "-c", "write -P 0x62 1M 64k"])
            .args(["-c", "flush", "-c", "read -P 0x62 1M 64k"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// Once the initiator has logged in (the volume has a holder).
    fn wait_for_login(&self) {
        let t = Instant::now();
        while !image_meta(&self.ceph, &self.pool, "s").contains("ferry.holder") {
            assert!(t.elapsed() < Duration::from_secs(20), "nobody logged in");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// What qemu-io said, once it ends (within `limit`), and whether it
/// ended well with every read as written.
fn initiator_result(
    mut io: std::process::Child,
    limit: Duration,
    since: Instant,
) -> (bool, String) {
    while io.try_wait().unwrap().is_none() {
        if since.elapsed() > limit {
            let _ = io.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = io.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!(
        "qemu-io went on {:.1} s after the fault: {text}",
        since.elapsed().as_secs_f64()
    );
    let ok =
        out.status.success() && !text.contains("verification failed") && !text.contains("error");
    (ok, text)
}

/// Initiators are given the site's portal, not a gateway's: the gateway
/// answering it is killed under an initiator's I/O, another takes the
/// address when the dead one's lease runs out, and the initiator,
/// reconnecting to the address it knows, logs in there and finds every
/// acknowledged write. A gateway started while another holds the portal
/// stands by; the holder stopped cleanly hands it over at once.
#[test]
fn an_initiator_at_the_site_portal_follows_it_to_another_gateway() {
    let rig = SiteRig::new("siteportal");
    let site = &rig.site;
    let mut gws = [Some(rig.gateway("g1")), Some(rig.gateway("g2"))];
    let logs = [rig.log("g1"), rig.log("g2")];
    let log_refs = [logs[0].as_path(), logs[1].as_path()];
    let holder = site_portal_holder(&log_refs, site);
    let other = 1 - holder;
    let addr_shown = sh(Command::new("ip").args(["-o", "addr", "show", "dev", &rig.link.0]));
    let ip = site.rsplit_once(':').unwrap().0;
    assert!(addr_shown.contains(ip), "{addr_shown}");
    // It told the link's neighbours (a gratuitous ARP went out).
    let said = std::fs::read_to_string(&logs[holder]).unwrap();
    assert!(!said.contains("could not announce"), "{said}");
    gws[0]
        .as_ref()
        .unwrap()
        .ferry(&["volume", "create", "s", "--size", "64M"]);

    // Its gateway is killed while the initiator waits, so the read meets
    // the dead portal and waits for the address to come back.
    let io = rig.initiator_across_a_fault(3000);
    rig.wait_for_login();
    std::thread::sleep(Duration::from_millis(1500));
    let killed_at = Instant::now();
    gws[holder].take().unwrap().kill9();
    let (ok, text) = initiator_result(io, Duration::from_secs(120), killed_at);
    assert!(ok, "{text}");
    assert_eq!(site_portal_holder(&[log_refs[other]], site), 0);
    // It did not wait for the dead holder's lease to run out: it found the
    // holder's NBD listener gone, fenced it and broke the lease.
    let said = std::fs::read_to_string(&logs[other]).unwrap();
    assert!(
        said.contains("the site portal's holder does not answer"),
        "{said}"
    );

    // A gateway started while another holds the portal stands by.
    let third = rig.gateway("g3");
    let third_log = rig.log("g3");
    let standby = "another gateway holds the site portal";
    if let Err(e) = wait_for_log(&third_log, 0, standby, Duration::from_secs(20)) {
        panic!("it never stood by: {e}");
    }
    // The holder stops cleanly: it gives the portal back and the other
    // takes it at its next try, with the volume.
    gws[other].take().unwrap().terminate();
    let t = Instant::now();
    assert_eq!(site_portal_holder(&[third_log.as_path()], site), 0);
    let handed_over = t.elapsed();
    assert!(
        handed_over < Duration::from_secs(5),
        "a clean stop handed the portal over only after {handed_over:?}"
    );
    let (ok, text) = qemu_io(
        &rig.url("s"),
        true,
        &["read -P 0x61 0 64k", "read -P 0x62 1M 64k"],
    );
    assert!(ok, "{text}");
    third.terminate();
}

/// The site portal's holder cut off from the cluster and the other
/// gateways while its initiator still reaches it (a partition, not a
/// crash): the standby finds it does not answer, fences it and takes the
/// lease; the holder, unable to renew, lets the address go before its
/// lease could run out, and the initiator follows the address to the
/// standby with every acknowledged write. When the cut heals, the fenced
/// gateway does not take the portal back: it starts again in the same
/// process as a new client and stands by. Fenced again within a minute,
/// it waits longer before rejoining, and a stop meanwhile stops it.
#[test]
fn a_site_portal_holder_cut_off_from_the_cluster_lets_the_address_go() {
    let rig = SiteRig::new("portalcut");
    let gws = [rig.gateway("g1"), rig.gateway("g2")];
    let logs = [rig.log("g1"), rig.log("g2")];
    let holder = site_portal_holder(&[logs[0].as_path(), logs[1].as_path()], &rig.site);
    let other = 1 - holder;
    gws[0].ferry(&["volume", "create", "s", "--size", "64M"]);

    let io = rig.initiator_across_a_fault(3000);
    rig.wait_for_login();
    std::thread::sleep(Duration::from_millis(1500));
    let cut_at = Instant::now();
    let cut = Partition::cut(gws[holder].child.id());
    let (ok, text) = initiator_result(io, Duration::from_secs(120), cut_at);
    assert!(ok, "{text}");
    assert_eq!(site_portal_holder(&[logs[other].as_path()], &rig.site), 0);
    let said = std::fs::read_to_string(&logs[other]).unwrap();
    assert!(
        said.contains("the site portal's holder does not answer"),
        "{said}"
    );
    let said = std::fs::read_to_string(&logs[holder]).unwrap();
    assert!(said.contains("letting the address go"), "{said}");
    let gws = gws.map(|mut g| {
        assert!(g.child.try_wait().unwrap().is_none(), "a gateway died");
        g
    });

    // The cut heals: the fenced gateway, refused by the cluster at its
    // next call, stops serving instead of answering as if alive, and
    // starts again in the same process as a new client of the cluster,
    // which stands by; the portal stays with the other, with the data.
    drop(cut);
    let [g1, g2] = gws;
    let (mut cut_off, mut serving) = if holder == 0 { (g1, g2) } else { (g2, g1) };
    let rejoining = "rejoining the Ceph cluster as a new client";
    let standby = "another gateway holds the site portal";
    let mut exited = || cut_off.child.try_wait().unwrap();
    let before =
        wait_for_log(&logs[holder], 0, rejoining, Duration::from_secs(90)).unwrap_or_else(|e| {
            panic!(
                "the fenced gateway never rejoined (exited: {:?}): {e}",
                exited()
            )
        });
    let at = before.find(rejoining).unwrap_or_default();
    let fenced_at = before.find("fenced this gateway").expect("it said why");
    assert!(fenced_at < at, "{before}");
    let standing = wait_for_log(&logs[holder], at, standby, Duration::from_secs(30))
        .unwrap_or_else(|e| {
            panic!(
                "the rejoined gateway never stood by (exited: {:?}): {e}",
                exited()
            )
        });
    assert_eq!(site_portal_holder(&[logs[other].as_path()], &rig.site), 0);
    let (ok, text) = qemu_io(
        &rig.url("s"),
        true,
        &["read -P 0x61 0 64k", "read -P 0x62 1M 64k"],
    );
    assert!(ok, "{text}");
    // The rejoined gateway takes the portal over when the other dies.
    let rejoined_len = at + standing.len();
    serving.child.kill().unwrap();
    serving.child.wait().unwrap();
    if let Err(e) = wait_for_log(
        &logs[holder],
        rejoined_len,
        "this gateway holds the site portal",
        Duration::from_secs(30),
    ) {
        panic!("the rejoined gateway never took the site portal: {e}");
    }
    assert_eq!(site_portal_holder(&[logs[holder].as_path()], &rig.site), 0);
    let (ok, text) = qemu_io(
        &rig.url("s"),
        true,
        &["read -P 0x61 0 64k", "read -P 0x62 1M 64k"],
    );
    assert!(ok, "{text}");
    assert!(
        cut_off.child.try_wait().unwrap().is_none(),
        "one process throughout"
    );

    // Fenced again within a minute of its rejoin, it waits 15 s before the
    // next; a stop asked for meanwhile is a stop, not a rejoin.
    let fourth = rig.gateway("g4");
    let fourth_log = rig.log("g4");
    if let Err(e) = wait_for_log(&fourth_log, 0, standby, Duration::from_secs(20)) {
        panic!("g4 never stood by: {e}");
    }
    let mark = std::fs::read_to_string(&logs[holder]).unwrap().len();
    let cut = Partition::cut(cut_off.child.id());
    assert_eq!(site_portal_holder(&[fourth_log.as_path()], &rig.site), 0);
    drop(cut);
    let said = wait_for_log(
        &logs[holder],
        mark,
        "rejoining the Ceph cluster",
        Duration::from_secs(90),
    )
    .unwrap_or_else(|e| panic!("it was not fenced again: {e}"));
    assert!(said.contains("wait_s=15"), "{said}");
    let pid = cut_off.child.id().to_string();
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    let t = Instant::now();
    let status = loop {
        if let Some(s) = cut_off.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "a stop during the wait did not stop it"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let said = std::fs::read_to_string(&logs[holder]).unwrap();
    let after = &said[mark..][said[mark..].find("rejoining the Ceph cluster").unwrap()..];
    assert!(
        !status.success() && !after.contains("NBD listening"),
        "{status}: {after}"
    );
    fourth.terminate();
}

/// Process `pid` cut off from every loopback address (the cluster and the
/// other gateways: its packets to 127.0.0.0/8 are dropped) while the
/// site's addresses still reach it: a net_cls class of its own and an
/// nftables rule on it. Healed when dropped.
struct Partition {
    cgroup: std::path::PathBuf,
    root: std::path::PathBuf,
    table: String,
}

impl Partition {
    fn cut(pid: u32) -> Partition {
        let id = std::process::id() % 0xffff;
        // The net_cls hierarchy where the machine mounts it, else ours.
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
        let root = match mounts.lines().find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(2) == Some(&"cgroup") && f[3].split(',').any(|o| o == "net_cls"))
                .then(|| std::path::PathBuf::from(f[1]))
        }) {
            Some(root) => root,
            None => {
                let root = std::path::PathBuf::from("/run/ferry-test-net_cls");
                std::fs::create_dir_all(&root).unwrap();
                sh(Command::new("mount")
                    .args(["-t", "cgroup", "-o", "net_cls", "net_cls"])
                    .arg(&root));
                root
            }
        };
        let cgroup = root.join(format!("ferry-part-{id}"));
        let _ = std::fs::create_dir(&cgroup);
        let class = format!("0x0010{id:04x}");
        std::fs::write(cgroup.join("net_cls.classid"), &class).unwrap();
        let table = format!("ferry_part_{id}");
        let _ = Command::new("nft")
            .args(["delete", "table", "inet", &table])
            .stderr(Stdio::null())
            .status();
        sh(Command::new("nft").args(["add", "table", "inet", &table]));
        sh(Command::new("nft").args([
            "add",
            "chain",
            "inet",
            &table,
            "out",
            "{ type filter hook output priority 0; }",
        ]));
        sh(Command::new("nft")
            .args(["add", "rule", "inet", &table, "out", "meta", "cgroup"])
            .args([class.as_str(), "ip", "daddr", "127.0.0.0/8", "drop"]));
        // Every thread of the process, sockets included, joins the class.
        std::fs::write(cgroup.join("cgroup.procs"), pid.to_string()).unwrap();
        Partition {
            cgroup,
            root,
            table,
        }
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        let _ = Command::new("nft")
            .args(["delete", "table", "inet", &self.table])
            .status();
        let procs = std::fs::read_to_string(self.cgroup.join("cgroup.procs")).unwrap_or_default();
        for pid in procs.split_whitespace() {
            let _ = std::fs::write(self.root.join("cgroup.procs"), pid);
        }
        let _ = std::fs::remove_dir(&self.cgroup);
    }
}
