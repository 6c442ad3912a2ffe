//! The `ferry` binary as users run it: `ferry serve` as a child process,
//! volume commands, bench, and durability across `kill -9`.
// Test fixtures: sizes, offsets and byte patterns the test itself chooses.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

mod common;

use common::{free_port, have, nbd_pki, trust_each_other, Serve, FERRY};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn volume_commands_import_export_and_bench() {
    let d = tempfile::tempdir().unwrap();
    let s = Serve::start(&d.path().join("pool"));
    let img = d.path().join("img.raw");
    let mut data = vec![0u8; 3 << 20];
    for (i, b) in data.iter_mut().enumerate().skip(1 << 20) {
        *b = (i * 7 % 253) as u8;
    }
    std::fs::write(&img, &data).unwrap();
    s.ferry(&["volume", "import", "disk", img.to_str().unwrap()]);
    let info: serde_json::Value =
        serde_json::from_str(&s.ferry(&["volume", "info", "disk"])).unwrap();
    assert_eq!(info["size"], 3 << 20);
    let out = d.path().join("out.raw");
    s.ferry(&["volume", "export", "disk", out.to_str().unwrap()]);
    assert_eq!(std::fs::read(&out).unwrap(), data);
    s.ferry(&[
        "volume",
        "create",
        "two",
        "--size",
        "16M",
        "--block-size",
        "4096",
        "--preallocate",
    ]);
    let list = s.ferry(&["volume", "list"]);
    assert!(
        list.contains("disk") && list.contains("two") && list.contains("preallocated"),
        "{list}"
    );
    s.ferry(&["volume", "resize", "two", "32M"]);
    s.ferry(&[
        "bitmap",
        "add",
        "two",
        "mig",
        "--granularity",
        "64K",
        "--persistent",
    ]);
    assert!(s.ferry(&["bitmap", "list", "two"]).contains("\"mig\""));
    let report = s.ferry(&[
        "bench",
        "--nbd",
        &s.nbd,
        "--export",
        "two",
        "--profile",
        "oltp",
        "--profile",
        "dd",
        "--runtime",
        "0.5",
        "--iodepth",
        "4",
        "--connections",
        "2",
        "--json",
    ]);
    let r: serde_json::Value = serde_json::from_str(&report).unwrap();
    assert_eq!(r.as_array().unwrap().len(), 3);
    for row in r.as_array().unwrap() {
        assert!(row["ops"].as_u64().unwrap() > 0, "{row}");
    }
    // The persistent bitmap saw the bench writes and survives a clean stop.
    s.ferry(&["volume", "delete", "disk"]);
    let pool = d.path().join("pool");
    s.terminate();
    let s = Serve::start(&pool);
    let b = s.ferry(&["bitmap", "list", "two"]);
    let b: serde_json::Value = serde_json::from_str(&b).unwrap();
    assert!(b[0]["dirty_bytes"].as_u64().unwrap() > 0);
    assert!(!s.ferry(&["volume", "list"]).contains("disk"));
}

#[test]
fn bad_arguments_get_clear_errors() {
    let out = Command::new(FERRY)
        .args(["volume", "list"])
        .env("FERRY_ADMIN", "127.0.0.1:1")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("cannot reach the storage daemon's admin API"));
    let d = tempfile::tempdir().unwrap();
    let s = Serve::start(&d.path().join("pool"));
    let out = Command::new(FERRY)
        .args(["volume", "create", "x", "--size", "12Q"])
        .env("FERRY_ADMIN", &s.admin)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid size"));
    let out = Command::new(FERRY)
        .args(["volume", "info", "ghost"])
        .env("FERRY_ADMIN", &s.admin)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("404"));
}

/// FUA writes and flushed writes are acknowledged only once durable; after
/// kill -9 they are there, and persistent bitmaps (not saved since) come
/// back all dirty rather than missing a write.
#[test]
fn kill_9_keeps_acknowledged_writes() {
    if !have("qemu-io") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let pool = d.path().join("pool");
    let s = Serve::start(&pool);
    s.ferry(&["volume", "create", "k", "--size", "8M"]);
    s.ferry(&["bitmap", "add", "k", "b", "--persistent"]);
    let uri = format!("nbd://{}/k", s.nbd);
    let st = Command::new("qemu-io")
        .args([
            "-f",
            "raw",
            &uri,
            "-c",
            "write -f -P 0x61 0 64k",
            "-c",
            "write -P 0x62 1M 64k",
            "-c",
            "flush",
        ])
        .output()
        .unwrap();
    assert!(st.status.success());
    s.kill9();
    let s = Serve::start(&pool);
    let uri = format!("nbd://{}/k", s.nbd);
    let out = Command::new("qemu-io")
        .args([
            "-f",
            "raw",
            "-r",
            &uri,
            "-c",
            "read -P 0x61 0 64k",
            "-c",
            "read -P 0x62 1M 64k",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && !text.contains("verification failed"),
        "{text}"
    );
    let b: serde_json::Value = serde_json::from_str(&s.ferry(&["bitmap", "list", "k"])).unwrap();
    assert_eq!(b[0]["dirty_bytes"], 8 << 20);
}

/// The same over iSCSI (`ferry serve --iscsi`): a FUA WRITE and a write
/// followed by SYNCHRONIZE CACHE survive kill -9 of the daemon.
#[test]
fn iscsi_fua_and_sync_cache_survive_kill_9() {
    if !have("qemu-io") || !have("iscsi-ls") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let pool = d.path().join("pool");
    let portal = format!("127.0.0.1:{}", free_port());
    let nbd = format!("127.0.0.1:{}", free_port());
    let admin = format!("127.0.0.1:{}", free_port());
    let s = Serve::start_on(&pool, &nbd, &admin, &["--iscsi", &portal]);
    s.ferry(&["volume", "create", "k", "--size", "8M"]);
    let url = format!("iscsi://{portal}/iqn.2026-11.io.ferry:k/0");
    let st = Command::new("qemu-io")
        .args([
            "-f",
            "raw",
            &url,
            "-c",
            "write -f -P 0x71 0 64k",
            "-c",
            "write -P 0x72 1M 64k",
            "-c",
            "flush",
        ])
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    s.kill9();
    let s = Serve::start_on(&pool, &nbd, &admin, &["--iscsi", &portal]);
    let out = Command::new("qemu-io")
        .args([
            "-f",
            "raw",
            "-r",
            &url,
            "-c",
            "read -P 0x71 0 64k",
            "-c",
            "read -P 0x72 1M 64k",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && !text.contains("verification failed"),
        "{text}"
    );
    drop(s);
}

/// Multi-conn flush: a write acknowledged on one connection and a FLUSH
/// sent on another; after kill -9 the write is there. (ferry keeps no
/// user-space write cache; this guards that promise.)
#[test]
fn flush_on_one_connection_covers_writes_of_another() {
    let d = tempfile::tempdir().unwrap();
    let pool = d.path().join("pool");
    let s = Serve::start(&pool);
    s.ferry(&["volume", "create", "m", "--size", "4M"]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let nbd = s.nbd.clone();
    rt.block_on(async {
        let opts = ferry_client::ConnectOptions::default();
        let a = ferry_client::NbdClient::connect(&nbd, "m", &opts)
            .await
            .unwrap();
        let b = ferry_client::NbdClient::connect(&nbd, "m", &opts)
            .await
            .unwrap();
        assert!(a.export().flags & 256 != 0, "CAN_MULTI_CONN not advertised");
        a.write(8192, bytes::Bytes::from(vec![0x5c; 65536]), false)
            .await
            .unwrap();
        b.flush().await.unwrap();
    });
    s.kill9();
    let s = Serve::start(&pool);
    let nbd = s.nbd.clone();
    rt.block_on(async {
        let c = ferry_client::NbdClient::connect(&nbd, "m", &Default::default())
            .await
            .unwrap();
        let data = c.read(8192, 65536).await.unwrap();
        assert!(data.iter().all(|&x| x == 0x5c));
    });
}

/// `len` bytes of xorshift noise from `seed`, also written to `path`.
fn noise_image(path: &Path, len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed;
    let data: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    std::fs::write(path, &data).unwrap();
    data
}

/// Wait until the volume `vm` at the daemon with admin `admin` has at
/// least `bytes` allocated (a migration's copy is that far along).
fn wait_for_allocated(admin: &str, bytes: u64) {
    let t = Instant::now();
    loop {
        let v = ureq::get(&format!("http://{admin}/v1/volumes/vm")).call();
        if let Ok(r) = v {
            let j: serde_json::Value = r.into_json().unwrap();
            if j["allocated_bytes"].as_u64().unwrap_or(0) >= bytes {
                return;
            }
        }
        assert!(t.elapsed() < Duration::from_secs(60), "no progress");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `ferry migrate --json` between two `ferry serve` processes that trust
/// each other through `ferry certs`; the destination is killed with -9 in
/// the middle and restarted, and the migration resumes and completes.
#[test]
fn migrate_resumes_after_the_destination_is_killed() {
    let d = tempfile::tempdir().unwrap();
    let (pa, pb) = (d.path().join("a"), d.path().join("b"));
    let mig = format!("127.0.0.1:{}", free_port());
    let (dst_nbd, dst_admin) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let src = Serve::start(&pa);
    let dst = Serve::start_on(&pb, &dst_nbd, &dst_admin, &["--migrate", &mig]);
    trust_each_other(&pa, &pb);
    let img = d.path().join("img");
    let data = noise_image(&img, 24 << 20, 0x9e37_79b9_7f4a_7c15);
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
    // Kill the destination once part of the copy has arrived.
    wait_for_allocated(&dst_admin, 6 << 20);
    dst.kill9();
    std::thread::sleep(Duration::from_millis(500));
    let dst = Serve::start_on(&pb, &dst_nbd, &dst_admin, &["--migrate", &mig]);
    let out = migrate.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(r["result"], "switched");
    assert!(r["attempts"].as_u64().unwrap() >= 2, "{r}");
    assert!(r["chunks"]["resumed"].as_u64().unwrap() > 0, "{r}");
    assert!(
        r["bytes"]["resent_after_failures"].as_u64().unwrap() > 0,
        "{r}"
    );
    assert_eq!(r["digest"]["matches"], true);
    let got = std::fs::read(pb.join("volumes/vm/data.raw")).unwrap();
    assert_eq!(&got[..data.len()], &data[..]);
    assert!(got[data.len()..].iter().all(|&b| b == 0));
    // The volume is served by the destination now, under the same identity.
    let info: serde_json::Value =
        serde_json::from_str(&dst.ferry(&["volume", "info", "vm"])).unwrap();
    let src_info: serde_json::Value =
        serde_json::from_str(&src.ferry(&["volume", "info", "vm"])).unwrap();
    assert_eq!(info["wwn"], src_info["wwn"]);
    assert_eq!(src_info["moved_to"], dst_nbd.as_str());
    assert!(info.get("incoming").is_none());
}

/// The source daemon killed with -9 in the middle of a migration: restarted
/// on the same pool, the same `ferry migrate` command resumes under the
/// journaled migration id, and the destination keeps what it already had.
#[test]
fn migrate_resumes_after_the_source_is_killed() {
    let d = tempfile::tempdir().unwrap();
    let (pa, pb) = (d.path().join("a"), d.path().join("b"));
    let mig = format!("127.0.0.1:{}", free_port());
    let (src_nbd, src_admin) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let (dst_nbd, dst_admin) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let src = Serve::start_on(&pa, &src_nbd, &src_admin, &[]);
    let dst = Serve::start_on(&pb, &dst_nbd, &dst_admin, &["--migrate", &mig]);
    trust_each_other(&pa, &pb);
    let img = d.path().join("img");
    let data = noise_image(&img, 24 << 20, 0x2545_f491_4f6c_dd1d);
    src.ferry(&["volume", "create", "vm", "--size", "32M"]);
    src.ferry(&["volume", "import", "vm", img.to_str().unwrap()]);
    let first = Command::new(FERRY)
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
        .env("FERRY_ADMIN", &src_admin)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Kill the source once part of the copy has arrived.
    wait_for_allocated(&dst_admin, 6 << 20);
    src.kill9();
    let _ = first.wait_with_output();
    // Restarted: the volume says which migration it was in, and the same
    // command resumes it.
    let _src = Serve::start_on(&pa, &src_nbd, &src_admin, &[]);
    let meta = std::fs::read_to_string(pa.join("volumes/vm/meta.json")).unwrap();
    assert!(meta.contains("\"outgoing\""), "{meta}");
    let out = Command::new(FERRY)
        .args(["migrate", "vm", "--to", &mig, "--json"])
        .env("FERRY_ADMIN", &src_admin)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(r["result"], "switched");
    assert!(r["chunks"]["resumed"].as_u64().unwrap() >= 1024, "{r}");
    assert!(
        r["chunks"]["sent"].as_u64().unwrap() < 24 * 256,
        "only what was missing: {r}"
    );
    let got = std::fs::read(pb.join("volumes/vm/data.raw")).unwrap();
    assert_eq!(&got[..data.len()], &data[..]);
    // Switched: the journal is gone.
    let meta = std::fs::read_to_string(pa.join("volumes/vm/meta.json")).unwrap();
    assert!(!meta.contains("\"outgoing\""), "{meta}");
    drop(dst);
}

/// `ferry control plan` on a snapshot: the I/O-bound guest far from its
/// disk moves to it, the CPU-bound one stays; bad snapshots and policies
/// get clear errors. `simulate` reports every policy.
#[test]
fn control_plan_and_simulate() {
    let d = tempfile::tempdir().unwrap();
    let snap = d.path().join("cluster.json");
    let vm = |name: &str, iops: f64| {
        serde_json::json!({"name": name, "placement": {"host_site": "home", "disk_site": "cloud"},
            "memory_bytes": 256e6, "disk_bytes": 4e9,
            "load": {"iops": iops, "io_bytes": 4096, "latency_ms": 16.3, "cpu": 1.0,
                     "dirty_rate": 1e6, "write_rate": 1e5}})
    };
    let cluster = |vms: Vec<serde_json::Value>| {
        serde_json::json!({
            "sites": [{"name": "home", "cpu_capacity": 8}, {"name": "cloud", "cpu_capacity": 8}],
            "links": [{"a": "home", "b": "cloud", "rtt_ms": 16, "bandwidth": 12.5e6}],
            "vms": vms})
    };
    std::fs::write(
        &snap,
        cluster(vec![vm("db", 60.0), vm("batch", 0.2)]).to_string(),
    )
    .unwrap();
    let run = |args: &[&str]| Command::new(FERRY).args(args).output().unwrap();
    let out = run(&[
        "control",
        "plan",
        "--cluster",
        snap.to_str().unwrap(),
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ds = plan["decisions"].as_array().unwrap();
    assert_eq!(ds.len(), 1, "{plan}");
    assert_eq!(ds[0]["vm"], "db");
    assert_eq!(ds[0]["action"], "move_vm");
    assert_eq!(ds[0]["to"]["host_site"], "cloud");

    // The pre-flight estimate of a move by hand, and of staying behind
    // another RTT; what cannot be estimated says why.
    let s = snap.to_str().unwrap();
    let out = run(&[
        "control",
        "estimate",
        "db",
        "--cluster",
        s,
        "--vm-to",
        "cloud",
        "--json",
    ]);
    let e: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let cost = &e["cost"];
    assert!(
        cost["seconds"].as_f64().unwrap() > 0.0 && cost["bytes"].as_f64().unwrap() > 0.0,
        "{e}"
    );
    assert!(cost["pause_s"].as_f64().unwrap() < 0.3, "{e}");
    assert!(
        e["access_then"]["rate"].as_f64() > e["access_now"]["rate"].as_f64(),
        "{e}"
    );
    let out = run(&["control", "estimate", "db", "--cluster", s, "--rtt-ms", "2"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("ms per request now"),
        "{text}"
    );
    for (args, says) in [
        (vec!["--vm-to", "home"], "already has its VM at site home"),
        (
            vec!["--teleport-to", "cloud"],
            "already has its disk at site cloud",
        ),
        (vec!["--disk-to", "mars"], "no site mars"),
        (vec![], "give --vm-to, --disk-to or --teleport-to"),
        (vec!["--rtt-ms=-3"], "zero or more"),
    ] {
        let mut a = vec!["control", "estimate", "db", "--cluster", s];
        a.extend(args);
        let out = run(&a);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{a:?}: {err}");
    }
    let out = run(&[
        "control",
        "estimate",
        "nobody",
        "--cluster",
        s,
        "--vm-to",
        "cloud",
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("no VM nobody"));

    let mut bad = cluster(vec![vm("db", 60.0)]);
    bad["vms"][0]["placement"]["disk_site"] = "mars".into();
    std::fs::write(&snap, bad.to_string()).unwrap();
    let out = run(&["control", "plan", "--cluster", snap.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown site mars"));
    std::fs::write(&snap, cluster(vec![vm("db", -1.0)]).to_string()).unwrap();
    let out = run(&["control", "plan", "--cluster", snap.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("VM db iops"));
    std::fs::write(&snap, cluster(vec![vm("db", 60.0)]).to_string()).unwrap();
    let pol = d.path().join("policy.json");
    std::fs::write(&pol, r#"{"locality":true,"horizon_s":600,"margin":0.5,"min_gain_share":0.1,"latency_trigger_ms":0,"hold_s":0,"hysteresis":0.8,"max_moves_per_link":2,"cooldown_s":300,"paused":false}"#).unwrap();
    let out = run(&[
        "control",
        "plan",
        "--cluster",
        snap.to_str().unwrap(),
        "--policy",
        pol.to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("margin must be at least 1"));

    let out = run(&[
        "control", "simulate", "--vms", "50", "--ticks", "10", "--json",
    ]);
    assert!(out.status.success());
    let rs: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rs.as_array().unwrap().len(), 5);
    assert_eq!(rs[0]["policy"], "none");
    assert!(rs[2]["lost_s"].as_f64() < rs[0]["lost_s"].as_f64(), "{rs}");
    assert_eq!(rs[3]["policy"], "locality + bursting");
    assert!(rs[4]["drained_at_tick"].as_u64().is_some(), "{rs}");
    // Impossible numbers are refused.
    let out = run(&["control", "simulate", "--remote-share", "2"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--remote-share must be 0 to 1"));

    // Replay: both guests measured across 0.5 ms; the RTT rises to 16 ms
    // at 10 s; with a 5 ms trigger held 6 s, the I/O-bound guest slows,
    // is moved after the hold, and runs faster than before once moved;
    // the CPU-bound one stays.
    let mut calm = cluster(vec![vm("db", 1000.0), vm("batch", 0.2)]);
    calm["links"][0]["rtt_ms"] = 0.5.into();
    calm["vms"][0]["load"]["latency_ms"] = 0.9.into();
    calm["vms"][1]["load"]["latency_ms"] = 0.9.into();
    std::fs::write(&snap, calm.to_string()).unwrap();
    std::fs::write(&pol, r#"{"locality":true,"horizon_s":600,"margin":1.5,"min_gain_share":0.1,"latency_trigger_ms":5,"hold_s":6,"hysteresis":0.8,"max_moves_per_link":2,"cooldown_s":300,"paused":false}"#).unwrap();
    let (s, p) = (snap.to_str().unwrap(), pol.to_str().unwrap());
    let replay = |more: &[&str]| {
        let mut a = vec!["control", "simulate", "--replay", s, "--policy", p];
        a.extend_from_slice(&["--ticks", "20"]);
        a.extend_from_slice(more);
        run(&a)
    };
    let out = replay(&["--rtt-at", "10:home-cloud=16", "--tick-s", "2", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let moves = r["moves"].as_array().unwrap();
    assert_eq!(moves.len(), 1, "{r}");
    assert_eq!(moves[0]["vm"], "db");
    let decided = moves[0]["decided_s"].as_f64().unwrap();
    assert!((16.0..=18.0).contains(&decided), "{r}");
    let db_at = |t: f64| {
        r["ticks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["t_s"].as_f64() == Some(t))
            .and_then(|x| {
                x["guests"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|g| g["vm"] == "db")
            })
            .map(|g| g["rate_vs_snapshot"].as_f64().unwrap())
            .unwrap()
    };
    assert!(
        (db_at(8.0) - 1.0).abs() < 1e-9 && db_at(12.0) < 0.2 && db_at(38.0) > 1.0,
        "{r}"
    );
    let text =
        String::from_utf8_lossy(&replay(&["--rtt-at", "10:home-cloud=16"]).stdout).into_owned();
    assert!(
        text.contains("| 12 | db | home | cloud |") && text.contains("at 1"),
        "{text}"
    );
    for (args, says) in [
        (vec!["--rtt-at", "soon"], "SECONDS:SITE-SITE=RTT_MS"),
        (vec!["--rtt-at", "1:home-mars=3"], "mars"),
        (vec!["--tick-s", "0"], "--tick-s must be above 0"),
    ] {
        let out = replay(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{args:?}: {err}"
        );
    }
    // Acting once alone: on live sites only, journaled in a state
    // directory it holds while it runs. Sites whose host does not answer
    // leave nothing to do; the journal says a standalone cycle ran.
    let inv = d.path().join("inventory.json");
    std::fs::write(
        &inv,
        serde_json::json!({"sites": [{"name": "home", "cpu_capacity": 8,
            "hosts": [{"control": "127.0.0.1:9", "moves": "127.0.0.1:9"}],
            "storage": [{"nbd": "127.0.0.1:9", "migrate": "127.0.0.1:9", "admin": "127.0.0.1:9"}]}],
            "links": []})
        .to_string(),
    )
    .unwrap();
    let state = d.path().join("ctl");
    let apply = |extra: &[&str]| {
        let mut args = vec![
            "control",
            "plan",
            "--apply",
            "--interval",
            "100ms",
            "--inventory",
            inv.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(&args)
            .output()
            .unwrap()
    };
    let out = apply(&[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--state-dir"),
        "{err}"
    );
    let out = apply(&["--state-dir", state.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let journal = std::fs::read_to_string(state.join("journal.jsonl")).unwrap();
    assert!(
        journal.contains("plan --apply: one cycle, standalone"),
        "{journal}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["control", "plan", "--apply", "--cluster"])
        .arg(&snap)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("cannot be used with"),
        "{err}"
    );
}

/// `ferry certs nbd` makes the credentials, `ferry serve --nbd-tls-dir`
/// uses them, and QEMU and libnbd connect with them; clients without TLS,
/// without a certificate, or with one from another authority are refused,
/// and a client that speaks garbage after STARTTLS harms no one else.
#[test]
fn nbd_over_tls_with_client_certificates() {
    if !have("qemu-io") || !have("qemu-img") || !have("nbdinfo") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let pki = d.path().join("pki");
    let other = d.path().join("other");
    for (dir, client) in [(&pki, "qemu"), (&other, "stranger")] {
        nbd_pki(dir, &["localhost", "127.0.0.1"], client);
    }
    // A second run into the same directory must not overwrite the authority.
    let again = Command::new(FERRY)
        .args(["certs", "nbd", "--out"])
        .arg(&pki)
        .args(["--server-name", "localhost"])
        .output()
        .unwrap();
    assert!(!again.status.success());
    let no_cert = d.path().join("no-cert");
    std::fs::create_dir(&no_cert).unwrap();
    std::fs::copy(pki.join("ca-cert.pem"), no_cert.join("ca-cert.pem")).unwrap();

    let cfg = d.path().join("ferry.toml");
    std::fs::write(&cfg, "[nbd]\ntls_clear_loopback = false\n").unwrap();
    let port = free_port();
    let nbd = format!("127.0.0.1:{port}");
    let admin = format!("127.0.0.1:{}", free_port());
    let server_dir = pki.join("server");
    let s = Serve::start_on(
        &d.path().join("pool"),
        &nbd,
        &admin,
        &[
            "--config",
            cfg.to_str().unwrap(),
            "--nbd-tls-dir",
            server_dir.to_str().unwrap(),
            "--allow-path",
            d.path().to_str().unwrap(),
        ],
    );
    s.ferry(&["volume", "create", "v1", "--size", "16M"]);

    let client = pki.join("client-qemu");
    let creds = format!(
        "tls-creds-x509,id=tls0,dir={},endpoint=client",
        client.display()
    );
    let image = format!(
        "driver=nbd,server.type=inet,server.host=localhost,server.port={port},export=v1,tls-creds=tls0"
    );
    // qemu-io's commands over TLS on `image`, every pattern verified.
    let qemu_io_tls = |image: &str, cmds: &[&str]| {
        let mut c = Command::new("qemu-io");
        c.args(["--object", &creds, "--image-opts", image]);
        for x in cmds {
            c.args(["-c", x]);
        }
        let out = c.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && !text.contains("Pattern verification failed"),
            "qemu-io over TLS on {image}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    // QEMU writes a pattern over TLS and reads it back.
    qemu_io_tls(&image, &["write -P 0x5a 1M 2M", "read -P 0x5a 1M 2M"]);
    // qemu-img copies a file in and finds it equal.
    let src = d.path().join("src.img");
    noise_image(&src, 4 << 20, 7);
    let file = format!("driver=file,filename={}", src.display());
    for args in [
        vec![
            "convert",
            "-n",
            "-f",
            "raw",
            src.to_str().unwrap(),
            "--target-image-opts",
            &image,
        ],
        vec!["compare", "--image-opts", &file, &image],
    ] {
        let out = Command::new("qemu-img")
            .arg(args[0])
            .args(["--object", &creds])
            .args(&args[1..])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "qemu-img {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Those large READs found their pages cached (written just before):
    // they were encrypted from the mapped pages (kernels with cachestat).
    let from_file = |v: &str| {
        let m = ureq::get(&format!("http://{admin}/metrics"))
            .call()
            .unwrap()
            .into_string()
            .unwrap();
        let key = format!("ferry_nbd_reads_sent_from_file_total{{volume=\"{v}\"}} ");
        m.lines()
            .find_map(|l| l.strip_prefix(&key))
            .map_or(0, |n| n.trim().parse::<u64>().unwrap())
    };
    let osrelease = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut rel = osrelease
        .split(['.', '-'])
        .map(|x| x.parse::<u32>().unwrap_or(0));
    let cachestat = (rel.next().unwrap_or(0), rel.next().unwrap_or(0)) >= (6, 5);
    if cachestat {
        assert!(
            from_file("v1") >= 2,
            "{} TLS reads from v1's file",
            from_file("v1")
        );
    }
    // A file made a volume (outside the pool), its pages cached as it was
    // written: read over TLS from the mapped file, as the file holds it.
    let ext = d.path().join("ext.raw");
    let mut bytes = vec![0x6bu8; 4 << 20];
    bytes[2 << 20..].fill(0x7c);
    std::fs::write(&ext, &bytes).unwrap();
    s.ferry(&["volume", "create", "ext", "--path", ext.to_str().unwrap()]);
    let ext_image = image.replace("export=v1", "export=ext");
    qemu_io_tls(
        &ext_image,
        &[
            "read -P 0x6b 0 2M",
            "read -P 0x7c 2M 2M",
            "read -P 0x6b 1M 1M",
            "read -P 0x7c 2M 1M",
        ],
    );
    if cachestat {
        assert!(
            from_file("ext") >= 3,
            "{} TLS reads from ext's file",
            from_file("ext")
        );
    }

    // libnbd: with a certificate it works; without TLS, without a client
    // certificate, or with another authority's, it is refused.
    let nbdinfo = |uri: String| {
        let out = Command::new("nbdinfo").arg(&uri).output().unwrap();
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    };
    let with = |dir: &Path| {
        format!(
            "nbds://localhost:{port}/v1?tls-certificates={}",
            dir.display()
        )
    };
    let (ok, text) = nbdinfo(with(&client));
    assert!(ok && text.contains("with TLS"), "{text}");
    let (ok, text) = nbdinfo(format!("nbd://localhost:{port}/v1"));
    assert!(!ok, "a clear-text client: {text}");
    let clear = image.replace(",tls-creds=tls0", "");
    let out = Command::new("qemu-io")
        .args(["--image-opts", &clear, "-c", "read 0 512"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && text.contains("this server requires TLS"),
        "QEMU without TLS is told why: {text}"
    );
    let (ok, text) = nbdinfo(with(&no_cert));
    assert!(!ok, "a client without a certificate: {text}");
    let (ok, text) = nbdinfo(with(&other.join("client-stranger")));
    assert!(!ok, "another authority's client: {text}");

    // STARTTLS, then bytes that are not TLS: that connection ends.
    {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(&nbd).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut greeting = [0u8; 18];
        c.read_exact(&mut greeting).unwrap();
        let mut opt = 3u32.to_be_bytes().to_vec();
        opt.extend(b"IHAVEOPT");
        opt.extend(5u32.to_be_bytes());
        opt.extend(0u32.to_be_bytes());
        c.write_all(&opt).unwrap();
        let mut reply = [0u8; 20];
        c.read_exact(&mut reply).unwrap();
        assert_eq!(
            u32::from_be_bytes(reply[12..16].try_into().unwrap()),
            1,
            "STARTTLS acked"
        );
        c.write_all(b"GET / HTTP/1.0\r\n\r\n this is not a TLS client hello")
            .unwrap();
        let mut rest = Vec::new();
        let _ = c.read_to_end(&mut rest);
    }
    let (ok, text) = nbdinfo(with(&client));
    assert!(ok, "the server still serves: {text}");

    // `ferry host` reaches the server over TLS and serves the guest in
    // clear on its own loopback; without credentials it is refused.
    let upstream = format!("127.0.0.1:{port}");
    let refused = Command::new(FERRY)
        .args(["host", "--server", &upstream, "--volume", "v1"])
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .env("FERRY_LOG", "error")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && text.contains("TLS"),
        "ferry host without TLS credentials: {text}"
    );
    let hport = free_port();
    let mut host = Command::new(FERRY)
        .args(["host", "--server", &upstream, "--volume", "v1"])
        .args(["--listen", &format!("127.0.0.1:{hport}"), "--nbd-tls-dir"])
        .arg(&client)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let via_host =
        format!("driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={hport},export=v1");
    let t = Instant::now();
    let out = loop {
        let out = Command::new("qemu-io")
            .args(["--image-opts", &via_host])
            .args(["-c", "write -P 0x33 8M 1M", "-c", "read -P 0x33 8M 1M"])
            .output()
            .unwrap();
        if out.status.success() || t.elapsed() > Duration::from_secs(20) {
            break out;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let _ = host.kill();
    let _ = host.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && !text.contains("Pattern verification failed"),
        "qemu-io through ferry host: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new("qemu-io")
        .args(["--object", &creds, "--image-opts", &image])
        .args(["-c", "read -P 0x33 8M 1M"])
        .output()
        .unwrap();
    assert!(
        out.status.success()
            && !String::from_utf8_lossy(&out.stdout).contains("verification failed"),
        "the write through ferry host reached the server"
    );
    s.terminate();
}

/// `ferry vm seed`: the cloud-init seed `vm create` would attach, written
/// to a file without any daemon, for a guest run by QEMU or libvirt; bad
/// input refused with the reason.
#[test]
fn vm_seed_writes_a_nocloud_disk() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("seed.img");
    let run = |args: &[&str]| Command::new(FERRY).args(args).output().unwrap();
    let o = run(&[
        "vm",
        "seed",
        "db",
        "--out",
        out.to_str().unwrap(),
        "--mac",
        "52:54:00:00:00:07",
        "--address",
        "10.7.0.2/24,gateway=10.7.0.1",
        "--first-boot",
        "echo hi",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let img = std::fs::read(&out).unwrap();
    assert_eq!(img.len(), 1 << 20);
    // The FAT boot sector's volume label (FAT12/16 layout).
    assert_eq!(&img[43..54], b"CIDATA     ");
    let text = String::from_utf8_lossy(&img);
    assert!(text.contains("instance-id: \"db\""), "meta-data");
    assert!(
        text.contains(r#""macaddress":"52:54:00:00:00:07""#),
        "network-config"
    );
    assert!(text.contains(r#""runcmd":["echo hi"]"#), "user-data");
    for (args, says) in [
        (
            vec!["--address", "10.7.0.2/24"],
            "1 addresses for 0 network card(s)",
        ),
        (vec!["--mac", "zz", "--hostname", "x"], "six hex octets"),
        (vec![], "nothing to seed"),
        (vec!["--hostname", "a_b"], "host name \"a_b\""),
    ] {
        let mut a = vec!["vm", "seed", "db", "--out", out.to_str().unwrap()];
        a.extend(args);
        let o = run(&a);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(says), "{a:?}: {err}");
    }
}

/// Wait until the index of the daemon at `admin` keeps complete prints of
/// `volume` (its import's scan is done).
fn wait_for_prints(admin: &str, volume: &str) {
    let t = Instant::now();
    loop {
        let j: serde_json::Value = ureq::get(&format!("http://{admin}/v1/index"))
            .call()
            .unwrap()
            .into_json()
            .unwrap();
        let has = j["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["volume"] == volume && v["prints"] == true);
        if has {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "never indexed: {j}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A source prints from its index what nothing wrote since it was hashed,
/// without reading it: across a clean restart it still does (the written
/// blocks' marks were saved), and after kill -9 it trusts none of those
/// prints (its volumes' bitmaps come back all dirty) and reads everything.
/// Every write arrives either way. The source never re-hashes here
/// (`[index] refresh_interval_ms = 0`), so only the marks say what changed.
#[test]
fn a_source_prints_unread_only_what_no_write_or_crash_has_put_in_doubt() {
    if !have("qemu-io") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (pa, pb) = (d.path().join("a"), d.path().join("b"));
    let mig = format!("127.0.0.1:{}", free_port());
    let (src_nbd, src_admin) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let cfg = d.path().join("source.toml");
    std::fs::write(&cfg, "[index]\nrefresh_interval_ms = 0\n").unwrap();
    let cfg = cfg.to_str().unwrap().to_string();
    let start_source = || Serve::start_on(&pa, &src_nbd, &src_admin, &["--config", &cfg]);
    let src = start_source();
    let _dst = Serve::start_on(
        &pb,
        &format!("127.0.0.1:{}", free_port()),
        &format!("127.0.0.1:{}", free_port()),
        &["--migrate", &mig],
    );
    trust_each_other(&pa, &pb);
    let img = d.path().join("img");
    let data = noise_image(&img, 8 << 20, 0x9e37_79b9_7f4a_7c15);
    for v in ["kept", "killed"] {
        src.ferry(&["volume", "create", v, "--size", "8M"]);
        src.ferry(&["volume", "import", v, img.to_str().unwrap()]);
        wait_for_prints(&src_admin, v);
    }
    let write = |volume: &str, pattern: u8, at: usize| {
        let out = Command::new("qemu-io")
            .args([
                "-f",
                "raw",
                &format!("nbd://{src_nbd}/{volume}"),
                "-c",
                &format!("write -P {pattern} {at} 64k"),
                "-c",
                "flush",
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    };
    let migrate = |volume: &str| -> serde_json::Value {
        let out = Command::new(FERRY)
            .args(["migrate", volume, "--to", &mig, "--json"])
            .env("FERRY_ADMIN", &src_admin)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(r["result"], "switched", "{r}");
        r
    };
    let arrived = |volume: &str, writes: &[(u8, usize)]| {
        let mut want = data.clone();
        for &(p, at) in writes {
            want[at..at + 65536].fill(p);
        }
        let got = std::fs::read(pb.join(format!("volumes/{volume}/data.raw"))).unwrap();
        assert!(
            got[..want.len()] == want[..],
            "{volume} arrived other than written"
        );
    };
    write("kept", 0x63, 1 << 20);
    write("killed", 0x63, 1 << 20);
    // A clean stop saves the marks: all but the 16 written blocks print unread.
    src.terminate();
    let src = start_source();
    let r = migrate("kept");
    assert_eq!(r["chunks"]["unread"], 2048 - 16, "{r}");
    arrived("kept", &[(0x63, 1 << 20)]);
    // kill -9: nothing is trusted; every block is read and hashed again.
    write("killed", 0x64, 2 << 20);
    src.kill9();
    let _src = start_source();
    let r = migrate("killed");
    assert_eq!(r["chunks"]["unread"], 0, "{r}");
    arrived("killed", &[(0x63, 1 << 20), (0x64, 2 << 20)]);
}
