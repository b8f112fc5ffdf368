//! Bindings of the serving store (`ServingTables`).
//!
//! `apply` releases the GIL (it reads files and builds indexes). `lookup` is called per
//! prediction request and takes microseconds, less than a GIL hand-off can cost when
//! another thread holds the GIL, so it keeps the GIL unless the call has at least
//! `DETACH_MIN_IDS` IDs; the apply thread never needs the GIL inside its write section, so
//! a lookup waiting for that section with the GIL held cannot deadlock.

use std::path::PathBuf;

use numpy::{Ix1, PyArray2, PyArrayMethods};
use pyo3::exceptions::{PyKeyError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::snapshot::values_dtype;
use super::{extract_u64, get_array, guard, type_name};
use crate::serving::{ServingSlice, ServingTables};
use crate::store::default_threads;

/// Lookups of at least this many IDs (over all requests) release the GIL.
const DETACH_MIN_IDS: usize = 1 << 14;

/// A model replica's embedding tables, values only, applied version by version.
#[pyclass(name = "ServingTables", module = "trillium_native", frozen)]
pub struct PyServing {
    inner: ServingTables,
}

#[pymethods]
impl PyServing {
    #[new]
    #[pyo3(signature = (tables, shards, dtype="fp16", threads=None, *, slice=(0, 1)))]
    fn new(
        tables: &Bound<'_, PyAny>,
        shards: i64,
        dtype: &str,
        threads: Option<i64>,
        slice: (i64, i64),
    ) -> PyResult<Self> {
        let d = tables.cast::<PyDict>().map_err(|_| {
            PyTypeError::new_err(format!("tables must be a dict of name -> dim, got {}", type_name(tables)))
        })?;
        let mut ts = Vec::with_capacity(d.len());
        for (k, v) in d.iter() {
            let name: String = k.extract().map_err(|_| PyTypeError::new_err("table names must be str"))?;
            let dim: i64 = v.extract().map_err(|_| PyTypeError::new_err(format!("dim of {name:?} must be an int")))?;
            if dim < 1 {
                return Err(PyValueError::new_err(format!("dim of {name:?} must be >= 1, got {dim}")));
            }
            ts.push((name, dim as usize));
        }
        if !(1..=u32::MAX as i64).contains(&shards) {
            return Err(PyValueError::new_err(format!("shards must be in [1, 2**32), got {shards}")));
        }
        let threads = match threads {
            Some(t) if t < 1 => return Err(PyValueError::new_err(format!("threads must be >= 1, got {t}"))),
            Some(t) => t as usize,
            None => default_threads(),
        };
        let (index, count) = slice;
        if !(1..=u32::MAX as i64).contains(&count) || !(0..count).contains(&index) {
            return Err(PyValueError::new_err(format!(
                "slice must be (index, count) with 0 <= index < count < 2**32, got ({index}, {count})"
            )));
        }
        let slice = ServingSlice { index: index as u32, count: count as u32 };
        let dtype = values_dtype(dtype)?;
        let inner = guard(|| ServingTables::new(&ts, shards as u32, slice, dtype, threads))?;
        Ok(PyServing { inner })
    }

    /// Apply `[(training shard, values-file path)]` as `version`; GIL released.
    fn apply<'py>(
        &self,
        py: Python<'py>,
        parts: Vec<(i64, PathBuf)>,
        version: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let version = extract_u64(version, "version")?;
        let mut files = Vec::with_capacity(parts.len());
        for (s, p) in parts {
            if !(0..=u32::MAX as i64).contains(&s) {
                return Err(PyValueError::new_err(format!(
                    "values file {}: training shard {s} out of range",
                    p.display()
                )));
            }
            files.push((s as u32, p));
        }
        let inner = &self.inner;
        let r = py.detach(|| guard(|| inner.apply(&files, version)))?;
        let d = PyDict::new(py);
        d.set_item("version", r.version)?;
        d.set_item("files", r.files)?;
        d.set_item("bytes", r.bytes)?;
        d.set_item("rows", r.rows)?;
        d.set_item("parts_replaced", r.parts_replaced)?;
        d.set_item("parts_merged", r.parts_merged)?;
        d.set_item("rows_updated", r.rows_updated)?;
        d.set_item("rows_inserted", r.rows_inserted)?;
        d.set_item("read_s", r.read_s)?;
        d.set_item("build_s", r.build_s)?;
        d.set_item("lock_wait_s", r.lock_wait_s)?;
        d.set_item("lock_hold_s", r.lock_hold_s)?;
        d.set_item("total_s", r.total_s)?;
        Ok(d)
    }

    /// `[(table, uint64 ids)]` -> (float32 `[n, dim]` per request, version, misses per request).
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        requests: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyList>, u64, Vec<u64>)> {
        let mut ids = Vec::new();
        let mut tables = Vec::new();
        let mut arrays = Vec::new();
        let mut outs: Vec<&mut [f32]> = Vec::new();
        let mut total = 0usize;
        for item in requests.try_iter()? {
            let item = item?;
            let (name, arr): (String, Bound<'py, PyAny>) = item.extract().map_err(|_| {
                PyTypeError::new_err(format!("a request is a (table, ids) tuple, got {}", type_name(&item)))
            })?;
            let t =
                self.inner.table_index(&name).ok_or_else(|| PyKeyError::new_err(format!("unknown table {name:?}")))?;
            let a = get_array::<u64, Ix1>(py, &arr, "ids", "uint64", 1)?;
            let (n, dim) = (a.shape()[0], self.inner.dim(t));
            // SAFETY: every element is written by the lookup before the array is returned.
            let out = unsafe { PyArray2::<f32>::new(py, [n, dim], false) };
            // SAFETY: the array was just created, is C-contiguous, and not shared yet.
            outs.push(unsafe { std::slice::from_raw_parts_mut(out.data(), n * dim) });
            total += n;
            ids.push(a);
            tables.push(t);
            arrays.push(out.into_any());
        }
        let reqs: Vec<(usize, &[u64])> =
            tables.iter().zip(&ids).map(|(&t, a)| Ok((t, a.slice()?))).collect::<PyResult<_>>()?;
        let mut misses = vec![0u64; reqs.len()];
        let inner = &self.inner;
        let version = if total >= DETACH_MIN_IDS {
            py.detach(|| guard(|| Ok(inner.lookup(&reqs, &mut outs, &mut misses))))?
        } else {
            guard(|| Ok(inner.lookup(&reqs, &mut outs, &mut misses)))?
        };
        Ok((PyList::new(py, arrays)?, version, misses))
    }

    /// The last applied version (0 before any).
    #[getter]
    fn version(&self) -> u64 {
        self.inner.version()
    }

    #[getter]
    fn shards(&self) -> u32 {
        self.inner.shards()
    }

    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype().name()
    }

    #[getter]
    fn threads(&self) -> usize {
        self.inner.threads()
    }

    /// Table name -> dim.
    #[getter]
    fn tables<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (name, dim) in self.inner.tables() {
            d.set_item(name, dim)?;
        }
        Ok(d)
    }

    /// Per table: rows, overlay_rows, memory_bytes, lookups, misses.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for s in self.inner.stats() {
            let d = PyDict::new(py);
            d.set_item("rows", s.rows)?;
            d.set_item("overlay_rows", s.overlay_rows)?;
            d.set_item("memory_bytes", s.memory_bytes)?;
            d.set_item("lookups", s.lookups)?;
            d.set_item("misses", s.misses)?;
            out.set_item(s.name, d)?;
        }
        Ok(out)
    }

    fn memory_bytes(&self) -> u64 {
        self.inner.memory_bytes()
    }

    /// `(index, count)`: the rows kept are those with `shard_of(id, count) == index`.
    #[getter]
    fn slice(&self) -> (u32, u32) {
        let s = self.inner.slice();
        (s.index, s.count)
    }

    fn __repr__(&self) -> String {
        let s = self.inner.slice();
        format!(
            "ServingTables(tables={:?}, shards={}, slice=({}, {}), dtype={:?}, version={})",
            self.inner.tables(),
            self.inner.shards(),
            s.index,
            s.count,
            self.inner.dtype().name(),
            self.inner.version()
        )
    }
}
