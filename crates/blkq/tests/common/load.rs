//! A verified write load: a thread writes 4 KiB blocks round-robin over a list of block
//! numbers, each with a pattern naming the block and its sequence number, flushing every few
//! writes, and remembers the last acknowledged write of every block ([`Ledger`]); at the end
//! every block must read back as its last acknowledged write. A write or flush that fails
//! stops the load and fails the test when it is joined: the server must keep serving.

use std::collections::HashMap;
use std::thread::JoinHandle;

use blkq_sync::atomic::{AtomicBool, AtomicU64, Ordering};
use blkq_sync::Arc;
use nbd::client::Client;
use nbd::codec::proto::CmdFlags;

/// The size of every write of the load.
pub const BLOCK: u64 = 4096;
/// Writes between two flushes, by default.
const FLUSH_EVERY: u64 = 16;

/// A few blocks spread over each of `chunks`, array chunks of `chunk` bytes (the bitmap's).
pub fn blocks_in(chunk: u64, chunks: &[u64]) -> Vec<u64> {
    chunks
        .iter()
        .flat_map(|c| (0..8).map(move |k| c * (chunk / BLOCK) + k * 29))
        .collect()
}

/// The last acknowledged write of each block a load wrote.
#[derive(Default)]
pub struct Ledger {
    last: HashMap<u64, u64>,
    seq: u64,
}

fn seed(block: u64, seq: u64) -> u64 {
    (block << 24) ^ seq
}

impl Ledger {
    /// Every block written reads back as its last acknowledged write; returns how many blocks
    /// were checked.
    pub fn verify(&self, c: &mut Client) -> usize {
        for (&block, &seq) in &self.last {
            let got = c.read(block * BLOCK, BLOCK).unwrap();
            assert!(
                got == testkit::pattern(seed(block, seq), BLOCK as usize),
                "block {block} does not hold its last acknowledged write (seq {seq})"
            );
        }
        self.last.len()
    }

    /// The blocks written so far.
    pub fn blocks(&self) -> impl Iterator<Item = u64> + '_ {
        self.last.keys().copied()
    }
}

/// A running load (see the module docs).
pub struct Load {
    stop: Arc<AtomicBool>,
    writes: Arc<AtomicU64>,
    handle: JoinHandle<Ledger>,
}

impl Load {
    /// Starts writing round-robin over `blocks` through `c`, continuing `ledger`, with a
    /// flush every 16 writes.
    pub fn start(c: Client, blocks: Vec<u64>, ledger: Ledger) -> Self {
        Self::start_flushing_every(c, blocks, ledger, FLUSH_EVERY)
    }

    /// As [`Load::start`], with a flush every `flush_every` writes (`u64::MAX`: only when
    /// stopped).
    pub fn start_flushing_every(
        mut c: Client,
        blocks: Vec<u64>,
        mut ledger: Ledger,
        flush_every: u64,
    ) -> Self {
        assert!(!blocks.is_empty());
        let stop = Arc::new(AtomicBool::new(false));
        let writes = Arc::new(AtomicU64::new(0));
        let (s, w) = (stop.clone(), writes.clone());
        let handle = std::thread::spawn(move || {
            let mut n = 0u64;
            // Relaxed: the flag only asks the thread to stop; the ledger comes back by join.
            while !s.load(Ordering::Relaxed) {
                let block = blocks[(n % blocks.len() as u64) as usize];
                ledger.seq += 1;
                let data = testkit::pattern(seed(block, ledger.seq), BLOCK as usize);
                if let Err(e) = c.write(block * BLOCK, &data, CmdFlags::empty()) {
                    panic!("write {n} (block {block}) failed: {e}");
                }
                ledger.last.insert(block, ledger.seq);
                n += 1;
                if n.is_multiple_of(flush_every) {
                    if let Err(e) = c.flush() {
                        panic!("flush after write {n} failed: {e}");
                    }
                }
                // Relaxed: a progress count for the test's waits.
                w.store(n, Ordering::Relaxed);
            }
            c.flush().unwrap();
            ledger
        });
        Self {
            stop,
            writes,
            handle,
        }
    }

    /// Writes acknowledged so far.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// Waits (bounded, 120 s) until `n` more writes were acknowledged than now.
    pub fn wait_more(&self, n: u64) {
        let target = self.writes() + n;
        testkit::wait_until_within(
            "the load's writes",
            std::time::Duration::from_secs(120),
            || self.writes() >= target || self.handle.is_finished(),
        );
        assert!(!self.handle.is_finished(), "the load stopped early");
    }

    /// Stops the load (after a final flush) and returns its ledger; a failed write or flush
    /// fails the test here.
    pub fn stop(self) -> Ledger {
        self.stop.store(true, Ordering::Relaxed);
        match self.handle.join() {
            Ok(l) => l,
            Err(e) => std::panic::resume_unwind(e),
        }
    }
}
