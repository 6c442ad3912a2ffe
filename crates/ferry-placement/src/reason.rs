//! Why the planner refused a move: one typed reason per filter, kept for
//! every candidate it weighed, so `ferry control status`, the API and the
//! page can say "teleport to b: refused by cooldown, 212 s left" instead of
//! letting a refused candidate vanish.

use crate::cluster::Placement;
use crate::policy::Action;
use serde::{Deserialize, Serialize};

/// A filter's refusal of one move (or of every move of one guest).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "filter", rename_all = "snake_case")]
pub enum Refusal {
    /// Automation is paused: nothing is planned.
    Paused,
    /// The operator named a site for maintenance that is not one.
    NotASite { site: String },
    /// A move of this guest is running; it is planned again once it ends.
    InFlight { action: Action, to: Placement },
    /// Moved too recently.
    Cooldown { left_s: f64, cooldown_s: f64 },
    /// The same move failed in a row lately (the controller's backoff).
    HeldBack {
        failures: u32,
        retry_in_s: f64,
        reason: String,
    },
    /// The guest's CPU does not fit in what the site may still run.
    NoRoom {
        site: String,
        used_cpu: f64,
        limit_cpu: f64,
        cpu: f64,
    },
    /// The site has the CPUs, but none of its hosts has the room (CPU or
    /// memory) for the guest.
    NoHost {
        site: String,
        cpu: f64,
        memory_bytes: f64,
    },
    /// The site is being drained: nothing moves in.
    Draining { site: String },
    /// A site in maintenance must lose this guest, and no linked site can
    /// take it.
    NowhereToGo { draining: String },
    /// The site is above its burst threshold, but has not stayed above
    /// it for the hold time yet (a boot or a spike is not a demand).
    BurstHold {
        site: String,
        used_cpu: f64,
        limit_cpu: f64,
        above_s: f64,
        hold_s: f64,
    },
    /// A burst guest's home is still too full for it.
    HomeFull {
        home: String,
        used_cpu: f64,
        limit_cpu: f64,
    },
    /// The guest dirties faster than the link carries: the move would not
    /// end.
    NotConverging,
    /// The link already carries as many moves as the policy allows.
    LinkLimit {
        a: String,
        b: String,
        moves: usize,
        limit: usize,
    },
    /// The site already takes part in as many moves as the policy allows.
    SiteLimit {
        site: String,
        moves: usize,
        limit: usize,
    },
    /// The guest's host, or the host it would go to, already takes part in
    /// as many moves as the policy allows.
    HostLimit {
        host: String,
        moves: usize,
        limit: usize,
    },
    /// The best move's gain does not beat its cost by the margin (or is too
    /// small a share of the horizon to be worth the risk).
    GainTooSmall {
        gain_s: f64,
        cost_s: f64,
        horizon_s: f64,
        margin: f64,
    },
    /// Another move of the same guest scores better (loses less).
    Outscored {
        by: Action,
        to: Placement,
        lost_s: f64,
        best_lost_s: f64,
    },
}

impl Refusal {
    /// The filter's name, as the policy's documentation calls it.
    pub fn filter(&self) -> &'static str {
        match self {
            Refusal::Paused => "pause",
            Refusal::NotASite { .. } => "maintenance",
            Refusal::InFlight { .. } => "in flight",
            Refusal::Cooldown { .. } => "cooldown",
            Refusal::HeldBack { .. } => "backoff",
            Refusal::NoRoom { .. } | Refusal::NoHost { .. } => "fits",
            Refusal::Draining { .. } | Refusal::NowhereToGo { .. } => "drain",
            Refusal::BurstHold { .. } => "burst hold",
            Refusal::HomeFull { .. } => "coming home",
            Refusal::NotConverging => "converges",
            Refusal::LinkLimit { .. } => "per-link limit",
            Refusal::SiteLimit { .. } => "per-site limit",
            Refusal::HostLimit { .. } => "per-host limit",
            Refusal::GainTooSmall { .. } => "margin",
            Refusal::Outscored { .. } => "locality score",
        }
    }
}

impl std::fmt::Display for Refusal {
    /// "refused by cooldown, 212 s left".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "refused by {}, ", self.filter())?;
        match self {
            Refusal::Paused => f.write_str("automation is paused"),
            Refusal::NotASite { site } => write!(f, "{site} is not a site"),
            Refusal::InFlight { action, to } => write!(f, "its {action} to {to} is running"),
            Refusal::Cooldown { left_s, cooldown_s } => {
                write!(f, "{left_s:.0} s left (cooldown {cooldown_s:.0} s)")
            }
            Refusal::HeldBack {
                failures,
                retry_in_s,
                reason,
            } => write!(
                f,
                "failed {failures} times in a row ({reason}), tried again in {retry_in_s:.0} s"
            ),
            Refusal::NoRoom {
                site,
                used_cpu,
                limit_cpu,
                cpu,
            } => write!(
                f,
                "{site} runs {used_cpu:.1} of {limit_cpu:.1} CPUs, no room for {cpu:.2} more"
            ),
            Refusal::NoHost {
                site,
                cpu,
                memory_bytes,
            } => write!(
                f,
                "no host of {site} has room for {cpu:.2} CPUs and {:.0} MiB",
                memory_bytes / 1048576.0
            ),
            Refusal::Draining { site } => write!(f, "{site} is in maintenance"),
            Refusal::NowhereToGo { draining } => write!(
                f,
                "{draining} is in maintenance, but no linked site has room for it"
            ),
            Refusal::BurstHold {
                site,
                used_cpu,
                limit_cpu,
                above_s,
                hold_s,
            } => write!(
                f,
                "{site} runs {used_cpu:.1} CPUs, above its {limit_cpu:.1}, for {above_s:.0} s of the {hold_s:.0} s hold"
            ),
            Refusal::HomeFull {
                home,
                used_cpu,
                limit_cpu,
            } => write!(
                f,
                "burst from {home}, which has no room for it yet ({used_cpu:.1} of {limit_cpu:.1} CPUs used)"
            ),
            Refusal::NotConverging => {
                f.write_str("it dirties faster than the link carries (the move would not end)")
            }
            Refusal::LinkLimit { a, b, moves, limit } => {
                write!(f, "link {a}-{b} already has {moves} of {limit} moves")
            }
            Refusal::SiteLimit { site, moves, limit } => {
                write!(f, "site {site} already takes part in {moves} of {limit} moves")
            }
            Refusal::HostLimit { host, moves, limit } => {
                write!(f, "host {host} already takes part in {moves} of {limit} moves")
            }
            Refusal::GainTooSmall {
                gain_s,
                cost_s,
                horizon_s,
                margin,
            } => write!(
                f,
                "gains {gain_s:.1} s over {horizon_s:.0} s for a cost of {cost_s:.1} s (margin {margin:.1}×)"
            ),
            Refusal::Outscored {
                by,
                to,
                lost_s,
                best_lost_s,
            } => write!(
                f,
                "loses {lost_s:.1} s where a {by} to {to} loses {best_lost_s:.1} s"
            ),
        }
    }
}

/// One move the planner weighed for one guest, and what became of it.
/// `action` and `to` are absent when the guest was refused before any move
/// was weighed (in flight, cooling down).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    pub vm: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<Action>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<Placement>,
    /// Absent: chosen (it is among the plan's decisions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<Refusal>,
    /// The whole of it in one line, for the page and the CLI.
    #[serde(default)]
    pub line: String,
}

impl Candidate {
    pub fn new(
        vm: &str,
        action: Option<Action>,
        to: Option<&Placement>,
        refused: Option<Refusal>,
    ) -> Candidate {
        let mut c = Candidate {
            vm: vm.into(),
            action,
            to: to.cloned(),
            refused,
            line: String::new(),
        };
        c.line = c.to_string();
        c
    }
}

impl std::fmt::Display for Candidate {
    /// "web: teleport to VM and disk at b: refused by cooldown, 212 s left".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: ", self.vm)?;
        match (&self.action, &self.to) {
            (Some(a), Some(to)) => write!(f, "{a} to {to}: ")?,
            (Some(a), None) => write!(f, "{a}: ")?,
            _ => f.write_str("any move: ")?,
        }
        match &self.refused {
            None => f.write_str("chosen"),
            Some(r) => write!(f, "{r}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_names_its_filter_and_its_numbers() {
        let to = Placement {
            host_site: "b".into(),
            disk_site: "b".into(),
        };
        let r = Refusal::Cooldown {
            left_s: 212.4,
            cooldown_s: 300.0,
        };
        let c = Candidate::new("web", Some(Action::Teleport), Some(&to), Some(r));
        assert_eq!(
            c.line,
            "web: teleport to VM and disk at b: refused by cooldown, 212 s left (cooldown 300 s)"
        );
        let j = serde_json::to_value(&c).unwrap();
        assert_eq!(j["refused"]["filter"], "cooldown");
        assert_eq!(j["refused"]["left_s"], 212.4);
        let back: Candidate = serde_json::from_value(j).unwrap();
        assert_eq!(back, c);
        let chosen = Candidate::new("web", Some(Action::Teleport), Some(&to), None);
        assert!(chosen.line.ends_with(": chosen"));
    }
}
