//! Export descriptions sent to clients (NBD_INFO_DESCRIPTION, NBD_OPT_LIST) disclose no host
//! path unless `--describe-paths` asks for it. The built binary, `nbd::client`.

mod common;

use common::Serving;
use nbd::client::Endpoint;
use nbd::client::Handshake;

fn descriptions(s: &Serving) -> (String, Vec<(String, String)>) {
    let stream = Endpoint::Unix(s.sock.clone()).connect().unwrap();
    let mut h = Handshake::start(stream).unwrap();
    let info = h.info("").unwrap();
    let list = h.list().unwrap();
    h.abort().unwrap();
    (info.description.unwrap_or_default(), list)
}

#[test]
fn descriptions_name_no_host_path_unless_asked() {
    let dir = tempfile::tempdir().unwrap();
    let (path, spec) = common::leg_file(dir.path(), "secret-disk.img", 4 << 20);
    let shown = path.display().to_string();

    let mut s = Serving::start(dir.path(), "plain", &["--device", &spec]);
    let (info, list) = descriptions(&s);
    assert!(!info.contains(&shown) && !info.contains("secret"), "{info}");
    assert!(info.contains("file"), "the kind is still told: {info}");
    assert_eq!(list.len(), 1);
    assert!(!list[0].1.contains("secret"), "{list:?}");
    s.signal(libc::SIGTERM);
    assert!(s.wait_exit(std::time::Duration::from_secs(60)).success());

    let mut s = Serving::start(
        dir.path(),
        "paths",
        &["--device", &spec, "--describe-paths"],
    );
    let (info, list) = descriptions(&s);
    assert!(info.contains(&shown), "{info}");
    assert!(list[0].1.contains(&shown), "{list:?}");
    s.signal(libc::SIGTERM);
    assert!(s.wait_exit(std::time::Duration::from_secs(60)).success());
}
