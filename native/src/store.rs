//! The embedding store: named tables, a private thread pool and the version clock.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::{Mutex, RwLock};

use crate::config::{Result, StoreError, TableConfig};
use crate::elem::OutElem;
use crate::table::{RowState, Table};

/// Store-wide monotonically increasing version. Every update batch (and every
/// `set_row`) takes the next version; `committed()` is the largest version
/// such that all batches with versions <= it have finished.
pub struct VersionClock {
    next: AtomicU64,
    inflight: Mutex<BTreeSet<u64>>,
}

impl Default for VersionClock {
    fn default() -> Self {
        VersionClock { next: AtomicU64::new(1), inflight: Mutex::new(BTreeSet::new()) }
    }
}

impl VersionClock {
    pub fn begin(&self) -> u64 {
        let mut g = self.inflight.lock();
        let v = self.next.fetch_add(1, Ordering::SeqCst);
        g.insert(v);
        v
    }
    pub fn end(&self, v: u64) {
        self.inflight.lock().remove(&v);
    }
    pub fn committed(&self) -> u64 {
        let g = self.inflight.lock();
        match g.first() {
            Some(m) => m - 1,
            None => self.next.load(Ordering::SeqCst) - 1,
        }
    }
    /// Version stamped on rows created by lookups: the version the next update
    /// batch will take (so `export_delta(since=committed())` includes them).
    pub fn pending(&self) -> u64 {
        self.next.load(Ordering::SeqCst)
    }
    pub fn next_value(&self) -> u64 {
        self.next.load(Ordering::SeqCst)
    }
    pub fn advance_to(&self, next: u64) {
        let _g = self.inflight.lock();
        self.next.fetch_max(next, Ordering::SeqCst);
    }
}

struct VersionGuard<'a> {
    clock: &'a VersionClock,
    v: u64,
}
impl Drop for VersionGuard<'_> {
    fn drop(&mut self) {
        self.clock.end(self.v);
    }
}

/// Current UNIX time in whole seconds (saturating into u32).
pub fn now_secs() -> u32 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs().min(u32::MAX as u64) as u32).unwrap_or(0)
}

#[derive(Default)]
pub struct Registry {
    pub map: HashMap<String, Arc<Table>>,
    pub order: Vec<String>,
}

pub struct Store {
    pub tables: RwLock<Registry>,
    pub pool: rayon::ThreadPool,
    pub threads: usize,
    pub num_shards: usize,
    pub clock: VersionClock,
}

pub fn default_threads() -> usize {
    if let Some(n) = std::env::var("RAYON_NUM_THREADS").ok().and_then(|s| s.trim().parse::<usize>().ok()) {
        if n > 0 {
            return n;
        }
    }
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

impl Store {
    pub fn new(num_shards: Option<usize>, threads: Option<usize>) -> Result<Self> {
        let threads = match threads {
            Some(0) => return Err(StoreError::Value("threads must be >= 1".into())),
            Some(t) if t > 1024 => return Err(StoreError::Value("threads must be <= 1024".into())),
            Some(t) => t,
            None => default_threads(),
        };
        let num_shards = match num_shards {
            Some(0) => return Err(StoreError::Value("num_internal_shards must be >= 1".into())),
            Some(n) if n > 65536 => return Err(StoreError::Value("num_internal_shards must be <= 65536".into())),
            Some(n) => n,
            None => (4 * threads).max(16).next_power_of_two(),
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("trillium-native-{i}"))
            .build()
            .map_err(|e| StoreError::Value(format!("cannot start thread pool: {e}")))?;
        Ok(Store {
            tables: RwLock::new(Registry::default()),
            pool,
            threads,
            num_shards,
            clock: VersionClock::default(),
        })
    }

    /// **Locking behaviour:** the table registry's write lock (no shard lock).
    pub fn create_table(&self, cfg: TableConfig) -> Result<()> {
        cfg.validate()?;
        let mut reg = self.tables.write();
        if reg.map.contains_key(&cfg.name) {
            return Err(StoreError::Value(format!("table {:?} already exists", cfg.name)));
        }
        let name = cfg.name.clone();
        let t = Table::new(cfg, self.num_shards)?;
        reg.map.insert(name.clone(), Arc::new(t));
        reg.order.push(name);
        Ok(())
    }

    /// **Locking behaviour:** the table registry's write lock (no shard lock); a capture or
    /// dump that listed the table keeps its `Arc` and finishes with it.
    pub fn drop_table(&self, name: &str) -> Result<()> {
        let mut reg = self.tables.write();
        if reg.map.remove(name).is_none() {
            return Err(unknown(name));
        }
        reg.order.retain(|n| n != name);
        Ok(())
    }

    pub fn table(&self, name: &str) -> Result<Arc<Table>> {
        self.tables.read().map.get(name).cloned().ok_or_else(|| unknown(name))
    }

    pub fn table_names(&self) -> Vec<String> {
        self.tables.read().order.clone()
    }

    pub fn tables_ordered(&self) -> Vec<Arc<Table>> {
        let reg = self.tables.read();
        reg.order.iter().map(|n| reg.map[n].clone()).collect()
    }

    /// Run `f` on the store's pool; a single-threaded store runs it inline on
    /// the calling thread (no hand-off to a worker).
    pub fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        if self.threads == 1 {
            f()
        } else {
            self.pool.install(f)
        }
    }

    fn ctx_for<'a>(&self, t: &'a Table, version: u64, batch: u32) -> crate::table::Ctx<'a> {
        let mut ctx = t.ctx(version, now_secs(), batch);
        ctx.sequential = self.threads == 1;
        ctx
    }

    /// **Locking behaviour:** as `Table::lookup` (see `run` for where it runs); no registry lock.
    pub fn lookup<O: OutElem>(&self, t: &Table, ids: &[u64], out: &mut [O], create: bool) {
        let batch = t.counters.update_batches.load(Ordering::Relaxed) as u32;
        let ctx = self.ctx_for(t, self.clock.pending(), batch);
        self.run(|| t.lookup(&ctx, ids, out, create));
    }

    /// **Locking behaviour:** as `Table::update` (see `run` for where it runs); no registry lock.
    pub fn update(&self, t: &Table, ids: &[u64], grads: &[f32]) -> u64 {
        let v = self.clock.begin();
        let _g = VersionGuard { clock: &self.clock, v };
        let b = t.counters.update_batches.fetch_add(1, Ordering::Relaxed) + 1;
        let ctx = self.ctx_for(t, v, b as u32);
        self.run(|| t.update(&ctx, ids, grads))
    }

    /// **Locking behaviour:** as `Table::set_row`, on the calling thread.
    pub fn set_row(&self, t: &Table, id: u64, values: &[f32]) -> Result<()> {
        let v = self.clock.begin();
        let _g = VersionGuard { clock: &self.clock, v };
        let batch = t.counters.update_batches.load(Ordering::Relaxed) as u32;
        let ctx = t.ctx(v, now_secs(), batch);
        t.set_row(&ctx, id, values)
    }

    /// **Locking behaviour:** as `Table::get_state`, on the calling thread.
    pub fn get_state(&self, t: &Table, id: u64) -> Option<RowState> {
        t.get_state(id)
    }

    /// Rows of `t` changed after `since`; returns (ids, rows, current_version).
    ///
    /// **Locking behaviour:** as `Table::export_delta`, on the store's pool.
    pub fn export_delta(&self, t: &Table, since: u64) -> (Vec<u64>, Vec<f32>, u64) {
        // Read the committed version *before* scanning: every change with a
        // version <= current is then guaranteed to be visible in the scan.
        let current = self.clock.committed();
        let (ids, rows) = self.pool.install(|| t.export_delta(since));
        (ids, rows, current)
    }

    /// Remove `t`'s rows past their TTL as of `now` (default: the clock); returns how many.
    ///
    /// **Locking behaviour:** as `Table::expire`, on the store's pool.
    pub fn expire(&self, t: &Table, now: Option<u32>) -> u64 {
        let batch = t.counters.update_batches.load(Ordering::Relaxed) as u32;
        let ctx = t.ctx(self.clock.pending(), now.unwrap_or_else(now_secs), batch);
        self.pool.install(|| t.expire(&ctx))
    }

    /// Remove the rows of `ids` from `t`, resident or on disk; returns how many there were.
    ///
    /// **Locking behaviour:** as `Table::forget` (see `run` for where it runs); no registry lock.
    pub fn forget(&self, t: &Table, ids: &[u64]) -> u64 {
        let sequential = self.threads == 1;
        self.run(|| t.forget(ids, sequential))
    }

    pub fn version(&self) -> u64 {
        self.clock.committed()
    }
}

pub fn unknown(name: &str) -> StoreError {
    StoreError::Key(format!("unknown table {name:?}"))
}
