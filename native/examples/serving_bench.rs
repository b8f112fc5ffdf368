//! Python-free micro-benchmark of the serving store: memory per value after a full
//! version, lookup latency of prediction requests (26 requests of 64 IDs, uniform over
//! the table, so nearly all cache misses, or Zipf-like; then the same IDs every call, all
//! cached; and a dense gather of as many rows by position, for scale), and the cost of
//! applying a 100k-row delta (90% updates of present rows, 10% new IDs).
//! `cargo run --release --example serving_bench -- [rows] [shards] [dim] [threads]`
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use half::f16;
use trillium_native::config::DType;
use trillium_native::hash::{mix64, shard_of, SplitMix64};
use trillium_native::serving::{ApplyReport, ServingSlice, ServingTables};
use trillium_native::values::ValuesWriter;

/// A values file of one table "t" of `ids` (sorted), row of `id` = `(id % 1000) / 1000 + tag`.
fn write(path: &Path, delta: bool, ids: &[u64], dim: usize, tag: f32) {
    let mut f = BufWriter::with_capacity(4 << 20, File::create(path).expect("create"));
    let mut w = ValuesWriter::new(&mut f, DType::F16, delta, 1, 0).expect("header");
    w.table("t", dim, ids).expect("table");
    let mut row = vec![f16::ZERO; dim];
    for &id in ids {
        row.fill(f16::from_f32((id % 1000) as f32 / 1000.0 + tag));
        w.values(&row).expect("values");
    }
    w.finish().expect("trailer");
    f.flush().expect("flush");
}

fn report(what: &str, r: &ApplyReport, wall: f64) {
    println!(
        "{what}: {:.1} ms wall (read {:.1}, build {:.1}, lock wait {:.3}, lock held {:.3} ms); \
         {} rows, {} updated, {} inserted, {} parts merged",
        wall * 1e3,
        r.read_s * 1e3,
        r.build_s * 1e3,
        r.lock_wait_s * 1e3,
        r.lock_hold_s * 1e3,
        r.rows,
        r.rows_updated,
        r.rows_inserted,
        r.parts_merged
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: u64| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (rows, shards, dim, threads) = (arg(1, 1_000_000) as usize, arg(2, 2) as u32, arg(3, 64) as usize, arg(4, 2));
    let dir = std::env::temp_dir().join(format!("trl-serving-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let all: Vec<u64> = (0..rows as u64).map(|i| mix64(i + 1)).collect();
    let files = |name: &str, ids: &[u64], delta: bool, tag: f32| -> Vec<(u32, PathBuf)> {
        (0..shards)
            .map(|s| {
                let mut own: Vec<u64> = ids.iter().copied().filter(|&id| shard_of(id, shards) == s).collect();
                own.sort_unstable();
                let p = dir.join(format!("{name}-{s}"));
                write(&p, delta, &own, dim, tag);
                (s, p)
            })
            .collect()
    };
    let st = ServingTables::new(&[("t".into(), dim)], shards, ServingSlice::WHOLE, DType::F16, threads as usize)
        .expect("store");
    let full = files("full", &all, false, 0.0);
    let t0 = Instant::now();
    let r = st.apply(&full, 1).expect("apply");
    report("full apply", &r, t0.elapsed().as_secs_f64());
    let mem = st.memory_bytes();
    println!(
        "rows {rows}, dim {dim}, shards {shards}: memory {mem} bytes = {:.4} bytes/value ({:.2} bytes/row of index)",
        mem as f64 / (rows * dim) as f64,
        (mem as f64 - (rows * dim * 2) as f64) / rows as f64
    );

    // Prediction requests: 26 requests of 64 IDs, drawn anew for every call, uniformly
    // (nearly every row a cache miss) or Zipf(1.1)-like (a hot set, as real traffic has).
    let mut rng = SplitMix64::new(7);
    let mut outs: Vec<Vec<f32>> = (0..26).map(|_| vec![0f32; 64 * dim]).collect();
    for (what, zipf) in [("uniform", false), ("Zipf(1.1)", true)] {
        let mut times = Vec::new();
        for call in 0..3000 {
            let mut draw = || {
                let u = ((rng.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
                let k = if zipf { (u.powf(-10.0).min(1e18) as u64).saturating_sub(1) } else { rng.next() };
                all[(k % rows as u64) as usize]
            };
            let ids: Vec<Vec<u64>> = (0..26).map(|_| (0..64).map(|_| draw()).collect()).collect();
            let reqs: Vec<(usize, &[u64])> = ids.iter().map(|v| (0, &v[..])).collect();
            let mut o: Vec<&mut [f32]> = outs.iter_mut().map(|v| &mut v[..]).collect();
            let mut misses = [0u64; 26];
            let t = Instant::now();
            st.lookup(&reqs, &mut o, &mut misses);
            if call >= 100 {
                times.push(t.elapsed().as_secs_f64() * 1e6);
            }
            assert_eq!(misses.iter().sum::<u64>(), 0);
        }
        times.sort_by(f64::total_cmp);
        let q = |f: f64| times[((times.len() - 1) as f64 * f) as usize];
        println!(
            "lookup 26 x 64 IDs, {what}: median {:.1} us, p90 {:.1} us, p99 {:.1} us ({:.1} ns per ID, median)",
            q(0.5),
            q(0.9),
            q(0.99),
            q(0.5) * 1e3 / 1664.0
        );
    }

    // The same 1664 IDs again and again: everything in cache, the CPU's cost alone.
    let ids: Vec<Vec<u64>> =
        (0..26).map(|_| (0..64).map(|_| all[(rng.next() % rows as u64) as usize]).collect()).collect();
    let reqs: Vec<(usize, &[u64])> = ids.iter().map(|v| (0, &v[..])).collect();
    let mut warm = Vec::new();
    for _ in 0..3000 {
        let mut o: Vec<&mut [f32]> = outs.iter_mut().map(|v| &mut v[..]).collect();
        let mut misses = [0u64; 26];
        let t = Instant::now();
        st.lookup(&reqs, &mut o, &mut misses);
        warm.push(t.elapsed().as_secs_f64() * 1e6);
    }
    warm.sort_by(f64::total_cmp);
    println!(
        "lookup 26 x 64 IDs, the same every call (cached): median {:.1} us, min {:.1} us",
        warm[warm.len() / 2],
        warm[0]
    );

    // For scale: the same gather from a dense (huge-page) array of the rows, by position.
    let mut dense = trillium_native::mem::RawBuf::<f16>::zeroed(rows * dim, true);
    for (k, v) in dense.iter_mut().enumerate() {
        *v = f16::from_f32((k % 7) as f32);
    }
    let mut gtimes = Vec::new();
    for call in 0..3000 {
        let pos: Vec<usize> = (0..1664).map(|_| (rng.next() % rows as u64) as usize).collect();
        let t = Instant::now();
        for (k, &p) in pos.iter().enumerate() {
            let o = &mut outs[k / 64][(k % 64) * dim..(k % 64 + 1) * dim];
            trillium_native::elem::widen_f16(&dense[p * dim..(p + 1) * dim], o);
        }
        if call >= 100 {
            gtimes.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    gtimes.sort_by(f64::total_cmp);
    println!(
        "dense gather of 1664 rows by position, for scale: median {:.1} us, min {:.1} us",
        gtimes[gtimes.len() / 2],
        gtimes[0]
    );
    drop(dense);

    // A 100k-row delta: 90k present rows updated, 10k new IDs.
    let mut delta: Vec<u64> = (0..90_000).map(|k| all[(mix64(k + 99) % rows as u64) as usize]).collect();
    delta.sort_unstable();
    delta.dedup();
    delta.extend((0..10_000u64).map(|k| mix64(rows as u64 + 1 + k)));
    let d = files("delta", &delta, true, 1.0);
    let t0 = Instant::now();
    let r = st.apply(&d, 2).expect("apply delta");
    report("100k-row delta apply", &r, t0.elapsed().as_secs_f64());
    println!("after the delta: {:.4} bytes/value", st.memory_bytes() as f64 / (st.stats()[0].rows * dim as u64) as f64);
    std::fs::remove_dir_all(&dir).expect("cleanup");
}
