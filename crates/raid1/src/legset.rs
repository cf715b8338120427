//! A set of legs (slots 0..[`MAX_LEGS`]): one bit per slot in a `u32`, `Copy`, no allocation.
//! Every mask of legs an I/O carries (the legs a write goes to, the legs whose success counts,
//! the write-behind legs, the legs a read tried) is one, so a slot number and a set of slots
//! are never confused.

use crate::superblock::MAX_LEGS;

// One bit per slot.
const _: () = assert!(MAX_LEGS <= u32::BITS as usize);

/// A set of leg slots.
#[repr(transparent)]
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub(crate) struct LegSet(u32);

impl LegSet {
    /// No leg.
    pub(crate) const EMPTY: Self = Self(0);

    /// The set holding only `leg` (empty when `leg` is not a slot number).
    #[inline]
    pub(crate) fn one(leg: usize) -> Self {
        Self(bit(leg))
    }

    /// The set of a bit mask (bit i: slot i), as [`crate::lend::Lent`] keeps it.
    #[inline]
    pub(crate) const fn from_bits(bits: u32) -> Self {
        Self(bits)
    }

    /// The bit mask (bit i: slot i).
    #[inline]
    pub(crate) const fn bits(self) -> u32 {
        self.0
    }

    #[inline]
    pub(crate) const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// How many legs.
    #[inline]
    pub(crate) const fn len(self) -> u32 {
        self.0.count_ones()
    }

    #[inline]
    pub(crate) fn contains(self, leg: usize) -> bool {
        self.0 & bit(leg) != 0
    }

    #[inline]
    pub(crate) fn insert(&mut self, leg: usize) {
        self.0 |= bit(leg);
    }

    #[inline]
    pub(crate) fn remove(&mut self, leg: usize) {
        self.0 &= !bit(leg);
    }

    /// The lowest slot in the set.
    #[inline]
    pub(crate) const fn first(self) -> Option<usize> {
        if self.0 == 0 {
            None
        } else {
            Some(self.0.trailing_zeros() as usize)
        }
    }

    /// The slots in the set, lowest first.
    #[inline]
    pub(crate) fn iter(self) -> Iter {
        Iter(self.0)
    }
}

#[inline]
fn bit(leg: usize) -> u32 {
    u32::try_from(leg)
        .ok()
        .and_then(|l| 1u32.checked_shl(l))
        .unwrap_or(0)
}

impl core::fmt::Debug for LegSet {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

impl core::ops::BitOr for LegSet {
    type Output = Self;
    #[inline]
    fn bitor(self, o: Self) -> Self {
        Self(self.0 | o.0)
    }
}

impl core::ops::BitOrAssign for LegSet {
    #[inline]
    fn bitor_assign(&mut self, o: Self) {
        self.0 |= o.0;
    }
}

impl core::ops::BitAnd for LegSet {
    type Output = Self;
    #[inline]
    fn bitand(self, o: Self) -> Self {
        Self(self.0 & o.0)
    }
}

/// The legs of `self` that are not in `o`.
impl core::ops::Sub for LegSet {
    type Output = Self;
    #[inline]
    fn sub(self, o: Self) -> Self {
        Self(self.0 & !o.0)
    }
}

impl core::ops::SubAssign for LegSet {
    #[inline]
    fn sub_assign(&mut self, o: Self) {
        self.0 &= !o.0;
    }
}

impl FromIterator<usize> for LegSet {
    fn from_iter<I: IntoIterator<Item = usize>>(it: I) -> Self {
        let mut s = Self::EMPTY;
        for leg in it {
            s.insert(leg);
        }
        s
    }
}

impl IntoIterator for LegSet {
    type Item = usize;
    type IntoIter = Iter;
    #[inline]
    fn into_iter(self) -> Iter {
        self.iter()
    }
}

/// The slots of a [`LegSet`], lowest first.
pub(crate) struct Iter(u32);

impl Iterator for Iter {
    type Item = usize;
    #[inline]
    fn next(&mut self) -> Option<usize> {
        if self.0 == 0 {
            return None;
        }
        let i = self.0.trailing_zeros() as usize;
        self.0 &= self.0 - 1;
        Some(i)
    }
}

#[cfg(test)]
mod tests {
    use super::LegSet;

    #[test]
    fn set_operations() {
        let mut s = LegSet::EMPTY;
        assert!(s.is_empty());
        assert_eq!(s.first(), None);
        s.insert(3);
        s.insert(0);
        s.insert(31);
        assert!(s.contains(3) && s.contains(0) && s.contains(31) && !s.contains(1));
        assert_eq!(s.len(), 3);
        assert_eq!(s.first(), Some(0));
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![0, 3, 31]);
        s.remove(0);
        assert_eq!(s.first(), Some(3));
        let t: LegSet = [3usize, 5].into_iter().collect();
        assert_eq!((s & t).iter().collect::<Vec<_>>(), vec![3]);
        assert_eq!((s - t).iter().collect::<Vec<_>>(), vec![31]);
        assert_eq!((s | t).len(), 3);
        assert_eq!(format!("{t:?}"), "{3, 5}");
    }

    #[test]
    fn out_of_range_slots_are_never_members() {
        let mut s = LegSet::one(32);
        assert!(s.is_empty());
        s.insert(usize::MAX);
        assert!(s.is_empty() && !s.contains(40));
        s.remove(64);
        assert_eq!(s, LegSet::EMPTY);
    }
}
