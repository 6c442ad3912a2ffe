//! A host's, controller's or storage daemon's state file
//! (`ferry-state-file`: a guest's spec, a move record, the controller's
//! settings, a pool's rebuild rate and small moves' set-up, a host's
//! move measures) read back after damage: loading never panics, whatever
//! loads saves and loads again to the same value, a rate read from any
//! file is absent or positive and finite, a fixed cost absent or finite
//! and not negative, and a kept pause positive and finite with a finite
//! round trip and memory.
#![no_main]

use ferry_server::rebuild_rate::RebuildRate;
use ferry_state_file::rate_log::{PauseLog, RateLog, SecondsLog};
use ferry_state_file::{load, save, Kind};
use ferry_vm_host::guest::files;
use libfuzzer_sys::fuzz_target;

const ANY: Kind = Kind {
    format: "ferry-vm-spec",
    version: 1,
    max_bytes: 1 << 16,
};

fuzz_target!(|data: &[u8]| {
    let dir = std::env::temp_dir().join(format!("ferry-fuzz-state-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join("state.json");
    if std::fs::write(&path, data).is_err() {
        return;
    }
    // A guest's spec, as the host reads it at start.
    let _ = load::<ferry_api::VmSpec>(&path, files::SPEC);
    // A pool's rebuild rate, as the storage daemon reads it at start.
    if let Some(bps) = RebuildRate::open(path.clone()).bytes_per_second() {
        assert!(bps.is_finite() && bps > 0.0, "{bps}");
    }
    // A host's memory stream rate and move set-up, as the host reads them.
    if let Some(bps) = RateLog::open(path.clone(), files::STREAM_RATE, "fuzz").bytes_per_second() {
        assert!(bps.is_finite() && bps > 0.0, "{bps}");
    }
    if let Some(s) = SecondsLog::open(path.clone(), files::SETUP_COST, "fuzz").median() {
        assert!(s.is_finite() && s >= 0.0, "{s}");
    }
    // A host's part of its disk moves, as the host tells it.
    for s in SecondsLog::open(path.clone(), files::DISK_MOVE_HOST, "fuzz").values() {
        assert!(s.is_finite() && s >= 0.0, "{s}");
    }
    // A pool's small moves' fixed work, as the storage daemon tells it.
    for s in ferry_server::move_setup::MoveSetup::open(path.clone()).kept() {
        assert!(s.is_finite() && s >= 0.0, "{s}");
    }
    for p in PauseLog::open(path.clone(), files::PAUSES, "fuzz").recent() {
        assert!(p.pause_s.is_finite() && p.pause_s > 0.0, "{p:?}");
        assert!(p.rtt_s.is_finite() && p.rtt_s >= 0.0, "{p:?}");
        assert!(p.memory_bytes > 0, "{p:?}");
    }
    // Any JSON under the envelope: what loads round-trips.
    if let Ok(Some(v)) = load::<serde_json::Value>(&path, ANY) {
        save(&path, ANY, &v).expect("a loaded state saves");
        let again: serde_json::Value = load(&path, ANY).expect("saved loads").expect("present");
        assert_eq!(again, v);
    }
});
