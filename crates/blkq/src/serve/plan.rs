//! From checked settings to what the server serves: [`open`] opens the devices, assembles (or
//! creates) the mirrors and gives each export its description; [`exposure_warning`] says what
//! a listener others can reach exposes.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use blk::Device;
use blk_drivers::spec::QueueOverrides;
use blkq_sync::DynArc as Arc;
use cbt::Store;
use nbd::remote::RemoteDevice;
use nbd::server::{Access, Export, ServerConfig};
use nbd::tls::TlsMode;
use raid1::Raid1;

use super::bitmaps::{split_spec, store_for, store_for_mirror, track, BitmapsOpt};
use super::devices::{Devices, Entry};
use super::settings::{Backing, ExportSettings, Settings};
use crate::control::server::Control;
use crate::open::{open_leg, Spec};
use crate::raid::away::{Away, OnBack};
use crate::raid::create::{self, CreateRules};
use crate::raid::legs;

/// What [`open`] made: the server's configuration and what to print and start beside it.
pub struct Opened {
    /// Exports, listeners and tuning.
    pub server: ServerConfig,
    /// The full description of each export (printed locally).
    pub descriptions: Vec<String>,
    /// Control sockets to start: the server's (no mirror of its own) and one per mirror that
    /// asked for one. Each also serves every export's dirty bitmaps.
    pub control_sockets: Vec<(PathBuf, Option<Arc<Control>>)>,
    /// Every mirror, by export name (for metrics), with its control (shared with its socket).
    pub mirrors: Vec<(String, Arc<Control>)>,
    /// Every export's devices beside the server (its bitmaps, its remote device), kept in
    /// step with the server's table while serving (`control::exports`).
    pub devices: Arc<Devices>,
}

/// One export opened by [`open_export`]: what the server serves, and what runs beside it.
pub struct OpenedExport {
    /// The export.
    pub export: Export,
    /// Its full description (printed locally, `blkq export list`).
    pub description: String,
    /// A mirror's control socket (`control` of its `[[raid1]]`).
    pub control_socket: Option<PathBuf>,
    /// Its dirty bitmaps (all but `bitmaps=off`).
    pub tracked: Option<Arc<cbt::Tracked>>,
    /// A mirror's control.
    pub mirror: Option<Arc<Control>>,
    /// A remote export's device (`--device nbd://...`).
    pub remote: Option<Arc<RemoteDevice>>,
}

impl OpenedExport {
    /// What [`Devices`] keeps of it.
    pub fn entry(&self) -> Entry {
        Entry {
            name: self.export.name.clone(),
            device: self.description.clone(),
            tracked: self.tracked.clone(),
            remote: self.remote.clone(),
            mirror: self.mirror.is_some(),
            _device: self.export.device.clone(),
        }
    }
}

/// Opens the devices and assembles the mirrors: the server's configuration. `from_file`:
/// the settings came from a `--config` file, so errors name its keys, not the flags it
/// forbids.
pub fn open(settings: &Settings, from_file: bool) -> Result<Opened> {
    let mut exports = Vec::new();
    let mut descriptions = Vec::new();
    let mut control_sockets = Vec::new();
    let mut mirrors = Vec::new();
    let devices = Arc::new(Devices::default());
    if let Some(path) = &settings.control {
        control_sockets.push((path.clone(), None));
    }
    for e in &settings.exports {
        let o = open_export(settings, e, from_file)?;
        if let (Some(path), Some(ctl)) = (&o.control_socket, &o.mirror) {
            control_sockets.push((path.clone(), Some(ctl.clone())));
        }
        if let Some(ctl) = &o.mirror {
            mirrors.push((e.name.clone(), ctl.clone()));
        }
        devices.insert(o.entry());
        exports.push(o.export);
        descriptions.push(o.description);
    }
    let mut cfg = ServerConfig::new(exports);
    cfg.tuning.drain_timeout = std::time::Duration::from_secs(settings.shutdown_timeout);
    settings.limits.apply(&mut cfg.tuning);
    cfg.tcp = settings.tcp;
    if let Some((path, mode)) = &settings.unix {
        cfg.unix = Some(path.clone());
        cfg.unix_mode = *mode;
    }
    Ok(Opened {
        server: cfg,
        descriptions,
        control_sockets,
        mirrors,
        devices,
    })
}

/// Opens the device of export `e` (or assembles its mirror) as `settings` say: at start, and
/// for `blkq export add` while serving. `from_file`: as for [`open`].
pub fn open_export(
    settings: &Settings,
    e: &ExportSettings,
    from_file: bool,
) -> Result<OpenedExport> {
    let (backing, bitmaps_opt) = match &e.backing {
        Backing::Device(s) => {
            let (s, o) = split_spec(s).with_context(|| format!("device spec {s:?}"))?;
            (Backing::Device(s), o)
        }
        b => (b.clone(), BitmapsOpt::Default),
    };
    let b = match &backing {
        Backing::Mirror {
            legs,
            create,
            options,
            control,
        } => open_mirror_backing(settings, e, legs, create.as_ref(), options, from_file)?
            .with_control_socket(control.clone()),
        Backing::Device(spec) => open_device_backing(settings, e, spec, &bitmaps_opt)?,
    };
    let mut tracked = None;
    let dev: Arc<dyn Device> = match b.store {
        Some(store) => {
            let t = track(
                &e.name,
                b.dev,
                store,
                settings.bitmaps_reset,
                settings.bitmaps_gate,
            )?;
            tracked = Some(t.clone());
            t
        }
        None => b.dev,
    };
    let description = match &e.description {
        Some(d) => d.clone(),
        None if settings.describe_paths => b.full.clone(),
        None => neutral_description(b.kind, dev.limits().capacity),
    };
    let export = Export::new(e.name.clone(), dev)
        .description(description)
        .read_only(b.read_only)
        .access(e.access.clone());
    Ok(OpenedExport {
        export,
        description: b.full,
        control_socket: b.control_socket,
        tracked,
        mirror: b.mirror,
        remote: b.remote,
    })
}

/// An export's device as [`open_export`] opened it, before its dirty bitmaps.
struct Backed {
    dev: Arc<dyn Device>,
    /// Its full description.
    full: String,
    /// Its kind, for the neutral description.
    kind: &'static str,
    read_only: bool,
    /// Where its dirty bitmaps live; `None` for none (`bitmaps=off`).
    store: Option<Store>,
    /// A mirror's control socket.
    control_socket: Option<PathBuf>,
    /// A mirror's control.
    mirror: Option<Arc<Control>>,
    /// A remote device.
    remote: Option<Arc<RemoteDevice>>,
}

impl Backed {
    fn with_control_socket(mut self, path: Option<PathBuf>) -> Self {
        self.control_socket = path;
        self
    }
}

/// Assembles (or creates) the mirror of export `e` on `legs`, with its control; a leg it
/// starts without is watched and let back in when it returns.
fn open_mirror_backing(
    settings: &Settings,
    e: &ExportSettings,
    legs: &[String],
    create: Option<&CreateRules>,
    options: &[String],
    from_file: bool,
) -> Result<Backed> {
    let leg_overrides = QueueOverrides {
        read_only: false,
        ..settings.overrides.clone()
    };
    let (r, specs, away) = open_mirror(legs, create, options, &leg_overrides, from_file)?;
    let uuid = r.superblock(0).map(|s| s.array_uuid.to_string());
    let full = format!(
        "raid1 {} (array {}; each leg's first {} bytes hold its superblock and bitmap)",
        legs.join(","),
        uuid.unwrap_or_default(),
        r.data_offset()
    );
    let store = store_for_mirror(&r, &specs, legs);
    let ctl =
        Arc::new(Control::new(r.clone(), specs, leg_overrides.clone()).with_away(away.clone()));
    for a in &away {
        let c = Arc::downgrade(&ctl);
        let on_back: OnBack = Box::new(move |shown, slot, spec| {
            if let Some(c) = c.upgrade() {
                c.leg_back(shown, slot, spec);
            }
        });
        a.watch(on_back, &r, leg_overrides.clone());
    }
    let dev: Arc<dyn Device> = r;
    Ok(Backed {
        dev,
        full,
        kind: "raid1",
        read_only: e.read_only,
        store: Some(store),
        control_socket: None,
        mirror: Some(ctl),
        remote: None,
    })
}

/// Opens the device `spec` names (a local one, or an export on another NBD server; see
/// [`Spec`]), warning of what an operator should know (fault injection, data kept in memory).
fn open_device_backing(
    settings: &Settings,
    e: &ExportSettings,
    spec: &str,
    bitmaps_opt: &BitmapsOpt,
) -> Result<Backed> {
    let overrides = QueueOverrides {
        read_only: e.read_only,
        ..settings.overrides.clone()
    };
    let parsed = Spec::parse(spec).with_context(|| format!("device spec {spec:?}"))?;
    let opened = parsed
        .open(&overrides)
        .with_context(|| format!("device spec {spec:?}"))?;
    for w in &opened.warnings {
        tracing::warn!(export = %e.name, "{spec}: {w}");
    }
    let store = (*bitmaps_opt != BitmapsOpt::Off)
        .then(|| store_for(parsed.local(), bitmaps_opt, opened.dev.limits().capacity));
    Ok(Backed {
        full: format!("{spec} ({})", opened.describe),
        kind: opened.kind,
        read_only: opened.read_only,
        store,
        control_socket: None,
        mirror: None,
        remote: opened.remote,
        dev: opened.dev,
    })
}

/// A mirror [`open_mirror`] assembled: the array, the spec of the leg in each slot, and the
/// legs it started without.
type OpenedMirror = (Arc<Raid1>, Vec<Option<String>>, Vec<Arc<Away>>);

/// Opens the legs of a mirror and assembles (or, with `create`, creates by those rules) the
/// array. Returns it with the spec of the leg in each slot, and the legs it starts without
/// because they could not be opened (remote legs, with `allow_degraded`: see [`Away`]).
/// Errors name the flags, or with `from_file` the `[[raid1]]` table's keys.
fn open_mirror(
    legs: &[String],
    create: Option<&CreateRules>,
    options: &[String],
    overrides: &QueueOverrides,
    from_file: bool,
) -> Result<OpenedMirror> {
    let (create_how, degraded_how) = if from_file {
        (
            "`create = true` in its [[raid1]] table",
            "`options = [\"allow_degraded=true\"]` in its [[raid1]] table",
        )
    } else {
        ("--raid1-create", "--raid1-degraded")
    };
    let cfg = legs::raid1_config(options)?;
    if let Some(rules) = create {
        let r = create::create_array(legs, overrides, cfg, rules, create::SERVE)
            .context("--raid1-create: creating the array")?;
        tracing::info!(
            "raid1: created a new array over {} legs{}",
            legs.len(),
            if rules.assume_clean {
                ""
            } else {
                "; resyncing it from the first leg"
            }
        );
        return Ok((
            Arc::new(r),
            legs.iter().cloned().map(Some).collect(),
            Vec::new(),
        ));
    }
    // A remote leg that cannot be opened (its server down or unreachable) is started missing
    // when degraded starts are allowed, and tried again; any other failure stops the start.
    let mut opened = Vec::new();
    let mut unreachable = Vec::new();
    for spec in legs {
        match open_leg(spec, overrides) {
            Ok(dev) => opened.push((spec.clone(), dev)),
            Err(e) if Spec::on_another_host(spec) && cfg.allow_degraded => {
                tracing::warn!(
                    "raid1: {e:#}; starting the mirror without the leg (--raid1-degraded): it \
                     is shown missing, and taken back when it answers if its superblock is \
                     this array's"
                );
                unreachable.push((spec.clone(), format!("{e:#}")));
            }
            Err(e) if Spec::on_another_host(spec) => {
                return Err(e.context(format!(
                    "--raid1: leg {spec:?} cannot be reached, and the mirror does not start \
                     without it: {degraded_how} would start it without the leg (shown \
                     missing, and taken back when it answers)"
                )))
            }
            Err(e) => return Err(e),
        }
    }
    if opened.is_empty() {
        bail!("--raid1: no leg can be opened: the mirror cannot start");
    }
    match legs::plan_opened(opened)? {
        None if !unreachable.is_empty() => bail!(
            "--raid1: the legs that open carry no raid1 superblock and the others cannot be \
             reached: the array cannot be assembled"
        ),
        None => bail!(
            "--raid1: no leg carries a raid1 superblock (blank legs). To make a new mirror on \
             them add {create_how} (or run `blkq raid create {}` first)",
            legs.join(" ")
        ),
        Some(p) => {
            let rep = p.report()?;
            if !rep.legs.iter().any(|l| l.state == "in_sync") {
                bail!(
                    "--raid1: no in-sync leg among the given legs: the array cannot be assembled"
                );
            }
            for n in &rep.notes {
                tracing::warn!("raid1: {n}");
            }
            let mut specs: Vec<Option<String>> =
                rep.legs.iter().map(|l| l.device.clone()).collect();
            let every = cfg.readd_interval;
            let r = Raid1::assemble(legs::plan_devices(&p), cfg)
                .context("--raid1: assembling the array")?;
            let r = Arc::new(r);
            // The unreachable legs are shown in the slots the array misses (those whose leg
            // is missing, then the empty ones: a run without the leg emptied its slot on
            // disk), in the order given; where one goes back is its superblock's to say.
            let absent = |i: &usize| !r.leg_status(*i).is_some_and(|s| s.present);
            let is_missing = |i: &usize| rep.legs.get(*i).is_some_and(|l| l.state == "missing");
            let mut missing = (0..r.slots())
                .filter(|i| absent(i) && is_missing(i))
                .chain((0..r.slots()).filter(|i| absent(i) && !is_missing(i)));
            let mut away = Vec::new();
            for (spec, error) in unreachable {
                let Some(slot) = missing.next() else {
                    tracing::warn!(
                        "raid1: leg {spec:?}: the array misses no other slot for it: left out \
                         (add it with `blkq raid add` once it answers)"
                    );
                    continue;
                };
                specs.resize(r.slots().max(specs.len()), None);
                specs[slot] = Some(spec.clone());
                away.push(Arc::new(Away::new(spec, slot, every, error)));
            }
            Ok((r, specs, away))
        }
    }
}

/// What clients are told about an export without --describe-paths: the kind of device and
/// its size, nothing of the host (no file path, no spec options).
pub fn neutral_description(kind: &str, capacity: u64) -> String {
    format!("blkq {kind} device, {capacity} bytes")
}

/// The warning for a TCP listener others can reach, naming the risk; `None` on loopback or
/// with TLS required.
pub fn exposure_warning<'a>(
    addr: SocketAddr,
    tls: TlsMode,
    exports: impl IntoIterator<Item = (&'a str, &'a Access)>,
) -> Option<String> {
    if addr.ip().to_canonical().is_loopback() || tls == TlsMode::Require {
        return None;
    }
    let open: Vec<&str> = exports
        .into_iter()
        .filter(|(_, a)| a.allow.is_empty() && a.allow_subjects.is_empty())
        .map(|(n, _)| n)
        .collect();
    let clear = match tls {
        TlsMode::Off => {
            "without TLS: every block read and written crosses the network in clear \
                         (anyone on the path can read the data or change the writes)"
        }
        _ => {
            "with TLS optional (mode \"on\"): a client that does not ask for TLS sends and \
              receives every block in clear"
        }
    };
    let who = if open.is_empty() {
        "; every export has an allow-list, but a client address is no proof of identity on \
         its own"
            .to_string()
    } else {
        format!(
            "; anyone who can reach the port can read and write export(s) {open:?}, which have \
             no allow-list"
        )
    };
    Some(format!(
        "listening on {addr}, which is not a loopback address, {clear}{who}. Use TLS \
         (--tls=require) and allow-lists, or listen on 127.0.0.1 and tunnel"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use nbd::server::parse_cidr;

    fn export(name: &str, allow: &[&str]) -> Export {
        let dev = open_leg("null:1M", &QueueOverrides::default()).unwrap();
        Export::new(name, dev).access(Access {
            allow: allow.iter().map(|c| parse_cidr(c).unwrap()).collect(),
            ..Access::default()
        })
    }

    /// A device's own scheduler options hold unless `--sched` is given.
    #[test]
    fn a_device_keeps_its_scheduler_unless_told() {
        use crate::serve::args::parse_serve_flags;
        use crate::serve::config::{Config, Source};
        use crate::serve::settings::check;
        // Whether the first export's queue runs a scheduler.
        let scheduled = |flags: &[&str]| {
            let cfg = Config::from_args(&parse_serve_flags(flags).unwrap()).unwrap();
            open(&check(&cfg, &Source::CommandLine).unwrap(), false).map(|o| {
                let dev = o.server.exports[0].device.clone();
                let q = dev.queue_stats().expect("a plain device is a queue");
                q.sched.is_some()
            })
        };
        let spec = "null:16M,sched=mq-deadline,fifo_batch=8";
        assert!(scheduled(&["--device", spec, "--no-unix"]).unwrap());
        assert!(!scheduled(&["--device", "null:16M", "--no-unix"]).unwrap());
        assert!(scheduled(&[
            "--device",
            "null:16M",
            "--sched",
            "mq-deadline",
            "--no-unix"
        ])
        .unwrap());
        // Told otherwise, the device's tunables have no scheduler to go to: said so.
        let e = scheduled(&["--device", spec, "--sched", "none", "--no-unix"]).err();
        assert!(
            format!("{e:?}").contains("without sched=mq-deadline"),
            "{e:?}"
        );
    }

    #[test]
    fn exposure_warnings() {
        let lo: SocketAddr = "127.0.0.1:10809".parse().unwrap();
        let any: SocketAddr = "0.0.0.0:10809".parse().unwrap();
        let ex = [export("a", &[]), export("b", &["10.0.0.0/8"])];
        let ex: Vec<(&str, &Access)> = ex.iter().map(|e| (e.name.as_str(), &e.access)).collect();
        assert_eq!(exposure_warning(lo, TlsMode::Off, ex.clone()), None);
        assert_eq!(
            exposure_warning("[::1]:1".parse().unwrap(), TlsMode::Off, ex.clone()),
            None
        );
        assert_eq!(exposure_warning(any, TlsMode::Require, ex.clone()), None);
        let w = exposure_warning(any, TlsMode::Off, ex.clone()).unwrap();
        assert!(w.contains("without TLS") && w.contains("in clear"), "{w}");
        assert!(
            w.contains("anyone who can reach the port") && w.contains("\"a\""),
            "{w}"
        );
        let w = exposure_warning(any, TlsMode::On, ex[1..].to_vec()).unwrap();
        assert!(w.contains("TLS optional") && w.contains("every export has an allow-list"));
    }
}
