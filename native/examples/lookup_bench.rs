//! Python-free micro-benchmark of the core: best-batch lookup/update rate vs. a
//! plain gather from a dense (huge-page) array, Zipf(1.1)-like ids.
//! `cargo run --release --example lookup_bench -- [rows] [dim] [threads]`
use std::time::Instant;
use trillium_native::config::{OptKind, TableConfig};
use trillium_native::hash::SplitMix64;
use trillium_native::mem::RawBuf;
use trillium_native::store::Store;

fn zipf_ids(rows: u64, n: usize, seed: u64) -> Vec<u64> {
    // Continuous Pareto(0.1) tail (the Zipf(1.1) rank distribution), folded into [0, rows).
    let mut r = SplitMix64::new(seed);
    (0..n)
        .map(|_| {
            let u = ((r.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            let k = u.powf(-10.0);
            let k = if k.is_finite() && k < 1e18 { k as u64 } else { u64::MAX / 2 };
            (k - 1) % rows
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: u64| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (rows, dim, threads) = (arg(1, 1_000_000), arg(2, 64) as usize, arg(3, 1) as usize);
    let store = Store::new(None, Some(threads)).expect("store");
    let mut c = TableConfig::new("t", dim);
    c.optimizer = OptKind::RowwiseAdagrad;
    store.create_table(c).expect("table");
    let t = store.table("t").expect("table");
    let b = 65536usize;
    let mut out = vec![0f32; b * dim];
    let t0 = Instant::now();
    for s in (0..rows).step_by(b) {
        let ids: Vec<u64> = (s..(s + b as u64).min(rows)).collect();
        store.lookup(&t, &ids, &mut out[..ids.len() * dim], true);
    }
    eprintln!("populate: {:.2} M rows/s", rows as f64 / t0.elapsed().as_secs_f64() / 1e6);
    let batches: Vec<Vec<u64>> = (0..20).map(|i| zipf_ids(rows, b, i)).collect();
    let dense = RawBuf::<f32>::filled(rows as usize * dim, 0.01, true);
    let grads = vec![0.001f32; b * dim];
    let mut best = [f64::MAX; 3];
    for _ in 0..10 {
        for ids in &batches {
            let t0 = Instant::now();
            store.lookup(&t, ids, &mut out, true);
            std::hint::black_box(&out);
            best[0] = best[0].min(t0.elapsed().as_secs_f64());
            let t0 = Instant::now();
            for (k, &id) in ids.iter().enumerate() {
                let i = id as usize;
                out[k * dim..(k + 1) * dim].copy_from_slice(&dense[i * dim..(i + 1) * dim]);
            }
            std::hint::black_box(&out);
            best[1] = best[1].min(t0.elapsed().as_secs_f64());
            let t0 = Instant::now();
            store.update(&t, ids, &grads);
            best[2] = best[2].min(t0.elapsed().as_secs_f64());
        }
    }
    let r = |x: f64| b as f64 / x / 1e6;
    eprintln!(
        "best batch: lookup {:.2} M rows/s, dense gather {:.2} M rows/s (ratio {:.3}), update {:.2} M rows/s",
        r(best[0]),
        r(best[1]),
        best[1] / best[0],
        r(best[2])
    );
}
