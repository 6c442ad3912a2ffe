//! Engine tests: volumes, persistence across reopen, allocation map, and the
//! bitmap invariant under concurrent writers racing with take().
// Test fixtures: sizes, offsets and byte patterns the test itself chooses.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use ferry_storage::{CreateOptions, Pool, PoolOptions, StorageError, ZeroMode};
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicBool, Ordering};

fn opts(size: u64) -> CreateOptions {
    CreateOptions {
        size,
        ..Default::default()
    }
}

#[test]
fn create_write_read_reopen() {
    let d = tempfile::tempdir().unwrap();
    let uuid;
    {
        let p = Pool::open(d.path(), PoolOptions::default()).unwrap();
        let v = p.create("disk0", &opts(1 << 20)).unwrap();
        uuid = v.meta().uuid;
        v.write_at(4096, b"hello", true).unwrap();
        v.create_bitmap("mig", 65536, true).unwrap();
        v.write_at(200_000, b"x", false).unwrap();
        assert!(matches!(
            p.create("disk0", &opts(4096)),
            Err(StorageError::Exists(_))
        ));
        assert!(matches!(
            p.create("../x", &opts(4096)),
            Err(StorageError::InvalidName(_))
        ));
        assert!(matches!(
            p.create("odd", &opts(1000)),
            Err(StorageError::Invalid(_))
        ));
        p.close().unwrap();
    }
    let p = Pool::open(d.path(), PoolOptions::default()).unwrap();
    let v = p.get("disk0").unwrap();
    assert_eq!(v.meta().uuid, uuid);
    let mut b = [0u8; 5];
    v.read_at(4096, &mut b).unwrap();
    assert_eq!(&b, b"hello");
    // Clean close: the persistent bitmap kept exactly the one write.
    assert_eq!(v.bitmap("mig").unwrap().take(), vec![196_608]);
    assert!(matches!(
        v.read_at((1 << 20) - 2, &mut b),
        Err(StorageError::OutOfRange { .. })
    ));
}

#[test]
fn unclean_shutdown_marks_persistent_bitmaps_all_dirty() {
    let d = tempfile::tempdir().unwrap();
    {
        let p = Pool::open(d.path(), PoolOptions::default()).unwrap();
        let v = p.create("v", &opts(1 << 20)).unwrap();
        v.create_bitmap("b", 65536, true).unwrap();
        v.save_bitmaps().unwrap();
        v.write_at(0, b"lost-from-the-saved-bitmap", false).unwrap();
        // no close(): simulate a crash
    }
    let p = Pool::open(d.path(), PoolOptions::default()).unwrap();
    let v = p.get("v").unwrap();
    assert_eq!(v.bitmap("b").unwrap().dirty_bytes(), 1 << 20);
}

#[test]
fn holes_zeroes_trim_and_allocation() {
    let d = tempfile::tempdir().unwrap();
    let p = Pool::open(d.path(), PoolOptions::default()).unwrap();
    let v = p.create("v", &opts(4 << 20)).unwrap();
    let e = v.extents(0, 4 << 20, 100).unwrap();
    assert_eq!(e.len(), 1);
    assert!(e[0].hole);
    v.write_at(1 << 20, &vec![7u8; 65536], false).unwrap();
    let e = v.extents(0, 4 << 20, 100).unwrap();
    assert!(e.iter().any(|x| !x.hole && x.offset <= 1 << 20));
    v.write_zeroes(
        1 << 20,
        65536,
        ZeroMode {
            may_punch: true,
            fast_only: false,
        },
        false,
    )
    .unwrap();
    let mut b = vec![1u8; 65536];
    v.read_at(1 << 20, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0));
    v.write_at(0, &[9u8; 4096], false).unwrap();
    v.trim(0, 4096, false).unwrap();
    v.read_at(0, &mut b[..4096]).unwrap();
    assert!(b[..4096].iter().all(|&x| x == 0));
}

#[test]
fn sparse_reads_equal_plain_reads_across_holes_and_data() {
    let d = tempfile::tempdir().unwrap();
    let p = Pool::open(d.path(), PoolOptions::default()).unwrap();
    let size = 16u64 << 20;
    let v = p.create("v", &opts(size)).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    // Data islands of odd sizes, one at the very end, one crossing 8 MiB.
    for (off, len) in [
        (4096u64, 8192usize),
        (1 << 20, 65536),
        ((8 << 20) - 3000, 6000),
        (size - 4096, 4096),
    ] {
        let data: Vec<u8> = (0..len).map(|_| rng.gen::<u8>() | 1).collect();
        v.write_at(off, &data, false).unwrap();
    }
    // Reads that start and end in holes, in data, and span many extents;
    // the buffer starts dirty so a hole not zeroed would show.
    for (off, len) in [
        (0u64, size),
        (0, 4096),
        (4096, 4096),
        (2048, 12288),
        ((8 << 20) - 4096, 8192),
        (size - 8192, 8192),
        (3 << 20, 1 << 20),
    ] {
        let len = len as usize;
        let mut plain = vec![0xAAu8; len];
        let mut sparse = vec![0x55u8; len];
        v.read_at(off, &mut plain).unwrap();
        v.read_sparse_at(off, &mut sparse).unwrap();
        assert!(plain == sparse, "read at {off} of {len} bytes differs");
    }
    // Write-behind starts and bounds writeback; the data stays as written.
    v.write_at(5 << 20, &[3u8; 65536], false).unwrap();
    v.write_behind().unwrap();
    v.write_behind().unwrap();
    let mut b = vec![0u8; 65536];
    v.read_at(5 << 20, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 3));
    // Past the end is refused like read_at.
    let mut b = vec![0u8; 8192];
    assert!(v.read_sparse_at(size - 4096, &mut b).is_err());
}

#[test]
fn the_slowest_write_counts_a_wait_at_the_gate_and_starts_again_when_taken() {
    let d = tempfile::tempdir().unwrap();
    let p = Pool::open(d.path(), PoolOptions::default()).unwrap();
    let v = p.create("v", &opts(4 << 20)).unwrap();
    v.write_at(0, &[1u8; 4096], false).unwrap();
    v.flush().unwrap();
    assert!(v.take_slowest_write() < std::time::Duration::from_millis(100));
    assert!(v.gate().pause(std::time::Duration::from_secs(1)));
    let v2 = v.clone();
    let writer = std::thread::spawn(move || v2.write_at(4096, &[2u8; 4096], false));
    // Hold the writer 150 ms once it waits at the gate (however late a
    // loaded machine starts its thread).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while v.gate().waiting() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the writer never reached the gate"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    std::thread::sleep(std::time::Duration::from_millis(150));
    v.gate().resume();
    writer.join().unwrap().unwrap();
    assert!(v.take_slowest_write() >= std::time::Duration::from_millis(150));
    assert_eq!(v.take_slowest_write(), std::time::Duration::ZERO);
}

#[test]
fn a_pool_on_a_file_system_that_cannot_share_extents_says_so_and_leaves_no_probe() {
    // tmpfs shares no extents (FICLONE is refused there).
    let Ok(d) = tempfile::tempdir_in("/dev/shm") else {
        eprintln!("skipped: no /dev/shm here");
        return;
    };
    let p = Pool::open(d.path(), PoolOptions::default()).unwrap();
    assert!(!p.shares_extents());
    // The probe's files are gone: the pool directory holds only volumes.
    let left: Vec<_> = std::fs::read_dir(d.path().join("volumes"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
    p.create("v", &opts(1 << 20)).unwrap();
    drop(p);
    let p = Pool::open(d.path(), PoolOptions::default()).unwrap();
    assert_eq!(p.list().len(), 1);
}

#[test]
fn preallocated_and_resize_and_delete() {
    let d = tempfile::tempdir().unwrap();
    let p = Pool::open(d.path(), PoolOptions::default()).unwrap();
    let v = p
        .create(
            "pre",
            &CreateOptions {
                size: 1 << 20,
                preallocate: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert!(v.allocated_bytes() >= 1 << 20);
    v.create_bitmap("b", 4096, false).unwrap();
    v.resize(2 << 20, false).unwrap();
    assert_eq!(v.size(), 2 << 20);
    assert_eq!(v.bitmap("b").unwrap().dirty_bytes(), 1 << 20);
    assert!(v.resize(1 << 20, false).is_err());
    v.resize(1 << 20, true).unwrap();
    // A migration fixes the size until it ends.
    let held = v.hold(ferry_storage::Holder::OutgoingMigration);
    let e = v.resize(2 << 20, false).unwrap_err();
    assert!(
        matches!(e, ferry_storage::StorageError::InUse { .. }),
        "{e}"
    );
    assert_eq!(v.size(), 1 << 20);
    drop(held);
    p.delete("pre", false).unwrap();
    assert!(p.get("pre").is_err());
    assert!(v.write_at(0, b"x", false).is_err());
    let p2 = Pool::open(d.path(), PoolOptions::default()).unwrap();
    assert!(p2.list().is_empty());
}

#[test]
fn external_backing_file_is_kept_on_delete() {
    let d = tempfile::tempdir().unwrap();
    let ext = d.path().join("ext.img");
    std::fs::write(&ext, vec![5u8; 8192]).unwrap();
    let p = Pool::open(&d.path().join("pool"), PoolOptions::default()).unwrap();
    let v = p
        .create(
            "ext",
            &CreateOptions {
                external: Some(ext.clone()),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(v.size(), 8192);
    p.delete("ext", false).unwrap();
    assert!(ext.exists());
}

#[test]
fn direct_io_volume_reads_and_writes_aligned() {
    let d = tempfile::tempdir_in(std::env::current_dir().unwrap()).unwrap();
    let p = match Pool::open(
        d.path(),
        PoolOptions {
            direct_io: true,
            ..Default::default()
        },
    ) {
        Ok(p) => p,
        Err(e) => panic!("{e}"),
    };
    let v = match p.create("d", &opts(1 << 20)) {
        Ok(v) => v,
        // tmpfs and some file systems refuse O_DIRECT; nothing to test there.
        Err(StorageError::Io { source, .. }) if source.raw_os_error() == Some(libc_einval()) => {
            return
        }
        Err(e) => panic!("{e}"),
    };
    v.write_at(512, &[3u8; 512], false).unwrap();
    let mut b = [0u8; 1024];
    v.read_at(0, &mut b).unwrap();
    assert!(b[512..].iter().all(|&x| x == 3));
    assert!(v.write_at(1, &[0u8; 512], false).is_err());
}

/// `copy_from` writes the source's bytes where it is told, through the
/// write gate, marking what it wrote; a misaligned range is refused with
/// nothing written; a range past either end is an error. With the page
/// cache and with O_DIRECT (where the file system takes it).
#[test]
fn a_copy_made_by_the_kernel_is_the_source_s_bytes_and_marks_what_it_wrote() {
    for direct_io in [false, true] {
        let d = tempfile::tempdir_in(std::env::current_dir().unwrap()).unwrap();
        let p = Pool::open(
            d.path(),
            PoolOptions {
                direct_io,
                ..Default::default()
            },
        )
        .unwrap();
        let (src, dst) = match (
            p.create("src", &opts(1 << 20)),
            p.create("dst", &opts(1 << 20)),
        ) {
            (Ok(s), Ok(t)) => (s, t),
            (Err(StorageError::Io { source, .. }), _)
            | (_, Err(StorageError::Io { source, .. }))
                if direct_io && source.raw_os_error() == Some(libc_einval()) =>
            {
                continue
            }
            (Err(e), _) | (_, Err(e)) => panic!("{e}"),
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let data: Vec<u8> = (0..1 << 20).map(|_| rng.gen()).collect();
        src.write_at(0, &data, false).unwrap();
        let bm = dst.create_bitmap("b", 4096, false).unwrap();
        let mark = dst.write_mark().unwrap();
        assert!(dst.copy_from(&src, 64 << 10, 128 << 10, 256 << 10).unwrap());
        assert!(dst.written_since(mark), "direct_io {direct_io}");
        let mut got = vec![0u8; 1 << 20];
        dst.read_at(0, &mut got).unwrap();
        assert_eq!(got[128 << 10..384 << 10], data[64 << 10..320 << 10]);
        assert!(got[..128 << 10]
            .iter()
            .chain(&got[384 << 10..])
            .all(|&b| b == 0));
        assert!(bm.is_dirty(128 << 10, 256 << 10));
        assert_eq!(bm.dirty_bytes(), 256 << 10, "direct_io {direct_io}");

        bm.clear();
        assert!(!dst.copy_from(&src, 1, 0, 4096).unwrap());
        assert!(!dst.copy_from(&src, 0, 4096, 100).unwrap());
        assert_eq!(bm.dirty_bytes(), 0);
        assert!(dst.copy_from(&src, 1 << 20, 0, 4096).is_err());
        assert!(dst.copy_from(&src, 0, (1 << 20) - 4096, 8192).is_err());
        assert_eq!(bm.dirty_bytes(), 0);
    }
}

fn libc_einval() -> i32 {
    22
}

/// The migration invariant: a consumer that repeatedly takes dirty bits and
/// copies those chunks, racing with writers, ends with an exact copy after
/// one last take once the writers stop.
#[test]
fn concurrent_writers_never_escape_the_bitmap() {
    let d = tempfile::tempdir().unwrap();
    let p = Pool::open(d.path(), PoolOptions::default()).unwrap();
    let size = 4u64 << 20;
    let gran = 4096u64;
    let v = p.create("v", &opts(size)).unwrap();
    let bm = v.create_bitmap("mig", gran as u32, false).unwrap();
    let mut shadow = vec![0u8; size as usize];
    let stop = AtomicBool::new(false);
    let writers: Vec<_> = (0..4)
        .map(|t| {
            let v = v.clone();
            std::thread::spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(t);
                let mut n = 0;
                while n < 3_000 {
                    let len = rng.gen_range(1..20_000u64);
                    let off = rng.gen_range(0..size - len);
                    let byte = rng.gen::<u8>();
                    v.write_at(off, &vec![byte; len as usize], false).unwrap();
                    n += 1;
                }
            })
        })
        .collect();
    let copy = |shadow: &mut Vec<u8>| {
        for off in bm.take() {
            let n = gran.min(size - off) as usize;
            v.read_at(off, &mut shadow[off as usize..off as usize + n])
                .unwrap();
        }
    };
    let mut rounds = 0;
    while writers.iter().any(|w| !w.is_finished()) {
        copy(&mut shadow);
        rounds += 1;
    }
    stop.store(true, Ordering::Relaxed);
    assert!(rounds > 1, "the consumer never raced the writers");
    for w in writers {
        w.join().unwrap();
    }
    copy(&mut shadow);
    let mut actual = vec![0u8; size as usize];
    v.read_at(0, &mut actual).unwrap();
    assert!(actual == shadow, "bitmap missed a write");
}

#[test]
fn nowait_paths_read_and_write_like_the_blocking_ones() {
    let d = tempfile::tempdir().unwrap();
    let p = Pool::open(d.path(), PoolOptions::default()).unwrap();
    let v = p.create("v", &opts(1 << 20)).unwrap();
    let bm = v.create_bitmap("b", 4096, false).unwrap();
    // A write that cannot be done without blocking must still be done by write_at.
    if !v.try_write_nowait(8192, b"fast").unwrap() {
        v.write_at(8192, b"fast", false).unwrap();
    }
    assert_eq!(bm.take(), vec![8192]);
    let mut out = bytes::BytesMut::from(&b"hdr"[..]);
    if !v.read_append(8192, 4, &mut out, true).unwrap() {
        assert_eq!(&out[..], b"hdr");
        v.read_append(8192, 4, &mut out, false).unwrap();
    }
    assert_eq!(&out[..], b"hdrfast");
    assert!(v.read_append((1 << 20) - 2, 4, &mut out, false).is_err());
    assert!(v.try_write_nowait((1 << 20) - 2, b"xxxx").is_err());
}

#[test]
fn sanitize_overwrites_every_block_marks_bitmaps_and_resumes_after_a_crash() {
    use ferry_storage::{SanitizeOp, SanitizeStatus};
    let d = tempfile::tempdir().unwrap();
    let size = 3 << 20;
    {
        let p = Pool::open(d.path(), PoolOptions::default()).unwrap();
        let v = p.create("s", &opts(size)).unwrap();
        v.write_at(0, &vec![7u8; 8192], false).unwrap();
        v.create_bitmap("b", 65536, true).unwrap();
        let op = SanitizeOp::Overwrite {
            pattern: vec![0xa5, 0x5a],
            invert: true,
            passes: 3,
        };
        // A pattern longer than a block, or no pass, is refused.
        assert!(matches!(
            v.begin_sanitize(
                SanitizeOp::Overwrite {
                    pattern: vec![1; 513],
                    invert: false,
                    passes: 1
                },
                false
            ),
            Err(StorageError::Invalid(_))
        ));
        v.begin_sanitize(op.clone(), false).unwrap();
        // From the request on, no read or write passes, and no second one.
        let mut buf = vec![0u8; 512];
        assert!(matches!(
            v.read_at(0, &mut buf),
            Err(StorageError::Sanitizing(_))
        ));
        assert!(matches!(
            v.write_at(0, &buf, false),
            Err(StorageError::Sanitizing(_))
        ));
        assert!(matches!(
            v.begin_sanitize(SanitizeOp::BlockErase, false),
            Err(StorageError::Sanitizing(_))
        ));
        assert!(matches!(
            v.sanitize_status(),
            SanitizeStatus::Running { .. }
        ));
        // The daemon dies before the blocks change: no run, no close.
        drop(v);
        drop(p);
    }
    let p = Pool::open(d.path(), PoolOptions::default()).unwrap();
    let v = p.get("s").unwrap();
    assert!(v.sanitize_pending(), "the journaled sanitize resumes");
    let mut buf = vec![0u8; 512];
    assert!(matches!(
        v.read_at(0, &mut buf),
        Err(StorageError::Sanitizing(_))
    ));
    v.run_sanitize(0).unwrap();
    assert_eq!(v.sanitize_status(), SanitizeStatus::Idle);
    let mut all = vec![0u8; size as usize];
    v.read_at(0, &mut all).unwrap();
    // The last of three inverting passes writes the pattern itself,
    // repeated to fill every block.
    assert!(all.chunks(2).all(|c| c == [0xa5, 0x5a]));
    let b = v.bitmap("b").unwrap();
    assert_eq!(b.dirty_bytes(), size, "every block marked");
    assert!(v.meta().sanitize.is_none(), "journal cleared");

    // Block erase: every block deallocated and read as zeroes.
    v.begin_sanitize(SanitizeOp::BlockErase, false).unwrap();
    v.run_sanitize(0).unwrap();
    v.read_at(0, &mut all).unwrap();
    assert!(all.iter().all(|&x| x == 0));
    let ext = v.extents(0, size, 16).unwrap();
    assert!(ext.iter().all(|e| e.hole), "{ext:?}");
    v.write_at(0, b"after", true).unwrap();
}

#[test]
fn a_failed_sanitize_keeps_the_volume_refusing_io_across_a_restart() {
    use ferry_storage::{SanitizeOp, SanitizeStatus};
    let d = tempfile::tempdir().unwrap();
    for ause in [false, true] {
        let name = format!("f{}", u8::from(ause));
        {
            let p = Pool::open(d.path(), PoolOptions::default()).unwrap();
            let v = p.create(&name, &opts(1 << 20)).unwrap();
            v.begin_sanitize(SanitizeOp::BlockErase, ause).unwrap();
            p.close().unwrap();
        }
        // Journal what a failed run leaves (a disk error mid-way).
        let meta_path = d.path().join("volumes").join(&name).join("meta.json");
        let mut m = ferry_storage::VolumeMeta::load(&meta_path).unwrap();
        m.sanitize.as_mut().unwrap().failed = Some("write: Input/output error".into());
        m.store(&meta_path).unwrap();
        let p = Pool::open(d.path(), PoolOptions::default()).unwrap();
        let v = p.get(&name).unwrap();
        assert!(!v.sanitize_pending());
        assert!(matches!(
            v.sanitize_status(),
            SanitizeStatus::Failed { ause: a, .. } if a == ause
        ));
        let mut buf = vec![0u8; 512];
        assert!(matches!(
            v.read_at(0, &mut buf),
            Err(StorageError::SanitizeFailed(_))
        ));
        if ause {
            v.exit_sanitize_failure().unwrap();
        } else {
            assert!(v.exit_sanitize_failure().is_err());
            // A sanitize that succeeds ends the failure mode.
            v.begin_sanitize(SanitizeOp::BlockErase, false).unwrap();
            v.run_sanitize(0).unwrap();
        }
        v.read_at(0, &mut buf).unwrap();
        p.close().unwrap();
    }
}

/// A switch the destination committed is taken in memory before it is
/// stored (the guest's held writes go at once): writes fail with Moved at
/// once, and a daemon that stops before the store finds the volume held in
/// doubt (not served, not writable), to ask the destination; once stored,
/// it reopens moved.
#[test]
fn a_move_marked_before_it_is_stored_reopens_in_doubt_never_writable() {
    let d = tempfile::tempdir().unwrap();
    {
        let p = Pool::open(d.path(), PoolOptions::default()).unwrap();
        let v = p.create("vm", &opts(1 << 20)).unwrap();
        v.write_at(0, b"before", false).unwrap();
        v.set_outgoing(Some(ferry_storage::OutgoingMigration {
            id: "0".repeat(32),
            to: "10.0.0.2:10810".into(),
            switch_sent: false,
            plaintext: false,
        }))
        .unwrap();
        v.set_switch_sent(true).unwrap();
        v.mark_moved("10.0.0.2:10809", "", None, &"0".repeat(32));
        assert!(matches!(
            v.write_at(0, b"after", false),
            Err(StorageError::Moved { .. })
        ));
        assert_eq!(v.moved_to().as_deref(), Some("10.0.0.2:10809"));
        // Stopped here, before the store (no clean close either).
        drop(v);
        drop(p);
    }
    {
        let p = Pool::open(d.path(), PoolOptions::default()).unwrap();
        let v = p.get("vm").unwrap();
        assert!(v.in_doubt() && !v.is_serving());
        assert!(v.moved_to().is_none());
        assert!(matches!(
            v.write_at(0, b"after", false),
            Err(StorageError::InDoubt { .. })
        ));
        // The destination says it committed: stored, reopened moved.
        v.set_moved("10.0.0.2:10809", "", None, &"0".repeat(32))
            .unwrap();
        p.close().unwrap();
    }
    let p = Pool::open(d.path(), PoolOptions::default()).unwrap();
    let v = p.get("vm").unwrap();
    assert_eq!(v.moved_to().as_deref(), Some("10.0.0.2:10809"));
    assert!(matches!(
        v.write_at(0, b"after", false),
        Err(StorageError::Moved { .. })
    ));
}
