//! Files blkq keeps beside the data it serves (a dirty-bitmap sidecar, a metrics address
//! file), written so that nobody else can redirect them. A server often runs as root in a
//! directory other users can write to (`/var/tmp`): a name there that a file of ours will take
//! can be taken first, by a link to a file the attacker could not write himself. So:
//!
//! - a replacement is written to a new file of an unpredictable name in the same directory,
//!   created `O_CREAT|O_EXCL|O_NOFOLLOW` (a file or link already there is never opened: another
//!   name is tried), synced, and renamed onto the path, which replaces whatever entry is there
//!   (a link itself, never its target) ([`replace`]);
//! - an existing file is opened `O_NOFOLLOW` and kept only if it is a regular file owned by
//!   this process's effective user ([`open_owned`]): a link, or a file another user planted, is
//!   refused with what it is named.

use std::fs::{File, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Attempts at an unused temporary name before giving up.
const ATTEMPTS: u32 = 64;

/// Replaces the file at `path` with a new one that `fill` writes (through the file it is
/// given, which is open for reading and writing): created beside `path` under an
/// unpredictable name that nothing can be planted at (see the module docs), with `mode`
/// (less the umask), synced, renamed onto `path`, and the directory synced. Returns the new
/// file, open. On an error the temporary file is removed and `path` is untouched.
pub fn replace(
    path: &Path,
    mode: u32,
    fill: impl FnOnce(&File) -> io::Result<()>,
) -> io::Result<File> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::other("the path must end in a file name"))?
        .to_string_lossy();
    let (f, tmp) = create_unique(dir, &name, mode)?;
    let done = fill(&f)
        .and_then(|()| f.sync_all())
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = done {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    File::open(dir).and_then(|d| d.sync_all())?;
    Ok(f)
}

/// A new file `DIR/.NAME.RANDOM.tmp`, created so that nothing already there (a file, a link)
/// is ever opened.
fn create_unique(dir: &Path, name: &str, mode: u32) -> io::Result<(File, PathBuf)> {
    let mut last = None;
    for attempt in 0..ATTEMPTS {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write_u32(attempt);
        if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            h.write_u128(t.as_nanos());
        }
        let tmp = dir.join(format!(".{name}.{:016x}.tmp", h.finish()));
        match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)
        {
            Ok(f) => return Ok((f, tmp)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| io::ErrorKind::AlreadyExists.into()))
}

/// Opens the existing file at `path` for reading and writing, never through a link, and only
/// if it is a regular file owned by this process's effective user. A missing file is
/// `NotFound`, as from `open`; a link or a file of another user is an error that says so.
pub fn open_owned(path: &Path) -> io::Result<File> {
    let f = match OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "is a symbolic link: refused (a file blkq writes is never reached through a \
                 link; put the real path in its place)",
            ));
        }
        Err(e) => return Err(e),
    };
    let m = f.metadata()?;
    if !m.file_type().is_file() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "is not a regular file: refused",
        ));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if m.uid() != me {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "is owned by uid {}, not by this server's user (uid {me}): refused (another \
                 user could have planted it)",
                m.uid()
            ),
        ));
    }
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replacement_never_opens_what_is_planted_and_replaces_a_link_itself() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"secret").unwrap();
        let path = dir.path().join("x");
        std::os::unix::fs::symlink(&victim, &path).unwrap();
        let f = replace(&path, 0o600, |f| {
            use std::os::unix::fs::FileExt;
            f.write_all_at(b"new", 0)
        })
        .unwrap();
        drop(f);
        assert_eq!(std::fs::read(&victim).unwrap(), b"secret");
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        assert!(std::fs::symlink_metadata(&path).unwrap().is_file());
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 2, "no temporary file left: {left:?}");
    }

    #[test]
    fn a_failed_fill_leaves_the_path_and_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x");
        std::fs::write(&path, b"old").unwrap();
        let e = replace(&path, 0o600, |_| Err(io::Error::other("full"))).unwrap_err();
        assert_eq!(e.to_string(), "full");
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn open_owned_refuses_a_link_and_says_a_missing_file_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        std::fs::write(&real, b"x").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let e = open_owned(&link).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert!(open_owned(&real).is_ok());
        let e = open_owned(&dir.path().join("none")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }
}
