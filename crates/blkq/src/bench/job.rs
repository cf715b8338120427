//! The job loop of `blkq bench`: building the queue, running the jobs (threads keeping
//! `iodepth` bios in flight), gathering one run's results, and the verify pass.

use blkq_sync::atomic::{AtomicBool, AtomicU64, Ordering};
use blkq_sync::{DynArc as Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use blk::{Bio, Buffer, Device, EndIo, Op, Queue};
use blk_drivers::spec::{DeviceSpec, QueueOverrides};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};
use waitq::WaitQueue;

use super::args::{RunCfg, Rw};
use super::hist::{LatHist, LatSummary};

/// One run's results.
#[derive(Debug, Clone, Default)]
pub struct RunResult {
    pub ios: u64,
    pub errors: u64,
    pub secs: f64,
    pub iops: f64,
    pub bw_bytes: f64,
    pub lat: LatSummary,
    pub tag_wait_count: u64,
    pub tag_wait_mean_ns: u64,
    pub tag_wait_max_ns: u64,
    pub tag_wait_p99_ns: u64,
    pub ctx_switches: u64,
    /// Bios merged by the scheduler.
    pub merges: u64,
    /// The scheduler lock's acquisitions and contended ones.
    pub lock_attempts: u64,
    pub lock_contended: u64,
}

impl RunResult {
    /// Contended scheduler-lock acquisitions per completed I/O.
    pub(super) fn contended_per_io(&self) -> f64 {
        self.lock_contended as f64 / self.ios.max(1) as f64
    }
}

/// What a job's completions hand back.
pub(super) struct Returned {
    pub(super) bios: Vec<Bio>,
    pub(super) hist: LatHist,
    pub(super) errors: u64,
    pub(super) first_error: Option<String>,
}

/// A job's completion side (registered once as its `EndIo`).
pub(super) struct JobEnd {
    pub(super) base: Instant,
    pub(super) ret: Mutex<Returned>,
    pub(super) wq: WaitQueue,
}

impl EndIo for JobEnd {
    fn end_io(&self, bio: Bio, res: Result<(), blk::Error>) {
        // cookie: 0 = not timed, else ns since `base` + 1 at submission.
        let lat = (bio.cookie != 0)
            .then(|| (self.base.elapsed().as_nanos() as u64).saturating_sub(bio.cookie - 1));
        {
            let mut r = self.ret.lock();
            if let Err(e) = res {
                r.errors += 1;
                if r.first_error.is_none() {
                    r.first_error = Some(e.to_string());
                }
            }
            if let Some(l) = lat {
                r.hist.record(l);
            }
            r.bios.push(bio);
        }
        self.wq.wake_one();
    }
}

pub(super) fn thread_ctx_switches() -> u64 {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `ru` is valid writable storage for one rusage; RUSAGE_THREAD is a valid `who`.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, ru.as_mut_ptr()) };
    if rc != 0 {
        return 0;
    }
    // SAFETY: getrusage succeeded and filled the struct (it was zeroed before anyway).
    let ru = unsafe { ru.assume_init() };
    (ru.ru_nvcsw + ru.ru_nivcsw) as u64
}

/// A job's generator of offsets and read/write choices: `rand`'s `SmallRng` (xoshiro256++:
/// a few ns per number, no allocation, no syscall), seeded from `--seed` and the job's number
/// so a run's offset sequences are reproducible.
pub(super) fn job_rng(seed: u64, job: usize) -> SmallRng {
    // seed_from_u64 expands the word with PCG32, so neighbouring seeds give unrelated streams.
    SmallRng::seed_from_u64(seed ^ (job as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

pub(super) struct JobOut {
    pub(super) ios: u64,
    pub(super) hist: LatHist,
    pub(super) errors: u64,
    pub(super) first_error: Option<String>,
    pub(super) ctx: u64,
}

/// What the jobs drive: a queue (plugged submission) or any bio-based device (one
/// `submit_batch` per iodepth refill), e.g. a RAID1 mirror.
#[derive(Clone)]
pub(super) enum Target {
    Queue(Arc<Queue>),
    Device(Arc<dyn Device>),
}

impl Target {
    fn capacity(&self) -> u64 {
        match self {
            Target::Queue(q) => q.core().limits().capacity,
            Target::Device(d) => d.limits().capacity,
        }
    }
}

/// Whether bios need data buffers: every device but `null` without `memory_backed` reads or
/// writes its buffer, and a RAID1 mirror refuses data bios without one (whatever its legs);
/// `--as-leg` carries them as a mirror does.
fn needs_data(cfg: &RunCfg) -> bool {
    cfg.raid1.is_some()
        || cfg.as_leg
        || !cfg.device.starts_with("null")
        || cfg.device.contains("memory_backed=1")
}

/// The op and block of a job's next bio: in sequence (`seq`, wrapping at `blocks`) or at
/// random from `rng`, as `--rw` says.
#[inline]
fn next_block(cfg: &RunCfg, rng: &mut SmallRng, seq: &mut u64, blocks: u64) -> (Op, u64) {
    match cfg.rw {
        Rw::Read | Rw::Write => {
            let b = *seq % blocks;
            *seq += 1;
            (
                if cfg.rw == Rw::Read {
                    Op::Read
                } else {
                    Op::Write
                },
                b,
            )
        }
        Rw::RandRead => (Op::Read, rng.random_range(0..blocks)),
        Rw::RandWrite => (Op::Write, rng.random_range(0..blocks)),
        Rw::RandRw => {
            let op = if rng.random_range(0..100u32) < cfg.rwmixread {
                Op::Read
            } else {
                Op::Write
            };
            (op, rng.random_range(0..blocks))
        }
    }
}

/// Takes the bios that completed into `free` (empty on entry), sleeping only when none has;
/// returns how many.
#[inline]
fn reap(end: &JobEnd, free: &mut Vec<Bio>) -> u64 {
    loop {
        let got = {
            let mut r = end.ret.lock();
            std::mem::swap(&mut r.bios, free);
            free.len()
        };
        if got > 0 {
            return got as u64;
        }
        end.wq.wait_for(|| {
            let r = end.ret.lock();
            (!r.bios.is_empty()).then_some(())
        });
    }
}

/// Waits for every bio in flight to come back into `free` (`iodepth` of them).
fn drain(end: &JobEnd, free: &mut Vec<Bio>, iodepth: usize) {
    while free.len() < iodepth {
        end.wq
            .wait_for(|| {
                let mut r = end.ret.lock();
                (!r.bios.is_empty()).then(|| std::mem::take(&mut r.bios))
            })
            .into_iter()
            .for_each(|b| free.push(b));
    }
}

pub(super) fn run_job(
    target: Target,
    cfg: RunCfg,
    job: usize,
    region: u64,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
) -> JobOut {
    let needs_data = needs_data(&cfg);
    let end = Arc::new(JobEnd {
        base: Instant::now(),
        ret: Mutex::new(Returned {
            bios: Vec::with_capacity(cfg.iodepth),
            hist: LatHist::new(),
            errors: 0,
            first_error: None,
        }),
        wq: WaitQueue::new(),
    });
    let end_dyn: Arc<dyn EndIo> = end.clone();
    let mut free: Vec<Bio> = (0..cfg.iodepth)
        .map(|_| {
            let mut b = Bio::new(Op::Read, 0, cfg.bs);
            if needs_data {
                b.buf = Some(Buffer::new(cfg.bs as usize));
            }
            b
        })
        .collect();
    let blocks = (region / u64::from(cfg.bs)).max(1);
    let mut rng = job_rng(cfg.seed, job);
    let mut seq = (blocks / cfg.jobs as u64) * job as u64;
    let mut plug = blk::Plug::new(cfg.iodepth);
    // The batch of a bio-based target (its capacity kept: no allocation per refill).
    let mut batch: Vec<Bio> = Vec::with_capacity(cfg.iodepth);
    let mut ios = 0u64;
    let mut n = 0u64;
    let ctx0 = thread_ctx_switches();
    while !stop.load(Ordering::Relaxed) {
        while let Some(mut bio) = free.pop() {
            let (op, block) = next_block(&cfg, &mut rng, &mut seq, blocks);
            bio.op = op;
            bio.len = cfg.bs;
            bio.sector = (block * u64::from(cfg.bs)) >> blk::SECTOR_SHIFT;
            n += 1;
            bio.cookie = if n.is_multiple_of(cfg.lat_sample) {
                end.base.elapsed().as_nanos() as u64 + 1
            } else {
                0
            };
            match &target {
                Target::Queue(q) => q.submit_plugged(&mut plug, bio, &end_dyn),
                // One bio at a time, as a mirror submits to its legs (no plug).
                Target::Device(d) if cfg.as_leg => d.submit(bio, &end_dyn),
                Target::Device(_) => batch.push(bio),
            }
        }
        match &target {
            Target::Queue(q) => q.flush_plug(&mut plug),
            Target::Device(d) => {
                if !batch.is_empty() {
                    d.submit_batch(&mut batch.drain(..), &end_dyn);
                }
            }
        }
        // Reap: whatever has completed; sleep only when nothing has.
        let got = reap(&end, &mut free);
        ios += got;
        done.fetch_add(got, Ordering::Relaxed);
    }
    // Drain what is still in flight before the queue can go away.
    drain(&end, &mut free, cfg.iodepth);
    let ctx = thread_ctx_switches().saturating_sub(ctx0);
    let mut r = end.ret.lock();
    JobOut {
        ios,
        hist: std::mem::replace(&mut r.hist, LatHist::new()),
        errors: r.errors,
        first_error: r.first_error.take(),
        ctx,
    }
}

fn overrides(cfg: &RunCfg) -> QueueOverrides {
    QueueOverrides {
        hw_queues: cfg.hw_queues,
        queue_depth: cfg.queue_depth,
        shared_tags: cfg.shared_tags.then_some(true),
        wake: Some(cfg.wake),
        policy: Some(cfg.policy),
        read_only: false,
        sched: Some(cfg.sched),
        sched_lock: Some(cfg.sched_lock),
    }
}

pub(super) fn build_queue(cfg: &RunCfg) -> Result<Queue> {
    let spec: DeviceSpec = cfg.device.parse()?;
    let queue_settings = overrides(cfg);
    let q = spec
        .build(&queue_settings)
        .with_context(|| format!("building device {}", cfg.device))?;
    for p in q.pools() {
        p.set_batch(cfg.batch_requests, cfg.batch_time);
        p.set_max_in_flight(cfg.max_in_flight);
    }
    Ok(q)
}

/// Builds the RAID1 mirror of `--raid1`: opens the legs with the same builder as
/// `blkq serve --raid1` and creates a new array on them (the bench owns its legs).
pub(super) fn build_raid1(cfg: &RunCfg, legs: &str) -> Result<Arc<dyn Device>> {
    let legs = crate::raid::legs::split_legs(legs)?;
    let rc = crate::raid::legs::raid1_config(&cfg.raid1_options)?;
    let queue_settings = overrides(cfg);
    let devs = legs
        .iter()
        .map(|l| crate::open::open_leg(l, &queue_settings))
        .collect::<Result<Vec<_>>>()?;
    let r = raid1::Raid1::create(devs, rc).context("--raid1: creating the array")?;
    Ok(Arc::new(r))
}

/// `--dirty-bitmaps`: the `--device` queue as a bio-based device, bare (`None`) or wrapped in
/// `cbt::Tracked` with `n` dirty bitmaps in memory.
fn build_tracked(cfg: &RunCfg, bitmaps: Option<usize>) -> Result<Arc<dyn Device>> {
    let mut plain = cfg.clone();
    plain.device = cfg
        .device
        .split(" [")
        .next()
        .unwrap_or_default()
        .to_string();
    let q: Arc<dyn Device> = Arc::new(build_queue(&plain)?);
    let Some(n) = bitmaps else {
        return Ok(q);
    };
    let (b, _) = cbt::Bitmaps::open(
        q.limits().capacity,
        &cbt::Options {
            mode: cfg.dirty_bitmaps_gate,
            ..cbt::Options::memory()
        },
    )?;
    for i in 0..n {
        b.add(&format!("b{i}"), cbt::DEFAULT_GRANULARITY)?;
    }
    // Every granule dirty and durable before the run: the steady state, where a write costs
    // the gate and one load per bitmap (the first-write cost is bench/cbt.sh's `first`).
    let cap = q.limits().capacity;
    for off in (0..cap).step_by(1 << 20) {
        let (g, r) = b.start_write(off, (1 << 20).min(cap - off));
        b.end_write(g);
        r?;
    }
    Ok(Arc::new(cbt::Tracked::new(q, b)))
}

/// Builds what the jobs drive: the `--raid1` mirror, the `--device` built as a leg
/// (`--as-leg`), the `--device` wrapped in its fault device when the spec has `fault.`
/// options, or else the `--device` queue.
fn build_target(cfg: &RunCfg) -> Result<Target> {
    if let Some(legs) = &cfg.raid1 {
        return Ok(Target::Device(build_raid1(cfg, legs)?));
    }
    if cfg.as_leg {
        // The spec alone (the run's label may have been put in its place).
        let spec = cfg.device.split(" [").next().unwrap_or_default();
        return Ok(Target::Device(crate::open::open_leg(
            spec,
            &overrides(cfg),
        )?));
    }
    if let Some(bitmaps) = cfg.dirty_bitmaps {
        return Ok(Target::Device(build_tracked(cfg, bitmaps)?));
    }
    let spec: DeviceSpec = cfg.device.parse()?;
    if spec.fault_config()?.is_some() {
        let d = spec
            .build_device(&overrides(cfg))
            .with_context(|| format!("building device {}", cfg.device))?;
        return Ok(Target::Device(d));
    }
    Ok(Target::Queue(Arc::new(build_queue(cfg)?)))
}

/// A progress bar for one run on stderr, or a hidden one when stderr is not a terminal (so
/// nothing is ever drawn into piped or `--json` output): elapsed time against the runtime,
/// and the IOPS of the last interval.
fn progress_bar(cfg: &RunCfg, label: &str) -> ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template("{prefix} [{bar:30}] {pos:>5}/{len} ms {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    let pb = ProgressBar::with_draw_target(
        Some(cfg.runtime.as_millis() as u64),
        ProgressDrawTarget::stderr(),
    )
    .with_style(style);
    pb.set_prefix(label.to_string());
    pb
}

/// Runs one configuration. `progress`: the label of a progress bar to draw on stderr while
/// it runs (drawn only when stderr is a terminal).
pub(super) fn run_once(cfg: &RunCfg, progress: Option<&str>) -> Result<RunResult> {
    let target = build_target(cfg)?;
    let q = match &target {
        Target::Queue(q) => Some(q.clone()),
        Target::Device(_) => None,
    };
    let cap = target.capacity();
    let region = cfg.size.unwrap_or(cap).min(cap);
    if region < u64::from(cfg.bs) {
        bail!(
            "device region ({region} bytes) is smaller than one block ({})",
            cfg.bs
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let bar = progress.map_or_else(ProgressBar::hidden, |l| progress_bar(cfg, l));
    let tick = if bar.is_hidden() {
        Duration::from_secs(1)
    } else {
        Duration::from_millis(250)
    };
    let t0 = Instant::now();
    let handles: Vec<_> = (0..cfg.jobs)
        .map(|j| {
            let (t, cfg, stop, done) = (target.clone(), cfg.clone(), stop.clone(), done.clone());
            std::thread::Builder::new()
                .name(format!("bench-job{j}"))
                .spawn(move || run_job(t, cfg, j, region, stop, done))
        })
        .collect::<std::io::Result<_>>()?;
    let mut last = (t0, 0u64);
    while t0.elapsed() < cfg.runtime {
        let left = cfg.runtime.saturating_sub(t0.elapsed());
        std::thread::sleep(left.min(tick));
        if !bar.is_hidden() {
            let now = (Instant::now(), done.load(Ordering::Relaxed));
            let rate = (now.1 - last.1) as f64 / (now.0 - last.0).as_secs_f64();
            bar.set_position(t0.elapsed().as_millis() as u64);
            bar.set_message(format!(
                "{} IOPS",
                super::format::thousands_or_millions(rate)
            ));
            last = now;
        }
    }
    bar.finish_and_clear();
    stop.store(true, Ordering::Relaxed);
    let mut hist = LatHist::new();
    let mut res = RunResult::default();
    let mut first_error = None;
    for h in handles {
        let o = h
            .join()
            .map_err(|_| anyhow::anyhow!("a bench job panicked"))?;
        res.ios += o.ios;
        res.errors += o.errors;
        res.ctx_switches += o.ctx;
        hist.merge(&o.hist);
        first_error = first_error.or(o.first_error);
    }
    res.secs = t0.elapsed().as_secs_f64();
    res.iops = res.ios as f64 / res.secs;
    res.bw_bytes = res.iops * f64::from(cfg.bs);
    res.lat = hist.summary();
    let Some(q) = q else {
        // A bio-based target: no tags or scheduler of its own (see the module docs).
        if let Some(e) = first_error {
            eprintln!("warning: {} I/O errors; first: {e}", res.errors);
        }
        return Ok(res);
    };
    let mut wait_sum = 0u64;
    for p in q.pools() {
        let w = p.wait_stats();
        res.tag_wait_count += w.count;
        wait_sum += w.mean_ns * w.count;
        res.tag_wait_max_ns = res.tag_wait_max_ns.max(w.max_ns);
        res.tag_wait_p99_ns = res.tag_wait_p99_ns.max(w.p99_ns);
    }
    res.tag_wait_mean_ns = wait_sum.checked_div(res.tag_wait_count).unwrap_or(0);
    let ds = q.stats();
    res.merges = ds.merges[0] + ds.merges[1];
    if let Some(s) = q.scheduler() {
        let ls = s.lock_stats();
        res.lock_attempts = ls.attempts;
        res.lock_contended = ls.contended;
    }
    if let Some(e) = first_error {
        eprintln!("warning: {} I/O errors; first: {e}", res.errors);
    }
    Ok(res)
}

/// Writes a pattern over the region and reads it back.
pub(super) fn verify(cfg: &RunCfg) -> Result<()> {
    let q = build_target(cfg)?;
    let cap = q.capacity();
    let region = cfg.size.unwrap_or(cap.min(1 << 30)).min(cap);
    let bs = u64::from(cfg.bs);
    let blocks = region / bs;
    let pattern = |block: u64, i: usize| -> u8 {
        (block.wrapping_mul(0x9e37_79b9).wrapping_add(i as u64 * 31) >> 3) as u8
    };
    struct Done(Mutex<Vec<(Bio, Option<String>)>>, WaitQueue);
    impl EndIo for Done {
        fn end_io(&self, bio: Bio, res: Result<(), blk::Error>) {
            self.0.lock().push((bio, res.err().map(|e| e.to_string())));
            self.1.wake_one();
        }
    }
    let done = Arc::new(Done(Mutex::new(vec![]), WaitQueue::new()));
    let end: Arc<dyn EndIo> = done.clone();
    let mut bad = 0u64;
    for op in [Op::Write, Op::Read] {
        let mut next = 0u64;
        let mut free: Vec<Bio> = (0..cfg.iodepth)
            .map(|_| Bio::with_buf(op, 0, Buffer::new(cfg.bs as usize)))
            .collect();
        let mut in_flight = 0usize;
        while next < blocks || in_flight > 0 {
            while next < blocks {
                let Some(mut bio) = free.pop() else { break };
                bio.op = op;
                bio.sector = (next * bs) >> blk::SECTOR_SHIFT;
                bio.cookie = next;
                if op == Op::Write {
                    if let Some(b) = bio.buf.as_mut() {
                        for (i, x) in b.as_mut_slice().iter_mut().enumerate() {
                            *x = pattern(next, i);
                        }
                    }
                } else if let Some(b) = bio.buf.as_mut() {
                    b.as_mut_slice().fill(0xAA);
                }
                match &q {
                    Target::Queue(q) => q.submit(bio, &end),
                    Target::Device(d) => d.submit(bio, &end),
                }
                in_flight += 1;
                next += 1;
            }
            let got = done.1.wait_for(|| {
                let mut v = done.0.lock();
                (!v.is_empty()).then(|| std::mem::take(&mut *v))
            });
            for (bio, err) in got {
                in_flight -= 1;
                if let Some(e) = err {
                    bail!("{op:?} of block {} failed: {e}", bio.cookie);
                }
                if op == Op::Read {
                    if let Some(b) = &bio.buf {
                        if b.as_slice()
                            .iter()
                            .enumerate()
                            .any(|(i, &x)| x != pattern(bio.cookie, i))
                        {
                            bad += 1;
                        }
                    }
                }
                free.push(bio);
            }
        }
    }
    if bad > 0 {
        bail!("verify: {bad} of {blocks} blocks read back wrong");
    }
    eprintln!(
        "verify: {blocks} blocks of {} bytes written and read back correctly",
        cfg.bs
    );
    Ok(())
}

#[cfg(all(test, not(blkq_loom)))]
mod tests {
    use std::time::Duration;

    use blk::sched::{LockMode, SchedChoice};
    use blk::PoolPolicy;
    use sbitmap::WakeAlgo;

    use super::super::args::apply;
    use super::*;

    fn raid_cfg(rw: &str) -> RunCfg {
        RunCfg {
            device: String::new(),
            rw: rw.parse().unwrap(),
            rwmixread: 50,
            bs: 4096,
            iodepth: 4,
            jobs: 2,
            runtime: Duration::from_millis(50),
            hw_queues: None,
            queue_depth: None,
            shared_tags: false,
            wake: WakeAlgo::Counter,
            policy: PoolPolicy::Steal,
            sched: SchedChoice::None,
            sched_lock: LockMode::Serialized,
            max_in_flight: None,
            batch_requests: 32,
            batch_time: Duration::from_micros(10_000),
            size: None,
            lat_sample: 1,
            seed: 1,
            raid1: Some("mem:8M,mem:8M".into()),
            raid1_options: vec!["barrier=locked".into()],
            as_leg: false,
            dirty_bitmaps: None,
            dirty_bitmaps_gate: cbt::Mode::LockFree,
        }
    }

    /// `--raid1` drives a mirror through `submit_batch`: I/Os complete without errors, for
    /// both barrier designs (the sweep key `barrier`), and `--verify` reads back its pattern.
    #[test]
    fn bench_over_a_mirror() {
        for barrier in ["locked", "lockless"] {
            let mut cfg = raid_cfg("randrw");
            apply(&mut cfg, "barrier", barrier).unwrap();
            assert_eq!(
                cfg.label(),
                format!("raid1:mem:8M,mem:8M [barrier=locked barrier={barrier}]")
            );
            let r = run_once(&cfg, None).unwrap();
            assert!(r.ios > 0, "{barrier}");
            assert_eq!(r.errors, 0, "{barrier}");
            assert_eq!(r.tag_wait_count, 0);
        }
        verify(&raid_cfg("randread")).unwrap();
        // Both write paths, swept as `share_writes`, write what `--verify` reads back.
        for share in ["0", "1"] {
            let mut cfg = raid_cfg("randread");
            apply(&mut cfg, "share_writes", share).unwrap();
            verify(&cfg).unwrap();
        }
        let mut bad = raid_cfg("randread");
        bad.raid1_options = vec!["barrier=spin".into()];
        assert!(run_once(&bad, None).is_err());
        // `barrier` is a sweep key only with --raid1.
        let mut plain = raid_cfg("randread");
        plain.raid1 = None;
        assert!(apply(&mut plain, "barrier", "locked").is_err());
    }

    /// The jobs' generators are reproducible from `--seed`, differ between jobs and seeds, and
    /// stay inside the drawn range.
    #[test]
    fn job_rng_is_seeded() {
        use rand::Rng as _;
        let draw = |seed, job| {
            let mut r = job_rng(seed, job);
            (0..8).map(|_| r.next_u64()).collect::<Vec<_>>()
        };
        assert_eq!(draw(1, 0), draw(1, 0));
        assert_ne!(draw(1, 0), draw(1, 1));
        assert_ne!(draw(1, 0), draw(2, 0));
        let mut r = job_rng(7, 3);
        assert!((0..1000).all(|_| r.random_range(0..5u64) < 5));
    }

    /// A `--device` spec with `fault.` options runs through the fault device and counts its
    /// injected errors.
    #[test]
    fn bench_over_a_fault_device() {
        let mut cfg = raid_cfg("randread");
        cfg.raid1 = None;
        cfg.device = "mem:8M,fault.fail_read=all".into();
        let r = run_once(&cfg, None).unwrap();
        assert!(r.ios > 0);
        assert_eq!(r.errors, r.ios);
    }

    /// `--as-leg` drives one leg as the mirror drives it: bio-based, with data buffers (a
    /// `mem` leg reads back what was written; a `null` one gets buffers too).
    #[test]
    fn bench_one_device_as_a_leg() {
        let mut cfg = raid_cfg("randwrite");
        cfg.raid1 = None;
        cfg.as_leg = true;
        cfg.device = "null:8M".into();
        assert!(needs_data(&cfg));
        assert_eq!(cfg.label(), "null:8M [as leg]");
        assert!(matches!(build_target(&cfg).unwrap(), Target::Device(_)));
        let r = run_once(&cfg, None).unwrap();
        assert!(r.ios > 0);
        assert_eq!(r.errors, 0);
        cfg.device = "mem:8M".into();
        verify(&cfg).unwrap();
    }
}
