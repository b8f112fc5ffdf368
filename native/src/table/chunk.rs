//! Row storage: the per-table `Layout` (record size, which optional columns exist, rows
//! per chunk), the slab `Chunk` holding up to `chunk_rows` rows column by column, views
//! and copies of one row, and `RowColumns`, the columns of some rows as snapshots read and
//! write them.

use crate::config::TableConfig;
use crate::elem::Elem;
use crate::mem::{Arena, RawBuf};

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
    /// RAM a resident row takes (its record, version, state and per-row scalars, and
    /// about 8 bytes of index and free list): what a RAM budget is divided by.
    pub fn ram_row_bytes(&self, elem_size: usize) -> usize {
        let scalars = [self.has_acc, self.has_steps, self.has_lru, self.has_utime, self.has_utick];
        8 + (self.dim * elem_size).div_ceil(8) * 8
            + 4
            + self.state_dim * 4
            + 4 * scalars.iter().filter(|&&b| b).count()
            + 8
    }
    #[inline(always)]
    pub fn loc(&self, slot: u32) -> (usize, usize) {
        ((slot >> self.chunk_shift) as usize, (slot as usize) & (self.chunk_rows - 1))
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
    pub(super) fn new(l: &Layout, rows: usize, arena: &Arena) -> Self {
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
    pub(super) fn len(&self) -> usize {
        self.len
    }
    #[inline(always)]
    pub(super) fn cap_rows(&self) -> usize {
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
    pub(super) fn reserve_rows(&mut self, l: &Layout, rows: usize, arena: &Arena) {
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
    pub(super) fn push_slot(&mut self, l: &Layout) {
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
    pub(super) fn memory_bytes(&self) -> usize {
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
    /// Whether slot offset `l` holds a row (free slots of the chunk do not).
    #[inline(always)]
    pub fn occupied(&self, l: usize) -> bool {
        (self.occ[l >> 6] >> (l & 63)) & 1 == 1
    }

    /// Copy of the chunk: every column up to `len` (free slots included, the occupancy
    /// bitmap tells them apart) except the LRU ticks, which snapshots do not keep.
    pub(super) fn copy(&self, arena: &Arena) -> Self {
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

    /// Gather the live rows whose version is at least `since` (0: every row) into `blk`
    /// (cleared first). The chunk's versions are offsets from `vbase`, its shard's base.
    pub fn gather(&self, l: &Layout, vbase: u64, since: u64, blk: &mut RowColumns<W>) {
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

/// The columns of some rows of a shard, as snapshots read and write them: one ROWS block
/// of the file. An optional column is empty when the table does not keep it.
#[derive(Default)]
pub struct RowColumns<W> {
    pub ids: Vec<u64>,
    pub versions: Vec<u64>,
    pub weights: Vec<W>,
    pub state: Vec<f32>,
    pub acc: Vec<f32>,
    pub steps: Vec<u32>,
    pub utime: Vec<u32>,
    pub utick: Vec<u32>,
}

impl<W> RowColumns<W> {
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
