//! Opens a device from its spec, whatever its kind: one of blk-drivers' local kinds (`null:`,
//! `mem:`, `file:`, `rbd:`, each parsing its own options; `fault.` options wrap it in a device
//! that injects faults) or an export on another NBD server (`nbd://`, `nbd+unix://` and their
//! TLS forms). The one place in the binary that tells a local spec from a remote one: exports,
//! legs, `blkq raid`, `blkq bench` and the control socket's `add` all open through it.

use anyhow::{Context, Result};
use blk::Device;
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use blkq_sync::DynArc as Arc;
use nbd::remote::{RemoteDevice, RemoteSpec};

/// A checked device spec.
pub enum Spec {
    /// A local device.
    Local(DeviceSpec),
    /// An export on another NBD server: its URI, checked.
    Remote(String),
}

/// A device [`Spec::open`] opened, with what the server says of it.
pub struct Opened {
    /// The device.
    pub dev: Arc<dyn Device>,
    /// Its kind's name (`null`, `mem`, `file`, `rbd`, `nbd`).
    pub kind: &'static str,
    /// What it is, for a local description (its queue and driver, or the remote export).
    pub describe: String,
    /// Whether it takes no writes (asked, or its server says so).
    pub read_only: bool,
    /// The remote device, for its connections' statistics and checks.
    pub remote: Option<Arc<RemoteDevice>>,
    /// What an operator should be told when it opens (fault injection, data kept in memory).
    pub warnings: Vec<&'static str>,
}

impl Spec {
    /// Parses and checks `spec` without opening anything (a local spec's fault options
    /// included).
    pub fn parse(spec: &str) -> Result<Self> {
        if Self::on_another_host(spec) {
            RemoteSpec::parse(spec)?;
            return Ok(Self::Remote(spec.to_string()));
        }
        let parsed: DeviceSpec = spec.parse()?;
        parsed.fault_config()?;
        Ok(Self::Local(parsed))
    }

    /// Whether `part` of a list begins a device spec (a local kind's `NAME:` or a remote
    /// export's URI) rather than continuing the one before (`key=value`).
    pub fn starts_a_spec(part: &str) -> bool {
        DeviceSpec::starts_a_spec(part) || Self::on_another_host(part)
    }

    /// Whether `spec` names a device on another host, which may be unreachable for a while
    /// (a mirror may start without such a leg, and take it back when it answers).
    pub fn on_another_host(spec: &str) -> bool {
        RemoteSpec::is_remote(spec)
    }

    /// `spec` with every relative path in it joined to `dir` (a config file's directory): the
    /// paths a local spec's kind declares ([`DeviceSpec::rebase`]), or a remote URI's path
    /// parameters ([`RemoteSpec::rebase`]).
    pub fn rebase(spec: &str, dir: &std::path::Path) -> Result<String> {
        if Self::on_another_host(spec) {
            return Ok(RemoteSpec::rebase(spec, dir));
        }
        Ok(DeviceSpec::rebase(spec, dir)?)
    }

    /// The local spec, if it is one (where its dirty bitmaps' sidecar goes by default).
    pub fn local(&self) -> Option<&DeviceSpec> {
        match self {
            Self::Local(p) => Some(p),
            Self::Remote(_) => None,
        }
    }

    /// Opens the device, with `overrides` over a local spec's queue options (read-only among
    /// them).
    pub fn open(&self, overrides: &QueueOverrides) -> Result<Opened> {
        match self {
            Self::Remote(uri) => {
                let dev = Arc::new(RemoteDevice::open(uri)?);
                let read_only = overrides.read_only
                    || dev
                        .details()
                        .flags
                        .contains(nbd::codec::TransmissionFlags::READ_ONLY);
                Ok(Opened {
                    describe: format!("remote NBD export, {} bytes", dev.limits().capacity),
                    kind: "nbd",
                    read_only,
                    remote: Some(dev.clone()),
                    dev,
                    warnings: Vec::new(),
                })
            }
            Self::Local(parsed) => {
                let faults = parsed.fault_config()?.is_some();
                let (dev, describe): (Arc<dyn Device>, String) = if faults {
                    let dev = parsed.build_device(overrides)?;
                    (dev, "with fault injection".to_string())
                } else {
                    let q = parsed.build(overrides)?;
                    let describe = q.describe();
                    (Arc::new(q), describe)
                };
                let mut warnings = Vec::new();
                if faults {
                    warnings.push("fault injection is on: I/O fails or is delayed on purpose");
                }
                warnings.extend(parsed.kind.warning);
                Ok(Opened {
                    dev,
                    kind: parsed.kind.name,
                    describe,
                    read_only: parsed.is_read_only(overrides),
                    remote: None,
                    warnings,
                })
            }
        }
    }
}

/// Opens a mirror's leg (or a bench's device) from its spec.
pub fn open_leg(spec: &str, overrides: &QueueOverrides) -> Result<Arc<dyn Device>> {
    let parsed = Spec::parse(spec).with_context(|| format!("leg {spec:?}: bad device spec"))?;
    let opened = parsed
        .open(overrides)
        .with_context(|| format!("leg {spec:?}: cannot open it"))?;
    Ok(opened.dev)
}
