//! RBD images in a real Ceph cluster (started by the test command, or by
//! this test): I/O, allocation map, zeroing, resize, lock, metadata, errors.

use ferry_rbd::{testing, Cluster, ClusterConfig, RbdError};

fn pool() -> std::sync::Arc<ferry_rbd::Pool> {
    let c = Cluster::connect(&testing::cluster(0), 30).expect("connect");
    c.pool(testing::POOL).expect("pool")
}

#[test]
fn an_image_reads_back_what_was_written_and_maps_its_holes() {
    let p = pool();
    let name = testing::unique("io");
    p.create(&name, 64 << 20).unwrap();
    assert!(p.list().unwrap().contains(&name));
    let img = p.open(&name, false).unwrap();
    assert_eq!(img.size().unwrap(), 64 << 20);
    assert!(img.is_lock_owner().unwrap());
    let mut buf = vec![7u8; 4096];
    img.read_at(&mut buf, 10 << 20).unwrap();
    assert!(buf.iter().all(|&b| b == 0), "a new image reads as zeroes");
    img.write_at(&[0xa5; 8192], 20 << 20).unwrap();
    img.write_at(&[0x5a; 512], 40 << 20).unwrap();
    img.flush().unwrap();
    img.read_at(&mut buf, 20 << 20).unwrap();
    assert!(buf.iter().all(|&b| b == 0xa5));
    let ext = img.extents(0, 64 << 20, 100).unwrap();
    let data: Vec<_> = ext.iter().filter(|e| e.allocated).collect();
    assert_eq!(data.len(), 2, "{ext:?}");
    assert!(data[0].offset <= 20 << 20 && data[0].offset + data[0].length >= (20 << 20) + 8192);
    assert_eq!(ext.iter().map(|e| e.length).sum::<u64>(), 64 << 20);
    assert!(img.allocated_bytes().unwrap() >= 8192 + 512);

    // Zeroes read back as zeroes, even inside an object.
    img.write_zeroes((20 << 20) + 4096, 4096).unwrap();
    img.read_at(&mut buf, (20 << 20) + 4096).unwrap();
    assert!(buf.iter().all(|&b| b == 0));
    img.read_at(&mut buf, 20 << 20).unwrap();
    assert!(buf.iter().all(|&b| b == 0xa5));
    // Zeroing a whole object deallocates it.
    img.write_zeroes(40 << 20, 4 << 20).unwrap();
    let ext = img.extents(40 << 20, 4 << 20, 10).unwrap();
    assert!(ext.iter().all(|e| !e.allocated), "{ext:?}");

    img.resize(128 << 20, false).unwrap();
    assert_eq!(img.size().unwrap(), 128 << 20);
    img.resize(32 << 20, true).unwrap();
    assert_eq!(img.size().unwrap(), 32 << 20);
    assert!(
        img.read_at(&mut buf, 40 << 20).is_err(),
        "read past the end"
    );

    img.metadata_set("ferry.meta", "{\"a\":1}").unwrap();
    assert_eq!(
        img.metadata_get("ferry.meta").unwrap().as_deref(),
        Some("{\"a\":1}")
    );
    assert_eq!(img.metadata_get("ferry.none").unwrap(), None);
    img.metadata_remove("ferry.meta").unwrap();
    assert_eq!(img.metadata_get("ferry.meta").unwrap(), None);
    drop(img);
    p.remove(&name).unwrap();
    assert!(!p.list().unwrap().contains(&name));
}

#[test]
fn asynchronous_writes_land_whether_or_not_they_are_awaited() {
    let p = pool();
    let name = testing::unique("aio");
    p.create(&name, 16 << 20).unwrap();
    let img = p.open(&name, false).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        // 64 writes of 4 KiB in flight at once, each its own byte.
        let writes: Vec<_> = (0..64u8)
            .map(|i| {
                img.write_async(bytes::Bytes::from(vec![i + 1; 4096]), u64::from(i) * 65536)
                    .unwrap()
            })
            .collect();
        for w in writes {
            w.await.unwrap();
        }
        // Past the end: refused, at the start or when it ends.
        let past = img.write_async(bytes::Bytes::from(vec![1; 4096]), 16 << 20);
        match past {
            Err(e) => assert!(e.to_string().contains("write"), "{e}"),
            Ok(w) => assert!(w.await.is_err(), "a write past the end succeeded"),
        }
    });
    // A write whose future is dropped at once still lands (librbd kept
    // its data).
    drop(
        img.write_async(bytes::Bytes::from(vec![0xee; 4096]), 8 << 20)
            .unwrap(),
    );
    img.flush().unwrap();
    let mut buf = vec![0u8; 4096];
    for i in 0..64u8 {
        img.read_at(&mut buf, u64::from(i) * 65536).unwrap();
        assert!(buf.iter().all(|&b| b == i + 1), "write {i}");
    }
    img.read_at(&mut buf, 8 << 20).unwrap();
    assert!(buf.iter().all(|&b| b == 0xee));
    drop(img);
    p.remove(&name).unwrap();
}

#[test]
fn a_second_writer_is_refused_while_readers_are_let_in() {
    let p = pool();
    let name = testing::unique("lock");
    p.create(&name, 8 << 20).unwrap();
    let first = p.open(&name, false).unwrap();
    first.write_at(&[1; 4096], 0).unwrap();
    // Another client (another gateway) asks to write: refused, the owner named.
    let other = Cluster::connect(&testing::cluster(0), 30)
        .unwrap()
        .pool(testing::POOL)
        .unwrap();
    match other.open(&name, false) {
        Err(RbdError::Locked { owners, .. }) => assert!(!owners.is_empty()),
        other => panic!("second writer: {other:?}"),
    }
    // A reader sees the data and does not disturb the writer.
    let reader = other.open(&name, true).unwrap();
    let mut b = [0u8; 4096];
    reader.read_at(&mut b, 0).unwrap();
    assert_eq!(b, [1; 4096]);
    first.write_at(&[2; 4096], 4096).unwrap();
    assert!(first.is_lock_owner().unwrap());
    // Closed, the lock passes to the next writer.
    drop(first);
    let second = other.open(&name, false).unwrap();
    second.write_at(&[3; 4096], 0).unwrap();
    drop((second, reader));
    p.remove(&name).unwrap();
}

#[test]
fn missing_things_are_named_in_the_error() {
    let c = Cluster::connect(&testing::cluster(0), 30).unwrap();
    let e = c.pool("no-such-pool").unwrap_err();
    assert!(matches!(e, RbdError::NoPool(_)), "{e}");
    assert!(e.to_string().contains("no-such-pool"));
    let p = c.pool(testing::POOL).unwrap();
    let e = p.open("no-such-image", false).unwrap_err();
    assert!(matches!(e, RbdError::NoImage { .. }), "{e}");
    let name = testing::unique("dup");
    p.create(&name, 1 << 20).unwrap();
    assert!(matches!(
        p.create(&name, 1 << 20),
        Err(RbdError::Exists { .. })
    ));
    p.remove(&name).unwrap();
    assert!(matches!(p.remove(&name), Err(RbdError::NoImage { .. })));
    assert!(matches!(p.open("", false), Err(RbdError::BadName(_))));
    assert!(matches!(p.open("a\0b", false), Err(RbdError::BadName(_))));
}

#[test]
fn a_wrong_key_or_a_dead_monitor_is_a_connect_error() {
    let good = testing::cluster(0);
    let d = tempfile::tempdir().unwrap();
    // A key the cluster never issued.
    let bad = d.path().join("keyring");
    std::fs::write(
        &bad,
        "[client.admin]\n\tkey = AQBjg0BnAAAAABAAr0y2h0r0gB9F5e8Kc8b5xA==\n",
    )
    .unwrap();
    let e = Cluster::connect(
        &ClusterConfig {
            keyring: Some(bad),
            ..good.clone()
        },
        5,
    )
    .unwrap_err();
    assert!(matches!(e, RbdError::Connect { .. }), "{e}");
    // No monitor listening.
    let conf = d.path().join("ceph.conf");
    std::fs::write(&conf, "[global]\nmon host = v1:127.0.0.1:9\n").unwrap();
    let e = Cluster::connect(&ClusterConfig { conf, ..good }, 3).unwrap_err();
    assert!(matches!(e, RbdError::Connect { .. }), "{e}");
}

#[test]
fn a_dead_writers_lock_is_broken_and_the_writer_fenced() {
    let name = testing::unique("fence");
    let first = Cluster::connect(&testing::cluster(0), 30).unwrap();
    let p1 = first.pool(testing::POOL).unwrap();
    p1.create(&name, 8 << 20).unwrap();
    let img = p1.open(&name, false).unwrap();
    img.write_at(&[1; 4096], 0).unwrap();
    // Another client, told the first is dead (a restarted gateway that
    // recorded its predecessor's address), takes the image at once.
    let addr = first.address();
    assert!(!addr.is_empty());
    let second = Cluster::connect(&testing::cluster(0), 30).unwrap();
    let p2 = second.pool(testing::POOL).unwrap();
    let t = std::time::Instant::now();
    let taken = p2.open_breaking(&name, false, &[addr]).unwrap();
    assert!(
        t.elapsed() < std::time::Duration::from_secs(20),
        "{:?}",
        t.elapsed()
    );
    taken.write_at(&[2; 4096], 0).unwrap();
    // The first is fenced: its writes fail instead of landing behind the
    // new owner's.
    assert!(img.write_at(&[3; 4096], 0).is_err());
    let mut b = [0u8; 4096];
    taken.read_at(&mut b, 0).unwrap();
    assert_eq!(b, [2; 4096]);
    drop(taken);
    p2.remove(&name).unwrap();
}

#[test]
fn an_open_locked_image_is_renamed_in_one_step_and_a_taken_name_refused() {
    let p = pool();
    let (from, to, taken) = (
        testing::unique("ren-from"),
        testing::unique("ren-to"),
        testing::unique("ren-taken"),
    );
    p.create(&from, 4 << 20).unwrap();
    p.create(&taken, 4 << 20).unwrap();
    let img = p.open(&from, false).unwrap();
    img.write_at(&[0x3c; 4096], 0).unwrap();
    match p.rename(&from, &taken) {
        Err(RbdError::Exists { image, .. }) => assert_eq!(image, taken),
        other => panic!("{other:?}"),
    }
    // Renamed under its writer, which goes on writing and holding it.
    p.rename(&from, &to).unwrap();
    img.write_at(&[0x3d; 4096], 4096).unwrap();
    img.flush().unwrap();
    assert!(img.is_lock_owner().unwrap());
    let names = p.list().unwrap();
    assert!(names.contains(&to) && !names.contains(&from), "{names:?}");
    drop(img);
    let back = p.open(&to, true).unwrap();
    let mut buf = vec![0u8; 8192];
    back.read_at(&mut buf, 0).unwrap();
    assert!(buf[..4096].iter().all(|&b| b == 0x3c) && buf[4096..].iter().all(|&b| b == 0x3d));
    drop(back);
    match p.rename(&from, &testing::unique("ren-none")) {
        Err(RbdError::NoImage { image, .. }) => assert_eq!(image, from),
        other => panic!("{other:?}"),
    }
    p.remove(&to).unwrap();
    p.remove(&taken).unwrap();
}

#[test]
fn a_lease_has_one_holder_until_it_is_released_or_runs_out() {
    let p = pool();
    let object = testing::unique("lease");
    assert!(p.lease(&object, "portal", "one", 30).unwrap());
    // Another holder waits; the holder renews.
    assert!(!p.lease(&object, "portal", "two", 30).unwrap());
    assert!(p.lease(&object, "portal", "one", 30).unwrap());
    // Released, the next takes it at once.
    p.release_lease(&object, "portal", "one").unwrap();
    assert!(p.lease(&object, "portal", "two", 2).unwrap());
    assert!(!p.lease(&object, "portal", "one", 2).unwrap());
    // A holder that stops renewing (a dead gateway) loses it when it runs
    // out; releasing a lease one does not hold changes nothing.
    std::thread::sleep(std::time::Duration::from_millis(2500));
    p.release_lease(&object, "portal", "three").unwrap();
    assert!(p.lease(&object, "portal", "one", 30).unwrap());
    assert!(!p.lease(&object, "portal", "two", 30).unwrap());
    let holders = p.lease_holders(&object, "portal").unwrap();
    assert_eq!(holders.len(), 1, "{holders:?}");
    assert_eq!(holders[0].cookie, "one");
    p.release_lease(&object, "portal", "one").unwrap();
    assert!(p.lease_holders(&object, "portal").unwrap().is_empty());

    // A holder known dead is fenced and its lease taken at once: another
    // client of the cluster holds it, is broken, and cannot renew.
    let other = Cluster::connect(&testing::cluster(0), 30)
        .unwrap()
        .pool(testing::POOL)
        .unwrap();
    assert!(other.lease(&object, "portal", "victim", 30).unwrap());
    let victim = p.lease_holders(&object, "portal").unwrap();
    assert_eq!(victim[0].cookie, "victim");
    p.cluster().blocklist(&victim[0].address).unwrap();
    p.break_lease(&object, "portal", &victim[0]).unwrap();
    assert!(p.lease(&object, "portal", "one", 30).unwrap());
    // The fenced client's renewal fails (or never returns: it is cut off).
    let (tx, rx) = std::sync::mpsc::channel();
    let o = object.clone();
    std::thread::spawn(move || {
        let _ = tx.send(other.lease(&o, "portal", "victim", 30).is_ok());
    });
    match rx.recv_timeout(std::time::Duration::from_secs(20)) {
        Ok(renewed) => assert!(!renewed, "a fenced client renewed its lease"),
        Err(_) => eprintln!("the fenced client's renewal did not return in 20 s"),
    }
    assert_eq!(p.lease_holders(&object, "portal").unwrap()[0].cookie, "one");
    p.release_lease(&object, "portal", "one").unwrap();
}
