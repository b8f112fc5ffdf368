//! The sorted base of a part (one table's rows owned by one training shard): IDs sorted
//! ascending beside a dense slab of their values in the same order, with an index of
//! about 6 bytes per row.
//!
//! Layout, for `n` rows and `b` bucket bits (`B = 2^b` buckets):
//! * the bucket of an ID is its top `b` bits, so buckets are ranges of the sorted IDs;
//!   `start(k)` is the position of bucket `k`'s first ID (`start(B) = n`);
//! * `keys`: each ID's low 48 bits in 6 bytes when `b >= 16` (the bucket then supplies the
//!   top 16 bits), else the whole ID in 8 bytes; read as one unaligned 8-byte load, so
//!   `keys` ends with `8 - key width` bytes of padding;
//! * `start` is kept in two levels, a u32 per group of buckets and a start relative to its
//!   group per bucket, as narrow as the groups allow: a u8 per bucket in groups of 16
//!   (1.25 bytes per bucket) when no group holds 256 rows or more, else a u16 in groups of
//!   256 (~2 bytes), else (IDs far from uniform) a u32 per bucket;
//! * `values`: `n * dim` values, row `p` belonging to the ID at position `p`.
//!
//! Parts of at least 2^16 rows use `b = max(16, floor(log2 n) - 4)` and 6-byte keys:
//! from 2^20 rows on, 16 to 32 rows per bucket and u16 starts, 6.06 to 6.13 bytes per row
//! (6.1 at 5M rows); below, 2^16 buckets of u8 starts, 6 + 81920 / n (6.16 at 500k rows,
//! 7.25 at 2^16). Smaller parts use `b = floor(log2 n) - 4` and 8-byte keys (8.1 to 8.3
//! bytes per row).
//! Feature IDs are xxh3 hashes, so their top bits are uniform and buckets even; other IDs
//! are served correctly, only with longer buckets.
//!
//! A lookup computes the bucket, reads its two starts and searches its keys (binary
//! search down to 8 keys, then a scan); batched lookups prefetch each step for a block of
//! IDs before taking it (`serving/lookup.rs`). The base never changes shape once built: apply
//! overwrites values in place (under the store's write lock) and builds a new base to
//! add rows (outside it); see `serving/apply.rs`.

use crate::elem::Elem;
use crate::mem::{prefetch, Pod, RawBuf};

/// Parts with at least this many rows get 6-byte keys (and at least 16 bucket bits).
const SHORT_KEYS_MIN_ROWS: usize = 1 << 16;
/// With 6-byte keys the top 16 bits of an ID come from its bucket.
const SHORT_KEYS_MIN_BITS: u32 = 16;
/// Buckets per group of the two-level starts: 2^4 with u8 starts, 2^8 with u16 ones.
const BYTE_GROUP_SHIFT: u32 = 4;
const GROUP_SHIFT: u32 = 8;
/// Aim for 2^4 to 2^5 rows per bucket.
const ROWS_PER_BUCKET_LOG2: u32 = 4;

/// Where each bucket starts (see the module doc).
enum Starts {
    /// `start(k) = groups[k >> BYTE_GROUP_SHIFT] + rel[k]`.
    Byte {
        groups: Vec<u32>,
        rel: Vec<u8>,
    },
    /// `start(k) = groups[k >> GROUP_SHIFT] + rel[k]`.
    Half {
        groups: Vec<u32>,
        rel: Vec<u16>,
    },
    Wide(Vec<u32>),
}

/// `start` as a u32 per group of `2^shift` buckets and a `T` per bucket relative to its
/// group, if every relative start fits a `T`.
fn relative<T: TryFrom<u32>>(start: &[u32], shift: u32) -> Option<(Vec<u32>, Vec<T>)> {
    let groups: Vec<u32> = (0..=((start.len() - 1) >> shift)).map(|g| start[g << shift]).collect();
    let mut rel = Vec::with_capacity(start.len());
    for (k, &s) in start.iter().enumerate() {
        rel.push(T::try_from(s - groups[k >> shift]).ok()?);
    }
    Some((groups, rel))
}

/// A sorted base (see the module doc). Positions are u32: at most 2^32 - 1 rows per part.
pub struct Base<W: Copy> {
    n: usize,
    dim: usize,
    bits: u32,
    /// Key width in bytes: 6 or 8.
    kw: usize,
    /// The bits of an ID a key keeps.
    mask: u64,
    keys: RawBuf<u8>,
    starts: Starts,
    values: RawBuf<W>,
}

fn floor_log2(n: usize) -> u32 {
    usize::BITS - 1 - n.max(1).leading_zeros()
}

impl<W: Elem + Pod> Base<W> {
    /// An empty base.
    pub fn empty(dim: usize) -> Self {
        Base::build(&[], RawBuf::default(), dim)
    }

    /// A base of `ids` (strictly ascending) and their `values` (`ids.len() * dim`, in the
    /// same order), which it takes over.
    pub fn build(ids: &[u64], values: RawBuf<W>, dim: usize) -> Self {
        let n = ids.len();
        assert!(n < u32::MAX as usize, "a part holds at most 2^32 - 1 rows");
        assert_eq!(values.len(), n * dim, "values of {n} rows of dim {dim}");
        debug_assert!(ids.windows(2).all(|w| w[0] < w[1]));
        let (bits, kw) = if n >= SHORT_KEYS_MIN_ROWS {
            (SHORT_KEYS_MIN_BITS.max(floor_log2(n) - ROWS_PER_BUCKET_LOG2), 6)
        } else {
            (floor_log2(n).saturating_sub(ROWS_PER_BUCKET_LOG2), 8)
        };
        let mask = if kw == 8 { u64::MAX } else { (1u64 << (8 * kw)) - 1 };
        let nb = 1usize << bits;
        // start(k) = the first position whose bucket is >= k.
        let mut start: Vec<u32> = Vec::with_capacity(nb + 1);
        let mut p = 0usize;
        for k in 0..=nb {
            while p < n && bucket_of(ids[p], bits) < k {
                p += 1;
            }
            start.push(p as u32);
        }
        let starts = if let Some((groups, rel)) = relative::<u8>(&start, BYTE_GROUP_SHIFT) {
            Starts::Byte { groups, rel }
        } else if let Some((groups, rel)) = relative::<u16>(&start, GROUP_SHIFT) {
            Starts::Half { groups, rel }
        } else {
            Starts::Wide(start)
        };
        let mut keys = RawBuf::<u8>::zeroed(n * kw + (8 - kw), n * kw >= crate::mem::MMAP_MIN);
        for (dst, &id) in keys.chunks_exact_mut(kw).zip(ids) {
            dst.copy_from_slice(&(id & mask).to_le_bytes()[..kw]);
        }
        Base { n, dim, bits, kw, mask, keys, starts, values }
    }

    pub fn len(&self) -> usize {
        self.n
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The bucket of `id`.
    #[inline(always)]
    pub fn bucket(&self, id: u64) -> usize {
        bucket_of(id, self.bits)
    }

    /// Positions `[lo, hi)` of bucket `k`'s IDs.
    #[inline(always)]
    pub fn range(&self, k: usize) -> (usize, usize) {
        match &self.starts {
            Starts::Byte { groups, rel } => (
                (groups[k >> BYTE_GROUP_SHIFT] + rel[k] as u32) as usize,
                (groups[(k + 1) >> BYTE_GROUP_SHIFT] + rel[k + 1] as u32) as usize,
            ),
            Starts::Half { groups, rel } => (
                (groups[k >> GROUP_SHIFT] + rel[k] as u32) as usize,
                (groups[(k + 1) >> GROUP_SHIFT] + rel[k + 1] as u32) as usize,
            ),
            Starts::Wide(s) => (s[k] as usize, s[k + 1] as usize),
        }
    }

    /// The key at position `p < n`.
    #[inline(always)]
    fn key(&self, p: usize) -> u64 {
        debug_assert!(p < self.n);
        // SAFETY: p < n, and `keys` holds n * kw + (8 - kw) bytes: the 8 bytes at p * kw
        // are in bounds. An unaligned read of plain bytes.
        let raw = unsafe { (self.keys.as_ptr().add(p * self.kw) as *const u64).read_unaligned() };
        u64::from_le(raw) & self.mask
    }

    /// Position of `id` among the positions `[lo, hi)` of its bucket.
    #[inline]
    pub fn search(&self, (mut lo, mut hi): (usize, usize), id: u64) -> Option<usize> {
        let key = id & self.mask;
        while hi - lo > 8 {
            let mid = (lo + hi) / 2;
            let k = self.key(mid);
            if k == key {
                return Some(mid);
            }
            if k < key {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        while lo < hi {
            let k = self.key(lo);
            if k >= key {
                return (k == key).then_some(lo);
            }
            lo += 1;
        }
        None
    }

    /// Position of `id`, if present.
    #[inline]
    pub fn find(&self, id: u64) -> Option<usize> {
        self.search(self.range(self.bucket(id)), id)
    }

    /// Hint: bucket `k`'s starts will be read (see `serving/lookup.rs`).
    #[inline(always)]
    pub fn prefetch_starts(&self, k: usize) {
        match &self.starts {
            Starts::Byte { groups, rel } => {
                prefetch(groups.as_ptr().wrapping_add(k >> BYTE_GROUP_SHIFT));
                prefetch(rel.as_ptr().wrapping_add(k));
            }
            Starts::Half { groups, rel } => {
                prefetch(groups.as_ptr().wrapping_add(k >> GROUP_SHIFT));
                prefetch(rel.as_ptr().wrapping_add(k));
            }
            Starts::Wide(s) => prefetch(s.as_ptr().wrapping_add(k)),
        }
    }

    /// Hint: the keys at positions `[lo, hi)` will be read (their first and last lines).
    #[inline(always)]
    pub fn prefetch_keys(&self, (lo, hi): (usize, usize)) {
        if lo < hi {
            prefetch(self.keys.as_ptr().wrapping_add(lo * self.kw));
            prefetch(self.keys.as_ptr().wrapping_add(hi * self.kw - 1));
        }
    }

    #[inline(always)]
    pub fn row(&self, p: usize) -> &[W] {
        &self.values[p * self.dim..(p + 1) * self.dim]
    }

    #[inline(always)]
    pub fn row_mut(&mut self, p: usize) -> &mut [W] {
        &mut self.values[p * self.dim..(p + 1) * self.dim]
    }

    /// Every ID, ascending (decoded from the buckets and keys).
    pub fn ids(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.n);
        for k in 0..(1usize << self.bits) {
            let (lo, hi) = self.range(k);
            let top = if self.kw == 8 { 0 } else { (k as u64) << (64 - self.bits) };
            out.extend((lo..hi).map(|p| top | self.key(p)));
        }
        out
    }

    /// Bytes allocated (capacities).
    pub fn memory_bytes(&self) -> usize {
        let starts = match &self.starts {
            Starts::Byte { groups, rel } => groups.capacity() * 4 + rel.capacity(),
            Starts::Half { groups, rel } => groups.capacity() * 4 + rel.capacity() * 2,
            Starts::Wide(s) => s.capacity() * 4,
        };
        self.keys.capacity() + starts + self.values.capacity() * std::mem::size_of::<W>() + std::mem::size_of::<Self>()
    }

    /// Bytes of the index alone (keys and starts), for tests and reports.
    #[cfg(test)]
    pub fn index_bytes(&self) -> usize {
        self.memory_bytes() - self.values.capacity() * std::mem::size_of::<W>() - std::mem::size_of::<Self>()
    }
}

/// The bucket of `id` among `2^bits` (its top `bits` bits; 0 when `bits` is 0).
#[inline(always)]
fn bucket_of(id: u64, bits: u32) -> usize {
    ((id >> 1) >> (63 - bits)) as usize
}
