//! The site's iSCSI portal: one address a site of shared gateways gives
//! its initiators, answered by one live gateway at a time.
//!
//! An initiator reconnects to the portal it was configured with (libiscsi,
//! QEMU's driver, open-iscsi without multipath), even after a login
//! redirect sent it elsewhere; if that portal is one gateway's own address
//! and the gateway dies, the initiator retries a dead address for ever.
//! The site portal is an address that outlives any one gateway: whichever
//! gateway holds a lease on it in the cluster (a RADOS lock with a
//! duration, renewed every second) adds the address to its interface,
//! announces it (gratuitous ARP) and listens on it. A gateway that is
//! killed stops renewing: its lease runs out and another takes the address
//! and the listener; an initiator reconnecting logs in there and finds the
//! volume (the new holder claims it, fencing the dead gateway, as for any
//! shared volume). A standby does not wait for the lease to run out when
//! the holder is plainly dead: its NBD listener does not answer (the test
//! a volume's claim makes), so the standby breaks its lease and fences it
//! in the cluster. A gateway that cannot renew (cut off from the
//! cluster, or fenced) lets the address go at once when fenced, and
//! otherwise before its lease could run out.

use crate::ServerState;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How long a lease lasts without renewal.
const LEASE_SECS: u32 = 6;
/// How often the holder renews.
const RENEW_EVERY: Duration = Duration::from_secs(1);
/// How often a standby tries to take the lease (and so how soon it finds
/// a dead holder: the initiators' stall starts there).
const STANDBY_EVERY: Duration = Duration::from_millis(250);
/// A holder that has not renewed for this long lets the address go: well
/// before its lease runs out and another gateway takes it.
const LET_GO_AFTER: Duration = Duration::from_secs(4);
/// The longest one lease call may take before it counts as failed.
const CALL_LIMIT: Duration = Duration::from_secs(3);
/// The lock's name on the lease object.
const LOCK_NAME: &str = "ferry-site-portal";

/// What a gateway needs to take part.
#[derive(Debug, Clone)]
pub struct SitePortal {
    pub addr: SocketAddrV4,
    pub prefix: u8,
    pub device: String,
}

impl SitePortal {
    /// From `[iscsi] site_portal*`; `None` when unset.
    ///
    /// # Errors
    ///
    /// A portal that is not `IPv4:PORT`, no device, a bad prefix, or a
    /// daemon that is not a shared gateway.
    pub fn from_config(config: &crate::config::Config) -> Result<Option<SitePortal>, String> {
        let c = &config.iscsi;
        if c.site_portal.is_empty() {
            return Ok(None);
        }
        let addr: SocketAddr = c.site_portal.parse().map_err(|_| {
            format!(
                "iscsi.site_portal {:?} is not IPv4:PORT (IPv6 site portals are not supported)",
                c.site_portal
            )
        })?;
        let SocketAddr::V4(addr) = addr else {
            return Err(format!(
                "iscsi.site_portal {addr}: IPv6 site portals are not supported (no unsolicited neighbour advertisement yet)"
            ));
        };
        if addr.ip().is_unspecified() || addr.ip().is_loopback() || addr.port() == 0 {
            return Err(format!(
                "iscsi.site_portal {addr}: needs an address initiators reach and a port"
            ));
        }
        if c.site_portal_device.is_empty() {
            return Err(
                "iscsi.site_portal needs site_portal_device: the interface its address goes on"
                    .into(),
            );
        }
        if !(1..=32).contains(&c.site_portal_prefix) {
            return Err(format!(
                "iscsi.site_portal_prefix {} is not 1 to 32",
                c.site_portal_prefix
            ));
        }
        if !config.storage.ceph.as_ref().is_some_and(|c| c.shared) {
            return Err(
                "iscsi.site_portal is for shared gateways ([storage.ceph] shared = true)".into(),
            );
        }
        if c.listen.len() >= 15 {
            return Err("iscsi.site_portal counts as a portal: at most 14 others".into());
        }
        Ok(Some(SitePortal {
            addr,
            prefix: c.site_portal_prefix,
            device: c.site_portal_device.clone(),
        }))
    }

    /// The object in the pool whose lock is the lease.
    fn object(&self) -> String {
        format!("ferry.site-portal.{}_{}", self.addr.ip(), self.addr.port())
    }

    /// `ip addr VERB` of the portal's address on its device.
    fn address(&self, verb: &str) -> Result<(), String> {
        ip(&[
            "addr",
            verb,
            &format!("{}/{}", self.addr.ip(), self.prefix),
            "dev",
            &self.device,
        ])
    }
}

/// Take part in holding the site portal until `shutdown`: take the lease
/// when it is free or its holder is dead, then serve the address as portal
/// `index` while it is renewed; give it back (lease and address) on
/// shutdown.
pub async fn run(
    portal: SitePortal,
    index: usize,
    pool: Arc<ferry_rbd::Pool>,
    gateway: ferry_storage::SharedGateway,
    state: Arc<ServerState>,
    shutdown: CancellationToken,
) {
    // The cookie names this gateway's NBD address: the others ask it
    // whether the holder lives, as they ask a volume's holder.
    let cookie = format!("{}#{:016x}", gateway.address, rand::random::<u64>());
    let object = portal.object();
    let mut held: Option<Held> = None;
    let mut last_renewed = Instant::now();
    let mut said_busy = false;
    let mut unanswered = None;
    loop {
        // A holder's call may not outlast its right to the address: it
        // must know it lost the lease before the lease can run out.
        let limit = if held.is_some() {
            LET_GO_AFTER
                .saturating_sub(last_renewed.elapsed())
                .clamp(Duration::from_millis(100), CALL_LIMIT)
        } else {
            CALL_LIMIT
        };
        let took = lease(&pool, &object, &cookie, limit, &mut unanswered).await;
        let mut again = false;
        match (took, held.is_some()) {
            (Ok(true), false) => match Held::start(&portal, index, &state, &shutdown) {
                Ok(h) => {
                    tracing::info!(portal = %portal.addr, device = %portal.device, "this gateway holds the site portal");
                    held = Some(h);
                    said_busy = false;
                    last_renewed = Instant::now();
                }
                Err(e) => {
                    tracing::error!(portal = %portal.addr, error = %e, "took the site portal's lease but cannot serve its address: giving it back");
                    release(&pool, &object, &cookie).await;
                }
            },
            (Ok(true), true) => last_renewed = Instant::now(),
            (Ok(false), true) => {
                tracing::error!(portal = %portal.addr, "the site portal's lease went to another gateway: letting the address go");
                if let Some(h) = held.take() {
                    h.stop(&portal);
                }
            }
            (Ok(false), false) => {
                if !said_busy {
                    tracing::info!(portal = %portal.addr, "another gateway holds the site portal; standing by");
                    said_busy = true;
                }
                again = take_from_dead(&pool, &object, &gateway).await;
            }
            (Err(e), is_held) => {
                tracing::warn!(portal = %portal.addr, error = %e, "site portal lease call failed");
                let fenced = pool.cluster().fenced();
                if is_held && (fenced || last_renewed.elapsed() >= LET_GO_AFTER) {
                    tracing::error!(portal = %portal.addr, fenced, "cannot renew the site portal's lease: letting the address go");
                    if let Some(h) = held.take() {
                        h.stop(&portal);
                    }
                }
            }
        }
        if again {
            continue;
        }
        let pause = if held.is_some() {
            RENEW_EVERY
        } else {
            STANDBY_EVERY
        };
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = tokio::time::sleep(pause) => {}
        }
    }
    if let Some(h) = held.take() {
        h.stop(&portal);
        release(&pool, &object, &cookie).await;
        tracing::info!(portal = %portal.addr, "site portal given back");
    }
}

/// Why a call to the cluster failed. Whether the cluster fenced this
/// gateway is the client's to say ([`ferry_rbd::Cluster::fenced`]).
type LeaseError = String;

/// `call` on a blocking thread, given up after `limit` (the thread may go
/// on: librados has no timeout of its own here).
async fn in_cluster<T: Send + 'static>(
    limit: Duration,
    call: impl FnOnce() -> Result<T, ferry_rbd::RbdError> + Send + 'static,
) -> Result<T, LeaseError> {
    wait_for(limit, tokio::task::spawn_blocking(call), &mut None).await
}

/// A call to the cluster on a blocking thread.
type Call<T> = tokio::task::JoinHandle<Result<T, ferry_rbd::RbdError>>;

/// `call`'s answer if it comes within `limit`; else the call is left in
/// `unanswered` (it may yet end) and counts as failed.
async fn wait_for<T>(
    limit: Duration,
    mut call: Call<T>,
    unanswered: &mut Option<Call<T>>,
) -> Result<T, LeaseError> {
    match tokio::time::timeout(limit, &mut call).await {
        Ok(Ok(Ok(v))) => Ok(v),
        Ok(Ok(Err(e))) => Err(e.to_string()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => {
            *unanswered = Some(call);
            Err(format!("no answer from the cluster in {limit:?}"))
        }
    }
}

/// Take or renew the lease. A call a cut-off cluster has not answered is
/// waited on again rather than joined by another (a call to it hangs until
/// the cut heals: one blocking thread, not one per second).
async fn lease(
    pool: &Arc<ferry_rbd::Pool>,
    object: &str,
    cookie: &str,
    limit: Duration,
    unanswered: &mut Option<Call<bool>>,
) -> Result<bool, LeaseError> {
    let call = unanswered.take().unwrap_or_else(|| {
        let (p, o, c) = (pool.clone(), object.to_string(), cookie.to_string());
        tokio::task::spawn_blocking(move || p.lease(&o, LOCK_NAME, &c, LEASE_SECS))
    });
    wait_for(limit, call, unanswered).await
}

/// When the lease's holder is dead (its NBD listener does not answer, as
/// for a volume's holder) or is this gateway's own earlier run: break its
/// lease, so that this gateway takes the portal now rather than when the
/// lease runs out, and fence it. Whether it did.
///
/// The portal is taken without waiting for the fence (a monitors'
/// proposal, up to a second): an initiator retrying the address finds it
/// served sooner, and the volumes' claims, which must not write before
/// the dead gateway is fenced, wait for this same fence
/// ([`ferry_rbd::Cluster::blocklist`]) rather than start another. A holder
/// that was only cut off learns at its next renewal that it lost the lease.
async fn take_from_dead(
    pool: &Arc<ferry_rbd::Pool>,
    object: &str,
    gateway: &ferry_storage::SharedGateway,
) -> bool {
    let (p, o, g) = (pool.clone(), object.to_string(), gateway.clone());
    let took = in_cluster(CALL_LIMIT * 2, move || {
        for h in p.lease_holders(&o, LOCK_NAME)? {
            let at = h.cookie.split('#').next().unwrap_or_default().to_string();
            if at.is_empty() || (at != g.address && (g.alive)(&at)) {
                continue;
            }
            p.break_lease(&o, LOCK_NAME, &h)?;
            return Ok(Some((at, h.address)));
        }
        Ok(None)
    })
    .await;
    match took {
        Ok(Some((at, client))) => {
            tracing::warn!(holder = %at, %client, "the site portal's holder does not answer: broke its lease, fencing it");
            let cluster = pool.cluster().clone();
            tokio::task::spawn_blocking(move || match cluster.blocklist(&client) {
                Ok(()) => tracing::info!(%client, "fenced the site portal's last holder"),
                Err(e) => {
                    tracing::error!(%client, error = %e, "could not fence the site portal's last holder (its volumes' claims fence it)")
                }
            });
            true
        }
        Ok(None) => false,
        Err(e) => {
            tracing::warn!(error = %e, "could not take the site portal from its holder");
            false
        }
    }
}

async fn release(pool: &Arc<ferry_rbd::Pool>, object: &str, cookie: &str) {
    let (p, o, c) = (pool.clone(), object.to_string(), cookie.to_string());
    if let Err(e) = in_cluster(CALL_LIMIT, move || p.release_lease(&o, LOCK_NAME, &c)).await {
        tracing::warn!(object, error = %e, "could not give back the site portal's lease (it runs out by itself)");
    }
}

/// The address and listener of a held site portal.
struct Held {
    /// Whether this gateway added the address (and so removes it).
    added: bool,
    serving: CancellationToken,
}

impl Held {
    fn start(
        portal: &SitePortal,
        index: usize,
        state: &Arc<ServerState>,
        shutdown: &CancellationToken,
    ) -> Result<Held, String> {
        let listener =
            listen(portal.addr).map_err(|e| format!("listening on {}: {e}", portal.addr))?;
        let added = !is_local(*portal.addr.ip());
        if added {
            portal.address("add")?;
        }
        if let Err(e) = announce(&portal.device, *portal.addr.ip()) {
            tracing::warn!(portal = %portal.addr, error = %e, "could not announce the site portal's address (neighbours learn it when their ARP entries age)");
        }
        let serving = shutdown.child_token();
        tokio::spawn(crate::iscsi::serve(
            listener,
            index,
            state.clone(),
            serving.clone(),
        ));
        Ok(Held { added, serving })
    }

    fn stop(self, portal: &SitePortal) {
        self.serving.cancel();
        if self.added {
            if let Err(e) = portal.address("del") {
                tracing::error!(portal = %portal.addr, error = %e, "could not remove the site portal's address");
            }
        }
    }
}

/// A listener on `addr` even before the address is this machine's
/// (IP_FREEBIND), so it answers the moment the address is added.
fn listen(addr: SocketAddrV4) -> std::io::Result<tokio::net::TcpListener> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    s.set_reuse_address(true)?;
    s.set_freebind_v4(true)?;
    s.set_nonblocking(true)?;
    s.bind(&SocketAddr::V4(addr).into())?;
    s.listen(1024)?;
    tokio::net::TcpListener::from_std(s.into())
}

/// Whether `ip` is already an address of this machine (network namespace).
fn is_local(ip: Ipv4Addr) -> bool {
    std::net::TcpListener::bind(SocketAddrV4::new(ip, 0)).is_ok()
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("running ip {}: {e}", args.join(" ")))?;
    if !out.status.success() {
        return Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// Tell the link's neighbours that `ip` is now at this interface: three
/// gratuitous ARP requests (sender and target both `ip`), broadcast.
fn announce(device: &str, ip: Ipv4Addr) -> Result<(), String> {
    let mac_text = std::fs::read_to_string(format!("/sys/class/net/{device}/address"))
        .map_err(|e| format!("{device}'s hardware address: {e}"))?;
    let mac: Vec<u8> = mac_text
        .trim()
        .split(':')
        .filter_map(|h| u8::from_str_radix(h, 16).ok())
        .collect();
    let Ok(mac) = <[u8; 6]>::try_from(mac) else {
        return Err(format!(
            "{device} has no Ethernet address ({})",
            mac_text.trim()
        ));
    };
    let frame = gratuitous_arp(mac, ip);
    let name = std::ffi::CString::new(device).map_err(|e| e.to_string())?;
    // SAFETY: a NUL-terminated name; the call only reads it.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if ifindex == 0 {
        return Err(format!("no interface {device}"));
    }
    let sock = socket2::Socket::new(
        socket2::Domain::PACKET,
        socket2::Type::RAW,
        Some(socket2::Protocol::from(i32::from(ETH_P_ARP.to_be()))),
    )
    .map_err(|e| format!("a packet socket: {e}"))?;
    // SAFETY: sockaddr_ll is plain data; zeroed is a valid value, then
    // the fields the kernel reads are set.
    let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    to.sll_family = u16::try_from(libc::AF_PACKET).unwrap_or_default();
    to.sll_protocol = ETH_P_ARP.to_be();
    to.sll_ifindex = i32::try_from(ifindex).unwrap_or_default();
    to.sll_halen = 6;
    to.sll_addr[..6].copy_from_slice(&[0xff; 6]);
    let len = u32::try_from(std::mem::size_of::<libc::sockaddr_ll>()).unwrap_or_default();
    for _ in 0..3 {
        // SAFETY: a packet socket we own, a buffer of the given length, and
        // a sockaddr_ll of the given length.
        let r = unsafe {
            libc::sendto(
                std::os::fd::AsRawFd::as_raw_fd(&sock),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                std::ptr::addr_of!(to).cast(),
                len,
            )
        };
        if r < 0 {
            return Err(format!(
                "sending on {device}: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

const ETH_P_ARP: u16 = 0x0806;

/// An Ethernet frame carrying an ARP request for `ip` from `ip` at `mac`,
/// to everyone.
fn gratuitous_arp(mac: [u8; 6], ip: Ipv4Addr) -> Vec<u8> {
    let mut f = Vec::with_capacity(42);
    f.extend_from_slice(&[0xff; 6]);
    f.extend_from_slice(&mac);
    f.extend_from_slice(&ETH_P_ARP.to_be_bytes());
    f.extend_from_slice(&[0, 1, 0x08, 0x00, 6, 4, 0, 1]);
    f.extend_from_slice(&mac);
    f.extend_from_slice(&ip.octets());
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&ip.octets());
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gratuitous_arp_names_the_address_as_sender_and_target() {
        let mac = [2, 0, 0, 0, 0, 7];
        let f = gratuitous_arp(mac, Ipv4Addr::new(10, 1, 2, 3));
        assert_eq!(f.len(), 42);
        assert_eq!(&f[..6], &[0xff; 6], "broadcast");
        assert_eq!(&f[6..12], &mac);
        assert_eq!(&f[12..14], &[0x08, 0x06], "ARP");
        assert_eq!(&f[20..22], &[0, 1], "a request");
        assert_eq!(&f[22..28], &mac);
        assert_eq!(&f[28..32], &[10, 1, 2, 3]);
        assert_eq!(&f[38..42], &[10, 1, 2, 3]);
    }

    #[test]
    fn a_site_portal_needs_ipv4_a_device_and_shared_gateways() {
        let mut c = crate::config::Config::default();
        assert!(SitePortal::from_config(&c).unwrap().is_none());
        c.iscsi.site_portal = "10.0.0.9:3260".into();
        let e = SitePortal::from_config(&c).unwrap_err();
        assert!(e.contains("site_portal_device"), "{e}");
        c.iscsi.site_portal_device = "eth0".into();
        let e = SitePortal::from_config(&c).unwrap_err();
        assert!(e.contains("shared gateways"), "{e}");
        c.storage.ceph = Some(crate::config::CephConfig {
            shared: true,
            ..Default::default()
        });
        let p = SitePortal::from_config(&c).unwrap().unwrap();
        assert_eq!(p.object(), "ferry.site-portal.10.0.0.9_3260");
        c.iscsi.site_portal = "[fd00::9]:3260".into();
        let e = SitePortal::from_config(&c).unwrap_err();
        assert!(e.contains("IPv6"), "{e}");
        c.iscsi.site_portal = "127.0.0.1:3260".into();
        assert!(SitePortal::from_config(&c).is_err());
        c.iscsi.site_portal = "10.0.0.9:3260".into();
        c.iscsi.site_portal_prefix = 33;
        assert!(SitePortal::from_config(&c).is_err());
    }
}
