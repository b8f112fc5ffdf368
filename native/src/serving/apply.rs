//! Applying a version (`Serving::apply`), in four steps:
//!
//! 1. **Read and check** every file, in parallel on the pool, with no lock held: the
//!    format (magic, version, CRC, IDs strictly ascending; `crate::values`), its dtype
//!    (the store's), every table served with the same dim, every ID owned by the file's
//!    training shard (`shard_of(id, shards) == shard`: the version's consistency check).
//!    Any failure fails the call naming the file; nothing has changed. A sliced store
//!    then drops the rows outside its slice (`ServingSlice`).
//! 2. **Fold** the files per part (table, shard) in list order: a full file replaces what
//!    came before it, a delta is merged on top (later rows win). A part ends up with a
//!    full run (its new rows) or a delta run (rows to upsert), each sorted by ID.
//! 3. **Plan and build** each part's change under the store's *upgradable* read lock
//!    (lookups go on; another apply waits): a full run becomes a new base. A delta's rows
//!    are located (base position, overlay slot, or new); if the overlay would then hold
//!    more than `1/MERGE_FRACTION` of the base's rows, base, overlay and delta are merged
//!    into a new base; otherwise the new rows are laid out in new overlay chunks (with a
//!    copy of the partly filled last one) and the overlay index is rebuilt.
//! 4. **Commit** under the write lock: swap the new bases, chunks and indexes in, copy
//!    the values of updated rows into place, set the version. The replaced structures
//!    are freed after the lock is released.
//!
//! Memory: a full version holds the old and the new copy of each part it replaces until
//! the swap; a merge likewise the part's old and new base.

use std::path::{Path, PathBuf};
use std::time::Instant;

use parking_lot::RwLockUpgradableReadGuard;
use rayon::prelude::*;

use super::base::Base;
use super::overlay::{build_index, Overlay, OverlayChunk, CHUNK_ROWS};
use super::{Part, Serving, State};
use crate::config::{Result, StoreError};
use crate::elem::Elem;
use crate::hash::shard_of;
use crate::mem::{Pod, RawBuf};
use crate::values::{read_values, ValuesError};

/// An overlay is merged into a new base once it would hold more than 1/64 of the base's
/// rows (and more than `MERGE_MIN_ROWS`). Its IDs and index cost 13 to 19 bytes per row,
/// so at most ~0.3 bytes per base row: with a base of >= 500k rows at dim 64 in fp16 the
/// store stays within 2.1 bytes per value between merges (1/32 measured 2.1005 at 1M rows
/// over 2 shards after a delta of 20k new IDs). A merge copies the part, outside the
/// write lock, at most once per base/64 new IDs.
const MERGE_FRACTION: usize = 64;
const MERGE_MIN_ROWS: usize = CHUNK_ROWS;

/// What an apply did, and how long its steps took.
#[derive(Clone, Debug, Default)]
pub struct ApplyReport {
    pub version: u64,
    pub files: usize,
    pub bytes: u64,
    /// Rows read from the files.
    pub rows: u64,
    /// Parts replaced by a full file.
    pub parts_replaced: usize,
    /// Parts whose overlay and delta were merged into a new base.
    pub parts_merged: usize,
    /// Delta rows that overwrote a present row / added a new one.
    pub rows_updated: u64,
    pub rows_inserted: u64,
    /// Seconds: reading and checking the files; planning and building; waiting for the
    /// write lock (readers draining); holding it; the whole call.
    pub read_s: f64,
    pub build_s: f64,
    pub lock_wait_s: f64,
    pub lock_hold_s: f64,
    pub total_s: f64,
}

/// Sorted rows of one table from one or more files.
struct Run<W: Copy> {
    ids: Vec<u64>,
    values: RawBuf<W>,
    dim: usize,
}

impl<W: Copy> Run<W> {
    #[inline(always)]
    fn row(&self, j: usize) -> &[W] {
        &self.values[j * self.dim..(j + 1) * self.dim]
    }
}

/// A part's files folded: its new rows, or rows to upsert.
enum Acc<W: Copy> {
    Full(Run<W>),
    Delta(Run<W>),
}

/// A checked file: its shard, kind, size, rows read and `(table index, rows kept)`.
struct Checked<W: Copy> {
    shard: u32,
    delta: bool,
    bytes: u64,
    rows: u64,
    runs: Vec<(usize, Run<W>)>,
}

/// One part's change, built outside the write lock.
enum Change<W: Copy> {
    /// A new base from a full run; the overlay emptied.
    Replace(Base<W>),
    /// Base, overlay and delta merged into a new base; the overlay emptied.
    Merge(Base<W>),
    Upsert(Upsert<W>),
}

/// A delta applied in place: values copied into present rows, new rows appended to the
/// overlay (its chunks from `from` on replaced by `chunks`, with a new `index`).
struct Upsert<W: Copy> {
    run: Run<W>,
    /// (base position, run row) and (overlay slot, run row).
    base_writes: Vec<(u32, u32)>,
    ovl_writes: Vec<(u32, u32)>,
    from: usize,
    chunks: Vec<OverlayChunk<W>>,
    added: usize,
    index: Option<Box<[u32]>>,
}

fn file_err(path: &Path, e: ValuesError) -> StoreError {
    match e {
        ValuesError::Io(e) => {
            StoreError::Io(std::io::Error::new(e.kind(), format!("values file {}: {e}", path.display())))
        }
        ValuesError::Bad(m) => StoreError::Value(format!("values file {}: {m}", path.display())),
    }
}

/// Merge two sorted runs; rows of `b` win.
fn merge_runs<W: Elem + Pod>(a: Run<W>, b: Run<W>) -> Run<W> {
    let dim = a.dim;
    let (mut i, mut j) = (0, 0);
    let mut ids = Vec::with_capacity(a.ids.len() + b.ids.len());
    let mut src: Vec<(bool, usize)> = Vec::with_capacity(a.ids.len() + b.ids.len());
    while i < a.ids.len() || j < b.ids.len() {
        let take_b = j < b.ids.len() && (i == a.ids.len() || b.ids[j] <= a.ids[i]);
        if take_b {
            if i < a.ids.len() && a.ids[i] == b.ids[j] {
                i += 1;
            }
            ids.push(b.ids[j]);
            src.push((true, j));
            j += 1;
        } else {
            ids.push(a.ids[i]);
            src.push((false, i));
            i += 1;
        }
    }
    let mut values = RawBuf::<W>::zeroed(ids.len() * dim, true);
    for (dst, &(from_b, k)) in values.chunks_exact_mut(dim).zip(&src) {
        dst.copy_from_slice(if from_b { b.row(k) } else { a.row(k) });
    }
    Run { ids, values, dim }
}

impl<W: Elem + Pod> Serving<W> {
    /// `f` of every item: in parallel on the pool, or in order on the calling thread
    /// without one.
    fn map<T: Send, R: Send>(&self, items: Vec<T>, f: impl Fn(T) -> R + Sync + Send) -> Vec<R> {
        match &self.pool {
            Some(p) => p.install(|| items.into_par_iter().map(f).collect()),
            None => items.into_iter().map(f).collect(),
        }
    }

    /// Step 1: read `path` (of training shard `shard`) and check it against the store.
    fn check_file(&self, shard: u32, path: &Path) -> Result<Checked<W>> {
        let f = read_values::<W>(path, true).map_err(|e| file_err(path, e))?;
        let bad = |m: String| StoreError::Value(format!("values file {}: {m}", path.display()));
        let mut runs = Vec::with_capacity(f.tables.len());
        let mut rows = 0;
        for t in f.tables {
            let Some(&k) = self.by_name.get(&t.name) else {
                return Err(bad(format!("table {:?} is not served (tables: {:?})", t.name, self.names)));
            };
            if t.dim != self.dims[k] {
                return Err(bad(format!(
                    "table {:?} has dim {}, the served table dim {}",
                    t.name, t.dim, self.dims[k]
                )));
            }
            if let Some(p) = t.ids.iter().position(|&id| shard_of(id, self.shards) != shard) {
                let id = t.ids[p];
                return Err(bad(format!(
                    "table {:?}: ID {id} (row {p}) belongs to training shard {} of {}, not to shard {shard}",
                    t.name,
                    shard_of(id, self.shards),
                    self.shards
                )));
            }
            rows += t.ids.len() as u64;
            runs.push((k, self.sliced(Run { ids: t.ids, values: t.values, dim: t.dim })));
        }
        Ok(Checked { shard, delta: f.delta, bytes: f.bytes, rows, runs })
    }

    /// The rows of `run` in this store's slice (`run` itself when it keeps them all).
    fn sliced(&self, run: Run<W>) -> Run<W> {
        if run.ids.iter().all(|&id| self.slice.keeps(id)) {
            return run;
        }
        let kept: Vec<usize> = (0..run.ids.len()).filter(|&j| self.slice.keeps(run.ids[j])).collect();
        let dim = run.dim;
        let mut values = RawBuf::<W>::zeroed(kept.len() * dim, true);
        for (dst, &j) in values.chunks_exact_mut(dim).zip(&kept) {
            dst.copy_from_slice(run.row(j));
        }
        Run { ids: kept.iter().map(|&j| run.ids[j]).collect(), values, dim }
    }

    /// Apply values files `(training shard, path)` as `version` (> the current one), all
    /// at once (see the module doc for the steps and `super` for the guarantees).
    ///
    /// **Locking behaviour:** none while reading files; then the store's upgradable read
    /// lock (lookups go on, other applies wait) while building, upgraded to the write
    /// lock for the swap and the copy of updated rows.
    pub fn apply(&self, files: &[(u32, PathBuf)], version: u64) -> Result<ApplyReport> {
        let t0 = Instant::now();
        let check_version = |current: u64| {
            if version <= current {
                return Err(StoreError::Value(format!(
                    "version {version} is not greater than the current version {current}"
                )));
            }
            Ok(())
        };
        check_version(self.state.read().version)?;
        for (shard, path) in files {
            if *shard >= self.shards {
                return Err(StoreError::Value(format!(
                    "values file {}: training shard {shard} out of range for {} shards",
                    path.display(),
                    self.shards
                )));
            }
        }
        let mut rep = ApplyReport { version, files: files.len(), ..Default::default() };
        // Step 1 (the first failure, in list order, is reported).
        let checked = self.map(files.iter().collect(), |(s, p)| self.check_file(*s, p));
        let checked = checked.into_iter().collect::<Result<Vec<_>>>()?;
        rep.read_s = t0.elapsed().as_secs_f64();
        // Step 2.
        let n = self.shards as usize;
        let mut accs: Vec<Option<Acc<W>>> = (0..self.names.len() * n).map(|_| None).collect();
        for c in checked {
            rep.bytes += c.bytes;
            rep.rows += c.rows;
            for (t, run) in c.runs {
                let slot = &mut accs[t * n + c.shard as usize];
                *slot = Some(match (slot.take(), c.delta) {
                    (_, false) => Acc::Full(run),
                    (None, true) => Acc::Delta(run),
                    (Some(Acc::Full(r)), true) => Acc::Full(merge_runs(r, run)),
                    (Some(Acc::Delta(r)), true) => Acc::Delta(merge_runs(r, run)),
                });
            }
        }
        let accs: Vec<(usize, Acc<W>)> = accs.into_iter().enumerate().filter_map(|(k, a)| a.map(|a| (k, a))).collect();
        // Step 3.
        let t1 = Instant::now();
        let guard = self.state.upgradable_read();
        check_version(guard.version)?;
        let st: &State<W> = &guard;
        let planned = self.map(accs, |(k, a)| (k, plan(&st.parts[k], a)));
        let mut changes = Vec::with_capacity(planned.len());
        for (k, (c, updated, inserted)) in planned {
            rep.rows_updated += updated;
            rep.rows_inserted += inserted;
            match &c {
                Change::Replace(_) => rep.parts_replaced += 1,
                Change::Merge(_) => rep.parts_merged += 1,
                Change::Upsert(_) => {}
            }
            changes.push((k, c));
        }
        rep.build_s = t1.elapsed().as_secs_f64();
        // Step 4.
        let t2 = Instant::now();
        let mut w = RwLockUpgradableReadGuard::upgrade(guard);
        let t3 = Instant::now();
        let mut work: Vec<(&mut Part<W>, Change<W>)> = Vec::with_capacity(changes.len());
        let mut parts = w.parts.iter_mut().enumerate();
        for (k, c) in changes {
            let part = parts.find(|(i, _)| *i == k).map(|(_, p)| p).expect("parts in order");
            work.push((part, c));
        }
        let garbage = self.map(work, |(p, c)| commit(p, c));
        w.version = version;
        drop(w);
        rep.lock_wait_s = (t3 - t2).as_secs_f64();
        rep.lock_hold_s = t3.elapsed().as_secs_f64();
        drop(garbage);
        rep.total_s = t0.elapsed().as_secs_f64();
        Ok(rep)
    }
}

/// Step 3 for one part (its structures are read while lookups go on); also returns how
/// many of a delta's rows update present rows and how many are new.
fn plan<W: Elem + Pod>(part: &Part<W>, acc: Acc<W>) -> (Change<W>, u64, u64) {
    let run = match acc {
        Acc::Full(run) => return (Change::Replace(Base::build(&run.ids, run.values, run.dim)), 0, 0),
        Acc::Delta(run) => run,
    };
    let (mut base_writes, mut ovl_writes, mut new_rows) = (Vec::new(), Vec::new(), Vec::new());
    for (j, &id) in run.ids.iter().enumerate() {
        if let Some(p) = part.base.find(id) {
            base_writes.push((p as u32, j as u32));
        } else if let Some(s) = part.overlay.find(id) {
            ovl_writes.push((s as u32, j as u32));
        } else {
            new_rows.push(j as u32);
        }
    }
    let (updated, inserted) = ((base_writes.len() + ovl_writes.len()) as u64, new_rows.len() as u64);
    let ov = &part.overlay;
    if !new_rows.is_empty() && ov.len() + new_rows.len() > MERGE_MIN_ROWS.max(part.base.len() / MERGE_FRACTION) {
        return (Change::Merge(merge_all(part, &run, new_rows.len())), updated, inserted);
    }
    let (dim, mut chunks, mut index) = (run.dim, Vec::new(), None);
    let from = match ov.chunks.last() {
        Some(c) if c.ids.len() < CHUNK_ROWS => ov.chunks.len() - 1,
        _ => ov.chunks.len(),
    };
    if !new_rows.is_empty() {
        // The partly filled last chunk's rows, then the new ones, in chunks of exactly
        // their rows (every chunk but the last full).
        let tail = ov.chunks.get(from).map(|c| (&c.ids[..], &c.values[..])).unwrap_or((&[], &[]));
        let rows = tail.0.iter().copied().zip(tail.1.chunks_exact(dim));
        let rows = rows.chain(new_rows.iter().map(|&j| (run.ids[j as usize], run.row(j as usize))));
        let mut left = tail.0.len() + new_rows.len();
        let mut cur = OverlayChunk::with_rows(left.min(CHUNK_ROWS), dim);
        for (id, row) in rows {
            if cur.ids.len() == CHUNK_ROWS {
                chunks.push(std::mem::replace(&mut cur, OverlayChunk::with_rows(left.min(CHUNK_ROWS), dim)));
            }
            cur.ids.push(id);
            cur.values.extend_from_slice(row);
            left -= 1;
        }
        chunks.push(cur);
        let ids = ov.chunks[..from].iter().chain(&chunks).flat_map(|c| c.ids.iter().copied());
        index = Some(build_index(ids, ov.len() + new_rows.len()));
    }
    let added = new_rows.len();
    (Change::Upsert(Upsert { run, base_writes, ovl_writes, from, chunks, added, index }), updated, inserted)
}

/// A new base of the part's base and overlay rows and the delta `run` (whose rows win;
/// `new` of them are in neither).
fn merge_all<W: Elem + Pod>(part: &Part<W>, run: &Run<W>, new: usize) -> Base<W> {
    let (base, ov, dim) = (&part.base, &part.overlay, run.dim);
    let base_ids = base.ids();
    let mut ovl: Vec<(u64, usize)> = ov.entries().collect();
    ovl.sort_unstable_by_key(|e| e.0);
    let total = base.len() + ov.len() + new;
    let mut ids = Vec::with_capacity(total);
    let mut values = RawBuf::<W>::zeroed(total * dim, true);
    let (mut i, mut j, mut k) = (0, 0, 0);
    for dst in values.chunks_exact_mut(dim) {
        let a = base_ids.get(i).copied();
        let b = ovl.get(j).map(|e| e.0);
        let c = run.ids.get(k).copied();
        let m = [a, b, c].into_iter().flatten().min().expect("rows left");
        if c == Some(m) {
            dst.copy_from_slice(run.row(k));
            k += 1;
            // Base and overlay are disjoint: at most one of them holds `m` too.
            if a == Some(m) {
                i += 1;
            } else if b == Some(m) {
                j += 1;
            }
        } else if a == Some(m) {
            dst.copy_from_slice(base.row(i));
            i += 1;
        } else {
            dst.copy_from_slice(ov.row(ovl[j].1));
            j += 1;
        }
        ids.push(m);
    }
    debug_assert!(i == base_ids.len() && j == ovl.len() && k == run.ids.len());
    Base::build(&ids, values, dim)
}

/// Step 4 for one part, under the write lock; returns what it replaced, to free later.
fn commit<W: Elem + Pod>(part: &mut Part<W>, change: Change<W>) -> Vec<Box<dyn Send>> {
    let mut old: Vec<Box<dyn Send>> = Vec::new();
    match change {
        Change::Replace(b) | Change::Merge(b) => {
            let dim = part.base.dim();
            old.push(Box::new(std::mem::replace(&mut part.base, b)));
            old.push(Box::new(std::mem::replace(&mut part.overlay, Overlay::new(dim))));
        }
        Change::Upsert(u) => {
            if let Some(index) = u.index {
                let (chunks, index) = part.overlay.splice(u.from, u.chunks, u.added, index);
                old.push(Box::new(chunks));
                old.push(Box::new(index));
            }
            for &(p, j) in &u.base_writes {
                part.base.row_mut(p as usize).copy_from_slice(u.run.row(j as usize));
            }
            for &(s, j) in &u.ovl_writes {
                part.overlay.row_mut(s as usize).copy_from_slice(u.run.row(j as usize));
            }
            old.push(Box::new(u.run));
        }
    }
    old
}
