//! [`ExtentBuilder`]: how the backends build an allocation map
//! ([`Backend::extents_into`](super::store::Backend::extents_into)).

use blk::Extent;

/// Accumulates an allocation map clipped to `[start, end)`, merging neighbours that agree,
/// stopping at `max` extents.
pub(crate) struct ExtentBuilder<'a> {
    out: &'a mut Vec<Extent>,
    max: usize,
    start: u64,
    end: u64,
}

impl<'a> ExtentBuilder<'a> {
    /// An empty map of `[start, end)` in `out` (cleared here), at most `max` extents.
    pub(crate) fn new(out: &'a mut Vec<Extent>, start: u64, end: u64, max: usize) -> Self {
        out.clear();
        ExtentBuilder {
            out,
            max,
            start,
            end,
        }
    }

    /// Adds `[from, to)` (clipped); returns `false` once a new extent would exceed `max`.
    pub(crate) fn add(&mut self, from: u64, to: u64, allocated: bool) -> bool {
        let from = from.max(self.start);
        let to = to.min(self.end);
        if from >= to {
            return true;
        }
        if let Some(last) = self.out.last_mut() {
            if last.allocated == allocated && last.offset + last.len == from {
                last.len += to - from;
                return true;
            }
        }
        if self.out.len() >= self.max {
            return false;
        }
        self.out.push(Extent {
            offset: from,
            len: to - from,
            allocated,
        });
        true
    }
}
