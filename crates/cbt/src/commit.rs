//! The committer: makes newly set bits durable before the writes they cover go down, batching
//! concurrent first writes into one sync (group commit).
//!
//! A writer whose bits are not all durable ([`crate::bits::Bitmap::mark`] said so) calls
//! [`Committer::persist`]: under the lock it adds the pages holding its words to the pending
//! batch and notes the batch number that will carry them (`started + 1`). If no leader is
//! running it becomes the leader: it takes the pending batch, drops the lock, snapshots each
//! page's words and writes them to the [`Sink`] (pwrite of the sidecar's pages), syncs once
//! (fdatasync), marks the snapshotted bits durable, publishes `finished`, wakes the waiters,
//! and loops while more pages arrived meanwhile. Otherwise it sleeps until `finished` reaches
//! its batch. Either way it then checks that its bits are durable: when they are not, the
//! persist failed and the write fails with it, never going down uncounted on disk.
//!
//! Ordering: the writer's `fetch_or` of its bits happens before it takes the lock to push its
//! page; the leader takes the batch under the same lock, then loads the words: the snapshot
//! holds the bit (the mutex's release/acquire). Bits set after the snapshot are not marked
//! durable (the durable mask is the snapshot, not a re-load), so they are persisted by a later
//! batch. Pages are written one leader at a time, so a later snapshot of a page never lands
//! before an earlier one.

use blkq_sync::{Arc, DynArc, Mutex};
use waitq::WaitQueue;

use crate::bits::Bitmap;
use crate::sidecar::{decode_words, encode_page, PAGE, WORDS_PER_PAGE};
use crate::sink::Sink;

type Batch = Vec<(Arc<Bitmap>, u64)>;

struct State {
    pending: Batch,
    spare: Batch,
    buf: Vec<u8>,
    leader: bool,
    started: u64,
    finished: u64,
    last_error: Option<String>,
    batches: u64,
    pages: u64,
}

/// Counters of what the committer did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommitStats {
    /// Syncs issued (one per batch).
    pub batches: u64,
    /// Pages written.
    pub pages: u64,
}

/// See the module docs.
pub struct Committer {
    sink: DynArc<dyn Sink>,
    st: Mutex<State>,
    done: WaitQueue,
}

impl Committer {
    /// A committer writing to `sink`.
    pub fn new(sink: DynArc<dyn Sink>) -> Self {
        Self {
            sink,
            st: Mutex::new(State {
                pending: Vec::new(),
                spare: Vec::new(),
                buf: Vec::new(),
                leader: false,
                started: 0,
                finished: 0,
                last_error: None,
                batches: 0,
                pages: 0,
            }),
            done: WaitQueue::new(),
        }
    }

    /// The sink.
    pub fn sink(&self) -> &DynArc<dyn Sink> {
        &self.sink
    }

    /// What it did so far.
    pub fn stats(&self) -> CommitStats {
        let st = self.st.lock();
        CommitStats {
            batches: st.batches,
            pages: st.pages,
        }
    }

    /// Makes the words `[w0, w1)` of `bm` durable (with whatever else is pending), for the
    /// write of `[offset, offset + len)`; `Err` (a message naming the store) when the persist
    /// failed and those bits are not on disk.
    pub fn persist(
        &self,
        bm: &Arc<Bitmap>,
        (w0, w1): (usize, usize),
        offset: u64,
        len: u64,
    ) -> Result<(), String> {
        let mut st = self.st.lock();
        for p in (w0 / WORDS_PER_PAGE)..=((w1 - 1) / WORDS_PER_PAGE) {
            let p = p as u64;
            if !st
                .pending
                .iter()
                .any(|(b, q)| *q == p && Arc::ptr_eq(b, bm))
            {
                st.pending.push((bm.clone(), p));
            }
        }
        let mine = st.started + 1;
        if st.leader {
            drop(st);
            self.done
                .wait_for(|| (self.st.lock().finished >= mine).then_some(()));
        } else {
            st.leader = true;
            loop {
                let mut batch = std::mem::take(&mut st.spare);
                std::mem::swap(&mut batch, &mut st.pending);
                st.started += 1;
                let e = st.started;
                let mut buf = std::mem::take(&mut st.buf);
                drop(st);
                let res = self.write_batch(&batch, &mut buf);
                st = self.st.lock();
                st.finished = e;
                st.batches += 1;
                st.pages += batch.len() as u64;
                if let Err(m) = res {
                    st.last_error = Some(m);
                }
                batch.clear();
                st.spare = batch;
                st.buf = buf;
                let more = !st.pending.is_empty();
                if !more {
                    st.leader = false;
                }
                drop(st);
                self.done.wake_all();
                if !more {
                    break;
                }
                st = self.st.lock();
            }
        }
        if bm.is_durable(offset, len) {
            return Ok(());
        }
        let why = self.st.lock().last_error.clone().unwrap_or_default();
        Err(format!(
            "persisting dirty bitmap {:?} to {}: {why}",
            bm.name(),
            self.sink.describe()
        ))
    }

    /// Writes every page of the batch, syncs once, then marks the written bits durable.
    fn write_batch(&self, batch: &Batch, buf: &mut Vec<u8>) -> Result<(), String> {
        buf.resize(batch.len() * PAGE, 0);
        for (i, (bm, p)) in batch.iter().enumerate() {
            let page = &mut buf[i * PAGE..(i + 1) * PAGE];
            encode_page(bm, *p, page);
            self.sink
                .write_pages(bm.region() + p, page)
                .map_err(|e| e.to_string())?;
        }
        self.sink.sync().map_err(|e| e.to_string())?;
        for (i, (bm, p)) in batch.iter().enumerate() {
            let first = *p as usize * WORDS_PER_PAGE;
            for (j, v) in decode_words(&buf[i * PAGE..(i + 1) * PAGE]).enumerate() {
                if first + j < bm.nwords() && v != 0 {
                    bm.set_durable(first + j, v);
                }
            }
        }
        Ok(())
    }
}
