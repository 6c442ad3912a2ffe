//! Attacks on ferry's control paths, tried against real daemons (the
//! `ferry` binary), each refused with a clear error and nothing changed.
//! docs/security.md's table of attacks names these tests.
//!
//! "Beyond loopback" runs in a network namespace this test makes (an
//! address of TEST-NET-1 on its own loopback device): no traffic leaves
//! the machine.

mod common;

use common::{free_port, have, required};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Wait until something listens on `addr` (inside `ns` if given).
fn wait_port(addr: &str, ns: Option<&Netns>) {
    let t = Instant::now();
    let probe = format!("exec 3<>/dev/tcp/{}/{}", host_of(addr), port_of(addr));
    loop {
        let mut c = match ns {
            Some(n) => n.cmd("bash"),
            None => Command::new("bash"),
        };
        c.args(["-c", &probe]).stderr(Stdio::null());
        if c.status().is_ok_and(|s| s.success()) {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "{addr} never listened"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn host_of(a: &str) -> &str {
    a.rsplit_once(':').unwrap().0
}

fn port_of(a: &str) -> &str {
    a.rsplit_once(':').unwrap().1
}

/// A raw HTTP request to a loopback API: (status, body).
fn raw(
    addr: &str,
    method: &str,
    path: &str,
    host: &str,
    ctype: Option<&str>,
    body: &str,
) -> (u16, String) {
    let mut r = ureq::request(method, &format!("http://{addr}{path}")).set("Host", host);
    if let Some(c) = ctype {
        r = r.set("Content-Type", c);
    }
    match r.send_string(body) {
        Ok(resp) => (resp.status(), resp.into_string().unwrap_or_default()),
        Err(ureq::Error::Status(code, resp)) => (code, resp.into_string().unwrap_or_default()),
        Err(e) => panic!("{method} {path}: {e}"),
    }
}

fn serve(pool: &Path, admin: &str, extra: &[&str]) -> Daemon {
    let child = Command::new(FERRY)
        .args(["serve", "--pool"])
        .arg(pool)
        .args(["--nbd", "", "--admin", admin])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_port(admin, None);
    Daemon(child)
}

fn volume_names(admin: &str) -> Vec<String> {
    let v: Value = ureq::get(&format!("http://{admin}/v1/volumes"))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x["name"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn a_browser_page_cannot_drive_a_loopback_api_and_host_files_are_not_volumes() {
    let d = tempfile::tempdir().unwrap();
    let admin = format!("127.0.0.1:{}", free_port());
    let _s = serve(&d.path().join("pool"), &admin, &[]);
    let create = r#"{"name":"v","size":"1M"}"#;

    // A cross-site form or fetch without preflight: text/plain, or no type.
    for ct in [
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        None,
    ] {
        let (code, body) = raw(&admin, "POST", "/v1/volumes", "127.0.0.1", ct, create);
        assert_eq!(code, 415, "{ct:?}: {body}");
        assert!(body.contains("application/json"), "{body}");
    }
    // DNS rebinding: the right content type, but another site's name.
    let (code, body) = raw(
        &admin,
        "POST",
        "/v1/volumes",
        "evil.example:80",
        Some("application/json"),
        create,
    );
    assert_eq!(code, 421, "{body}");
    assert!(body.contains("evil.example"), "{body}");
    assert!(volume_names(&admin).is_empty(), "nothing created");

    // Files of the host as volumes: refused without storage.allowed_paths.
    let block = ["/dev/sda", "/dev/vda", "/dev/nvme0n1", "/dev/loop0"]
        .into_iter()
        .find(|p| {
            use std::os::unix::fs::FileTypeExt;
            std::fs::metadata(p).is_ok_and(|m| m.file_type().is_block_device())
        })
        .unwrap_or("/dev/zero");
    for path in ["/etc/shadow", block] {
        let body = serde_json::json!({"name": "stolen", "path": path}).to_string();
        let (code, answer) = raw(
            &admin,
            "POST",
            "/v1/volumes",
            "127.0.0.1",
            Some("application/json"),
            &body,
        );
        assert_eq!(code, 403, "{path}: {answer}");
        assert!(answer.contains("allowed_paths"), "{answer}");
    }
    assert!(volume_names(&admin).is_empty(), "nothing created");

    // A resize past the daemon's bound.
    let (code, _) = raw(
        &admin,
        "POST",
        "/v1/volumes",
        "localhost",
        Some("application/json"),
        create,
    );
    assert_eq!(code, 201);
    let (code, body) = raw(
        &admin,
        "POST",
        "/v1/volumes/v/resize",
        "127.0.0.1",
        Some("application/json"),
        r#"{"size":"1000000T"}"#,
    );
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("largest volume"), "{body}");
}

#[test]
fn an_api_with_no_identity_refuses_to_listen_beyond_loopback_in_plaintext() {
    // `ferry host` without a state directory has no TLS identity.
    let out = Command::new(FERRY)
        .args(["host", "--control", &format!("0.0.0.0:{}", free_port())])
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let t = text(&out);
    assert!(t.contains("beyond loopback, in plaintext"), "{t}");
    assert!(t.contains("--insecure-plaintext-api"), "{t}");
}

/// A network namespace of this test's own, deleted on drop.
struct Netns(String);

impl Netns {
    fn new() -> Option<Netns> {
        if !have("ip") {
            assert!(!required(), "iproute2 missing");
            return None;
        }
        // One per test: tests of this file run at once.
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("ferrysec{}-{n}", std::process::id());
        let ok = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            assert!(!required(), "cannot make a network namespace (not root?)");
            return None;
        }
        let ns = Netns(name);
        for args in [
            vec!["link", "set", "lo", "up"],
            vec!["addr", "add", "192.0.2.1/32", "dev", "lo"],
        ] {
            let st = ns.cmd("ip").args(&args).status().unwrap();
            assert!(st.success(), "ip {args:?}");
        }
        Some(ns)
    }

    fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.0, program]);
        c
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.0])
            .status();
    }
}

fn identity(dir: &Path, role: &str) -> PathBuf {
    let out = Command::new(FERRY)
        .args(["--tls-dir"])
        .arg(dir)
        .args(["certs", "identity", "--role", role])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    dir.join("cert.pem")
}

/// `ferry PRE.. certs POST.. trust CERT --role ROLE`.
fn trust(pre: &[&str], post: &[&str], cert: &Path, role: &str) {
    let out = Command::new(FERRY)
        .args(pre)
        .arg("certs")
        .args(post)
        .arg("trust")
        .arg(cert)
        .args(["--role", role])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn beyond_loopback_every_call_needs_a_pinned_certificate_of_the_right_role() {
    let Some(ns) = Netns::new() else { return };
    let d = tempfile::tempdir().unwrap();
    let pool = d.path().join("pool");
    let (ops, mon, stranger) = (
        d.path().join("ops"),
        d.path().join("mon"),
        d.path().join("stranger"),
    );
    // The storage daemon's identity, and three callers: an operator and a
    // monitor it trusts, and one it does not.
    let out = Command::new(FERRY)
        .args(["certs", "--pool"])
        .arg(&pool)
        .arg("show")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let daemon_cert = pool.join("tls").join("cert.pem");
    let pool_s = pool.to_str().unwrap();
    trust(
        &[],
        &["--pool", pool_s],
        &identity(&ops, "operator"),
        "operator",
    );
    trust(
        &[],
        &["--pool", pool_s],
        &identity(&mon, "monitor"),
        "monitor",
    );
    identity(&stranger, "operator");
    for who in [&ops, &mon, &stranger] {
        trust(
            &["--tls-dir", who.to_str().unwrap()],
            &[],
            &daemon_cert,
            "storage",
        );
    }

    let admin = format!("192.0.2.1:{}", free_port());
    let child = ns
        .cmd(FERRY)
        .args(["serve", "--pool", pool_s, "--nbd", "", "--admin", &admin])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _serve = Daemon(child);
    wait_port(&admin, Some(&ns));
    let as_caller = |who: Option<&Path>, args: &[&str]| -> Output {
        let mut c = ns.cmd(FERRY);
        if let Some(w) = who {
            c.arg("--tls-dir").arg(w);
        }
        c.args(args)
            .args(["--admin", &admin])
            .env_remove("FERRY_TLS_DIR")
            .output()
            .unwrap()
    };

    // No certificate: plaintext beyond loopback is answered 403.
    let out = as_caller(None, &["volume", "list"]);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("requires TLS with a pinned client certificate"),
        "{}",
        text(&out)
    );
    // A certificate the daemon never pinned: the handshake fails.
    let out = as_caller(Some(&stranger), &["volume", "list"]);
    assert!(!out.status.success(), "{}", text(&out));
    // The monitor reads, and may not create.
    let out = as_caller(Some(&mon), &["volume", "list"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = as_caller(Some(&mon), &["volume", "create", "m", "--size", "1M"]);
    assert!(!out.status.success());
    let t = text(&out);
    assert!(
        t.contains("needs the role operator") && t.contains("pinned as monitor"),
        "{t}"
    );
    // The operator does.
    let out = as_caller(Some(&ops), &["volume", "create", "v", "--size", "1M"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = as_caller(Some(&mon), &["volume", "list"]);
    let t = text(&out);
    assert!(t.contains('v') && !t.contains(" m "), "{t}");
}

#[test]
fn a_host_uses_only_storage_it_knows_and_probes_only_declared_peers() {
    let d = tempfile::tempdir().unwrap();
    let images = d.path().join("images");
    std::fs::create_dir_all(&images).unwrap();
    let kernel = images.join("vmlinuz");
    std::fs::write(&kernel, b"not a kernel: refused before it is read").unwrap();
    let control = format!("127.0.0.1:{}", free_port());
    let child = Command::new(FERRY)
        .args(["host", "--state-dir"])
        .arg(d.path().join("host"))
        .args(["--control", &control, "--image-dir"])
        .arg(&images)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _host = Daemon(child);
    wait_port(&control, None);

    // A disk on an NBD server beyond this machine that the host was not
    // told of: refused before anything connects to it.
    let out = Command::new(FERRY)
        .args([
            "vm",
            "create",
            "g",
            "--disk",
            "root@192.0.2.1:10809",
            "--kernel",
        ])
        .arg(&kernel)
        .args(["--no-start", "--host", &control])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let t = text(&out);
    assert!(t.contains("not a storage daemon this host knows"), "{t}");
    let listed: Value = ureq::get(&format!("http://{control}/v1/vms"))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(listed, serde_json::json!([]), "nothing created");

    // A probe to an address that is not a declared peer: refused, nothing
    // sent there.
    let (code, body) = raw(
        &control,
        "POST",
        "/v1/probe",
        "127.0.0.1",
        Some("application/json"),
        r#"{"to":"192.0.2.1:22"}"#,
    );
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("not a declared peer"), "{body}");
}

/// The host's control API and the controller's API beyond loopback, as
/// the storage admin API above: no certificate, 403; a monitor reads but
/// may not change anything; the operator may.
#[test]
fn beyond_loopback_the_host_and_controller_apis_need_a_pinned_certificate_too() {
    let Some(ns) = Netns::new() else { return };
    let d = tempfile::tempdir().unwrap();
    let (ops, mon) = (d.path().join("ops"), d.path().join("mon"));
    let (ops_cert, mon_cert) = (identity(&ops, "operator"), identity(&mon, "monitor"));
    let as_caller = |who: Option<&Path>, args: &[&str]| -> Output {
        let mut c = ns.cmd(FERRY);
        if let Some(w) = who {
            c.arg("--tls-dir").arg(w);
        }
        c.args(args).env_remove("FERRY_TLS_DIR").output().unwrap()
    };

    // A host: its identity in its state directory; it trusts both callers,
    // and both pin it as a host.
    let state = d.path().join("host");
    let state_s = state.to_str().unwrap();
    let out = Command::new(FERRY)
        .args(["certs", "--pool", state_s, "show"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    pin_both_ways(
        state_s,
        &[(&ops, &ops_cert, "operator"), (&mon, &mon_cert, "monitor")],
        "host",
    );
    let control = format!("192.0.2.1:{}", free_port());
    let nbd = format!("127.0.0.1:{}", free_port());
    let child = ns
        .cmd(FERRY)
        .args(["host", "--state-dir", state_s, "--control", &control])
        .args(["--listen", &nbd, "--qemu-user", ""])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _host = Daemon(child);
    wait_port(&control, Some(&ns));
    roles_hold(
        &as_caller,
        &ops,
        &mon,
        &["vm", "list", "--host", &control],
        &["vm", "stop", "g", "--host", &control],
        &["vm", "list", "--host", &control],
    );

    // A controller: its identity in its state directory.
    let cstate = d.path().join("controller");
    let cstate_s = cstate.to_str().unwrap();
    let api = format!("192.0.2.1:{}", free_port());
    let child = ns
        .cmd(FERRY)
        .args(["control", "run", "--state-dir", cstate_s, "--listen", &api])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _controller = Daemon(child);
    wait_port(&api, Some(&ns));
    pin_both_ways(
        cstate_s,
        &[(&ops, &ops_cert, "operator"), (&mon, &mon_cert, "monitor")],
        "controller",
    );
    roles_hold(
        &as_caller,
        &ops,
        &mon,
        &["control", "status", "--controller", &api],
        &["control", "pause", "--controller", &api],
        &["control", "pause", "--controller", &api],
    );
}

/// The daemon whose store is `--pool STORE` trusts each caller's
/// certificate as its role, and each caller pins the daemon's certificate
/// as `daemon_role`.
fn pin_both_ways(store: &str, callers: &[(&Path, &Path, &str)], daemon_role: &str) {
    let daemon_cert = Path::new(store).join("tls").join("cert.pem");
    for (dir, cert, role) in callers {
        trust(&[], &["--pool", store], cert, role);
        trust(
            &["--tls-dir", dir.to_str().unwrap()],
            &[],
            &daemon_cert,
            daemon_role,
        );
    }
}

/// Beyond loopback: without a certificate even `read` is refused; the
/// monitor may `read` but not `change`; the operator may `operator_may`.
fn roles_hold(
    as_caller: &dyn Fn(Option<&Path>, &[&str]) -> Output,
    ops: &Path,
    mon: &Path,
    read: &[&str],
    change: &[&str],
    operator_may: &[&str],
) {
    let out = as_caller(None, read);
    assert!(!out.status.success());
    let t = text(&out);
    assert!(
        t.contains("requires TLS with a pinned client certificate"),
        "{t}"
    );
    let out = as_caller(Some(mon), read);
    assert!(out.status.success(), "{}", text(&out));
    let out = as_caller(Some(mon), change);
    let t = text(&out);
    assert!(
        !out.status.success() && t.contains("needs the role operator"),
        "{t}"
    );
    let out = as_caller(Some(ops), operator_may);
    assert!(out.status.success(), "{}", text(&out));
}
