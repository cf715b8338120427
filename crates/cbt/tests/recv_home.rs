//! A write received into its home ([`blk::Device::recv_home`]) through [`Tracked`]: it stays
//! on the zero-copy path, and its granules are dirty (made durable before the bytes land) like
//! any bio's.

use std::io::Write;
use std::os::unix::net::UnixStream;

use blk::{Device, DirtyExtent};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use blkq_sync::DynArc as Arc;
use cbt::{Bitmaps, Mode, Options, Store, Tracked};
use testkit::io::SocketSource;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 64 * MIB;

#[test]
fn a_write_received_into_its_home_is_counted_and_lands() {
    let inner: Arc<dyn Device> = Arc::new(
        "mem:64M,store=map"
            .parse::<DeviceSpec>()
            .unwrap()
            .build(&QueueOverrides::default())
            .unwrap(),
    );
    assert!(
        inner.caps().recv_home,
        "mem store=map receives into its home"
    );
    let opts = Options {
        store: Store::Memory,
        reset: false,
        mode: Mode::LockFree,
    };
    let (bitmaps, _) = Bitmaps::open(SIZE, &opts).unwrap();
    let t = Tracked::new(inner.clone(), bitmaps);
    t.bitmaps().add("b", 64 << 10).unwrap();
    assert!(t.caps().recv_home, "Tracked keeps the zero-copy write path");

    let (mut tx, rx) = UnixStream::pair().unwrap();
    let payload: Vec<u8> = (0..MIB as usize).map(|i| (i % 251) as u8).collect();
    let sender = std::thread::spawn({
        let p = payload.clone();
        move || tx.write_all(&p)
    });
    t.recv_home(3 * MIB, MIB as usize, &mut SocketSource(rx))
        .unwrap();
    sender.join().unwrap().unwrap();

    let mut out = Vec::new();
    t.dirty_bitmaps()
        .unwrap()
        .dirty_extents_into("b", 0, SIZE, 16, &mut out)
        .unwrap();
    let d = |len, dirty| DirtyExtent { len, dirty };
    assert_eq!(
        out,
        vec![d(3 * MIB, false), d(MIB, true), d(SIZE - 4 * MIB, false)]
    );
    let back = testkit::io::read_at(inner.as_ref(), 3 * MIB, MIB as usize).unwrap();
    assert!(back == payload, "the bytes are in the device");
}
