//! An `rbd:` device's target and options ([`RbdConfig`]), as the spec gives them (the
//! options are listed in [`crate::rbd`]'s docs).

use std::fmt;
use std::path::PathBuf;

use blk::Error;

/// How librbd's completions reach the queue (`completion=`, [`crate::rbd`]'s docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CompletionMode {
    /// One completion thread per device polls them in batches.
    #[default]
    Poll,
    /// librbd's callback completes each request on librbd's own thread.
    Callback,
}

/// An `rbd:` device's target and options ([`crate::rbd`]'s docs).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RbdConfig {
    /// The pool.
    pub pool: String,
    /// The image.
    pub image: String,
    /// `conf=`: the cluster's configuration file.
    pub conf: Option<PathBuf>,
    /// `id=`: the client's name, without `client.`.
    pub id: Option<String>,
    /// `keyring=`.
    pub keyring: Option<PathBuf>,
    /// `snap=`: a snapshot, opened read-only.
    pub snap: Option<String>,
    /// `ro=1`.
    pub read_only: bool,
    /// `lock=off`: do not take the exclusive lock.
    pub no_lock: bool,
    /// `timeout=SECS`: librados' operation timeout (0 or absent: wait forever).
    pub timeout_secs: Option<u32>,
    /// `completion=poll|callback`.
    pub completion: CompletionMode,
}

impl RbdConfig {
    /// Parses the target of `rbd:POOL/IMAGE`.
    pub fn parse_target(arg: &str) -> Result<Self, Error> {
        match arg.split_once('/') {
            Some((pool, image))
                if !pool.is_empty() && !image.is_empty() && !image.contains('/') =>
            {
                Ok(Self {
                    pool: pool.to_string(),
                    image: image.to_string(),
                    ..Self::default()
                })
            }
            _ => Err(Error::Config(format!(
                "bad rbd target {arg:?}: expected rbd:POOL/IMAGE"
            ))),
        }
    }

    /// Whether the device is opened read-only (`ro=1` or a snapshot).
    pub fn is_read_only(&self) -> bool {
        self.read_only || self.snap.is_some()
    }

    /// Applies one `key=value` option of the spec; `Ok(false)` for a key that is not one of
    /// the rbd options.
    pub fn set(&mut self, k: &str, v: &str) -> Result<bool, Error> {
        let bad = |what: &str| Error::Config(format!("option {k}: {what} {v:?}"));
        match k {
            "conf" => self.conf = Some(PathBuf::from(v)),
            "id" => self.id = Some(v.to_string()),
            "keyring" => self.keyring = Some(PathBuf::from(v)),
            "snap" if !v.is_empty() => self.snap = Some(v.to_string()),
            "timeout" => {
                let n: u32 = v.parse().map_err(|_| bad("bad number of seconds"))?;
                self.timeout_secs = (n > 0).then_some(n);
            }
            "completion" => {
                self.completion = match v {
                    "poll" => CompletionMode::Poll,
                    "callback" => CompletionMode::Callback,
                    _ => return Err(bad("expected poll or callback, not")),
                }
            }
            _ => return Ok(false),
        }
        if [self.id.as_deref(), self.snap.as_deref()]
            .into_iter()
            .flatten()
            .chain([self.pool.as_str(), self.image.as_str()])
            .any(|s| s.contains('\0'))
        {
            return Err(bad("a NUL byte in"));
        }
        Ok(true)
    }
}

impl fmt::Display for RbdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rbd:{}/{}", self.pool, self.image)?;
        if let Some(s) = &self.snap {
            write!(f, "@{s}")?;
        }
        Ok(())
    }
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use super::*;

    #[test]
    fn targets_and_options() {
        let mut c = RbdConfig::parse_target("rbd/img").unwrap();
        assert_eq!((c.pool.as_str(), c.image.as_str()), ("rbd", "img"));
        for bad in ["", "rbd", "rbd/", "/img", "a/b/c"] {
            assert!(RbdConfig::parse_target(bad).is_err(), "{bad}");
        }
        assert!(c.set("conf", "/x/ceph.conf").unwrap());
        assert!(c.set("snap", "s1").unwrap());
        assert!(c.is_read_only());
        assert!(c.set("timeout", "x").is_err());
        assert!(c.set("timeout", "30").unwrap());
        assert_eq!(c.timeout_secs, Some(30));
        assert_eq!(c.completion, CompletionMode::Poll);
        assert!(c.set("completion", "callback").unwrap());
        assert_eq!(c.completion, CompletionMode::Callback);
        assert!(c.set("completion", "thread").is_err());
        assert!(!c.set("engine", "uring").unwrap());
        assert_eq!(c.to_string(), "rbd:rbd/img@s1");
    }
}
