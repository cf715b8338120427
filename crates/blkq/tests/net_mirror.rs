//! A mirror whose second leg lives on another host: two network namespaces joined by a veth
//! pair (`common::Hosts`), `blkq serve --raid1 file:LOCAL,nbd://BACK/leg` in the front one,
//! the leg's server in the back one: another blkq, nbdkit's file plugin or
//! qemu-storage-daemon (any NBD server is a leg). Under a verified write load the link is cut
//! and restored, or the leg's server killed and started again: the array never stops serving, the leg comes back by itself (the device
//! reconnects, the array's probe re-adds it) and is recovered by copying exactly the chunks
//! written while it was away, and the legs compare equal. Skipped,
//! saying why, where namespaces cannot be made (they can where CI runs) or a peer is missing.

mod common;
use common::*;

use std::path::Path;
use std::time::Duration;

const LEG_SIZE: u64 = 64 << 20;
const CHUNK: u64 = 1 << 20;
/// The leg's server, as the front reaches it.
const PORT: u16 = 10809;

/// Who serves the remote leg.
#[derive(Clone, Copy, Debug)]
enum Peer {
    Blkq,
    Nbdkit,
    QemuStorageDaemon,
}

/// The leg file at `path` served as the export `leg` on the back host by `peer`, TCP only;
/// None (with the reason printed) when the peer is not installed.
fn serve_leg(peer: Peer, hosts: &Hosts, dir: &Path, path: &Path) -> Option<Running> {
    let addr = format!("{BACK_IP}:{PORT}");
    let file = path.display().to_string();
    let (program, args): (&str, Vec<String>) = match peer {
        Peer::Blkq => {
            let spec = format!("file:{file}");
            let l = Launch::serve(["--device", &spec, "--export", "leg", "--no-unix"])
                .args(["--listen", &addr]);
            return Some(
                l.stderr_to(&dir.join("leg.stderr"))
                    .in_netns(&hosts.back())
                    .ready_when_tcp_in(&hosts.back(), &addr)
                    .start(),
            );
        }
        Peer::Nbdkit => (
            "nbdkit",
            [
                "--foreground",
                "--ipaddr",
                BACK_IP,
                "--port",
                &PORT.to_string(),
            ]
            .into_iter()
            .map(String::from)
            .chain(["file".to_string(), format!("file={file}")])
            .collect(),
        ),
        Peer::QemuStorageDaemon => (
            "qemu-storage-daemon",
            vec![
                "--blockdev".into(),
                format!("driver=file,node-name=leg0,filename={file}"),
                "--nbd-server".into(),
                format!("addr.type=inet,addr.host={BACK_IP},addr.port={PORT}"),
                "--export".into(),
                "type=nbd,id=exp0,node-name=leg0,name=leg,writable=on".into(),
            ],
        ),
    };
    if std::process::Command::new(program)
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("SKIPPED ({peer:?} leg): {program} is not installed");
        return None;
    }
    Some(
        Launch::program(program, args)
            .stderr_to(&dir.join("leg.stderr"))
            .in_netns(&hosts.back())
            .ready_when_tcp_in(&hosts.back(), &addr)
            .start(),
    )
}

/// The front's spec of the remote leg: a request unanswered for 2 s breaks the connection,
/// and requests fail (the leg with them) after 1 s more without one.
fn leg_spec() -> String {
    format!("nbd://{BACK_IP}:{PORT}/leg,timeout=2,reconnect_deadline=1")
}

/// The front: a new array over a local file and the back's export, a short request timeout
/// so a lost leg is noticed within seconds, a 1 MiB bitmap chunk, bits cleared after 200 ms
/// of quiet (never while degraded).
fn serve_front(hosts: &Hosts, dir: &Path, local: &str) -> Server {
    Server::launch(
        dir,
        &format!("{local},{}", leg_spec()),
        // Both legs are new sparse files: what a recovery copies is all these tests count.
        &common::create_clean(&[
            "bitmap_chunk=1M",
            "bitmap_quiet_ms=200",
            "readd_interval_ms=300",
        ]),
        |l| l.in_netns(&hosts.front()),
    )
}

#[test]
fn cutting_the_link_to_a_blkq_leg_loses_nothing_and_copies_only_what_it_missed() {
    lose_and_return(Peer::Blkq, Loss::Link);
}

#[test]
fn cutting_the_link_to_an_nbdkit_leg_loses_nothing_and_copies_only_what_it_missed() {
    lose_and_return(Peer::Nbdkit, Loss::Link);
}

#[test]
fn cutting_the_link_to_a_qemu_storage_daemon_leg_loses_nothing_and_copies_only_what_it_missed() {
    lose_and_return(Peer::QemuStorageDaemon, Loss::Link);
}

#[test]
fn killing_a_blkq_legs_server_loses_nothing_and_copies_only_what_it_missed() {
    lose_and_return(Peer::Blkq, Loss::Server);
}

#[test]
fn killing_an_nbdkit_legs_server_loses_nothing_and_copies_only_what_it_missed() {
    lose_and_return(Peer::Nbdkit, Loss::Server);
}

/// How the leg is lost.
#[derive(Clone, Copy, Debug)]
enum Loss {
    /// The link is cut (`ip link set down`), then brought back up.
    Link,
    /// The leg's server is killed (SIGKILL), then started again on the same file.
    Server,
}

/// `peer`'s leg lost under load and back (see the module docs).
fn lose_and_return(peer: Peer, loss: Loss) {
    let Some(hosts) = hosts_or_skip(&format!("{loss:?} lost to a {peer:?} leg")) else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let (local_path, local) = leg_file(d.path(), "local.img", LEG_SIZE);
    let (leg_path, _) = leg_file(d.path(), "leg.img", LEG_SIZE);
    let Some(mut leg) = serve_leg(peer, &hosts, d.path(), &leg_path) else {
        return;
    };
    let s = serve_front(&hosts, d.path(), &local);

    // Before: both legs take the writes; then the bitmap goes clean. (Into chunks that are
    // written while away too: a bit still set on the leg's own bitmap when the link goes down
    // is copied as well, and the count below stays exact.)
    let away = [10u64, 13, 17, 22, 30];
    let load = Load::start(s.client(), blocks_in(CHUNK, &away[..2]), Ledger::default());
    load.wait_more(200);
    let ledger = load.stop();
    s.wait_for(
        &|v| v["bitmap"]["dirty"] == 0 && in_sync_and_idle(v),
        "a clean bitmap before the cut",
    );

    // The loss, under load: the remote leg is failed, the array keeps serving.
    match loss {
        Loss::Link => hosts.cut(),
        Loss::Server => leg.kill(),
    }
    let load = Load::start(s.client(), blocks_in(CHUNK, &away), ledger);
    let v = s.wait_for(&|v| leg_state(v, 1) == "faulty", "the remote leg failed");
    assert_eq!(leg_state(&v, 0), "in_sync", "{v}");
    load.wait_more(300);

    // The leg back, still under load (only into chunks already written while away): the
    // remote device reconnects, the array's probe finds the leg's superblock and re-adds it.
    let _leg = match loss {
        Loss::Link => {
            hosts.restore();
            leg
        }
        Loss::Server => serve_leg(peer, &hosts, d.path(), &leg_path).unwrap(),
    };
    let v = s.wait_for(&in_sync_and_idle, "the remote leg re-added and recovered");
    assert_eq!(v["legs"][1]["readds"], 1, "{v}");
    load.wait_more(100);
    let ledger = load.stop();

    assert_eq!(
        v["sync"]["chunks_copied"].as_u64(),
        Some(away.len() as u64),
        "the recovery copied other chunks than those written while the leg was away: {v}"
    );
    let checked = ledger.verify(&mut s.client());
    assert_eq!(checked, 8 * away.len());
    let (doff, cap) = geometry(&v);
    assert_leg_files_equal(&local_path, &leg_path, doff, cap);
}

#[test]
fn namespaces_are_removed_with_the_hosts() {
    let Some(hosts) = hosts_or_skip("namespaces_are_removed_with_the_hosts") else {
        return;
    };
    let (f, b) = (hosts.front(), hosts.back());
    assert!(f.exists() && b.exists());
    drop(hosts);
    assert!(
        !f.exists() && !b.exists(),
        "{} or {} is left",
        f.display(),
        b.display()
    );
}

#[test]
fn over_a_slow_link_write_behind_runs_ahead_of_the_remote_leg_and_a_flush_catches_up() {
    let Some(hosts) = hosts_or_skip("write-behind over a slow link") else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let (local_path, local) = leg_file(d.path(), "local.img", LEG_SIZE);
    let (leg_path, _) = leg_file(d.path(), "leg.img", LEG_SIZE);
    let Some(_leg) = serve_leg(Peer::Blkq, &hosts, d.path(), &leg_path) else {
        return;
    };
    // About 120 writes of 4 KiB a second reach the back; the local leg takes thousands.
    hosts.limit_rate("4mbit");
    ok_in(
        &hosts.front(),
        &[
            "raid",
            "create",
            &local,
            &leg_spec(),
            "--write-mostly",
            "1",
            "--assume-clean",
        ],
    );
    const BEHIND: u64 = 32;
    let s = Server::launch(
        d.path(),
        &format!("{local},{}", leg_spec()),
        &["--raid1-option", &format!("write_behind={BEHIND}")],
        |l| l.in_netns(&hosts.front()),
    );
    // Writes without flushes: acknowledged once the local leg has them, up to BEHIND still
    // on their way to the remote leg, never more.
    let load = Load::start_flushing_every(
        s.client(),
        blocks_in(CHUNK, &[10, 11, 12, 13]),
        Ledger::default(),
        u64::MAX,
    );
    let mut most = 0;
    testkit::wait_until_within(
        "writes behind the remote leg",
        Duration::from_secs(60),
        || {
            let v = s.status_json();
            let behind = v["legs"][1]["write_behind"].as_u64().unwrap_or(0);
            assert!(
                behind <= BEHIND,
                "{behind} writes behind, at most {BEHIND}: {v}"
            );
            most = most.max(behind);
            most > 0
        },
    );
    load.wait_more(300);
    // The load's last flush waits for the writes behind: then the remote leg has them all.
    let ledger = load.stop();
    let v = s.status_json();
    assert_eq!(v["legs"][1]["write_behind"], 0, "{v}");
    assert_eq!(ledger.verify(&mut s.client()), 32);
    let (doff, cap) = geometry(&v);
    assert_leg_files_equal(&local_path, &leg_path, doff, cap);
}
