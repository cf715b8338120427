//! How `blkq bench` writes rates.

/// A rate in thousands (`12.3K`) or, from a million up, millions (`1.23M`).
pub(super) fn thousands_or_millions(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else {
        format!("{:.1}K", x / 1e3)
    }
}
