//! The reader: `recv` into the receive buffer, decode every whole request in it, validate
//! each, *stage* it (bios, and an [`InFlight`] entry taken from the spares), then `commit`:
//! one lock to move the staged entries into free slots, one [`Device::submit_batch`] (one
//! plug) for all their bios, and a flush of whatever replies are ready.
//!
//! Threads: only the connection's own thread (the reader) runs this file. It blocks only in
//! `recv`, in the device's tag wait (backpressure from a full queue), or asleep on
//! `ConnState::reader_wake` when every slot (or the in-flight byte budget) is taken.

use std::io::{self, IoSliceMut, Read};
use std::time::Instant;

use blk::{Bio, BioFlags, Device, Op, SECTOR_SHIFT};

use super::block_status::nbd_extent;
use super::home::HomeFailure;
use super::inflight::{bio_cookie, InFlight, Part};
use super::parse_state::{ParseStop, PartialWrite};
use super::recv::{BIG_WRITE, RECV_AFTER_BIG_WRITE};
use super::splice::SPLICE_MIN_BYTES;
use super::Connection;
use crate::stream::is_timeout;
use nbd_proto::proto::{CmdFlags, Command, Errno, NBD_STATE_HOLE};
use nbd_proto::transmission::{decode_request, Request};
use nbd_proto::{Decoded, Error};

/// Extents asked of the device per structured read (more fragmented reads send the rest as
/// data).
const MAX_READ_EXTENTS: usize = 64;
/// Trim and write-zeroes are split into bios of at most this many bytes (`Bio::len` is 32
/// bits).
const MAX_RANGE_BIO: u64 = 1 << 30;

impl<'a> Connection<'a> {
    /// Reads more bytes into the receive buffer (blocking).
    pub(super) fn recv(&mut self) -> Result<(), String> {
        if self.recv_pos > 0 {
            self.recv_buf.copy_within(self.recv_pos..self.recv_len, 0);
            self.recv_len -= self.recv_pos;
            self.recv_pos = 0;
        }
        if self.recv_len == self.recv_buf.len() {
            return Err("receive buffer full without a whole request".into());
        }
        let mid_request = self.recv_len > 0 || self.discard_left > 0;
        if !mid_request && self.stream.partial_record_since().is_none() {
            // At a request boundary: whatever comes next begins a new request.
            self.mid.end();
        }
        loop {
            let end = self.recv_end();
            match self.stream.read(&mut self.recv_buf[self.recv_len..end]) {
                Err(e) if is_timeout(&e) => {
                    if let Some(reason) = self.recv_timed_out(mid_request) {
                        return Err(reason);
                    }
                }
                Ok(0) => {
                    return Err(if self.server.stopping() {
                        "server shutting down".into()
                    } else if self.export.is_removed() {
                        "export removed".into()
                    } else if self.recv_len > 0 {
                        "client closed the connection in the middle of a request".into()
                    } else {
                        "client closed the connection".into()
                    });
                }
                Ok(n) => {
                    self.recv_len += n;
                    return match self.received(n, Instant::now()) {
                        Some(reason) => Err(reason),
                        None => Ok(()),
                    };
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(format!("read error: {e}")),
            }
        }
    }

    /// Where a read into `recv_buf` may stop: the whole buffer, or [`RECV_AFTER_BIG_WRITE`]
    /// bytes past what it holds while large writes arrive (see [`BIG_WRITE`]).
    fn recv_end(&self) -> usize {
        let header = self.mode.request_header_len();
        if self.home_writes && self.discard_left == 0 && self.recv_len < header {
            // One header at a time: the payload behind it stays in the socket for the device
            // to take (`home.rs`). Not while a refused payload is skipped: that goes by the
            // buffer.
            header
        } else if self.big_writes {
            (self.recv_len + RECV_AFTER_BIG_WRITE).min(self.recv_buf.len())
        } else {
            self.recv_buf.len()
        }
    }

    /// Decodes and stages requests from the buffer, up to the free slots and budget given.
    pub(super) fn parse(&mut self, free_slots: usize, budget_left: u64) -> ParseStop {
        // A removal of the export drains the connection as a shutdown does.
        let stopping = self.server.stopping() || self.export.is_removed();
        loop {
            if self.staged.len() >= free_slots || self.staged_bytes >= budget_left {
                return ParseStop::Full;
            }
            if self.discard_left > 0 {
                let buffered = self.recv_len - self.recv_pos;
                let n = buffered.min(self.discard_left.min(usize::MAX as u64) as usize);
                self.recv_pos += n;
                self.discard_left -= n as u64;
                if self.discard_left > 0 {
                    return ParseStop::NeedMore;
                }
            }
            if let Some(entry) = self.discarding.take() {
                // The refused request's payload is all read: its reply may go now.
                self.staged.push(entry);
                continue;
            }
            let buffered = &self.recv_buf[self.recv_pos..self.recv_len];
            match decode_request(buffered, self.mode) {
                Ok(Decoded::Incomplete(_)) => return ParseStop::NeedMore,
                Ok(Decoded::Complete { value, consumed }) => {
                    // The budget is taken before the request is consumed: if it does not
                    // fit, the request stays in the buffer until it does.
                    let need = self.budget_need(&value, stopping);
                    if need > 0 && !self.server.budget.try_take(need) {
                        return ParseStop::NoBudget(need);
                    }
                    self.recv_pos += consumed;
                    if let Some(stop) = self.stage(value, stopping) {
                        return stop;
                    }
                }
                Err(Error::UnknownCommand(u)) => {
                    self.recv_pos += u.header_len;
                    self.stats.requests += 1;
                    self.stats.refused += 1;
                    let mut entry = self.spare_entry();
                    entry.begin(u.cookie, u.offset, u.length, None, u.flags);
                    entry.fail(Errno::Inval);
                    if let Some(stop) = self.refuse(entry, u.payload_len) {
                        return stop;
                    }
                }
                Err(e) => return ParseStop::Fatal(format!("bad request: {e}")),
            }
        }
    }

    /// Bytes of the global memory budget a request takes, if it will be staged (not
    /// refused): its payload for a read or write, the extents it may answer for a block
    /// status ([`Self::status_bytes`]). Must agree with `budget_bytes` set in `stage_read`,
    /// `stage_write` and `stage_block_status`.
    fn budget_need(&self, r: &Request, stopping: bool) -> u64 {
        if stopping
            || !matches!(
                r.kind,
                Command::Read | Command::Write | Command::BlockStatus
            )
        {
            return 0;
        }
        if self.validate(r).is_some() {
            return 0;
        }
        match r.kind {
            Command::BlockStatus => self.status_bytes(r),
            _ => r.length,
        }
    }

    /// An empty entry to stage into (recycled from a previous commit when there is one).
    fn spare_entry(&mut self) -> InFlight {
        self.spare_entries.pop().unwrap_or_default()
    }

    /// Stages a refused request's (error) reply, after arranging for its payload to be
    /// skipped. The reply waits until the payload has been read: a client still sending a
    /// request cannot match a reply to it yet (libnbd fails with "no matching cookie found for
    /// server reply"). A payload longer than `Tuning::discard_limit` closes the connection
    /// instead (after the reply).
    fn refuse(&mut self, entry: InFlight, payload: u64) -> Option<ParseStop> {
        let limit = self.server.tuning.discard_limit;
        if payload > limit {
            self.staged.push(entry);
            return Some(ParseStop::Fatal(format!(
                "refused a request with a {payload}-byte payload (more than the {limit} bytes \
                 the server discards)"
            )));
        }
        if payload == 0 {
            self.staged.push(entry);
        } else {
            self.discard_left = payload;
            self.discarding = Some(entry);
        }
        None
    }

    /// The NBD error a request gets before it reaches the device, if any.
    fn validate(&self, r: &Request) -> Option<Errno> {
        let mut allowed = CmdFlags::FUA;
        match r.kind {
            Command::Read if self.mode.chunked_replies() => allowed |= CmdFlags::DF,
            Command::Write if self.mode.extended_headers() => allowed |= CmdFlags::PAYLOAD_LEN,
            Command::WriteZeroes => allowed |= CmdFlags::NO_HOLE | CmdFlags::FAST_ZERO,
            Command::BlockStatus => allowed |= CmdFlags::REQ_ONE,
            _ => {}
        }
        if !r.flags.difference(allowed).is_empty() {
            return Some(Errno::Inval);
        }
        let writes = matches!(
            r.kind,
            Command::Write | Command::Trim | Command::WriteZeroes
        );
        if writes && self.export.export.read_only {
            return Some(Errno::Perm);
        }
        match r.kind {
            Command::Flush => return None,
            Command::Read
            | Command::Write
            | Command::Trim
            | Command::WriteZeroes
            | Command::Cache
            | Command::BlockStatus => {}
            _ => return Some(Errno::Inval),
        }
        if r.kind == Command::BlockStatus && !self.contexts.any() {
            return Some(Errno::Inval);
        }
        let (off, len) = (r.offset, r.length);
        if len == 0 || off % self.min_block != 0 || len % self.min_block != 0 {
            return Some(Errno::Inval);
        }
        if off
            .checked_add(len)
            .is_none_or(|end| end > self.export.size)
        {
            return Some(match r.kind {
                Command::Write | Command::WriteZeroes => Errno::NoSpc,
                _ => Errno::Inval,
            });
        }
        if len > self.max_block {
            match r.kind {
                Command::Read if r.flags.contains(CmdFlags::DF) => return Some(Errno::Overflow),
                Command::Read | Command::Write => return Some(Errno::Inval),
                _ => {}
            }
        }
        None
    }

    /// Stages one decoded request; `Some` stops the parse pass.
    fn stage(&mut self, r: Request, stopping: bool) -> Option<ParseStop> {
        self.stats.requests += 1;
        if r.kind == Command::Disc {
            return Some(ParseStop::Disconnect);
        }
        if r.kind == Command::Write
            && self.mode.extended_headers()
            && r.payload_len(self.mode) > self.max_block
        {
            // The extended-headers extension: a server SHOULD disconnect rather than read a
            // payload over its advertised maximum.
            return Some(ParseStop::Fatal(format!(
                "a WRITE with a {}-byte payload, over the {}-byte maximum block size",
                r.payload_len(self.mode),
                self.max_block
            )));
        }
        let mut entry = self.spare_entry();
        entry.start(&r);
        let refused = if stopping {
            Some(Errno::Shutdown)
        } else {
            self.validate(&r)
        };
        if let Some(error) = refused {
            self.stats.refused += 1;
            entry.fail(error);
            return self.refuse(entry, r.payload_len(self.mode));
        }
        match r.kind {
            Command::Read => self.stats.bytes_read += r.length,
            Command::Write => self.stats.bytes_written += r.length,
            _ => {}
        }
        if r.kind != Command::Write {
            self.home_writes = false;
        }
        match r.kind {
            Command::Read => self.stage_read(&r, entry),
            Command::Write => return self.stage_write(&r, entry),
            Command::Flush => {
                self.bios.push(Bio::new(Op::Flush, 0, 0));
                entry.bios_pending = 1;
                self.staged.push(entry);
            }
            Command::Trim => self.stage_range(&r, Op::Discard, entry),
            Command::WriteZeroes => self.stage_range(&r, Op::WriteZeroes, entry),
            Command::BlockStatus => {
                self.stage_block_status(&r, &mut entry);
                self.staged.push(entry);
            }
            // Cache: nothing to prefetch in a block layer without a page cache.
            _ => self.staged.push(entry),
        }
        None
    }

    /// The most extents a map of `len` bytes can hold at the export's block size, capped at
    /// `max`: what the extent vectors reserve before a map is asked for, so that their
    /// capacity follows the shape of the requests and not the device's fragmentation at the
    /// time (which could make them grow again long after warm-up).
    pub(super) fn extent_bound(&self, len: u64, max: usize) -> usize {
        (len / self.min_block.max(1)).min(max as u64) as usize
    }

    fn bio_flags(r: &Request) -> BioFlags {
        let mut f = BioFlags::NONE;
        if r.flags.contains(CmdFlags::FUA) {
            f = f | BioFlags::FUA;
        }
        if r.flags.contains(CmdFlags::NO_HOLE) {
            f = f | BioFlags::NO_HOLE;
        }
        if r.flags.contains(CmdFlags::FAST_ZERO) {
            f = f | BioFlags::FAST_ZERO;
        }
        f
    }

    /// Trim or write-zeroes: bios of at most [`MAX_RANGE_BIO`] bytes.
    fn stage_range(&mut self, r: &Request, op: Op, mut entry: InFlight) {
        let flags = Self::bio_flags(r);
        let piece = MAX_RANGE_BIO / self.min_block * self.min_block;
        let (mut at, end) = (r.offset, r.offset + r.length);
        while at < end {
            let len = (end - at).min(piece);
            let mut b = Bio::new(op, at >> SECTOR_SHIFT, len as u32);
            b.flags = flags;
            self.bios.push(b);
            entry.bios_pending += 1;
            at += len;
        }
        self.staged.push(entry);
    }

    /// Data parts of a read from `at`, one bio (and buffer) of at most `max_bio_bytes` each;
    /// or, for a read the writer splices (`splice.rs`), one part with neither.
    fn add_read_data(&mut self, entry: &mut InFlight, mut at: u64, len: u64, spliced: bool) {
        if spliced {
            entry.parts.push(Part {
                offset: at,
                len,
                hole: false,
                buf: None,
                spliced: true,
            });
            return;
        }
        let end = at + len;
        while at < end {
            let n = (end - at).min(self.max_bio_bytes as u64);
            let buf = self.buffers.get(n as usize);
            let mut b = Bio::with_buf(Op::Read, at >> SECTOR_SHIFT, buf);
            // The slot is added when the entry gets one (`commit`).
            b.cookie = bio_cookie(0, entry.parts.len() as u32);
            self.bios.push(b);
            entry.bios_pending += 1;
            entry.parts.push(Part {
                offset: at,
                len: n,
                hole: false,
                buf: None,
                spliced: false,
            });
            at += n;
        }
    }

    /// A read: data parts, and (structured replies, `DF` not set, a device whose allocation
    /// map costs no I/O) holes where the device says nothing is allocated.
    fn stage_read(&mut self, r: &Request, mut entry: InFlight) {
        let end = r.offset + r.length;
        // Asked per read: a device may turn zero-copy reads off at run time.
        let caps = self.device().caps();
        // A device whose allocation map costs I/O (a remote export, a mirror with such a leg)
        // would answer with a round trip to its server, synchronous in this reader: every read
        // would wait for it, and the pipeline behind it. Its holes reach the client as zeros.
        let sparse =
            self.mode.chunked_replies() && !r.flags.contains(CmdFlags::DF) && !caps.slow_extents;
        // Large reads on a plaintext connection to a device that can: spliced by the writer,
        // no bio, no buffer (`splice.rs`), when the rule says this client takes them faster
        // that way (`splice_rule.rs`).
        let spliced = r.length >= SPLICE_MIN_BYTES
            && caps.splice
            && self.core.splice_dev.is_some()
            && self.splice_chooser.choose(
                r.length,
                Instant::now(),
                self.in_flight + self.staged.len(),
            );
        let mut at = r.offset;
        if sparse {
            // The connection's reused vector, taken for the loop (which needs `&mut self`)
            // and put back: no allocation once it has grown.
            let mut extents = std::mem::take(&mut self.extents_buf);
            extents.clear();
            extents.reserve(self.extent_bound(r.length, MAX_READ_EXTENTS));
            let found =
                self.device()
                    .extents_into(r.offset, r.length, MAX_READ_EXTENTS, &mut extents);
            if found.is_ok() {
                for e in &extents {
                    if e.offset != at || e.len == 0 {
                        break;
                    }
                    let e_end = e.offset.saturating_add(e.len).min(end);
                    let hole = nbd_extent(e).flags & u64::from(NBD_STATE_HOLE) != 0;
                    if !hole || e_end - at < self.min_block {
                        self.add_read_data(&mut entry, at, e_end - at, spliced);
                    } else {
                        entry.parts.push(Part {
                            offset: at,
                            len: e_end - at,
                            hole: true,
                            buf: None,
                            spliced: false,
                        });
                    }
                    at = e_end;
                    if at >= end {
                        break;
                    }
                }
            }
            self.extents_buf = extents;
        }
        if at < end {
            self.add_read_data(&mut entry, at, end - at, spliced);
        }
        entry.budget_bytes = r.length;
        self.staged_bytes += r.length;
        self.staged.push(entry);
    }

    /// A write: its payload goes into pooled buffers, from the receive buffer and then, if it
    /// continues past it, straight from the socket ([`Self::fill_partial_write`]).
    fn stage_write(&mut self, r: &Request, mut entry: InFlight) -> Option<ParseStop> {
        self.home_writes = self.home_capable(r);
        if self.home_writes && self.recv_pos == self.recv_len {
            // Received straight into the device (`home.rs`): no bio, no buffer.
            self.big_writes = true;
            entry.bios_pending = 0;
            entry.budget_bytes = r.length;
            self.staged_bytes += r.length;
            self.partial_write = Some(PartialWrite {
                entry,
                bio: 0,
                filled: 0,
                remaining: r.length,
                home: Some(r.offset),
            });
            return Some(ParseStop::PartialWrite);
        }
        let flags = Self::bio_flags(r);
        let (mut at, end) = (r.offset, r.offset + r.length);
        self.write_bios.clear();
        while at < end {
            let n = (end - at).min(self.max_bio_bytes as u64);
            let buf = self.buffers.get(n as usize);
            let mut b = Bio::with_buf(Op::Write, at >> SECTOR_SHIFT, buf);
            b.flags = flags;
            self.write_bios.push(b);
            at += n;
        }
        entry.bios_pending = self.write_bios.len() as u32;
        self.big_writes = r.length >= BIG_WRITE;
        entry.budget_bytes = r.length;
        self.staged_bytes += r.length;
        let mut remaining = r.length;
        let (mut bio, mut filled) = (0usize, 0usize);
        while remaining > 0 && self.recv_pos < self.recv_len {
            let Some(buf) = self.write_bios.get_mut(bio).and_then(|b| b.buf.as_mut()) else {
                break;
            };
            let dst = &mut buf.as_mut_slice()[filled..];
            let n = dst.len().min(self.recv_len - self.recv_pos);
            dst[..n].copy_from_slice(&self.recv_buf[self.recv_pos..self.recv_pos + n]);
            self.recv_pos += n;
            filled += n;
            remaining -= n as u64;
            if n == dst.len() {
                bio += 1;
                filled = 0;
            }
        }
        if remaining == 0 {
            self.bios.append(&mut self.write_bios);
            self.staged.push(entry);
            return None;
        }
        self.partial_write = Some(PartialWrite {
            entry,
            bio,
            filled,
            remaining,
            home: None,
        });
        Some(ParseStop::PartialWrite)
    }

    /// Reads the rest of a write's payload straight into its buffers; the bytes that follow
    /// it (the next requests) land in the receive buffer with the same `readv`. On an error the
    /// write stays in `partial_write`, for teardown to drop (and give its budget back).
    pub(super) fn fill_partial_write(&mut self) -> Result<(), String> {
        let Some(mut p) = self.partial_write.take() else {
            return Ok(());
        };
        let res = match p.home {
            Some(offset) => match self.fill_home(offset, p.remaining) {
                Ok(()) => Ok(()),
                Err(HomeFailure::Close(reason)) => Err(reason),
                Err(HomeFailure::Device { error, left }) => {
                    // Answered with the device's error once the rest of the payload is read
                    // off the socket, as a refused write's (`parse`).
                    tracing::warn!("a write received into the device failed: {error}");
                    p.entry.fail(Errno::from_errno(error.errno()));
                    self.discard_left = left;
                    self.discarding = Some(p.entry);
                    return Ok(());
                }
            },
            None => self.fill(&mut p),
        };
        match res {
            Ok(()) => {
                if p.home.is_none() {
                    self.bios.append(&mut self.write_bios);
                }
                self.staged.push(p.entry);
            }
            Err(_) => self.partial_write = Some(p),
        }
        res
    }

    fn fill(&mut self, p: &mut PartialWrite) -> Result<(), String> {
        // Everything buffered was consumed into the payload.
        self.recv_pos = 0;
        self.recv_len = 0;
        let nbios = self.write_bios.len();
        while p.remaining > 0 {
            let end = self.recv_end();
            let Some(buf) = self.write_bios.get_mut(p.bio).and_then(|b| b.buf.as_mut()) else {
                return Err("internal error: write buffer missing".into());
            };
            let full = buf.len();
            let dst = &mut buf.as_mut_slice()[p.filled..];
            let dst_len = dst.len();
            let last = p.bio + 1 == nbios;
            let res = if last {
                let mut iov = [
                    IoSliceMut::new(dst),
                    IoSliceMut::new(&mut self.recv_buf[self.recv_len..end]),
                ];
                self.stream.read_vectored(&mut iov)
            } else {
                self.stream.read(dst)
            };
            let n = match res {
                Ok(0) => return Err("client closed the connection in the middle of a write".into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if is_timeout(&e) => match self.recv_timed_out(true) {
                    Some(reason) => return Err(reason),
                    None => continue,
                },
                Err(e) => return Err(format!("read error: {e}")),
            };
            let into_payload = n.min(dst_len);
            if let Some(reason) = self.received(n, Instant::now()) {
                return Err(reason);
            }
            p.remaining -= into_payload as u64;
            p.filled += into_payload;
            self.recv_len += n - into_payload;
            if p.filled == full {
                p.bio += 1;
                p.filled = 0;
            }
        }
        Ok(())
    }

    /// Moves the staged entries into free slots (one lock), then submits their bios as one
    /// batch and flushes ready replies.
    pub(super) fn commit(&mut self) {
        if self.staged.is_empty() {
            self.core.flush();
            return;
        }
        let (mut committed, mut bios_done) = (0usize, 0usize);
        // Server-side disk counters (a device without its own): one coarse clock read for
        // the whole batch.
        let disk = self
            .core
            .disk
            .as_deref()
            .map(|d| (d, blk::stats::batch_ns()));
        {
            let mut guard = self.core.locked.lock();
            let locked = &mut *guard;
            for staged in &mut self.staged {
                let Some(slot) = locked.free_slots.pop() else {
                    break;
                };
                let Some(entry) = locked.table.get_mut(slot as usize) else {
                    break;
                };
                // The emptied entry that was in the slot comes back as a spare (below).
                std::mem::swap(entry, staged);
                let nbios = entry.bios_pending as usize;
                for b in &mut self.bios[bios_done..bios_done + nbios] {
                    b.cookie |= bio_cookie(slot, 0);
                }
                locked.bytes_in_flight += entry.budget_bytes;
                if let (Some((d, now)), Some(op), true) = (disk, entry.disk_op(), nbios > 0) {
                    entry.start_ns = now;
                    d.started(op.dir(), now);
                }
                if nbios == 0 {
                    locked.ready_slots.push(slot);
                }
                self.staged_bytes -= entry.budget_bytes;
                bios_done += nbios;
                committed += 1;
            }
        }
        self.spare_entries.extend(self.staged.drain(..committed));
        if bios_done > 0 {
            let device = self.device();
            device.submit_batch(&mut self.bios.drain(..bios_done), &self.end_io);
        }
        self.core.flush();
    }

    pub(super) fn device(&self) -> &'a dyn Device {
        self.export.export.device.as_ref()
    }
}
