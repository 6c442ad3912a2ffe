//! The controller's journal: one JSON line per decision, move start, move
//! end, settings change and problem, appended and synced to
//! `<state>/journal.jsonl` before the controller acts on it. A restarted
//! controller reads it back: the recent entries for its page and API, and
//! the moves it started but never saw end, which it then follows.

use crate::act::MoveOutcome;
use crate::ControllerError;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Entries kept in memory for the API.
const RECENT: usize = 2000;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// A policy decided a move (acted on unless automation is paused).
    Decided {
        vm: String,
        action: String,
        reason: String,
        /// The whole decision with its numbers.
        decision: serde_json::Value,
        acted: bool,
    },
    /// A move was asked of a host; `id` names it there.
    Started {
        vm: String,
        id: String,
        control: String,
        expect: MoveOutcome,
    },
    /// A move ended (or the controller stopped following it).
    Finished { id: String, outcome: MoveOutcome },
    /// The operator changed the inventory, the policy or the switch.
    Settings { what: String },
    /// Something could not be measured or done.
    Problem { what: String },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub at_unix: f64,
    pub cycle: u64,
    #[serde(flatten)]
    pub event: Event,
}

pub struct Journal {
    path: PathBuf,
    file: Mutex<File>,
    recent: Mutex<VecDeque<Entry>>,
}

fn now_unix() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Journal {
    /// Open (or create) the journal in `dir`, reading back what it holds.
    /// A torn last line (a crash mid-append) is skipped.
    pub fn open(dir: &Path) -> Result<Journal, ControllerError> {
        let path = dir.join("journal.jsonl");
        let io = |e: std::io::Error| ControllerError::State(format!("{}: {e}", path.display()));
        // Read once: the entries, and whether the last line is whole.
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(io(e)),
        };
        let mut recent = VecDeque::new();
        for line in bytes.split(|b| *b == b'\n') {
            if let Ok(e) = serde_json::from_slice::<Entry>(line) {
                recent.push_back(e);
                if recent.len() > RECENT {
                    recent.pop_front();
                }
            }
        }
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io)?;
        // After a torn last line, the next entry starts on a line of its own.
        if bytes.last().is_some_and(|b| *b != b'\n') {
            file.write_all(b"\n").map_err(io)?;
        }
        Ok(Journal {
            path,
            file: Mutex::new(file),
            recent: Mutex::new(recent),
        })
    }

    /// Append and sync one entry; it is durable when this returns Ok.
    pub fn record(&self, cycle: u64, event: Event) -> Result<Entry, ControllerError> {
        let e = Entry {
            at_unix: now_unix(),
            cycle,
            event,
        };
        let mut line = serde_json::to_vec(&e).map_err(|x| ControllerError::State(x.to_string()))?;
        line.push(b'\n');
        {
            let mut f = self.file.lock();
            f.write_all(&line)
                .and_then(|()| f.sync_data())
                .map_err(|x| ControllerError::State(format!("{}: {x}", self.path.display())))?;
        }
        let mut r = self.recent.lock();
        r.push_back(e.clone());
        if r.len() > RECENT {
            r.pop_front();
        }
        Ok(e)
    }

    /// The last `n` entries, oldest first.
    pub fn tail(&self, n: usize) -> Vec<Entry> {
        let r = self.recent.lock();
        r.iter().skip(r.len().saturating_sub(n)).cloned().collect()
    }

    /// Moves started and never seen to end: (id, control, expected outcome).
    pub fn unfinished(&self) -> Vec<(String, String, MoveOutcome)> {
        let r = self.recent.lock();
        let mut open: Vec<(String, String, MoveOutcome)> = Vec::new();
        for e in r.iter() {
            match &e.event {
                Event::Started {
                    id,
                    control,
                    expect,
                    ..
                } => open.push((id.clone(), control.clone(), expect.clone())),
                Event::Finished { id, .. } => open.retain(|(i, _, _)| i != id),
                _ => {}
            }
        }
        open
    }

    /// The last cycle number recorded.
    pub fn last_cycle(&self) -> u64 {
        self.recent.lock().back().map_or(0, |e| e.cycle)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_control::policy::Action;

    fn outcome(vm: &str) -> MoveOutcome {
        MoveOutcome {
            vm: vm.into(),
            action: Action::MoveVm,
            to_host_site: "b".into(),
            to_disk_site: "b".into(),
            result: "not started".into(),
            seconds: 0.0,
            predicted_seconds: 3.0,
            bytes: 0.0,
            predicted_bytes: 1e6,
            guest_pause_ms: None,
            reason: None,
        }
    }

    #[test]
    fn entries_survive_a_reopen_and_unfinished_moves_are_found() {
        let d = tempfile::tempdir().unwrap();
        let j = Journal::open(d.path()).unwrap();
        for (id, vm) in [("m1", "a"), ("m2", "b")] {
            j.record(
                1,
                Event::Started {
                    vm: vm.into(),
                    id: id.into(),
                    control: "h:1".into(),
                    expect: outcome(vm),
                },
            )
            .unwrap();
        }
        j.record(
            2,
            Event::Finished {
                id: "m1".into(),
                outcome: outcome("a"),
            },
        )
        .unwrap();
        drop(j);
        // A crash mid-append leaves a torn line: skipped, not fatal.
        let mut f = OpenOptions::new()
            .append(true)
            .open(d.path().join("journal.jsonl"))
            .unwrap();
        f.write_all(b"{\"at_unix\": 1, \"cyc").unwrap();
        drop(f);
        let j = Journal::open(d.path()).unwrap();
        j.record(3, Event::Problem { what: "x".into() }).unwrap();
        drop(j);
        let j = Journal::open(d.path()).unwrap();
        assert_eq!(j.tail(10).len(), 4, "{:?}", j.tail(10));
        assert_eq!(j.last_cycle(), 3);
        let open = j.unfinished();
        assert_eq!(open.len(), 1);
        assert_eq!(open[0].0, "m2");
        assert_eq!(open[0].2.vm, "b");
    }
}
