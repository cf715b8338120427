//! `blkq serve` on SIGHUP: reloads what can change without dropping a client. The TLS
//! certificates are read again from the certificates directory (new handshakes use them,
//! connected clients keep theirs); with `--config`, the file is read again: `log_level` is
//! applied (unless `RUST_LOG` is set), each export's
//! access rules (`allow`, `allow_subjects`) replace the ones in force, an `[[export]]` the file
//! gained is opened and served, and one it lost is removed as `blkq export remove` removes it
//! (its clients drained within `shutdown_timeout`, its device flushed; the signal thread waits
//! for that). Exports added or removed with `blkq export` are the control socket's: a reload
//! compares the file with the file as last applied, never with them. Everything else (the
//! listeners, the control sockets, a mirror, an export's device or name, the limits, the TLS
//! mode) needs a restart: a difference there is named in the log, and left as it is. A reload
//! that fails to load (a file that no longer parses or checks, certificates that do not load)
//! changes nothing; an export that cannot be opened or removed is named and the rest applies.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use nbd::server::Reloader;
use nbd::tls::TlsMode;

use super::config::{Config, Source};
use super::settings::{check, Backing, ExportSettings, Settings};
use super::tls::load as load_tls;
use crate::control::exports::Served;
use std::sync::Weak;

/// What a reload compares with and where it applies.
pub struct Reload {
    /// `--config FILE` (`None`: started from flags, only the certificates reload).
    pub config: Option<PathBuf>,
    /// The settings in force (the access rules as last reloaded).
    pub settings: Settings,
    /// The running server.
    pub server: Reloader,
    /// Where the settings came from (errors name its flags or keys).
    pub source: Source,
    /// The export table, for the exports the file gained or lost. Weak: the signal thread
    /// lives to the process's end, and must not keep the exports' devices (a mirror marks its
    /// superblocks clean when its last reference goes, at shutdown).
    pub served: Weak<Served>,
    /// The log's level (`None`: the subscriber was installed elsewhere).
    pub levels: Option<crate::logs::Levels>,
}

impl Reload {
    /// Reloads; logs what changed, what needs a restart, or why nothing changed.
    pub fn run(&mut self) {
        match self.try_run() {
            Ok(changed) if changed.is_empty() => {
                tracing::info!("SIGHUP: reloaded, nothing changed")
            }
            Ok(changed) => tracing::info!("SIGHUP: reloaded: {}", changed.join("; ")),
            Err(e) => tracing::warn!("SIGHUP: reload refused, nothing changed: {e:#}"),
        }
    }

    fn try_run(&mut self) -> Result<Vec<String>> {
        let new = match &self.config {
            Some(path) => {
                let (config, source) = Config::load(path)?;
                Some(check(&config, &source).with_context(|| format!("{}", path.display()))?)
            }
            None => None,
        };
        let old = &self.settings;
        let mut restart = Vec::new();
        let mut access = Vec::new();
        if let Some(new) = &new {
            restart = needs_restart(old, new);
            for n in &new.exports {
                if let Some(o) = old.exports.iter().find(|o| o.name == n.name) {
                    if o.access != n.access && same_but_access(o, n) {
                        access.push((n.name.clone(), n.access.clone()));
                    }
                }
            }
        }
        // The certificates: from the directory in force (a new one needs a restart).
        let tls = if old.tls.tls != TlsMode::Off {
            load_tls(&old.tls, &self.source)?
        } else {
            None
        };
        // Everything loaded: apply.
        let mut changed = Vec::new();
        if let Some(t) = tls {
            if self.server.set_tls_config(t.config) {
                changed.push(format!(
                    "TLS certificates read again from {} (new connections use them)",
                    old.tls
                        .tls_certificates
                        .as_deref()
                        .unwrap_or(std::path::Path::new("?"))
                        .display()
                ));
            }
        }
        for (name, a) in access {
            if self.server.set_access(&name, a.clone()) {
                changed.push(format!(
                    "export {name:?}: access rules now allow {:?} allow_subjects {:?}",
                    a.allow.iter().map(|n| n.to_string()).collect::<Vec<_>>(),
                    a.allow_subjects
                ));
                if let Some(e) = self.settings.exports.iter_mut().find(|e| e.name == name) {
                    e.access = a;
                }
            }
        }
        if let Some(new) = &new {
            if let Some(l) = self.levels.as_mut() {
                match l.set(new.log_level.as_deref()) {
                    Ok(Some(m)) => changed.push(m),
                    Ok(None) => {}
                    Err(e) => tracing::warn!("SIGHUP: log_level not applied: {e}"),
                }
            }
            self.settings.log_level = new.log_level.clone();
            self.apply_export_set(new, &mut changed);
        }
        for r in &restart {
            tracing::warn!(
                "SIGHUP: {r} changed in the configuration: needs a restart (kept as it was)"
            );
        }
        Ok(changed)
    }

    /// Serves the exports `new` has and the file as last applied had not, and removes the
    /// ones it lost (mirrors aside: they need a restart, said by [`needs_restart`]). Each
    /// one that cannot be done is named in the log; the others apply.
    fn apply_export_set(&mut self, new: &Settings, changed: &mut Vec<String>) {
        let Some(served) = self.served.upgrade() else {
            return; // shutting down
        };
        let timeout = Duration::from_secs(self.settings.shutdown_timeout);
        let lost: Vec<ExportSettings> = self
            .settings
            .exports
            .iter()
            .filter(|o| !is_mirror(o) && !new.exports.iter().any(|n| n.name == o.name))
            .cloned()
            .collect();
        for o in lost {
            match served.remove_export(&o.name, timeout) {
                Ok(r) => changed.push(format!("{r} (gone from the configuration)")),
                Err(e) => tracing::warn!("SIGHUP: export {:?} not removed: {e:#}", o.name),
            }
            // Removed, or gone already: the file as applied no longer has it either way,
            // except when it is still served (a removal that failed before it began).
            if !served.is_served(&o.name) {
                self.settings.exports.retain(|e| e.name != o.name);
            }
        }
        let gained: Vec<ExportSettings> = new
            .exports
            .iter()
            .filter(|n| !is_mirror(n) && !self.settings.exports.iter().any(|o| o.name == n.name))
            .cloned()
            .collect();
        for n in gained {
            match served.add_checked(&n) {
                Ok(m) => {
                    changed.push(format!("{m} (new in the configuration)"));
                    self.settings.exports.push(n);
                }
                Err(e) => tracing::warn!("SIGHUP: export {:?} not added: {e:#}", n.name),
            }
        }
    }
}

fn is_mirror(e: &ExportSettings) -> bool {
    matches!(e.backing, Backing::Mirror { .. })
}

/// Whether two settings of one export differ in nothing but their access rules.
fn same_but_access(o: &ExportSettings, n: &ExportSettings) -> bool {
    let mut n = n.clone();
    n.access = o.access.clone();
    &n == o
}

/// What differs between `old` and `new` that only a restart applies, named.
fn needs_restart(old: &Settings, new: &Settings) -> Vec<String> {
    let mut v = Vec::new();
    let dbg = |x: &dyn std::fmt::Debug| format!("{x:?}");
    if old.tcp != new.tcp {
        v.push("[server] listen".to_string());
    }
    if old.unix != new.unix {
        v.push("[server] socket / socket_mode".to_string());
    }
    if old.control != new.control {
        v.push("[server] control".to_string());
    }
    if dbg(&old.limits) != dbg(&new.limits) || old.shutdown_timeout != new.shutdown_timeout {
        v.push("the limits".to_string());
    }
    if old.tls.tls != new.tls.tls
        || old.tls.tls_certificates != new.tls.tls_certificates
        || old.tls.tls_verify_peer != new.tls.tls_verify_peer
    {
        v.push("[tls]".to_string());
    }
    // Exports gained or lost are applied (`apply_export_set`), but for mirrors.
    for n in &new.exports {
        match old.exports.iter().find(|o| o.name == n.name) {
            None if is_mirror(n) => v.push(format!("mirror export {:?} (new)", n.name)),
            None => {}
            Some(o) if !same_but_access(o, n) => v.push(format!("export {:?}", n.name)),
            Some(_) => {}
        }
    }
    for o in &old.exports {
        if is_mirror(o) && !new.exports.iter().any(|n| n.name == o.name) {
            v.push(format!("mirror export {:?} (removed)", o.name));
        }
    }
    v
}
