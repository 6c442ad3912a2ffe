//! ferry serve against the programs users use: qemu-img, qemu-io, nbdinfo,
//! nbdcopy and fio, plus restart with data intact.
// Test fixtures: sizes, offsets and byte patterns the test itself chooses.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

mod common;
use common::*;
use std::process::Command;

#[test]
fn qemu_img_convert_in_and_out() {
    if !have("qemu-img") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(&d.path().join("pool"));
    s.create("disk", 32 << 20);
    let img = d.path().join("in.img");
    let out = d.path().join("out.img");
    make_image(&img, 32);
    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&img)
        .arg(s.uri("disk")));
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw"])
        .arg(s.uri("disk"))
        .arg(&out));
    assert_eq!(sha(&img), sha(&out));
    run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&img)
        .arg(s.uri("disk")));
}

#[test]
fn qemu_io_patterns_zeroes_and_fua() {
    if !have("qemu-io") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(&d.path().join("pool"));
    s.create("v", 16 << 20);
    let out = run(Command::new("qemu-io")
        .args(["-f", "raw"])
        .arg(s.uri("v"))
        .args([
            "-c",
            "write -P 0xab 0 1M",
            "-c",
            "read -P 0xab 0 1M",
            "-c",
            "write -z 512k 64k",
            "-c",
            "read -P 0 512k 64k",
            "-c",
            "read -P 0xab 576k 448k",
            "-c",
            "write -f -P 0x5a 4M 4k",
            "-c",
            "read -P 0x5a 4M 4k",
            "-c",
            "aio_write -P 0x01 8M 64k",
            "-c",
            "aio_write -P 0x02 9M 64k",
            "-c",
            "aio_flush",
            "-c",
            "read -P 0x01 8M 64k",
            "-c",
            "read -P 0x02 9M 64k",
            "-c",
            "discard 8M 64k",
            "-c",
            "read -P 0 8M 64k",
            "-c",
            "flush",
        ]));
    assert!(!out.contains("Pattern verification failed"), "{out}");
    assert!(!out.to_lowercase().contains("error"), "{out}");
}

#[test]
fn nbdinfo_map_shows_holes_allocation_and_dirty_bitmap() {
    if !have("nbdinfo") || !have("qemu-io") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(&d.path().join("pool"));
    let v = s.create("sparse", 8 << 20);
    let map = run(Command::new("nbdinfo").arg("--map").arg(s.uri("sparse")));
    let rows: Vec<&str> = map.lines().collect();
    assert_eq!(rows.len(), 1, "{map}");
    assert!(rows[0].contains("hole,zero"), "{map}");
    v.create_bitmap("mig", 65536, false).unwrap();
    run(Command::new("qemu-io")
        .args(["-f", "raw"])
        .arg(s.uri("sparse"))
        .args(["-c", "write -P 7 2M 1M"]));
    let map = run(Command::new("nbdinfo").arg("--map").arg(s.uri("sparse")));
    let data: Vec<&str> = map
        .lines()
        .filter(|l| l.trim_end().ends_with("data"))
        .collect();
    assert_eq!(data.len(), 1, "{map}");
    let f: Vec<u64> = data[0]
        .split_whitespace()
        .take(2)
        .map(|x| x.parse().unwrap())
        .collect();
    assert!(f[0] <= 2 << 20 && f[0] + f[1] >= 3 << 20, "{map}");
    let dirty = run(Command::new("nbdinfo")
        .arg("--map=ferry:dirty-bitmap:mig")
        .arg(s.uri("sparse")));
    let rows: Vec<Vec<u64>> = dirty
        .lines()
        .map(|l| {
            l.split_whitespace()
                .take(3)
                .map(|x| x.parse().unwrap())
                .collect()
        })
        .collect();
    assert_eq!(
        rows,
        vec![
            vec![0, 2 << 20, 0],
            vec![2 << 20, 1 << 20, 1],
            vec![3 << 20, 5 << 20, 0]
        ],
        "{dirty}"
    );
    let list = run(Command::new("nbdinfo")
        .arg("--list")
        .arg(format!("nbd://{}", s.nbd)));
    assert!(list.contains("export=\"sparse\""), "{list}");
}

/// `ferry_nbd_reads_sent_from_file` of volume `v`.
fn reads_from_file(s: &TestServer, v: &str) -> u64 {
    let m = s.state.metrics.render(&s.state.pool, &s.state.index);
    let key = format!("ferry_nbd_reads_sent_from_file_total{{volume=\"{v}\"}} ");
    m.lines()
        .find_map(|l| l.strip_prefix(&key))
        .map_or(0, |n| n.trim().parse().unwrap())
}

/// Whether this kernel has `cachestat(2)` (6.5 on), which tells ferry a
/// range is all in the page cache.
fn kernel_has_cachestat() -> bool {
    let r = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut n = r.split(['.', '-']).map(|x| x.parse::<u32>().unwrap_or(0));
    (n.next().unwrap_or(0), n.next().unwrap_or(0)) >= (6, 5)
}

/// Write `path` back and drop its pages from the page cache; whether
/// none is left (`fincore`; a file system that keeps its pages, tmpfs,
/// cannot drop them).
fn drop_cached_pages(path: &std::path::Path) -> bool {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    f.sync_all().unwrap();
    // SAFETY: advice on an open descriptor; no memory is passed.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    let out = run(Command::new("fincore")
        .args(["--bytes", "--noheadings", "--output", "RES"])
        .arg(path));
    out.trim() == "0"
}

/// qemu-io's commands on export `v`, every pattern verified.
fn qemu_io(s: &TestServer, v: &str, cmds: &[&str]) {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw"]).arg(s.uri(v));
    for x in cmds {
        c.args(["-c", x]);
    }
    let out = run(&mut c);
    assert!(!out.contains("Pattern verification failed"), "{out}");
    assert!(!out.to_lowercase().contains("error"), "{out}");
}

#[test]
fn large_reads_sent_from_the_page_cache_see_every_acknowledged_write() {
    if !have("qemu-io") || !have("fincore") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start_with(&d.path().join("pool"), |c| {
        c.nbd.sendfile_reads = ferry_server::config::SendfileReads::Always
    });
    let v = s.create("r", 16 << 20);
    // Written through the server, so every page is cached: large reads go
    // from the file by the kernel, and each sees the writes before it.
    qemu_io(
        &s,
        "r",
        &[
            "write -P 0x11 0 8M",
            "read -P 0x11 0 8M",
            "write -P 0x22 1M 2M",
            "read -P 0x22 1M 2M",
            "read -P 0x11 0 1M",
            "read -P 0x11 3M 5M",
            "aio_write -P 0x33 4M 1M",
            "aio_flush",
            "read -P 0x33 4M 1M",
            "read -P 0x11 5M 3M",
            // Small reads are answered from a buffer, as before.
            "read -P 0x22 2M 64k",
        ],
    );
    let sent = reads_from_file(&s, "r");
    if kernel_has_cachestat() {
        assert!(sent >= 6, "{sent} reads sent from the file");
    }
    // The pages dropped: each read waits for the disk on a worker thread,
    // and sees the same data. A range read again once cached goes from the
    // file again.
    if drop_cached_pages(v.data_path()) {
        qemu_io(
            &s,
            "r",
            // Backwards, so that no read's readahead caches the next.
            &[
                "read -P 0x33 4M 1M",
                "read -P 0x22 1M 2M",
                "read -P 0x11 0 1M",
            ],
        );
        assert_eq!(reads_from_file(&s, "r"), sent);
        qemu_io(&s, "r", &["read -P 0x22 1M 2M"]);
        if kernel_has_cachestat() {
            assert_eq!(reads_from_file(&s, "r"), sent + 1);
        }
    }
}

#[test]
fn a_cached_read_over_a_hole_is_copied_with_its_hole_not_sent_from_the_file() {
    if !have("qemu-io") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start_with(&d.path().join("pool"), |c| {
        c.nbd.sendfile_reads = ferry_server::config::SendfileReads::Always
    });
    let v = s.create("h", 8 << 20);
    // 1M-2M stays a hole. ferry answers a hole without reading it, so the
    // file is read here to put the hole's zero pages in the page cache:
    // then a READ over the hole is all cached, and is answered with data
    // and hole chunks from the pieces asked for once.
    qemu_io(&s, "h", &["write -P 0x55 0 1M", "write -P 0x66 2M 1M"]);
    std::fs::read(v.data_path()).unwrap();
    let sent = reads_from_file(&s, "h");
    qemu_io(
        &s,
        "h",
        &[
            "read -P 0x55 512k 512k",
            "read -P 0 1M 1M",
            "read 512k 1M",
            "read -P 0x66 2M 512k",
            "read -P 0 1M 64k",
        ],
    );
    // The hole's READ and the one across data and hole went by copy; the
    // two of data alone from the file.
    if kernel_has_cachestat() {
        assert_eq!(reads_from_file(&s, "h"), sent + 2);
    }
    let out = d.path().join("out.img");
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw"])
        .arg(s.uri("h"))
        .arg(&out));
    assert_eq!(sha(&out), sha(v.data_path()));
}

#[test]
fn by_default_a_connection_reading_alone_reads_from_the_file_after_its_window() {
    if !have("qemu-io") || !kernel_has_cachestat() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    // The default.
    let s = TestServer::start(&d.path().join("pool"));
    s.create("r", 8 << 20);
    // Written through the server, so every page is cached. The reads in
    // the window after this connection's first large READ are copied;
    // those after it (qemu-io's sleep is in milliseconds) go from the file.
    let window = ferry_server::nbd::sole_reader::SOLE_FOR.as_millis() + 50;
    qemu_io(
        &s,
        "r",
        &[
            "write -P 0x44 0 4M",
            "read -P 0x44 0 1M",
            &format!("sleep {window}"),
            "read -P 0x44 1M 1M",
            "read -P 0x44 2M 2M",
        ],
    );
    assert_eq!(reads_from_file(&s, "r"), 2);
    // Another connection's first READ restarts the window: a new
    // connection alone copies its first READ again.
    qemu_io(&s, "r", &["read -P 0x44 0 1M"]);
    assert_eq!(reads_from_file(&s, "r"), 2);
}

#[test]
fn large_reads_are_copied_from_a_buffer_with_sendfile_turned_off() {
    if !have("qemu-io") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start_with(&d.path().join("pool"), |c| {
        c.nbd.sendfile_reads = ferry_server::config::SendfileReads::Off
    });
    s.create("r", 8 << 20);
    qemu_io(&s, "r", &["write -P 0x44 0 4M", "read -P 0x44 0 4M"]);
    assert_eq!(reads_from_file(&s, "r"), 0);
}

#[test]
fn nbdcopy_multi_conn_round_trip() {
    if !have("nbdcopy") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(&d.path().join("pool"));
    s.create("c", 48 << 20);
    let img = d.path().join("in.img");
    let out = d.path().join("out.img");
    make_image(&img, 48);
    run(Command::new("nbdcopy")
        .arg("--connections=4")
        .arg(&img)
        .arg(s.uri("c")));
    run(Command::new("nbdcopy")
        .arg("--connections=4")
        .arg(s.uri("c"))
        .arg(&out));
    assert_eq!(sha(&img), sha(&out));
    // Zero runs went over as holes, not data.
    let vol = s.state.pool.get("c").unwrap();
    assert!(vol.allocated_bytes() < 48 << 20);
}

#[test]
fn fio_verify_qd32_over_4_connections() {
    if !have("fio") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(&d.path().join("pool"));
    s.create("f", 128 << 20);
    let out = run(Command::new("fio").current_dir(d.path()).args([
        "--name=verify",
        "--ioengine=nbd",
        &format!("--uri={}", s.uri("f")),
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=32",
        "--numjobs=4",
        "--size=24M",
        "--offset_increment=32M",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        "--group_reporting",
    ]));
    assert!(out.contains("err= 0"), "{out}");
    // Each of the 4 jobs is its own NBD connection: all four were served.
    let m = s.state.metrics.render(&s.state.pool, &s.state.index);
    assert!(
        m.contains("ferry_requests_total{volume=\"f\",op=\"write\"} 24576"),
        "{m}"
    );
}

#[test]
fn restart_keeps_data_and_identity() {
    if !have("qemu-io") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let pool = d.path().join("pool");
    let s = TestServer::start(&pool);
    let uuid = s.create("keep", 4 << 20).meta().uuid;
    s.state
        .pool
        .get("keep")
        .unwrap()
        .create_bitmap("b", 65536, true)
        .unwrap();
    run(Command::new("qemu-io")
        .args(["-f", "raw"])
        .arg(s.uri("keep"))
        .args(["-c", "write -P 0x3c 1M 256k"]));
    s.stop();
    let s = TestServer::start(&pool);
    let v = s.state.pool.get("keep").unwrap();
    assert_eq!(v.meta().uuid, uuid);
    assert_eq!(v.bitmap("b").unwrap().dirty_bytes(), 256 << 10);
    let out = run(Command::new("qemu-io")
        .args(["-f", "raw", "-r"])
        .arg(s.uri("keep"))
        .args(["-c", "read -P 0x3c 1M 256k"]));
    assert!(!out.contains("Pattern verification failed"), "{out}");
}

/// A large READ over a sparse volume answers its holes with hole chunks
/// (seen by libnbd's chunk callback) and QEMU reads the same bytes: data
/// where it was written, zeroes elsewhere.
#[test]
fn sparse_reads_answer_holes_with_hole_chunks() {
    // nbdsh comes with libnbd's Python binding, which the check uses.
    if !have("qemu-io") || !have("nbdsh") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(&d.path().join("pool"));
    let v = s.create("sparse", 16 << 20);
    v.write_at(1 << 20, &[0x11; 65536], false).unwrap();
    v.write_at(3 << 20, &[0x22; 4096], false).unwrap();
    let script = format!(
        r#"
import nbd
h = nbd.NBD()
h.connect_uri("{uri}")
seen = []
def chunk(buf, off, status, err):
    seen.append((off, len(buf), status))
    return 0
buf = h.pread_structured(4 << 20, 0, chunk)
assert buf[:1 << 20] == bytes(1 << 20)
assert buf[1 << 20:(1 << 20) + 65536] == b"\x11" * 65536
assert buf[3 << 20:(3 << 20) + 4096] == b"\x22" * 4096
holes = sum(n for (_, n, st) in seen if st == nbd.READ_HOLE)
data = sum(n for (_, n, st) in seen if st == nbd.READ_DATA)
print(holes, data, sorted(seen))
"#,
        uri = s.uri("sparse")
    );
    let out = run(Command::new("/usr/bin/python3").args(["-c", &script]));
    let mut it = out.split_whitespace();
    let holes: u64 = it.next().unwrap().parse().unwrap();
    let data: u64 = it.next().unwrap().parse().unwrap();
    assert_eq!(holes + data, 4 << 20, "{out}");
    assert_eq!(data, 65536 + 4096, "only written blocks go as data: {out}");
    let out = run(Command::new("qemu-io").args([
        "-f",
        "raw",
        &s.uri("sparse"),
        "-c",
        "read -P 0 0 1M",
        "-c",
        "read -P 0x11 1M 64k",
        "-c",
        "read -P 0 1088k 1984k",
        "-c",
        "read -P 0x22 3M 4k",
        "-c",
        "read -P 0 3076k 13308k",
    ]));
    assert!(!out.contains("verification failed"), "{out}");
}

/// QEMU 9+ negotiates NBD extended headers by itself: 64-bit effect
/// lengths (one 5 GiB WRITE_ZEROES, BLOCK_STATUS over the whole 6 GiB
/// volume), 32-byte replies, 64-bit status chunks; the data and the map it
/// sees are those a compact client (the system QEMU) sees.
#[test]
fn qemu_10_uses_extended_headers_with_64_bit_lengths() {
    let (Some(io), Some(img)) = (qemu_ext("qemu-io"), qemu_ext("qemu-img")) else {
        return;
    };
    if !have("qemu-img") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(&d.path().join("pool"));
    s.create("big", 6 << 30);
    let uri = s.uri("big");
    let out = run(Command::new(&io)
        .args([
            "--trace",
            "nbd_receive_option_reply",
            "--trace",
            "nbd_send_request",
        ])
        .args([
            "--trace",
            "nbd_receive_reply_chunk_header",
            "-f",
            "raw",
            &uri,
        ])
        .args(["-c", "write -P 0xa5 0 1M", "-c", "write -P 0x5a 5632M 1M"])
        .args(["-c", "write -P 0x33 8M 1M", "-c", "write -P 0x44 5127M 1M"])
        .args(["-c", "write -P 0x55 5128M 1M"])
        // One request of 5 GiB (compact headers stop at 4 GiB).
        .args(["-c", "write -z -n 8M 5G"])
        .args(["-c", "read -P 0xa5 0 1M", "-c", "read -P 0 8M 1M"])
        .args(["-c", "read -P 0 5127M 1M", "-c", "read -P 0x55 5128M 1M"])
        .args(["-c", "read -P 0x5a 5632M 1M"])
        .args(["-c", "aio_write -P 0x66 2M 64k", "-c", "aio_flush"])
        .args(["-c", "read -P 0x66 2M 64k", "-c", "map"])
        .stderr(std::process::Stdio::piped()));
    let trace = String::from_utf8_lossy(
        &Command::new(&io)
            .args(["--trace", "nbd_*", "-f", "raw", &uri, "-c", "map"])
            .output()
            .unwrap()
            .stderr,
    )
    .into_owned();
    assert!(!out.contains("verification failed"), "{out}");
    assert!(!out.to_lowercase().contains("error"), "{out}");
    assert!(
        trace.contains("option reply 11 (extended headers), type 1 (ack)"),
        "extended headers not negotiated:\n{trace}"
    );
    assert!(
        trace.contains("block status (64-bit)") && trace.contains(".len = 6442450944"),
        "no 64-bit block status over the whole volume:\n{trace}"
    );
    // The map over extended headers is the map over compact ones.
    let map_ext = run(Command::new(&img).args(["map", "--output=json", "-f", "raw", &uri]))
        // A field QEMU 7.2 does not print.
        .replace("\"compressed\": false, ", "");
    let map_compact =
        run(Command::new("qemu-img").args(["map", "--output=json", "-f", "raw", &uri]));
    assert_eq!(map_ext, map_compact);
    assert!(map_ext.contains("\"start\": 5905580032"), "{map_ext}");
    // Whole images in and out through extended headers.
    s.create("copy", 32 << 20);
    let src = d.path().join("in.img");
    let back = d.path().join("out.img");
    make_image(&src, 32);
    let copy = s.uri("copy");
    run(Command::new(&img)
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&src)
        .arg(&copy));
    run(Command::new(&img)
        .args(["convert", "-f", "raw", "-O", "raw", &copy])
        .arg(&back));
    assert_eq!(sha(&src), sha(&back));
}
