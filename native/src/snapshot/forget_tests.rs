//! Forgetting IDs: a live store's next capture is full, and a rewritten snapshot loads as the
//! store that forgot them.

use std::collections::HashMap;
use std::path::Path;

use sha2::Digest;

use super::tests::{assert_same_row, filled_store};
use super::*;
use crate::store::Store;
use crate::table::RowState;
use crate::test_dir::TestDir;

/// The IDs `filled_store` creates in each table.
fn filled_ids() -> Vec<u64> {
    (0..3000u64).map(|i| i * 31 + 7).collect()
}

fn by_table(ids: &[(&str, &[u64])]) -> HashMap<String, Vec<u64>> {
    ids.iter().map(|(n, v)| (n.to_string(), v.to_vec())).collect()
}

/// `(bytes, sha256)` of the file at `p`, computed here.
fn file_digest(p: &Path) -> (u64, [u8; 32]) {
    let b = std::fs::read(p).unwrap();
    (b.len() as u64, sha2::Sha256::digest(&b).into())
}

fn no_temp_files(dir: &Path) -> bool {
    std::fs::read_dir(dir).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().contains(".tmp-"))
}

#[test]
fn a_capture_after_a_forget_is_full() {
    let s = filled_store();
    let mark = Capture::new(&s).mark();
    let t = s.table("a").unwrap();
    s.update(&t, &filled_ids()[..10], &vec![0.1f32; 10 * t.cfg.dim]);
    assert!(Capture::since(&s, &mark).is_delta(), "updates alone make a delta");
    assert_eq!(s.forget(&t, &[1, 2, 3]), 0, "IDs the table lacks: nothing removed");
    assert!(Capture::since(&s, &mark).is_delta(), "nothing removed, still a delta");
    assert_eq!(s.forget(&t, &filled_ids()[..5]), 5);
    let after = Capture::since(&s, &mark);
    assert!(!after.is_delta(), "a forgotten row would come back from the base");
    assert_eq!(after.rows(), 2 * 3000 - 5);
    // The counters persisted do not move; the mark of the full capture makes deltas again.
    assert_eq!(t.counters.snapshot()[2..4], [0, 0]);
    assert!(Capture::since(&s, &after.mark()).is_delta());
}

#[test]
fn forgetting_nothing_gives_the_same_bytes() {
    let dir = TestDir::new("forget-same");
    let s = filled_store();
    let p = dir.join("s.bin");
    write_snapshot(&s, &p).unwrap();
    let (bytes, sha) = file_digest(&p);
    for ids in [by_table(&[]), by_table(&[("a", &[1, 2]), ("zz", &[7])])] {
        let q = dir.join("q.bin");
        let (removed, written) = forget_in_snapshot(&p, &q, &ids).unwrap();
        assert_eq!((removed, written), (0, (bytes, sha)));
        assert_eq!(std::fs::read(&q).unwrap(), std::fs::read(&p).unwrap());
    }
}

#[test]
fn rewritten_base_and_delta_load_as_the_store_that_forgot() {
    let dir = TestDir::new("forget-delta");
    let s = filled_store();
    let base = Capture::new(&s);
    base.write(&dir.join("base.bin")).unwrap();
    let ids = filled_ids();
    let (changed, fresh): (Vec<u64>, Vec<u64>) = (ids[..400].to_vec(), (0..300u64).map(|i| 2_000_000 + i).collect());
    for n in ["a", "b"] {
        let t = s.table(n).unwrap();
        s.update(&t, &changed, &vec![0.5f32; changed.len() * t.cfg.dim]);
        let mut out = vec![0f32; fresh.len() * t.cfg.dim];
        s.lookup(&t, &fresh, &mut out, true);
        s.lookup(&t, &fresh, &mut out, true);
    }
    let delta = Capture::since(&s, &base.mark());
    assert!(delta.is_delta());
    delta.write(&dir.join("delta.bin")).unwrap();
    // From "a": rows only in the base, rows in both files, rows only in the delta, unknown
    // IDs; from "b": a few of the base's. Table "c" is not in the files.
    let gone_a: Vec<u64> =
        ids[390..420].iter().chain(&ids[2000..2100]).chain(&fresh[..50]).copied().chain([1, 2]).collect();
    let gone_b: Vec<u64> = ids[..3].to_vec();
    let gone = by_table(&[("a", &gone_a), ("b", &gone_b), ("c", &[5])]);
    let (rb, wb) = forget_in_snapshot(&dir.join("base.bin"), &dir.join("base2.bin"), &gone).unwrap();
    let (rd, wd) = forget_in_snapshot(&dir.join("delta.bin"), &dir.join("delta2.bin"), &gone).unwrap();
    // The base had 130 of a's and 3 of b's; the delta a's changed (10) and new (50) ones, b's 3.
    assert_eq!((rb, rd), (133, 63));
    assert_eq!(wb, file_digest(&dir.join("base2.bin")));
    assert_eq!(wd, file_digest(&dir.join("delta2.bin")));
    let (d0, d1) = (std::fs::read(dir.join("delta.bin")).unwrap(), std::fs::read(dir.join("delta2.bin")).unwrap());
    assert_eq!(d0[..40], d1[..40], "the header (delta flag, clock, creation time) as it was");
    assert_eq!(u32::from_le_bytes(d1[12..16].try_into().unwrap()), FLAG_DELTA);
    // The oracle: the live store's rows before it forgets, less the forgotten ones.
    let every: Vec<u64> = ids.iter().chain(&fresh).copied().collect();
    let before: Vec<Vec<Option<RowState>>> =
        ["a", "b"].iter().map(|n| every.iter().map(|&id| s.table(n).unwrap().get_state(id)).collect()).collect();
    for (n, g) in [("a", &gone_a), ("b", &gone_b)] {
        s.forget(&s.table(n).unwrap(), g);
    }
    let back = Store::new(Some(3), Some(2)).unwrap();
    load_snapshot(&back, &dir.join("base2.bin"), None).unwrap();
    load_snapshot(&back, &dir.join("delta2.bin"), None).unwrap();
    assert_eq!(back.clock.next_value(), s.clock.next_value());
    for (k, (n, g)) in [("a", &gone_a), ("b", &gone_b)].into_iter().enumerate() {
        let (live, loaded) = (s.table(n).unwrap(), back.table(n).unwrap());
        assert_eq!(loaded.rows(), live.rows());
        assert_eq!(loaded.rows(), 3300 - g.iter().filter(|id| every.contains(id)).count());
        assert_eq!(loaded.counters.snapshot(), live.counters.snapshot(), "{n}: counters as they were");
        let cells = |t: &crate::table::Table| -> Vec<u32> {
            t.sketch
                .iter()
                .flat_map(|sk| sk.counters.iter().map(|c| c.load(std::sync::atomic::Ordering::Relaxed)))
                .collect()
        };
        assert_eq!(cells(&loaded), cells(&live), "{n}: sketch");
        for (id, row) in every.iter().zip(&before[k]) {
            match (g.contains(id), loaded.get_state(*id)) {
                (true, None) => {}
                (false, Some(got)) => assert_same_row(row.as_ref().unwrap(), &got, &format!("{n}/{id}")),
                (forgotten, got) => panic!("{n}/{id}: forgotten {forgotten}, loaded {}", got.is_some()),
            }
        }
    }
    assert!(no_temp_files(&dir));
}

#[test]
fn a_corrupt_source_is_refused_and_nothing_written() {
    let dir = TestDir::new("forget-corrupt");
    let s = filled_store();
    let p = dir.join("s.bin");
    write_snapshot(&s, &p).unwrap();
    let good = std::fs::read(&p).unwrap();
    let (bad, dst) = (dir.join("bad.bin"), dir.join("dst.bin"));
    let gone = by_table(&[("a", &filled_ids()[..100])]);
    let step = (good.len() / 41).max(1);
    for pos in (0..good.len()).step_by(step) {
        let mut b = good.clone();
        b[pos] ^= 0x10;
        std::fs::write(&bad, &b).unwrap();
        match forget_in_snapshot(&bad, &dst, &gone) {
            Err(StoreError::Corrupt(_)) => {}
            other => panic!("flip at {pos}: {:?}", other.map(|r| r.0)),
        }
        assert!(!dst.exists(), "flip at {pos}: a file was written");
        // In place: the source stays as it was.
        assert!(forget_in_snapshot(&bad, &bad, &gone).is_err());
        assert_eq!(std::fs::read(&bad).unwrap(), b);
    }
    std::fs::write(&bad, &good[..good.len() - 3]).unwrap();
    assert!(matches!(forget_in_snapshot(&bad, &dst, &gone), Err(StoreError::Corrupt(_))));
    assert!(!dst.exists() && no_temp_files(&dir));
}

#[test]
fn a_rewrite_in_place() {
    let dir = TestDir::new("forget-in-place");
    let s = filled_store();
    let p = dir.join("s.bin");
    write_snapshot(&s, &p).unwrap();
    let ids = filled_ids();
    let gone = by_table(&[("b", &ids[1000..])]);
    let (removed, written) = forget_in_snapshot(&p, &p, &gone).unwrap();
    assert_eq!((removed, written), (2000, file_digest(&p)));
    let back = Store::new(Some(2), Some(1)).unwrap();
    load_snapshot(&back, &p, None).unwrap();
    let (a, b) = (back.table("a").unwrap(), back.table("b").unwrap());
    assert_eq!((a.rows(), b.rows()), (3000, 1000));
    let live = s.table("b").unwrap();
    for &id in &ids[..1000] {
        assert_same_row(&live.get_state(id).unwrap(), &b.get_state(id).unwrap(), &format!("b/{id}"));
    }
    assert!(ids[1000..].iter().all(|&id| b.get_state(id).is_none()));
    assert!(no_temp_files(&dir));
}
