//! The disk tier of a table with a RAM budget (`memory_budget_bytes` and `disk`): each
//! internal shard keeps at most its share of the budget in RAM (its *resident* rows, in
//! the chunks) and spills the least recently used rows beyond it to a spill file of its
//! own (its *cold* rows).
//!
//! A cold row is a fixed-size record in the file — the id, the weights in the storage
//! dtype, the element-wise optimizer state, the row-wise accumulator and the Adam step
//! count where the table keeps them, and its LRU tick — at `fslot * rec_bytes`; the file's
//! free record slots are reused (LIFO), so the file is as large as the most rows ever cold
//! at once. What the shard decides on without reading a row stays in RAM, in columns by
//! cold index: the id, the record slot and the version (20 bytes), the LRU tick where
//! capacity eviction needs it, the TTL stamps where the table has a TTL, and a 4-byte bucket
//! of an `id -> cold index` hash index (the shard's own `Index`, verified against the ids
//! column): about 25 bytes a cold row.
//!
//! Which rows stay: the most recently looked up, with a frequency filter. A new row starts
//! on probation, as if last looked up four budgets of rows ago (`Tier::probation`), so that a
//! row seen once (most of a long tail) spills before the rows seen again; a second lookup
//! makes it as recent as any. On Zipf(1.1) IDs over 2M rows with 5% of them in RAM, 10.2% of
//! the looked-up IDs were read from disk without it, 8.5% with it. (Not with capacity
//! eviction, whose victims the ticks decide.)
//!
//! Spilled is not evicted: the shard's row count, capacity eviction (the candidates are
//! resident and cold rows alike, see evict.rs), TTL, versions, `export_delta`, captures,
//! dumps and loads all see a cold row as the row it is, so a table with a tier answers
//! exactly as the same table all in RAM. A lookup, update, `set_row` or load of a cold id
//! reads it back first (`fault_in`: one pass per call, in file order) and the normal path
//! then handles it (admission never sees it as new); the call ends by spilling the shard
//! back under its budget (`spill_over_budget`: the oldest LRU ticks, down to 7/8 of the
//! budget so that the scan for them is paid once per budget/8 rows).
//!
//! The file is mapped (`mem::FileMap`): a record is read and written by a copy, with no
//! syscall per row. It grows by an eighth at a time, its blocks allocated on disk before
//! they are mapped, so a full disk fails the growth: the row then stays in RAM, the tier is
//! marked failed (`Tier::error`), and the bindings raise it after the call, naming the table
//! and the file. (A read the device cannot serve raises SIGBUS and ends the process, whose
//! job recovers from its last checkpoint.) A capture reads its pinned records with `pread`
//! (spill_copy.rs): one it cannot read fails the capture's write, never a partial snapshot.

use crate::elem::Elem;
use crate::hash::internal_hash;

use super::{Cold, Ctx, Layout, RowColumns, RowState, Shard};

fn f32_at(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Decode the record `b` of cold row `c` onto owned columns.
pub(super) fn decode_record<W: Elem>(l: &Layout, c: &Cold, b: &[u8], blk: &mut RowColumns<W>) {
    blk.ids.push(c.id);
    blk.versions.push(c.version);
    let start = blk.weights.len();
    blk.weights.resize(start + l.dim, W::default());
    let wb = W::as_bytes_mut(&mut blk.weights[start..]);
    let n = wb.len();
    wb.copy_from_slice(&b[8..8 + n]);
    let mut at = 8 + n;
    for _ in 0..l.state_dim {
        blk.state.push(f32_at(b, at));
        at += 4;
    }
    if l.has_acc {
        blk.acc.push(f32_at(b, at));
        at += 4;
    }
    if l.has_steps {
        blk.steps.push(u32_at(b, at));
    }
    if l.has_utime {
        blk.utime.push(c.utime);
    }
    if l.has_utick {
        blk.utick.push(c.utick);
    }
}

impl<W: Elem> Shard<W> {
    /// Rows spilled to disk.
    #[inline(always)]
    pub fn cold_rows(&self) -> usize {
        match &self.tier {
            Some(t) => t.len(),
            None => 0,
        }
    }

    /// Every row of the shard, resident or cold.
    #[inline(always)]
    pub fn len(&self) -> usize {
        self.rows + self.cold_rows()
    }

    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Encode the resident row in `slot` as a spill record.
    fn encode(&self, l: &Layout, slot: u32, buf: &mut [u8]) {
        let (c, o) = l.loc(slot);
        let ch = &self.chunks[c];
        buf[..8].copy_from_slice(&ch.id(l, o).to_le_bytes());
        let wb = W::as_bytes(ch.w(l, o));
        buf[8..8 + wb.len()].copy_from_slice(wb);
        let mut at = 8 + wb.len();
        for x in ch.state.get(o * l.state_dim..(o + 1) * l.state_dim).unwrap_or_default() {
            buf[at..at + 4].copy_from_slice(&x.to_le_bytes());
            at += 4;
        }
        if l.has_acc {
            buf[at..at + 4].copy_from_slice(&ch.acc[o].to_le_bytes());
            at += 4;
        }
        if l.has_steps {
            buf[at..at + 4].copy_from_slice(&ch.steps[o].to_le_bytes());
            at += 4;
        }
        buf[at..at + 4].copy_from_slice(&ch.lru[o].to_le_bytes());
    }

    /// Bring the cold rows among `ids` back into RAM, reading their records in file order;
    /// returns how many. A row that cannot be read stays cold (the tier is marked failed).
    /// Takes no slot from capacity: the rows are in the shard already.
    pub(super) fn fault_in(&mut self, ctx: &Ctx, ids: &[u64]) -> usize {
        let Some(tier) = self.tier.as_mut() else { return 0 };
        if tier.is_empty() {
            return 0;
        }
        let mut want: Vec<(u32, u64)> = ids.iter().filter_map(|&id| tier.get(id).map(|c| (c.fslot, id))).collect();
        if want.is_empty() {
            return 0;
        }
        want.sort_unstable();
        want.dedup();
        let rb = tier.rec_bytes;
        let mut bufs = vec![0u8; want.len() * rb];
        let mut rows: Vec<Cold> = Vec::with_capacity(want.len());
        for &(fslot, id) in &want {
            let k = rows.len();
            tier.read(fslot, &mut bufs[k * rb..(k + 1) * rb]);
            rows.push(tier.take(id).expect("cold row"));
        }
        let l = ctx.layout;
        for (k, c) in rows.iter().enumerate() {
            let Some(slot) = self.alloc_slot(l, ctx.arena, c.id, internal_hash(c.id)) else {
                // MAX_SLOTS resident rows: cannot happen below the budget's rows.
                panic!("internal shard has no free slot for a row read back from disk");
            };
            let b = &bufs[k * rb..(k + 1) * rb];
            let version = self.version_word(c.version);
            let r = self.row_mut(l, slot);
            let wb = W::as_bytes_mut(r.w);
            let n = wb.len();
            wb.copy_from_slice(&b[8..8 + n]);
            let mut at = 8 + n;
            for x in r.state.iter_mut() {
                *x = f32_at(b, at);
                at += 4;
            }
            if let Some(a) = r.acc {
                *a = f32_at(b, at);
                at += 4;
            }
            if let Some(s) = r.step {
                *s = u32_at(b, at);
                at += 4;
            }
            *r.version = version;
            if let Some(t) = r.lru {
                *t = u32_at(b, at);
            }
            if let Some(t) = r.utime {
                *t = c.utime;
            }
            if let Some(t) = r.utick {
                *t = c.utick;
            }
        }
        rows.len()
    }

    /// Spill the least recently used resident rows while more than the budget are resident
    /// (down to 7/8 of it). A file that cannot grow (a full disk) stops the spill and leaves
    /// the rows resident.
    pub(super) fn spill_over_budget(&mut self, l: &Layout) {
        let Some(tier) = self.tier.as_ref() else { return };
        if self.rows <= tier.budget || tier.is_failed() {
            return;
        }
        let n = self.rows - tier.low;
        let rb = tier.rec_bytes;
        let tick = self.tick;
        // (age, slot) of every resident row; the n oldest go.
        let mut cand: Vec<(u32, u32)> = Vec::with_capacity(self.rows);
        for (c, ch) in self.chunks.iter().enumerate() {
            for o in 0..ch.len() {
                if ch.occupied(o) {
                    cand.push((tick.wrapping_sub(ch.lru[o]), ((c << l.chunk_shift) | o) as u32));
                }
            }
        }
        if n < cand.len() {
            cand.select_nth_unstable_by(n, |a, b| b.cmp(a));
            cand.truncate(n);
        }
        let mut buf = vec![0u8; rb];
        for &(_, slot) in &cand {
            self.encode(l, slot, &mut buf);
            let (c, o) = l.loc(slot);
            let ch = &self.chunks[c];
            let cold = Cold {
                id: ch.id(l, o),
                version: self.version_of(ch, o),
                fslot: 0,
                lru: ch.lru[o],
                utime: ch.utime.get(o).copied().unwrap_or(0),
                utick: ch.utick.get(o).copied().unwrap_or(0),
            };
            let tier = self.tier.as_mut().expect("tier");
            if tier.put(&buf, cold).is_err() {
                return;
            }
            self.remove_slot(l, slot);
        }
    }

    /// The cold rows whose version is at least `since`, read in file order and handed to
    /// `f` in blocks (as snapshots write them; see `ColdCopy::blocks`).
    pub fn cold_blocks(
        &self,
        l: &Layout,
        since: u64,
        f: impl FnMut(&RowColumns<W>) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        match &self.tier {
            Some(tier) => tier.pin_rows(since).map_err(std::io::Error::other)?.blocks(l, f),
            None => Ok(()),
        }
    }

    /// `get_state` of a cold row (read from disk; the row stays cold).
    pub(super) fn cold_state(&self, l: &Layout, id: u64) -> Option<RowState> {
        let tier = self.tier.as_ref()?;
        let c = tier.get(id)?;
        let mut buf = vec![0u8; tier.rec_bytes];
        tier.read(c.fslot, &mut buf);
        let mut blk = RowColumns::default();
        decode_record(l, &c, &buf, &mut blk);
        let mut w = vec![0f32; l.dim];
        W::load_row(&blk.weights, &mut w);
        Some(RowState {
            weights: w,
            state: blk.state,
            acc: blk.acc.first().copied(),
            step: blk.steps.first().copied(),
            version: c.version,
            utime: blk.utime.first().copied(),
            utick: blk.utick.first().copied(),
        })
    }

    /// `export_delta` of the cold rows (read from disk in file order).
    pub(super) fn cold_export_delta(&self, l: &Layout, since: u64, ids: &mut Vec<u64>, rows: &mut Vec<f32>) {
        let _ = self.cold_blocks(l, since.saturating_add(1), |b: &RowColumns<W>| {
            for k in 0..b.len() {
                ids.push(b.ids[k]);
                let start = rows.len();
                rows.resize(start + l.dim, 0.0);
                W::load_row(&b.weights[k * l.dim..(k + 1) * l.dim], &mut rows[start..]);
            }
            Ok(())
        });
    }

    /// Remove the cold rows past their TTL (`expire`'s sweep of the disk tier).
    pub(super) fn expire_cold(&mut self, ctx: &Ctx) -> u64 {
        let Some(tier) = self.tier.as_mut() else { return 0 };
        let mut n = 0;
        let mut i = 0;
        while i < tier.len() {
            let c = tier.at(i);
            if Self::expired_stamps(ctx, c.utime, c.utick) {
                tier.remove_at(i);
                n += 1;
            } else {
                i += 1;
            }
        }
        n
    }
}
