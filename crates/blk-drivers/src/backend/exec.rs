//! Running a bio on a backend: the one place that maps a bio's operation and flags to
//! [`Backend`]'s calls, for every backend-based driver.

use blk::{Bio, BioFlags, Error, Op};

use super::store::Backend;

/// Executes a bio on a backend, synchronously. Shared by every backend-based driver.
///
/// FUA: a write passes it to [`Backend::write_at`] (which makes just that write durable); a
/// discard or write-zeroes, which have no such flag of their own (`fallocate` has none), is
/// followed by [`Backend::flush`] before it completes: the same `fdatasync` a FUA write
/// falls back to where `RWF_DSYNC` is refused.
pub fn exec_on_backend(be: &dyn Backend, bio: &mut Bio) -> Result<(), Error> {
    let off = bio.offset();
    let len = bio.len as usize;
    let fua = bio.flags.contains(BioFlags::FUA);
    match bio.op {
        Op::Read => {
            let buf = bio.buf.as_mut().ok_or(Error::NoBuffer)?;
            be.read_at(off, &mut buf.as_mut_slice()[..len])?;
        }
        Op::Write => {
            let buf = bio.buf.as_ref().ok_or(Error::NoBuffer)?;
            be.write_at(off, &buf.as_slice()[..len], fua)?;
        }
        Op::Flush => be.flush()?,
        Op::Discard => {
            be.discard(off, len as u64)?;
            if fua {
                be.flush()?;
            }
        }
        Op::WriteZeroes => {
            if bio.flags.contains(BioFlags::FAST_ZERO) && !be.fast_zero() {
                return Err(Error::NotSupported("fast zero"));
            }
            be.write_zeroes(off, len as u64, !bio.flags.contains(BioFlags::NO_HOLE))?;
            if fua {
                be.flush()?;
            }
        }
    }
    Ok(())
}
