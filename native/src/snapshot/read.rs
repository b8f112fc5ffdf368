//! The verifying snapshot reader and the loader.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use half::{bf16, f16};
use parking_lot::RwLock;
use rayon::prelude::*;

use super::meta::decode_meta;
use super::*;
use crate::config::DType;
use crate::elem::Elem;
use crate::hash::{internal_hash, internal_shard, shard_of};
use crate::store::{now_secs, Store};
use crate::table::{Local, RowColumns, Shard, Shards, Table};

struct Rd<R: Read> {
    r: R,
}
impl<R: Read> Rd<R> {
    fn exact(&mut self, buf: &mut [u8], what: &str) -> Result<()> {
        self.r.read_exact(buf).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                StoreError::Corrupt(format!("file is truncated (while reading {what})"))
            } else {
                StoreError::Io(e)
            }
        })
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        let mut b = [0u8; 4];
        self.exact(&mut b, what)?;
        Ok(u32::from_le_bytes(b))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        let mut b = [0u8; 8];
        self.exact(&mut b, what)?;
        Ok(u64::from_le_bytes(b))
    }
    /// Read into a typed column, feeding the crc.
    fn col<T: Copy + Default>(&mut self, h: &mut crc32fast::Hasher, n: usize, what: &str) -> Result<Vec<T>> {
        let mut v = vec![T::default(); n];
        let b = bytes_of_mut(&mut v);
        self.exact(b, what)?;
        h.update(b);
        Ok(v)
    }
}

/// The columns of a decoded ROWS block, by storage type.
pub enum AnyBlock {
    F32(RowColumns<f32>),
    F16(RowColumns<f16>),
    BF16(RowColumns<bf16>),
}

pub trait Visitor {
    /// The header's table count and creation time, before `header`: only a visitor that
    /// writes the file again needs them.
    fn file_header(&mut self, _num_tables: u32, _created_secs: u64) -> Result<()> {
        Ok(())
    }
    /// `delta`: the header's `FLAG_DELTA`.
    fn header(&mut self, next_version: u64, delta: bool) -> Result<()>;
    fn table(&mut self, cfg: &TableConfig, counters: &[u64; 9]) -> Result<()>;
    fn sketch(&mut self, width: u32, depth: u32, counters: &[u32]) -> Result<()>;
    fn rows(&mut self, blk: AnyBlock) -> Result<()>;
    fn end(&mut self, next_version: u64) -> Result<()>;
}

fn read_block_typed<W: Elem, R: Read>(
    rd: &mut Rd<R>,
    h: &mut crc32fast::Hasher,
    cfg: &TableConfig,
    cols: u32,
    n: usize,
) -> Result<RowColumns<W>> {
    let mut b = RowColumns::<W> {
        ids: rd.col(h, n, "row ids")?,
        versions: rd.col(h, n, "row versions")?,
        ..Default::default()
    };
    let mut w = vec![W::default(); n * cfg.dim];
    let bytes = W::as_bytes_mut(&mut w);
    rd.exact(bytes, "row weights")?;
    h.update(bytes);
    b.weights = w;
    if cols & COL_STATE != 0 {
        b.state = rd.col(h, n * cfg.state_dim(), "optimizer state")?;
    }
    if cols & COL_ACC != 0 {
        b.acc = rd.col(h, n, "row accumulators")?;
    }
    if cols & COL_STEPS != 0 {
        b.steps = rd.col(h, n, "adam steps")?;
    }
    if cols & COL_UTIME != 0 {
        b.utime = rd.col(h, n, "update times")?;
    }
    if cols & COL_UTICK != 0 {
        b.utick = rd.col(h, n, "update batches")?;
    }
    Ok(b)
}

pub fn read_snapshot(path: &Path, v: &mut dyn Visitor) -> Result<()> {
    let f = File::open(path)?;
    let mut rd = Rd { r: BufReader::with_capacity(4 << 20, f) };
    let mut hdr = [0u8; 36];
    rd.exact(&mut hdr, "header")?;
    if &hdr[0..8] != MAGIC {
        return corrupt("bad magic: not a Trillium embedding snapshot");
    }
    let ver = u32::from_le_bytes(hdr[8..12].try_into().unwrap_or_default());
    if ver != FORMAT_VERSION {
        return corrupt(format!(
            "unsupported snapshot format version {ver} (this build reads version {FORMAT_VERSION})"
        ));
    }
    let crc = rd.u32("header checksum")?;
    if crc32fast::hash(&hdr) != crc {
        return corrupt("header checksum mismatch");
    }
    let flags = u32::from_le_bytes(hdr[12..16].try_into().unwrap_or_default());
    if flags & !FLAG_DELTA != 0 {
        return corrupt(format!("unknown snapshot header flags {flags:#x}"));
    }
    let next_version = u64::from_le_bytes(hdr[16..24].try_into().unwrap_or_default());
    let num_tables = u32::from_le_bytes(hdr[24..28].try_into().unwrap_or_default());
    let created_secs = u64::from_le_bytes(hdr[28..36].try_into().unwrap_or_default());
    v.file_header(num_tables, created_secs)?;
    v.header(next_version, flags & FLAG_DELTA != 0)?;
    let mut names = HashSet::new();
    let mut all_rows = 0u64;
    for _ in 0..num_tables {
        let t = rd.u32("table metadata tag")?;
        if t != TAG_META {
            return corrupt("expected a table metadata block");
        }
        let len = rd.u32("table metadata length")?;
        if len > MAX_META_LEN {
            return corrupt("table metadata block is too large");
        }
        let mut meta = vec![0u8; len as usize];
        rd.exact(&mut meta, "table metadata")?;
        if crc32fast::hash(&meta) != rd.u32("table metadata checksum")? {
            return corrupt("table metadata checksum mismatch");
        }
        let (cfg, counters) = decode_meta(&meta)?;
        if !names.insert(cfg.name.clone()) {
            return corrupt(format!("duplicate table {:?}", cfg.name));
        }
        v.table(&cfg, &counters)?;
        let expect_cols = columns_of(&cfg);
        let mut rows = 0u64;
        loop {
            let t = rd.u32("block tag")?;
            let mut h = crc32fast::Hasher::new();
            match t {
                TAG_SKETCH => {
                    let width = rd.u32("sketch width")?;
                    let depth = rd.u32("sketch depth")?;
                    h.update(&width.to_le_bytes());
                    h.update(&depth.to_le_bytes());
                    if !width.is_power_of_two() || width > (1 << 28) || depth == 0 || depth > 16 {
                        return corrupt("bad sketch dimensions");
                    }
                    let c: Vec<u32> = rd.col(&mut h, (width * depth) as usize, "sketch")?;
                    if h.finalize() != rd.u32("sketch checksum")? {
                        return corrupt("sketch checksum mismatch");
                    }
                    v.sketch(width, depth, &c)?;
                }
                TAG_ROWS => {
                    let n = rd.u32("row block header")?;
                    let cols = rd.u32("row block header")?;
                    let plen = rd.u64("row block header")?;
                    h.update(&n.to_le_bytes());
                    h.update(&cols.to_le_bytes());
                    h.update(&plen.to_le_bytes());
                    if n == 0 || n > MAX_BLOCK_ROWS {
                        return corrupt(format!("row block has an invalid row count {n}"));
                    }
                    if cols != expect_cols {
                        return corrupt("row block columns do not match the table configuration");
                    }
                    if plen != payload_len(&cfg, cols, n as u64) {
                        return corrupt("row block payload length does not match its header");
                    }
                    let n = n as usize;
                    let blk = match cfg.dtype {
                        DType::F32 => AnyBlock::F32(read_block_typed(&mut rd, &mut h, &cfg, cols, n)?),
                        DType::F16 => AnyBlock::F16(read_block_typed(&mut rd, &mut h, &cfg, cols, n)?),
                        DType::BF16 => AnyBlock::BF16(read_block_typed(&mut rd, &mut h, &cfg, cols, n)?),
                    };
                    if h.finalize() != rd.u32("row block checksum")? {
                        return corrupt("row block checksum mismatch");
                    }
                    rows += n as u64;
                    v.rows(blk)?;
                }
                TAG_TEND => {
                    let r = rd.u64("table end")?;
                    h.update(&r.to_le_bytes());
                    if h.finalize() != rd.u32("table end checksum")? {
                        return corrupt("table end checksum mismatch");
                    }
                    if r != rows {
                        return corrupt(format!("table {:?}: expected {r} rows, found {rows}", cfg.name));
                    }
                    break;
                }
                _ => return corrupt(format!("unexpected block tag 0x{t:08x}")),
            }
        }
        all_rows += rows;
    }
    if rd.u32("trailer")? != TAG_TRAILER {
        return corrupt("missing trailer");
    }
    let mut tr = [0u8; 28];
    rd.exact(&mut tr, "trailer")?;
    if crc32fast::hash(&tr) != rd.u32("trailer checksum")? {
        return corrupt("trailer checksum mismatch");
    }
    let nt = u32::from_le_bytes(tr[0..4].try_into().unwrap_or_default());
    let nr = u64::from_le_bytes(tr[4..12].try_into().unwrap_or_default());
    let end_next = u64::from_le_bytes(tr[12..20].try_into().unwrap_or_default());
    if nt != num_tables || nr != all_rows || &tr[20..28] != END_MAGIC {
        return corrupt("trailer does not match the file contents");
    }
    let mut extra = [0u8; 1];
    match rd.r.read(&mut extra) {
        Ok(0) => {}
        Ok(_) => return corrupt("unexpected data after the trailer"),
        Err(e) => return Err(StoreError::Io(e)),
    }
    v.end(next_version.max(end_next))
}

/// Pass 1: structural checks + compatibility with existing tables.
struct Verify<'a> {
    store: &'a Store,
}

fn check_compatible(existing: &TableConfig, cfg: &TableConfig) -> Result<()> {
    if existing.dim != cfg.dim || existing.dtype != cfg.dtype || existing.optimizer != cfg.optimizer {
        return Err(StoreError::Value(format!(
            "snapshot table {:?} (dim={}, dtype={}, optimizer={}) is incompatible with the existing table (dim={}, dtype={}, optimizer={})",
            cfg.name,
            cfg.dim,
            cfg.dtype.name(),
            cfg.optimizer.name(),
            existing.dim,
            existing.dtype.name(),
            existing.optimizer.name()
        )));
    }
    Ok(())
}

impl Visitor for Verify<'_> {
    fn header(&mut self, _: u64, _: bool) -> Result<()> {
        Ok(())
    }
    fn table(&mut self, cfg: &TableConfig, _: &[u64; 9]) -> Result<()> {
        if let Ok(t) = self.store.table(&cfg.name) {
            check_compatible(&t.cfg, cfg)?;
        }
        Ok(())
    }
    fn sketch(&mut self, _: u32, _: u32, _: &[u32]) -> Result<()> {
        Ok(())
    }
    fn rows(&mut self, _: AnyBlock) -> Result<()> {
        Ok(())
    }
    fn end(&mut self, _: u64) -> Result<()> {
        Ok(())
    }
}

/// Pass 2: apply to the store.
struct Apply<'a> {
    store: &'a Store,
    filter: Option<(u32, u32)>,
    table: Option<Arc<Table>>,
    /// Added to the current table's loaded last-update batches (see `Apply::table`).
    utick_shift: u32,
    /// The file is a delta on top of what the store holds (see `Apply::table`).
    delta: bool,
}

/// Shard `i` of `n`'s share of a counter: the `n` shares of `c` add up to exactly `c`.
pub(super) fn share(c: u64, i: u32, n: u32) -> u64 {
    let c = c as u128;
    (c * (i as u128 + 1) / n as u128 - c * i as u128 / n as u128) as u64
}

fn apply_block<W: Elem>(
    store: &Store,
    t: &Table,
    shards: &[RwLock<Shard<W>>],
    blk: &RowColumns<W>,
    filter: Option<(u32, u32)>,
) -> u64 {
    let n = blk.len();
    let hashes: Vec<u64> = blk.ids.iter().map(|&id| internal_hash(id)).collect();
    let ns = shards.len();
    let mut per: Vec<Vec<u32>> = vec![Vec::new(); ns];
    for k in 0..n {
        if let Some((i, m)) = filter {
            if shard_of(blk.ids[k], m) != i {
                continue;
            }
        }
        per[internal_shard(hashes[k], ns)].push(k as u32);
    }
    let batch = t.counters.update_batches.load(Ordering::Relaxed) as u32;
    let ctx = t.ctx(0, now_secs(), batch);
    let loaded: u64 = per.iter().map(|p| p.len() as u64).sum();
    let total = store.pool.install(|| {
        per.par_iter()
            .enumerate()
            .map(|(s, which)| {
                let mut local = Local::default();
                if !which.is_empty() {
                    shards[s].write().load_rows(&ctx, blk, which, &hashes, &mut local);
                }
                local
            })
            .reduce(Local::default, |a, b| a + b)
    });
    t.counters.evicted.fetch_add(total.evicted, Ordering::Relaxed);
    t.counters.expired.fetch_add(total.expired, Ordering::Relaxed);
    loaded
}

impl Visitor for Apply<'_> {
    fn header(&mut self, next_version: u64, delta: bool) -> Result<()> {
        self.delta = delta;
        self.store.clock.advance_to(next_version);
        Ok(())
    }
    fn table(&mut self, cfg: &TableConfig, counters: &[u64; 9]) -> Result<()> {
        let t = match self.store.table(&cfg.name) {
            Ok(t) => {
                check_compatible(&t.cfg, cfg)?;
                t
            }
            Err(_) => {
                // A concurrent create_table may win the race; fall back to it.
                match self.store.create_table(cfg.clone()) {
                    Ok(()) => {}
                    Err(StoreError::Value(_)) => {}
                    Err(e) => return Err(e),
                }
                let t = self.store.table(&cfg.name)?;
                check_compatible(&t.cfg, cfg)?;
                t
            }
        };
        // Event counters: each of `n` filtered loads of a file adds its share, so the new
        // shards together count what the old ones did.
        let (i, n) = self.filter.unwrap_or((0, 1));
        let mut c: [u64; 9] = std::array::from_fn(|k| share(counters[k], i, n));
        c[8] = 0; // update_batches is a clock, not an event count: below
        t.counters.add_all(&c);
        // The table's update-batch count becomes the largest seen; every row keeps its age
        // in update batches (the TTL by updates): rows already here move up with the count,
        // rows from this file are shifted from the file's count to the table's.
        // A delta continues the clock of the file beneath it: the rows already here are that
        // file's, and keep their stamps.
        let prev = t.counters.update_batches.fetch_max(counters[8], Ordering::Relaxed);
        let now = prev.max(counters[8]);
        if !self.delta {
            t.shift_update_batches(now.wrapping_sub(prev) as u32);
        }
        self.utick_shift = now.wrapping_sub(counters[8]) as u32;
        self.table = Some(t);
        Ok(())
    }
    fn sketch(&mut self, width: u32, depth: u32, counters: &[u32]) -> Result<()> {
        if let Some(t) = &self.table {
            if let Some(sk) = &t.sketch {
                if sk.width == width as usize && sk.depth == depth as usize {
                    // Element-wise max: an id's sightings are all in one file (its owner's,
                    // lookups are routed by shard_of), so the max is still an over-estimate
                    // of every id's count, without the other shards' traffic a sum would add;
                    // and loading a file twice changes nothing.
                    for (c, v) in sk.counters.iter().zip(counters) {
                        c.fetch_max(*v, Ordering::Relaxed);
                    }
                }
            }
        }
        Ok(())
    }
    fn rows(&mut self, mut blk: AnyBlock) -> Result<()> {
        let t = match &self.table {
            Some(t) => t.clone(),
            None => return corrupt("row block outside of a table"),
        };
        if self.utick_shift != 0 {
            let utick = match &mut blk {
                AnyBlock::F32(b) => &mut b.utick,
                AnyBlock::F16(b) => &mut b.utick,
                AnyBlock::BF16(b) => &mut b.utick,
            };
            for u in utick {
                *u = u.wrapping_add(self.utick_shift);
            }
        }
        match (&t.shards, &blk) {
            (Shards::F32(s), AnyBlock::F32(b)) => apply_block(self.store, &t, s, b, self.filter),
            (Shards::F16(s), AnyBlock::F16(b)) => apply_block(self.store, &t, s, b, self.filter),
            (Shards::BF16(s), AnyBlock::BF16(b)) => apply_block(self.store, &t, s, b, self.filter),
            _ => return corrupt("row block dtype does not match the table"),
        };
        Ok(())
    }
    fn end(&mut self, next_version: u64) -> Result<()> {
        self.store.clock.advance_to(next_version);
        Ok(())
    }
}

/// Load (merge) a snapshot into the store, optionally keeping only the rows
/// with `shard_of(id, num_shards) == shard_index`. Loading each of S files with
/// `(i, n)` into store `i` of `n` reshards a checkpoint (see native/README.md for
/// how rows, counters, sketches, clocks and update-batch stamps merge).
///
/// **Locking behaviour:** the verifying pass takes the table registry's read lock
/// only to look tables up. The applying pass takes the registry's write lock to
/// create missing tables, then, per row block, the *write* lock of each internal
/// shard receiving rows (one pool task per shard); a table whose update-batch count
/// moves up has every shard's write lock taken in turn to shift the stamps.
pub fn load_snapshot(store: &Store, path: &Path, filter: Option<(u32, u32)>) -> Result<()> {
    read_snapshot(path, &mut Verify { store })?;
    read_snapshot(path, &mut Apply { store, filter, table: None, utick_shift: 0, delta: false })
}
