//! Helpers the `ferry` binary's test files share.
// Each test file uses only some of them.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `ferry` binary under test.
pub const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

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

/// `ferry serve` as a child process; its log goes to `<pool>.log`.
pub struct Serve {
    pub child: Child,
    pub nbd: String,
    pub admin: String,
}

impl Serve {
    pub fn start(pool: &Path) -> Serve {
        let nbd = format!("127.0.0.1:{}", free_port());
        let admin = format!("127.0.0.1:{}", free_port());
        Self::start_on(pool, &nbd, &admin, &[])
    }

    /// On given addresses, with extra `ferry serve` arguments.
    pub fn start_on(pool: &Path, nbd: &str, admin: &str, extra: &[&str]) -> Serve {
        let (nbd, admin) = (nbd.to_string(), admin.to_string());
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(pool.with_extension("log"))
            .unwrap();
        let child = Command::new(FERRY)
            .args(["serve", "--pool"])
            .arg(pool)
            .args(["--nbd", &nbd, "--admin", &admin])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let t = Instant::now();
        while ureq::get(&format!("http://{admin}/v1/server"))
            .call()
            .is_err()
        {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "ferry serve did not start: {}",
                std::fs::read_to_string(pool.with_extension("log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Serve { child, nbd, admin }
    }

    /// Run `ferry ARGS` against this daemon's admin API; its stdout.
    pub fn ferry(&self, args: &[&str]) -> String {
        let out = Command::new(FERRY)
            .args(args)
            .env("FERRY_ADMIN", &self.admin)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "ferry {args:?}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    pub fn terminate(mut self) {
        let pid = self.child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        let st = self.child.wait().unwrap();
        assert!(st.success(), "ferry serve exited with {st}");
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Each daemon's pool trusts the other's migration certificate
/// (`ferry certs show`, `ferry certs trust`).
pub fn trust_each_other(pa: &Path, pb: &Path) {
    let (pa, pb) = (pa.display().to_string(), pb.display().to_string());
    let certs = |args: &[&str]| {
        let out = Command::new(FERRY)
            .arg("certs")
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(certs(&["show", "--pool", &pa]).contains("sha256"));
    certs(&["show", "--pool", &pb]);
    certs(&["trust", &format!("{pb}/tls/cert.pem"), "--pool", &pa]);
    certs(&["trust", &format!("{pa}/tls/cert.pem"), "--pool", &pb]);
    assert_eq!(certs(&["list", "--pool", &pa]).lines().count(), 1);
}

/// Run `c` and insist it succeeded; its standard output.
pub fn sh(c: &mut Command) -> String {
    let o = c.output().unwrap();
    assert!(
        o.status.success(),
        "{c:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `program` in network namespace `ns`.
pub fn exec_in(ns: &str, program: &str) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns, program]);
    c
}

/// A network namespace (loopback up), deleted with what runs in it when
/// dropped. Needs root.
pub struct Ns(pub String);

impl Ns {
    /// Namespace `name`, replacing one of that name a killed run left.
    pub fn new(name: String) -> Ns {
        Ns(name.clone()).remove();
        sh(Command::new("ip").args(["netns", "add", &name]));
        let ns = Ns(name);
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    pub fn exec(&self, program: &str) -> Command {
        exec_in(&self.0, program)
    }

    pub fn ip(&self, args: &[&str]) {
        sh(self.exec("ip").args(args));
    }

    /// Kill what runs in the namespace, then delete it (if it exists).
    pub fn remove(&self) {
        if let Ok(o) = Command::new("ip").args(["netns", "pids", &self.0]).output() {
            let pids = String::from_utf8_lossy(&o.stdout).into_owned();
            for pid in pids.split_whitespace() {
                let _ = Command::new("kill").args(["-9", pid]).status();
            }
            if !pids.trim().is_empty() {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.0])
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for Ns {
    fn drop(&mut self) {
        self.remove();
    }
}
