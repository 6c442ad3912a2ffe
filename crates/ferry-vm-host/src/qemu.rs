//! The QEMU command line of a guest (pure: spec and paths in, arguments
//! out), the accelerator choice, and the checks made before anything
//! starts.

use ferry_api::{Accel, Boot, VmSpec};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The QEMU binary (override with `FERRY_QEMU`).
pub fn qemu_binary() -> String {
    std::env::var("FERRY_QEMU").unwrap_or_else(|_| "qemu-system-x86_64".into())
}

/// Whether QEMU runs here at all (`--version`).
pub fn qemu_available() -> bool {
    Command::new(qemu_binary())
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether KVM really runs guests here: `/dev/kvm` opens, and a QEMU
/// with the CPU model guests get (`-cpu host`) stays up for a second
/// (nested or partial KVM can open the device yet fail at the first vCPU
/// reset). Probed once per process.
pub fn kvm_usable() -> bool {
    static USABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *USABLE.get_or_init(|| {
        let opens = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/kvm")
            .is_ok();
        opens && probe_kvm()
    })
}

fn probe_kvm() -> bool {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(qemu_binary());
    cmd.args(["-accel", "kvm", "-M", "q35", "-cpu", "host", "-m", "32"])
        .args(["-nodefaults", "-display", "none", "-S"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // The probe must not outlive a daemon stopped during its 1.5 s: it
    // dies with the thread that started it, which waits for it below.
    // SAFETY: prctl is async-signal-safe and touches no memory of ours.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let Ok(mut child) = cmd.spawn() else {
        return false;
    };
    let t = std::time::Instant::now();
    while t.elapsed() < std::time::Duration::from_millis(1500) {
        if let Ok(Some(_)) = child.try_wait() {
            tracing::info!("KVM is present but does not run guests here; using TCG");
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    true
}

/// The accelerator a request resolves to on this host.
pub fn resolve_accel(want: Accel) -> Result<&'static str, String> {
    match want {
        Accel::Tcg => Ok("tcg"),
        Accel::Kvm if kvm_usable() => Ok("kvm"),
        Accel::Kvm => Err("KVM was asked for but /dev/kvm is not usable on this host".into()),
        Accel::Auto if kvm_usable() => Ok("kvm"),
        Accel::Auto => Ok("tcg"),
    }
}

/// Files of one guest on the host.
#[derive(Debug, Clone)]
pub struct GuestPaths {
    pub dir: PathBuf,
    pub qmp: PathBuf,
    pub serial: PathBuf,
    pub pidfile: PathBuf,
    /// The cloud-init seed disk (`crate::seed`), when the spec has one.
    pub seed: PathBuf,
    /// QEMU's end of an incoming move (`migrate-incoming unix:...`).
    pub incoming: PathBuf,
    /// The source's end of an outgoing move.
    pub outgoing: PathBuf,
    /// The directory of those two sockets (the guest's own directory, or
    /// its confined socket directory).
    pub sockets: PathBuf,
    /// The user QEMU runs as (`-runas`), if it is confined.
    pub qemu_user: Option<crate::confine::QemuUser>,
}

impl GuestPaths {
    /// The files of the guest in `dir`; with `confined`, its move sockets
    /// are in that directory, for that user (`crate::confine`).
    pub fn new(dir: &Path, confined: Option<(PathBuf, crate::confine::QemuUser)>) -> GuestPaths {
        let (sockets, qemu_user) = match confined {
            Some((s, u)) => (s, Some(u)),
            None => (dir.to_path_buf(), None),
        };
        GuestPaths {
            dir: dir.to_path_buf(),
            qmp: dir.join("qmp.sock"),
            serial: dir.join("serial.log"),
            pidfile: dir.join("qemu.pid"),
            seed: dir.join("cloud-init.img"),
            incoming: sockets.join("in.sock"),
            outgoing: sockets.join("out.sock"),
            sockets,
            qemu_user,
        }
    }
}

/// A kernel or initrd QEMU is given must be a file inside one of the
/// host's image directories (links resolved first): a caller cannot boot
/// a guest from any file of the host (its TLS key read as an initrd).
pub fn boot_files_allowed(spec: &VmSpec, dirs: &[PathBuf]) -> Result<(), String> {
    let Boot::Kernel { kernel, initrd, .. } = &spec.boot else {
        return Ok(());
    };
    for f in std::iter::once(kernel).chain(initrd.iter()) {
        let real =
            std::fs::canonicalize(f).map_err(|e| format!("boot file {}: {e}", f.display()))?;
        let inside = dirs
            .iter()
            .filter_map(|d| std::fs::canonicalize(d).ok())
            .any(|d| real.starts_with(&d) && real != d);
        if !inside {
            return Err(format!(
                "boot file {} is outside this host's image directories ({}); \
                 copy it there, or start `ferry host` with --image-dir",
                f.display(),
                dirs.iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
    }
    Ok(())
}

/// QEMU's system-call filter (seccomp): obsolete calls, new processes
/// (fork, exec) and changes to resource limits, priorities and affinities
/// are denied. ferry starts QEMU detached itself rather than with
/// `-daemonize`, which forks after the filter is on. `elevateprivileges`
/// stays allowed: `-runas` calls setgid and setuid after it too.
pub const SANDBOX: &str = "on,obsolete=deny,spawn=deny,resourcecontrol=deny";

/// Limits a spec must fall within.
pub const MIN_MEMORY_MIB: u64 = 32;
pub const MAX_VCPUS: u32 = 256;

/// Check a spec before anything is started; `host_mib` is the host's RAM.
pub fn validate(spec: &VmSpec, host_mib: u64) -> Result<(), String> {
    let name_ok = !spec.name.is_empty()
        && spec.name.len() <= 64
        && spec
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        && !spec.name.starts_with('.');
    if !name_ok {
        return Err(format!(
            "guest name {:?}: use 1-64 letters, digits, '-', '_' or '.'",
            spec.name
        ));
    }
    if spec.memory_mib < MIN_MEMORY_MIB {
        return Err(format!(
            "memory {} MiB is below the minimum of {MIN_MEMORY_MIB} MiB",
            spec.memory_mib
        ));
    }
    if host_mib > 0 && spec.memory_mib > host_mib {
        return Err(format!(
            "memory {} MiB is more than this host has ({host_mib} MiB)",
            spec.memory_mib
        ));
    }
    if spec.vcpus == 0 || spec.vcpus > MAX_VCPUS {
        return Err(format!(
            "vcpus {} is not within 1..={MAX_VCPUS}",
            spec.vcpus
        ));
    }
    if spec.disks.is_empty() && spec.boot == Boot::Disk {
        return Err("boot from disk needs at least one disk".into());
    }
    let mut seen = std::collections::BTreeSet::new();
    for d in &spec.disks {
        if d.volume.is_empty() || d.server.is_empty() {
            return Err("every disk needs a volume and a server".into());
        }
        if !seen.insert(&d.volume) {
            return Err(format!("volume {} is attached twice", d.volume));
        }
    }
    if spec.nics.len() > crate::network::MAX_NICS {
        return Err(format!(
            "{} network cards: at most {}",
            spec.nics.len(),
            crate::network::MAX_NICS
        ));
    }
    let mut macs = std::collections::BTreeSet::new();
    for n in &spec.nics {
        if n.network.is_empty() {
            return Err("every network card needs a network".into());
        }
        let mac = crate::network::check_mac(&n.mac).map_err(|e| e.to_string())?;
        if !macs.insert(mac) {
            return Err(format!("MAC {} is given to two cards", n.mac));
        }
    }
    if let Some(ci) = &spec.cloud_init {
        crate::seed::check(&spec.name, ci, spec.nics.len()).map_err(|e| e.to_string())?;
    }
    if let Boot::Kernel { kernel, initrd, .. } = &spec.boot {
        for f in std::iter::once(kernel).chain(initrd.iter()) {
            if !f.is_file() {
                return Err(format!("boot file {} does not exist", f.display()));
            }
        }
    }
    Ok(())
}

/// The memory this host can still give, in MiB (`MemAvailable`; 0 when
/// it cannot be read).
pub fn host_available_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb / 1024)
}

/// The host's memory in MiB (0 when it cannot be read).
pub fn host_memory_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb / 1024)
}

/// QEMU's `-m` for a guest of `memory_mib`.
///
/// Under TCG the guest gets 8 KiB more than asked. QEMU 7.2 syncs the
/// migration dirty bitmap of a RAM block whose size is a multiple of 64
/// pages by swapping whole bitmap words to zero without re-arming TCG's
/// write tracking (`TLB_NOTDIRTY`) in the vCPUs' TLBs; a page that stays in
/// a TLB (a hot kernel page under a global mapping) is then written
/// untracked, and the destination resumes with a stale copy of it (seen
/// here as guest panics right after moves whose memory copy waited on the
/// link: 14 to 58 pages differed between the stopped source and the
/// destination). For any other size QEMU clears page by page and re-arms
/// the TLBs, so every write is seen. KVM tracks writes itself.
pub fn memory_arg(memory_mib: u64, accel: &str) -> String {
    if accel == "tcg" {
        format!("{}K", memory_mib * 1024 + 8)
    } else {
        format!("{memory_mib}M")
    }
}

/// How a QEMU starts: booting the guest, or waiting for it to arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    Boot,
    /// Waits for a move (`-incoming defer`) and, once the guest's state
    /// has arrived, stays paused (`-S`) until the source confirms and this
    /// host records the arrival (`Finish`): a guest never runs here unless
    /// its source can no longer run it.
    Incoming,
    /// The same, running the guest as soon as QEMU says (post-copy, where
    /// the guest runs here while its memory still comes).
    IncomingPostcopy,
}

/// QEMU's arguments for `spec`. Disks are NBD exports on the forwarder's
/// unix socket `nbd`, reconnected for 30 s if the forwarder restarts. See
/// [`Start`] for an incoming guest. The host starts it detached
/// (`Guest::spawn_detached`), so it outlives the host daemon.
/// The disks' CHS geometry (the largest CHS disk's, what QEMU guesses
/// for any disk past 8 GB): given, so that QEMU does not read the disk to
/// guess it. Guests address their disks by LBA; the geometry only
/// answers an old BIOS call.
const GEOMETRY: &str = "cyls=16383,heads=16,secs=63";

pub fn command_line(
    spec: &VmSpec,
    accel: &str,
    paths: &GuestPaths,
    nbd: &Path,
    start: Start,
) -> Vec<String> {
    let mut a: Vec<String> = vec![
        "-name".into(),
        format!("guest={},debug-threads=on", spec.name),
        "-M".into(),
        "q35".into(),
        "-accel".into(),
        accel.into(),
        "-cpu".into(),
        if accel == "kvm" { "host" } else { "max" }.into(),
        "-m".into(),
        memory_arg(spec.memory_mib, accel),
        "-smp".into(),
        spec.vcpus.to_string(),
        "-nodefaults".into(),
        "-display".into(),
        "none".into(),
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", paths.qmp.display()),
        "-chardev".into(),
        format!("file,id=serial0,path={},append=on", paths.serial.display()),
        "-serial".into(),
        "chardev:serial0".into(),
        "-pidfile".into(),
        paths.pidfile.display().to_string(),
        "-sandbox".into(),
        SANDBOX.into(),
    ];
    if let Some(u) = &paths.qemu_user {
        // Everything QEMU opens after this is in `paths.sockets` or the
        // forwarder's confined NBD socket.
        a.push("-runas".into());
        a.push(u.name.clone());
    }
    // Diagnosis: FERRY_QEMU_TRACE=PATTERN[,PATTERN] turns on QEMU's trace
    // events matching them, logged to qemu-trace.log beside the guest.
    if let Ok(t) = std::env::var("FERRY_QEMU_TRACE") {
        for pat in t.split(',').filter(|p| !p.is_empty()) {
            a.push("-trace".into());
            a.push(format!("enable={pat}"));
        }
        a.push("-D".into());
        a.push(paths.dir.join("qemu-trace.log").display().to_string());
    }
    for (i, d) in spec.disks.iter().enumerate() {
        let node = serde_json::json!({
            "driver": "nbd",
            "node-name": format!("disk{i}"),
            "server": {"type": "unix", "path": nbd.display().to_string()},
            "export": d.volume,
            "reconnect-delay": 30,
        });
        a.push("-blockdev".into());
        a.push(node.to_string());
        a.push("-device".into());
        let boot = if i == 0 && spec.boot == Boot::Disk {
            ",bootindex=1"
        } else {
            ""
        };
        // A fixed geometry: without one QEMU reads the disk's first
        // sector at start to guess it from a partition table, and a move's
        // destination would then read the disk before the switch, from
        // where it was (or hang there, if it cannot reach that storage).
        a.push(format!(
            "virtio-blk-pci,drive=disk{i},id=vd{i},{GEOMETRY}{boot}"
        ));
    }
    for (i, n) in spec.nics.iter().enumerate() {
        // The tap the host plugged into the network's bridge before QEMU
        // started (`network::plug`); QEMU announces the guest's MAC on it
        // after an incoming move (virtio-net's guest announce).
        a.push("-netdev".into());
        a.push(format!(
            "tap,id=net{i},ifname={},script=no,downscript=no",
            crate::network::tap_name(&paths.dir, i)
        ));
        a.push("-device".into());
        a.push(format!(
            "virtio-net-pci,netdev=net{i},mac={},id=nic{i}",
            n.mac
        ));
    }
    if spec.cloud_init.is_some() {
        // Written by the host just before (`seed::image`); read-only.
        let node = serde_json::json!({
            "driver": "raw",
            "node-name": "seed",
            "read-only": true,
            "file": {
                "driver": "file",
                "filename": paths.seed.display().to_string(),
                "read-only": true,
            },
        });
        a.push("-blockdev".into());
        a.push(node.to_string());
        a.push("-device".into());
        a.push(format!("virtio-blk-pci,drive=seed,id=seed,{GEOMETRY}"));
    }
    if let Boot::Kernel {
        kernel,
        initrd,
        cmdline,
    } = &spec.boot
    {
        a.push("-kernel".into());
        a.push(kernel.display().to_string());
        if let Some(i) = initrd {
            a.push("-initrd".into());
            a.push(i.display().to_string());
        }
        a.push("-append".into());
        a.push(cmdline.clone());
    }
    if start != Start::Boot {
        a.push("-incoming".into());
        a.push("defer".into());
    }
    if start == Start::Incoming {
        a.push("-S".into());
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_api::VmDisk;

    fn spec() -> VmSpec {
        VmSpec {
            name: "web-1".into(),
            memory_mib: 256,
            vcpus: 2,
            disks: vec![VmDisk {
                volume: "root".into(),
                server: "127.0.0.1:10809".into(),
                admin: None,
            }],
            boot: Boot::Disk,
            accel: Accel::Auto,
            nics: Vec::new(),
            cloud_init: None,
        }
    }

    #[test]
    fn command_line_has_disks_qmp_and_incoming() {
        let p = GuestPaths::new(Path::new("/s/vms/web-1"), None);
        let a = command_line(
            &spec(),
            "tcg",
            &p,
            Path::new("/s/nbd.sock"),
            Start::Incoming,
        );
        let j = a.join(" ");
        // TCG: 8 KiB over, so QEMU syncs dirty pages page by page (memory_arg).
        assert!(j.contains("-accel tcg -cpu max -m 262152K -smp 2"), "{j}");
        assert!(j.contains("unix:/s/vms/web-1/qmp.sock,server=on,wait=off"));
        assert!(j.contains(r#""export":"root""#) && j.contains(r#""reconnect-delay":30"#));
        assert!(
            j.contains("virtio-blk-pci,drive=disk0,id=vd0,cyls=16383,heads=16,secs=63,bootindex=1")
        );
        // Arrived, it waits for the source's word before it runs.
        assert!(j.ends_with("-incoming defer -S"));
        let a = command_line(
            &spec(),
            "tcg",
            &p,
            Path::new("/s/nbd.sock"),
            Start::IncomingPostcopy,
        );
        assert!(a.join(" ").ends_with("-incoming defer"));
        let a = command_line(&spec(), "kvm", &p, Path::new("/s/nbd.sock"), Start::Boot);
        assert!(!a.contains(&"-incoming".to_string()));
        assert!(a.join(" ").contains("-cpu host -m 256M"));
        let mut s = spec();
        s.nics = vec![ferry_api::VmNic {
            network: "lan".into(),
            mac: "52:54:00:ab:cd:ef".into(),
        }];
        let j = command_line(&s, "tcg", &p, Path::new("/s/nbd.sock"), Start::Boot).join(" ");
        let tap = crate::network::tap_name(&p.dir, 0);
        assert!(
            j.contains(&format!(
                "-netdev tap,id=net0,ifname={tap},script=no,downscript=no"
            )) && j.contains("-device virtio-net-pci,netdev=net0,mac=52:54:00:ab:cd:ef,id=nic0"),
            "{j}"
        );
    }

    #[test]
    fn bad_specs_are_refused_with_a_reason() {
        assert!(validate(&spec(), 4096).is_ok());
        let mut s = spec();
        s.memory_mib = 8;
        assert!(validate(&s, 4096).unwrap_err().contains("minimum"));
        s.memory_mib = 1 << 30;
        assert!(validate(&s, 4096)
            .unwrap_err()
            .contains("more than this host"));
        let mut s = spec();
        s.vcpus = 0;
        assert!(validate(&s, 4096).is_err());
        let mut s = spec();
        s.name = "../x".into();
        assert!(validate(&s, 4096).unwrap_err().contains("name"));
        let mut s = spec();
        s.disks.push(s.disks[0].clone());
        assert!(validate(&s, 4096).unwrap_err().contains("twice"));
        let nic = |mac: &str| ferry_api::VmNic {
            network: "lan".into(),
            mac: mac.into(),
        };
        let mut s = spec();
        s.nics = vec![nic("52:54:00:00:00:01"), nic("52:54:00:00:00:02")];
        assert!(validate(&s, 4096).is_ok());
        s.nics[1].mac = "52:54:00:00:00:01".into();
        assert!(validate(&s, 4096).unwrap_err().contains("two cards"));
        s.nics[1].mac = "ff:ff:ff:ff:ff:ff".into();
        assert!(validate(&s, 4096).unwrap_err().contains("multicast"));
        s.nics = vec![nic("52:54:00:00:00:01"); 9];
        assert!(validate(&s, 4096).unwrap_err().contains("at most"));
        let mut s = spec();
        s.boot = Boot::Kernel {
            kernel: "/no/such/kernel".into(),
            initrd: None,
            cmdline: String::new(),
        };
        assert!(validate(&s, 4096).unwrap_err().contains("does not exist"));
    }
}
