//! `ferry control run` as operators use it: sites added and removed by
//! CLI, bad input refused with the reason, unreachable daemons reported
//! while the controller keeps running, the automation switch, the page and
//! `/metrics`, and its settings and journal kept across `kill -9`; with
//! a real etcd server, two controllers sharing the state, one leading,
//! the other taking over (and following the move the first left
//! unfinished) when the leader is killed or frozen. (The controller
//! moving a real guest is in tests/vm.rs.)

mod common;

use common::{free_port, on_path};
use serde_json::Value;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

struct Controller {
    child: Child,
    addr: String,
}

impl Controller {
    fn start(state: &Path, addr: &str) -> Controller {
        Controller::start_with(&["--state-dir", &state.display().to_string()], addr)
    }

    /// `ferry control run` with `args` (where its state lives) on `addr`.
    fn start_with(args: &[&str], addr: &str) -> Controller {
        let c = Controller::spawn(args, addr);
        c.wait_up();
        c
    }

    /// Start it without waiting for its API.
    fn spawn(args: &[&str], addr: &str) -> Controller {
        let child = Command::new(FERRY)
            .args(["control", "run"])
            .args(args)
            .args(["--listen", addr, "--interval", "300ms", "--sample", "50ms"])
            .env("FERRY_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Controller {
            child,
            addr: addr.into(),
        }
    }

    /// Wait until its API answers.
    fn wait_up(&self) {
        let t = Instant::now();
        while ureq::get(&format!("http://{}/v1/status", self.addr))
            .call()
            .is_err()
        {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "controller did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn run(&self, args: &[&str]) -> Output {
        Command::new(FERRY)
            .args(args)
            .env("FERRY_CONTROLLER", &self.addr)
            .output()
            .unwrap()
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "ferry {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn refused(&self, args: &[&str], says: &str) {
        let out = self.run(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "ferry {args:?} was accepted");
        assert!(err.contains(says), "ferry {args:?}: {err}");
    }

    fn status(&self) -> Value {
        let v: Value =
            serde_json::from_str(&self.ok(&["control", "status", "--json", "--journal", "200"]))
                .unwrap();
        v
    }

    /// Wait until the status satisfies `f`.
    fn wait(&self, what: &str, f: impl Fn(&Value) -> bool) -> Value {
        let t = Instant::now();
        loop {
            let v = self.status();
            if f(&v) {
                return v;
            }
            assert!(t.elapsed() < Duration::from_secs(20), "{what}: {v}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn problems(v: &Value) -> String {
    v["status"]["problems"].to_string()
}

#[test]
fn the_controller_keeps_its_sites_refuses_bad_input_and_survives_kill_9() {
    let d = tempfile::tempdir().unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    let mut c = Controller::start(d.path(), &addr);
    c.wait("no sites yet", |v| problems(v).contains("no sites"));

    // A site whose daemons do not answer: reported, and the controller runs on.
    let dead = |p: u16| format!("127.0.0.1:{p}");
    let (h, m, n, g, a) = (
        free_port(),
        free_port(),
        free_port(),
        free_port(),
        free_port(),
    );
    c.ok(&[
        "site",
        "add",
        "a",
        "--cpu-capacity",
        "8",
        "--host",
        &format!("control={},moves={}", dead(h), dead(m)),
        "--storage",
        &format!("nbd={},migrate={},admin={}", dead(n), dead(g), dead(a)),
    ]);
    let v = c.wait("the unreachable host is reported", |v| {
        problems(v).contains(&format!("host {} of site a", dead(h)))
    });
    assert!(problems(&v).contains("cannot reach"), "{}", problems(&v));

    // Bad input: each refused with its reason; nothing changes.
    c.refused(
        &["site", "add", "a", "--cpu-capacity", "4"],
        "site a exists already",
    );
    c.refused(
        &[
            "site",
            "add",
            "b",
            "--cpu-capacity",
            "4",
            "--host",
            "control=x:1",
        ],
        "moves= is missing",
    );
    c.refused(
        &[
            "site",
            "add",
            "b",
            "--cpu-capacity",
            "4",
            "--storage",
            "nbd=x:1,migrate=x:2,admin=x:3,color=red",
        ],
        "unknown key color",
    );
    c.refused(&["site", "remove", "nowhere"], "no site nowhere");
    c.refused(
        &[
            "site", "link", "a", "nowhere", "--rtt-ms", "5", "--mbit", "100",
        ],
        "nowhere",
    );
    let mut policy = c.status()["settings"]["policy"].clone();
    policy["horizon_s"] = serde_json::json!(-5);
    for body in [policy.to_string(), "{\"horizon_s\": 60}".to_string()] {
        match ureq::put(&format!("http://{addr}/v1/policy"))
            .set("content-type", "application/json")
            .send_string(&body)
        {
            Err(ureq::Error::Status(400, r)) => {
                let answer: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
                assert!(answer["error"].is_string(), "{answer}");
                if body.contains("-5") {
                    assert!(
                        answer["error"]
                            .as_str()
                            .unwrap()
                            .contains("horizon_s must be positive"),
                        "{answer}"
                    );
                }
            }
            other => panic!("policy {body} was not refused: {other:?}"),
        }
    }
    let sites: Value = serde_json::from_str(&c.ok(&["site", "list", "--json"])).unwrap();
    assert_eq!(sites["sites"].as_array().unwrap().len(), 1, "{sites}");
    // Where a guest network's clients are: at one site only.
    let with_clients = |name: &'static str| {
        [
            "site",
            "add",
            name,
            "--cpu-capacity",
            "4",
            "--clients",
            "lan",
        ]
    };
    c.ok(&with_clients("b"));
    let listed = c.ok(&["site", "list"]);
    assert!(
        listed.contains("b: 4 CPUs, hosts , storage , clients of lan"),
        "{listed}"
    );
    c.refused(
        &with_clients("c"),
        "the clients of network lan are placed at two sites",
    );
    c.ok(&["site", "remove", "b"]);

    // Maintenance and bursting are policy: set, shown, undone; bad values refused.
    c.refused(&["site", "maintenance", "nowhere"], "no site nowhere");
    c.ok(&["site", "maintenance", "a"]);
    assert_eq!(
        c.status()["settings"]["policy"]["maintenance"],
        serde_json::json!(["a"])
    );
    assert!(c.ok(&["control", "status"]).contains("in maintenance: a"));
    c.ok(&["site", "maintenance", "a", "--off"]);
    assert_eq!(
        c.status()["settings"]["policy"]["maintenance"],
        serde_json::json!([])
    );
    c.refused(
        &["control", "burst", "on", "--above", "1.5"],
        "burst_above must be in (0, 1]",
    );
    let out = c.ok(&["control", "burst", "on", "--above", "0.8", "--hold", "1m"]);
    assert!(out.contains("above 80% of a site's CPUs for 60 s"), "{out}");
    let p = &c.status()["settings"]["policy"];
    assert_eq!(
        (
            p["burst"].as_bool(),
            p["burst_above"].as_f64(),
            p["burst_hold_s"].as_f64()
        ),
        (Some(true), Some(0.8), Some(60.0))
    );
    c.ok(&["control", "burst", "off"]);

    // A second site and the link between them.
    c.ok(&[
        "site",
        "add",
        "b",
        "--cpu-capacity",
        "16",
        "--storage",
        &format!(
            "nbd={},migrate={},admin={},nbd_local=10.0.0.9:10809",
            dead(n + 1),
            dead(g),
            dead(a)
        ),
    ]);
    c.ok(&["site", "link", "a", "b", "--rtt-ms", "16", "--mbit", "100"]);
    let listed = c.ok(&["site", "list"]);
    assert!(listed.contains("a <-> b: 16 ms, 100 Mbit/s"), "{listed}");

    // The page in a real browser: its script fills the tables from the API.
    if let Some(browser) = ["chromium", "chromium-browser"]
        .into_iter()
        .find(|b| on_path(b))
    {
        let dom = Command::new(browser)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--virtual-time-budget=5000",
                "--dump-dom",
                &format!("http://{addr}/"),
            ])
            .output()
            .unwrap();
        let dom = String::from_utf8_lossy(&dom.stdout);
        for shown in [
            "<td>a ↔ b</td>",
            "<td class=\"n\">16.0</td>",
            "<td class=\"n\">12.5</td>",
            "automation on",
        ] {
            assert!(dom.contains(shown), "the page does not show {shown}: {dom}");
        }
        assert!(
            dom.contains(&format!("host {} of site a", dead(h))),
            "the page shows the problem: {dom}"
        );
    } else {
        assert!(
            std::env::var("FERRY_REQUIRE_TOOLS").is_err(),
            "chromium is needed to test the page"
        );
    }

    // The automation switch, the page, /metrics.
    c.ok(&["control", "pause"]);
    c.wait("paused", |v| v["status"]["paused"] == true);
    let page = ureq::get(&format!("http://{addr}/"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert!(page.contains("<title>ferry control</title>") && page.contains("/v1/status"));
    let metrics = ureq::get(&format!("http://{addr}/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert!(metrics.contains("ferry_controller_paused 1"), "{metrics}");
    assert!(
        metrics.contains("ferry_controller_cycles_total"),
        "{metrics}"
    );
    assert!(metrics.contains("# EOF"), "{metrics}");

    // kill -9: the settings and the journal are still there.
    c.child.kill().unwrap();
    c.child.wait().unwrap();
    c = Controller::start(d.path(), &addr);
    let v = c.status();
    assert_eq!(v["status"]["paused"], true, "{v}");
    let names: Vec<&str> = v["settings"]["inventory"]["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["name"].as_str())
        .collect();
    assert_eq!(names, ["a", "b"]);
    let journal = v["journal"].to_string();
    for what in [
        "site a added",
        "site b added",
        "links replaced",
        "automation paused",
    ] {
        assert!(
            journal.contains(what),
            "{what} not in the journal: {journal}"
        );
    }
    assert!(
        journal.contains(&format!("host {} of site a", dead(h))),
        "{journal}"
    );

    c.ok(&["control", "resume"]);
    c.ok(&["site", "remove", "b"]);
    let v = c.wait("resumed", |v| v["status"]["paused"] == false);
    assert!(
        v["settings"]["inventory"]["links"]
            .as_array()
            .unwrap()
            .is_empty(),
        "{v}"
    );

    // A controller that cannot reach its own API address says so.
    let out = Command::new(FERRY)
        .args(["control", "run", "--state-dir"])
        .arg(d.path().join("other"))
        .args(["--listen", &addr])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot listen"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A real etcd server on loopback ports, its data in a temporary folder.
struct Etcd {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Etcd {
    fn start() -> Etcd {
        Self::start_tls(None)
    }

    /// With `pki` (made by `ferry certs nbd`): https only, and every
    /// client must present a certificate of that authority.
    fn start_tls(pki: Option<&Path>) -> Etcd {
        let dir = tempfile::tempdir().unwrap();
        let (client, peer) = (free_port(), free_port());
        let scheme = if pki.is_some() { "https" } else { "http" };
        let url = format!("{scheme}://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let mut cmd = Command::new("etcd");
        cmd.arg("--data-dir")
            .arg(dir.path().join("data"))
            .args([
                "--listen-client-urls",
                &url,
                "--advertise-client-urls",
                &url,
            ])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("default={peer_url}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(p) = pki {
            cmd.arg("--cert-file")
                .arg(p.join("server/server-cert.pem"))
                .arg("--key-file")
                .arg(p.join("server/server-key.pem"))
                .arg("--client-cert-auth")
                .arg("--trusted-ca-file")
                .arg(p.join("ca-cert.pem"));
        }
        let child = cmd.spawn().unwrap();
        let t = Instant::now();
        let up = || {
            std::net::TcpStream::connect(("127.0.0.1", client)).is_ok()
                && (pki.is_some() || ureq::get(&format!("{url}/health")).call().is_ok())
        };
        while !up() {
            assert!(t.elapsed() < Duration::from_secs(30), "etcd did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        Etcd {
            child,
            url,
            _dir: dir,
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn signal(c: &Controller, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &c.child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig}");
}

fn role(c: &Controller) -> String {
    c.status()["status"]["role"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

#[test]
fn controllers_sharing_etcd_elect_one_leader_that_is_replaced_when_it_dies_or_freezes() {
    use ferry_controller::act::MoveOutcome;
    use ferry_controller::etcd::{Compare, EtcdClient, Put};
    use ferry_controller::journal::{Entry, Event};
    if !common::have("etcd") {
        eprintln!("etcd is not installed: skipped");
        return;
    }
    let etcd = Etcd::start();
    let prefix = "/test/control/";
    let start = |name: &str| {
        let addr = format!("127.0.0.1:{}", free_port());
        Controller::start_with(
            &[
                "--etcd",
                &etcd.url,
                "--etcd-prefix",
                prefix,
                "--name",
                name,
                "--lease",
                "3s",
            ],
            &addr,
        )
    };
    let one = start("one");
    let two = start("two");
    // Exactly one leads, and both name it.
    let t = Instant::now();
    let (leader, follower) = loop {
        let (r1, r2) = (role(&one), role(&two));
        match (r1.as_str(), r2.as_str()) {
            ("leader", "follower") => break (one, two),
            ("follower", "leader") => break (two, one),
            ("leader", "leader") => panic!("two leaders"),
            _ => {}
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "no leader: {r1} {r2}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let leader_name = leader.status()["status"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    follower.wait("the follower names the leader", |v| {
        v["status"]["leader"].as_str() == Some(leader_name.as_str())
    });

    // Only the leader changes the shared settings; the follower says who does.
    follower.refused(
        &["site", "add", "a", "--cpu-capacity", "8"],
        &format!("the leader is {leader_name}"),
    );
    leader.ok(&["site", "add", "a", "--cpu-capacity", "8"]);
    follower.wait("the follower sees the leader's site", |v| {
        v["settings"]["inventory"]["sites"][0]["name"] == "a"
    });
    // And its journal entry: a follower adds what the leader wrote since
    // its last entry.
    let t = Instant::now();
    loop {
        let j: Value = ureq::get(&format!("http://{}/v1/journal", follower.addr))
            .call()
            .unwrap()
            .into_json()
            .unwrap();
        let seen = j.as_array().unwrap().iter().any(|e| {
            e["event"] == "settings" && e["what"].as_str().is_some_and(|w| w.contains("site a"))
        });
        if seen {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the follower's journal lacks the leader's entry: {j}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // A move the leader journaled as started, whose host is gone: whoever
    // leads next must follow it to an end.
    let c = EtcdClient::new(std::slice::from_ref(&etcd.url), Duration::from_secs(5)).unwrap();
    let id = ferry_api::MigrationId::random().to_string();
    let expect: MoveOutcome = serde_json::from_value(serde_json::json!({
        "vm": "g", "action": "move_vm", "to_host_site": "a", "to_disk_site": "a",
        "result": "running", "seconds": 0.0, "predicted_seconds": 1.0, "bytes": 0.0,
        "predicted_bytes": 0.0, "guest_pause_ms": null, "reason": null
    }))
    .unwrap();
    let started = Entry::new(
        1_000_000,
        0.0,
        0,
        Event::Started {
            vm: "g".into(),
            id: id.clone(),
            control: format!("127.0.0.1:{}", free_port()),
            expect,
        },
    );
    let key = format!("{prefix}journal/{:020}", started.seq);
    assert!(c
        .txn(
            &[Compare::Absent(key.clone())],
            &[Put::Value {
                key,
                value: serde_json::to_vec(&started).unwrap(),
                lease: None,
            }],
        )
        .unwrap());

    // Frozen leader: it cannot renew, so it stops leading; the other takes
    // over after the lease, and the first, thawed, follows.
    signal(&leader, "-STOP");
    follower.wait("the follower takes over from the frozen leader", |v| {
        v["status"]["role"] == "leader"
    });
    signal(&leader, "-CONT");
    leader.wait("the thawed leader follows", |v| {
        v["status"]["role"] == "follower"
    });
    let new_name = follower.status()["status"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    leader.wait("the thawed leader names the new one", |v| {
        v["status"]["leader"].as_str() == Some(new_name.as_str())
    });
    leader.refused(
        &["site", "add", "b", "--cpu-capacity", "4"],
        &format!("the leader is {new_name}"),
    );
    // The new leader kept the state and followed the move to its end.
    let t = Instant::now();
    let journal = loop {
        let v = follower.status();
        let done = v["journal"].as_array().unwrap().iter().any(|e| {
            e["event"] == "finished" && e["id"] == id.as_str() && e["outcome"]["result"] == "failed"
        });
        if done {
            break v;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the unfinished move was not followed: {}",
            v["journal"]
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(journal["settings"]["inventory"]["sites"][0]["name"], "a");
    let seqs: Vec<u64> = journal["journal"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");

    // The journal in etcd keeps its last entries, not all of them: the
    // leader trims it in the same fenced writes (here: keep 10, trimmed
    // every 100 entries, so after 250 entries, 191 to 250 remain).
    {
        use ferry_controller::leader::Leadership;
        use ferry_controller::store::Store;
        let l = std::sync::Arc::new(Leadership::new(
            c.clone(),
            "/trim/",
            "trimmer",
            Duration::from_secs(5),
        ));
        assert!(l.campaign().unwrap());
        let store = std::sync::Arc::new(Store::etcd(c.clone(), "/trim/", l.clone(), 10));
        let j = ferry_controller::journal::Journal::open(store).unwrap();
        for i in 0..250 {
            j.record(
                i,
                Event::Problem {
                    what: format!("p{i}"),
                },
            )
            .unwrap();
        }
        let keys: Vec<u64> = c
            .list("/trim/journal/", None)
            .unwrap()
            .iter()
            .map(|kv| kv.key.rsplit('/').next().unwrap().parse().unwrap())
            .collect();
        assert_eq!(keys, (191..=250).collect::<Vec<u64>>());
        l.resign();
    }

    // Killed leader: the other (restarted) one takes over.
    let mut new_leader = follower;
    let old = leader;
    signal(&new_leader, "-KILL");
    let _ = new_leader.child.wait();
    old.wait("the survivor takes over from the killed leader", |v| {
        v["status"]["role"] == "leader"
    });
    new_leader = start(&new_name);
    new_leader.wait("the restarted controller follows", |v| {
        v["status"]["role"] == "follower"
    });
    old.ok(&["site", "add", "b", "--cpu-capacity", "4"]);
    new_leader.wait("the follower sees the site", |v| {
        v["settings"]["inventory"]["sites"]
            .as_array()
            .unwrap()
            .len()
            == 2
    });
}

/// Two controllers started at the same moment with every default (no
/// --name, no settings) on a fresh etcd, as from one unit file on two
/// machines: both come up, one leads, the other follows, and their names
/// differ. The fence of every write is the leader's lease, so even two
/// controllers given the same name cannot both write. Then two more with
/// the same policy file started together: both come up too (settings
/// equal to the leader's are not a conflict), and one with a different
/// policy is refused.
#[test]
fn controllers_started_with_the_same_defaults_never_both_lead() {
    use ferry_controller::etcd::EtcdClient;
    use ferry_controller::leader::Leadership;
    if !common::have("etcd") {
        assert!(!common::required(), "etcd is not installed");
        return;
    }
    let etcd = Etcd::start();
    let spawn = |extra: &[&str]| {
        let addr = format!("127.0.0.1:{}", free_port());
        let mut args = vec!["--etcd", &etcd.url, "--lease", "3s"];
        args.extend_from_slice(extra);
        Controller::spawn(&args, &addr)
    };
    let (one, two) = (spawn(&[]), spawn(&[]));
    one.wait_up();
    two.wait_up();
    let t = Instant::now();
    loop {
        let (r1, r2) = (role(&one), role(&two));
        assert!(!(r1 == "leader" && r2 == "leader"), "two leaders");
        if (r1 == "leader") != (r2 == "leader") && [&r1, &r2].iter().all(|r| !r.is_empty()) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "no leader: {r1} {r2}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let name = |c: &Controller| c.status()["status"]["name"].as_str().unwrap().to_string();
    assert_ne!(name(&one), name(&two), "default names must differ");

    // Two leaderships under one name: only the one holding the lease writes.
    let c = EtcdClient::new(std::slice::from_ref(&etcd.url), Duration::from_secs(5)).unwrap();
    let a = std::sync::Arc::new(Leadership::new(
        c.clone(),
        "/same/",
        "c1",
        Duration::from_secs(6),
    ));
    let b = std::sync::Arc::new(Leadership::new(
        c.clone(),
        "/same/",
        "c1",
        Duration::from_secs(6),
    ));
    assert!(a.campaign().unwrap());
    assert!(!b.campaign().unwrap(), "the key is held");
    let key = "/same/probe".to_string();
    let put = |l: &Leadership| {
        c.txn(
            &[l.fence()],
            &[ferry_controller::etcd::Put::Value {
                key: key.clone(),
                value: b"x".to_vec(),
                lease: None,
            }],
        )
        .unwrap()
    };
    assert!(put(&a), "the leader writes");
    assert!(
        !put(&b),
        "a controller of the same name without the lease cannot"
    );
    drop((one, two));

    // The same settings given to controllers started together.
    let d = tempfile::tempdir().unwrap();
    let policy = d.path().join("policy.json");
    let other = d.path().join("other.json");
    for (f, horizon) in [(&policy, 120.0), (&other, 240.0)] {
        let p = ferry_placement::policy::Policy {
            horizon_s: horizon,
            ..Default::default()
        };
        std::fs::write(f, serde_json::to_string(&p).unwrap()).unwrap();
    }
    let with = |f: &Path| -> Vec<String> {
        [
            "--etcd-prefix",
            "/together/",
            "--policy",
            f.to_str().unwrap(),
        ]
        .map(String::from)
        .to_vec()
    };
    let args = with(&policy);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (three, four) = (spawn(&args), spawn(&args));
    three.wait_up();
    four.wait_up();
    let out = Command::new(FERRY)
        .args(["control", "run", "--etcd", &etcd.url, "--lease", "3s"])
        .args(with(&other))
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let t = String::from_utf8_lossy(&out.stderr);
    assert!(
        t.contains("differ from those of the controller that leads"),
        "{t}"
    );
}

/// etcd that requires client certificates: a controller with
/// `--etcd-tls-dir` leads and keeps its state there; one without the
/// credentials cannot start, and says it could not reach etcd.
#[test]
fn a_controller_reaches_etcd_over_tls_with_its_client_certificate() {
    if !common::have("etcd") {
        eprintln!("etcd is not installed: skipped");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let pki = d.path().join("pki");
    common::nbd_pki(&pki, &["127.0.0.1"], "ctl");
    let etcd = Etcd::start_tls(Some(&pki));
    let endpoint = etcd.url.trim_start_matches("https://").to_string();
    let creds = pki.join("client-ctl");
    let c = Controller::start_with(
        &[
            "--etcd",
            &endpoint,
            "--etcd-tls-dir",
            creds.to_str().unwrap(),
        ],
        &format!("127.0.0.1:{}", free_port()),
    );
    c.wait("it leads", |v| v["status"]["role"] == "leader");
    c.ok(&["site", "add", "a", "--cpu-capacity", "8"]);
    c.wait("the site is kept", |v| {
        v["settings"]["inventory"]["sites"][0]["name"] == "a"
    });
    let out = Command::new(FERRY)
        .args(["control", "run", "--etcd", &endpoint])
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .env("FERRY_LOG", "error")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no etcd endpoint answered"),
        "a controller without credentials: {err}"
    );
}
