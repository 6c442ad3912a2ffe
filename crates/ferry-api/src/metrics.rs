//! The names of the metrics `ferry host` exports for its guests, as
//! Prometheus stores them: the host registers them, the controller's
//! PromQL and the dashboards query them, from these constants only.
//! Counters end in `_total` (the host registers them without it; the
//! exposition adds it).

/// Gauge, 1 for the guest's current state; labels `vm`, `state`, `accel`.
pub const VM_STATE: &str = "ferry_vm_state";
/// Counter: CPU seconds of the guest's QEMU; label `vm`.
pub const VM_CPU_SECONDS_TOTAL: &str = "ferry_vm_cpu_seconds_total";
/// Gauge: guest RAM resident in QEMU; label `vm`.
pub const VM_MEMORY_RESIDENT_BYTES: &str = "ferry_vm_memory_resident_bytes";
/// Gauge: guest RAM dirtied per second (QEMU's estimate); label `vm`.
pub const VM_MEMORY_DIRTY_BYTES_PER_SECOND: &str = "ferry_vm_memory_dirty_bytes_per_second";
/// Gauge: link bytes a memory move would send per resident byte; label `vm`.
pub const VM_MEMORY_LINK_SHARE: &str = "ferry_vm_memory_link_share";
/// Counter: disk requests; labels `vm`, `volume`, `op`.
pub const VM_DISK_REQUESTS_TOTAL: &str = "ferry_vm_disk_requests_total";
/// Counter: disk bytes; labels `vm`, `volume`, `dir` (`read`, `write`).
pub const VM_DISK_BYTES_TOTAL: &str = "ferry_vm_disk_bytes_total";
/// Counter: bytes through a guest's network card (its tap); labels `vm`,
/// `network`, `mac`, `dir` (`to_guest`, `from_guest`).
pub const VM_NETWORK_BYTES_TOTAL: &str = "ferry_vm_network_bytes_total";
/// Counter: packets through a guest's network card; labels as
/// `VM_NETWORK_BYTES_TOTAL`.
pub const VM_NETWORK_PACKETS_TOTAL: &str = "ferry_vm_network_packets_total";
/// Counter: disk requests answered with an error; labels `vm`, `volume`.
pub const VM_DISK_ERRORS_TOTAL: &str = "ferry_vm_disk_errors_total";
/// Histogram (seconds): a request's arrival at the forwarder to its
/// answer; labels `vm`, `volume`. Series `_sum`, `_count`, `_bucket`.
pub const VM_DISK_LATENCY_SECONDS: &str = "ferry_vm_disk_latency_seconds";
