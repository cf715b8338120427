//! A log2 latency histogram, as the wake-up latency histograms of the swait-completions
//! design were read: bucket `i` counts samples in `[2^(i-1), 2^i)` nanoseconds.
//!
//! Counters are independent `Relaxed` atomics: a snapshot taken while samples are being
//! recorded may be torn between buckets, which is fine for statistics.

use std::fmt;
use std::time::Instant;

use blkq_sync::atomic::{AtomicU64, Ordering};

/// Number of buckets: enough for any `u64` of nanoseconds.
pub const BUCKETS: usize = 65;

/// A log2 histogram of nanosecond latencies.
#[derive(Debug)]
pub struct LatencyHistogram {
    base: Instant,
    buckets: [AtomicU64; BUCKETS],
    sum: AtomicU64,
    max: AtomicU64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self::new()
    }
}

/// The bucket of a sample: 0 for 0 ns, else 1 + floor(log2(ns)).
#[inline]
pub fn bucket_of(ns: u64) -> usize {
    (u64::BITS - ns.leading_zeros()) as usize
}

impl LatencyHistogram {
    /// An empty histogram whose clock starts now.
    pub fn new() -> Self {
        Self {
            base: Instant::now(),
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum: AtomicU64::new(0),
            max: AtomicU64::new(0),
        }
    }

    /// Nanoseconds since this histogram was made (its clock for stamps).
    #[inline]
    pub fn now_ns(&self) -> u64 {
        self.base.elapsed().as_nanos() as u64
    }

    /// Records one sample.
    #[inline]
    pub fn record(&self, ns: u64) {
        self.buckets[bucket_of(ns)].fetch_add(1, Ordering::Relaxed);
        self.sum.fetch_add(ns, Ordering::Relaxed);
        self.max.fetch_max(ns, Ordering::Relaxed);
    }

    /// A copy of the counts.
    pub fn snapshot(&self) -> HistogramSnapshot {
        HistogramSnapshot {
            buckets: std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed)),
            sum: self.sum.load(Ordering::Relaxed),
            max: self.max.load(Ordering::Relaxed),
        }
    }
}

/// A point-in-time copy of a [`LatencyHistogram`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistogramSnapshot {
    /// Counts per log2 bucket (see [`bucket_of`]).
    pub buckets: [u64; BUCKETS],
    /// Sum of all samples, ns.
    pub sum: u64,
    /// Largest sample, ns.
    pub max: u64,
}

impl HistogramSnapshot {
    /// Number of samples.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// Mean sample, ns (0 when empty).
    pub fn mean(&self) -> u64 {
        self.sum.checked_div(self.count()).unwrap_or(0)
    }

    /// An upper bound of the `q` quantile (0.0..=1.0): the top of the bucket it falls in.
    pub fn quantile_upper(&self, q: f64) -> u64 {
        let n = self.count();
        if n == 0 {
            return 0;
        }
        let want = ((n as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen >= want {
                return if i == 0 {
                    0
                } else {
                    (1u64 << (i - 1)).saturating_mul(2) - 1
                };
            }
        }
        self.max
    }
}

impl fmt::Display for HistogramSnapshot {
    /// One line per non-empty bucket: range, count and a bar, like the kernel's hist triggers.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let peak = self.buckets.iter().copied().max().unwrap_or(0).max(1);
        for (i, &c) in self.buckets.iter().enumerate() {
            if c == 0 {
                continue;
            }
            let lo = if i == 0 { 0 } else { 1u64 << (i - 1) };
            let bar = "#".repeat(((c * 40).div_ceil(peak)) as usize);
            writeln!(f, "{lo:>12} ns .. : {c:>10} {bar}")?;
        }
        write!(
            f,
            "count {} mean {} ns max {} ns",
            self.count(),
            self.mean(),
            self.max
        )
    }
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_log2() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(1), 1);
        assert_eq!(bucket_of(2), 2);
        assert_eq!(bucket_of(3), 2);
        assert_eq!(bucket_of(1024), 11);
        assert_eq!(bucket_of(u64::MAX), 64);
    }

    #[test]
    fn snapshot_counts_mean_max_quantile() {
        let h = LatencyHistogram::new();
        for ns in [100, 200, 300, 5000] {
            h.record(ns);
        }
        let s = h.snapshot();
        assert_eq!(s.count(), 4);
        assert_eq!(s.mean(), 1400);
        assert_eq!(s.max, 5000);
        assert_eq!(s.quantile_upper(0.5), 255);
        assert_eq!(s.quantile_upper(1.0), 8191);
        assert!(s.to_string().contains("count 4"));
    }
}
