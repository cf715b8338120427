//! The crash model's state: the undo log of the writes not yet durable ([`State`], under
//! `FaultState::state`; `cache` keeps it and rolls it back).

use blk::Buffer;

/// The old contents of one not yet durable write's range.
pub(super) struct UndoEntry {
    pub(super) id: u64,
    pub(super) offset: u64,
    /// The old contents, in chunks of at most the inner device's max I/O.
    pub(super) chunks: Vec<Buffer>,
    /// Acknowledgement number, once acknowledged.
    pub(super) acked: Option<u64>,
}

/// The crash model's state, under `FaultState::state`.
#[derive(Default)]
pub(super) struct State {
    pub(super) crashed: bool,
    pub(super) epoch: u64,
    /// I/Os forwarded to the inner device and not completed.
    pub(super) in_flight: u64,
    /// Acknowledgements of entries so far.
    pub(super) acks: u64,
    pub(super) next_undo: u64,
    pub(super) undo: Vec<UndoEntry>,
}
