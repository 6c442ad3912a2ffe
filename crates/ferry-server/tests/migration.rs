//! Live migration between two real daemons over TLS: local rebuild, the
//! switch seen through `ferry host` by fio, refusals, and link faults and a
//! destination restart injected with toxiproxy.
// Test fixtures: sizes, offsets and byte patterns the test itself chooses.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

mod common;
#[path = "common/toxiproxy.rs"]
mod toxiproxy;

use common::{have, run, sha, trust_each_other, wait_report as wait, TestServer};
use ferry_migration_engine::source::{start, MigrateRequest};
use ferry_migration_engine::tls::CertStore;
use ferry_migration_engine::{MigrationResult, MigrationRun, Phase};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

fn destination(pool: &Path) -> TestServer {
    destination_on(pool, "127.0.0.1:0")
}

fn destination_on(pool: &Path, addr: &str) -> TestServer {
    let addr = addr.to_string();
    TestServer::start_with(pool, move |c| c.migration.listen = addr)
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

fn migrate(src: &TestServer, req: MigrateRequest) -> Arc<MigrationRun> {
    let _g = src.rt().enter();
    start(src.state.clone(), req).unwrap().run().clone()
}

fn request(volume: &str, to: String) -> MigrateRequest {
    MigrateRequest {
        volume: volume.into(),
        to,
        ..MigrateRequest::default()
    }
}

#[test]
fn migration_rebuilds_local_blocks_sends_the_rest_and_switches() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    let src = TestServer::start(&pa);
    let dst = destination(&pb);
    trust_each_other(&pa, &pb);

    // The destination holds a base image; the source volume is that base
    // plus new data, plus zeroes.
    let base = noise(24 * MIB as usize, 7);
    let extra = noise(8 * MIB as usize, 99);
    let b = dst.create("base", 64 * MIB);
    b.write_at(0, &base, false).unwrap();
    ferry_server::indexer::rebuild_volume(&dst.state.index, &b).unwrap();
    let v = src.create("vm", 64 * MIB);
    v.write_at(0, &base, false).unwrap();
    v.write_at(40 * MIB, &extra, false).unwrap();
    let wwn = v.meta().wwn;

    let to = dst.migration.unwrap().to_string();
    let r = wait(&migrate(&src, request("vm", to)), Duration::from_secs(120));
    assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
    assert!(r.digest.matches);
    assert_eq!(r.digest.source, r.digest.destination);
    assert!(r.tls);
    let base_chunks = 24 * MIB / 4096;
    let extra_chunks = 8 * MIB / 4096;
    assert_eq!(r.chunks.local, base_chunks, "{:?}", r.chunks);
    assert_eq!(r.chunks.sent, extra_chunks, "{:?}", r.chunks);
    assert_eq!(r.chunks.zero, 64 * MIB / 4096 - base_chunks - extra_chunks);
    // Literal data is what crossed; fingerprints are small next to it.
    assert!(r.bytes.data_raw == extra_chunks * 4096);
    assert!(r.bytes.wire_tx < (8 + 2) * MIB, "{:?}", r.bytes);
    assert_eq!(r.new_location.as_deref(), Some(&*dst.nbd.to_string()));

    // The copy is whole, complete, exported, and keeps the identity.
    let copy = dst.state.pool.get("vm").unwrap();
    assert!(copy.incoming().is_none());
    assert_eq!(copy.meta().wwn, wwn);
    assert_eq!(sha(v.data_path()), sha(copy.data_path()));
    if have("qemu-img") {
        run(Command::new("qemu-img").args([
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            &v.data_path().display().to_string(),
            &dst.uri("vm"),
        ]));
    }
    // The source refuses writes and reads, and says where the volume went.
    assert!(v.write_at(0, b"x", false).is_err());
    assert_eq!(v.moved_to(), Some(dst.nbd.to_string()));
    let e = src
        .rt()
        .block_on(ferry_client::NbdClient::connect(
            &src.nbd.to_string(),
            "vm",
            &Default::default(),
        ))
        .err()
        .expect("a moved export is refused");
    assert!(e.to_string().contains(ferry_nbd::MOVED_PREFIX), "{e}");
}

/// An XFS file system (extents shared between files) mounted on a loop
/// device under `dir`, unmounted when dropped; `None` where this machine
/// cannot make one (not root, no xfsprogs, no loop device).
struct XfsMount(std::path::PathBuf);

impl XfsMount {
    fn new(dir: &Path) -> Option<XfsMount> {
        let (img, mnt) = (dir.join("xfs.img"), dir.join("xfs"));
        std::fs::create_dir_all(&mnt).ok()?;
        std::fs::File::create(&img).ok()?.set_len(512 * MIB).ok()?;
        let ok = |c: &mut Command| c.output().is_ok_and(|o| o.status.success());
        if !have("mkfs.xfs")
            || !ok(Command::new("mkfs.xfs")
                .args(["-q", "-m", "reflink=1"])
                .arg(&img))
        {
            return None;
        }
        ok(Command::new("mount")
            .args(["-o", "loop"])
            .arg(&img)
            .arg(&mnt))
        .then_some(XfsMount(mnt))
    }

    /// Bytes in use on the file system.
    fn used(&self) -> u64 {
        self.df("used")
    }

    /// Bytes free on the file system.
    fn free(&self) -> u64 {
        self.df("avail")
    }

    /// One of `df`'s byte counts of the file system.
    fn df(&self, field: &str) -> u64 {
        let out = run(Command::new("df")
            .arg(format!("--output={field}"))
            .arg("-B1")
            .arg(&self.0));
        out.lines()
            .nth(1)
            .and_then(|l| l.trim().parse().ok())
            .unwrap_or_else(|| panic!("df's {field} bytes: {out}"))
    }
}

impl Drop for XfsMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A source, and a destination whose pool is on XFS holding `base` in
/// its indexed volume "base"; the source's volume "vm" (`size` bytes)
/// begins with the same bytes. Fields drop in order, the mount last.
struct HeldOnXfs {
    src: TestServer,
    dst: TestServer,
    base: Arc<ferry_storage::Volume>,
    vm: Arc<ferry_storage::Volume>,
    xfs: XfsMount,
}

impl HeldOnXfs {
    /// `None` (and says so) where no XFS can be made here; CI installs
    /// xfsprogs and runs as root, so there these tests run.
    fn new(dir: &Path, base: &[u8], size: u64) -> Option<HeldOnXfs> {
        Self::with_destination(dir, base, size, |_| {})
    }

    /// [`HeldOnXfs::new`], the destination's configuration changed by `f`.
    fn with_destination(
        dir: &Path,
        base: &[u8],
        size: u64,
        f: impl FnOnce(&mut ferry_server::config::Config) + Send + 'static,
    ) -> Option<HeldOnXfs> {
        let Some(xfs) = XfsMount::new(dir) else {
            eprintln!("skipped: no XFS file system could be made here (needs root, mkfs.xfs and a loop device)");
            return None;
        };
        let (pa, pb) = (dir.join("a"), xfs.0.join("b"));
        let src = TestServer::start(&pa);
        let dst = TestServer::start_with(&pb, move |c| {
            c.migration.listen = "127.0.0.1:0".into();
            f(c);
        });
        trust_each_other(&pa, &pb);
        let b = dst.create("base", base.len() as u64);
        b.write_at(0, base, false).unwrap();
        b.flush().unwrap();
        ferry_server::indexer::rebuild_volume(&dst.state.index, &b).unwrap();
        let vm = src.create("vm", size);
        vm.write_at(0, base, false).unwrap();
        Some(HeldOnXfs {
            src,
            dst,
            base: b,
            vm,
            xfs,
        })
    }

    fn migrate(&self) -> ferry_api::Report {
        let to = self.dst.migration.unwrap().to_string();
        let r = wait(
            &migrate(&self.src, request("vm", to)),
            Duration::from_secs(120),
        );
        assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
        assert!(r.digest.matches);
        r
    }
}

#[test]
fn blocks_the_destination_holds_share_their_extents_where_the_file_system_can() {
    let dir = tempfile::tempdir().unwrap();
    let base = noise(64 * MIB as usize, 7);
    let Some(t) = HeldOnXfs::new(dir.path(), &base, 96 * MIB) else {
        return;
    };
    t.vm.write_at(80 * MIB, &noise(4 * MIB as usize, 99), false)
        .unwrap();
    // The destination tells a controller asking about its index that
    // what it holds costs it only a read (the model prices it so).
    let lookup = ferry_api::AdminClient::new(&t.dst.admin.to_string())
        .index_lookup(&[], None)
        .unwrap();
    assert!(lookup.shares_extents, "{lookup:?}");
    let used = t.xfs.used();
    let r = t.migrate();
    assert_eq!(r.chunks.local, 64 * MIB / 4096, "{:?}", r.chunks);
    let copy = t.dst.state.pool.get("vm").unwrap();
    assert_eq!(sha(t.vm.data_path()), sha(copy.data_path()));
    // The 64 MiB found at the destination share the base's extents: the
    // file system grew by about the 4 MiB that crossed, not 68 MiB.
    let grown = t.xfs.used().saturating_sub(used);
    assert!(
        grown < 24 * MIB,
        "the destination's file system grew by {grown} bytes"
    );

    // Either copy written later leaves the other as it was.
    let before = sha(copy.data_path());
    t.base.write_at(0, &noise(MIB as usize, 5), false).unwrap();
    t.base.flush().unwrap();
    assert_eq!(sha(copy.data_path()), before);
    copy.write_at(MIB, &noise(MIB as usize, 6), false).unwrap();
    copy.flush().unwrap();
    let mut head = vec![0u8; 2 * MIB as usize];
    t.base.read_at(0, &mut head).unwrap();
    assert_eq!(&head[MIB as usize..], &base[MIB as usize..2 * MIB as usize]);
}

#[test]
fn a_destination_that_shares_extents_takes_a_copy_larger_than_its_free_space() {
    let dir = tempfile::tempdir().unwrap();
    let base = noise(64 * MIB as usize, 7);
    // Ten times the 64 MiB the destination holds, and 4 MiB it lacks:
    // more than its 512 MiB file system has free, most of it shared.
    let Some(t) = HeldOnXfs::new(dir.path(), &base, 644 * MIB) else {
        return;
    };
    for i in 1..10 {
        t.vm.write_at(i * 64 * MIB, &base, false).unwrap();
    }
    t.vm.write_at(640 * MIB, &noise(4 * MIB as usize, 99), false)
        .unwrap();
    assert!(t.vm.allocated_bytes() > t.xfs.free());
    let r = t.migrate();
    assert_eq!(r.chunks.local, 640 * MIB / 4096, "{:?}", r.chunks);
    let copy = t.dst.state.pool.get("vm").unwrap();
    assert_eq!(sha(t.vm.data_path()), sha(copy.data_path()));
}

#[test]
fn a_destination_that_shares_extents_refuses_a_copy_whose_missing_data_does_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    let base = noise(64 * MIB as usize, 7);
    let Some(t) = HeldOnXfs::new(dir.path(), &base, 64 * MIB + 640 * MIB) else {
        return;
    };
    // 640 MiB the destination lacks: more than its file system holds.
    // What it holds passes the check at the Hello; what must cross does
    // not, and the copy is refused while its prints are answered, before
    // its file system fills.
    for i in 0..10u64 {
        t.vm.write_at(
            64 * MIB + i * 64 * MIB,
            &noise(64 * MIB as usize, 100 + i),
            false,
        )
        .unwrap();
    }
    let to = t.dst.migration.unwrap().to_string();
    let r = wait(
        &migrate(&t.src, request("vm", to)),
        Duration::from_secs(120),
    );
    assert_eq!(r.result, MigrationResult::Failed, "{r:?}");
    let err = r.error.clone().unwrap_or_default();
    assert!(err.contains("not enough space"), "{err}");
    assert_eq!(r.attempts, 1, "a full disk is not retried: {r:?}");
    assert!(t.src.state.pool.get("vm").unwrap().moved_to().is_none());
    // The source's volume serves as before; the destination's file
    // system kept its reserve.
    t.vm.write_at(0, &[1; 4096], false).unwrap();
    assert!(t.xfs.free() > 32 * MIB);
}

#[test]
fn held_blocks_rewritten_while_they_are_shared_arrive_as_the_source_has_them() {
    let dir = tempfile::tempdir().unwrap();
    let Some(t) = HeldOnXfs::new(dir.path(), &noise(64 * MIB as usize, 7), 64 * MIB) else {
        return;
    };
    // The base is rewritten, a block at a time, all through the move: a
    // block found and then rewritten before its extents are shared must
    // not arrive as rewritten.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (b, stop) = (t.base.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && n < 10_000_000 {
                let block = (n * 7919) % (64 * MIB / 4096);
                b.write_at(block * 4096, &noise(4096, n + 1000), false)
                    .unwrap();
                n += 1;
                // Out of the gate most of the time, so that blocks are
                // found between its writes.
                std::thread::sleep(Duration::from_micros(50));
            }
            n
        })
    };
    let r = t.migrate();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let rewritten = writer.join().unwrap();
    let copy = t.dst.state.pool.get("vm").unwrap();
    assert_eq!(
        sha(t.vm.data_path()),
        sha(copy.data_path()),
        "{rewritten} blocks rewritten; {:?}",
        r.chunks
    );
}

/// Write `path`'s pages back and drop them from the page cache.
fn uncache(path: &Path) {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    f.sync_all().unwrap();
    // SAFETY: a valid descriptor; advice only.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(r, 0);
}

/// Bytes of `path` in the page cache (mincore of a mapping of it): what
/// was read or written since [`uncache`].
fn cached(path: &Path) -> u64 {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    let len = f.metadata().unwrap().len() as usize;
    // SAFETY: a shared read-only mapping of an open file of `len` bytes,
    // unmapped below; mincore fills one byte per page of it.
    unsafe {
        let m = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        );
        assert_ne!(m, libc::MAP_FAILED);
        let mut pages = vec![0u8; len.div_ceil(4096)];
        assert_eq!(libc::mincore(m, len, pages.as_mut_ptr()), 0);
        libc::munmap(m, len);
        pages.iter().filter(|p| **p & 1 == 1).count() as u64 * 4096
    }
}

/// Where the destination's pool shares extents, what it holds under
/// current index prints is shared without being read (and the source,
/// indexed too, reads nothing of it either); a run of the base written
/// since it was indexed (marked, not re-hashed: refreshes off) is not
/// trusted: read, found changed, and sent by the source.
#[test]
fn held_blocks_are_shared_unread_unless_written_since_they_were_indexed() {
    let dir = tempfile::tempdir().unwrap();
    let base = noise(64 * MIB as usize, 7);
    let Some(t) = HeldOnXfs::with_destination(dir.path(), &base, 64 * MIB, |c| {
        c.index.refresh_interval_ms = 0;
    }) else {
        return;
    };
    ferry_server::indexer::rebuild_volume(&t.src.state.index, &t.vm).unwrap();
    t.base
        .write_at(8 * MIB, &noise(4 * MIB as usize, 11), false)
        .unwrap();
    uncache(t.base.data_path());
    uncache(t.vm.data_path());
    let r = t.migrate();
    let per_mib = MIB / 4096;
    assert_eq!(r.chunks.local, 60 * per_mib, "{:?}", r.chunks);
    assert_eq!(r.chunks.sent, 4 * per_mib, "{:?}", r.chunks);
    assert_eq!(r.chunks.unread, 64 * per_mib, "{:?}", r.chunks);
    // Of the base, only the changed run was read; of the source, only
    // what was sent: not the 60 MiB shared.
    let (base_read, vm_read) = (cached(t.base.data_path()), cached(t.vm.data_path()));
    assert!(base_read <= 16 * MIB, "{base_read} bytes of the base read");
    assert!(vm_read <= 16 * MIB, "{vm_read} bytes of the source read");
    let copy = t.dst.state.pool.get("vm").unwrap();
    assert_eq!(sha(t.vm.data_path()), sha(copy.data_path()));
}

/// Wait (30 s at most) until `file` exists: a daemon writes its measures
/// on a blocking thread, off the migration's path.
fn wait_written(file: &Path) {
    let end = Instant::now() + Duration::from_secs(30);
    while !file.exists() {
        assert!(Instant::now() < end, "{} not written", file.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Move "vm" from `src` to `dst`; it switched, its digests matching.
fn move_vm(src: &TestServer, dst: &TestServer) -> ferry_api::Report {
    let r = wait(
        &migrate(src, request("vm", dst.migration.unwrap().to_string())),
        Duration::from_secs(120),
    );
    assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
    assert!(r.digest.matches);
    r
}

/// Where the destination's pool does not share extents, what it holds
/// under current index prints is copied by the kernel without being read
/// or hashed by the daemon; a run of the base written since it was
/// indexed (marked, not re-hashed: refreshes off) is not trusted: read,
/// found changed, and sent by the source. (With the marks ignored, the
/// rewritten run would be copied as it is now under its old print, and
/// both digests would agree on it.)
#[test]
fn held_blocks_are_copied_unread_unless_written_since_they_were_indexed() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    let src = TestServer::start(&pa);
    let dst = TestServer::start_with(&pb, |c| {
        c.migration.listen = "127.0.0.1:0".into();
        c.index.refresh_interval_ms = 0;
    });
    trust_each_other(&pa, &pb);
    let base = noise(64 * MIB as usize, 7);
    let b = dst.create("base", 64 * MIB);
    b.write_at(0, &base, false).unwrap();
    ferry_server::indexer::rebuild_volume(&dst.state.index, &b).unwrap();
    b.write_at(8 * MIB, &noise(4 * MIB as usize, 11), false)
        .unwrap();
    let v = src.create("vm", 64 * MIB);
    v.write_at(0, &base, false).unwrap();
    let lookup = |s: &TestServer| {
        ferry_api::AdminClient::new(&s.admin.to_string())
            .index_lookup(&[], None)
            .unwrap()
    };
    assert_eq!(lookup(&dst).rebuild_bps, None, "nothing rebuilt here yet");
    let r = move_vm(&src, &dst);
    let per_mib = MIB / 4096;
    assert_eq!(r.chunks.local, 60 * per_mib, "{:?}", r.chunks);
    assert_eq!(r.chunks.sent, 4 * per_mib, "{:?}", r.chunks);
    assert_eq!(
        sha(v.data_path()),
        sha(dst.state.pool.get("vm").unwrap().data_path())
    );
    // The destination timed its rebuild of the 60 MiB it held and tells
    // it with every lookup (the model prices a move here at it); the
    // source rebuilt nothing.
    let rate = lookup(&dst).rebuild_bps.expect("a measured rebuild rate");
    assert!(rate.is_finite() && rate > 0.0, "{rate}");
    assert_eq!(lookup(&src).rebuild_bps, None);
    // A restarted daemon still knows it (once written: off the commit's
    // path, on a blocking thread).
    let kept = pb.join(ferry_server::rebuild_rate::FILE);
    wait_written(&kept);
    dst.stop();
    let again = TestServer::start(&pb);
    let kept = lookup(&again).rebuild_bps.expect("the rate kept");
    assert!((kept - rate).abs() <= rate * 1e-9, "{kept} {rate}");

    // The source timed the link's round trip (its Ping) and keeps its
    // switch's hold less that round trip, told with every sample of its
    // volumes (the model prices a disk move's pause from here at it),
    // and kept across a restart.
    let rtt = r.time.link_rtt_ms.expect("a timed round trip");
    // The Ping is timed apart from the switch: on a loaded machine it can
    // take longer than the whole pause, whose hold is then kept as zero.
    assert!(rtt > 0.0 && r.time.pause_ms > 0.0, "{:?}", r.time);
    let hold_file = pa.join(ferry_server::switch_hold::FILE);
    wait_written(&hold_file);
    src.create("other", MIB);
    let sample = |s: &TestServer| {
        ferry_api::AdminClient::new(&s.admin.to_string())
            .sample_volume("other", 8)
            .unwrap()
    };
    let hold = |s: &TestServer| sample(s).switch_hold_s;
    // Kept, and its median not told before three are (a first switch's
    // outlier would be the median of one); the holds themselves are.
    let kept = || ferry_server::switch_hold::SwitchHold::open(hold_file.clone()).kept();
    let own = kept();
    assert_eq!(own.len(), 1, "{own:?}");
    let expected = (r.time.pause_ms - rtt).max(0.0) / 1e3;
    assert!((own[0] - expected).abs() < 1e-5, "{own:?} {:?}", r.time);
    assert_eq!(hold(&src), None, "one switch's median is not told");
    assert_eq!(sample(&src).switch_holds_s, own);
    again.create("other", MIB);
    assert_eq!(hold(&again), None, "the destination switched nothing");
    assert!(sample(&again).switch_holds_s.is_empty());
    src.stop();
    let src_again = TestServer::start(&pa);
    assert_eq!(hold(&src_again), None);
    assert_eq!(
        sample(&src_again).switch_holds_s,
        own,
        "told after a restart"
    );
    drop(src_again);
    assert_eq!(kept(), own, "kept across a restart");
    // A move that sent more than 4 MiB is not a measure of the daemons'
    // fixed work (the bytes' time hides it).
    let setups = ferry_server::move_setup::MoveSetup::open(pa.join(ferry_server::move_setup::FILE));
    assert!(
        setups.kept().is_empty(),
        "{:?} {:?}",
        setups.kept(),
        r.bytes
    );
}

/// A move that sends little (its first pass at most 4 MiB, straight to the
/// pause) is the source daemon's measure of its own fixed work: its time
/// less its pause and three round trips, told with every sample of its
/// volumes and kept across a restart.
#[test]
fn a_small_move_measures_the_daemons_fixed_work() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    let src = TestServer::start(&pa);
    let dst = destination(&pb);
    trust_each_other(&pa, &pb);
    let v = src.create("vm", 4 * MIB);
    v.write_at(0, &noise(MIB as usize, 5), false).unwrap();
    let r = move_vm(&src, &dst);
    assert!(r.bytes.wire_tx <= 4 * MIB, "{:?}", r.bytes);
    assert_eq!(r.rounds, 0, "{r:?}");
    let rtt = r.time.link_rtt_ms.expect("a timed round trip") / 1e3;
    let file = pa.join(ferry_server::move_setup::FILE);
    wait_written(&file);
    let kept = || ferry_server::move_setup::MoveSetup::open(file.clone()).kept();
    let own = kept();
    assert_eq!(own.len(), 1, "{own:?}");
    // At most the move's time less its pause and round trips (measured
    // a little before the report's total was taken), and not nothing.
    let most = r.time.total_s - r.time.pause_ms / 1e3 - 3.0 * rtt;
    assert!(
        own[0] > 0.0 && own[0] <= most + 1e-6,
        "{own:?} {:?}",
        r.time
    );
    src.create("other", MIB);
    let told = |s: &TestServer| {
        ferry_api::AdminClient::new(&s.admin.to_string())
            .sample_volume("other", 8)
            .unwrap()
            .move_setups_s
    };
    assert_eq!(told(&src), own);
    dst.create("other", MIB);
    assert!(told(&dst).is_empty(), "the destination sent nothing");
    src.stop();
    let again = TestServer::start(&pa);
    assert_eq!(told(&again), own, "kept across a restart");
}

/// The source prints from its index every chunk nothing wrote since the
/// index hashed it, unread, and reads and hashes the chunks written since:
/// a chunk changed, one that became a copy of what the destination holds,
/// one that became zeroes. The copy is the source's either way.
#[test]
fn the_source_prints_unread_what_was_not_written_since_it_was_indexed() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    // No re-hashing at the source: the marks stay as the writes left them.
    let src = TestServer::start_with(&pa, |c| c.index.refresh_interval_ms = 0);
    let dst = destination(&pb);
    trust_each_other(&pa, &pb);
    let base = noise(24 * MIB as usize, 7);
    let b = dst.create("base", 64 * MIB);
    b.write_at(0, &base, false).unwrap();
    ferry_server::indexer::rebuild_volume(&dst.state.index, &b).unwrap();
    let v = src.create("vm", 64 * MIB);
    v.write_at(0, &base, false).unwrap();
    v.write_at(30 * MIB, &noise(MIB as usize, 3), false)
        .unwrap();
    ferry_server::indexer::rebuild_volume(&src.state.index, &v).unwrap();
    // Written after it was indexed: new data over the base, a copy of the
    // base's first MiB where there was none, zeroes over other data.
    v.write_at(4 * MIB, &noise(MIB as usize, 5), false).unwrap();
    v.write_at(48 * MIB, &base[..MIB as usize], false).unwrap();
    v.write_at(30 * MIB, &vec![0u8; MIB as usize], false)
        .unwrap();
    let r = move_vm(&src, &dst);
    let per_mib = MIB / 4096;
    assert_eq!(
        r.chunks.unread,
        64 * per_mib - 3 * per_mib,
        "{:?}",
        r.chunks
    );
    assert_eq!(r.chunks.local, 24 * per_mib, "{:?}", r.chunks);
    assert_eq!(r.chunks.sent, per_mib, "{:?}", r.chunks);
    assert_eq!(r.chunks.zero, 64 * per_mib - 25 * per_mib, "{:?}", r.chunks);
    assert_eq!(
        sha(v.data_path()),
        sha(dst.state.pool.get("vm").unwrap().data_path())
    );
}

#[test]
fn index_off_sends_every_nonzero_block() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    let src = TestServer::start(&pa);
    let dst = destination(&pb);
    trust_each_other(&pa, &pb);
    let data = noise(4 * MIB as usize, 3);
    let b = dst.create("base", 16 * MIB);
    b.write_at(0, &data, false).unwrap();
    ferry_server::indexer::rebuild_volume(&dst.state.index, &b).unwrap();
    let v = src.create("vm", 16 * MIB);
    v.write_at(MIB, &data, false).unwrap();
    let mut req = request("vm", dst.migration.unwrap().to_string());
    req.dedup = false;
    let r = wait(&migrate(&src, req), Duration::from_secs(60));
    assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
    assert_eq!(r.chunks.local, 0);
    assert_eq!(r.chunks.sent, 4 * MIB / 4096);
    assert_eq!(
        sha(v.data_path()),
        sha(dst.state.pool.get("vm").unwrap().data_path())
    );
}

#[test]
fn untrusted_or_conflicting_destinations_refuse_and_the_source_is_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    let src = TestServer::start(&pa);
    let dst = destination(&pb);
    let v = src.create("vm", 8 * MIB);
    v.write_at(0, &noise(MIB as usize, 5), false).unwrap();
    let before = sha(v.data_path());
    let to = dst.migration.unwrap().to_string();

    // No trust either way: the TLS handshake fails at once (a trust
    // problem is not retried for `retry_for`), nothing is created.
    let started = Instant::now();
    let r = wait(
        &migrate(&src, request("vm", to.clone())),
        Duration::from_secs(30),
    );
    assert_eq!(r.result, MigrationResult::Failed);
    assert_eq!(r.attempts, 1, "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(
        r.error
            .as_deref()
            .unwrap_or("")
            .contains("TLS handshake refused"),
        "{r:?}"
    );
    // Trusted by the source only: the destination refuses the source's
    // certificate; also not retried.
    let sa = CertStore::new(&pa);
    sa.ensure_identity().unwrap();
    sa.trust(&CertStore::new(&pb).cert_path(), Some("b"), None)
        .unwrap();
    let started = Instant::now();
    let r = wait(
        &migrate(&src, request("vm", to.clone())),
        Duration::from_secs(30),
    );
    assert_eq!(r.result, MigrationResult::Failed);
    assert!(started.elapsed() < Duration::from_secs(10), "{r:?}");
    assert!(r.error.as_deref().unwrap_or("").contains("TLS"), "{r:?}");
    let mut req = request("vm", to.clone());
    req.retry_for = Duration::ZERO;
    assert!(dst.state.pool.get("vm").is_err());
    assert!(v.moved_to().is_none());
    v.write_at(0, b"still writable", false).unwrap();
    v.write_at(0, &noise(MIB as usize, 5), false).unwrap();
    assert!(v.bitmap_names().iter().all(|b| !b.starts_with("migration")));

    // Trusted, but the name is taken there: refused, not retried.
    trust_each_other(&pa, &pb);
    dst.create("vm", 8 * MIB);
    let r = wait(&migrate(&src, req), Duration::from_secs(30));
    assert_eq!(r.result, MigrationResult::Failed);
    assert!(r.error.unwrap().contains("already exists"));
    assert_eq!(r.attempts, 1);
    assert_eq!(sha(v.data_path()), before);
    assert!(v.moved_to().is_none());

    // Plaintext is refused by a TLS listener (no Hello gets through), and
    // the source says why at once instead of retrying for `retry_for`.
    let mut req = request("vm", to);
    req.plaintext = true;
    fails_at_once_saying(&src, req, "answered with TLS");

    // The other way round: a TLS source at a plaintext listener is
    // answered with a TLS alert and fails at once, saying why.
    let pc = dir.path().join("c");
    let plain = TestServer::start_with(&pc, |c| {
        c.migration.listen = "127.0.0.1:0".into();
        c.migration.plaintext = true;
    });
    trust_each_other(&pa, &pc);
    let to_plain = plain.migration.unwrap().to_string();
    fails_at_once_saying(&src, request("vm", to_plain), "listens without TLS");
    assert!(plain.state.pool.get("vm").is_err());
}

/// The migration fails in one attempt, well within the retry window, and
/// its error says `why`.
fn fails_at_once_saying(src: &TestServer, req: MigrateRequest, why: &str) {
    let started = Instant::now();
    let r = wait(&migrate(src, req), Duration::from_secs(30));
    assert_eq!(r.result, MigrationResult::Failed);
    assert_eq!(r.attempts, 1, "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(10), "{r:?}");
    assert!(r.error.as_deref().unwrap_or("").contains(why), "{r:?}");
}

#[test]
fn fio_writes_through_ferry_host_see_no_error_across_the_switch() {
    fio_across_a_held_switch(false);
}

/// The release of a held switch that comes while a round sent during the
/// hold waits for its answer: the pause goes on without it (the answer is
/// read before the verdict), and no write is lost or refused.
#[test]
fn a_switch_released_while_a_held_round_is_answered_loses_no_write() {
    fio_across_a_held_switch(true);
}

/// fio writes (and verifies) through a forwarder while its volume migrates
/// with the switch held, released once converged, or with `mid_round`
/// right after a held round went out (while its answer is on its way).
fn fio_across_a_held_switch(mid_round: bool) {
    if !have("fio") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    let src = TestServer::start(&pa);
    let dst = destination(&pb);
    trust_each_other(&pa, &pb);
    let v = src.create("vm", 128 * MIB);
    v.write_at(0, &noise(16 * MIB as usize, 11), false).unwrap();

    // The agent, on its own runtime like a separate process.
    let agent_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let up = Arc::new(
        agent_rt
            .block_on(ferry_forwarder::Upstream::connect(
                &src.nbd.to_string(),
                "vm",
                ferry_forwarder::DEFAULT_HOLD,
            ))
            .unwrap(),
    );
    let listener = agent_rt
        .block_on(ferry_forwarder::Listener::bind("127.0.0.1:0"))
        .unwrap();
    let agent_addr = listener.local_addr().unwrap();
    agent_rt.spawn(ferry_forwarder::serve(
        listener,
        ferry_forwarder::Agent::single(up.clone()),
        shutdown.clone(),
    ));

    let fio_spawned = Instant::now();
    let fio = std::thread::spawn(move || {
        Command::new("fio")
            .args([
                "--name=verify",
                "--ioengine=nbd",
                &format!("--uri=nbd://{agent_addr}/vm"),
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=8",
                "--offset=64m",
                "--size=32m",
                "--rate=2m",
                "--verify=crc32c",
                "--verify_fatal=1",
                "--do_verify=1",
            ])
            .current_dir(std::env::temp_dir())
            .output()
            .unwrap()
    });
    std::thread::sleep(Duration::from_millis(1500));
    // fio writes each block of its 32 MiB once (16 s at its rate), then
    // reads them all back to check them. The switch is held until the copy
    // has converged, then let go while fio still writes: without the hold a
    // slow machine could finish the copy after fio's last write, and nothing
    // would cross the switch. The copy is not rate-limited, so it converges
    // well within fio's writes even on a slow machine.
    let mut req = request("vm", dst.migration.unwrap().to_string());
    req.hold_switch = true;
    let run = migrate(&src, req);
    let deadline = Instant::now() + Duration::from_secs(120);
    wait_ready_to_switch(&run, deadline);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !fio.is_finished(),
        "fio ended before the copy converged: {:?}",
        run.status()
    );
    if mid_round {
        // The round counter moves once a held round's data is out, before
        // its end is sent and answered.
        let r0 = run
            .counters
            .rounds
            .load(std::sync::atomic::Ordering::Relaxed);
        while run
            .counters
            .rounds
            .load(std::sync::atomic::Ordering::Relaxed)
            == r0
        {
            assert!(Instant::now() < deadline, "{:?}", run.status());
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    let released_after = fio_spawned.elapsed();
    assert!(run.release_switch());
    let r = wait(&run, Duration::from_secs(120));
    assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
    let out = fio.join().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "fio failed:\n{text}");
    assert!(text.contains("err= 0"), "{text}");
    // The check read back all it wrote, through the destination (a
    // time-based job would print `READ: … io=0B`: it checks nothing).
    assert!(
        text.lines()
            .any(|l| l.trim_start().starts_with("READ:") && l.contains("io=32.0MiB")),
        "{text}"
    );
    // The switch was let go before fio's writes ended (its read-back
    // alone would cross it on a machine slow to converge).
    let writing = fio_phase_ms(&text, "WRITE:").expect("fio's WRITE line");
    assert!(
        released_after < Duration::from_millis(writing),
        "released {released_after:?} after fio started, its writes took {writing} ms"
    );
    let (switches, _, _) = up.stats();
    assert_eq!(switches, 1);
    assert_eq!(up.server(), dst.nbd.to_string());
    shutdown.cancel();
}

/// How long fio's job ran the phase its summary line `what` (`READ:` or
/// `WRITE:`) reports: the first figure of its `run=A-Bmsec`.
fn fio_phase_ms(text: &str, what: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.trim_start().starts_with(what))?;
    let run = line.split("run=").nth(1)?;
    run.split(['-', 'm']).next()?.parse().ok()
}

/// Wait until a held migration has converged and holds before its switch.
fn wait_ready_to_switch(run: &MigrationRun, deadline: Instant) {
    while run.phase() != Phase::ReadyToSwitch {
        assert!(!run.phase().is_terminal(), "{:?}", run.status());
        assert!(Instant::now() < deadline, "{:?}", run.status());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Wait until the destination copy holds `bytes` of data.
fn wait_for_bytes_at(
    dst: &TestServer,
    name: &str,
    bytes: u64,
    deadline: Instant,
    run: &MigrationRun,
) {
    loop {
        if let Ok(v) = dst.state.pool.get(name) {
            if v.allocated_bytes() >= bytes {
                return;
            }
        }
        assert!(Instant::now() < deadline, "no progress: {:?}", run.status());
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_cut_link_resumes_without_resending_what_arrived() {
    if !have("toxiproxy-server") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    let src = TestServer::start(&pa);
    let dst = destination(&pb);
    trust_each_other(&pa, &pb);
    let v = src.create("vm", 64 * MIB);
    v.write_at(0, &noise(32 * MIB as usize, 21), false).unwrap();
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
    let mut req = request("vm", to);
    req.compress = false;
    let run = migrate(&src, req);
    let deadline = Instant::now() + Duration::from_secs(60);
    wait_for_bytes_at(&dst, "vm", 8 * MIB, deadline, &run);
    tp.cut_until_retried("mig", &run, deadline);
    std::thread::sleep(Duration::from_millis(300));
    tp.remove_toxic("mig", "cut");
    let r = wait(&run, Duration::from_secs(120));
    assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
    assert!(r.attempts >= 2, "{r:?}");
    assert!(r.chunks.resumed > 0, "nothing kept: {:?}", r.chunks);
    assert!(r.bytes.resent_after_failures > 0);
    // The last attempt sent only what had not arrived before.
    assert!(r.chunks.sent < 32 * MIB / 4096, "{:?}", r.chunks);
    assert_eq!(
        sha(v.data_path()),
        sha(dst.state.pool.get("vm").unwrap().data_path())
    );
}

#[test]
fn a_restarted_destination_resumes_into_its_incomplete_copy() {
    if !have("toxiproxy-server") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    let src = TestServer::start(&pa);
    let dst = destination(&pb);
    trust_each_other(&pa, &pb);
    let v = src.create("vm", 64 * MIB);
    v.write_at(0, &noise(32 * MIB as usize, 33), false).unwrap();
    let tp = toxiproxy::Toxiproxy::start();
    let to = tp.proxy("mig", &dst.migration.unwrap().to_string());
    tp.add_toxic(
        "mig",
        "slow",
        "bandwidth",
        "upstream",
        serde_json::json!({"rate": 16_000}),
    );
    let mut req = request("vm", to);
    req.compress = false;
    let run = migrate(&src, req);
    let deadline = Instant::now() + Duration::from_secs(60);
    wait_for_bytes_at(&dst, "vm", 8 * MIB, deadline, &run);
    dst.stop();
    // Back on the same pool, on a new port behind the same proxy.
    let dst = destination(&pb);
    let copy = dst.state.pool.get("vm").unwrap();
    assert!(
        copy.incoming().is_some(),
        "the copy must be marked incomplete"
    );
    tp.set_upstream("mig", &dst.migration.unwrap().to_string());
    tp.remove_toxic("mig", "slow");
    let r = wait(&run, Duration::from_secs(120));
    assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
    assert!(r.attempts >= 2);
    assert!(r.chunks.resumed > 0, "{:?}", r.chunks);
    assert_eq!(
        sha(v.data_path()),
        sha(dst.state.pool.get("vm").unwrap().data_path())
    );
}

#[test]
fn writes_during_the_migration_arrive_and_auto_converge_reports() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    let src = TestServer::start(&pa);
    let dst = destination(&pb);
    trust_each_other(&pa, &pb);
    let v = src.create("vm", 64 * MIB);
    v.write_at(0, &noise(16 * MIB as usize, 44), false).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (v2, stop2) = (v.clone(), stop.clone());
    // A guest writing as fast as it can, until the switch stops it.
    let writer = std::thread::spawn(move || {
        let mut n = 0u64;
        let block = noise(64 << 10, 5);
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
            let off = (n * 7919 % 1000) * (64 << 10);
            if v2.write_at(off, &block, false).is_err() {
                break;
            }
            n += 1;
        }
        n
    });
    let mut req = request("vm", dst.migration.unwrap().to_string());
    req.bwlimit = 16 * MIB;
    req.max_downtime = Duration::from_millis(50);
    let r = wait(&migrate(&src, req), Duration::from_secs(120));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let writes = writer.join().unwrap();
    assert!(r.converged, "{r:?}");
    assert!(
        r.auto_converge.max_delay_us > 0,
        "the guest outran the link; it must be slowed: {r:?}"
    );
    // The report counts what the slowing cost the writer at the least.
    #[allow(clippy::cast_precision_loss)]
    let least = r.auto_converge.max_delay_us as f64 / 1e3;
    assert!(r.time.slowest_write_ms >= least, "{r:?}");
    assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
    assert!(writes > 0);
    assert!(r.rounds >= 1, "{r:?}");
    assert!(r.chunks.dirty_resent > 0);
    assert_eq!(
        sha(v.data_path()),
        sha(dst.state.pool.get("vm").unwrap().data_path())
    );
}

#[test]
fn a_link_lost_at_the_switch_keeps_writes_held_until_the_outcome_is_known() {
    if !have("toxiproxy-server") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    let src = TestServer::start(&pa);
    let dst = destination(&pb);
    trust_each_other(&pa, &pb);
    let v = src.create("vm", 32 * MIB);
    v.write_at(0, &noise(4 * MIB as usize, 55), false).unwrap();
    let tp = toxiproxy::Toxiproxy::start();
    let to = tp.proxy("mig", &dst.migration.unwrap().to_string());
    // Slow answers give the test time to cut the way back once the pause starts.
    tp.add_toxic(
        "mig",
        "slow",
        "latency",
        "downstream",
        serde_json::json!({"latency": 300}),
    );
    let run = migrate(&src, request("vm", to));
    let deadline = Instant::now() + Duration::from_secs(60);
    while run.phase() != Phase::Paused {
        assert!(
            Instant::now() < deadline,
            "never paused: {:?}",
            run.status()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // The destination gets Switch and commits; its Done never arrives.
    tp.add_toxic(
        "mig",
        "void",
        "timeout",
        "downstream",
        serde_json::json!({"timeout": 0}),
    );
    toxiproxy::wait_for_retry(&run, deadline);
    // Meanwhile the guest's writes are held, not failed and not applied.
    assert!(v.gate().is_paused());
    let copy = dst.state.pool.get("vm").unwrap();
    assert!(copy.incoming().is_none(), "the destination committed");
    tp.remove_toxic("mig", "void");
    let r = wait(&run, Duration::from_secs(60));
    assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
    assert!(r.attempts >= 2);
    assert_eq!(v.moved_to(), Some(dst.nbd.to_string()));
    assert!(!v.gate().is_paused());
    assert!(v.write_at(0, b"late", false).is_err());
    assert_eq!(sha(v.data_path()), sha(copy.data_path()));
}

#[test]
fn a_buddy_on_the_destination_site_supplies_blocks_the_destination_lacks() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb, pc) = (
        dir.path().join("a"),
        dir.path().join("b"),
        dir.path().join("c"),
    );
    let src = TestServer::start(&pa);
    let buddy = destination(&pc);
    let buddy_addr = buddy.migration.unwrap().to_string();
    let dst = TestServer::start_with(&pb, move |c| {
        c.migration.listen = "127.0.0.1:0".into();
        c.migration.buddies = vec!["127.0.0.1:1".into(), buddy_addr];
    });
    trust_each_other(&pa, &pb);
    trust_each_other(&pb, &pc);
    // The base image is on the buddy only; the destination itself is empty.
    let base = noise(8 * MIB as usize, 77);
    let extra = noise(2 * MIB as usize, 78);
    let b = buddy.create("golden", 16 * MIB);
    b.write_at(0, &base, false).unwrap();
    ferry_server::indexer::rebuild_volume(&buddy.state.index, &b).unwrap();
    let v = src.create("vm", 16 * MIB);
    v.write_at(0, &base, false).unwrap();
    v.write_at(12 * MIB, &extra, false).unwrap();
    let r = wait(
        &migrate(&src, request("vm", dst.migration.unwrap().to_string())),
        Duration::from_secs(60),
    );
    assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
    // One buddy address is dead; the live one supplied the base.
    assert_eq!(r.chunks.buddy, 8 * MIB / 4096, "{:?}", r.chunks);
    assert_eq!(r.chunks.local, 0);
    assert_eq!(r.chunks.sent, 2 * MIB / 4096);
    assert_eq!(
        sha(v.data_path()),
        sha(dst.state.pool.get("vm").unwrap().data_path())
    );
}

#[test]
fn a_link_cut_during_the_dirty_rounds_resumes_and_loses_no_write() {
    if !have("toxiproxy-server") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    let src = TestServer::start(&pa);
    let dst = destination(&pb);
    trust_each_other(&pa, &pb);
    let v = src.create("vm", 32 * MIB);
    v.write_at(0, &noise(8 * MIB as usize, 66), false).unwrap();
    let tp = toxiproxy::Toxiproxy::start();
    let to = tp.proxy("mig", &dst.migration.unwrap().to_string());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (v2, stop2) = (v.clone(), stop.clone());
    let writer = std::thread::spawn(move || {
        let block = noise(4096, 9);
        let mut n = 0u64;
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
            if v2
                .write_at((n * 7919 % 4096) * 4096, &block, false)
                .is_err()
            {
                break;
            }
            n += 1;
            std::thread::sleep(Duration::from_micros(200));
        }
    });
    let mut req = request("vm", to);
    req.bwlimit = 4 * MIB;
    req.max_downtime = Duration::from_millis(20);
    let run = migrate(&src, req);
    let deadline = Instant::now() + Duration::from_secs(60);
    while run.phase() != Phase::Rounds {
        assert!(Instant::now() < deadline, "no rounds: {:?}", run.status());
        std::thread::sleep(Duration::from_millis(5));
    }
    tp.cut_until_retried("mig", &run, deadline);
    tp.remove_toxic("mig", "cut");
    let r = wait(&run, Duration::from_secs(120));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
    assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
    assert!(r.attempts >= 2);
    assert!(r.chunks.resumed > 0, "{:?}", r.chunks);
    assert_eq!(
        sha(v.data_path()),
        sha(dst.state.pool.get("vm").unwrap().data_path())
    );
}

/// A volume the destination has nothing like: after two frames of prints
/// found almost nothing, the rest goes as data without prints, so the
/// migration costs about what one without prints does.
#[test]
fn prints_stop_when_the_destination_holds_nothing_alike() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    let src = TestServer::start(&pa);
    let dst = destination(&pb);
    trust_each_other(&pa, &pb);
    let data = noise(256 * MIB as usize, 11);
    let to = dst.migration.unwrap().to_string();
    let mut reports = Vec::new();
    for (name, dedup) in [("with-prints", true), ("without", false)] {
        let v = src.create(name, 256 * MIB);
        v.write_at(0, &data, false).unwrap();
        let mut req = request(name, to.clone());
        req.dedup = dedup;
        req.compress = false;
        let r = wait(&migrate(&src, req), Duration::from_secs(120));
        assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
        assert_eq!(r.chunks.sent, 256 * MIB / 4096, "{r:?}");
        assert_eq!(
            sha(v.data_path()),
            sha(dst.state.pool.get(name).unwrap().data_path())
        );
        reports.push(r);
    }
    let (with, without) = (&reports[0], &reports[1]);
    // The first 16,384 keys are judged, at the next frame of 8,192 keys
    // sent once they are answered; the scan runs at most 32,768 keys ahead
    // of the answers, so at least an eighth of the volume's 65,536 chunks
    // goes without prints (a quarter or more unless the destination is
    // slow to answer: under a loaded machine, less).
    assert!(
        with.chunks.unprinted >= 256 * MIB / 4096 / 8,
        "prints went on: {with:?}"
    );
    #[allow(clippy::cast_precision_loss)]
    let ratio = with.bytes.wire_tx as f64 / without.bytes.wire_tx as f64;
    assert!(
        ratio < 1.01,
        "with prints {ratio:.4}x without: {with:?} {without:?}"
    );
}

/// Attacks on the WAN-facing migration listener (docs/security.md): a
/// certificate the destination pinned as a *host* cannot open a
/// migration (one kind of peer cannot act as another); a hundred idle
/// connections from one address are capped and, unauthenticated, closed at
/// the handshake deadline, while a real migration from another address
/// runs and switches.
#[test]
fn the_migration_listener_takes_only_storage_peers_and_idle_strangers_cannot_fill_it() {
    use ferry_trust::Role;
    use tokio::io::AsyncReadExt;
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    let src = TestServer::start(&pa);
    let dst = destination(&pb);
    trust_each_other(&pa, &pb);
    let to = dst.migration.unwrap();

    // A host's certificate, pinned at the destination as a host.
    let host = CertStore::at(&dir.path().join("host-tls"), Role::Host);
    host.ensure_identity().unwrap();
    CertStore::new(&pb)
        .trust(&host.cert_path(), Some("h"), Some(Role::Host))
        .unwrap();
    host.trust(
        &CertStore::new(&pb).cert_path(),
        Some("dst"),
        Some(Role::Storage),
    )
    .unwrap();
    let refused = src.rt().block_on(async {
        let cfg = host.api_client_config(&[Role::Storage]).unwrap();
        let tcp = tokio::net::TcpStream::connect(to).await.unwrap();
        let tls = tokio_rustls::TlsConnector::from(cfg)
            .connect(ferry_migration_engine::tls::server_name(), tcp)
            .await;
        match tls {
            Err(_) => true,
            // TLS 1.3: the server's verdict on our certificate comes with
            // the first read.
            Ok(mut s) => {
                let mut b = [0u8; 1];
                matches!(
                    tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await,
                    Ok(Err(_) | Ok(0))
                )
            }
        }
    });
    assert!(
        refused,
        "a host certificate was let into the migration listener"
    );

    // A hundred idle connections from 127.0.0.2.
    let idle: Vec<tokio::net::TcpStream> = src.rt().block_on(async {
        let mut v = Vec::new();
        for _ in 0..100 {
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            s.bind("127.0.0.2:0".parse().unwrap()).unwrap();
            v.push(s.connect(to).await.unwrap());
        }
        v
    });
    let closed_at_once = src.rt().block_on(async {
        let mut n = 0;
        for s in &idle {
            let mut b = [0u8; 1];
            if let Ok(Ok(0) | Err(_)) =
                tokio::time::timeout(Duration::from_millis(50), s.peek(&mut b)).await
            {
                n += 1;
            }
        }
        n
    });
    let cap = ferry_migration_engine::destination::MIGRATION_LIMITS.per_peer;
    assert!(
        closed_at_once >= 100 - cap,
        "only {closed_at_once} of 100 idle connections were refused at once (cap {cap} per peer)"
    );

    // A real migration from 127.0.0.1 runs beside them.
    let v = src.create("vm", 16 * MIB);
    v.write_at(0, &noise(4 * MIB as usize, 5), false).unwrap();
    let r = wait(
        &migrate(&src, request("vm", to.to_string())),
        Duration::from_secs(120),
    );
    assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
    assert!(r.digest.matches);

    // The idle ones never authenticated: closed at the handshake deadline.
    let deadline = ferry_migration_engine::destination::HANDSHAKE_DEADLINE;
    let all_closed = src.rt().block_on(async {
        let end = tokio::time::Instant::now() + deadline + Duration::from_secs(5);
        for s in &idle {
            let mut b = [0u8; 1];
            match tokio::time::timeout_at(end, s.peek(&mut b)).await {
                Ok(Ok(0) | Err(_)) => {}
                _ => return false,
            }
        }
        true
    });
    assert!(
        all_closed,
        "idle connections outlived the handshake deadline"
    );
}

/// Start a migration of `volume` over a slow proxy, let 8 MiB arrive, and
/// cancel it at the source: the destination keeps an incomplete copy, as a
/// failed move leaves one.
fn leave_an_incomplete_copy(
    src: &TestServer,
    dst: &TestServer,
    tp: &toxiproxy::Toxiproxy,
    volume: &str,
) -> String {
    let to = tp.proxy(volume, &dst.migration.unwrap().to_string());
    tp.add_toxic(
        volume,
        "slow",
        "bandwidth",
        "upstream",
        serde_json::json!({"rate": 8_000}),
    );
    let mut req = request(volume, to.clone());
    req.compress = false;
    let run = migrate(src, req);
    wait_for_bytes_at(
        dst,
        volume,
        8 * MIB,
        Instant::now() + Duration::from_secs(60),
        &run,
    );
    run.cancel.cancel();
    assert_eq!(
        wait(&run, Duration::from_secs(30)).result,
        MigrationResult::Failed
    );
    let copy = dst.state.pool.get(volume).unwrap();
    assert_eq!(copy.incoming().unwrap().id, run.id.to_string());
    // The destination notices the closed link and lets the copy go.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !copy.held_by().is_empty() {
        assert!(Instant::now() < deadline, "the copy stays held");
        std::thread::sleep(Duration::from_millis(20));
    }
    tp.remove_toxic(volume, "slow");
    to
}

/// A move tried again under a new id, as a teleport or the controller does.
fn again(volume: &str, to: &str) -> MigrateRequest {
    let mut req = request(volume, to.to_string());
    req.id = Some(ferry_api::MigrationId::random());
    req
}

#[test]
fn a_failed_migrations_leftover_is_resumed_or_replaced_refused_when_foreign_and_cleared_when_stale()
{
    assert!(
        have("toxiproxy-server"),
        "the test command installs toxiproxy"
    );
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    let src = TestServer::start(&pa);
    let keep_copies = |c: &mut ferry_server::config::Config| {
        c.migration.listen = "127.0.0.1:0".into();
        c.migration.incomplete_ttl_secs = 0;
    };
    let dst = TestServer::start_with(&pb, keep_copies);
    trust_each_other(&pa, &pb);
    let tp = toxiproxy::Toxiproxy::start();
    for (name, seed) in [("vm", 61), ("web", 62), ("db", 63)] {
        let v = src.create(name, 64 * MIB);
        v.write_at(0, &noise(32 * MIB as usize, seed), false)
            .unwrap();
    }

    // The same volume again: resumed, what arrived kept.
    let to = leave_an_incomplete_copy(&src, &dst, &tp, "vm");
    let admin = ferry_api::AdminClient::new(&format!("http://{}", dst.admin));
    let shown = admin.volume("vm").unwrap().unwrap();
    let inc = shown.incoming.expect("the copy shows as incomplete");
    assert!(
        inc.started_unix > 0 && inc.touched_unix >= inc.started_unix,
        "{inc:?}"
    );
    assert_eq!(inc.source, "127.0.0.1");
    let r = wait(&migrate(&src, again("vm", &to)), Duration::from_secs(120));
    assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
    assert_eq!(
        r.destination_copy,
        ferry_api::DestinationCopy::LeftoverResumed
    );
    assert!(r.chunks.resumed >= 8 * MIB / 4096 / 2, "{:?}", r.chunks);
    assert_eq!(
        sha(src.state.pool.get("vm").unwrap().data_path()),
        sha(dst.state.pool.get("vm").unwrap().data_path())
    );

    // The same volume grown since: the leftover cannot be resumed, it is
    // replaced.
    let to = leave_an_incomplete_copy(&src, &dst, &tp, "web");
    src.state
        .pool
        .get("web")
        .unwrap()
        .resize(96 * MIB, false)
        .unwrap();
    let r = wait(&migrate(&src, again("web", &to)), Duration::from_secs(120));
    assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
    assert_eq!(
        r.destination_copy,
        ferry_api::DestinationCopy::LeftoverReplaced
    );
    assert_eq!(dst.state.pool.get("web").unwrap().size(), 96 * MIB);
    assert_eq!(
        sha(src.state.pool.get("web").unwrap().data_path()),
        sha(dst.state.pool.get("web").unwrap().data_path())
    );

    // Another volume with the same name (a new identity): refused, and the
    // message says how to clear the copy; the leftover is untouched.
    let to = leave_an_incomplete_copy(&src, &dst, &tp, "db");
    src.state.pool.delete("db", false).unwrap();
    src.create("db", 64 * MIB);
    let r = wait(&migrate(&src, again("db", &to)), Duration::from_secs(60));
    assert_eq!(r.result, MigrationResult::Failed, "{r:?}");
    let why = r.error.unwrap_or_default();
    assert!(
        why.contains("another volume") && why.contains("ferry volume delete db"),
        "{why}"
    );
    assert_eq!(r.attempts, 1, "a refusal is not retried");
    assert!(dst.state.pool.get("db").unwrap().incoming().is_some());

    // A daemon that deletes copies untouched for 2 s clears it.
    dst.stop();
    let dst = TestServer::start_with(&pb, |c| {
        keep_copies(c);
        c.migration.incomplete_ttl_secs = 2;
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while dst.state.pool.get("db").is_ok() {
        assert!(Instant::now() < deadline, "the stale copy stays");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(dst.state.pool.get("vm").unwrap().incoming().is_none());
    // Its files go just after it leaves the pool's map (renamed aside,
    // then removed).
    while pb.join("volumes").join("db").exists() {
        assert!(Instant::now() < deadline, "the stale copy's files stay");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The `Prints` bytes and the data a migration sent, for the report.
fn crossed(r: &ferry_api::Report) -> (u64, u64) {
    (r.bytes.fingerprints, r.chunks.sent + r.chunks.dirty_resent)
}

#[test]
fn a_return_trip_prints_only_what_was_written_since_and_a_wrong_claim_is_caught() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    let a = destination(&pa);
    let mut b = destination(&pb);
    trust_each_other(&pa, &pb);
    let v = a.create("vm", 64 * MIB);
    v.write_at(0, &noise(32 * MIB as usize, 21), false).unwrap();
    let nonzero = 32 * MIB / 4096;

    let to_b = b.migration.unwrap().to_string();
    let out = wait(&migrate(&a, request("vm", to_b)), Duration::from_secs(120));
    assert_eq!(out.result, MigrationResult::Switched, "{out:?}");
    assert_eq!(out.destination_copy, ferry_api::DestinationCopy::New);
    assert_eq!(out.chunks.unchanged, 0);
    let full_prints = out.bytes.fingerprints;

    // Written at B: 1 MiB over the data, 1 MiB where there was none. A
    // clean restart of B keeps what it tracked.
    let at_b = b.state.pool.get("vm").unwrap();
    at_b.write_at(MIB, &noise(MIB as usize, 22), false).unwrap();
    at_b.write_at(48 * MIB, &noise(MIB as usize, 23), false)
        .unwrap();
    drop(at_b);
    b.stop();
    b = destination(&pb);

    // Home again: only the written chunks are printed; the rest the copy A
    // kept holds as it is.
    let back = tracked_return(&b, &a, Duration::from_secs(120));
    assert_eq!(
        back.chunks.unchanged,
        nonzero - MIB / 4096,
        "{:?}",
        back.chunks
    );
    let (prints, sent) = crossed(&back);
    assert!(prints * 10 < full_prints, "{prints} against {full_prints}");
    assert_eq!(sent, 2 * MIB / 4096, "{:?}", back.chunks);
    let home = a.state.pool.get("vm").unwrap();
    assert_eq!(
        sha(home.data_path()),
        sha(b.state.pool.get("vm").unwrap().data_path())
    );

    // Out again with nothing written at A: nothing is printed or sent.
    let out = tracked_return(&a, &b, Duration::from_secs(120));
    assert_eq!(
        out.chunks.unchanged,
        nonzero + MIB / 4096,
        "{:?}",
        out.chunks
    );
    assert_eq!(crossed(&out).1, 0, "{:?}", out.chunks);

    // A change the tracking did not see (the backing file written behind
    // the daemon's back): the claim is wrong, the digests differ, and the
    // volume stays at B, whole. Nothing marks such a write, so B's index
    // prints would vouch for the old block too and both digests would
    // agree on it; it is caught once B's index hashes the volume again
    // (what `ferry index rebuild` does), as here.
    let at_b = b.state.pool.get("vm").unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(at_b.data_path())
            .unwrap();
        f.write_all_at(&noise(4096, 24), 5 * MIB).unwrap();
    }
    ferry_server::indexer::rebuild_volume(&b.state.index, &at_b).unwrap();
    let to_a = a.migration.unwrap().to_string();
    let bad = wait(
        &migrate(&b, request("vm", to_a.clone())),
        Duration::from_secs(120),
    );
    assert_eq!(bad.result, MigrationResult::Failed, "{bad:?}");
    assert!(bad.error.unwrap_or_default().contains("digests differ"));
    assert!(at_b.is_serving() && at_b.moved_to().is_none());
    // The same command again resumes the journaled migration (same id),
    // into the copy A no longer trusts: every chunk is printed, and the
    // volume arrives whole.
    let again = wait(
        &migrate(&b, request("vm", to_a.clone())),
        Duration::from_secs(120),
    );
    assert_eq!(again.id, bad.id);
    assert_eq!(again.result, MigrationResult::Switched, "{again:?}");
    assert_eq!(again.destination_copy, ferry_api::DestinationCopy::Resumed);
    assert_eq!(again.chunks.unchanged, 0);
    assert_eq!(
        sha(at_b.data_path()),
        sha(a.state.pool.get("vm").unwrap().data_path())
    );
}

/// Volume "vm" migrated from `from` to `to`, which holds the copy it left
/// there: the report of a tracked return that switched.
fn tracked_return(from: &TestServer, to: &TestServer, within: Duration) -> ferry_api::Report {
    let r = wait(
        &migrate(from, request("vm", to.migration.unwrap().to_string())),
        within,
    );
    assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
    assert_eq!(
        r.destination_copy,
        ferry_api::DestinationCopy::ReturnedTracked
    );
    r
}

/// Two daemons under `dir` that trust each other, and a 64 MiB volume
/// "vm" (32 MiB of noise from `seed`) migrated from the first to the
/// second: the first keeps its moved-away copy.
fn moved_to_b(dir: &Path, seed: u64) -> (TestServer, TestServer) {
    let (pa, pb) = (dir.join("a"), dir.join("b"));
    let a = destination(&pa);
    let b = destination(&pb);
    trust_each_other(&pa, &pb);
    let v = a.create("vm", 64 * MIB);
    v.write_at(0, &noise(32 * MIB as usize, seed), false)
        .unwrap();
    let out = wait(
        &migrate(&a, request("vm", b.migration.unwrap().to_string())),
        Duration::from_secs(120),
    );
    assert_eq!(out.result, MigrationResult::Switched, "{out:?}");
    (a, b)
}

/// A return records the chunks the volume left unchanged from the kept
/// copy's own index, unread, as the source does from its own: a block of
/// the kept copy written behind the daemon's back is not read, so that
/// return does not see it; the next migration catches it once the
/// index has hashed the copy again (what `ferry index rebuild` does).
#[test]
fn a_return_records_the_kept_copy_from_its_index_unread() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = moved_to_b(dir.path(), 51);
    // The copy A kept, its index current; then one of its blocks changed
    // behind the daemon's back (nothing marks it).
    let kept = a.state.pool.get("vm").unwrap();
    ferry_server::indexer::rebuild_volume(&a.state.index, &kept).unwrap();
    let behind = noise(4096, 52);
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(kept.data_path())
            .unwrap();
        f.write_all_at(&behind, 5 * MIB).unwrap();
    }
    let at_b = b.state.pool.get("vm").unwrap();
    at_b.write_at(MIB, &noise(4096, 53), false).unwrap();
    let back = tracked_return(&b, &a, Duration::from_secs(120));
    assert_eq!(crossed(&back).1, 1, "{:?}", back.chunks);
    // Unread: the index vouched for the block as it was, and the block
    // written behind stays. Every other block is the source's.
    let home = a.state.pool.get("vm").unwrap();
    let block_at = |path: &std::path::Path, off: u64| {
        use std::os::unix::fs::FileExt;
        let mut b = vec![0u8; 4096];
        std::fs::File::open(path)
            .unwrap()
            .read_exact_at(&mut b, off)
            .unwrap();
        b
    };
    assert_eq!(block_at(home.data_path(), 5 * MIB), behind);
    assert_eq!(
        block_at(home.data_path(), MIB),
        block_at(at_b.data_path(), MIB)
    );
    // Once A's index hashes the copy again, the next move out claims the
    // block unchanged since it arrived, B's copy differs there, and the
    // digests catch it: the volume stays at A.
    ferry_server::indexer::rebuild_volume(&a.state.index, &home).unwrap();
    let bad = wait(
        &migrate(&a, request("vm", b.migration.unwrap().to_string())),
        Duration::from_secs(120),
    );
    assert_eq!(bad.result, MigrationResult::Failed, "{bad:?}");
    assert!(bad.error.unwrap_or_default().contains("digests differ"));
    assert!(home.is_serving() && home.moved_to().is_none());
}

/// A return whose unchanged chunks outnumber what one `Prints` frame
/// carries (65,536 in `Same` runs): the run is cut across frames, and
/// every chunk is still accounted for once.
#[test]
fn a_tracked_return_longer_than_one_prints_frame_is_cut_across_frames() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    let a = destination(&pa);
    let b = destination(&pb);
    trust_each_other(&pa, &pb);
    // 80,000 non-zero chunks (of 4 KiB), one block repeated: the first
    // move sends it once and the destination builds the rest from it.
    let data = 80_000 * 4096;
    let v = a.create("vm", 320 * MIB);
    let block = noise(4096, 41);
    let piece: Vec<u8> = block
        .iter()
        .copied()
        .cycle()
        .take(16 * MIB as usize)
        .collect();
    let mut at = 0;
    while at < data {
        let n = (data - at).min(piece.len() as u64);
        v.write_at(at, &piece[..n as usize], false).unwrap();
        at += n;
    }
    let out = wait(
        &migrate(&a, request("vm", b.migration.unwrap().to_string())),
        Duration::from_secs(300),
    );
    assert_eq!(out.result, MigrationResult::Switched, "{out:?}");
    // Written at B: one chunk before the frame's cut and one after it.
    let at_b = b.state.pool.get("vm").unwrap();
    at_b.write_at(4096, &noise(4096, 42), false).unwrap();
    at_b.write_at(70_000 * 4096, &noise(4096, 43), false)
        .unwrap();
    let back = tracked_return(&b, &a, Duration::from_secs(300));
    assert_eq!(back.chunks.unchanged, 80_000 - 2, "{:?}", back.chunks);
    assert_eq!(crossed(&back).1, 2, "{:?}", back.chunks);
    assert_eq!(
        sha(a.state.pool.get("vm").unwrap().data_path()),
        sha(at_b.data_path())
    );
}

#[test]
fn a_tracked_return_cut_mid_way_resumes_still_tracked() {
    assert!(
        have("toxiproxy-server"),
        "the test command installs toxiproxy"
    );
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = moved_to_b(dir.path(), 31);
    // 16 MiB written at B, where there was nothing: the return sends it.
    b.state
        .pool
        .get("vm")
        .unwrap()
        .write_at(40 * MIB, &noise(16 * MIB as usize, 32), false)
        .unwrap();

    // Home over a slow link, cut once part of that has crossed.
    let tp = toxiproxy::Toxiproxy::start();
    let to = tp.proxy("home", &a.migration.unwrap().to_string());
    tp.add_toxic(
        "home",
        "slow",
        "bandwidth",
        "upstream",
        serde_json::json!({"rate": 8_000}),
    );
    let mut req = request("vm", to);
    req.compress = false;
    let run = migrate(&b, req);
    let deadline = Instant::now() + Duration::from_secs(60);
    // The new data crosses in order: once the block 4 MiB into it is at
    // A, so is what came before it.
    let home = a.state.pool.get("vm").unwrap();
    let mut block = vec![0u8; 4096];
    loop {
        // (Refused until the return reclaims the moved-away copy.)
        if home.read_at(44 * MIB, &mut block).is_ok() && block.iter().any(|&x| x != 0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "nothing arrived: {:?}",
            run.status()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    tp.cut_until_retried("home", &run, deadline);
    std::thread::sleep(Duration::from_millis(300));
    tp.remove_toxic("home", "cut");
    tp.remove_toxic("home", "slow");
    let r = wait(&run, Duration::from_secs(120));
    assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
    assert!(r.attempts >= 2, "{r:?}");
    // The attempt that finished still trusted what B tracked: the 32 MiB
    // A kept went unprinted, and what crossed before the cut was kept.
    assert_eq!(
        r.destination_copy,
        ferry_api::DestinationCopy::ReturnedTracked
    );
    assert_eq!(r.chunks.unchanged, 32 * MIB / 4096, "{:?}", r.chunks);
    assert!(r.chunks.resumed > 0, "nothing kept: {:?}", r.chunks);
    assert!(r.chunks.sent < 16 * MIB / 4096, "{:?}", r.chunks);
    assert_eq!(
        sha(b.state.pool.get("vm").unwrap().data_path()),
        sha(a.state.pool.get("vm").unwrap().data_path())
    );
}

/// A host at the destination site waiting for a held migration's copy
/// (`GET /v1/volumes/{name}/arrival`) is answered when the copy commits,
/// with where its clients go; another migration's id is not.
#[test]
fn a_host_waiting_at_the_destination_is_told_of_the_commit_and_where_to_go() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (dir.path().join("a"), dir.path().join("b"));
    let src = TestServer::start(&pa);
    let dst = destination(&pb);
    trust_each_other(&pa, &pb);
    let v = src.create("vm", 16 * MIB);
    v.write_at(0, &noise(4 * MIB as usize, 3), false).unwrap();
    let mut req = request("vm", dst.migration.unwrap().to_string());
    req.hold_switch = true;
    let run = migrate(&src, req);
    let deadline = Instant::now() + Duration::from_secs(120);
    wait_ready_to_switch(&run, deadline);
    let admin = ferry_api::AdminClient::new(&dst.admin.to_string());
    let id = run.id.clone();
    // Not committed yet: a short wait answers "not arrived".
    let early = admin
        .wait_arrival("vm", &id, Duration::from_millis(100))
        .unwrap();
    assert!(!early.arrived, "{early:?}");
    assert_eq!(early.location, None);
    let waiter = {
        let (admin, id) = (admin.clone(), id.clone());
        std::thread::spawn(move || admin.wait_arrival("vm", &id, Duration::from_secs(25)))
    };
    std::thread::sleep(Duration::from_millis(300));
    assert!(!waiter.is_finished(), "answered before the switch");
    assert!(run.release_switch());
    let t = Instant::now();
    let got = waiter.join().unwrap().unwrap();
    assert!(t.elapsed() < Duration::from_secs(20), "woke at its limit");
    assert!(got.arrived, "{got:?}");
    assert_eq!(got.location.as_deref(), Some(&*dst.nbd.to_string()));
    assert_eq!(got.admin.as_deref(), Some(&*dst.admin.to_string()));
    let r = wait(&run, Duration::from_secs(120));
    assert_eq!(r.result, MigrationResult::Switched, "{r:?}");
    // Asked again, at once; another migration's id is not this commit.
    assert!(
        admin
            .wait_arrival("vm", &id, Duration::ZERO)
            .unwrap()
            .arrived
    );
    let other = ferry_api::MigrationId::random();
    let not = admin
        .wait_arrival("vm", &other, Duration::from_millis(50))
        .unwrap();
    assert!(!not.arrived, "{not:?}");
    // A malformed id is a clear error, not a wait.
    let bad = ureq::get(&format!(
        "http://{}/v1/volumes/vm/arrival?migration=nope&wait_ms=5000",
        dst.admin
    ))
    .call();
    assert!(matches!(bad, Err(ureq::Error::Status(400, _))), "{bad:?}");
    // A daemon restarted since the commit still knows it, and where its
    // clients go (its own listener, not the migration's connection).
    dst.stop();
    let dst = destination(&pb);
    let after = ferry_api::AdminClient::new(&dst.admin.to_string())
        .wait_arrival("vm", &id, Duration::ZERO)
        .unwrap();
    assert!(after.arrived, "{after:?}");
    assert_eq!(after.location.as_deref(), Some(&*dst.nbd.to_string()));
}
