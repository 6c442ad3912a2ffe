//! What two VM hosts say to each other over their mutually authenticated
//! TLS link (no I/O here: bytes in, messages out). Each connection opens
//! with one request line (JSON, at most [`MAX_LINE`] bytes) and gets one
//! answer line; a `Stream` connection then carries QEMU's migration stream
//! in [`Frame`]s, compressed or not, and acknowledgements the other way
//! (the sender keeps at most a window of unacknowledged bytes on the
//! link, so QEMU measures the link's real rate, not a buffer's).
//!
//! Protocol version [`PEER_VERSION`], carried by `Check` and `Prepare`
//! (the first requests of a move); a host answers a request of another
//! version with an error naming both, before anything is copied. One move,
//! each arrow a connection (request line, answer line):
//!
//! ```text
//!  source host                                      destination host
//!    | Check {version, spec, disks} ------------------>|  admissible? no side effect
//!    |   (teleport: the disks' pre-copy runs meanwhile) |
//!    | Prepare {version, id, spec, disks, ...} ------->|  disks attached (pending ones
//!    |                                                  |  offered, not connected), QEMU
//!    |                                                  |  waiting (-incoming), marked
//!    | Stream {id} + frames (one per QEMU channel) ---->|  QEMU's migration stream
//!    |   ... QEMU pauses before the switchover (teleport: the disks'
//!    |   switch is released and QEMU goes on at once, both under way)
//!    |   ... QEMU sends the device state, completes
//!    | Finish {id, disks} ----------------------------->|  each pending disk: waits for
//!    |                                                  |  its site's storage to commit
//!    |                                                  |  it (its `arrival`), or where
//!    |                                                  |  `disks` says it switched;
//!    |                                                  |  connected, marked arrived,
//!    |                                                  |  `cont`;
//!    |<------------------ {ok, control, resumed, ...}   |  answered once it runs
//!    | Abort {id} (any time before Finish's answer) --->|  QEMU stopped, forgotten
//! ```
//!
//! A pending disk with an `arrival` (the source knew the destination
//! storage's admin API) is learnt of at the destination, from its own
//! site's storage daemon: `Finish` goes as soon as QEMU has sent the guest,
//! and the disk's commit reaches the destination host a one-way trip
//! before it could reach the source and come back. One without is placed
//! by `Finish` once the source has seen it switch (and a source may always
//! place a disk itself: after post-copy it does).
//!
//! The destination keeps each arriving move's [`ArrivalOrder`] and refuses
//! a request out of it: a `Stream` after `Finish`, a `Finish` that does not
//! say where a pending disk without an arrival switched (the guest would
//! run without its disk), or names a disk the move did not bring. `Finish`
//! asked again (the source lost the answer) is answered again.

use ferry_api::{MigrationId, VmSpec};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The version of this protocol; a host refuses a move in another.
pub const PEER_VERSION: u32 = 4;

/// The longest request or answer line.
pub const MAX_LINE: usize = 1 << 20;
/// The most raw bytes one frame carries.
pub const MAX_FRAME: usize = 1 << 20;
/// Frame header: kind (1), raw length (4), encoded length (4).
pub const FRAME_HEADER: usize = 9;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum PeerError {
    #[error("peer line longer than {MAX_LINE} bytes")]
    LineTooLong,
    #[error("peer line is not a known request or answer: {0}")]
    Decode(String),
    #[error("frame kind {0} is unknown")]
    FrameKind(u8),
    #[error("frame of {0} bytes is larger than {MAX_FRAME}")]
    FrameTooLarge(usize),
    #[error("frame does not decompress to its stated length: {0}")]
    Corrupt(String),
}

/// How the destination reaches a disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IncomingDisk {
    pub volume: String,
    pub server: String,
    /// The disk is still on its way: offer it as `size` bytes and connect
    /// only when told where it landed (teleport).
    pub pending: bool,
    pub size: u64,
    pub flags: u16,
    /// A pending disk's migration, and its destination storage's admin
    /// API: the destination asks that daemon when the disk has switched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arrival: Option<DiskArrival>,
}

/// Where the destination host learns that a pending disk has switched.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskArrival {
    /// The disk's storage migration.
    pub migration: MigrationId,
    /// The admin API of the storage daemon it migrates to (this site's).
    pub admin: String,
}

/// Where a teleport's disk is after its migration switched it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SwitchedDisk {
    pub volume: String,
    /// Its NBD `HOST:PORT` now.
    pub server: String,
    /// Its admin API, where known: the guest's spec records it, so the
    /// disk's next move starts there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin: Option<String>,
}

/// The first line of every connection between hosts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum PeerRequest {
    /// Get ready to receive a guest: attach its disks, start QEMU waiting.
    Prepare {
        /// [`PEER_VERSION`] of the source (absent: before versions, 1).
        #[serde(default = "version_one")]
        version: u32,
        id: MigrationId,
        spec: VmSpec,
        disks: Vec<IncomingDisk>,
        postcopy: bool,
        /// Parallel memory channels (QEMU multifd), 0 for none.
        #[serde(default)]
        multifd: u8,
    },
    /// Could this host take the guest? The checks of `Prepare`, with no
    /// side effect: asked before a teleport copies any disk byte.
    Check {
        #[serde(default = "version_one")]
        version: u32,
        spec: VmSpec,
        disks: Vec<IncomingDisk>,
    },
    /// This connection carries one channel of QEMU's migration stream.
    Stream { id: MigrationId, compress: bool },
    /// The source finished sending (and a teleport's disks switched):
    /// connect the pending disks where they are now, run the guest, and
    /// answer once it runs.
    Finish {
        id: MigrationId,
        /// A teleport's disks, where their migrations switched them.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        disks: Vec<SwitchedDisk>,
    },
    /// The move is off: stop the waiting guest and forget it.
    Abort { id: MigrationId },
    /// Answer at once: a round-trip probe between hosts.
    Ping,
    /// A bandwidth probe: frames follow (a 4-byte big-endian length, then
    /// that many bytes; at most [`SINK_FRAME_MAX`] each), up to an empty
    /// one; answer with how many bytes came. At most [`SINK_MAX`] in all.
    Sink,
}

fn version_one() -> u32 {
    1
}

/// A request of another protocol version, refused with both named.
pub fn check_version(theirs: u32) -> Result<(), String> {
    if theirs == PEER_VERSION {
        Ok(())
    } else {
        Err(format!(
            "the source host speaks VM move protocol version {theirs}, this host {PEER_VERSION}: run the same ferry on both"
        ))
    }
}

/// Where one arriving move stands at the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// Prepared; QEMU waits for the stream.
    Waiting,
    /// `Finish` came: the guest runs here (or was tried).
    Finished,
    Aborted,
}

/// A request out of a move's order, refused by the destination.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum OrderError {
    #[error("{request} for a move that is {state}")]
    OutOfOrder {
        request: &'static str,
        state: &'static str,
    },
    #[error("Finish while disk(s) {0} have not switched: the guest would run without them")]
    DisksPending(String),
    #[error("Finish names disk {0}, which this move did not bring")]
    UnknownDisk(String),
}

/// The order the destination holds one move to (see the module's
/// diagram); no I/O. `Check` and `Ping` are outside any move.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArrivalOrder {
    state: Arrival,
    /// Pending disks (a teleport's) without an arrival: `Finish` must say
    /// where each went.
    pending: std::collections::BTreeSet<String>,
    /// Pending disks learnt of here, unless `Finish` places them.
    arrivals: std::collections::BTreeMap<String, DiskArrival>,
    /// Every disk the move brings.
    disks: std::collections::BTreeSet<String>,
}

impl ArrivalOrder {
    /// A move prepared with `disks`, the pending ones to be placed by
    /// `Finish`.
    pub fn new(disks: &[IncomingDisk]) -> ArrivalOrder {
        ArrivalOrder {
            state: Arrival::Waiting,
            pending: disks
                .iter()
                .filter(|d| d.pending && d.arrival.is_none())
                .map(|d| d.volume.clone())
                .collect(),
            arrivals: disks
                .iter()
                .filter(|d| d.pending)
                .filter_map(|d| Some((d.volume.clone(), d.arrival.clone()?)))
                .collect(),
            disks: disks.iter().map(|d| d.volume.clone()).collect(),
        }
    }

    pub fn state(&self) -> Arrival {
        self.state
    }

    /// The pending disks `placed` (a `Finish`'s) leaves to be learnt of
    /// here, each with where to ask.
    pub fn awaited(&self, placed: &[SwitchedDisk]) -> Vec<(String, DiskArrival)> {
        self.arrivals
            .iter()
            .filter(|(v, _)| !placed.iter().any(|d| &d.volume == *v))
            .map(|(v, a)| (v.clone(), a.clone()))
            .collect()
    }

    fn state_name(&self) -> &'static str {
        match self.state {
            Arrival::Waiting => "waiting for its guest",
            Arrival::Finished => "finished",
            Arrival::Aborted => "aborted",
        }
    }

    /// Take `req` in this move's order, or say why not.
    pub fn accept(&mut self, req: &PeerRequest) -> Result<(), OrderError> {
        let out = |request, me: &Self| OrderError::OutOfOrder {
            request,
            state: me.state_name(),
        };
        match req {
            PeerRequest::Prepare { .. } if self.state == Arrival::Waiting => Ok(()),
            PeerRequest::Prepare { .. } => Err(out("Prepare", self)),
            PeerRequest::Stream { .. } if self.state == Arrival::Waiting => Ok(()),
            PeerRequest::Stream { .. } => Err(out("Stream", self)),
            PeerRequest::Finish { disks, .. } => match self.state {
                Arrival::Aborted => Err(out("Finish", self)),
                Arrival::Finished => Ok(()),
                Arrival::Waiting => {
                    if let Some(d) = disks.iter().find(|d| !self.disks.contains(&d.volume)) {
                        return Err(OrderError::UnknownDisk(d.volume.clone()));
                    }
                    let unplaced: Vec<&str> = self
                        .pending
                        .iter()
                        .filter(|v| !disks.iter().any(|d| &d.volume == *v))
                        .map(String::as_str)
                        .collect();
                    if !unplaced.is_empty() {
                        return Err(OrderError::DisksPending(unplaced.join(", ")));
                    }
                    self.state = Arrival::Finished;
                    Ok(())
                }
            },
            PeerRequest::Abort { .. } => {
                if self.state == Arrival::Waiting {
                    self.state = Arrival::Aborted;
                }
                Ok(())
            }
            PeerRequest::Check { .. } | PeerRequest::Ping | PeerRequest::Sink => Ok(()),
        }
    }
}

/// The largest frame of a bandwidth probe.
pub const SINK_FRAME_MAX: u32 = 1 << 20;
/// The most bytes one bandwidth probe may send.
pub const SINK_MAX: u64 = 64 << 20;

/// The answer line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerAnswer {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// After `Finish`: this host's control API, where `ferry vm` reaches
    /// the guest now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control: Option<String>,
    /// After `Finish`: QEMU's run state at the destination.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
    /// After `Finish`: when the guest's first disk request was answered
    /// at the destination (unix ms), if it made one yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_io_unix_ms: Option<u64>,
    /// After `Finish`: QEMU's RESUME event here (unix seconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_unix_s: Option<f64>,
    /// After `Finish`: the guest arrived here (it may have run), whatever
    /// runs now; a source must not resume its own copy then.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub arrived: bool,
    /// After `Sink`: the bytes received.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub received: Option<u64>,
}

impl PeerAnswer {
    pub fn ok() -> PeerAnswer {
        PeerAnswer {
            ok: true,
            control: None,
            error: None,
            status: None,
            first_io_unix_ms: None,
            resumed_unix_s: None,
            arrived: false,
            received: None,
        }
    }
    pub fn err(e: impl Into<String>) -> PeerAnswer {
        PeerAnswer {
            ok: false,
            control: None,
            error: Some(e.into()),
            status: None,
            first_io_unix_ms: None,
            resumed_unix_s: None,
            arrived: false,
            received: None,
        }
    }
}

/// One JSON line, newline-terminated.
pub fn encode_line<T: Serialize>(m: &T) -> Vec<u8> {
    let mut v = serde_json::to_vec(m).unwrap_or_default();
    v.push(b'\n');
    v
}

/// Take one complete line off `buf` and decode it; `Ok(None)` until the
/// newline has arrived.
pub fn decode_line<T: for<'de> Deserialize<'de>>(
    buf: &mut Vec<u8>,
) -> Result<Option<T>, PeerError> {
    let Some(nl) = buf.iter().position(|b| *b == b'\n') else {
        if buf.len() > MAX_LINE {
            return Err(PeerError::LineTooLong);
        }
        return Ok(None);
    };
    if nl > MAX_LINE {
        return Err(PeerError::LineTooLong);
    }
    let line: Vec<u8> = buf.drain(..=nl).collect();
    serde_json::from_slice(&line[..nl])
        .map(Some)
        .map_err(|e| PeerError::Decode(e.to_string()))
}

/// What one frame on a stream connection carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Stream bytes (decompressed).
    Data(Vec<u8>),
    /// The receiver delivered this many more link bytes to its QEMU: the
    /// sender's window opens by as much.
    Ack(u64),
}

const KIND_RAW: u8 = 0;
const KIND_ZSTD: u8 = 1;
const KIND_ACK: u8 = 2;

/// Encode `raw` (at most [`MAX_FRAME`] bytes), compressed when that makes
/// it smaller.
pub fn encode_frame(raw: &[u8], compress: bool, out: &mut Vec<u8>) {
    let len = u32::try_from(raw.len().min(MAX_FRAME)).unwrap_or(0);
    if compress {
        if let Ok(z) = zstd::bulk::compress(raw, 1) {
            if z.len() < raw.len() {
                out.push(KIND_ZSTD);
                out.extend_from_slice(&len.to_be_bytes());
                out.extend_from_slice(&u32::try_from(z.len()).unwrap_or(0).to_be_bytes());
                out.extend_from_slice(&z);
                return;
            }
        }
    }
    out.push(KIND_RAW);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(raw);
}

/// Encode an acknowledgement of `bytes` link bytes (at most `u32::MAX`).
pub fn encode_ack(bytes: u32, out: &mut Vec<u8>) {
    out.push(KIND_ACK);
    out.extend_from_slice(&bytes.to_be_bytes());
    out.extend_from_slice(&0u32.to_be_bytes());
}

/// Take one whole frame off the front of `buf`; `Ok(None)` until it has
/// arrived. Data frames also answer their size on the link.
pub fn decode_frame(buf: &mut Vec<u8>) -> Result<Option<(Frame, usize)>, PeerError> {
    if buf.len() < FRAME_HEADER {
        return Ok(None);
    }
    let kind = buf[0];
    let be = |i: usize| u32::from_be_bytes([buf[i], buf[i + 1], buf[i + 2], buf[i + 3]]);
    if kind == KIND_ACK {
        let n = u64::from(be(1));
        if be(5) != 0 {
            return Err(PeerError::Corrupt("ack frame with a body".into()));
        }
        buf.drain(..FRAME_HEADER);
        return Ok(Some((Frame::Ack(n), FRAME_HEADER)));
    }
    let raw_len = usize::try_from(be(1)).unwrap_or(usize::MAX);
    let enc_len = usize::try_from(be(5)).unwrap_or(usize::MAX);
    if raw_len > MAX_FRAME {
        return Err(PeerError::FrameTooLarge(raw_len));
    }
    if enc_len > MAX_FRAME + 1024 {
        return Err(PeerError::FrameTooLarge(enc_len));
    }
    match kind {
        KIND_RAW if enc_len != raw_len => {
            return Err(PeerError::Corrupt("raw frame lengths differ".into()))
        }
        KIND_RAW | KIND_ZSTD => {}
        k => return Err(PeerError::FrameKind(k)),
    }
    if buf.len() < FRAME_HEADER + enc_len {
        return Ok(None);
    }
    let size = FRAME_HEADER + enc_len;
    let body: Vec<u8> = buf.drain(..size).skip(FRAME_HEADER).collect();
    if kind == KIND_RAW {
        return Ok(Some((Frame::Data(body), size)));
    }
    let raw =
        zstd::bulk::decompress(&body, raw_len).map_err(|e| PeerError::Corrupt(e.to_string()))?;
    if raw.len() != raw_len {
        return Err(PeerError::Corrupt(format!(
            "{} bytes instead of {raw_len}",
            raw.len()
        )));
    }
    Ok(Some((Frame::Data(raw), size)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(volume: &str, pending: bool) -> IncomingDisk {
        IncomingDisk {
            volume: volume.into(),
            server: "127.0.0.1:1".into(),
            pending,
            size: 1 << 20,
            flags: 0,
            arrival: None,
        }
    }

    #[test]
    fn a_pending_disk_with_an_arrival_is_learnt_of_here_unless_finish_places_it() {
        let id = MigrationId::random();
        let arriving = |v: &str| IncomingDisk {
            arrival: Some(DiskArrival {
                migration: MigrationId::random(),
                admin: "127.0.0.1:2".into(),
            }),
            ..disk(v, true)
        };
        let placed = |vols: &[&str]| -> Vec<SwitchedDisk> {
            vols.iter()
                .map(|v| SwitchedDisk {
                    volume: (*v).into(),
                    server: "h:1".into(),
                    admin: None,
                })
                .collect()
        };
        let o = ArrivalOrder::new(&[arriving("root"), disk("home", true), disk("data", false)]);
        let waits: Vec<String> = o.awaited(&[]).into_iter().map(|(v, _)| v).collect();
        assert_eq!(waits, ["root"], "only a pending disk with an arrival");
        assert!(o.awaited(&placed(&["root"])).is_empty(), "Finish placed it");
        let mut o = o;
        // The one without an arrival must still be placed by Finish.
        let e = o.accept(&PeerRequest::Finish {
            id: id.clone(),
            disks: Vec::new(),
        });
        assert_eq!(e, Err(OrderError::DisksPending("home".into())));
        o.accept(&PeerRequest::Finish {
            id,
            disks: placed(&["home"]),
        })
        .unwrap();
        assert_eq!(o.state(), Arrival::Finished);
    }

    #[test]
    fn the_destination_refuses_requests_out_of_a_moves_order() {
        let id = MigrationId::random();
        let finish_with = |vols: &[&str]| PeerRequest::Finish {
            id: id.clone(),
            disks: vols
                .iter()
                .map(|v| SwitchedDisk {
                    volume: (*v).into(),
                    server: "h:1".into(),
                    admin: None,
                })
                .collect(),
        };
        let finish = finish_with(&[]);
        let stream = PeerRequest::Stream {
            id: id.clone(),
            compress: true,
        };
        let mut o =
            ArrivalOrder::new(&[disk("root", true), disk("home", true), disk("data", false)]);
        o.accept(&stream).unwrap();
        assert_eq!(
            o.accept(&finish),
            Err(OrderError::DisksPending("home, root".into())),
            "a teleport's guest never runs before its disks switched"
        );
        assert_eq!(
            o.accept(&finish_with(&["root"])),
            Err(OrderError::DisksPending("home".into())),
            "every pending disk is placed"
        );
        assert_eq!(
            o.accept(&finish_with(&["root", "home", "swap"])),
            Err(OrderError::UnknownDisk("swap".into()))
        );
        assert_eq!(
            o.state(),
            Arrival::Waiting,
            "a refused Finish changes nothing"
        );
        o.accept(&finish_with(&["root", "home", "data"])).unwrap();
        assert_eq!(o.state(), Arrival::Finished);
        // Asked again (the source lost the answer): answered again.
        o.accept(&finish).unwrap();
        assert!(
            matches!(o.accept(&stream), Err(OrderError::OutOfOrder { .. })),
            "no stream after Finish"
        );
        // A VM-only move has no pending disk; an aborted move is over.
        let mut vm = ArrivalOrder::new(&[disk("root", false)]);
        vm.accept(&PeerRequest::Abort { id: id.clone() }).unwrap();
        let e = vm.accept(&finish).unwrap_err();
        assert_eq!(e.to_string(), "Finish for a move that is aborted");
    }

    #[test]
    fn a_request_of_another_version_is_refused_naming_both() {
        let spec = VmSpec {
            name: "g".into(),
            memory_mib: 64,
            vcpus: 1,
            disks: vec![],
            boot: ferry_api::Boot::Disk,
            accel: ferry_api::Accel::Auto,
            nics: Vec::new(),
            cloud_init: None,
        };
        let check = PeerRequest::Check {
            version: PEER_VERSION,
            spec,
            disks: vec![],
        };
        // The same request as a host from before versions writes it.
        let mut old: serde_json::Value = serde_json::to_value(&check).unwrap();
        old.as_object_mut().unwrap().remove("version");
        let mut buf = encode_line(&old);
        let Some(PeerRequest::Check { version, .. }) =
            decode_line::<PeerRequest>(&mut buf).unwrap()
        else {
            panic!("not a check");
        };
        assert_eq!(version, 1, "a request from before versions reads as 1");
        let e = check_version(version).unwrap_err();
        assert!(
            e.contains("version 1,") && e.contains(&format!("this host {PEER_VERSION}")),
            "{e}"
        );
        let mut buf = encode_line(&check);
        assert_eq!(decode_line::<PeerRequest>(&mut buf).unwrap(), Some(check));
        assert!(check_version(PEER_VERSION).is_ok());
    }

    #[test]
    fn frames_round_trip_compressed_or_not() {
        let zeros = vec![0u8; 200_000];
        let noise: Vec<u8> = (0..5000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13).to_le_bytes()[0])
            .collect();
        let mut wire = Vec::new();
        encode_frame(&zeros, true, &mut wire);
        assert!(wire.len() < 1000, "zeros compress");
        encode_frame(&noise, true, &mut wire);
        encode_frame(b"plain", false, &mut wire);
        encode_ack(77, &mut wire);
        let mut got = Vec::new();
        // Byte by byte: partial frames wait.
        let mut buf = Vec::new();
        for b in wire {
            buf.push(b);
            while let Some((f, _)) = decode_frame(&mut buf).unwrap() {
                got.push(f);
            }
        }
        assert_eq!(
            got,
            vec![
                Frame::Data(zeros),
                Frame::Data(noise),
                Frame::Data(b"plain".to_vec()),
                Frame::Ack(77)
            ]
        );
    }

    #[test]
    fn bad_frames_are_refused() {
        let mut b = vec![7, 0, 0, 0, 1, 0, 0, 0, 1, 0];
        assert_eq!(decode_frame(&mut b), Err(PeerError::FrameKind(7)));
        let mut b = vec![0, 0xff, 0, 0, 0, 0xff, 0, 0, 0];
        assert!(matches!(
            decode_frame(&mut b),
            Err(PeerError::FrameTooLarge(_))
        ));
        let mut b = vec![0, 0, 0, 0, 2, 0, 0, 0, 3, 1, 2, 3];
        assert!(matches!(decode_frame(&mut b), Err(PeerError::Corrupt(_))));
        let mut b = vec![1, 0, 0, 0, 9, 0, 0, 0, 3, 1, 2, 3];
        assert!(matches!(decode_frame(&mut b), Err(PeerError::Corrupt(_))));
        let mut b = vec![2, 0, 0, 0, 9, 0, 0, 0, 3, 1, 2, 3];
        assert!(matches!(decode_frame(&mut b), Err(PeerError::Corrupt(_))));
    }

    #[test]
    fn lines_decode_one_at_a_time_and_refuse_junk() {
        let id = MigrationId::random();
        let finish = PeerRequest::Finish {
            id: id.clone(),
            disks: vec![SwitchedDisk {
                volume: "root".into(),
                server: "b:10809".into(),
                admin: Some("b:8080".into()),
            }],
        };
        let mut buf = encode_line(&finish);
        buf.extend_from_slice(&encode_line(&PeerRequest::Abort { id: id.clone() }));
        assert_eq!(decode_line::<PeerRequest>(&mut buf).unwrap(), Some(finish));
        assert_eq!(
            decode_line::<PeerRequest>(&mut buf).unwrap(),
            Some(PeerRequest::Abort { id })
        );
        assert_eq!(decode_line::<PeerRequest>(&mut buf).unwrap(), None);
        let mut junk = b"{\"op\":\"format_disk\"}\n".to_vec();
        assert!(matches!(
            decode_line::<PeerRequest>(&mut junk),
            Err(PeerError::Decode(_))
        ));
        let mut long = vec![b'x'; MAX_LINE + 2];
        assert_eq!(
            decode_line::<PeerRequest>(&mut long),
            Err(PeerError::LineTooLong)
        );
    }
}
