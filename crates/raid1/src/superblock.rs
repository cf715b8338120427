//! The per-leg superblock (md's 1.2 placement: 4 KiB from the start of the leg).
//!
//! Leg layout:
//!
//! ```text
//! 0        4 KiB       8 KiB                                                  data_offset (1 MiB aligned)
//! | unused | superblock | write-intent bitmap (header+bits) | checksums, if any | data ... |
//! ```
//!
//! The superblock is one 4 KiB block of explicit little-endian fields, checksummed with
//! crc32c over everything but the last 4 bytes, which hold the checksum. Decoding a foreign or
//! corrupt block returns a [`SuperblockError`]; it never panics. Every state change bumps
//! `events`; on assembly the leg with the highest `events` is the most recent.
//!
//! | offset | size | field                                                    |
//! |--------|------|----------------------------------------------------------|
//! | 0      | 8    | magic `b"BLKQRAD1"`                                      |
//! | 8      | 4    | version (1)                                              |
//! | 12     | 4    | number of legs (slots) in the array, <= [`MAX_LEGS`]     |
//! | 16     | 16   | array UUID                                               |
//! | 32     | 16   | this leg's UUID                                          |
//! | 48     | 4    | role: slot number, or `u32::MAX` for a spare             |
//! | 52     | 4    | array state: 0 clean, 1 active, 2 degraded               |
//! | 56     | 8    | data offset, bytes                                       |
//! | 64     | 8    | data size, bytes                                         |
//! | 72     | 8    | events                                                   |
//! | 80     | 8    | bitmap offset, bytes from the start of the leg           |
//! | 88     | 8    | bitmap length, bytes                                     |
//! | 96     | 8    | bitmap chunk size, bytes                                 |
//! | 104    | 8    | current generation (0: none recorded; see [`crate::generation`]) |
//! | 112    | 8    | events at which the current generation began            |
//! | 120    | 4    | number of earlier generations, <= [`HISTORY`]           |
//! | 128    | 32*n | per slot: leg UUID (16), state bits (4), 0 (4), recovery offset (8) |
//! | 1152   | 16*h | earlier generations, newest first: id (8), events at which it began (8) |
//! | 2048   | 4    | per-block checksums: 0 none, 1 crc32c (see [`crate::integrity`]) |
//! | 2052   | 4    | 0                                                        |
//! | 2056   | 8    | checksum area offset, bytes from the start of the leg (0: none) |
//! | 2064   | 8    | checksum area length, bytes                              |
//! | 4092   | 4    | crc32c of bytes 0..4092                                  |

use uuid::Uuid;

use crate::generation::{Generation, Lineage, HISTORY};
use crate::integrity::{area_len, Algorithm, ChecksumArea};

/// Byte offset of the superblock on a leg.
pub const SB_OFFSET: u64 = 4096;
/// Size of the superblock block.
pub const SB_SIZE: usize = 4096;
/// Byte offset of the write-intent bitmap on a leg (right after the superblock).
pub const BITMAP_OFFSET: u64 = SB_OFFSET + SB_SIZE as u64;
/// Data starts at a multiple of this.
pub const DATA_ALIGN: u64 = 1 << 20;
/// Most slots in an array.
pub const MAX_LEGS: usize = 32;
/// The magic.
pub const MAGIC: [u8; 8] = *b"BLKQRAD1";
/// The superblock format version.
pub const VERSION: u32 = 1;

const LEGS_AT: usize = 128;
const LEG_ENTRY: usize = 32;
const CRC_AT: usize = SB_SIZE - 4;
const HISTORY_AT: usize = LEGS_AT + MAX_LEGS * LEG_ENTRY;
const GENERATION: usize = 16;
const INTEGRITY_AT: usize = 2048;

const ST_IN_SYNC: u32 = 1;
const ST_FAULTY: u32 = 2;
const ST_WRITE_MOSTLY: u32 = 4;
const ST_RECOVERING: u32 = 8;
const ST_KNOWN: u32 = ST_IN_SYNC | ST_FAULTY | ST_WRITE_MOSTLY | ST_RECOVERING;

/// Why a block is not a valid superblock.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SuperblockError {
    /// Shorter than a superblock.
    #[error("superblock buffer is {0} bytes, need {SB_SIZE}")]
    TooShort(usize),
    /// Not a blkq raid1 superblock.
    #[error("no raid1 superblock (bad magic)")]
    BadMagic,
    /// A format this code does not know.
    #[error("unsupported raid1 superblock version {0}")]
    UnsupportedVersion(u32),
    /// The checksum does not match: the block is corrupt.
    #[error("superblock checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    BadChecksum {
        /// In the block.
        stored: u32,
        /// Over the block.
        computed: u32,
    },
    /// A field is out of range.
    #[error("invalid superblock: {0}")]
    Invalid(&'static str),
}

/// A leg's role in the array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Holds slot `n` (0-based).
    Slot(u32),
    /// A spare, not in a slot.
    Spare,
}

/// The state of the whole array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArrayState {
    /// Cleanly stopped: no resync needed (the in-sync legs agree; a recovering leg agrees
    /// below its recovery offset), degraded or not.
    Clean,
    /// Running (writes may be in flight).
    Active,
    /// Running with a slot missing or faulty.
    Degraded,
}

/// The state of one slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LegInfo {
    /// The UUID of the leg in the slot (nil: empty slot).
    pub uuid: Uuid,
    /// Holds all data.
    pub in_sync: bool,
    /// Failed; not read nor written.
    pub faulty: bool,
    /// Read only when no other leg can serve.
    pub write_mostly: bool,
    /// Being recovered; data below this byte offset (of the array) is in sync.
    pub recovery_offset: Option<u64>,
}

/// Where the write-intent bitmap is on the leg.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BitmapLocation {
    /// Byte offset from the start of the leg.
    pub offset: u64,
    /// Length in bytes (header + bits).
    pub len: u64,
    /// Bytes of array data per bit.
    pub chunk_size: u64,
}

/// One leg's superblock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    /// The array's UUID (the same on every leg).
    pub array_uuid: Uuid,
    /// This leg's UUID.
    pub leg_uuid: Uuid,
    /// This leg's role.
    pub role: Role,
    /// Array state.
    pub array_state: ArrayState,
    /// Where data starts on the leg, bytes.
    pub data_offset: u64,
    /// Bytes of data (the array's capacity).
    pub data_size: u64,
    /// Bumped on every state change.
    pub events: u64,
    /// The bitmap.
    pub bitmap: BitmapLocation,
    /// Per slot.
    pub legs: Vec<LegInfo>,
    /// The array's history as this leg last knew it (see [`crate::generation`]).
    pub lineage: Lineage,
    /// Per-block checksums, if the array keeps them.
    pub integrity: Option<ChecksumArea>,
}

impl std::fmt::Display for Superblock {
    /// One line for logs and reports: role, events, state, and each slot's view.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} events {} {} {:?} legs {:?}",
            self.role, self.events, self.lineage, self.array_state, self.legs
        )
    }
}

/// The layout of a leg of `leg_size` bytes with a bitmap of `chunk_size` bytes per bit:
/// (bitmap location, data offset, data size). Errors if the leg is too small.
pub fn layout(
    leg_size: u64,
    chunk_size: u64,
) -> Result<(BitmapLocation, u64, u64), SuperblockError> {
    layout_with(leg_size, chunk_size, None).map(|(bm, _, off, size)| (bm, off, size))
}

/// [`layout`] with room for per-block checksums after the bitmap when `integrity` is
/// given: (bitmap, checksum area, data offset, data size).
pub fn layout_with(
    leg_size: u64,
    chunk_size: u64,
    integrity: Option<Algorithm>,
) -> Result<(BitmapLocation, Option<ChecksumArea>, u64, u64), SuperblockError> {
    if chunk_size == 0 || !chunk_size.is_power_of_two() || chunk_size < 4096 {
        return Err(SuperblockError::Invalid("bitmap chunk size"));
    }
    // Bits for the whole leg (an upper bound for the data part), in 4 KiB blocks after a
    // 4 KiB header.
    let chunks = leg_size.div_ceil(chunk_size);
    let len = 4096 + chunks.div_ceil(8).next_multiple_of(4096);
    // Sums for every block of the whole leg (again an upper bound).
    let sums = integrity.map(|algorithm| ChecksumArea {
        algorithm,
        offset: BITMAP_OFFSET + len,
        len: area_len(leg_size),
    });
    let meta_end = sums.map_or(BITMAP_OFFSET + len, |a| a.offset + a.len);
    let data_offset = meta_end.next_multiple_of(DATA_ALIGN);
    if leg_size <= data_offset {
        return Err(SuperblockError::Invalid("leg too small"));
    }
    let bm = BitmapLocation {
        offset: BITMAP_OFFSET,
        len,
        chunk_size,
    };
    Ok((bm, sums, data_offset, leg_size - data_offset))
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
fn get_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}
fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}
fn get_uuid(b: &[u8], at: usize) -> Uuid {
    let mut a = [0u8; 16];
    a.copy_from_slice(&b[at..at + 16]);
    Uuid::from_bytes(a)
}

impl Superblock {
    /// Superblocks for a new array of `nr_legs` legs of `leg_size` bytes each (the smallest
    /// leg), all in sync, fresh random UUIDs, state clean, `events` 1.
    pub fn new_array(
        nr_legs: usize,
        leg_size: u64,
        chunk_size: u64,
    ) -> Result<Vec<Superblock>, SuperblockError> {
        Self::new_array_with(nr_legs, leg_size, chunk_size, None)
    }

    /// [`Superblock::new_array`] keeping per-block checksums when `integrity` is given.
    pub fn new_array_with(
        nr_legs: usize,
        leg_size: u64,
        chunk_size: u64,
        integrity: Option<Algorithm>,
    ) -> Result<Vec<Superblock>, SuperblockError> {
        if nr_legs == 0 || nr_legs > MAX_LEGS {
            return Err(SuperblockError::Invalid("number of legs"));
        }
        let (bitmap, integrity, data_offset, data_size) =
            layout_with(leg_size, chunk_size, integrity)?;
        let array_uuid = Uuid::new_v4();
        let lineage = Lineage::new_at(1);
        let legs: Vec<LegInfo> = (0..nr_legs)
            .map(|_| LegInfo {
                uuid: Uuid::new_v4(),
                in_sync: true,
                ..LegInfo::default()
            })
            .collect();
        Ok((0..nr_legs)
            .map(|i| Superblock {
                array_uuid,
                leg_uuid: legs[i].uuid,
                role: Role::Slot(i as u32),
                array_state: ArrayState::Clean,
                data_offset,
                data_size,
                events: 1,
                bitmap,
                legs: legs.clone(),
                lineage: lineage.clone(),
                integrity,
            })
            .collect())
    }

    /// Records a state change.
    pub fn bump_events(&mut self) {
        self.events = self.events.wrapping_add(1);
    }

    /// Encodes into a new 4 KiB block.
    pub fn encode(&self) -> Result<Vec<u8>, SuperblockError> {
        let mut b = vec![0u8; SB_SIZE];
        self.encode_into(&mut b)?;
        Ok(b)
    }

    /// Encodes into `b` (at least [`SB_SIZE`] bytes; only the first [`SB_SIZE`] are written).
    pub fn encode_into(&self, b: &mut [u8]) -> Result<(), SuperblockError> {
        if b.len() < SB_SIZE {
            return Err(SuperblockError::TooShort(b.len()));
        }
        if self.legs.len() > MAX_LEGS {
            return Err(SuperblockError::Invalid("number of legs"));
        }
        if self.lineage.history.len() > HISTORY {
            return Err(SuperblockError::Invalid("generation history"));
        }
        let b = &mut b[..SB_SIZE];
        b.fill(0);
        b[0..8].copy_from_slice(&MAGIC);
        put_u32(b, 8, VERSION);
        put_u32(b, 12, self.legs.len() as u32);
        b[16..32].copy_from_slice(self.array_uuid.as_bytes());
        b[32..48].copy_from_slice(self.leg_uuid.as_bytes());
        put_u32(
            b,
            48,
            match self.role {
                Role::Slot(n) => n,
                Role::Spare => u32::MAX,
            },
        );
        put_u32(
            b,
            52,
            match self.array_state {
                ArrayState::Clean => 0,
                ArrayState::Active => 1,
                ArrayState::Degraded => 2,
            },
        );
        put_u64(b, 56, self.data_offset);
        put_u64(b, 64, self.data_size);
        put_u64(b, 72, self.events);
        put_u64(b, 80, self.bitmap.offset);
        put_u64(b, 88, self.bitmap.len);
        put_u64(b, 96, self.bitmap.chunk_size);
        put_u64(b, 104, self.lineage.current.id);
        put_u64(b, 112, self.lineage.current.since);
        put_u32(b, 120, self.lineage.history.len() as u32);
        for (i, g) in self.lineage.history.iter().enumerate() {
            let at = HISTORY_AT + i * GENERATION;
            put_u64(b, at, g.id);
            put_u64(b, at + 8, g.since);
        }
        if let Some(a) = self.integrity {
            put_u32(b, INTEGRITY_AT, a.algorithm.code());
            put_u64(b, INTEGRITY_AT + 8, a.offset);
            put_u64(b, INTEGRITY_AT + 16, a.len);
        }
        for (i, l) in self.legs.iter().enumerate() {
            let at = LEGS_AT + i * LEG_ENTRY;
            b[at..at + 16].copy_from_slice(l.uuid.as_bytes());
            let mut st = 0;
            if l.in_sync {
                st |= ST_IN_SYNC;
            }
            if l.faulty {
                st |= ST_FAULTY;
            }
            if l.write_mostly {
                st |= ST_WRITE_MOSTLY;
            }
            if l.recovery_offset.is_some() {
                st |= ST_RECOVERING;
            }
            put_u32(b, at + 16, st);
            put_u64(b, at + 24, l.recovery_offset.unwrap_or(0));
        }
        let crc = crc32c::crc32c(&b[..CRC_AT]);
        put_u32(b, CRC_AT, crc);
        Ok(())
    }

    /// Decodes a block read from [`SB_OFFSET`].
    pub fn decode(b: &[u8]) -> Result<Self, SuperblockError> {
        if b.len() < SB_SIZE {
            return Err(SuperblockError::TooShort(b.len()));
        }
        let b = &b[..SB_SIZE];
        if b[0..8] != MAGIC {
            return Err(SuperblockError::BadMagic);
        }
        let stored = get_u32(b, CRC_AT);
        let computed = crc32c::crc32c(&b[..CRC_AT]);
        if stored != computed {
            return Err(SuperblockError::BadChecksum { stored, computed });
        }
        let version = get_u32(b, 8);
        if version != VERSION {
            return Err(SuperblockError::UnsupportedVersion(version));
        }
        let nr = get_u32(b, 12) as usize;
        if nr > MAX_LEGS {
            return Err(SuperblockError::Invalid("number of legs"));
        }
        let role = match get_u32(b, 48) {
            u32::MAX => Role::Spare,
            n if (n as usize) < nr => Role::Slot(n),
            _ => return Err(SuperblockError::Invalid("role slot out of range")),
        };
        let array_state = match get_u32(b, 52) {
            0 => ArrayState::Clean,
            1 => ArrayState::Active,
            2 => ArrayState::Degraded,
            _ => return Err(SuperblockError::Invalid("array state")),
        };
        let mut legs = Vec::with_capacity(nr);
        for i in 0..nr {
            let at = LEGS_AT + i * LEG_ENTRY;
            let st = get_u32(b, at + 16);
            if st & !ST_KNOWN != 0 || get_u32(b, at + 20) != 0 {
                return Err(SuperblockError::Invalid("leg state bits"));
            }
            let off = get_u64(b, at + 24);
            let recovery_offset = if st & ST_RECOVERING != 0 {
                Some(off)
            } else if off != 0 {
                return Err(SuperblockError::Invalid("recovery offset without recovery"));
            } else {
                None
            };
            legs.push(LegInfo {
                uuid: get_uuid(b, at),
                in_sync: st & ST_IN_SYNC != 0,
                faulty: st & ST_FAULTY != 0,
                write_mostly: st & ST_WRITE_MOSTLY != 0,
                recovery_offset,
            });
        }
        let nr_history = get_u32(b, 120) as usize;
        if nr_history > HISTORY || get_u32(b, 124) != 0 {
            return Err(SuperblockError::Invalid("generation history"));
        }
        let generation = |at: usize| Generation {
            id: get_u64(b, at),
            since: get_u64(b, at + 8),
        };
        let lineage = Lineage {
            current: generation(104),
            history: (0..nr_history)
                .map(|i| generation(HISTORY_AT + i * GENERATION))
                .collect(),
        };
        let (offset, len) = (get_u64(b, INTEGRITY_AT + 8), get_u64(b, INTEGRITY_AT + 16));
        let integrity = match get_u32(b, INTEGRITY_AT) {
            _ if get_u32(b, INTEGRITY_AT + 4) != 0 => {
                return Err(SuperblockError::Invalid("integrity fields"))
            }
            0 if offset == 0 && len == 0 => None,
            1 if offset % 4096 == 0 && len % 4096 == 0 && offset > 0 => Some(ChecksumArea {
                algorithm: Algorithm::Crc32c,
                offset,
                len,
            }),
            _ => return Err(SuperblockError::Invalid("integrity algorithm or area")),
        };
        Ok(Superblock {
            integrity,
            array_uuid: get_uuid(b, 16),
            leg_uuid: get_uuid(b, 32),
            role,
            array_state,
            data_offset: get_u64(b, 56),
            data_size: get_u64(b, 64),
            events: get_u64(b, 72),
            bitmap: BitmapLocation {
                offset: get_u64(b, 80),
                len: get_u64(b, 88),
                chunk_size: get_u64(b, 96),
            },
            legs,
            lineage,
        })
    }
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn new_array_layout_and_round_trip() {
        let sbs = Superblock::new_array(2, 1 << 30, 64 << 20).unwrap();
        assert_eq!(sbs.len(), 2);
        assert_eq!(sbs[0].array_uuid, sbs[1].array_uuid);
        assert_ne!(sbs[0].leg_uuid, sbs[1].leg_uuid);
        assert_eq!(sbs[0].data_offset % DATA_ALIGN, 0);
        assert!(sbs[0].data_offset >= sbs[0].bitmap.offset + sbs[0].bitmap.len);
        for sb in &sbs {
            assert_eq!(&Superblock::decode(&sb.encode().unwrap()).unwrap(), sb);
        }
    }

    #[test]
    fn foreign_and_short_blocks_are_refused() {
        assert_eq!(
            Superblock::decode(&[0u8; 100]),
            Err(SuperblockError::TooShort(100))
        );
        assert_eq!(
            Superblock::decode(&[0u8; SB_SIZE]),
            Err(SuperblockError::BadMagic)
        );
        let mut b = vec![0u8; SB_SIZE];
        b[..8].copy_from_slice(&MAGIC);
        assert!(matches!(
            Superblock::decode(&b),
            Err(SuperblockError::BadChecksum { .. })
        ));
        assert!(layout(1 << 20, 64 << 20).is_err());
        assert!(layout(1 << 30, 1000).is_err());
    }

    fn arb_leg() -> impl Strategy<Value = LegInfo> {
        (
            any::<u128>(),
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            proptest::option::of(any::<u64>()),
        )
            .prop_map(
                |(u, in_sync, faulty, write_mostly, recovery_offset)| LegInfo {
                    uuid: Uuid::from_u128(u),
                    in_sync,
                    faulty,
                    write_mostly,
                    recovery_offset,
                },
            )
    }

    fn arb_sb() -> impl Strategy<Value = Superblock> {
        (
            proptest::collection::vec(arb_leg(), 1..=MAX_LEGS),
            any::<(u128, u128)>(),
            any::<(u32, bool, u8)>(),
            any::<(u64, u64, u64)>(),
            any::<(u64, u64, u64)>(),
            (
                any::<(u64, u64)>(),
                proptest::collection::vec(any::<(u64, u64)>(), 0..=HISTORY),
            ),
            proptest::option::of((1u64..1 << 40, 0u64..1 << 30)),
        )
            .prop_map(
                |(legs, (a, l), (slot, spare, st), (d, s, e), (bo, bl, bc), (cur, hist), sums)| {
                    Superblock {
                        integrity: sums.map(|(o, n)| ChecksumArea {
                            algorithm: Algorithm::Crc32c,
                            offset: o * 4096,
                            len: n * 4096,
                        }),
                        array_uuid: Uuid::from_u128(a),
                        leg_uuid: Uuid::from_u128(l),
                        role: if spare {
                            Role::Spare
                        } else {
                            Role::Slot(slot % legs.len() as u32)
                        },
                        array_state: match st % 3 {
                            0 => ArrayState::Clean,
                            1 => ArrayState::Active,
                            _ => ArrayState::Degraded,
                        },
                        data_offset: d,
                        data_size: s,
                        events: e,
                        bitmap: BitmapLocation {
                            offset: bo,
                            len: bl,
                            chunk_size: bc,
                        },
                        legs,
                        lineage: Lineage {
                            current: Generation {
                                id: cur.0,
                                since: cur.1,
                            },
                            history: hist
                                .into_iter()
                                .map(|(id, since)| Generation { id, since })
                                .collect(),
                        },
                    }
                },
            )
    }

    proptest! {
        #[test]
        fn decode_encode_round_trips(sb in arb_sb()) {
            let b = sb.encode().unwrap();
            prop_assert_eq!(Superblock::decode(&b).unwrap(), sb);
        }

        #[test]
        fn any_flipped_byte_is_refused(sb in arb_sb(), at in 0..SB_SIZE, x in 1u8..=255) {
            let mut b = sb.encode().unwrap();
            b[at] ^= x;
            prop_assert!(Superblock::decode(&b).is_err());
        }

        #[test]
        fn random_blocks_never_panic(b in proptest::collection::vec(any::<u8>(), 0..5000)) {
            let _ = Superblock::decode(&b);
        }
    }
}
