//! Synchronous I/O on any `blk::Device`, for tests: submit one bio and wait for it (with the
//! suite's [`PROMPT`] deadline, failing the test rather than hanging), or read and write bytes.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use blk::{Bio, Buffer, Device, EndIo, Error, Op, SECTOR_SHIFT};

use crate::PROMPT;

/// Submits `bio` to `dev` and waits for its completion ([`blk::submit_wait_until`]); returns
/// the bio (with its buffer) and its status. Panics if it does not complete within [`PROMPT`].
pub fn submit_wait(dev: &dyn Device, bio: Bio) -> (Bio, Result<(), Error>) {
    blk::submit_wait_until(dev, bio, Instant::now() + PROMPT)
        .unwrap_or_else(|| panic!("a bio did not complete within {PROMPT:?}"))
}

/// One completion reused for every request, for the tests that count allocations
/// ([`crate::alloc`]), where [`submit_wait`]'s completion per call would be counted:
/// [`Reused::run`] submits one bio and waits for it, allocating nothing.
pub struct Reused {
    done: Arc<ReusedEnd>,
    end: Arc<dyn EndIo>,
}

#[derive(Default)]
struct ReusedEnd {
    out: Mutex<Option<(Bio, Result<(), Error>)>>,
    wq: waitq::WaitQueue,
}

impl EndIo for ReusedEnd {
    fn end_io(&self, bio: Bio, res: Result<(), Error>) {
        *self.out.lock().unwrap() = Some((bio, res));
        self.wq.wake_one();
    }
}

impl Default for Reused {
    fn default() -> Self {
        let done = Arc::new(ReusedEnd::default());
        let end: Arc<dyn EndIo> = done.clone();
        Self { done, end }
    }
}

impl Reused {
    /// Submits `bio` to `dev`, waits for it and returns it; panics if it failed.
    pub fn run(&self, dev: &dyn Device, bio: Bio) -> Bio {
        dev.submit(bio, &self.end);
        let (bio, r) = self
            .done
            .wq
            .wait_for(|| self.done.out.lock().unwrap().take());
        r.unwrap();
        bio
    }
}

/// Writes `data` at byte `offset` (sector-aligned) and returns the status.
pub fn write_at(dev: &dyn Device, offset: u64, data: &[u8]) -> Result<(), Error> {
    let mut b = Buffer::new(data.len());
    b.as_mut_slice().copy_from_slice(data);
    submit_wait(dev, Bio::with_buf(Op::Write, offset >> SECTOR_SHIFT, b)).1
}

/// Reads `len` bytes at byte `offset` (sector-aligned).
pub fn read_at(dev: &dyn Device, offset: u64, len: usize) -> Result<Vec<u8>, Error> {
    let (b, r) = submit_wait(
        dev,
        Bio::with_buf(Op::Read, offset >> SECTOR_SHIFT, Buffer::new(len)),
    );
    r?;
    let buf = b.buf.expect("a read bio comes back with its buffer");
    Ok(buf.as_slice()[..len].to_vec())
}

/// Flushes `dev` and returns the status.
pub fn flush(dev: &dyn Device) -> Result<(), Error> {
    submit_wait(dev, Bio::new(Op::Flush, 0, 0)).1
}

/// The receiving end of a socket pair as a [`blk::RecvSource`], as the NBD server's connection
/// would be: retries an interrupted receive, stops when the peer closes. For tests of
/// [`Device::recv_home`].
pub struct SocketSource(pub std::os::unix::net::UnixStream);

impl blk::RecvSource for SocketSource {
    fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.0)
    }
    fn received(&mut self, res: std::io::Result<usize>) -> std::io::Result<()> {
        match res {
            Ok(0) => Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(_) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Ok(()),
            Err(e) => Err(e),
        }
    }
}
