//! Guest networks on a host: the bridge each network's NICs plug into, the
//! overlay joining that bridge to the same network's bridges at other
//! sites (kernel VXLAN, one VNI per network, head-end replication to the
//! listed peers; or kernel GENEVE, one point-to-point link per peer, made
//! isolated bridge ports so that a frame from one site never goes on to
//! another and a mesh of sites has no loop; learning on either way, so a
//! moved guest's MAC is learned where it announces itself; IPv4 or IPv6
//! underlay), and one tap device per NIC of a running guest.
//!
//! The host's networks are its configuration (`ferry host --network`);
//! their bridges and overlay links are made at start if missing and left
//! in place when the daemon stops (guests that outlive it keep their
//! network). A guest's taps live as long as its QEMU: plugged into their
//! bridges before QEMU starts (a move's destination does it before the
//! memory arrives), removed when QEMU is stopped. Set up with iproute2's
//! `ip` and `bridge`, the tools an operator uses to look at them.

use std::net::IpAddr;
use std::process::Command;
use std::str::FromStr;
use thiserror::Error;

/// UDP port of the VXLAN overlay (IANA's).
pub const VXLAN_PORT: u16 = 4789;
/// UDP port of the GENEVE overlay (IANA's).
pub const GENEVE_PORT: u16 = 6081;
/// The most NICs one guest may have.
pub const MAX_NICS: usize = 8;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum NetError {
    #[error("--network {0}: {1}")]
    BadConfig(String, String),
    #[error("network {0} is not configured on this host (ferry host --network)")]
    Unknown(String),
    #[error("{0}")]
    BadNic(String),
    #[error("{command}: {detail}")]
    Command { command: String, detail: String },
}

/// A network as this host knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Network {
    pub name: String,
    /// The Linux bridge guests' taps plug into.
    pub bridge: String,
    /// How the bridge reaches the same network at other sites.
    pub overlay: Option<Overlay>,
}

/// The encapsulation of an overlay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encapsulation {
    /// One VXLAN link, flooding to every peer from its forwarding table.
    Vxlan,
    /// One GENEVE link per peer, isolated from each other on the bridge.
    Geneve,
}

impl Encapsulation {
    fn name(self) -> &'static str {
        match self {
            Encapsulation::Vxlan => "vxlan",
            Encapsulation::Geneve => "geneve",
        }
    }
}

/// An overlay: this host's end and the other sites' ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overlay {
    pub encapsulation: Encapsulation,
    pub vni: u32,
    /// This host's underlay address (the VXLAN packets' source).
    pub local: IpAddr,
    /// The other sites' hosts on this network (their `local`).
    pub peers: Vec<IpAddr>,
    /// The underlay device, when the local address alone does not say
    /// (VXLAN only).
    pub dev: Option<String>,
    pub port: u16,
}

impl Overlay {
    /// The VXLAN link's name: one per VNI on a host.
    pub fn link(&self) -> String {
        format!("fvx{}", self.vni)
    }

    /// The GENEVE link to peer `index` (of [`Overlay::peers`]).
    pub fn peer_link(&self, index: usize) -> String {
        format!("fgn{}x{index}", self.vni)
    }
}

impl std::fmt::Display for Overlay {
    /// "vxlan 77 (10.0.0.1 to 10.0.0.2, 10.0.0.3)".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = self.encapsulation.name();
        write!(f, "{kind} {} ({} to ", self.vni, self.local)?;
        if self.peers.is_empty() {
            return f.write_str("no peers)");
        }
        let peers: Vec<String> = self.peers.iter().map(ToString::to_string).collect();
        write!(f, "{})", peers.join(", "))
    }
}

fn valid_ifname(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 15
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

impl FromStr for Network {
    type Err = NetError;

    /// `NAME,bridge=BR[,vxlan=VNI|geneve=VNI,local=IP,peer=IP[,peer=IP...][,dev=IF][,port=N]]`.
    fn from_str(s: &str) -> Result<Network, NetError> {
        let bad = |m: String| NetError::BadConfig(s.into(), m);
        let mut parts = s.split(',');
        let name = parts.next().unwrap_or_default().trim().to_string();
        if name.is_empty() || name.contains('=') {
            return Err(bad("starts with the network's name".into()));
        }
        if !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        {
            return Err(bad(format!("name {name:?}: letters, digits, - _ . only")));
        }
        let (mut bridge, mut vni, mut local, mut dev, mut port) = (None, None, None, None, None);
        let mut peers = Vec::new();
        for kv in parts {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| bad(format!("{kv:?} is not KEY=VALUE")))?;
            let ip = |v: &str| {
                v.parse::<IpAddr>()
                    .map_err(|_| bad(format!("{k}={v}: not an IP address")))
            };
            match k {
                "bridge" => bridge = Some(v.to_string()),
                "vxlan" | "geneve" => {
                    let n: u32 = v
                        .parse()
                        .map_err(|_| bad(format!("{k}={v}: not a number")))?;
                    if n == 0 || n >= 1 << 24 {
                        return Err(bad(format!("{k}={v}: a VNI is 1 to 16777215")));
                    }
                    if vni.is_some() {
                        return Err(bad("one overlay per network: vxlan= or geneve=".into()));
                    }
                    let e = if k == "vxlan" {
                        Encapsulation::Vxlan
                    } else {
                        Encapsulation::Geneve
                    };
                    vni = Some((e, n));
                }
                "local" => local = Some(ip(v)?),
                "peer" => peers.push(ip(v)?),
                "dev" => dev = Some(v.to_string()),
                "port" => {
                    port = Some(
                        v.parse::<u16>()
                            .ok()
                            .filter(|p| *p > 0)
                            .ok_or_else(|| bad(format!("port={v}: 1 to 65535")))?,
                    );
                }
                other => {
                    return Err(bad(format!(
                        "unknown key {other:?} (bridge, vxlan, geneve, local, peer, dev, port)"
                    )))
                }
            }
        }
        let bridge = bridge.ok_or_else(|| bad("bridge=NAME is missing".into()))?;
        if !valid_ifname(&bridge) {
            return Err(bad(format!(
                "bridge={bridge}: an interface name (up to 15 letters, digits, - _)"
            )));
        }
        if let Some(d) = &dev {
            if !valid_ifname(d) {
                return Err(bad(format!("dev={d}: not an interface name")));
            }
        }
        let overlay = match (vni, local) {
            (None, None) if peers.is_empty() && dev.is_none() && port.is_none() => None,
            (Some((encapsulation, vni)), Some(local)) => {
                if peers.contains(&local) {
                    return Err(bad(format!("peer={local} is this host's own address")));
                }
                if let Some(p) = peers.iter().find(|p| p.is_ipv4() != local.is_ipv4()) {
                    return Err(bad(format!(
                        "peer={p} and local={local}: one address family for the underlay"
                    )));
                }
                if encapsulation == Encapsulation::Geneve && dev.is_some() {
                    return Err(bad(
                        "dev= applies to vxlan (a GENEVE link follows the route to its peer)"
                            .into(),
                    ));
                }
                let default_port = match encapsulation {
                    Encapsulation::Vxlan => VXLAN_PORT,
                    Encapsulation::Geneve => GENEVE_PORT,
                };
                Some(Overlay {
                    encapsulation,
                    vni,
                    local,
                    peers,
                    dev,
                    port: port.unwrap_or(default_port),
                })
            }
            _ => {
                return Err(bad(
                    "an overlay needs vxlan=VNI (or geneve=VNI) and local=IP".into(),
                ))
            }
        };
        Ok(Network {
            name,
            bridge,
            overlay,
        })
    }
}

/// Every network of a host.
#[derive(Debug, Clone, Default)]
pub struct Networks(Vec<Network>);

impl Networks {
    /// Refuses two networks of one name, bridge or VNI.
    pub fn new(nets: Vec<Network>) -> Result<Networks, NetError> {
        for (i, a) in nets.iter().enumerate() {
            for b in &nets[..i] {
                let clash = if a.name == b.name {
                    Some("name")
                } else if a.bridge == b.bridge {
                    Some("bridge")
                } else if a.overlay.as_ref().map(|o| o.vni) == b.overlay.as_ref().map(|o| o.vni)
                    && a.overlay.is_some()
                {
                    Some("VNI")
                } else {
                    None
                };
                if let Some(what) = clash {
                    return Err(NetError::BadConfig(
                        a.name.clone(),
                        format!("same {what} as network {}", b.name),
                    ));
                }
            }
        }
        Ok(Networks(nets))
    }

    pub fn get(&self, name: &str) -> Result<&Network, NetError> {
        self.0
            .iter()
            .find(|n| n.name == name)
            .ok_or_else(|| NetError::Unknown(name.into()))
    }

    pub fn all(&self) -> &[Network] {
        &self.0
    }

    /// Make every network's bridge and overlay, where missing.
    pub fn ensure(&self) -> Result<(), NetError> {
        for n in &self.0 {
            ensure_network(n)?;
        }
        Ok(())
    }
}

/// A NIC's MAC: six hex octets, unicast, not all zero; lower-cased.
pub fn check_mac(mac: &str) -> Result<String, NetError> {
    let bad = || {
        NetError::BadNic(format!(
            "MAC {mac:?}: six hex octets like 52:54:00:12:34:56"
        ))
    };
    let octets: Vec<u8> = mac
        .split(':')
        .map(|o| {
            if o.len() == 2 {
                u8::from_str_radix(o, 16).map_err(|_| bad())
            } else {
                Err(bad())
            }
        })
        .collect::<Result<_, _>>()?;
    if octets.len() != 6 {
        return Err(bad());
    }
    if octets[0] & 1 == 1 {
        return Err(NetError::BadNic(format!(
            "MAC {mac}: a multicast address cannot be a NIC's"
        )));
    }
    if octets.iter().all(|o| *o == 0) {
        return Err(NetError::BadNic(format!("MAC {mac}: all zero")));
    }
    Ok(mac.to_ascii_lowercase())
}

/// A new MAC in QEMU's locally administered range 52:54:00.
pub fn new_mac() -> String {
    let b: [u8; 3] = rand::random();
    format!("52:54:00:{:02x}:{:02x}:{:02x}", b[0], b[1], b[2])
}

/// The tap device of a guest's NIC `index`: from the guest's directory
/// (its host's state directory and its name, links resolved), so that
/// whoever stops QEMU finds it without being told, and two hosts of one
/// machine (one network namespace) never name a tap alike when a guest
/// moves between them (15 characters at most, the kernel's limit).
pub fn tap_name(guest_dir: &std::path::Path, index: usize) -> String {
    let dir = std::fs::canonicalize(guest_dir).unwrap_or_else(|_| guest_dir.to_path_buf());
    // FNV-1a: stable across builds and machines.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in dir.as_os_str().as_encoded_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("ft{:09x}n{index}", h & 0xf_ffff_ffff)
}

fn run(program: &str, args: &[&str]) -> Result<String, NetError> {
    let failed = |detail: String| NetError::Command {
        command: format!("{program} {}", args.join(" ")),
        detail,
    };
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| failed(e.to_string()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(failed(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ))
    }
}

fn link_exists(name: &str) -> bool {
    std::path::Path::new("/sys/class/net").join(name).exists()
}

fn ensure_network(n: &Network) -> Result<(), NetError> {
    if !link_exists(&n.bridge) {
        run("ip", &["link", "add", &n.bridge, "type", "bridge"])?;
    }
    if let Some(mac) = pin_bridge_address(&n.bridge)? {
        tracing::info!(bridge = %n.bridge, %mac, "the bridge's MAC set, so that guests' taps coming and going keep it");
    }
    run("ip", &["link", "set", &n.bridge, "up"])?;
    match &n.overlay {
        None => Ok(()),
        Some(o) if o.encapsulation == Encapsulation::Vxlan => ensure_vxlan(o, &n.bridge),
        Some(o) => ensure_geneve(o, &n.bridge),
    }
}

fn ensure_vxlan(o: &Overlay, bridge: &str) -> Result<(), NetError> {
    let link = o.link();
    if !link_exists(&link) {
        let (vni, local, port) = (o.vni.to_string(), o.local.to_string(), o.port.to_string());
        let mut args = vec![
            "link", "add", &link, "type", "vxlan", "id", &vni, "local", &local, "dstport", &port,
        ];
        if let Some(d) = &o.dev {
            args.extend(["dev", d.as_str()]);
        }
        run("ip", &args)?;
    }
    run("ip", &["link", "set", &link, "master", bridge])?;
    run("ip", &["link", "set", &link, "up"])?;
    // Broadcasts and unknown MACs go to every peer (head-end replication):
    // one all-zero flood entry per peer, added where missing.
    let known = run("bridge", &["fdb", "show", "dev", &link]).unwrap_or_default();
    for p in &o.peers {
        let p = p.to_string();
        if !known
            .lines()
            .any(|l| l.starts_with("00:00:00:00:00:00") && l.contains(&format!("dst {p} ")))
        {
            run(
                "bridge",
                &[
                    "fdb",
                    "append",
                    "00:00:00:00:00:00",
                    "dev",
                    &link,
                    "dst",
                    &p,
                ],
            )?;
        }
    }
    Ok(())
}

/// One GENEVE link per peer, each an isolated port of the bridge: frames
/// pass between a link and the guests' taps, never from one site's link
/// to another's (split horizon), so sites that all list each other form
/// no loop. The kernel picks each link's source address by its route to
/// the peer; `local` names this host to the others.
fn ensure_geneve(o: &Overlay, bridge: &str) -> Result<(), NetError> {
    let (vni, port) = (o.vni.to_string(), o.port.to_string());
    for (i, p) in o.peers.iter().enumerate() {
        let link = o.peer_link(i);
        if !link_exists(&link) {
            let peer = p.to_string();
            run(
                "ip",
                &[
                    "link", "add", &link, "type", "geneve", "id", &vni, "remote", &peer, "dstport",
                    &port,
                ],
            )
            .map_err(no_geneve_says_so)?;
        }
        run("ip", &["link", "set", &link, "master", bridge])?;
        run("bridge", &["link", "set", "dev", &link, "isolated", "on"])?;
        run("ip", &["link", "set", &link, "up"])?;
    }
    Ok(())
}

/// A kernel without GENEVE answers "Unknown device type": say what that means.
fn no_geneve_says_so(e: NetError) -> NetError {
    match e {
        NetError::Command { command, detail } if detail.contains("Unknown device type") => {
            NetError::Command {
                command,
                detail: format!(
                    "{detail} (this kernel has no GENEVE links, CONFIG_GENEVE: use vxlan=)"
                ),
            }
        }
        e => e,
    }
}

/// Give `bridge` its current MAC as one set on purpose, unless one was
/// (returns the MAC when it did). A bridge whose address nobody set takes
/// its lowest port's MAC and changes it as ports come and go; each change
/// silences, until their ARP entries expire (seconds to a minute), the
/// neighbours that reach this host through the bridge's address: clients
/// on the host itself, guests whose gateway it is. Kernel: a bridge keeps
/// an address assigned by the user (`addr_assign_type` 3) for good.
fn pin_bridge_address(bridge: &str) -> Result<Option<String>, NetError> {
    let sys = std::path::Path::new("/sys/class/net").join(bridge);
    let read = |f: &str| std::fs::read_to_string(sys.join(f)).map(|s| s.trim().to_string());
    if read("addr_assign_type").is_ok_and(|t| t == "3") {
        return Ok(None);
    }
    let mac = read("address").map_err(|e| NetError::Command {
        command: format!("read {}", sys.join("address").display()),
        detail: e.to_string(),
    })?;
    run("ip", &["link", "set", "dev", bridge, "address", &mac])?;
    Ok(Some(mac))
}

/// The MAC of a guest tap's own end: the guest's with the first octet
/// 0xfe (libvirt's rule). A bridge without a set address takes its lowest
/// port's MAC, and a tap with a random one could become it; 0xfe keeps
/// taps above the uplinks' and overlays' MACs, so a guest starting,
/// stopping or moving never changes such a bridge's address.
pub fn tap_mac(guest_mac: &str) -> String {
    match guest_mac.split_once(':') {
        Some((_, rest)) => format!("fe:{rest}"),
        None => guest_mac.to_string(),
    }
}

/// Make `tap` (owned by `user`, so a QEMU running as that user opens it;
/// its own MAC [`tap_mac`] of the guest's `mac`) and plug it into
/// `bridge`. A tap of that name left by a QEMU that ended without its
/// daemon is replaced.
pub fn plug(tap: &str, bridge: &str, mac: &str, user: Option<&str>) -> Result<(), NetError> {
    if link_exists(tap) {
        run("ip", &["link", "del", tap])?;
    }
    let mut args = vec!["tuntap", "add", "dev", tap, "mode", "tap"];
    if let Some(u) = user {
        args.extend(["user", u]);
    }
    run("ip", &args)?;
    let own = tap_mac(mac);
    let r = run("ip", &["link", "set", "dev", tap, "address", &own])
        .and_then(|_| run("ip", &["link", "set", tap, "master", bridge]))
        .and_then(|_| run("ip", &["link", "set", tap, "up"]));
    if r.is_err() {
        let _ = run("ip", &["link", "del", tap]);
    }
    r.map(|_| ())
}

/// Remove `tap` if it is there.
pub fn unplug(tap: &str) {
    if link_exists(tap) {
        if let Err(e) = run("ip", &["link", "del", tap]) {
            tracing::warn!(%tap, error = %e, "cannot remove a guest's tap");
        }
    }
}

/// What a tap carried, each way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TapCounters {
    pub to_guest_bytes: u64,
    pub from_guest_bytes: u64,
    pub to_guest_packets: u64,
    pub from_guest_packets: u64,
}

/// A tap's counters (`None` when it does not exist).
pub fn tap_counters(tap: &str) -> Option<TapCounters> {
    let read = |f: &str| -> Option<u64> {
        std::fs::read_to_string(format!("/sys/class/net/{tap}/statistics/{f}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    // The host's tx is what reaches the guest.
    Some(TapCounters {
        to_guest_bytes: read("tx_bytes")?,
        from_guest_bytes: read("rx_bytes")?,
        to_guest_packets: read("tx_packets")?,
        from_guest_packets: read("rx_packets")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_network_is_read_from_its_flag_and_bad_ones_are_refused_with_the_rule() {
        let n: Network = "web,bridge=br-web".parse().unwrap();
        assert_eq!((n.name.as_str(), n.bridge.as_str()), ("web", "br-web"));
        assert!(n.overlay.is_none());
        let n: Network = "web,bridge=br-web,vxlan=42,local=10.0.0.1,peer=10.0.0.2,peer=10.0.0.3"
            .parse()
            .unwrap();
        let o = n.overlay.unwrap();
        assert_eq!((o.vni, o.port, o.peers.len()), (42, VXLAN_PORT, 2));
        assert_eq!(o.link(), "fvx42");
        assert_eq!(o.to_string(), "vxlan 42 (10.0.0.1 to 10.0.0.2, 10.0.0.3)");
        let n: Network =
            "web,bridge=br-web,geneve=16777215,local=fd00::1,peer=fd00::2,peer=fd00::3"
                .parse()
                .unwrap();
        let o = n.overlay.unwrap();
        assert_eq!(o.encapsulation, Encapsulation::Geneve);
        assert_eq!((o.port, o.peers.len()), (GENEVE_PORT, 2));
        assert_eq!(
            o.to_string(),
            "geneve 16777215 (fd00::1 to fd00::2, fd00::3)"
        );
        let link = o.peer_link(7);
        assert!(link.len() <= 15 && valid_ifname(&link), "{link}");
        for (flag, says) in [
            ("", "name"),
            ("web", "bridge=NAME is missing"),
            ("web,bridge=a-bridge-name-too-long", "interface name"),
            ("web,bridge=br,vxlan=0,local=10.0.0.1", "VNI is 1 to"),
            (
                "web,bridge=br,vxlan=7",
                "vxlan=VNI (or geneve=VNI) and local=IP",
            ),
            (
                "web,bridge=br,peer=10.0.0.2",
                "vxlan=VNI (or geneve=VNI) and local=IP",
            ),
            (
                "web,bridge=br,geneve=7,vxlan=7,local=10.0.0.1",
                "one overlay",
            ),
            ("web,bridge=br,geneve=0,local=10.0.0.1", "VNI is 1 to"),
            (
                "web,bridge=br,geneve=7,local=fd00::1,peer=10.0.0.2",
                "one address family",
            ),
            (
                "web,bridge=br,vxlan=7,local=10.0.0.1,peer=fd00::2",
                "one address family",
            ),
            (
                "web,bridge=br,geneve=7,local=10.0.0.1,peer=10.0.0.2,dev=eth0",
                "dev= applies to vxlan",
            ),
            (
                "web,bridge=br,vxlan=7,local=10.0.0.1,peer=10.0.0.1",
                "own address",
            ),
            ("web,bridge=br,vxlan=7,local=nowhere", "not an IP"),
            ("web,bridge=br,color=red", "unknown key"),
            ("web,bridge=br,vxlan", "KEY=VALUE"),
        ] {
            let e = flag.parse::<Network>().unwrap_err().to_string();
            assert!(e.contains(says), "{flag}: {e}");
        }
        let two = |a: &str, b: &str| Networks::new(vec![a.parse().unwrap(), b.parse().unwrap()]);
        assert!(two("a,bridge=b1", "a,bridge=b2").is_err());
        assert!(two("a,bridge=b1", "b,bridge=b1").is_err());
        assert!(two(
            "a,bridge=b1,vxlan=5,local=10.0.0.1",
            "b,bridge=b2,vxlan=5,local=10.0.0.1"
        )
        .is_err());
        let nets = two("a,bridge=b1", "b,bridge=b2").unwrap();
        assert_eq!(nets.get("b").unwrap().bridge, "b2");
        assert_eq!(nets.get("c"), Err(NetError::Unknown("c".into())));
    }

    #[test]
    fn a_taps_own_mac_is_the_guests_above_every_uplinks() {
        assert_eq!(tap_mac("52:54:00:12:34:56"), "fe:54:00:12:34:56");
        assert_eq!(tap_mac("02:00:00:00:00:01"), "fe:00:00:00:00:01");
        assert!(check_mac(&tap_mac(&new_mac())).is_ok());
    }

    #[test]
    fn macs_are_checked_and_made_and_taps_named_within_the_kernels_limit() {
        assert_eq!(check_mac("52:54:00:AB:cd:01").unwrap(), "52:54:00:ab:cd:01");
        for bad in [
            "",
            "52:54:00:ab:cd",
            "52:54:00:ab:cd:0g",
            "01:00:5e:00:00:01",
            "00:00:00:00:00:00",
            "5254.00ab.cd01",
        ] {
            assert!(check_mac(bad).is_err(), "{bad}");
        }
        for _ in 0..100 {
            let m = new_mac();
            assert_eq!(check_mac(&m).unwrap(), m);
            assert!(m.starts_with("52:54:00:"));
        }
        let p = |s: &str| std::path::PathBuf::from(s);
        let t = tap_name(&p("/var/lib/ferry-host/vms/a-guest-with-a-long-name"), 7);
        assert!(t.len() <= 15 && valid_ifname(&t), "{t}");
        assert_eq!(
            t,
            tap_name(&p("/var/lib/ferry-host/vms/a-guest-with-a-long-name"), 7),
            "stable"
        );
        assert_ne!(
            tap_name(&p("/h/vms/web"), 0),
            tap_name(&p("/h/vms/web2"), 0)
        );
        assert_ne!(tap_name(&p("/h/vms/web"), 0), tap_name(&p("/h/vms/web"), 1));
        // The same guest on two hosts of one machine.
        assert_ne!(tap_name(&p("/a/vms/web"), 0), tap_name(&p("/b/vms/web"), 0));
    }
}
