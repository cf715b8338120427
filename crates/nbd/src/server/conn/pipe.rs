//! The connection's pipe for zero-copy reads (`splice.rs`): made at the first spliced read,
//! filled from the device, holding the bytes of one segment at a time.

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use blk::Device;

/// Pipe sizes asked for, in order: 2 MiB holds an unaligned 1 MiB read whole (257 pages);
/// an unprivileged process gets at most `fs.pipe-max-size` (1 MiB by default); failing both,
/// the pipe keeps its default (64 KiB) and replies go through it in more rounds.
const PIPE_BYTES: [usize; 2] = [2 << 20, 1 << 20];

/// The connection's pipe and what it holds (rule 1).
#[derive(Debug, Default)]
pub(super) struct SplicePipe {
    /// Read end, write end; made at the first spliced read.
    ends: Option<(OwnedFd, OwnedFd)>,
    /// The pipe's capacity, bytes.
    capacity: usize,
    /// Bytes in the pipe, all of segment `held_for`, from its first unsent byte on.
    pub(super) held: usize,
    pub(super) held_for: usize,
}

impl SplicePipe {
    /// The pipe, made on first use: (read end, write end).
    pub(super) fn ends(&mut self) -> io::Result<(&OwnedFd, &OwnedFd)> {
        if self.ends.is_none() {
            let (r, w, capacity) = crate::sys::pipe_sized(&PIPE_BYTES)?;
            self.capacity = capacity;
            self.ends = Some((r, w));
        }
        match &self.ends {
            Some((r, w)) => Ok((r, w)),
            None => Err(io::Error::other("no pipe")),
        }
    }

    /// After a reset of the output: a pipe still holding bytes is closed (a new one is made
    /// if needed), so that they can never lead another reply.
    pub(super) fn forget_held(&mut self) {
        if self.held > 0 {
            self.discard();
        }
        self.held_for = 0;
    }

    /// Closes the pipe with whatever it holds, counted or not; the next fill makes a new one.
    fn discard(&mut self) {
        *self = Self::default();
    }

    /// Moves more of segment `index` (`len` bytes of the device at `offset`, `sent` of them
    /// sent) into the pipe, as much as fits. Returns the bytes now held.
    pub(super) fn fill(
        &mut self,
        dev: &dyn Device,
        index: usize,
        offset: u64,
        len: usize,
        sent: usize,
    ) -> Result<usize, blk::Error> {
        self.ends().map_err(blk::Error::Io)?;
        if self.held_for != index {
            debug_assert_eq!(self.held, 0, "the pipe holds another segment's bytes");
            self.held_for = index;
            self.held = 0;
        }
        let unfilled = len - sent - self.held;
        let room = self.capacity.saturating_sub(self.held);
        if unfilled > 0 && room > 0 {
            let at = offset + (sent + self.held) as u64;
            let (_, w) = self.ends().map_err(blk::Error::Io)?;
            let n = match dev.splice_read(at, unfilled.min(room), w.as_fd()) {
                Ok(n) => n,
                Err(e) => {
                    // The device may have put part of the bytes in the pipe before it failed
                    // (`mem:` splices region by region): they are counted nowhere, and must
                    // never lead another reply. The pipe goes with them; the next spliced
                    // read makes a new one.
                    self.discard();
                    return Err(e);
                }
            };
            if n == 0 && self.held == 0 {
                return Err(blk::Error::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the device gave no bytes at {at} (is it shorter than it says?)"),
                )));
            }
            self.held += n;
        }
        Ok(self.held)
    }
}
