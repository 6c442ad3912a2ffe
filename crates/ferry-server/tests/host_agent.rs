//! One `ferry host` agent forwarding several volumes, attached and detached
//! through its control API, served by the same NBD connection loop as the
//! daemon (`ferry_nbd_server`), read by real clients.
// Test fixtures: sizes, offsets and byte patterns the test itself chooses.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

mod common;

use common::{have, run, TestServer};
use ferry_api::AdminClient;
use std::process::Command;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

const MIB: u64 = 1 << 20;

#[test]
fn one_agent_serves_several_volumes_attached_over_its_control_api() {
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start(&dir.path().join("pool"));
    let a = s.create("alpha", 4 * MIB);
    a.write_at(0, &vec![0xAA; MIB as usize], false).unwrap();
    let b = s.create("beta", 8 * MIB);
    b.write_at(MIB, &vec![0xBB; MIB as usize], false).unwrap();

    let rt = tokio::runtime::Runtime::new().unwrap();
    let agent = ferry_forwarder::Agent::new(ferry_forwarder::DEFAULT_HOLD);
    let shutdown = CancellationToken::new();
    let sock = dir.path().join("agent.sock");
    let (nbd, ctl) = rt.block_on(async {
        let l = ferry_forwarder::Listener::bind("127.0.0.1:0")
            .await
            .unwrap();
        let u = ferry_forwarder::Listener::bind(&format!("unix:{}", sock.display()))
            .await
            .unwrap();
        let nbd = l.local_addr().unwrap();
        tokio::spawn(ferry_forwarder::serve(l, agent.clone(), shutdown.clone()));
        tokio::spawn(ferry_forwarder::serve(u, agent.clone(), shutdown.clone()));
        let c = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let ctl = c.local_addr().unwrap();
        tokio::spawn(ferry_forwarder::control::serve(
            c,
            Arc::clone(&agent),
            shutdown.clone(),
        ));
        (nbd, ctl)
    });
    let c = AdminClient::new(&ctl.to_string());
    let server = s.nbd.to_string();
    assert!(c.host_volumes().unwrap().is_empty());
    let att = c.host_attach("alpha", &server).unwrap();
    assert_eq!((att.size, att.server.as_str()), (4 * MIB, &*server));
    c.host_attach("beta", &server).unwrap();
    assert_eq!(c.host_volumes().unwrap().len(), 2);
    // Twice is a conflict; a volume no server has is a gateway error.
    assert_eq!(
        c.host_attach("alpha", &server).unwrap_err().status(),
        Some(409)
    );
    assert_eq!(
        c.host_attach("ghost", &server).unwrap_err().status(),
        Some(502)
    );

    // Each export reads its own volume, over TCP and the unix socket.
    let read = |addr: String, export: &str, off: u64| {
        rt.block_on(async {
            let cl = ferry_client::NbdClient::connect(&addr, export, &Default::default()).await?;
            cl.read(off, 4096).await
        })
    };
    assert!(read(nbd.to_string(), "alpha", 0)
        .unwrap()
        .iter()
        .all(|&x| x == 0xAA));
    assert!(read(nbd.to_string(), "beta", MIB)
        .unwrap()
        .iter()
        .all(|&x| x == 0xBB));
    if have("nbdinfo") {
        let out = run(Command::new("nbdinfo").args(["--list", "--json", &format!("nbd://{nbd}")]));
        assert!(
            out.contains("\"alpha\"") && out.contains("\"beta\""),
            "{out}"
        );
        let out = run(Command::new("nbdinfo").args([
            "--size",
            &format!("nbd+unix:///beta?socket={}", sock.display()),
        ]));
        assert_eq!(out.trim(), (8 * MIB).to_string());
    }
    if have("qemu-img") {
        run(Command::new("qemu-img").args([
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            &a.data_path().display().to_string(),
            &format!("nbd://{nbd}/alpha"),
        ]));
    }

    // Detached: new connections are refused, the other volume stays.
    c.host_detach("alpha").unwrap();
    assert_eq!(c.host_detach("alpha").unwrap_err().status(), Some(404));
    assert!(read(nbd.to_string(), "alpha", 0).is_err());
    assert!(read(nbd.to_string(), "beta", MIB).is_ok());
    // With one volume left, it is also the default export.
    assert!(read(nbd.to_string(), "", MIB)
        .unwrap()
        .iter()
        .all(|&x| x == 0xBB));
    shutdown.cancel();
}
