//! Guests on a VM host and their moves between hosts.
//!
//! A [`VmHost`] runs QEMU guests whose disks it reaches through the host's
//! forwarder (`ferry_forwarder::Agent`: one stable NBD export per volume that
//! follows the volume when it migrates). It keeps each guest's spec under
//! its state directory and finds its QEMU processes again after a restart.
//! It moves guests to another host ([`moves`]): memory by QEMU's live
//! migration tunnelled through ferry's mutually authenticated TLS
//! ([`tunnel`], [`peer`]), disks by ferry's own migration, the two ordered
//! so that the guest pauses once (the teleport); [`move_order`] is the
//! memory copy's order, pure, which `moves` carries out. [`converge`] decides what
//! to do when a move does not converge; [`dirty_rate`] measures how fast
//! each guest dirties its memory and [`memory_sample`] how much of it a
//! move would send, for the controller.

pub mod api;
pub mod confine;
pub mod converge;
pub mod daemon;
pub mod dirty_rate;
pub mod fault;
pub mod gateways;
pub mod guest;
pub mod host;
pub mod incoming;
pub mod memory_sample;
pub mod move_order;
pub mod moves;
pub mod network;
pub mod peer;
pub mod qemu;
pub mod recover;
pub mod seed;
pub mod tunnel;

pub use host::VmHost;

mod error;
pub use error::{PeerFault, QemuFault, VmError};
