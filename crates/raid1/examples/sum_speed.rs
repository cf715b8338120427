//! What summing one 4 KiB block costs (the per-block checksums' hash, `raid1::integrity`):
//! ns per block over a loop, as docs/bench.md section 22 quotes it.
//!   cargo run --release -p raid1 --example sum_speed -- [BLOCKS]
fn main() {
    let n: u32 = std::env::args()
        .nth(1)
        .map_or(2_000_000, |s| s.parse().expect("BLOCKS"));
    let block = vec![0x5au8; 4096];
    let t = std::time::Instant::now();
    let mut acc = 0u32;
    for i in 0..n {
        acc ^= raid1::integrity::block_sum(std::hint::black_box(&block)).wrapping_add(i);
    }
    let ns = t.elapsed().as_nanos() as f64 / f64::from(n);
    println!("block_sum (crc32c) of 4 KiB: {ns:.1} ns ({n} blocks, {acc:x})");
}
