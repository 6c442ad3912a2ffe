//! One acting controller among several: the leader holds the key
//! `<prefix>/leader` under an etcd lease and renews it. It believes
//! itself leader only until a margin before the lease could have run out
//! (counted from when it *sent* the last renewal), so it stops acting
//! before etcd lets anyone else take the key; and every write it makes
//! to the shared state is a transaction that also checks the key is still
//! held under *its* lease (the fence is the lease, not the name: two
//! controllers given the same name still cannot both write), so a leader
//! that lost the key cannot write.

use crate::etcd::{Compare, EtcdClient, EtcdError, Put};
use parking_lot::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy)]
struct Held {
    lease: i64,
    /// Leader until then, unless renewed.
    until: Instant,
}

pub struct Leadership {
    etcd: EtcdClient,
    key: String,
    /// This controller's name, the value of the key while it leads.
    me: String,
    ttl: Duration,
    held: Mutex<Option<Held>>,
}

impl Leadership {
    pub fn new(etcd: EtcdClient, prefix: &str, me: &str, ttl: Duration) -> Leadership {
        Leadership {
            etcd,
            key: format!("{prefix}leader"),
            me: me.into(),
            ttl: ttl.max(Duration::from_secs(2)),
            held: Mutex::new(None),
        }
    }

    pub fn me(&self) -> &str {
        &self.me
    }

    /// How long after sending a renewal this controller still acts: a
    /// third of the lease is kept back for clocks and delays.
    fn trust(&self) -> Duration {
        self.ttl * 2 / 3
    }

    /// Whether this controller leads now.
    pub fn is_leader(&self) -> bool {
        self.held.lock().is_some_and(|h| Instant::now() < h.until)
    }

    /// The condition every write of the leader carries: the key is held
    /// under this controller's lease. Without a lease, a condition no key
    /// meets (lease ids are positive).
    pub fn fence(&self) -> Compare {
        let lease = self.held.lock().map_or(-1, |h| h.lease);
        Compare::LeaseIs(self.key.clone(), lease)
    }

    /// Who leads, as etcd says now.
    pub fn leader(&self) -> Result<Option<String>, EtcdError> {
        Ok(self
            .etcd
            .get(&self.key)?
            .map(|kv| String::from_utf8_lossy(&kv.value).into_owned()))
    }

    /// Try to become leader (or stay it): true when this controller leads.
    pub fn campaign(&self) -> Result<bool, EtcdError> {
        if self.is_leader() {
            return self.renew();
        }
        // A lapsed hold: give its lease back, so the key (if it is still
        // ours) goes at once rather than at the lease's end.
        if let Some(h) = self.held.lock().take() {
            let _ = self.etcd.revoke(h.lease);
        }
        let sent = Instant::now();
        let ttl_s = self.ttl.as_secs().max(2);
        let lease = self.etcd.grant(ttl_s)?;
        let won = self.etcd.txn(
            &[Compare::Absent(self.key.clone())],
            &[Put::Value {
                key: self.key.clone(),
                value: self.me.as_bytes().to_vec(),
                lease: Some(lease),
            }],
        )?;
        if won {
            *self.held.lock() = Some(Held {
                lease,
                until: sent + self.trust(),
            });
            tracing::info!(me = %self.me, "this controller leads now");
        } else {
            let _ = self.etcd.revoke(lease);
        }
        Ok(won)
    }

    /// Renew the lease; false (and no longer leader) when it is gone.
    pub fn renew(&self) -> Result<bool, EtcdError> {
        let Some(h) = *self.held.lock() else {
            return Ok(false);
        };
        let sent = Instant::now();
        let left = self.etcd.keep_alive(h.lease)?;
        let mut held = self.held.lock();
        if left <= 0 {
            tracing::warn!(me = %self.me, "the leader's lease expired: no longer leading");
            *held = None;
            return Ok(false);
        }
        if let Some(h) = held.as_mut() {
            h.until = sent + self.trust();
        }
        Ok(true)
    }

    /// Stop leading now (a clean shutdown): the key goes with the lease.
    pub fn resign(&self) {
        if let Some(h) = self.held.lock().take() {
            let _ = self.etcd.revoke(h.lease);
        }
    }

    /// How often to renew: well inside the trusted span.
    pub fn renew_every(&self) -> Duration {
        self.ttl / 4
    }
}
