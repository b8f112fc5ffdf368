use super::*;

fn table(cfg: TableConfig) -> Table {
    Table::new(cfg, 8).unwrap()
}

#[test]
fn lookup_creates_deterministically_and_update_applies() {
    let mut cfg = TableConfig::new("t", 4);
    cfg.lr = 0.5;
    let t = table(cfg.clone());
    let ctx = t.ctx(1, 0, 0);
    let ids = [5u64, 9, 5, 1 << 40];
    let mut out = vec![0f32; 16];
    t.lookup(&ctx, &ids, &mut out, true);
    assert_eq!(t.rows(), 3);
    assert_eq!(&out[0..4], &out[8..12]);
    let mut expect = vec![0f32; 4];
    init_values(&cfg, 9, &mut expect);
    assert_eq!(&out[4..8], &expect[..]);
    // same id, another table object with a different shard count => same vector
    let t2 = Table::new(cfg.clone(), 3).unwrap();
    let mut out2 = vec![0f32; 4];
    t2.lookup(&t2.ctx(1, 0, 0), &[9], &mut out2, true);
    assert_eq!(out2, expect);
    // duplicate ids are summed: id 5 gets 2*g
    let g = vec![1f32; 16];
    let n = t.update(&t.ctx(2, 0, 1), &ids, &g);
    assert_eq!(n, 3);
    let st = t.get_state(5).unwrap();
    assert_eq!(st.weights.len(), 4);
    for (w, o) in st.weights.iter().zip(&out[0..4]) {
        assert!((w - (o - 0.5 * 2.0)).abs() < 1e-6);
    }
    assert_eq!(st.version, 2);
}

#[test]
fn capacity_evicts_lru_exactly_when_small() {
    let mut cfg = TableConfig::new("t", 2);
    cfg.capacity = Some(3);
    let t = table(cfg);
    assert_eq!(t.num_shards(), 1);
    let ctx = t.ctx(1, 0, 0);
    let mut out = vec![0f32; 2];
    for id in [1u64, 2, 3, 1, 4] {
        t.lookup(&ctx, &[id], &mut out, true);
    }
    // 2 was least recently used when 4 arrived
    assert!(t.get_state(2).is_none());
    for id in [1, 3, 4] {
        assert!(t.get_state(id).is_some());
    }
    assert_eq!(t.counters.evicted.load(Ordering::Relaxed), 1);
    assert_eq!(t.rows(), 3);
}

#[test]
fn many_rows_with_eviction_and_reuse() {
    let mut cfg = TableConfig::new("t", 3);
    cfg.capacity = Some(5000);
    let t = table(cfg);
    let ctx = t.ctx(1, 0, 0);
    let ids: Vec<u64> = (0..20000u64).map(|i| i * 7919).collect();
    let mut out = vec![0f32; ids.len() * 3];
    t.lookup(&ctx, &ids, &mut out, true);
    assert_eq!(t.rows(), 5000);
    assert_eq!(t.counters.evicted.load(Ordering::Relaxed), 15000);
    // every remaining row is findable and consistent
    let mut found = 0;
    for &id in &ids {
        if let Some(st) = t.get_state(id) {
            let mut e = vec![0f32; 3];
            init_values(&t.cfg, id, &mut e);
            assert_eq!(st.weights, e);
            found += 1;
        }
    }
    assert_eq!(found, 5000);
}

#[test]
fn ttl_updates_expire() {
    let mut cfg = TableConfig::new("t", 2);
    cfg.ttl_updates = Some(2);
    let t = table(cfg);
    let mut out = vec![0f32; 4];
    t.lookup(&t.ctx(1, 0, 0), &[1, 2], &mut out, true);
    // two update batches touching only id 1
    for b in 1..=3u32 {
        t.counters.update_batches.store(b as u64, Ordering::Relaxed);
        t.update(&t.ctx(1 + b as u64, 0, b), &[1], &[0.1, 0.1]);
    }
    let n = t.expire(&t.ctx(10, 0, 3));
    assert_eq!(n, 1);
    assert!(t.get_state(2).is_none());
    assert!(t.get_state(1).is_some());
}

#[test]
fn version_offsets_rebase_without_losing_changes() {
    let t = table(TableConfig::new("t", 2));
    let mut out = vec![0f32; 6];
    t.lookup(&t.ctx(5, 0, 0), &[1, 2, 3], &mut out, true);
    let big = (1u64 << 33) + 7;
    t.update(&t.ctx(big, 0, 1), &[2], &[0.5, 0.5]);
    assert_eq!(t.get_state(2).unwrap().version, big);
    // old rows are clamped up to the new base: still >= their real version
    for id in [1u64, 3] {
        let v = t.get_state(id).unwrap().version;
        assert!(v >= 5 && v < big);
    }
    let (ids, _) = t.export_delta(big - 1);
    assert_eq!(ids, vec![2]);
    let (mut ids, _) = t.export_delta(4);
    ids.sort();
    assert_eq!(ids, vec![1, 2, 3]);
}

/// A row's state as bits (weights, state, accumulator, step), without its version.
fn bits(s: &RowState) -> (Vec<u32>, Vec<u32>, Option<u32>, Option<u32>) {
    (
        s.weights.iter().map(|x| x.to_bits()).collect(),
        s.state.iter().map(|x| x.to_bits()).collect(),
        s.acc.map(f32::to_bits),
        s.step,
    )
}

#[test]
fn forget_removes_rows_and_a_forgotten_id_comes_back_new() {
    let mut cfg = TableConfig::new("t", 3);
    cfg.optimizer = crate::config::OptKind::Adam;
    cfg.lr = 0.1;
    for sequential in [true, false] {
        let t = table(cfg.clone());
        let ctx = |v: u64, b: u32| Ctx { sequential, ..t.ctx(v, 0, b) };
        let ids: Vec<u64> = (0..500u64).map(|i| i * 13 + 1).collect();
        let mut out = vec![0f32; ids.len() * 3];
        t.lookup(&ctx(1, 0), &ids, &mut out, true);
        t.update(&ctx(2, 1), &ids, &vec![0.5f32; ids.len() * 3]);
        let before: Vec<RowState> = ids.iter().map(|&id| t.get_state(id).unwrap()).collect();
        // Every third ID, one of them twice, and two IDs the table lacks.
        let mut gone: Vec<u64> = ids.iter().step_by(3).copied().collect();
        gone.extend([ids[0], 2, 4]);
        assert_eq!(t.forget(&gone, sequential), 167);
        assert_eq!((t.rows(), t.forgotten.load(Ordering::Relaxed)), (333, 167));
        assert_eq!(t.counters.snapshot()[2..4], [0, 0], "a removal is no eviction or expiry");
        for (k, &id) in ids.iter().enumerate() {
            match t.get_state(id) {
                Some(s) => {
                    assert!(k % 3 != 0, "id {id} was forgotten");
                    assert_eq!(bits(&s), bits(&before[k]));
                    assert_eq!(s.version, before[k].version);
                }
                None => assert!(k % 3 == 0, "id {id} was not forgotten"),
            }
        }
        assert_eq!(t.forget(&gone, sequential), 0);
        // Looked up again: a new row, as in a table that never saw the ID.
        let fresh = table(cfg.clone());
        let again = [ids[0], ids[1], ids[3]];
        t.lookup(&ctx(3, 1), &again, &mut [0f32; 9], true);
        fresh.lookup(&fresh.ctx(3, 0, 1), &again, &mut [0f32; 9], true);
        for id in [ids[0], ids[3]] {
            assert_eq!(bits(&t.get_state(id).unwrap()), bits(&fresh.get_state(id).unwrap()), "id {id}");
        }
        assert_ne!(bits(&t.get_state(ids[0]).unwrap()), bits(&before[0]));
        assert_eq!(bits(&t.get_state(ids[1]).unwrap()), bits(&before[1]));
    }
}
