//! `blkq serve --device SPEC` with `fault.` options serves the device through the fault-injection
//! wrapper: the chosen range fails with EIO, the rest of the device and the connection keep
//! working. The built binary, a Unix socket in a tempdir, `nbd::client`.

mod common;

use std::time::Duration;

use common::Serving;
use nbd::codec::proto::CmdFlags;

#[test]
fn fault_options_on_a_served_device_inject_and_the_connection_survives() {
    let dir = tempfile::tempdir().unwrap();
    let mut srv = Serving::start(
        dir.path(),
        "fault",
        &["--device", "mem:16M,fault.fail_read=0+4096"],
    );
    let mut cl = srv.client();
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
    srv.signal(libc::SIGTERM);
    let st = srv.wait_exit(Duration::from_secs(60));
    assert!(st.success(), "blkq serve exit status {st}");
}
