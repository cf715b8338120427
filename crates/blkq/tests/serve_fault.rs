//! `blkq serve --device SPEC` with `fault.` options serves the device through the fault-injection
//! wrapper: the chosen range fails with EIO, the rest of the device and the connection keep
//! working. The built binary, a Unix socket in a tempdir, `nbd::client`.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nbd::client::{Client, ClientOptions, Endpoint};
use nbd::proto::CmdFlags;

#[test]
fn fault_options_on_a_served_device_inject_and_the_connection_survives() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_blkq"))
        .args([
            "serve",
            "--device",
            "mem:16M,fault.fail_read=0+4096",
            "--no-tcp",
        ])
        .arg("--socket")
        .arg(&sock)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !sock.exists() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "blkq serve exited early"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "server did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut cl = Client::connect(&Endpoint::Unix(sock.clone()), &ClientOptions::default()).unwrap();
    cl.write(0, &[7u8; 8192], CmdFlags::empty()).unwrap();
    assert!(cl.read(0, 4096).is_err(), "the faulty range must fail");
    assert_eq!(
        cl.read(4096, 4096).unwrap(),
        vec![7u8; 4096],
        "the rest reads back"
    );
    assert!(cl.read(0, 512).is_err(), "still failing, same connection");
    drop(cl);
    // SIGTERM: a clean stop.
    // SAFETY: kill(2) on our own child's pid with a valid signal number has no memory effects.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let st = child.wait().unwrap();
    assert!(st.success(), "blkq serve exit status {st}");
}
