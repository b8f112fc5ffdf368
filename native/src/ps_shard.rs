//! A PS shard's store as its native gRPC service serves it (`trillium_transport::ps::Shard`):
//! the job's store, set and cleared by the service as its jobs come and go, read by the lookups
//! of the server's thread without Python. Each row is read from its table once, into the frame
//! the answer carries.

use std::sync::{Arc, RwLock};

use bytes::Bytes;
use half::f16;
use trillium_transport::frame::{ArrayWriter, FrameElem};
use trillium_transport::pb;
use trillium_transport::ps::{Lookup, Rows, Shard, ShardError};

use crate::elem::OutElem;
use crate::store::Store;
use crate::table::Table;

/// Told of a shard's own failure (a disk tier that failed a lookup), before the caller is.
pub type OnFailure = Box<dyn Fn(&str) + Send + Sync>;

/// The tables of one attempt of a job, as the service set them up.
pub struct Served {
    pub store: Arc<Store>,
    pub job_id: String,
    pub attempt: i32,
}

pub struct ServedStore {
    /// The PS's name, for what a caller is told (`embedding_ps-0`).
    name: String,
    shard: i32,
    served: RwLock<Option<Arc<Served>>>,
    on_failure: OnFailure,
}

impl ServedStore {
    pub fn new(name: String, shard: i32, on_failure: OnFailure) -> Self {
        Self { name, shard, served: RwLock::new(None), on_failure }
    }

    /// Serve `served` from now on (None: no job's tables; lookups are UNAVAILABLE).
    ///
    /// **Locking behaviour:** takes the slot's write lock, which each lookup holds only to clone the Arc.
    pub fn serve(&self, served: Option<Served>) {
        *self.served.write().unwrap_or_else(|e| e.into_inner()) = served.map(Arc::new);
    }

    fn current(&self) -> Result<Arc<Served>, ShardError> {
        let served = self.served.read().unwrap_or_else(|e| e.into_inner()).clone();
        served.ok_or_else(|| ShardError::Unavailable(format!("{} holds no tables yet (no job set up)", self.name)))
    }

    /// The tables a lookup for attempt `attempt` of `job_id` may read: those served, when they
    /// are that attempt's. An earlier attempt is fenced out; a later one, or another job, is not
    /// set up here yet (the caller may try again).
    fn for_attempt(&self, job_id: &str, attempt: i32) -> Result<Arc<Store>, ShardError> {
        let served = self.current()?;
        let serving = || format!("{} serves attempt {} of job {}", self.name, served.attempt, served.job_id);
        if served.job_id != job_id || attempt > served.attempt {
            return Err(ShardError::Unavailable(format!("{}, not attempt {attempt} of job {job_id:?} yet", serving())));
        }
        if attempt < served.attempt {
            return Err(ShardError::Fenced(format!("{}: attempt {attempt} is fenced out", serving())));
        }
        Ok(served.store.clone())
    }
}

fn planned(store: &Store, lookup: &Lookup<'_>) -> Result<(Vec<Arc<Table>>, Vec<usize>), ShardError> {
    if lookup.tables.len() != lookup.counts.len() {
        return Err(ShardError::Invalid(format!("{} tables but {} counts", lookup.tables.len(), lookup.counts.len())));
    }
    let tables = lookup
        .tables
        .iter()
        .map(|n| store.table(n).map_err(|e| ShardError::Invalid(e.to_string())))
        .collect::<Result<Vec<_>, _>>()?;
    let counts = lookup
        .counts
        .iter()
        .map(|&n| usize::try_from(n).map_err(|_| ShardError::Invalid(format!("a count must be >= 0, got {n}"))))
        .collect::<Result<Vec<_>, _>>()?;
    // Checked sums: a hostile count cannot wrap around to fit.
    let total = counts.iter().try_fold(0usize, |sum, &n| sum.checked_add(n));
    if total != Some(lookup.ids.len()) {
        let names: Vec<&str> = tables.iter().map(|t| t.cfg.name.as_str()).collect();
        return Err(ShardError::Invalid(format!(
            "{} ids do not fit the counts {:?} of tables {names:?}",
            lookup.ids.len(),
            lookup.counts
        )));
    }
    Ok((tables, counts))
}

fn rows<O: OutElem + FrameElem>(
    store: &Store,
    tables: &[Arc<Table>],
    counts: &[usize],
    mut ids: &[u64],
    create: bool,
) -> Bytes {
    let total = tables.iter().zip(counts).map(|(t, n)| n * t.cfg.dim).sum();
    let mut frame = ArrayWriter::<O>::new(total);
    let mut rest = frame.values();
    for (t, &n) in tables.iter().zip(counts) {
        let (these, more) = std::mem::take(&mut rest).split_at_mut(n * t.cfg.dim);
        store.lookup(t, &ids[..n], these, create);
        (rest, ids) = (more, &ids[n..]);
    }
    frame.finish()
}

impl Shard for ServedStore {
    fn lookup(&self, lookup: Lookup<'_>) -> Result<Rows, ShardError> {
        let store = self.for_attempt(lookup.job_id, lookup.attempt)?;
        let (tables, counts) = planned(&store, &lookup)?;
        let frame = if lookup.fp16 {
            rows::<f16>(&store, &tables, &counts, lookup.ids, lookup.create)
        } else {
            rows::<f32>(&store, &tables, &counts, lookup.ids, lookup.create)
        };
        if let Some(error) = tables.iter().find_map(|t| t.tier_error()) {
            (self.on_failure)(&error);
            return Err(ShardError::Failed(error));
        }
        Ok(Rows { frame, dims: tables.iter().map(|t| t.cfg.dim as i64).collect() })
    }

    fn may_block(&self) -> bool {
        self.current().is_ok_and(|s| s.store.tables_ordered().iter().any(|t| t.cfg.has_disk_tier()))
    }

    fn stats(&self) -> Result<pb::ShardStatsResponse, ShardError> {
        let tables = match self.current() {
            Ok(served) => served.store.tables_ordered().iter().map(|t| table_stats(t)).collect(),
            Err(_) => vec![], // no job's tables: none to tell of
        };
        Ok(pb::ShardStatsResponse { shard: self.shard, tables })
    }
}

fn table_stats(t: &Table) -> pb::TableStats {
    let rows = t.rows() as u64;
    let c = &t.counters;
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    let disk = t.disk_stats();
    let sum = |f: fn(&crate::table::DiskStats) -> u64| disk.iter().map(f).sum::<u64>();
    pb::TableStats {
        table: t.cfg.name.clone(),
        rows,
        memory_bytes: t.memory_bytes() as u64,
        admitted: load(&c.admitted),
        evicted: load(&c.evicted),
        expired: load(&c.expired),
        nan_grads_skipped: load(&c.nan_grads_skipped),
        // Without a disk tier every row is resident and none is on disk.
        resident_rows: if disk.is_empty() { rows } else { sum(|s| s.resident_rows) },
        disk_rows: sum(|s| s.rows),
        disk_bytes: sum(|s| s.bytes),
        disk_lookup_hits: sum(|s| s.lookup_hits),
        lookups: load(&c.lookups),
    }
}
