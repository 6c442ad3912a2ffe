//! A typed client of the controller's API (what `ferry control` and
//! `ferry site` call): one method per route, errors that say whether the
//! controller could not be reached or refused, and why.

use crate::journal::Entry;
use crate::settings::Settings;
use ferry_placement::inventory::SiteInventory;
use ferry_placement::policy::Policy;
use ferry_placement::Link;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ControllerClientError {
    #[error("cannot reach the controller at {base} (is `ferry control run` running? set --controller or FERRY_CONTROLLER): {detail}")]
    Unreachable { base: String, detail: String },
    #[error("the controller answered {code}: {message}")]
    Refused { code: u16, message: String },
    #[error("the controller's answer to {path} does not decode: {detail}")]
    Garbled { path: String, detail: String },
}

type Result<T> = std::result::Result<T, ControllerClientError>;

#[derive(Clone)]
pub struct ControllerClient {
    base: String,
    agent: ureq::Agent,
}

impl ControllerClient {
    /// `addr` is `host:port` or a URL.
    pub fn new(addr: &str) -> ControllerClient {
        let plain = ControllerClient {
            base: ferry_trust::client::base_url(addr, addr.starts_with("https://")),
            agent: ureq::AgentBuilder::new()
                .timeout(Duration::from_secs(30))
                .build(),
        };
        match ferry_api::client::process_identity() {
            Some(store) => match plain.clone().identity(addr, Some(store)) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "no TLS identity for the controller client");
                    plain
                }
            },
            None => plain,
        }
    }

    /// Call with an operator's identity wherever the call goes over TLS
    /// (an `https://` URL, or an address that is not a loopback one); the
    /// controller's certificate must be pinned in `store` as a controller.
    pub fn identity(
        mut self,
        addr: &str,
        store: Option<&ferry_trust::CertStore>,
    ) -> std::result::Result<ControllerClient, ferry_trust::CertError> {
        if let Some(store) = store.filter(|_| ferry_trust::client::wants_tls(addr)) {
            self.agent = ferry_trust::client::agent(
                store,
                &[ferry_trust::Role::Controller],
                Some(Duration::from_secs(30)),
            )?;
            self.base = ferry_trust::client::base_url(addr, true);
        }
        Ok(self)
    }

    fn call<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<T> {
        self.call_within(method, path, body, None)
    }

    /// A call whose answer may take longer than the agent's 30 s.
    fn call_within<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<serde_json::Value>,
        limit: Option<Duration>,
    ) -> Result<T> {
        let mut req = self.agent.request(method, &format!("{}{path}", self.base));
        if let Some(l) = limit {
            req = req.timeout(l);
        }
        if method != "GET" {
            // The API refuses state changes a browser page could forge.
            req = req.set("Content-Type", "application/json");
        }
        let r = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        let garbled = |detail: String| ControllerClientError::Garbled {
            path: path.into(),
            detail,
        };
        match r {
            Ok(r) => {
                let text = r.into_string().map_err(|e| garbled(e.to_string()))?;
                let text = if text.is_empty() { "null" } else { &text };
                serde_json::from_str(text).map_err(|e| garbled(e.to_string()))
            }
            Err(ureq::Error::Status(code, r)) => {
                let text = r.into_string().unwrap_or_default();
                let message = serde_json::from_str::<serde_json::Value>(&text)
                    .ok()
                    .and_then(|v| v["error"].as_str().map(String::from))
                    .unwrap_or(text);
                Err(ControllerClientError::Refused { code, message })
            }
            Err(e) => Err(ControllerClientError::Unreachable {
                base: self.base.clone(),
                detail: e.to_string(),
            }),
        }
    }

    fn send<B: Serialize, T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        b: &B,
    ) -> Result<T> {
        let v = serde_json::to_value(b).map_err(|e| ControllerClientError::Garbled {
            path: path.into(),
            detail: e.to_string(),
        })?;
        self.call(method, path, Some(v))
    }

    /// What the last cycle saw and decided (`service::Status` as JSON).
    pub fn status(&self) -> Result<serde_json::Value> {
        self.call("GET", "/v1/status", None)
    }

    pub fn journal(&self, limit: usize) -> Result<Vec<Entry>> {
        self.call("GET", &format!("/v1/journal?limit={limit}"), None)
    }

    pub fn settings(&self) -> Result<Settings> {
        self.call("GET", "/v1/settings", None)
    }

    pub fn put_policy(&self, p: &Policy) -> Result<Settings> {
        self.send("PUT", "/v1/policy", p)
    }

    pub fn add_site(&self, s: &SiteInventory) -> Result<Settings> {
        self.send("POST", "/v1/sites", s)
    }

    /// Change a site in place (its links stay).
    pub fn replace_site(&self, s: &SiteInventory) -> Result<Settings> {
        self.send("PUT", &format!("/v1/sites/{}", s.name), s)
    }

    pub fn remove_site(&self, name: &str) -> Result<()> {
        self.call::<serde_json::Value>("DELETE", &format!("/v1/sites/{name}"), None)
            .map(|_| ())
    }

    pub fn put_links(&self, links: &[Link]) -> Result<Settings> {
        self.send("PUT", "/v1/links", &links)
    }

    /// Run one cycle now that acts even while paused (`plan --apply`);
    /// answers once it ran: `{cycle, plan, problems}` (`service::Applied`).
    pub fn apply(&self) -> Result<serde_json::Value> {
        self.call_within("POST", "/v1/apply", None, Some(Duration::from_secs(330)))
    }

    pub fn pause(&self) -> Result<Settings> {
        self.call("POST", "/v1/pause", None)
    }

    pub fn resume(&self) -> Result<Settings> {
        self.call("POST", "/v1/resume", None)
    }
}
