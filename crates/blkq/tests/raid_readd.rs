//! A mirror leg on another NBD server that dies and comes back: `blkq serve --raid1
//! file:LOCAL,nbd+unix:///?socket=S` goes degraded, keeps serving and shows the leg as
//! unreachable; and once the leg's server is back, the automatic re-add (`readd=auto`) puts
//! the leg back and recovers only the chunks written while it was away.
//!
//! The remote device does not reconnect by itself yet (a dropped connection stays dropped,
//! docs/serve.md), so the second test builds the mirror in process over a leg that dials
//! the server again after a failure (`Redial`, test-only): what it proves is the re-add path
//! over a real NBD leg whose server restarts, not the front's own reconnect.
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blk::{Bio, Device, EndIo, Error, Limits};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use common::{leg_file, Serving};
use nbd::remote::RemoteDevice;
use raid1::{Raid1, Raid1Config, SyncAction};

const MB: u64 = 1 << 20;

fn remote(sock: &Path) -> String {
    format!("nbd+unix:///?socket={}", sock.display())
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "timed out waiting for: {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_remote_leg_whose_server_dies_is_failed_shown_unreachable_and_the_mirror_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let (_, b) = leg_file(dir.path(), "b.img", 64 * MB);
    let (_, a) = leg_file(dir.path(), "a.img", 64 * MB);
    let mut back = Serving::start(dir.path(), "leg", &["--device", &b]);
    let legs = format!("{a},{},timeout=5", remote(&back.sock));
    let front = common::Server::start(
        dir.path(),
        &legs,
        &["--raid1-create", "--raid1-option", "readd_interval_ms=50"],
    );
    let mut c = front.client();
    c.write(0, &[1u8; 65536], nbd::codec::CmdFlags::FUA)
        .unwrap();
    // Both legs have a round trip now.
    let v = front.status_json();
    assert!(v["legs"][0]["rtt_ns"].as_u64().unwrap() > 0, "{v}");
    assert!(v["legs"][1]["rtt_ns"].as_u64().unwrap() > 0, "{v}");
    assert!(front.status().contains("rtt: [0] "));
    back.kill();
    // Keeps serving: the write fails on the remote leg, which is failed, and succeeds.
    c.write(MB, &[2u8; 65536], nbd::codec::CmdFlags::FUA)
        .unwrap();
    assert_eq!(c.read(MB, 65536).unwrap(), vec![2u8; 65536]);
    let v = front.wait_for(
        &|v| v["legs"][1]["probe_error"].is_string(),
        "the remote leg's probe error",
    );
    assert_eq!(v["legs"][1]["state"], "faulty");
    assert_eq!(v["legs"][1]["probing"], true);
    let st = front.status();
    assert!(st.contains("[U_]"), "{st}");
    // The probe's read fails, or gets no answer within its wait while the device waits to
    // reconnect: either way the leg is shown unreachable, naming the read.
    assert!(
        st.contains("leg 1 unreachable:") && st.contains("superblock read"),
        "{st}"
    );
}

#[test]
fn a_write_behind_remote_leg_is_served_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    let (_, b) = leg_file(dir.path(), "b.img", 64 * MB);
    let (_, a) = leg_file(dir.path(), "a.img", 64 * MB);
    let back = Serving::start(dir.path(), "leg", &["--device", &b]);
    let rleg = format!("{},timeout=5", remote(&back.sock));
    common::ok(&[
        "raid",
        "create",
        &a,
        &rleg,
        "--write-mostly",
        "1",
        "--assume-clean",
    ]);
    let legs = format!("{a},{rleg}");
    let front = common::Server::start(dir.path(), &legs, &["--raid1-option", "write_behind=8"]);
    let mut c = front.client();
    for i in 0..32u64 {
        c.write(
            i * 65536,
            &[i as u8 + 1; 65536],
            nbd::codec::CmdFlags::empty(),
        )
        .unwrap();
    }
    c.flush().unwrap();
    for i in 0..32u64 {
        assert_eq!(c.read(i * 65536, 65536).unwrap(), vec![i as u8 + 1; 65536]);
    }
    let v = front.status_json();
    assert_eq!(v["legs"][1]["write_mostly"], true, "{v}");
    assert!(v["legs"][1]["write_behind"].as_u64().unwrap() <= 8, "{v}");
    let d = common::ok(&["raid", "detail", "--control", front.ctl()]);
    assert!(d.contains("write-behind :"), "{d}");
    // What was flushed is on the remote leg too: a check finds the legs equal.
    common::ok(&["raid", "check", "--control", front.ctl()]);
    let v = front.wait_for(
        &|v| v["sync"]["action"] == "idle" && v["sync"]["total_bytes"].as_u64() > Some(0),
        "the check",
    );
    assert_eq!(v["sync"]["mismatch_cnt"], 0, "{v}");
}

/// A leg on another NBD server that dials it again after a failed request.
struct Redial {
    spec: String,
    cur: Arc<Mutex<Option<Arc<RemoteDevice>>>>,
    limits: Limits,
}

/// Drops the connection a failed request went over.
struct DropOnError {
    cur: Arc<Mutex<Option<Arc<RemoteDevice>>>>,
    dev: Arc<RemoteDevice>,
    end: Arc<dyn EndIo>,
}

impl EndIo for DropOnError {
    fn end_io(&self, bio: Bio, res: Result<(), Error>) {
        if res.is_err() {
            let mut g = self.cur.lock().unwrap();
            if g.as_ref().is_some_and(|d| Arc::ptr_eq(d, &self.dev)) {
                *g = None;
            }
        }
        self.end.end_io(bio, res)
    }
}

impl Redial {
    fn open(spec: String) -> Self {
        let dev = RemoteDevice::open(&spec).unwrap();
        let limits = dev.limits();
        Self {
            spec,
            cur: Arc::new(Mutex::new(Some(Arc::new(dev)))),
            limits,
        }
    }
}

impl Device for Redial {
    fn submit(&self, bio: Bio, end: &Arc<dyn EndIo>) {
        let dev = {
            let mut g = self.cur.lock().unwrap();
            if g.is_none() {
                *g = RemoteDevice::open(&self.spec).ok().map(Arc::new);
            }
            g.clone()
        };
        let Some(dev) = dev else {
            end.end_io(bio, Err(Error::Io(std::io::Error::other("not connected"))));
            return;
        };
        let e: Arc<dyn EndIo> = Arc::new(DropOnError {
            cur: self.cur.clone(),
            dev: dev.clone(),
            end: end.clone(),
        });
        dev.submit(bio, &e);
    }

    fn limits(&self) -> Limits {
        self.limits
    }

    fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<blk::Extent>,
    ) -> Result<(), Error> {
        let dev = self.cur.lock().unwrap().clone();
        match dev {
            Some(d) => d.extents_into(offset, len, max, out),
            None => Err(Error::Io(std::io::Error::other("not connected"))),
        }
    }
}

fn write(dev: &dyn Device, off: u64, byte: u8) {
    let mut b = Bio::with_buf(blk::Op::Write, off >> 9, blk::Buffer::new(16384));
    b.buf.as_mut().unwrap().as_mut_slice().fill(byte);
    blk::submit_wait(dev, b).1.unwrap();
}

fn flush(dev: &dyn Device) {
    blk::submit_wait(dev, Bio::new(blk::Op::Flush, 0, 0))
        .1
        .unwrap();
}

#[test]
fn a_remote_leg_whose_server_restarts_is_readded_and_recovers_only_what_it_missed() {
    let dir = tempfile::tempdir().unwrap();
    let (a_path, a) = leg_file(dir.path(), "a.img", 32 * MB);
    let (b_path, b) = leg_file(dir.path(), "b.img", 32 * MB);
    let mut back = Serving::start(dir.path(), "leg", &["--device", &b]);
    let local: Arc<dyn Device> = a
        .parse::<DeviceSpec>()
        .unwrap()
        .build_device(&QueueOverrides::default())
        .unwrap();
    let leg: Arc<dyn Device> = Arc::new(Redial::open(format!("{},timeout=5", remote(&back.sock))));
    let cfg = Raid1Config {
        bitmap_chunk: MB,
        bitmap_quiet: Duration::from_millis(10),
        tick: Duration::from_millis(20),
        readd_interval: Some(Duration::from_millis(50)),
        ..Raid1Config::default()
    };
    let r = Raid1::create(vec![local, leg], cfg).unwrap();
    let cap = r.limits().capacity;
    for c in 0..cap / MB {
        write(&r, c * MB, c as u8 + 1);
    }
    flush(&r);
    let dirty = |r: &Raid1| -> u64 {
        let bm = r.bitmap().unwrap();
        bm.dirty_chunks().iter().map(|c| c.end - c.first).sum()
    };
    wait_until("every bit cleared", || dirty(&r) == 0);
    let copied0 = r.sync_progress().chunks_copied;

    back.kill();
    for c in [2u64, 7, 11] {
        write(&r, c * MB + 4096, 0xA0 + c as u8);
    }
    flush(&r);
    assert!(r.leg_status(1).unwrap().faulty, "the remote leg failed");
    assert_eq!(dirty(&r), 3);

    let back = Serving::start(dir.path(), "leg", &["--device", &b]);
    wait_until("the remote leg back in sync", || {
        let st = r.leg_status(1).unwrap();
        st.in_sync && !st.faulty
    });
    assert!(r.wait_sync_idle(Duration::from_secs(120)));
    assert_eq!(r.sync_progress().chunks_copied - copied0, 3);
    assert_eq!(r.readd_status(1).unwrap().readds, 1);
    r.set_sync_action(SyncAction::Check).unwrap();
    assert!(r.wait_sync_idle(Duration::from_secs(120)));
    assert_eq!(r.sync_progress().mismatch_cnt, 0);
    // Both files hold the same data area.
    let doff = r.data_offset() as usize;
    flush(&r);
    drop(r);
    drop(back);
    let (fa, fb) = (
        std::fs::read(a_path).unwrap(),
        std::fs::read(b_path).unwrap(),
    );
    let end = doff + cap as usize;
    assert!(
        fa[doff..end] == fb[doff..end],
        "the legs' data areas differ"
    );
}

/// A mirror of a local leg and a remote one, created and written through a front, both
/// stopped cleanly (once every bit of the bitmap is cleared, if `settle`): the leg files,
/// the back's device spec, and the front's `--raid1` legs.
fn stopped_mirror(
    dir: &Path,
    settle: bool,
) -> (std::path::PathBuf, std::path::PathBuf, String, String) {
    let (a_path, a) = leg_file(dir, "a.img", 16 * MB);
    let (b_path, b) = leg_file(dir, "b.img", 16 * MB);
    let mut back = Serving::start(dir, "leg", &["--device", &b]);
    let rleg = format!("{},timeout=1", remote(&back.sock));
    let legs = format!("{a},{rleg}");
    let mut front = common::Server::start(
        dir,
        &legs,
        &[
            "--raid1-create",
            "--raid1-option",
            "bitmap_chunk=1M",
            "--raid1-option",
            "bitmap_quiet_ms=10",
        ],
    );
    front.wait_for(
        &|v| v["legs"][1]["state"] == "in_sync" && v["sync"]["action"] == "idle",
        "the initial resync",
    );
    let mut c = front.client();
    for i in 0..8u64 {
        c.write(i * MB, &[i as u8 + 1; 65536], nbd::codec::CmdFlags::FUA)
            .unwrap();
    }
    drop(c);
    // Every bit cleared: what a later recovery copies is only what was written after.
    if settle {
        front.wait_for(&|v| v["bitmap"]["dirty"] == 0, "every bit cleared");
    }
    assert!(front.stop(), "the front stops cleanly");
    assert!(back.stop(Duration::from_secs(30)), "the back stops cleanly");
    (a_path, b_path, b, legs)
}

/// A front started with `--raid1-degraded` while its remote leg's server is down (a power
/// cut on the front's side, the back not up yet) starts without the leg, shows it missing
/// with its spec, serves from the local leg, and takes the leg back by itself once its
/// server answers, recovering only the chunks written meanwhile.
#[test]
fn a_front_started_degraded_without_its_remote_leg_readds_it_when_it_answers() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (a_path, b_path, b, legs) = stopped_mirror(d, true);
    let rleg = legs.split_once(',').unwrap().1.to_string();
    let front = common::Server::start(
        d,
        &legs,
        &["--raid1-degraded", "--raid1-option", "readd_interval_ms=50"],
    );
    let err = front.stderr_text();
    assert!(
        err.contains("WARN") && err.contains(&rleg) && err.contains("cannot open it"),
        "{err}"
    );
    let v = front.status_json();
    assert_eq!(v["legs"][0]["state"], "in_sync", "{v}");
    assert_eq!(v["legs"][1]["state"], "missing", "{v}");
    assert_eq!(v["legs"][1]["device"], rleg.as_str(), "{v}");
    let v = front.wait_for(
        &|v| v["legs"][1]["probe_error"].is_string(),
        "the missing leg's last attempt",
    );
    assert_eq!(v["legs"][1]["probing"], true, "{v}");
    let st = front.status();
    assert!(st.contains("[U_]") && st.contains(&rleg), "{st}");
    // Serves from the local leg: what was written before, and new writes.
    let mut c = front.client();
    assert_eq!(c.read(3 * MB, 65536).unwrap(), vec![4u8; 65536]);
    for i in [2u64, 5] {
        c.write(
            i * MB + 4096,
            &[0xA0 + i as u8; 4096],
            nbd::codec::CmdFlags::FUA,
        )
        .unwrap();
    }
    assert_eq!(c.read(5 * MB + 4096, 4096).unwrap(), vec![0xA5; 4096]);
    drop(c);
    // Another power cut before the back is up: the degraded run emptied the leg's slot on
    // disk, and the front starts without the leg again, still showing it and still waiting.
    let mut front = front;
    front.kill();
    let front = common::Server::start(
        d,
        &legs,
        &["--raid1-degraded", "--raid1-option", "readd_interval_ms=50"],
    );
    let v = front.status_json();
    assert_eq!(v["legs"][1]["state"], "missing", "{v}");
    assert_eq!(v["legs"][1]["device"], rleg.as_str(), "{v}");
    let mut c = front.client();
    assert_eq!(c.read(2 * MB + 4096, 4096).unwrap(), vec![0xA2; 4096]);
    let copied0 = front.status_json()["sync"]["chunks_copied"]
        .as_u64()
        .unwrap();

    let _back = Serving::start(d, "leg", &["--device", &b]);
    let v = front.wait_for(
        &|v| v["legs"][1]["state"] == "in_sync" && v["sync"]["action"] == "idle",
        "the remote leg re-added and recovered",
    );
    assert_eq!(v["legs"][1]["device"], rleg.as_str(), "{v}");
    assert_eq!(v["legs"][1]["readds"], 1, "{v}");
    // Only the two chunks written while it was away were copied.
    assert_eq!(
        v["sync"]["chunks_copied"].as_u64().unwrap() - copied0,
        2,
        "{v}"
    );
    let (doff, cap) = common::geometry(&v);
    c.flush().unwrap();
    drop(c);
    let mut front = front;
    assert!(front.stop(), "the front stops cleanly");
    common::assert_leg_files_equal(&a_path, &b_path, doff, cap);
}

/// Without `--raid1-degraded` a front whose remote leg cannot be reached still refuses to
/// start, and says what would start it without the leg.
#[test]
fn a_front_whose_remote_leg_is_down_refuses_to_start_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (_, _, _, legs) = stopped_mirror(d, false);
    let sock = d.join("front.sock");
    let err = common::fails_within(
        &[
            "serve",
            "--raid1",
            &legs,
            "--no-tcp",
            "--socket",
            sock.to_str().unwrap(),
        ],
        Duration::from_secs(20),
    );
    assert!(
        err.contains("cannot open it") && err.contains("--raid1-degraded"),
        "{err}"
    );
}

/// A leg the front started without is judged by its superblock when it answers, never taken
/// blindly: a server that comes back with a blank device in its place is refused, named in
/// `status`, and not written.
#[test]
fn a_leg_started_missing_that_answers_with_another_device_is_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (_, _, _, legs) = stopped_mirror(d, false);
    let rleg = legs.split_once(',').unwrap().1.to_string();
    let front = common::Server::start(
        d,
        &legs,
        &["--raid1-degraded", "--raid1-option", "readd_interval_ms=50"],
    );
    let (c_path, c) = leg_file(d, "c.img", 16 * MB);
    let _back = Serving::start(d, "leg", &["--device", &c]);
    let v = front.wait_for(
        &|v| v["legs"][1]["refused"].is_string(),
        "the refusal of the blank device",
    );
    assert_eq!(v["legs"][1]["state"], "missing", "{v}");
    assert_eq!(v["legs"][1]["device"], rleg.as_str(), "{v}");
    let why = v["legs"][1]["refused"].as_str().unwrap();
    assert!(why.contains("no superblock of this array"), "{why}");
    let st = front.status();
    assert!(st.contains("leg 1 refused:"), "{st}");
    // The array keeps serving, and the blank device was not written.
    let mut c = front.client();
    c.write(0, &[7u8; 4096], nbd::codec::CmdFlags::FUA).unwrap();
    assert_eq!(c.read(0, 4096).unwrap(), vec![7u8; 4096]);
    assert!(
        std::fs::read(&c_path).unwrap().iter().all(|&b| b == 0),
        "the refused device was written"
    );
    let err = front.stderr_text();
    assert!(err.contains("is refused"), "{err}");
}

/// A mirror none of whose legs can be opened does not start, even with `--raid1-degraded`.
#[test]
fn a_mirror_with_no_leg_reachable_does_not_start_even_degraded() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let legs = format!(
        "{},timeout=1,{},timeout=1",
        remote(&d.join("x.sock")),
        remote(&d.join("y.sock"))
    );
    let sock = d.join("front.sock");
    let err = common::fails_within(
        &[
            "serve",
            "--raid1",
            &legs,
            "--raid1-degraded",
            "--no-tcp",
            "--socket",
            sock.to_str().unwrap(),
        ],
        Duration::from_secs(20),
    );
    assert!(err.contains("no leg can be opened"), "{err}");
}
