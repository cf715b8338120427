//! `blkq bench`: an in-process fio. Jobs are threads; each keeps `iodepth` bios in flight
//! against one queue built from a device spec, submitting under a plug and reaping whatever
//! completed, until the runtime is over.

use blkq_sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::fmt::Write as _;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use blk::sched::{LockMode, SchedChoice};
use blk::{Bio, Buffer, EndIo, Op, PoolPolicy, Queue};
use blk_drivers::spec::{parse_size, DeviceSpec, QueueOverrides};
use clap::Args;
use sbitmap::WakeAlgo;
use waitq::WaitQueue;

/// Access pattern.
#[allow(clippy::enum_variant_names)] // fio's names
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rw {
    Read,
    Write,
    RandRead,
    RandWrite,
    RandRw,
}

impl FromStr for Rw {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "read" => Rw::Read,
            "write" => Rw::Write,
            "randread" => Rw::RandRead,
            "randwrite" => Rw::RandWrite,
            "randrw" => Rw::RandRw,
            _ => bail!("unknown --rw {s:?} (read, write, randread, randwrite, randrw)"),
        })
    }
}

impl Rw {
    fn name(self) -> &'static str {
        match self {
            Rw::Read => "read",
            Rw::Write => "write",
            Rw::RandRead => "randread",
            Rw::RandWrite => "randwrite",
            Rw::RandRw => "randrw",
        }
    }
}

/// `blkq bench` options.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Device spec: null:SIZE, mem:SIZE or file:PATH, with ,key=value options.
    #[arg(long, default_value = "null:1G")]
    pub device: String,
    /// read, write, randread, randwrite or randrw.
    #[arg(long, default_value = "randread")]
    pub rw: String,
    /// Percentage of reads for randrw.
    #[arg(long, default_value_t = 50)]
    pub rwmixread: u32,
    /// Block size (e.g. 4K).
    #[arg(long, default_value = "4K")]
    pub bs: String,
    /// Bios in flight per job.
    #[arg(long, default_value_t = 32)]
    pub iodepth: usize,
    /// Jobs (submitting threads).
    #[arg(long, default_value_t = 1)]
    pub jobs: usize,
    /// Seconds per run.
    #[arg(long, default_value_t = 5.0)]
    pub runtime: f64,
    /// Hardware queues.
    #[arg(long)]
    pub hw_queues: Option<u16>,
    /// Tags per hardware queue (or in all, with --shared-tags).
    #[arg(long)]
    pub queue_depth: Option<u32>,
    /// One tag bitmap shared by all hardware queues.
    #[arg(long)]
    pub shared_tags: bool,
    /// Wake-up algorithm(s): counter, legacy, or both as "counter,legacy".
    #[arg(long, default_value = "counter")]
    pub wake: String,
    /// Pool-full policy(ies): steal, fifo, batch, or a comma list.
    #[arg(long, default_value = "steal")]
    pub policy: String,
    /// I/O scheduler(s): none, mq-deadline, or both as "none,mq-deadline".
    #[arg(long, default_value = "none")]
    pub sched: String,
    /// mq-deadline's lock design(s): locked, serialized, or both as "locked,serialized".
    #[arg(long, default_value = "serialized")]
    pub sched_lock: String,
    /// Cap on tags in use (batch/fifo experiments).
    #[arg(long)]
    pub max_in_flight: Option<u32>,
    /// Batch policy: tags a batch owner may take.
    #[arg(long, default_value_t = 32)]
    pub batch_requests: u32,
    /// Batch policy: how long a batch lasts, microseconds.
    #[arg(long, default_value_t = 10_000)]
    pub batch_time_us: u64,
    /// Write a pattern over the region, read it back and check it.
    #[arg(long)]
    pub verify: bool,
    /// Bytes of the device to use (default: all, capped at 1G for --verify).
    #[arg(long)]
    pub size: Option<String>,
    /// One JSON object per run on stdout.
    #[arg(long)]
    pub json: bool,
    /// Runs per configuration (mean and stddev are reported).
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Sweep one parameter: queue-depth=2,4,8 | iodepth=.. | jobs=.. | hw-queues=.. | bs=..
    #[arg(long)]
    pub sweep: Option<String>,
    /// Time one I/O in N for latency (the clock costs ~33 ns a read here).
    #[arg(long, default_value_t = 8)]
    pub lat_sample: u64,
}

/// One run's configuration.
#[derive(Debug, Clone)]
struct RunCfg {
    device: String,
    rw: Rw,
    rwmixread: u32,
    bs: u32,
    iodepth: usize,
    jobs: usize,
    runtime: Duration,
    hw_queues: Option<u16>,
    queue_depth: Option<u32>,
    shared_tags: bool,
    wake: WakeAlgo,
    policy: PoolPolicy,
    sched: SchedChoice,
    sched_lock: LockMode,
    max_in_flight: Option<u32>,
    batch_requests: u32,
    batch_time: Duration,
    size: Option<u64>,
    lat_sample: u64,
}

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
    fn contended_per_io(&self) -> f64 {
        self.lock_contended as f64 / self.ios.max(1) as f64
    }
}

/// Latency summary, ns.
#[derive(Debug, Clone, Copy, Default)]
pub struct LatSummary {
    pub samples: u64,
    pub mean: u64,
    pub p50: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
}

/// A log-linear latency histogram (16 sub-buckets per power of two: ~6% resolution).
#[derive(Debug, Clone)]
struct LatHist {
    buckets: Vec<u64>,
    sum: u64,
    max: u64,
    n: u64,
}

const SUB: u32 = 4; // log2 of sub-buckets

impl LatHist {
    fn new() -> Self {
        Self {
            buckets: vec![0; (64 << SUB) as usize],
            sum: 0,
            max: 0,
            n: 0,
        }
    }

    fn index(ns: u64) -> usize {
        if ns < (1 << SUB) {
            return ns as usize;
        }
        let msb = 63 - ns.leading_zeros();
        let sub = (ns >> (msb - SUB)) & ((1 << SUB) - 1);
        (((msb - SUB + 1) << SUB) as u64 + sub) as usize
    }

    fn upper(i: usize) -> u64 {
        let i = i as u64;
        if i < (1 << SUB) {
            return i;
        }
        let e = (i >> SUB) - 1 + u64::from(SUB);
        let sub = i & ((1 << SUB) - 1);
        ((1u64 << SUB) + sub + 1).saturating_mul(1u64 << (e - u64::from(SUB))) - 1
    }

    fn record(&mut self, ns: u64) {
        self.buckets[Self::index(ns)] += 1;
        self.sum += ns;
        self.max = self.max.max(ns);
        self.n += 1;
    }

    fn merge(&mut self, o: &LatHist) {
        for (a, b) in self.buckets.iter_mut().zip(&o.buckets) {
            *a += b;
        }
        self.sum += o.sum;
        self.max = self.max.max(o.max);
        self.n += o.n;
    }

    fn quantile(&self, q: f64) -> u64 {
        if self.n == 0 {
            return 0;
        }
        let want = ((self.n as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen >= want {
                return Self::upper(i).min(self.max);
            }
        }
        self.max
    }

    fn summary(&self) -> LatSummary {
        LatSummary {
            samples: self.n,
            mean: self.sum.checked_div(self.n).unwrap_or(0),
            p50: self.quantile(0.5),
            p99: self.quantile(0.99),
            p999: self.quantile(0.999),
            max: self.max,
        }
    }
}

/// What a job's completions hand back.
struct Returned {
    bios: Vec<Bio>,
    hist: LatHist,
    errors: u64,
    first_error: Option<String>,
}

/// A job's completion side (registered once as its `EndIo`).
struct JobEnd {
    base: Instant,
    ret: Mutex<Returned>,
    wq: WaitQueue,
}

impl EndIo for JobEnd {
    fn end_io(&self, bio: Bio, res: Result<(), blk::Error>) {
        // cookie: 0 = not timed, else ns since `base` + 1 at submission.
        let lat = (bio.cookie != 0)
            .then(|| (self.base.elapsed().as_nanos() as u64).saturating_sub(bio.cookie - 1));
        {
            let mut r = self.ret.lock().unwrap_or_else(|e| e.into_inner());
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

fn thread_ctx_switches() -> u64 {
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

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

struct JobOut {
    ios: u64,
    hist: LatHist,
    errors: u64,
    first_error: Option<String>,
    ctx: u64,
}

fn run_job(
    q: Arc<Queue>,
    cfg: RunCfg,
    job: usize,
    region: u64,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
) -> JobOut {
    let needs_data = !cfg.device.starts_with("null") || cfg.device.contains("memory_backed=1");
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
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((job as u64 + 1) << 32));
    let mut seq = (blocks / cfg.jobs as u64) * job as u64;
    let mut plug = blk::Plug::new(cfg.iodepth);
    let mut ios = 0u64;
    let mut n = 0u64;
    let ctx0 = thread_ctx_switches();
    while !stop.load(Ordering::Relaxed) {
        while let Some(mut bio) = free.pop() {
            let (op, block) = match cfg.rw {
                Rw::Read | Rw::Write => {
                    let b = seq % blocks;
                    seq += 1;
                    (
                        if cfg.rw == Rw::Read {
                            Op::Read
                        } else {
                            Op::Write
                        },
                        b,
                    )
                }
                Rw::RandRead => (Op::Read, rng.next() % blocks),
                Rw::RandWrite => (Op::Write, rng.next() % blocks),
                Rw::RandRw => {
                    let r = rng.next();
                    let op = if (r >> 40) % 100 < u64::from(cfg.rwmixread) {
                        Op::Read
                    } else {
                        Op::Write
                    };
                    (op, r % blocks)
                }
            };
            bio.op = op;
            bio.len = cfg.bs;
            bio.sector = (block * u64::from(cfg.bs)) >> blk::SECTOR_SHIFT;
            n += 1;
            bio.cookie = if n.is_multiple_of(cfg.lat_sample) {
                end.base.elapsed().as_nanos() as u64 + 1
            } else {
                0
            };
            q.submit_plugged(&mut plug, bio, &end_dyn);
        }
        q.flush_plug(&mut plug);
        // Reap: whatever has completed; sleep only when nothing has.
        loop {
            let got = {
                let mut r = end.ret.lock().unwrap_or_else(|e| e.into_inner());
                std::mem::swap(&mut r.bios, &mut free);
                free.len()
            };
            if got > 0 {
                ios += got as u64;
                done.fetch_add(got as u64, Ordering::Relaxed);
                break;
            }
            end.wq.wait_for(|| {
                let r = end.ret.lock().unwrap_or_else(|e| e.into_inner());
                (!r.bios.is_empty()).then_some(())
            });
        }
    }
    // Drain what is still in flight before the queue can go away.
    while free.len() < cfg.iodepth {
        end.wq
            .wait_for(|| {
                let mut r = end.ret.lock().unwrap_or_else(|e| e.into_inner());
                (!r.bios.is_empty()).then(|| std::mem::take(&mut r.bios))
            })
            .into_iter()
            .for_each(|b| free.push(b));
    }
    let ctx = thread_ctx_switches().saturating_sub(ctx0);
    let r = end.ret.lock().unwrap_or_else(|e| e.into_inner());
    JobOut {
        ios,
        hist: r.hist.clone(),
        errors: r.errors,
        first_error: r.first_error.clone(),
        ctx,
    }
}

fn build_queue(cfg: &RunCfg) -> Result<Queue> {
    let spec: DeviceSpec = cfg.device.parse()?;
    let ov = QueueOverrides {
        hw_queues: cfg.hw_queues,
        queue_depth: cfg.queue_depth,
        shared_tags: cfg.shared_tags.then_some(true),
        wake: Some(cfg.wake),
        policy: Some(cfg.policy),
        read_only: false,
        sched: Some(cfg.sched),
        sched_lock: Some(cfg.sched_lock),
    };
    let q = spec
        .build(&ov)
        .with_context(|| format!("building device {}", cfg.device))?;
    for p in q.pools() {
        p.set_batch(cfg.batch_requests, cfg.batch_time);
        p.set_max_in_flight(cfg.max_in_flight);
    }
    Ok(q)
}

fn run_once(cfg: &RunCfg, progress: bool) -> Result<RunResult> {
    let q = Arc::new(build_queue(cfg)?);
    let cap = q.core().limits().capacity;
    let region = cfg.size.unwrap_or(cap).min(cap);
    if region < u64::from(cfg.bs) {
        bail!(
            "device region ({region} bytes) is smaller than one block ({})",
            cfg.bs
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let handles: Vec<_> = (0..cfg.jobs)
        .map(|j| {
            let (q, cfg, stop, done) = (q.clone(), cfg.clone(), stop.clone(), done.clone());
            std::thread::Builder::new()
                .name(format!("bench-job{j}"))
                .spawn(move || run_job(q, cfg, j, region, stop, done))
        })
        .collect::<std::io::Result<_>>()?;
    let mut last = (t0, 0u64);
    while t0.elapsed() < cfg.runtime {
        let left = cfg.runtime.saturating_sub(t0.elapsed());
        std::thread::sleep(left.min(Duration::from_secs(1)));
        if progress && cfg.runtime > Duration::from_secs(3) && t0.elapsed() < cfg.runtime {
            let now = (Instant::now(), done.load(Ordering::Relaxed));
            let rate = (now.1 - last.1) as f64 / (now.0 - last.0).as_secs_f64();
            eprintln!(
                "  [{:>4.1}s/{:.0}s] {:.0} IOPS",
                t0.elapsed().as_secs_f64(),
                cfg.runtime.as_secs_f64(),
                rate
            );
            last = now;
        }
    }
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

fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

fn wake_name(w: WakeAlgo) -> &'static str {
    match w {
        WakeAlgo::Counter => "counter",
        WakeAlgo::Legacy => "legacy",
    }
}

fn policy_name(p: PoolPolicy) -> &'static str {
    match p {
        PoolPolicy::Steal => "steal",
        PoolPolicy::Fifo => "fifo",
        PoolPolicy::Batch => "batch",
    }
}

fn to_json(cfg: &RunCfg, r: &RunResult, repeat: usize) -> String {
    format!(
        concat!(
            "{{\"device\":{},\"rw\":\"{}\",\"bs\":{},\"iodepth\":{},\"jobs\":{},",
            "\"runtime_s\":{:.3},\"hw_queues\":{},\"queue_depth\":{},\"shared_tags\":{},",
            "\"wake\":\"{}\",\"policy\":\"{}\",\"sched\":\"{}\",\"sched_lock\":{},",
            "\"max_in_flight\":{},",
            "\"repeat\":{},\"ios\":{},\"errors\":{},\"iops\":{:.0},\"bw_bytes\":{:.0},",
            "\"lat_ns\":{{\"mean\":{},\"p50\":{},\"p99\":{},\"p999\":{},\"max\":{},",
            "\"samples\":{},\"sampled_every\":{}}},",
            "\"tag_wait\":{{\"count\":{},\"mean_ns\":{},\"max_ns\":{},\"p99_ns\":{}}},",
            "\"ctx_switches\":{},\"ctx_switches_per_io\":{:.4},\"merges\":{},",
            "\"sched_lock_attempts\":{},\"sched_lock_contended\":{},",
            "\"contended_per_io\":{:.4}}}"
        ),
        json_str(&cfg.device),
        cfg.rw.name(),
        cfg.bs,
        cfg.iodepth,
        cfg.jobs,
        r.secs,
        cfg.hw_queues.map_or("null".into(), |v| v.to_string()),
        cfg.queue_depth.map_or("null".into(), |v| v.to_string()),
        cfg.shared_tags,
        wake_name(cfg.wake),
        policy_name(cfg.policy),
        cfg.sched.name(),
        match cfg.sched {
            SchedChoice::None => "null".to_string(),
            _ => format!("\"{}\"", cfg.sched_lock.name()),
        },
        cfg.max_in_flight.map_or("null".into(), |v| v.to_string()),
        repeat,
        r.ios,
        r.errors,
        r.iops,
        r.bw_bytes,
        r.lat.mean,
        r.lat.p50,
        r.lat.p99,
        r.lat.p999,
        r.lat.max,
        r.lat.samples,
        cfg.lat_sample,
        r.tag_wait_count,
        r.tag_wait_mean_ns,
        r.tag_wait_max_ns,
        r.tag_wait_p99_ns,
        r.ctx_switches,
        r.ctx_switches as f64 / r.ios.max(1) as f64,
        r.merges,
        r.lock_attempts,
        r.lock_contended,
        r.contended_per_io(),
    )
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len().max(1) as f64;
    let m = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (m, var.sqrt())
}

fn kfmt(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else {
        format!("{:.1}K", x / 1e3)
    }
}

fn list<T: FromStr>(s: &str, what: &str) -> Result<Vec<T>>
where
    T::Err: std::fmt::Display,
{
    s.split(',')
        .map(|x| {
            x.trim()
                .parse::<T>()
                .map_err(|e| anyhow::anyhow!("bad {what} {x:?}: {e}"))
        })
        .collect()
}

/// Applies one sweep value to a config.
fn apply(cfg: &mut RunCfg, key: &str, val: &str) -> Result<()> {
    match key {
        "queue-depth" | "queue_depth" => cfg.queue_depth = Some(val.parse()?),
        "iodepth" => cfg.iodepth = val.parse()?,
        "jobs" => cfg.jobs = val.parse()?,
        "hw-queues" | "hw_queues" => cfg.hw_queues = Some(val.parse()?),
        "bs" => cfg.bs = parse_size(val)? as u32,
        "max-in-flight" | "max_in_flight" => cfg.max_in_flight = Some(val.parse()?),
        _ => {
            bail!("cannot sweep {key:?} (queue-depth, iodepth, jobs, hw-queues, bs, max-in-flight)")
        }
    }
    Ok(())
}

/// Writes a pattern over the region and reads it back.
fn verify(cfg: &RunCfg) -> Result<()> {
    let q = build_queue(cfg)?;
    let cap = q.core().limits().capacity;
    let region = cfg.size.unwrap_or(cap.min(1 << 30)).min(cap);
    let bs = u64::from(cfg.bs);
    let blocks = region / bs;
    let pattern = |block: u64, i: usize| -> u8 {
        (block.wrapping_mul(0x9e37_79b9).wrapping_add(i as u64 * 31) >> 3) as u8
    };
    struct Done(Mutex<Vec<(Bio, Option<String>)>>, WaitQueue);
    impl EndIo for Done {
        fn end_io(&self, bio: Bio, res: Result<(), blk::Error>) {
            self.0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((bio, res.err().map(|e| e.to_string())));
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
                q.submit(bio, &end);
                in_flight += 1;
                next += 1;
            }
            let got = done.1.wait_for(|| {
                let mut v = done.0.lock().unwrap_or_else(|e| e.into_inner());
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

/// Runs `blkq bench`.
pub fn run(a: BenchArgs) -> Result<()> {
    if a.iodepth == 0 || a.jobs == 0 || a.repeat == 0 || a.lat_sample == 0 {
        bail!("--iodepth, --jobs, --repeat and --lat-sample must be at least 1");
    }
    let wakes: Vec<WakeAlgo> = list(&a.wake, "--wake")?;
    let policies: Vec<PoolPolicy> = list(&a.policy, "--policy")?;
    let scheds: Vec<SchedChoice> = list(&a.sched, "--sched")?;
    let locks: Vec<LockMode> = list(&a.sched_lock, "--sched-lock")?;
    // Rows of schedulers: `none` once, mq-deadline once per lock design.
    let mut sched_rows: Vec<(SchedChoice, LockMode)> = vec![];
    for &s in &scheds {
        match s {
            SchedChoice::None => sched_rows.push((s, locks[0])),
            _ => sched_rows.extend(locks.iter().map(|&l| (s, l))),
        }
    }
    let base = RunCfg {
        device: a.device.clone(),
        rw: a.rw.parse()?,
        rwmixread: a.rwmixread.min(100),
        bs: u32::try_from(parse_size(&a.bs)?).context("--bs too large")?,
        iodepth: a.iodepth,
        jobs: a.jobs,
        runtime: Duration::from_secs_f64(a.runtime.max(0.1)),
        hw_queues: a.hw_queues,
        queue_depth: a.queue_depth,
        shared_tags: a.shared_tags,
        wake: wakes[0],
        policy: policies[0],
        sched: sched_rows[0].0,
        sched_lock: sched_rows[0].1,
        max_in_flight: a.max_in_flight,
        batch_requests: a.batch_requests,
        batch_time: Duration::from_micros(a.batch_time_us),
        size: a.size.as_deref().map(parse_size).transpose()?,
        lat_sample: a.lat_sample,
    };
    if a.verify {
        return verify(&base);
    }
    let (sweep_key, sweep_vals): (Option<String>, Vec<String>) = match &a.sweep {
        Some(s) => {
            let (k, v) = s.split_once('=').context("--sweep expects key=v1,v2,...")?;
            (
                Some(k.to_string()),
                v.split(',').map(str::to_string).collect(),
            )
        }
        None => (None, vec![String::new()]),
    };
    // rows: (wake, policy, scheduler); columns: sweep values; cells: iops per repeat
    let mut table: Vec<(String, Vec<(f64, f64)>)> = vec![];
    // the same rows, cells: contended scheduler-lock acquisitions per I/O
    let mut contention: Vec<(String, Vec<(f64, f64)>)> = vec![];
    let progress = !a.json && a.repeat == 1 && sweep_key.is_none();
    for &w in &wakes {
        for &p in &policies {
            for &(sc, lk) in &sched_rows {
                let mut row = vec![];
                let mut crow = vec![];
                for v in &sweep_vals {
                    let mut cfg = base.clone();
                    cfg.wake = w;
                    cfg.policy = p;
                    cfg.sched = sc;
                    cfg.sched_lock = lk;
                    if let Some(k) = &sweep_key {
                        apply(&mut cfg, k, v)?;
                    }
                    let mut iops = vec![];
                    let mut cont = vec![];
                    for rep in 0..a.repeat {
                        let r = run_once(&cfg, progress)?;
                        if a.json {
                            println!("{}", to_json(&cfg, &r, rep));
                        } else if sweep_key.is_none() && a.repeat == 1 {
                            print_human(&cfg, &r);
                        }
                        iops.push(r.iops);
                        cont.push(r.contended_per_io());
                    }
                    row.push(mean_sd(&iops));
                    crow.push(mean_sd(&cont));
                }
                let mut name = format!("{}/{}", wake_name(w), policy_name(p));
                if sched_rows.len() > 1 || sc != SchedChoice::None {
                    name = match sc {
                        SchedChoice::None => format!("{name}/none"),
                        _ => format!("{name}/{}/{}", sc.name(), lk.name()),
                    };
                }
                if sc != SchedChoice::None {
                    contention.push((name.clone(), crow));
                }
                table.push((name, row));
            }
        }
    }
    if !a.json && (sweep_key.is_some() || a.repeat > 1 || table.len() > 1) {
        let key = sweep_key.as_deref().unwrap_or("-");
        print_table(key, &sweep_vals, &table, &kfmt);
        if !contention.is_empty() {
            println!("\ncontended scheduler-lock acquisitions per I/O (mean (sd)):");
            print_table(key, &sweep_vals, &contention, &|x| format!("{x:.4}"));
        }
    }
    Ok(())
}

fn print_human(cfg: &RunCfg, r: &RunResult) {
    println!(
        "{} {} bs={} iodepth={} jobs={} wake={} policy={} sched={}{}",
        cfg.device,
        cfg.rw.name(),
        cfg.bs,
        cfg.iodepth,
        cfg.jobs,
        wake_name(cfg.wake),
        policy_name(cfg.policy),
        cfg.sched.name(),
        match cfg.sched {
            SchedChoice::None => String::new(),
            _ => format!(" sched_lock={}", cfg.sched_lock.name()),
        }
    );
    println!(
        "  iops={} bw={:.1}MiB/s ios={} errors={} ({:.2}s)",
        kfmt(r.iops),
        r.bw_bytes / (1 << 20) as f64,
        r.ios,
        r.errors,
        r.secs
    );
    println!(
        "  lat(ns, 1 in {}): mean={} p50={} p99={} p99.9={} max={}",
        cfg.lat_sample, r.lat.mean, r.lat.p50, r.lat.p99, r.lat.p999, r.lat.max
    );
    println!(
        "  tag waits={} mean={}ns p99<={}ns max={}ns  ctx switches={} ({:.4}/io)",
        r.tag_wait_count,
        r.tag_wait_mean_ns,
        r.tag_wait_p99_ns,
        r.tag_wait_max_ns,
        r.ctx_switches,
        r.ctx_switches as f64 / r.ios.max(1) as f64
    );
    if cfg.sched != SchedChoice::None {
        println!(
            "  sched: merges={} lock acquisitions={} contended={} ({:.4}/io)",
            r.merges,
            r.lock_attempts,
            r.lock_contended,
            r.contended_per_io()
        );
    }
}

fn print_table(
    key: &str,
    vals: &[String],
    table: &[(String, Vec<(f64, f64)>)],
    fmt: &dyn Fn(f64) -> String,
) {
    let w = table
        .iter()
        .map(|(n, _)| n.len())
        .chain([key.len(), 16])
        .max()
        .unwrap_or(16);
    let mut out = String::new();
    let _ = write!(out, "| {key:<w$} |");
    for v in vals {
        let _ = write!(out, " {v:>17} |");
    }
    out.push('\n');
    let _ = write!(out, "|{}|", "-".repeat(w + 2));
    for _ in vals {
        let _ = write!(out, "{}|", "-".repeat(19));
    }
    out.push('\n');
    for (name, row) in table {
        let _ = write!(out, "| {name:<w$} |");
        for (m, sd) in row {
            let _ = write!(out, " {:>17} |", format!("{} ({})", fmt(*m), fmt(*sd)));
        }
        out.push('\n');
    }
    if table.len() == 2 {
        let _ = write!(out, "| {:<w$} |", "ratio row1/row2");
        for (a, b) in table[0].1.iter().zip(&table[1].1) {
            let r = if b.0 > 0.0 {
                format!("{:.3}", a.0 / b.0)
            } else {
                "-".to_string()
            };
            let _ = write!(out, " {r:>17} |");
        }
        out.push('\n');
    }
    print!("{out}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lat_hist_quantiles_are_close() {
        let mut h = LatHist::new();
        for ns in 1..=10_000u64 {
            h.record(ns);
        }
        let p50 = h.quantile(0.5) as f64;
        let p99 = h.quantile(0.99) as f64;
        assert!((p50 / 5000.0 - 1.0).abs() < 0.07, "p50 {p50}");
        assert!((p99 / 9900.0 - 1.0).abs() < 0.07, "p99 {p99}");
        assert_eq!(h.quantile(1.0), 10_000);
        for i in 0..LatHist::index(u64::MAX) {
            assert!(LatHist::upper(i) < LatHist::upper(i + 1), "bucket {i}");
        }
        for ns in [0u64, 1, 15, 16, 17, 1000, 123_456_789] {
            assert!(LatHist::upper(LatHist::index(ns)) >= ns);
        }
    }
}
