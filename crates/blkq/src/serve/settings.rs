//! The configuration checked: [`check`] turns a [`Config`] (from flags or a file) into
//! [`Settings`], everything validated that can be without opening a device. The sections'
//! values were validated as they were parsed (their types); what is left is what spans
//! fields or needs the exports: names, device specs, mirrors, access rules, listeners.

use std::net::SocketAddr;
use std::ops::Range;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use blk_drivers::spec::QueueOverrides;
use nbd::server::{parse_cidr, parse_subject_rule, Access};
use nbd::tls::TlsMode;
use toml::Spanned;

use super::args::{listen_addr, LimitArgs, TlsArgs};
use super::config::{Config, ExportDecl, Raid1Decl, Source};
use crate::open::Spec;
use crate::raid::create::CreateRules;

/// What a `--device` or `[[export]] device` may not be: the command line's spelling of a
/// mirror is `--raid1`, the file's a `[[raid1]]` table.
const MIRROR_PREFIX: &str = "raid1:";

/// A validated configuration: everything parsed, nothing opened yet.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Queue settings every device gets (`read_only` is per export).
    pub overrides: QueueOverrides,
    /// The TCP address (`None`: `no_tcp`).
    pub tcp: Option<SocketAddr>,
    /// The Unix socket and its mode (`None`: `no_unix`).
    pub unix: Option<(PathBuf, u32)>,
    /// Resource limits.
    pub limits: LimitArgs,
    /// Seconds of `--shutdown-timeout`.
    pub shutdown_timeout: u64,
    /// Send full descriptions.
    pub describe_paths: bool,
    /// TLS settings.
    pub tls: TlsArgs,
    /// The exports, in order.
    pub exports: Vec<ExportSettings>,
    /// The server's control socket (`[server] control`), beside any mirror's own.
    pub control: Option<PathBuf>,
    /// Replace refused bitmap sidecars (`--bitmaps-reset`).
    pub bitmaps_reset: bool,
    /// The bitmaps' gate (`--bitmaps-gate`).
    pub bitmaps_gate: cbt::Mode,
    /// `--log-level` (validated).
    pub log_level: Option<String>,
}

/// One validated export.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportSettings {
    /// Its name.
    pub name: String,
    /// A description given in the file, sent as is.
    pub description: Option<String>,
    /// What it serves.
    pub backing: Backing,
    /// Read-only.
    pub read_only: bool,
    /// Who may use it.
    pub access: Access,
}

/// What an export serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backing {
    /// A device spec (validated).
    Device(String),
    /// A mirror.
    Mirror {
        /// The legs' specs.
        legs: Vec<String>,
        /// Create it first, by these rules.
        create: Option<CreateRules>,
        /// `KEY=VALUE` options (validated).
        options: Vec<String>,
        /// Its control socket.
        control: Option<PathBuf>,
    },
}

/// Checks a device spec without opening it ([`Spec::parse`]).
fn check_device(spec: &str) -> Result<()> {
    let (spec, _) = super::bitmaps::split_spec(spec)?;
    Spec::parse(&spec)?;
    Ok(())
}

/// Validates an `[[export]]` (`--device`) named `name` (checked by the caller) without
/// opening its device: at start, and for `blkq export add` while serving (`tls`: the
/// server's, for `allow_subjects`).
pub fn check_export(
    e: &ExportDecl,
    name: String,
    src: &Source,
    tls: &TlsArgs,
) -> Result<ExportSettings> {
    let spec = e.device.get_ref();
    let at = src.at(&e.device, "device", "device");
    if spec.starts_with(MIRROR_PREFIX) {
        bail!(
            "{at} {spec:?}: a mirror is a [[raid1]] table (--raid1 LEG,LEG on the command \
             line)"
        );
    }
    check_device(spec).with_context(|| format!("{at} {spec:?}"))?;
    Ok(ExportSettings {
        name,
        description: e.description.clone(),
        backing: Backing::Device(spec.clone()),
        read_only: e.read_only,
        access: access(src, &e.allow, &e.allow_subjects, tls)?,
    })
}

/// Checks a `[[raid1]]` table (or `--raid1`) named `name`: its legs, its options, and the
/// keys that only creating an array takes.
fn check_array(r: &Raid1Decl, name: String, src: &Source, tls: &TlsArgs) -> Result<ExportSettings> {
    let at = src.at(&r.legs, "legs", "raid1");
    // One leg serves an existing array alone (a failover: the array itself asks for
    // allow_degraded); a new one needs two.
    if r.create && r.legs.get_ref().len() < 2 {
        bail!("{at}: creating a mirror needs at least two legs");
    }
    if !r.create && (r.force || r.assume_clean || r.size.is_some()) {
        bail!("{at}: force, assume_clean and size are for creating the array (create = true)");
    }
    for leg in r.legs.get_ref() {
        let spec = leg.get_ref();
        check_device(spec).with_context(|| format!("{} {spec:?}", src.at(leg, "legs", "raid1")))?;
    }
    for o in &r.options {
        crate::raid::legs::raid1_config(std::slice::from_ref(o.get_ref()))
            .with_context(|| src.at(o, "options", "raid1-option"))?;
        if !r.create && o.get_ref().starts_with("integrity=") {
            bail!(
                "{}: per-block checksums are chosen when the array is created (create = \
                 true, --raid1-create); an existing array keeps what its superblock says",
                src.at(o, "options", "raid1-option")
            );
        }
    }
    Ok(ExportSettings {
        name,
        description: r.description.clone(),
        backing: Backing::Mirror {
            legs: r
                .legs
                .get_ref()
                .iter()
                .map(|l| l.get_ref().clone())
                .collect(),
            create: r.create.then(|| CreateRules {
                force: r.force,
                assume_clean: r.assume_clean,
                size: r.size.map(|b| b.0),
            }),
            options: r.options.iter().map(|o| o.get_ref().clone()).collect(),
            control: r.control.clone(),
        },
        read_only: r.read_only,
        access: access(src, &r.allow, &r.allow_subjects, tls)?,
    })
}

/// Validates everything that can be without opening a device.
pub fn check(cfg: &Config, src: &Source) -> Result<Settings> {
    let s = &cfg.server;
    if s.no_tcp && s.no_unix {
        bail!("no_tcp and no_unix together leave nothing to listen on");
    }
    let tcp = if s.no_tcp {
        None
    } else {
        Some(listen_addr(&s.listen).with_context(|| src.at_key("server", "listen", "listen"))?)
    };
    let socket = s
        .socket
        .clone()
        .unwrap_or_else(|| nbd::server::DEFAULT_UNIX_PATH.into());
    let unix = (!s.no_unix).then_some((socket, s.socket_mode.0));
    let tls = cfg.tls.clone();
    if tls.tls_verify_peer && tls.tls == TlsMode::Off {
        bail!(
            "{}: verifying client certificates needs TLS (mode \"on\" or \"require\")",
            src.at_key("tls", "verify_peer", "tls-verify-peer")
        );
    }
    let overrides = QueueOverrides {
        hw_queues: s.hw_queues,
        queue_depth: s.queue_depth,
        policy: s.policy,
        sched: s.sched,
        sched_lock: s.sched_lock,
        ..QueueOverrides::default()
    };

    let mut exports: Vec<ExportSettings> = Vec::new();
    let mut names: Vec<(String, String)> = Vec::new(); // name, where
    let mut add_name = |name: &Option<Spanned<String>>, fallback: Range<usize>| {
        let (n, span) = match name {
            Some(n) => (n.get_ref().clone(), n.span()),
            None => (String::new(), fallback),
        };
        let at = src.at_span(span, "name", "export");
        if n.len() > 4096 || n.contains('\0') {
            bail!("{at}: {n:?} is not a valid export name (at most 4096 bytes, no NUL)");
        }
        if let Some((_, first)) = names.iter().find(|(m, _)| *m == n) {
            bail!("{at}: a second export named {n:?} (the first: {first})");
        }
        names.push((n.clone(), at));
        Ok(n)
    };
    for e in &cfg.exports {
        let name = add_name(&e.name, e.device.span())?;
        exports.push(check_export(e, name, src, &tls)?);
    }
    for r in &cfg.arrays {
        let name = add_name(&r.name, r.legs.span())?;
        exports.push(check_array(r, name, src, &tls)?);
    }
    if exports.is_empty() {
        bail!("nothing to serve: no [[export]] or [[raid1]] table");
    }
    Ok(Settings {
        overrides,
        tcp,
        unix,
        limits: cfg.limits.clone(),
        shutdown_timeout: s.shutdown_timeout.0,
        describe_paths: s.describe_paths,
        tls,
        exports,
        control: s.control.clone(),
        bitmaps_reset: s.bitmaps_reset,
        bitmaps_gate: s.bitmaps_gate.0,
        log_level: match &s.log_level {
            Some(l) => {
                crate::logs::parse_filter(l).map_err(|e| {
                    anyhow::anyhow!("{}: {e}", src.at_key("server", "log_level", "log-level"))
                })?;
                Some(l.clone())
            }
            None => None,
        },
    })
}

/// An export's access rules, validated.
fn access(
    src: &Source,
    allow: &[Spanned<String>],
    subjects: &[Spanned<String>],
    tls: &TlsArgs,
) -> Result<Access> {
    let mut a = Access::default();
    for c in allow {
        let net = parse_cidr(c.get_ref()).with_context(|| src.at(c, "allow", "allow"))?;
        a.allow.push(net);
    }
    for s in subjects {
        let at = src.at(s, "allow_subjects", "allow-subject");
        // Checked here, kept as written: nbd::server::access matches it, exactly.
        if let Err(e) = parse_subject_rule(s.get_ref()) {
            bail!("{at}: {e}");
        }
        if !tls.tls_verify_peer {
            bail!(
                "{at}: certificate subjects need verified client certificates ([tls] \
                 verify_peer = true, --tls-verify-peer): without them no client has a subject"
            );
        }
        a.allow_subjects.push(s.get_ref().clone());
    }
    Ok(a)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::serve::args::{parse_serve_flags, ServeArgs};

    fn args(v: &[&str]) -> ServeArgs {
        parse_serve_flags(v).unwrap()
    }

    fn file(text: &str) -> Result<Settings> {
        let path = Path::new("blkq.toml");
        let cfg = Config::parse(path, text)?;
        check(
            &cfg,
            &Source::File {
                path: path.into(),
                text: text.into(),
            },
        )
    }

    fn flags(v: &[&str]) -> Result<Settings> {
        check(&Config::from_args(&args(v))?, &Source::CommandLine)
    }

    fn err(r: Result<Settings>) -> String {
        format!("{:#}", r.unwrap_err())
    }

    #[test]
    fn a_file_and_the_equivalent_flags_give_the_same_exports() {
        let text = r#"
[server]
socket = "/tmp/x.sock"
socket_mode = 0o660
listen = "0.0.0.0:10900"
sched = "mq-deadline"
queue_depth = 64
shutdown_timeout = 5

[limits]
max_connections = 7
idle_timeout = 2.5
memory_budget = "512M"

[[export]]
name = "a"
device = "mem:1M"
read_only = true
allow = ["10.0.0.0/8", "127.0.0.1"]

[[export]]
name = "b"
device = "null:1G"
read_only = true
allow = ["10.0.0.0/8", "127.0.0.1"]

[[raid1]]
name = "m"
legs = ["file:/a.img,direct=1", "file:/b.img"]
create = true
assume_clean = true
size = "64M"
options = ["barrier=locked"]
control = "/tmp/ctl"
read_only = true
allow = ["10.0.0.0/8", "127.0.0.1"]
"#;
        let f = file(text).unwrap();
        let c = flags(&[
            "--socket",
            "/tmp/x.sock",
            "--socket-mode",
            "660",
            "--listen",
            "0.0.0.0:10900",
            "--sched",
            "mq-deadline",
            "--queue-depth",
            "64",
            "--shutdown-timeout",
            "5",
            "--max-connections",
            "7",
            "--idle-timeout",
            "2.5",
            "--memory-budget",
            "512M",
            "--device",
            "mem:1M",
            "--export",
            "a",
            "--device",
            "null:1G",
            "--export",
            "b",
            "--raid1",
            "file:/a.img,direct=1,file:/b.img",
            "--raid1-create",
            "--raid1-assume-clean",
            "--raid1-size",
            "64M",
            "--raid1-option",
            "barrier=locked",
            "--control",
            "/tmp/ctl",
            "--export",
            "m",
            "--read-only",
            "--allow",
            "10.0.0.0/8",
            "--allow",
            "127.0.0.1",
        ])
        .unwrap();
        assert_eq!(format!("{f:?}"), format!("{c:?}"));
        assert_eq!(f.exports.len(), 3);
        assert_eq!(f.exports[0].access.allow.len(), 2);
        assert_eq!(f.unix, Some(("/tmp/x.sock".into(), 0o660)));
        assert_eq!(f.limits.memory_budget.map(|b| b.0), Some(512 << 20));
    }

    /// Without a mirror, `--control` is the server's socket, as `[server] control` is; the
    /// `bitmaps=` option is checked with the spec; `--bitmaps-reset` is `[server]
    /// bitmaps_reset`.
    #[test]
    fn the_servers_control_socket_and_bitmap_options() {
        let f = file(
            "[server]\ncontrol = \"/tmp/c.sock\"\nbitmaps_reset = true\n\n[[export]]\n\
             device = \"file:/x.img,bitmaps=/y.bm\"\n",
        )
        .unwrap();
        let c = flags(&[
            "--device",
            "file:/x.img,bitmaps=/y.bm",
            "--control",
            "/tmp/c.sock",
            "--bitmaps-reset",
        ])
        .unwrap();
        assert_eq!(format!("{f:?}"), format!("{c:?}"));
        assert_eq!(c.control, Some("/tmp/c.sock".into()));
        assert!(c.bitmaps_reset);
        let e = err(flags(&["--device", "mem:1M,bitmaps="]));
        assert!(e.contains("bitmaps= needs a path or off"), "{e}");
        // With a mirror, --control stays the mirror's (which also serves the bitmaps).
        let m = flags(&["--raid1", "file:/a,file:/b", "--control", "/tmp/m.sock"]).unwrap();
        assert_eq!(m.control, None);
    }

    #[test]
    fn defaults_are_the_command_lines() {
        let f = file("[[export]]\ndevice = \"mem:1G\"\n").unwrap();
        let c = flags(&[]).unwrap();
        assert_eq!(format!("{f:?}"), format!("{c:?}"));
        assert_eq!(f.exports[0].name, "");
    }

    #[test]
    fn the_example_config_parses() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/blkq.example.toml");
        let (cfg, src) = Config::load(&path).unwrap();
        let c = check(&cfg, &src).unwrap();
        let names: Vec<&str> = c.exports.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["scratch", "images", "mirror"]);
        assert!(c.exports[1].read_only);
        assert_eq!(c.exports[1].access.allow.len(), 3);
    }

    #[test]
    fn errors_name_the_line() {
        // (file, what the error starts with, what else it says)
        let cases: &[(&str, &str, &str)] = &[
            (
                "[[export]]\nname = \"a\"\ndevice = \"mem:1M\"\nallow = [\n  \"10.0.0.0/8\",\n  \"10.0.0/8\",\n]\n",
                "blkq.toml:6: allow",
                "10.0.0/8",
            ),
            (
                "[server]\nlisten = \"127.0.0.1:1\"\nbogus = 1\n[[export]]\ndevice = \"mem:1M\"\n",
                "blkq.toml:3:",
                "bogus",
            ),
            (
                "[[export]]\ndevice = \"mem:1M\"\n\n[[export]]\nname = \"x\"\ndevice = \"floppy:1M\"\n",
                "blkq.toml:6: device \"floppy:1M\"",
                "",
            ),
            (
                "[[export]]\ndevice = \"mem:1M\"\nreadonly = true\n",
                "blkq.toml:3:",
                "readonly",
            ),
            (
                "[tls]\nmode = \"maybe\"\n[[export]]\ndevice = \"mem:1M\"\n",
                "blkq.toml:2: mode",
                "maybe",
            ),
            (
                "[tls]\nmode = \"off\"\n\nverify_peer = true\n[[export]]\ndevice = \"mem:1M\"\n",
                "blkq.toml:4: verify_peer",
                "needs TLS",
            ),
            (
                "[[export]]\nname = \"a\"\ndevice = \"mem:1M\"\n[[export]]\nname = \"a\"\ndevice = \"mem:1M\"\n",
                "blkq.toml:5: name",
                "second",
            ),
            (
                "[[export]]\ndevice = \"mem:1M\"\nallow_subjects = [\"CN=x\"]\n",
                "blkq.toml:3: allow_subjects",
                "verify_peer",
            ),
            (
                "[[export]]\ndevice = \"mem:1M\"\nallow_subjects = [\n\"foo:CN=y\",\n\"CN=x\"]\n",
                "blkq.toml:4: allow_subjects",
                "unknown prefix",
            ),
            (
                "[server]\nsocket_mode = 660\n[[export]]\ndevice = \"mem:1M\"\n",
                "blkq.toml:2: socket_mode",
                "0o660",
            ),
            (
                "[server]\nshutdown_timeout = 0\n[[export]]\ndevice = \"mem:1M\"\n",
                "blkq.toml:2: shutdown_timeout",
                "86400",
            ),
            (
                "[server]\nsched = \"cfq\"\n[[export]]\ndevice = \"mem:1M\"\n",
                "blkq.toml:2: sched",
                "cfq",
            ),
            (
                "[limits]\n\nsend_timeout = 0\n[[export]]\ndevice = \"mem:1M\"\n",
                "blkq.toml:3: send_timeout",
                "positive",
            ),
            (
                "[limits]\nmemory_budget = \"0\"\n[[export]]\ndevice = \"mem:1M\"\n",
                "blkq.toml:2: memory_budget",
                "zero",
            ),
            (
                "[limits]\nmax_connections = 0\n[[export]]\ndevice = \"mem:1M\"\n",
                "blkq.toml:2: max_connections",
                "",
            ),
            (
                "[limits]\nbudget_impl = \"locked\"\n[[export]]\ndevice = \"mem:1M\"\n",
                "blkq.toml:2:",
                "budget_impl",
            ),
            (
                "[[raid1]]\nlegs = [\"file:/a\"]\ncreate = true\n",
                "blkq.toml:2: legs",
                "two legs",
            ),
            (
                "[[raid1]]\nlegs = [\"file:/a\", \"file:/b\"]\nassume_clean = true\n",
                "blkq.toml:2: legs",
                "create = true",
            ),
            (
                "[[raid1]]\nlegs = [\"file:/a\", \"file:/b\"]\noptions = [\n\"nonsense\"]\n",
                "blkq.toml:4: options",
                "",
            ),
            ("[server]\nno_tcp = true\n", "", "nothing to serve"),
            ("[server\n", "blkq.toml:1:", ""),
        ];
        for (text, starts, says) in cases {
            let e = err(file(text));
            assert!(e.starts_with(starts) && e.contains(says), "{text:?}: {e}");
        }
    }

    #[test]
    fn command_line_errors_name_the_flag() {
        let e = err(flags(&["--allow", "300.0.0.0/8"]));
        assert!(e.starts_with("--allow") && e.contains("300.0.0.0/8"), "{e}");
        let e = err(flags(&["--device", "floppy:1M"]));
        assert!(e.starts_with("--device \"floppy:1M\""), "{e}");
        let e = err(flags(&["--device", "raid1:file:/a,file:/b"]));
        assert!(e.contains("--raid1"), "{e}");
        let e = err(flags(&["--tls-verify-peer"]));
        assert!(
            e.starts_with("--tls-verify-peer") && e.contains("needs TLS"),
            "{e}"
        );
        let e = err(flags(&["--allow-subject", "CN=a"]));
        assert!(
            e.starts_with("--allow-subject") && e.contains("verify"),
            "{e}"
        );
        for (rule, says) in [
            ("CN=a, O=b", "space"),
            ("CN=client1 ", "whitespace"),
            ("CN=client1\t", "whitespace"),
            ("CN=client1\u{a0}", "whitespace"),
            ("CN=a\nb", "control"),
            ("", "empty"),
            ("exact:CN=a", "unknown prefix"),
            ("client1", "no '='"),
            ("attr:CN=a,O=b", "one TYPE=VALUE"),
        ] {
            let e = err(flags(&["--allow-subject", rule]));
            assert!(
                e.starts_with("--allow-subject") && e.contains(says),
                "{rule:?}: {e}"
            );
        }
    }

    #[test]
    fn relative_paths_in_a_file_are_from_its_directory() {
        let d = tempfile::tempdir().unwrap();
        let etc = d.path().join("etc");
        std::fs::create_dir(&etc).unwrap();
        let f = etc.join("blkq.toml");
        std::fs::write(
            &f,
            r#"
[server]
socket = "run/blkq.sock"
[tls]
mode = "on"
certificates = "pki"
[[export]]
name = "rel"
device = "file:disk.img,ro=1"
[[export]]
name = "abs"
device = "file:/srv/abs.img"
[[export]]
name = "mem"
device = "mem:1M"
[[raid1]]
name = "m"
legs = ["file:a.img", "file:/srv/b.img,fault.seed=1", "file:../c.img"]
control = "ctl.sock"
"#,
        )
        .unwrap();
        let (cfg, src) = Config::load(&f).unwrap();
        let c = check(&cfg, &src).unwrap();
        let at = |p: &str| etc.join(p);
        let spec = |p: &str| format!("file:{}", at(p).display());
        let mode = nbd::server::DEFAULT_UNIX_MODE;
        assert_eq!(c.unix, Some((at("run/blkq.sock"), mode)));
        assert_eq!(c.tls.tls_certificates, Some(at("pki")));
        let backing: Vec<&Backing> = c.exports.iter().map(|e| &e.backing).collect();
        assert_eq!(
            backing,
            [
                &Backing::Device(format!("{},ro=1", spec("disk.img"))),
                &Backing::Device("file:/srv/abs.img".into()),
                &Backing::Device("mem:1M".into()),
                &Backing::Mirror {
                    legs: vec![
                        spec("a.img"),
                        "file:/srv/b.img,fault.seed=1".into(),
                        spec("../c.img"),
                    ],
                    create: None,
                    options: vec![],
                    control: Some(at("ctl.sock")),
                },
            ]
        );
        // Left out, the socket is the command line's default (from the working directory).
        std::fs::write(&f, "[[export]]\ndevice = \"mem:1M\"\n").unwrap();
        let (cfg, src) = Config::load(&f).unwrap();
        let c = check(&cfg, &src).unwrap();
        assert_eq!(c.unix, Some((nbd::server::DEFAULT_UNIX_PATH.into(), mode)));
        // The command line's paths stay relative to the working directory.
        let c = flags(&["--socket", "s.sock", "--device", "file:d.img"]).unwrap();
        assert_eq!(c.unix, Some(("s.sock".into(), mode)));
        assert_eq!(c.exports[0].backing, Backing::Device("file:d.img".into()));
        // A directory whose name a device spec cannot hold: said so, with the line.
        let odd = d.path().join("a,b");
        std::fs::create_dir(&odd).unwrap();
        let f = odd.join("blkq.toml");
        std::fs::write(&f, "[[export]]\ndevice = \"file:x.img\"\n").unwrap();
        let e = format!("{:#}", Config::load(&f).unwrap_err());
        assert!(
            e.contains("blkq.toml:2: device") && e.contains("comma"),
            "{e}"
        );
    }
}
