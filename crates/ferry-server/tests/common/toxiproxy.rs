//! toxiproxy (the real program, installed by the test command) between two
//! daemons: latency, bandwidth, and faults on a migration link.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Toxiproxy {
    child: Child,
    api: String,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Toxiproxy {
    pub fn start() -> Toxiproxy {
        let port = free_port();
        let child = Command::new("toxiproxy-server")
            .args(["-host", "127.0.0.1", "-port", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting toxiproxy-server");
        let api = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while ureq::get(&format!("{api}/version")).call().is_err() {
            assert!(Instant::now() < deadline, "toxiproxy-server did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        Toxiproxy { child, api }
    }

    /// A proxy to `upstream`; returns the address to connect to.
    pub fn proxy(&self, name: &str, upstream: &str) -> String {
        let listen = format!("127.0.0.1:{}", free_port());
        ureq::post(&format!("{}/proxies", self.api))
            .send_json(serde_json::json!({
                "name": name, "listen": listen, "upstream": upstream, "enabled": true
            }))
            .unwrap();
        listen
    }

    /// Point the proxy at a new upstream (a restarted daemon).
    pub fn set_upstream(&self, name: &str, upstream: &str) {
        ureq::post(&format!("{}/proxies/{name}", self.api))
            .send_json(serde_json::json!({ "upstream": upstream }))
            .unwrap();
    }

    /// Cut (false) or restore (true) the link: open connections are closed.
    #[allow(dead_code)]
    pub fn set_enabled(&self, name: &str, enabled: bool) {
        ureq::post(&format!("{}/proxies/{name}", self.api))
            .send_json(serde_json::json!({ "enabled": enabled }))
            .unwrap();
    }

    pub fn add_toxic(
        &self,
        proxy: &str,
        toxic: &str,
        ty: &str,
        stream: &str,
        attrs: serde_json::Value,
    ) {
        ureq::post(&format!("{}/proxies/{proxy}/toxics", self.api))
            .send_json(serde_json::json!({
                "name": toxic, "type": ty, "stream": stream, "toxicity": 1.0, "attributes": attrs
            }))
            .unwrap();
    }

    /// Delay every byte `ms` each way (toxics `lat_up`, `lat_down`): a
    /// round trip of twice `ms` through the proxy.
    #[allow(dead_code)]
    pub fn add_latency(&self, proxy: &str, ms: u64) {
        for (name, dir) in [("lat_up", "upstream"), ("lat_down", "downstream")] {
            self.add_toxic(
                proxy,
                name,
                "latency",
                dir,
                serde_json::json!({ "latency": ms }),
            );
        }
    }

    pub fn remove_toxic(&self, proxy: &str, toxic: &str) {
        ureq::delete(&format!("{}/proxies/{proxy}/toxics/{toxic}", self.api))
            .call()
            .unwrap();
    }

    /// Reset the link of proxy `proxy` (the toxic "cut", left for the
    /// caller to remove) and wait until the migration `run` has begun its
    /// next attempt.
    pub fn cut_until_retried(
        &self,
        proxy: &str,
        run: &ferry_migration_engine::MigrationRun,
        deadline: Instant,
    ) {
        self.add_toxic(
            proxy,
            "cut",
            "reset_peer",
            "upstream",
            serde_json::json!({"timeout": 0}),
        );
        wait_for_retry(run, deadline);
    }
}

impl Drop for Toxiproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Wait until the migration `run` has begun its next attempt.
pub fn wait_for_retry(run: &ferry_migration_engine::MigrationRun, deadline: Instant) {
    while run
        .counters
        .attempts
        .load(std::sync::atomic::Ordering::Relaxed)
        < 2
    {
        assert!(Instant::now() < deadline, "no retry: {:?}", run.status());
        std::thread::sleep(Duration::from_millis(10));
    }
}
