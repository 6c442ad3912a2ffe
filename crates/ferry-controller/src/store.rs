//! Where the controller's state lives: the settings and the journal, in
//! one local directory (the default: one controller, no other service),
//! or in etcd, shared by several controllers of which one leads (see
//! [`crate::leader`]). In etcd the settings are `<prefix>settings` and
//! each journal entry is `<prefix>journal/<20-digit sequence>`, written
//! only if that key is new and the writer still leads.

use crate::etcd::{Compare, EtcdClient, Put};
use crate::journal::Entry;
use crate::leader::Leadership;
use crate::settings::{Settings, SettingsFile};
use crate::ControllerError;
use parking_lot::Mutex;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub enum Store {
    Dir {
        /// Held while the store is open: one controller (or one
        /// `plan --apply`) per state directory.
        _lock: ferry_state_file::DirLock,
        settings: SettingsFile,
        journal_path: PathBuf,
        journal: Mutex<File>,
        /// What the journal file held when opened.
        loaded: Mutex<Option<Vec<Entry>>>,
        /// Entries in the file now; past twice [`JOURNAL_KEEP`] it is
        /// rewritten with the last `JOURNAL_KEEP`.
        lines: Mutex<u64>,
    },
    Etcd {
        etcd: EtcdClient,
        prefix: String,
        leader: Arc<Leadership>,
        /// Journal entries kept in etcd; older ones are deleted as new
        /// ones are written (every [`TRIM_EVERY`] entries).
        keep: u64,
    },
}

/// Journal entries kept (in etcd, and in a state directory's
/// journal.jsonl) by default.
pub const JOURNAL_KEEP: u64 = 10_000;
/// How often (in entries) the leader trims the journal in etcd.
pub const TRIM_EVERY: u64 = 100;

/// Replace the journal file with `entries`, durably.
fn rewrite_journal(path: &Path, entries: &[Entry]) -> Result<(), ControllerError> {
    let mut text = Vec::new();
    for e in entries {
        text.extend(serde_json::to_vec(e).map_err(state_err)?);
        text.push(b'\n');
    }
    ferry_state_file::write_durably(path, &text).map_err(state_err)?;
    tracing::info!(path = %path.display(), kept = entries.len(), "journal compacted");
    Ok(())
}

/// Keep the last [`JOURNAL_KEEP`] entries of the journal file; the file
/// to append to afterwards.
fn compact_journal(path: &Path) -> Result<File, ControllerError> {
    let io = |e: std::io::Error| state_err(format!("{}: {e}", path.display()));
    let bytes = std::fs::read(path).map_err(io)?;
    let mut entries: Vec<Entry> = bytes
        .split(|b| *b == b'\n')
        .filter_map(|l| serde_json::from_slice::<Entry>(l).ok())
        .filter(Entry::readable)
        .collect();
    let skip = entries
        .len()
        .saturating_sub(usize::try_from(JOURNAL_KEEP).unwrap_or(usize::MAX));
    entries.drain(..skip);
    rewrite_journal(path, &entries)?;
    OpenOptions::new().append(true).open(path).map_err(io)
}

fn state_err(e: impl std::fmt::Display) -> ControllerError {
    ControllerError::State(e.to_string())
}

impl Store {
    /// The state in `dir` (created if missing). A torn last journal line
    /// (a crash mid-append) is skipped, and the next entry starts on a
    /// line of its own.
    pub fn dir(dir: &Path) -> Result<Store, ControllerError> {
        std::fs::create_dir_all(dir).map_err(|e| state_err(format!("{}: {e}", dir.display())))?;
        let lock = ferry_state_file::lock_dir(dir).map_err(|e| match e {
            ferry_state_file::StateFileError::Locked { .. } => ControllerError::Conflict(format!(
                "{e}: a controller (ferry control run, or plan --apply) acts on this state already"
            )),
            e => state_err(e),
        })?;
        let path = dir.join("journal.jsonl");
        let io = |e: std::io::Error| state_err(format!("{}: {e}", path.display()));
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(io(e)),
        };
        let mut entries: Vec<Entry> = bytes
            .split(|b| *b == b'\n')
            .filter_map(|l| serde_json::from_slice::<Entry>(l).ok())
            .filter(Entry::readable)
            .collect();
        if entries.len() as u64 > JOURNAL_KEEP {
            let skip = entries.len() - usize::try_from(JOURNAL_KEEP).unwrap_or(usize::MAX);
            entries.drain(..skip);
            rewrite_journal(&path, &entries)?;
        }
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io)?;
        if bytes.last().is_some_and(|b| *b != b'\n') {
            file.write_all(b"\n").map_err(io)?;
        }
        Ok(Store::Dir {
            _lock: lock,
            settings: SettingsFile::new(dir),
            journal_path: path,
            journal: Mutex::new(file),
            lines: Mutex::new(entries.len() as u64),
            loaded: Mutex::new(Some(entries)),
        })
    }

    /// The state in etcd under `prefix` (ending in `/`).
    /// The journal keeps the last `keep` entries.
    pub fn etcd(etcd: EtcdClient, prefix: &str, leader: Arc<Leadership>, keep: u64) -> Store {
        Store::Etcd {
            etcd,
            prefix: prefix.into(),
            leader,
            keep: keep.max(1),
        }
    }

    pub fn leadership(&self) -> Option<&Arc<Leadership>> {
        match self {
            Store::Dir { .. } => None,
            Store::Etcd { leader, .. } => Some(leader),
        }
    }

    /// Whether this controller may act and write: always when alone.
    pub fn may_act(&self) -> bool {
        self.leadership().is_none_or(|l| l.is_leader())
    }

    /// Ok when this controller may act; otherwise the refusal naming the
    /// controller that leads.
    pub fn must_lead(&self) -> Result<(), ControllerError> {
        match self.leadership() {
            Some(l) if !l.is_leader() => Err(Self::not_leader(l)),
            _ => Ok(()),
        }
    }

    fn not_leader(leader: &Leadership) -> ControllerError {
        let who = leader.leader().ok().flatten();
        ControllerError::Conflict(match who {
            Some(w) => format!("this controller does not lead; the leader is {w}"),
            None => "this controller does not lead, and no controller leads right now".into(),
        })
    }

    pub fn load_settings(&self) -> Result<Option<Settings>, ControllerError> {
        match self {
            Store::Dir { settings, .. } => settings.load(),
            Store::Etcd { etcd, prefix, .. } => {
                match etcd.get(&format!("{prefix}settings")).map_err(state_err)? {
                    Some(kv) => serde_json::from_slice(&kv.value)
                        .map(Some)
                        .map_err(|e| state_err(format!("settings in etcd: {e}"))),
                    None => Ok(None),
                }
            }
        }
    }

    pub fn save_settings(&self, s: &Settings) -> Result<(), ControllerError> {
        match self {
            Store::Dir { settings, .. } => settings.save(s),
            Store::Etcd {
                etcd,
                prefix,
                leader,
                ..
            } => {
                let value = serde_json::to_vec(s).map_err(state_err)?;
                let ok = etcd
                    .txn(
                        &[leader.fence()],
                        &[Put::Value {
                            key: format!("{prefix}settings"),
                            value,
                            lease: None,
                        }],
                    )
                    .map_err(state_err)?;
                if ok {
                    Ok(())
                } else {
                    Err(Self::not_leader(leader))
                }
            }
        }
    }

    /// The journal, oldest first; at most the last `keep` entries.
    pub fn load_journal(&self, keep: usize) -> Result<Vec<Entry>, ControllerError> {
        match self {
            Store::Dir { loaded, .. } => {
                let mut all = loaded.lock().take().unwrap_or_default();
                let skip = all.len().saturating_sub(keep);
                all.drain(..skip);
                Ok(all)
            }
            Store::Etcd { etcd, prefix, .. } => etcd
                .list(&format!("{prefix}journal/"), Some(keep))
                .map_err(state_err)?
                .iter()
                .map(journal_entry)
                .collect(),
        }
    }

    /// The entries after `seq`, oldest first, as another controller wrote
    /// them (a directory store has no other writer: none).
    pub fn journal_after(&self, seq: u64) -> Result<Vec<Entry>, ControllerError> {
        match self {
            Store::Dir { .. } => Ok(Vec::new()),
            Store::Etcd { etcd, prefix, .. } => etcd
                .list_from(
                    &format!("{prefix}journal/{:020}", seq + 1),
                    &format!("{prefix}journal/"),
                )
                .map_err(state_err)?
                .iter()
                .map(journal_entry)
                .collect(),
        }
    }

    /// Make one entry durable; it is when this returns Ok.
    pub fn append(&self, e: &Entry) -> Result<(), ControllerError> {
        let mut line = serde_json::to_vec(e).map_err(state_err)?;
        match self {
            Store::Dir {
                journal,
                journal_path,
                lines,
                ..
            } => {
                line.push(b'\n');
                let mut f = journal.lock();
                f.write_all(&line)
                    .and_then(|()| f.sync_data())
                    .map_err(|x| state_err(format!("{}: {x}", journal_path.display())))?;
                let mut n = lines.lock();
                *n += 1;
                if *n > 2 * JOURNAL_KEEP {
                    // Only the last JOURNAL_KEEP entries are kept: the file
                    // is rewritten (durably) and appended to again.
                    *f = compact_journal(journal_path)?;
                    *n = JOURNAL_KEEP;
                }
                Ok(())
            }
            Store::Etcd {
                etcd,
                prefix,
                leader,
                keep,
            } => {
                let key = format!("{prefix}journal/{:020}", e.seq);
                let mut puts = vec![Put::Value {
                    key: key.clone(),
                    value: line,
                    lease: None,
                }];
                // Every so often, the entries older than the last `keep` go
                // (in the same fenced transaction).
                if e.seq.is_multiple_of(TRIM_EVERY) && e.seq > *keep {
                    puts.push(Put::DeleteRange(
                        format!("{prefix}journal/{:020}", 0),
                        format!("{prefix}journal/{:020}", e.seq - keep + 1),
                    ));
                }
                let ok = etcd
                    .txn(&[leader.fence(), Compare::Absent(key)], &puts)
                    .map_err(state_err)?;
                if ok {
                    Ok(())
                } else {
                    Err(Self::not_leader(leader))
                }
            }
        }
    }
}

/// One journal entry as etcd holds it: its number is its key's last part.
fn journal_entry(kv: &crate::etcd::KeyValue) -> Result<Entry, ControllerError> {
    let mut e: Entry = serde_json::from_slice(&kv.value)
        .map_err(|x| state_err(format!("journal entry {}: {x}", kv.key)))?;
    if !e.readable() {
        return Err(state_err(format!(
            "journal entry {} is {} version {}; this ferry reads {} up to version {} (written by a newer ferry?)",
            kv.key,
            e.format,
            e.version,
            crate::journal::JOURNAL_FORMAT,
            crate::journal::JOURNAL_VERSION
        )));
    }
    e.seq = kv
        .key
        .rsplit('/')
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Ok(e)
}
