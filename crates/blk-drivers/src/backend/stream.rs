//! Copies into a store that do not pass through the caches: the `mem:` map store's writes
//! (`stream=1`, the default; docs/design.md, "Streaming writes").
//!
//! A write of a whole page or more into a device larger than the caches lands on memory no
//! core holds: an ordinary copy first reads every destination line in (a read for
//! ownership), evicting what the threads work on (the store's locks, its allocation bitmap,
//! the server's buffers), and the lock release after it waits for the copy's stores to
//! drain. Non-temporal stores (`movntdq`) write whole lines to memory through the
//! write-combining buffers with no read first and no line left in the caches: 1.37x-1.47x
//! the write throughput of ordinary copies in process (docs/bench.md 9, "Streamed writes").
//! The cost is a read that follows at once (the line comes from memory, not the cache),
//! which is why only copies of at least [`STREAM_MIN`] stream: smaller writes are the metadata
//! a filesystem reads and writes again.
//!
//! Ordering: non-temporal stores are weakly ordered (x86's store order does not cover them),
//! so [`copy`] ends with `sfence`: every streamed byte is visible to other cores before any
//! store the caller makes next, the release of the region's lock included. A reader that
//! takes the lock after the writer released it therefore sees the whole copy, as with an
//! ordinary copy under the lock.

/// The smallest copy that streams, bytes (one page); smaller copies are ordinary.
pub const STREAM_MIN: usize = 4096;

/// Copies `src` to `dst`, streaming the 64-byte-aligned lines of the destination where the
/// copy is at least [`STREAM_MIN`] bytes and the target has non-temporal stores (x86-64),
/// ordinary copies for the rest; fenced (module docs) before it returns.
///
/// # Safety
/// `dst` is valid for writes of `src.len()` bytes, does not overlap `src`, and no other
/// thread reads or writes those bytes during the copy (the caller holds their lock).
#[inline]
pub unsafe fn copy(dst: *mut u8, src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    if src.len() >= STREAM_MIN {
        // SAFETY: the caller's contract, passed on.
        unsafe { x86::copy_streaming(dst, src) };
        return;
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};

    /// A cache line, the unit streamed.
    const LINE: usize = 64;

    /// The streaming copy: the unaligned head and the tail short of a line copied plainly,
    /// every whole destination line in between written with four 16-byte non-temporal
    /// stores, then `sfence`. SSE2, part of every x86-64 processor, so no detection.
    ///
    /// # Safety
    /// As [`super::copy`].
    pub(super) unsafe fn copy_streaming(dst: *mut u8, src: &[u8]) {
        let len = src.len();
        let head = ((LINE - dst as usize % LINE) % LINE).min(len);
        let body = (len - head) / LINE * LINE;
        let s = src.as_ptr();
        // SAFETY: all offsets stay inside `[0, len)` of both buffers, which the caller
        // vouches for; the body's destination is 64-byte aligned (`head`), so each 16-byte
        // store is aligned as `_mm_stream_si128` requires; loads are unaligned ones.
        unsafe {
            std::ptr::copy_nonoverlapping(s, dst, head);
            let mut at = head;
            while at < head + body {
                let from = s.add(at).cast::<__m128i>();
                let to = dst.add(at).cast::<__m128i>();
                let a = _mm_loadu_si128(from);
                let b = _mm_loadu_si128(from.add(1));
                let c = _mm_loadu_si128(from.add(2));
                let d = _mm_loadu_si128(from.add(3));
                _mm_stream_si128(to, a);
                _mm_stream_si128(to.add(1), b);
                _mm_stream_si128(to.add(2), c);
                _mm_stream_si128(to.add(3), d);
                at += LINE;
            }
            std::ptr::copy_nonoverlapping(s.add(at), dst.add(at), len - at);
            _mm_sfence();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every byte lands where it belongs, whatever the destination's alignment and the length
    /// (under the threshold, at it, with a partial head and tail), and nothing around the
    /// destination is touched.
    #[test]
    fn every_byte_lands_and_nothing_around_it_moves() {
        let src: Vec<u8> = (0..3 * STREAM_MIN + 200)
            .map(|i| (i * 7 + i / 251) as u8)
            .collect();
        for &len in &[
            0,
            1,
            63,
            64,
            STREAM_MIN - 1,
            STREAM_MIN,
            STREAM_MIN + 1,
            3 * STREAM_MIN + 77,
        ] {
            for misalign in [0usize, 1, 15, 16, 33, 63] {
                let mut dst = vec![0xEEu8; len + 256];
                let base = dst.as_mut_ptr();
                let start = base.align_offset(64) + misalign;
                // SAFETY: `[start, start + len)` is inside `dst` (256 spare bytes cover the
                // alignment and misalignment); `src` is another allocation.
                unsafe { copy(base.add(start), &src[..len]) };
                assert_eq!(
                    &dst[start..start + len],
                    &src[..len],
                    "len {len} misalign {misalign}"
                );
                assert!(dst[..start].iter().all(|&b| b == 0xEE), "before, len {len}");
                assert!(
                    dst[start + len..].iter().all(|&b| b == 0xEE),
                    "after, len {len}"
                );
            }
        }
    }
}
