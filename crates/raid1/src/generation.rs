//! Generations: which history a leg's data belongs to (DRBD's generation UUIDs, in md's
//! superblock).
//!
//! `events` orders the superblocks of one history, but two legs that each ran without the
//! other (a mirror split by a lost link, and its remote leg started alone for failover) both
//! count up from the same point: the larger count is not the one to keep, each side holds
//! writes the other lacks. So every superblock also carries its array's [`Lineage`]: the
//! current generation (a random number) and the generations before it, newest first, each
//! with the `events` at which it began.
//!
//! A new generation starts whenever the set of legs in sync shrinks: a leg is failed or
//! removed, or the array starts without a leg that was in sync (`Raid1::assemble` with a leg
//! missing, which only `Raid1Config::allow_degraded` permits). A leg that leaves therefore
//! keeps the old generation, which the array's history remembers: when it returns it is an
//! ancestor ([`Kinship::Ancestor`]) and a bitmap recovery brings it up to date. Two sides that
//! each ran alone both started new generations from a common one: neither is in the other's
//! history ([`Kinship::Diverged`]), and nothing picks a side without the operator.
//!
//! Generation 0 is the history before generations were recorded (superblocks written by an
//! older blkq): an ancestor of every generation.

/// Generations remembered before the current one.
pub const HISTORY: usize = 16;

/// One generation: its number and the array `events` at which it began.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Generation {
    /// Random, never 0 once recorded (0: before generations).
    pub id: u64,
    /// The superblock `events` at which it began.
    pub since: u64,
}

/// A history: the current generation and up to [`HISTORY`] earlier ones, newest first.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Lineage {
    /// The current generation.
    pub current: Generation,
    /// Earlier generations, newest first.
    pub history: Vec<Generation>,
}

/// How one history relates to another ([`Lineage::kinship`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kinship {
    /// The same generation.
    Same,
    /// The other is an earlier point of this history: it missed what came after.
    Ancestor,
    /// This is an earlier point of the other's history.
    Descendant,
    /// Each went on without the other from a common generation (or none is known).
    Diverged,
}

/// A fresh random generation number, never 0.
fn fresh_id() -> u64 {
    uuid::Uuid::new_v4().as_u64_pair().0 | 1
}

impl Lineage {
    /// The lineage of a new array: one fresh generation beginning at `events`.
    pub fn new_at(events: u64) -> Self {
        Self {
            current: Generation {
                id: fresh_id(),
                since: events,
            },
            history: Vec::new(),
        }
    }

    /// Starts a new generation at `events`; the current one goes into the history (the
    /// oldest is forgotten past [`HISTORY`]).
    pub fn rotate(&mut self, events: u64) {
        self.history.insert(0, self.current);
        self.history.truncate(HISTORY);
        self.current = Generation {
            id: fresh_id(),
            since: events,
        };
    }

    /// Whether generation `id` is this lineage's current one or an earlier one.
    fn knows(&self, id: u64) -> bool {
        id == 0 || self.current.id == id || self.history.iter().any(|g| g.id == id)
    }

    /// How `other` relates to this history: the same generation, an earlier point of it
    /// (`Ancestor`), a later point (`Descendant`), or another branch (`Diverged`).
    pub fn kinship(&self, other: &Lineage) -> Kinship {
        if self.current.id == other.current.id {
            Kinship::Same
        } else if self.knows(other.current.id) {
            Kinship::Ancestor
        } else if other.knows(self.current.id) {
            Kinship::Descendant
        } else {
            Kinship::Diverged
        }
    }

    /// The `events` at which this history left generation `id` (when the generation after it
    /// began), if `id` is in its history; for a diverged pair, `id` is their last common
    /// generation. Bits of the write-intent bitmap cleared after this point may hide writes
    /// made since.
    pub fn left_at(&self, id: u64) -> Option<u64> {
        let mut after = self.current;
        for g in &self.history {
            if g.id == id {
                return Some(after.since);
            }
            after = *g;
        }
        None
    }

    /// The newest generation both histories know (0 when they share none but the history
    /// before generations).
    pub fn common(&self, other: &Lineage) -> u64 {
        std::iter::once(&self.current)
            .chain(&self.history)
            .map(|g| g.id)
            .find(|&id| other.knows(id))
            .unwrap_or(0)
    }
}

impl std::fmt::Display for Lineage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "generation {:016x}", self.current.id)?;
        if let Some(p) = self.history.first() {
            write!(f, " (after {:016x})", p.id)?;
        }
        Ok(())
    }
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_branch_that_left_is_an_ancestor_and_two_branches_diverge() {
        let g = Lineage::new_at(1);
        let mut front = g.clone();
        front.rotate(10);
        assert_eq!(front.kinship(&g), Kinship::Ancestor);
        assert_eq!(g.kinship(&front), Kinship::Descendant);
        assert_eq!(front.left_at(g.current.id), Some(10));
        let mut back = g.clone();
        back.rotate(7);
        assert_eq!(front.kinship(&back), Kinship::Diverged);
        assert_eq!(back.kinship(&front), Kinship::Diverged);
        assert_eq!(front.common(&back), g.current.id);
        assert_eq!(back.left_at(front.common(&back)), Some(7));
        assert_eq!(front.kinship(&front.clone()), Kinship::Same);
    }

    #[test]
    fn the_history_before_generations_is_everyones_ancestor() {
        let old = Lineage::default();
        let g = Lineage::new_at(5);
        assert_eq!(g.kinship(&old), Kinship::Ancestor);
        assert_eq!(old.kinship(&g), Kinship::Descendant);
    }

    #[test]
    fn history_is_bounded_and_forgets_the_oldest() {
        let first = Lineage::new_at(0);
        let mut l = first.clone();
        for e in 1..=HISTORY as u64 + 3 {
            l.rotate(e);
        }
        assert_eq!(l.history.len(), HISTORY);
        // Too far back to tell: treated as another branch, never silently as an ancestor.
        assert_eq!(l.kinship(&first), Kinship::Diverged);
    }
}
