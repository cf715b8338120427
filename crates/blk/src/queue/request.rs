//! A request and the token that owns its cell (the queue's module docs say how a token moves
//! from tag allocation to completion): the request's identity fields are the queue's to
//! write, so they are visible to `queue.rs` and private to everyone else.

use std::fmt;

use blkq_sync::DynArc as Arc;
use blkq_sync::UnsafeCell;

use crate::bio::{Bio, EndIo};

/// A request: a bio in flight, in the preallocated request cell of its tag.
///
/// Its fields are private: what identifies the request (tag, pool, hardware context) is set
/// by the queue when the tag is allocated and read back by [`RequestQueue::complete`] to free
/// that tag, so nobody else may write it (a driver that could rewrite `tag` could make
/// `complete` free a tag another request holds, and two owners would share one cell).
/// Drivers and schedulers read it through accessors; the bio can be borrowed, taken out and
/// put back.
///
/// [`RequestQueue::complete`]: super::RequestQueue::complete
#[derive(Default)]
pub struct Request {
    pub(super) bio: Option<Bio>,
    pub(super) end: Option<Arc<dyn EndIo>>,
    pub(super) start_ns: u64,
    pub(super) hctx: u16,
    pub(super) tag: u32,
    pub(super) reserved: bool,
    /// The tag came from a shallow allocation (the scheduler's `async_depth`).
    pub(super) shallow: bool,
    pub(super) merged: Option<RequestToken>,
}

impl Request {
    /// The bio (`None` only while a driver has taken it out with [`Request::take_bio`]).
    #[inline]
    pub fn bio(&self) -> Option<&Bio> {
        self.bio.as_ref()
    }

    /// The bio, mutably (a read fills its buffer).
    #[inline]
    pub fn bio_mut(&mut self) -> Option<&mut Bio> {
        self.bio.as_mut()
    }

    /// Takes the bio out, e.g. to hand its buffer to an engine; put it back with
    /// [`Request::put_bio`] before completing, or the submitter never gets it back.
    #[inline]
    pub fn take_bio(&mut self) -> Option<Bio> {
        self.bio.take()
    }

    /// Puts a bio (back) into the request; returns the one it replaces, if any.
    #[inline]
    pub fn put_bio(&mut self, bio: Bio) -> Option<Bio> {
        self.bio.replace(bio)
    }

    /// Coarse submission time, ns (the clock of the disk statistics): the time its plug batch
    /// read when its first request took a tag ([`crate::stats`]: one read per batch).
    #[inline]
    pub fn start_ns(&self) -> u64 {
        self.start_ns
    }

    /// The hardware context the request was submitted on.
    #[inline]
    pub fn hctx(&self) -> u16 {
        self.hctx
    }

    /// The tag within its pool.
    #[inline]
    pub fn tag(&self) -> u32 {
        self.tag
    }

    /// Whether the tag is from the reserved pool.
    #[inline]
    pub fn reserved(&self) -> bool {
        self.reserved
    }

    /// The next request of this request's merge chain (module docs), `None` for a request that
    /// carries one bio.
    #[inline]
    pub fn merged(&self) -> Option<&RequestToken> {
        self.merged.as_ref()
    }

    /// Links `next` (the token of a request of the same queue) as this request's successor in
    /// its merge chain, returning the previous link. What a merging scheduler calls at
    /// dispatch; the chain's head token then owns the whole chain.
    #[inline]
    pub fn set_merged(&mut self, next: Option<RequestToken>) -> Option<RequestToken> {
        std::mem::replace(&mut self.merged, next)
    }
}

impl fmt::Debug for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Request")
            .field("bio", &self.bio)
            .field("hctx", &self.hctx)
            .field("tag", &self.tag)
            .field("merged", &self.merged)
            .finish()
    }
}

/// The right to use one request cell, from tag allocation to completion (module docs): an
/// owning, non-`Clone` token. [`RequestQueue::complete`] consumes it.
///
/// In debug builds the token also names the queue it belongs to, and every use on another
/// queue fails a debug assertion: a token is an index into one queue's table.
///
/// [`RequestQueue::complete`]: super::RequestQueue::complete
#[derive(Debug)]
pub struct RequestToken {
    pub(super) idx: u32,
    /// The identity of the owning queue (`RequestQueue::id`), checked on every use.
    #[cfg(debug_assertions)]
    pub(super) queue: usize,
}

impl RequestToken {
    /// The request's index in its queue's table (unique among requests in flight on this
    /// queue, below [`RequestQueue::nr_requests`]).
    ///
    /// [`RequestQueue::nr_requests`]: super::RequestQueue::nr_requests
    #[inline]
    pub fn index(&self) -> u32 {
        self.idx
    }
}

/// The preallocated cell of one request.
pub(super) struct RequestCell(pub(super) UnsafeCell<Request>);

// SAFETY: a cell is only accessed by the holder of its RequestToken (one token per cell, only
// made by `prepare` from a tag it allocated, and by the unsafe `token_from_index`), and
// ownership passes between threads through the tag bitmap's Release/Acquire (module docs).
// The fields that name the tag are private and written only by `prepare`, so `complete`
// frees exactly the tag that made the token.
unsafe impl Sync for RequestCell {}
// SAFETY: as above; the contents (Bio, Arc<dyn EndIo>) are Send.
unsafe impl Send for RequestCell {}
