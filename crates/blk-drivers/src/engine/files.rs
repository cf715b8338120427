//! [`EngineFiles`]: the descriptors an engine does its I/O on.

use std::fs::File;

use blkq_sync::atomic::AtomicBool;

use crate::fd_io::FileIo;

/// The descriptors an engine works on: a buffered one and, optionally, an `O_DIRECT` one
/// used for 4096-aligned transfers (see [`crate::backend::file`]). Made by
/// [`crate::backend::FileBackend::engine_files`] or [`EngineFiles::new`].
#[derive(Debug)]
pub struct EngineFiles {
    pub(super) io: FileIo,
}

impl EngineFiles {
    /// From open files; `direct`, if any, must be the same file opened with `O_DIRECT`.
    pub fn new(buffered: File, direct: Option<File>) -> EngineFiles {
        EngineFiles {
            io: FileIo {
                buffered,
                direct,
                direct_ok: AtomicBool::new(true),
                dsync_ok: AtomicBool::new(true),
            },
        }
    }

    pub(crate) fn from_io(io: FileIo) -> EngineFiles {
        EngineFiles { io }
    }
}
