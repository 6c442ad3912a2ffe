//! What the operator tells the controller about the sites: their hosts
//! (control API and move listener), their storage daemons (NBD, migration
//! listener, admin API), and the links between sites. With the hosts'
//! measurements it becomes a [`Cluster`](crate::Cluster) snapshot.

use crate::cluster::{Host, Link, Site};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostRef {
    /// `ferry host --control`.
    pub control: String,
    /// `ferry host --move-listen`, as other sites reach it.
    pub moves: String,
    /// vCPUs it runs guests on (absent: the site's share, its CPUs split
    /// evenly among its hosts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    /// Guest memory it can hold, MiB (absent: not limited).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StorageRef {
    /// NBD address guests' disks name (`--disk VOLUME@NBD`), as hosts of
    /// other sites reach it.
    pub nbd: String,
    /// NBD address as hosts of its own site reach it, when that differs:
    /// a guest moved to this site is told to use it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_local: Option<String>,
    /// Migration listener, as other sites reach it.
    pub migrate: String,
    pub admin: String,
    /// The Ceph cluster this daemon is a shared gateway of (a name the
    /// operator chooses): daemons of one site naming the same cluster are
    /// one storage, any of them serving any of its volumes (`ferry serve
    /// --ceph-shared`), so a move to it may go through any that answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
}

impl StorageRef {
    pub fn serves(&self, addr: &str) -> bool {
        self.nbd == addr || self.nbd_local.as_deref() == Some(addr)
    }

    /// The address a host at `host_site` uses, this daemon being at `site`.
    pub fn nbd_from(&self, site: &str, host_site: &str) -> &str {
        match &self.nbd_local {
            Some(l) if site == host_site => l,
            _ => &self.nbd,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SiteInventory {
    pub name: String,
    pub cpu_capacity: f64,
    pub hosts: Vec<HostRef>,
    pub storage: Vec<StorageRef>,
    /// Guest networks (`ferry host --network NAME,...`) whose clients are
    /// at this site: a guest on one of them that runs elsewhere makes
    /// those clients wait across the link (a cost the policies weigh).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clients: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Inventory {
    pub sites: Vec<SiteInventory>,
    pub links: Vec<Link>,
}

impl Inventory {
    pub fn sites(&self) -> Vec<Site> {
        self.sites
            .iter()
            .map(|s| Site {
                name: s.name.clone(),
                cpu_capacity: s.cpu_capacity,
            })
            .collect()
    }

    /// Every site's hosts with what each can run.
    pub fn hosts(&self) -> Vec<Host> {
        let mut out = Vec::new();
        for s in &self.sites {
            #[allow(clippy::cast_precision_loss)]
            let share = s.cpu_capacity / s.hosts.len().max(1) as f64;
            for h in &s.hosts {
                #[allow(clippy::cast_precision_loss)]
                out.push(Host {
                    name: h.control.clone(),
                    site: s.name.clone(),
                    cpu_capacity: h.cpus.unwrap_or(share),
                    memory_bytes: h.memory_mib.map(|m| (m << 20) as f64),
                });
            }
        }
        out
    }

    /// The host of `site` whose control API is `control`.
    pub fn host(&self, site: &str, control: &str) -> Option<&HostRef> {
        self.site(site)?.hosts.iter().find(|h| h.control == control)
    }

    /// The host of `site` a placement chose (by its control API), else,
    /// when it chose none (the snapshot lists no hosts of the site), the
    /// site's first; or why there is none.
    pub fn chosen_host(&self, site: &str, chosen: Option<&str>) -> Result<&HostRef, String> {
        let s = self
            .site(site)
            .ok_or_else(|| format!("unknown site {site}"))?;
        match chosen {
            Some(h) => s
                .hosts
                .iter()
                .find(|x| x.control == h)
                .ok_or_else(|| format!("site {site} has no host {h}")),
            None => s
                .hosts
                .first()
                .ok_or_else(|| format!("site {site} has no host")),
        }
    }

    /// The site whose storage daemon serves NBD at `addr`.
    pub fn site_of_storage(&self, addr: &str) -> Option<&SiteInventory> {
        self.sites
            .iter()
            .find(|s| s.storage.iter().any(|x| x.serves(addr)))
    }

    /// The storage daemon serving NBD at `addr` (either of its addresses).
    pub fn storage_at(&self, addr: &str) -> Option<(&SiteInventory, &StorageRef)> {
        self.sites
            .iter()
            .find_map(|s| s.storage.iter().find(|x| x.serves(addr)).map(|x| (s, x)))
    }

    /// `st` (a daemon of `site`) and, after it, the other gateways of its
    /// Ceph cluster at that site: where a move to `st` may go instead.
    pub fn gateways_of<'a>(&'a self, site: &str, st: &'a StorageRef) -> Vec<&'a StorageRef> {
        let mut out = vec![st];
        if let (Some(c), Some(s)) = (&st.cluster, self.site(site)) {
            out.extend(
                s.storage
                    .iter()
                    .filter(|x| x.cluster.as_ref() == Some(c) && x.nbd != st.nbd),
            );
        }
        out
    }

    /// The site where the clients of guest network `network` are, when
    /// the operator said.
    pub fn clients_of(&self, network: &str) -> Option<&str> {
        self.sites
            .iter()
            .find(|s| s.clients.iter().any(|n| n == network))
            .map(|s| s.name.as_str())
    }

    pub fn site(&self, name: &str) -> Option<&SiteInventory> {
        self.sites.iter().find(|s| s.name == name)
    }

    /// Refuse an inventory with unknown or missing parts.
    pub fn validate(&self) -> Result<(), String> {
        if self.sites.is_empty() {
            return Err("the inventory names no site".into());
        }
        for s in &self.sites {
            for n in &s.clients {
                if let Some(other) = self.clients_of(n).filter(|o| *o != s.name) {
                    return Err(format!(
                        "the clients of network {n} are placed at two sites, {other} and {}",
                        s.name
                    ));
                }
            }
        }
        for l in &self.links {
            for s in [&l.a, &l.b] {
                if self.site(s).is_none() {
                    return Err(format!("link {}-{}: unknown site {s}", l.a, l.b));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_networks_clients_are_at_one_site_only() {
        let site = |n: &str, clients: &[&str]| SiteInventory {
            name: n.into(),
            cpu_capacity: 4.0,
            hosts: vec![],
            storage: vec![],
            clients: clients.iter().map(ToString::to_string).collect(),
        };
        let mut inv = Inventory {
            sites: vec![site("home", &["lan", "web"]), site("cloud", &["dmz"])],
            links: vec![],
        };
        assert_eq!(inv.validate(), Ok(()));
        assert_eq!(inv.clients_of("web"), Some("home"));
        assert_eq!(inv.clients_of("dmz"), Some("cloud"));
        assert_eq!(inv.clients_of("backup"), None);
        inv.sites[1].clients.push("lan".into());
        let e = inv.validate().unwrap_err();
        assert!(e.contains("network lan") && e.contains("two sites"), "{e}");
        // An inventory saved before sites named clients reads back.
        let old: SiteInventory =
            serde_json::from_str(r#"{"name": "a", "cpu_capacity": 1, "hosts": [], "storage": []}"#)
                .unwrap();
        assert!(old.clients.is_empty());
    }
}
