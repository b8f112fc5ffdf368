use super::*;
use crate::config::*;
use crate::hash::shard_of;
use crate::store::Store;

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("trl-snap-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn filled_store() -> Store {
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
    let dir = tmpdir("rt");
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
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn corruption_detected_everywhere() {
    let dir = tmpdir("corrupt");
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
    std::fs::remove_dir_all(&dir).ok();
}
