//! A shard's side of snapshots: whole copies for a capture (`ShardCopy`), the rows changed
//! since a version for a delta capture, loading decoded rows, and shifting update-batch
//! stamps when snapshots merge.

use crate::elem::Elem;
use crate::mem::Arena;

use super::{Chunk, ColdCopy, Ctx, Layout, Local, RowColumns, Shard};

/// A point-in-time copy of one internal shard's rows (see `Shard::copy`).
pub struct ShardCopy<W: Copy> {
    pub chunks: Vec<Chunk<W>>,
    /// Base of the chunks' u32 version offsets.
    pub vbase: u64,
    /// Rows copied: the chunks' and `cold`'s.
    pub rows: usize,
    /// The disk tier's rows, pinned in its file (read when the capture is written).
    pub cold: Option<ColdCopy>,
    /// Why the disk tier's rows could not be pinned (the copy is then unusable).
    pub error: Option<String>,
}

/// What a delta capture copies of a shard: its changed rows in RAM, and its disk tier's pinned.
pub type ChangedCopy<W> = (Vec<RowColumns<W>>, Option<ColdCopy>);

impl<W: Elem> ShardCopy<W> {
    pub fn memory_bytes(&self) -> usize {
        self.chunks.iter().map(|c| c.memory_bytes()).sum::<usize>()
            + self.cold.as_ref().map_or(0, |c| c.memory_bytes())
            + std::mem::size_of::<Self>()
    }
}

impl<W: Elem> Shard<W> {
    /// A copy of the shard's rows for a point-in-time capture; the chunks are copied whole
    /// (a memcpy per column beats gathering row by row while the shard is locked).
    /// A disk tier's rows stay in its file, pinned (see spill_copy.rs).
    pub fn copy(&self, arena: &Arena) -> ShardCopy<W> {
        let (cold, error) = match self.tier.as_ref().map(|t| t.pin_rows(0)) {
            None => (None, None),
            Some(Ok(c)) => (Some(c), None),
            Some(Err(e)) => (None, Some(e)),
        };
        ShardCopy {
            chunks: self.chunks.iter().map(|ch| ch.copy(arena)).collect(),
            vbase: self.vbase,
            rows: self.rows + cold.as_ref().map_or(0, |c| c.len()),
            cold,
            error,
        }
    }

    /// The rows whose version is at least `since` (created or updated since then), one
    /// block per chunk that has any, and a disk tier's pinned: what a delta capture copies.
    pub fn copy_since(&self, l: &Layout, since: u64) -> Result<ChangedCopy<W>, String> {
        let cold = self.tier.as_ref().map(|t| t.pin_rows(since)).transpose()?;
        let mut out = Vec::new();
        for ch in &self.chunks {
            let mut blk = RowColumns::default();
            ch.gather(l, self.vbase, since, &mut blk);
            if !blk.is_empty() {
                out.push(blk);
            }
        }
        Ok((out, cold))
    }

    /// Add `d` to every row's last-update batch: the rows keep their age when the table's
    /// update-batch count moves up by `d` (merging snapshots, see snapshot/read.rs).
    pub fn shift_update_batches(&mut self, d: u32) {
        for ch in &mut self.chunks {
            for t in ch.utick.iter_mut() {
                *t = t.wrapping_add(d);
            }
        }
        if let Some(tier) = &mut self.tier {
            tier.shift_update_batches(d);
        }
    }

    /// Insert/overwrite rows `which` of decoded snapshot columns.
    pub fn load_rows(&mut self, ctx: &Ctx, blk: &RowColumns<W>, which: &[u32], hashes: &[u64], local: &mut Local) {
        let l = ctx.layout;
        let (dim, sd) = (l.dim, l.state_dim);
        if self.tier.is_some() {
            let ids: Vec<u64> = which.iter().map(|&k| blk.ids[k as usize]).collect();
            self.fault_in(ctx, &ids);
        }
        for &k in which {
            let k = k as usize;
            let id = blk.ids[k];
            let h = hashes[k];
            let slot = match self.find(l, id, h) {
                Some(s) => s,
                None => match self.alloc(ctx, id, h, local) {
                    Some(s) => s,
                    None => continue,
                },
            };
            let (now, batch) = (ctx.now_secs, ctx.batch.wrapping_add(1));
            let version = self.version_word(blk.versions[k]);
            let r = self.row_mut(l, slot);
            r.w.copy_from_slice(&blk.weights[k * dim..(k + 1) * dim]);
            if sd > 0 && blk.state.len() >= (k + 1) * sd {
                r.state.copy_from_slice(&blk.state[k * sd..(k + 1) * sd]);
            }
            if let Some(a) = r.acc {
                *a = blk.acc.get(k).copied().unwrap_or(ctx.opt.initial_accumulator);
            }
            if let Some(s) = r.step {
                *s = blk.steps.get(k).copied().unwrap_or(0);
            }
            *r.version = version;
            if let Some(t) = r.utime {
                *t = blk.utime.get(k).copied().unwrap_or(now);
            }
            if let Some(t) = r.utick {
                *t = blk.utick.get(k).copied().unwrap_or(batch);
            }
            self.touch(l, slot);
        }
        self.spill_over_budget(l);
    }
}
