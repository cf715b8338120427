//! How a metric family is written: one descriptor and a sample per label set ([`family`]),
//! label values escaped, and the value types the families use (counters, seconds, gauges,
//! log2 histograms).

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Unit;

/// One metric family: a descriptor, then one sample per label set.
pub(super) fn family<'a, M: EncodeMetric>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    samples: impl IntoIterator<Item = (Vec<(&'a str, String)>, M)>,
) -> Result<(), std::fmt::Error> {
    let mut samples = samples.into_iter().peekable();
    let Some((_, first)) = samples.peek() else {
        return Ok(());
    };
    let ty: MetricType = first.metric_type();
    let mut fam: MetricEncoder = enc.encode_descriptor(name, help, unit, ty)?;
    for (labels, m) in samples {
        if labels.is_empty() {
            // A family of one unlabelled sample (no `{}` after the name).
            return m.encode(fam);
        }
        // prometheus-client writes label values as they are: escaped here, for every family.
        let labels: Vec<(&str, String)> = labels
            .into_iter()
            .map(|(k, v)| (k, escape_label(&v)))
            .collect();
        m.encode(fam.encode_family(&labels)?)?;
    }
    Ok(())
}

/// A label value as the text format (Prometheus 0.0.4 and OpenMetrics alike) writes it: `\`,
/// `"` and a line feed escaped as `\\`, `\"` and `\n`. Values are names users give (exports,
/// bitmaps): unescaped, a name could end its label and add samples of its own.
fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

pub(super) fn counter(v: u64) -> ConstCounter<u64> {
    ConstCounter::new(v)
}

pub(super) fn seconds(ns: u64) -> ConstCounter<f64> {
    ConstCounter::new(ns as f64 / 1e9)
}

pub(super) fn gauge(v: u64) -> ConstGauge<i64> {
    ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX))
}

/// A histogram of log2 buckets (`waitq::HistogramSnapshot`), in seconds.
#[derive(Debug)]
pub(super) struct Log2Histogram(pub(super) waitq::HistogramSnapshot);

/// Buckets below 2^10 ns (1 µs) are folded into the first bucket; the last finite bound is
/// 2^36 ns (about 69 s).
const HIST_FIRST: usize = 10;
const HIST_LAST: usize = 36;

impl EncodeMetric for Log2Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let b = &self.0.buckets;
        // waitq bucket i holds samples in [2^(i-1), 2^i) ns: below the bound 2^i.
        let mut out: Vec<(f64, u64)> = Vec::with_capacity(HIST_LAST - HIST_FIRST + 2);
        let upto = |i: usize| b.iter().take(i + 1).sum::<u64>();
        let mut prev = 0;
        for i in HIST_FIRST..=HIST_LAST.min(b.len() - 1) {
            let c = upto(i);
            out.push(((1u64 << i) as f64 / 1e9, c - prev));
            prev = c;
        }
        out.push((f64::MAX, self.0.count() - prev));
        encoder.encode_histogram::<()>(self.0.sum as f64 / 1e9, self.0.count(), &out, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}
