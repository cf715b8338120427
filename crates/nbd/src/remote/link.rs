//! One connection of a [`super::RemoteDevice`]: its shared state (the slot table, the
//! socket's write half) and its two threads (the receiver, which also reconnects, and the
//! sender), started on a negotiated connection and stopped on drop.

use std::io;
use std::time::{Duration, Instant};

use blkq_sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use blkq_sync::{DynArc, Mutex};
use waitq::WaitQueue;

use super::check::Hook;
use super::connect::{Opened, RemoteError};
use super::receiver::{self, Receiver, SCRATCH};
use super::reconnect::Supervisor;
use super::sender;
use super::spec::{RemoteSpec, SendMode};
use super::table::{Durability, LinkState, Table, Writer};

pub(super) struct Link {
    pub(super) sh: DynArc<LinkState>,
    receiver: Option<std::thread::JoinHandle<()>>,
    sender: Option<std::thread::JoinHandle<()>>,
}

impl Link {
    /// Starts the threads of connection number `k` on `opened`; `durability` and `hook` are
    /// shared by the device's connections.
    pub(super) fn start(
        spec: &RemoteSpec,
        opened: Opened,
        k: usize,
        durability: &DynArc<Durability>,
        hook: &DynArc<Hook>,
    ) -> Result<Self, RemoteError> {
        let uri = spec.to_string();
        let io_err = |e: io::Error| RemoteError::Connect {
            uri: uri.clone(),
            source: e,
        };
        let Opened {
            stream,
            mode,
            details,
            limits,
            meta_id,
            ..
        } = opened;
        let mut table = Table::new(spec.depth);
        table.meta_id = meta_id;
        // The receiver wakes every tick to check the requests' ages.
        let tick = (spec.timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
        stream.set_read_timeout(Some(tick)).map_err(io_err)?;
        let reader = stream.try_clone().map_err(io_err)?;
        let sock = stream.try_clone().map_err(io_err)?;
        let sh = DynArc::new(LinkState {
            uri: uri.clone(),
            table: Mutex::new(table),
            writer: Mutex::new(Writer {
                stream: Some(stream),
                epoch: 1,
                mode,
                header: [0; 32],
                partial: None,
            }),
            slot_freed: WaitQueue::new(),
            sender_wq: WaitQueue::new(),
            backoff_wq: WaitQueue::new(),
            flags: AtomicU32::new(u32::from(details.flags.bits())),
            limits,
            timeout: spec.timeout,
            reconnect_deadline: spec.reconnect_deadline,
            closing: AtomicBool::new(false),
            send_failed: AtomicBool::new(false),
            orphaned: AtomicBool::new(false),
            up: AtomicBool::new(true),
            sock: Mutex::new(Some(sock)),
            reconnects: AtomicU64::new(0),
            inline: spec.send == SendMode::Inline && spec.tls.is_none(),
            sent_inline: AtomicU64::new(0),
            sent_by_thread: AtomicU64::new(0),
            fatal: Mutex::new(None),
            durability: durability.clone(),
            hook: hook.clone(),
        });
        let sup = Supervisor::new(
            Receiver {
                sh: sh.clone(),
                stream: receiver::buffered(reader),
                mode,
                scratch: vec![0; SCRATCH],
                tick,
                last_check: Instant::now(),
                draining: false,
                drain_since: Instant::now(),
                mid_reply: false,
                reply_since: Instant::now(),
                replying: None,
                seal_by: None,
                mid_check: Instant::now(),
                batch: None,
            },
            spec.clone(),
        );
        let sh2 = sh.clone();
        let sender = std::thread::Builder::new()
            .name(format!("blkq-nbd-send{k}"))
            .spawn(move || sender::run(sh2))
            .map_err(io_err)?;
        let mut link = Self {
            sh,
            receiver: None,
            sender: Some(sender),
        };
        // On failure `link`'s drop stops the sender.
        link.receiver = Some(
            std::thread::Builder::new()
                .name(format!("blkq-nbd-recv{k}"))
                .spawn(move || sup.run())
                .map_err(io_err)?,
        );
        Ok(link)
    }
}

impl Drop for Link {
    /// Shuts the socket down and joins the receiver, which fails what is still in flight
    /// with `EIO`, then the sender.
    fn drop(&mut self) {
        // SeqCst: see `LinkState::closing`.
        self.sh.closing.store(true, Ordering::SeqCst);
        self.sh.shut_socket();
        self.sh.backoff_wq.wake_all();
        self.sh.sender_wq.wake_all();
        if let Some(h) = self.receiver.take() {
            let _ = h.join();
        } else {
            // The receiver never started: nobody else fails what is waiting.
            self.sh.kill(None);
        }
        if let Some(h) = self.sender.take() {
            let _ = h.join();
        }
    }
}
