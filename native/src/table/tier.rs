//! A disk tier's file and bookkeeping: one internal shard's spill file, its cold rows' columns
//! in RAM, and the record slots a capture pins. The design (what stays in RAM, when rows move,
//! what fails how) is in spill.rs, which moves rows between the shard's chunks and this tier.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::hash::internal_hash;
use crate::index::Index;
use crate::mem::FileMap;
use crate::with_shards;

use super::{ColdCopy, Layout, Table};

/// A cold row's bookkeeping, as the tier hands it out (built from its columns).
#[derive(Clone, Copy, Debug)]
pub struct Cold {
    pub id: u64,
    pub version: u64,
    /// Record slot in the spill file.
    pub fslot: u32,
    /// LRU tick: kept in RAM only for capacity eviction (else 0 here; the record has it).
    pub lru: u32,
    pub utime: u32,
    pub utick: u32,
}

/// Which optional columns a tier keeps in RAM (those its table's decisions read).
#[derive(Clone, Copy, Debug, Default)]
pub struct ColdColumns {
    pub lru: bool,
    pub utime: bool,
    pub utick: bool,
}

/// One internal shard's spill file and its cold rows.
pub struct Tier {
    map: FileMap,
    pub path: PathBuf,
    pub rec_bytes: usize,
    /// Resident rows allowed; `low`: what a spill goes down to.
    pub budget: usize,
    pub(super) low: usize,
    /// The age a new row starts at (see `Shard::init_row`): 0 when capacity eviction reads
    /// the LRU ticks (its victims must be the all-in-RAM table's).
    pub probation: u32,
    keep: ColdColumns,
    // The cold rows' columns, by cold index (a removed row's place takes the last row).
    ids: Vec<u64>,
    fslots: Vec<u32>,
    versions: Vec<u64>,
    lru: Vec<u32>,
    utime: Vec<u32>,
    utick: Vec<u32>,
    /// `id -> cold index`.
    index: Index,
    free: Vec<u32>,
    /// Captures that may still read records of the file (see spill_copy.rs), and the record
    /// slots freed meanwhile: reused only once no capture pins them.
    pins: Arc<AtomicUsize>,
    deferred: Vec<u32>,
    /// Record slots in the file.
    high: u32,
    failed: Mutex<Option<String>>,
    /// The most bytes the file may grow to: a disk that fills, for tests.
    #[cfg(test)]
    pub limit_for_test: Option<usize>,
    /// Set with `failed`; shared by the table's tiers (`Table::tier_error` reads it first).
    flag: Arc<AtomicBool>,
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    /// Ids a lookup found cold (read from disk), against the table's `lookups`.
    pub lookup_hits: AtomicU64,
}

/// Push onto a column growing by an eighth, not doubling: a tier's columns are most of
/// its RAM, and a doubled Vec's slack would be up to half of it.
#[inline]
fn push<T>(v: &mut Vec<T>, x: T) {
    if v.len() == v.capacity() {
        v.reserve_exact((v.len() / 8).max(64));
    }
    v.push(x);
}

static NEXT_FILE: AtomicU64 = AtomicU64::new(0);

/// Bytes of one record: id, weights, state, accumulator, step count, LRU tick.
pub fn record_bytes(l: &Layout, elem_size: usize) -> usize {
    8 + l.dim * elem_size + l.state_dim * 4 + 4 * (l.has_acc as usize + l.has_steps as usize) + 4
}

impl Tier {
    /// A new, empty spill file for shard `shard` of table `table` in `dir` (created if
    /// missing); its space is given back when the tier drops or the process dies.
    pub fn create(
        dir: &Path,
        table: &str,
        shard: usize,
        rec_bytes: usize,
        budget: usize,
        keep: ColdColumns,
        flag: Arc<AtomicBool>,
    ) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let safe: String = table.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
        let n = NEXT_FILE.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("{safe}.{shard}.{}-{n}.spill", std::process::id()));
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path)?;
        // Unlinked at once: the file lives as long as this handle, so no crash (a kill -9) can
        // leave one behind. `path` names it in errors; `Table::disk_stats` reports its size.
        std::fs::remove_file(&path)?;
        Ok(Tier {
            map: FileMap::new(file),
            path,
            rec_bytes,
            budget,
            low: budget - budget / 8,
            probation: if keep.lru { 0 } else { (4 * budget).min(u32::MAX as usize / 2) as u32 },
            keep,
            ids: Vec::new(),
            fslots: Vec::new(),
            versions: Vec::new(),
            lru: Vec::new(),
            utime: Vec::new(),
            utick: Vec::new(),
            index: Index::default(),
            free: Vec::new(),
            pins: Arc::new(AtomicUsize::new(0)),
            deferred: Vec::new(),
            high: 0,
            failed: Mutex::new(None),
            #[cfg(test)]
            limit_for_test: None,
            flag,
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            lookup_hits: AtomicU64::new(0),
        })
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.ids.len()
    }
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
    /// The cold index of `id`, if its row is cold.
    #[inline]
    fn find(&self, id: u64) -> Option<usize> {
        if self.ids.is_empty() {
            return None;
        }
        self.index.find(id, internal_hash(id), |i| self.ids[i as usize]).map(|i| i as usize)
    }
    #[inline]
    pub fn contains(&self, id: u64) -> bool {
        self.find(id).is_some()
    }
    pub fn get(&self, id: u64) -> Option<Cold> {
        self.find(id).map(|i| self.at(i))
    }
    /// Cold row `i` (`0..len()`).
    pub fn at(&self, i: usize) -> Cold {
        Cold {
            id: self.ids[i],
            version: self.versions[i],
            fslot: self.fslots[i],
            lru: self.lru.get(i).copied().unwrap_or(0),
            utime: self.utime.get(i).copied().unwrap_or(0),
            utick: self.utick.get(i).copied().unwrap_or(0),
        }
    }
    /// Cold row `i`'s version (what a delta's filter reads).
    #[inline]
    pub fn version_at(&self, i: usize) -> u64 {
        self.versions[i]
    }
    /// Add `d` to every cold row's last-update batch (see `Shard::shift_update_batches`).
    pub fn shift_update_batches(&mut self, d: u32) {
        for t in &mut self.utick {
            *t = t.wrapping_add(d);
        }
    }
    /// Bytes of the spill file on disk (every record slot, free ones and those allocated
    /// ahead included).
    pub fn file_bytes(&self) -> u64 {
        self.map.len() as u64
    }
    /// RAM held by the cold rows' bookkeeping.
    pub fn memory_bytes(&self) -> usize {
        self.ids.capacity() * 8
            + self.versions.capacity() * 8
            + (self.fslots.capacity() + self.lru.capacity() + self.utime.capacity() + self.utick.capacity()) * 4
            + self.index.memory_bytes()
            + (self.free.capacity() + self.deferred.capacity()) * 4
    }
    /// Why the tier failed, if it did (sticky).
    pub fn error(&self) -> Option<String> {
        self.failed.lock().clone()
    }
    pub fn is_failed(&self) -> bool {
        self.failed.lock().is_some()
    }
    fn fail(&self, what: &str, e: &std::io::Error) -> String {
        let msg = format!("disk tier: {what} {} failed: {e}", self.path.display());
        let mut f = self.failed.lock();
        if f.is_none() {
            *f = Some(msg.clone());
        }
        self.flag.store(true, Ordering::Relaxed);
        msg
    }

    /// Read the record in `fslot` into `buf` (`rec_bytes` long): a copy out of the mapped file.
    pub fn read(&self, fslot: u32, buf: &mut [u8]) {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.map.read(fslot as usize * self.rec_bytes, buf);
    }

    /// Room in the file for record slot `fslot`: the file grows by an eighth (64 KiB at least),
    /// its blocks allocated on disk first, so that a full disk fails here.
    fn room_for(&mut self, fslot: u32) -> Result<(), String> {
        let end = (fslot as usize + 1) * self.rec_bytes;
        if end <= self.map.len() {
            return Ok(());
        }
        let len = end.max(self.map.len() + (self.map.len() / 8).max(64 << 10)).next_multiple_of(4096);
        #[cfg(test)]
        if self.limit_for_test.is_some_and(|l| len > l) {
            return Err(self.fail("growing", &std::io::Error::from_raw_os_error(libc::ENOSPC)));
        }
        self.map.grow(len).map_err(|e| self.fail("growing", &e))
    }

    /// Write the record `buf` of row `c` to a free record slot and make the row cold.
    pub(super) fn put(&mut self, buf: &[u8], c: Cold) -> Result<(), String> {
        if !self.deferred.is_empty() && !self.pinned() {
            self.free.append(&mut self.deferred);
        }
        let fslot = match self.free.pop() {
            Some(s) => s,
            None => {
                self.room_for(self.high)?;
                self.high += 1;
                self.high - 1
            }
        };
        self.map.write(fslot as usize * self.rec_bytes, buf);
        self.writes.fetch_add(1, Ordering::Relaxed);
        let i = self.ids.len();
        if self.index.needs_rebuild(i + 1) {
            let ids = &self.ids;
            self.index.rebuild(i + 1, i + 1, (0..i).map(|k| (k as u32, internal_hash(ids[k]))));
        }
        self.index.insert_new(i as u32, internal_hash(c.id));
        push(&mut self.ids, c.id);
        push(&mut self.fslots, fslot);
        push(&mut self.versions, c.version);
        if self.keep.lru {
            push(&mut self.lru, c.lru);
        }
        if self.keep.utime {
            push(&mut self.utime, c.utime);
        }
        if self.keep.utick {
            push(&mut self.utick, c.utick);
        }
        Ok(())
    }

    /// Forget cold row `i` (its record slot becomes free; the last row takes its index).
    pub fn remove_at(&mut self, i: usize) -> Cold {
        let c = self.at(i);
        let last = self.ids.len() - 1;
        let Tier { index, ids, .. } = self;
        index.remove(i as u32, internal_hash(c.id), |k| internal_hash(ids[k as usize]));
        if i != last {
            let moved = ids[last];
            index.remove(last as u32, internal_hash(moved), |k| internal_hash(ids[k as usize]));
            index.insert_new(i as u32, internal_hash(moved));
        }
        self.ids.swap_remove(i);
        self.fslots.swap_remove(i);
        self.versions.swap_remove(i);
        for col in [&mut self.lru, &mut self.utime, &mut self.utick] {
            if !col.is_empty() {
                col.swap_remove(i);
            }
        }
        if self.pinned() {
            self.deferred.push(c.fslot); // a capture may still read the record
        } else {
            self.free.push(c.fslot);
        }
        if self.ids.is_empty() && !self.pinned() {
            // Nothing cold: the file starts over (and gives its space back).
            self.free.clear();
            self.deferred.clear();
            self.high = 0;
            let _ = self.map.clear();
        }
        c
    }

    fn pinned(&self) -> bool {
        self.pins.load(Ordering::Acquire) > 0
    }

    /// The cold rows whose version is at least `since`, pinned for a capture: their records
    /// stay in the file, unchanged, until the copy drops (see spill_copy.rs).
    pub fn pin_rows(&self, since: u64) -> Result<ColdCopy, String> {
        let file = self.map.file().try_clone().map_err(|e| format!("disk tier: {}: {e}", self.path.display()))?;
        let rows = (0..self.len()).filter(|&i| self.versions[i] >= since).map(|i| self.at(i)).collect();
        Ok(ColdCopy::new(file, self.path.clone(), self.rec_bytes, rows, self.pins.clone()))
    }

    /// Remove `id`'s cold row, if it has one.
    pub fn take(&mut self, id: u64) -> Option<Cold> {
        let i = self.find(id)?;
        Some(self.remove_at(i))
    }
}

/// One internal shard's disk tier, as `Table::disk_stats` reports it.
#[derive(Clone, Copy, Debug, Default)]
pub struct DiskStats {
    pub resident_rows: u64,
    pub rows: u64,
    pub bytes: u64,
    pub reads: u64,
    pub writes: u64,
    pub lookup_hits: u64,
    pub budget_rows: u64,
}

impl Table {
    /// The disk tier per internal shard (none without one): rows on disk, bytes of the
    /// spill file, records read and written, ids lookups read from disk.
    ///
    /// **Locking behaviour:** each internal shard's *read* lock in turn.
    pub fn disk_stats(&self) -> Vec<DiskStats> {
        with_shards!(&self.shards, shards => shards.iter().filter_map(|s| {
            let g = s.read();
            g.tier.as_ref().map(|t| DiskStats {
                resident_rows: g.rows as u64,
                rows: t.len() as u64,
                bytes: t.file_bytes(),
                reads: t.reads.load(Ordering::Relaxed),
                writes: t.writes.load(Ordering::Relaxed),
                lookup_hits: t.lookup_hits.load(Ordering::Relaxed),
                budget_rows: t.budget as u64,
            })
        }).collect())
    }

    /// Why the table's disk tier failed (a full disk, an I/O error), naming the table and
    /// the file; sticky: every later call of the bindings raises it.
    ///
    /// **Locking behaviour:** each internal shard's *read* lock in turn (none without a tier).
    pub fn tier_error(&self) -> Option<String> {
        if !self.tier_failed.load(Ordering::Relaxed) {
            return None;
        }
        with_shards!(&self.shards, shards => shards.iter().find_map(|s| s.read().tier.as_ref().and_then(|t| t.error())))
            .map(|e| format!("table {:?}: {e}", self.cfg.name))
    }
}
