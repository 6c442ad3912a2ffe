//! How a guest's QEMU is confined: its system-call filter (`-sandbox`),
//! the unprivileged user it runs as once it has opened what it needs as
//! root (`-runas`), and the one directory of sockets that user can reach.
//!
//! QEMU opens its kernel, initrd, monitor socket, serial log, pid file and
//! disks before it drops to the user. What it opens afterwards are sockets:
//! the forwarder's NBD socket when a disk reconnects (after `ferry host`
//! restarts), the socket the source host listens on for an outgoing move,
//! and the one it listens on itself for an incoming move. Those live in
//! `/run/ferry/<hash of the state directory>/` (`nbd.sock`, and a directory
//! per guest owned by the user), handed to the user and no one else; the
//! state directory itself stays root's.

use std::path::{Path, PathBuf};

/// The account QEMU runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
}

/// The user QEMU is asked to run as by default (scripts/install-deps.sh
/// creates it).
pub const DEFAULT_QEMU_USER: &str = "ferry-qemu";

/// Where the confined sockets of all hosts of this machine live.
pub const SOCKET_ROOT: &str = "/run/ferry";

/// `name`'s account, if this process can hand QEMU to it (it runs as
/// root) and the account exists.
pub fn qemu_user(name: &str) -> Option<QemuUser> {
    if name.is_empty() || !running_as_root() {
        return None;
    }
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: getpwnam takes a NUL-terminated name and returns a pointer
    // to static storage or null; the fields are copied out at once, before
    // any other call could reuse that storage.
    let pw = unsafe { libc::getpwnam(c.as_ptr()) };
    if pw.is_null() {
        return None;
    }
    // SAFETY: pw is not null, and points to a passwd getpwnam filled.
    let (uid, gid) = unsafe { ((*pw).pw_uid, (*pw).pw_gid) };
    Some(QemuUser {
        name: name.into(),
        uid,
        gid,
    })
}

fn running_as_root() -> bool {
    // SAFETY: geteuid has no arguments and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Whether an unprivileged QEMU can take a post-copy move: the
/// destination's QEMU needs userfaultfd for the guest's memory, which an
/// unprivileged process gets only with `vm.unprivileged_userfaultfd = 1`
/// (QEMU from 8.1 could also use `/dev/userfaultfd`; Debian 12's 7.2
/// cannot).
pub fn unprivileged_postcopy() -> bool {
    std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd").is_ok_and(|s| s.trim() == "1")
}

/// FNV-1a of `bytes`: a short stable name for a path (not a secret).
fn short_hash(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// The socket directory of the host whose state is in `state_dir`.
pub fn socket_dir(state_dir: &Path) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    let abs = std::fs::canonicalize(state_dir).unwrap_or_else(|_| state_dir.to_path_buf());
    Path::new(SOCKET_ROOT).join(short_hash(abs.as_os_str().as_bytes()))
}

/// The directory of one guest's move sockets inside `socket_dir`.
pub fn guest_socket_dir(socket_dir: &Path, guest: &str) -> PathBuf {
    socket_dir.join(format!("g-{}", short_hash(guest.as_bytes())))
}

/// The file in a socket directory naming the state directory it serves.
const STATE_MARK: &str = "state-dir";

/// Make `dir` (root's, others may pass through) and its parents, noting
/// in it the state directory it serves (see [`prune_orphans`]).
pub fn make_socket_dir(dir: &Path, state_dir: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    for d in [Path::new(SOCKET_ROOT), dir] {
        if d.starts_with(SOCKET_ROOT) {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?;
        }
    }
    let abs = std::fs::canonicalize(state_dir).unwrap_or_else(|_| state_dir.to_path_buf());
    std::fs::write(dir.join(STATE_MARK), abs.as_os_str().as_bytes())
}

/// Remove the socket directories under `root` whose state directory no
/// longer exists (hosts whose state was deleted: test runs, a host
/// retired); returns how many. Directories without the note (older
/// hosts') are left alone.
pub fn prune_orphans(root: &Path) -> usize {
    use std::os::unix::ffi::OsStrExt;
    let mut n = 0;
    for e in std::fs::read_dir(root).into_iter().flatten().flatten() {
        let Ok(mark) = std::fs::read(e.path().join(STATE_MARK)) else {
            continue;
        };
        let state = Path::new(std::ffi::OsStr::from_bytes(&mark));
        if state.is_absolute() && !state.exists() && std::fs::remove_dir_all(e.path()).is_ok() {
            n += 1;
        }
    }
    n
}

/// Make `dir` the user's alone (QEMU creates its incoming socket there).
pub fn give_dir(dir: &Path, user: &QemuUser) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    std::os::unix::fs::chown(dir, Some(user.uid), Some(user.gid))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// Hand a socket ferry listens on to the user alone (root reaches it
/// anyway).
pub fn give_socket(path: &Path, user: &QemuUser) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_paths_are_stable_short_and_distinct() {
        let a = socket_dir(Path::new("/no/such/state-a"));
        let b = socket_dir(Path::new("/no/such/state-b"));
        assert_ne!(a, b);
        assert_eq!(a, socket_dir(Path::new("/no/such/state-a")));
        assert!(a.starts_with(SOCKET_ROOT));
        // Unix socket paths must fit in 108 bytes.
        let longest = guest_socket_dir(&a, &"x".repeat(64)).join("out.sock");
        assert!(longest.as_os_str().len() < 100, "{}", longest.display());
        assert_ne!(guest_socket_dir(&a, "g1"), guest_socket_dir(&a, "g2"));
    }

    #[test]
    fn socket_directories_of_deleted_state_directories_are_pruned() {
        let root = tempfile::tempdir().unwrap();
        let (live, gone) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (a, b, old) = (
            root.path().join("a"),
            root.path().join("b"),
            root.path().join("old"),
        );
        make_socket_dir(&a, live.path()).unwrap();
        make_socket_dir(&b, gone.path()).unwrap();
        std::fs::create_dir_all(&old).unwrap();
        drop(gone);
        assert_eq!(prune_orphans(root.path()), 1);
        assert!(a.exists() && !b.exists(), "only the orphan goes");
        assert!(old.exists(), "a directory without the note is left alone");
    }

    #[test]
    fn no_user_when_it_does_not_exist_or_is_empty() {
        assert_eq!(qemu_user(""), None);
        assert_eq!(qemu_user("no-such-user-ferry-test"), None);
    }
}
