use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use sha2::Digest;

use super::read::share;
use super::*;
use crate::config::*;
use crate::hash::shard_of;
use crate::store::Store;
use crate::table::{RowState, Table, COUNTER_NAMES};
use crate::test_dir::TestDir;

pub(super) fn filled_store() -> Store {
    let s = Store::new(Some(4), Some(2)).unwrap();
    let mut c = TableConfig::new("a", 5);
    c.optimizer = OptKind::Adam;
    c.dtype = DType::F16;
    c.ttl_updates = Some(100);
    s.create_table(c).unwrap();
    let mut c = TableConfig::new("b", 3);
    c.optimizer = OptKind::RowwiseAdagrad;
    c.admission = AdmissionKind::Threshold;
    c.admission_threshold = 2;
    c.sketch_width = 1024;
    s.create_table(c).unwrap();
    for name in ["a", "b"] {
        let t = s.table(name).unwrap();
        let dim = t.cfg.dim;
        let ids: Vec<u64> = (0..3000u64).map(|i| i * 31 + 7).collect();
        let mut out = vec![0f32; ids.len() * dim];
        s.lookup(&t, &ids, &mut out, true);
        s.lookup(&t, &ids, &mut out, true);
        let g: Vec<f32> = (0..ids.len() * dim).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect();
        s.update(&t, &ids, &g);
    }
    s
}

#[test]
fn round_trip_and_reshard() {
    let dir = TestDir::new("snap-rt");
    let p = dir.join("s.bin");
    let s = filled_store();
    write_snapshot(&s, &p).unwrap();
    let full = Store::new(Some(7), Some(1)).unwrap();
    load_snapshot(&full, &p, None).unwrap();
    for name in ["a", "b"] {
        let (t0, t1) = (s.table(name).unwrap(), full.table(name).unwrap());
        assert_eq!(t0.rows(), t1.rows());
        assert_eq!(t0.cfg, t1.cfg);
        assert_eq!(t0.counters.snapshot(), t1.counters.snapshot());
        for i in 0..3000u64 {
            let id = i * 31 + 7;
            let (a, b) = (t0.get_state(id).unwrap(), t1.get_state(id).unwrap());
            assert_eq!(a.weights, b.weights);
            assert_eq!(a.state, b.state);
            assert_eq!(a.acc, b.acc);
            assert_eq!(a.step, b.step);
            assert_eq!(a.version, b.version);
            assert_eq!(a.utick, b.utick);
        }
    }
    assert_eq!(full.clock.next_value(), s.clock.next_value());
    // reshard into 3
    let parts: Vec<Store> = (0..3).map(|_| Store::new(Some(2), Some(1)).unwrap()).collect();
    for (i, st) in parts.iter().enumerate() {
        load_snapshot(st, &p, Some((i as u32, 3))).unwrap();
    }
    let total: usize = parts.iter().map(|st| st.table("a").unwrap().rows()).sum();
    assert_eq!(total, 3000);
    for i in 0..3000u64 {
        let id = i * 31 + 7;
        let owner = shard_of(id, 3) as usize;
        for (k, st) in parts.iter().enumerate() {
            assert_eq!(st.table("a").unwrap().get_state(id).is_some(), k == owner);
        }
    }
}

#[test]
fn corruption_detected_everywhere() {
    let dir = TestDir::new("snap-corrupt");
    let p = dir.join("c.bin");
    let s = filled_store();
    write_snapshot(&s, &p).unwrap();
    let good = std::fs::read(&p).unwrap();
    let q = dir.join("bad.bin");
    // Flip one byte at many positions; truncate at many lengths.
    let step = (good.len() / 97).max(1);
    for pos in (0..good.len()).step_by(step) {
        let mut b = good.clone();
        b[pos] ^= 0x40;
        std::fs::write(&q, &b).unwrap();
        let st = Store::new(Some(2), Some(1)).unwrap();
        match load_snapshot(&st, &q, None) {
            Err(StoreError::Corrupt(_)) => {}
            other => panic!("flip at {pos}: {:?}", other.err()),
        }
        assert!(st.table_names().is_empty(), "store modified by a corrupt load");
    }
    for len in (0..good.len()).step_by(step) {
        std::fs::write(&q, &good[..len]).unwrap();
        let st = Store::new(Some(2), Some(1)).unwrap();
        let r = load_snapshot(&st, &q, None);
        assert!(matches!(r, Err(StoreError::Corrupt(_))), "truncated at {len} of {}: {:?}", good.len(), r.err());
    }
}

pub(super) fn assert_same_row(a: &RowState, b: &RowState, what: &str) {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a.weights), bits(&b.weights), "{what}: weights");
    assert_eq!(bits(&a.state), bits(&b.state), "{what}: optimizer state");
    assert_eq!(a.acc.map(f32::to_bits), b.acc.map(f32::to_bits), "{what}: accumulator");
    assert_eq!((a.step, a.version, a.utime, a.utick), (b.step, b.version, b.utime, b.utick), "{what}: scalars");
}

/// Header bytes 28..40 hold the creation time and the header checksum.
fn without_created_time(b: &[u8]) -> Vec<u8> {
    [&b[..28], &b[40..]].concat()
}

#[test]
fn capture_is_a_point_in_time_copy_written_in_the_dump_format() {
    let dir = TestDir::new("snap-capture");
    let s = filled_store();
    let ids: Vec<u64> = (0..3000u64).map(|i| i * 31 + 7).collect();
    let before: Vec<(&str, Vec<RowState>)> = ["a", "b"]
        .iter()
        .map(|&n| (n, ids.iter().map(|&id| s.table(n).unwrap().get_state(id).unwrap()).collect()))
        .collect();
    let cap = Capture::new(&s);
    assert_eq!(cap.rows(), 6000);
    assert_eq!(cap.table_names(), ["a", "b"]);
    let (dumped, dump_sha) = write_snapshot(&s, &dir.join("dump.bin")).unwrap();
    // Change the live store after the capture: updates, and lookups creating rows.
    for n in ["a", "b"] {
        let t = s.table(n).unwrap();
        let g = vec![0.25f32; ids.len() * t.cfg.dim];
        s.update(&t, &ids, &g);
        let fresh: Vec<u64> = (0..500u64).map(|i| 1_000_000 + i).collect();
        let mut out = vec![0f32; fresh.len() * t.cfg.dim];
        s.lookup(&t, &fresh, &mut out, true);
        s.lookup(&t, &fresh, &mut out, true);
    }
    let p = dir.join("cap.bin");
    let (bytes, sha) = cap.write(&p).unwrap();
    let file = std::fs::read(&p).unwrap();
    assert_eq!(bytes, file.len() as u64);
    assert_eq!(bytes, dumped);
    let digest: [u8; 32] = sha2::Sha256::digest(&file).into();
    assert_eq!(sha, digest);
    // Bit-exactly what dump() wrote before the changes, but for the creation time.
    let dump = std::fs::read(dir.join("dump.bin")).unwrap();
    assert_eq!(without_created_time(&file), without_created_time(&dump));
    if file[28..36] == dump[28..36] {
        assert_eq!(sha, dump_sha);
    }
    // Writing again gives the same bytes.
    assert_eq!(cap.write(&dir.join("again.bin")).unwrap(), (bytes, sha));
    let loaded = Store::new(Some(3), Some(2)).unwrap();
    load_snapshot(&loaded, &p, None).unwrap();
    assert_eq!(loaded.clock.next_value(), 3, "versions 1 and 2 were taken before the capture");
    for (n, rows) in &before {
        let (live, back) = (s.table(n).unwrap(), loaded.table(n).unwrap());
        assert_eq!(back.rows(), 3000);
        assert_eq!(live.rows(), 3500);
        for (id, row) in ids.iter().zip(rows) {
            assert_same_row(row, &back.get_state(*id).unwrap(), &format!("{n}/{id}"));
            assert_ne!(live.get_state(*id).unwrap().weights, row.weights, "{n}/{id}: the live store moved on");
        }
    }
    assert!(std::fs::read_dir(&*dir).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().contains(".tmp-")));
}

#[test]
fn capture_during_lookups_that_create_rows_is_loadable_and_untorn() {
    let dir = TestDir::new("snap-capture-live");
    let s = Store::new(Some(8), Some(2)).unwrap();
    s.create_table(TableConfig::new("t", 16)).unwrap();
    let t = s.table("t").unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let mut next = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let ids: Vec<u64> = (next..next + 2000).collect();
                let mut out = vec![0f32; ids.len() * 16];
                s.lookup(&t, &ids, &mut out, true);
                next += 2000;
            }
        });
        for k in 0..4 {
            let cap = Capture::new(&s);
            let p = dir.join(format!("c{k}.bin"));
            cap.write(&p).unwrap();
            let back = Store::new(Some(4), Some(1)).unwrap();
            load_snapshot(&back, &p, None).unwrap();
            let bt = back.table("t").unwrap();
            assert_eq!(bt.rows() as u64, cap.rows());
            // No update ran: every captured row holds exactly its initial value.
            let mut expect = vec![0f32; 16];
            for id in 0..(cap.rows() + 4000) {
                if let Some(st) = bt.get_state(id) {
                    crate::table::init_values(&bt.cfg, id, &mut expect);
                    assert_eq!(st.weights, expect, "row {id}");
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
}

/// `n` PS shards trained on the ids they own (routed by shard_of, as the embedding
/// worker does), with different numbers of update batches per shard.
fn ps_shards(n: u32) -> Vec<Store> {
    let shards: Vec<Store> = (0..n).map(|_| Store::new(Some(4), Some(1)).unwrap()).collect();
    for (s, st) in shards.iter().enumerate() {
        let mut c = TableConfig::new("r", 4);
        c.optimizer = OptKind::RowwiseAdagrad;
        c.admission = AdmissionKind::Threshold;
        c.admission_threshold = 2;
        c.sketch_width = 256;
        c.ttl_updates = Some(1000);
        st.create_table(c).unwrap();
        let mut c = TableConfig::new("m", 3);
        c.optimizer = OptKind::Adam;
        c.dtype = DType::BF16;
        st.create_table(c).unwrap();
        for step in 0..(4 + 3 * s as u64) {
            for name in ["r", "m"] {
                let t = st.table(name).unwrap();
                let ids: Vec<u64> = (0..700u64)
                    .map(|j| (step * 977 + j * 13) % 4000)
                    .filter(|&id| shard_of(id, n) == s as u32)
                    .collect();
                let mut out = vec![0f32; ids.len() * t.cfg.dim];
                st.lookup(&t, &ids, &mut out, true);
                st.lookup(&t, &ids, &mut out, true);
                let g: Vec<f32> = (0..out.len()).map(|i| ((i * 7 + step as usize) % 11) as f32 * 0.05 - 0.25).collect();
                st.update(&t, &ids, &g);
            }
        }
    }
    shards
}

/// Load every file of `src` into `n` new shards (`load(file, shard_index=j, num_shards=n)`)
/// and check that the merge keeps every row exactly once with its state, its age in
/// update batches, the job-wide counters, the sketches and the clock.
fn check_reshard(src: &[Store], n: u32, dir: &Path) {
    let files: Vec<_> = src
        .iter()
        .enumerate()
        .map(|(i, st)| {
            let p = dir.join(format!("from{}-{i}.bin", src.len()));
            // One through a capture, the others through dump: the same format.
            if i == 0 {
                Capture::new(st).write(&p).unwrap();
            } else {
                write_snapshot(st, &p).unwrap();
            }
            p
        })
        .collect();
    let dst: Vec<Store> = (0..n).map(|_| Store::new(Some(3), Some(2)).unwrap()).collect();
    for (j, st) in dst.iter().enumerate() {
        for p in &files {
            load_snapshot(st, p, Some((j as u32, n))).unwrap();
        }
    }
    let max_clock = src.iter().map(|s| s.clock.next_value()).max().unwrap();
    assert!(dst.iter().all(|d| d.clock.next_value() == max_clock));
    for name in ["r", "m"] {
        let old: Vec<_> = src.iter().map(|s| s.table(name).unwrap()).collect();
        let new: Vec<_> = dst.iter().map(|s| s.table(name).unwrap()).collect();
        let batches = |t: &Table| t.counters.update_batches.load(Ordering::Relaxed) as u32;
        let mut seen = 0;
        for id in 0..4000u64 {
            let owner = old.iter().find_map(|t| t.get_state(id).map(|st| (t, st)));
            let holders: Vec<_> = new.iter().filter_map(|t| t.get_state(id).map(|st| (t, st))).collect();
            match owner {
                None => assert!(holders.is_empty(), "{name}/{id} appeared from nowhere"),
                Some((ot, ost)) => {
                    assert_eq!(holders.len(), 1, "{name}/{id} must be in exactly one new shard");
                    let (nt, nst) = &holders[0];
                    assert!(Arc::ptr_eq(nt, &new[shard_of(id, n) as usize]), "{name}/{id} in the wrong shard");
                    if let (Some(a), Some(b)) = (ost.utick, nst.utick) {
                        assert_eq!(batches(ot).wrapping_sub(a), batches(nt).wrapping_sub(b), "{name}/{id}: age");
                    }
                    let shifted = RowState { utick: nst.utick.map(|_| ost.utick.unwrap()), ..nst.clone() };
                    assert_same_row(&ost, &shifted, &format!("{name}/{id}"));
                    seen += 1;
                }
            }
        }
        assert_eq!(seen, old.iter().map(|t| t.rows()).sum::<usize>());
        assert_eq!(new.iter().map(|t| t.rows()).sum::<usize>(), seen);
        let old_c: Vec<[u64; 9]> = old.iter().map(|t| t.counters.snapshot()).collect();
        let new_c: Vec<[u64; 9]> = new.iter().map(|t| t.counters.snapshot()).collect();
        for k in 0..8 {
            let sum = |c: &[[u64; 9]]| c.iter().map(|x| x[k]).sum::<u64>();
            assert_eq!(sum(&new_c), sum(&old_c), "{name}: counter {}", COUNTER_NAMES[k]);
        }
        let max_batches = old_c.iter().map(|c| c[8]).max().unwrap();
        assert!(new_c.iter().all(|c| c[8] == max_batches));
        if let Some(sk0) = &old[0].sketch {
            let cells = |t: &Table| -> Vec<u32> {
                t.sketch.as_ref().unwrap().counters.iter().map(|c| c.load(Ordering::Relaxed)).collect()
            };
            let expect: Vec<u32> =
                (0..sk0.counters.len()).map(|i| old.iter().map(|t| cells(t)[i]).max().unwrap()).collect();
            assert!(expect.iter().any(|&c| c > 0));
            for t in &new {
                assert!(cells(t) == expect, "{name}: the sketch is not the element-wise max");
            }
        }
    }
}

#[test]
fn reshard_two_to_three_and_three_to_one() {
    let dir = TestDir::new("snap-reshard");
    let two = ps_shards(2);
    assert_ne!(
        two[0].table("r").unwrap().counters.update_batches.load(Ordering::Relaxed),
        two[1].table("r").unwrap().counters.update_batches.load(Ordering::Relaxed)
    );
    check_reshard(&two, 3, &dir);
    check_reshard(&ps_shards(3), 1, &dir);
}

#[test]
fn counter_shares_add_up() {
    for c in [0u64, 1, 7, 1000, u64::MAX] {
        for n in 1..6u32 {
            let shares: Vec<u64> = (0..n).map(|i| share(c, i, n)).collect();
            assert_eq!(shares.iter().map(|&x| x as u128).sum::<u128>(), c as u128);
            assert!(shares.iter().max().unwrap() - shares.iter().min().unwrap() <= 1);
        }
    }
}

#[test]
fn a_delta_on_its_base_loads_as_the_store_at_the_delta() {
    let dir = TestDir::new("snap-delta");
    let s = filled_store();
    let base = Capture::new(&s);
    assert!(!base.is_delta());
    base.write(&dir.join("base.bin")).unwrap();
    // After the base: some rows updated, some created; most untouched.
    let changed: Vec<u64> = (0..400u64).map(|i| i * 31 + 7).collect();
    let fresh: Vec<u64> = (0..300u64).map(|i| 2_000_000 + i).collect();
    for n in ["a", "b"] {
        let t = s.table(n).unwrap();
        s.update(&t, &changed, &vec![0.5f32; changed.len() * t.cfg.dim]);
        let mut out = vec![0f32; fresh.len() * t.cfg.dim];
        s.lookup(&t, &fresh, &mut out, true);
        s.lookup(&t, &fresh, &mut out, true);
    }
    let delta = Capture::since(&s, &base.mark());
    assert!(delta.is_delta());
    assert_eq!(delta.rows(), 2 * 700, "only the rows changed since the base");
    let (delta_bytes, _) = delta.write(&dir.join("delta.bin")).unwrap();
    let (full_bytes, _) = write_snapshot(&s, &dir.join("full.bin")).unwrap();
    assert!(delta_bytes * 3 < full_bytes, "{delta_bytes} vs {full_bytes}");
    let back = Store::new(Some(3), Some(2)).unwrap();
    load_snapshot(&back, &dir.join("base.bin"), None).unwrap();
    load_snapshot(&back, &dir.join("delta.bin"), None).unwrap();
    assert_eq!(back.clock.next_value(), s.clock.next_value());
    for n in ["a", "b"] {
        let (live, loaded) = (s.table(n).unwrap(), back.table(n).unwrap());
        assert_eq!(loaded.rows(), live.rows());
        assert_eq!(loaded.counters.snapshot(), live.counters.snapshot(), "{n}: counters add up");
        for id in (0..3000u64).map(|i| i * 31 + 7).chain(fresh.iter().copied()) {
            assert_same_row(&live.get_state(id).unwrap(), &loaded.get_state(id).unwrap(), &format!("{n}/{id}"));
        }
    }
    // A delta of the delta, nothing having changed: only the rows created since the last update,
    // whose version is the next update's (a row is never missed, at worst written twice).
    assert!(Capture::since(&s, &delta.mark()).rows() <= 2 * 300);
}

#[test]
fn rows_leaving_the_store_after_the_mark_make_a_full_capture() {
    let s = filled_store();
    let mark = Capture::new(&s).mark();
    // Table a expires rows not updated in its last 100 update batches.
    let t = s.table("a").unwrap();
    for _ in 0..101 {
        s.update(&t, &[7], &vec![0.1f32; t.cfg.dim]);
    }
    assert!(s.expire(&t, None) > 0);
    let after = Capture::since(&s, &mark);
    assert!(!after.is_delta(), "an expired row would come back from the base");
    assert_eq!(after.rows(), s.table("a").unwrap().rows() as u64 + s.table("b").unwrap().rows() as u64);
    // A dropped table, likewise.
    let mark = after.mark();
    s.drop_table("b").unwrap();
    assert!(!Capture::since(&s, &mark).is_delta());
}
