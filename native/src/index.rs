//! Open-addressing hash index `id -> slot` for one internal shard.
//!
//! Each bucket is a single `u32`: the low `slot_bits` bits hold the slot, the
//! remaining high bits hold a tag taken from the placement hash, so a probe only
//! dereferences the id array for (almost always) true matches. Ids themselves
//! live in the shard's slab, so the index costs 4 bytes per bucket. Linear
//! probing, load factor <= 0.875, growth x1.25, backward-shift deletion (no
//! tombstones). The index is collisionless: every match is verified against
//! the stored id.

use crate::mem::RawBuf;

pub const EMPTY: u32 = u32::MAX;
const MAX_LOAD_NUM: usize = 7;
const MAX_LOAD_DEN: usize = 8;

#[derive(Default)]
pub struct Index {
    entries: RawBuf<u32>,
    slot_bits: u32,
    len: usize,
}

#[inline(always)]
fn bucket_of(h: u64, cap: usize) -> usize {
    (((h as u32) as u64 * cap as u64) >> 32) as usize
}

/// Number of bits so that every slot `< slot_limit` is strictly below the all-ones pattern.
#[inline]
pub fn bits_for(slot_limit: usize) -> u32 {
    let b = usize::BITS - slot_limit.leading_zeros();
    b.max(1)
}

impl Index {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn capacity(&self) -> usize {
        self.entries.len()
    }
    pub fn memory_bytes(&self) -> usize {
        self.entries.capacity() * 4
    }
    #[inline(always)]
    fn tag(&self, h: u64) -> u32 {
        ((h >> 32) as u32).wrapping_shl(self.slot_bits)
    }
    #[inline(always)]
    fn slot_mask(&self) -> u32 {
        ((1u64 << self.slot_bits) - 1) as u32
    }

    /// True if an insert with slots up to `slot_limit` (exclusive) needs a rebuild first.
    #[inline]
    pub fn needs_rebuild(&self, slot_limit: usize) -> bool {
        let cap = self.entries.len();
        cap == 0
            || (self.len + 1) * MAX_LOAD_DEN > cap * MAX_LOAD_NUM
            || slot_limit as u64 >= (1u64 << self.slot_bits) - 1
    }

    /// Rebuild with room for at least `min_len` entries and slots below `slot_limit`.
    /// `items` yields (slot, placement hash) of every live row.
    pub fn rebuild(&mut self, min_len: usize, slot_limit: usize, items: impl Iterator<Item = (u32, u64)>) {
        let mut cap = self.entries.len().max(8);
        while (min_len + 1) * MAX_LOAD_DEN > cap * MAX_LOAD_NUM {
            cap += cap / 4;
        }
        // Give the slot space 2x headroom so rebuilds for it stay rare.
        let bits = bits_for(slot_limit.saturating_mul(2).max(16)).min(31);
        self.slot_bits = bits;
        self.entries = RawBuf::default(); // free the old table before allocating the new one
                                          // Large indexes get a huge-page mapping; its rounded-up size is used as capacity.
        self.entries = RawBuf::filled(cap, EMPTY, true);
        self.len = 0;
        for (slot, h) in items {
            self.insert_new(slot, h);
        }
    }

    #[inline(always)]
    pub fn home(&self, h: u64) -> usize {
        bucket_of(h, self.entries.len())
    }

    /// Address of the home bucket (for prefetching).
    #[inline(always)]
    pub fn bucket_ptr(&self, h: u64) -> *const u32 {
        if self.entries.is_empty() {
            return std::ptr::null();
        }
        // SAFETY: home() < len.
        unsafe { self.entries.as_ptr().add(self.home(h)) }
    }

    /// First bucket candidate whose tag matches (or EMPTY if an empty bucket is hit first).
    /// Cheap: touches only the index. Must be verified with `find_from`.
    #[inline(always)]
    pub fn candidate(&self, h: u64) -> u32 {
        let cap = self.entries.len();
        if cap == 0 {
            return EMPTY;
        }
        let tag = self.tag(h);
        let mask = self.slot_mask();
        let mut i = bucket_of(h, cap);
        loop {
            // SAFETY: i < cap.
            let e = unsafe { *self.entries.get_unchecked(i) };
            if e == EMPTY {
                return EMPTY;
            }
            if (e & !mask) == tag {
                return e & mask;
            }
            i += 1;
            if i == cap {
                i = 0;
            }
        }
    }

    /// Full lookup; `id_of(slot)` returns the id stored in `slot`.
    #[inline(always)]
    pub fn find(&self, id: u64, h: u64, id_of: impl Fn(u32) -> u64) -> Option<u32> {
        let cap = self.entries.len();
        if cap == 0 {
            return None;
        }
        let tag = self.tag(h);
        let mask = self.slot_mask();
        let mut i = bucket_of(h, cap);
        loop {
            // SAFETY: i < cap.
            let e = unsafe { *self.entries.get_unchecked(i) };
            if e == EMPTY {
                return None;
            }
            if (e & !mask) == tag {
                let s = e & mask;
                if id_of(s) == id {
                    return Some(s);
                }
            }
            i += 1;
            if i == cap {
                i = 0;
            }
        }
    }

    /// Insert a key known to be absent. Caller guarantees `!needs_rebuild(slot+1)`.
    #[inline]
    pub fn insert_new(&mut self, slot: u32, h: u64) {
        let cap = self.entries.len();
        debug_assert!(cap > 0 && (slot as u64) < (1u64 << self.slot_bits) - 1);
        let e = self.tag(h) | slot;
        let mut i = bucket_of(h, cap);
        loop {
            if self.entries[i] == EMPTY {
                self.entries[i] = e;
                self.len += 1;
                return;
            }
            i += 1;
            if i == cap {
                i = 0;
            }
        }
    }

    /// Remove the entry of `slot` (whose placement hash is `h`).
    /// `hash_of(slot)` returns the placement hash of the row in another slot.
    pub fn remove(&mut self, slot: u32, h: u64, hash_of: impl Fn(u32) -> u64) -> bool {
        let cap = self.entries.len();
        if cap == 0 {
            return false;
        }
        let mask = self.slot_mask();
        let mut i = bucket_of(h, cap);
        loop {
            let e = self.entries[i];
            if e == EMPTY {
                return false;
            }
            if e & mask == slot {
                break;
            }
            i += 1;
            if i == cap {
                i = 0;
            }
        }
        // Backward-shift deletion.
        let mut j = i;
        loop {
            j += 1;
            if j == cap {
                j = 0;
            }
            let e = self.entries[j];
            if e == EMPTY {
                break;
            }
            let k = bucket_of(hash_of(e & mask), cap);
            // Entry at j may move to i iff its home k is not cyclically in (i, j].
            let stays = if i <= j { i < k && k <= j } else { i < k || k <= j };
            if !stays {
                self.entries[i] = e;
                i = j;
            }
        }
        self.entries[i] = EMPTY;
        self.len -= 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::internal_hash;
    use std::collections::HashMap;

    #[test]
    fn insert_find_remove_random() {
        let mut ids: Vec<u64> = Vec::new();
        let mut idx = Index::default();
        let mut live: HashMap<u64, u32> = HashMap::new();
        let mut rng = crate::hash::SplitMix64::new(7);
        for step in 0..20000u64 {
            let r = rng.next();
            let id = r % 3000; // many collisions of ids -> updates/removes
            if r >> 63 == 0 || live.len() < 10 {
                if !live.contains_key(&id) {
                    let slot = ids.len() as u32;
                    ids.push(id);
                    if idx.needs_rebuild(ids.len()) {
                        let items: Vec<(u32, u64)> =
                            live.values().map(|&s| (s, internal_hash(ids[s as usize]))).collect();
                        idx.rebuild(live.len() + 1, ids.len(), items.into_iter());
                    }
                    idx.insert_new(slot, internal_hash(id));
                    live.insert(id, slot);
                }
            } else if let Some(&slot) = live.get(&id) {
                let ids_ref = &ids;
                assert!(idx.remove(slot, internal_hash(id), |s| internal_hash(ids_ref[s as usize])));
                live.remove(&id);
            }
            if step % 997 == 0 {
                for q in 0..3000u64 {
                    let got = idx.find(q, internal_hash(q), |s| ids[s as usize]);
                    assert_eq!(got, live.get(&q).copied(), "id {q}");
                }
            }
        }
        assert_eq!(idx.len(), live.len());
    }
}
