//! Latency statistics of `blkq bench`: the log-linear histogram jobs record into and the
//! summary it reduces to.

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

/// A log-linear latency histogram (16 sub-buckets per power of two: ~6% resolution).
#[derive(Debug, Clone)]
pub(super) struct LatHist {
    pub(super) buckets: Vec<u64>,
    pub(super) sum: u64,
    pub(super) max: u64,
    pub(super) n: u64,
}

pub(super) const SUB: u32 = 4; // log2 of sub-buckets

impl LatHist {
    pub(super) fn new() -> Self {
        Self {
            buckets: vec![0; (64 << SUB) as usize],
            sum: 0,
            max: 0,
            n: 0,
        }
    }

    pub(super) fn index(ns: u64) -> usize {
        if ns < (1 << SUB) {
            return ns as usize;
        }
        let msb = 63 - ns.leading_zeros();
        let sub = (ns >> (msb - SUB)) & ((1 << SUB) - 1);
        (((msb - SUB + 1) << SUB) as u64 + sub) as usize
    }

    pub(super) fn upper(i: usize) -> u64 {
        let i = i as u64;
        if i < (1 << SUB) {
            return i;
        }
        let e = (i >> SUB) - 1 + u64::from(SUB);
        let sub = i & ((1 << SUB) - 1);
        ((1u64 << SUB) + sub + 1).saturating_mul(1u64 << (e - u64::from(SUB))) - 1
    }

    pub(super) fn record(&mut self, ns: u64) {
        self.buckets[Self::index(ns)] += 1;
        self.sum += ns;
        self.max = self.max.max(ns);
        self.n += 1;
    }

    pub(super) fn merge(&mut self, o: &LatHist) {
        for (a, b) in self.buckets.iter_mut().zip(&o.buckets) {
            *a += b;
        }
        self.sum += o.sum;
        self.max = self.max.max(o.max);
        self.n += o.n;
    }

    pub(super) fn quantile(&self, q: f64) -> u64 {
        if self.n == 0 {
            return 0;
        }
        let want = ((self.n as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen >= want {
                return Self::upper(i).min(self.max);
            }
        }
        self.max
    }

    pub(super) fn summary(&self) -> LatSummary {
        LatSummary {
            samples: self.n,
            mean: self.sum.checked_div(self.n).unwrap_or(0),
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

    #[test]
    fn lat_hist_quantiles_are_close() {
        let mut h = LatHist::new();
        for ns in 1..=10_000u64 {
            h.record(ns);
        }
        let p50 = h.quantile(0.5) as f64;
        let p99 = h.quantile(0.99) as f64;
        assert!((p50 / 5000.0 - 1.0).abs() < 0.07, "p50 {p50}");
        assert!((p99 / 9900.0 - 1.0).abs() < 0.07, "p99 {p99}");
        assert_eq!(h.quantile(1.0), 10_000);
        for i in 0..LatHist::index(u64::MAX) {
            assert!(LatHist::upper(i) < LatHist::upper(i + 1), "bucket {i}");
        }
        for ns in [0u64, 1, 15, 16, 17, 1000, 123_456_789] {
            assert!(LatHist::upper(LatHist::index(ns)) >= ns);
        }
    }
}
