//! Guests' loads read from a Prometheus server that scrapes the hosts
//! (`ferry control run --prometheus URL`), instead of the controller
//! reading every host twice itself. Five instant queries over a window:
//! disk requests, bytes, written bytes, latency and QEMU's CPU time, each
//! a `rate()` of the counters `ferry host` exports (`ferry_vm_*`), summed
//! per guest (`vm` label); a sixth reads the guests' memory dirty rate
//! (a gauge); two more its network cards' packets and bytes per network.
//! The placement (which host runs which guest,
//! where its disk is) still comes from the hosts: Prometheus only says
//! how busy each guest is.

use std::collections::BTreeMap;
use std::time::Duration;

/// How long one query may take.
const QUERY_LIMIT: Duration = Duration::from_secs(10);

/// One guest's rates over the window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GuestRates {
    /// Disk requests per second (reads, writes, flushes, others).
    pub iops: f64,
    /// Disk bytes per second, read and written.
    pub bytes_per_sec: f64,
    pub write_bytes_per_sec: f64,
    /// Mean latency of a disk request, in ms (0 without requests).
    pub latency_ms: f64,
    /// CPUs the guest's QEMU used.
    pub cpu: f64,
    /// Guest RAM dirtied per second, the host's latest measurement.
    pub memory_dirty: Option<f64>,
    /// Its traffic per network.
    pub networks: BTreeMap<String, crate::measure::NicRates>,
}

/// A Prometheus server and the window its rates are taken over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrometheusSource {
    /// Base URL, e.g. `http://prom:9090`.
    pub url: String,
    pub window: Duration,
}

impl PrometheusSource {
    /// The window as PromQL writes it (whole seconds, at least 1 s).
    fn range(&self) -> String {
        format!("{}s", self.window.as_secs().max(1))
    }

    /// Every guest's rates, by guest name. `Err` says what failed (an
    /// unreachable server, a refused query): the caller falls back to
    /// reading the hosts.
    pub fn guest_rates(&self) -> Result<BTreeMap<String, GuestRates>, String> {
        let w = self.range();
        use ferry_api::metrics::{
            VM_CPU_SECONDS_TOTAL as CPU, VM_DISK_BYTES_TOTAL as BYTES,
            VM_DISK_LATENCY_SECONDS as LATENCY, VM_DISK_REQUESTS_TOTAL as REQUESTS,
            VM_MEMORY_DIRTY_BYTES_PER_SECOND as DIRTY, VM_NETWORK_BYTES_TOTAL as NET_BYTES,
            VM_NETWORK_PACKETS_TOTAL as NET_PACKETS,
        };
        let iops = self.by_vm(&format!("sum by (vm) (rate({REQUESTS}[{w}]))"))?;
        let bytes = self.by_vm(&format!("sum by (vm) (rate({BYTES}[{w}]))"))?;
        let writes = self.by_vm(&format!(
            "sum by (vm) (rate({BYTES}{{dir=\"write\"}}[{w}]))"
        ))?;
        let latency = self.by_vm(&format!(
            "sum by (vm) (rate({LATENCY}_sum[{w}])) / sum by (vm) (rate({LATENCY}_count[{w}]))"
        ))?;
        let cpu = self.by_vm(&format!("sum by (vm) (rate({CPU}[{w}]))"))?;
        let dirty = self.by_vm(&format!("max by (vm) ({DIRTY})"))?;
        let packets = self.by_labels(
            &format!("sum by (vm, network, dir) (rate({NET_PACKETS}[{w}]))"),
            &["vm", "network", "dir"],
        )?;
        let net_bytes = self.by_labels(
            &format!("sum by (vm, network) (rate({NET_BYTES}[{w}]))"),
            &["vm", "network"],
        )?;
        let mut out: BTreeMap<String, GuestRates> = BTreeMap::new();
        for (vm, v) in iops {
            out.entry(vm).or_default().iops = v;
        }
        for (vm, v) in bytes {
            out.entry(vm).or_default().bytes_per_sec = v;
        }
        for (vm, v) in writes {
            out.entry(vm).or_default().write_bytes_per_sec = v;
        }
        for (vm, v) in latency {
            // 0/0 (no requests in the window) is NaN.
            out.entry(vm).or_default().latency_ms = if v.is_finite() { v * 1000.0 } else { 0.0 };
        }
        for (vm, v) in cpu {
            out.entry(vm).or_default().cpu = v;
        }
        for (vm, v) in dirty {
            if v.is_finite() {
                out.entry(vm).or_default().memory_dirty = Some(v);
            }
        }
        for (k, v) in packets {
            let [vm, network, dir] = <[String; 3]>::try_from(k).unwrap_or_default();
            let r = out
                .entry(vm)
                .or_default()
                .networks
                .entry(network)
                .or_default();
            match dir.as_str() {
                "to_guest" => r.to_guest_packets += v,
                "from_guest" => r.from_guest_packets += v,
                _ => {}
            }
        }
        for (k, v) in net_bytes {
            let [vm, network] = <[String; 2]>::try_from(k).unwrap_or_default();
            out.entry(vm)
                .or_default()
                .networks
                .entry(network)
                .or_default()
                .bytes += v;
        }
        Ok(out)
    }

    /// An instant query's samples keyed by the values of `labels` (a
    /// sample lacking one of them is skipped).
    fn by_labels(
        &self,
        query: &str,
        labels: &[&str],
    ) -> Result<BTreeMap<Vec<String>, f64>, String> {
        let body = self.query(query)?;
        parse_vector_by(&body, labels).map_err(|e| self.bad_answer(query, &e))
    }

    fn by_vm(&self, query: &str) -> Result<BTreeMap<String, f64>, String> {
        let body = self.query(query)?;
        parse_vector(&body).map_err(|e| self.bad_answer(query, &e))
    }

    /// An answer to `query` that `e` says is not what was asked.
    fn bad_answer(&self, query: &str, e: &str) -> String {
        format!("prometheus at {}: {query}: {e}", self.url)
    }

    fn query(&self, query: &str) -> Result<serde_json::Value, String> {
        let url = format!("{}/api/v1/query", self.url.trim_end_matches('/'));
        ureq::get(&url)
            .timeout(QUERY_LIMIT)
            .query("query", query)
            .call()
            .map_err(|e| format!("prometheus at {}: {e}", self.url))?
            .into_json()
            .map_err(|e| format!("prometheus at {}: not JSON: {e}", self.url))
    }
}

/// The samples of an instant-query answer, by their `vm` label.
fn parse_vector(body: &serde_json::Value) -> Result<BTreeMap<String, f64>, String> {
    Ok(parse_vector_by(body, &["vm"])?
        .into_iter()
        .filter_map(|(mut k, v)| k.pop().map(|vm| (vm, v)))
        .collect())
}

/// The samples of an instant-query answer, by the values of `labels`.
fn parse_vector_by(
    body: &serde_json::Value,
    labels: &[&str],
) -> Result<BTreeMap<Vec<String>, f64>, String> {
    if body["status"] != "success" {
        return Err(format!(
            "{}: {}",
            body["errorType"].as_str().unwrap_or("error"),
            body["error"].as_str().unwrap_or("the query failed")
        ));
    }
    if body["data"]["resultType"] != "vector" {
        return Err(format!(
            "expected a vector, got {}",
            body["data"]["resultType"]
        ));
    }
    let mut out = BTreeMap::new();
    for r in body["data"]["result"].as_array().into_iter().flatten() {
        let Some(key) = labels
            .iter()
            .map(|l| r["metric"][*l].as_str().map(str::to_string))
            .collect::<Option<Vec<String>>>()
        else {
            continue;
        };
        // Prometheus writes sample values as strings ("NaN" included).
        let v = r["value"][1]
            .as_str()
            .and_then(|s| s.parse::<f64>().ok())
            .ok_or_else(|| format!("bad sample value {}", r["value"]))?;
        out.insert(key, v);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn vectors_are_read_by_guest_and_errors_say_why() {
        let ok = json!({"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {"vm": "web"}, "value": [1.7e9, "12.5"]},
            {"metric": {"vm": "db"}, "value": [1.7e9, "NaN"]},
            {"metric": {}, "value": [1.7e9, "3"]}
        ]}});
        let m = parse_vector(&ok).unwrap();
        assert_eq!(m.len(), 2);
        assert!((m["web"] - 12.5).abs() < 1e-9);
        assert!(m["db"].is_nan());
        let bad = json!({"status": "error", "errorType": "bad_data", "error": "parse error"});
        assert_eq!(parse_vector(&bad).unwrap_err(), "bad_data: parse error");
        let matrix = json!({"status": "success", "data": {"resultType": "matrix", "result": []}});
        assert!(parse_vector(&matrix)
            .unwrap_err()
            .contains("expected a vector"));
        let junk = json!({"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {"vm": "x"}, "value": [1.0, 7]}
        ]}});
        assert!(parse_vector(&junk).is_err());
    }

    #[test]
    fn network_series_are_read_by_guest_network_and_direction() {
        let ok = json!({"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {"vm": "web", "network": "lan", "dir": "to_guest"}, "value": [1.7e9, "40"]},
            {"metric": {"vm": "web", "network": "lan"}, "value": [1.7e9, "3"]}
        ]}});
        let m = parse_vector_by(&ok, &["vm", "network", "dir"]).unwrap();
        assert_eq!(m.len(), 1, "a sample lacking a label is skipped");
        let key: Vec<String> = ["web", "lan", "to_guest"].map(String::from).into();
        assert!((m[&key] - 40.0).abs() < 1e-9);
    }

    #[test]
    fn an_unreachable_server_is_an_error_not_a_zero_load() {
        let p = PrometheusSource {
            url: "http://127.0.0.1:1".into(),
            window: Duration::from_secs(60),
        };
        let e = p.guest_rates().unwrap_err();
        assert!(e.contains("prometheus at http://127.0.0.1:1"), "{e}");
        assert_eq!(p.range(), "60s");
    }
}
