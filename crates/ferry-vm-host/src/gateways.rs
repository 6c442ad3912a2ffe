//! The gateways of one site in front of one Ceph cluster as `ferry host
//! --gateways` names them: each one's NBD address (where the forwarder
//! goes when another does not answer) and, when given, its admin API
//! (where a move of a disk it serves starts when the gateway the guest's
//! spec names is gone).

use std::str::FromStr;

/// One gateway: `NBD_HOST:PORT[@ADMIN_HOST:PORT]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayRef {
    pub nbd: String,
    pub admin: Option<String>,
}

fn host_port(what: &str, s: &str) -> Result<String, String> {
    match s.rsplit_once(':') {
        Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0) => Ok(s.into()),
        _ => Err(format!("{what} {s:?}: expected HOST:PORT")),
    }
}

impl FromStr for GatewayRef {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (nbd, admin) = match s.split_once('@') {
            Some((n, a)) => (n, Some(host_port("admin address", a.trim())?)),
            None => (s, None),
        };
        Ok(GatewayRef {
            nbd: host_port("gateway", nbd.trim())?,
            admin,
        })
    }
}

/// Every group of gateways the host knows (one per site and cluster).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GatewayGroups(pub Vec<Vec<GatewayRef>>);

impl GatewayGroups {
    /// One `--gateways` value (comma-separated members) added as a group.
    pub fn add_group(&mut self, s: &str) -> Result<(), String> {
        let g = s
            .split(',')
            .map(str::trim)
            .filter(|m| !m.is_empty())
            .map(GatewayRef::from_str)
            .collect::<Result<Vec<_>, _>>()?;
        if g.is_empty() {
            return Err(format!("--gateways {s:?} names no gateway"));
        }
        self.0.push(g);
        Ok(())
    }

    /// The groups by NBD address, as the forwarder follows them.
    pub fn nbd_groups(&self) -> Vec<Vec<String>> {
        self.0
            .iter()
            .map(|g| g.iter().map(|m| m.nbd.clone()).collect())
            .collect()
    }

    /// Every member's NBD address.
    pub fn nbd_addresses(&self) -> impl Iterator<Item = &str> {
        self.0.iter().flatten().map(|m| m.nbd.as_str())
    }

    /// The gateways that may stand in for the one at `admin` (or serving
    /// NBD at `server`) for a move: the others of its group with an admin
    /// address, the one the forwarder uses now (`current`) first.
    pub fn stand_ins(
        &self,
        server: &str,
        admin: Option<&str>,
        current: Option<&str>,
    ) -> Vec<&GatewayRef> {
        let is_it =
            |m: &GatewayRef| m.nbd == server || (admin.is_some() && m.admin.as_deref() == admin);
        let Some(g) = self.0.iter().find(|g| g.iter().any(is_it)) else {
            return Vec::new();
        };
        let mut out: Vec<&GatewayRef> = g
            .iter()
            .filter(|m| m.admin.is_some() && m.admin.as_deref() != admin)
            .collect();
        out.sort_by_key(|m| Some(m.nbd.as_str()) != current);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gateways_are_read_with_their_admin_addresses_and_bad_ones_are_refused() {
        let mut gs = GatewayGroups::default();
        gs.add_group("10.0.0.1:10809@10.0.0.1:10880, 10.0.0.2:10809@10.0.0.2:10880,10.0.0.3:10809")
            .unwrap();
        gs.add_group("10.1.0.1:10809").unwrap();
        assert_eq!(
            gs.nbd_groups(),
            [
                vec!["10.0.0.1:10809", "10.0.0.2:10809", "10.0.0.3:10809"],
                vec!["10.1.0.1:10809"]
            ]
        );
        assert_eq!(gs.nbd_addresses().count(), 4);
        for bad in ["", "x", "a:b:c:0", "10.0.0.1:10809@nowhere", "@1.2.3.4:5"] {
            assert!(
                GatewayGroups::default().add_group(bad).is_err(),
                "{bad:?} accepted"
            );
        }
        // The disk's gateway (by NBD or admin address) is gone: the others
        // of its group with an admin address stand in, the forwarder's
        // current one first; a server of no group has none.
        let admins = |v: Vec<&GatewayRef>| -> Vec<String> {
            v.iter().filter_map(|m| m.admin.clone()).collect()
        };
        assert_eq!(
            admins(gs.stand_ins("10.0.0.1:10809", Some("10.0.0.1:10880"), None)),
            ["10.0.0.2:10880"]
        );
        assert_eq!(
            admins(gs.stand_ins(
                "elsewhere:1",
                Some("10.0.0.2:10880"),
                Some("10.0.0.1:10809")
            )),
            ["10.0.0.1:10880"]
        );
        assert!(gs
            .stand_ins("10.9.9.9:10809", Some("10.9.9.9:10880"), None)
            .is_empty());
        let mut three = GatewayGroups::default();
        three.add_group("a:1@a:2,b:1@b:2,c:1@c:2").unwrap();
        assert_eq!(
            admins(three.stand_ins("a:1", Some("a:2"), Some("c:1"))),
            ["c:2", "b:2"]
        );
    }
}
