//! Statistics of `blkq bench` over the repeats of a run.

/// The mean and the sample standard deviation of `v` (0 for one value; both 0 for none).
pub(super) fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len().max(1) as f64;
    let m = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (m, var.sqrt())
}
