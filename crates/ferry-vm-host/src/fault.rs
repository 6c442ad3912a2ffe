//! Named points in a move where a test can hold this daemon for a while,
//! to kill a participant at an exact phase (the kill matrix of
//! `ferry-cli/tests/vm.rs`). Built on `fail` (TiKV's fail points); only a
//! build with the `failpoints` feature has them, set through
//! `PUT /v1/failpoints/NAME` with a `fail` action such as
//! `1*return(4000)` (hold 4 s, once). Elsewhere [`hold`] does nothing.

use std::time::Duration;

/// The disk pre-copy of a teleport has begun (storage migrations running).
pub const DISK_PRECOPY: &str = "move.disk_precopy";
/// QEMU has sent a teleport's guest and its disks' switch is released
/// (switched, where the destination does not learn of it itself); it is
/// stopped at the source and the destination has not been told to run it
/// (its `Finish` not sent).
pub const SWITCHOVER: &str = "move.switchover";
/// QEMU finished sending the guest: it is paused here and may run there;
/// the destination has not yet confirmed it.
pub const FINISH: &str = "move.finish";
/// The destination confirmed it runs the guest; this host has not yet
/// dropped its copy.
pub const SWITCHED: &str = "move.switched";

/// Every point, for the route that sets them.
pub const ALL: [&str; 4] = [DISK_PRECOPY, SWITCHOVER, FINISH, SWITCHED];

/// How long the point `name` holds, if a test set it.
fn hold_for(name: &str) -> Option<Duration> {
    let _ = name;
    fail::fail_point!(name, |arg: Option<String>| arg
        .and_then(|a| a.parse().ok())
        .map(Duration::from_millis));
    None
}

/// Wait here as long as a test asked (nothing in a release build).
pub async fn hold(name: &str) {
    if let Some(d) = hold_for(name) {
        tracing::warn!(
            point = name,
            ms = d.as_millis(),
            "fail point: holding the move"
        );
        tokio::time::sleep(d).await;
    }
}

/// Set point `name` to the `fail` action `actions` (test builds).
#[cfg(feature = "failpoints")]
pub fn set(name: &str, actions: &str) -> Result<(), String> {
    if !ALL.contains(&name) {
        return Err(format!("no fail point named {name} (known: {ALL:?})"));
    }
    fail::cfg(name, actions)
}
