//! Bindings of the embedding store (`EmbeddingStore`).

use std::path::PathBuf;
use std::sync::Arc;

use half::f16;
use numpy::{Ix1, Ix2, PyArray1, PyArray2, PyArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::snapshot::{written, PyCapture, PyCaptureMark};
use super::store_tables;
use super::{extract_u64, get_array, guard, nonneg, opt_nonneg, to_py};
use crate::config::{AdmissionKind, DType, InitKind, OptKind, TableConfig};
use crate::snapshot;
use crate::store::Store;
use crate::table::{Table, COUNTER_NAMES};

/// Native embedding store: named tables of `dim`-float rows keyed by uint64 ids.
#[pyclass(name = "EmbeddingStore", module = "trillium_native", frozen)]
pub struct PyStore {
    pub(super) store: Arc<Store>,
}

impl PyStore {
    /// The table `name`; an OSError if its disk tier failed (sticky: see `tier_ok`).
    fn table(&self, name: &str) -> PyResult<Arc<Table>> {
        let t = self.store.table(name).map_err(to_py)?;
        tier_ok(&t)?;
        Ok(t)
    }
}

/// An OSError naming the table and the spill file if the table's disk tier failed (a full
/// disk, an I/O error): raised by the call that failed and every later one.
fn tier_ok(t: &Table) -> PyResult<()> {
    match t.tier_error() {
        Some(e) => Err(pyo3::exceptions::PyOSError::new_err(e)),
        None => Ok(()),
    }
}

#[pymethods]
impl PyStore {
    #[new]
    #[pyo3(signature = (num_internal_shards=None, threads=None))]
    fn new(num_internal_shards: Option<i64>, threads: Option<i64>) -> PyResult<Self> {
        let ns = match num_internal_shards {
            Some(n) if n < 1 => {
                return Err(PyValueError::new_err(format!("num_internal_shards must be >= 1, got {n}")))
            }
            Some(n) => Some(n as usize),
            None => None,
        };
        let th = match threads {
            Some(n) if n < 1 => return Err(PyValueError::new_err(format!("threads must be >= 1, got {n}"))),
            Some(n) => Some(n as usize),
            None => None,
        };
        let store = guard(|| Store::new(ns, th))?;
        Ok(PyStore { store: Arc::new(store) })
    }

    #[pyo3(signature = (
        name, dim, *, dtype="fp32", initializer="uniform", init_low=-0.01, init_high=0.01,
        init_mean=0.0, init_std=0.01, seed=None, optimizer="sgd", lr=0.01, weight_decay=0.0,
        eps=1e-8, beta1=0.9, beta2=0.999, initial_accumulator=0.0, ftrl_alpha=0.05,
        ftrl_beta=1.0, ftrl_l1=0.0, ftrl_l2=0.0, weight_bound=None, admission="off",
        admission_probability=1.0, admission_threshold=0, admission_sketch_width=1048576,
        admission_sketch_depth=4, capacity=None, ttl_seconds=None, ttl_updates=None,
        memory_budget_bytes=None, disk=None
    ))]
    // One argument per keyword of the Python signature above (create_table's options).
    #[allow(clippy::too_many_arguments)]
    fn create_table(
        &self,
        name: &str,
        dim: i64,
        dtype: &str,
        initializer: &str,
        init_low: f64,
        init_high: f64,
        init_mean: f64,
        init_std: f64,
        seed: Option<&Bound<'_, PyAny>>,
        optimizer: &str,
        lr: f64,
        weight_decay: f64,
        eps: f64,
        beta1: f64,
        beta2: f64,
        initial_accumulator: f64,
        ftrl_alpha: f64,
        ftrl_beta: f64,
        ftrl_l1: f64,
        ftrl_l2: f64,
        weight_bound: Option<f64>,
        admission: &str,
        admission_probability: f64,
        admission_threshold: i64,
        admission_sketch_width: i64,
        admission_sketch_depth: i64,
        capacity: Option<i64>,
        ttl_seconds: Option<i64>,
        ttl_updates: Option<i64>,
        memory_budget_bytes: Option<i64>,
        disk: Option<PathBuf>,
    ) -> PyResult<()> {
        if dim < 1 {
            return Err(PyValueError::new_err(format!("dim must be >= 1, got {dim}")));
        }
        let mut c = TableConfig::new(name, dim as usize);
        c.dtype = DType::parse(dtype).map_err(to_py)?;
        c.initializer = InitKind::parse(initializer).map_err(to_py)?;
        c.init_low = init_low;
        c.init_high = init_high;
        c.init_mean = init_mean;
        c.init_std = init_std;
        c.seed = match seed {
            None => 0,
            Some(s) => match s.extract::<u64>() {
                Ok(v) => v,
                Err(_) => match s.extract::<i64>() {
                    Ok(v) => v as u64,
                    Err(_) => {
                        return Err(PyTypeError::new_err(format!("seed must be an int in [-2**63, 2**64), got {s}")))
                    }
                },
            },
        };
        c.optimizer = OptKind::parse(optimizer).map_err(to_py)?;
        c.lr = lr;
        c.weight_decay = weight_decay;
        c.eps = eps;
        c.beta1 = beta1;
        c.beta2 = beta2;
        c.initial_accumulator = initial_accumulator;
        c.ftrl_alpha = ftrl_alpha;
        c.ftrl_beta = ftrl_beta;
        c.ftrl_l1 = ftrl_l1;
        c.ftrl_l2 = ftrl_l2;
        c.weight_bound = weight_bound;
        c.admission = AdmissionKind::parse(admission).map_err(to_py)?;
        c.admission_probability = admission_probability;
        let thr = nonneg(admission_threshold, "admission_threshold")?;
        c.admission_threshold =
            u32::try_from(thr).map_err(|_| PyValueError::new_err("admission_threshold must be < 2**32"))?;
        let w = nonneg(admission_sketch_width, "admission_sketch_width")?;
        c.sketch_width = u32::try_from(w).map_err(|_| PyValueError::new_err("admission_sketch_width is too large"))?;
        let d = nonneg(admission_sketch_depth, "admission_sketch_depth")?;
        c.sketch_depth = u32::try_from(d).map_err(|_| PyValueError::new_err("admission_sketch_depth is too large"))?;
        c.capacity = opt_nonneg(capacity, "capacity")?;
        c.ttl_seconds = opt_nonneg(ttl_seconds, "ttl_seconds")?;
        c.ttl_updates = opt_nonneg(ttl_updates, "ttl_updates")?;
        c.memory_budget_bytes = memory_budget_bytes.map(|b| nonneg(b, "memory_budget_bytes")).transpose()?;
        c.disk = disk.map(|p| p.to_string_lossy().into_owned());
        guard(|| self.store.create_table(c))
    }

    /// Remove a table and free its memory.
    fn drop_table(&self, name: &str) -> PyResult<()> {
        guard(|| self.store.drop_table(name))
    }

    fn tables(&self) -> Vec<String> {
        self.store.table_names()
    }

    fn __contains__(&self, name: &str) -> bool {
        self.store.table(name).is_ok()
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        let tables = self.store.tables_ordered();
        py.detach(|| tables.iter().map(|t| t.rows()).sum())
    }

    fn num_rows(&self, py: Python<'_>, table: &str) -> PyResult<usize> {
        let t = self.table(table)?;
        Ok(py.detach(|| t.rows()))
    }

    #[pyo3(signature = (table=None))]
    fn memory_bytes(&self, py: Python<'_>, table: Option<&str>) -> PyResult<usize> {
        let tables = match table {
            Some(n) => vec![self.table(n)?],
            None => self.store.tables_ordered(),
        };
        Ok(py.detach(|| tables.iter().map(|t| t.memory_bytes()).sum()))
    }

    #[getter]
    fn version(&self) -> u64 {
        self.store.version()
    }

    #[getter]
    fn threads(&self) -> usize {
        self.store.threads
    }

    #[getter]
    fn num_internal_shards(&self) -> usize {
        self.store.num_shards
    }

    fn __repr__(&self) -> String {
        format!(
            "EmbeddingStore(tables={:?}, threads={}, num_internal_shards={}, version={})",
            self.store.table_names(),
            self.store.threads,
            self.store.num_shards,
            self.store.version()
        )
    }

    #[pyo3(signature = (table, ids, *, create=true, out_dtype="float32"))]
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        table: &str,
        ids: &Bound<'py, PyAny>,
        create: bool,
        out_dtype: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        let t = self.table(table)?;
        let ids = get_array::<u64, Ix1>(py, ids, "ids", "uint64", 1)?;
        let ids_s = ids.slice()?;
        let n = ids_s.len();
        let dim = t.cfg.dim;
        let store = &*self.store;
        match out_dtype {
            "float32" | "fp32" | "f32" => {
                // SAFETY: every element is written by the lookup before the array is returned.
                let out = unsafe { PyArray2::<f32>::new(py, [n, dim], false) };
                if n > 0 {
                    // SAFETY: the array was just created, is C-contiguous, and not shared yet.
                    let o = unsafe { std::slice::from_raw_parts_mut(out.data(), n * dim) };
                    py.detach(|| {
                        guard(|| {
                            store.lookup(&t, ids_s, o, create);
                            Ok(())
                        })
                    })?;
                    tier_ok(&t)?;
                }
                Ok(out.into_any())
            }
            "float16" | "fp16" | "f16" => {
                // SAFETY: as above.
                let out = unsafe { PyArray2::<f16>::new(py, [n, dim], false) };
                if n > 0 {
                    // SAFETY: as above.
                    let o = unsafe { std::slice::from_raw_parts_mut(out.data(), n * dim) };
                    py.detach(|| {
                        guard(|| {
                            store.lookup(&t, ids_s, o, create);
                            Ok(())
                        })
                    })?;
                    tier_ok(&t)?;
                }
                Ok(out.into_any())
            }
            other => {
                Err(PyValueError::new_err(format!("unknown out_dtype {other:?}: expected 'float32' or 'float16'")))
            }
        }
    }

    fn update<'py>(
        &self,
        py: Python<'py>,
        table: &str,
        ids: &Bound<'py, PyAny>,
        grads: &Bound<'py, PyAny>,
    ) -> PyResult<u64> {
        let t = self.table(table)?;
        let ids = get_array::<u64, Ix1>(py, ids, "ids", "uint64", 1)?;
        let grads = get_array::<f32, Ix2>(py, grads, "grads", "float32", 2)?;
        let ids_s = ids.slice()?;
        let shape = grads.shape();
        let dim = t.cfg.dim;
        if shape[0] != ids_s.len() || shape[1] != dim {
            return Err(PyValueError::new_err(format!(
                "grads must have shape ({}, {dim}) for {} ids in table {table:?} (dim={dim}), got {:?}",
                ids_s.len(),
                ids_s.len(),
                shape
            )));
        }
        let g = grads.slice()?;
        let store = &*self.store;
        let n = py.detach(|| guard(|| Ok(store.update(&t, ids_s, g))))?;
        tier_ok(&t)?;
        Ok(n)
    }

    /// Every table's rows of one request: `ids` holds `counts[i]` IDs of `tables[i]` in turn; the
    /// rows come back in that order as one flat array, with each table's dim.
    #[pyo3(signature = (tables, counts, ids, *, create=true, out_dtype="float32"))]
    fn lookup_tables<'py>(
        &self,
        py: Python<'py>,
        tables: Vec<String>,
        counts: Vec<i64>,
        ids: &Bound<'py, PyAny>,
        create: bool,
        out_dtype: &str,
    ) -> PyResult<(Bound<'py, PyAny>, Vec<usize>)> {
        let tables = tables.iter().map(|n| self.table(n)).collect::<PyResult<Vec<_>>>()?;
        let counts = counts.iter().map(|&n| Ok(nonneg(n, "a count")? as usize)).collect::<PyResult<Vec<_>>>()?;
        store_tables::lookup_tables(py, &self.store, &tables, &counts, ids, create, out_dtype)
    }

    fn get_row<'py>(
        &self,
        py: Python<'py>,
        table: &str,
        id: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyArray1<f32>>>> {
        let t = self.table(table)?;
        let id = extract_u64(id, "id")?;
        let st = guard(|| Ok(t.get_state(id)))?;
        Ok(st.map(|s| PyArray1::from_vec(py, s.weights)))
    }

    /// Full row state for debugging: weights, optimizer state, version, ...
    fn get_row_state<'py>(
        &self,
        py: Python<'py>,
        table: &str,
        id: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let t = self.table(table)?;
        let id = extract_u64(id, "id")?;
        let st = match guard(|| Ok(t.get_state(id)))? {
            Some(s) => s,
            None => return Ok(None),
        };
        let d = PyDict::new(py);
        let dim = t.cfg.dim;
        d.set_item("weights", PyArray1::from_vec(py, st.weights))?;
        match t.cfg.optimizer {
            OptKind::Sgd => {}
            OptKind::Adagrad => d.set_item("accumulator", PyArray1::from_vec(py, st.state))?,
            OptKind::RowwiseAdagrad => d.set_item("accumulator", st.acc.unwrap_or(0.0))?,
            OptKind::Adam => {
                d.set_item("m", PyArray1::from_slice(py, &st.state[..dim]))?;
                d.set_item("v", PyArray1::from_slice(py, &st.state[dim..]))?;
                d.set_item("step", st.step.unwrap_or(0))?;
            }
            OptKind::Ftrl => {
                d.set_item("z", PyArray1::from_slice(py, &st.state[..dim]))?;
                d.set_item("n", PyArray1::from_slice(py, &st.state[dim..]))?;
            }
        }
        d.set_item("version", st.version)?;
        if let Some(u) = st.utime {
            d.set_item("update_time", u)?;
        }
        if let Some(u) = st.utick {
            d.set_item("update_batch", u)?;
        }
        Ok(Some(d))
    }

    fn set_row<'py>(
        &self,
        py: Python<'py>,
        table: &str,
        id: &Bound<'py, PyAny>,
        values: &Bound<'py, PyAny>,
    ) -> PyResult<()> {
        let t = self.table(table)?;
        let id = extract_u64(id, "id")?;
        let dim = t.cfg.dim;
        let np = py.import("numpy")?;
        let arr = np
            .call_method1("asarray", (values,))
            .map_err(|_| PyTypeError::new_err("values must be array-like of floats"))?;
        let arr = np
            .call_method1("ascontiguousarray", (arr, "float32"))
            .map_err(|e| PyTypeError::new_err(format!("values must be convertible to float32: {e}")))?;
        let v = get_array::<f32, Ix1>(py, &arr, "values", "float32", 1)?;
        let s = v.slice()?;
        if s.len() != dim {
            return Err(PyValueError::new_err(format!("values must have shape ({dim},), got ({},)", s.len())));
        }
        if !s.iter().all(|x| x.is_finite()) {
            return Err(PyValueError::new_err("values must be finite"));
        }
        let store = &*self.store;
        guard(|| store.set_row(&t, id, s))
    }

    /// Remove the rows of `ids` from `table`, resident or on disk; returns how many there were
    /// (see `Table::forget`). Not refused on a failed disk tier: removing reads and writes no
    /// record.
    fn forget<'py>(&self, py: Python<'py>, table: &str, ids: &Bound<'py, PyAny>) -> PyResult<u64> {
        let t = self.store.table(table).map_err(to_py)?;
        let ids = get_array::<u64, Ix1>(py, ids, "ids", "uint64", 1)?;
        let ids_s = ids.slice()?;
        let store = &*self.store;
        py.detach(|| guard(|| Ok(store.forget(&t, ids_s))))
    }

    /// Point-in-time copy of the whole store (see `snapshot::Capture::new`), or with `since`
    /// of what changed after that mark (`snapshot::Capture::since`).
    #[pyo3(signature = (since=None))]
    fn capture(&self, py: Python<'_>, since: Option<PyRef<'_, PyCaptureMark>>) -> PyResult<PyCapture> {
        let store = &*self.store;
        let mark = since.map(|m| m.inner.clone());
        py.detach(|| {
            guard(|| {
                Ok(match &mark {
                    Some(m) => snapshot::Capture::since(store, m),
                    None => snapshot::Capture::new(store),
                })
            })
        })
        .map(PyCapture::new)
    }

    fn dump(&self, py: Python<'_>, path: PathBuf) -> PyResult<(u64, String)> {
        let store = &*self.store;
        py.detach(|| guard(|| snapshot::write_snapshot(store, &path))).map(written)
    }

    #[pyo3(signature = (path, shard_index=None, num_shards=None))]
    fn load(&self, py: Python<'_>, path: PathBuf, shard_index: Option<i64>, num_shards: Option<i64>) -> PyResult<()> {
        let filter = match (shard_index, num_shards) {
            (None, None) => None,
            (Some(i), Some(n)) => {
                if n < 1 || n > u32::MAX as i64 {
                    return Err(PyValueError::new_err(format!("num_shards must be in [1, 2**32), got {n}")));
                }
                if i < 0 || i >= n {
                    return Err(PyValueError::new_err(format!("shard_index must be in [0, {n}), got {i}")));
                }
                Some((i as u32, n as u32))
            }
            _ => return Err(PyValueError::new_err("shard_index and num_shards must be given together")),
        };
        let store = &*self.store;
        py.detach(|| guard(|| snapshot::load_snapshot(store, &path, filter)))
    }

    // The Python-visible (ids, rows, version) tuple, spelled out as the stub has it.
    #[allow(clippy::type_complexity)]
    fn export_delta<'py>(
        &self,
        py: Python<'py>,
        table: &str,
        since_version: i64,
    ) -> PyResult<(Bound<'py, PyArray1<u64>>, Bound<'py, PyArray2<f32>>, u64)> {
        let t = self.table(table)?;
        let since = nonneg(since_version, "since_version")?;
        let store = &*self.store;
        let (ids, rows, cur) = py.detach(|| guard(|| Ok(store.export_delta(&t, since))))?;
        tier_ok(&t)?;
        let n = ids.len();
        let rows = PyArray1::from_vec(py, rows).reshape([n, t.cfg.dim])?;
        Ok((PyArray1::from_vec(py, ids), rows, cur))
    }

    #[pyo3(signature = (table=None, *, now=None))]
    fn expire(&self, py: Python<'_>, table: Option<&str>, now: Option<f64>) -> PyResult<u64> {
        let tables = match table {
            Some(n) => vec![self.table(n)?],
            None => self.store.tables_ordered(),
        };
        let now = match now {
            None => None,
            Some(x) if x.is_finite() && x >= 0.0 => Some(x.min(u32::MAX as f64) as u32),
            Some(x) => return Err(PyValueError::new_err(format!("now must be a non-negative UNIX time, got {x}"))),
        };
        let store = &*self.store;
        let n = py.detach(|| guard(|| Ok(tables.iter().map(|t| store.expire(t, now)).sum())))?;
        tables.iter().try_for_each(|t| tier_ok(t))?;
        Ok(n)
    }

    fn stats<'py>(&self, py: Python<'py>, table: &str) -> PyResult<Bound<'py, PyDict>> {
        let t = self.store.table(table).map_err(to_py)?;
        let (rows, mem, disk) = py.detach(|| (t.rows(), t.memory_bytes(), t.disk_stats()));
        let d = PyDict::new(py);
        d.set_item("rows", rows)?;
        d.set_item("memory_bytes", mem)?;
        for (name, v) in COUNTER_NAMES.iter().zip(t.counters.snapshot()) {
            d.set_item(*name, v)?;
        }
        d.set_item("forgotten", t.forgotten.load(std::sync::atomic::Ordering::Relaxed))?;
        d.set_item("version", self.store.version())?;
        d.set_item("internal_shards", t.num_shards())?;
        if !disk.is_empty() {
            // The disk tier: totals, and per internal shard (lists in shard order).
            let sum = |f: fn(&crate::table::DiskStats) -> u64| disk.iter().map(f).sum::<u64>();
            let each = |f: fn(&crate::table::DiskStats) -> u64| disk.iter().map(f).collect::<Vec<u64>>();
            d.set_item("disk_rows", sum(|s| s.rows))?;
            d.set_item("disk_bytes", sum(|s| s.bytes))?;
            d.set_item("disk_reads", sum(|s| s.reads))?;
            d.set_item("disk_writes", sum(|s| s.writes))?;
            d.set_item("disk_lookup_hits", sum(|s| s.lookup_hits))?;
            d.set_item("resident_rows", sum(|s| s.resident_rows))?;
            d.set_item("budget_rows", sum(|s| s.budget_rows))?;
            d.set_item("disk_rows_per_shard", each(|s| s.rows))?;
            d.set_item("disk_bytes_per_shard", each(|s| s.bytes))?;
            d.set_item("resident_rows_per_shard", each(|s| s.resident_rows))?;
            d.set_item("disk_error", t.tier_error())?;
        }
        Ok(d)
    }

    fn table_config<'py>(&self, py: Python<'py>, table: &str) -> PyResult<Bound<'py, PyDict>> {
        let t = self.store.table(table).map_err(to_py)?;
        let c = &t.cfg;
        let d = PyDict::new(py);
        d.set_item("name", &c.name)?;
        d.set_item("dim", c.dim)?;
        d.set_item("dtype", c.dtype.name())?;
        d.set_item("initializer", c.initializer.name())?;
        d.set_item("init_low", c.init_low)?;
        d.set_item("init_high", c.init_high)?;
        d.set_item("init_mean", c.init_mean)?;
        d.set_item("init_std", c.init_std)?;
        d.set_item("seed", c.seed)?;
        d.set_item("optimizer", c.optimizer.name())?;
        d.set_item("lr", c.lr)?;
        d.set_item("weight_decay", c.weight_decay)?;
        d.set_item("eps", c.eps)?;
        d.set_item("beta1", c.beta1)?;
        d.set_item("beta2", c.beta2)?;
        d.set_item("initial_accumulator", c.initial_accumulator)?;
        d.set_item("ftrl_alpha", c.ftrl_alpha)?;
        d.set_item("ftrl_beta", c.ftrl_beta)?;
        d.set_item("ftrl_l1", c.ftrl_l1)?;
        d.set_item("ftrl_l2", c.ftrl_l2)?;
        d.set_item("weight_bound", c.weight_bound)?;
        d.set_item("admission", c.admission.name())?;
        d.set_item("admission_probability", c.admission_probability)?;
        d.set_item("admission_threshold", c.admission_threshold)?;
        d.set_item("admission_sketch_width", c.sketch_width)?;
        d.set_item("admission_sketch_depth", c.sketch_depth)?;
        d.set_item("capacity", c.capacity)?;
        d.set_item("ttl_seconds", c.ttl_seconds)?;
        d.set_item("ttl_updates", c.ttl_updates)?;
        d.set_item("memory_budget_bytes", c.memory_budget_bytes)?;
        d.set_item("disk", &c.disk)?;
        Ok(d)
    }
}
