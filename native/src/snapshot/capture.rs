//! Point-in-time captures of a live store, written later (checkpoints at a step cut).
//!
//! The parameter server stops applying gradients, captures its store, resumes at once and
//! writes the capture while training goes on. `Capture::new` copies every internal shard
//! whole (a memcpy per column, under that shard's read lock, shards in parallel on the
//! store's pool) into huge-page memory owned by the capture; `Capture::write` gathers the
//! copied rows into the snapshot format with the same writer as `dump`.
//!
//! A **delta** (`Capture::since`) copies only the rows created or updated since an earlier
//! capture's `CaptureMark`; loading the earlier capture's file and then the delta's gives the
//! store as of the delta. That holds only while no row has left the store in between (an
//! eviction, a TTL expiry, a forgotten ID, a dropped table would come back from the older
//! file), so then a full capture is taken instead. A delta's event counters are the
//! increments since the mark: loading (merging) both files adds them up to the store's counts.

use std::path::Path;

use rayon::prelude::*;

use super::write::{write_file, SnapWriter, TableSource, Written};
use super::FLAG_DELTA;
use crate::config::TableConfig;
use crate::elem::Elem;
use crate::mem::Arena;
use crate::store::{now_secs, Store};
use crate::table::{ChangedCopy, ColdCopy, Layout, RowColumns, Shard, ShardCopy, Shards, Table};

/// A table's copied rows: every shard whole, or only the rows changed since a mark (the
/// changed rows in RAM copied, and those of a disk tier pinned in its files).
pub(super) enum Copied<W: Elem> {
    Whole(Vec<ShardCopy<W>>),
    Changed(Vec<RowColumns<W>>, Vec<ColdCopy>),
}

impl<W: Elem> Copied<W> {
    pub(super) fn rows(&self) -> u64 {
        match self {
            Copied::Whole(s) => s.iter().map(|c| c.rows as u64).sum(),
            Copied::Changed(b, cold) => {
                b.iter().map(|b| b.len() as u64).sum::<u64>() + cold.iter().map(|c| c.len() as u64).sum::<u64>()
            }
        }
    }
    fn memory_bytes(&self) -> usize {
        match self {
            Copied::Whole(s) => s.iter().map(|c| c.memory_bytes()).sum(),
            Copied::Changed(b, cold) => {
                b.iter().map(|b| b.memory_bytes()).sum::<usize>() + cold.iter().map(|c| c.memory_bytes()).sum::<usize>()
            }
        }
    }
}

/// Copied rows of a table, by storage type.
pub(super) enum ShardCopies {
    F32(Copied<f32>),
    F16(Copied<half::f16>),
    BF16(Copied<half::bf16>),
}

macro_rules! with_copied {
    ($c:expr, $v:ident => $body:expr) => {
        match $c {
            ShardCopies::F32($v) => $body,
            ShardCopies::F16($v) => $body,
            ShardCopies::BF16($v) => $body,
        }
    };
}

/// Where a capture stood, for a later delta (`Capture::since`): the store's version clock
/// and, per table, how many rows had left it (evicted, expired or forgotten), both read
/// before any row was copied, and its counters as the capture wrote them (read after).
#[derive(Clone, Debug)]
pub struct CaptureMark {
    since: u64,
    tables: Vec<(String, [u64; 9], u64)>,
}

/// How many rows have left `t`: evicted, expired (`counters`, read before) and forgotten (not a
/// persisted counter, see `Table::forget`). Each only grows, so an equal sum means none left.
fn removed(t: &Table, counters: &[u64; 9]) -> u64 {
    counters[2] + counters[3] + t.forgotten.load(std::sync::atomic::Ordering::Acquire)
}

struct SketchCopy {
    width: usize,
    depth: usize,
    cells: Vec<u32>,
}

/// One table of a capture.
pub(super) struct TableCapture {
    pub(super) cfg: TableConfig,
    pub(super) layout: Layout,
    /// As written: the table's counters, or for a delta their increments since the mark
    /// (the update-batch count, a clock, stays whole).
    counters: [u64; 9],
    sketch: Option<SketchCopy>,
    pub(super) shards: ShardCopies,
    /// Holds the copied chunks; declared after `shards` so that they drop first.
    _arena: Arena,
}

/// A point-in-time copy of a whole store: every table's configuration, counters,
/// admission sketch and rows (weights, optimizer state, versions, TTL stamps), and the
/// store's version clock.
pub struct Capture {
    pub(super) next_version: u64,
    created_secs: u64,
    pub(super) tables: Vec<TableCapture>,
    /// Whether only the rows changed since a mark were copied.
    pub(super) delta: bool,
    mark: CaptureMark,
    /// Why a table's disk tier could not be pinned (its file not opened again): the capture
    /// then writes nothing.
    error: Option<String>,
}

/// Copy `shards` one at a time under its read lock; in parallel on the current pool
/// unless `sequential`. Returns why a disk tier could not be pinned, if one could not.
fn copy_shards<W: Elem>(
    shards: &[parking_lot::RwLock<Shard<W>>],
    arena: &Arena,
    sequential: bool,
) -> (Vec<ShardCopy<W>>, Option<String>) {
    let copies: Vec<ShardCopy<W>> = if sequential {
        shards.iter().map(|s| s.read().copy(arena)).collect()
    } else {
        shards.par_iter().map(|s| s.read().copy(arena)).collect()
    };
    let error = copies.iter().find_map(|c| c.error.clone());
    (copies, error)
}

type ChangedRows<W> = (Vec<RowColumns<W>>, Vec<ColdCopy>);

fn copy_changed<W: Elem>(
    shards: &[parking_lot::RwLock<Shard<W>>],
    l: &Layout,
    since: u64,
    sequential: bool,
) -> (ChangedRows<W>, Option<String>) {
    let parts: Vec<Result<ChangedCopy<W>, String>> = if sequential {
        shards.iter().map(|s| s.read().copy_since(l, since)).collect()
    } else {
        shards.par_iter().map(|s| s.read().copy_since(l, since)).collect()
    };
    let (mut blocks, mut cold) = (Vec::new(), Vec::new());
    let mut error = None;
    for p in parts {
        match p {
            Ok((b, c)) => {
                blocks.extend(b);
                cold.extend(c);
            }
            Err(e) => error = error.or(Some(e)),
        }
    }
    ((blocks, cold), error)
}

impl TableCapture {
    /// The table's rows: whole, or those changed since `since` (a delta); and why a disk
    /// tier's rows could not be pinned, if they could not.
    fn rows_of(t: &Table, since: Option<u64>, sequential: bool) -> (ShardCopies, Arena, Option<String>) {
        let arena = Arena::small_pages();
        let l = &t.layout;
        macro_rules! whole {
            ($v:ident, $s:expr) => {{
                let (c, e) = copy_shards($s, &arena, sequential);
                (ShardCopies::$v(Copied::Whole(c)), e)
            }};
        }
        macro_rules! changed {
            ($v:ident, $s:expr, $since:expr) => {{
                let ((b, c), e) = copy_changed($s, l, $since, sequential);
                (ShardCopies::$v(Copied::Changed(b, c)), e)
            }};
        }
        let (shards, error) = match (&t.shards, since) {
            (Shards::F32(s), None) => whole!(F32, s),
            (Shards::F16(s), None) => whole!(F16, s),
            (Shards::BF16(s), None) => whole!(BF16, s),
            (Shards::F32(s), Some(v)) => changed!(F32, s, v),
            (Shards::F16(s), Some(v)) => changed!(F16, s, v),
            (Shards::BF16(s), Some(v)) => changed!(BF16, s, v),
        };
        (shards, arena, error.map(|e| format!("table {:?}: {e}", t.cfg.name)))
    }

    fn rows(&self) -> u64 {
        with_copied!(&self.shards, c => c.rows())
    }

    fn memory_bytes(&self) -> usize {
        with_copied!(&self.shards, c => c.memory_bytes())
            + self.sketch.as_ref().map_or(0, |s| s.cells.capacity() * 4)
            + std::mem::size_of::<Self>()
    }
}

fn write_copies<W: Elem>(w: &mut SnapWriter<'_>, t: &TableCapture, copied: &Copied<W>) -> std::io::Result<()> {
    match copied {
        Copied::Whole(copies) => {
            let mut blk = RowColumns::default();
            for c in copies {
                w.chunks(&t.cfg, &t.layout, &c.chunks, c.vbase, &mut blk)?;
                if let Some(cold) = &c.cold {
                    cold.blocks(&t.layout, |b: &RowColumns<W>| w.rows_block(&t.cfg, b))?;
                }
            }
        }
        Copied::Changed(blocks, cold) => {
            for blk in blocks {
                w.rows_block(&t.cfg, blk)?;
            }
            for c in cold {
                c.blocks(&t.layout, |b: &RowColumns<W>| w.rows_block(&t.cfg, b))?;
            }
        }
    }
    Ok(())
}

impl TableSource for TableCapture {
    fn config(&self) -> &TableConfig {
        &self.cfg
    }
    fn counters(&self) -> [u64; 9] {
        self.counters
    }
    fn write_sketch(&self, w: &mut SnapWriter<'_>) -> std::io::Result<()> {
        match &self.sketch {
            Some(sk) => w.sketch(sk.width, sk.depth, sk.cells.iter().copied()),
            None => Ok(()),
        }
    }
    fn write_rows(&self, w: &mut SnapWriter<'_>) -> std::io::Result<()> {
        with_copied!(&self.shards, c => write_copies(w, self, c))
    }
}

impl Capture {
    /// Copy the whole store. Consistent (one instant for every table) when no update runs
    /// meanwhile; lookups may run, and the rows they create in a shard before it is
    /// copied are included.
    ///
    /// **Locking behaviour:** takes the table registry's read lock only to list the
    /// tables; then each internal shard's *read* lock in turn, for as long as copying that
    /// shard takes (one pool thread per shard, never two shard locks at once on a thread).
    /// Lookups of rows that exist proceed meanwhile on every shard; a lookup that
    /// creates rows, or an update, waits for the copy of the shard it needs. Admission
    /// sketches, counters and the version clock are read without locks, after the rows.
    pub fn new(store: &Store) -> Capture {
        Capture::take(store, None)
    }

    /// A delta of the capture that left `mark`: only the rows created or updated since, with
    /// the counters' increments. A full capture (see `is_delta`) when rows may have left the
    /// store since the mark (evicted, expired or forgotten), or the tables differ from the
    /// mark's. Locks as `new` does.
    pub fn since(store: &Store, mark: &CaptureMark) -> Capture {
        Capture::take(store, Some(mark))
    }

    fn take(store: &Store, mark: Option<&CaptureMark>) -> Capture {
        let created_secs = now_secs() as u64;
        let sequential = store.threads == 1;
        let tables = store.tables_ordered();
        // Read before any row is copied: a row changed while the copy runs is then in this
        // capture or (its version being at least `since`) in the next delta; a row removed
        // meanwhile makes the next capture a full one.
        let since = store.clock.next_value();
        let gone: Vec<u64> = tables.iter().map(|t| removed(t, &t.counters.snapshot())).collect();
        let delta = mark.filter(|m| {
            m.tables.len() == tables.len()
                && m.tables
                    .iter()
                    .zip(tables.iter().zip(&gone))
                    .all(|((name, _, then), (t, now))| *name == t.cfg.name && now == then)
        });
        let from = delta.map(|m| m.since);
        let rows: Vec<(ShardCopies, Arena, Option<String>)> = if sequential {
            tables.iter().map(|t| TableCapture::rows_of(t, from, true)).collect()
        } else {
            store.pool.install(|| tables.iter().map(|t| TableCapture::rows_of(t, from, false)).collect())
        };
        // Read after the rows: the clock and the update-batch counts are then at least as
        // new as every copied row's version and update-batch stamp.
        let next_version = store.clock.next_value();
        let counters: Vec<[u64; 9]> = tables.iter().map(|t| t.counters.snapshot()).collect();
        let mark = CaptureMark {
            since,
            tables: tables.iter().zip(&counters).zip(&gone).map(|((t, c), g)| (t.cfg.name.clone(), *c, *g)).collect(),
        };
        let error = rows.iter().find_map(|r| r.2.clone());
        let tables = tables
            .iter()
            .zip(rows)
            .zip(&counters)
            .enumerate()
            .map(|(k, ((t, (shards, arena, _)), now))| TableCapture {
                cfg: t.cfg.clone(),
                layout: t.layout.clone(),
                counters: match delta {
                    // Event counts as increments; the update-batch count (a clock) whole.
                    Some(m) => {
                        std::array::from_fn(|i| if i == 8 { now[i] } else { now[i].saturating_sub(m.tables[k].1[i]) })
                    }
                    None => *now,
                },
                sketch: t.sketch.as_ref().map(|sk| SketchCopy {
                    width: sk.width,
                    depth: sk.depth,
                    cells: sk.counters.iter().map(|c| c.load(std::sync::atomic::Ordering::Relaxed)).collect(),
                }),
                shards,
                _arena: arena,
            })
            .collect();
        Capture { next_version, created_secs, tables, delta: delta.is_some(), mark, error }
    }

    /// An error if a table's disk tier could not be pinned while copying (the capture is
    /// incomplete, and writes no file).
    pub fn check(&self) -> crate::config::Result<()> {
        match &self.error {
            Some(e) => Err(crate::config::StoreError::Io(std::io::Error::other(format!(
                "capture is incomplete, not written: {e}"
            )))),
            None => Ok(()),
        }
    }

    /// Whether this capture holds only the rows changed since a mark (see `since`).
    pub fn is_delta(&self) -> bool {
        self.delta
    }

    /// Where this capture stood, for a later delta on top of it.
    pub fn mark(&self) -> CaptureMark {
        self.mark.clone()
    }

    /// Write the capture to `path` in the snapshot format (readable by `load_snapshot`);
    /// the same capture always gives the same bytes. Takes no lock of the store.
    pub fn write(&self, path: &Path) -> crate::config::Result<Written> {
        self.check()?;
        let tables: Vec<&TableCapture> = self.tables.iter().collect();
        write_file(path, self.created_secs, if self.delta { FLAG_DELTA } else { 0 }, || self.next_version, &tables)
    }

    pub fn rows(&self) -> u64 {
        self.tables.iter().map(|t| t.rows()).sum()
    }

    /// Bytes held by the copy (the copied columns, sketches and bookkeeping).
    pub fn memory_bytes(&self) -> usize {
        self.tables.iter().map(|t| t.memory_bytes()).sum::<usize>() + std::mem::size_of::<Self>()
    }

    pub fn table_names(&self) -> Vec<String> {
        self.tables.iter().map(|t| t.cfg.name.clone()).collect()
    }
}
