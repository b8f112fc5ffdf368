use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use half::{bf16, f16};
use sha2::Digest;

use super::*;
use crate::config::{DType, TableConfig};
use crate::snapshot::Capture;
use crate::store::Store;
use crate::test_dir::TestDir;

/// A values file of `tables` (name, dim, sorted ids, values as f16).
pub(super) fn write_raw(path: &Path, delta: bool, tables: &[(&str, usize, Vec<u64>, Vec<f16>)]) {
    let mut f = BufWriter::new(File::create(path).unwrap());
    let mut w = ValuesWriter::new(&mut f, DType::F16, delta, tables.len() as u32, 77).unwrap();
    for (name, dim, ids, vals) in tables {
        w.table(name, *dim, ids).unwrap();
        w.values(vals).unwrap();
    }
    w.finish().unwrap();
    f.flush().unwrap();
}

pub(super) fn small_file(path: &Path) {
    let vals: Vec<f16> = (0..9).map(|i| f16::from_f32(i as f32 * 0.5 - 1.0)).collect();
    write_raw(path, true, &[("a", 3, vec![1, 5, 9], vals), ("bb", 2, vec![], vec![])]);
}

#[test]
fn crc_is_zlibs() {
    // The check value of CRC-32/ISO-HDLC.
    assert_eq!(crc32fast::hash(b"123456789"), 0xCBF4_3926);
}

#[test]
fn round_trip() {
    let dir = TestDir::new("values-rt");
    let p = dir.join("v.bin");
    small_file(&p);
    let f = read_values::<f16>(&p, false).unwrap();
    assert!(f.delta);
    assert_eq!(f.store_version, 77);
    assert_eq!(f.bytes, std::fs::metadata(&p).unwrap().len());
    assert_eq!(f.tables.len(), 2);
    let a = &f.tables[0];
    assert_eq!((a.name.as_str(), a.dim, &a.ids[..]), ("a", 3, &[1u64, 5, 9][..]));
    assert_eq!(a.values[4].to_f32(), 1.0);
    assert_eq!((f.tables[1].name.as_str(), f.tables[1].dim, f.tables[1].ids.len()), ("bb", 2, 0));
    // Table "a": head 15 bytes at 28, padded to 48; 24 bytes of IDs, 18 of values (to 90);
    // "bb": head 16 bytes, padded from 106 to 112, no rows.
    assert_eq!(f.bytes as usize, 112 + TRAILER_LEN);
    // The wrong dtype is refused from the header.
    let e = read_values::<f32>(&p, false).err().unwrap().to_string();
    assert!(e.contains("values are fp16"), "{e}");
}

#[test]
fn truncation_and_flipped_bytes_refused() {
    let dir = TestDir::new("values-bad");
    let p = dir.join("v.bin");
    small_file(&p);
    let good = std::fs::read(&p).unwrap();
    let q = dir.join("w.bin");
    for cut in 0..good.len() {
        std::fs::write(&q, &good[..cut]).unwrap();
        match read_values::<f16>(&q, false) {
            Err(ValuesError::Bad(_)) => {}
            Err(e) => panic!("cut at {cut}: {e}"),
            Ok(_) => panic!("a file cut at {cut} of {} bytes was accepted", good.len()),
        }
    }
    for i in 0..good.len() {
        for bit in [0x01u8, 0x80] {
            let mut b = good.clone();
            b[i] ^= bit;
            std::fs::write(&q, &b).unwrap();
            assert!(read_values::<f16>(&q, false).is_err(), "byte {i} flipped ({bit:#x}) was accepted");
        }
    }
    let mut b = good.clone();
    b.push(0);
    std::fs::write(&q, &b).unwrap();
    let e = read_values::<f16>(&q, false).err().unwrap().to_string();
    assert!(e.contains("CRC") || e.contains("after the trailer"), "{e}");
    // A payload byte flipped is reported as corruption.
    let mut b = good.clone();
    b[48 + 3 * 8 + 1] ^= 4;
    std::fs::write(&q, &b).unwrap();
    assert!(read_values::<f16>(&q, false).err().unwrap().to_string().contains("CRC-32 mismatch"));
}

#[test]
fn unsorted_ids_refused() {
    let dir = TestDir::new("values-unsorted");
    let p = dir.join("v.bin");
    write_raw(&p, false, &[("a", 1, vec![3, 2], vec![f16::ONE, f16::ONE])]);
    let e = read_values::<f16>(&p, false).err().unwrap().to_string();
    assert!(e.contains("not strictly ascending at row 1"), "{e}");
    write_raw(&p, false, &[("a", 1, vec![2, 2], vec![f16::ONE, f16::ONE])]);
    assert!(read_values::<f16>(&p, false).is_err());
    write_raw(&p, false, &[("a", 1, vec![2], vec![f16::ONE]), ("a", 1, vec![], vec![])]);
    assert!(read_values::<f16>(&p, false).err().unwrap().to_string().contains("twice"));
}

/// A store of an fp32, an fp16 and a bf16 table, trained a little.
pub(super) fn trained_store() -> Store {
    let s = Store::new(Some(4), Some(2)).unwrap();
    for (name, dim, dtype) in [("f32", 5, DType::F32), ("f16", 3, DType::F16), ("b16", 4, DType::BF16)] {
        let mut c = TableConfig::new(name, dim);
        c.dtype = dtype;
        c.init_low = -1.0;
        c.init_high = 1.0;
        s.create_table(c).unwrap();
        let t = s.table(name).unwrap();
        let ids: Vec<u64> = (0..5000u64).map(|i| crate::hash::mix64(i + 1)).collect();
        let mut out = vec![0f32; ids.len() * dim];
        s.lookup(&t, &ids, &mut out, true);
        let g: Vec<f32> = (0..ids.len() * dim).map(|i| (i % 11) as f32 * 0.01 - 0.05).collect();
        s.update(&t, &ids, &g);
    }
    s
}

/// The file's rows equal a read-only lookup's with the same output dtype, bit for bit.
fn check_against_store<O: crate::elem::OutElem + crate::elem::Elem + crate::mem::Pod + PartialEq>(
    s: &Store,
    f: &ValuesFile<O>,
) {
    for t in &f.tables {
        let table = s.table(&t.name).unwrap();
        assert_eq!(t.dim, table.cfg.dim);
        let mut want = vec![O::default(); t.ids.len() * t.dim];
        s.lookup(&table, &t.ids, &mut want, false);
        assert!(want.iter().zip(t.values.iter()).all(|(a, b)| O::as_bytes(&[*a]) == O::as_bytes(&[*b])));
    }
}

#[test]
fn capture_export_matches_lookups() {
    let dir = TestDir::new("values-export");
    let s = trained_store();
    let c = Capture::new(&s);
    let p = dir.join("full.bin");
    let (bytes, sha) = c.write_values(&p, DType::F16).unwrap();
    let raw = std::fs::read(&p).unwrap();
    assert_eq!(bytes as usize, raw.len());
    assert_eq!(sha, <[u8; 32]>::from(sha2::Sha256::digest(&raw)));
    let f = read_values::<f16>(&p, false).unwrap();
    assert!(!f.delta);
    assert_eq!(f.tables.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), ["f32", "f16", "b16"]);
    assert!(f.tables.iter().all(|t| t.ids.len() == 5000));
    check_against_store(&s, &f);
    // fp32 values: f32 tables as they are, f16 and bf16 widened.
    c.write_values(&p, DType::F32).unwrap();
    let f32s = read_values::<f32>(&p, false).unwrap();
    check_against_store(&s, &f32s);
    assert!(c.write_values(&p, DType::BF16).is_err());

    // A delta holds the rows updated since the mark, and says so.
    let t = s.table("f16").unwrap();
    let ids: Vec<u64> = (0..10u64).map(|i| crate::hash::mix64(i + 1)).collect();
    s.update(&t, &ids, &[0.5f32; 30]);
    let d = Capture::since(&s, &c.mark());
    assert!(d.is_delta());
    d.write_values(&p, DType::F16).unwrap();
    let f = read_values::<f16>(&p, false).unwrap();
    assert!(f.delta);
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    assert_eq!(f.tables[1].ids, sorted);
    assert!(f.tables[0].ids.is_empty() && f.tables[2].ids.is_empty());
    check_against_store(&s, &f);
    // bf16 -> f16 goes through f32, as lookups do: one value against the row's weights.
    let w = s.table("b16").unwrap().get_state(ids[0]).unwrap().weights;
    c.write_values(&p, DType::F16).unwrap();
    let f = read_values::<f16>(&p, false).unwrap();
    let r = f.tables[2].ids.binary_search(&ids[0]).unwrap();
    assert_eq!(f.tables[2].values[r * 4], f16::from_f32(bf16::from_f32(w[0]).to_f32()));
}
