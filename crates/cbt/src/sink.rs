//! Where the committer's pages go: the sidecar file ([`crate::sidecar::FileSink`], or a
//! mirror's copies in [`crate::sidecar::Sidecars`]), or nowhere for a bitmap kept in memory
//! only ([`NoSink`]).

/// Where pages go: the sidecar file, or nowhere for a bitmap kept in memory only.
pub trait Sink: Send + Sync {
    /// Writes `data` (whole pages) at page `page` of the store.
    fn write_pages(&self, page: u64, data: &[u8]) -> std::io::Result<()>;
    /// Makes the written pages durable.
    fn sync(&self) -> std::io::Result<()>;
    /// Names the store in messages (its path).
    fn describe(&self) -> String;
}

/// The sink of a bitmap kept in memory only: nothing to write.
pub struct NoSink;

impl Sink for NoSink {
    fn write_pages(&self, _: u64, _: &[u8]) -> std::io::Result<()> {
        Ok(())
    }
    fn sync(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn describe(&self) -> String {
        "memory".into()
    }
}
