//! Who holds a volume: connected clients and migrations, counted per kind,
//! so that deleting a volume in use is refused with who holds it (a client
//! may be overridden with `force`; a migration never).

use crate::Volume;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A kind of holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    NbdClient = 0,
    IscsiSession = 1,
    /// This daemon is migrating the volume away.
    OutgoingMigration = 2,
    /// The volume is the copy an incoming migration is filling.
    IncomingMigration = 3,
}

impl Holder {
    const ALL: [Holder; 4] = [
        Holder::NbdClient,
        Holder::IscsiSession,
        Holder::OutgoingMigration,
        Holder::IncomingMigration,
    ];

    fn name(self, n: usize) -> String {
        let what = match self {
            Holder::NbdClient => "NBD client",
            Holder::IscsiSession => "iSCSI session",
            Holder::OutgoingMigration => "outgoing migration",
            Holder::IncomingMigration => "incoming migration",
        };
        format!("{n} {what}{}", if n == 1 { "" } else { "s" })
    }

    /// A migration: deleting under it would lose data, so never allowed.
    pub fn is_migration(self) -> bool {
        matches!(self, Holder::OutgoingMigration | Holder::IncomingMigration)
    }
}

/// Counts per kind.
#[derive(Debug, Default)]
pub struct Holders([AtomicUsize; 4]);

/// What holds a volume at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldBy(pub Vec<(Holder, usize)>);

impl HeldBy {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn has_migration(&self) -> bool {
        self.0.iter().any(|(h, _)| h.is_migration())
    }
}

impl fmt::Display for HeldBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.0.iter().map(|(h, n)| h.name(*n)).collect();
        f.write_str(&parts.join(", "))
    }
}

impl Holders {
    pub fn snapshot(&self) -> HeldBy {
        HeldBy(
            Holder::ALL
                .iter()
                .filter_map(|h| {
                    let n = self.0[*h as usize].load(Ordering::Acquire);
                    (n > 0).then_some((*h, n))
                })
                .collect(),
        )
    }
}

/// Holds the volume until dropped.
#[derive(Debug)]
pub struct HoldGuard {
    vol: Arc<Volume>,
    kind: Holder,
}

impl HoldGuard {
    pub(crate) fn new(vol: Arc<Volume>, kind: Holder) -> HoldGuard {
        vol.holders().0[kind as usize].fetch_add(1, Ordering::AcqRel);
        HoldGuard { vol, kind }
    }
}

impl Drop for HoldGuard {
    fn drop(&mut self) {
        self.vol.holders().0[self.kind as usize].fetch_sub(1, Ordering::AcqRel);
    }
}
