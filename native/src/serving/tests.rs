use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use half::f16;

use super::base::Base;
use super::*;
use crate::hash::{mix64, shard_of};
use crate::mem::RawBuf;
use crate::test_dir::TestDir;
use crate::values::ValuesWriter;

/// Rows of one table: id -> values (f32 that are exact in f16).
type Rows = HashMap<u64, Vec<f32>>;

/// Write a values file of `tables` (name, dim, rows), sorted, as fp16.
fn write_file(path: &Path, delta: bool, tables: &[(&str, usize, &Rows)]) {
    let mut f = BufWriter::new(File::create(path).unwrap());
    let mut w = ValuesWriter::new(&mut f, DType::F16, delta, tables.len() as u32, 1).unwrap();
    for (name, dim, rows) in tables {
        let mut ids: Vec<u64> = rows.keys().copied().collect();
        ids.sort_unstable();
        w.table(name, *dim, &ids).unwrap();
        let vals: Vec<f16> = ids.iter().flat_map(|id| rows[id].iter().map(|&v| f16::from_f32(v))).collect();
        w.values(&vals).unwrap();
    }
    w.finish().unwrap();
    f.flush().unwrap();
}

/// `n` uniform IDs owned by `shard` of `shards`, from stream `seed`.
fn owned_ids(n: usize, shard: u32, shards: u32, seed: u64) -> Vec<u64> {
    (0u64..).map(|i| mix64(i ^ (seed << 40))).filter(|&id| shard_of(id, shards) == shard).take(n).collect()
}

fn rows_of(ids: &[u64], dim: usize, tag: f32) -> Rows {
    ids.iter().map(|&id| (id, (0..dim).map(|k| ((id % 97) as f32 + k as f32) * 0.25 + tag).collect())).collect()
}

/// Look `ids` up in table `t`; returns (rows, misses, version).
fn get(s: &ServingTables, t: usize, ids: &[u64]) -> (Vec<f32>, u64, u64) {
    let mut out = vec![0f32; ids.len() * s.dim(t)];
    let mut misses = [0u64];
    let v = s.lookup(&[(t, ids)], &mut [&mut out[..]], &mut misses);
    (out, misses[0], v)
}

/// Every ID of `ids` reads as `model` says (zeros and a miss when absent).
fn check(s: &ServingTables, t: usize, model: &Rows, ids: &[u64]) {
    let dim = s.dim(t);
    let (out, misses, _) = get(s, t, ids);
    let mut want_misses = 0;
    for (k, id) in ids.iter().enumerate() {
        let row = &out[k * dim..(k + 1) * dim];
        match model.get(id) {
            Some(v) => assert_eq!(row, &v[..], "id {id}"),
            None => {
                want_misses += 1;
                assert!(row.iter().all(|&x| x == 0.0), "absent id {id} read {row:?}");
            }
        }
    }
    assert_eq!(misses, want_misses);
}

#[test]
fn base_finds_every_id_uniform_or_not() {
    for (n, uniform) in
        [(0, true), (1, true), (17, true), (65535, true), (65536, true), (300_000, true), (70_000, false)]
    {
        let mut ids: Vec<u64> = if uniform {
            (0..n as u64).map(|i| mix64(i + 1)).collect()
        } else {
            (0..n as u64 * 2).step_by(2).collect()
        };
        ids.sort_unstable();
        let dim = 2;
        let mut vals = RawBuf::<f32>::zeroed(n * dim, false);
        for (k, v) in vals.iter_mut().enumerate() {
            *v = (k / dim) as f32;
        }
        let b = Base::build(&ids, vals, dim);
        assert_eq!(b.ids(), ids, "n {n}");
        for (p, &id) in ids.iter().enumerate() {
            assert_eq!(b.find(id), Some(p));
            assert_eq!(b.row(p)[0], p as f32);
            // Neighbours of present IDs are absent (uniform ones are far apart, the others even).
            if !uniform || ids.binary_search(&(id ^ 1)).is_err() {
                assert_eq!(b.find(id ^ 1), None);
            }
        }
        assert_eq!(b.find(u64::MAX), ids.last().filter(|&&x| x == u64::MAX).map(|_| n - 1));
        if n >= 65536 && uniform {
            // 6-byte keys; at least 2^16 buckets, of 1.25 bytes (u8 starts) below 2^20 rows.
            let per_row = b.index_bytes() as f64 / n as f64;
            let starts = (81920.0 / n as f64).max(0.13);
            assert!(per_row <= 6.02 + starts, "{per_row} index bytes per row at {n} rows");
        }
    }
}

#[test]
fn full_replaces_a_shards_rows_and_delta_upserts() {
    let dir = TestDir::new("serving-full");
    let s = ServingTables::new(&[("a".into(), 4), ("b".into(), 2)], 2, ServingSlice::WHOLE, DType::F16, 2).unwrap();
    assert_eq!(s.version(), 0);
    let a0 = rows_of(&owned_ids(300, 0, 2, 1), 4, 0.0);
    let a1 = rows_of(&owned_ids(300, 1, 2, 1), 4, 0.5);
    let b1 = rows_of(&owned_ids(50, 1, 2, 2), 2, 1.0);
    write_file(&dir.join("s0"), false, &[("a", 4, &a0)]);
    write_file(&dir.join("s1"), false, &[("a", 4, &a1), ("b", 2, &b1)]);
    let r = s.apply(&[(0, dir.join("s0")), (1, dir.join("s1"))], 5).unwrap();
    assert_eq!((r.version, r.files, r.rows, r.parts_replaced), (5, 2, 650, 3));
    assert_eq!(s.version(), 5);
    let mut model_a: Rows = a0.clone().into_iter().chain(a1.clone()).collect();
    let probe_a: Vec<u64> = model_a.keys().copied().chain(owned_ids(40, 0, 2, 9)).collect();
    check(&s, 0, &model_a, &probe_a);
    check(&s, 1, &b1, &b1.keys().copied().collect::<Vec<_>>());

    // A full file of shard 0 replaces shard 0's rows of "a" only.
    let a0_new = rows_of(&owned_ids(100, 0, 2, 3), 4, 2.0);
    write_file(&dir.join("s0b"), false, &[("a", 4, &a0_new)]);
    s.apply(&[(0, dir.join("s0b"))], 6).unwrap();
    model_a.retain(|id, _| shard_of(*id, 2) == 1);
    model_a.extend(a0_new.clone());
    let probe: Vec<u64> = probe_a.iter().copied().chain(a0_new.keys().copied()).collect();
    check(&s, 0, &model_a, &probe);

    // A delta overwrites the rows it lists, adds new ones, keeps the rest.
    let mut d1: Rows = a1.iter().take(20).map(|(id, v)| (*id, v.iter().map(|x| x + 3.0).collect())).collect();
    d1.extend(rows_of(&owned_ids(30, 1, 2, 4), 4, 4.0));
    write_file(&dir.join("d1"), true, &[("a", 4, &d1)]);
    let r = s.apply(&[(1, dir.join("d1"))], 7).unwrap();
    assert_eq!((r.rows_updated, r.rows_inserted, r.parts_replaced), (20, 30, 0));
    model_a.extend(d1.clone());
    let probe: Vec<u64> = probe.iter().copied().chain(d1.keys().copied()).collect();
    check(&s, 0, &model_a, &probe);
    let st = s.stats();
    assert_eq!(st[0].rows, model_a.len() as u64);
    assert_eq!(st[0].overlay_rows, 30);
    assert!(st[0].lookups > 0 && st[0].misses > 0);

    // Several files of one shard in one call fold in order: full, then a delta on top.
    let a1_full = rows_of(&owned_ids(10, 1, 2, 5), 4, 5.0);
    let a1_delta = rows_of(&owned_ids(12, 1, 2, 5)[8..], 4, 6.0);
    write_file(&dir.join("f"), false, &[("a", 4, &a1_full)]);
    write_file(&dir.join("d"), true, &[("a", 4, &a1_delta)]);
    s.apply(&[(1, dir.join("f")), (1, dir.join("d"))], 8).unwrap();
    model_a.retain(|id, _| shard_of(*id, 2) == 0);
    model_a.extend(a1_full);
    model_a.extend(a1_delta);
    let probe: Vec<u64> = probe.iter().copied().chain(model_a.keys().copied()).collect();
    check(&s, 0, &model_a, &probe);
    assert_eq!(s.stats()[0].overlay_rows, 0);
}

#[test]
fn a_slice_keeps_the_rows_of_its_hash_whatever_the_training_shards() {
    let dir = TestDir::new("serving-slice");
    // 2 training shards served by 3 slices: every slice reads both files and keeps its third.
    let a0 = rows_of(&owned_ids(600, 0, 2, 1), 4, 0.0);
    let a1 = rows_of(&owned_ids(600, 1, 2, 1), 4, 0.5);
    write_file(&dir.join("s0"), false, &[("a", 4, &a0)]);
    write_file(&dir.join("s1"), false, &[("a", 4, &a1)]);
    let d1 = rows_of(&owned_ids(90, 1, 2, 7), 4, 1.5);
    write_file(&dir.join("d1"), true, &[("a", 4, &d1)]);
    let whole: Rows = a0.iter().chain(&a1).chain(&d1).map(|(id, v)| (*id, v.clone())).collect();
    let probe: Vec<u64> = whole.keys().copied().collect();
    let mut held = 0;
    for index in 0..3 {
        let slice = ServingSlice { index, count: 3 };
        let s = ServingTables::new(&[("a".into(), 4)], 2, slice, DType::F16, 1).unwrap();
        let r = s.apply(&[(0, dir.join("s0")), (1, dir.join("s1"))], 1).unwrap();
        assert_eq!(r.rows, 1200, "rows read");
        s.apply(&[(1, dir.join("d1"))], 2).unwrap();
        let mine: Rows =
            whole.iter().filter(|(id, _)| shard_of(**id, 3) == index).map(|(i, v)| (*i, v.clone())).collect();
        check(&s, 0, &mine, &probe); // the others' IDs miss
        let rows = s.stats()[0].rows as usize;
        assert_eq!(rows, mine.len());
        assert!((rows as f64 - whole.len() as f64 / 3.0).abs() < 0.15 * whole.len() as f64 / 3.0, "{rows}");
        held += rows;
    }
    assert_eq!(held, whole.len());
    // Where the count divides the training shards' a file is kept whole, the other one dropped.
    let s = ServingTables::new(&[("a".into(), 4)], 2, ServingSlice { index: 1, count: 2 }, DType::F16, 1).unwrap();
    s.apply(&[(1, dir.join("s1"))], 1).unwrap();
    check(&s, 0, &a1, &probe.iter().copied().filter(|id| !d1.contains_key(id)).collect::<Vec<_>>());
    assert!(ServingTables::new(&[("a".into(), 4)], 2, ServingSlice { index: 3, count: 3 }, DType::F16, 1).is_err());
}

#[test]
fn bad_files_and_versions_change_nothing() {
    let dir = TestDir::new("serving-bad");
    let s = ServingTables::new(&[("a".into(), 3)], 2, ServingSlice::WHOLE, DType::F16, 1).unwrap();
    let a0 = rows_of(&owned_ids(100, 0, 2, 1), 3, 0.0);
    write_file(&dir.join("ok"), false, &[("a", 3, &a0)]);
    s.apply(&[(0, dir.join("ok"))], 3).unwrap();
    let ids: Vec<u64> = a0.keys().copied().collect();
    let before = get(&s, 0, &ids);
    let err = |files: &[(u32, PathBuf)], v: u64| s.apply(files, v).expect_err("refused").to_string();

    // Not greater than the current version.
    assert!(err(&[(0, dir.join("ok"))], 3).contains("not greater than the current version 3"));
    // IDs of shard 1 in shard 0's file: the consistency check.
    let mixed: Rows = a0.clone().into_iter().chain(rows_of(&owned_ids(1, 1, 2, 1), 3, 0.0)).collect();
    write_file(&dir.join("mixed"), true, &[("a", 3, &mixed)]);
    let e = err(&[(0, dir.join("ok")), (0, dir.join("mixed"))], 4);
    assert!(e.contains("mixed") && e.contains("belongs to training shard 1 of 2, not to shard 0"), "{e}");
    // Unknown table, wrong dim, shard out of range, a missing file, a corrupt one.
    write_file(&dir.join("unknown"), true, &[("zz", 3, &a0)]);
    assert!(err(&[(0, dir.join("unknown"))], 4).contains("\"zz\" is not served"));
    write_file(&dir.join("dim"), true, &[("a", 2, &rows_of(&owned_ids(3, 0, 2, 1), 2, 0.0))]);
    assert!(err(&[(0, dir.join("dim"))], 4).contains("dim 2, the served table dim 3"));
    assert!(err(&[(2, dir.join("ok"))], 4).contains("training shard 2 out of range"));
    assert!(matches!(s.apply(&[(0, dir.join("nope"))], 4), Err(StoreError::Io(_))));
    let mut b = std::fs::read(dir.join("ok")).unwrap();
    let k = b.len() / 2;
    b[k] ^= 1;
    std::fs::write(dir.join("flipped"), &b).unwrap();
    assert!(err(&[(0, dir.join("ok")), (0, dir.join("flipped"))], 4).contains("CRC-32 mismatch"));
    // An fp32 store refuses fp16 files.
    let s32 = ServingTables::new(&[("a".into(), 3)], 2, ServingSlice::WHOLE, DType::F32, 1).unwrap();
    assert!(s32.apply(&[(0, dir.join("ok"))], 1).err().unwrap().to_string().contains("expected fp32"));

    assert_eq!(s.version(), 3);
    assert_eq!(get(&s, 0, &ids), before);
    s.apply(&[], 9).unwrap();
    assert_eq!(s.version(), 9);
}

#[test]
fn overlay_grows_then_merges() {
    let dir = TestDir::new("serving-merge");
    let (dim, n) = (2, 400_000);
    let s = ServingTables::new(&[("a".into(), dim)], 1, ServingSlice::WHOLE, DType::F16, 2).unwrap();
    let ids = owned_ids(n + 40_000, 0, 1, 7);
    let mut model = rows_of(&ids[..n], dim, 0.0);
    write_file(&dir.join("full"), false, &[("a", dim, &model)]);
    s.apply(&[(0, dir.join("full"))], 1).unwrap();
    let base_mem = s.memory_bytes();
    // 1500 new rows and 100 (150) updated ones per delta: the overlay spans chunks until
    // it would pass base/64 = 6250 rows, and the fifth delta merges it.
    let mut version = 1;
    for d in 0..5 {
        let mut delta = rows_of(&ids[n + d * 1500..n + (d + 1) * 1500], dim, d as f32);
        delta.extend(ids[d * 100..(d + 1) * 100].iter().map(|&id| (id, vec![d as f32 + 0.5; dim])));
        if d > 0 {
            // And 50 rows the previous delta added (in the overlay).
            let prev = &ids[n + (d - 1) * 1500..n + (d - 1) * 1500 + 50];
            delta.extend(prev.iter().map(|&id| (id, vec![d as f32 + 0.25; dim])));
        }
        let p = dir.join(format!("d{d}"));
        write_file(&p, true, &[("a", dim, &delta)]);
        version += 1;
        let r = s.apply(&[(0, p)], version).unwrap();
        model.extend(delta);
        let st = &s.stats()[0];
        assert_eq!(st.rows, model.len() as u64);
        if d < 4 {
            assert_eq!((r.parts_merged, st.overlay_rows), (0, 1500 * (d as u64 + 1)));
        } else {
            assert_eq!((r.parts_merged, st.overlay_rows), (1, 0));
        }
        let probe: Vec<u64> =
            ids[..n + 6 * 1500].iter().copied().step_by(7).chain(ids[n - 10..n + 7500].iter().copied()).collect();
        check(&s, 0, &model, &probe);
    }
    assert!(s.memory_bytes() > base_mem);
}

#[test]
fn memory_per_value_at_1m_rows() {
    let dir = TestDir::new("serving-mem");
    let (dim, n) = (64, 1_000_000);
    let s = ServingTables::new(&[("a".into(), dim)], 2, ServingSlice::WHOLE, DType::F16, 2).unwrap();
    for shard in 0..2 {
        let ids = owned_ids(n / 2, shard, 2, 3);
        let rows: Rows = ids.iter().map(|&id| (id, vec![(id % 5) as f32; dim])).collect();
        write_file(&dir.join(format!("s{shard}")), false, &[("a", dim, &rows)]);
    }
    s.apply(&[(0, dir.join("s0")), (1, dir.join("s1"))], 1).unwrap();
    let per_value = s.memory_bytes() as f64 / (n * dim) as f64;
    assert!(per_value <= 2.1, "{per_value} bytes per value");
    // Still within 2.1 with the overlays as full as they get before a merge (base/64).
    for shard in 0..2 {
        let ids = owned_ids(7800, shard, 2, 4);
        let rows: Rows = ids.iter().map(|&id| (id, vec![1.0; dim])).collect();
        write_file(&dir.join(format!("d{shard}")), true, &[("a", dim, &rows)]);
    }
    let r = s.apply(&[(0, dir.join("d0")), (1, dir.join("d1"))], 2).unwrap();
    assert_eq!((r.rows_inserted, r.parts_merged, s.stats()[0].overlay_rows), (15_600, 0, 15_600));
    let per_value = s.memory_bytes() as f64 / ((n + 15_600) * dim) as f64;
    assert!(per_value <= 2.1, "{per_value} bytes per value with full overlays");
    let ids = owned_ids(1000, 1, 2, 3);
    let (out, misses, _) = get(&s, 0, &ids);
    assert_eq!(misses, 0);
    assert!(ids.iter().enumerate().all(|(k, id)| out[k * dim] == (id % 5) as f32));
}

#[test]
fn lookups_never_see_a_mixed_version() {
    let dir = TestDir::new("serving-atomic");
    let dim = 3;
    let s = std::sync::Arc::new(
        ServingTables::new(&[("a".into(), dim), ("b".into(), dim)], 2, ServingSlice::WHOLE, DType::F16, 2).unwrap(),
    );
    let ids: Vec<u64> = (0..2).flat_map(|sh| owned_ids(500, sh, 2, 1)).collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (s, ids, stop) = (s.clone(), ids.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut seen = 0;
            while !stop.load(Ordering::Relaxed) {
                let (mut a, mut b) = (vec![0f32; ids.len() * dim], vec![0f32; ids.len() * dim]);
                let mut misses = [0u64; 2];
                let v = s.lookup(&[(0, &ids), (1, &ids)], &mut [&mut a[..], &mut b[..]], &mut misses);
                assert!(a.iter().chain(&b).all(|&x| x == v as f32), "version {v} read a mixed state");
                seen += 1;
            }
            seen
        })
    };
    for v in 1..=30u64 {
        let mut files = Vec::new();
        for sh in 0..2u32 {
            let rows: Rows = owned_ids(500, sh, 2, 1).into_iter().map(|id| (id, vec![v as f32; dim])).collect();
            let p = dir.join(format!("v{v}-{sh}"));
            write_file(&p, v % 3 != 1, &[("a", dim, &rows), ("b", dim, &rows)]);
            files.push((sh, p));
        }
        s.apply(&files, v).unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    assert!(reader.join().unwrap() > 0);
}
