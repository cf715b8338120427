//! The payload buffers of one connection: pools by size class, the large classes mapped so
//! that a payload costs only the pages it fills.

use blk::{Buffer, BufferPool};

/// Size classes from this one up are [`BufferPool::new_mapped`]: their pages are committed
/// only as data lands in them, so a WRITE whose payload stalls costs only what was received
/// (and a 32 MiB WRITE header alone costs nothing).
const MAPPED_FROM: usize = 256 << 10;

/// Buffer pools by size class, per connection.
pub(super) struct BufferPools {
    sizes: Vec<usize>,
    pools: Vec<BufferPool>,
}

impl BufferPools {
    /// Size classes of 4, 16, 64 and 256 KiB below `max_bio_bytes`, and `max_bio_bytes`.
    pub(super) fn new(max_bio_bytes: usize) -> Self {
        let mut sizes = Vec::new();
        let mut pools = Vec::new();
        for (size, keep) in [
            (4 << 10, 256),
            (16 << 10, 128),
            (64 << 10, 64),
            (256 << 10, 32),
        ] {
            if size < max_bio_bytes {
                sizes.push(size);
                pools.push(pool(size, keep));
            }
        }
        sizes.push(max_bio_bytes);
        pools.push(pool(max_bio_bytes, 32));
        Self { sizes, pools }
    }

    /// A buffer of `len` bytes from the smallest class that holds it (a fresh one when its
    /// pool is empty or `len` is above every class).
    pub(super) fn get(&self, len: usize) -> Buffer {
        for (size, pool) in self.sizes.iter().zip(&self.pools) {
            if len <= *size {
                if let Some(b) = pool.get(len) {
                    return b;
                }
            }
        }
        if len >= MAPPED_FROM {
            Buffer::new_mapped(len)
        } else {
            Buffer::new(len)
        }
    }
}

/// A pool of `size`-byte buffers keeping `keep` free ones (mapped from [`MAPPED_FROM`] up).
fn pool(size: usize, keep: usize) -> BufferPool {
    if size >= MAPPED_FROM {
        BufferPool::new_mapped(size, 0, keep)
    } else {
        BufferPool::new(size, 0, keep)
    }
}
