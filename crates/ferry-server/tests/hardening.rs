//! Mistakes an operator can make, refused with a clear answer: deleting a
//! volume in use, a reserved bitmap name, sizes beyond what the pool's file
//! system can hold, and a resize that fails half-way.
// Test fixtures: sizes, offsets and byte patterns the test itself chooses.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

mod common;

use common::TestServer;
use ferry_api::{AdminClient, BitmapRequest, CreateVolume, MigrateRequest, MigrationPhase, Size};
use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

#[test]
fn a_volume_in_use_is_not_deleted_unless_forced_and_never_while_it_migrates() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start(&dir.path().join("a"));
    let dst = TestServer::start_with(&dir.path().join("b"), |c| {
        c.migration.listen = "127.0.0.1:0".into();
        c.migration.plaintext = true;
    });
    let c = AdminClient::new(&s.admin.to_string());
    s.create("busy", 4 * MIB)
        .write_at(0, &[7; 4096], false)
        .unwrap();

    // An NBD client holds it: 409 naming the holder.
    let client = s
        .rt()
        .block_on(ferry_client::NbdClient::connect(
            &s.nbd.to_string(),
            "busy",
            &Default::default(),
        ))
        .unwrap();
    let e = c.delete_volume("busy", false).unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    assert!(e.to_string().contains("1 NBD client"), "{e}");
    assert!(s.state.pool.get("busy").is_ok());
    // Forced: gone, and the client's next request fails instead of reaching
    // a deleted file.
    c.delete_volume("busy", true).unwrap();
    assert!(c.volume("busy").unwrap().is_none());
    assert!(s.rt().block_on(client.read(0, 4096)).is_err());
    drop(client);

    // A migration holds it: 409 even with force, until it ends.
    s.create("moving", 16 * MIB)
        .write_at(0, &vec![3; 8 << 20], false)
        .unwrap();
    let run = c
        .migrate(
            "moving",
            &MigrateRequest {
                to: dst.migration.unwrap().to_string(),
                plaintext: true,
                hold_switch: true,
                ..MigrateRequest::default()
            },
        )
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while c.migration(&run.id).unwrap().phase != MigrationPhase::ReadyToSwitch {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(20));
    }
    for force in [false, true] {
        let e = c.delete_volume("moving", force).unwrap_err();
        assert_eq!(e.status(), Some(409), "{e}");
        assert!(e.to_string().contains("outgoing migration"), "{e}");
    }
    // The destination's incomplete copy is held by its incoming migration.
    let dc = AdminClient::new(&dst.admin.to_string());
    let e = dc.delete_volume("moving", true).unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    assert!(e.to_string().contains("incoming migration"), "{e}");
    c.cancel_migration(&run.id).unwrap();
    assert_eq!(
        c.watch_migration(&run.id, |_| {}).unwrap().phase,
        MigrationPhase::Failed
    );
    c.delete_volume("moving", false).unwrap();
}

#[test]
fn reserved_bitmaps_and_impossible_sizes_are_refused_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start(dir.path());
    let c = AdminClient::new(&s.admin.to_string());
    s.create("v", 4 * MIB);
    for name in ["ferry-index", "ferry-anything", "migration-0123456789ab"] {
        let e = c
            .create_bitmap(
                "v",
                &BitmapRequest {
                    name: name.into(),
                    granularity: 65536,
                    persistent: false,
                },
            )
            .unwrap_err();
        assert_eq!(e.status(), Some(400), "{name}: {e}");
        assert!(e.to_string().contains("reserved"), "{e}");
    }
    // The index's own marks are not cleared by hand (its prints trust them).
    ferry_server::indexer::rebuild_volume(&s.state.index, &s.state.pool.get("v").unwrap()).unwrap();
    s.state
        .pool
        .get("v")
        .unwrap()
        .write_at(0, &[7u8; 4096], false)
        .unwrap();
    let e = c.clear_bitmap("v", "ferry-index").unwrap_err();
    assert_eq!(e.status(), Some(400), "{e}");
    assert!(e.to_string().contains("stale prints"), "{e}");
    let marks = c.bitmaps("v").unwrap();
    let index = marks.iter().find(|b| b.name == "ferry-index").unwrap();
    assert_eq!(index.dirty_bytes, 4096, "{marks:?}");
    // Sizes no file system here holds: 400 with the reason, nothing created.
    for size in [Size::Bytes(1 << 62), Size::Text("9000000T".into())] {
        let e = c
            .create_volume(&CreateVolume {
                name: "huge".into(),
                size: Some(size.clone()),
                ..CreateVolume::default()
            })
            .unwrap_err();
        assert_eq!(e.status(), Some(400), "{size:?}: {e}");
        assert!(c.volume("huge").unwrap().is_none());
    }
    // A resize the file system refuses leaves the volume exactly as it was,
    // in the API, on NBD and after a restart.
    let e = c
        .resize_volume("v", Size::Bytes(1 << 62), false)
        .unwrap_err();
    assert_eq!(e.status(), Some(400), "{e}");
    assert_eq!(c.get_volume("v").unwrap().size, 4 * MIB);
    assert_eq!(s.state.pool.get("v").unwrap().size(), 4 * MIB);
    let pool = s.pool.clone();
    s.stop();
    let s = TestServer::start(&pool);
    assert_eq!(s.state.pool.get("v").unwrap().size(), 4 * MIB);
}

/// An idle client that has the NBD greeting and holds its slot.
fn idle(addr: SocketAddr, from: &str) -> TcpStream {
    let sock = connect_from(addr, from);
    let mut g = [0u8; 18];
    (&sock).read_exact(&mut g).unwrap();
    assert_eq!(&g[..8], b"NBDMAGIC");
    sock
}

/// Connect from a chosen loopback address (127.0.0.0/8 all reach us).
fn connect_from(addr: SocketAddr, from: &str) -> TcpStream {
    let local: SocketAddr = format!("{from}:0").parse().unwrap();
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind(local).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let s = rt.block_on(sock.connect(addr)).unwrap().into_std().unwrap();
    s.set_nonblocking(false).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// What a client over the limit sees: the greeting, then the end, at once.
fn refused_at_once(addr: SocketAddr, from: &str) {
    let t = Instant::now();
    let mut s = connect_from(addr, from);
    let mut all = Vec::new();
    let _ = s.read_to_end(&mut all);
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "refused, not left hanging"
    );
    assert_eq!(all.len(), 18, "the greeting, then the close");
    assert_eq!(&all[..8], b"NBDMAGIC");
}

#[test]
fn nbd_clients_over_the_limits_are_refused_at_once_and_one_peer_cannot_take_every_slot() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_with(dir.path(), |c| {
        c.nbd.max_connections = 4;
        c.nbd.max_connections_per_peer = 2;
    });
    let a1 = idle(s.nbd, "127.0.0.1");
    let _a2 = idle(s.nbd, "127.0.0.1");
    // A third from the same address is over its share...
    refused_at_once(s.nbd, "127.0.0.1");
    // ...while other hosts still get in, up to the listener's limit.
    let _b1 = idle(s.nbd, "127.0.0.2");
    let _b2 = idle(s.nbd, "127.0.0.3");
    refused_at_once(s.nbd, "127.0.0.4");
    // A freed slot is usable again.
    let metrics = || {
        ureq::get(&format!("http://{}/metrics", s.admin))
            .call()
            .unwrap()
            .into_string()
            .unwrap()
    };
    drop(a1);
    // The slot is free once the server has seen the close (however slow
    // this machine is today), not after a fixed wait.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !metrics().contains("ferry_nbd_connections 3\n") {
        assert!(Instant::now() < deadline, "the close was never seen");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(50));
    let _a3 = idle(s.nbd, "127.0.0.1");
    let m = metrics();
    assert!(m.contains("ferry_connections_refused_total 2"), "{m}");
}

#[test]
fn a_destination_without_room_refuses_before_anything_is_written_and_is_not_retried() {
    let dir = tempfile::tempdir().unwrap();
    let src = TestServer::start(&dir.path().join("a"));
    // Keep free more than the file system has: no copy fits.
    let dst = TestServer::start_with(&dir.path().join("b"), |c| {
        c.migration.listen = "127.0.0.1:0".into();
        c.migration.plaintext = true;
        c.migration.reserve_bytes = u64::MAX / 2;
    });
    src.create("vm", 16 * MIB)
        .write_at(0, &vec![9; 8 << 20], false)
        .unwrap();
    let c = AdminClient::new(&src.admin.to_string());
    let t = Instant::now();
    let run = c
        .migrate(
            "vm",
            &MigrateRequest {
                to: dst.migration.unwrap().to_string(),
                plaintext: true,
                ..MigrateRequest::default()
            },
        )
        .unwrap();
    let last = c.watch_migration(&run.id, |_| {}).unwrap();
    assert_eq!(last.phase, MigrationPhase::Failed);
    let report = last.report.unwrap();
    assert_eq!(report.attempts, 1, "a full disk is not retried");
    assert!(t.elapsed() < Duration::from_secs(10));
    let err = last.error.unwrap_or_default();
    assert!(err.contains("not enough space"), "{err}");
    assert!(dst.state.pool.get("vm").is_err(), "nothing created");
    assert!(src.state.pool.get("vm").unwrap().moved_to().is_none());
}

#[test]
fn a_volume_path_may_not_alias_the_pool_or_another_volume_and_data_files_are_locked() {
    let dir = tempfile::tempdir().unwrap();
    let pool = dir.path().join("pool");
    let top = dir.path().to_path_buf();
    let s = TestServer::start_with(&pool, |c| c.storage.allowed_paths = vec![top]);
    let c = AdminClient::new(&s.admin.to_string());
    let inside = s.create("inside", MIB);
    let ext = dir.path().join("ext.raw");
    std::fs::write(&ext, vec![1u8; MIB as usize]).unwrap();
    let create = |name: &str, path: &std::path::Path| {
        c.create_volume(&CreateVolume {
            name: name.into(),
            path: Some(path.to_path_buf()),
            ..CreateVolume::default()
        })
    };
    create("x", &ext).unwrap();
    for (name, path, why) in [
        ("y", inside.data_path().to_path_buf(), "inside the pool"),
        ("y", ext.clone(), "already the data of volume x"),
        ("y", dir.path().join("."), "outside storage.allowed_paths"),
        (
            "y",
            {
                let sub = dir.path().join("sub");
                std::fs::create_dir_all(&sub).unwrap();
                sub
            },
            "not a regular file",
        ),
    ] {
        let e = create(name, &path).unwrap_err();
        assert!(
            matches!(e.status(), Some(400 | 403)),
            "{}: {e}",
            path.display()
        );
        assert!(e.to_string().contains(why), "{e}");
        assert!(c.volume(name).unwrap().is_none());
    }
    // A pool edited by hand so that two volumes share one file: the second
    // cannot take the file's lock and is not opened (the first is intact).
    s.stop();
    let meta_x = pool.join("volumes/x/meta.json");
    let twin = pool.join("volumes/twin");
    std::fs::create_dir(&twin).unwrap();
    let text = std::fs::read_to_string(&meta_x)
        .unwrap()
        .replace("\"name\": \"x\"", "\"name\": \"twin\"");
    std::fs::write(twin.join("meta.json"), text).unwrap();
    let s = TestServer::start(&pool);
    let names: Vec<String> = s.state.pool.list().iter().map(|v| v.name()).collect();
    assert_eq!(
        names.iter().filter(|n| *n == "x" || *n == "twin").count(),
        1,
        "{names:?}"
    );
}

#[test]
fn an_import_cut_half_way_stays_marked_incomplete_and_unexported_until_one_finishes() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let pool = dir.path().join("pool");
    let s = TestServer::start(&pool);
    s.create("img", 8 * MIB);
    // An upload that promises 8 MiB and stops after 1 MiB (the client died).
    let mut t = TcpStream::connect(s.admin).unwrap();
    write!(
        t,
        "PUT /v1/volumes/img/data HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\n\r\n",
        8 * MIB
    )
    .unwrap();
    t.write_all(&vec![0xab; MIB as usize]).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    drop(t);
    let c = AdminClient::new(&s.admin.to_string());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !c.get_volume("img").unwrap().importing {
        assert!(Instant::now() < deadline, "the import never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let nbd = |s: &TestServer| {
        s.rt().block_on(ferry_client::NbdClient::connect(
            &s.nbd.to_string(),
            "img",
            &Default::default(),
        ))
    };
    assert!(c.get_volume("img").unwrap().importing);
    assert!(nbd(&s).is_err(), "a partial image is not exported");
    // Still so after a restart.
    s.stop();
    let s = TestServer::start(&pool);
    let c = AdminClient::new(&s.admin.to_string());
    assert!(c.get_volume("img").unwrap().importing);
    assert!(nbd(&s).is_err());
    // A whole import clears it.
    let image = vec![0xcd; 8 * MIB as usize];
    c.import("img", &image[..], 8 * MIB).unwrap();
    assert!(!c.get_volume("img").unwrap().importing);
    let cl = nbd(&s).unwrap();
    let got = s.rt().block_on(cl.read(0, 4096)).unwrap();
    assert!(got.iter().all(|&b| b == 0xcd));
}

/// Rewrite a stopped daemon's volume metadata as if it had crashed just
/// after sending Switch: no `moved_to`, the migration journaled with
/// `switch_sent`.
fn journal_switch_sent(pool: &std::path::Path, volume: &str, id: &str, to: &str) {
    let path = pool.join("volumes").join(volume).join("meta.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let o = m.as_object_mut().unwrap();
    o.remove("moved_to");
    o.insert(
        "outgoing".into(),
        serde_json::json!({"id": id, "to": to, "switch_sent": true, "plaintext": true}),
    );
    std::fs::write(&path, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
}

/// Two volumes of a stopped source daemon, both journaled as if it had
/// crashed just after sending Switch to `dst`: "vm" moved there for real,
/// "w2" was never committed. Returns the destination, the request that
/// reaches it, and vm's migration id.
fn held_in_doubt(
    pa: &std::path::Path,
    pb: &std::path::Path,
) -> (TestServer, MigrateRequest, ferry_api::MigrationId) {
    let src = TestServer::start(pa);
    let dst = TestServer::start_with(pb, |c| {
        c.migration.listen = "127.0.0.1:0".into();
        c.migration.plaintext = true;
    });
    let to = dst.migration.unwrap().to_string();
    let req = MigrateRequest {
        to: to.clone(),
        plaintext: true,
        ..MigrateRequest::default()
    };
    src.create("vm", 8 * MIB)
        .write_at(0, &vec![5; 4 << 20], false)
        .unwrap();
    src.create("w2", 8 * MIB)
        .write_at(0, &vec![6; 4 << 20], false)
        .unwrap();
    let c = AdminClient::new(&src.admin.to_string());
    // vm: moved for real; then the source "forgets" it learned so.
    let run = c.migrate("vm", &req).unwrap();
    assert_eq!(
        c.watch_migration(&run.id, |_| {}).unwrap().phase,
        MigrationPhase::Switched
    );
    src.stop();
    journal_switch_sent(pa, "vm", run.id.as_str(), &to);
    // w2: "crashed" before the destination committed anything.
    let other = ferry_api::MigrationId::random();
    journal_switch_sent(pa, "w2", other.as_str(), &to);
    (dst, req, run.id)
}

#[test]
fn a_source_restarted_after_switch_holds_the_volume_until_the_destination_answers() {
    let dir = tempfile::tempdir().unwrap();
    let pa = dir.path().join("a");
    let (dst, req, vm_id) = held_in_doubt(&pa, &dir.path().join("b"));
    let src = TestServer::start(&pa);
    let c = AdminClient::new(&src.admin.to_string());
    for name in ["vm", "w2"] {
        let v = src.state.pool.get(name).unwrap();
        assert!(v.in_doubt(), "{name}");
        assert!(
            v.write_at(0, b"x", false).is_err(),
            "{name}: no writes while in doubt"
        );
        let nbd = src.rt().block_on(ferry_client::NbdClient::connect(
            &src.nbd.to_string(),
            name,
            &Default::default(),
        ));
        assert!(nbd.is_err(), "{name}: not served while in doubt");
        assert!(c.get_volume(name).unwrap().outgoing.is_some());
    }
    // Only the same destination can settle it.
    let e = c
        .migrate(
            "vm",
            &MigrateRequest {
                to: "127.0.0.1:1".into(),
                ..req.clone()
            },
        )
        .unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    // Nor can another migration id: it would not find out what happened,
    // and a refusal must not release the hold.
    let e = c
        .migrate(
            "vm",
            &MigrateRequest {
                id: Some(ferry_api::MigrationId::random()),
                ..req.clone()
            },
        )
        .unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    assert!(src.state.pool.get("vm").unwrap().in_doubt());
    // The destination had committed vm: the source learns it, marks it moved.
    let r = c.migrate("vm", &req).unwrap();
    let last = c.watch_migration(&r.id, |_| {}).unwrap();
    assert_eq!(last.phase, MigrationPhase::Switched, "{last:?}");
    assert_eq!(r.id, vm_id, "the journaled id is reused");
    let v = c.get_volume("vm").unwrap();
    assert_eq!(v.moved_to.as_deref(), Some(&*dst.nbd.to_string()));
    assert!(v.outgoing.is_none());
    // It had not committed w2: the guest writes again and the move goes on.
    let r = c.migrate("w2", &req).unwrap();
    let last = c.watch_migration(&r.id, |_| {}).unwrap();
    assert_eq!(last.phase, MigrationPhase::Switched, "{last:?}");
    let copy = dst.state.pool.get("w2").unwrap();
    let mut b = vec![0u8; 4096];
    copy.read_at(0, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 6));
}

#[test]
fn a_source_held_in_doubt_asks_the_destination_by_itself() {
    let dir = tempfile::tempdir().unwrap();
    let pa = dir.path().join("a");
    let (dst, _, _) = held_in_doubt(&pa, &dir.path().join("b"));
    let src = TestServer::start_with(&pa, |c| c.migration.in_doubt_check_secs = 1);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let settled = |name: &str| !src.state.pool.get(name).unwrap().in_doubt();
    while !(settled("vm") && settled("w2")) {
        assert!(std::time::Instant::now() < deadline, "still held in doubt");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // The destination had committed vm: marked moved there.
    let vm = src.state.pool.get("vm").unwrap();
    assert_eq!(vm.moved_to().as_deref(), Some(&*dst.nbd.to_string()));
    // It had not committed w2: served and writable here again, not moved,
    // and the journal kept so the same migration resumes when run again.
    let w2 = src.state.pool.get("w2").unwrap();
    assert!(w2.moved_to().is_none());
    w2.write_at(0, b"x", false).unwrap();
    assert!(w2.outgoing().is_some_and(|o| !o.switch_sent));
    assert!(dst
        .state
        .pool
        .get("w2")
        .map_or(true, |v| v.incoming().is_some()));
}
