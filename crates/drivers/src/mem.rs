//! The `mem` driver: each request executed synchronously on a [`Backend`] in `queue_rq`
//! (`mem:` devices; `file:` devices with `engine=sync` do the same in
//! [`crate::FileDriver`]).

use blkq_sync::DynArc as Arc;

use blk::{Driver, Error, Extent, QueueCore, RequestToken};

use crate::backend::{exec_on_backend, Backend};

/// A driver that executes each request synchronously on a [`Backend`] in `queue_rq`
/// (`mem:` devices; `file:` devices with `engine=sync` do the same in [`crate::FileDriver`]).
#[derive(Debug)]
pub struct BackendDriver {
    name: &'static str,
    backend: Arc<dyn Backend>,
}

impl BackendDriver {
    /// A driver over `backend`, described as `name`.
    pub fn new(name: &'static str, backend: Arc<dyn Backend>) -> Self {
        Self { name, backend }
    }
}

impl Driver for BackendDriver {
    #[inline]
    fn queue_rq(&self, q: &QueueCore, mut r: RequestToken) {
        // Every bio of a merge chain, in sector order; the chain completes with the first
        // error, if any.
        let res = q.for_each_bio(&mut r, |bio| exec_on_backend(self.backend.as_ref(), bio));
        q.complete(r, res);
    }

    fn max_merge(&self) -> u32 {
        u32::MAX
    }

    fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<Extent>, Error> {
        Ok(self.backend.extents(offset, len, max)?)
    }

    fn describe(&self) -> String {
        format!("{} size={}", self.name, self.backend.size())
    }
}
