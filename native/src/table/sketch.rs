//! The count-min sketch of threshold admission: one per table, shared by all its internal
//! shards without a lock (relaxed atomic counters).

use std::sync::atomic::{AtomicU32, Ordering};

use crate::hash::{mix64, SKETCH_SALT};

/// Count-min sketch for frequency admission (shared by all internal shards).
pub struct Sketch {
    pub width: usize,
    pub depth: usize,
    pub counters: Vec<AtomicU32>,
}

impl Sketch {
    pub fn new(width: usize, depth: usize) -> Self {
        let mut counters = Vec::with_capacity(width * depth);
        counters.resize_with(width * depth, || AtomicU32::new(0));
        Sketch { width, depth, counters }
    }
    #[inline]
    fn cells(&self, id: u64) -> impl Iterator<Item = usize> + '_ {
        let h = mix64(id ^ SKETCH_SALT);
        let h1 = h as u32 as usize;
        let h2 = ((h >> 32) as u32 | 1) as usize;
        let mask = self.width - 1;
        (0..self.depth).map(move |i| i * self.width + (h1.wrapping_add(i.wrapping_mul(h2)) & mask))
    }
    /// Add `m` sightings of `id`; returns the new (over-)estimate of its count.
    pub fn add(&self, id: u64, m: u32) -> u32 {
        let mut est = u32::MAX;
        for c in self.cells(id) {
            let cell = &self.counters[c];
            let mut cur = cell.load(Ordering::Relaxed);
            loop {
                let new = cur.saturating_add(m);
                match cell.compare_exchange_weak(cur, new, Ordering::Relaxed, Ordering::Relaxed) {
                    Ok(_) => {
                        cur = new;
                        break;
                    }
                    Err(x) => cur = x,
                }
            }
            est = est.min(cur);
        }
        est
    }
    pub fn estimate(&self, id: u64) -> u32 {
        self.cells(id).map(|c| self.counters[c].load(Ordering::Relaxed)).min().unwrap_or(0)
    }
    pub fn memory_bytes(&self) -> usize {
        self.counters.capacity() * 4
    }
}
