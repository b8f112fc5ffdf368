//! Forgetting IDs in a values file (a right to be forgotten, GDPR Art. 17): the file is
//! streamed into a new one without the rows of the given IDs, keeping its dtype, delta flag,
//! store version and table order, the values copied as bytes (no conversion).
//!
//! The source gets the checks `read_values` makes (structure against the file's length, IDs
//! strictly ascending, each table once, the row count, the CRC-32 of every byte), made as
//! it streams: the destination is written atomically (`write_atomically`), so a source
//! that fails any of them leaves no file behind, and the destination may be the source.
//! Memory: one table's IDs (8 bytes a row, which the table head must declare before its
//! values) and a batch of values.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use super::read::CrcReader;
use super::{pad_to_8, u64_bytes_mut, ValuesError, ValuesWriter, HEADER_LEN, MAX_DIM, TRAILER_LEN};
use super::{VALUES_END_MAGIC, VALUES_FLAG_DELTA, VALUES_FORMAT_VERSION, VALUES_MAGIC};
use crate::config::{DType, Result, StoreError};
use crate::snapshot::{write_atomically, FileOut, Written};

/// Rows of values copied per read.
const BATCH: usize = 4096;

/// Rewrite the values file `src` to `dst` without the rows of `ids` (table name -> IDs; a
/// table the file lacks is skipped, a table not named is copied whole). Returns the number
/// of rows removed and (bytes written, SHA-256 of `dst`). A source that is not a valid
/// values file raises `StoreError::Value` naming it (as `ServingTables::apply` does).
pub fn forget_in_values(src: &Path, dst: &Path, ids: &HashMap<String, Vec<u64>>) -> Result<(u64, Written)> {
    let drop: HashMap<&str, Vec<u64>> = ids
        .iter()
        .map(|(name, v)| {
            let mut v = v.clone();
            v.sort_unstable();
            (name.as_str(), v)
        })
        .collect();
    let mut removed = 0;
    let written = write_atomically(dst, |out| -> Result<()> {
        removed = rewrite(src, out, &drop)?;
        Ok(())
    })?;
    Ok((removed, written))
}

/// A read error of the source, named as `ServingTables::apply` names them.
fn src_err(src: &Path, e: ValuesError) -> StoreError {
    match e {
        ValuesError::Io(e) => {
            StoreError::Io(std::io::Error::new(e.kind(), format!("values file {}: {e}", src.display())))
        }
        ValuesError::Bad(m) => StoreError::Value(format!("values file {}: {m}", src.display())),
    }
}

fn rewrite(src: &Path, out: &mut FileOut, drop: &HashMap<&str, Vec<u64>>) -> Result<u64> {
    let bad = |m: String| src_err(src, ValuesError::Bad(m));
    let rd = |e: std::io::Error| src_err(src, e.into());
    let f = File::open(src).map_err(rd)?;
    let len = f.metadata().map_err(rd)?.len();
    if len < (HEADER_LEN + TRAILER_LEN) as u64 {
        return Err(bad(format!("file is truncated: {len} bytes, shorter than a header and a trailer")));
    }
    let mut r = CrcReader { inner: BufReader::with_capacity(1 << 20, f), crc: crc32fast::Hasher::new(), pos: 0 };
    if &r.array::<8>().map_err(rd)? != VALUES_MAGIC {
        return Err(bad("not a values file (bad magic)".into()));
    }
    let version = r.u32().map_err(rd)?;
    if version != VALUES_FORMAT_VERSION {
        return Err(bad(format!("format version {version}; this reader knows version {VALUES_FORMAT_VERSION}")));
    }
    let [code, flags] = r.array().map_err(rd)?;
    let (dtype, size) = match code {
        0 => (DType::F32, 4u64),
        1 => (DType::F16, 2u64),
        _ => return Err(bad(format!("unknown dtype code {code}"))),
    };
    if flags & !VALUES_FLAG_DELTA != 0 || r.u16().map_err(rd)? != 0 {
        return Err(bad(format!("unknown header flags {flags:#x} or non-zero reserved bytes")));
    }
    let num_tables = r.u32().map_err(rd)?;
    let store_version = r.u64().map_err(rd)?;
    let mut w = ValuesWriter::new(out, dtype, flags & VALUES_FLAG_DELTA != 0, num_tables, store_version)?;
    let (mut names, mut rows_in, mut removed) = (Vec::new(), 0u64, 0u64);
    for k in 0..num_tables {
        // The smallest table (an empty name, no rows) takes 14 bytes.
        if len - r.pos < 14 + TRAILER_LEN as u64 {
            return Err(bad(format!(
                "file is truncated: table {k} of {num_tables} starts {} bytes before the end",
                len - r.pos
            )));
        }
        let mut name = vec![0u8; r.u16().map_err(rd)? as usize];
        if len - r.pos < (name.len() + 12 + TRAILER_LEN) as u64 {
            return Err(bad(format!("file is truncated in the head of table {k}")));
        }
        r.read(&mut name).map_err(rd)?;
        let Ok(name) = String::from_utf8(name) else { return Err(bad(format!("table {k}: name is not UTF-8"))) };
        let dim = r.u32().map_err(rd)? as usize;
        let rows = r.u64().map_err(rd)?;
        if dim == 0 || dim > MAX_DIM {
            return Err(bad(format!("table {name:?}: dim {dim} out of range [1, {MAX_DIM}]")));
        }
        let mut pad = [0u8; 8];
        let pad = &mut pad[..pad_to_8(r.pos)];
        if len - r.pos < (pad.len() + TRAILER_LEN) as u64 {
            return Err(bad(format!("file is truncated in the head of table {name:?}")));
        }
        r.read(pad).map_err(rd)?;
        if pad.iter().any(|&b| b != 0) {
            return Err(bad(format!("table {name:?}: non-zero padding")));
        }
        let left = len - r.pos - TRAILER_LEN as u64;
        if !matches!(rows.checked_mul(8 + dim as u64 * size), Some(n) if n <= left) {
            return Err(bad(format!(
                "file is truncated: table {name:?} declares {rows} rows of dim {dim}, {left} bytes remain"
            )));
        }
        if names.contains(&name) {
            return Err(bad(format!("table {name:?} appears twice")));
        }
        let mut ids = vec![0u64; rows as usize];
        r.read(u64_bytes_mut(&mut ids)).map_err(rd)?;
        if let Some(i) = ids.windows(2).position(|w| w[0] >= w[1]) {
            return Err(bad(format!(
                "table {name:?}: IDs not strictly ascending at row {} ({} then {})",
                i + 1,
                ids[i],
                ids[i + 1]
            )));
        }
        let gone = drop.get(name.as_str()).filter(|d| !d.is_empty());
        let keep: Vec<bool> = ids.iter().map(|id| gone.is_none_or(|d| d.binary_search(id).is_err())).collect();
        let kept: Vec<u64> = ids.iter().zip(&keep).filter(|(_, &k)| k).map(|(&id, _)| id).collect();
        w.table(&name, dim, &kept)?;
        copy_kept(src, &mut r, &mut w, &keep, dim * size as usize)?;
        (rows_in, removed) = (rows_in + rows, removed + (ids.len() - kept.len()) as u64);
        names.push(name);
    }
    let end: [u8; 8] = r.array().map_err(rd)?;
    let total_rows = r.u64().map_err(rd)?;
    let computed = std::mem::take(&mut r.crc).finalize();
    let mut stored = [0u8; 4];
    r.inner.read_exact(&mut stored).map_err(rd)?;
    r.pos += 4;
    if u32::from_le_bytes(stored) != computed {
        return Err(bad(format!(
            "CRC-32 mismatch (stored {:#010x}, computed {computed:#010x}): the file is corrupt",
            u32::from_le_bytes(stored)
        )));
    }
    if &end != VALUES_END_MAGIC {
        return Err(bad("bad trailer magic".into()));
    }
    if r.pos != len {
        return Err(bad(format!("{} bytes after the trailer", len - r.pos)));
    }
    if total_rows != rows_in {
        return Err(bad(format!("trailer counts {total_rows} rows, the tables hold {rows_in}")));
    }
    w.finish()?;
    Ok(removed)
}

/// Copy one table's values (`row_bytes` a row) from `r` to `w`, the rows `keep` says.
fn copy_kept(
    src: &Path,
    r: &mut CrcReader,
    w: &mut ValuesWriter<'_, FileOut>,
    keep: &[bool],
    row_bytes: usize,
) -> Result<()> {
    let mut buf = vec![0u8; BATCH.min(keep.len()) * row_bytes];
    for batch in keep.chunks(BATCH) {
        let b = &mut buf[..batch.len() * row_bytes];
        r.read(b).map_err(|e| src_err(src, e.into()))?;
        // Compact the kept rows to the front, in order, and write them at once.
        let mut n = 0;
        for (k, _) in batch.iter().enumerate().filter(|(_, &k)| k) {
            b.copy_within(k * row_bytes..(k + 1) * row_bytes, n * row_bytes);
            n += 1;
        }
        w.put(&b[..n * row_bytes])?;
    }
    Ok(())
}
