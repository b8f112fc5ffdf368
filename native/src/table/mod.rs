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
//!
//! Files: `counters` (event counters), `sketch` (the admission sketch), `chunk` (the
//! per-table `Layout`, slab chunks, row views and the columns snapshots read and write),
//! `shard` (one internal shard: slots, probing, allocation), and the shard's concerns in
//! files of their own: `lookup` (lookups, admission of the missing ids), `update`
//! (optimizer updates, `set_row`), `evict` (eviction and TTL), `forget` (removing given IDs),
//! `copy` (copies and loads for snapshots). This file: the per-call `Ctx`, the routing `Plan` and the `Table` front,
//! which takes the shard locks. Rows leave a shard only through `Shard::remove_slot` and
//! a lookup's missing ids are resolved only in `Shard::handle_missing`. `spill` is the disk
//! tier of a table with a RAM budget: the shard's least recently used rows beyond it live in
//! a spill file of the shard's, read back by the calls that need them (see spill.rs); `tier`
//! holds that file and the cold rows' bookkeeping, `spill_copy` a capture's pinned view of it.

use std::sync::atomic::Ordering;

use half::{bf16, f16};
use parking_lot::RwLock;
use rayon::prelude::*;

use crate::config::{AdmissionKind, Result, TableConfig};
use crate::elem::{Elem, OutElem};
use crate::hash::{internal_hash, internal_shard, mix64};
use crate::index::EMPTY;
use crate::mem::{prefetch, Arena, SendPtr};
use crate::optim::OptParams;

mod chunk;
mod copy;
mod counters;
mod evict;
mod forget;
mod lookup;
mod shard;
mod sketch;
mod spill;
mod spill_copy;
mod tier;
mod update;

#[cfg(test)]
mod spill_tests;
#[cfg(test)]
mod tests;

pub use chunk::{Chunk, Layout, RowColumns, RowMut, RowState};
pub use copy::{ChangedCopy, ShardCopy};
pub use counters::{Counters, Local, COUNTER_NAMES};
pub use evict::{EVICTION_SAMPLES, EXACT_LRU_MAX_ROWS};
pub use shard::{init_values, Shard};
pub use sketch::Sketch;
pub use spill_copy::ColdCopy;
pub use tier::{Cold, ColdColumns, DiskStats, Tier};

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

impl Ctx<'_> {
    #[inline(always)]
    fn ttl_enabled(&self) -> bool {
        self.layout.has_utime || self.layout.has_utick
    }
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
    /// Rows removed by `forget`: not one of the persisted counters (a snapshot never carries
    /// it); a `CaptureMark` compares it so that a capture after a removal is full.
    pub forgotten: std::sync::atomic::AtomicU64,
    /// Set when a disk tier of the table failed (see `tier_error`).
    pub tier_failed: std::sync::Arc<std::sync::atomic::AtomicBool>,
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
        let mut shards = match cfg.dtype {
            crate::config::DType::F32 => mk!(F32),
            crate::config::DType::F16 => mk!(F16),
            crate::config::DType::BF16 => mk!(BF16),
        };
        let layout = Layout::new(&cfg);
        let tier_failed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        if let (Some(budget), Some(dir)) = (cfg.memory_budget_bytes, &cfg.disk) {
            let rows = budget / layout.ram_row_bytes(cfg.dtype.size()) as u64;
            let rec = tier::record_bytes(&layout, cfg.dtype.size());
            // What a cold row keeps in RAM beyond its id, record slot and version: what capacity
            // eviction (its LRU tick) and TTL (its stamps) decide on without reading it.
            let keep = ColdColumns { lru: cfg.capacity.is_some(), utime: layout.has_utime, utick: layout.has_utick };
            with_shards!(&mut shards, s => {
                for (i, sh) in s.iter_mut().enumerate() {
                    let share = rows / n as u64 + ((i as u64) < rows % n as u64) as u64;
                    let budget = share.min(usize::MAX as u64) as usize;
                    let tier = Tier::create(std::path::Path::new(dir), &cfg.name, i, rec, budget, keep, tier_failed.clone())
                        .map_err(|e| crate::config::StoreError::Io(std::io::Error::new(
                            e.kind(),
                            format!("table {:?}: cannot create its spill file in {dir}: {e}", cfg.name),
                        )))?;
                    sh.get_mut().tier = Some(Box::new(tier));
                }
            });
        }
        let sketch = match cfg.admission {
            AdmissionKind::Threshold => Some(Sketch::new(cfg.sketch_width as usize, cfg.sketch_depth as usize)),
            _ => None,
        };
        Ok(Table {
            layout,
            opt: OptParams::from_config(&cfg),
            cfg,
            shards,
            sketch,
            counters: Counters::default(),
            forgotten: Default::default(),
            tier_failed,
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
    ///
    /// **Locking behaviour:** tables with a capacity or a TTL: one task per internal shard
    /// with ids in the batch, each under that shard's *write* lock. Other tables: see
    /// `lookup_in_order` (every shard's lock at once, read or, single-threaded, write).
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
    ///
    /// **Locking behaviour:** `ctx.sequential`: the write locks of all the table's shards,
    /// taken in shard order and held for the whole call. Otherwise each range task holds the
    /// *read* locks of all shards (taken in shard order) while it scans; then one task per
    /// shard with missing ids takes that shard's write lock (even when `!create`).
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
    ///
    /// **Locking behaviour:** one task per internal shard with ids in the batch, each under
    /// that shard's *write* lock (never two shard locks on one thread).
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

    /// An owned copy of the row of `id`, if it has one.
    ///
    /// **Locking behaviour:** the *read* lock of `id`'s internal shard.
    pub fn get_state(&self, id: u64) -> Option<RowState> {
        let h = internal_hash(id);
        let s = internal_shard(h, self.num_shards());
        with_shards!(&self.shards, shards => shards[s].read().get_state(&self.layout, id))
    }

    /// Overwrite (or create, bypassing admission) the weights of `id`.
    ///
    /// **Locking behaviour:** the *write* lock of `id`'s internal shard.
    pub fn set_row(&self, ctx: &Ctx, id: u64, values: &[f32]) -> Result<()> {
        let h = internal_hash(id);
        let s = internal_shard(h, self.num_shards());
        let mut local = Local::default();
        let r = with_shards!(&self.shards, shards => shards[s].write().set_row(ctx, id, values, &mut local));
        self.counters.add_local(&local);
        r
    }

    /// The ids and rows (as f32) of the rows whose version is above `since`.
    ///
    /// **Locking behaviour:** every internal shard's *read* lock, one pool task per shard.
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

    /// Remove every row past its TTL; returns how many. No-op for tables without a TTL.
    ///
    /// **Locking behaviour:** every internal shard's *write* lock, one pool task per shard
    /// (none when the table has no TTL).
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
    /// **Locking behaviour:** each internal shard's *write* lock in turn.
    pub fn shift_update_batches(&self, d: u32) {
        if self.layout.has_utick && d != 0 {
            with_shards!(&self.shards, shards => shards.iter().for_each(|s| s.write().shift_update_batches(d)))
        }
    }

    /// Rows in the table.
    ///
    /// **Locking behaviour:** each internal shard's *read* lock in turn.
    pub fn rows(&self) -> usize {
        with_shards!(&self.shards, shards => shards.iter().map(|s| s.read().len()).sum())
    }

    /// Bytes allocated for the table (chunks, indexes, free lists, sketch).
    ///
    /// **Locking behaviour:** each internal shard's *read* lock in turn.
    pub fn memory_bytes(&self) -> usize {
        let shards =
            with_shards!(&self.shards, shards => shards.iter().map(|s| s.read().memory_bytes()).sum::<usize>());
        shards + self.sketch.as_ref().map_or(0, |s| s.memory_bytes()) + std::mem::size_of::<Self>()
    }
}
