//! Which leg takes which slot: what a set of superblocks decides about the array they form
//! ([`Assembly::decide`], a pure function: which array, whose superblock speaks for it, which
//! leg takes which slot), and the re-add rule a returning leg's superblock is judged by
//! ([`readd_covers`]). Assembly acts on the decision; `add_leg`, the automatic re-add and a
//! tool that only reports on legs at rest ask the same questions.

use crate::generation::{Kinship, Lineage};
use crate::superblock::{Role, Superblock};
use uuid::Uuid;

/// What the superblocks of a set of legs decide about the array they form, before anything
/// starts ([`Assembly::decide`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assembly {
    /// The position, among the legs given, of the superblock whose view of the array wins:
    /// the slot table, events, layout and state come from it.
    pub newest: usize,
    /// For each leg given, the slot it takes in that view: `None` for a leg without a
    /// readable superblock, a spare, or a leg replaced in its slot since.
    pub slots: Vec<Option<usize>>,
    /// Disagreements worked around (equal events, different views), naming legs by position.
    pub warnings: Vec<String>,
}

/// Why the legs given do not form one array ([`Assembly::decide`]). Legs are named by their
/// position among the legs given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AssemblyError {
    /// No leg has a readable superblock.
    #[error("no leg with a readable superblock")]
    NoSuperblock,
    /// A leg carries another array's superblock than the array most legs belong to.
    #[error(
        "leg {leg} belongs to another array (array UUID {its}) than legs {} (array UUID \
         {array})",
        join(.members)
    )]
    ForeignLeg {
        /// The first such leg.
        leg: usize,
        /// Its array's UUID.
        its: Uuid,
        /// The legs of the array.
        members: Vec<usize>,
        /// The array's UUID.
        array: Uuid,
    },
    /// Two legs carry the same leg UUID: the same leg given twice (or a copy of it).
    #[error("legs {first} and {second} are the same leg (leg UUID {leg_uuid})")]
    DuplicateLeg {
        /// The first of them.
        first: usize,
        /// The second.
        second: usize,
        /// The leg UUID they share.
        leg_uuid: Uuid,
    },
    /// The newest superblocks (same events) each record another's leg as failed: each leg
    /// may hold writes the others lack.
    #[error(
        "legs {} have the same events ({events}) and each records another as failed (split \
         brain): refusing to assemble; assemble from the legs you trust",
        join(.legs)
    )]
    SplitBrain {
        /// The legs with those events.
        legs: Vec<usize>,
        /// Their events.
        events: u64,
    },
    /// The legs carry histories that went apart (see [`crate::generation`]): each side ran
    /// without the other and holds writes the other lacks, whatever their events say.
    #[error(
        "the legs' histories diverged: {}: each side ran without the other and holds writes \
         the other lacks; refusing to pick a side: assemble from the side to keep (allowing a \
         degraded start), then add the other with --discard (only the chunks either side \
         changed are copied)",
        name_sides(.sides)
    )]
    Diverged {
        /// Each side: its legs (positions among the legs given) and its generation.
        sides: Vec<(Vec<usize>, u64)>,
    },
}

fn name_sides(sides: &[(Vec<usize>, u64)]) -> String {
    sides
        .iter()
        .map(|(legs, g)| {
            let which = if legs.len() == 1 { "leg" } else { "legs" };
            format!("{which} {} at generation {g:016x}", join(legs))
        })
        .collect::<Vec<_>>()
        .join(" and ")
}

fn join(legs: &[usize]) -> String {
    legs.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

impl Assembly {
    /// Decides from the superblocks of the legs given, in order (`None`: a leg whose
    /// superblock could not be read, left out of the decision):
    /// 1. the array: the array UUID most legs carry (a tie goes to the array with the highest
    ///    events, then to the earlier leg's); a leg of another array is refused
    ///    ([`AssemblyError::ForeignLeg`]), and so is a leg given twice
    ///    ([`AssemblyError::DuplicateLeg`]);
    /// 2. the newest history: legs whose generation is an earlier point of another leg's
    ///    history are stale whatever their events; two legs whose histories went apart are
    ///    refused ([`AssemblyError::Diverged`]: each side ran without the other);
    /// 3. the newest superblock among the legs at that point (md compares events first): the
    ///    highest
    ///    `events`; among superblocks with those events that disagree (a leg failed while they
    ///    were being written), never one whose own leg another records as failed (that leg
    ///    missed writes the other saw), then the one recording the most failed legs, then the
    ///    lowest slot: the same choice in any order. Two legs that each record the other as
    ///    failed (split brain: each may hold writes the other lacks) are refused
    ///    ([`AssemblyError::SplitBrain`]);
    /// 4. each leg's slot: its superblock's role, where the newest superblock's slot table
    ///    still holds that leg.
    pub fn decide(sbs: &[Option<&Superblock>]) -> Result<Assembly, AssemblyError> {
        let given: Vec<(usize, &Superblock)> = sbs
            .iter()
            .enumerate()
            .filter_map(|(i, sb)| sb.map(|sb| (i, sb)))
            .collect();
        // How strongly the legs speak for an array: how many carry it, then its newest events.
        let weight = |u: Uuid| {
            let of = || given.iter().filter(move |(_, sb)| sb.array_uuid == u);
            (of().count(), of().map(|(_, sb)| sb.events).max())
        };
        // Ties keep the earlier leg's array.
        let array = given
            .iter()
            .map(|(_, sb)| sb.array_uuid)
            .fold(None::<Uuid>, |best, u| match best {
                Some(b) if weight(b) >= weight(u) => Some(b),
                _ => Some(u),
            })
            .ok_or(AssemblyError::NoSuperblock)?;
        if let Some((leg, sb)) = given.iter().find(|(_, sb)| sb.array_uuid != array) {
            return Err(AssemblyError::ForeignLeg {
                leg: *leg,
                its: sb.array_uuid,
                members: given
                    .iter()
                    .filter(|(_, sb)| sb.array_uuid == array)
                    .map(|(i, _)| *i)
                    .collect(),
                array,
            });
        }
        for (k, (first, a)) in given.iter().enumerate() {
            if let Some((second, _)) = given[k + 1..]
                .iter()
                .find(|(_, b)| b.leg_uuid == a.leg_uuid)
            {
                return Err(AssemblyError::DuplicateLeg {
                    first: *first,
                    second: *second,
                    leg_uuid: a.leg_uuid,
                });
            }
        }
        // Only the legs at the newest point of the history speak for the array; legs at an
        // earlier point are stale, whatever their events; two newest points are refused.
        let heads = newest_generation(&given)?;
        let at_head: Vec<(usize, &Superblock)> = given
            .iter()
            .filter(|(_, sb)| sb.lineage.current.id == heads)
            .copied()
            .collect();
        let mut warnings = Vec::new();
        let newest = choose_newest(&at_head, &mut warnings)?;
        let nb = sbs[newest].expect("the newest superblock is one of those given");
        let slots = sbs
            .iter()
            .map(|sb| {
                let sb = (*sb)?;
                let Role::Slot(n) = sb.role else {
                    return None; // a spare
                };
                let n = n as usize;
                // Else replaced in its slot since: not part of the array any more.
                nb.legs.get(n).filter(|l| l.uuid == sb.leg_uuid).map(|_| n)
            })
            .collect();
        Ok(Assembly {
            newest,
            slots,
            warnings,
        })
    }
}

/// The generation of the newest history among `found` (one array's legs): the one no other
/// leg's history has gone past. Step 2 of [`Assembly::decide`].
fn newest_generation(found: &[(usize, &Superblock)]) -> Result<u64, AssemblyError> {
    let mut heads: Vec<(Vec<usize>, u64)> = Vec::new();
    for (i, sb) in found {
        let passed = found
            .iter()
            .any(|(_, o)| o.lineage.kinship(&sb.lineage) == Kinship::Ancestor);
        if passed {
            continue;
        }
        let g = sb.lineage.current.id;
        match heads.iter_mut().find(|(_, h)| *h == g) {
            Some((legs, _)) => legs.push(*i),
            None => heads.push((vec![*i], g)),
        }
    }
    match heads.len() {
        0 => Err(AssemblyError::NoSuperblock),
        1 => Ok(heads[0].1),
        _ => Err(AssemblyError::Diverged { sides: heads }),
    }
}

/// Whether a leg whose own superblock is `sb` left slot `n` in sync (its last superblock,
/// written while it was a member, records it in sync and not failed).
pub(crate) fn left_in_sync(sb: &Superblock, n: usize) -> bool {
    sb.legs.get(n).is_some_and(|l| l.in_sync && !l.faulty)
}

/// md's re-add rule: a returning leg of this array's slot needs only the bitmap's dirty
/// chunks if it left in sync ([`left_in_sync`]) and its events (`events`, its own
/// superblock's) are not behind the bitmap's `events_cleared` (no bit it would need was
/// cleared since it left). Assembly, `add_leg` and the automatic re-add all ask this.
pub(crate) fn readd_rule(left_in_sync: bool, events: u64, events_cleared: u64) -> bool {
    left_in_sync && events >= events_cleared
}

/// The re-add rule across generations (see `generation`): a returning leg at `generation`
/// (its own superblock's, with its `events` and whether it left in sync) of an array whose
/// history is `lineage` needs only the bitmap's dirty chunks when md's rule holds
/// ([`readd_rule`]: no bit was cleared after its last superblock) and, of an earlier
/// generation, no bit was cleared since the array left it. Both, because a leg can leave the
/// array without a new generation (a superblock write that never reached it, then a removal
/// while it recovered: no leg in sync left) and the array may clear bits in that same
/// generation afterwards. Assembly, `add_leg` and the automatic re-add all ask this.
pub(crate) fn readd_covers(
    lineage: &Lineage,
    generation: u64,
    left_in_sync: bool,
    events: u64,
    events_cleared: u64,
) -> bool {
    readd_rule(left_in_sync, events, events_cleared)
        && (generation == lineage.current.id
            // Strictly before: a clear at the new generation's first events came after it.
            || lineage
                .left_at(generation)
                .is_some_and(|left| events_cleared < left))
}

/// Whether the bitmaps of two sides that parted (`ours`, the array's history with its
/// `events_cleared`; `theirs`, a returning leg's, with its own bitmap's) show every chunk
/// either changed since they parted ([`Kinship::Diverged`], or [`Kinship::Descendant`]: the
/// leg went on while the array was stopped). Neither side may have cleared a bit since the
/// first of them left their last common generation: a side that left first (at fewer events)
/// lacks what the other wrote in the common generation afterwards, and a bit cleared then
/// hides it. `ours` has not left the common generation when it is its current one.
pub(crate) fn parted_covers(
    ours: &Lineage,
    our_cleared: u64,
    theirs: &Lineage,
    their_cleared: u64,
) -> bool {
    let common = ours.common(theirs);
    // Each side's departure from the common generation, strictly before which every clear
    // must lie (a clear at a new generation's first events came after it).
    let departures = [ours.left_at(common), theirs.left_at(common)];
    let Some(first) = departures.iter().flatten().min().copied() else {
        return false;
    };
    our_cleared < first && their_cleared < first
}

/// Whether `sb` records slot `n` as failed or not in sync.
fn records_failed(sb: &Superblock, n: usize) -> bool {
    sb.legs.get(n).is_some_and(|l| l.faulty || !l.in_sync)
}

/// The position of the superblock whose view wins, among `found` (one array's legs, with
/// their positions among the legs given): step 2 of [`Assembly::decide`].
fn choose_newest(
    found: &[(usize, &Superblock)],
    warnings: &mut Vec<String>,
) -> Result<usize, AssemblyError> {
    let max = found
        .iter()
        .map(|(_, sb)| sb.events)
        .max()
        .ok_or(AssemblyError::NoSuperblock)?;
    let top: Vec<&(usize, &Superblock)> = found.iter().filter(|(_, sb)| sb.events == max).collect();
    let slot = |sb: &Superblock| match sb.role {
        Role::Slot(n) => n as usize,
        Role::Spare => usize::MAX,
    };
    if top.iter().all(|(_, sb)| sb.legs == top[0].1.legs) {
        return Ok(top[0].0);
    }
    let refuted = |sb: &Superblock| {
        top.iter()
            .any(|(_, other)| other.leg_uuid != sb.leg_uuid && records_failed(other, slot(sb)))
    };
    let best = top
        .iter()
        .filter(|(_, sb)| !refuted(sb))
        .min_by_key(|(_, sb)| {
            let failed = (0..sb.legs.len())
                .filter(|&n| records_failed(sb, n))
                .count();
            (std::cmp::Reverse(failed), slot(sb))
        });
    let legs: Vec<usize> = top.iter().map(|(i, _)| *i).collect();
    let Some((i, _)) = best else {
        return Err(AssemblyError::SplitBrain { legs, events: max });
    };
    warnings.push(format!(
        "legs {} have the same events ({max}) but disagree on the array's state (a leg \
         failed while the superblocks were written); using leg {i}'s, which records the failure",
        join(&legs)
    ));
    Ok(*i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generation::Generation;

    fn lineage(current: (u64, u64), history: &[(u64, u64)]) -> Lineage {
        let g = |(id, since): (u64, u64)| Generation { id, since };
        Lineage {
            current: g(current),
            history: history.iter().map(|&h| g(h)).collect(),
        }
    }

    /// A leg whose superblock stopped at events 8 of generation 0xa, in sync, while the array
    /// went on in that generation without it (a superblock write that never reached it, then
    /// a removal while it recovered: no generation starts when no leg in sync leaves), cleared
    /// bits at events 25 and began generation 0xb at 26. The clear came after the leg's last
    /// superblock: a bit it needs may be gone, whatever the generations say (seed 45000313).
    #[test]
    fn an_ancestor_whose_events_are_behind_a_clear_is_not_covered() {
        let array = lineage((0xb, 26), &[(0xa, 1)]);
        assert!(
            !readd_covers(&array, 0xa, true, 8, 25),
            "a clear at 25 after the leg's events 8"
        );
        assert!(
            readd_covers(&array, 0xa, true, 8, 8),
            "a clear at its own events"
        );
        assert!(readd_covers(&array, 0xa, true, 25, 25), "it saw the clear");
        assert!(
            !readd_covers(&array, 0xa, true, 25, 26),
            "a clear at the new generation's start"
        );
        assert!(
            !readd_covers(&array, 0xa, false, 25, 0),
            "it left out of sync"
        );
        assert!(
            readd_covers(&array, 0xb, true, 30, 27),
            "the current generation"
        );
        assert!(!readd_covers(&array, 0xb, true, 26, 27), "md's rule");
    }

    /// Two sides parted from generation 0xa: the leg left it at events 9 (its generation 0xc
    /// began then), the array stayed in it to 26. A clear the array made at 20 hides chunks
    /// it wrote after the leg had left; a clear at 8 hides nothing either lacks.
    #[test]
    fn parted_sides_are_covered_only_by_clears_before_the_first_departure() {
        let array = lineage((0xb, 26), &[(0xa, 1)]);
        let leg = lineage((0xc, 9), &[(0xa, 1)]);
        assert!(parted_covers(&array, 8, &leg, 8));
        assert!(
            !parted_covers(&array, 20, &leg, 8),
            "ours after their departure"
        );
        assert!(
            !parted_covers(&array, 8, &leg, 9),
            "theirs at their new generation"
        );
        assert!(!parted_covers(&leg, 8, &array, 20), "either way round");
        // A descendant: the array never left 0xa (it was stopped), the leg left at 9.
        let stopped = lineage((0xa, 1), &[]);
        assert!(parted_covers(&stopped, 8, &leg, 3));
        assert!(
            !parted_covers(&stopped, 12, &leg, 3),
            "a clear after the leg went on"
        );
        // Nothing in common that either left: nothing shows what changed.
        assert!(!parted_covers(&stopped, 0, &stopped, 0));
    }
}
