//! Forgetting IDs in values files: the rows named go, the rest is read back as it was.

use std::collections::HashMap;
use std::path::Path;

use half::f16;
use sha2::Digest;

use super::tests::{small_file, trained_store};
use super::*;
use crate::config::{DType, StoreError};
use crate::elem::Elem;
use crate::mem::Pod;
use crate::snapshot::Capture;
use crate::test_dir::TestDir;

fn by_table(ids: &[(&str, &[u64])]) -> HashMap<String, Vec<u64>> {
    ids.iter().map(|(n, v)| (n.to_string(), v.to_vec())).collect()
}

fn file_digest(p: &Path) -> (u64, [u8; 32]) {
    let b = std::fs::read(p).unwrap();
    (b.len() as u64, sha2::Sha256::digest(&b).into())
}

/// `a` less the rows of `gone` (per table) equals `b`: names, dims, IDs, value bits, flags.
fn check_less<W: Elem + Pod>(a: &ValuesFile<W>, b: &ValuesFile<W>, gone: &HashMap<String, Vec<u64>>) {
    assert_eq!((a.delta, a.store_version), (b.delta, b.store_version));
    assert_eq!(a.tables.len(), b.tables.len());
    for (x, y) in a.tables.iter().zip(&b.tables) {
        assert_eq!((&x.name, x.dim), (&y.name, y.dim));
        let g = gone.get(&x.name).cloned().unwrap_or_default();
        let kept: Vec<usize> = (0..x.ids.len()).filter(|&k| !g.contains(&x.ids[k])).collect();
        assert_eq!(y.ids, kept.iter().map(|&k| x.ids[k]).collect::<Vec<_>>(), "{}", x.name);
        let d = x.dim;
        for (r, &k) in kept.iter().enumerate() {
            assert_eq!(W::as_bytes(&y.values[r * d..(r + 1) * d]), W::as_bytes(&x.values[k * d..(k + 1) * d]));
        }
    }
}

#[test]
fn the_rows_named_go_and_the_rest_reads_back() {
    let dir = TestDir::new("values-forget-small");
    let (p, q) = (dir.join("v.bin"), dir.join("w.bin"));
    small_file(&p);
    let gone = by_table(&[("a", &[77, 5]), ("bb", &[1]), ("zz", &[3])]);
    let (removed, written) = forget_in_values(&p, &q, &gone).unwrap();
    assert_eq!((removed, written), (1, file_digest(&q)));
    let (a, b) = (read_values::<f16>(&p, false).unwrap(), read_values::<f16>(&q, false).unwrap());
    assert!(b.delta, "the delta flag kept");
    assert_eq!(b.tables[0].ids, [1, 9]);
    check_less(&a, &b, &gone);
    // Nothing to forget: the same bytes.
    assert_eq!(forget_in_values(&p, &q, &by_table(&[("a", &[2])])).unwrap(), (0, file_digest(&p)));
    assert_eq!(std::fs::read(&p).unwrap(), std::fs::read(&q).unwrap());
}

#[test]
fn a_capture_export_less_the_rows_named() {
    let dir = TestDir::new("values-forget-capture");
    let s = trained_store();
    let c = Capture::new(&s);
    let (p, q) = (dir.join("v.bin"), dir.join("w.bin"));
    // Every 7th ID of f32 (5000 rows: more than a batch of values), two of b16, none of f16.
    let f = {
        c.write_values(&p, DType::F32).unwrap();
        read_values::<f32>(&p, false).unwrap()
    };
    let sevenths: Vec<u64> = f.tables[0].ids.iter().step_by(7).copied().collect();
    let gone = by_table(&[("f32", &sevenths), ("b16", &f.tables[2].ids[10..12])]);
    for dtype in [DType::F32, DType::F16] {
        c.write_values(&p, dtype).unwrap();
        let (removed, written) = forget_in_values(&p, &q, &gone).unwrap();
        assert_eq!((removed, written), (715 + 2, file_digest(&q)));
        match dtype {
            DType::F32 => check_less(&read_values::<f32>(&p, false).unwrap(), &read_values(&q, false).unwrap(), &gone),
            _ => check_less(&read_values::<f16>(&p, false).unwrap(), &read_values(&q, false).unwrap(), &gone),
        }
    }
    // A delta stays one.
    let t = s.table("f32").unwrap();
    s.update(&t, &sevenths[..20], &vec![0.5f32; 20 * 5]);
    let d = Capture::since(&s, &c.mark());
    assert!(d.is_delta());
    d.write_values(&p, DType::F16).unwrap();
    assert_eq!(forget_in_values(&p, &p, &gone).unwrap().0, 20, "in place");
    let back = read_values::<f16>(&p, false).unwrap();
    assert!(back.delta && back.tables.iter().all(|t| t.ids.is_empty()));
}

#[test]
fn a_damaged_source_is_refused_and_nothing_written() {
    let dir = TestDir::new("values-forget-bad");
    let (p, bad, dst) = (dir.join("v.bin"), dir.join("bad.bin"), dir.join("dst.bin"));
    small_file(&p);
    let good = std::fs::read(&p).unwrap();
    let gone = by_table(&[("a", &[5])]);
    let refused = |b: &[u8], what: &str| {
        std::fs::write(&bad, b).unwrap();
        match forget_in_values(&bad, &dst, &gone) {
            Err(StoreError::Value(m)) => assert!(m.contains("bad.bin"), "{what}: {m}"),
            other => panic!("{what}: {:?}", other.map(|r| r.0)),
        }
        assert!(!dst.exists(), "{what}: a file was written");
        assert!(forget_in_values(&bad, &bad, &gone).is_err(), "{what}: in place");
        assert_eq!(std::fs::read(&bad).unwrap(), b, "{what}: the source changed");
    };
    for cut in 0..good.len() {
        refused(&good[..cut], &format!("cut at {cut}"));
    }
    for i in 0..good.len() {
        for bit in [0x01u8, 0x80] {
            let mut b = good.clone();
            b[i] ^= bit;
            refused(&b, &format!("byte {i} ^ {bit:#x}"));
        }
    }
    refused(&[&good[..], &[0]].concat(), "a byte after the trailer");
    assert!(std::fs::read_dir(&*dir).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().contains(".tmp-")));
}
