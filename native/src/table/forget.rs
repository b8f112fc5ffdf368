//! Forgetting IDs (a right to be forgotten, GDPR Art. 17): the rows of given IDs leave the
//! table wherever they are, resident (`Shard::remove_slot`) or cold in a disk tier
//! (`Tier::take`, whose record slot a capture in progress keeps pinned until it is done).
//!
//! A removal is not an event of the 9 persisted counters (no eviction, no expiry): the table
//! counts it in `Table::forgotten`, which only a `CaptureMark` reads, so that the next capture
//! since a mark is a full one (a delta cannot say that a row is gone). The admission sketch
//! is left as it is: it holds hashed sighting counts shared by many IDs, no ID, and a
//! count-min cell cannot be decremented for one ID without under-counting the others.

use std::sync::atomic::Ordering;

use rayon::prelude::*;

use crate::elem::Elem;
use crate::with_shards;

use super::{Group, Layout, Plan, Shard, Table};

impl<W: Elem> Shard<W> {
    /// Remove the rows of the group's IDs, resident or cold; returns how many there were.
    pub(super) fn forget(&mut self, l: &Layout, g: &Group) -> u64 {
        let mut n = 0;
        for k in 0..g.len() {
            if let Some(slot) = self.find(l, g.id[k], g.hash[k]) {
                self.remove_slot(l, slot);
                n += 1;
            } else if self.tier.as_mut().is_some_and(|t| t.take(g.id[k]).is_some()) {
                n += 1;
            }
        }
        n
    }
}

impl Table {
    /// Remove the rows of `ids` (IDs the table lacks, and repeats, are skipped); returns the
    /// number of rows removed and adds it to `forgotten`. A forgotten ID looked up again
    /// is a new row (its initial value, fresh optimizer state). Run inside a rayon pool
    /// unless `sequential`.
    ///
    /// **Locking behaviour:** one task per internal shard with IDs in the batch, each under
    /// that shard's *write* lock (never two shard locks on one thread).
    pub fn forget(&self, ids: &[u64], sequential: bool) -> u64 {
        let ns = self.num_shards();
        let plan = Plan::new(ids, ns, sequential);
        let l = &self.layout;
        let n: u64 = with_shards!(&self.shards, shards => {
            let one = |s: usize| {
                let g = plan.group(s);
                if g.is_empty() { 0 } else { shards[s].write().forget(l, &g) }
            };
            if sequential { (0..ns).map(one).sum() } else { (0..ns).into_par_iter().map(one).sum() }
        });
        // After every removal (Release): a capture that reads the new count (Acquire) before it
        // copies sees none of these rows.
        self.forgotten.fetch_add(n, Ordering::Release);
        n
    }
}
