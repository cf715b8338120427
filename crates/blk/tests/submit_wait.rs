//! `submit_wait` and `PendingBio`: the bio and its status come back whether the device
//! completes inline or on another thread; `wait_until` gives up at its deadline while the bio
//! stays in flight, and a late completion into the abandoned waiter is harmless.
// A plain threaded test, never a loom model: it may use std::sync.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blk::{Bio, Device, EndIo, Error, Extent, Limits, Op, PendingBio};

/// Completes inline, on a thread after a delay, or never (until `release`).
#[derive(Default)]
struct Dev {
    delay: Option<Duration>,
    held: Mutex<Vec<(Bio, Arc<dyn EndIo>)>>,
    hold: bool,
}

impl Dev {
    fn release(&self) {
        for (b, e) in self.held.lock().unwrap().drain(..) {
            e.end_io(b, Ok(()));
        }
    }
}

impl Device for Dev {
    fn submit(&self, bio: Bio, end: &Arc<dyn EndIo>) {
        if self.hold {
            self.held.lock().unwrap().push((bio, end.clone()));
            return;
        }
        let res = if bio.op == Op::Discard {
            Err(Error::Io(std::io::ErrorKind::Unsupported.into()))
        } else {
            Ok(())
        };
        match self.delay {
            None => end.end_io(bio, res),
            Some(d) => {
                let end = end.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(d);
                    end.end_io(bio, res);
                });
            }
        }
    }
    fn limits(&self) -> Limits {
        Limits {
            capacity: 1 << 20,
            logical_block_size: 512,
            max_io_bytes: 1 << 20,
        }
    }
    fn extents_into(&self, _: u64, _: u64, _: usize, out: &mut Vec<Extent>) -> Result<(), Error> {
        out.clear();
        Ok(())
    }
}

#[test]
fn inline_and_threaded_completions_come_back_with_their_status() {
    for delay in [None, Some(Duration::from_millis(20))] {
        let dev = Dev {
            delay,
            ..Dev::default()
        };
        let (bio, res) = blk::submit_wait(&dev, Bio::new(Op::Flush, 0, 0));
        assert_eq!(bio.op, Op::Flush);
        res.unwrap();
        let (bio, res) = blk::submit_wait(&dev, Bio::new(Op::Discard, 8, 4096));
        assert_eq!((bio.op, bio.sector, bio.len), (Op::Discard, 8, 4096));
        assert!(res.is_err());
    }
}

#[test]
fn several_in_flight_then_waited_for() {
    let dev = Dev {
        delay: Some(Duration::from_millis(10)),
        ..Dev::default()
    };
    let pending: Vec<PendingBio> = (0..4)
        .map(|i| PendingBio::submit(&dev, Bio::new(Op::Discard, i * 8, 4096)))
        .collect();
    for (i, p) in pending.into_iter().enumerate() {
        let (bio, res) = p.wait();
        assert_eq!(bio.sector, i as u64 * 8);
        assert!(res.is_err());
    }
}

#[test]
fn wait_until_gives_up_and_a_late_completion_is_harmless() {
    let dev = Dev {
        hold: true,
        ..Dev::default()
    };
    let t = Instant::now();
    let out = blk::submit_wait_until(
        &dev,
        Bio::new(Op::Flush, 0, 0),
        t + Duration::from_millis(30),
    );
    assert!(out.is_none());
    assert!(t.elapsed() >= Duration::from_millis(30));
    dev.release();

    let p = PendingBio::submit(&dev, Bio::new(Op::Flush, 0, 0));
    dev.release();
    let (bio, res) = p
        .wait_until(Instant::now() + Duration::from_secs(10))
        .expect("completed before the wait");
    assert_eq!(bio.op, Op::Flush);
    res.unwrap();
}
