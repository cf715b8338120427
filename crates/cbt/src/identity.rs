//! Which image a sidecar belongs to: the image's size and a UUID the image itself carries.
//!
//! For a `file:` image the UUID lives in the image's extended attribute `user.blkq.cbt`
//! (16 bytes), written when its first bitmap is made. An attribute follows the file through
//! renames and `cp --preserve=xattr`/`rsync -X`, and is gone from a file that was replaced by
//! another one (a restore, `qemu-img convert`, `mv other image`): exactly the cases where a
//! sidecar must stop matching, which device and inode numbers get wrong (they change on a copy
//! of the same data, and may be reused by another file). The attribute also tells that the
//! image had bitmaps, so a sidecar that has gone missing is noticed rather than replaced by an
//! empty one.
//!
//! On a file system without user extended attributes the UUID is made from the device and
//! inode numbers instead (said in the log), and a missing sidecar can no longer be told from
//! one that never existed. A mirror's identity is its array UUID; a memory device's is its
//! size alone.

use std::path::Path;

use crate::sidecar::Identity;

/// The attribute holding the UUID.
pub const XATTR: &str = "user.blkq.cbt";

/// What an image says about its identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageId {
    /// Size and UUID.
    pub ident: Identity,
    /// Whether the image is marked as having bitmaps (its attribute exists), so a missing
    /// sidecar is an error.
    pub marked: bool,
    /// Whether the UUID lives in the attribute (`false`: made from device and inode).
    pub in_xattr: bool,
}

fn cpath(p: &Path) -> std::io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other)
}

fn xattr_name() -> std::ffi::CString {
    std::ffi::CString::new(XATTR).expect("no NUL in the name")
}

/// Reads the identity of the image file at `path`, of `size` bytes. A new UUID (not yet
/// stored: see [`mark`]) when the image has none.
pub fn of_file(path: &Path, size: u64) -> std::io::Result<ImageId> {
    let c = cpath(path)?;
    let name = xattr_name();
    let mut uuid = [0u8; 16];
    // SAFETY: `c` and `name` are NUL-terminated strings that outlive the call; `uuid` is a
    // writable buffer of the length passed.
    let n = unsafe {
        libc::getxattr(
            c.as_ptr(),
            name.as_ptr(),
            uuid.as_mut_ptr().cast(),
            uuid.len(),
        )
    };
    if n == 16 {
        return Ok(ImageId {
            ident: Identity { size, uuid },
            marked: true,
            in_xattr: true,
        });
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::ENODATA) => Ok(ImageId {
            ident: Identity {
                size,
                uuid: *uuid::Uuid::new_v4().as_bytes(),
            },
            marked: false,
            in_xattr: true,
        }),
        Some(libc::ENOTSUP) => {
            use std::os::unix::fs::MetadataExt;
            let m = std::fs::metadata(path)?;
            let mut u = [0u8; 16];
            u[..8].copy_from_slice(&m.dev().to_le_bytes());
            u[8..].copy_from_slice(&m.ino().to_le_bytes());
            Ok(ImageId {
                ident: Identity { size, uuid: u },
                marked: false,
                in_xattr: false,
            })
        }
        _ if n >= 0 => Err(std::io::Error::other(format!(
            "{}: attribute {XATTR} has {n} bytes, not 16",
            path.display()
        ))),
        _ => Err(err),
    }
}

/// Stores the UUID of `id` in the image's attribute (when it lives there).
pub fn mark(path: &Path, id: &ImageId) -> std::io::Result<()> {
    if !id.in_xattr {
        return Ok(());
    }
    let c = cpath(path)?;
    let name = xattr_name();
    // SAFETY: as in `of_file`; `value` is readable for its length.
    let rc = unsafe {
        libc::setxattr(
            c.as_ptr(),
            name.as_ptr(),
            id.ident.uuid.as_ptr().cast(),
            id.ident.uuid.len(),
            0,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_file_gets_a_uuid_once_marked_and_keeps_it() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("img");
        std::fs::write(&p, [0u8; 4096]).unwrap();
        let a = of_file(&p, 4096).unwrap();
        assert!(!a.marked);
        let b = of_file(&p, 4096).unwrap();
        if a.in_xattr {
            assert_ne!(
                a.ident.uuid, b.ident.uuid,
                "not stored yet: a new one each time"
            );
        }
        mark(&p, &a).unwrap();
        let c = of_file(&p, 4096).unwrap();
        if a.in_xattr {
            assert!(c.marked);
            assert_eq!(c.ident.uuid, a.ident.uuid);
            // A file put in its place is another image.
            std::fs::write(d.path().join("other"), [0u8; 4096]).unwrap();
            std::fs::rename(d.path().join("other"), &p).unwrap();
            let e = of_file(&p, 4096).unwrap();
            assert!(!e.marked);
            assert_ne!(e.ident.uuid, a.ident.uuid);
        }
    }
}
