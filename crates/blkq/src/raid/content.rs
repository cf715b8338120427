//! Owns the question "does this leg hold data?", asked before a device becomes a leg (`blkq
//! raid create`, `blkq serve --raid1-create`, `blkq raid add`): a known signature at its
//! place, else a non-zero byte in the region probed.
//!
//! The signatures are a small table (mdadm and wipefs ask libblkid; a Rust binding would bring
//! a C library for ten magic numbers). What is read is bounded: the region asked for, in
//! [`PIECE`]-byte reads, stopping at the first non-zero byte, so a sparse 10G file costs a
//! few reads. Zeros there do not prove the rest of the leg blank.

use anyhow::{Context, Result};
use blk::Device;

use super::legs::read_at;

/// The least a probe reads from the start of a leg: where partition tables and filesystems
/// keep their signatures (btrfs's superblock is at 64 KiB, ISO 9660's descriptors at 32 KiB,
/// ext4's at 1 KiB, ...).
pub const BLANK_PROBE: u64 = 128 << 10;
/// Bytes per read.
const PIECE: u64 = 128 << 10;

/// A format recognised by bytes at a fixed offset.
#[derive(Debug)]
pub struct Signature {
    /// Byte offset from the start of the device.
    pub at: u64,
    /// The bytes there.
    pub magic: &'static [u8],
    /// What they mean.
    pub what: &'static str,
}

/// The formats recognised, in the order they are tried (filesystems before the MBR boot
/// signature, which FAT and NTFS boot sectors carry too).
pub const SIGNATURES: &[Signature] = &[
    Signature {
        at: 0,
        magic: b"LUKS\xba\xbe",
        what: "a LUKS encrypted volume",
    },
    Signature {
        at: 0,
        magic: b"XFSB",
        what: "an XFS filesystem",
    },
    Signature {
        at: 1080,
        magic: &[0x53, 0xef],
        what: "an ext2/3/4 filesystem (magic 0xEF53 at byte 1080)",
    },
    Signature {
        at: 65600,
        magic: b"_BHRfS_M",
        what: "a btrfs filesystem",
    },
    Signature {
        at: 32769,
        magic: b"CD001",
        what: "an ISO 9660 filesystem",
    },
    Signature {
        at: 4086,
        magic: b"SWAPSPACE2",
        what: "a Linux swap area",
    },
    Signature {
        at: 4086,
        magic: b"SWAP-SPACE",
        what: "a Linux swap area",
    },
    Signature {
        at: 512,
        magic: b"EFI PART",
        what: "a GPT partition table",
    },
    Signature {
        at: 8192,
        magic: &raid1::bitmap::BITMAP_MAGIC,
        what: "a raid1 write-intent bitmap (a former leg whose superblock was erased)",
    },
    Signature {
        at: 510,
        magic: &[0x55, 0xaa],
        what: "an MBR partition table or boot sector (0x55AA at byte 510)",
    },
];

/// What a probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Held {
    /// Zeros wherever it read.
    Blank,
    /// A known format.
    Signature(&'static str),
    /// No known format, but a non-zero byte at this offset.
    Data(u64),
}

impl Held {
    /// What the leg holds, in words (`None`: blank where probed).
    pub fn describe(&self, probed: u64) -> Option<String> {
        match self {
            Held::Blank => None,
            Held::Signature(what) => Some(what.to_string()),
            Held::Data(at) => Some(format!(
                "a non-zero byte at offset {at}, within the first {} KiB",
                probed.div_ceil(1024)
            )),
        }
    }
}

/// The signature `head` (the device's first bytes) carries, if any.
pub fn signature(head: &[u8]) -> Option<&'static str> {
    SIGNATURES.iter().find_map(|s| {
        let at = s.at as usize;
        (head.get(at..at + s.magic.len()) == Some(s.magic)).then_some(s.what)
    })
}

/// Probes the first `len` bytes of `dev` (at least [`BLANK_PROBE`], at most its capacity):
/// a known signature, else the first non-zero byte. Returns what it found and how many bytes
/// it probed.
pub fn probe(dev: &dyn Device, len: u64) -> Result<(Held, u64)> {
    let len = len.max(BLANK_PROBE).min(dev.limits().capacity);
    let mut pos = 0;
    while pos < len {
        let n = PIECE.min(len - pos);
        let b = read_at(dev, pos, n as usize).with_context(|| format!("probing byte {pos}"))?;
        if pos == 0 {
            if let Some(what) = signature(&b) {
                return Ok((Held::Signature(what), len));
            }
        }
        if let Some(i) = b.iter().position(|&x| x != 0) {
            return Ok((Held::Data(pos + i as u64), len));
        }
        pos += n;
    }
    Ok((Held::Blank, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_are_found_at_their_place() {
        let mut head = vec![0u8; BLANK_PROBE as usize];
        assert_eq!(signature(&head), None);
        head[1080] = 0x53;
        head[1081] = 0xef;
        assert_eq!(
            signature(&head),
            Some("an ext2/3/4 filesystem (magic 0xEF53 at byte 1080)")
        );
        let mut head = vec![0u8; BLANK_PROBE as usize];
        head[510] = 0x55;
        head[511] = 0xaa;
        head[512..520].copy_from_slice(b"EFI PART");
        assert_eq!(signature(&head), Some("a GPT partition table"));
        // A head shorter than a signature's place is not that format.
        assert_eq!(signature(&head[..600]), Some("a GPT partition table"));
        assert_eq!(
            signature(&head[..515]),
            Some("an MBR partition table or boot sector (0x55AA at byte 510)")
        );
        for s in SIGNATURES {
            let mut head = vec![0u8; BLANK_PROBE as usize];
            head[s.at as usize..s.at as usize + s.magic.len()].copy_from_slice(s.magic);
            assert_eq!(signature(&head), Some(s.what), "{s:?}");
        }
    }
}
