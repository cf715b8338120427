//! Which bytes of a read its reply has filled: the ranges its chunks covered, so that
//! overlapping chunks are refused and a read succeeds only when covered whole. Shared by the
//! remote device's receiver and the blocking client.

/// Most separate pieces a read's reply may leave filled at once (pieces that touch merge: a
/// reply in order, or in reverse, is one piece throughout).
pub(crate) const PIECES: usize = 16;

/// The byte ranges of a read that its reply has filled so far, relative to the read's start:
/// sorted, disjoint, touching ones merged, at most [`PIECES`]. Fixed size: no allocation per
/// request. A chunk that overlaps what was filled is a malformed reply (a server sending the
/// first half twice must not pass for one that sent both halves), and a read succeeds only
/// when the ranges cover it whole: no byte of its buffer that no reply wrote is handed out.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Coverage {
    ranges: [(u64, u64); PIECES],
    n: usize,
    total: u64,
}

impl Coverage {
    pub(crate) fn clear(&mut self) {
        self.n = 0;
        self.total = 0;
    }

    /// Bytes filled.
    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    /// Records `len` bytes filled at `at`; why not, if they overlap bytes already filled or
    /// would leave more than [`PIECES`] separate pieces (nothing is recorded then).
    pub(crate) fn add(&mut self, at: u64, len: u64) -> Result<(), String> {
        let Some(end) = at.checked_add(len) else {
            return Err(format!("a chunk {at}+{len} past the end"));
        };
        if len == 0 {
            return Ok(());
        }
        let r = &mut self.ranges[..self.n];
        // The first piece that starts after `at`.
        let i = r.partition_point(|&(s, _)| s <= at);
        let overlaps_prev = i > 0 && r[i - 1].1 > at;
        let overlaps_next = i < r.len() && r[i].0 < end;
        if overlaps_prev || overlaps_next {
            return Err(format!(
                "a chunk {at}+{len} overlaps bytes of the read already received"
            ));
        }
        let joins_prev = i > 0 && r[i - 1].1 == at;
        let joins_next = i < r.len() && r[i].0 == end;
        match (joins_prev, joins_next) {
            (true, true) => {
                r[i - 1].1 = r[i].1;
                self.ranges.copy_within(i + 1..self.n, i);
                self.n -= 1;
            }
            (true, false) => r[i - 1].1 = end,
            (false, true) => r[i].0 = at,
            (false, false) => {
                if self.n == PIECES {
                    return Err(format!(
                        "a read answered in more than {PIECES} separate pieces at once"
                    ));
                }
                self.ranges.copy_within(i..self.n, i + 1);
                self.ranges[i] = (at, end);
                self.n += 1;
            }
        }
        self.total += len;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{Coverage, PIECES};

    #[test]
    fn coverage_merges_touching_pieces_and_refuses_overlaps() {
        let mut c = Coverage::default();
        c.add(100, 50).unwrap();
        c.add(0, 50).unwrap();
        assert_eq!(c.n, 2);
        // Fills the gap: the three become one.
        c.add(50, 50).unwrap();
        assert_eq!((c.n, c.ranges[0], c.total()), (1, (0, 150), 150));
        for (at, len) in [(0, 1), (149, 10), (10, 20), (140, 5)] {
            let e = c.add(at, len).unwrap_err();
            assert!(e.contains("overlaps"), "{at}+{len}: {e}");
        }
        c.add(150, 10).unwrap();
        assert_eq!((c.n, c.ranges[0], c.total()), (1, (0, 160), 160));
        assert!(c.add(u64::MAX, 2).is_err());
        c.clear();
        assert_eq!((c.n, c.total()), (0, 0));
    }

    #[test]
    fn coverage_holds_at_most_pieces_apart() {
        let mut c = Coverage::default();
        for k in 0..PIECES as u64 {
            c.add(k * 10, 5).unwrap();
        }
        let e = c.add(1000, 5).unwrap_err();
        assert!(e.contains("pieces"), "{e}");
        assert_eq!(c.total(), PIECES as u64 * 5);
        // A piece that joins two leaves room again.
        c.add(5, 5).unwrap();
        c.add(1000, 5).unwrap();
        assert_eq!(c.n, PIECES);
    }
}
