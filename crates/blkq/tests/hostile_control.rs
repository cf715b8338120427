//! Hostile clients of the control socket (`blkq serve --raid1 ... --control PATH`):
//! tricklers, floods of idle connections, oversized and malformed lines, and `raid
//! add` of a device that is not blank. The built binary, file legs in a tempdir.
//!
//! The bounds (`crates/blkq/src/control.rs`, `listen.rs`): [`SLOTS`] connections are served at
//! once, a thread each; a connection has [`DEADLINE`] in all to send its line and read its
//! reply; when every slot is taken, a new connection evicts the oldest one still waiting on its
//! client, so a legitimate command always gets through.

mod common;
use common::*;

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

const LEG_SIZE: u64 = 8 << 20;
/// Connections served at once (`control::SLOTS`).
const SLOTS: usize = 8;
/// The whole-request deadline (`control::DEADLINE`).
const DEADLINE: Duration = Duration::from_secs(5);

fn leg(dir: &Path, name: &str) -> String {
    leg_file(dir, name, LEG_SIZE).1
}

fn serve(dir: &Path) -> Server {
    let (a, b) = (leg(dir, "a.img"), leg(dir, "b.img"));
    Server::start(dir, &format!("{a},{b}"), &["--raid1-create"])
}

/// The server's pid, from the credentials of a connection to it.
fn server_pid(ctl: &str) -> i32 {
    let s = UnixStream::connect(ctl).unwrap();
    // SAFETY: `ucred` is a plain C struct; all-zero bytes are a valid value.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt(2) with SO_PEERCRED writes at most `len` bytes into `cred`.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    assert_eq!(r, 0, "SO_PEERCRED");
    cred.pid
}

/// Sends `req` on a new connection, returns what comes back until the server closes.
fn exchange(ctl: &str, req: &[u8]) -> String {
    let mut s = UnixStream::connect(ctl).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = s.write_all(req);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// Bound: slots. With twice [`SLOTS`] clients trickling a byte every 500 ms (each
/// reconnecting when cut), `blkq raid status` still answers, within 3 s.
#[test]
fn status_answers_while_tricklers_hold_every_slot() {
    let d = tempfile::tempdir().unwrap();
    let s = serve(d.path());
    let ctl = std::path::PathBuf::from(s.ctl());
    let _t = common::Tricklers::start(
        move || UnixStream::connect(&ctl),
        2 * SLOTS,
        Duration::from_millis(500),
        b's',
    );
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..3 {
        let out = common::ok_within(
            &["raid", "status", "--control", s.ctl()],
            Duration::from_secs(3),
        );
        assert!(out.contains("[UU]"), "{out}");
    }
}

/// Bound: deadline. A client trickling a byte every second (each read well within any
/// per-read timeout) is cut [`DEADLINE`] after it connected, not later, and told why.
#[test]
fn a_trickler_is_cut_at_the_deadline() {
    let d = tempfile::tempdir().unwrap();
    let s = serve(d.path());
    let mut c = UnixStream::connect(s.ctl()).unwrap();
    c.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let got = common::trickle_until_cut(&mut c, b's', Duration::from_secs(1), DEADLINE);
    let got = String::from_utf8_lossy(&got);
    assert!(got.contains("\"ok\":false") && got.contains("5 s"), "{got}");
}

/// Bounds: slots and memory (threads). Sixty-four connections that send nothing take at most
/// [`SLOTS`] threads of the server, and `blkq raid status` answers within 3 s while they
/// are held open.
#[test]
fn a_flood_of_idle_connections_takes_slots_not_threads() {
    let d = tempfile::tempdir().unwrap();
    let s = serve(d.path());
    let pid = server_pid(s.ctl());
    std::thread::sleep(Duration::from_millis(200));
    let before = common::threads_of(pid as u32);
    let idle: Vec<UnixStream> = (0..64)
        .map(|_| UnixStream::connect(s.ctl()).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let during = common::threads_of(pid as u32);
    assert!(
        during <= before + SLOTS + 1,
        "{} idle connections: {before} threads before, {during} during",
        idle.len()
    );
    let out = common::ok_within(
        &["raid", "status", "--control", s.ctl()],
        Duration::from_secs(3),
    );
    assert!(out.contains("[UU]"), "{out}");
    drop(idle);
}

/// Bound: memory. Lines over 4 KiB (with or without a newline) and lines that are not UTF-8
/// are refused with a reason; a line cut by the client's EOF is still answered; the socket
/// stays usable.
#[test]
fn bad_lines_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let s = serve(d.path());
    let ctl = s.ctl();
    let r = exchange(ctl, "x".repeat(64 << 10).as_bytes());
    assert!(r.contains("longer than 4096"), "{r}");
    let r = exchange(ctl, format!("status {}\n", " ".repeat(5000)).as_bytes());
    assert!(r.contains("longer than 4096"), "{r}");
    let r = exchange(ctl, b"stat\xff\xfeus\n");
    assert!(r.contains("not UTF-8"), "{r}");
    let r = exchange(ctl, b"\n");
    assert!(r.contains("empty command"), "{r}");
    let r = exchange(ctl, b"bogus 1 2 3\n");
    assert!(r.contains("unknown command"), "{r}");
    // Connect and close at once, many times.
    for _ in 0..32 {
        drop(UnixStream::connect(ctl).unwrap());
    }
    // A line cut by EOF (no newline) is still a line.
    let mut c = UnixStream::connect(ctl).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(b"status").unwrap();
    c.shutdown(std::net::Shutdown::Write).unwrap();
    let mut r = String::new();
    c.read_to_string(&mut r).unwrap();
    assert!(r.contains("\"ok\":true"), "{r}");
    assert!(s.status().contains("[UU]"));
}

/// `raid add` (and `replace`) through the control socket refuse, unless `--force`, what
/// `raid create` refuses: a leg with a damaged superblock; and also a leg with no superblock
/// whose first 128 KiB hold data (a filesystem, a partition table, an image): nothing there is
/// overwritten. A blank (zeroed) leg needs no `--force`.
#[test]
fn add_refuses_a_leg_that_is_not_blank_unless_forced() {
    use std::os::unix::fs::FileExt;
    let d = tempfile::tempdir().unwrap();
    let s = serve(d.path());
    ok(&["raid", "fail", "1", "--control", s.ctl()]);
    ok(&["raid", "remove", "1", "--control", s.ctl()]);

    // A leg of another array, its superblock then damaged (checksum).
    let (x, y) = (leg(d.path(), "x.img"), leg(d.path(), "y.img"));
    ok(&["raid", "create", &x, &y]);
    let xf = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(d.path().join("x.img"))
        .unwrap();
    let mut byte = [0u8; 1];
    xf.read_exact_at(&mut byte, 4096 + 20).unwrap();
    xf.write_all_at(&[byte[0] ^ 0xff], 4096 + 20).unwrap();
    let e = fails(&["raid", "add", &x, "--control", s.ctl()]);
    assert!(
        e.contains("damaged raid1 superblock") && e.contains("--force"),
        "{e}"
    );
    let e = fails(&["raid", "replace", "0", &x, "--control", s.ctl()]);
    assert!(e.contains("damaged raid1 superblock"), "{e}");

    // No superblock, but data: an ext4 superblock's magic at 1080, say.
    let (fs_path, fs) = leg_file(d.path(), "fs.img", LEG_SIZE);
    let ff = std::fs::OpenOptions::new()
        .write(true)
        .open(&fs_path)
        .unwrap();
    ff.write_all_at(&[0x53, 0xef], 1080).unwrap();
    let e = fails(&["raid", "add", &fs, "--control", s.ctl()]);
    assert!(
        e.contains("no raid1 superblock") && e.contains("data") && e.contains("--force"),
        "{e}"
    );
    // Data further in (at 64 KiB, where btrfs keeps its superblock) counts too.
    let (far_path, far) = leg_file(d.path(), "far.img", LEG_SIZE);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&far_path)
        .unwrap()
        .write_all_at(b"_BHRfS_M", (64 << 10) + 64)
        .unwrap();
    let e = fails(&["raid", "add", &far, "--control", s.ctl()]);
    assert!(e.contains("data"), "{e}");
    let st = s.status();
    assert!(st.contains("[U_]"), "nothing was added: {st}");

    // --force overrides.
    let m = ok(&["raid", "add", "--force", &fs, "--control", s.ctl()]);
    assert!(m.contains("slot 1"), "{m}");
    assert!(s.status().contains("fs.img"));
}
