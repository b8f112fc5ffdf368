//! Tables: internally sharded, slab-allocated embedding rows.
//!
//! Layout of one internal shard:
//! * `chunks`: fixed-size slabs (`chunk_rows` rows each, a power of two). Each
//!   chunk keeps row records (the id as an 8-byte header followed by the
//!   weights in the storage dtype, so a lookup verifies the id on the cache
//!   lines it copies anyway) and *parallel arrays* for the rest — versions (u32
//!   offsets from a per-shard base), element-wise optimizer state (f32), and
//!   optional per-row scalars
//!   (row-wise Adagrad accumulator, Adam step count, LRU tick, last-update time,
//!   last-update batch) that exist only when the table's configuration needs
//!   them — plus an occupancy bitmap. A row is addressed by its slot index
//!   `chunk << chunk_shift | offset`; freed slots are reused via a free list.
//!   Growing never copies existing chunks (only the very first chunk of a shard
//!   grows geometrically, so tiny tables stay tiny).
//! * `index`: open-addressing `id -> slot` map with 4-byte buckets (see index.rs).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use half::{bf16, f16};
use parking_lot::RwLock;
use rayon::prelude::*;

use crate::config::{AdmissionKind, InitKind, OptKind, Result, StoreError, TableConfig};
use crate::elem::{Elem, OutElem};
use crate::hash::{
    admission_draw, internal_hash, internal_shard, mix64, row_stream_seed, unit_f64, SplitMix64, SKETCH_SALT,
};
use crate::index::{Index, EMPTY};
use crate::mem::{prefetch, Arena, RawBuf, SendPtr};
use crate::optim::{self, OptParams, RowScalars};

/// Rows per shard above which eviction samples instead of scanning.
pub const EXACT_LRU_MAX_ROWS: usize = 64;
/// Number of candidates sampled per eviction.
pub const EVICTION_SAMPLES: usize = 16;
/// Maximum slots per internal shard.
const MAX_SLOTS: usize = (1 << 31) - 16;

/// Derived per-table layout constants.
#[derive(Clone, Debug)]
pub struct Layout {
    pub dim: usize,
    /// Row record length in u64 words: 1 (id header) + weights rounded up to 8 bytes.
    pub rec_words: usize,
    pub state_dim: usize,
    pub has_acc: bool,
    pub has_steps: bool,
    pub has_lru: bool,
    pub has_utime: bool,
    pub has_utick: bool,
    pub chunk_shift: u32,
    pub chunk_rows: usize,
}

impl Layout {
    pub fn new(cfg: &TableConfig) -> Self {
        let dim = cfg.dim;
        let state_dim = cfg.state_dim();
        let row_bytes = dim * cfg.dtype.size() + state_dim * 4 + 32;
        // ~1 MiB of row data per chunk, between 64 and 65536 rows.
        let target = (1usize << 20) / row_bytes.max(1);
        let shift = (usize::BITS - 1 - target.max(1).leading_zeros()).clamp(6, 16);
        Layout {
            dim,
            rec_words: 1 + (dim * cfg.dtype.size()).div_ceil(8),
            state_dim,
            has_acc: cfg.has_row_acc(),
            has_steps: cfg.has_steps(),
            has_lru: cfg.has_lru(),
            has_utime: cfg.has_utime(),
            has_utick: cfg.has_utick(),
            chunk_shift: shift,
            chunk_rows: 1 << shift,
        }
    }
    #[inline(always)]
    pub fn loc(&self, slot: u32) -> (usize, usize) {
        ((slot >> self.chunk_shift) as usize, (slot as usize) & (self.chunk_rows - 1))
    }
}

/// Atomic per-table counters.
#[derive(Default)]
pub struct Counters {
    pub admitted: AtomicU64,
    pub not_admitted: AtomicU64,
    pub evicted: AtomicU64,
    pub expired: AtomicU64,
    pub nan_grads_skipped: AtomicU64,
    pub lookups: AtomicU64,
    pub updates: AtomicU64,
    pub dropped_grads: AtomicU64,
    pub update_batches: AtomicU64,
}

pub const COUNTER_NAMES: [&str; 9] = [
    "admitted",
    "not_admitted",
    "evicted",
    "expired",
    "nan_grads_skipped",
    "lookups",
    "updates",
    "dropped_grads",
    "update_batches",
];

impl Counters {
    fn all(&self) -> [&AtomicU64; 9] {
        [
            &self.admitted,
            &self.not_admitted,
            &self.evicted,
            &self.expired,
            &self.nan_grads_skipped,
            &self.lookups,
            &self.updates,
            &self.dropped_grads,
            &self.update_batches,
        ]
    }
    pub fn snapshot(&self) -> [u64; 9] {
        let a = self.all();
        std::array::from_fn(|i| a[i].load(Ordering::Relaxed))
    }
    pub fn add_all(&self, v: &[u64; 9]) {
        for (c, x) in self.all().iter().zip(v) {
            c.fetch_add(*x, Ordering::Relaxed);
        }
    }
    fn add_local(&self, l: &Local) {
        let f = |c: &AtomicU64, v: u64| {
            if v != 0 {
                c.fetch_add(v, Ordering::Relaxed);
            }
        };
        f(&self.admitted, l.admitted);
        f(&self.not_admitted, l.not_admitted);
        f(&self.evicted, l.evicted);
        f(&self.expired, l.expired);
        f(&self.nan_grads_skipped, l.nan);
        f(&self.updates, l.updated);
        f(&self.dropped_grads, l.dropped);
    }
}

/// Counters accumulated by one shard task.
#[derive(Default, Clone, Copy, Debug)]
pub struct Local {
    pub admitted: u64,
    pub not_admitted: u64,
    pub evicted: u64,
    pub expired: u64,
    pub nan: u64,
    pub updated: u64,
    pub dropped: u64,
}

impl std::ops::Add for Local {
    type Output = Local;
    fn add(self, o: Local) -> Local {
        Local {
            admitted: self.admitted + o.admitted,
            not_admitted: self.not_admitted + o.not_admitted,
            evicted: self.evicted + o.evicted,
            expired: self.expired + o.expired,
            nan: self.nan + o.nan,
            updated: self.updated + o.updated,
            dropped: self.dropped + o.dropped,
        }
    }
}

/// Count-min sketch for frequency admission (shared by all internal shards).
pub struct Sketch {
    pub width: usize,
    pub depth: usize,
    pub counters: Vec<AtomicU32>,
}

impl Sketch {
    pub fn new(width: usize, depth: usize) -> Self {
        let mut counters = Vec::with_capacity(width * depth);
        counters.resize_with(width * depth, || AtomicU32::new(0));
        Sketch { width, depth, counters }
    }
    #[inline]
    fn cells(&self, id: u64) -> impl Iterator<Item = usize> + '_ {
        let h = mix64(id ^ SKETCH_SALT);
        let h1 = h as u32 as usize;
        let h2 = ((h >> 32) as u32 | 1) as usize;
        let mask = self.width - 1;
        (0..self.depth).map(move |i| i * self.width + (h1.wrapping_add(i.wrapping_mul(h2)) & mask))
    }
    /// Add `m` sightings of `id`; returns the new (over-)estimate of its count.
    pub fn add(&self, id: u64, m: u32) -> u32 {
        let mut est = u32::MAX;
        for c in self.cells(id) {
            let cell = &self.counters[c];
            let mut cur = cell.load(Ordering::Relaxed);
            loop {
                let new = cur.saturating_add(m);
                match cell.compare_exchange_weak(cur, new, Ordering::Relaxed, Ordering::Relaxed) {
                    Ok(_) => {
                        cur = new;
                        break;
                    }
                    Err(x) => cur = x,
                }
            }
            est = est.min(cur);
        }
        est
    }
    pub fn estimate(&self, id: u64) -> u32 {
        self.cells(id).map(|c| self.counters[c].load(Ordering::Relaxed)).min().unwrap_or(0)
    }
    pub fn memory_bytes(&self) -> usize {
        self.counters.capacity() * 4
    }
}

/// Per-call context shared by all shard tasks of one batched operation.
pub struct Ctx<'a> {
    pub cfg: &'a TableConfig,
    pub arena: &'a Arena,
    pub layout: &'a Layout,
    pub opt: &'a OptParams,
    pub sketch: Option<&'a Sketch>,
    /// Version stamped on rows changed by this call.
    pub version: u64,
    /// Current wall clock in whole UNIX seconds (TTL).
    pub now_secs: u32,
    /// Table update-batch number stamped on updated rows (created rows get +1).
    pub batch: u32,
    /// Current table update-batch number for TTL-by-updates checks.
    pub batch_now: u32,
    /// Run shard tasks sequentially on the calling thread (single-threaded store).
    pub sequential: bool,
}

/// Map `f` over `0..n` (in parallel on the current rayon pool unless
/// `sequential`) and sum the resulting counters.
fn map_shards(sequential: bool, n: usize, f: impl Fn(usize) -> Local + Sync + Send) -> Local {
    if sequential {
        (0..n).map(f).fold(Local::default(), |a, b| a + b)
    } else {
        (0..n).into_par_iter().map(f).reduce(Local::default, |a, b| a + b)
    }
}

impl Ctx<'_> {
    #[inline(always)]
    fn ttl_enabled(&self) -> bool {
        self.layout.has_utime || self.layout.has_utick
    }
}

/// One slab chunk for up to `chunk_rows` rows.
///
/// `recs` holds one record per slot: the row's id (one u64 header) followed by
/// its weights in the storage dtype (padded to 8 bytes), so verifying a lookup
/// touches the same cache lines as copying the row. Everything else is kept
/// in parallel arrays.
pub struct Chunk<W: Copy> {
    pub recs: RawBuf<u64>,
    pub len: usize,
    /// Row versions as offsets from the shard's `vbase` (see Shard::version_word).
    pub versions: RawBuf<u32>,
    pub state: RawBuf<f32>,
    pub acc: RawBuf<f32>,
    pub steps: RawBuf<u32>,
    pub lru: RawBuf<u32>,
    pub utime: RawBuf<u32>,
    pub utick: RawBuf<u32>,
    pub occ: Vec<u64>,
    _w: std::marker::PhantomData<W>,
}

impl<W: Elem> Chunk<W> {
    fn new(l: &Layout, rows: usize, arena: &Arena) -> Self {
        let mut c = Chunk {
            recs: RawBuf::default(),
            len: 0,
            versions: RawBuf::default(),
            state: RawBuf::default(),
            acc: RawBuf::default(),
            steps: RawBuf::default(),
            lru: RawBuf::default(),
            utime: RawBuf::default(),
            utick: RawBuf::default(),
            occ: vec![0u64; l.chunk_rows.div_ceil(64)],
            _w: std::marker::PhantomData,
        };
        c.reserve_rows(l, rows, arena);
        c
    }
    #[inline(always)]
    fn len(&self) -> usize {
        self.len
    }
    #[inline(always)]
    fn cap_rows(&self) -> usize {
        self.versions.capacity()
    }
    #[inline(always)]
    pub fn id(&self, l: &Layout, o: usize) -> u64 {
        self.recs[o * l.rec_words]
    }
    #[inline(always)]
    pub fn w(&self, l: &Layout, o: usize) -> &[W] {
        let r = &self.recs[o * l.rec_words + 1..(o + 1) * l.rec_words];
        // SAFETY: the record tail holds >= dim*size_of::<W>() bytes; W (f32/f16/bf16)
        // has alignment <= 8 and every bit pattern is valid.
        unsafe { std::slice::from_raw_parts(r.as_ptr() as *const W, l.dim) }
    }
    #[inline(always)]
    pub fn rec_mut(&mut self, l: &Layout, o: usize) -> (&mut u64, &mut [W]) {
        let r = &mut self.recs[o * l.rec_words..(o + 1) * l.rec_words];
        let (id, rest) = r.split_at_mut(1);
        // SAFETY: as in `w`.
        (&mut id[0], unsafe { std::slice::from_raw_parts_mut(rest.as_mut_ptr() as *mut W, l.dim) })
    }
    /// Grow every column to `rows` rows. Full-size chunks come from the
    /// table's huge-page arena, smaller (growing) ones from the heap.
    fn reserve_rows(&mut self, l: &Layout, rows: usize, arena: &Arena) {
        let a = if rows >= l.chunk_rows { Some(arena) } else { None };
        self.recs.grow_to(rows * l.rec_words, a);
        self.versions.grow_to(rows, a);
        if l.state_dim > 0 {
            self.state.grow_to(rows * l.state_dim, a);
        }
        if l.has_acc {
            self.acc.grow_to(rows, a);
        }
        if l.has_steps {
            self.steps.grow_to(rows, a);
        }
        if l.has_lru {
            self.lru.grow_to(rows, a);
        }
        if l.has_utime {
            self.utime.grow_to(rows, a);
        }
        if l.has_utick {
            self.utick.grow_to(rows, a);
        }
    }
    fn push_slot(&mut self, l: &Layout) {
        self.recs.extend_fill(l.rec_words, 0);
        self.len += 1;
        self.versions.push(0);
        if l.state_dim > 0 {
            self.state.extend_fill(l.state_dim, 0.0);
        }
        if l.has_acc {
            self.acc.push(0.0);
        }
        if l.has_steps {
            self.steps.push(0);
        }
        if l.has_lru {
            self.lru.push(0);
        }
        if l.has_utime {
            self.utime.push(0);
        }
        if l.has_utick {
            self.utick.push(0);
        }
    }
    fn memory_bytes(&self) -> usize {
        self.recs.capacity() * 8
            + self.versions.capacity() * 4
            + self.state.capacity() * 4
            + self.acc.capacity() * 4
            + self.steps.capacity() * 4
            + self.lru.capacity() * 4
            + self.utime.capacity() * 4
            + self.utick.capacity() * 4
            + self.occ.capacity() * 8
            + std::mem::size_of::<Self>()
    }
    #[inline(always)]
    fn occupied(&self, l: usize) -> bool {
        (self.occ[l >> 6] >> (l & 63)) & 1 == 1
    }

    /// Copy of the chunk: every column up to `len` (free slots included, the occupancy
    /// bitmap tells them apart) except the LRU ticks, which snapshots do not keep.
    fn copy(&self, arena: &Arena) -> Self {
        let a = Some(arena);
        Chunk {
            recs: RawBuf::copy_of(&self.recs, a),
            len: self.len,
            versions: RawBuf::copy_of(&self.versions, a),
            state: RawBuf::copy_of(&self.state, a),
            acc: RawBuf::copy_of(&self.acc, a),
            steps: RawBuf::copy_of(&self.steps, a),
            lru: RawBuf::default(),
            utime: RawBuf::copy_of(&self.utime, a),
            utick: RawBuf::copy_of(&self.utick, a),
            occ: self.occ[..self.len.div_ceil(64)].to_vec(),
            _w: std::marker::PhantomData,
        }
    }

    /// Gather the live rows into `blk` (the snapshot writer's row block); versions are
    /// offsets from the owning shard's `vbase`.
    /// The live rows whose version is at least `since` (0: every row) into `blk`.
    pub fn gather(&self, l: &Layout, vbase: u64, since: u64, blk: &mut RowBlock<W>) {
        blk.clear();
        let sd = l.state_dim;
        for o in 0..self.len() {
            if !self.occupied(o) || vbase + (self.versions[o] as u64) < since {
                continue;
            }
            blk.ids.push(self.id(l, o));
            blk.versions.push(vbase + self.versions[o] as u64);
            blk.weights.extend_from_slice(self.w(l, o));
            if sd > 0 {
                blk.state.extend_from_slice(&self.state[o * sd..(o + 1) * sd]);
            }
            if l.has_acc {
                blk.acc.push(self.acc[o]);
            }
            if l.has_steps {
                blk.steps.push(self.steps[o]);
            }
            if l.has_utime {
                blk.utime.push(self.utime[o]);
            }
            if l.has_utick {
                blk.utick.push(self.utick[o]);
            }
        }
    }
}

/// Mutable view of all the fields of one row.
pub struct RowMut<'a, W> {
    pub id: &'a mut u64,
    pub version: &'a mut u32,
    pub w: &'a mut [W],
    pub state: &'a mut [f32],
    pub acc: Option<&'a mut f32>,
    pub step: Option<&'a mut u32>,
    pub lru: Option<&'a mut u32>,
    pub utime: Option<&'a mut u32>,
    pub utick: Option<&'a mut u32>,
}

/// Owned copy of one row (debugging / tests).
#[derive(Clone, Debug)]
pub struct RowState {
    pub weights: Vec<f32>,
    pub state: Vec<f32>,
    pub acc: Option<f32>,
    pub step: Option<u32>,
    pub version: u64,
    pub utime: Option<u32>,
    pub utick: Option<u32>,
}

/// Columns of a batch of rows, as stored in snapshots.
#[derive(Default)]
pub struct RowBlock<W> {
    pub ids: Vec<u64>,
    pub versions: Vec<u64>,
    pub weights: Vec<W>,
    pub state: Vec<f32>,
    pub acc: Vec<f32>,
    pub steps: Vec<u32>,
    pub utime: Vec<u32>,
    pub utick: Vec<u32>,
}

impl<W> RowBlock<W> {
    pub fn clear(&mut self) {
        self.ids.clear();
        self.versions.clear();
        self.weights.clear();
        self.state.clear();
        self.acc.clear();
        self.steps.clear();
        self.utime.clear();
        self.utick.clear();
    }
    pub fn len(&self) -> usize {
        self.ids.len()
    }
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
    /// Bytes held by the block's columns.
    pub fn memory_bytes(&self) -> usize {
        self.ids.capacity() * 8
            + self.versions.capacity() * 8
            + self.weights.capacity() * std::mem::size_of::<W>()
            + (self.state.capacity() + self.acc.capacity()) * 4
            + (self.steps.capacity() + self.utime.capacity() + self.utick.capacity()) * 4
    }
}

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
}

/// A point-in-time copy of one internal shard's rows (see `Shard::copy`).
pub struct ShardCopy<W: Copy> {
    pub chunks: Vec<Chunk<W>>,
    /// Base of the chunks' u32 version offsets.
    pub vbase: u64,
    pub rows: usize,
}

impl<W: Elem> ShardCopy<W> {
    pub fn memory_bytes(&self) -> usize {
        self.chunks.iter().map(|c| c.memory_bytes()).sum::<usize>() + std::mem::size_of::<Self>()
    }
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
        }
    }

    #[inline(always)]
    fn next_rand(&mut self) -> u64 {
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
    fn version_word(&mut self, v: u64) -> u32 {
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
    fn is_occupied(&self, l: &Layout, slot: u32) -> bool {
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
    fn touch(&mut self, l: &Layout, slot: u32) {
        if l.has_lru {
            self.tick = self.tick.wrapping_add(1);
            let (c, o) = l.loc(slot);
            self.chunks[c].lru[o] = self.tick;
        }
    }

    /// Is the row in `slot` past its TTL?
    #[inline(always)]
    fn expired(&self, ctx: &Ctx, slot: u32) -> bool {
        let (c, o) = ctx.layout.loc(slot);
        let ch = &self.chunks[c];
        if let Some(ttl) = ctx.cfg.ttl_seconds {
            let age = ctx.now_secs.wrapping_sub(ch.utime[o]) as i32;
            if age as i64 > ttl as i64 {
                return true;
            }
        }
        if let Some(ttl) = ctx.cfg.ttl_updates {
            let age = ctx.batch_now.wrapping_sub(ch.utick[o]) as i32;
            if age as i64 >= ttl as i64 {
                return true;
            }
        }
        false
    }

    pub fn find(&self, l: &Layout, id: u64, h: u64) -> Option<u32> {
        self.index.find(id, h, |s| self.id_at(l, s))
    }

    /// Verify a candidate slot for `id` (full probe on a tag false-positive).
    #[inline(always)]
    fn verify(&self, l: &Layout, cand: u32, id: u64, h: u64) -> u32 {
        if cand == EMPTY || self.id_at(l, cand) == id {
            cand
        } else {
            self.find(l, id, h).unwrap_or(EMPTY)
        }
    }

    /// Prefetch a whole row record (id header + weights).
    #[inline(always)]
    fn prefetch_rec(&self, l: &Layout, slot: u32) {
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
    fn pipeline(&self, l: &Layout, g: &Group, mut pre: impl FnMut(usize), mut f: impl FnMut(&Self, usize, u32)) {
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

    /// Evict one row by (approximate) LRU; expired rows are preferred.
    fn evict_one(&mut self, ctx: &Ctx, local: &mut Local) -> bool {
        if self.rows == 0 {
            return false;
        }
        let l = ctx.layout;
        let ttl = ctx.ttl_enabled();
        let mut best: Option<(u32, u32)> = None; // (age, slot)
        let mut consider = |sh: &Self, s: u32| -> bool {
            if ttl && sh.expired(ctx, s) {
                best = Some((u32::MAX, s));
                return true;
            }
            let (c, o) = l.loc(s);
            let age = if l.has_lru { sh.tick.wrapping_sub(sh.chunks[c].lru[o]) } else { 0 };
            match best {
                Some((a, _)) if a >= age => {}
                _ => best = Some((age, s)),
            }
            false
        };
        if self.rows <= EXACT_LRU_MAX_ROWS {
            'scan: for (c, ch) in self.chunks.iter().enumerate() {
                for o in 0..ch.len() {
                    if ch.occupied(o) {
                        let s = ((c << l.chunk_shift) | o) as u32;
                        if consider(self, s) {
                            break 'scan;
                        }
                    }
                }
            }
        } else {
            let mut found = 0;
            let mut tries = 0;
            while found < EVICTION_SAMPLES && tries < EVICTION_SAMPLES * 8 {
                tries += 1;
                let s = (self.next_rand() % self.high as u64) as u32;
                if !self.is_occupied(l, s) {
                    continue;
                }
                found += 1;
                if consider(self, s) {
                    break;
                }
            }
        }
        match best {
            Some((age, s)) => {
                self.remove_slot(l, s);
                if age == u32::MAX && ttl {
                    local.expired += 1;
                } else {
                    local.evicted += 1;
                }
                true
            }
            None => false,
        }
    }

    /// Allocate a slot for a new row `id` (evicting if at capacity). The row's
    /// data fields are NOT initialized.
    fn alloc(&mut self, ctx: &Ctx, id: u64, h: u64, local: &mut Local) -> Option<u32> {
        let l = ctx.layout;
        if self.rows >= self.cap && !self.evict_one(ctx, local) {
            return None;
        }
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                if self.high >= MAX_SLOTS {
                    return None;
                }
                let c = self.high >> l.chunk_shift;
                if c == self.chunks.len() {
                    let first = if c == 0 { 16.min(l.chunk_rows) } else { l.chunk_rows };
                    self.chunks.push(Chunk::new(l, first, ctx.arena));
                }
                let ch = &mut self.chunks[c];
                if ch.len() == ch.cap_rows() {
                    let rows = (ch.cap_rows() * 2).clamp(16, l.chunk_rows);
                    ch.reserve_rows(l, rows, ctx.arena);
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
    fn init_row(&mut self, ctx: &Ctx, slot: u32, id: u64, tmp: &mut [f32]) {
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
    }

    /// Admission decision for a missing id seen `m` times in a lookup batch.
    fn admit(ctx: &Ctx, id: u64, m: u32) -> bool {
        match ctx.cfg.admission {
            AdmissionKind::Off => true,
            AdmissionKind::Probability => admission_draw(ctx.cfg.seed, id) < ctx.cfg.admission_probability,
            AdmissionKind::Threshold => match ctx.sketch {
                Some(sk) => sk.add(id, m) >= ctx.cfg.admission_threshold,
                None => true,
            },
        }
    }

    /// Batched lookup of a group of batch positions; writes rows into `out`.
    pub fn lookup<O: OutElem>(&mut self, ctx: &Ctx, g: &Group, out: SendPtr<O>, create: bool, local: &mut Local) {
        let l = ctx.layout;
        let dim = l.dim;
        let ttl = ctx.ttl_enabled();
        let out_lines = (dim * std::mem::size_of::<O>()).div_ceil(64).min(16);
        let mut missing: Vec<u32> = Vec::new(); // group indices
        let mut found: Vec<u32> = Vec::new(); // (only with TTL/LRU) group index -> slot
        let bookkeeping = ttl || l.has_lru;
        if bookkeeping {
            found.resize(g.len(), EMPTY);
        }
        self.pipeline(
            l,
            g,
            |k| {
                // Output rows are written in shard order (scattered): prefetch them.
                let d = out.0.wrapping_add(g.pos[k] as usize * dim) as *const u8;
                for line in 0..out_lines {
                    prefetch(d.wrapping_add(line * 64));
                }
            },
            |sh, k, s| {
                if s == EMPTY {
                    missing.push(k as u32);
                } else if bookkeeping {
                    found[k] = s;
                } else {
                    let pos = g.pos[k] as usize;
                    // SAFETY: pos < n_ids and rows of distinct positions are disjoint.
                    let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(pos * dim), dim) };
                    O::write_row(sh.w_row(l, s), dst);
                }
            },
        );
        if bookkeeping {
            // Slow path for tables with TTL / LRU bookkeeping (mutates the shard).
            for (k, &s) in found.iter().enumerate() {
                if s == EMPTY {
                    continue;
                }
                if ttl {
                    if !self.is_occupied(l, s) || self.id_at(l, s) != g.id[k] {
                        // removed as expired earlier in this batch
                        missing.push(k as u32);
                        continue;
                    }
                    if self.expired(ctx, s) {
                        self.remove_slot(l, s);
                        local.expired += 1;
                        missing.push(k as u32);
                        continue;
                    }
                }
                self.touch(l, s);
                let pos = g.pos[k] as usize;
                // SAFETY: as above.
                let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(pos * dim), dim) };
                O::write_row(self.w_row(l, s), dst);
            }
        }
        self.handle_missing(ctx, g, missing, out, create, local);
    }

    /// Admission / insertion for the ids of a lookup group that have no row
    /// (`missing`: group indices). Writes their output rows (zeros if not admitted).
    pub fn handle_missing<O: OutElem>(
        &mut self,
        ctx: &Ctx,
        g: &Group,
        missing: Vec<u32>,
        out: SendPtr<O>,
        create: bool,
        local: &mut Local,
    ) {
        let l = ctx.layout;
        let dim = l.dim;
        if missing.is_empty() {
            return;
        }
        let zero_row = |pos: usize| {
            // SAFETY: as above.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(pos * dim), dim) };
            dst.fill(O::default());
        };
        if !create {
            for &k in &missing {
                zero_row(g.pos[k as usize] as usize);
            }
            return;
        }
        // Group the missing positions by id so that every occurrence of an id
        // in this batch gets the same answer. Entries: (id, group index).
        let mut keyed: Vec<(u64, u32)> = missing.iter().map(|&k| (g.id[k as usize], k)).collect();
        keyed.sort_unstable();
        let mut tmp = vec![0f32; dim];
        let mut i = 0;
        while i < keyed.len() {
            let id = keyed[i].0;
            let mut j = i + 1;
            while j < keyed.len() && keyed[j].0 == id {
                j += 1;
            }
            let h = g.hash[keyed[i].1 as usize];
            if let Some(s) = self.find(l, id, h) {
                // inserted concurrently since this batch was scanned
                for &(_, k) in &keyed[i..j] {
                    let p = g.pos[k as usize] as usize;
                    // SAFETY: as above.
                    let dst = unsafe { std::slice::from_raw_parts_mut(out.get().add(p * dim), dim) };
                    O::write_row(self.w_row(l, s), dst);
                }
                i = j;
                continue;
            }
            let admitted = Self::admit(ctx, id, (j - i) as u32);
            let slot = if admitted { self.alloc(ctx, id, h, local) } else { None };
            match slot {
                Some(s) => {
                    local.admitted += 1;
                    self.init_row(ctx, s, id, &mut tmp);
                    for &(_, k) in &keyed[i..j] {
                        let p = g.pos[k as usize] as usize;
                        // SAFETY: as above.
                        let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(p * dim), dim) };
                        O::write_row(self.w_row(l, s), dst);
                    }
                }
                None => {
                    local.not_admitted += 1;
                    for &(_, k) in &keyed[i..j] {
                        zero_row(g.pos[k as usize] as usize);
                    }
                }
            }
            i = j;
        }
    }

    /// Batched optimizer update. Duplicate ids are summed; ids without a row
    /// are dropped (counted); rows with a non-finite summed gradient are skipped.
    pub fn update(&mut self, ctx: &Ctx, g: &Group, grads: &[f32], local: &mut Local) {
        let l = ctx.layout;
        let dim = l.dim;
        let mut pairs: Vec<u64> = Vec::with_capacity(g.len());
        let mut dropped = 0;
        self.pipeline(
            l,
            g,
            |_| {},
            |_, k, s| {
                if s == EMPTY {
                    dropped += 1;
                } else {
                    pairs.push(((s as u64) << 32) | g.pos[k] as u64);
                }
            },
        );
        local.dropped += dropped;
        pairs.sort_unstable();
        let mut tmp = vec![0f32; dim];
        let mut i = 0;
        let n = pairs.len();
        while i < n {
            let slot = (pairs[i] >> 32) as u32;
            let mut j = i + 1;
            while j < n && (pairs[j] >> 32) as u32 == slot {
                j += 1;
            }
            // Prefetch the next group's row and gradient.
            if j < n {
                let ns = (pairs[j] >> 32) as u32;
                let np = (pairs[j] as u32) as usize;
                self.prefetch_rec(l, ns);
                let gp = grads.as_ptr().wrapping_add(np * dim) as *const u8;
                for line in 0..(dim * 4).div_ceil(64).min(8) {
                    prefetch(gp.wrapping_add(line * 64));
                }
            }
            let p0 = (pairs[i] as u32) as usize;
            let g: &[f32] = if j - i == 1 {
                &grads[p0 * dim..(p0 + 1) * dim]
            } else {
                tmp.copy_from_slice(&grads[p0 * dim..(p0 + 1) * dim]);
                for &pp in &pairs[i + 1..j] {
                    let p = (pp as u32) as usize;
                    for (t, x) in tmp.iter_mut().zip(&grads[p * dim..(p + 1) * dim]) {
                        *t += *x;
                    }
                }
                &tmp
            };
            i = j;
            if !optim::all_finite(g) {
                local.nan += 1;
                continue;
            }
            let (now, batch) = (ctx.now_secs, ctx.batch);
            let version = self.version_word(ctx.version);
            let r = self.row_mut(l, slot);
            optim::apply(ctx.opt, r.w, g, r.state, RowScalars { acc: r.acc, step: r.step });
            *r.version = version;
            if let Some(t) = r.utime {
                *t = now;
            }
            if let Some(t) = r.utick {
                *t = batch;
            }
            // LRU recency is refreshed by lookups only (a row is always looked
            // up before it is updated).
            local.updated += 1;
        }
    }

    pub fn get_state(&self, l: &Layout, id: u64) -> Option<RowState> {
        let slot = self.find(l, id, internal_hash(id))?;
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

    /// Overwrite (or create, bypassing admission) the weights of `id`.
    pub fn set_row(&mut self, ctx: &Ctx, id: u64, values: &[f32], local: &mut Local) -> Result<()> {
        let l = ctx.layout;
        let h = internal_hash(id);
        let (slot, fresh) = match self.find(l, id, h) {
            Some(s) => (s, false),
            None => match self.alloc(ctx, id, h, local) {
                Some(s) => (s, true),
                None => return Err(StoreError::Value("internal shard is full".into())),
            },
        };
        if fresh {
            local.admitted += 1;
        }
        let (now, batch) = (ctx.now_secs, ctx.batch.wrapping_add(1));
        let version = self.version_word(ctx.version);
        let opt = ctx.opt;
        let r = self.row_mut(l, slot);
        W::store_row(values, r.w);
        if fresh {
            optim::init_state(opt, r.w, r.state, RowScalars { acc: r.acc, step: r.step });
        } else if opt.kind == OptKind::Ftrl {
            let (z, n) = r.state.split_at_mut(l.dim);
            for i in 0..l.dim {
                z[i] = optim::ftrl_z_for_weight(opt, r.w[i].to_f32(), n[i]);
            }
        }
        *r.version = version;
        if let Some(t) = r.utime {
            *t = now;
        }
        if let Some(t) = r.utick {
            *t = batch;
        }
        self.touch(l, slot);
        Ok(())
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
    }

    pub fn expire(&mut self, ctx: &Ctx, local: &mut Local) {
        let l = ctx.layout;
        let mut victims = Vec::new();
        for (c, ch) in self.chunks.iter().enumerate() {
            for o in 0..ch.len() {
                if ch.occupied(o) {
                    let s = ((c << l.chunk_shift) | o) as u32;
                    if self.expired(ctx, s) {
                        victims.push(s);
                    }
                }
            }
        }
        for s in victims {
            self.remove_slot(l, s);
            local.expired += 1;
        }
    }

    pub fn memory_bytes(&self) -> usize {
        self.chunks.iter().map(|c| c.memory_bytes()).sum::<usize>()
            + self.chunks.capacity() * std::mem::size_of::<Chunk<W>>()
            + self.index.memory_bytes()
            + self.free.capacity() * 4
            + std::mem::size_of::<Self>()
    }

    /// A copy of the shard's rows for a point-in-time capture; the chunks are copied whole
    /// (a memcpy per column beats gathering row by row while the shard is locked).
    pub fn copy(&self, arena: &Arena) -> ShardCopy<W> {
        ShardCopy { chunks: self.chunks.iter().map(|ch| ch.copy(arena)).collect(), vbase: self.vbase, rows: self.rows }
    }

    /// The rows whose version is at least `since` (created or updated since then), one
    /// block per chunk that has any: what a delta capture copies.
    pub fn copy_since(&self, l: &Layout, since: u64) -> Vec<RowBlock<W>> {
        let mut out = Vec::new();
        for ch in &self.chunks {
            let mut blk = RowBlock::default();
            ch.gather(l, self.vbase, since, &mut blk);
            if !blk.is_empty() {
                out.push(blk);
            }
        }
        out
    }

    /// Add `d` to every row's last-update batch: the rows keep their age when the table's
    /// update-batch count moves up by `d` (merging snapshots, see snapshot/read.rs).
    pub fn shift_update_batches(&mut self, d: u32) {
        for ch in &mut self.chunks {
            for t in ch.utick.iter_mut() {
                *t = t.wrapping_add(d);
            }
        }
    }

    /// Insert/overwrite rows `which` of a decoded snapshot block.
    pub fn load_rows(&mut self, ctx: &Ctx, blk: &RowBlock<W>, which: &[u32], hashes: &[u64], local: &mut Local) {
        let l = ctx.layout;
        let (dim, sd) = (l.dim, l.state_dim);
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
    }
}

/// The shards of a table, by storage type.
pub enum Shards {
    F32(Vec<RwLock<Shard<f32>>>),
    F16(Vec<RwLock<Shard<f16>>>),
    BF16(Vec<RwLock<Shard<bf16>>>),
}

#[macro_export]
macro_rules! with_shards {
    ($shards:expr, $s:ident => $body:expr) => {
        match $shards {
            $crate::table::Shards::F32($s) => $body,
            $crate::table::Shards::F16($s) => $body,
            $crate::table::Shards::BF16($s) => $body,
        }
    };
}

/// The batch positions routed to one internal shard, with their ids and
/// placement hashes laid out contiguously (in batch order).
pub struct Group<'a> {
    pub pos: &'a [u32],
    pub hash: &'a [u64],
    pub id: &'a [u64],
}

impl Group<'_> {
    #[inline(always)]
    pub fn len(&self) -> usize {
        self.pos.len()
    }
    #[inline(always)]
    pub fn is_empty(&self) -> bool {
        self.pos.is_empty()
    }
}

/// Batch routing plan: positions grouped by internal shard (stable counting sort).
pub struct Plan {
    pub order: Vec<u32>,
    pub ohash: Vec<u64>,
    pub oid: Vec<u64>,
    pub offsets: Vec<usize>,
}

impl Plan {
    pub fn new(ids: &[u64], nshards: usize, sequential: bool) -> Self {
        let n = ids.len();
        let mut hashes = vec![0u64; n];
        if n >= 1 << 15 && !sequential {
            hashes.par_chunks_mut(1 << 13).zip(ids.par_chunks(1 << 13)).for_each(|(h, i)| {
                for (a, b) in h.iter_mut().zip(i) {
                    *a = internal_hash(*b);
                }
            });
        } else {
            for (a, b) in hashes.iter_mut().zip(ids) {
                *a = internal_hash(*b);
            }
        }
        let mut offsets = vec![0usize; nshards + 1];
        if nshards == 1 {
            offsets[1] = n;
            return Plan { order: (0..n as u32).collect(), ohash: hashes, oid: ids.to_vec(), offsets };
        }
        for &h in &hashes {
            offsets[internal_shard(h, nshards) + 1] += 1;
        }
        for s in 0..nshards {
            offsets[s + 1] += offsets[s];
        }
        let mut fill = offsets.clone();
        let mut order = vec![0u32; n];
        let mut ohash = vec![0u64; n];
        let mut oid = vec![0u64; n];
        for (i, &h) in hashes.iter().enumerate() {
            let f = &mut fill[internal_shard(h, nshards)];
            order[*f] = i as u32;
            ohash[*f] = h;
            oid[*f] = ids[i];
            *f += 1;
        }
        Plan { order, ohash, oid, offsets }
    }
    #[inline]
    pub fn group(&self, s: usize) -> Group<'_> {
        let r = self.offsets[s]..self.offsets[s + 1];
        Group { pos: &self.order[r.clone()], hash: &self.ohash[r.clone()], id: &self.oid[r] }
    }
}

/// A table: configuration, internal shards, sketch and counters.
pub struct Table {
    pub cfg: TableConfig,
    pub layout: Layout,
    pub opt: OptParams,
    /// Declared before `arena`: shards (which may point into it) drop first.
    pub shards: Shards,
    pub sketch: Option<Sketch>,
    pub counters: Counters,
    pub arena: Arena,
}

/// Number of internal shards for a table in a store with `store_shards`.
/// Tables with a small capacity use fewer shards so that every shard holds a
/// meaningful share of the capacity (and tiny tables get exact LRU).
pub fn table_shards(cfg: &TableConfig, store_shards: usize) -> usize {
    match cfg.capacity {
        Some(c) => {
            let per = (c / 1024).max(1) as usize;
            store_shards.min(per).max(1)
        }
        None => store_shards.max(1),
    }
}

impl Table {
    pub fn new(cfg: TableConfig, store_shards: usize) -> Result<Self> {
        cfg.validate()?;
        let n = table_shards(&cfg, store_shards);
        let cap_total = cfg.capacity.unwrap_or(u64::MAX);
        let seed = mix64(cfg.seed ^ 0xD1B5_4A32_D192_ED03);
        let cap_of = |i: usize| -> usize {
            if cap_total == u64::MAX {
                usize::MAX
            } else {
                let base = cap_total / n as u64;
                let extra = (i as u64) < cap_total % n as u64;
                (base + extra as u64).min(usize::MAX as u64) as usize
            }
        };
        macro_rules! mk {
            ($v:ident) => {
                Shards::$v((0..n).map(|i| RwLock::new(Shard::new(cap_of(i), mix64(seed ^ i as u64)))).collect())
            };
        }
        let shards = match cfg.dtype {
            crate::config::DType::F32 => mk!(F32),
            crate::config::DType::F16 => mk!(F16),
            crate::config::DType::BF16 => mk!(BF16),
        };
        let sketch = match cfg.admission {
            AdmissionKind::Threshold => Some(Sketch::new(cfg.sketch_width as usize, cfg.sketch_depth as usize)),
            _ => None,
        };
        Ok(Table {
            layout: Layout::new(&cfg),
            opt: OptParams::from_config(&cfg),
            cfg,
            shards,
            sketch,
            counters: Counters::default(),
            arena: Arena::default(),
        })
    }

    pub fn num_shards(&self) -> usize {
        with_shards!(&self.shards, s => s.len())
    }

    pub fn ctx(&self, version: u64, now_secs: u32, batch: u32) -> Ctx<'_> {
        Ctx {
            cfg: &self.cfg,
            arena: &self.arena,
            layout: &self.layout,
            opt: &self.opt,
            sketch: self.sketch.as_ref(),
            version,
            now_secs,
            batch,
            batch_now: self.counters.update_batches.load(Ordering::Relaxed) as u32,
            sequential: false,
        }
    }

    /// Batched lookup into `out` (len = ids.len() * dim). Run inside a rayon pool.
    pub fn lookup<O: OutElem>(&self, ctx: &Ctx, ids: &[u64], out: &mut [O], create: bool) {
        debug_assert_eq!(out.len(), ids.len() * self.layout.dim);
        let ns = self.num_shards();
        if !ctx.ttl_enabled() && !self.layout.has_lru {
            let total = with_shards!(&self.shards, shards => self.lookup_in_order(ctx, shards, ids, out, create));
            self.counters.lookups.fetch_add(ids.len() as u64, Ordering::Relaxed);
            self.counters.add_local(&total);
            return;
        }
        let plan = Plan::new(ids, ns, ctx.sequential);
        let outp = SendPtr(out.as_mut_ptr());
        let total = with_shards!(&self.shards, shards => {
            map_shards(ctx.sequential, ns, |s| {
                let g = plan.group(s);
                let mut local = Local::default();
                if !g.is_empty() {
                    shards[s].write().lookup(ctx, &g, outp, create, &mut local);
                }
                local
            })
        });
        self.counters.lookups.fetch_add(ids.len() as u64, Ordering::Relaxed);
        self.counters.add_local(&total);
    }

    /// Scan batch positions `lo..hi` in order against locked shards (`guards`):
    /// found rows are copied to `out` (written sequentially), missing positions
    /// are appended to `missing[shard]`. Index buckets are prefetched 2*D
    /// positions ahead and row records D ahead.
    #[allow(clippy::too_many_arguments)]
    fn scan_range<W: Elem, O: OutElem, G: std::ops::Deref<Target = Shard<W>>>(
        &self,
        guards: &[G],
        ids: &[u64],
        lo: usize,
        hi: usize,
        out: SendPtr<O>,
        missing: &mut [Vec<u32>],
    ) {
        const D: usize = 12;
        const R: usize = 32; // ring > 2*D
        let l = &self.layout;
        let dim = l.dim;
        let ns = guards.len();
        let mut rh = [0u64; R];
        let mut rs = [0u32; R];
        let mut rc = [EMPTY; R];
        let stage_a = |p: usize, rh: &mut [u64; R], rs: &mut [u32; R]| {
            let h = internal_hash(ids[p]);
            let s = internal_shard(h, ns);
            rh[p % R] = h;
            rs[p % R] = s as u32;
            prefetch(guards[s].index.bucket_ptr(h));
        };
        let stage_b = |p: usize, rh: &[u64; R], rs: &[u32; R], rc: &mut [u32; R]| {
            let g = &guards[rs[p % R] as usize];
            let c = g.index.candidate(rh[p % R]);
            rc[p % R] = c;
            g.prefetch_rec(l, c);
        };
        for p in lo..hi.min(lo + 2 * D) {
            stage_a(p, &mut rh, &mut rs);
        }
        for p in lo..hi.min(lo + D) {
            stage_b(p, &rh, &rs, &mut rc);
        }
        for p in lo..hi {
            if p + 2 * D < hi {
                stage_a(p + 2 * D, &mut rh, &mut rs);
            }
            if p + D < hi {
                stage_b(p + D, &rh, &rs, &mut rc);
            }
            let (h, s) = (rh[p % R], rs[p % R] as usize);
            let g = &guards[s];
            let slot = g.verify(l, rc[p % R], ids[p], h);
            if slot == EMPTY {
                missing[s].push(p as u32);
            } else {
                // SAFETY: p < n; positions of concurrent scans are disjoint.
                let dst = unsafe { std::slice::from_raw_parts_mut(out.get().add(p * dim), dim) };
                O::write_row(g.w_row(l, slot), dst);
            }
        }
    }

    /// Lookup fast path for tables without TTL/LRU bookkeeping: walk the batch
    /// in order (sequential output writes, no routing plan). A single-threaded
    /// store holds every shard's write lock for the whole call; otherwise
    /// contiguous ranges of positions are scanned in parallel under shared read
    /// locks, then the misses are admitted/inserted per shard under its write
    /// lock (re-checking for rows inserted concurrently in between).
    fn lookup_in_order<W: Elem, O: OutElem>(
        &self,
        ctx: &Ctx,
        shards: &[RwLock<Shard<W>>],
        ids: &[u64],
        out: &mut [O],
        create: bool,
    ) -> Local {
        let n = ids.len();
        let ns = shards.len();
        let outp = SendPtr(out.as_mut_ptr());
        let handle = |s: usize, guard: &mut Shard<W>, pos: Vec<u32>, local: &mut Local| {
            let hash: Vec<u64> = pos.iter().map(|&p| internal_hash(ids[p as usize])).collect();
            let id: Vec<u64> = pos.iter().map(|&p| ids[p as usize]).collect();
            let g = Group { pos: &pos, hash: &hash, id: &id };
            let all: Vec<u32> = (0..pos.len() as u32).collect();
            let _ = s;
            guard.handle_missing(ctx, &g, all, outp, create, local);
        };
        if ctx.sequential {
            let mut guards: Vec<_> = shards.iter().map(|s| s.write()).collect();
            let mut missing: Vec<Vec<u32>> = vec![Vec::new(); ns];
            self.scan_range(&guards, ids, 0, n, outp, &mut missing);
            let mut local = Local::default();
            for (s, pos) in missing.into_iter().enumerate() {
                if !pos.is_empty() {
                    handle(s, &mut guards[s], pos, &mut local);
                }
            }
            return local;
        }
        let range = (n.div_ceil(rayon::current_num_threads().max(1) * 4)).max(4096);
        let parts: Vec<Vec<Vec<u32>>> = (0..n.div_ceil(range))
            .into_par_iter()
            .map(|r| {
                let guards: Vec<_> = shards.iter().map(|s| s.read()).collect();
                let mut missing: Vec<Vec<u32>> = vec![Vec::new(); ns];
                self.scan_range(&guards, ids, r * range, ((r + 1) * range).min(n), outp, &mut missing);
                missing
            })
            .collect();
        let parts = &parts;
        map_shards(false, ns, |s| {
            let pos: Vec<u32> = parts.iter().flat_map(|m| m[s].iter().copied()).collect();
            let mut local = Local::default();
            if !pos.is_empty() {
                handle(s, &mut shards[s].write(), pos, &mut local);
            }
            local
        })
    }

    /// Batched update; returns the number of rows updated.
    pub fn update(&self, ctx: &Ctx, ids: &[u64], grads: &[f32]) -> u64 {
        let ns = self.num_shards();
        let plan = Plan::new(ids, ns, ctx.sequential);
        let total = with_shards!(&self.shards, shards => {
            map_shards(ctx.sequential, ns, |s| {
                let g = plan.group(s);
                let mut local = Local::default();
                if !g.is_empty() {
                    shards[s].write().update(ctx, &g, grads, &mut local);
                }
                local
            })
        });
        self.counters.add_local(&total);
        total.updated
    }

    pub fn get_state(&self, id: u64) -> Option<RowState> {
        let h = internal_hash(id);
        let s = internal_shard(h, self.num_shards());
        with_shards!(&self.shards, shards => shards[s].read().get_state(&self.layout, id))
    }

    pub fn set_row(&self, ctx: &Ctx, id: u64, values: &[f32]) -> Result<()> {
        let h = internal_hash(id);
        let s = internal_shard(h, self.num_shards());
        let mut local = Local::default();
        let r = with_shards!(&self.shards, shards => shards[s].write().set_row(ctx, id, values, &mut local));
        self.counters.add_local(&local);
        r
    }

    pub fn export_delta(&self, since: u64) -> (Vec<u64>, Vec<f32>) {
        let l = &self.layout;
        let parts: Vec<(Vec<u64>, Vec<f32>)> = with_shards!(&self.shards, shards => {
            shards.par_iter().map(|sh| {
                let (mut ids, mut rows) = (Vec::new(), Vec::new());
                sh.read().export_delta(l, since, &mut ids, &mut rows);
                (ids, rows)
            }).collect()
        });
        let n: usize = parts.iter().map(|p| p.0.len()).sum();
        let mut ids = Vec::with_capacity(n);
        let mut rows = Vec::with_capacity(n * l.dim);
        for (i, r) in parts {
            ids.extend_from_slice(&i);
            rows.extend_from_slice(&r);
        }
        (ids, rows)
    }

    pub fn expire(&self, ctx: &Ctx) -> u64 {
        if !ctx.ttl_enabled() {
            return 0;
        }
        let total = with_shards!(&self.shards, shards => {
            shards.par_iter().map(|sh| {
                let mut local = Local::default();
                sh.write().expire(ctx, &mut local);
                local
            }).reduce(Local::default, |a, b| a + b)
        });
        self.counters.add_local(&total);
        total.expired
    }

    /// Add `d` to every row's last-update batch (see `Shard::shift_update_batches`).
    ///
    /// **Locking behaviour:** each internal shard's write lock in turn.
    pub fn shift_update_batches(&self, d: u32) {
        if self.layout.has_utick && d != 0 {
            with_shards!(&self.shards, shards => shards.iter().for_each(|s| s.write().shift_update_batches(d)))
        }
    }

    pub fn rows(&self) -> usize {
        with_shards!(&self.shards, shards => shards.iter().map(|s| s.read().rows).sum())
    }

    pub fn memory_bytes(&self) -> usize {
        let shards =
            with_shards!(&self.shards, shards => shards.iter().map(|s| s.read().memory_bytes()).sum::<usize>());
        shards + self.sketch.as_ref().map_or(0, |s| s.memory_bytes()) + std::mem::size_of::<Self>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(cfg: TableConfig) -> Table {
        Table::new(cfg, 8).unwrap()
    }

    #[test]
    #[allow(clippy::needless_range_loop)]
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
        for i in 0..4 {
            assert!((st.weights[i] - (out[i] - 0.5 * 2.0)).abs() < 1e-6);
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
}
