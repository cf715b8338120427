//! The `mem` driver's store: a sparse, page-granular RAM disk.
//!
//! Memory is allocated in 4 KiB pages on first write; never-written ranges read as zeros and
//! cost nothing, so a 1 TiB device holding 4 MiB of data takes about 4 MiB.
//!
//! # Why sharded hash maps, not a radix tree of atomically installed pages
//!
//! The page table is [`SHARDS`] hash maps, each behind its own (cache-padded) mutex; page `i`
//! lives in shard `i % SHARDS`, so consecutive pages fall in different shards and a large
//! sequential I/O, or many small I/Os from different queues, spread over all the locks. A lock
//! is held only for one page's lookup and `memcpy` (at most 4 KiB), never across pages, so
//! there is no lock ordering to get wrong.
//!
//! A lock-free radix tree would let readers skip the lock, but the page *contents* would then
//! be read and written by several threads at once: for overlapping concurrent I/O (allowed on a
//! block device, with undefined results) that is a data race on plain bytes, which Rust makes
//! undefined behaviour, so the pages would have to be arrays of atomic bytes (slow copies) or
//! need per-page locks anyway. Freeing pages on discard would also need a reclamation scheme
//! (epochs, hazard pointers). Sharding keeps all of this safe code with short critical sections.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::io;

use blkq_sync::atomic::{AtomicU64, Ordering};
use blkq_sync::{CachePadded, Mutex};

use super::extents::ExtentBuilder;
use super::store::{check_range, Backend};
use blk::Extent;

/// Page size of the store, bytes.
pub const PAGE_SIZE: usize = 4096;
const PAGE_SHIFT: u32 = 12;
const PAGE_MASK: u64 = PAGE_SIZE as u64 - 1;
/// Number of page-table shards (a power of two).
pub const SHARDS: usize = 64;
const SHARD_SHIFT: u32 = SHARDS.trailing_zeros();

type Page = Box<[u8; PAGE_SIZE]>;

/// Hashes a shard-local page key (`page_index / SHARDS`): Fibonacci hashing, a permutation of
/// the low bits so consecutive keys use consecutive buckets; far cheaper than SipHash, and the
/// keys are not attacker-chosen in a way that matters (a client can only pick offsets within
/// the device, and the map is per device).
#[derive(Default)]
struct PageHasher(u64);

impl Hasher for PageHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, key: u64) {
        self.0 = key.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type PageMap = HashMap<u64, Page, BuildHasherDefault<PageHasher>>;

/// A sparse RAM store of `size` bytes, thread-safe, allocated by 4 KiB page on first write.
///
/// See the [module documentation](self) for the sharding.
pub struct MemBackend {
    size: u64,
    shards: Box<[CachePadded<Mutex<PageMap>>]>,
    /// Pages currently allocated (a statistic: updated under the shard locks, read without).
    allocated_pages: AtomicU64,
}

impl std::fmt::Debug for MemBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemBackend")
            .field("size", &self.size)
            .field("allocated_bytes", &self.allocated_bytes())
            .finish()
    }
}

/// One page's share of a byte range.
#[derive(Clone, Copy)]
struct Chunk {
    /// Page index.
    page: u64,
    /// Offset in the page.
    in_page: usize,
    /// Bytes in this page.
    len: usize,
    /// Offset of the chunk from the start of the range.
    done: usize,
}

/// Splits `[offset, offset + len)` into per-page chunks. `len` fits in `usize` (callers pass
/// buffer lengths, or lengths clamped by [`MemBackend::zero_range`]).
fn chunks(offset: u64, len: usize) -> impl Iterator<Item = Chunk> {
    let mut done = 0usize;
    std::iter::from_fn(move || {
        if done >= len {
            return None;
        }
        let pos = offset + done as u64;
        let in_page = (pos & PAGE_MASK) as usize;
        let n = (PAGE_SIZE - in_page).min(len - done);
        let c = Chunk {
            page: pos >> PAGE_SHIFT,
            in_page,
            len: n,
            done,
        };
        done += n;
        Some(c)
    })
}

fn zero_page() -> Page {
    Box::new([0u8; PAGE_SIZE])
}

impl MemBackend {
    /// A store of `size` bytes, all reading as zeros, with no memory allocated yet.
    pub fn new(size: u64) -> MemBackend {
        let shards = (0..SHARDS)
            .map(|_| CachePadded(Mutex::new(PageMap::default())))
            .collect();
        MemBackend {
            size,
            shards,
            allocated_pages: AtomicU64::new(0),
        }
    }

    /// Bytes of page memory allocated now (whole pages, so a multiple of 4096).
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated_pages.load(Ordering::Relaxed) << PAGE_SHIFT
    }

    /// The shard holding `page`, and the page's key in it.
    #[inline]
    fn shard(&self, page: u64) -> (&Mutex<PageMap>, u64) {
        let idx = (page as usize) & (SHARDS - 1);
        (&self.shards[idx].0, page >> SHARD_SHIFT)
    }

    /// Whether `chunk` covers all of its page that lies inside the device.
    #[inline]
    fn covers_page(&self, c: &Chunk) -> bool {
        c.in_page == 0 && (c.len == PAGE_SIZE || (c.page << PAGE_SHIFT) + c.len as u64 >= self.size)
    }

    /// Whether `page` is allocated.
    fn is_allocated(&self, page: u64) -> bool {
        let (shard, key) = self.shard(page);
        shard.lock().contains_key(&key)
    }

    /// The allocated pages in `[first, last]`, sorted: one pass over every shard, for maps
    /// queried over ranges much larger than what is allocated.
    fn allocated_in(&self, first: u64, last: u64) -> Vec<u64> {
        let mut pages = Vec::new();
        for (s, shard) in self.shards.iter().enumerate() {
            let map = shard.lock();
            pages.extend(
                map.keys()
                    .map(|&key| (key << SHARD_SHIFT) | s as u64)
                    .filter(|&p| p >= first && p <= last),
            );
        }
        pages.sort_unstable();
        pages
    }
}

impl Backend for MemBackend {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        check_range("mem read", offset, buf.len() as u64, self.size)?;
        for c in chunks(offset, buf.len()) {
            let dst = &mut buf[c.done..c.done + c.len];
            let (shard, key) = self.shard(c.page);
            let map = shard.lock();
            match map.get(&key) {
                Some(page) => dst.copy_from_slice(&page[c.in_page..c.in_page + c.len]),
                None => dst.fill(0),
            }
        }
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8], _fua: bool) -> io::Result<()> {
        check_range("mem write", offset, buf.len() as u64, self.size)?;
        for c in chunks(offset, buf.len()) {
            let src = &buf[c.done..c.done + c.len];
            let (shard, key) = self.shard(c.page);
            let mut map = shard.lock();
            let page = map.entry(key).or_insert_with(|| {
                self.allocated_pages.fetch_add(1, Ordering::Relaxed);
                zero_page()
            });
            page[c.in_page..c.in_page + c.len].copy_from_slice(src);
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    /// Zeroes `[offset, offset + len)`; with `unmap`, frees the pages it covers (and partial
    /// pages left all zeros), else allocates zero pages where none are.
    fn zero(&self, what: &str, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        check_range(what, offset, len, self.size)?;
        // Work in steps whose length fits in usize on every target.
        const STEP: u64 = 1 << 30;
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let step = (end - pos).min(STEP) as usize;
            for c in chunks(pos, step) {
                let (shard, key) = self.shard(c.page);
                let whole = self.covers_page(&c);
                let mut map = shard.lock();
                if unmap {
                    if whole {
                        if map.remove(&key).is_some() {
                            self.allocated_pages.fetch_sub(1, Ordering::Relaxed);
                        }
                    } else if let Some(page) = map.get_mut(&key) {
                        page[c.in_page..c.in_page + c.len].fill(0);
                        if page.iter().all(|&b| b == 0) {
                            map.remove(&key);
                            self.allocated_pages.fetch_sub(1, Ordering::Relaxed);
                        }
                    }
                } else {
                    match map.get_mut(&key) {
                        Some(page) => page[c.in_page..c.in_page + c.len].fill(0),
                        None => {
                            map.insert(key, zero_page());
                            self.allocated_pages.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
            pos += step as u64;
        }
        Ok(())
    }

    fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        check_range("mem extents", offset, len, self.size)?;
        if len == 0 || max_extents == 0 {
            out.clear();
            return Ok(());
        }
        let end = offset + len;
        let first = offset >> PAGE_SHIFT;
        let last = (end - 1) >> PAGE_SHIFT;
        let mut b = ExtentBuilder::new(out, offset, end, max_extents);
        let span = last - first + 1;
        let allocated = self.allocated_pages.load(Ordering::Relaxed);
        if span <= allocated.saturating_mul(4).saturating_add(256) {
            // Probe page by page: the range is not much larger than what is allocated.
            for page in first..=last {
                let at = page << PAGE_SHIFT;
                if !b.add(at, at + PAGE_SIZE as u64, self.is_allocated(page)) {
                    break;
                }
            }
        } else {
            // Mostly holes: walk the allocated pages only.
            let mut next = first;
            for page in self.allocated_in(first, last) {
                if page > next && !b.add(next << PAGE_SHIFT, page << PAGE_SHIFT, false) {
                    return Ok(());
                }
                let at = page << PAGE_SHIFT;
                if !b.add(at, at + PAGE_SIZE as u64, true) {
                    return Ok(());
                }
                next = page + 1;
            }
            if next <= last {
                b.add(next << PAGE_SHIFT, (last + 1) << PAGE_SHIFT, false);
            }
        }
        Ok(())
    }

    fn fast_zero(&self) -> bool {
        true
    }
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    #[test]
    fn chunks_split_at_page_boundaries() {
        let v: Vec<_> = chunks(4090, 10_000)
            .map(|c| (c.page, c.in_page, c.len, c.done))
            .collect();
        assert_eq!(
            v,
            vec![
                (0, 4090, 6, 0),
                (1, 0, 4096, 6),
                (2, 0, 4096, 4102),
                (3, 0, 1802, 8198)
            ]
        );
    }

    #[test]
    fn extents_paths_agree() {
        // The per-page and the sorted-walk paths must give the same map.
        let m = MemBackend::new(1 << 30);
        for p in [3u64, 4, 5, 100, 1000, 1001, 200_000] {
            m.write_at(p << PAGE_SHIFT, &[1], false).unwrap();
        }
        let walk = m.extents(100, (1 << 30) - 100, 100).unwrap();
        let mut probed = Vec::new();
        let mut probe = ExtentBuilder::new(&mut probed, 100, 1 << 30, 100);
        for page in 0..(1u64 << 18) {
            let at = page << PAGE_SHIFT;
            probe.add(at, at + 4096, m.is_allocated(page));
        }
        assert_eq!(walk, probed);
        assert_eq!(walk.len(), 9);
    }
}
