//! Panic containment on the completion side (issue 13 item 4): an `end_io` that panics on a
//! driver's completion thread does not take that thread with it, leaks no tag, and the other
//! requests of the device keep completing.
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]
#![cfg(not(blkq_loom))]

use std::sync::Arc;

use blk::{Bio, Buffer, EndIo, Error, Op};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};

struct Panicking;

impl EndIo for Panicking {
    fn end_io(&self, _bio: Bio, _res: Result<(), Error>) {
        panic!("injected: a submitter's completion panics");
    }
}

#[test]
fn a_panicking_end_io_leaves_the_completion_thread_and_the_tags_alone() {
    let spec: DeviceSpec = "null:16M,completion=thread,hw_queue_depth=4"
        .parse()
        .unwrap();
    let q = spec.build(&QueueOverrides::default()).unwrap();
    let bad: Arc<dyn EndIo> = Arc::new(Panicking);
    // More panicking completions than there are tags: a leaked tag would stall what follows.
    for i in 0..16u64 {
        q.submit(Bio::with_buf(Op::Read, i * 8, Buffer::new(4096)), &bad);
    }
    for i in 0..64u64 {
        let b = Bio::with_buf(Op::Read, i * 8, Buffer::new(4096));
        let (_, r) = testkit::io::submit_wait(&q, b);
        r.expect("a normal request after the panics");
    }
    let st = q.stats();
    assert_eq!(st.in_flight, [0, 0], "tags leaked");
    assert_eq!(st.ios[0], 80);
}
