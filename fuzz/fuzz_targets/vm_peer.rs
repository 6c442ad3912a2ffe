//! What one VM host reads from another: request/answer lines and the
//! frames of a tunnelled migration stream, on arbitrary bytes fed in
//! arbitrary pieces. Never panics; never holds more than a line's or a
//! frame's bound of unparsed bytes; a frame decodes to at most its bound.
//! Every request decoded is also fed to one arriving move's order, which
//! never lets a `Finish` through that does not place the pending disk.
#![no_main]

use ferry_vm_host::peer::{
    decode_frame, decode_line, Arrival, ArrivalOrder, DiskArrival, IncomingDisk, PeerAnswer,
    PeerRequest, FRAME_HEADER, MAX_FRAME, MAX_LINE,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let step = usize::from(data.first().copied().unwrap_or(1)).max(1);
    let (mut lines, mut answers, mut frames) = (Vec::new(), Vec::new(), Vec::new());
    let (mut lines_ok, mut answers_ok, mut frames_ok) = (true, true, true);
    let root = IncomingDisk {
        volume: "root".into(),
        server: "127.0.0.1:1".into(),
        pending: true,
        size: 1 << 20,
        flags: 0,
        arrival: None,
    };
    // A pending disk the destination learns of from its own storage:
    // `Finish` may leave it out, and then it is awaited here.
    let data_disk = IncomingDisk {
        volume: "data".into(),
        arrival: Some(DiskArrival {
            migration: ferry_api::MigrationId::from_bytes([7; 16]),
            admin: "127.0.0.1:2".into(),
        }),
        ..root.clone()
    };
    let mut order = ArrivalOrder::new(&[root, data_disk]);
    for piece in data.chunks(step) {
        if lines_ok {
            lines.extend_from_slice(piece);
            loop {
                match decode_line::<PeerRequest>(&mut lines) {
                    Ok(Some(req)) => {
                        let before = order.state();
                        let _ = order.accept(&req);
                        if before == Arrival::Waiting && order.state() == Arrival::Finished {
                            let PeerRequest::Finish { disks, .. } = &req else {
                                panic!("finished by {req:?}");
                            };
                            assert!(
                                disks.iter().any(|d| d.volume == "root"),
                                "finished without saying where the pending disk switched"
                            );
                            let placed_data = disks.iter().any(|d| d.volume == "data");
                            assert_eq!(
                                order.awaited(disks).len(),
                                usize::from(!placed_data),
                                "a disk left out of Finish must be awaited here, and only then"
                            );
                        }
                        continue;
                    }
                    Ok(None) => break,
                    Err(_) => {
                        lines_ok = false;
                        break;
                    }
                }
            }
            assert!(!lines_ok || lines.len() <= MAX_LINE + step);
        }
        if answers_ok {
            answers.extend_from_slice(piece);
            while let Ok(Some(_)) = decode_line::<PeerAnswer>(&mut answers) {}
            answers_ok = answers.len() <= MAX_LINE + step;
        }
        if frames_ok {
            frames.extend_from_slice(piece);
            loop {
                match decode_frame(&mut frames) {
                    Ok(Some((ferry_vm_host::peer::Frame::Data(raw), _))) => assert!(raw.len() <= MAX_FRAME),
                    Ok(Some((ferry_vm_host::peer::Frame::Ack(n), _))) => assert!(n <= u64::from(u32::MAX)),
                    Ok(None) => break,
                    Err(_) => {
                        frames_ok = false;
                        break;
                    }
                }
            }
            assert!(!frames_ok || frames.len() <= FRAME_HEADER + MAX_FRAME + 1024 + step);
        }
    }
});
