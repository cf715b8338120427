//! Reply shaping: turns a finished [`InFlight`] entry into wire bytes in an [`Output`]: one
//! run of encoded headers, plus the read buffers themselves as data segments (never copied).
//! Simple replies, structured `OFFSET_DATA` / `OFFSET_HOLE` chunks for reads, block-status
//! chunks (32- or 64-bit descriptors), and errors.
//!
//! Threads: whoever holds the writer token (`writer.rs`) calls [`Output::shape`], under the
//! connection lock. This file calls nothing else of the connection: it is a leaf.

use blk::Buffer;
use tracing::warn;

use super::inflight::{InFlight, Part};
use super::output::{HeaderForm, Output, Segment};
use crate::server::handshake::BASE_ALLOCATION_ID;
use nbd_proto::proto::{CmdFlags, Command, Errno, ReplyFlags, TransmissionMode, NBD_STATE_DIRTY};
use nbd_proto::transmission::{Extent, ExtentExt, ReplyChunk, ReplyTo, SimpleReply};
use nbd_proto::Error;

impl Output {
    /// Shapes the reply to `entry` (whose slot is already in `shaped_slots`). A reply that
    /// cannot be encoded is a bug of ours, not the client's: it is answered `NBD_EIO` rather
    /// than with garbage.
    pub(super) fn shape(&mut self, entry: &mut InFlight, mode: TransmissionMode, min_block: u32) {
        let start = self.headers.len();
        let (segments, buffers) = (self.segments.len(), self.buffers.len());
        if let Err(e) = self.encode(entry, mode, min_block) {
            warn!("encoding the reply to cookie {:#x}: {e}", entry.cookie);
            self.headers.truncate(start);
            self.segments.truncate(segments);
            self.buffers.truncate(buffers);
            entry.error = Some(Errno::Io);
            // Shaped as a plain error, whatever the command was.
            entry.command = None;
            if self.encode(entry, mode, min_block).is_err() {
                self.headers.truncate(start);
                self.segments.truncate(segments);
            }
        }
    }

    /// Appends the headers written since `start` as a segment (merged with the previous one
    /// when adjacent).
    fn push_headers(&mut self, start: usize) {
        let end = self.headers.len();
        if end == start {
            return;
        }
        if let Some(Segment::Headers { end: e, .. }) = self.segments.last_mut() {
            if *e == start {
                *e = end;
                return;
            }
        }
        self.segments.push(Segment::Headers { start, end });
    }

    /// The part's data: its buffer, or (spliced) the device range, announced by the header
    /// that ends the headers written so far.
    fn push_part(&mut self, p: &mut Part, form: HeaderForm) {
        if p.spliced {
            self.segments.push(Segment::Spliced {
                offset: p.offset,
                len: p.len as usize,
                hdr_end: self.headers.len(),
                form,
            });
        } else if let Some(b) = p.buf.take() {
            self.push_data(b, p.len as usize);
        }
    }

    fn push_data(&mut self, b: Buffer, len: usize) {
        self.segments.push(Segment::Data {
            index: self.buffers.len(),
            len,
        });
        self.buffers.push(b);
    }

    fn encode(
        &mut self,
        entry: &mut InFlight,
        mode: TransmissionMode,
        min_block: u32,
    ) -> Result<(), Error> {
        let to = ReplyTo {
            cookie: entry.cookie,
            offset: entry.offset,
        };
        if entry.is_read() && entry.error.is_none() {
            // Every data part must have come back with its buffer.
            let complete = entry.parts.iter().all(|p| {
                p.hole || p.spliced || p.buf.as_ref().is_some_and(|b| b.len() as u64 >= p.len)
            });
            if !complete {
                entry.error = Some(Errno::Io);
            }
        }
        if let Some(error) = entry.error {
            return self.encode_error(entry, error, mode, to);
        }
        match entry.command {
            Some(Command::Read) => self.encode_read(entry, mode, to),
            Some(Command::BlockStatus) => self.encode_block_status(entry, mode, to, min_block),
            _ => {
                let start = self.headers.len();
                if mode == TransmissionMode::Extended {
                    ReplyChunk::None.encode(mode, to, ReplyFlags::DONE, &mut self.headers)?;
                } else {
                    SimpleReply {
                        cookie: entry.cookie,
                        error: 0,
                    }
                    .encode(&mut self.headers);
                }
                self.push_headers(start);
                Ok(())
            }
        }
    }

    /// An error reply: simple where the mode allows it (structured replies keep simple error
    /// replies for everything but reads), else an error chunk.
    fn encode_error(
        &mut self,
        entry: &InFlight,
        error: Errno,
        mode: TransmissionMode,
        to: ReplyTo,
    ) -> Result<(), Error> {
        let start = self.headers.len();
        let simple = match mode {
            TransmissionMode::Simple => true,
            TransmissionMode::Structured => !entry.is_read(),
            TransmissionMode::Extended => false,
        };
        if simple {
            SimpleReply {
                cookie: entry.cookie,
                error: error.as_u32(),
            }
            .encode(&mut self.headers);
        } else {
            let chunk = ReplyChunk::Error {
                error: error.as_u32(),
                message: "",
            };
            chunk.encode(mode, to, ReplyFlags::DONE, &mut self.headers)?;
        }
        self.push_headers(start);
        Ok(())
    }

    /// A read: one simple reply followed by the data, or (structured) one `OFFSET_DATA` chunk
    /// per run of data parts (one segment per buffer) and one `OFFSET_HOLE` per hole.
    fn encode_read(
        &mut self,
        entry: &mut InFlight,
        mode: TransmissionMode,
        to: ReplyTo,
    ) -> Result<(), Error> {
        let start = self.headers.len();
        if mode == TransmissionMode::Simple {
            SimpleReply {
                cookie: entry.cookie,
                error: 0,
            }
            .encode(&mut self.headers);
            self.push_headers(start);
            for p in &mut entry.parts {
                self.push_part(p, HeaderForm::Simple);
            }
            return Ok(());
        }
        let n = entry.parts.len();
        if n == 0 {
            ReplyChunk::None.encode(mode, to, ReplyFlags::DONE, &mut self.headers)?;
            self.push_headers(start);
            return Ok(());
        }
        let mut i = 0;
        while i < n {
            let chunk_start = self.headers.len();
            if entry.parts[i].hole {
                let p = &entry.parts[i];
                let done = if i + 1 == n {
                    ReplyFlags::DONE
                } else {
                    ReplyFlags::empty()
                };
                let size = u32::try_from(p.len).map_err(|_| Error::ValueTooLarge {
                    field: "hole size",
                    value: p.len,
                    max: u64::from(u32::MAX),
                })?;
                let chunk = ReplyChunk::OffsetHole {
                    offset: p.offset,
                    size,
                };
                chunk.encode(mode, to, done, &mut self.headers)?;
                self.push_headers(chunk_start);
                i += 1;
                continue;
            }
            // A run of data parts is one OFFSET_DATA chunk with one segment per buffer.
            let mut j = i;
            let mut total = 0u64;
            while j < n && !entry.parts[j].hole {
                total += entry.parts[j].len;
                j += 1;
            }
            let done = if j == n {
                ReplyFlags::DONE
            } else {
                ReplyFlags::empty()
            };
            let chunk = ReplyChunk::OffsetData {
                offset: entry.parts[i].offset,
                data_len: total,
            };
            chunk.encode(mode, to, done, &mut self.headers)?;
            self.push_headers(chunk_start);
            let form = HeaderForm::Chunk {
                extended: mode == TransmissionMode::Extended,
            };
            for p in &mut entry.parts[i..j] {
                self.push_part(p, form);
            }
            i = j;
        }
        Ok(())
    }

    /// Block status: one chunk per context answered (`entry.contexts`, in order), the last
    /// with `DONE`; 64-bit descriptors with extended headers, else 32-bit ones (a longer
    /// extent is cut to a multiple of the block size and ends that context's list, which must
    /// stay contiguous from the request's offset). `REQ_ONE`: one extent per context.
    fn encode_block_status(
        &mut self,
        entry: &InFlight,
        mode: TransmissionMode,
        to: ReplyTo,
        min_block: u32,
    ) -> Result<(), Error> {
        let start = self.headers.len();
        let mut at = 0usize;
        for (i, &(context_id, count)) in entry.contexts.iter().enumerate() {
            let end = at + count as usize;
            let extents = entry.extents.get(at..end).unwrap_or_default();
            at = end;
            let done = if i + 1 == entry.contexts.len() {
                ReplyFlags::DONE
            } else {
                ReplyFlags::empty()
            };
            self.encode_context(entry, context_id, extents, mode, to, done, min_block)?;
        }
        if entry.contexts.is_empty() {
            // Nothing was answered (cannot happen for a validated request): an empty
            // success rather than a reply the client could not match.
            ReplyChunk::None.encode(mode, to, ReplyFlags::DONE, &mut self.headers)?;
        }
        self.push_headers(start);
        Ok(())
    }

    /// One context's block-status chunk. An empty map (a device or bitmap that answered
    /// nothing) is sent as one extent over the request with the state that promises least:
    /// allocated (0) for `base:allocation`, dirty for a bitmap (which may say more than was
    /// written, never less).
    #[allow(clippy::too_many_arguments)]
    fn encode_context(
        &mut self,
        entry: &InFlight,
        context_id: u32,
        extents: &[ExtentExt],
        mode: TransmissionMode,
        to: ReplyTo,
        done: ReplyFlags,
        min_block: u32,
    ) -> Result<(), Error> {
        let req_one = entry.flags.contains(CmdFlags::REQ_ONE);
        let present = extents.iter().filter(|e| e.length > 0);
        let unknown = if context_id == BASE_ALLOCATION_ID {
            0
        } else {
            NBD_STATE_DIRTY
        };
        // Reserve what the entry reserved (the request's bound, `reader.rs`), not what this
        // map needs: the reused vectors then stop growing once warm.
        if mode == TransmissionMode::Extended {
            self.extents64.clear();
            self.extents64.reserve(entry.extents.capacity());
            for e in present {
                self.extents64.push(*e);
                if req_one {
                    break;
                }
            }
            if self.extents64.is_empty() {
                self.extents64.push(ExtentExt {
                    length: entry.length,
                    flags: u64::from(unknown),
                });
            }
            let chunk = ReplyChunk::BlockStatusExt {
                context_id,
                extents: &self.extents64,
            };
            chunk.encode(mode, to, done, &mut self.headers)?;
        } else {
            let cap = u64::from(u32::MAX / min_block * min_block);
            self.extents32.clear();
            self.extents32.reserve(entry.extents.capacity());
            for e in present {
                let len = e.length.min(cap);
                self.extents32.push(Extent {
                    length: len as u32,
                    // The flags of `base:allocation` and of dirty bitmaps are 32-bit values.
                    flags: e.flags as u32,
                });
                if req_one || len < e.length {
                    break;
                }
            }
            if self.extents32.is_empty() {
                self.extents32.push(Extent {
                    length: entry.length.min(cap) as u32,
                    flags: unknown,
                });
            }
            let chunk = ReplyChunk::BlockStatus {
                context_id,
                extents: &self.extents32,
            };
            chunk.encode(mode, to, done, &mut self.headers)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nbd_proto::proto::{NBD_SIMPLE_REPLY_MAGIC, NBD_STATE_HOLE};

    fn entry(command: Option<Command>, length: u64) -> InFlight {
        let mut e = InFlight::default();
        e.begin(0xc0ffee, 0, length, command, CmdFlags::empty());
        e
    }

    #[test]
    fn structured_errors_are_simple_except_for_reads() {
        let mut out = Output::default();
        let mut write = entry(Some(Command::Write), 512);
        write.fail(Errno::NoSpc);
        out.shape(&mut write, TransmissionMode::Structured, 512);
        assert_eq!(out.headers.len(), 16);
        assert_eq!(out.headers[..4], NBD_SIMPLE_REPLY_MAGIC.to_be_bytes());
        assert_eq!(out.headers[4..8], Errno::NoSpc.as_u32().to_be_bytes());
        let before = out.headers.len();
        let mut read = entry(Some(Command::Read), 512);
        read.fail(Errno::Io);
        out.shape(&mut read, TransmissionMode::Structured, 512);
        // An error chunk: 20-byte chunk header, 4-byte error, 2-byte message length.
        assert_eq!(out.headers.len() - before, 26);
        // Adjacent headers merge into one segment.
        assert_eq!(out.segments.len(), 1);
    }

    #[test]
    fn read_parts_become_data_segments_and_holes() {
        let mut out = Output::default();
        let mut read = entry(Some(Command::Read), 3 * 512);
        read.parts.push(Part {
            offset: 0,
            len: 512,
            hole: false,
            buf: Some(Buffer::new(512)),
            spliced: false,
        });
        read.parts.push(Part {
            offset: 512,
            len: 1024,
            hole: true,
            buf: None,
            spliced: false,
        });
        out.shape(&mut read, TransmissionMode::Structured, 512);
        assert!(read.error.is_none());
        assert_eq!(out.buffers.len(), 1);
        assert!(matches!(
            out.segments[..],
            [
                Segment::Headers { .. },
                Segment::Data { index: 0, len: 512 },
                Segment::Headers { .. }
            ]
        ));
    }

    #[test]
    fn a_read_missing_its_buffer_is_answered_eio() {
        let mut out = Output::default();
        let mut read = entry(Some(Command::Read), 512);
        read.parts.push(Part {
            offset: 0,
            len: 512,
            hole: false,
            buf: None,
            spliced: false,
        });
        out.shape(&mut read, TransmissionMode::Simple, 512);
        assert_eq!(read.error, Some(Errno::Io));
        assert_eq!(out.headers[4..8], Errno::Io.as_u32().to_be_bytes());
    }

    #[test]
    fn compact_block_status_cuts_long_extents() {
        let mut out = Output::default();
        let mut status = entry(Some(Command::BlockStatus), 8 << 30);
        status.extents.push(ExtentExt {
            length: 8 << 30,
            flags: u64::from(NBD_STATE_HOLE),
        });
        status.contexts.push((BASE_ALLOCATION_ID, 1));
        out.shape(&mut status, TransmissionMode::Structured, 4096);
        assert_eq!(out.extents32.len(), 1);
        assert_eq!(
            u64::from(out.extents32[0].length),
            u64::from(u32::MAX / 4096 * 4096)
        );
        assert_eq!(out.extents32[0].flags, NBD_STATE_HOLE);
    }
}
