//! A daemon's persisted JSON state (a guest's spec and runtime, a move's
//! record, the controller's settings): each file is an envelope
//! `{"format": NAME, "version": N, "state": ...}`, written to a temporary
//! file beside it, synced, renamed over the old one and the directory
//! synced, so a crash leaves the old file or the new one, never half of
//! one; read with a size limit, and refused with a clear error when it is
//! another format or a version this build does not know. Files written
//! before the envelope existed (the bare state) are still read, and get
//! the envelope when next saved.

pub mod rate_log;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};
use thiserror::Error;

/// What one kind of file is.
#[derive(Debug, Clone, Copy)]
pub struct Kind {
    /// Its format name, e.g. `ferry-vm-spec`.
    pub format: &'static str,
    /// The version this build writes (and the newest it reads).
    pub version: u32,
    /// The largest file read.
    pub max_bytes: u64,
}

#[derive(Debug, Error)]
pub enum StateFileError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is larger than {max} bytes: not a {format} file, or damaged")]
    TooLarge {
        path: PathBuf,
        max: u64,
        format: &'static str,
    },
    #[error("{path} is a {found:?} file, not {expected:?}")]
    Format {
        path: PathBuf,
        found: String,
        expected: &'static str,
    },
    #[error("{path} is {format} version {found}; this ferry reads up to version {known} (written by a newer ferry?)")]
    Version {
        path: PathBuf,
        format: &'static str,
        found: u32,
        known: u32,
    },
    #[error("{path}: does not decode as {format}: {detail}")]
    Decode {
        path: PathBuf,
        format: &'static str,
        detail: String,
    },
    /// Another process holds the state directory's lock.
    #[error("{path} is in use by another process{}", holder.map(|p| format!(" (pid {p})")).unwrap_or_default())]
    Locked { path: PathBuf, holder: Option<u32> },
}

/// An exclusive hold on a state directory, kept while this value lives
/// (an advisory `flock` on `<dir>/lock`, released by the kernel when the
/// process dies, however it dies). Two daemons, or a daemon and a one-shot
/// command, that would write the same state cannot both hold it.
#[derive(Debug)]
pub struct DirLock {
    _file: std::fs::File,
}

/// Take `dir`'s lock without waiting; the lock file names the holder's pid.
pub fn lock_dir(dir: &Path) -> Result<DirLock, StateFileError> {
    use std::io::Seek;
    use std::os::unix::io::AsRawFd;
    let path = dir.join("lock");
    let io = |op: &'static str| {
        let path = path.clone();
        move |source| StateFileError::Io { op, path, source }
    };
    std::fs::create_dir_all(dir).map_err(io("creating"))?;
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io("opening"))?;
    // SAFETY: flock on a descriptor `file` owns; no memory is involved.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(io("locking")(err));
        }
        let mut text = String::new();
        let _ = file.read_to_string(&mut text);
        return Err(StateFileError::Locked {
            path: dir.to_path_buf(),
            holder: text.trim().parse().ok(),
        });
    }
    file.set_len(0).map_err(io("writing"))?;
    file.rewind().map_err(io("writing"))?;
    writeln!(file, "{}", std::process::id()).map_err(io("writing"))?;
    Ok(DirLock { _file: file })
}

#[derive(Serialize)]
struct Out<'a, T> {
    format: &'a str,
    version: u32,
    state: &'a T,
}

#[derive(Deserialize)]
struct In {
    format: String,
    version: u32,
    state: serde_json::Value,
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> StateFileError + 'a {
    move |source| StateFileError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// Replace `path` with `state` in `kind`'s envelope, durably.
pub fn save<T: Serialize>(path: &Path, kind: Kind, state: &T) -> Result<(), StateFileError> {
    let data = serde_json::to_vec_pretty(&Out {
        format: kind.format,
        version: kind.version,
        state,
    })
    .map_err(|e| StateFileError::Decode {
        path: path.to_path_buf(),
        format: kind.format,
        detail: e.to_string(),
    })?;
    write_durably(path, &data)
}

/// Write `data` to a temporary file beside `path`, sync it, rename it over
/// `path`, sync the directory.
pub fn write_durably(path: &Path, data: &[u8]) -> Result<(), StateFileError> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    {
        let mut f = std::fs::File::create(&tmp).map_err(io("create", &tmp))?;
        f.write_all(data).map_err(io("write", &tmp))?;
        f.sync_all().map_err(io("fsync", &tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(io("rename", path))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io("fsync", dir))?;
    }
    Ok(())
}

/// Read `path` as `kind`; `None` when there is no such file.
pub fn load<T: DeserializeOwned>(path: &Path, kind: Kind) -> Result<Option<T>, StateFileError> {
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io("open", path)(e)),
    };
    let mut buf = Vec::new();
    f.take(kind.max_bytes + 1)
        .read_to_end(&mut buf)
        .map_err(io("read", path))?;
    if buf.len() as u64 > kind.max_bytes {
        return Err(StateFileError::TooLarge {
            path: path.to_path_buf(),
            max: kind.max_bytes,
            format: kind.format,
        });
    }
    let decode = |detail: String| StateFileError::Decode {
        path: path.to_path_buf(),
        format: kind.format,
        detail,
    };
    let value: serde_json::Value =
        serde_json::from_slice(&buf).map_err(|e| decode(e.to_string()))?;
    let state = if value.get("format").is_some() && value.get("state").is_some() {
        let env: In = serde_json::from_value(value).map_err(|e| decode(e.to_string()))?;
        if env.format != kind.format {
            return Err(StateFileError::Format {
                path: path.to_path_buf(),
                found: env.format,
                expected: kind.format,
            });
        }
        if env.version > kind.version {
            return Err(StateFileError::Version {
                path: path.to_path_buf(),
                format: kind.format,
                found: env.version,
                known: kind.version,
            });
        }
        env.state
    } else {
        // Written before files had an envelope.
        tracing::debug!(path = %path.display(), format = kind.format, "a state file without an envelope");
        value
    };
    serde_json::from_value(state)
        .map(Some)
        .map_err(|e| decode(e.to_string()))
}

/// Remove the oldest `*.json` files of `dir` beyond `keep`, and any older
/// than `max_age` (by modification time); returns how many went.
pub fn prune(dir: &Path, keep: usize, max_age: Duration) -> usize {
    let now = SystemTime::now();
    let mut files: Vec<(SystemTime, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    files.sort();
    let over = files.len().saturating_sub(keep);
    let mut gone = 0;
    for (i, (t, p)) in files.iter().enumerate() {
        let old = now.duration_since(*t).is_ok_and(|age| age > max_age);
        if (i < over || old) && std::fs::remove_file(p).is_ok() {
            gone += 1;
        }
    }
    if gone > 0 {
        tracing::info!(dir = %dir.display(), gone, "old records pruned");
    }
    gone
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_state_directory_is_held_by_one_holder_at_a_time() {
        let d = tempfile::tempdir().unwrap();
        let first = super::lock_dir(d.path()).unwrap();
        let again = super::lock_dir(d.path()).unwrap_err();
        assert!(
            matches!(again, super::StateFileError::Locked { holder: Some(p), .. } if p == std::process::id()),
            "{again}"
        );
        drop(first);
        super::lock_dir(d.path()).unwrap();
    }

    use super::*;

    const K: Kind = Kind {
        format: "ferry-test",
        version: 2,
        max_bytes: 4096,
    };

    #[test]
    fn saved_state_reads_back_and_missing_is_none() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("s.json");
        assert_eq!(load::<Vec<u32>>(&p, K).unwrap(), None);
        save(&p, K, &vec![1u32, 2, 3]).unwrap();
        assert_eq!(load::<Vec<u32>>(&p, K).unwrap(), Some(vec![1, 2, 3]));
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(
            text.contains("\"format\": \"ferry-test\"") && text.contains("\"version\": 2"),
            "{text}"
        );
        assert_eq!(
            std::fs::read_dir(d.path()).unwrap().count(),
            1,
            "no temporary file left"
        );
    }

    #[test]
    fn legacy_files_read_and_bad_ones_refused_clearly() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("s.json");
        std::fs::write(&p, "[4, 5]").unwrap();
        assert_eq!(load::<Vec<u32>>(&p, K).unwrap(), Some(vec![4, 5]));
        std::fs::write(&p, r#"{"format":"other","version":1,"state":[1]}"#).unwrap();
        assert!(matches!(
            load::<Vec<u32>>(&p, K),
            Err(StateFileError::Format { .. })
        ));
        std::fs::write(&p, r#"{"format":"ferry-test","version":3,"state":[1]}"#).unwrap();
        let e = load::<Vec<u32>>(&p, K).unwrap_err();
        assert!(e.to_string().contains("newer ferry"), "{e}");
        std::fs::write(&p, vec![b' '; 5000]).unwrap();
        assert!(matches!(
            load::<Vec<u32>>(&p, K),
            Err(StateFileError::TooLarge { .. })
        ));
        std::fs::write(&p, "{half").unwrap();
        assert!(matches!(
            load::<Vec<u32>>(&p, K),
            Err(StateFileError::Decode { .. })
        ));
    }

    #[test]
    fn prune_keeps_the_newest() {
        let d = tempfile::tempdir().unwrap();
        for i in 0..5u64 {
            let p = d.path().join(format!("{i}.json"));
            std::fs::write(&p, "{}").unwrap();
            let t = SystemTime::now() - Duration::from_secs(100 - i);
            std::fs::File::options()
                .write(true)
                .open(&p)
                .unwrap()
                .set_modified(t)
                .unwrap();
        }
        std::fs::write(d.path().join("keep.txt"), "x").unwrap();
        assert_eq!(prune(d.path(), 3, Duration::from_secs(3600)), 2);
        let mut left: Vec<String> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["2.json", "3.json", "4.json", "keep.txt"]);
        assert_eq!(prune(d.path(), 10, Duration::from_secs(97)), 2, "by age");
    }
}
