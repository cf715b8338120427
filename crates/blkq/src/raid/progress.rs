//! Owns md's progress line of a resync/recovery/check (`[===>....]  recover = 27.3% ...`).

use super::report::SyncReport;

/// md's progress line: `[=====>...............]  recovery = 27.3% (x/y) finish=1.2min
/// speed=10240K/sec`.
pub fn progress_line(s: &SyncReport) -> String {
    const WIDTH: u64 = 20;
    let per_mille = (s.done_bytes.min(s.total_bytes) as u128 * 1000)
        .checked_div(s.total_bytes as u128)
        .unwrap_or(0) as u64;
    let filled = per_mille * WIDTH / 1000;
    let mut bar = String::with_capacity(WIDTH as usize + 2);
    bar.push('[');
    for i in 0..WIDTH {
        bar.push(if i < filled {
            '='
        } else if i == filled {
            '>'
        } else {
            '.'
        });
    }
    bar.push(']');
    let finish = s
        .eta_secs
        .map_or("?".to_string(), |e| format!("{:.1}min", e as f64 / 60.0));
    format!(
        "{bar}  {} = {}.{}% ({}/{}) finish={finish} speed={}K/sec",
        s.action,
        per_mille / 10,
        per_mille % 10,
        s.done_bytes / 1024,
        s.total_bytes / 1024,
        s.speed_kib_s
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_line_looks_like_md() {
        let s = SyncReport {
            action: "recover".into(),
            done_bytes: 50 << 20,
            total_bytes: 100 << 20,
            speed_kib_s: 1024,
            eta_secs: Some(90),
            mismatch_cnt: 0,
            chunks_copied: 0,
            yields: 0,
        };
        let l = progress_line(&s);
        assert!(
            l.starts_with("[==========>.........]  recover = 50.0%"),
            "{l}"
        );
        assert!(l.contains("finish=1.5min speed=1024K/sec"), "{l}");
    }
}
