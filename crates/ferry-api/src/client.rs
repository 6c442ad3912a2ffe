//! A blocking client of the admin API (one `ureq` agent, typed calls).
//!
//! Errors say whose fault they are: the daemon could not be reached, it
//! answered with an error status (and its `{"error"}` message), or its
//! answer did not decode as the type this build expects.

use crate::host::{AttachRequest, AttachedVolume};
use crate::index::{IndexStatus, RebuildReport, RebuildRequest};
use crate::migration::{MigrateRequest, MigrationId, MigrationStatus};
use crate::server::ServerView;
use crate::vm::{CreateVm, VmMigrateRequest, VmMoveStatus, VmSpec, VmView};
use crate::volume::{ArrivalView, VolumeView};
use crate::volume::{BitmapRequest, BitmapView, CreateVolume, ImportReport, ResizeVolume, Size};
use crate::ErrorBody;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::io::{BufRead, BufReader, Read};
use thiserror::Error;

/// A failed admin API call.
#[derive(Debug, Error)]
pub enum ClientError {
    /// No answer: nothing listens there, or the connection broke.
    #[error("cannot reach {} at {base} ({}): {detail}", .daemon.what(), .daemon.hint())]
    Unreachable {
        daemon: Daemon,
        base: String,
        detail: String,
    },
    /// The daemon answered with an error status.
    #[error("{} at {base} answered {status}: {message}", .daemon.what())]
    Status {
        daemon: Daemon,
        base: String,
        status: u16,
        message: String,
    },
    /// The answer is not what this client expects.
    #[error("admin API answer to {path} does not decode: {detail}")]
    Decode { path: String, detail: String },
}

/// Which daemon a client talks to, so that an unreachable one is named
/// with the command and option that start or point at it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Daemon {
    /// `ferry serve`'s admin API.
    Storage,
    /// `ferry host`'s control API.
    Host,
}

impl Daemon {
    fn what(self) -> &'static str {
        match self {
            Daemon::Storage => "the storage daemon's admin API",
            Daemon::Host => "the host's control API",
        }
    }

    fn hint(self) -> &'static str {
        match self {
            Daemon::Storage => "is `ferry serve` running? set --admin or FERRY_ADMIN",
            Daemon::Host => "is `ferry host` running? set --host or FERRY_HOST",
        }
    }
}

impl ClientError {
    /// The HTTP status of an error answer.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }
}

type Result<T> = std::result::Result<T, ClientError>;

/// Every state-changing call says it is JSON: the APIs refuse the content
/// types a browser page can send across sites.
const JSON: &str = "application/json";

/// A client of one daemon's admin API.
#[derive(Debug, Clone)]
pub struct AdminClient {
    url: String,
    base: String,
    agent: ureq::Agent,
    daemon: Daemon,
    limit: Option<std::time::Duration>,
    tls: Option<ferry_trust::CertStore>,
    /// Why this process's identity cannot be used: every call fails with
    /// it (and goes nowhere: the base is an unroutable name).
    identity_error: Option<String>,
}

/// The identity every client of this process calls with unless told
/// otherwise: a process is one daemon, or one operator's CLI, and has one
/// identity ([`set_process_identity`]).
static PROCESS_IDENTITY: std::sync::OnceLock<ferry_trust::CertStore> = std::sync::OnceLock::new();

/// Set this process's identity (once; later calls are ignored): `ferry
/// host` its state directory's store, `ferry control run` its own, the CLI
/// the operator's `--tls-dir`.
pub fn set_process_identity(store: ferry_trust::CertStore) {
    let _ = PROCESS_IDENTITY.set(store);
}

/// This process's identity, if one was set.
pub fn process_identity() -> Option<&'static ferry_trust::CertStore> {
    PROCESS_IDENTITY.get()
}

impl AdminClient {
    /// `url` is `HOST:PORT`, `http://HOST:PORT` or `https://HOST:PORT`.
    /// Calls go over TLS with the process's identity (if it has one)
    /// wherever [`ferry_trust::client::wants_tls`] says so.
    pub fn new(url: &str) -> Self {
        let mut c = AdminClient {
            url: url.to_string(),
            base: ferry_trust::client::base_url(url, url.starts_with("https://")),
            agent: ureq::AgentBuilder::new().build(),
            daemon: Daemon::Storage,
            limit: None,
            tls: None,
            identity_error: None,
        };
        c.tls = process_identity()
            .filter(|_| ferry_trust::client::wants_tls(url))
            .cloned();
        c.rebuild();
        c
    }

    /// Call with this identity (a daemon's store, or an operator's
    /// `--tls-dir`) wherever the call goes over TLS: to an `https://` URL,
    /// or to any address that is not a loopback one. The server's
    /// certificate must be pinned in `store` as the daemon this client
    /// calls (a storage daemon, or a host).
    pub fn identity(mut self, store: Option<&ferry_trust::CertStore>) -> Self {
        self.tls = store
            .filter(|_| ferry_trust::client::wants_tls(&self.url))
            .cloned();
        self.rebuild();
        self
    }

    fn rebuild(&mut self) {
        let roles: &[ferry_trust::Role] = match self.daemon {
            Daemon::Storage => &[ferry_trust::Role::Storage],
            Daemon::Host => &[ferry_trust::Role::Host],
        };
        let plain = || {
            let mut b = ureq::AgentBuilder::new();
            if let Some(t) = self.limit {
                b = b
                    .timeout_connect(t.min(std::time::Duration::from_secs(5)))
                    .timeout(t);
            }
            b.build()
        };
        self.identity_error = None;
        match &self.tls {
            Some(store) => match ferry_trust::client::agent(store, roles, self.limit) {
                Ok(a) => {
                    self.agent = a;
                    self.base = ferry_trust::client::base_url(&self.url, true);
                }
                Err(e) => {
                    // Calls fail with this reason, rather than going out in
                    // plaintext.
                    self.agent = plain();
                    self.base = "https://identity-unusable.invalid".into();
                    self.identity_error = Some(format!("this process's TLS identity: {e}"));
                }
            },
            None => self.agent = plain(),
        }
    }

    /// A client of `ferry host`'s control API (same calls; its errors
    /// name the host daemon).
    pub fn for_host(url: &str) -> Self {
        let mut c = AdminClient {
            daemon: Daemon::Host,
            ..AdminClient::new(url)
        };
        c.rebuild();
        c
    }

    /// The same with a limit on every call (connect, send and answer),
    /// for callers that must not hang on one unresponsive daemon.
    pub fn with_timeout(url: &str, limit: std::time::Duration) -> Self {
        AdminClient::new(url).limited(limit)
    }

    /// This client with a limit on every call.
    pub fn limited(mut self, limit: std::time::Duration) -> Self {
        self.limit = Some(limit);
        self.rebuild();
        self
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    fn check(&self, r: std::result::Result<ureq::Response, ureq::Error>) -> Result<ureq::Response> {
        if let Some(why) = &self.identity_error {
            return Err(ClientError::Unreachable {
                daemon: self.daemon,
                base: self.url.clone(),
                detail: why.clone(),
            });
        }
        match r {
            Ok(r) => Ok(r),
            Err(ureq::Error::Status(status, resp)) => {
                let text = resp.into_string().unwrap_or_default();
                let message = serde_json::from_str::<ErrorBody>(&text)
                    .map(|b| b.error)
                    .unwrap_or_else(|_| {
                        if text.is_empty() {
                            "no details".into()
                        } else {
                            text
                        }
                    });
                Err(ClientError::Status {
                    daemon: self.daemon,
                    base: self.base.clone(),
                    status,
                    message,
                })
            }
            Err(e) => Err(ClientError::Unreachable {
                daemon: self.daemon,
                base: self.base.clone(),
                detail: e.to_string(),
            }),
        }
    }

    fn decode<T: DeserializeOwned>(path: &str, r: ureq::Response) -> Result<T> {
        let text = r.into_string().map_err(|e| ClientError::Decode {
            path: path.into(),
            detail: e.to_string(),
        })?;
        serde_json::from_str(&text).map_err(|e| ClientError::Decode {
            path: path.into(),
            detail: e.to_string(),
        })
    }

    fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T> {
        let r = self.check(self.agent.get(&self.url(path)).call())?;
        Self::decode(path, r)
    }

    fn post<B: Serialize, T: DeserializeOwned>(&self, path: &str, body: &B) -> Result<T> {
        let r = self.check(self.agent.post(&self.url(path)).send_json(body))?;
        Self::decode(path, r)
    }

    fn delete(&self, path: &str) -> Result<()> {
        self.check(
            self.agent
                .delete(&self.url(path))
                .set("Content-Type", JSON)
                .call(),
        )?;
        Ok(())
    }

    pub fn server(&self) -> Result<ServerView> {
        self.get("/v1/server")
    }

    pub fn volumes(&self) -> Result<Vec<VolumeView>> {
        self.get("/v1/volumes")
    }

    pub fn create_volume(&self, req: &CreateVolume) -> Result<VolumeView> {
        self.post("/v1/volumes", req)
    }

    /// The volume; a 404 error when the daemon has no such volume.
    pub fn get_volume(&self, name: &str) -> Result<VolumeView> {
        self.get(&format!("/v1/volumes/{name}"))
    }

    /// The volume, or `None` when the daemon has no such volume.
    pub fn volume(&self, name: &str) -> Result<Option<VolumeView>> {
        match self.get_volume(name) {
            Err(ClientError::Status { status: 404, .. }) => Ok(None),
            r => r.map(Some),
        }
    }

    /// Delete a volume; refused (409) while a client or a migration holds
    /// it, unless `force` (which never overrides a migration).
    pub fn delete_volume(&self, name: &str, force: bool) -> Result<()> {
        let q = if force { "?force=true" } else { "" };
        self.delete(&format!("/v1/volumes/{name}{q}"))
    }

    pub fn resize_volume(&self, name: &str, size: Size, allow_shrink: bool) -> Result<VolumeView> {
        self.post(
            &format!("/v1/volumes/{name}/resize"),
            &ResizeVolume { size, allow_shrink },
        )
    }

    /// Stream `len` bytes of a raw image into the volume from offset 0.
    pub fn import(&self, name: &str, data: impl Read, len: u64) -> Result<ImportReport> {
        let path = format!("/v1/volumes/{name}/data");
        let r = self.check(
            self.agent
                .put(&self.url(&path))
                .set("Content-Type", "application/octet-stream")
                .set("Content-Length", &len.to_string())
                .send(data),
        )?;
        Self::decode(&path, r)
    }

    /// The whole volume as a stream, and its length.
    pub fn export(&self, name: &str) -> Result<(u64, Box<dyn Read + Send + Sync>)> {
        let r = self.check(
            self.agent
                .get(&self.url(&format!("/v1/volumes/{name}/data")))
                .call(),
        )?;
        let len = r
            .header("Content-Length")
            .and_then(|l| l.parse().ok())
            .unwrap_or(0);
        Ok((len, r.into_reader()))
    }

    pub fn bitmaps(&self, volume: &str) -> Result<Vec<BitmapView>> {
        self.get(&format!("/v1/volumes/{volume}/bitmaps"))
    }

    pub fn create_bitmap(&self, volume: &str, req: &BitmapRequest) -> Result<BitmapView> {
        self.post(&format!("/v1/volumes/{volume}/bitmaps"), req)
    }

    pub fn clear_bitmap(&self, volume: &str, bitmap: &str) -> Result<BitmapView> {
        self.post(
            &format!("/v1/volumes/{volume}/bitmaps/{bitmap}/clear"),
            &serde_json::Value::Null,
        )
    }

    pub fn delete_bitmap(&self, volume: &str, bitmap: &str) -> Result<()> {
        self.delete(&format!("/v1/volumes/{volume}/bitmaps/{bitmap}"))
    }

    pub fn index_status(&self) -> Result<IndexStatus> {
        self.get("/v1/index")
    }

    pub fn index_rebuild(&self, volume: Option<&str>) -> Result<Vec<RebuildReport>> {
        self.post(
            "/v1/index/rebuild",
            &RebuildRequest {
                volume: volume.map(str::to_string),
            },
        )
    }

    /// Start a migration (or, with the id of one already started for the
    /// same volume and destination, get that one).
    pub fn migrate(&self, volume: &str, req: &MigrateRequest) -> Result<MigrationStatus> {
        self.post(&format!("/v1/volumes/{volume}/migrate"), req)
    }

    pub fn migrations(&self) -> Result<Vec<MigrationStatus>> {
        self.get("/v1/migrations")
    }

    pub fn migration(&self, id: &MigrationId) -> Result<MigrationStatus> {
        self.get(&format!("/v1/migrations/{id}"))
    }

    /// Cancel a migration that has not paused the guest yet.
    pub fn cancel_migration(&self, id: &MigrationId) -> Result<MigrationStatus> {
        let path = format!("/v1/migrations/{id}");
        let r = self.check(
            self.agent
                .delete(&self.url(&path))
                .set("Content-Type", JSON)
                .call(),
        )?;
        Self::decode(&path, r)
    }

    /// Whether migration `id` has committed its copy of `volume` at this
    /// daemon, waiting up to `wait` for it (the call's own limit must be
    /// longer).
    pub fn wait_arrival(
        &self,
        volume: &str,
        id: &MigrationId,
        wait: std::time::Duration,
    ) -> Result<ArrivalView> {
        self.get(&format!(
            "/v1/volumes/{volume}/arrival?migration={id}&wait_ms={}",
            wait.as_millis()
        ))
    }

    /// Release a migration held before its switch (`hold_switch`).
    pub fn release_switch(&self, id: &MigrationId) -> Result<MigrationStatus> {
        self.post(
            &format!("/v1/migrations/{id}/switch"),
            &serde_json::Value::Null,
        )
    }

    /// Release a held migration only if it is ready to switch now; the
    /// answer's `switch_released` says whether it is released (a daemon
    /// before this call releases it whatever its phase).
    pub fn release_switch_if_ready(&self, id: &MigrationId) -> Result<MigrationStatus> {
        self.post(
            &format!("/v1/migrations/{id}/switch?if_ready=true"),
            &serde_json::Value::Null,
        )
    }

    /// Follow a migration as the daemon reports it (one status per change,
    /// pushed by the daemon), calling `each` for every status, until it
    /// ends; returns the last status.
    pub fn watch_migration(
        &self,
        id: &MigrationId,
        mut each: impl FnMut(&MigrationStatus),
    ) -> Result<MigrationStatus> {
        let path = format!("/v1/migrations/{id}/events");
        let r = self.check(self.agent.get(&self.url(&path)).call())?;
        let mut last: Option<MigrationStatus> = None;
        for line in BufReader::new(r.into_reader()).lines() {
            let line = line.map_err(|e| ClientError::Unreachable {
                daemon: self.daemon,
                base: self.base.clone(),
                detail: format!("event stream broke: {e}"),
            })?;
            if line.trim().is_empty() {
                continue;
            }
            let s: MigrationStatus =
                serde_json::from_str(&line).map_err(|e| ClientError::Decode {
                    path: path.clone(),
                    detail: e.to_string(),
                })?;
            each(&s);
            let done = s.phase.is_terminal();
            last = Some(s);
            if done {
                break;
            }
        }
        match last {
            Some(s) if s.phase.is_terminal() => Ok(s),
            // The stream ended early (daemon restarting?): ask once more.
            _ => self.migration(id),
        }
    }

    /// The volumes a `ferry host` agent forwards (this client pointed at
    /// its control address).
    pub fn host_volumes(&self) -> Result<Vec<AttachedVolume>> {
        self.get("/v1/volumes")
    }

    /// Ask a `ferry host` agent to forward a volume.
    pub fn host_attach(&self, volume: &str, server: &str) -> Result<AttachedVolume> {
        self.post(
            "/v1/volumes",
            &AttachRequest {
                volume: volume.into(),
                server: server.into(),
            },
        )
    }

    /// Ask a `ferry host` agent to stop offering a volume.
    pub fn host_detach(&self, volume: &str) -> Result<()> {
        self.delete(&format!("/v1/volumes/{volume}"))
    }

    /// The guests a `ferry host` runs (this client pointed at its control
    /// address).
    pub fn vms(&self) -> Result<Vec<VmView>> {
        self.get("/v1/vms")
    }

    /// Define a guest on a host (and start it unless `start` is false).
    pub fn create_vm(&self, spec: &VmSpec, start: bool) -> Result<VmView> {
        self.post(
            "/v1/vms",
            &CreateVm {
                spec: spec.clone(),
                start,
            },
        )
    }

    pub fn vm(&self, name: &str) -> Result<VmView> {
        self.get(&format!("/v1/vms/{name}"))
    }

    /// Change a defined guest where it is safe ([`crate::UpdateVm`]).
    pub fn set_vm(&self, name: &str, update: &crate::UpdateVm) -> Result<VmView> {
        self.post(&format!("/v1/vms/{name}/set"), update)
    }

    pub fn start_vm(&self, name: &str) -> Result<VmView> {
        self.post(&format!("/v1/vms/{name}/start"), &serde_json::Value::Null)
    }

    pub fn stop_vm(&self, name: &str) -> Result<VmView> {
        self.post(&format!("/v1/vms/{name}/stop"), &serde_json::Value::Null)
    }

    pub fn delete_vm(&self, name: &str) -> Result<()> {
        self.delete(&format!("/v1/vms/{name}"))
    }

    /// Start moving a guest (answers at once; follow with [`Self::vm_move`]).
    pub fn migrate_vm(&self, name: &str, req: &VmMigrateRequest) -> Result<VmMoveStatus> {
        self.post(&format!("/v1/vms/{name}/migrate"), req)
    }

    /// Fingerprints of `blocks` blocks spread over volume `name`.
    pub fn sample_volume(&self, name: &str, blocks: u64) -> Result<crate::VolumeSample> {
        self.post(
            &format!("/v1/volumes/{name}/sample"),
            &crate::SampleRequest { blocks },
        )
    }

    /// How many of `fingerprints` (hex) this daemon's index holds, and
    /// whether it holds the copy volume `copy_of` left when it moved away.
    pub fn index_lookup(
        &self,
        fingerprints: &[String],
        copy_of: Option<&crate::VolumeIdentity>,
    ) -> Result<crate::LookupAnswer> {
        self.post(
            "/v1/index/lookup",
            &crate::LookupRequest {
                fingerprints: fingerprints.to_vec(),
                copy_of: copy_of.cloned(),
            },
        )
    }

    /// Round trips from this host to another host's move listener.
    pub fn probe(&self, to: &str, count: u32) -> Result<crate::vm::LinkProbe> {
        self.probe_with_bandwidth(to, count, 0, 1.0)
    }

    /// Round trips, then a bulk transfer of at most `bytes` for at most
    /// `secs` to measure the link's bandwidth.
    pub fn probe_with_bandwidth(
        &self,
        to: &str,
        count: u32,
        bytes: u64,
        secs: f64,
    ) -> Result<crate::vm::LinkProbe> {
        self.post(
            "/v1/probe",
            &crate::vm::ProbeRequest {
                to: to.into(),
                count,
                bandwidth_bytes: bytes,
                bandwidth_secs: secs,
            },
        )
    }

    pub fn vm_moves(&self) -> Result<Vec<VmMoveStatus>> {
        self.get("/v1/vm-moves")
    }

    pub fn vm_move(&self, id: &MigrationId) -> Result<VmMoveStatus> {
        self.get(&format!("/v1/vm-moves/{id}"))
    }

    /// Stop a move before its point of no return (the guest stays).
    pub fn cancel_vm_move(&self, id: &MigrationId) -> Result<VmMoveStatus> {
        self.post(
            &format!("/v1/vm-moves/{id}/cancel"),
            &serde_json::Value::Null,
        )
    }
}

/// Whether a listener at `addr` (`HOST:PORT`, any address it resolves to)
/// accepts a TCP connection within `within`: the liveness probe for a
/// daemon that may have died (a gateway holding a volume, a storage
/// daemon a move could go to).
pub fn accepts_connections(addr: &str, within: std::time::Duration) -> bool {
    use std::net::ToSocketAddrs;
    addr.to_socket_addrs()
        .is_ok_and(|mut a| a.any(|sa| std::net::TcpStream::connect_timeout(&sa, within).is_ok()))
}
