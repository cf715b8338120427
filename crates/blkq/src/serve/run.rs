//! `blkq serve` running: the server started over the opened exports, signals, shutdown.
//!
//! Signals: SIGINT, SIGTERM and SIGHUP are blocked in every thread (the mask is set before any thread
//! exists, and threads inherit it) and taken synchronously by one thread with `sigwait(2)`:
//! no signal handler runs, so nothing has to be async-signal-safe. The first signal starts a
//! graceful shutdown (see `nbd::server`: stop accepting without touching the socket path,
//! finish in-flight requests within `--shutdown-timeout`, flush the devices, remove the
//! socket); the exit status is 0 only if every export drained and every flush succeeded. An
//! export with a request stuck in its device (a hung disk) past the timeout is named on stderr
//! and the process exits 1 without waiting for it. A second signal exits at once with status
//! 130. SIGHUP never stops the server: it reloads the certificates and the access rules
//! (see [`super::reload`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use nbd::server::{Export, Server, Stopper};
use nbd::tls::TlsMode;

use super::args::{listen_addr, ServeArgs};
use super::config::{Config, Source};
use super::plan::{exposure_warning, open};
use super::reload::Reload;
use super::settings::check;
use super::tls::load as load_tls;
use crate::control::bitmap::Handler;
use crate::control::exports::Served;
use crate::control::server::Control;
use crate::control::socket::ControlServer;
use blkq_sync::Arc;

/// Blocks SIGINT, SIGTERM and SIGHUP in the calling thread (and so in every thread it spawns later).
fn block_signals() -> Result<libc::sigset_t> {
    // SAFETY: an all-zero `sigset_t` is a valid (if unspecified) value; `sigemptyset`
    // initialises it properly before use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, exclusively borrowed sigset_t for each call; the signal
    // numbers are valid; `pthread_sigmask` reads `set` and does not keep the pointer.
    let rc = unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGHUP);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut())
    };
    if rc != 0 {
        bail!(
            "blocking SIGINT/SIGTERM/SIGHUP: {}",
            std::io::Error::from_raw_os_error(rc)
        );
    }
    Ok(set)
}

/// Waits for SIGINT/SIGTERM/SIGHUP on a thread of its own; the first SIGINT or SIGTERM stops
/// the server, SIGHUP reloads.
fn watch_signals(set: libc::sigset_t, stopper: Stopper, mut reload: Reload) {
    std::thread::spawn(move || {
        let mut first = true;
        loop {
            let mut sig: libc::c_int = 0;
            // SAFETY: `set` is an initialised sigset_t owned by this closure and `sig` a valid
            // out-pointer; both outlive the call.
            let rc = unsafe { libc::sigwait(&set, &mut sig) };
            if rc != 0 {
                continue;
            }
            if sig == libc::SIGHUP {
                reload.run();
                continue;
            }
            if first {
                tracing::info!(
                    "signal {sig} received: finishing in-flight requests (again to force)"
                );
                super::notify::sd_notify("STOPPING=1\nSTATUS=finishing in-flight requests");
                stopper.stop();
                first = false;
            } else {
                tracing::warn!("second signal: exiting now");
                std::process::exit(130);
            }
        }
    });
}

/// Runs `blkq serve`.
pub fn run(a: ServeArgs) -> Result<()> {
    // Before any thread exists (see the module docs).
    let sigset = block_signals()?;
    let mut levels = crate::logs::init(a.report.log_format, a.report.verbose);
    let (config, source) = match &a.config {
        Some(path) => Config::load(path)?,
        None => (Config::from_args(&a)?, Source::CommandLine),
    };
    let settings = check(&config, &source)?;
    if let (Some(l), Some(level)) = (levels.as_mut(), &settings.log_level) {
        if let Err(e) = l.set(Some(level)) {
            tracing::warn!("--log-level {level:?} not applied: {e}");
        }
    }
    let kept = settings.clone();
    let tls_mode = settings.tls.tls;
    let tls_dir = settings
        .tls
        .tls_certificates
        .clone()
        .filter(|_| tls_mode != TlsMode::Off);
    let tls = load_tls(&settings.tls, &source)?;
    let shutdown_timeout = settings.shutdown_timeout;
    let opened = open(&settings, source.is_file())?;
    let exports = opened.server.exports.clone();
    let descriptions = opened.descriptions;
    let mut cfg = opened.server;
    cfg.tls = tls;
    if let Some(addr) = cfg.tcp {
        let access = exports.iter().map(|e| (e.name.as_str(), &e.access));
        if let Some(w) = exposure_warning(addr, tls_mode, access) {
            tracing::warn!("{w}");
        }
    }
    let server = Server::start(cfg)?;
    let served = Arc::new(Served {
        server: server.exports(),
        settings: settings.clone(),
        devices: opened.devices.clone(),
    });
    let reload = Reload {
        config: a.config.clone(),
        settings: kept,
        server: server.reloader(),
        source,
        served: Arc::downgrade(&served),
        levels,
    };
    watch_signals(sigset, server.stopper(), reload);
    let _metrics = match &a.report.metrics {
        Some(m) => Some(crate::metrics::start_for_serve(
            listen_addr(m).context("--metrics")?,
            a.report.metrics_addr_file.as_deref(),
            server.metrics(),
            opened.mirrors.clone(),
            opened.devices.clone(),
        )?),
        None => None,
    };
    let control_servers = start_control_servers(opened.control_sockets, &served)?;

    // Every listener is bound: the NBD sockets (Server::start), metrics, control sockets.
    if let Some(fd) = a.report.ready_fd {
        super::notify::ready_fd(fd)?;
    }
    super::notify::sd_notify(&format!(
        "READY=1\nSTATUS=serving {} export(s)",
        exports.len()
    ));
    print_exports(&server, &exports, &descriptions, tls_dir.as_deref());
    // From here the exports' devices are held by the server's table and `devices` (which
    // `blkq export remove` empties of an export it removes): not by this list.
    drop(exports);
    let devices = opened.devices;
    let report = server.wait();
    for cs in control_servers {
        cs.shutdown();
    }
    if !report.stuck.is_empty() {
        // A device holds a request for ever: dropping the exports could wait on it (a
        // mirror drains on drop). Leave them to the exit.
        std::mem::forget(devices);
        bail!(
            "shutdown timed out: export(s) {:?} stuck (a request or the final flush never \
             completed within --shutdown-timeout {}s); data on them may be lost",
            report.stuck,
            shutdown_timeout
        );
    }
    let failed = report.failed;
    // The last reference to a mirror goes here: it drains and marks its superblocks clean.
    drop((served, devices));
    if !failed.is_empty() {
        // Error stickiness: a write or flush failed; data a client was told is durable may
        // be lost.
        bail!("write error on export(s) {failed:?}: a write or flush failed, data may be lost");
    }
    Ok(())
}

/// Starts a control socket at each path (a mirror's, or with none the server's), each
/// serving every export's table and dirty bitmaps beside its mirror's commands.
fn start_control_servers(
    control_sockets: Vec<(PathBuf, Option<Arc<Control>>)>,
    served: &Arc<Served>,
) -> Result<Vec<ControlServer>> {
    let mut control_servers = Vec::new();
    for (path, mirror) in control_sockets {
        let what = if mirror.is_some() {
            "raid1 control socket"
        } else {
            "control socket"
        };
        let handler = Arc::new(Handler {
            mirror,
            served: served.clone(),
        });
        control_servers.push(ControlServer::start(&path, handler)?);
        println!("{what}: {}", path.display());
    }
    Ok(control_servers)
}

/// Prints what is served: each export with its size and the URIs that reach it, and how to
/// try one (`tls_dir`: the certificates' directory when TLS is on).
fn print_exports(
    server: &Server,
    exports: &[Export],
    descriptions: &[String],
    tls_dir: Option<&Path>,
) {
    println!("blkq serve: {} export(s)", exports.len());
    let cert_for = tls_dir.and_then(cert_names);
    let tcp_host = server
        .tcp_addr()
        .and_then(|a| tls_host(shown_addr(a), cert_for.as_deref()?));
    for (e, full) in exports.iter().zip(descriptions) {
        let lim = e.device.limits();
        println!(
            "  export {:?}: {} bytes{}, {}",
            e.name,
            lim.capacity,
            if e.read_only { ", read-only" } else { "" },
            full
        );
        for u in uris(
            &e.name,
            server.tcp_addr(),
            server.unix_path(),
            tls_dir,
            tcp_host.as_deref(),
        ) {
            println!("    {u}");
        }
    }
    let first = &exports[0].name;
    let example = uris(
        first,
        server.tcp_addr(),
        server.unix_path(),
        tls_dir,
        tcp_host.as_deref(),
    );
    if let Some(h) = &tcp_host {
        println!(
            "  (the server's certificate is for {h}, not this address: a TCP client must \
             reach it by that name)"
        );
    }
    if let Some(u) = example.last() {
        println!("try:");
        match tls_dir {
            None => println!("  qemu-img info {u}"),
            Some(d) => println!(
                "  (qemu: --object tls-creds-x509,id=tls0,endpoint=client,dir={} and \
                 tls-creds=tls0 in its --image-opts)",
                d.display()
            ),
        }
        println!("  nbdinfo '{}'", example[0]);
    }
    println!("Ctrl-C stops the server (in-flight requests finish first).");
}

/// The address a client on this host reaches a TCP listener by (an unspecified IPv4 address
/// as 127.0.0.1).
fn shown_addr(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V4(x) if x.ip().is_unspecified() => {
            SocketAddr::from(([127, 0, 0, 1], x.port()))
        }
        other => other,
    }
}

/// The names (DNS names and IP addresses) the server certificate `DIR/server-cert.pem` is
/// for; `None` when it cannot be read (the server has loaded it already: the banner then
/// keeps the address).
fn cert_names(dir: &Path) -> Option<Vec<String>> {
    use x509_parser::extensions::GeneralName;
    let pem = std::fs::read(dir.join("server-cert.pem")).ok()?;
    let (_, pem) = x509_parser::pem::parse_x509_pem(&pem).ok()?;
    let cert = pem.parse_x509().ok()?;
    let san = cert.subject_alternative_name().ok()??;
    let names = san
        .value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::DNSName(d) => Some((*d).to_owned()),
            GeneralName::IPAddress(b) => match b.len() {
                4 => Some(std::net::Ipv4Addr::from(<[u8; 4]>::try_from(*b).ok()?).to_string()),
                16 => Some(std::net::Ipv6Addr::from(<[u8; 16]>::try_from(*b).ok()?).to_string()),
                _ => None,
            },
            _ => None,
        })
        .collect();
    Some(names)
}

/// The `host:port` a TLS client must name to verify the certificate, when the certificate is
/// not for `addr`'s IP (`None` when it is, or names nothing): its first name.
fn tls_host(addr: SocketAddr, names: &[String]) -> Option<String> {
    let ip = addr.ip().to_string();
    if names.contains(&ip) {
        return None;
    }
    let first = names.first()?;
    Some(match first.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V6(v6)) => format!("[{v6}]:{}", addr.port()),
        _ => format!("{first}:{}", addr.port()),
    })
}

/// The URIs of an export (`nbd://`, `nbd+unix://`); with TLS (`tls`: the certificates
/// directory) `nbds` ones that name it, as libnbd's tools take them, the TCP one naming
/// `tls_host` (`host:port`, a name the certificate is for) instead of the address when given.
fn uris(
    name: &str,
    tcp: Option<SocketAddr>,
    unix: Option<&Path>,
    tls: Option<&Path>,
    tls_host: Option<&str>,
) -> Vec<String> {
    let mut v = Vec::new();
    let (s, certs) = match tls {
        Some(d) => ("s", format!("tls-certificates={}", d.display())),
        None => ("", String::new()),
    };
    if let Some(p) = unix {
        let amp = if tls.is_some() { "&" } else { "" };
        v.push(format!(
            "nbd{s}+unix:///{name}?socket={}{amp}{certs}",
            p.display()
        ));
    }
    if let Some(a) = tcp {
        let a = match (tls, tls_host) {
            (Some(_), Some(h)) => h.to_owned(),
            _ => shown_addr(a).to_string(),
        };
        let q = if tls.is_some() { "?" } else { "" };
        if name.is_empty() && tls.is_none() {
            v.push(format!("nbd://{a}"));
        } else {
            v.push(format!("nbd{s}://{a}/{name}{q}{certs}"));
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_look_right() {
        let tcp: SocketAddr = "127.0.0.1:10809".parse().unwrap();
        let u = uris("", Some(tcp), Some(Path::new("./blkq.sock")), None, None);
        assert_eq!(
            u,
            vec!["nbd+unix:///?socket=./blkq.sock", "nbd://127.0.0.1:10809"]
        );
        let u = uris("disk", Some(tcp), None, None, None);
        assert_eq!(u, vec!["nbd://127.0.0.1:10809/disk"]);
        let pki = Path::new("./pki");
        let u = uris("", Some(tcp), Some(Path::new("./s")), Some(pki), None);
        assert_eq!(
            u,
            vec![
                "nbds+unix:///?socket=./s&tls-certificates=./pki",
                "nbds://127.0.0.1:10809/?tls-certificates=./pki"
            ]
        );
        let u = uris("", Some(tcp), None, Some(pki), Some("myhost:10809"));
        assert_eq!(u, vec!["nbds://myhost:10809/?tls-certificates=./pki"]);
    }

    #[test]
    fn the_tls_host_is_a_name_the_certificate_is_for() {
        let tcp: SocketAddr = "127.0.0.1:10809".parse().unwrap();
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(tls_host(tcp, &names(&["localhost", "127.0.0.1"])), None);
        assert_eq!(
            tls_host(tcp, &names(&["myhost"])).as_deref(),
            Some("myhost:10809")
        );
        assert_eq!(
            tls_host(tcp, &names(&["::1"])).as_deref(),
            Some("[::1]:10809")
        );
        assert_eq!(tls_host(tcp, &[]), None);
    }
}
