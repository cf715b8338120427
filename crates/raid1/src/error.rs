//! [`Raid1Error`]: the errors of building and managing an array (a leaf: the options, the
//! start-up and the leg management all return it).

use blk::Error;

use crate::bitmap::BitmapError;
use crate::superblock::SuperblockError;

/// Errors building or managing a [`Raid1`](crate::Raid1).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Raid1Error {
    /// A leg's I/O failed.
    #[error("leg {leg}: {source}")]
    Leg {
        /// Slot.
        leg: usize,
        /// Why.
        source: Error,
    },
    /// Superblock problem.
    #[error(transparent)]
    Superblock(#[from] SuperblockError),
    /// Bitmap problem.
    #[error(transparent)]
    Bitmap(#[from] BitmapError),
    /// A bad configuration.
    #[error("{0}")]
    Config(String),
    /// No such slot, or the slot is in the wrong state for the operation.
    #[error("slot {0}: {1}")]
    Slot(usize, &'static str),
    /// The sync thread cannot take the request now.
    #[error("sync busy: {0}")]
    Busy(&'static str),
    /// The array has failed (see [`Raid1::failure`](crate::Raid1::failure)): its state no longer changes, since no
    /// superblock can record the change; stop it and assemble it again.
    #[error(
        "the array has failed ({0}): its legs no longer change; stop it and assemble it again"
    )]
    Failed(&'static str),
    /// The legs given to [`Raid1::assemble`](crate::Raid1::assemble) do not form one array.
    #[error(transparent)]
    Assembly(#[from] crate::placement::AssemblyError),
    /// A leg offered to [`Raid1::add_leg`](crate::Raid1::add_leg) went on without this array (see
    /// [`crate::generation`]): it holds writes the array lacks.
    #[error(
        "the leg's history {} the array's (leg at generation {leg:016x}, array at {array:016x}): \
         it ran without this array and holds writes the array lacks; refusing to overwrite \
         them: add it with --discard (add_leg_discarding) to discard them, which copies only \
         the chunks either side changed",
        if *.newer { "is newer than" } else { "diverged from" }
    )]
    Diverged {
        /// The leg's current generation.
        leg: u64,
        /// The array's current generation.
        array: u64,
        /// The array's generation is an earlier point of the leg's history (the leg is
        /// newer), rather than another branch.
        newer: bool,
    },
}
