//! Sector stamps: every sector a simulator writes carries (write id, sector number) and a
//! pattern derived from both, so a read tells which write, if any, put each sector there, and
//! whether it belongs to another offset or is torn.

/// Bytes in a sector.
pub const SECTOR: usize = 512;

const MAGIC: u64 = 0x5349_4d5f_464c_5553; // "SIM_FLUS"

/// Fills one sector with write `id`'s data for sector `sector`: magic, id, sector, then a
/// pattern derived from both.
pub fn stamp_sector(out: &mut [u8], id: u64, sector: u64) {
    out[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    out[8..16].copy_from_slice(&id.to_le_bytes());
    out[16..24].copy_from_slice(&sector.to_le_bytes());
    let mut x = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ sector.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    for w in out[24..].chunks_exact_mut(8) {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        w.copy_from_slice(&x.to_le_bytes());
    }
}

/// What a sector read back holds: `Ok(0)` zeros, `Ok(id)` write `id`'s data for this sector,
/// `Err` anything else (described).
pub fn decode_sector(data: &[u8], sector: u64) -> Result<u64, String> {
    if data.iter().all(|&b| b == 0) {
        return Ok(0);
    }
    let word = |i: usize| u64::from_le_bytes(data[i..i + 8].try_into().unwrap_or([0; 8]));
    if word(0) != MAGIC {
        return Err("bytes no write of this run produced".into());
    }
    let (id, at) = (word(8), word(16));
    if at != sector {
        return Err(format!(
            "write {id}'s data for sector {at}: another offset's bytes"
        ));
    }
    let mut want = [0u8; SECTOR];
    stamp_sector(&mut want, id, sector);
    if data != want {
        return Err(format!(
            "write {id}'s header over other bytes: a torn sector"
        ));
    }
    Ok(id)
}
