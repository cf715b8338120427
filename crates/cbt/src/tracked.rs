//! [`Tracked`]: a [`Filter`] that counts every write, discard and write-zeroes in its export's
//! recording dirty bitmaps before forwarding it to the device it wraps, and answers
//! [`Device::dirty_bitmaps`]. Writes received into their home ([`Device::recv_home`]) are
//! counted the same way. Everything else is the inner device's, forwarded by `Filter`'s
//! defaults: reads, flushes, limits, allocation maps, capabilities and zero-copy reads, the
//! disk and queue statistics.
//!
//! A changing bio is marked ([`Bitmaps::start_write`]: a clean granule's bit is made durable
//! first), then forwarded with the device's own completion, which ends the bio's gate count
//! ([`Bitmaps::end_write`]) before handing it back to the submitter. What the completion needs
//! (the submitter's `EndIo`, its cookie, the gate's token) is kept in a slot table, and the
//! bio's cookie carries the table's and the slot's index down and back (blk never reads
//! cookies), so no I/O allocates once the tables have grown to the most writes ever in
//! flight. There are [`TABLES`] tables, a submitting thread using the one of its thread slot,
//! so that submitters on many cores do not share one lock.

use blk::{Bio, Device, DirtyBitmaps, DirtyExtent, EndIo, Error, Filter, Op};
use blkq_sync::DynArc;
use blkq_sync::{CachePadded, Mutex};

use crate::bitmaps::Bitmaps;

struct Pending {
    end: DynArc<dyn EndIo>,
    cookie: u64,
    token: u64,
}

#[derive(Default)]
struct SlotTable {
    slots: Vec<Option<Pending>>,
    free: Vec<u32>,
}

/// Slot tables per device (see the module docs).
pub const TABLES: usize = 16;

/// What a [`Tracked`] shares with its writes' completions: the bitmaps and the slot tables.
struct TrackedState {
    bitmaps: Bitmaps,
    tables: [CachePadded<Mutex<SlotTable>>; TABLES],
}

/// The completion [`Tracked`] hands the inner device for every write.
struct Completer(DynArc<TrackedState>);

impl EndIo for Completer {
    fn end_io(&self, mut bio: Bio, res: Result<(), Error>) {
        let p = (bio.cookie >> 32) as usize;
        let p = self.0.tables.get(p).and_then(|t| {
            let mut t = t.lock();
            let i = bio.cookie as u32 as usize;
            let p = t.slots.get_mut(i).and_then(Option::take);
            if p.is_some() {
                t.free.push(i as u32);
            }
            p
        });
        // A completion for a slot we do not hold is a bug of the inner device; there is no
        // submitter to tell, so it is dropped (logged) rather than panicking on a request path.
        let Some(p) = p else {
            tracing::error!(cookie = bio.cookie, "cbt: completion for an unknown write");
            return;
        };
        bio.cookie = p.cookie;
        self.0.bitmaps.end_write(p.token);
        p.end.end_io(bio, res);
    }
}

/// See the module docs.
pub struct Tracked {
    inner: DynArc<dyn Device>,
    shared: DynArc<TrackedState>,
    completer: DynArc<dyn EndIo>,
}

fn changes(op: Op) -> bool {
    matches!(op, Op::Write | Op::Discard | Op::WriteZeroes)
}

impl Tracked {
    /// Wraps `inner`, counting its writes in `bitmaps`.
    pub fn new(inner: DynArc<dyn Device>, bitmaps: Bitmaps) -> Self {
        let shared = DynArc::new(TrackedState {
            bitmaps,
            tables: std::array::from_fn(|_| CachePadded(Mutex::new(SlotTable::default()))),
        });
        let completer: DynArc<dyn EndIo> = DynArc::new(Completer(shared.clone()));
        Self {
            inner,
            shared,
            completer,
        }
    }

    /// The bitmaps (management: add, remove, clear, rotate, list).
    pub fn bitmaps(&self) -> &Bitmaps {
        &self.shared.bitmaps
    }

    /// The wrapped device.
    pub fn inner(&self) -> &DynArc<dyn Device> {
        &self.inner
    }

    /// Marks a changing bio and parks its completion in a slot; `None` when it was ended
    /// here with an error (its bits could not be persisted).
    fn prepare(&self, mut bio: Bio, end: &DynArc<dyn EndIo>) -> Option<Bio> {
        let b = &self.shared.bitmaps;
        let (token, res) = b.start_write(bio.offset(), u64::from(bio.len));
        if let Err(e) = res {
            b.end_write(token);
            end.end_io(bio, Err(e));
            return None;
        }
        let p = Pending {
            end: end.clone(),
            cookie: bio.cookie,
            token,
        };
        let table = blkq_sync::thread_slot() % TABLES;
        let mut t = self.shared.tables[table].lock();
        let i = match t.free.pop() {
            Some(i) => {
                t.slots[i as usize] = Some(p);
                i
            }
            None => {
                t.slots.push(Some(p));
                (t.slots.len() - 1) as u32
            }
        };
        bio.cookie = ((table as u64) << 32) | u64::from(i);
        Some(bio)
    }
}

/// The tracker changes what marks its bitmaps (bios that change data, writes received into
/// their home) and adds its bitmaps; everything else is the inner device's ([`Filter`]'s
/// defaults: limits, extents, zero-copy reads, counters).
impl Filter for Tracked {
    fn lower(&self) -> &dyn Device {
        &*self.inner
    }

    fn submit(&self, bio: Bio, end: &DynArc<dyn EndIo>) {
        if !changes(bio.op) {
            return self.inner.submit(bio, end);
        }
        if let Some(bio) = self.prepare(bio, end) {
            self.inner.submit(bio, &self.completer);
        }
    }

    fn submit_batch(&self, bios: &mut dyn Iterator<Item = Bio>, end: &DynArc<dyn EndIo>) {
        // Runs of reads and runs of writes go down as batches of their own (their completions
        // differ), in order.
        let mut bios = bios.peekable();
        while let Some(first) = bios.next() {
            if changes(first.op) {
                let mut run = std::iter::once(first)
                    .chain(std::iter::from_fn(|| bios.next_if(|b| changes(b.op))))
                    .filter_map(|b| self.prepare(b, end));
                self.inner.submit_batch(&mut run, &self.completer);
            } else {
                let mut run = std::iter::once(first)
                    .chain(std::iter::from_fn(|| bios.next_if(|b| !changes(b.op))));
                self.inner.submit_batch(&mut run, end);
            }
        }
    }

    /// A write received into its home is counted as a bio is: its granules made durable
    /// first, the gate held until the bytes are in place (a `rotate` waits for it).
    fn recv_home(
        &self,
        offset: u64,
        len: usize,
        src: &mut dyn blk::RecvSource,
    ) -> Result<(), Error> {
        let b = &self.shared.bitmaps;
        let (gen, res) = b.start_write(offset, len as u64);
        let res = res.and_then(|()| self.inner.recv_home(offset, len, src));
        b.end_write(gen);
        res
    }

    fn dirty_bitmaps(&self) -> Option<&dyn DirtyBitmaps> {
        Some(&self.shared.bitmaps)
    }
}

impl DirtyBitmaps for Bitmaps {
    fn names(&self) -> Vec<String> {
        self.list().into_iter().map(|i| i.name).collect()
    }

    fn dirty_extents_into(
        &self,
        name: &str,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<DirtyExtent>,
    ) -> Result<(), Error> {
        self.extents_into(name, offset, len, max, out)
            .map_err(|_| Error::NotFound {
                kind: "dirty bitmap",
                name: name.to_string(),
            })
    }
}
