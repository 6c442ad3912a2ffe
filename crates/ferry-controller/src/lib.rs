//! The placement controller as a service (`ferry control run`): every
//! cycle it measures the sites' guests through their hosts, plans with
//! `ferry-placement`'s policies (the same code `ferry control plan` and the
//! simulator run), journals each decision, and, unless automation is
//! paused, carries the moves out through the hosts' move API and journals
//! how each ended beside its prediction.
//!
//! - [`measure`]: hosts' counters read twice, turned into a snapshot.
//! - [`act`]: one decision carried out and followed to its end.
//! - [`client`]: the typed client of the API (`ferry control`, `ferry site`).
//! - [`journal`]: the durable record of decisions and moves; the moves a
//!   restarted controller must follow.
//! - [`settings`]: inventory, policy and the automation switch, on disk.
//! - [`service`]: the cycle thread, the HTTP API, `/metrics`, the page.
//!
//! - [`store`]: where settings and journal live: one directory, or etcd.
//! - [`etcd`], [`leader`]: the etcd client and the election of the one
//!   controller that acts when several share the state in etcd.
//!
//! State lives in one directory by default (no other service needed);
//! with `--etcd`, in etcd, where several controllers elect one leader.

pub mod act;
pub mod client;
pub mod etcd;
pub mod journal;
pub mod leader;
pub mod measure;
pub mod prometheus;
pub mod service;
pub mod settings;
pub mod store;

/// What can go wrong for the controller, as its API answers it.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("{0}")]
    BadInput(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    NotFound(String),
    #[error("controller state: {0}")]
    State(String),
}
