//! One internal shard: its chunks and slots, the `id -> slot` index and its probing
//! (software-pipelined over a group of batch positions), allocating, initializing and
//! removing rows. The shard's other concerns are its siblings' impl blocks: `lookup.rs`,
//! `update.rs`, `evict.rs` (eviction and TTL) and `copy.rs` (snapshots).

use crate::config::{InitKind, TableConfig};
use crate::elem::Elem;
use crate::hash::{internal_hash, row_stream_seed, unit_f64, SplitMix64};
use crate::index::{Index, EMPTY};
use crate::mem::prefetch;
use crate::optim::{self, RowScalars};

use super::{Chunk, Ctx, Group, Layout, Local, RowMut, RowState, Tier};
use crate::mem::Arena;

/// Maximum slots per internal shard.
const MAX_SLOTS: usize = (1 << 31) - 16;

/// One internal shard.
pub struct Shard<W: Copy> {
    pub chunks: Vec<Chunk<W>>,
    pub index: Index,
    pub free: Vec<u32>,
    pub rows: usize,
    /// Number of slots ever materialized (next fresh slot).
    pub high: usize,
    pub tick: u32,
    pub cap: usize,
    pub rng: u64,
    /// Base of the u32 row-version offsets.
    pub vbase: u64,
    /// The disk tier holding the rows beyond the shard's RAM budget (see spill.rs).
    pub tier: Option<Box<Tier>>,
}

/// Fill `out` with the deterministic initial vector of `id`.
pub fn init_values(cfg: &TableConfig, id: u64, out: &mut [f32]) {
    let mut rng = SplitMix64::new(row_stream_seed(cfg.seed, id));
    match cfg.initializer {
        InitKind::Uniform => {
            let (lo, span) = (cfg.init_low, cfg.init_high - cfg.init_low);
            for v in out.iter_mut() {
                *v = (lo + span * unit_f64(rng.next())) as f32;
            }
        }
        InitKind::Normal => {
            let mut i = 0;
            while i < out.len() {
                let u1 = 1.0 - unit_f64(rng.next()); // (0, 1]
                let u2 = unit_f64(rng.next());
                let r = (-2.0 * u1.ln()).sqrt();
                let t = 2.0 * std::f64::consts::PI * u2;
                out[i] = (cfg.init_mean + cfg.init_std * r * t.cos()) as f32;
                if i + 1 < out.len() {
                    out[i + 1] = (cfg.init_mean + cfg.init_std * r * t.sin()) as f32;
                }
                i += 2;
            }
        }
    }
}

impl<W: Elem> Shard<W> {
    pub fn new(cap: usize, seed: u64) -> Self {
        Shard {
            chunks: Vec::new(),
            index: Index::default(),
            free: Vec::new(),
            rows: 0,
            high: 0,
            tick: 0,
            cap,
            rng: seed | 1,
            vbase: 0,
            tier: None,
        }
    }

    #[inline(always)]
    pub(super) fn next_rand(&mut self) -> u64 {
        // xorshift64*
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// The stored u32 form of version `v` (rebasing the shard if `v` is more
    /// than 2^32-1 past the base: older rows are clamped up to the new base,
    /// which can only make `export_delta` return them again, never miss them).
    pub(super) fn version_word(&mut self, v: u64) -> u32 {
        if v < self.vbase {
            return 0;
        }
        if v - self.vbase > u32::MAX as u64 {
            let new_base = v - (1u64 << 31);
            let old = self.vbase;
            for ch in &mut self.chunks {
                for x in ch.versions.iter_mut() {
                    *x = (old + *x as u64).saturating_sub(new_base).min(u32::MAX as u64) as u32;
                }
            }
            self.vbase = new_base;
        }
        (v - self.vbase) as u32
    }

    #[inline(always)]
    pub fn version_of(&self, ch: &Chunk<W>, o: usize) -> u64 {
        self.vbase + ch.versions[o] as u64
    }

    #[inline(always)]
    pub fn id_at(&self, l: &Layout, slot: u32) -> u64 {
        let (c, o) = l.loc(slot);
        // SAFETY: slots handed out by the index / free list are always materialized.
        unsafe { *self.chunks.get_unchecked(c).recs.get_unchecked(o * l.rec_words) }
    }

    /// Address of a row record (id header + weights), for prefetching.
    #[inline(always)]
    fn rec_ptr(&self, l: &Layout, slot: u32) -> *const u8 {
        let (c, o) = l.loc(slot);
        match self.chunks.get(c) {
            Some(ch) => ch.recs.as_ptr().wrapping_add(o * l.rec_words) as *const u8,
            None => std::ptr::null(),
        }
    }

    #[inline(always)]
    pub fn w_row(&self, l: &Layout, slot: u32) -> &[W] {
        let (c, o) = l.loc(slot);
        self.chunks[c].w(l, o)
    }

    #[inline(always)]
    pub(super) fn is_occupied(&self, l: &Layout, slot: u32) -> bool {
        let (c, o) = l.loc(slot);
        self.chunks.get(c).is_some_and(|ch| o < ch.len() && ch.occupied(o))
    }

    pub fn row_mut(&mut self, l: &Layout, slot: u32) -> RowMut<'_, W> {
        let (c, o) = l.loc(slot);
        let ch = &mut self.chunks[c];
        let sd = l.state_dim;
        let rw = l.rec_words;
        let r = &mut ch.recs[o * rw..(o + 1) * rw];
        let (idw, rest) = r.split_at_mut(1);
        // SAFETY: see Chunk::w.
        let w = unsafe { std::slice::from_raw_parts_mut(rest.as_mut_ptr() as *mut W, l.dim) };
        RowMut {
            id: &mut idw[0],
            version: &mut ch.versions[o],
            w,
            state: if sd > 0 { &mut ch.state[o * sd..(o + 1) * sd] } else { &mut [] },
            acc: ch.acc.get_mut(o),
            step: ch.steps.get_mut(o),
            lru: ch.lru.get_mut(o),
            utime: ch.utime.get_mut(o),
            utick: ch.utick.get_mut(o),
        }
    }

    #[inline(always)]
    pub(super) fn touch(&mut self, l: &Layout, slot: u32) {
        if l.has_lru {
            self.tick = self.tick.wrapping_add(1);
            let (c, o) = l.loc(slot);
            self.chunks[c].lru[o] = self.tick;
        }
    }

    pub fn find(&self, l: &Layout, id: u64, h: u64) -> Option<u32> {
        self.index.find(id, h, |s| self.id_at(l, s))
    }

    /// Verify a candidate slot for `id` (full probe on a tag false-positive).
    #[inline(always)]
    pub(super) fn verify(&self, l: &Layout, cand: u32, id: u64, h: u64) -> u32 {
        if cand == EMPTY || self.id_at(l, cand) == id {
            cand
        } else {
            self.find(l, id, h).unwrap_or(EMPTY)
        }
    }

    /// Prefetch a whole row record (id header + weights).
    #[inline(always)]
    pub(super) fn prefetch_rec(&self, l: &Layout, slot: u32) {
        if slot != EMPTY {
            let p = self.rec_ptr(l, slot);
            let lines = (l.rec_words * 8).div_ceil(64).min(16);
            for line in 0..lines {
                prefetch(p.wrapping_add(line * 64));
            }
        }
    }

    /// Software-pipelined resolution of a group: calls `f(k, slot)` for every
    /// k in order (slot = EMPTY if absent). Index buckets are prefetched 2*D
    /// ahead, row records D ahead, so the misses of many rows overlap.
    #[inline(always)]
    pub(super) fn pipeline(
        &self,
        l: &Layout,
        g: &Group,
        mut pre: impl FnMut(usize),
        mut f: impl FnMut(&Self, usize, u32),
    ) {
        const D: usize = 12;
        const R: usize = 16; // ring size > D
        let n = g.len();
        if self.index.capacity() == 0 {
            for k in 0..n {
                f(self, k, EMPTY);
            }
            return;
        }
        let mut ring = [EMPTY; R];
        for k in 0..n.min(2 * D) {
            prefetch(self.index.bucket_ptr(g.hash[k]));
        }
        for k in 0..n.min(D) {
            let c = self.index.candidate(g.hash[k]);
            ring[k % R] = c;
            self.prefetch_rec(l, c);
            pre(k);
        }
        for k in 0..n {
            if k + 2 * D < n {
                prefetch(self.index.bucket_ptr(g.hash[k + 2 * D]));
            }
            if k + D < n {
                let c = self.index.candidate(g.hash[k + D]);
                ring[(k + D) % R] = c;
                self.prefetch_rec(l, c);
                pre(k + D);
            }
            let s = self.verify(l, ring[k % R], g.id[k], g.hash[k]);
            f(self, k, s);
        }
    }

    /// Remove the row in `slot`.
    pub fn remove_slot(&mut self, l: &Layout, slot: u32) {
        let id = self.id_at(l, slot);
        let Shard { index, chunks, .. } = self;
        let shift = l.chunk_shift;
        let mask = l.chunk_rows - 1;
        let removed = index.remove(slot, internal_hash(id), |s| {
            internal_hash(chunks[(s >> shift) as usize].recs[(s as usize & mask) * l.rec_words])
        });
        debug_assert!(removed);
        let (c, o) = l.loc(slot);
        self.chunks[c].occ[o >> 6] &= !(1u64 << (o & 63));
        self.free.push(slot);
        self.rows -= 1;
    }

    /// Allocate a slot for a new row `id` (evicting if at capacity: cold rows count). The
    /// row's data fields are NOT initialized.
    pub(super) fn alloc(&mut self, ctx: &Ctx, id: u64, h: u64, local: &mut Local) -> Option<u32> {
        if self.rows + self.cold_rows() >= self.cap && !self.evict_one(ctx, local) {
            return None;
        }
        self.alloc_slot(ctx.layout, ctx.arena, id, h)
    }

    /// Allocate a slot for row `id` and index it, whatever the capacity (`alloc` checks it).
    pub(super) fn alloc_slot(&mut self, l: &Layout, arena: &Arena, id: u64, h: u64) -> Option<u32> {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                if self.high >= MAX_SLOTS {
                    return None;
                }
                let c = self.high >> l.chunk_shift;
                if c == self.chunks.len() {
                    let first = if c == 0 { 16.min(l.chunk_rows) } else { l.chunk_rows };
                    self.chunks.push(Chunk::new(l, first, arena));
                }
                let ch = &mut self.chunks[c];
                if ch.len() == ch.cap_rows() {
                    let rows = (ch.cap_rows() * 2).clamp(16, l.chunk_rows);
                    ch.reserve_rows(l, rows, arena);
                }
                ch.push_slot(l);
                self.high += 1;
                (self.high - 1) as u32
            }
        };
        if self.index.needs_rebuild(self.high) {
            let Shard { index, chunks, rows, high, .. } = self;
            let live = chunks.iter().enumerate().flat_map(|(c, ch)| {
                (0..ch.len())
                    .filter(move |&o| ch.occupied(o))
                    .map(move |o| (((c << l.chunk_shift) | o) as u32, internal_hash(ch.id(l, o))))
            });
            index.rebuild(*rows + 1, *high, live);
        }
        self.index.insert_new(slot, h);
        let (c, o) = l.loc(slot);
        let ch = &mut self.chunks[c];
        ch.occ[o >> 6] |= 1u64 << (o & 63);
        ch.recs[o * l.rec_words] = id;
        self.rows += 1;
        Some(slot)
    }

    /// Initialize a freshly allocated row with its deterministic initial value.
    pub(super) fn init_row(&mut self, ctx: &Ctx, slot: u32, id: u64, tmp: &mut [f32]) {
        init_values(ctx.cfg, id, tmp);
        let (now, batch) = (ctx.now_secs, ctx.batch.wrapping_add(1));
        let version = self.version_word(ctx.version);
        let r = self.row_mut(ctx.layout, slot);
        W::store_row(tmp, r.w);
        optim::init_state(ctx.opt, r.w, r.state, RowScalars { acc: r.acc, step: r.step });
        *r.version = version;
        if let Some(t) = r.utime {
            *t = now;
        }
        if let Some(t) = r.utick {
            *t = batch;
        }
        self.touch(ctx.layout, slot);
        if let Some(p) = self.tier.as_ref().map(|t| t.probation).filter(|&p| p > 0) {
            // A new row starts on probation, as if looked up `p` ticks ago: one seen once spills
            // before the rows seen again since (see spill.rs).
            let (c, o) = ctx.layout.loc(slot);
            self.chunks[c].lru[o] = self.tick.wrapping_sub(p);
        }
    }

    pub fn get_state(&self, l: &Layout, id: u64) -> Option<RowState> {
        let Some(slot) = self.find(l, id, internal_hash(id)) else {
            return self.cold_state(l, id);
        };
        let (c, o) = l.loc(slot);
        let ch = &self.chunks[c];
        let mut w = vec![0f32; l.dim];
        W::load_row(ch.w(l, o), &mut w);
        Some(RowState {
            weights: w,
            state: ch.state.get(o * l.state_dim..(o + 1) * l.state_dim).map(|s| s.to_vec()).unwrap_or_default(),
            acc: ch.acc.get(o).copied(),
            step: ch.steps.get(o).copied(),
            version: self.version_of(ch, o),
            utime: ch.utime.get(o).copied(),
            utick: ch.utick.get(o).copied(),
        })
    }

    pub fn export_delta(&self, l: &Layout, since: u64, ids: &mut Vec<u64>, rows: &mut Vec<f32>) {
        let dim = l.dim;
        for ch in &self.chunks {
            for o in 0..ch.len() {
                if self.version_of(ch, o) > since && ch.occupied(o) {
                    ids.push(ch.id(l, o));
                    let start = rows.len();
                    rows.resize(start + dim, 0.0);
                    W::load_row(ch.w(l, o), &mut rows[start..]);
                }
            }
        }
        if self.tier.is_some() {
            self.cold_export_delta(l, since, ids, rows);
        }
    }

    pub fn memory_bytes(&self) -> usize {
        self.chunks.iter().map(|c| c.memory_bytes()).sum::<usize>()
            + self.chunks.capacity() * std::mem::size_of::<Chunk<W>>()
            + self.index.memory_bytes()
            + self.free.capacity() * 4
            + self.tier.as_ref().map_or(0, |t| t.memory_bytes())
            + std::mem::size_of::<Self>()
    }
}
