//! Helpers the `ferry` binary's test files share.
// Each test file uses only some of them.
#![allow(dead_code)]

use std::net::TcpListener;
use std::process::Command;

/// A loopback port nothing listens on (at the moment of asking).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Whether `tool` is on PATH.
pub fn on_path(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Whether missing tools fail the tests (`FERRY_REQUIRE_TOOLS=1`, as in CI).
pub fn required() -> bool {
    std::env::var("FERRY_REQUIRE_TOOLS").as_deref() == Ok("1")
}

/// `tool` is on PATH; when tools are required, its absence fails the test.
pub fn have(tool: &str) -> bool {
    let ok = on_path(tool);
    assert!(ok || !required(), "{tool} required");
    ok
}

/// `ferry certs nbd --out OUT`: an authority, `OUT/server/` valid for
/// `server_names`, and `OUT/client-CLIENT/`.
pub fn nbd_pki(out: &std::path::Path, server_names: &[&str], client: &str) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
    c.args(["certs", "nbd", "--out"]).arg(out);
    for n in server_names {
        c.args(["--server-name", n]);
    }
    let o = c.args(["--client", client]).output().unwrap();
    assert!(
        o.status.success(),
        "ferry certs nbd: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}
