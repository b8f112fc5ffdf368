//! The serving store of a model replica: a published model's embedding tables as values
//! only (no optimizer state), read by prediction requests while new versions are applied.
//!
//! Training PS shard `i` of `S` publishes a values file per version (`crate::values`;
//! `Capture::write_values`) holding the rows it owns (`shard_of(id, S) == i`). The replica
//! keeps each table as `S` **parts**, part `i` holding shard `i`'s rows, so a full file
//! replaces exactly one part of each table it lists and a delta upserts into it. A part is
//! a sorted `Base` (about 6 bytes of index per row beside a dense values slab) plus an
//! `Overlay` for IDs new since the base was built. At dim 64 in fp16 that is about
//! 2.1 bytes per value, index included (values alone are 2.0).
//!
//! **A slice of the rows** (a serving shard, `ServingSlice`): serving shard `k` of `N` keeps
//! only the rows with `shard_of(id, N) == k`, whatever `S` is, by the ID's hash as the PS
//! shards place them, so `N` is free of the training layout and the slices are even. It is
//! given the files of the training shards that can hold such IDs (`t % gcd(S, N) ==
//! k % gcd(S, N)`) and drops the other rows as it reads them; where `N` divides `S` a file
//! is wholly kept and nothing is filtered.
//!
//! **Atomic versions.** `apply` takes a list of files and a version, and all of them
//! become visible together: a lookup reads every table of its call under one read lock,
//! at one version, before or after an apply, never in between. Apply reads and checks
//! every file (CRC, dtype, tables, dims, IDs sorted and owned by the file's shard: the
//! consistency check of a version) and builds every new base and overlay piece *before*
//! it takes the write lock; a bad file fails the whole call and the previous version goes
//! on serving. Under the write lock apply only swaps structures in and copies the values
//! of the updated rows into place. See `apply.rs`.
//!
//! **Lookups** run on the calling thread: a request's few thousand IDs take tens of
//! microseconds, mostly cache misses, which a pool would not shorten (`lookup.rs`). An ID
//! not present reads as zeros, the vector an ID never admitted in training reads as, and
//! counts as a miss.
//!
//! **Locking behaviour:** one `parking_lot::RwLock` over all tables. `lookup`, `stats` and
//! `memory_bytes` take its read lock. `apply` takes its upgradable read lock for the whole
//! call once the files are read (so applies run one at a time, while lookups go on), and
//! upgrades it to the write lock only for the swap and the copy of updated rows (about
//! 1-2 ms per 100k updated rows; see native/README.md); the old structures are freed
//! after it is released. Nothing waits for I/O under any lock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use half::f16;
use parking_lot::RwLock;

use crate::config::{value_err, DType, Result, StoreError};
use crate::elem::Elem;
use crate::mem::Pod;

mod apply;
mod base;
mod lookup;
mod overlay;

pub use apply::ApplyReport;
use base::Base;
use overlay::Overlay;

/// Which rows a store keeps: those with `shard_of(id, count) == index` (`WHOLE`: all).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServingSlice {
    pub index: u32,
    pub count: u32,
}

impl ServingSlice {
    pub const WHOLE: ServingSlice = ServingSlice { index: 0, count: 1 };

    #[inline(always)]
    pub fn keeps(&self, id: u64) -> bool {
        self.count == 1 || crate::hash::shard_of(id, self.count) == self.index
    }
}

/// One table's rows owned by one training shard.
pub struct Part<W: Copy> {
    base: Base<W>,
    overlay: Overlay<W>,
}

impl<W: Elem + Pod> Part<W> {
    fn new(dim: usize) -> Self {
        Part { base: Base::empty(dim), overlay: Overlay::new(dim) }
    }

    /// The values of `id`, if present.
    #[inline]
    pub fn get(&self, id: u64) -> Option<&[W]> {
        match self.base.find(id) {
            Some(p) => Some(self.base.row(p)),
            None => self.overlay.find(id).map(|s| self.overlay.row(s)),
        }
    }

    pub fn rows(&self) -> usize {
        self.base.len() + self.overlay.len()
    }

    pub fn memory_bytes(&self) -> usize {
        self.base.memory_bytes() + self.overlay.memory_bytes()
    }
}

/// What the lock guards: the version and every part, `parts[table * shards + shard]`.
struct State<W: Copy> {
    version: u64,
    parts: Vec<Part<W>>,
}

/// Lifetime counters of a table (relaxed atomics: statistics only).
#[derive(Default)]
struct TableCounters {
    lookups: AtomicU64,
    misses: AtomicU64,
}

/// One table's statistics (`ServingTables::stats`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServingStats {
    pub name: String,
    pub rows: u64,
    pub overlay_rows: u64,
    pub memory_bytes: u64,
    pub lookups: u64,
    pub misses: u64,
}

/// The serving store of one dtype (see the module doc).
pub struct Serving<W: Copy> {
    names: Vec<String>,
    dims: Vec<usize>,
    by_name: HashMap<String, usize>,
    shards: u32,
    slice: ServingSlice,
    threads: usize,
    /// None for `threads == 1`: everything runs on the calling thread.
    pool: Option<rayon::ThreadPool>,
    state: RwLock<State<W>>,
    counters: Vec<TableCounters>,
}

impl<W: Elem + Pod> Serving<W> {
    fn new(tables: &[(String, usize)], shards: u32, slice: ServingSlice, threads: usize) -> Result<Self> {
        let pool = if threads > 1 {
            let p = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("trillium-serving-{i}"))
                .build()
                .map_err(|e| StoreError::Value(format!("cannot start thread pool: {e}")))?;
            Some(p)
        } else {
            None
        };
        let parts = tables.iter().flat_map(|(_, dim)| (0..shards).map(|_| Part::new(*dim))).collect();
        Ok(Serving {
            names: tables.iter().map(|t| t.0.clone()).collect(),
            dims: tables.iter().map(|t| t.1).collect(),
            by_name: tables.iter().enumerate().map(|(k, t)| (t.0.clone(), k)).collect(),
            shards,
            slice,
            threads,
            pool,
            state: RwLock::new(State { version: 0, parts }),
            counters: tables.iter().map(|_| TableCounters::default()).collect(),
        })
    }

    /// Look up each request `(table index, ids)` into its output (`ids.len() * dim` f32),
    /// all under one read lock; writes each request's misses and returns the version read.
    ///
    /// **Locking behaviour:** the store's read lock for the whole call, on the calling thread.
    pub fn lookup(&self, reqs: &[(usize, &[u64])], outs: &mut [&mut [f32]], misses: &mut [u64]) -> u64 {
        let st = self.state.read();
        let n = self.shards as usize;
        for ((&(t, ids), out), miss) in reqs.iter().zip(outs.iter_mut()).zip(misses.iter_mut()) {
            let dim = self.dims[t];
            assert_eq!(out.len(), ids.len() * dim, "output of {} rows of dim {dim}", ids.len());
            let m = lookup::lookup_ids(&st.parts[t * n..(t + 1) * n], self.shards, ids, out, dim);
            *miss = m;
            let c = &self.counters[t];
            c.lookups.fetch_add(ids.len() as u64, Ordering::Relaxed);
            c.misses.fetch_add(m, Ordering::Relaxed);
        }
        st.version
    }

    /// **Locking behaviour:** the store's read lock.
    fn stats(&self) -> Vec<ServingStats> {
        let st = self.state.read();
        let n = self.shards as usize;
        (0..self.names.len())
            .map(|t| {
                let parts = &st.parts[t * n..(t + 1) * n];
                ServingStats {
                    name: self.names[t].clone(),
                    rows: parts.iter().map(|p| p.rows() as u64).sum(),
                    overlay_rows: parts.iter().map(|p| p.overlay.len() as u64).sum(),
                    memory_bytes: parts.iter().map(|p| p.memory_bytes() as u64).sum(),
                    lookups: self.counters[t].lookups.load(Ordering::Relaxed),
                    misses: self.counters[t].misses.load(Ordering::Relaxed),
                }
            })
            .collect()
    }
}

/// The serving store, fp16 or fp32 (see the module doc).
pub enum ServingTables {
    F16(Serving<f16>),
    F32(Serving<f32>),
}

macro_rules! with_serving {
    ($s:expr, $v:ident => $body:expr) => {
        match $s {
            ServingTables::F16($v) => $body,
            ServingTables::F32($v) => $body,
        }
    };
}

impl ServingTables {
    /// Tables `(name, dim)` of a model trained on `shards` PS shards, holding `dtype`
    /// values (fp16 or fp32), keeping the rows of `slice`, applying versions on `threads`
    /// threads.
    pub fn new(
        tables: &[(String, usize)],
        shards: u32,
        slice: ServingSlice,
        dtype: DType,
        threads: usize,
    ) -> Result<Self> {
        if shards == 0 {
            return value_err("shards must be >= 1");
        }
        if slice.count == 0 || slice.index >= slice.count {
            return value_err(format!("slice {}/{}: the index must be below the count", slice.index, slice.count));
        }
        if threads == 0 || threads > 1024 {
            return value_err(format!("threads must be in [1, 1024], got {threads}"));
        }
        for (k, (name, dim)) in tables.iter().enumerate() {
            if *dim == 0 || *dim > crate::values::MAX_DIM {
                return value_err(format!("table {name:?}: dim must be in [1, {}], got {dim}", crate::values::MAX_DIM));
            }
            if tables[..k].iter().any(|t| t.0 == *name) {
                return value_err(format!("table {name:?} given twice"));
            }
        }
        match dtype {
            DType::F16 => Ok(ServingTables::F16(Serving::new(tables, shards, slice, threads)?)),
            DType::F32 => Ok(ServingTables::F32(Serving::new(tables, shards, slice, threads)?)),
            DType::BF16 => value_err("a serving store holds fp16 or fp32 values, not bf16"),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            ServingTables::F16(_) => DType::F16,
            ServingTables::F32(_) => DType::F32,
        }
    }

    /// Index of table `name`.
    pub fn table_index(&self, name: &str) -> Option<usize> {
        with_serving!(self, s => s.by_name.get(name).copied())
    }

    /// Names and dims, in the order given at construction.
    pub fn tables(&self) -> Vec<(String, usize)> {
        with_serving!(self, s => s.names.iter().cloned().zip(s.dims.iter().copied()).collect())
    }

    pub fn dim(&self, table: usize) -> usize {
        with_serving!(self, s => s.dims[table])
    }

    pub fn shards(&self) -> u32 {
        with_serving!(self, s => s.shards)
    }

    pub fn slice(&self) -> ServingSlice {
        with_serving!(self, s => s.slice)
    }

    pub fn threads(&self) -> usize {
        with_serving!(self, s => s.threads)
    }

    /// The last applied version (0 before any).
    ///
    /// **Locking behaviour:** the store's read lock.
    pub fn version(&self) -> u64 {
        with_serving!(self, s => s.state.read().version)
    }

    /// See `Serving::lookup`. **Locking behaviour:** the store's read lock for the whole call.
    pub fn lookup(&self, reqs: &[(usize, &[u64])], outs: &mut [&mut [f32]], misses: &mut [u64]) -> u64 {
        with_serving!(self, s => s.lookup(reqs, outs, misses))
    }

    /// Apply values files `(training shard, path)` as `version` (see `apply.rs`).
    pub fn apply(&self, files: &[(u32, std::path::PathBuf)], version: u64) -> Result<ApplyReport> {
        with_serving!(self, s => s.apply(files, version))
    }

    /// Per table: rows, overlay rows, memory, lifetime lookups and misses.
    /// **Locking behaviour:** the store's read lock.
    pub fn stats(&self) -> Vec<ServingStats> {
        with_serving!(self, s => s.stats())
    }

    /// Bytes allocated by every table (capacities of the actual allocations).
    /// **Locking behaviour:** the store's read lock.
    pub fn memory_bytes(&self) -> u64 {
        self.stats().iter().map(|t| t.memory_bytes).sum::<u64>() + std::mem::size_of::<Self>() as u64
    }
}

#[cfg(test)]
mod tests;
