//! Volumes on Ceph RBD, in real clusters started for the test (see
//! `ferry_rbd::testing`): real clients through NBD, holes, zeroes, resize,
//! restart, delete; a file and an RBD volume side by side; refusals; and
//! live migration between two clusters that sends only what B lacks.
// Test fixtures: sizes, offsets and byte patterns the test itself chooses.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

mod common;
#[path = "common/toxiproxy.rs"]
#[allow(dead_code)]
mod toxiproxy;

use common::{have, run, trust_each_other, wait_report, TestServer};
use ferry_migration_engine::source::{start, MigrateRequest};
use ferry_migration_engine::{MigrationResult, MigrationRun, Report};
use ferry_rbd::testing;
use ferry_server::config::{CephConfig, Config};
use ferry_storage::{Backing, CreateOptions};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// The `[storage.ceph]` section for test cluster `which`, in a pool made
/// for this test alone (so tests running at once see only their images).
fn ceph(which: usize, pool: &str) -> CephConfig {
    make_pool(&testing::cluster(which), pool);
    ceph_existing(which, pool)
}

fn make_pool(c: &ferry_rbd::ClusterConfig, pool: &str) {
    let conf = c.conf.display().to_string();
    run(Command::new("ceph").args(["-c", &conf, "osd", "pool", "create", pool, "8", "8"]));
    run(Command::new("rbd").args(["-c", &conf, "pool", "init", pool]));
}

fn images(which: usize, pool: &str) -> Vec<String> {
    ferry_rbd::Cluster::connect(&testing::cluster(which), 30)
        .unwrap()
        .pool(pool)
        .unwrap()
        .list()
        .unwrap()
}

fn on_ceph(pool: &Path, ceph: CephConfig, migration: bool) -> TestServer {
    TestServer::start_with(pool, move |c: &mut Config| {
        c.storage.ceph = Some(ceph);
        if migration {
            c.migration.listen = "127.0.0.1:0".into();
        }
    })
}

/// Deterministic pseudo-random bytes.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn pool_name(tag: &str) -> String {
    testing::unique(tag).replace('-', "_")
}

#[test]
fn a_volume_on_ceph_serves_real_clients_and_keeps_its_data_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("gw");
    let pool = pool_name("serve");
    let srv = on_ceph(&p, ceph(0, &pool), false);
    let v = srv.create("disk", 64 * MIB);
    assert_eq!(
        v.meta().backing,
        Backing::Rbd {
            pool: pool.clone(),
            image: "disk".into()
        }
    );
    assert!(v.on_ceph());
    assert_eq!(images(0, &pool), vec!["disk".to_string()]);

    // A real client writes through NBD; the same writes go to a local file.
    let local = dir.path().join("expect.raw");
    run(Command::new("qemu-img").args([
        "create",
        "-f",
        "raw",
        &local.display().to_string(),
        "64M",
    ]));
    let ops =
        "write -P 0x11 0 1M\nwrite -P 0x22 20M 4k\nwrite -z 20M 512\nwrite -P 0x33 63M 1M\nflush";
    for target in [srv.uri("disk"), local.display().to_string()] {
        let mut cmd = Command::new("qemu-io");
        cmd.args(["-f", "raw"]);
        for op in ops.lines() {
            cmd.args(["-c", op]);
        }
        run(cmd.arg(&target));
    }
    run(Command::new("qemu-img").args([
        "compare",
        "-f",
        "raw",
        "-F",
        "raw",
        &srv.uri("disk"),
        &local.display().to_string(),
    ]));
    // The allocation map comes from the cluster: the written ranges are
    // data, the rest holes (object-sized, 4 MiB).
    if have("nbdinfo") {
        let map = run(Command::new("nbdinfo").args(["--map", "--totals", &srv.uri("disk")]));
        let data_line = map
            .lines()
            .find(|l| l.contains("data"))
            .unwrap_or_else(|| panic!("{map}"));
        let data_bytes: u64 = data_line
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            (2 * MIB..=12 * MIB).contains(&data_bytes),
            "allocated {data_bytes}: {map}"
        );
    }
    assert!(v.allocated_bytes() >= 2 * MIB && v.allocated_bytes() <= 12 * MIB);
    let ext = v.extents(0, 64 * MIB, 100).unwrap();
    assert!(
        ext.iter().any(|e| e.hole) && ext.iter().any(|e| !e.hole),
        "{ext:?}"
    );

    // Resize grows the image.
    v.resize(96 * MIB, false).unwrap();
    let img_size = ferry_rbd::Cluster::connect(&testing::cluster(0), 30)
        .unwrap()
        .pool(&pool)
        .unwrap()
        .open("disk", true)
        .unwrap()
        .size()
        .unwrap();
    assert_eq!(img_size, 96 * MIB);
    v.write_at(90 * MIB, &[0x44; 4096], true).unwrap();
    drop(v);

    // Stopped and started again (another gateway process, same pool dir):
    // everything acknowledged is there.
    srv.stop();
    let srv = on_ceph(&p, ceph_existing(0, &pool), false);
    let v = srv.state.pool.get("disk").unwrap();
    assert_eq!(v.size(), 96 * MIB);
    let mut b = vec![0u8; 4096];
    v.read_at(90 * MIB, &mut b).unwrap();
    assert_eq!(b, vec![0x44; 4096]);
    v.read_at(0, &mut b).unwrap();
    assert_eq!(b, vec![0x11; 4096]);
    v.read_at(20 * MIB, &mut b).unwrap();
    assert!(b[..512].iter().all(|&x| x == 0) && b[512..].iter().all(|&x| x == 0x22));
    drop(v);

    // Deleted: the image goes with it.
    srv.state.pool.delete("disk", false).unwrap();
    assert!(images(0, &pool).is_empty());
}

/// The section for a pool made already.
fn ceph_existing(which: usize, pool: &str) -> CephConfig {
    let c = testing::cluster(which);
    CephConfig {
        conf: c.conf,
        keyring: c.keyring.unwrap_or_default(),
        client: c.client,
        pool: pool.into(),
        ..CephConfig::default()
    }
}

#[test]
fn file_and_ceph_volumes_live_side_by_side_and_bad_requests_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pool = pool_name("side");
    let mut cfg = ceph(0, &pool);
    cfg.default = false;
    let srv = on_ceph(&dir.path().join("gw"), cfg, false);
    let file = srv.create("file-vol", 8 * MIB);
    assert_eq!(file.meta().backing, Backing::Sparse);
    let rbd = srv
        .state
        .pool
        .create(
            "rbd-vol",
            &CreateOptions {
                size: 8 * MIB,
                on_ceph: Some(true),
                ..Default::default()
            },
        )
        .unwrap();
    assert!(rbd.on_ceph() && !file.on_ceph());
    assert_eq!(images(0, &pool), vec!["rbd-vol".to_string()]);
    // Preallocation and external files do not apply to Ceph.
    for bad in [
        CreateOptions {
            size: 8 * MIB,
            on_ceph: Some(true),
            preallocate: true,
            ..Default::default()
        },
        CreateOptions {
            size: 8 * MIB,
            on_ceph: Some(true),
            external: Some(dir.path().join("x")),
            ..Default::default()
        },
    ] {
        let e = srv.state.pool.create("bad", &bad).unwrap_err();
        assert!(matches!(e, ferry_storage::StorageError::Invalid(_)), "{e}");
    }
    // An image of that name made by someone else is not taken over.
    let cl = ferry_rbd::Cluster::connect(&testing::cluster(0), 30).unwrap();
    cl.pool(&pool).unwrap().create("theirs", MIB).unwrap();
    let e = srv
        .state
        .pool
        .create(
            "theirs",
            &CreateOptions {
                size: 8 * MIB,
                on_ceph: Some(true),
                ..Default::default()
            },
        )
        .unwrap_err();
    assert!(e.to_string().contains("already exists"), "{e}");
    assert!(images(0, &pool).contains(&"theirs".to_string()));
    assert!(srv.state.pool.get("theirs").is_err());

    // While the gateway serves rbd-vol, another client cannot write it;
    // a reader may look and changes nothing.
    match cl.pool(&pool).unwrap().open("rbd-vol", false) {
        Err(ferry_rbd::RbdError::Locked { .. }) => {}
        other => panic!("a second writer was let in: {other:?}"),
    }
    rbd.write_at(0, &[9; 4096], true).unwrap();
    let reader = cl.pool(&pool).unwrap().open("rbd-vol", true).unwrap();
    let mut b = [0u8; 4096];
    reader.read_at(&mut b, 0).unwrap();
    assert_eq!(b, [9; 4096]);
    drop(reader);
    rbd.write_at(4096, &[8; 4096], true).unwrap();
    drop((rbd, file));
    srv.stop();

    // The image held by another writer when the gateway starts: the volume
    // is not served (no second writer), the rest of the pool is.
    let held = cl.pool(&pool).unwrap().open("rbd-vol", false).unwrap();
    let srv = on_ceph(&dir.path().join("gw"), ceph_existing(0, &pool), false);
    assert!(srv.state.pool.get("rbd-vol").is_err());
    assert!(srv.state.pool.get("file-vol").is_ok());
    drop(held);
    srv.stop();

    // A pool that does not exist: the daemon refuses to start, naming it.
    let mut missing = ceph_existing(0, "no_such_pool");
    missing.connect_timeout_secs = 10;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let e = rt
        .block_on(ferry_server::Daemon::bind(Config {
            pool: dir.path().join("gw2"),
            storage: ferry_server::config::StorageConfig {
                ceph: Some(missing),
                ..Default::default()
            },
            ..Default::default()
        }))
        .err()
        .expect("a missing Ceph pool is refused");
    assert!(e.to_string().contains("no_such_pool"), "{e}");
    // No Ceph configured: asking for it is refused.
    let plain = TestServer::start(&dir.path().join("plain"));
    let e = plain
        .state
        .pool
        .create(
            "x",
            &CreateOptions {
                size: MIB,
                on_ceph: Some(true),
                ..Default::default()
            },
        )
        .unwrap_err();
    assert!(e.to_string().contains("storage.ceph"), "{e}");
}

fn migrate(src: &TestServer, volume: &str, to: &TestServer) -> Report {
    let req = MigrateRequest {
        volume: volume.into(),
        to: to.migration.unwrap().to_string(),
        ..MigrateRequest::default()
    };
    let run: Arc<MigrationRun> = {
        let _g = src.rt().enter();
        start(src.state.clone(), req).unwrap().run().clone()
    };
    wait_report(&run, Duration::from_secs(180))
}

#[test]
fn a_volume_moves_live_between_two_clusters_sending_only_what_b_lacks_and_comes_back() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    let pool = pool_name("move");
    let src = on_ceph(&pa, ceph(0, &pool), true);
    let dst = on_ceph(&pb, ceph(1, &pool), true);
    trust_each_other(&pa, &pb);

    // Cluster B holds a base image (a template); the volume at A is that
    // base plus data of its own.
    let base = noise(24 * MIB as usize, 7);
    let extra = noise(8 * MIB as usize, 99);
    let b = dst.create("base", 64 * MIB);
    b.write_at(0, &base, false).unwrap();
    ferry_server::indexer::rebuild_volume(&dst.state.index, &b).unwrap();
    let v = src.create("vm", 64 * MIB);
    v.write_at(0, &base, false).unwrap();
    v.write_at(40 * MIB, &extra, false).unwrap();
    // One block inside the template's range differs: the run of blocks
    // read in order around it keeps its neighbours, it crosses the link.
    let odd = noise(4096, 1234);
    v.write_at(5 * MIB + 8192, &odd, false).unwrap();
    let wwn = v.meta().wwn;

    let r = migrate(&src, "vm", &dst);
    assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
    assert!(r.digest.matches && r.tls);
    let (base_chunks, extra_chunks) = (24 * MIB / 4096, 8 * MIB / 4096);
    assert_eq!(r.chunks.local, base_chunks - 1, "{:?}", r.chunks);
    assert_eq!(r.chunks.sent, extra_chunks + 1, "{:?}", r.chunks);
    assert!(r.bytes.wire_tx < 10 * MIB, "{:?}", r.bytes);
    // The copy is an RBD image in cluster B, whole, with the identity.
    let copy = dst.state.pool.get("vm").unwrap();
    assert!(copy.on_ceph() && copy.incoming().is_none());
    assert_eq!(copy.meta().wwn, wwn);
    assert!(images(1, &pool).contains(&"vm".to_string()));
    let mut got = vec![0u8; 8 * MIB as usize];
    copy.read_at(40 * MIB, &mut got).unwrap();
    assert!(got == extra);
    let mut first = vec![0u8; 24 * MIB as usize];
    copy.read_at(0, &mut first).unwrap();
    let mut want = base.clone();
    want[(5 * MIB + 8192) as usize..(5 * MIB + 12288) as usize].copy_from_slice(&odd);
    assert!(first == want);
    // Nothing served at two sites.
    assert!(v.write_at(0, b"x", false).is_err());

    // Written at B, then home again: only what changed crosses back.
    copy.write_at(MIB, &noise(MIB as usize, 5), false).unwrap();
    drop(copy);
    let back = migrate(&dst, "vm", &src);
    assert_eq!(back.result, MigrationResult::Switched, "{back:?}");
    assert!(back.chunks.sent <= 2 * MIB / 4096, "{:?}", back.chunks);
    assert!(back.bytes.wire_tx < 4 * MIB, "{:?}", back.bytes);
    let home = src.state.pool.get("vm").unwrap();
    let mut b1 = vec![0u8; MIB as usize];
    home.read_at(MIB, &mut b1).unwrap();
    assert!(b1 == noise(MIB as usize, 5));
    home.read_at(40 * MIB, &mut got).unwrap();
    assert!(got == extra);
}

#[test]
fn a_file_volume_moves_onto_ceph() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    let pool = pool_name("fromfile");
    let src = TestServer::start_with(&pa, |c| c.migration.listen = "127.0.0.1:0".into());
    let dst = on_ceph(&pb, ceph(1, &pool), true);
    trust_each_other(&pa, &pb);
    let v = src.create("vm", 32 * MIB);
    v.write_at(3 * MIB, &noise(5 * MIB as usize, 11), false)
        .unwrap();
    let r = migrate(&src, "vm", &dst);
    assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
    let copy = dst.state.pool.get("vm").unwrap();
    assert!(copy.on_ceph());
    let src_path = v.data_path().display().to_string();
    run(Command::new("qemu-img").args([
        "compare",
        "-f",
        "raw",
        "-F",
        "raw",
        &src_path,
        &dst.uri("vm"),
    ]));
}

fn shared(mut c: CephConfig) -> CephConfig {
    c.shared = true;
    c
}

/// A gateway killed while making a shared volume leaves an image under a
/// temporary name, never under the volume's: the name stays free, no
/// listing shows the debris (even one that got as far as its metadata),
/// and a gateway's background look removes it once it is ten minutes
/// old, leaving one that is being made now (and images whose names ferry
/// does not give) alone.
#[test]
fn a_crash_while_making_a_shared_volume_takes_neither_its_name_nor_space_for_long() {
    let dir = tempfile::tempdir().unwrap();
    let pool = pool_name("making");
    let c = shared(ceph(0, &pool));
    let rbd = ferry_rbd::Cluster::connect(&testing::cluster(0), 30)
        .unwrap()
        .pool(&pool)
        .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    // What a maker of "vm" killed an hour ago left, and an image another
    // gateway is making now.
    let old = format!(".new-vm-{}-0badcafe", now - 3600);
    let fresh = format!(".new-other-{now}-0fee1234");
    rbd.create(&old, 4 * MIB).unwrap();
    rbd.create(&fresh, 4 * MIB).unwrap();
    // Not a name ferry gives: someone else's, never removed.
    rbd.create(".new-theirs", 4 * MIB).unwrap();
    let gw = TestServer::start_with(&dir.path().join("gw"), move |cfg: &mut Config| {
        cfg.storage.ceph = Some(c);
        cfg.index.shared_scan_secs = 1;
    });
    let v = gw.create("vm", 16 * MIB);
    assert!(v.shared());
    v.write_at(0, &noise(4096, 3), true).unwrap();
    // The one being made has got as far as its metadata.
    let meta = rbd
        .open("vm", true)
        .unwrap()
        .metadata_get(ferry_storage::shared::META_KEY)
        .unwrap()
        .unwrap();
    rbd.open_unlocked(&fresh)
        .unwrap()
        .metadata_set(
            ferry_storage::shared::META_KEY,
            &meta.replace("\"vm\"", "\"other\""),
        )
        .unwrap();
    let t0 = std::time::Instant::now();
    while images(0, &pool).contains(&old) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the old half-made image was never removed: {:?}",
            images(0, &pool)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut left = images(0, &pool);
    left.sort();
    let mut want = vec![".new-theirs".to_string(), fresh.clone(), "vm".to_string()];
    want.sort();
    assert_eq!(left, want);
    let listed: serde_json::Value = ureq::get(&format!("http://{}/v1/volumes", gw.admin))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    let names: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(names, ["vm"], "{listed}");
    // A name that is taken is still refused.
    assert!(matches!(
        gw.state.pool.create(
            "vm",
            &CreateOptions {
                size: 16 * MIB,
                ..CreateOptions::default()
            }
        ),
        Err(ferry_storage::StorageError::Exists(_))
    ));
    drop(v);
    gw.stop();
}

#[test]
fn a_move_into_a_cluster_of_shared_gateways_takes_what_any_of_them_holds() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb1, pb2) = (
        dir.path().join("a"),
        dir.path().join("b1"),
        dir.path().join("b2"),
    );
    let pool = pool_name("gwmove");
    let src = on_ceph(&pa, ceph(0, &pool), true);
    let cb = shared(ceph(1, &pool));
    let b1 = TestServer::start_with(&pb1, move |c: &mut Config| {
        c.storage.ceph = Some(cb);
        c.migration.listen = "127.0.0.1:0".into();
        c.index.shared_scan_secs = 1;
    });
    let b2 = on_ceph(&pb2, shared(ceph_existing(1, &pool)), false);
    trust_each_other(&pa, &pb1);

    // The template is written through gateway b2, which keeps holding it.
    let base = noise(16 * MIB as usize, 7);
    let t = b2.create("base", 32 * MIB);
    t.write_at(0, &base, false).unwrap();
    t.flush().unwrap();
    // b1 cannot serve it while b2 does, but its index covers it: b1 looks
    // for the cluster's volumes its index lacks and scans them where they
    // are (and a rebuild of everything reads every one of them).
    match b1.state.pool.get("base") {
        Err(ferry_storage::StorageError::HeldElsewhere { holder, .. }) => {
            assert_eq!(holder, b2.nbd.to_string());
        }
        other => panic!("{other:?}"),
    }
    let t0 = std::time::Instant::now();
    while !b1.state.index.contains("base") {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "b1 never indexed base"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let rebuilt: serde_json::Value = ureq::post(&format!("http://{}/v1/index/rebuild", b1.admin))
        .send_json(serde_json::json!({}))
        .unwrap()
        .into_json()
        .unwrap();
    assert!(rebuilt.to_string().contains("\"base\""), "{rebuilt}");

    let v = src.create("vm", 32 * MIB);
    v.write_at(0, &base, false).unwrap();
    let extra = noise(4 * MIB as usize, 99);
    v.write_at(20 * MIB, &extra, false).unwrap();
    let r = migrate(&src, "vm", &b1);
    assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
    assert!(r.digest.matches);
    assert_eq!(r.chunks.local, 16 * MIB / 4096, "{:?}", r.chunks);
    assert_eq!(r.chunks.sent, 4 * MIB / 4096, "{:?}", r.chunks);

    // The copy is a shared volume held by b1; b2 sends its clients there.
    let copy = b1.state.pool.get("vm").unwrap();
    assert!(copy.shared() && copy.incoming().is_none());
    let mut got = vec![0u8; 16 * MIB as usize];
    copy.read_at(0, &mut got).unwrap();
    assert!(got == base);
    match b2.state.pool.get("vm") {
        Err(ferry_storage::StorageError::HeldElsewhere { holder, .. }) => {
            assert_eq!(holder, b1.nbd.to_string());
        }
        other => panic!("{other:?}"),
    }
    assert!(!pb1.join("volumes/vm").exists());
    drop((t, copy));
    b2.stop();
    b1.stop();
}

#[test]
fn a_move_to_shared_gateways_resumes_after_a_cut_link() {
    assert!(
        have("toxiproxy-server"),
        "the test command installs toxiproxy"
    );
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    let pool = pool_name("cut");
    let src = on_ceph(&pa, ceph(0, &pool), true);
    let dst = on_ceph(&pb, shared(ceph(1, &pool)), true);
    trust_each_other(&pa, &pb);
    let data = noise(32 * MIB as usize, 21);
    let v = src.create("vm", 64 * MIB);
    v.write_at(0, &data, false).unwrap();
    let tp = toxiproxy::Toxiproxy::start();
    let to = tp.proxy("mig", &dst.migration.unwrap().to_string());
    // 16 MB/s, so the cut lands mid-transfer.
    tp.add_toxic(
        "mig",
        "slow",
        "bandwidth",
        "upstream",
        serde_json::json!({"rate": 16_000}),
    );
    let req = MigrateRequest {
        volume: "vm".into(),
        to,
        compress: false,
        ..MigrateRequest::default()
    };
    let run: Arc<MigrationRun> = {
        let _g = src.rt().enter();
        start(src.state.clone(), req).unwrap().run().clone()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while dst.state.pool.get("vm").map_or(0, |c| c.allocated_bytes()) < 8 * MIB {
        assert!(std::time::Instant::now() < deadline, "{:?}", run.status());
        std::thread::sleep(Duration::from_millis(20));
    }
    tp.cut_until_retried("mig", &run, deadline);
    std::thread::sleep(Duration::from_millis(300));
    tp.remove_toxic("mig", "cut");
    let r = wait_report(&run, Duration::from_secs(180));
    assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
    assert!(r.attempts >= 2 && r.chunks.resumed > 0, "{r:?}");
    assert!(r.chunks.sent < 32 * MIB / 4096, "{:?}", r.chunks);
    let copy = dst.state.pool.get("vm").unwrap();
    assert!(copy.shared());
    let mut got = vec![0u8; 32 * MIB as usize];
    copy.read_at(0, &mut got).unwrap();
    assert!(got == data);
    drop(copy);
    dst.stop();
}
