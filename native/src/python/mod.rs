//! PyO3 bindings, one module per area (store, captures, forgetting IDs in files, hashing, text
//! cells, pooling, serving, events, the join, the wire's fp16, a PS shard's and an embedding worker's gRPC servers); this one registers them and
//! holds the helpers they share. Every batched call releases the GIL and runs on the store's
//! own rayon pool; every entry point catches panics and maps errors to ValueError /
//! TypeError / KeyError / OSError.

use std::panic::{catch_unwind, AssertUnwindSafe};

use numpy::ndarray::Dimension;
use numpy::{Element, PyArray, PyArrayMethods, PyReadonlyArray, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyKeyError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::config::StoreError;
use crate::snapshot::FORMAT_VERSION;

mod cells;
mod events;
mod forget;
mod hash;
mod join;
mod json_out;
mod pooling;
mod ps_server;
mod serving;
mod snapshot;
mod store;
mod store_tables;
mod task_join;
mod wire16;
mod worker_server;

pub(crate) fn to_py(e: StoreError) -> PyErr {
    match e {
        StoreError::Value(s) => PyValueError::new_err(s),
        StoreError::Type(s) => PyTypeError::new_err(s),
        StoreError::Key(s) => PyKeyError::new_err(s),
        StoreError::Io(e) => PyErr::from(e),
        c @ StoreError::Corrupt(_) => PyValueError::new_err(c.to_string()),
    }
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".into()
    }
}

/// Run `f`, converting errors and panics into Python exceptions.
pub(crate) fn guard<T>(f: impl FnOnce() -> Result<T, StoreError>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(to_py(e)),
        Err(p) => Err(PyRuntimeError::new_err(format!("trillium_native internal error: {}", panic_message(p)))),
    }
}

pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "object".into())
}

/// A contiguous, aligned read-only view of a numpy array (copied only when needed).
pub(crate) struct Arr<'py, T: Element, D: Dimension> {
    ro: PyReadonlyArray<'py, T, D>,
}

impl<T: Element, D: Dimension> Arr<'_, T, D> {
    pub(crate) fn slice(&self) -> PyResult<&[T]> {
        self.ro.as_slice().map_err(|e| PyValueError::new_err(format!("array is not contiguous: {e}")))
    }
    pub(crate) fn shape(&self) -> Vec<usize> {
        self.ro.shape().to_vec()
    }
}

pub(crate) fn get_array<'py, T: Element, D: Dimension>(
    py: Python<'py>,
    obj: &Bound<'py, PyAny>,
    what: &str,
    dtype_name: &str,
    ndim: usize,
) -> PyResult<Arr<'py, T, D>> {
    let arr = obj.cast::<PyUntypedArray>().map_err(|_| {
        PyTypeError::new_err(format!("{what} must be a numpy.ndarray of dtype {dtype_name}, got {}", type_name(obj)))
    })?;
    if arr.ndim() != ndim {
        return Err(PyValueError::new_err(format!("{what} must be a {ndim}-D array, got shape {:?}", arr.shape())));
    }
    let typed = match arr.cast::<PyArray<T, D>>() {
        Ok(a) => a.clone(),
        Err(_) => {
            let dt = arr.dtype().str().map(|s| s.to_string()).unwrap_or_else(|_| "?".into());
            return Err(PyTypeError::new_err(format!(
                "{what} must have dtype {dtype_name}, got {dt} (convert with .astype(np.{dtype_name}))"
            )));
        }
    };
    let typed = if typed.is_c_contiguous() && typed.is_aligned() {
        typed
    } else {
        let np = py.import("numpy")?;
        np.call_method1("ascontiguousarray", (typed,))?.cast_into::<PyArray<T, D>>()?
    };
    let ro = typed.try_readonly().map_err(|e| PyValueError::new_err(format!("{what}: cannot borrow array: {e}")))?;
    Ok(Arr { ro })
}

pub(crate) fn extract_u64(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    if let Ok(v) = obj.extract::<u64>() {
        return Ok(v);
    }
    if obj.extract::<i64>().is_ok() || obj.extract::<i128>().is_ok() {
        return Err(PyValueError::new_err(format!("{what} must be in [0, 2**64), got {obj}")));
    }
    Err(PyTypeError::new_err(format!("{what} must be an int, got {}", type_name(obj))))
}

pub(crate) fn opt_nonneg(v: Option<i64>, what: &str) -> PyResult<Option<u64>> {
    match v {
        None => Ok(None),
        Some(x) if x >= 1 => Ok(Some(x as u64)),
        Some(x) => Err(PyValueError::new_err(format!("{what} must be >= 1 or None, got {x}"))),
    }
}

pub(crate) fn nonneg(v: i64, what: &str) -> PyResult<u64> {
    if v < 0 {
        Err(PyValueError::new_err(format!("{what} must be >= 0, got {v}")))
    } else {
        Ok(v as u64)
    }
}

#[pymodule]
fn trillium_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<store::PyStore>()?;
    m.add_class::<ps_server::PyShardServer>()?;
    m.add_class::<worker_server::PyWorkerServer>()?;
    m.add_class::<snapshot::PyCapture>()?;
    m.add_class::<snapshot::PyCaptureMark>()?;
    m.add_class::<pooling::PyLayout>()?;
    m.add_class::<pooling::PyPlan>()?;
    m.add_class::<serving::PyServing>()?;
    m.add_class::<events::PyEventDecoder>()?;
    m.add_class::<join::PyEventJoin>()?;
    m.add_class::<task_join::PyTaskJoin>()?;
    m.add_function(wrap_pyfunction!(store_tables::apply_gradients, m)?)?;
    m.add_function(wrap_pyfunction!(hash::shard_of, m)?)?;
    m.add_function(wrap_pyfunction!(hash::hash_ids, m)?)?;
    m.add_function(wrap_pyfunction!(hash::kafka_partitions, m)?)?;
    m.add_function(wrap_pyfunction!(hash::hash_ints, m)?)?;
    m.add_function(wrap_pyfunction!(hash::hash_strings, m)?)?;
    m.add_function(wrap_pyfunction!(cells::hash_cells, m)?)?;
    m.add_function(wrap_pyfunction!(cells::parse_floats, m)?)?;
    m.add_function(wrap_pyfunction!(cells::row_cells, m)?)?;
    m.add_function(wrap_pyfunction!(json_out::json_rows, m)?)?;
    m.add_function(wrap_pyfunction!(wire16::to_fp16_scaled, m)?)?;
    m.add_function(wrap_pyfunction!(wire16::from_fp16_scaled, m)?)?;
    m.add_function(wrap_pyfunction!(forget::forget_in_snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(forget::forget_in_values, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("SNAPSHOT_FORMAT_VERSION", FORMAT_VERSION)?;
    m.add("VALUES_FORMAT_VERSION", crate::values::VALUES_FORMAT_VERSION)?;
    Ok(())
}
