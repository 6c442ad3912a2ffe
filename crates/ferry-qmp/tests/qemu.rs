//! The QMP client against a real QEMU (TCG; no guest OS needed: the
//! machine runs its firmware): commands and errors, events waited on, and a
//! live migration between two QEMU processes that stops before the
//! switchover (`pause-before-switchover`) until it is told to go on, the
//! hook a VM move uses to switch its disk at the same moment.

use ferry_qmp::{Capability, MigrateParameters, MigrationStatus, QmpClient, QmpError};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn have_qemu() -> bool {
    let ok = Command::new("qemu-system-x86_64")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok && std::env::var_os("FERRY_REQUIRE_TOOLS").is_some() {
        panic!("qemu-system-x86_64 is required (FERRY_REQUIRE_TOOLS is set)");
    }
    ok
}

struct Qemu {
    child: Child,
    qmp: PathBuf,
}

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A small machine, paused (`-S`) unless it waits for an incoming
/// migration (which, with `-S`, would stay paused after arriving); `extra`
/// adds arguments.
fn qemu(dir: &Path, name: &str, extra: &[&str]) -> Qemu {
    let paused: &[&str] = if extra.contains(&"-incoming") {
        &[]
    } else {
        &["-S"]
    };
    let qmp = dir.join(format!("{name}.qmp"));
    let child = Command::new("qemu-system-x86_64")
        .args([
            "-M",
            "q35",
            "-accel",
            "tcg",
            "-nodefaults",
            "-display",
            "none",
        ])
        .args(["-m", "64"])
        .args(paused)
        .arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", qmp.display()))
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("qemu-system-x86_64 starts");
    // The socket file appears when QEMU binds it, a moment before it
    // listens: wait until a connection is taken (and let it go).
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::os::unix::net::UnixStream::connect(&qmp).is_err() {
        assert!(Instant::now() < deadline, "QMP socket not listening");
        std::thread::sleep(Duration::from_millis(20));
    }
    Qemu { child, qmp }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

async fn status(c: &QmpClient) -> String {
    let v: Value = c.execute("query-status", None).await.unwrap();
    v["status"].as_str().unwrap().to_string()
}

#[test]
fn commands_errors_events_and_quit() {
    if !have_qemu() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let q = qemu(dir.path(), "a", &[]);
    rt().block_on(async {
        let c = QmpClient::connect(&q.qmp).await.unwrap();
        assert!(c.greeting().version["qemu"]["major"].as_u64().is_some());
        assert_eq!(status(&c).await, "prelaunch");
        let m = c.mark();
        c.execute_value("cont", None).await.unwrap();
        c.wait_named(m, "RESUME", Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(status(&c).await, "running");
        let m = c.mark();
        c.execute_value("stop", None).await.unwrap();
        let e = c
            .wait_named(m, "STOP", Duration::from_secs(10))
            .await
            .unwrap();
        assert!(e.timestamp > 1e9);
        // A refused command is a typed error, and the session goes on.
        match c.execute_value("no-such-command", None).await {
            Err(QmpError::Command { class, .. }) => assert_eq!(class, "CommandNotFound"),
            other => panic!("{other:?}"),
        }
        match c.execute_value("migrate", Some(json!({"uri": 7}))).await {
            Err(QmpError::Command { class, .. }) => assert_eq!(class, "GenericError"),
            other => panic!("{other:?}"),
        }
        // Waiting for an event that does not come times out.
        let m = c.mark();
        assert!(matches!(
            c.wait_named(m, "RESUME", Duration::from_millis(200)).await,
            Err(QmpError::Timeout(_))
        ));
        let m = c.mark();
        c.execute_value("quit", None).await.unwrap();
        c.wait_named(m, "SHUTDOWN", Duration::from_secs(10))
            .await
            .unwrap();
        c.closed(Duration::from_secs(10)).await.unwrap();
        assert!(matches!(
            c.execute_value("query-status", None).await,
            Err(QmpError::Closed | QmpError::Io(_))
        ));
    });
}

#[test]
fn a_live_migration_holds_before_the_switchover_until_told_to_continue() {
    if !have_qemu() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = qemu(dir.path(), "src", &[]);
    let dst = qemu(dir.path(), "dst", &["-incoming", "defer"]);
    let sock = dir.path().join("mig.sock");
    let uri = format!("unix:{}", sock.display());
    rt().block_on(async {
        let s = QmpClient::connect(&src.qmp).await.unwrap();
        let d = QmpClient::connect(&dst.qmp).await.unwrap();
        // The typed commands, against a real QEMU.
        let caps = [
            (Capability::Events, true),
            (Capability::PauseBeforeSwitchover, true),
        ];
        s.migrate_set_capabilities(&caps).await.unwrap();
        d.migrate_set_capabilities(&caps).await.unwrap();
        s.migrate_set_parameters(&MigrateParameters {
            downtime_limit: Some(300),
            ..Default::default()
        })
        .await
        .unwrap();
        assert_eq!(
            s.query_migrate().await.unwrap().status,
            MigrationStatus::None
        );
        let dm = d.mark();
        d.migrate_incoming(&uri).await.unwrap();
        s.cont().await.unwrap();
        assert!(s.query_status().await.unwrap().running);
        assert_eq!(status(&s).await, "running");
        let sm = s.mark();
        s.migrate(&uri).await.unwrap();
        // Memory is copied, then the source stops before the switchover
        // and waits: the guest is paused, nothing is running anywhere new.
        s.wait_event(sm, Duration::from_secs(60), |e| {
            e.name == "MIGRATION" && e.data["status"] == "pre-switchover"
        })
        .await
        .unwrap();
        let q = s.query_migrate().await.unwrap();
        assert_eq!(q.status, MigrationStatus::PreSwitchover);
        assert!(q.ram().dirty_sync_count >= 1, "{q:?}");
        assert_eq!(status(&s).await, "finish-migrate");
        assert_eq!(status(&d).await, "inmigrate");
        // Told to go on: it completes, and the guest runs at the destination.
        let sm = s.mark();
        s.migrate_continue().await.unwrap();
        s.wait_event(sm, Duration::from_secs(60), |e| {
            e.name == "MIGRATION" && e.data["status"] == "completed"
        })
        .await
        .unwrap();
        d.wait_named(dm, "RESUME", Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(status(&d).await, "running");
        assert_eq!(status(&s).await, "postmigrate");
        let q = s.query_migrate().await.unwrap();
        assert_eq!(q.status, MigrationStatus::Completed);
        assert!(q.ram().transferred > 0 && q.downtime.is_some(), "{q:?}");
    });
}
