//! Which ranges of the remote export are allocated: `NBD_CMD_BLOCK_STATUS` on the
//! `base:allocation` context, when the server offered it at the handshake; every range is
//! allocated otherwise.
//!
//! A query is an ordinary request in the slot table (sent, timed, re-sent after a
//! reconnection like any other) whose bio's buffer receives the reply's raw descriptors (8
//! bytes each: length, flags), as many as fit, followed by a zero descriptor as the end mark.
//! `NBD_STATE_HOLE` and `NBD_STATE_ZERO` together map to an unallocated extent (it reads as
//! zeros, which is what [`Extent::allocated`]` == false` promises); anything else, a hole
//! whose contents the server does not vouch for included, is allocated.

use blk::{Bio, Buffer, Device, EndIo, Error, Extent, Limits, Op, PendingBio};
use blkq_sync::DynArc;

use super::submit::Req;
use super::table::LinkState;
use nbd_proto::proto::{CmdFlags, Command, NBD_STATE_HOLE, NBD_STATE_ZERO};

/// Descriptors asked for per query at most (8 bytes each).
const MAX_DESCRIPTORS: usize = 1024;

/// One block-status query as a [`Device`], so that the common [`PendingBio`] can wait for it.
struct Query<'a> {
    sh: &'a LinkState,
    offset: u64,
    len: u64,
}

impl Device for Query<'_> {
    fn submit(&self, bio: Bio, end: &DynArc<dyn EndIo>) {
        let req = Req {
            cmd: Command::BlockStatus,
            flags: CmdFlags::empty(),
            fua_flush: false,
            offset: self.offset,
            len: self.len,
        };
        self.sh.submit(bio, end, req);
    }

    fn limits(&self) -> Limits {
        self.sh.limits
    }

    /// Never asked: a query only carries one request.
    fn extents_into(&self, _: u64, _: u64, _: usize, _: &mut Vec<Extent>) -> Result<(), Error> {
        Err(Error::NotSupported("extents of a block-status query"))
    }
}

impl LinkState {
    /// Whether the current connection has block status.
    fn has_block_status(&self) -> bool {
        self.table.lock().meta_id.is_some()
    }

    /// [`Device::extents_into`] for the remote export (see the module documentation).
    pub(super) fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), Error> {
        out.clear();
        let cap = self.limits.capacity;
        let end = match offset.checked_add(len) {
            Some(e) if e <= cap => e,
            _ => {
                return Err(Error::OutOfRange {
                    offset,
                    len,
                    capacity: cap,
                })
            }
        };
        if len == 0 || max == 0 {
            return Ok(());
        }
        if !self.has_block_status() {
            out.push(Extent {
                offset,
                len,
                allocated: true,
            });
            return Ok(());
        }
        // The length field is 32 bits: ask for at most that, in whole blocks.
        let lbs = u64::from(self.limits.logical_block_size);
        let most = u64::from(u32::MAX) / lbs * lbs;
        let mut buf = Some(Buffer::new(8 * max.min(MAX_DESCRIPTORS)));
        let mut at = offset;
        while at < end && out.len() < max {
            let q = Query {
                sh: self,
                offset: at,
                len: (end - at).min(most),
            };
            let bio = Bio::with_buf(Op::Read, 0, buf.take().unwrap_or_else(|| Buffer::new(8)));
            let (bio, r) = PendingBio::submit(&q, bio).wait();
            if let Err(e) = r {
                if matches!(e, Error::NotSupported(_)) {
                    // The server no longer has it (a reconnection to another server).
                    out.push(Extent {
                        offset: at,
                        len: end - at,
                        allocated: true,
                    });
                    return Ok(());
                }
                return Err(e);
            }
            let b = bio.buf.unwrap_or_else(|| Buffer::new(8));
            let before = at;
            for d in b.as_slice().chunks_exact(8) {
                let n = u64::from(u32::from_be_bytes([d[0], d[1], d[2], d[3]]));
                let flags = u32::from_be_bytes([d[4], d[5], d[6], d[7]]);
                if n == 0 || at >= end {
                    break;
                }
                let n = n.min(end - at);
                let allocated =
                    flags & (NBD_STATE_HOLE | NBD_STATE_ZERO) != (NBD_STATE_HOLE | NBD_STATE_ZERO);
                let full = out.len() == max;
                match out.last_mut() {
                    Some(l) if l.allocated == allocated && l.offset + l.len == at => l.len += n,
                    _ if full => break,
                    _ => out.push(Extent {
                        offset: at,
                        len: n,
                        allocated,
                    }),
                }
                at += n;
            }
            if at == before {
                return Err(Error::Io(blk::error::with_context(
                    std::io::Error::from_raw_os_error(libc::EIO),
                    format!("{}: block status answered no extent", self.uri),
                )));
            }
            buf = Some(b);
        }
        Ok(())
    }
}
