//! The `mem` driver: each request executed synchronously on a [`Backend`] in `queue_rq`
//! (`mem:` devices; `file:` devices with `engine=sync` do the same in
//! [`crate::FileDriver`]).

use std::os::fd::BorrowedFd;

use blkq_sync::DynArc as Arc;

use blk::{Caps, Driver, Error, Extent, RecvSource, RequestQueue, RequestToken};

use crate::backend::{exec_on_backend, Backend, MapBackend, MemBackend, SpliceGate};
use crate::kind_options::{device_size, parse_bool, Kind, KindOptions};

/// Where a `mem:` device keeps its bytes: the spec's `store=` option (and `thp=`, `stream=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemStore {
    /// `store=map` (the default): one reserved anonymous mapping, [`MapBackend`].
    Map {
        /// Transparent huge pages (`thp=1`, [`MapBackend::with_huge_pages`]).
        huge: bool,
        /// Writes of a page or more streamed past the caches (`stream=1`, the default;
        /// [`MapBackend::streaming`]).
        stream: bool,
    },
    /// `store=pages`: 4 KiB pages in sharded hash maps, [`MemBackend`].
    Pages,
}

impl Default for MemStore {
    fn default() -> Self {
        MemStore::Map {
            huge: false,
            stream: true,
        }
    }
}

impl std::str::FromStr for MemStore {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "map" => Ok(MemStore::default()),
            "pages" => Ok(MemStore::Pages),
            _ => Err(Error::Config(format!(
                "option store: unknown value {s:?} (expected map or pages)"
            ))),
        }
    }
}

impl MemStore {
    /// The store with the spec's `thp=` and `stream=` options applied (`None`: not given):
    /// only `store=map` has them.
    pub fn with_map_options(self, thp: Option<bool>, stream: Option<bool>) -> Result<Self, Error> {
        match self {
            MemStore::Map { huge, stream: s } => Ok(MemStore::Map {
                huge: thp.unwrap_or(huge),
                stream: stream.unwrap_or(s),
            }),
            MemStore::Pages => match (thp, stream) {
                (Some(true), _) => Err(Error::Config(
                    "option thp: transparent huge pages are for store=map only".into(),
                )),
                (_, Some(true)) => Err(Error::Config(
                    "option stream: streaming writes are for store=map only".into(),
                )),
                _ => Ok(MemStore::Pages),
            },
        }
    }

    /// The driver's name in descriptions: `mem store=map` or `mem store=pages`, with the
    /// options that are not their defaults.
    pub fn describe(self) -> &'static str {
        match self {
            MemStore::Map {
                huge: false,
                stream: true,
            } => "mem store=map",
            MemStore::Map {
                huge: true,
                stream: true,
            } => "mem store=map thp=1",
            MemStore::Map {
                huge: false,
                stream: false,
            } => "mem store=map stream=0",
            MemStore::Map {
                huge: true,
                stream: false,
            } => "mem store=map thp=1 stream=0",
            MemStore::Pages => "mem store=pages",
        }
    }

    /// A store of `size` bytes of this kind; a size that cannot be mapped is an error.
    pub fn build(self, size: u64) -> Result<Arc<dyn Backend>, Error> {
        Ok(match self {
            MemStore::Map { huge, stream } => Arc::new(
                MapBackend::with_huge_pages(size, huge)
                    .map_err(|e| Error::Config(format!("mem:{size},store=map: {e}")))?
                    .streaming(stream),
            ),
            MemStore::Pages => Arc::new(MemBackend::new(size)),
        })
    }
}

/// A driver that executes each request synchronously on a [`Backend`] in `queue_rq`
/// (`mem:` devices; `file:` devices with `engine=sync` do the same in [`crate::FileDriver`]).
#[derive(Debug)]
pub struct BackendDriver {
    name: &'static str,
    backend: Arc<dyn Backend>,
    splice: SpliceGate,
    /// Writes received into their home ([`blk::Device::recv_home`]): the backend has them
    /// and the spec's `splice=0` did not turn them off.
    home: bool,
}

/// The `mem:SIZE` kind ([`crate::spec::KINDS`]).
pub(crate) const KIND: Kind = Kind {
    name: "mem",
    form: "mem:SIZE",
    parse: |spec, arg, _| Ok(Box::new(SpecOptions::new(device_size(spec, arg)?))),
    arg_is_path: false,
    path_options: &[],
    read_only_options: &[],
    warning: Some("the data lives in memory and is lost when the server stops"),
};

/// A `mem:` spec's options: `store`, `thp`, `stream`, `splice`.
pub(crate) struct SpecOptions {
    size: u64,
    store: MemStore,
    thp: Option<bool>,
    stream: Option<bool>,
    splice: bool,
}

impl SpecOptions {
    /// The defaults, for a device of `size` bytes.
    pub(crate) fn new(size: u64) -> Self {
        Self {
            size,
            store: MemStore::default(),
            thp: None,
            stream: None,
            splice: true,
        }
    }
}

impl KindOptions for SpecOptions {
    fn set(&mut self, k: &str, v: &str) -> Result<bool, Error> {
        match k {
            "store" => self.store = v.parse()?,
            "thp" => self.thp = Some(parse_bool(k, v)?),
            "stream" => self.stream = Some(parse_bool(k, v)?),
            "splice" => self.splice = parse_bool(k, v)?,
            _ => return Ok(false),
        }
        Ok(true)
    }

    fn open(
        self: Box<Self>,
        cfg: &mut blk::QueueConfig,
        _: bool,
    ) -> Result<Box<dyn Driver>, Error> {
        cfg.limits.capacity = self.size;
        let store = self.store.with_map_options(self.thp, self.stream)?;
        let driver = BackendDriver::new(store.describe(), store.build(self.size)?);
        Ok(Box::new(if self.splice {
            driver
        } else {
            driver.without_splice()
        }))
    }
}

impl BackendDriver {
    /// A driver over `backend`, described as `name`; zero-copy reads on where the backend
    /// has them.
    pub fn new(name: &'static str, backend: Arc<dyn Backend>) -> Self {
        let caps = backend.caps();
        let splice = SpliceGate::new(caps.splice);
        let home = caps.recv_home;
        Self {
            name,
            backend,
            splice,
            home,
        }
    }

    /// Zero-copy reads ([`blk::Device::splice_read`]) and writes received into their home
    /// ([`blk::Device::recv_home`]) off, whatever the backend has (the spec's `splice=0`):
    /// every payload is copied through the server's buffers.
    pub fn without_splice(self) -> Self {
        Self {
            splice: SpliceGate::new(false),
            home: false,
            ..self
        }
    }
}

impl Driver for BackendDriver {
    #[inline]
    fn queue_rq(&self, q: &RequestQueue, mut r: RequestToken) {
        // Every bio of a merge chain, in sector order; the chain completes with the first
        // error, if any.
        let res = q.for_each_bio(&mut r, |bio| exec_on_backend(self.backend.as_ref(), bio));
        q.complete(r, res);
    }

    fn max_merge(&self) -> u32 {
        u32::MAX
    }

    /// The zero-copy paths the backend has, less those the spec turned off; zero-copy reads
    /// off too once a splice has failed ([`SpliceGate`]).
    fn caps(&self) -> Caps {
        Caps {
            splice: self.splice.open(),
            recv_home: self.home,
            ..Caps::default()
        }
    }

    fn splice_read(&self, offset: u64, len: usize, pipe: BorrowedFd<'_>) -> Result<usize, Error> {
        self.splice.splice(self.backend.as_ref(), offset, len, pipe)
    }

    fn recv_home(&self, offset: u64, len: usize, src: &mut dyn RecvSource) -> Result<(), Error> {
        if !self.home {
            return Err(Error::Io(std::io::ErrorKind::Unsupported.into()));
        }
        Ok(self.backend.recv_at(offset, len, src)?)
    }

    fn extents_into(
        &self,
        offset: u64,
        len: u64,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), Error> {
        Ok(self.backend.extents_into(offset, len, max, out)?)
    }

    fn describe(&self) -> String {
        format!("{} size={}", self.name, self.backend.size())
    }
}
