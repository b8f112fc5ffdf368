//! The disk tier: a table with a tiny RAM budget answers exactly as the same table all in
//! RAM, over random operations, for every optimizer, dtype, admission and eviction setting.

use super::*;
use crate::config::{DType, OptKind};
use crate::hash::SplitMix64;
use crate::test_dir::TestDir;
use crate::with_shards;

/// `cfg` with a RAM budget of `budget_rows` rows and its spill files in `dir` (unlinked once
/// open, so the test's `TestDir` may go before its tables do).
fn with_tier(cfg: &TableConfig, budget_rows: u64, dir: &TestDir) -> TableConfig {
    let mut c = cfg.clone();
    let l = Layout::new(&{
        let mut x = cfg.clone();
        x.disk = Some(String::new());
        x
    });
    c.memory_budget_bytes = Some(budget_rows * l.ram_row_bytes(cfg.dtype.size()) as u64);
    c.disk = Some(dir.to_string_lossy().into_owned());
    c
}

fn ctx_of(t: &Table, version: u64, now: u32, batch: u32) -> Ctx<'_> {
    let mut c = t.ctx(version, now, batch);
    c.sequential = true;
    c
}

/// A row's state as bits: weights, state, accumulator, step, version, update time and batch.
type StateBits = (Vec<u32>, Vec<u32>, Option<u32>, Option<u32>, u64, Option<u32>, Option<u32>);

fn states(t: &Table, ids: u64) -> Vec<Option<StateBits>> {
    (0..ids)
        .map(|id| {
            t.get_state(id).map(|s| {
                (
                    s.weights.iter().map(|x| x.to_bits()).collect(),
                    s.state.iter().map(|x| x.to_bits()).collect(),
                    s.acc.map(f32::to_bits),
                    s.step,
                    s.version,
                    s.utime,
                    s.utick,
                )
            })
        })
        .collect()
}

fn delta(t: &Table, since: u64) -> Vec<(u64, Vec<u32>)> {
    let (ids, rows) = t.export_delta(since);
    let d = t.cfg.dim;
    let mut v: Vec<(u64, Vec<u32>)> = ids
        .iter()
        .enumerate()
        .map(|(k, &id)| (id, rows[k * d..(k + 1) * d].iter().map(|x| x.to_bits()).collect()))
        .collect();
    v.sort();
    v
}

/// Run the same random operations on `a` and `b`; every answer must be bit-identical.
fn run_same(a: &Table, b: &Table, seed: u64, steps: usize, universe: u64) {
    let mut rng = SplitMix64::new(seed);
    let dim = a.cfg.dim;
    let mut version = 1u64;
    let mut batch = 0u32;
    let mut now = 1000u32;
    for _ in 0..steps {
        let op = rng.next() % 10;
        let n = 1 + (rng.next() % 12) as usize;
        let ids: Vec<u64> = (0..n).map(|_| rng.next() % universe).collect();
        match op {
            0..=3 => {
                let create = op != 3;
                let (mut oa, mut ob) = (vec![0f32; n * dim], vec![0f32; n * dim]);
                a.lookup(&ctx_of(a, version, now, batch), &ids, &mut oa, create);
                b.lookup(&ctx_of(b, version, now, batch), &ids, &mut ob, create);
                assert_eq!(
                    oa.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    ob.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                );
            }
            4..=6 => {
                version += 1;
                batch += 1;
                for t in [a, b] {
                    t.counters.update_batches.store(batch as u64, Ordering::Relaxed);
                }
                let grads: Vec<f32> = (0..n * dim).map(|_| ((rng.next() % 2001) as f32 - 1000.0) / 5000.0).collect();
                let ua = a.update(&ctx_of(a, version, now, batch), &ids, &grads);
                let ub = b.update(&ctx_of(b, version, now, batch), &ids, &grads);
                assert_eq!(ua, ub);
            }
            7 => {
                version += 1;
                let vals: Vec<f32> = (0..dim).map(|i| i as f32 * 0.25 - 0.5).collect();
                let ra = a.set_row(&ctx_of(a, version, now, batch), ids[0], &vals).is_ok();
                let rb = b.set_row(&ctx_of(b, version, now, batch), ids[0], &vals).is_ok();
                assert_eq!(ra, rb);
            }
            8 => {
                now += (rng.next() % 120) as u32;
                let ea = a.expire(&ctx_of(a, version, now, batch));
                let eb = b.expire(&ctx_of(b, version, now, batch));
                assert_eq!(ea, eb);
            }
            _ => {
                let since = rng.next() % (version + 1);
                assert_eq!(delta(a, since), delta(b, since));
            }
        }
        assert_eq!(a.rows(), b.rows());
        assert_eq!(a.counters.snapshot(), b.counters.snapshot());
    }
    assert_eq!(states(a, universe), states(b, universe));
}

fn configs() -> Vec<TableConfig> {
    let mut out = Vec::new();
    for (k, opt) in
        [OptKind::Sgd, OptKind::Adagrad, OptKind::RowwiseAdagrad, OptKind::Adam, OptKind::Ftrl].into_iter().enumerate()
    {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let mut c = TableConfig::new("t/x", 3 + k);
            c.optimizer = opt;
            c.dtype = dtype;
            c.lr = 0.05;
            c.seed = k as u64;
            out.push(c.clone());
            let mut e = c.clone();
            e.capacity = Some(40);
            e.ttl_seconds = Some(60);
            out.push(e);
            let mut u = c.clone();
            u.ttl_updates = Some(7);
            u.admission = crate::config::AdmissionKind::Threshold;
            u.admission_threshold = 2;
            u.sketch_width = 64;
            out.push(u);
            let mut p = c;
            p.admission = crate::config::AdmissionKind::Probability;
            p.admission_probability = 0.6;
            p.capacity = Some(25);
            p.ttl_updates = Some(5);
            out.push(p);
        }
    }
    out
}

#[test]
fn tiny_budget_answers_as_all_in_ram() {
    let dir = TestDir::new("spill-all-in-ram");
    let (mut evicted, mut expired) = (0, 0);
    for (i, cfg) in configs().into_iter().enumerate() {
        for (budget, shards) in [(0u64, 1usize), (3, 1), (5, 4)] {
            let a = Table::new(cfg.clone(), shards).unwrap();
            let b = Table::new(with_tier(&cfg, budget, &dir), shards).unwrap();
            run_same(&a, &b, i as u64 * 31 + budget, 150, 80);
            let spilled: u64 = b.disk_stats().iter().map(|d| d.writes).sum();
            assert!(spilled > 0, "config {i}: nothing was spilled");
            let c = b.counters.snapshot();
            if cfg.capacity.is_some() || cfg.ttl_seconds.is_some() || cfg.ttl_updates.is_some() {
                assert!(c[2] + c[3] > 0, "config {i}: nothing was evicted or expired");
            }
            evicted += c[2];
            expired += c[3];
            assert!(b.tier_error().is_none());
        }
    }
    assert!(evicted > 1000 && expired > 1000, "{evicted} {expired}");
}

#[test]
fn resident_rows_stay_within_the_budget_and_the_file_is_reused() {
    let dir = TestDir::new("spill-budget");
    let cfg = TableConfig::new("t", 8);
    let t = Table::new(with_tier(&cfg, 100, &dir), 1).unwrap();
    let mut out = vec![0f32; 8 * 1000];
    for round in 0..5u64 {
        let ids: Vec<u64> = (0..1000).map(|i| i + round * 200).collect();
        t.lookup(&ctx_of(&t, 1, 0, 0), &ids, &mut out, true);
        let d = t.disk_stats()[0];
        assert!(d.resident_rows <= 100, "{d:?}");
        assert_eq!(d.rows + d.resident_rows, t.rows() as u64);
    }
    let d = t.disk_stats()[0];
    // records are fixed-size and free ones are reused: the file holds what is cold, and
    // grows an eighth (64 KiB at least) at a time
    let records = d.rows * (8 + 8 * 4 + 4);
    assert!(records <= d.bytes && d.bytes <= records * 9 / 8 + (68 << 10), "{d:?}");
    assert_eq!(t.rows(), 1800);
    assert!(d.lookup_hits > 0 && d.reads >= d.lookup_hits);
}

#[test]
fn a_full_disk_keeps_rows_in_ram_and_says_why() {
    let dir = TestDir::new("spill-full");
    let cfg = TableConfig::new("full", 4);
    let t = Table::new(with_tier(&cfg, 2, &dir), 1).unwrap();
    if let Shards::F32(s) = &t.shards {
        let mut g = s[0].write();
        let tier = g.tier.as_mut().unwrap();
        // A disk with no room for the file's first growth: it fails with ENOSPC.
        tier.limit_for_test = Some(0);
    }
    let ids: Vec<u64> = (0..10).collect();
    let mut out = vec![0f32; 40];
    t.lookup(&ctx_of(&t, 1, 0, 0), &ids, &mut out, true);
    assert_eq!(t.rows(), 10);
    let e = t.tier_error().expect("failed");
    assert!(e.contains("\"full\"") && e.contains("No space left"), "{e}");
    // every row is still there, in RAM, with its initial value
    for id in 0..10 {
        let mut v = vec![0f32; 4];
        init_values(&t.cfg, id, &mut v);
        assert_eq!(t.get_state(id).unwrap().weights, v);
    }
}

/// The IDs of the cold rows of `t`'s tier.
fn cold_ids(t: &Table) -> Vec<u64> {
    with_shards!(&t.shards, s => s.iter().flat_map(|sh| {
        let g = sh.read();
        let tier = g.tier.as_ref().unwrap();
        (0..tier.len()).map(|i| tier.at(i).id).collect::<Vec<_>>()
    }).collect())
}

#[test]
fn forget_removes_cold_rows_as_resident_ones() {
    let dir = TestDir::new("spill-forget");
    for (i, cfg) in configs().into_iter().enumerate().step_by(5) {
        for shards in [1usize, 4] {
            let a = Table::new(cfg.clone(), shards).unwrap();
            let b = Table::new(with_tier(&cfg, 6, &dir), shards).unwrap();
            run_same(&a, &b, i as u64 * 7 + shards as u64, 120, 80);
            // Every ID looked up (twice: admission), so that rows spill whatever the run left.
            let every: Vec<u64> = (0..80).collect();
            for t in [&a, &b, &a, &b] {
                t.lookup(&ctx_of(t, 1, 0, 0), &every, &mut vec![0f32; 80 * cfg.dim], true);
            }
            let cold = cold_ids(&b);
            assert!(cold.len() > 4, "config {i}: {} cold rows", cold.len());
            // Half the cold rows, every fifth ID of the universe (resident or absent), a repeat.
            let mut gone: Vec<u64> = cold.iter().step_by(2).copied().collect();
            gone.extend((0..80).step_by(5));
            gone.push(gone[0]);
            let n = a.forget(&gone, true);
            assert!(n as usize >= cold.len() / 2, "config {i}: {n} removed");
            assert_eq!(b.forget(&gone, false), n);
            for id in &gone {
                assert!(a.get_state(*id).is_none() && b.get_state(*id).is_none());
            }
            let left: u64 = b.disk_stats().iter().map(|d| d.rows).sum();
            assert_eq!(left as usize, cold.iter().filter(|id| !gone.contains(id)).count());
            assert_eq!(states(&a, 80), states(&b, 80));
            assert_eq!(b.forgotten.load(Ordering::Relaxed), n);
            // And on: the forgotten IDs come back as new rows, the tier's bookkeeping holds.
            run_same(&a, &b, i as u64 * 7 + 1000, 120, 80);
            assert!(b.tier_error().is_none());
        }
    }
}
