//! What the operator set: the inventory (sites, their daemons, links),
//! the policy and the automation switch, kept in `<state>/settings.json`
//! (written to a new file, synced, then renamed over the old one, so a
//! crash leaves the old settings or the new, never half of each).

use crate::ControllerError;
use ferry_placement::inventory::{Inventory, SiteInventory};
use ferry_placement::policy::Policy;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    pub inventory: Inventory,
    pub policy: Policy,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            inventory: Inventory {
                sites: Vec::new(),
                links: Vec::new(),
            },
            policy: Policy::default(),
        }
    }
}

impl Settings {
    /// Refuse settings the controller could not work with. An inventory
    /// without sites is allowed (sites are added later).
    pub fn validate(&self) -> Result<(), ControllerError> {
        if !self.inventory.sites.is_empty() {
            self.inventory
                .validate()
                .map_err(ControllerError::BadInput)?;
        }
        self.policy
            .validate()
            .map_err(|e| ControllerError::BadInput(e.to_string()))
    }

    pub fn add_site(&mut self, site: SiteInventory) -> Result<(), ControllerError> {
        if self.inventory.site(&site.name).is_some() {
            return Err(ControllerError::Conflict(format!(
                "site {} exists already: `ferry site add {} --replace ...` changes it (its links stay)",
                site.name, site.name
            )));
        }
        let mut next = self.clone();
        next.inventory.sites.push(site);
        next.validate()?;
        *self = next;
        Ok(())
    }

    /// Change a site's description in place; its links stay.
    pub fn replace_site(&mut self, site: SiteInventory) -> Result<(), ControllerError> {
        let mut next = self.clone();
        let Some(old) = next
            .inventory
            .sites
            .iter_mut()
            .find(|s| s.name == site.name)
        else {
            return Err(ControllerError::NotFound(format!(
                "no site {} to replace (add it without --replace)",
                site.name
            )));
        };
        *old = site;
        next.validate()?;
        *self = next;
        Ok(())
    }

    pub fn remove_site(&mut self, name: &str) -> Result<(), ControllerError> {
        if self.inventory.site(name).is_none() {
            return Err(ControllerError::NotFound(format!("no site {name}")));
        }
        let mut next = self.clone();
        next.inventory.sites.retain(|s| s.name != name);
        next.inventory.links.retain(|l| l.a != name && l.b != name);
        next.validate()?;
        *self = next;
        Ok(())
    }
}

/// `settings.json`'s format: named, versioned, written durably, read with
/// a size limit.
pub const SETTINGS_FILE: ferry_state_file::Kind = ferry_state_file::Kind {
    format: "ferry-controller-settings",
    version: 1,
    max_bytes: 16 << 20,
};

pub struct SettingsFile {
    path: PathBuf,
}

impl SettingsFile {
    pub fn new(dir: &Path) -> SettingsFile {
        SettingsFile {
            path: dir.join("settings.json"),
        }
    }

    /// The saved settings, or the defaults when none were saved yet.
    pub fn load(&self) -> Result<Option<Settings>, ControllerError> {
        ferry_state_file::load(&self.path, SETTINGS_FILE)
            .map_err(|e| ControllerError::State(e.to_string()))
    }

    pub fn save(&self, s: &Settings) -> Result<(), ControllerError> {
        ferry_state_file::save(&self.path, SETTINGS_FILE, s)
            .map_err(|e| ControllerError::State(e.to_string()))
    }
}
