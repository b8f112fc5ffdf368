//! Point-in-time captures of a live store, written later (checkpoints at a step cut).
//!
//! The parameter server stops applying gradients, captures its store, resumes at once and
//! writes the capture while training goes on. `Capture::new` copies every internal shard
//! whole (a memcpy per column, under that shard's read lock, shards in parallel on the
//! store's pool) into huge-page memory owned by the capture; `Capture::write` gathers the
//! copied rows into the snapshot format with the same writer as `dump`.

use std::path::Path;

use rayon::prelude::*;

use super::write::{write_file, SnapWriter, TableSource, Written};
use crate::config::TableConfig;
use crate::elem::Elem;
use crate::mem::Arena;
use crate::store::{now_secs, Store};
use crate::table::{Layout, RowBlock, Shard, ShardCopy, Shards, Table};

/// Copied shards of a table, by storage type.
enum ShardCopies {
    F32(Vec<ShardCopy<f32>>),
    F16(Vec<ShardCopy<half::f16>>),
    BF16(Vec<ShardCopy<half::bf16>>),
}

struct SketchCopy {
    width: usize,
    depth: usize,
    cells: Vec<u32>,
}

/// One table of a capture.
struct TableCapture {
    cfg: TableConfig,
    layout: Layout,
    counters: [u64; 9],
    sketch: Option<SketchCopy>,
    shards: ShardCopies,
    /// Holds the copied chunks; declared after `shards` so that they drop first.
    _arena: Arena,
}

/// A point-in-time copy of a whole store: every table's configuration, counters,
/// admission sketch and rows (weights, optimizer state, versions, TTL stamps), and the
/// store's version clock.
pub struct Capture {
    next_version: u64,
    created_secs: u64,
    tables: Vec<TableCapture>,
}

/// Copy `shards` one at a time under its read lock; in parallel on the current pool
/// unless `sequential`.
fn copy_shards<W: Elem>(
    shards: &[parking_lot::RwLock<Shard<W>>],
    arena: &Arena,
    sequential: bool,
) -> Vec<ShardCopy<W>> {
    if sequential {
        shards.iter().map(|s| s.read().copy(arena)).collect()
    } else {
        shards.par_iter().map(|s| s.read().copy(arena)).collect()
    }
}

impl TableCapture {
    fn rows_of(t: &Table, sequential: bool) -> (ShardCopies, Arena) {
        let arena = Arena::small_pages();
        let shards = match &t.shards {
            Shards::F32(s) => ShardCopies::F32(copy_shards(s, &arena, sequential)),
            Shards::F16(s) => ShardCopies::F16(copy_shards(s, &arena, sequential)),
            Shards::BF16(s) => ShardCopies::BF16(copy_shards(s, &arena, sequential)),
        };
        (shards, arena)
    }

    fn rows(&self) -> u64 {
        match &self.shards {
            ShardCopies::F32(s) => s.iter().map(|c| c.rows as u64).sum(),
            ShardCopies::F16(s) => s.iter().map(|c| c.rows as u64).sum(),
            ShardCopies::BF16(s) => s.iter().map(|c| c.rows as u64).sum(),
        }
    }

    fn memory_bytes(&self) -> usize {
        let shards: usize = match &self.shards {
            ShardCopies::F32(s) => s.iter().map(|c| c.memory_bytes()).sum(),
            ShardCopies::F16(s) => s.iter().map(|c| c.memory_bytes()).sum(),
            ShardCopies::BF16(s) => s.iter().map(|c| c.memory_bytes()).sum(),
        };
        shards + self.sketch.as_ref().map_or(0, |s| s.cells.capacity() * 4) + std::mem::size_of::<Self>()
    }
}

fn write_copies<W: Elem>(w: &mut SnapWriter, t: &TableCapture, copies: &[ShardCopy<W>]) -> std::io::Result<()> {
    let mut blk = RowBlock::default();
    for c in copies {
        w.chunks(&t.cfg, &t.layout, &c.chunks, c.vbase, &mut blk)?;
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
    fn write_sketch(&self, w: &mut SnapWriter) -> std::io::Result<()> {
        match &self.sketch {
            Some(sk) => w.sketch(sk.width, sk.depth, sk.cells.iter().copied()),
            None => Ok(()),
        }
    }
    fn write_rows(&self, w: &mut SnapWriter) -> std::io::Result<()> {
        match &self.shards {
            ShardCopies::F32(s) => write_copies(w, self, s),
            ShardCopies::F16(s) => write_copies(w, self, s),
            ShardCopies::BF16(s) => write_copies(w, self, s),
        }
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
        let created_secs = now_secs() as u64;
        let sequential = store.threads == 1;
        let tables = store.tables_ordered();
        let rows: Vec<(ShardCopies, Arena)> = if sequential {
            tables.iter().map(|t| TableCapture::rows_of(t, true)).collect()
        } else {
            store.pool.install(|| tables.iter().map(|t| TableCapture::rows_of(t, false)).collect())
        };
        // Read after the rows: the clock and the update-batch counts are then at least as
        // new as every copied row's version and update-batch stamp.
        let next_version = store.clock.next_value();
        let tables = tables
            .iter()
            .zip(rows)
            .map(|(t, (shards, arena))| TableCapture {
                cfg: t.cfg.clone(),
                layout: t.layout.clone(),
                counters: t.counters.snapshot(),
                sketch: t.sketch.as_ref().map(|sk| SketchCopy {
                    width: sk.width,
                    depth: sk.depth,
                    cells: sk.counters.iter().map(|c| c.load(std::sync::atomic::Ordering::Relaxed)).collect(),
                }),
                shards,
                _arena: arena,
            })
            .collect();
        Capture { next_version, created_secs, tables }
    }

    /// Write the capture to `path` in the snapshot format (readable by `load_snapshot`);
    /// the same capture always gives the same bytes. Takes no lock of the store.
    pub fn write(&self, path: &Path) -> crate::config::Result<Written> {
        let tables: Vec<&TableCapture> = self.tables.iter().collect();
        write_file(path, self.created_secs, || self.next_version, &tables)
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
