//! The typed admin API of migrations, through `ferry_api::AdminClient`
//! against two real daemons: a migration held before its switch while the
//! guest keeps writing, released by the caller; idempotent ids; the event
//! stream; and the error answers.
// Test fixtures: sizes, offsets and byte patterns the test itself chooses.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

mod common;

use common::{sha, TestServer};
use ferry_api::{AdminClient, ClientError, MigrateRequest, MigrationId, MigrationPhase};
use std::path::Path;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

/// Two daemons on loopback with plaintext migration links (the TLS path
/// is covered by tests/migration.rs).
fn pair(dir: &Path) -> (TestServer, TestServer) {
    let src = TestServer::start(&dir.join("a"));
    let dst = TestServer::start_with(&dir.join("b"), |c| {
        c.migration.listen = "127.0.0.1:0".into();
        c.migration.plaintext = true;
    });
    (src, dst)
}

fn client(s: &TestServer) -> AdminClient {
    AdminClient::new(&s.admin.to_string())
}

fn request(to: &TestServer) -> MigrateRequest {
    MigrateRequest {
        to: to.migration.unwrap().to_string(),
        plaintext: true,
        ..MigrateRequest::default()
    }
}

fn fill(v: &ferry_storage::Volume, seed: u8) {
    let data: Vec<u8> = (0..8 * MIB as usize)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect();
    v.write_at(0, &data, false).unwrap();
}

#[test]
fn a_held_migration_waits_for_release_while_writes_go_on_then_switches() {
    let dir = tempfile::tempdir().unwrap();
    let (src, dst) = pair(dir.path());
    let v = src.create("vm", 32 * MIB);
    fill(&v, 1);
    let c = client(&src);
    let id = MigrationId::random();
    let started = c
        .migrate(
            "vm",
            &MigrateRequest {
                id: Some(id.clone()),
                hold_switch: true,
                ..request(&dst)
            },
        )
        .unwrap();
    assert_eq!(started.id, id);
    assert!(started.hold_switch && !started.switch_released);

    // Follow the event stream in a thread; it must report the hold.
    let watcher = {
        let c = client(&src);
        let id = id.clone();
        std::thread::spawn(move || {
            let mut phases = Vec::new();
            let last = c
                .watch_migration(&id, |s| {
                    if phases.last() != Some(&s.phase) {
                        phases.push(s.phase);
                    }
                })
                .unwrap();
            (phases, last)
        })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while c.migration(&id).unwrap().phase != MigrationPhase::ReadyToSwitch {
        assert!(Instant::now() < deadline, "{:?}", c.migration(&id));
        std::thread::sleep(Duration::from_millis(20));
    }
    // Held: the guest still writes, and the writes keep crossing.
    for i in 0..20u64 {
        v.write_at(i * 4096 * 7, &[0xA5; 4096], false).unwrap();
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(500));
    let s = c.migration(&id).unwrap();
    assert_eq!(s.phase, MigrationPhase::ReadyToSwitch);
    assert!(v.moved_to().is_none());
    assert!(dst.state.pool.get("vm").unwrap().incoming().is_some());

    // Ready: released by the call a teleport's host makes at its pause.
    let released = c.release_switch_if_ready(&id).unwrap();
    assert!(released.switch_released);
    let (phases, last) = watcher.join().unwrap();
    assert_eq!(last.phase, MigrationPhase::Switched, "{last:?}");
    let report = last.report.unwrap();
    assert!(report.time.held_s > 0.4, "{:?}", report.time);
    assert!(report.digest.matches);
    let held_at = phases
        .iter()
        .position(|p| *p == MigrationPhase::ReadyToSwitch)
        .expect("the stream showed the hold");
    let paused_at = phases
        .iter()
        .position(|p| *p == MigrationPhase::Paused)
        .unwrap_or(usize::MAX);
    assert!(
        held_at < phases.len() - 1 && paused_at > held_at,
        "{phases:?}"
    );
    let copy = dst.state.pool.get("vm").unwrap();
    assert!(copy.incoming().is_none());
    assert_eq!(sha(v.data_path()), sha(copy.data_path()));

    // Releasing an ended migration is a conflict.
    let e = c.release_switch(&id).unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    let e = c.release_switch_if_ready(&id).unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
}

#[test]
fn a_named_migration_is_idempotent_and_conflicts_are_409() {
    let dir = tempfile::tempdir().unwrap();
    let (src, dst) = pair(dir.path());
    fill(&src.create("vm", 16 * MIB), 2);
    src.create("other", 16 * MIB);
    let c = client(&src);
    let id: MigrationId = "5c0ffee0-1111-4222-8333-444455556666".parse().unwrap();
    let req = MigrateRequest {
        id: Some(id.clone()),
        hold_switch: true,
        ..request(&dst)
    };
    let first = c.migrate("vm", &req).unwrap();
    // The same request again answers the same migration.
    let again = c.migrate("vm", &req).unwrap();
    assert_eq!(again.id, first.id);
    assert_eq!(c.migrations().unwrap().len(), 1);
    // The same id for another volume is a conflict.
    let e = c.migrate("other", &req).unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    // Another id for a volume already migrating is a conflict.
    let e = c
        .migrate(
            "vm",
            &MigrateRequest {
                id: None,
                ..req.clone()
            },
        )
        .unwrap_err();
    assert_eq!(e.status(), Some(409), "{e}");
    assert!(e.to_string().contains("already migrating"), "{e}");
    // Unknown ids are 404, in any spelling.
    let unknown = MigrationId::random();
    assert_eq!(c.migration(&unknown).unwrap_err().status(), Some(404));
    let r = ureq::get(&format!("http://{}/v1/migrations/not-an-id", src.admin)).call();
    assert!(matches!(r, Err(ureq::Error::Status(404, _))));
    // Cancel the held migration: it fails cleanly and the source stays.
    c.cancel_migration(&id).unwrap();
    let last = c.watch_migration(&id, |_| {}).unwrap();
    assert_eq!(last.phase, MigrationPhase::Failed);
    assert!(src.state.pool.get("vm").unwrap().moved_to().is_none());
}

#[test]
fn bad_bodies_get_json_errors_and_clients_name_the_fault() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start(dir.path());
    let url = format!("http://{}/v1/volumes", s.admin);
    for (body, ctype, status) in [
        ("{not json", "application/json", 400),
        (r#"{"name": 7}"#, "application/json", 422),
        (r#"{"name":"x","size":1}"#, "text/plain", 415),
    ] {
        match ureq::post(&url)
            .set("Content-Type", ctype)
            .send_string(body)
        {
            Err(ureq::Error::Status(code, r)) => {
                assert_eq!(code, status, "{body}");
                let b: serde_json::Value = r.into_json().expect("a JSON error body");
                assert!(b["error"].as_str().is_some_and(|e| !e.is_empty()), "{b}");
            }
            other => panic!("{body}: {other:?}"),
        }
    }
    // An unknown field in a migration request is refused, not ignored.
    s.create("vm", MIB);
    let r = ureq::post(&format!("http://{}/v1/volumes/vm/migrate", s.admin))
        .send_json(serde_json::json!({"to": "127.0.0.1:1", "hold": true}));
    assert!(matches!(r, Err(ureq::Error::Status(422, _))), "{r:?}");
    // Nothing listening: the client says so.
    let e = AdminClient::new("127.0.0.1:1").volumes().unwrap_err();
    assert!(matches!(e, ClientError::Unreachable { .. }), "{e}");
}

/// There and back and there again: each return finds the copy the volume
/// left behind and sends only what the guest wrote since it left.
#[test]
fn a_volume_that_comes_back_sends_only_what_changed_while_it_was_away() {
    let dir = tempfile::tempdir().unwrap();
    let listener = |c: &mut ferry_server::config::Config| {
        c.migration.listen = "127.0.0.1:0".into();
        c.migration.plaintext = true;
    };
    let a = TestServer::start_with(&dir.path().join("a"), listener);
    let b = TestServer::start_with(&dir.path().join("b"), listener);
    let noise = |n: usize, seed: u8| -> Vec<u8> {
        let mut x = u64::from(seed) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x.to_le_bytes()[0]
            })
            .collect()
    };
    a.create("vm", 32 * MIB)
        .write_at(0, &noise(16 << 20, 1), false)
        .unwrap();
    let move_to = |from: &TestServer, to: &TestServer| {
        let c = client(from);
        let run = c
            .migrate(
                "vm",
                &MigrateRequest {
                    to: to.migration.unwrap().to_string(),
                    plaintext: true,
                    compress: Some(false),
                    ..MigrateRequest::default()
                },
            )
            .unwrap();
        let last = c.watch_migration(&run.id, |_| {}).unwrap();
        assert_eq!(last.phase, MigrationPhase::Switched, "{last:?}");
        last.report.unwrap()
    };
    let first = move_to(&a, &b);
    assert_eq!(first.chunks.sent, 4096, "the first trip sends everything");
    // A controller asking where the volume could go learns which daemon
    // holds the copy it left (a move there is a return and rebuilds
    // nothing); the daemon it lives at holds none, nor does a volume of the
    // same name but another identity.
    let sample = client(&b).sample_volume("vm", 64).unwrap();
    let me = ferry_api::VolumeIdentity {
        name: "vm".into(),
        uuid: sample
            .uuid
            .clone()
            .expect("a sample says the volume's identity"),
        arrived_under: None,
    };
    let at_a = client(&a)
        .index_lookup(&sample.fingerprints, Some(&me))
        .unwrap();
    assert!(at_a.holds_copy, "{at_a:?}");
    assert!(!client(&b).index_lookup(&[], Some(&me)).unwrap().holds_copy);
    let other = ferry_api::VolumeIdentity {
        uuid: "0".repeat(32),
        ..me.clone()
    };
    assert!(
        !client(&a)
            .index_lookup(&[], Some(&other))
            .unwrap()
            .holds_copy
    );
    assert!(!client(&a).index_lookup(&[], None).unwrap().holds_copy);
    // Away at b, the guest writes 1 MiB; coming back sends about that.
    b.state
        .pool
        .get("vm")
        .unwrap()
        .write_at(20 << 20, &noise(1 << 20, 2), false)
        .unwrap();
    // b tracked what was written since the volume arrived; a, asked with
    // the migration it arrived by, holds the copy it left by that one
    // (and lacks the new blocks); asked with another, only a copy.
    let sample = client(&b).sample_volume("vm", 4096).unwrap();
    let since = sample
        .since_arrival
        .expect("b tracks what was written since the volume arrived");
    assert_eq!(since.arrived_under, first.id.to_string());
    assert_eq!((since.blocks, since.sample.sampled), (256, 256));
    assert_eq!(since.sample.fingerprints.len(), 256);
    // What the return trusts cannot be cleared by hand (only deleted).
    let e = client(&b)
        .clear_bitmap("vm", ferry_migration_engine::ARRIVAL_BITMAP)
        .unwrap_err();
    assert_eq!(e.status(), Some(400), "{e}");
    let tracked = ferry_api::VolumeIdentity {
        arrived_under: Some(since.arrived_under.clone()),
        ..me.clone()
    };
    let at_a = client(&a)
        .index_lookup(&since.sample.fingerprints, Some(&tracked))
        .unwrap();
    assert!(at_a.holds_copy && at_a.copy_tracked, "{at_a:?}");
    assert_eq!(at_a.found, 0, "{at_a:?}");
    let stale = ferry_api::VolumeIdentity {
        arrived_under: Some("0".repeat(32)),
        ..me.clone()
    };
    let at_a = client(&a).index_lookup(&[], Some(&stale)).unwrap();
    assert!(at_a.holds_copy && !at_a.copy_tracked, "{at_a:?}");
    let back = move_to(&b, &a);
    assert_eq!(
        back.destination_copy,
        ferry_api::DestinationCopy::ReturnedTracked
    );
    assert_eq!(back.chunks.unchanged, 4096, "{:?}", back.chunks);
    assert!(back.chunks.sent <= 256 + 8, "{:?}", back.chunks);
    assert!(
        back.bytes.data_raw <= (1 << 20) + (32 << 10),
        "{:?}",
        back.bytes
    );
    assert_eq!(
        sha(a.state.pool.get("vm").unwrap().data_path()),
        sha(b.state.pool.get("vm").unwrap().data_path())
    );
    // And there again, after another 1 MiB written at a.
    a.state
        .pool
        .get("vm")
        .unwrap()
        .write_at(4 << 20, &noise(1 << 20, 3), false)
        .unwrap();
    let again = move_to(&a, &b);
    assert!(again.chunks.sent <= 256 + 8, "{:?}", again.chunks);
    assert_eq!(
        sha(a.state.pool.get("vm").unwrap().data_path()),
        sha(b.state.pool.get("vm").unwrap().data_path())
    );
    let v = b.state.pool.get("vm").unwrap();
    assert!(v.moved_to().is_none() && v.incoming().is_none());
    assert!(a.state.pool.get("vm").unwrap().moved_to().is_some());
}
