//! The iSCSI target against real initiators: libiscsi's conformance suite
//! (`iscsi-test-cu`), its command-line tools, qemu-img over `iscsi://`
//! with CHAP, the same volume over NBD and iSCSI at once, and hand-made bad
//! PDUs on raw sockets.
// Test fixtures: sizes, offsets and byte patterns the test itself chooses.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

mod common;
#[path = "common/raw_iscsi.rs"]
mod raw_iscsi;

use bytes::{Bytes, BytesMut};
use common::{have, make_image, run, sha, TestServer};
use ferry_iscsi::pdu::{op, Pdu};
use ferry_server::config::IscsiAccess;
use raw_iscsi::*;
use std::io::Write;
use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

fn start(pool: &std::path::Path, f: impl FnOnce(&mut ferry_server::config::Config)) -> TestServer {
    TestServer::start_with(pool, |c| {
        c.iscsi.listen = vec!["127.0.0.1:0".into(), "127.0.0.1:0".into()];
        f(c);
    })
}

fn portals(s: &TestServer) -> Vec<SocketAddr> {
    s.state.iscsi.portals.lock().clone()
}

fn url(p: SocketAddr, volume: &str) -> String {
    format!("iscsi://{p}/{IQN}:{volume}/0")
}

/// Parse CUnit's "tests  total ran passed failed inactive" line.
fn cunit_tests(out: &str) -> (u32, u32, u32) {
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("tests"))
        .unwrap_or_else(|| panic!("no CUnit summary in:\n{out}"));
    let n: Vec<u32> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    (n[0], n[2], n[3])
}

/// Skip messages that mean "the target does not implement this command".
fn unsupported_skips(out: &str) -> Vec<String> {
    let mut v: Vec<String> = out
        .lines()
        .filter(|l| l.contains("[SKIPPED]") && l.contains("not implemented"))
        .map(|l| l.trim().to_string())
        .collect();
    v.sort();
    v.dedup();
    v
}

#[test]
fn conformance_suite_scsi_and_iscsi_families_pass() {
    if !have("iscsi-test-cu") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path(), |_| {});
    s.create("scratch", 1 << 30);
    let p = portals(&s);
    for family in ["SCSI", "iSCSI"] {
        // Two portal URLs to the same LUN: the MultipathIO tests run.
        let out = Command::new("iscsi-test-cu")
            .args(["--dataloss", "-t", family])
            .arg(url(p[0], "scratch"))
            .arg(url(p[1], "scratch"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        let (total, passed, failed) = cunit_tests(&text);
        assert_eq!(failed, 0, "{family}: {failed} failed\n{text}");
        assert_eq!(passed, total, "{family}\n{text}");
        assert!(
            !text.contains("Multipath unavailable"),
            "{family}: multipath tests skipped\n{text}"
        );
        // No test is skipped because a command is missing.
        let missing = unsupported_skips(&text);
        assert!(
            missing.is_empty(),
            "{family}: unsupported commands: {missing:?}"
        );
    }
    // The read-only tests need a write-protected unit.
    s.state
        .pool
        .create(
            "ro",
            &ferry_storage::CreateOptions {
                size: 64 << 20,
                read_only: true,
                ..Default::default()
            },
        )
        .unwrap();
    let out = Command::new("iscsi-test-cu")
        .args(["--dataloss", "-t", "SCSI.ReadOnly"])
        .arg(url(p[0], "ro"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (total, passed, failed) = cunit_tests(&text);
    assert_eq!((failed, passed), (0, total), "{text}");
    assert!(!text.contains("[SKIPPED]"), "{text}");

    // A 512e volume (512-byte blocks on 4 KiB physical blocks): the SCSI
    // family again, now with the tests that need LBPPB > 1.
    s.state
        .pool
        .create(
            "e512",
            &ferry_storage::CreateOptions {
                size: 256 << 20,
                physical_block_size: Some(4096),
                ..Default::default()
            },
        )
        .unwrap();
    let out = Command::new("iscsi-test-cu")
        .args(["--dataloss", "-t", "SCSI"])
        .arg(url(p[0], "e512"))
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let (total, passed, failed) = cunit_tests(&text);
    assert!(!text.contains("LBPPB < 2"), "512e not seen:\n{text}");
    assert!(unsupported_skips(&text).is_empty(), "{text}");
    // libiscsi's GetLBAStatus.UnmapSingle asks for the status at LBA i+1
    // and then expects the first descriptor at i+LBPPB, which SBC forbids
    // (the first descriptor starts at the LBA asked for); it can pass only
    // with LBPPB = 1. Every other test must pass.
    let failing: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| l.contains(".c:") && l.contains("CU_FAIL"))
        .collect();
    assert!(
        failed <= 1
            && failing
                .iter()
                .all(|l| l.contains("test_get_lba_status_unmap_single.c:135")),
        "512e: {failed} failed: {failing:?}\n{text}"
    );
    assert_eq!(passed + failed, total, "{text}");
}

/// SANITIZE against libiscsi's Sanitize suite (`--allow-sanitize`), on a
/// 512-byte and a 512e volume. The daemon writes at most 20 MiB/s for a
/// sanitize, so one of a 256 MiB volume runs about 13 s: the Reset test
/// needs it still under way 4 s after it began, across ABORT TASK, LUN and
/// target resets and a new login (at 40 MiB/s, 6 s, a loaded CI machine
/// once took longer than that over them).
#[test]
fn sanitize_conformance_tests_pass() {
    if !have("iscsi-test-cu") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path(), |c| c.storage.sanitize_bytes_per_sec = 20 << 20);
    s.create("san", 256 << 20);
    s.state
        .pool
        .create(
            "san512e",
            &ferry_storage::CreateOptions {
                size: 256 << 20,
                physical_block_size: Some(4096),
                ..Default::default()
            },
        )
        .unwrap();
    let p = portals(&s);
    // As an operator runs it: both portals, so each test has a second
    // path. One exception: the Reservations test takes a RESERVE(6) on the
    // second path and leaves it held (libiscsi's mpath_sd2_put does not end
    // a multipath session), so the Reset test right after it gets
    // RESERVATION CONFLICT for its SANITIZE, as SPC-2 requires; Reset runs
    // on its own after the others (the suite's cleanup ends the sessions,
    // and the reservation with them).
    let all_but_reset = "SCSI.Sanitize.BlockErase,SCSI.Sanitize.BlockEraseReserved,\
        SCSI.Sanitize.CryptoErase,SCSI.Sanitize.CryptoEraseReserved,\
        SCSI.Sanitize.ExitFailureMode,SCSI.Sanitize.InvalidServiceAction,\
        SCSI.Sanitize.Overwrite,SCSI.Sanitize.OverwriteReserved,\
        SCSI.Sanitize.Readonly,SCSI.Sanitize.Reservations";
    let suite = |volume: &str, tests: &str| {
        let out = Command::new("iscsi-test-cu")
            .args(["--dataloss", "--allow-sanitize", "-t", tests])
            .arg(url(p[0], volume))
            .arg(url(p[1], volume))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        let (total, passed, failed) = cunit_tests(&text);
        assert_eq!((failed, passed), (0, total), "{volume} {tests}:\n{text}");
        assert!(!text.contains("Multipath unavailable"), "{text}");
        assert!(!text.contains("flag is not set"), "{text}");
        // Only CRYPTO ERASE is missing (volumes have no key to destroy).
        let missing = unsupported_skips(&text);
        assert!(
            missing.iter().all(|l| l.contains("CRYPTO")),
            "{volume}: unsupported: {missing:?}\n{text}"
        );
        total
    };
    for volume in ["san", "san512e"] {
        assert!(suite(volume, all_but_reset) >= 10);
    }
    // The Reset test polls every 60 s once the sanitize outlives its
    // checks: both volumes at once.
    std::thread::scope(|sc| {
        let runs: Vec<_> = ["san", "san512e"]
            .map(|v| sc.spawn(move || suite(v, "SCSI.Sanitize.Reset")))
            .into_iter()
            .collect();
        for r in runs {
            assert_eq!(r.join().unwrap(), 1);
        }
    });
}

/// Status and sense (key, ASC, ASCQ; zeroes without sense data) of one
/// command.
fn status_and_sense(r: &mut Raw, p: &Pdu) -> (u8, (u8, u8, u8)) {
    r.send(p);
    loop {
        let x = r.recv().expect("answer");
        if x.opcode() == op::SCSI_RESPONSE {
            // Sense data follows a 2-byte length.
            let s = x.data.get(2..).unwrap_or_default();
            let at = |i: usize| s.get(i).copied().unwrap_or(0);
            return (x.bhs[3], (at(2) & 0x0f, at(12), at(13)));
        }
    }
}

/// The admin API's view of a volume.
fn volume_view(s: &TestServer, name: &str) -> serde_json::Value {
    ureq::get(&format!("http://{}/v1/volumes/{name}", s.admin))
        .call()
        .unwrap()
        .into_json()
        .unwrap()
}

/// Wait until nothing holds the data file's lock (a stopped daemon's
/// threads have let go of the volume).
fn wait_unlocked(path: &std::path::Path) {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    for _ in 0..500 {
        // SAFETY: flock on a descriptor `f` owns.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            // SAFETY: as above.
            unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) };
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("{} is still locked", path.display());
}

#[test]
fn a_sanitize_refuses_io_until_done_and_resumes_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path(), |c| c.storage.sanitize_bytes_per_sec = 8 << 20);
    let v = s.create("s", 64 << 20);
    let data = v.data_path().to_path_buf();
    drop(v);
    let p = portals(&s);
    let mut r = Raw::login(p[0], "s", false);
    let w = r.command_out(&write16(100, 1), &[0x11; 512]);
    assert_eq!(r.run(&w).0, 0);
    // OVERWRITE with IMMED: GOOD at once, the sanitize runs on.
    let mut param = vec![0x01, 0, 0x02, 0x00];
    param.extend_from_slice(&[0x5a; 512]);
    let mut cdb = [0u8; 10];
    cdb[0] = 0x48;
    cdb[1] = 0x80 | 0x01;
    cdb[7..9].copy_from_slice(&516u16.to_be_bytes());
    let san = r.command_out(&cdb, &param);
    assert_eq!(r.run(&san).0, 0);
    // Every medium command: NOT READY, SANITIZE IN PROGRESS.
    for c in [&[0u8; 6][..], &read16(0, 1)[..]] {
        let cmd = r.command(c, if c.len() == 16 { 512 } else { 0 });
        let (status, sense) = status_and_sense(&mut r, &cmd);
        assert_eq!(status, 2);
        assert_eq!(sense, (2, 0x04, 0x1b));
    }
    // NBD clients of the same volume get an error, not old data.
    if have("qemu-io") {
        let out = Command::new("qemu-io")
            .args(["-f", "raw", "-c", "read 0 512"])
            .arg(s.uri("s"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(text.contains("Input/output error"), "{text}");
    }
    // The admin API shows it running.
    let view = volume_view(&s, "s");
    assert_eq!(view["sanitize"]["state"], "running", "{view}");
    assert_eq!(view["sanitize"]["op"], "overwrite");
    drop(r);
    // The daemon stops half-way; the journal is in the metadata.
    std::thread::sleep(Duration::from_millis(1500));
    s.stop();
    wait_unlocked(&data);
    let meta = std::fs::read_to_string(dir.path().join("volumes/s/meta.json")).unwrap();
    assert!(meta.contains("\"sanitize\""), "{meta}");
    let half = std::fs::read(&data).unwrap();
    assert!(half[..512].iter().all(|&b| b == 0x5a));
    assert!(
        half.chunks(512).any(|c| c != [0x5a; 512]),
        "the sanitize finished before the stop"
    );
    // The next daemon resumes it and answers NOT READY until it is done.
    let s = start(dir.path(), |c| c.storage.sanitize_bytes_per_sec = 0);
    let p = portals(&s);
    let mut r = Raw::login(p[0], "s", false);
    let t = std::time::Instant::now();
    loop {
        let tur = r.command(&[0u8; 6], 0);
        let (status, sense) = status_and_sense(&mut r, &tur);
        if status == 0 {
            break;
        }
        assert_eq!(sense, (2, 0x04, 0x1b));
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "sanitize never ended"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let all = std::fs::read(&data).unwrap();
    assert_eq!(all.len(), 64 << 20);
    assert!(all.chunks(512).all(|c| c == [0x5a; 512]), "a block escaped");
    let rd = r.command(&read16(100, 1), 512);
    assert_eq!(r.run(&rd), (0, vec![0x5a; 512]));
    let meta = std::fs::read_to_string(dir.path().join("volumes/s/meta.json")).unwrap();
    assert!(!meta.contains("\"sanitize\""), "{meta}");
}

/// A size-limited tmpfs, unmounted when dropped.
struct SmallFs(std::path::PathBuf);

impl SmallFs {
    /// `None` when this process may not mount (not root, or a container);
    /// with FERRY_REQUIRE_TOOLS=1 (the test command's setting) that fails
    /// the test instead: it must not pass without running.
    fn mount(dir: &std::path::Path, mib: u32) -> Option<SmallFs> {
        let skip = |why: String| {
            assert!(
                std::env::var("FERRY_REQUIRE_TOOLS").as_deref() != Ok("1"),
                "{why} (FERRY_REQUIRE_TOOLS=1: this test must run)"
            );
            eprintln!("SKIP: {why}");
            None
        };
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return skip("mounting a small tmpfs needs root".into());
        }
        std::fs::create_dir_all(dir).unwrap();
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir)
            .status();
        if !st.is_ok_and(|s| s.success()) {
            // A container without the right to mount.
            return skip(format!("cannot mount a tmpfs on {}", dir.display()));
        }
        Some(SmallFs(dir.to_path_buf()))
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A sanitize that runs out of space half-way (a sparse volume larger than
/// its 16 MiB file system): the command fails, the volume stays in the
/// failure mode (MEDIUM ERROR, SANITIZE COMMAND FAILED) across a restart,
/// EXIT FAILURE MODE is refused without AUSE, and a BLOCK ERASE, which
/// frees the blocks, ends it.
#[test]
fn a_sanitize_that_runs_out_of_space_leaves_the_failure_mode_until_one_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let Some(_fs) = SmallFs::mount(&dir.path().join("fs"), 16) else {
        return;
    };
    let pool = dir.path().join("fs").join("pool");
    // Room an operator frees later.
    let ballast = dir.path().join("fs").join("ballast");
    std::fs::write(&ballast, vec![1u8; 1 << 20]).unwrap();
    let s = start(&pool, |c| c.storage.sanitize_bytes_per_sec = 0);
    s.create("full", 64 << 20);
    let p = portals(&s);
    let mut r = Raw::login(p[0], "full", false);
    let mut param = vec![0x01, 0, 0x02, 0x00];
    param.extend_from_slice(&[0x5a; 512]);
    let mut cdb = [0u8; 10];
    cdb[0] = 0x48;
    cdb[1] = 0x01; // OVERWRITE, no IMMED, no AUSE
    cdb[7..9].copy_from_slice(&516u16.to_be_bytes());
    let san = r.command_out(&cdb, &param);
    let (status, sense) = status_and_sense(&mut r, &san);
    assert_eq!(status, 2, "the sanitize did not fail");
    assert_eq!(sense, (7, 0x27, 0x07), "space allocation failed");
    let medium_failed = |r: &mut Raw| {
        let rd = r.command(&read16(0, 1), 512);
        let (status, sense) = status_and_sense(r, &rd);
        assert_eq!(status, 2);
        assert_eq!(sense, (3, 0x31, 0x03));
    };
    medium_failed(&mut r);
    let view = volume_view(&s, "full");
    assert_eq!(view["sanitize"]["state"], "failed", "{view}");
    assert!(
        view["sanitize"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("No space left")),
        "{view}"
    );
    drop(r);
    // A restarted daemon keeps refusing I/O: the failure is journaled, or,
    // when even that found the disk full (here), the journaled request is
    // resumed at start and fails again; never old data.
    s.stop();
    let s = start(&pool, |c| c.storage.sanitize_bytes_per_sec = 0);
    let p = portals(&s);
    let mut r = Raw::login(p[0], "full", false);
    let t = std::time::Instant::now();
    loop {
        let rd = r.command(&read16(0, 1), 512);
        let (status, sense) = status_and_sense(&mut r, &rd);
        assert_eq!(status, 2, "a block was served");
        match sense {
            (2, 0x04, 0x1b) => {
                assert!(t.elapsed() < Duration::from_secs(30));
                std::thread::sleep(Duration::from_millis(20));
            }
            other => {
                assert_eq!(other, (3, 0x31, 0x03));
                break;
            }
        }
    }
    // EXIT FAILURE MODE is refused: the failed sanitize did not set AUSE.
    let mut exit = [0u8; 10];
    exit[0] = 0x48;
    exit[1] = 0x1f;
    let x = r.command(&exit, 0);
    let (status, sense) = status_and_sense(&mut r, &x);
    assert_eq!(status, 2);
    assert_eq!((sense.0, sense.1), (5, 0x24));
    medium_failed(&mut r);
    // With the disk still full, even a BLOCK ERASE cannot be journaled:
    // refused, and nothing changes.
    let mut erase = [0u8; 10];
    erase[0] = 0x48;
    erase[1] = 0x02;
    let e = r.command(&erase, 0);
    let (status, sense) = status_and_sense(&mut r, &e);
    assert_eq!(status, 2);
    assert_eq!(sense, (7, 0x27, 0x07));
    medium_failed(&mut r);
    // The operator frees some room: BLOCK ERASE is journaled, frees the
    // blocks and succeeds; the volume reads zeroes and takes writes.
    std::fs::remove_file(&ballast).unwrap();
    let e = r.command(&erase, 0);
    assert_eq!(status_and_sense(&mut r, &e).0, 0);
    let rd = r.command(&read16(0, 1), 512);
    assert_eq!(r.run(&rd), (0, vec![0; 512]));
    let w = r.command_out(&write16(3, 1), &[0x22; 512]);
    assert_eq!(r.run(&w).0, 0);
}

#[test]
fn libiscsi_tools_show_the_volume() {
    if !have("iscsi-ls") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path(), |_| {});
    let v = s.create("disk1", 64 << 20);
    let p = portals(&s);
    let ls = run(Command::new("iscsi-ls").arg(format!("iscsi://{}", p[0])));
    assert!(
        ls.contains(&format!("Target:{IQN}:disk1 Portal:{},1", p[0])),
        "{ls}"
    );
    assert!(ls.contains(&format!("Portal:{},2", p[1])), "{ls}");
    let inq = run(Command::new("iscsi-inq").arg(url(p[0], "disk1")));
    assert!(inq.contains("Vendor:FERRY"), "{inq}");
    assert!(inq.contains("Product:disk1"), "{inq}");
    // VPD 0x83 carries the volume's WWN as an NAA designator (the same on
    // both portals, so multipath sees one LU) and the serial as a T10 id.
    let wwn = v.meta().wwn;
    let naa = ferry_scsi::naa_bytes(&wwn).unwrap();
    for portal in &p {
        let dev_id = run(Command::new("iscsi-inq")
            .args(["-e", "1", "-c", "131"])
            .arg(url(*portal, "disk1")));
        assert!(dev_id.contains("Designator Type:(3) NAA"), "{dev_id}");
        assert!(
            dev_id.contains(&v.meta().uuid.simple().to_string()),
            "{dev_id}"
        );
        let mut r = Raw::login(*portal, "disk1", false);
        let cmd = r.command(&[0x12, 1, 0x83, 0, 255, 0], 255);
        r.send(&cmd);
        let page = r.recv().unwrap();
        assert_eq!(page.opcode(), op::DATA_IN);
        assert!(
            page.data.windows(8).any(|w| w == naa),
            "NAA {wwn} not in VPD 0x83: {:02x?}",
            &page.data[..]
        );
    }
    let cap = run(Command::new("iscsi-readcapacity16").arg(url(p[0], "disk1")));
    assert!(
        cap.contains(&format!("Total size:{}", 64u64 << 20)),
        "{cap}"
    );
    assert!(cap.contains("LBPME:1"), "{cap}");
}

#[test]
fn qemu_img_round_trip_with_mutual_chap_and_acl() {
    if !have("qemu-img") || !have("iscsi-ls") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path(), |c| {
        c.iscsi.chap_user = "alice".into();
        c.iscsi.chap_secret = "alice-secret-1".into();
        c.iscsi.mutual_user = "ferry".into();
        c.iscsi.mutual_secret = "target-secret-2".into();
        c.iscsi.targets.insert(
            "locked".into(),
            IscsiAccess {
                acl: vec!["iqn.2026-11.test:allowed".into()],
                ..Default::default()
            },
        );
    });
    s.create("img", 32 << 20);
    s.create("locked", 1 << 20);
    let p = portals(&s);
    let src = dir.path().join("src.raw");
    make_image(&src, 32);
    let with_chap = format!(
        "iscsi://alice%alice-secret-1@{}/{IQN}:img/0?target_user=ferry&target_password=target-secret-2",
        p[0]
    );
    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&src)
        .arg(&with_chap));
    let back = dir.path().join("back.raw");
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw"])
        .arg(&with_chap)
        .arg(&back));
    assert_eq!(sha(&src), sha(&back));
    run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&src)
        .arg(&with_chap));
    // A wrong secret, or no CHAP at all, is refused.
    let wrong = format!("iscsi://alice%wrong-secret-9@{}/{IQN}:img/0", p[0]);
    let out = Command::new("qemu-img")
        .args(["info"])
        .arg(&wrong)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let out = Command::new("qemu-img")
        .args(["info"])
        .arg(url(p[0], "img"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    // The ACL target admits only its initiator.
    let out = Command::new("iscsi-inq")
        .args(["-i", "iqn.2026-11.test:intruder"])
        .arg(url(p[0], "locked"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    run(Command::new("iscsi-inq")
        .args(["-i", "iqn.2026-11.test:allowed"])
        .arg(url(p[0], "locked")));
}

#[test]
fn nbd_and_iscsi_see_one_disk_and_iscsi_writes_mark_bitmaps() {
    if !have("qemu-io") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path(), |_| {});
    let v = s.create("shared", 16 << 20);
    v.create_bitmap("b", 65536, false).unwrap();
    let p = portals(&s);
    let iscsi = url(p[0], "shared");
    let nbd = s.uri("shared");
    // Write over iSCSI, read over NBD (both connections open at once).
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0xab 1M 64k"])
        .arg(&iscsi));
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read -P 0xab 1M 64k"])
        .arg(&nbd));
    // And the other way.
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x5c 4M 128k"])
        .arg(&nbd));
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read -P 0x5c 4M 128k"])
        .arg(&iscsi));
    // Header digests (CRC32C) negotiated by a real initiator.
    let opts = format!(
        "driver=iscsi,transport=tcp,portal={},target={IQN}:shared,lun=0,header-digest=crc32c",
        p[1]
    );
    let out = run(Command::new("qemu-io").args([
        "--image-opts",
        &opts,
        "-c",
        "write -P 0x3c 8M 256k",
        "-c",
        "read -P 0x3c 8M 256k",
        "-c",
        "read -P 0xab 1M 64k",
    ]));
    assert!(!out.contains("fail"), "{out}");
    run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&iscsi)
        .arg(&nbd));
    let b = v.bitmap("b").unwrap();
    assert!(
        b.is_dirty(1 << 20, 65536),
        "iSCSI write not in the dirty bitmap"
    );
    assert!(!b.is_dirty(12 << 20, 65536));
    // iSCSI commands show in the per-volume metrics.
    let metrics = ureq::get(&format!("http://{}/metrics", s.admin))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("ferry_requests_total")
                && l.contains("iscsi_write")
                && l.contains("shared")),
        "no iscsi_write in metrics"
    );
    let server: serde_json::Value = ureq::get(&format!("http://{}/v1/server", s.admin))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(server["iscsi"].as_array().unwrap().len(), 2);
}

#[test]
fn bad_pdus_get_rfc_answers_and_harm_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path(), |_| {});
    let v = s.create("vol", 1 << 20);
    v.write_at(0, &[0x42; 4096], false).unwrap();
    let p = portals(&s)[0];

    // A healthy session that must survive everything below.
    let mut good = Raw::login(p, "vol", false);

    // 1. A SCSI command before login: refused, connection closed.
    let mut r = Raw::connect(p);
    let cmd = r.command(&read16(0, 1), 512);
    r.send(&cmd);
    let resp = r.recv();
    assert!(resp.is_none_or(|x| x.opcode() == op::LOGIN_RESPONSE && x.bhs[36] != 0));
    assert!(r.recv().is_none());

    // 2. Garbage bytes instead of a login.
    let mut r = Raw::connect(p);
    r.s.write_all(&[0xffu8; 200]).unwrap();
    let resp = r.recv();
    assert!(resp.is_none_or(|x| x.bhs[36] != 0));

    // 3. A data segment far over MaxRecvDataSegmentLength: dropped.
    let mut r = Raw::login(p, "vol", false);
    let mut big = [0u8; 48];
    big[0] = op::SCSI_COMMAND;
    big[5] = 0x7f; // ~8 MiB data segment
    r.s.write_all(&big).unwrap();
    assert!(r.recv().is_none());

    // 4. Unknown opcode: a Reject with "command not supported".
    let mut r = Raw::login(p, "vol", false);
    let mut odd = Pdu::new(0x1c);
    odd.bhs[0] |= 0x40;
    r.send(&odd);
    let rej = r.recv().unwrap();
    assert_eq!((rej.opcode(), rej.bhs[2]), (op::REJECT, 0x05));

    // 5. A READ past the end: CHECK CONDITION, LBA OUT OF RANGE.
    let cmd = r.command(&read16(2047, 2), 1024);
    r.send(&cmd);
    let resp = r.recv().unwrap();
    assert_eq!(resp.opcode(), op::SCSI_RESPONSE);
    assert_eq!(resp.bhs[3], 0x02);
    assert_eq!((resp.data[2 + 2] & 0x0f, resp.data[2 + 12]), (0x05, 0x21));

    // 6. A command out of the CmdSN window is ignored; the next in-window
    //    one is answered.
    let mut stale = r.command(&[0u8; 6], 0);
    stale.set_u32(24, r.cmdsn.wrapping_sub(100));
    r.send(&stale);
    let tur = r.command(&[0u8; 6], 0);
    let itt = tur.itt();
    r.send(&tur);
    let resp = r.recv().unwrap();
    assert_eq!((resp.opcode(), resp.itt()), (op::SCSI_RESPONSE, itt));

    // 7. A header digest error (CRC32C negotiated): the connection drops.
    let mut r = Raw::login(p, "vol", true);
    let cmd = r.command(&[0u8; 6], 0);
    let mut wire = BytesMut::new();
    cmd.encode(true, false, &mut wire);
    wire[48] ^= 0xff;
    r.s.write_all(&wire).unwrap();
    assert!(r.recv().is_none());

    // 8. A write whose data-out runs past the expected length: dropped,
    //    nothing written.
    let mut r = Raw::login(p, "vol", false);
    let mut w = r.command(&[0x2a, 0, 0, 0, 0, 0, 0, 0, 1, 0], 0);
    w.bhs[1] = 0x20; // W, not final: unsolicited data would follow
    w.set_u32(20, 512);
    r.send(&w);
    let mut d = Pdu::new(op::DATA_OUT);
    d.bhs[1] = 0x80;
    d.set_itt(w.itt());
    d.set_u32(20, 0xffff_ffff);
    d.set_u32(40, 512);
    d.data = Bytes::from(vec![0u8; 512]);
    r.send(&d);
    while let Some(x) = r.recv() {
        assert_ne!(x.opcode(), op::SCSI_RESPONSE, "a write past EDTL completed");
    }

    // The healthy session still reads the original data.
    let cmd = good.command(&read16(0, 8), 4096);
    good.send(&cmd);
    let mut data = Vec::new();
    loop {
        let x = good.recv().unwrap();
        if x.opcode() == op::DATA_IN {
            data.extend_from_slice(&x.data);
            if x.bhs[1] & 0x01 != 0 {
                assert_eq!(x.bhs[3], 0);
                break;
            }
        } else {
            assert_eq!(x.opcode(), op::SCSI_RESPONSE);
            assert_eq!(x.bhs[3], 0, "sense {:02x?}", &x.data[..]);
            break;
        }
    }
    assert_eq!(data, vec![0x42u8; 4096]);
    let mut check = vec![0u8; 8192];
    v.read_at(0, &mut check).unwrap();
    assert_eq!(&check[..4096], &[0x42u8; 4096][..]);
    assert_eq!(&check[4096..], &[0u8; 4096][..]);
}

#[test]
fn non_loopback_portal_without_acl_or_chap_refuses_logins() {
    // Bind every interface: the policy looks at the address the connection
    // arrived on, and 127.0.0.1 is loopback, so use another local address
    // when the machine has one.
    let own_netns = std::env::var_os("FERRY_TEST_OWN_NETNS").is_some();
    let ip = match non_loopback_ip() {
        Some(ip) if !own_netns || std::env::var_os("FERRY_IN_NETNS").is_some() => ip,
        _ if std::env::var_os("FERRY_IN_NETNS").is_none() => {
            // No address beyond loopback here (or asked not to use it):
            // run again in a network namespace of its own that has one.
            return again_in_own_netns("non_loopback_portal_without_acl_or_chap_refuses_logins");
        }
        _ => panic!("no non-loopback address in the test's own network namespace"),
    };
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_with(dir.path(), |c| {
        c.iscsi.listen = vec![format!("{ip}:0")];
    });
    s.create("v", 1 << 20);
    let (status, _) = login_answer(portals(&s)[0], "v", 1, 3);
    assert_eq!(status, (2, 2), "authorization failure");
}

/// Run test `name` of this binary again inside a new network namespace
/// with a veth interface at 10.213.0.1/24 (its default route), and check
/// that it passed there. Without the right to make one, the test is
/// skipped, or fails with FERRY_REQUIRE_TOOLS=1.
fn again_in_own_netns(name: &str) {
    struct Netns(String);
    impl Drop for Netns {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }
    let ns = Netns(format!("ferry-test-{}", std::process::id()));
    let ip = |args: &[&str]| {
        Command::new("ip")
            .args(args)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !ip(&["netns", "add", &ns.0]) {
        assert!(
            std::env::var("FERRY_REQUIRE_TOOLS").as_deref() != Ok("1"),
            "cannot make a network namespace (FERRY_REQUIRE_TOOLS=1: this test must run)"
        );
        eprintln!("SKIP: no non-loopback address, and no network namespace to make one in");
        return;
    }
    for cmd in [
        "link set lo up",
        "link add d0 type veth peer name d1",
        "addr add 10.213.0.1/24 dev d0",
        "link set d1 up",
        "link set d0 up",
        "route add default dev d0",
    ] {
        let mut args = vec!["netns", "exec", &ns.0, "ip"];
        args.extend(cmd.split(' '));
        assert!(ip(&args), "ip {cmd} in {}", ns.0);
    }
    let out = Command::new("ip")
        .args(["netns", "exec", &ns.0])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads", "1"])
        .env("FERRY_IN_NETNS", "1")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "in {}:\n{text}",
        ns.0
    );
}

fn non_loopback_ip() -> Option<std::net::IpAddr> {
    let sock = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    sock.connect("10.255.255.255:9").ok()?;
    let ip = sock.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

#[test]
fn a_group_target_serves_several_volumes_as_luns() {
    if !have("iscsi-ls") || !have("qemu-io") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path(), |c| {
        c.iscsi
            .groups
            .insert("pair".into(), vec!["g0".into(), "g1".into()]);
    });
    let g0 = s.create("g0", 8 << 20);
    let g1 = s.create("g1", 16 << 20);
    let p = portals(&s);
    let ls = run(Command::new("iscsi-ls")
        .arg("-s")
        .arg(format!("iscsi://{}", p[0])));
    assert!(ls.contains(&format!("{IQN}:pair")), "{ls}");
    assert!(ls.contains("Lun:0"), "{ls}");
    assert!(ls.contains("Lun:1"), "{ls}");
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x11 0 64k"])
        .arg(format!("iscsi://{}/{IQN}:pair/1", p[0])));
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x22 0 64k"])
        .arg(format!("iscsi://{}/{IQN}:pair/0", p[1])));
    let mut b = vec![0u8; 65536];
    g1.read_at(0, &mut b).unwrap();
    assert!(b.iter().all(|x| *x == 0x11));
    g0.read_at(0, &mut b).unwrap();
    assert!(b.iter().all(|x| *x == 0x22));
    // LUN 2 does not exist.
    let out = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read 0 4k"])
        .arg(format!("iscsi://{}/{IQN}:pair/2", p[0]))
        .output()
        .unwrap();
    assert!(!out.status.success());
}

/// PERSISTENT RESERVE OUT with APTPL: the registration and the reservation
/// are saved with the volume and are there after the daemon restarts.
#[test]
fn aptpl_reservations_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path(), |_| {});
    s.create("pr", 1 << 20);
    let p = portals(&s)[0];
    let mut r = Raw::login(p, "pr", false);
    // Clear the power-on state first (a TEST UNIT READY).
    let tur = r.command(&[0u8; 6], 0);
    r.run(&tur);
    let prout = |sa: u8, rtype: u8| {
        let mut c = [0u8; 10];
        c[0] = 0x5f;
        c[1] = sa;
        c[2] = rtype;
        c[8] = 24;
        c
    };
    let mut param = [0u8; 24];
    param[8..16].copy_from_slice(&0xfeedu64.to_be_bytes());
    param[20] = 0x01; // APTPL
    let cmd = r.command_out(&prout(0, 0), &param);
    assert_eq!(r.run(&cmd).0, 0, "REGISTER with APTPL");
    let mut param = [0u8; 24];
    param[0..8].copy_from_slice(&0xfeedu64.to_be_bytes());
    let cmd = r.command_out(&prout(1, 1), &param);
    assert_eq!(r.run(&cmd).0, 0, "RESERVE write exclusive");
    drop(r);
    let pool = s.pool.clone();
    s.stop();
    let s = TestServer::start_with(&pool, |c| {
        c.iscsi.listen = vec!["127.0.0.1:0".into()];
    });
    let mut r = Raw::login(portals(&s)[0], "pr", false);
    let keys = r.command(&[0x5e, 0, 0, 0, 0, 0, 0, 0, 64, 0], 64);
    let (st, d) = r.run(&keys);
    assert_eq!(st, 0);
    assert_eq!(&d[4..8], &8u32.to_be_bytes(), "one key");
    assert_eq!(&d[8..16], &0xfeedu64.to_be_bytes());
    let res = r.command(&[0x5e, 1, 0, 0, 0, 0, 0, 0, 64, 0], 64);
    let (st, d) = r.run(&res);
    assert_eq!(st, 0);
    assert_eq!(&d[4..8], &16u32.to_be_bytes(), "a reservation is held");
    assert_eq!(d[21] & 0x0f, 1, "write exclusive");
    // Another initiator may read but not write.
    let mut other = Raw::login(portals(&s)[0], "pr", false);
    let w = other.command_out(&[0x2a, 0, 0, 0, 0, 0, 0, 0, 1, 0], &[0u8; 512]);
    assert_eq!(other.run(&w).0, 0x18, "RESERVATION CONFLICT");
}

/// Over the portal's connection limit a login is answered "out of
/// resources" (03/02) at once, instead of waiting in the listen queue; a
/// slot that frees up is usable again.
#[test]
fn logins_over_the_connection_limit_get_out_of_resources() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path(), |c| c.iscsi.max_connections = 2);
    s.create("lim", 1 << 20);
    let p = portals(&s)[0];
    let a = Raw::login(p, "lim", false);
    let _b = Raw::login(p, "lim", false);
    // A new connection's login as `who`; the connection and the answer.
    let login_as = |who: &str| {
        let mut c = Raw::connect(p);
        c.send(&login_pdu(
            &format!("InitiatorName=iqn.2026-11.test:{who}\nTargetName={IQN}:lim\nSessionType=Normal\nAuthMethod=None\n"),
            1,
            3,
        ));
        let resp = c.recv().expect("a login response, not a hang");
        assert_eq!(resp.opcode(), op::LOGIN_RESPONSE);
        (c, resp)
    };
    let t = std::time::Instant::now();
    let (mut c, resp) = login_as("late");
    assert_eq!(&resp.bhs[36..38], &[3, 2], "out of resources");
    assert!(c.recv().is_none(), "then the connection closes");
    assert!(t.elapsed() < Duration::from_secs(5));
    drop(a);
    // Usable again once the target has seen the close (polled: a loaded
    // machine may take longer than any fixed wait).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (_d, resp) = login_as("again");
        if resp.bhs[36..38] == [0, 0] {
            break;
        }
        assert_eq!(&resp.bhs[36..38], &[3, 2], "only out of resources");
        assert!(
            std::time::Instant::now() < deadline,
            "the freed slot never came back"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The answer to one login request for volume `v`'s target at `portal`
/// with no authentication (stages `csg` to `nsg`): its status class and
/// detail, and its text keys.
fn login_answer(portal: SocketAddr, v: &str, csg: u8, nsg: u8) -> ((u8, u8), String) {
    let mut r = Raw::connect(portal);
    r.send(&login_pdu(
        &format!("InitiatorName=iqn.2026-11.test:x\nTargetName={IQN}:{v}\nAuthMethod=None\n"),
        csg,
        nsg,
    ));
    let resp = r.recv().expect("a login response");
    (
        (resp.bhs[36], resp.bhs[37]),
        String::from_utf8_lossy(&resp.data).into_owned(),
    )
}

/// The target port groups (group, ALUA state) REPORT TARGET PORT GROUPS
/// answers on `r`.
fn port_group_states(r: &mut Raw) -> Vec<(u16, u8)> {
    let c = r.command(&[0xa3, 0x0a, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0], 1024);
    let (status, data) = r.run(&c);
    assert_eq!(status, 0, "REPORT TARGET PORT GROUPS failed");
    let mut out = Vec::new();
    let mut at = 4;
    while at + 8 <= data.len() {
        out.push((
            u16::from_be_bytes([data[at + 2], data[at + 3]]),
            data[at] & 0x0f,
        ));
        at += 8 + 4 * usize::from(data[at + 7]);
    }
    out
}

/// A volume's iSCSI side follows its migration: ALUA states at both sites
/// (active/optimized and standby, then unavailable and active), the
/// sessions at the source asked to log out (async event 1) with the
/// commands the move failed withheld rather than failed, a session that
/// does not log out closed, and new logins at the source redirected to
/// the destination's portal.
#[test]
fn a_migrated_volumes_sessions_are_sent_to_the_destination() {
    use ferry_migration_engine::source::{start as migrate, MigrateRequest};
    use ferry_migration_engine::Phase;
    let dir = tempfile::tempdir().unwrap();
    let site = |name: &str, group: u16| {
        start(&dir.path().join(name), move |c| {
            c.iscsi.listen = vec!["127.0.0.1:0".into()];
            c.iscsi.port_group = group;
            c.migration.listen = "127.0.0.1:0".into();
            c.migration.plaintext = true;
        })
    };
    let (a, b) = (site("a", 11), site("b", 22));
    let v = a.create("v", 8 << 20);
    v.write_at(0, &[0x5a; 4096], false).unwrap();
    let (pa, pb) = (portals(&a)[0], portals(&b)[0]);
    let mut s1 = Raw::login(pa, "v", false);
    let mut idle = Raw::login(pa, "v", false);
    // Not migrating: one group, this site's.
    assert_eq!(port_group_states(&mut s1), vec![(11, 0)]);

    let run = {
        let _g = a.rt().enter();
        migrate(
            a.state.clone(),
            MigrateRequest {
                volume: "v".into(),
                to: b.state.addrs.migration.unwrap().to_string(),
                plaintext: true,
                hold_switch: true,
                ..MigrateRequest::default()
            },
        )
        .unwrap()
        .run()
        .clone()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while run.phase() != Phase::ReadyToSwitch {
        assert!(std::time::Instant::now() < deadline, "{:?}", run.status());
        std::thread::sleep(Duration::from_millis(20));
    }
    // Converged, before the pause: the destination's group is standby.
    assert_eq!(port_group_states(&mut s1), vec![(11, 0), (22, 2)]);
    assert!(run.release_switch());
    while run.phase() != Phase::Switched {
        assert!(std::time::Instant::now() < deadline, "{:?}", run.status());
        std::thread::sleep(Duration::from_millis(20));
    }
    // The session is asked to log out within 2 seconds.
    let ev = s1.recv().expect("an async message");
    assert_eq!(ev.opcode(), op::ASYNC);
    assert_eq!(ev.bhs[36], 1, "logout requested");
    assert_eq!(u16::from_be_bytes([ev.bhs[42], ev.bhs[43]]), 2);
    // ALUA now: this site unavailable, the destination active/optimized.
    assert_eq!(port_group_states(&mut s1), vec![(11, 3), (22, 0)]);
    // A write the move failed gets no answer (the initiator reissues it at
    // the destination); the session itself still answers a ping.
    let w = s1.command_out(&write16(8, 1), &[0x77; 512]);
    s1.send(&w);
    let mut nop = Pdu::new(op::NOP_OUT);
    nop.bhs[0] |= 0x40;
    nop.bhs[1] = 0x80;
    nop.set_itt(0x4242);
    nop.set_u32(20, 0xffff_ffff);
    nop.set_u32(24, s1.cmdsn);
    s1.send(&nop);
    let answer = s1.recv().expect("an answer");
    assert_eq!(answer.opcode(), op::NOP_IN, "the write was answered");
    // Logout: answered, and the connection closes.
    let mut lo = Pdu::new(op::LOGOUT);
    lo.bhs[0] |= 0x40;
    lo.bhs[1] = 0x80;
    lo.set_itt(0x4343);
    lo.set_u32(24, s1.cmdsn);
    s1.send(&lo);
    let r = s1.recv().expect("a logout response");
    assert_eq!(r.opcode(), op::LOGOUT_RESPONSE);
    assert!(
        s1.recv().is_none(),
        "the connection stays open after logout"
    );
    // The write never happened anywhere.
    let copy = b.state.pool.get("v").unwrap();
    let mut buf = vec![0u8; 4096];
    copy.read_at(0, &mut buf).unwrap();
    assert!(buf[..4096].iter().all(|x| *x == 0x5a));
    copy.read_at(4096, &mut buf).unwrap();
    assert!(
        buf.iter().all(|x| *x == 0),
        "the withheld write was applied"
    );

    // A new login at the source is redirected to the destination's portal.
    let redirect = (1, 1); // target moved temporarily
    let (status, keys) = login_answer(pa, "v", 0, 1);
    assert_eq!(status, redirect);
    assert!(keys.contains(&format!("TargetAddress={pb},1")), "{keys:?}");
    // At the destination, the same groups the other way round.
    let mut sb = Raw::login(pb, "v", false);
    assert_eq!(port_group_states(&mut sb), vec![(22, 0), (11, 3)]);

    // The session that ignored the request is closed within the grace.
    let t = std::time::Instant::now();
    let ev = idle.recv().expect("an async message");
    assert_eq!((ev.opcode(), ev.bhs[36]), (op::ASYNC, 1));
    assert!(idle.recv().is_none());
    assert!(t.elapsed() < Duration::from_secs(9), "{:?}", t.elapsed());

    // The source's daemon stopped and started again: the redirect is kept
    // with the volume.
    drop((sb, v, run));
    a.stop();
    let meta = std::fs::read_to_string(dir.path().join("a/volumes/v/meta.json")).unwrap();
    assert!(meta.contains("peer_port"), "{meta}");
    let a = site("a", 11);
    let (status, keys) = login_answer(portals(&a)[0], "v", 0, 1);
    assert_eq!(status, redirect, "not redirected after a restart");
    assert!(keys.contains(&format!("TargetAddress={pb},1")), "{keys:?}");
}
