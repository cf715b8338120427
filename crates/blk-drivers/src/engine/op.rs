//! What an engine is given and how it reports: [`UringOp`] (an operation, and the `unsafe`
//! contract that keeps its buffer alive), [`UringOpKind`], and the completion [`Callback`].

use std::io;

/// The completion callback: `(user_data, result)`, once per op.
pub type Callback = Box<dyn Fn(u64, io::Result<u32>) + Send + Sync>;

/// What an op does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UringOpKind {
    /// Read `len` bytes at `offset` into the buffer.
    Read,
    /// Write `len` bytes of the buffer at `offset` (durably with `fua`).
    Write,
    /// `fdatasync` the file.
    Fsync,
    /// Nothing: completes with `Ok(0)`.
    Nop,
}

/// One asynchronous operation. Reads and writes are built with the `unsafe` constructors,
/// whose contract keeps the buffer alive until the op's callback has run.
#[derive(Debug, Clone, Copy)]
pub struct UringOp {
    pub(super) kind: UringOpKind,
    pub(super) offset: u64,
    pub(super) ptr: *mut u8,
    pub(super) len: u32,
    pub(super) fua: bool,
}

// SAFETY: an op is an address and a length; the `unsafe` constructors' contract makes the
// buffer usable from any thread (the engines' reaper or workers) until the callback runs.
unsafe impl Send for UringOp {}
// SAFETY: as for `Send`: shared references to an op only read its plain fields.
unsafe impl Sync for UringOp {}

impl UringOp {
    /// A read of `len` bytes at `offset` into `ptr`.
    ///
    /// # Safety
    ///
    /// `ptr` must be valid for writes of `len` bytes, and not be read or written by anyone
    /// else, from the submission until the op's completion callback has returned.
    pub unsafe fn read(offset: u64, ptr: *mut u8, len: u32) -> UringOp {
        UringOp {
            kind: UringOpKind::Read,
            offset,
            ptr,
            len,
            fua: false,
        }
    }

    /// A write of `len` bytes from `ptr` at `offset`; with `fua`, durable before completion.
    ///
    /// # Safety
    ///
    /// `ptr` must be valid for reads of `len` bytes, and not be written by anyone, from the
    /// submission until the op's completion callback has returned.
    pub unsafe fn write(offset: u64, ptr: *const u8, len: u32, fua: bool) -> UringOp {
        UringOp {
            kind: UringOpKind::Write,
            offset,
            ptr: ptr.cast_mut(),
            len,
            fua,
        }
    }

    /// `fdatasync` of the file: completes once every write completed before it is durable.
    pub fn fsync() -> UringOp {
        UringOp {
            kind: UringOpKind::Fsync,
            offset: 0,
            ptr: std::ptr::null_mut(),
            len: 0,
            fua: false,
        }
    }

    /// An op that does nothing (completes with `Ok(0)`).
    pub fn nop() -> UringOp {
        UringOp {
            kind: UringOpKind::Nop,
            offset: 0,
            ptr: std::ptr::null_mut(),
            len: 0,
            fua: false,
        }
    }

    /// What it does.
    pub fn kind(&self) -> UringOpKind {
        self.kind
    }

    /// File offset, bytes.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Length, bytes.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// Whether it transfers nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether a write is FUA.
    pub fn fua(&self) -> bool {
        self.fua
    }
}
