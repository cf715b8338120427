//! The io_uring engine ([`UringEngine`]; see the [engine docs](super)).

use std::io;
use std::os::fd::AsRawFd;
use std::thread::{JoinHandle, ThreadId};

use blkq_sync::atomic::{AtomicBool, Ordering};
use blkq_sync::{Arc, Mutex};
use io_uring::{opcode, squeue, types, IoUring};
use waitq::WaitQueue;

use super::error::SubmitError;
use super::files::EngineFiles;
use super::op::{Callback, UringOp, UringOpKind};
use crate::fd_io::FileIo;
use blk::error::with_context;

/// `user_data` of the NOP that wakes the reaper at shutdown.
const WAKE: u64 = u64::MAX;
/// `user_data` of the construction-time probe NOP.
const PROBE: u64 = u64::MAX - 1;
/// How many times one op is resubmitted after `ECANCELED`/`EINTR`/`EAGAIN` before its error
/// is reported.
const MAX_RETRIES: u32 = 64;
/// `io_uring_enter` flag: wait for `min_complete` completions (not re-exported by the crate).
const IORING_ENTER_GETEVENTS: u32 = 1;
/// How many times a submission retries `EAGAIN`/`EBUSY` (50 µs apart) before giving up.
const BUSY_RETRIES: u32 = 20_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Reading or writing (possibly the remainder after a short transfer).
    Transfer,
    /// A FUA write done without `RWF_DSYNC`: its `fdatasync`.
    SyncAfter,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    user_data: u64,
    op: UringOp,
    /// Bytes transferred so far.
    done: u32,
    /// Whether the in-flight SQE uses the direct descriptor.
    direct: bool,
    /// A FUA write that needs an `fdatasync` after the transfer.
    need_sync: bool,
    phase: Phase,
    /// Resubmissions after `ECANCELED`/`EINTR`/`EAGAIN`.
    retries: u32,
}

#[derive(Debug)]
struct UState {
    slots: Vec<Option<Slot>>,
    free: Vec<u32>,
    /// Reused per batch (no allocation on the submission path once warm).
    scratch_idx: Vec<u32>,
    scratch_sqe: Vec<squeue::Entry>,
}

impl UState {
    fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }
}

struct UShared {
    ring: IoUring,
    files: FileIo,
    callback: Callback,
    /// The slots, and the submission queue: every push and `io_uring_enter(to_submit)` happens
    /// under this lock, and the queue is empty whenever it is released (but after `broken`).
    state: Mutex<UState>,
    /// Submitters waiting for a free slot.
    space: WaitQueue,
    shutdown: AtomicBool,
    /// A submission failed hard: no more `io_uring_enter` with entries to submit.
    broken: AtomicBool,
    reaper: Mutex<Option<ThreadId>>,
}

/// The io_uring engine. See the [module docs](self).
pub struct UringEngine {
    shared: Arc<UShared>,
    reaper: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for UringEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringEngine")
            .field("sq_entries", &self.shared.ring.params().sq_entries())
            .field("in_flight", &self.shared.state.lock().in_flight())
            .finish()
    }
}

fn errno(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
}

/// Whether io_uring works here: a real ring, the opcodes used, and a NOP round trip.
fn probe_ring(entries: u32) -> io::Result<IoUring> {
    let ring = IoUring::new(entries.max(2)).map_err(|e| with_context(e, "io_uring_setup"))?;
    let mut probe = io_uring::Probe::new();
    ring.submitter()
        .register_probe(&mut probe)
        .map_err(|e| with_context(e, "io_uring probe (kernel before 5.6?)"))?;
    for (name, code) in [
        ("READ", opcode::Read::CODE),
        ("WRITE", opcode::Write::CODE),
        ("FSYNC", opcode::Fsync::CODE),
        ("NOP", opcode::Nop::CODE),
    ] {
        if !probe.is_supported(code) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("io_uring without IORING_OP_{name}"),
            ));
        }
    }
    let nop = opcode::Nop::new().build().user_data(PROBE);
    {
        // SAFETY: the ring is not shared yet; this is the only submission queue handle.
        let mut sq = unsafe { ring.submission_shared() };
        // SAFETY: a NOP references no memory.
        unsafe { sq.push(&nop) }
            .map_err(|_| io::Error::other("io_uring: probe NOP does not fit"))?;
    }
    loop {
        match ring.submit_and_wait(1) {
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(with_context(e, "io_uring_enter (probe NOP)")),
        }
    }
    // SAFETY: the ring is not shared yet; this is the only completion queue handle.
    let cqe = unsafe { ring.completion_shared() }.next();
    match cqe {
        Some(c) if c.user_data() == PROBE && c.result() >= 0 => Ok(ring),
        Some(c) if c.result() < 0 => Err(with_context(errno(-c.result()), "io_uring probe NOP")),
        _ => Err(io::Error::other("io_uring: probe NOP did not complete")),
    }
}

impl UringEngine {
    /// Checks that io_uring can be used here (setup, opcodes, a NOP round trip); `Err` says
    /// why not (`EPERM` or `ENOSYS` where a container's seccomp policy blocks it).
    pub fn available() -> io::Result<()> {
        probe_ring(2).map(drop)
    }

    /// An engine over `files` with a ring of `entries` submission entries (also the most ops
    /// in flight), calling `callback` for each completed op. Fails cleanly where io_uring is
    /// unavailable.
    pub fn new(files: EngineFiles, entries: u32, callback: Callback) -> io::Result<UringEngine> {
        match Self::try_new(files, entries, callback) {
            Ok(engine) => Ok(engine),
            Err(TryNew::Unavailable(e, _, _) | TryNew::Failed(e)) => Err(e),
        }
    }

    /// [`UringEngine::new`] that hands back what it was given when io_uring is unavailable.
    pub(super) fn try_new(
        files: EngineFiles,
        entries: u32,
        callback: Callback,
    ) -> Result<UringEngine, TryNew> {
        let ring = match probe_ring(entries) {
            Ok(r) => r,
            Err(e) => return Err(TryNew::Unavailable(e, files, callback)),
        };
        let cap = ring.params().sq_entries();
        let shared = Arc::new(UShared {
            ring,
            files: files.io,
            callback,
            state: Mutex::new(UState {
                slots: vec![None; cap as usize],
                free: (0..cap).rev().collect(),
                scratch_idx: Vec::with_capacity(cap as usize),
                scratch_sqe: Vec::with_capacity(cap as usize),
            }),
            space: WaitQueue::new(),
            shutdown: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            reaper: Mutex::new(None),
        });
        let s2 = Arc::clone(&shared);
        let handle = std::thread::Builder::new()
            .name("blkq-uring-reaper".into())
            .spawn(move || reap(&s2))
            .map_err(|e| TryNew::Failed(with_context(e, "spawn io_uring reaper")))?;
        *shared.reaper.lock() = Some(handle.thread().id());
        Ok(UringEngine {
            shared,
            reaper: Some(handle),
        })
    }

    /// Submits one op; see [`UringEngine::submit_batch`].
    pub fn submit(&self, op: UringOp, user_data: u64) -> io::Result<()> {
        self.submit_batch(&[(op, user_data)]).map_err(|e| e.error)
    }

    /// Submits `ops` with one `io_uring_enter` per run that fits in the ring (so one for a
    /// batch of at most `sq_entries` when the ring has room), waiting for room if needed.
    /// `Err` says how many were accepted; the others will never be called back.
    pub fn submit_batch(&self, ops: &[(UringOp, u64)]) -> Result<(), SubmitError> {
        let sh = &*self.shared;
        let mut i = 0;
        while i < ops.len() {
            let mut st = sh.state.lock();
            // Checked under the lock: entering after a failure could submit the entries the
            // failed submitter gave up on.
            if sh.broken.load(Ordering::Acquire) {
                return Err(SubmitError {
                    accepted: i,
                    error: io::Error::other("io_uring engine is broken after a failed submit"),
                });
            }
            if st.free.is_empty() {
                drop(st);
                if *sh.reaper.lock() == Some(std::thread::current().id()) {
                    return Err(SubmitError {
                        accepted: i,
                        error: io::Error::new(
                            io::ErrorKind::WouldBlock,
                            "io_uring engine full (submitting from its completion callback)",
                        ),
                    });
                }
                sh.space.wait_for(|| {
                    (!sh.state.lock().free.is_empty() || sh.broken.load(Ordering::Acquire))
                        .then_some(())
                });
                continue;
            }
            let k = st.free.len().min(ops.len() - i);
            let mut idxs = std::mem::take(&mut st.scratch_idx);
            let mut sqes = std::mem::take(&mut st.scratch_sqe);
            idxs.clear();
            sqes.clear();
            for &(op, user_data) in &ops[i..i + k] {
                let Some(idx) = st.free.pop() else { break };
                let mut slot = Slot {
                    user_data,
                    op,
                    done: 0,
                    direct: false,
                    need_sync: op.kind == UringOpKind::Write
                        && op.fua
                        && !sh.files.dsync_ok.load(Ordering::Relaxed),
                    phase: Phase::Transfer,
                    retries: 0,
                };
                let sqe = sh.sqe(&mut slot, idx);
                st.slots[idx as usize] = Some(slot);
                idxs.push(idx);
                sqes.push(sqe);
            }
            let r = sh.push_and_enter(&sqes);
            let n = idxs.len();
            if let Err((submitted, _)) = &r {
                // The kernel never saw the rest (and never will).
                for &idx in &idxs[*submitted..] {
                    st.slots[idx as usize] = None;
                    st.free.push(idx);
                }
            }
            st.scratch_idx = idxs;
            st.scratch_sqe = sqes;
            match r {
                Ok(()) => i += n,
                Err((submitted, e)) => {
                    drop(st);
                    sh.space.wake_all();
                    return Err(SubmitError {
                        accepted: i + submitted,
                        error: e,
                    });
                }
            }
        }
        Ok(())
    }

    /// The most ops in flight at once (the ring's submission entries).
    pub fn capacity(&self) -> u32 {
        self.shared.ring.params().sq_entries()
    }
}

/// Why [`UringEngine::try_new`] failed.
pub(super) enum TryNew {
    /// io_uring cannot be used here; what it was given, to build something else.
    Unavailable(io::Error, EngineFiles, Callback),
    /// io_uring works but the engine could not be set up.
    Failed(io::Error),
}

impl UShared {
    /// The SQE for `slot`'s next step, recording in it whether it went direct.
    fn sqe(&self, slot: &mut Slot, idx: u32) -> squeue::Entry {
        let op = &slot.op;
        let ud = u64::from(idx);
        let rest = op.len.saturating_sub(slot.done);
        let e = match (slot.phase, op.kind) {
            (Phase::SyncAfter, _) | (_, UringOpKind::Fsync) => {
                slot.direct = false;
                opcode::Fsync::new(types::Fd(self.files.buffered.as_raw_fd()))
                    .flags(types::FsyncFlags::DATASYNC)
                    .build()
            }
            (_, UringOpKind::Nop) => opcode::Nop::new().build(),
            (_, UringOpKind::Read | UringOpKind::Write) if rest == 0 => opcode::Nop::new().build(),
            (_, UringOpKind::Read) => {
                let off = op.offset + u64::from(slot.done);
                let ptr = op.ptr.wrapping_add(slot.done as usize);
                let (fd, direct) = self.files.pick(off, ptr as usize, rest as usize);
                slot.direct = direct;
                opcode::Read::new(types::Fd(fd), ptr, rest)
                    .offset(off)
                    .build()
            }
            (_, UringOpKind::Write) => {
                let off = op.offset + u64::from(slot.done);
                let ptr = op.ptr.wrapping_add(slot.done as usize);
                let (fd, direct) = self.files.pick(off, ptr as usize, rest as usize);
                slot.direct = direct;
                let flags = if op.fua && !slot.need_sync {
                    libc::RWF_DSYNC
                } else {
                    0
                };
                opcode::Write::new(types::Fd(fd), ptr.cast_const(), rest)
                    .offset(off)
                    .rw_flags(flags)
                    .build()
            }
        };
        e.user_data(ud)
    }

    /// Pushes `entries` and submits them (the caller holds `state`'s lock, so the queue is
    /// empty on entry and has room for every slot). `Err((n, e))`: only the first `n` were
    /// taken by the kernel; the others never will be (after a failed `io_uring_enter` the
    /// engine is `broken` and enters nothing again).
    fn push_and_enter(&self, entries: &[squeue::Entry]) -> Result<(), (usize, io::Error)> {
        let mut pushed = 0usize;
        {
            // SAFETY: the caller holds `state`'s lock, which every user of the submission
            // queue takes: this is the only handle to it right now.
            let mut sq = unsafe { self.ring.submission_shared() };
            for e in entries {
                // SAFETY: each SQE points at a buffer that the op's `unsafe` constructor's
                // contract keeps valid until the op's callback, which runs only after its
                // last CQE; Nop and Fsync point at nothing.
                if unsafe { sq.push(e) }.is_err() {
                    break;
                }
                pushed += 1;
            }
            sq.sync();
        }
        let mut submitted = 0usize;
        let mut busy = 0u32;
        while submitted < pushed {
            match self.ring.submitter().submit() {
                Ok(n) if n > 0 => submitted += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(_) => busy += 1,
                Err(e)
                    if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EBUSY))
                        && busy < BUSY_RETRIES =>
                {
                    busy += 1;
                    std::thread::sleep(std::time::Duration::from_micros(50));
                }
                Err(e) => {
                    self.broken.store(true, Ordering::Release);
                    return Err((submitted, with_context(e, "io_uring_enter")));
                }
            }
            if busy >= BUSY_RETRIES {
                self.broken.store(true, Ordering::Release);
                return Err((
                    submitted,
                    io::Error::other("io_uring_enter makes no progress"),
                ));
            }
        }
        if pushed < entries.len() {
            // Not reached while the queue-empty invariant holds; the rest never got in.
            return Err((pushed, io::Error::other("io_uring submission queue full")));
        }
        Ok(())
    }

    /// Handles one CQE (under `state`'s lock): `Some(completion)`, or `None` after queueing
    /// the slot's next step into `resubmit`.
    fn on_cqe(
        &self,
        st: &mut UState,
        idx: u32,
        res: i32,
        resubmit: &mut Vec<squeue::Entry>,
    ) -> Option<(u64, io::Result<u32>)> {
        let entry = st.slots.get_mut(idx as usize)?;
        let slot = entry.as_mut()?;
        let op = slot.op;
        let transient = res == -libc::ECANCELED || res == -libc::EINTR || res == -libc::EAGAIN;
        let outcome: Result<Option<u32>, io::Error> = if transient && slot.retries < MAX_RETRIES {
            // ECANCELED: the kernel cancels a thread's requests when it exits, so ops from a
            // submitter that has gone are redone here, by the reaper (which outlives every
            // op). Positional transfers and fsync are idempotent; `done` is unchanged.
            slot.retries += 1;
            Ok(None)
        } else {
            match (slot.phase, op.kind) {
                (Phase::SyncAfter, _) => {
                    if res < 0 {
                        Err(errno(-res))
                    } else {
                        Ok(Some(op.len))
                    }
                }
                (_, UringOpKind::Fsync | UringOpKind::Nop) => {
                    if res < 0 {
                        Err(errno(-res))
                    } else {
                        Ok(Some(0))
                    }
                }
                (Phase::Transfer, UringOpKind::Read | UringOpKind::Write) => {
                    let write = op.kind == UringOpKind::Write;
                    if slot.done >= op.len && res >= 0 {
                        // A zero-length op went as a NOP.
                        Ok(Some(op.len))
                    } else if res < 0 {
                        let e = -res;
                        if e == libc::EINVAL && slot.direct {
                            self.files.direct_ok.store(false, Ordering::Relaxed);
                            Ok(None)
                        } else if write && op.fua && !slot.need_sync && e == libc::EOPNOTSUPP {
                            self.files.dsync_ok.store(false, Ordering::Relaxed);
                            slot.need_sync = true;
                            Ok(None)
                        } else {
                            Err(errno(e))
                        }
                    } else if res == 0 {
                        Err(if write {
                            io::Error::new(io::ErrorKind::WriteZero, "io_uring write wrote nothing")
                        } else {
                            io::Error::new(
                                io::ErrorKind::UnexpectedEof,
                                format!("end of file at {}", op.offset + u64::from(slot.done)),
                            )
                        })
                    } else {
                        slot.done = slot.done.saturating_add(res as u32).min(op.len);
                        if slot.done < op.len {
                            Ok(None)
                        } else if write && slot.need_sync {
                            slot.phase = Phase::SyncAfter;
                            Ok(None)
                        } else {
                            Ok(Some(op.len))
                        }
                    }
                }
            }
        };
        let result = match outcome {
            Ok(None) => {
                let sqe = self.sqe(slot, idx);
                resubmit.push(sqe);
                return None;
            }
            Ok(Some(n)) => Ok(n),
            Err(e) => Err(with_context(
                e,
                format!(
                    "io_uring {:?} at {}+{}",
                    op.kind,
                    op.offset + u64::from(slot.done),
                    op.len - slot.done.min(op.len)
                ),
            )),
        };
        let user_data = slot.user_data;
        *entry = None;
        st.free.push(idx);
        Some((user_data, result))
    }
}

/// The reaper: waits for CQEs, resubmits short transfers, runs the callback.
fn reap(sh: &UShared) {
    let mut cqes: Vec<(u64, i32)> = Vec::new();
    let mut done: Vec<(u64, io::Result<u32>)> = Vec::new();
    let mut resubmit: Vec<squeue::Entry> = Vec::new();
    loop {
        if sh.shutdown.load(Ordering::Acquire) && sh.state.lock().in_flight() == 0 {
            return;
        }
        // SAFETY: enter with no submissions (`to_submit` 0: the submission queue is left to
        // the lock holders) and no argument, just waiting for one completion.
        let r = unsafe {
            sh.ring
                .submitter()
                .enter::<libc::sigset_t>(0, 1, IORING_ENTER_GETEVENTS, None)
        };
        if let Err(e) = r {
            if e.kind() != io::ErrorKind::Interrupted {
                // Nothing sensible to do but try again; do not spin.
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        {
            // SAFETY: only this thread ever touches the completion queue (after construction).
            let cq = unsafe { sh.ring.completion_shared() };
            cqes.extend(cq.map(|c| (c.user_data(), c.result())));
        }
        if cqes.is_empty() {
            continue;
        }
        let freed;
        {
            let mut st = sh.state.lock();
            let before = st.free.len();
            for &(ud, res) in &cqes {
                if ud == WAKE || ud == PROBE {
                    continue;
                }
                let Ok(idx) = u32::try_from(ud) else { continue };
                if let Some(c) = sh.on_cqe(&mut st, idx, res, &mut resubmit) {
                    done.push(c);
                }
            }
            if !resubmit.is_empty() {
                let r = if sh.broken.load(Ordering::Acquire) {
                    // Entering now could also submit entries a failed submitter gave up on.
                    Err((0, io::Error::other("io_uring engine is broken")))
                } else {
                    sh.push_and_enter(&resubmit)
                };
                if let Err((submitted, e)) = r {
                    // Complete what the kernel did not take with the error.
                    let err_kind = e.kind();
                    let msg = e.to_string();
                    for sqe_ud in resubmit[submitted..]
                        .iter()
                        .map(squeue::Entry::get_user_data)
                    {
                        let Ok(idx) = u32::try_from(sqe_ud) else {
                            continue;
                        };
                        if let Some(Some(slot)) = st.slots.get(idx as usize).copied() {
                            done.push((slot.user_data, Err(io::Error::new(err_kind, msg.clone()))));
                            st.slots[idx as usize] = None;
                            st.free.push(idx);
                        }
                    }
                }
                resubmit.clear();
            }
            freed = st.free.len() - before;
        }
        cqes.clear();
        if freed > 0 {
            sh.space.wake_n(freed);
        }
        for (ud, r) in done.drain(..) {
            (sh.callback)(ud, r);
        }
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        let sh = &*self.shared;
        sh.shutdown.store(true, Ordering::Release);
        let woken = {
            let _st = sh.state.lock();
            let nop = opcode::Nop::new().build().user_data(WAKE);
            !sh.broken.load(Ordering::Acquire)
                && sh.push_and_enter(std::slice::from_ref(&nop)).is_ok()
        };
        let on_reaper = *sh.reaper.lock() == Some(std::thread::current().id());
        if let Some(h) = self.reaper.take() {
            // Joining from the reaper itself (the callback dropped the engine) would deadlock,
            // and without the wake-up NOP the reaper may never return: detach then. The reaper
            // still exits once nothing is in flight.
            if woken && !on_reaper {
                let _ = h.join();
            }
        }
    }
}
