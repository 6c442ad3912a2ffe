//! A small etcd v3 client over etcd's JSON gateway (`/v3/kv/*`,
//! `/v3/lease/*`, served by every etcd since 3.3 on the client port):
//! reads, guarded transactions and leases, which is all the controller
//! needs, without gRPC or a protobuf compiler at build time. Keys and
//! values are base64 on the wire; 64-bit numbers are JSON strings.

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde_json::{json, Value};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("no etcd endpoint answered ({0})")]
    Unreachable(String),
    #[error("etcd refused {call}: {detail}")]
    Refused { call: String, detail: String },
    #[error("etcd answered {call} with something unexpected: {detail}")]
    Garbled { call: String, detail: String },
}

/// One key and what etcd keeps about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    pub key: String,
    pub value: Vec<u8>,
    pub create_revision: i64,
    pub lease: i64,
}

/// A condition of a transaction.
#[derive(Debug, Clone)]
pub enum Compare {
    /// The key does not exist.
    Absent(String),
    /// The key exists with exactly this value.
    ValueIs(String, Vec<u8>),
    /// The key is attached to exactly this lease.
    LeaseIs(String, i64),
}

/// A write of a transaction.
#[derive(Debug, Clone)]
pub enum Put {
    Value {
        key: String,
        value: Vec<u8>,
        lease: Option<i64>,
    },
    Delete(String),
    /// Every key from the first up to (not including) the second.
    DeleteRange(String, String),
}

#[derive(Clone)]
pub struct EtcdClient {
    endpoints: Vec<String>,
    agent: ureq::Agent,
}

fn num(v: &Value) -> i64 {
    match v {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

fn b64(s: &[u8]) -> String {
    B64.encode(s)
}

/// The first key after every key starting with `prefix`.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn kv_of(v: &Value, call: &str) -> Result<KeyValue, EtcdError> {
    let garbled = |d: &str| EtcdError::Garbled {
        call: call.into(),
        detail: d.into(),
    };
    let key = B64
        .decode(v["key"].as_str().unwrap_or(""))
        .map_err(|e| garbled(&e.to_string()))?;
    let value = B64
        .decode(v["value"].as_str().unwrap_or(""))
        .map_err(|e| garbled(&e.to_string()))?;
    Ok(KeyValue {
        key: String::from_utf8(key).map_err(|e| garbled(&e.to_string()))?,
        value,
        create_revision: num(&v["create_revision"]),
        lease: num(&v["lease"]),
    })
}

impl EtcdClient {
    /// `endpoints`: `http://host:port` each (a bare `host:port` is taken
    /// as http). Calls go to the first that answers.
    pub fn new(endpoints: &[String], timeout: Duration) -> Result<EtcdClient, EtcdError> {
        Self::with_tls(endpoints, timeout, None)
    }

    /// The same over TLS with `tls` (its roots check etcd's certificate,
    /// its client certificate authenticates this controller) for
    /// `https://` endpoints.
    pub fn with_tls(
        endpoints: &[String],
        timeout: Duration,
        tls: Option<std::sync::Arc<rustls::ClientConfig>>,
    ) -> Result<EtcdClient, EtcdError> {
        let endpoints: Vec<String> = endpoints
            .iter()
            .map(|e| e.trim().trim_end_matches('/'))
            .filter(|e| !e.is_empty())
            .map(|e| {
                if e.contains("://") {
                    e.to_string()
                } else if tls.is_some() {
                    format!("https://{e}")
                } else {
                    format!("http://{e}")
                }
            })
            .collect();
        if endpoints.is_empty() {
            return Err(EtcdError::Unreachable("no endpoint given".into()));
        }
        let mut agent = ureq::AgentBuilder::new()
            .timeout(timeout)
            .timeout_connect(timeout);
        if let Some(t) = tls {
            agent = agent.tls_config(t);
        }
        Ok(EtcdClient {
            endpoints,
            agent: agent.build(),
        })
    }

    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    fn call(&self, path: &str, body: &Value) -> Result<Value, EtcdError> {
        let mut last = String::new();
        for e in &self.endpoints {
            match self.agent.post(&format!("{e}{path}")).send_json(body) {
                Ok(r) => {
                    return r.into_json::<Value>().map_err(|x| EtcdError::Garbled {
                        call: path.into(),
                        detail: x.to_string(),
                    })
                }
                Err(ureq::Error::Status(code, r)) => {
                    let text = r.into_string().unwrap_or_default();
                    return Err(EtcdError::Refused {
                        call: path.into(),
                        detail: format!("HTTP {code}: {}", text.trim()),
                    });
                }
                Err(x) => last = format!("{e}: {x}"),
            }
        }
        Err(EtcdError::Unreachable(last))
    }

    /// The key, if it exists.
    pub fn get(&self, key: &str) -> Result<Option<KeyValue>, EtcdError> {
        let v = self.call("/v3/kv/range", &json!({"key": b64(key.as_bytes())}))?;
        match v["kvs"].as_array().and_then(|a| a.first()) {
            Some(kv) => kv_of(kv, "range").map(Some),
            None => Ok(None),
        }
    }

    /// Keys starting with `prefix`, in key order; with `last`, only the
    /// last that many.
    pub fn list(&self, prefix: &str, last: Option<usize>) -> Result<Vec<KeyValue>, EtcdError> {
        let mut body = json!({
            "key": b64(prefix.as_bytes()),
            "range_end": b64(&prefix_end(prefix)),
        });
        if let Some(n) = last {
            body["limit"] = json!(n.to_string());
            body["sort_order"] = json!("DESCEND");
            body["sort_target"] = json!("KEY");
        }
        let v = self.call("/v3/kv/range", &body)?;
        let mut out = v["kvs"]
            .as_array()
            .map(|a| a.iter().map(|kv| kv_of(kv, "range")).collect())
            .unwrap_or_else(|| Ok(Vec::new()))?;
        if last.is_some() {
            out.reverse();
        }
        Ok(out)
    }

    /// Every key from `from` up to the end of `prefix`, in key order.
    pub fn list_from(&self, from: &str, prefix: &str) -> Result<Vec<KeyValue>, EtcdError> {
        let body = json!({
            "key": b64(from.as_bytes()),
            "range_end": b64(&prefix_end(prefix)),
        });
        let v = self.call("/v3/kv/range", &body)?;
        v["kvs"]
            .as_array()
            .map(|a| a.iter().map(|kv| kv_of(kv, "range")).collect())
            .unwrap_or_else(|| Ok(Vec::new()))
    }

    /// Apply `puts` if every condition holds; `Ok(false)` when one does not.
    pub fn txn(&self, when: &[Compare], puts: &[Put]) -> Result<bool, EtcdError> {
        let compare: Vec<Value> = when
            .iter()
            .map(|c| match c {
                Compare::Absent(k) => json!({
                    "target": "CREATE", "result": "EQUAL",
                    "key": b64(k.as_bytes()), "create_revision": "0",
                }),
                Compare::ValueIs(k, v) => json!({
                    "target": "VALUE", "result": "EQUAL",
                    "key": b64(k.as_bytes()), "value": b64(v),
                }),
                Compare::LeaseIs(k, l) => json!({
                    "target": "LEASE", "result": "EQUAL",
                    "key": b64(k.as_bytes()), "lease": l.to_string(),
                }),
            })
            .collect();
        let success: Vec<Value> = puts
            .iter()
            .map(|p| match p {
                Put::Value { key, value, lease } => {
                    let mut r = json!({"key": b64(key.as_bytes()), "value": b64(value)});
                    if let Some(l) = lease {
                        r["lease"] = json!(l.to_string());
                    }
                    json!({"request_put": r})
                }
                Put::Delete(k) => json!({"request_delete_range": {"key": b64(k.as_bytes())}}),
                Put::DeleteRange(from, to) => json!({"request_delete_range": {
                    "key": b64(from.as_bytes()), "range_end": b64(to.as_bytes()),
                }}),
            })
            .collect();
        let v = self.call(
            "/v3/kv/txn",
            &json!({"compare": compare, "success": success}),
        )?;
        if v.get("header").is_none() {
            return Err(EtcdError::Garbled {
                call: "txn".into(),
                detail: v.to_string(),
            });
        }
        Ok(v["succeeded"].as_bool().unwrap_or(false))
    }

    /// A new lease of `ttl` seconds.
    pub fn grant(&self, ttl: u64) -> Result<i64, EtcdError> {
        let v = self.call("/v3/lease/grant", &json!({"TTL": ttl.to_string()}))?;
        match num(&v["ID"]) {
            0 => Err(EtcdError::Refused {
                call: "lease grant".into(),
                detail: v.to_string(),
            }),
            id => Ok(id),
        }
    }

    /// Renew a lease; the seconds it has left (0: it has expired).
    pub fn keep_alive(&self, lease: i64) -> Result<i64, EtcdError> {
        let v = self.call("/v3/lease/keepalive", &json!({"ID": lease.to_string()}))?;
        if let Some(e) = v.get("error") {
            return Err(EtcdError::Refused {
                call: "lease keepalive".into(),
                detail: e.to_string(),
            });
        }
        Ok(num(&v["result"]["TTL"]))
    }

    pub fn revoke(&self, lease: i64) -> Result<(), EtcdError> {
        self.call("/v3/lease/revoke", &json!({"ID": lease.to_string()}))
            .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_ends_after_its_last_key() {
        assert_eq!(prefix_end("/a/"), b"/a0".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
        assert_eq!(prefix_end(""), vec![0]);
    }

    #[test]
    fn numbers_come_as_strings_or_numbers() {
        assert_eq!(num(&json!("42")), 42);
        assert_eq!(num(&json!(7)), 7);
        assert_eq!(num(&json!(null)), 0);
    }

    #[test]
    fn no_endpoint_is_a_clear_error() {
        assert!(matches!(
            EtcdClient::new(&[" ".into()], Duration::from_secs(1)),
            Err(EtcdError::Unreachable(_))
        ));
        let c = EtcdClient::new(&["127.0.0.1:2379/".into()], Duration::from_secs(1)).unwrap();
        assert_eq!(c.endpoints(), ["http://127.0.0.1:2379"]);
    }
}
