//! Unix sockets that are private from their first moment.
//!
//! `bind(2)` creates the socket file with the mode `0777 & ~umask`, so a `chmod` after it
//! leaves a moment in which anyone who can reach the directory may connect: under `umask 000`
//! an unprivileged user connecting in a loop got in. Changing the umask around
//! `bind` is no fix in a threaded process: it is one value for every thread. [`bind_private`]
//! instead binds inside a directory of its own that only the owner may enter (mode 0700,
//! created beside the target so that it is on the same filesystem), sets the socket's mode
//! there, and only then gives it its final name with `link(2)`: the path appears already
//! listening and with its final mode, and an existing file at the path is never replaced
//! (`EEXIST`, as `bind` itself would refuse), unlike `rename(2)`.
//!
//! A process killed between the two steps leaves an empty-ish `.NAME.XXXXXX` directory
//! beside the socket (mode 0700, harmless; remove it by hand).

use std::ffi::OsString;
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

/// The name of the socket inside the private directory (short: `sun_path` holds 107 bytes).
const INNER: &str = "s";

/// Binds and listens on a Unix socket at `path` whose permission bits are `mode & 0o777`
/// from the moment the path exists (see the module docs). Like `UnixListener::bind`, it fails
/// with `AddrInUse` when something already exists at `path`: remove a stale socket first.
pub fn bind_private(path: &Path, mode: u32) -> io::Result<UnixListener> {
    let name = path.file_name().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "a socket path must end in a file name",
        )
    })?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir = PrivateDir::create(parent, name.as_bytes())?;
    let inner = dir.path.join(INNER);
    let l = match UnixListener::bind(&inner) {
        Ok(l) => l,
        // The private directory made the path too long for `sun_path`: bind through a
        // descriptor of the directory instead (the kernel resolves /proc/self/fd/N).
        Err(e) if e.kind() == io::ErrorKind::InvalidInput => {
            let d = std::fs::File::open(&dir.path)?;
            use std::os::fd::AsRawFd;
            UnixListener::bind(format!("/proc/self/fd/{}/{INNER}", d.as_raw_fd()))?
        }
        Err(e) => return Err(e),
    };
    std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(mode & 0o777))?;
    match std::fs::hard_link(&inner, path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                "the path exists (another server bound it meanwhile?)",
            ))
        }
        // A filesystem without hard links: rename, which would replace a file that appeared
        // at the path since the caller looked (the stale-socket check just ran).
        Err(_) => std::fs::rename(&inner, path)?,
    }
    Ok(l)
}

/// A new directory only the owner may enter, removed (with the socket name in it) on drop.
struct PrivateDir {
    path: PathBuf,
}

impl PrivateDir {
    fn create(parent: &Path, name: &[u8]) -> io::Result<Self> {
        // `.NAME.XXXXXX`, the name cut so that the whole stays well under NAME_MAX.
        let name = &name[..name.len().min(64)];
        let mut last = None;
        for attempt in 0..64u32 {
            let mut n = Vec::with_capacity(name.len() + 8);
            n.push(b'.');
            n.extend_from_slice(name);
            n.push(b'.');
            n.extend_from_slice(&random_suffix(attempt));
            let path = parent.join(OsString::from_vec(n));
            // mkdir(2) creates it or fails (no race: EEXIST is a new name); the mode is
            // 0700 & ~umask, never wider than 0700. chmod then gives the owner what it needs
            // under a umask that took it away.
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => {
                    let d = Self { path };
                    std::fs::set_permissions(&d.path, std::fs::Permissions::from_mode(0o700))?;
                    return Ok(d);
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
                Err(e) => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!(
                            "creating a private directory in {} to bind the socket in: {e}",
                            parent.display()
                        ),
                    ))
                }
            }
        }
        Err(last.unwrap_or_else(|| io::Error::from(io::ErrorKind::AlreadyExists)))
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.path.join(INNER));
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// Six characters of `[a-z0-9]`, different on every call (std's randomly keyed hasher over the
/// pid, the time and the attempt).
fn random_suffix(attempt: u32) -> [u8; 6] {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u32(attempt);
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    let mut x = h.finish();
    let mut out = [0u8; 6];
    for c in &mut out {
        *c = b"abcdefghijklmnopqrstuvwxyz0123456789"[(x % 36) as usize];
        x /= 36;
    }
    out
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;
    use std::os::unix::fs::FileTypeExt;
    use std::os::unix::net::UnixStream;

    fn entries(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn binds_with_the_mode_and_leaves_nothing_behind() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.sock");
        let l = bind_private(&p, 0o640).unwrap();
        let m = std::fs::symlink_metadata(&p).unwrap();
        assert!(m.file_type().is_socket());
        assert_eq!(m.permissions().mode() & 0o777, 0o640);
        assert_eq!(entries(d.path()), ["x.sock"]);
        let _c = UnixStream::connect(&p).unwrap();
        l.accept().unwrap();
        // Something at the path: refused like bind(2), and nothing replaced or left behind.
        let e = bind_private(&p, 0o600).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse);
        assert_eq!(entries(d.path()), ["x.sock"]);
        let f = d.path().join("file");
        std::fs::write(&f, "keep").unwrap();
        assert!(bind_private(&f, 0o600).is_err());
        assert_eq!(std::fs::read_to_string(&f).unwrap(), "keep");
        assert_eq!(entries(d.path()), ["file", "x.sock"]);
    }

    #[test]
    fn a_long_path_binds_through_the_directory_descriptor() {
        let d = tempfile::tempdir().unwrap();
        let sub = d.path().join("d".repeat(40));
        std::fs::create_dir(&sub).unwrap();
        // The final path fits `sun_path` (107 bytes), the private directory's does not.
        let name = "n".repeat(105 - sub.as_os_str().len() - 1);
        let p = sub.join(&name);
        assert_eq!(p.as_os_str().len(), 105);
        assert!(UnixListener::bind(sub.join(format!(".{name}.abcdef/s"))).is_err());
        let _l = bind_private(&p, 0o600).unwrap();
        UnixStream::connect(&p).unwrap();
        assert_eq!(entries(&sub), [name]);
    }

    #[test]
    fn a_path_without_a_file_name_is_refused() {
        let e = bind_private(Path::new(""), 0o600).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }
}
