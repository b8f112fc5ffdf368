//! Per-table event counters (atomics shared by every shard task) and `Local`, the counts
//! one shard task accumulates before adding them to its table's.

use std::sync::atomic::{AtomicU64, Ordering};

/// Atomic per-table counters.
#[derive(Default)]
pub struct Counters {
    pub admitted: AtomicU64,
    pub not_admitted: AtomicU64,
    pub evicted: AtomicU64,
    pub expired: AtomicU64,
    pub nan_grads_skipped: AtomicU64,
    pub lookups: AtomicU64,
    pub updates: AtomicU64,
    pub dropped_grads: AtomicU64,
    pub update_batches: AtomicU64,
}

pub const COUNTER_NAMES: [&str; 9] = [
    "admitted",
    "not_admitted",
    "evicted",
    "expired",
    "nan_grads_skipped",
    "lookups",
    "updates",
    "dropped_grads",
    "update_batches",
];

impl Counters {
    fn all(&self) -> [&AtomicU64; 9] {
        [
            &self.admitted,
            &self.not_admitted,
            &self.evicted,
            &self.expired,
            &self.nan_grads_skipped,
            &self.lookups,
            &self.updates,
            &self.dropped_grads,
            &self.update_batches,
        ]
    }
    pub fn snapshot(&self) -> [u64; 9] {
        let a = self.all();
        std::array::from_fn(|i| a[i].load(Ordering::Relaxed))
    }
    pub fn add_all(&self, v: &[u64; 9]) {
        for (c, x) in self.all().iter().zip(v) {
            c.fetch_add(*x, Ordering::Relaxed);
        }
    }
    pub(super) fn add_local(&self, l: &Local) {
        let f = |c: &AtomicU64, v: u64| {
            if v != 0 {
                c.fetch_add(v, Ordering::Relaxed);
            }
        };
        f(&self.admitted, l.admitted);
        f(&self.not_admitted, l.not_admitted);
        f(&self.evicted, l.evicted);
        f(&self.expired, l.expired);
        f(&self.nan_grads_skipped, l.nan);
        f(&self.updates, l.updated);
        f(&self.dropped_grads, l.dropped);
    }
}

/// Counters accumulated by one shard task.
#[derive(Default, Clone, Copy, Debug)]
pub struct Local {
    pub admitted: u64,
    pub not_admitted: u64,
    pub evicted: u64,
    pub expired: u64,
    pub nan: u64,
    pub updated: u64,
    pub dropped: u64,
}

impl std::ops::Add for Local {
    type Output = Local;
    fn add(self, o: Local) -> Local {
        Local {
            admitted: self.admitted + o.admitted,
            not_admitted: self.not_admitted + o.not_admitted,
            evicted: self.evicted + o.evicted,
            expired: self.expired + o.expired,
            nan: self.nan + o.nan,
            updated: self.updated + o.updated,
            dropped: self.dropped + o.dropped,
        }
    }
}
