//! The login phase: security negotiation (CHAP one-way and mutual, or
//! none), operational negotiation of every RFC 7143 key, the target's ACL,
//! and the transition to the full feature phase.

use crate::chap;
use crate::pdu::{op, Pdu};
use crate::text;
use bytes::Bytes;

/// Limits ferry offers.
pub const OUR_MAX_RECV_DATA: u32 = 262_144;
pub const OUR_MAX_BURST: u32 = 16 * 1024 * 1024 - 1;
pub const OUR_MAX_OUTSTANDING_R2T: u32 = 16;
/// Commands a session may have outstanding (MaxCmdSN - ExpCmdSN + 1).
pub const COMMAND_WINDOW: u32 = 128;
/// Largest login text accepted across continued PDUs.
const MAX_LOGIN_TEXT: usize = 64 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionType {
    Normal,
    Discovery,
}

/// CHAP secrets for one target (or for discovery).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChapSecret {
    /// The name and secret the initiator must prove.
    pub user: String,
    pub secret: Vec<u8>,
    /// For mutual CHAP: the name and secret the target proves with.
    pub mutual: Option<(String, Vec<u8>)>,
}

/// Who may log in to a target.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TargetPolicy {
    pub chap: Option<ChapSecret>,
    /// Initiator names allowed; empty = any (subject to `open`).
    pub acl: Vec<String>,
    /// May an initiator with no CHAP and no ACL entry log in? (True only on
    /// loopback listeners when nothing is configured.)
    pub open: bool,
    /// The target lives elsewhere now: once the initiator has passed this
    /// policy, its login is answered "target moved temporarily" (status
    /// 01/01) with this `TargetAddress` (`HOST:PORT,TPGT`).
    pub moved_to: Option<String>,
}

/// The target names this portal serves, and their policies.
pub trait Targets {
    fn policy(&self, target: &str) -> Option<TargetPolicy>;
    fn discovery_policy(&self) -> TargetPolicy;
    /// `TargetName=`/`TargetAddress=` pairs for SendTargets. `only`
    /// restricts the answer to one target (normal sessions).
    fn send_targets(&self, initiator: &str, only: Option<&str>) -> Vec<(String, String)>;
    /// The portal group tag of the portal the connection came in on.
    fn portal_group(&self) -> u16;
}

/// What the login agreed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionParams {
    pub session_type: SessionType,
    pub initiator_name: String,
    pub initiator_alias: Option<String>,
    pub target_name: Option<String>,
    pub isid: [u8; 6],
    pub tsih: u16,
    pub cid: u16,
    pub header_digest: bool,
    pub data_digest: bool,
    /// Largest data segment we accept.
    pub max_recv_data: u32,
    /// Largest data segment we may send (the initiator's declaration).
    pub max_send_data: u32,
    pub max_burst: u32,
    pub first_burst: u32,
    pub initial_r2t: bool,
    pub immediate_data: bool,
    pub max_outstanding_r2t: u32,
    pub data_pdu_in_order: bool,
    pub data_sequence_in_order: bool,
    pub default_time2wait: u32,
    pub default_time2retain: u32,
    /// ExpCmdSN and StatSN at the start of the full feature phase.
    pub exp_cmdsn: u32,
    pub stat_sn: u32,
}

impl Default for SessionParams {
    /// The values RFC 7143 gives a key nobody negotiates (ErrorRecoveryLevel
    /// 0, as ferry runs), for a normal session not yet named.
    fn default() -> Self {
        SessionParams {
            session_type: SessionType::Normal,
            initiator_name: String::new(),
            initiator_alias: None,
            target_name: None,
            isid: [0; 6],
            tsih: 0,
            cid: 0,
            header_digest: false,
            data_digest: false,
            max_recv_data: OUR_MAX_RECV_DATA,
            max_send_data: 8192,
            max_burst: 262_144,
            first_burst: 65_536,
            initial_r2t: true,
            immediate_data: true,
            max_outstanding_r2t: 1,
            data_pdu_in_order: true,
            data_sequence_in_order: true,
            default_time2wait: 2,
            default_time2retain: 0,
            exp_cmdsn: 0,
            stat_sn: 0,
        }
    }
}

impl SessionParams {
    /// The initiator port name (`<name>,i,0x<ISID>`) that identifies the
    /// I_T nexus for reservations.
    pub fn initiator_port(&self) -> String {
        let mut s = format!("{},i,0x", self.initiator_name);
        for b in self.isid {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }
}

/// What to do after one login PDU.
#[derive(Debug)]
pub enum LoginStep {
    /// Send this response and wait for the next request.
    Continue(Pdu),
    /// Send this response; the full feature phase starts.
    Done(Pdu, Box<SessionParams>),
    /// Send this response and close the connection.
    Fail(Pdu, LoginFailure),
    /// Send this response (a redirect to the address) and close the
    /// connection: the initiator logs in there.
    Redirect(Pdu, String),
}

/// Why a login failed (status class 2 or 3 detail).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoginFailure {
    Authentication,
    Authorization,
    TargetNotFound,
    MissingParameter,
    UnsupportedVersion,
    SessionDoesNotExist,
    InvalidRequest,
    Initiator,
    /// The target has no room for another connection (status 03/02).
    OutOfResources,
}

impl LoginFailure {
    fn status(self) -> (u8, u8) {
        match self {
            LoginFailure::Initiator => (2, 0),
            LoginFailure::Authentication => (2, 1),
            LoginFailure::Authorization => (2, 2),
            LoginFailure::TargetNotFound => (2, 3),
            LoginFailure::MissingParameter => (2, 7),
            LoginFailure::UnsupportedVersion => (2, 5),
            LoginFailure::SessionDoesNotExist => (2, 0x0a),
            LoginFailure::InvalidRequest => (2, 0x0b),
            LoginFailure::OutOfResources => (3, 2),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Auth {
    /// Nothing agreed yet.
    Start,
    /// AuthMethod=CHAP agreed; waiting for CHAP_A.
    ChapAlgorithm,
    /// Challenge sent; waiting for CHAP_N/CHAP_R.
    ChapResponse {
        id: u8,
        challenge: Vec<u8>,
    },
    Done,
}

/// The login state machine for one connection.
#[derive(Debug)]
pub struct Login {
    first: bool,
    stage: u8,
    auth: Auth,
    policy: Option<TargetPolicy>,
    params: SessionParams,
    pending_text: Vec<u8>,
    declared_mrdsl: bool,
    challenge_seed: [u8; 16],
    tsih: u16,
    itt: u32,
    initiator_port_ok: bool,
}

fn yes(v: &str) -> Option<bool> {
    match v {
        "Yes" => Some(true),
        "No" => Some(false),
        _ => None,
    }
}
fn yn(b: bool) -> String {
    if b { "Yes" } else { "No" }.to_string()
}
fn num(v: &str, lo: u32, hi: u32) -> Option<u32> {
    let n: u64 = v.parse().ok()?;
    u32::try_from(n).ok().filter(|n| (lo..=hi).contains(n))
}

impl Login {
    /// `challenge_seed` supplies the CHAP challenge (random bytes from the
    /// caller); `tsih` is the session handle to give a new session.
    pub fn new(challenge_seed: [u8; 16], tsih: u16) -> Login {
        Login {
            first: true,
            stage: 0,
            auth: Auth::Start,
            policy: None,
            params: SessionParams {
                tsih,
                ..SessionParams::default()
            },
            pending_text: Vec::new(),
            declared_mrdsl: false,
            challenge_seed,
            tsih,
            itt: 0,
            initiator_port_ok: false,
        }
    }

    /// The agreed parameters so far (for logging a failed login).
    pub fn params(&self) -> &SessionParams {
        &self.params
    }

    fn response(&self, transit: bool, nsg: u8, keys: &[(String, String)]) -> Pdu {
        let mut p = Pdu::new(op::LOGIN_RESPONSE);
        let mut f = (self.stage & 3) << 2;
        if transit {
            f |= 0x80 | (nsg & 3);
        }
        p.bhs[1] = f;
        p.bhs[2] = 0; // version max
        p.bhs[3] = 0; // version active
        p.bhs[8..14].copy_from_slice(&self.params.isid);
        let tsih = if transit && nsg == 3 { self.tsih } else { 0 };
        p.bhs[14..16].copy_from_slice(&tsih.to_be_bytes());
        p.set_itt(self.itt);
        p.set_u32(24, self.params.stat_sn);
        p.set_u32(28, self.params.exp_cmdsn);
        p.set_u32(32, self.params.exp_cmdsn.wrapping_add(COMMAND_WINDOW - 1));
        p.data = Bytes::from(text::encode(keys));
        p
    }

    fn fail(&self, why: LoginFailure) -> LoginStep {
        let mut p = self.response(false, 0, &[]);
        let (class, detail) = why.status();
        p.bhs[36] = class;
        p.bhs[37] = detail;
        LoginStep::Fail(p, why)
    }

    /// "Target moved temporarily" (status 01/01) naming where it went
    /// (RFC 7143 11.13.5): the initiator logs in there instead.
    fn redirect(&self, to: &str) -> LoginStep {
        let keys = [("TargetAddress".to_string(), to.to_string())];
        let mut p = self.response(false, 0, &keys);
        p.bhs[36] = 1;
        p.bhs[37] = 1;
        LoginStep::Redirect(p, to.to_string())
    }

    /// Answer the first login request with "out of resources" (status
    /// 03/02): the portal is at its connection limit. The initiator may try
    /// again later.
    pub fn refuse_busy(&mut self, req: &Pdu) -> Pdu {
        self.itt = req.itt();
        self.params.isid.copy_from_slice(&req.bhs[8..14]);
        self.params.exp_cmdsn = req.u32_at(24);
        self.params.stat_sn = req.u32_at(28);
        match self.fail(LoginFailure::OutOfResources) {
            LoginStep::Fail(p, _)
            | LoginStep::Continue(p)
            | LoginStep::Done(p, _)
            | LoginStep::Redirect(p, _) => p,
        }
    }

    /// Handle one login request PDU.
    pub fn feed(&mut self, req: &Pdu, targets: &dyn Targets) -> LoginStep {
        if req.opcode() != op::LOGIN {
            return self.fail(LoginFailure::InvalidRequest);
        }
        let flags = req.flags();
        let transit = flags & 0x80 != 0;
        let cont = flags & 0x40 != 0;
        let csg = (flags >> 2) & 3;
        let nsg = flags & 3;
        self.itt = req.itt();
        if self.first {
            self.first = false;
            self.params.isid.copy_from_slice(&req.bhs[8..14]);
            self.params.cid = u16::from_be_bytes([req.bhs[20], req.bhs[21]]);
            self.params.exp_cmdsn = req.u32_at(24);
            self.params.stat_sn = req.u32_at(28);
            self.stage = csg;
            if req.bhs[3] > 0 {
                // Version-min above 0: ferry speaks only version 0.
                return self.fail(LoginFailure::UnsupportedVersion);
            }
            if u16::from_be_bytes([req.bhs[14], req.bhs[15]]) != 0 {
                // Adding a connection to an existing session (MC/S) is not
                // offered: MaxConnections is always 1.
                return self.fail(LoginFailure::SessionDoesNotExist);
            }
        } else {
            self.params.stat_sn = self.params.stat_sn.wrapping_add(1);
            if req.bhs[8..14] != self.params.isid {
                return self.fail(LoginFailure::InvalidRequest);
            }
        }
        if csg != self.stage
            || csg == 2
            || (transit && (nsg <= csg || nsg == 2))
            || (transit && cont)
        {
            return self.fail(LoginFailure::InvalidRequest);
        }
        self.pending_text.extend_from_slice(&req.data);
        if self.pending_text.len() > MAX_LOGIN_TEXT {
            return self.fail(LoginFailure::InvalidRequest);
        }
        if cont {
            // More text follows in the next PDU; acknowledge with nothing.
            return LoginStep::Continue(self.response(false, 0, &[]));
        }
        let data = std::mem::take(&mut self.pending_text);
        let Ok(keys) = text::parse(&data) else {
            return self.fail(LoginFailure::InvalidRequest);
        };
        let mut answer: Vec<(String, String)> = Vec::new();

        // Names come first, on the first request that carries them.
        if !self.initiator_port_ok {
            if let Err(why) = self.identify(&keys, targets, &mut answer) {
                return self.fail(why);
            }
            self.initiator_port_ok = true;
        }
        let policy = self.policy.clone().unwrap_or_default();

        if csg == 0 {
            match self.security(&keys, &policy, &mut answer) {
                Ok(()) => {}
                Err(why) => return self.fail(why),
            }
        } else if self.auth != Auth::Done {
            // Skipping the security stage is allowed only when the target
            // requires no authentication.
            if policy.chap.is_some() {
                return self.fail(LoginFailure::Authentication);
            }
            self.auth = Auth::Done;
        }
        if let (Auth::Done, Some(to)) = (&self.auth, &policy.moved_to) {
            return self.redirect(to);
        }
        if let Err(why) = self.operational(&keys, &mut answer) {
            return self.fail(why);
        }

        let may_transit = transit && self.auth == Auth::Done;
        if may_transit && nsg == 3 {
            if self.params.session_type == SessionType::Normal && self.params.target_name.is_none()
            {
                return self.fail(LoginFailure::MissingParameter);
            }
            if !self.declared_mrdsl {
                self.declared_mrdsl = true;
                answer.push((
                    "MaxRecvDataSegmentLength".into(),
                    OUR_MAX_RECV_DATA.to_string(),
                ));
            }
            if self.params.first_burst > self.params.max_burst {
                self.params.first_burst = self.params.max_burst;
            }
            let p = self.response(true, 3, &answer);
            let mut params = self.params.clone();
            params.stat_sn = params.stat_sn.wrapping_add(1);
            return LoginStep::Done(p, Box::new(params));
        }
        let p = self.response(may_transit, nsg, &answer);
        if may_transit {
            self.stage = nsg;
        }
        LoginStep::Continue(p)
    }

    fn identify(
        &mut self,
        keys: &[(String, String)],
        targets: &dyn Targets,
        answer: &mut Vec<(String, String)>,
    ) -> Result<(), LoginFailure> {
        let get = |k: &str| keys.iter().find(|(x, _)| x == k).map(|(_, v)| v.as_str());
        let name = get("InitiatorName").ok_or(LoginFailure::MissingParameter)?;
        if name.is_empty() || name.len() > 223 {
            return Err(LoginFailure::Initiator);
        }
        self.params.initiator_name = name.to_string();
        self.params.initiator_alias = get("InitiatorAlias").map(str::to_string);
        self.params.session_type = match get("SessionType").unwrap_or("Normal") {
            "Normal" => SessionType::Normal,
            "Discovery" => SessionType::Discovery,
            _ => return Err(LoginFailure::InvalidRequest),
        };
        let policy = match self.params.session_type {
            SessionType::Discovery => targets.discovery_policy(),
            SessionType::Normal => {
                let t = get("TargetName").ok_or(LoginFailure::MissingParameter)?;
                let p = targets.policy(t).ok_or(LoginFailure::TargetNotFound)?;
                self.params.target_name = Some(t.to_string());
                answer.push((
                    "TargetPortalGroupTag".into(),
                    targets.portal_group().to_string(),
                ));
                p
            }
        };
        if !policy.acl.is_empty() && !policy.acl.iter().any(|a| a == name) {
            return Err(LoginFailure::Authorization);
        }
        if policy.acl.is_empty() && policy.chap.is_none() && !policy.open {
            return Err(LoginFailure::Authorization);
        }
        self.policy = Some(policy);
        Ok(())
    }

    fn security(
        &mut self,
        keys: &[(String, String)],
        policy: &TargetPolicy,
        answer: &mut Vec<(String, String)>,
    ) -> Result<(), LoginFailure> {
        let get = |k: &str| keys.iter().find(|(x, _)| x == k).map(|(_, v)| v.as_str());
        match self.auth.clone() {
            Auth::Start => {
                let offered: Vec<&str> = get("AuthMethod")
                    .ok_or(LoginFailure::MissingParameter)?
                    .split(',')
                    .collect();
                let pick = if policy.chap.is_some() {
                    offered.contains(&"CHAP").then_some("CHAP")
                } else {
                    offered.contains(&"None").then_some("None")
                };
                let Some(pick) = pick else {
                    return Err(LoginFailure::Authentication);
                };
                answer.push(("AuthMethod".into(), pick.into()));
                self.auth = if pick == "CHAP" {
                    Auth::ChapAlgorithm
                } else {
                    Auth::Done
                };
                if pick == "CHAP" {
                    if let Some(a) = get("CHAP_A") {
                        self.chap_algorithm(a, answer)?;
                    }
                }
            }
            Auth::ChapAlgorithm => {
                let a = get("CHAP_A").ok_or(LoginFailure::Authentication)?;
                self.chap_algorithm(a, answer)?;
            }
            Auth::ChapResponse { id, challenge } => {
                let secret = policy.chap.as_ref().ok_or(LoginFailure::Authentication)?;
                let n = get("CHAP_N").ok_or(LoginFailure::Authentication)?;
                let r = get("CHAP_R")
                    .and_then(chap::decode_binary)
                    .ok_or(LoginFailure::Authentication)?;
                let expected = chap::response(id, &secret.secret, &challenge);
                if n != secret.user || r.len() != 16 || !ct_eq(&r, &expected) {
                    return Err(LoginFailure::Authentication);
                }
                match (get("CHAP_I"), get("CHAP_C")) {
                    (Some(i), Some(c)) => {
                        let (name, target_secret) =
                            secret.mutual.as_ref().ok_or(LoginFailure::Authentication)?;
                        let i: u8 = i.parse().map_err(|_| LoginFailure::Authentication)?;
                        let c = chap::decode_binary(c).ok_or(LoginFailure::Authentication)?;
                        // A challenge equal to ours would let the initiator
                        // reflect our own question back (RFC 7143 §12.1.3).
                        if c.is_empty()
                            || c.len() > 1024
                            || c == challenge
                            || target_secret == &secret.secret
                        {
                            return Err(LoginFailure::Authentication);
                        }
                        answer.push(("CHAP_N".into(), name.clone()));
                        answer.push((
                            "CHAP_R".into(),
                            chap::to_hex(&chap::response(i, target_secret, &c)),
                        ));
                    }
                    (None, None) => {}
                    _ => return Err(LoginFailure::Authentication),
                }
                self.auth = Auth::Done;
            }
            Auth::Done => {}
        }
        Ok(())
    }

    fn chap_algorithm(
        &mut self,
        offered: &str,
        answer: &mut Vec<(String, String)>,
    ) -> Result<(), LoginFailure> {
        if !offered.split(',').any(|a| a == "5") {
            return Err(LoginFailure::Authentication);
        }
        let id = self.challenge_seed[0];
        let challenge = self.challenge_seed.to_vec();
        answer.push(("CHAP_A".into(), "5".into()));
        answer.push(("CHAP_I".into(), id.to_string()));
        answer.push(("CHAP_C".into(), chap::to_hex(&challenge)));
        self.auth = Auth::ChapResponse { id, challenge };
        Ok(())
    }

    fn operational(
        &mut self,
        keys: &[(String, String)],
        answer: &mut Vec<(String, String)>,
    ) -> Result<(), LoginFailure> {
        let discovery = self.params.session_type == SessionType::Discovery;
        let p = &mut self.params;
        for (k, v) in keys {
            let reply = match k.as_str() {
                "InitiatorName" | "InitiatorAlias" | "SessionType" | "TargetName"
                | "AuthMethod" | "CHAP_A" | "CHAP_N" | "CHAP_R" | "CHAP_I" | "CHAP_C" => continue,
                "HeaderDigest" | "DataDigest" => {
                    let pick = v.split(',').find(|x| *x == "CRC32C" || *x == "None");
                    match pick {
                        Some(x) => {
                            if k == "HeaderDigest" {
                                p.header_digest = x == "CRC32C";
                            } else {
                                p.data_digest = x == "CRC32C";
                            }
                            x.to_string()
                        }
                        None => "Reject".into(),
                    }
                }
                "MaxConnections" => match num(v, 1, 65535) {
                    Some(_) => "1".into(),
                    None => "Reject".into(),
                },
                "ErrorRecoveryLevel" => match num(v, 0, 2) {
                    Some(_) => "0".into(),
                    None => "Reject".into(),
                },
                "MaxRecvDataSegmentLength" => {
                    match num(v, 512, (1 << 24) - 1) {
                        Some(n) => p.max_send_data = n,
                        None => return Err(LoginFailure::InvalidRequest),
                    }
                    if self.declared_mrdsl {
                        continue;
                    }
                    self.declared_mrdsl = true;
                    OUR_MAX_RECV_DATA.to_string()
                }
                "DefaultTime2Wait" => match num(v, 0, 3600) {
                    Some(n) => {
                        p.default_time2wait = n;
                        n.to_string()
                    }
                    None => "Reject".into(),
                },
                "DefaultTime2Retain" => match num(v, 0, 3600) {
                    Some(_) => {
                        p.default_time2retain = 0;
                        "0".into()
                    }
                    None => "Reject".into(),
                },
                "IFMarker" | "OFMarker" => match yes(v) {
                    Some(_) => "No".into(),
                    None => "Reject".into(),
                },
                "OFMarkInt" | "IFMarkInt" => "Irrelevant".into(),
                _ if discovery
                    && matches!(
                        k.as_str(),
                        "MaxBurstLength"
                            | "FirstBurstLength"
                            | "InitialR2T"
                            | "ImmediateData"
                            | "MaxOutstandingR2T"
                            | "DataPDUInOrder"
                            | "DataSequenceInOrder"
                    ) =>
                {
                    "Irrelevant".into()
                }
                "MaxBurstLength" => match num(v, 512, (1 << 24) - 1) {
                    Some(n) => {
                        p.max_burst = n.min(OUR_MAX_BURST);
                        p.max_burst.to_string()
                    }
                    None => "Reject".into(),
                },
                "FirstBurstLength" => match num(v, 512, (1 << 24) - 1) {
                    Some(n) => {
                        p.first_burst = n.min(OUR_MAX_BURST);
                        p.first_burst.to_string()
                    }
                    None => "Reject".into(),
                },
                "InitialR2T" => match yes(v) {
                    // OR with ours (No): the initiator's choice stands.
                    Some(b) => {
                        p.initial_r2t = b;
                        yn(b)
                    }
                    None => "Reject".into(),
                },
                "ImmediateData" => match yes(v) {
                    // AND with ours (Yes).
                    Some(b) => {
                        p.immediate_data = b;
                        yn(b)
                    }
                    None => "Reject".into(),
                },
                "MaxOutstandingR2T" => match num(v, 1, 65535) {
                    Some(n) => {
                        p.max_outstanding_r2t = n.min(OUR_MAX_OUTSTANDING_R2T);
                        p.max_outstanding_r2t.to_string()
                    }
                    None => "Reject".into(),
                },
                "DataPDUInOrder" | "DataSequenceInOrder" => match yes(v) {
                    // OR with ours (Yes): always Yes; ferry delivers in order
                    // and accepts any order.
                    Some(_) => "Yes".into(),
                    None => "Reject".into(),
                },
                "TargetAlias" | "TargetAddress" | "TargetPortalGroupTag" => {
                    // Declared by targets only.
                    return Err(LoginFailure::InvalidRequest);
                }
                _ => "NotUnderstood".into(),
            };
            answer.push((k.clone(), reply));
        }
        Ok(())
    }
}

fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    struct One(TargetPolicy);
    impl Targets for One {
        fn policy(&self, t: &str) -> Option<TargetPolicy> {
            (t == "iqn.t:vol").then(|| self.0.clone())
        }
        fn discovery_policy(&self) -> TargetPolicy {
            self.0.clone()
        }
        fn send_targets(&self, _: &str, _: Option<&str>) -> Vec<(String, String)> {
            vec![]
        }
        fn portal_group(&self) -> u16 {
            1
        }
    }

    fn req(csg: u8, nsg: u8, transit: bool, keys: &str) -> Pdu {
        let mut p = Pdu::new(op::LOGIN);
        p.bhs[0] |= 0x40;
        p.bhs[1] = (csg << 2) | if transit { 0x80 | nsg } else { 0 };
        p.bhs[8..14].copy_from_slice(&[0x40, 0, 0, 0, 0, 1]);
        p.data = Bytes::from(keys.replace('\n', "\0").into_bytes());
        p
    }

    fn keys(p: &Pdu) -> Vec<(String, String)> {
        text::parse(&p.data).unwrap()
    }

    #[test]
    fn no_auth_login_straight_to_full_feature() {
        let t = One(TargetPolicy {
            open: true,
            ..Default::default()
        });
        let mut l = Login::new([7; 16], 5);
        let step = l.feed(
            &req(1, 3, true, "InitiatorName=iqn.i\nTargetName=iqn.t:vol\nHeaderDigest=CRC32C,None\nInitialR2T=No\nMaxBurstLength=1048576\nFirstBurstLength=262144\nMaxRecvDataSegmentLength=65536\nX-foo=1\n"),
            &t,
        );
        let LoginStep::Done(p, params) = step else {
            panic!("{step:?}")
        };
        assert_eq!(p.bhs[1] & 0x83, 0x83);
        assert_eq!(u16::from_be_bytes([p.bhs[14], p.bhs[15]]), 5);
        assert!(params.header_digest);
        assert!(!params.initial_r2t);
        assert_eq!(params.max_send_data, 65536);
        let k = keys(&p);
        assert!(k.contains(&("X-foo".into(), "NotUnderstood".into())));
        assert!(k.contains(&("TargetPortalGroupTag".into(), "1".into())));
    }

    #[test]
    fn a_moved_target_redirects_only_initiators_its_policy_admits() {
        let moved = |acl: Vec<String>| {
            One(TargetPolicy {
                open: acl.is_empty(),
                acl,
                moved_to: Some("10.0.0.9:3260,1".into()),
                ..Default::default()
            })
        };
        let login = "InitiatorName=iqn.i\nTargetName=iqn.t:vol\nAuthMethod=None\n";
        let mut l = Login::new([0; 16], 1);
        let LoginStep::Redirect(p, to) = l.feed(&req(0, 1, true, login), &moved(vec![])) else {
            panic!("no redirect")
        };
        assert_eq!(to, "10.0.0.9:3260,1");
        assert_eq!((p.bhs[36], p.bhs[37]), (1, 1), "target moved temporarily");
        assert_eq!(p.bhs[1] & 0x80, 0, "no transit");
        assert!(keys(&p).contains(&("TargetAddress".into(), "10.0.0.9:3260,1".into())));
        // Not on the ACL: refused, and not told where the target went.
        let mut l = Login::new([0; 16], 1);
        let step = l.feed(&req(0, 1, true, login), &moved(vec!["iqn.other".into()]));
        let LoginStep::Fail(p, LoginFailure::Authorization) = step else {
            panic!("{step:?}")
        };
        assert!(keys(&p).is_empty());
    }

    #[test]
    fn unknown_target_acl_and_closed_portal() {
        let open = One(TargetPolicy {
            open: true,
            ..Default::default()
        });
        let mut l = Login::new([0; 16], 1);
        assert!(matches!(
            l.feed(
                &req(1, 3, true, "InitiatorName=iqn.i\nTargetName=nope\n"),
                &open
            ),
            LoginStep::Fail(_, LoginFailure::TargetNotFound)
        ));
        let acl = One(TargetPolicy {
            acl: vec!["iqn.good".into()],
            ..Default::default()
        });
        let mut l = Login::new([0; 16], 1);
        assert!(matches!(
            l.feed(
                &req(1, 3, true, "InitiatorName=iqn.bad\nTargetName=iqn.t:vol\n"),
                &acl
            ),
            LoginStep::Fail(_, LoginFailure::Authorization)
        ));
        let closed = One(TargetPolicy::default());
        let mut l = Login::new([0; 16], 1);
        assert!(matches!(
            l.feed(
                &req(1, 3, true, "InitiatorName=iqn.i\nTargetName=iqn.t:vol\n"),
                &closed
            ),
            LoginStep::Fail(_, LoginFailure::Authorization)
        ));
    }

    #[test]
    fn mutual_chap() {
        let t = One(TargetPolicy {
            chap: Some(ChapSecret {
                user: "alice".into(),
                secret: b"alicesecret12".to_vec(),
                mutual: Some(("target".into(), b"targetsecret1".to_vec())),
            }),
            ..Default::default()
        });
        let mut l = Login::new([9; 16], 1);
        // Skipping security is refused.
        let mut skip = Login::new([9; 16], 1);
        assert!(matches!(
            skip.feed(
                &req(1, 3, true, "InitiatorName=iqn.i\nTargetName=iqn.t:vol\n"),
                &t
            ),
            LoginStep::Fail(_, LoginFailure::Authentication)
        ));
        let LoginStep::Continue(p) = l.feed(
            &req(
                0,
                1,
                true,
                "InitiatorName=iqn.i\nTargetName=iqn.t:vol\nAuthMethod=None,CHAP\n",
            ),
            &t,
        ) else {
            panic!()
        };
        assert!(keys(&p).contains(&("AuthMethod".into(), "CHAP".into())));
        assert_eq!(p.bhs[1] & 0x80, 0, "no transit before CHAP is done");
        let LoginStep::Continue(p) = l.feed(&req(0, 1, false, "CHAP_A=7,5\n"), &t) else {
            panic!()
        };
        let k = keys(&p);
        let get = |n: &str| k.iter().find(|(x, _)| x == n).unwrap().1.clone();
        let id: u8 = get("CHAP_I").parse().unwrap();
        let c = chap::decode_binary(&get("CHAP_C")).unwrap();
        let r = chap::to_hex(&chap::response(id, b"alicesecret12", &c));
        let mine = chap::to_hex(&[1, 2, 3, 4, 5, 6, 7, 8]);
        let LoginStep::Continue(p) = l.feed(
            &req(
                0,
                1,
                true,
                &format!("CHAP_N=alice\nCHAP_R={r}\nCHAP_I=3\nCHAP_C={mine}\n"),
            ),
            &t,
        ) else {
            panic!()
        };
        assert_eq!(p.bhs[1] & 0x83, 0x81);
        let k = keys(&p);
        let tr = &k.iter().find(|(x, _)| x == "CHAP_R").unwrap().1;
        assert_eq!(
            chap::decode_binary(tr).unwrap(),
            chap::response(3, b"targetsecret1", &[1, 2, 3, 4, 5, 6, 7, 8]).to_vec()
        );
        assert!(matches!(
            l.feed(&req(1, 3, true, ""), &t),
            LoginStep::Done(..)
        ));
    }

    #[test]
    fn wrong_chap_response_fails() {
        let t = One(TargetPolicy {
            chap: Some(ChapSecret {
                user: "alice".into(),
                secret: b"alicesecret12".to_vec(),
                mutual: None,
            }),
            ..Default::default()
        });
        let mut l = Login::new([9; 16], 1);
        l.feed(
            &req(
                0,
                1,
                false,
                "InitiatorName=iqn.i\nTargetName=iqn.t:vol\nAuthMethod=CHAP\nCHAP_A=5\n",
            ),
            &t,
        );
        let bad = chap::to_hex(&[0u8; 16]);
        assert!(matches!(
            l.feed(
                &req(0, 1, true, &format!("CHAP_N=alice\nCHAP_R={bad}\n")),
                &t
            ),
            LoginStep::Fail(_, LoginFailure::Authentication)
        ));
    }
}
