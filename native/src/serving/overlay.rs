//! The overlay of a part: rows whose IDs are new since the part's base was built, until
//! apply merges them into a new base (see `serving/apply.rs` for when).
//!
//! Rows live in chunks of `CHUNK_ROWS` rows (each its IDs and their values), appended in
//! slot order: slot `s` is row `s % CHUNK_ROWS` of chunk `s / CHUNK_ROWS`. Every chunk but
//! the last is full, and the last is allocated at exactly its rows (apply rebuilds it,
//! outside the lock, when rows are added), so the overlay holds no spare capacity. The
//! index is an open-addressing table of u32 entries (slot + 1; 0 is empty) at a load of at
//! most 3/4, probed linearly from `fmix64(id)`; apply rebuilds it whole (outside the lock)
//! whenever rows are added, which costs O(overlay) — the overlay is kept to a fraction of
//! the base, so that stays below the cost of the rows' own copy.

use crate::hash::fmix64;

/// Rows per overlay chunk.
pub const CHUNK_ROWS: usize = 4096;

/// Up to `CHUNK_ROWS` overlay rows: their IDs and values, in slot order.
pub struct OverlayChunk<W> {
    pub ids: Vec<u64>,
    pub values: Vec<W>,
}

impl<W> OverlayChunk<W> {
    /// An empty chunk with room for exactly `rows` rows of `dim` values.
    pub fn with_rows(rows: usize, dim: usize) -> Self {
        OverlayChunk { ids: Vec::with_capacity(rows), values: Vec::with_capacity(rows * dim) }
    }

    fn memory_bytes(&self) -> usize {
        self.ids.capacity() * 8 + self.values.capacity() * std::mem::size_of::<W>()
    }
}

/// The overlay (see the module doc).
pub struct Overlay<W> {
    dim: usize,
    len: usize,
    pub(super) chunks: Vec<OverlayChunk<W>>,
    index: Box<[u32]>,
}

/// An index of `slots` (slot -> ID, in slot order) at load <= 3/4.
pub fn build_index(ids: impl Iterator<Item = u64>, slots: usize) -> Box<[u32]> {
    if slots == 0 {
        return Box::default();
    }
    let cap = (slots * 4 / 3 + 1).next_power_of_two().max(16);
    let mask = cap - 1;
    let mut index = vec![0u32; cap].into_boxed_slice();
    for (s, id) in ids.enumerate() {
        let mut h = fmix64(id) as usize & mask;
        while index[h] != 0 {
            h = (h + 1) & mask;
        }
        index[h] = s as u32 + 1;
    }
    index
}

impl<W: Copy> Overlay<W> {
    pub fn new(dim: usize) -> Self {
        Overlay { dim, len: 0, chunks: Vec::new(), index: Box::default() }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline(always)]
    pub fn id(&self, s: usize) -> u64 {
        self.chunks[s / CHUNK_ROWS].ids[s % CHUNK_ROWS]
    }

    /// Every (ID, slot), in slot order.
    pub fn entries(&self) -> impl Iterator<Item = (u64, usize)> + '_ {
        self.chunks.iter().flat_map(|c| c.ids.iter().copied()).enumerate().map(|(s, id)| (id, s))
    }

    /// Slot of `id`, if present.
    #[inline]
    pub fn find(&self, id: u64) -> Option<usize> {
        if self.is_empty() {
            return None;
        }
        let mask = self.index.len() - 1;
        let mut h = fmix64(id) as usize & mask;
        loop {
            let e = self.index[h];
            if e == 0 {
                return None;
            }
            let s = (e - 1) as usize;
            if self.id(s) == id {
                return Some(s);
            }
            h = (h + 1) & mask;
        }
    }

    #[inline(always)]
    pub fn row(&self, s: usize) -> &[W] {
        let o = (s % CHUNK_ROWS) * self.dim;
        &self.chunks[s / CHUNK_ROWS].values[o..o + self.dim]
    }

    #[inline(always)]
    pub fn row_mut(&mut self, s: usize) -> &mut [W] {
        let o = (s % CHUNK_ROWS) * self.dim;
        &mut self.chunks[s / CHUNK_ROWS].values[o..o + self.dim]
    }

    /// Replace the chunks from `from` on by `chunks` (holding `added` more rows than the
    /// replaced ones), and the index by `index`; returns what was replaced (to drop later).
    pub fn splice(
        &mut self,
        from: usize,
        chunks: Vec<OverlayChunk<W>>,
        added: usize,
        index: Box<[u32]>,
    ) -> (Vec<OverlayChunk<W>>, Box<[u32]>) {
        let old = self.chunks.split_off(from);
        self.chunks.extend(chunks);
        self.len += added;
        debug_assert_eq!(self.len, self.chunks.iter().map(|c| c.ids.len()).sum::<usize>());
        (old, std::mem::replace(&mut self.index, index))
    }

    /// Bytes allocated (capacities).
    pub fn memory_bytes(&self) -> usize {
        self.chunks.iter().map(|c| c.memory_bytes()).sum::<usize>()
            + self.chunks.capacity() * std::mem::size_of::<OverlayChunk<W>>()
            + self.index.len() * 4
            + std::mem::size_of::<Self>()
    }
}
