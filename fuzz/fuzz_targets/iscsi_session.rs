//! The full-feature-phase session and the SCSI logical unit on arbitrary
//! PDUs: every command runs against a RAM disk. Checks that nothing panics,
//! that every response carries a known opcode, and that no data segment
//! exceeds what the initiator declared.
#![no_main]

use bytes::BytesMut;
use ferry_iscsi::login::{SessionParams, TargetPolicy};
use ferry_iscsi::{CommandResult, Event, PduDecoder, Session, Targets};
use ferry_scsi::memory::MemoryDevice;
use ferry_scsi::{Identity, LogicalUnit, LuConfig, Nexus};
use libfuzzer_sys::fuzz_target;
use std::sync::Arc;

struct None_;
impl Targets for None_ {
    fn policy(&self, _: &str) -> Option<TargetPolicy> {
        None
    }
    fn discovery_policy(&self) -> TargetPolicy {
        TargetPolicy::default()
    }
    fn send_targets(&self, _: &str, _: Option<&str>) -> Vec<(String, String)> {
        vec![("TargetName".into(), "iqn.x:v".into())]
    }
    fn portal_group(&self) -> u16 {
        1
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let params = SessionParams {
        initiator_name: "iqn.i".into(),
        target_name: Some("iqn.x:v".into()),
        tsih: 1,
        max_recv_data: 8192,
        max_send_data: 512,
        max_burst: 4096,
        first_burst: 2048,
        initial_r2t: mode & 1 != 0,
        immediate_data: mode & 2 != 0,
        max_outstanding_r2t: 2,
        ..SessionParams::default()
    };
    let lu = LogicalUnit::new(
        Arc::new(MemoryDevice::new(64 * 1024, mode & 4 != 0)),
        Identity {
            name: "v".into(),
            naa: [0x30; 8],
            serial: "s".into(),
            target_name: "iqn.x:v".into(),
            port_group: 1,
            relative_port: 1,
            port_count: 2,
        },
        LuConfig {
            block_size: 512,
            physical_block: 512,
            thin: true,
        },
    );
    let nexus = Nexus {
        initiator_port: "iqn.i,i,0x000000000000".into(),
        relative_port: 1,
    };
    let mut s = Session::new(params);
    let dec = PduDecoder::new(8192);
    let mut buf = BytesMut::from(rest);
    let mut out = Vec::new();
    let mut events = Vec::new();
    while let Ok(Some(p)) = dec.decode(&mut buf) {
        if s.receive(p, &None_, &mut out, &mut events).is_err() {
            break;
        }
        for e in events.drain(..) {
            if let Event::Execute(t) = e {
                let r = lu.execute(&nexus, &t.cdb, &t.data_out);
                let res = CommandResult {
                    status: r.status as u8,
                    data: r.data.into(),
                    sense: r.sense.into(),
                    transfer_len: r.transfer_len,
                };
                s.complete(t.itt, &res, &mut out);
            }
        }
        for p in out.drain(..) {
            assert!(p.opcode() >= 0x20);
            assert!(p.data.len() <= 512 || p.opcode() != 0x25);
        }
    }
});
