//! A guest whose disk is an iSCSI LUN (QEMU's own libiscsi initiator,
//! `iscsi://` at the source site) while its volume migrates across an
//! emulated WAN: the source asks the session to log out after the switch,
//! redirects the new login to the destination's portal, and withholds the
//! commands the move failed, which the initiator issues again there. The
//! guest (busybox, numbered records written with fsync, an "ack" on the
//! serial console per durable record) must see no I/O error and stall
//! less than QEMU's reconnect allows, and every acknowledged record must be
//! on the destination's copy.
// Test fixtures: sizes the test itself chooses.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

#[path = "../../ferry-server/tests/common/toxiproxy.rs"]
#[allow(dead_code)]
mod toxiproxy;

mod common;
mod guests;

use common::have;
use guests::*;
use std::process::{Command, Stdio};
use std::time::Instant;

const IQN: &str = "iqn.2026-11.io.ferry";

/// The largest gap between two consecutive acks, in the guest's clock.
fn largest_stall(serial: &std::path::Path) -> (f64, u64) {
    let acks = acks(serial);
    let mut worst = (0.0, 0);
    for w in acks.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        let gap = b.1.parse::<f64>().unwrap_or(0.0) - a.1.parse::<f64>().unwrap_or(0.0);
        if gap > worst.0 {
            worst = (gap, b.0);
        }
    }
    worst
}

#[test]
fn an_iscsi_guest_follows_its_volume_to_the_other_site_without_an_io_error() {
    let Some((kernel, initrd)) = guest_files() else {
        return;
    };
    if !have("iscsi-inq") {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let d = tempfile::tempdir().unwrap();
    let p = d.path();
    let rtt_ms: u64 = std::env::var("FERRY_ISCSI_GUEST_RTT_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    // The other site's storage (its migration listener and its iSCSI
    // portal) is across the WAN: round trips of `rtt_ms`, 4 MB/s.
    let tp = toxiproxy::Toxiproxy::start();
    let (ia, ib) = (addr(), addr());
    let ib_wan = tp.proxy("iscsi", &ib);
    let sa = Storage::start_with(
        &p.join("sa"),
        addr(),
        addr(),
        addr(),
        &[
            "--iscsi".into(),
            ia.clone(),
            "--iscsi-port-group".into(),
            "1".into(),
        ],
    );
    let sb = Storage::start_with(
        &p.join("sb"),
        addr(),
        addr(),
        addr(),
        &[
            "--iscsi".into(),
            ib.clone(),
            "--iscsi-port-group".into(),
            "2".into(),
            "--advertise-iscsi".into(),
            ib_wan.clone(),
        ],
    );
    trust(&sa.pool, &sb.pool);
    let sb_wan = tp.proxy("storage", &sb.mig);
    for proxy in ["storage", "iscsi"] {
        tp.add_latency(proxy, rtt_ms / 2);
        tp.add_toxic(
            proxy,
            "bw",
            "bandwidth",
            "upstream",
            serde_json::json!({"rate": 4096}),
        );
    }
    ext4_volume(&sa, p, "disk");

    let serial = p.join("guest.serial");
    let qemu_log = p.join("qemu.log");
    let drive = format!("file=iscsi://{ia}/{IQN}:disk/0,format=raw,if=none,id=d0");
    let _guest = KillOnDrop(
        Command::new("qemu-system-x86_64")
            .args([
                "-accel",
                "tcg",
                "-m",
                "128M",
                "-nodefaults",
                "-display",
                "none",
            ])
            .arg("-serial")
            .arg(format!("file:{}", serial.display()))
            .arg("-kernel")
            .arg(&kernel)
            .arg("-initrd")
            .arg(&initrd)
            .args(["-append", "console=ttyS0 quiet", "-drive", &drive])
            .args(["-device", "virtio-blk-pci,drive=d0"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&qemu_log).unwrap())
            .spawn()
            .unwrap(),
    );
    wait_acks(&serial, 20);
    let unit_serial = || {
        ok_cmd(
            Command::new("iscsi-inq")
                .args(["-e", "1", "-c", "128"])
                .arg(format!("iscsi://{ia}/{IQN}:disk/0")),
        )
    };
    let before = unit_serial();
    let inq = |args: &[&str]| {
        ok_cmd(
            Command::new("iscsi-inq")
                .args(args)
                .arg(format!("iscsi://{ia}/{IQN}:disk/0")),
        )
    };
    // Implicit ALUA, and the target port group of the portal's site.
    assert!(inq(&[]).contains("TPGS:1"), "{}", inq(&[]));
    // libiscsi 1.19's iscsi-inq prints binary designators as text (the
    // group's number shows empty); the ALUA states themselves are checked
    // with raw PDUs in ferry-server's iscsi tests.
    let has_group =
        |ids: String| ids.contains("TARGET_PORT_GROUP") && ids.contains("RELATIVE_TARGET_PORT");
    assert!(has_group(inq(&["-e", "1", "-c", "131"])));

    let t = Instant::now();
    let report = ok(&[
        "migrate", "disk", "--to", &sb_wan, "--json", "--admin", &sa.admin,
    ]);
    let took = t.elapsed();
    let report: serde_json::Value = serde_json::from_str(&report).unwrap();
    assert_eq!(report["result"], "switched", "{report}");
    // The guest goes on writing, now through the destination.
    let after = acks(&serial).last().unwrap().0;
    wait_acks(&serial, 30);
    let sa_log = std::fs::read_to_string(sa.pool.with_extension("log")).unwrap();
    assert!(
        sa_log.contains("asking the initiator to log out"),
        "the source never asked the session to go:\n{sa_log}"
    );
    assert!(
        sa_log.contains("iSCSI login redirected"),
        "the initiator did not log in again at the source:\n{sa_log}"
    );
    let serial_text = std::fs::read_to_string(&serial).unwrap();
    for bad in ["I/O error", "EXT4-fs error", "ferry-guest: cannot"] {
        assert!(
            !serial_text.contains(bad),
            "the guest saw {bad:?}:\n{serial_text}"
        );
    }
    let qemu_text = std::fs::read_to_string(&qemu_log).unwrap();
    assert!(
        !qemu_text.contains("failed"),
        "QEMU's iSCSI driver reported a failure:\n{qemu_text}"
    );
    for l in sa_log
        .lines()
        .filter(|l| l.contains("iscsi") || l.contains("iSCSI"))
    {
        eprintln!("source: {l}");
    }
    let (stall, at) = largest_stall(&serial);
    eprintln!(
        "iSCSI guest across the move at {rtt_ms} ms RTT: migration {:.1} s, pause {} ms, acks before {after}, largest stall {stall:.3} s (guest clock) before record {at}",
        took.as_secs_f64(),
        report["time"]["pause_ms"],
    );

    // A new initiator at the old portal is redirected, and reads the same
    // device there (same unit serial), through the destination.
    assert_eq!(unit_serial(), before);
    assert!(has_group(inq(&["-e", "1", "-c", "131"])));
    // Discovery at the old portal lists the target at its new portal.
    let ls = ok_cmd(Command::new("iscsi-ls").arg(format!("iscsi://{ia}")));
    assert!(
        ls.contains(&format!("Target:{IQN}:disk Portal:{ib_wan},1")),
        "{ls}"
    );
    let sa_log = std::fs::read_to_string(sa.pool.with_extension("log")).unwrap();
    assert!(
        sa_log.matches("iSCSI login redirected").count() >= 2,
        "iscsi-inq was not redirected:\n{sa_log}"
    );

    drop(_guest);
    let checked = check_records(&sb, "disk", p, &[serial]);
    eprintln!("{checked} acknowledged records on the destination's copy");
}
