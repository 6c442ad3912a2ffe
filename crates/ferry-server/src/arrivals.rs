//! Copies committed here by incoming migrations, as a host at this site
//! waits on them: a teleport's destination host learns that its guest's
//! disk has switched from this daemon (`GET /v1/volumes/{name}/arrival`),
//! not from the source host a one-way trip later.

use std::collections::VecDeque;
use std::time::Duration;
use tokio::sync::Notify;

/// How many recent commits are remembered (older ones are still known
/// from the volume's metadata, without their advertised addresses).
const KEPT: usize = 256;

/// Where the clients of a committed copy go, as its `Done` said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Committed {
    pub location: String,
    pub admin: String,
}

#[derive(Debug, Default)]
pub struct Arrivals {
    recent: parking_lot::Mutex<VecDeque<(String, String, Committed)>>,
    changed: Notify,
}

impl Arrivals {
    /// Migration `migration` committed its copy of `volume` here.
    pub fn record(&self, volume: &str, migration: &str, at: Committed) {
        let mut r = self.recent.lock();
        r.retain(|(v, m, _)| !(v == volume && m == migration));
        r.push_back((volume.into(), migration.into(), at));
        while r.len() > KEPT {
            r.pop_front();
        }
        drop(r);
        self.changed.notify_waiters();
    }

    /// The commit of `volume` by `migration`, if recorded.
    pub fn get(&self, volume: &str, migration: &str) -> Option<Committed> {
        self.recent
            .lock()
            .iter()
            .find(|(v, m, _)| v == volume && m == migration)
            .map(|(_, _, c)| c.clone())
    }

    /// Wait up to `limit` for `done` to say the arrival is known (checked
    /// at once and after every commit here); its last answer.
    pub async fn wait<T>(&self, limit: Duration, mut done: impl FnMut() -> Option<T>) -> Option<T> {
        let end = tokio::time::Instant::now() + limit;
        loop {
            // Registered before the check: a commit between the two wakes it.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(t) = done() {
                return Some(t);
            }
            if tokio::time::timeout_at(end, changed).await.is_err() {
                return done();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn at(l: &str) -> Committed {
        Committed {
            location: l.into(),
            admin: String::new(),
        }
    }

    #[tokio::test]
    async fn a_waiter_wakes_at_the_commit_it_waits_for_and_not_before() {
        let a = Arc::new(Arrivals::default());
        let w = {
            let a = a.clone();
            tokio::spawn(async move {
                a.wait(Duration::from_secs(10), || a.get("root", "m1"))
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        a.record("root", "m0", at("old"));
        a.record("other", "m1", at("other"));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!w.is_finished(), "woke for another commit");
        a.record("root", "m1", at("here:10809"));
        let got = tokio::time::timeout(Duration::from_secs(5), w)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, Some(at("here:10809")));
    }

    #[tokio::test]
    async fn a_wait_ends_at_its_limit_with_nothing() {
        let a = Arrivals::default();
        let t = std::time::Instant::now();
        assert_eq!(
            a.wait(Duration::from_millis(50), || a.get("root", "m"))
                .await,
            None
        );
        assert!(t.elapsed() >= Duration::from_millis(50));
    }

    #[test]
    fn only_the_latest_commits_are_kept() {
        let a = Arrivals::default();
        for i in 0..KEPT + 10 {
            a.record("v", &i.to_string(), at("x"));
        }
        assert!(a.get("v", "0").is_none());
        assert!(a.get("v", &(KEPT + 9).to_string()).is_some());
    }
}
