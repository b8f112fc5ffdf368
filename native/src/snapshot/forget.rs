//! Forgetting IDs in a snapshot file (a right to be forgotten, GDPR Art. 17): the file is
//! streamed through the verifying reader into the writer, block by block, without the rows
//! of the given IDs; everything else goes through unchanged (header flags and creation
//! time, version clock, each table's metadata and counters, the admission sketch, every
//! column of every kept row, block boundaries), so a rewrite that removes nothing gives
//! the source's bytes back.
//!
//! The counters stay as they were: a removal is no event (see `Table::forget`), and a delta
//! file's counters are increments its base's add up with. The source is verified as it is
//! read; the destination is written atomically (`write_atomically`), its trailer only once
//! the whole source has been verified, so a corrupt source leaves no file behind, and the
//! destination may be the source itself.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use super::read::{read_snapshot, AnyBlock, Visitor};
use super::write::{write_atomically, SnapWriter, Written};
use super::*;
use crate::table::RowColumns;

/// The rows of `blk` whose IDs are not in `drop`, or None when it has none of them.
fn without<W: crate::elem::Elem>(
    blk: &RowColumns<W>,
    drop: &HashSet<u64>,
    dim: usize,
    sd: usize,
) -> Option<RowColumns<W>> {
    if !blk.ids.iter().any(|id| drop.contains(id)) {
        return None;
    }
    let mut out = RowColumns::default();
    for (k, id) in blk.ids.iter().enumerate() {
        if drop.contains(id) {
            continue;
        }
        out.ids.push(*id);
        out.versions.push(blk.versions[k]);
        out.weights.extend_from_slice(&blk.weights[k * dim..(k + 1) * dim]);
        if sd > 0 {
            out.state.extend_from_slice(&blk.state[k * sd..(k + 1) * sd]);
        }
        // An optional column is empty when the table does not keep it.
        if let Some(x) = blk.acc.get(k) {
            out.acc.push(*x);
        }
        for (col, src) in [(&mut out.steps, &blk.steps), (&mut out.utime, &blk.utime), (&mut out.utick, &blk.utick)] {
            if let Some(x) = src.get(k) {
                col.push(*x);
            }
        }
    }
    Some(out)
}

/// Copies what the reader hands it, less the rows to drop.
struct Rewrite<'a, 'w> {
    w: SnapWriter<'w>,
    ids: &'a HashMap<String, HashSet<u64>>,
    /// The current table's configuration and IDs to drop.
    table: Option<(TableConfig, Option<&'a HashSet<u64>>)>,
    num_tables: u32,
    created_secs: u64,
    removed: u64,
}

impl Rewrite<'_, '_> {
    fn write<W: crate::elem::Elem>(&mut self, blk: &RowColumns<W>) -> Result<()> {
        let Some((cfg, drop)) = &self.table else { return corrupt("row block outside of a table") };
        let kept = drop.and_then(|d| without(blk, d, cfg.dim, cfg.state_dim()));
        match &kept {
            None => self.w.rows_block(cfg, blk)?,
            Some(k) => {
                self.removed += (blk.len() - k.len()) as u64;
                // A block left empty is not written: the format has no empty blocks.
                if !k.is_empty() {
                    self.w.rows_block(cfg, k)?;
                }
            }
        }
        Ok(())
    }
}

impl Visitor for Rewrite<'_, '_> {
    fn file_header(&mut self, num_tables: u32, created_secs: u64) -> Result<()> {
        (self.num_tables, self.created_secs) = (num_tables, created_secs);
        Ok(())
    }
    fn header(&mut self, next_version: u64, delta: bool) -> Result<()> {
        let flags = if delta { FLAG_DELTA } else { 0 };
        Ok(self.w.header(next_version, self.num_tables, self.created_secs, flags)?)
    }
    fn table(&mut self, cfg: &TableConfig, counters: &[u64; 9]) -> Result<()> {
        if self.table.is_some() {
            self.w.table_end()?;
        }
        self.w.meta(cfg, counters)?;
        self.table = Some((cfg.clone(), self.ids.get(&cfg.name)));
        Ok(())
    }
    fn sketch(&mut self, width: u32, depth: u32, counters: &[u32]) -> Result<()> {
        Ok(self.w.sketch(width as usize, depth as usize, counters.iter().copied())?)
    }
    fn rows(&mut self, blk: AnyBlock) -> Result<()> {
        match &blk {
            AnyBlock::F32(b) => self.write(b),
            AnyBlock::F16(b) => self.write(b),
            AnyBlock::BF16(b) => self.write(b),
        }
    }
    fn end(&mut self, next_version: u64) -> Result<()> {
        if self.table.take().is_some() {
            self.w.table_end()?;
        }
        // The larger of the header's and the trailer's clocks, which is the trailer's in a
        // file the writer wrote (it reads the clock for the header first).
        Ok(self.w.trailer(next_version)?)
    }
}

/// Rewrite the snapshot `src` to `dst` without the rows of `ids` (table name -> IDs; a table
/// the file lacks is skipped, a table not named is copied whole). Returns the number of
/// rows removed and (bytes written, SHA-256 of `dst`). Memory: one row block (at most
/// 2^20 rows) and the IDs.
pub fn forget_in_snapshot(src: &Path, dst: &Path, ids: &HashMap<String, Vec<u64>>) -> Result<(u64, Written)> {
    let sets: HashMap<String, HashSet<u64>> =
        ids.iter().map(|(name, v)| (name.clone(), v.iter().copied().collect())).collect();
    let mut removed = 0;
    let written = write_atomically(dst, |out| -> Result<()> {
        let mut v =
            Rewrite { w: SnapWriter::new(out), ids: &sets, table: None, num_tables: 0, created_secs: 0, removed: 0 };
        read_snapshot(src, &mut v)?;
        removed = v.removed;
        Ok(())
    })?;
    Ok((removed, written))
}
