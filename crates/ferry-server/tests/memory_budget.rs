//! Clients that send and never read cannot grow the daemon past its reply
//! budgets: NBD, iSCSI, and NBD through `ferry host`.
//!
//! Each test measures the resident memory of this whole process (the
//! daemon runs in it), so these tests live in a binary of their own and run
//! one at a time: a neighbour test's buffers would count as the daemon's.
// Test fixtures: sizes, offsets and byte patterns the test itself chooses.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

mod common;
#[path = "common/raw_iscsi.rs"]
mod raw_iscsi;
#[path = "common/raw_nbd.rs"]
mod raw_nbd;

use bytes::BytesMut;
use common::{rss, TestServer};
use ferry_nbd::client::encode_request;
use ferry_nbd::Command;
use raw_iscsi::*;
use raw_nbd::*;
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// Held by each test for its whole run: one measurement at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn alone() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Three clients of `export` at `addr` that each send 2,000 READs of
/// 1 MiB (2 GiB of replies if they were all queued) and read nothing.
fn hogs(addr: SocketAddr, export: &str) -> Vec<TcpStream> {
    (0..3)
        .map(|_| {
            let (mut t, _) = go_at(addr, export, false);
            let mut b = BytesMut::new();
            for i in 0..2000u64 {
                encode_request(&mut b, 0, Command::Read, i, (i % 8) << 20, 1 << 20);
            }
            t.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
            let _ = t.write_all(&b);
            t
        })
        .collect()
}

/// A client that pipelines many large READs and never reads the replies
/// holds at most its reply budget: the daemon stops reading it instead of
/// queueing gigabytes, other clients are served, and the memory comes back
/// when it leaves.
#[test]
fn a_client_that_never_reads_replies_cannot_grow_the_daemon() {
    let _alone = alone();
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start(dir.path());
    let v = s.create("big", 64 << 20);
    v.write_at(0, &vec![0x5a; 8 << 20], false).unwrap();
    let before = rss();
    let hogs = hogs(s.nbd, "big");
    std::thread::sleep(Duration::from_secs(3));
    let grown = rss().saturating_sub(before);
    // Three connections at 64 MiB each, plus socket buffers and slack.
    assert!(grown < 400 << 20, "daemon grew by {} MiB", grown >> 20);
    // Others are still served while the hogs stall.
    healthy(&s, "big", 4096, &[0x5a; 4096]);
    drop(hogs);
    std::thread::sleep(Duration::from_millis(500));
    healthy(&s, "big", 0, &[0x5a; 4096]);
}

/// The same through `ferry host`: its clients hold at most their budgets
/// of the agent (and so of the daemon behind it), and another client of
/// the agent is served meanwhile.
#[test]
fn a_client_of_the_host_agent_that_never_reads_cannot_grow_it() {
    let _alone = alone();
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start(dir.path());
    let v = s.create("big", 64 << 20);
    v.write_at(0, &vec![0x5a; 8 << 20], false).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let agent = ferry_forwarder::Agent::new(ferry_forwarder::DEFAULT_HOLD);
    let shutdown = tokio_util::sync::CancellationToken::new();
    let addr = rt.block_on(async {
        agent.attach(&s.nbd.to_string(), "big").await.unwrap();
        let l = ferry_forwarder::Listener::bind("127.0.0.1:0")
            .await
            .unwrap();
        let a = l.local_addr().unwrap();
        tokio::spawn(ferry_forwarder::serve(l, agent.clone(), shutdown.clone()));
        a
    });
    let addr: SocketAddr = addr.to_string().parse().unwrap();
    let before = rss();
    let hogs = hogs(addr, "big");
    std::thread::sleep(Duration::from_secs(3));
    let grown = rss().saturating_sub(before);
    assert!(
        grown < 500 << 20,
        "agent and daemon grew by {} MiB",
        grown >> 20
    );
    healthy_at(addr, "big", 4096, &[0x5a; 4096]);
    drop(hogs);
    shutdown.cancel();
}

/// A daemon with one iSCSI portal (configured further by `f`) serving
/// volume "big", 64 MiB whose first 8 MiB are 0x5a; and that portal.
fn big_volume_on_iscsi(
    pool: &std::path::Path,
    f: impl FnOnce(&mut ferry_server::config::Config),
) -> (TestServer, SocketAddr) {
    let s = TestServer::start_with(pool, |c| {
        c.iscsi.listen = vec!["127.0.0.1:0".into()];
        f(c);
    });
    let v = s.create("big", 64 << 20);
    v.write_at(0, &vec![0x5a; 8 << 20], false).unwrap();
    let p = s.state.iscsi.portals.lock()[0];
    (s, p)
}

/// `sessions` sessions to volume "big" at `p`, each sent `reads` READs of
/// 8 MiB in CmdSN order (the target takes what its window allows) and
/// never reading an answer.
fn iscsi_hogs(p: SocketAddr, sessions: usize, reads: u64) -> Vec<Raw> {
    (0..sessions)
        .map(|_| {
            let mut r = Raw::login(p, "big", false);
            r.s.set_write_timeout(Some(Duration::from_secs(3))).unwrap();
            let mut wire = Vec::new();
            for i in 0..reads {
                let cmd = r.command(&read16((i % 8) * 16384, 16384), 8 << 20);
                wire.extend_from_slice(&cmd.to_bytes(false, false));
            }
            let _ = r.s.write_all(&wire);
            r
        })
        .collect()
}

/// An initiator that fills its command window with large READs and never
/// reads the Data-In holds at most its connection's budget of the
/// daemon's memory; other sessions are served meanwhile, and the memory
/// comes back when it leaves.
#[test]
fn an_initiator_that_never_reads_data_in_cannot_grow_the_daemon() {
    let _alone = alone();
    let dir = tempfile::tempdir().unwrap();
    let (_s, p) = big_volume_on_iscsi(dir.path(), |_| {});
    let before = rss();
    // 2,000 READs of 8 MiB each (16 GiB if all were answered into memory).
    let hogs = iscsi_hogs(p, 3, 2000);
    std::thread::sleep(Duration::from_secs(3));
    let grown = rss().saturating_sub(before);
    // Three connections at their 64 MiB budget, plus buffers and slack.
    assert!(grown < 400 << 20, "daemon grew by {} MiB", grown >> 20);
    let mut good = Raw::login(p, "big", false);
    let cmd = good.command(&read16(8, 8), 4096);
    let (status, data) = good.run(&cmd);
    assert_eq!(status, 0);
    assert_eq!(data, vec![0x5a; 4096]);
    drop(hogs);
    std::thread::sleep(Duration::from_millis(500));
    let cmd = good.command(&read16(16, 8), 4096);
    assert_eq!(good.run(&cmd), (0, vec![0x5a; 4096]));
}

/// The budget all iSCSI connections share (`iscsi.max_queued_bytes_total`)
/// holds when each connection alone is still under its own: five
/// initiators that never read hold at most the shared 64 MiB, not five
/// times their 64 MiB each, and a reader is served once they are gone.
#[test]
fn initiators_that_never_read_data_in_hold_at_most_the_shared_budget() {
    let _alone = alone();
    let dir = tempfile::tempdir().unwrap();
    let (_s, p) = big_volume_on_iscsi(dir.path(), |c| {
        c.iscsi.max_queued_bytes = 64 << 20;
        c.iscsi.max_queued_bytes_total = 64 << 20;
    });
    let before = rss();
    let hogs = iscsi_hogs(p, 5, 500);
    std::thread::sleep(Duration::from_secs(3));
    let grown = rss().saturating_sub(before);
    // The shared 64 MiB plus buffers and slack; five connection budgets
    // would be 320 MiB.
    assert!(grown < 200 << 20, "daemon grew by {} MiB", grown >> 20);
    drop(hogs);
    std::thread::sleep(Duration::from_millis(500));
    let mut good = Raw::login(p, "big", false);
    let cmd = good.command(&read16(16, 8), 4096);
    assert_eq!(good.run(&cmd), (0, vec![0x5a; 4096]));
}
