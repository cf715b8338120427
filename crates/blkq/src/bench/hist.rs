//! Latency statistics of `blkq bench`: the HDR histogram jobs record into and the summary it
//! reduces to.
//!
//! The histogram is `hdrhistogram`'s, sized once when a job starts (1 ns to `HIGHEST_NS`,
//! 3 significant digits: ~0.1% resolution, ~200 KiB) with auto-resize off, so recording is
//! an index computation and an increment: no allocation and no syscall per I/O. A latency
//! above `HIGHEST_NS` is clamped into the top bucket; the exact sum (for the mean) and the
//! exact maximum are kept beside the histogram.

use hdrhistogram::Histogram;

/// Latency summary, ns.
#[derive(Debug, Clone, Copy, Default)]
pub struct LatSummary {
    pub samples: u64,
    pub mean: u64,
    pub p50: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
}

/// The largest latency the histogram tells apart (100 s); anything above lands in its top
/// bucket (the reported `max` stays exact).
pub(super) const HIGHEST_NS: u64 = 100_000_000_000;

/// A job's latency histogram.
#[derive(Debug, Clone)]
pub(super) struct LatHist {
    h: Histogram<u64>,
    sum: u64,
    max: u64,
}

impl LatHist {
    pub(super) fn new() -> Self {
        // 1..=HIGHEST_NS with 3 significant digits are valid bounds (low >= 1, high >= 2 low,
        // sigfig <= 5): creation cannot fail.
        let mut h = Histogram::new_with_bounds(1, HIGHEST_NS, 3)
            .expect("valid hdrhistogram bounds (constants)");
        h.auto(false);
        Self { h, sum: 0, max: 0 }
    }

    /// Records one latency. No allocation: the histogram is pre-sized and clamps.
    pub(super) fn record(&mut self, ns: u64) {
        self.h.saturating_record(ns);
        self.sum = self.sum.saturating_add(ns);
        self.max = self.max.max(ns);
    }

    /// Adds another job's histogram into this one (same bounds, so it cannot fail).
    pub(super) fn merge(&mut self, o: &LatHist) {
        // Both were made by `new` with the same bounds: every count of `o` has a bucket here.
        let _ = self.h.add(&o.h);
        self.sum = self.sum.saturating_add(o.sum);
        self.max = self.max.max(o.max);
    }

    /// Samples recorded.
    pub(super) fn len(&self) -> u64 {
        self.h.len()
    }

    /// The value at quantile `q` (0..=1): the highest value equivalent (within the
    /// histogram's resolution) to the one `q` of the samples are at or below, capped at the
    /// exact maximum; 0 when empty.
    pub(super) fn quantile(&self, q: f64) -> u64 {
        if self.h.is_empty() {
            return 0;
        }
        self.h.value_at_quantile(q).min(self.max)
    }

    pub(super) fn summary(&self) -> LatSummary {
        let n = self.len();
        LatSummary {
            samples: n,
            mean: self.sum.checked_div(n).unwrap_or(0),
            p50: self.quantile(0.5),
            p99: self.quantile(0.99),
            p999: self.quantile(0.999),
            max: self.max,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(got: u64, want: f64) -> bool {
        (got as f64 / want - 1.0).abs() <= 0.001
    }

    /// Percentiles of a known uniform input, within the histogram's 0.1% resolution.
    #[test]
    fn lat_hist_percentiles_of_a_uniform_input() {
        let mut h = LatHist::new();
        for ns in 1..=10_000u64 {
            h.record(ns);
        }
        let s = h.summary();
        assert_eq!(s.samples, 10_000);
        assert_eq!(s.mean, 5000); // sum 50_005_000 / 10_000, exact
        assert!(close(s.p50, 5000.0), "p50 {}", s.p50);
        assert!(close(s.p99, 9900.0), "p99 {}", s.p99);
        assert!(close(s.p999, 9990.0), "p99.9 {}", s.p999);
        assert_eq!(s.max, 10_000);
        assert_eq!(h.quantile(1.0), 10_000);
        // Below 2000 the resolution is 1 ns: exact.
        assert_eq!(h.quantile(0.1), 1000);
    }

    /// A skewed input: 990 fast I/Os and 10 slow ones put p99 on the fast value and p99.9
    /// on the slow one; merging two jobs adds their counts; an empty histogram reads 0.
    #[test]
    fn lat_hist_tail_merge_and_empty() {
        let mut a = LatHist::new();
        for _ in 0..990 {
            a.record(100);
        }
        let mut b = LatHist::new();
        for _ in 0..10 {
            b.record(1_000_000);
        }
        a.merge(&b);
        let s = a.summary();
        assert_eq!(s.samples, 1000);
        assert_eq!(s.p50, 100);
        assert_eq!(s.p99, 100);
        assert!(close(s.p999, 1_000_000.0), "p99.9 {}", s.p999);
        assert_eq!(s.max, 1_000_000);
        assert_eq!(s.mean, (990 * 100 + 10 * 1_000_000) / 1000);
        let e = LatHist::new().summary();
        assert_eq!((e.samples, e.mean, e.p50, e.p99, e.max), (0, 0, 0, 0, 0));
        // 0 and values past the top are clamped, not lost; max stays exact.
        let mut c = LatHist::new();
        c.record(0);
        c.record(HIGHEST_NS * 10);
        assert_eq!(c.len(), 2);
        assert_eq!(c.summary().max, HIGHEST_NS * 10);
        assert!(c.quantile(1.0) >= HIGHEST_NS);
    }
}
