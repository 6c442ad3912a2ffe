//! The PDU decoder (with and without digests) and the login state machine
//! on arbitrary bytes, the target served here or moved (a redirect).
#![no_main]

use bytes::BytesMut;
use ferry_iscsi::login::{ChapSecret, TargetPolicy};
use ferry_iscsi::{Login, LoginStep, PduDecoder, Targets};
use libfuzzer_sys::fuzz_target;

/// CHAP required; the target moved away.
struct Fixed(bool, bool);
impl Targets for Fixed {
    fn policy(&self, t: &str) -> Option<TargetPolicy> {
        (t == "iqn.2026-11.io.ferry:v").then(|| TargetPolicy {
            moved_to: self.1.then(|| "10.0.0.2:3260,1".into()),
            ..self.discovery_policy()
        })
    }
    fn discovery_policy(&self) -> TargetPolicy {
        TargetPolicy {
            chap: self.0.then(|| ChapSecret {
                user: "u".into(),
                secret: b"secretsecret".to_vec(),
                mutual: Some(("t".into(), b"targetsecret".to_vec())),
            }),
            acl: Vec::new(),
            open: true,
            moved_to: None,
        }
    }
    fn send_targets(&self, _: &str, _: Option<&str>) -> Vec<(String, String)> {
        Vec::new()
    }
    fn portal_group(&self) -> u16 {
        1
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut dec = PduDecoder::new(8192);
    dec.header_digest = mode & 1 != 0;
    dec.data_digest = mode & 2 != 0;
    let targets = Fixed(mode & 4 != 0, mode & 8 != 0);
    let mut login = Login::new([mode; 16], 1);
    let mut buf = BytesMut::new();
    for piece in rest.chunks(61) {
        buf.extend_from_slice(piece);
        loop {
            match dec.decode(&mut buf) {
                Ok(Some(p)) => match login.feed(&p, &targets) {
                    LoginStep::Continue(r) => assert_eq!(r.opcode(), 0x23),
                    LoginStep::Done(r, params) => {
                        assert_eq!(r.opcode(), 0x23);
                        assert!(params.first_burst <= params.max_burst);
                        return;
                    }
                    LoginStep::Fail(r, _) => {
                        assert_ne!(r.bhs[36], 0);
                        return;
                    }
                    LoginStep::Redirect(r, _) => {
                        assert!(targets.1, "a redirect for a target that did not move");
                        assert_eq!((r.bhs[36], r.bhs[37]), (1, 1));
                        return;
                    }
                },
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
});
