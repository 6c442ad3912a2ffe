//! Placement of VMs and their disks across sites: the first bricks of
//! `ferry control` (issue 11). No I/O here: a [`Cluster`] snapshot in
//! (sites, links, VMs with their measured load and placement), predictions
//! and decisions out, so the very same code is run by the daemon, by
//! `ferry control plan` on a snapshot file, and by the simulator.
//!
//! - [`model`]: the cost model, stated in docs/placement-model.md: what a
//!   VM loses to a remote disk over a horizon, and what each move costs
//!   (time, bytes, pause).
//! - [`policy`]: locality (move compute to data or data to compute when the
//!   gain beats the cost by a margin), thresholds with hysteresis, limits
//!   (moves in flight per link, cooldown, minimum stay, paused automation).
//! - [`estimate`]: the pre-flight estimate of one named move, or of
//!   staying behind a link of another RTT (`ferry control estimate`).
//! - [`simulate`]: a simulated cluster with load traces, stepped through the
//!   policies.

pub mod backoff;
pub mod cluster;
pub mod cycle;
pub mod estimate;
#[cfg(test)]
mod fixtures;
pub mod inventory;
pub mod model;
pub mod policy;
pub mod reason;
pub mod replay;
pub mod simulate;

pub use cluster::{ClientTraffic, Cluster, Link, Placement, Site, VmLoad, VmState};
