//! The values export of a capture (`Capture::write_values`): every captured table's IDs
//! and weights, in the format of `crate::values`, for model replicas to serve.
//!
//! Rows are written sorted by ID (the reader builds a sorted index from each run). A
//! capture's rows are in slot order, so the export first sorts one 16-byte reference
//! per row (ID, chunk or block, row), then gathers the weights in that order (a disk tier's
//! row read from its pinned spill file) through the
//! conversion lookups use (`OutElem::write_row`): a served value is bit-identical to what
//! `EmbeddingStore.lookup(..., create=False, out_dtype=...)` returns for the row. The file
//! is written atomically by the snapshot writer's `write_atomically` (temporary file,
//! fsync, rename, fsync of the directory; SHA-256 of the bytes as written).

use std::path::Path;

use half::f16;

use super::capture::{Capture, Copied, ShardCopies, TableCapture};
use super::write::{write_atomically, FileOut, Written};
use crate::config::{value_err, DType, Result};
use crate::elem::{Elem, OutElem};
use crate::table::{Chunk, ColdCopy, RowColumns};
use crate::values::{dtype_code, ValuesWriter};

/// Rows converted per write.
const BATCH: usize = 4096;

/// A captured row: its ID, and where its weights are (chunk, block or pinned disk-tier copy
/// index, row in it).
type RowRef = (u64, u32, u32);

/// A table's copied rows as `RowRef`s index them: the chunks (a whole copy) or the changed
/// rows' blocks (a delta), then the disk tiers' pinned copies.
struct Sources<'a, W: Elem> {
    chunks: Vec<&'a Chunk<W>>,
    blocks: &'a [RowColumns<W>],
    cold: Vec<&'a ColdCopy>,
}

impl<'a, W: Elem> Sources<'a, W> {
    fn of(c: &'a Copied<W>) -> Self {
        match c {
            Copied::Whole(shards) => Sources {
                chunks: shards.iter().flat_map(|s| &s.chunks).collect(),
                blocks: &[],
                cold: shards.iter().filter_map(|s| s.cold.as_ref()).collect(),
            },
            Copied::Changed(blocks, cold) => Sources { chunks: Vec::new(), blocks, cold: cold.iter().collect() },
        }
    }
    /// Index of the first disk-tier copy.
    fn cold_base(&self) -> usize {
        self.chunks.len() + self.blocks.len()
    }
}

/// References to every row of a table's copy, sorted by ID.
fn sorted_rows<W: Elem>(t: &TableCapture, src: &Sources<'_, W>) -> Vec<RowRef> {
    let l = &t.layout;
    let mut rows: Vec<RowRef> = Vec::new();
    for (k, ch) in src.chunks.iter().enumerate() {
        rows.extend((0..ch.len).filter(|&o| ch.occupied(o)).map(|o| (ch.id(l, o), k as u32, o as u32)));
    }
    let nch = src.chunks.len();
    for (k, b) in src.blocks.iter().enumerate() {
        rows.extend(b.ids.iter().enumerate().map(|(o, &id)| (id, (nch + k) as u32, o as u32)));
    }
    let base = src.cold_base();
    for (k, c) in src.cold.iter().enumerate() {
        rows.extend(c.ids().enumerate().map(|(o, id)| (id, (base + k) as u32, o as u32)));
    }
    rows.sort_unstable_by_key(|r| r.0);
    rows
}

/// Write one table: its head and IDs, then its weights converted to `O`.
fn write_table<W: Elem, O: OutElem + Elem>(
    w: &mut ValuesWriter<'_, FileOut>,
    t: &TableCapture,
    c: &Copied<W>,
) -> std::io::Result<()> {
    let (l, dim) = (&t.layout, t.layout.dim);
    let src = Sources::of(c);
    let rows = sorted_rows(t, &src);
    if let Some(p) = rows.windows(2).position(|r| r[0].0 == r[1].0) {
        // A capture holds each row once; a repeat would be a bug of the copy.
        return Err(std::io::Error::other(format!("table {:?}: ID {} captured twice", t.cfg.name, rows[p].0)));
    }
    w.table(&t.cfg.name, dim, &rows.iter().map(|r| r.0).collect::<Vec<u64>>())?;
    let (nch, base) = (src.chunks.len(), src.cold_base());
    let mut cold_row = vec![W::default(); dim];
    let mut buf = vec![O::default(); BATCH.min(rows.len()) * dim];
    for batch in rows.chunks(BATCH) {
        for (&(_, k, o), dst) in batch.iter().zip(buf.chunks_exact_mut(dim)) {
            let (k, o) = (k as usize, o as usize);
            if k < nch {
                O::write_row(src.chunks[k].w(l, o), dst);
            } else if k < base {
                O::write_row(&src.blocks[k - nch].weights[o * dim..][..dim], dst);
            } else {
                src.cold[k - base].weights(l, o, &mut cold_row)?; // a record read from the spill file
                O::write_row(&cold_row, dst);
            }
        }
        w.values(&buf[..batch.len() * dim])?;
    }
    Ok(())
}

fn write_any<O: OutElem + Elem>(w: &mut ValuesWriter<'_, FileOut>, t: &TableCapture) -> std::io::Result<()> {
    match &t.shards {
        ShardCopies::F32(c) => write_table::<_, O>(w, t, c),
        ShardCopies::F16(c) => write_table::<_, O>(w, t, c),
        ShardCopies::BF16(c) => write_table::<_, O>(w, t, c),
    }
}

impl Capture {
    /// Write the captured tables' IDs and weights, converted to `dtype` (fp16 or fp32), to
    /// `path` as a values file (see `crate::values`): full or delta as the capture is.
    /// Returns (bytes written, SHA-256 of the file). Takes no lock of the store.
    pub fn write_values(&self, path: &Path, dtype: DType) -> Result<Written> {
        self.check()?;
        if dtype_code(dtype).is_none() {
            return value_err(format!("values files hold fp16 or fp32, not {}", dtype.name()));
        }
        write_atomically(path, |out| {
            let mut w = ValuesWriter::new(out, dtype, self.delta, self.tables.len() as u32, self.next_version)?;
            for t in &self.tables {
                match dtype {
                    DType::F16 => write_any::<f16>(&mut w, t)?,
                    _ => write_any::<f32>(&mut w, t)?,
                }
            }
            w.finish()
        })
    }
}
