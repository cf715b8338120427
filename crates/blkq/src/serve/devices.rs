//! What `blkq serve` keeps of each export beside the NBD server's table ([`Devices`]): its
//! full description, its dirty bitmaps and its remote device, for the control socket's
//! `bitmap` and `export` commands and the metrics. Kept in step with the table: filled by
//! the opening of the exports at start (`serve::plan`) and by `export add`, emptied of an
//! export by `export remove` (`control::exports`), so nothing keeps a removed export's device
//! open.

use blkq_sync::{Arc, Mutex};
use cbt::Tracked;
use nbd::remote::RemoteDevice;

/// One export's entry.
pub struct Entry {
    /// The export's name.
    pub name: String,
    /// The full description (spec and what was opened), never sent to clients.
    pub device: String,
    /// Its dirty bitmaps (all but `bitmaps=off`).
    pub tracked: Option<Arc<Tracked>>,
    /// Its remote device (`nbd://...`), for the metrics.
    pub remote: Option<Arc<RemoteDevice>>,
    /// A mirror: not removed while serving.
    pub mirror: bool,
    /// The device served (held here until the export is removed: at shutdown, `blkq serve`
    /// drops the last reference, or keeps it when the device is stuck).
    pub _device: blkq_sync::DynArc<dyn blk::Device>,
}

/// What `export list` shows of an entry.
pub struct View {
    /// The full description.
    pub device: String,
    /// How many dirty bitmaps it has (`None`: `bitmaps=off`).
    pub bitmaps: Option<usize>,
    /// Whether it is a mirror.
    pub mirror: bool,
}

/// The exports' devices as the control socket and the metrics see them.
#[derive(Default)]
pub struct Devices(Mutex<Vec<Entry>>);

impl Devices {
    /// Every export with dirty bitmaps, by name.
    pub fn tracked(&self) -> Vec<(String, Arc<Tracked>)> {
        self.0
            .lock()
            .iter()
            .filter_map(|e| Some((e.name.clone(), e.tracked.clone()?)))
            .collect()
    }

    /// Every remote export, by name.
    pub fn remotes(&self) -> Vec<(String, Arc<RemoteDevice>)> {
        self.0
            .lock()
            .iter()
            .filter_map(|e| Some((e.name.clone(), e.remote.clone()?)))
            .collect()
    }

    /// Records an export.
    pub fn insert(&self, e: Entry) {
        self.0.lock().push(e);
    }

    /// Forgets export `name` (and drops its device, unless something else holds it).
    pub fn remove(&self, name: &str) {
        self.0.lock().retain(|e| e.name != name);
    }

    /// Whether export `name` is a mirror.
    pub fn is_mirror(&self, name: &str) -> bool {
        self.0.lock().iter().any(|e| e.name == name && e.mirror)
    }

    /// What `export list` shows of export `name`.
    pub fn view(&self, name: &str) -> Option<View> {
        self.0.lock().iter().find(|e| e.name == name).map(|e| View {
            device: e.device.clone(),
            bitmaps: e.tracked.as_ref().map(|t| t.bitmaps().list().len()),
            mirror: e.mirror,
        })
    }
}
