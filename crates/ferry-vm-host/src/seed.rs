//! A guest's cloud-init seed disk (the NoCloud data source): a small FAT
//! file system labelled `CIDATA` with `meta-data`, `user-data` and, when
//! given, `network-config`, attached read-only. Written from the spec at
//! every start of the guest's QEMU, the same bytes on every host (fixed
//! volume id, no timestamps), so a moving guest's destination builds the
//! very disk the source had instead of receiving it.

use std::io::{Cursor, Write};
use std::net::IpAddr;

use ferry_api::{CloudInit, NicAddress};

/// The most a seed may carry (user-data, network-config and meta-data
/// together); clouds cap user-data at 16-64 KiB.
pub const MAX_SEED_BYTES: usize = 1 << 20;

/// The file system label cloud-init looks for.
const LABEL: [u8; 11] = *b"CIDATA     ";

/// Fixed, so that every host writes the same disk.
const VOLUME_ID: u32 = 0x6665_7279;

/// Why a seed cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    #[error("cloud-init: {0}")]
    Invalid(String),
    #[error("cloud-init seed: {0}")]
    Write(#[from] std::io::Error),
}

/// Refuse what cloud-init would choke on or ferry could not seed.
/// `cards` is how many network cards the guest has.
pub fn check(guest: &str, ci: &CloudInit, cards: usize) -> Result<(), SeedError> {
    let bad = |m: String| Err(SeedError::Invalid(m));
    if ci.network_config.is_some() && !ci.addresses.is_empty() {
        return bad("give a network-config or addresses, not both".into());
    }
    if ci.addresses.len() > cards {
        return bad(format!(
            "{} addresses for {cards} network card(s)",
            ci.addresses.len()
        ));
    }
    for a in &ci.addresses {
        parse_address(a).map_err(SeedError::Invalid)?;
    }
    if ci.user_data.trim().is_empty() {
        return bad("user-data is empty".into());
    }
    let first = ci.user_data.lines().next().unwrap_or("");
    if !(first.starts_with("#cloud-config") || first.starts_with("#!")) {
        return bad(format!(
            "user-data must start with #cloud-config or #! (it starts with {first:?})"
        ));
    }
    if ci
        .network_config
        .as_deref()
        .is_some_and(|n| n.trim().is_empty())
    {
        return bad("network-config is empty".into());
    }
    let host = hostname(guest, ci);
    if !valid_hostname(host) {
        return bad(format!(
            "host name {host:?}: letters, digits and '-' in dot-separated labels of 1-63, at most 253 in all"
        ));
    }
    let total = meta_data(guest, ci).len()
        + 200 * ci.addresses.len()
        + ci.user_data.len()
        + ci.network_config.as_ref().map_or(0, String::len);
    if total > MAX_SEED_BYTES {
        return bad(format!(
            "{total} bytes of configuration: at most {MAX_SEED_BYTES}"
        ));
    }
    Ok(())
}

/// `ADDR/PREFIX` and the gateway, checked; whether it is IPv6.
fn parse_address(a: &NicAddress) -> Result<bool, String> {
    let bad = || format!("address {:?}: expected ADDR/PREFIX", a.address);
    let (ip, prefix) = a.address.split_once('/').ok_or_else(bad)?;
    let ip: IpAddr = ip.parse().map_err(|_| bad())?;
    let prefix: u8 = prefix.parse().map_err(|_| bad())?;
    if prefix > if ip.is_ipv6() { 128 } else { 32 } {
        return Err(format!("address {:?}: prefix too long", a.address));
    }
    if let Some(g) = &a.gateway {
        let g: IpAddr = g
            .parse()
            .map_err(|_| format!("gateway {g:?} is not an IP address"))?;
        if g.is_ipv6() != ip.is_ipv6() {
            return Err(format!("gateway {g} is not of {}'s family", a.address));
        }
    }
    Ok(ip.is_ipv6())
}

/// `network-config` (version 2) for `ci.addresses`: each card found by
/// its MAC, whatever the guest's kernel names it.
pub fn network_config(ci: &CloudInit, macs: &[String]) -> Option<String> {
    if ci.addresses.is_empty() {
        return None;
    }
    let mut ethernets = serde_json::Map::new();
    for (i, (a, mac)) in ci.addresses.iter().zip(macs).enumerate() {
        let mut card = serde_json::json!({
            "match": {"macaddress": mac},
            "addresses": [a.address],
        });
        if let Some(g) = &a.gateway {
            let key = if parse_address(a).unwrap_or(false) {
                "gateway6"
            } else {
                "gateway4"
            };
            card[key] = g.clone().into();
        }
        ethernets.insert(format!("nic{i}"), card);
    }
    // JSON is YAML: cloud-init reads it as it is.
    Some(serde_json::json!({"version": 2, "ethernets": ethernets}).to_string() + "\n")
}

fn hostname<'a>(guest: &'a str, ci: &'a CloudInit) -> &'a str {
    ci.hostname.as_deref().unwrap_or(guest)
}

fn valid_hostname(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 253
        && h.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        })
}

/// `meta-data`: the instance id (the guest's name, so first-boot steps run
/// once per guest) and its host name.
pub fn meta_data(guest: &str, ci: &CloudInit) -> String {
    // JSON strings are YAML strings: the name cannot break the document.
    let q = |s: &str| serde_json::Value::String(s.into()).to_string();
    format!(
        "instance-id: {}\nlocal-hostname: {}\n",
        q(guest),
        q(hostname(guest, ci))
    )
}

/// The seed disk's bytes for guest `guest` whose cards have `macs`.
pub fn image(guest: &str, ci: &CloudInit, macs: &[String]) -> Result<Vec<u8>, SeedError> {
    check(guest, ci, macs.len())?;
    let meta = meta_data(guest, ci);
    let net = network_config(ci, macs);
    let mut files: Vec<(&str, &[u8])> = vec![
        ("meta-data", meta.as_bytes()),
        ("user-data", ci.user_data.as_bytes()),
    ];
    if let Some(n) = ci.network_config.as_ref().or(net.as_ref()) {
        files.push(("network-config", n.as_bytes()));
    }
    let content: usize = files.iter().map(|(_, b)| b.len()).sum();
    // Room for the content, the FATs and the clusters' slack; whole MiB.
    let size = (content + (512 << 10)).div_ceil(1 << 20) * (1 << 20);
    let mut disk = Cursor::new(vec![0u8; size]);
    fatfs::format_volume(
        &mut disk,
        fatfs::FormatVolumeOptions::new()
            .volume_label(LABEL)
            .volume_id(VOLUME_ID),
    )?;
    {
        let fs = fatfs::FileSystem::new(&mut disk, fatfs::FsOptions::new())?;
        for (name, bytes) in files {
            let mut f = fs.root_dir().create_file(name)?;
            f.truncate()?;
            f.write_all(bytes)?;
            f.flush()?;
        }
        fs.unmount()?;
    }
    Ok(disk.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn ci() -> CloudInit {
        CloudInit {
            hostname: Some("db-1".into()),
            user_data: "#cloud-config\nruncmd:\n  - [touch, /ran]\n".into(),
            network_config: Some("version: 2\nethernets: {}\n".into()),
            addresses: Vec::new(),
        }
    }

    const MACS: &[String] = &[];

    fn read(img: &[u8], name: &str) -> String {
        let fs =
            fatfs::FileSystem::new(Cursor::new(img.to_vec()), fatfs::FsOptions::new()).unwrap();
        let mut s = String::new();
        fs.root_dir()
            .open_file(name)
            .unwrap()
            .read_to_string(&mut s)
            .unwrap();
        s
    }

    #[test]
    fn the_seed_holds_the_three_files_under_the_cidata_label() {
        let img = image("g1", &ci(), MACS).unwrap();
        assert_eq!(img.len(), 1 << 20);
        let fs = fatfs::FileSystem::new(Cursor::new(img.clone()), fatfs::FsOptions::new()).unwrap();
        assert_eq!(fs.volume_label(), "CIDATA");
        assert_eq!(
            read(&img, "meta-data"),
            "instance-id: \"g1\"\nlocal-hostname: \"db-1\"\n"
        );
        assert_eq!(read(&img, "user-data"), ci().user_data);
        assert_eq!(read(&img, "network-config"), "version: 2\nethernets: {}\n");
    }

    #[test]
    fn every_host_writes_the_same_bytes() {
        assert_eq!(
            image("g1", &ci(), MACS).unwrap(),
            image("g1", &ci(), MACS).unwrap()
        );
        assert_ne!(
            image("g1", &ci(), MACS).unwrap(),
            image("g2", &ci(), MACS).unwrap()
        );
    }

    #[test]
    fn a_big_configuration_gets_a_bigger_disk() {
        let mut c = ci();
        c.user_data = format!("#cloud-config\n# {}\n", "x".repeat(900 << 10));
        let img = image("g1", &c, MACS).unwrap();
        assert_eq!(img.len(), 2 << 20);
        assert_eq!(read(&img, "user-data"), c.user_data);
    }

    #[test]
    fn bad_configurations_are_refused_with_the_reason() {
        let e = |c: CloudInit| image("g1", &c, MACS).unwrap_err().to_string();
        let mut c = ci();
        c.user_data = "runcmd: []".into();
        assert!(e(c).contains("#cloud-config or #!"));
        let mut c = ci();
        c.user_data = " \n".into();
        assert!(e(c).contains("user-data is empty"));
        let mut c = ci();
        c.hostname = Some("bad_name".into());
        assert!(e(c).contains("host name \"bad_name\""));
        let mut c = ci();
        c.hostname = Some("-x".into());
        assert!(e(c).contains("host name"));
        let mut c = ci();
        c.network_config = Some(String::new());
        assert!(e(c).contains("network-config is empty"));
        let mut c = ci();
        c.user_data = format!("#cloud-config\n{}", "x".repeat(MAX_SEED_BYTES));
        assert!(e(c).contains("at most"));
        // The guest's own name is its host name when none is given.
        let mut c = ci();
        c.hostname = None;
        assert!(image("web.example", &c, MACS).is_ok());
        assert!(image("web_1", &c, MACS).is_err());
    }

    #[test]
    fn addresses_become_a_network_config_matching_the_cards_macs() {
        let mut c = ci();
        c.network_config = None;
        c.addresses = vec![
            NicAddress {
                address: "10.1.0.5/24".into(),
                gateway: Some("10.1.0.1".into()),
            },
            NicAddress {
                address: "fd00::5/64".into(),
                gateway: None,
            },
        ];
        let macs = vec![
            "52:54:00:00:00:01".to_string(),
            "52:54:00:00:00:02".to_string(),
        ];
        let img = image("g1", &c, &macs).unwrap();
        let n: serde_json::Value = serde_json::from_str(&read(&img, "network-config")).unwrap();
        assert_eq!(n["version"], 2);
        assert_eq!(
            n["ethernets"]["nic0"]["match"]["macaddress"],
            "52:54:00:00:00:01"
        );
        assert_eq!(n["ethernets"]["nic0"]["addresses"][0], "10.1.0.5/24");
        assert_eq!(n["ethernets"]["nic0"]["gateway4"], "10.1.0.1");
        assert_eq!(n["ethernets"]["nic1"]["addresses"][0], "fd00::5/64");
        // More addresses than cards, bad addresses, both forms at once.
        let e = |c: &CloudInit, macs: &[String]| image("g1", c, macs).unwrap_err().to_string();
        assert!(e(&c, &macs[..1]).contains("2 addresses for 1 network card(s)"));
        let mut b = c.clone();
        b.addresses[0].address = "10.1.0.5".into();
        assert!(e(&b, &macs).contains("expected ADDR/PREFIX"));
        b.addresses[0].address = "10.1.0.5/33".into();
        assert!(e(&b, &macs).contains("prefix too long"));
        b.addresses[0].address = "10.1.0.5/24".into();
        b.addresses[0].gateway = Some("fd00::1".into());
        assert!(e(&b, &macs).contains("family"));
        let mut b = c.clone();
        b.network_config = Some("version: 2\n".into());
        assert!(e(&b, &macs).contains("not both"));
    }

    /// Linux's own tools see a FAT file system labelled CIDATA, with no
    /// errors (what cloud-init's ds-identify and mount rely on).
    #[test]
    fn blkid_and_fsck_accept_the_seed() {
        let have = |t: &str| {
            std::process::Command::new("sh")
                .args(["-c", &format!("command -v {t}")])
                .output()
                .is_ok_and(|o| o.status.success())
        };
        if !(have("blkid") && have("fsck.vfat")) {
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("seed.img");
        std::fs::write(&p, image("g1", &ci(), MACS).unwrap()).unwrap();
        let out = std::process::Command::new("blkid")
            .args(["-p", "-o", "export"])
            .arg(&p)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("LABEL=CIDATA") && text.contains("TYPE=vfat"),
            "{text}"
        );
        let out = std::process::Command::new("fsck.vfat")
            .arg("-n")
            .arg(&p)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
