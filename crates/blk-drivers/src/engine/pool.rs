//! The thread-pool engine ([`PoolEngine`]; see the [engine docs](super)).

use std::collections::VecDeque;
use std::io;
use std::thread::JoinHandle;

use blkq_sync::atomic::{AtomicBool, Ordering};
use blkq_sync::{Arc, Mutex};
use waitq::WaitQueue;

use super::error::SubmitError;
use super::files::EngineFiles;
use super::op::{Callback, UringOp, UringOpKind};
use crate::fd_io::FileIo;
use blk::error::with_context;

struct PShared {
    files: FileIo,
    callback: Callback,
    queue: Mutex<VecDeque<(UringOp, u64)>>,
    /// Idle workers.
    work: WaitQueue,
    shutdown: AtomicBool,
}

/// The thread-pool engine: `threads` workers doing positional reads and writes, with the
/// same loops (short transfers, `EINTR`, `O_DIRECT` choice, `RWF_DSYNC`) as
/// [`crate::backend::FileBackend`]. The queue is unbounded: submission never waits.
pub struct PoolEngine {
    shared: Arc<PShared>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for PoolEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolEngine")
            .field("threads", &self.workers.len())
            .field("queued", &self.shared.queue.lock().len())
            .finish()
    }
}

/// Runs one op synchronously.
fn execute(files: &FileIo, op: &UringOp) -> io::Result<u32> {
    let len = op.len as usize;
    match op.kind {
        UringOpKind::Nop => Ok(0),
        UringOpKind::Fsync => files.sync().map(|()| 0),
        _ if len == 0 => Ok(0),
        UringOpKind::Read => {
            // SAFETY: `UringOp::read`'s contract: `ptr` is valid for writes of `len` bytes and
            // used by no one else until this op's callback, which runs after this returns.
            let buf = unsafe { std::slice::from_raw_parts_mut(op.ptr, len) };
            files.read(buf, op.offset).map(|()| op.len)
        }
        UringOpKind::Write => {
            // SAFETY: `UringOp::write`'s contract: `ptr` is valid for reads of `len` bytes and
            // written by no one until this op's callback, which runs after this returns.
            let buf = unsafe { std::slice::from_raw_parts(op.ptr.cast_const(), len) };
            files.write(buf, op.offset, op.fua).map(|()| op.len)
        }
    }
}

fn work(sh: &PShared) {
    loop {
        let job = sh.work.wait_for(|| {
            let mut q = sh.queue.lock();
            match q.pop_front() {
                Some(job) => Some(Some(job)),
                // Drain the queue before leaving: every accepted op is called back.
                None if sh.shutdown.load(Ordering::Acquire) => Some(None),
                None => None,
            }
        });
        let Some((op, user_data)) = job else { return };
        let r = execute(&sh.files, &op)
            .map_err(|e| with_context(e, format!("{:?} at {}+{}", op.kind, op.offset, op.len)));
        (sh.callback)(user_data, r);
    }
}

impl PoolEngine {
    /// A pool of `threads` (at least 1) workers over `files`, calling `callback` for each
    /// completed op.
    pub fn new(files: EngineFiles, threads: usize, callback: Callback) -> io::Result<PoolEngine> {
        let shared = Arc::new(PShared {
            files: files.io,
            callback,
            queue: Mutex::new(VecDeque::new()),
            work: WaitQueue::new(),
            shutdown: AtomicBool::new(false),
        });
        let mut engine = PoolEngine {
            shared,
            workers: Vec::new(),
        };
        for i in 0..threads.max(1) {
            let sh = Arc::clone(&engine.shared);
            let h = std::thread::Builder::new()
                .name(format!("blkq-pool-{i}"))
                .spawn(move || work(&sh))
                .map_err(|e| with_context(e, "spawn file engine worker"))?;
            engine.workers.push(h);
        }
        Ok(engine)
    }

    /// Queues one op.
    pub fn submit(&self, op: UringOp, user_data: u64) -> io::Result<()> {
        self.submit_batch(&[(op, user_data)]).map_err(|e| e.error)
    }

    /// Queues `ops` under one lock and wakes as many workers. Never fails.
    pub fn submit_batch(&self, ops: &[(UringOp, u64)]) -> Result<(), SubmitError> {
        self.shared.queue.lock().extend(ops.iter().copied());
        self.shared.work.wake_n(ops.len());
        Ok(())
    }

    /// Number of worker threads.
    pub fn threads(&self) -> usize {
        self.workers.len()
    }
}

impl Drop for PoolEngine {
    /// Lets the workers finish every queued op, then joins them (not from a worker itself,
    /// which would deadlock: a callback that drops the engine detaches the pool instead).
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.work.wake_all();
        let me = std::thread::current().id();
        for h in self.workers.drain(..) {
            if h.thread().id() != me {
                let _ = h.join();
            }
        }
    }
}
