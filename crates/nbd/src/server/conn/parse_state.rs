//! What a parse pass of the reader (`reader.rs`) leaves for the reader loop (`mod.rs`): why
//! it stopped, and the write whose payload is still arriving.

use super::inflight::InFlight;

/// A write whose payload is still arriving: its bios are in `Connection::write_bios`, its
/// entry here.
#[derive(Debug)]
pub(super) struct PartialWrite {
    pub(super) entry: InFlight,
    /// The bio being filled, and bytes of its buffer already filled.
    pub(super) bio: usize,
    pub(super) filled: usize,
    /// Payload bytes still to read.
    pub(super) remaining: u64,
    /// Received into the device at this offset (`home.rs`), with no bios; `None`: into the
    /// bios' buffers.
    pub(super) home: Option<u64>,
}

impl PartialWrite {
    /// Bytes of the memory budget the write holds.
    pub(super) fn budget_bytes(&self) -> u64 {
        self.entry.budget_bytes
    }
}

/// Why a parse pass stopped.
pub(super) enum ParseStop {
    /// The buffer holds no whole request: read more.
    NeedMore,
    /// The slots or the byte budget are taken: submit, wait, go on.
    Full,
    /// A write payload continues past the buffer: read it straight into its buffers.
    PartialWrite,
    /// The next request's payload (this many bytes) does not fit in the global memory
    /// budget: wait for room, then parse again.
    NoBudget(u64),
    /// `NBD_CMD_DISC`.
    Disconnect,
    /// The stream is out of step or the client broke a hard rule: close.
    Fatal(String),
}
