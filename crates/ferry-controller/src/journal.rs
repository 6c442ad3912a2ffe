//! The controller's journal: one JSON line per decision, move start, move
//! end, settings change and problem, appended and synced to
//! `<state>/journal.jsonl` before the controller acts on it. A restarted
//! controller reads it back: the recent entries for its page and API, and
//! the moves it started but never saw end, which it then follows.

use crate::act::MoveOutcome;
use crate::store::Store;
use crate::ControllerError;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::sync::Arc;

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

/// Every journal entry's format name and version (entries written before
/// entries carried them read as this format, version 1). An entry of
/// another format or a newer version is not read.
pub const JOURNAL_FORMAT: &str = "ferry-journal";
pub const JOURNAL_VERSION: u32 = 1;

fn journal_format() -> String {
    JOURNAL_FORMAT.into()
}

fn journal_version() -> u32 {
    1
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    #[serde(default = "journal_format")]
    pub format: String,
    #[serde(default = "journal_version")]
    pub version: u32,
    /// Position in the journal (1, 2, ...): the entry's key in etcd.
    #[serde(default)]
    pub seq: u64,
    pub at_unix: f64,
    pub cycle: u64,
    #[serde(flatten)]
    pub event: Event,
}

impl Entry {
    /// An entry of this build's format and version.
    pub fn new(seq: u64, at_unix: f64, cycle: u64, event: Event) -> Entry {
        Entry {
            format: JOURNAL_FORMAT.into(),
            version: JOURNAL_VERSION,
            seq,
            at_unix,
            cycle,
            event,
        }
    }

    /// Whether this build reads it: this format, a version it knows.
    pub fn readable(&self) -> bool {
        self.format == JOURNAL_FORMAT && self.version <= JOURNAL_VERSION
    }
}

pub struct Journal {
    store: Arc<Store>,
    recent: Mutex<VecDeque<Entry>>,
}

fn now_unix() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Journal {
    /// The journal kept in `store`, with what it holds already.
    pub fn open(store: Arc<Store>) -> Result<Journal, ControllerError> {
        let j = Journal {
            store,
            recent: Mutex::new(VecDeque::new()),
        };
        j.reload()?;
        Ok(j)
    }

    /// Read the journal back from the store (a new leader does, since
    /// the one before it may have written since).
    pub fn reload(&self) -> Result<(), ControllerError> {
        let mut entries: VecDeque<Entry> = self.store.load_journal(RECENT)?.into();
        // Lines written before entries had numbers: number them in order.
        let mut last = 0;
        for e in &mut entries {
            if e.seq <= last {
                e.seq = last + 1;
            }
            last = e.seq;
        }
        *self.recent.lock() = entries;
        Ok(())
    }

    /// Add what another controller wrote since the last entry held (a
    /// follower keeps its view this way; the whole journal is read only
    /// when nothing is held yet).
    pub fn catch_up(&self) -> Result<(), ControllerError> {
        let last = self.recent.lock().back().map(|e| e.seq);
        let Some(last) = last else {
            return self.reload();
        };
        let new = self.store.journal_after(last)?;
        let mut r = self.recent.lock();
        for e in new {
            if r.back().is_some_and(|b| e.seq <= b.seq) {
                continue;
            }
            r.push_back(e);
            if r.len() > RECENT {
                r.pop_front();
            }
        }
        Ok(())
    }

    /// Append one entry; it is durable when this returns Ok.
    pub fn record(&self, cycle: u64, event: Event) -> Result<Entry, ControllerError> {
        let mut r = self.recent.lock();
        let e = Entry::new(r.back().map_or(1, |e| e.seq + 1), now_unix(), cycle, event);
        self.store.append(&e)?;
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

/// The journal entry of a decision: what was decided, why, with the
/// whole decision and whether it was acted on.
pub fn decided(d: &ferry_placement::policy::Decision, acted: bool) -> Event {
    Event::Decided {
        vm: d.vm.clone(),
        action: format!("{:?}", d.action),
        reason: d.reason.clone(),
        decision: serde_json::to_value(d).unwrap_or_default(),
        acted,
    }
}

/// A journal as the core's sink, for a one-shot apply: the entries a
/// controller writes, in the cycle after the last one journaled. A
/// decision is acted on only once it is durable.
pub struct JournalDecisions<'a> {
    pub journal: &'a Journal,
    pub cycle: u64,
}

impl ferry_placement::cycle::JournalSink for JournalDecisions<'_> {
    fn decided(&mut self, d: &ferry_placement::policy::Decision, acted: bool) -> bool {
        match self.journal.record(self.cycle, decided(d, acted)) {
            Ok(_) => !acted || self.journal.store.may_act(),
            Err(e) => {
                tracing::error!("cannot journal the decision about {}: {e}", d.vm);
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_placement::policy::Action;

    fn outcome(vm: &str) -> MoveOutcome {
        MoveOutcome {
            vm: vm.into(),
            action: Action::MoveVm,
            to_host_site: "b".into(),
            to_disk_site: "b".into(),
            to_host: None,
            from_host_site: "a".into(),
            from_disk_site: "b".into(),
            result: "not started".into(),
            seconds: 0.0,
            predicted_seconds: 3.0,
            bytes: 0.0,
            predicted_bytes: 1e6,
            guest_pause_ms: None,
            memory_setup_s: None,
            memory_bytes: None,
            memory_link_efficiency: None,
            reason: None,
            burst_from: None,
        }
    }

    #[test]
    fn entries_survive_a_reopen_and_unfinished_moves_are_found() {
        let d = tempfile::tempdir().unwrap();
        let open = || Journal::open(Arc::new(Store::dir(d.path()).unwrap())).unwrap();
        let j = open();
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
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(d.path().join("journal.jsonl"))
            .unwrap();
        std::io::Write::write_all(&mut f, b"{\"at_unix\": 1, \"cyc").unwrap();
        drop(f);
        let j = open();
        j.record(3, Event::Problem { what: "x".into() }).unwrap();
        drop(j);
        let j = open();
        assert_eq!(j.tail(10).len(), 4, "{:?}", j.tail(10));
        assert_eq!(j.last_cycle(), 3);
        let seqs: Vec<u64> = j.tail(10).iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [1, 2, 3, 4]);
        let open = j.unfinished();
        assert_eq!(open.len(), 1);
        assert_eq!(open[0].0, "m2");
        assert_eq!(open[0].2.vm, "b");
    }

    #[test]
    fn entries_carry_their_format_old_ones_read_and_newer_ones_are_skipped() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("journal.jsonl");
        // Before entries had a format; a newer ferry's; another format.
        std::fs::write(
            &path,
            concat!(
                "{\"seq\":1,\"at_unix\":1,\"cycle\":1,\"event\":\"problem\",\"what\":\"old\"}\n",
                "{\"format\":\"ferry-journal\",\"version\":9,\"seq\":2,\"at_unix\":1,\"cycle\":1,\"event\":\"problem\",\"what\":\"new\"}\n",
                "{\"format\":\"other\",\"version\":1,\"seq\":3,\"at_unix\":1,\"cycle\":1,\"event\":\"problem\",\"what\":\"other\"}\n",
            ),
        )
        .unwrap();
        let j = Journal::open(Arc::new(Store::dir(d.path()).unwrap())).unwrap();
        let what: Vec<String> = j
            .tail(10)
            .iter()
            .map(|e| match &e.event {
                Event::Problem { what } => what.clone(),
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(what, ["old"]);
        let e = j.record(2, Event::Problem { what: "now".into() }).unwrap();
        assert_eq!(
            (e.format.as_str(), e.version),
            (JOURNAL_FORMAT, JOURNAL_VERSION)
        );
        let last = std::fs::read_to_string(&path).unwrap();
        let last = last.lines().last().unwrap();
        assert!(
            last.contains("\"format\":\"ferry-journal\",\"version\":1"),
            "{last}"
        );
    }
}
