//! Bindings of point-in-time captures (`StoreCapture`).

use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::guard;
use crate::config::DType;
use crate::snapshot::{Capture, CaptureMark, Written};

/// "fp16" / "fp32" (and their numpy spellings) as a values dtype.
pub(crate) fn values_dtype(s: &str) -> PyResult<DType> {
    match DType::parse(s) {
        Ok(d @ (DType::F16 | DType::F32)) => Ok(d),
        _ => Err(PyValueError::new_err(format!("unknown dtype {s:?}: expected 'fp16' or 'fp32'"))),
    }
}

/// `(bytes written, sha256 hex digest of the file)`, as returned by `dump` and `write`.
pub(crate) fn written(w: Written) -> (u64, String) {
    let (bytes, sha) = w;
    (bytes, sha.iter().map(|b| format!("{b:02x}")).collect())
}

/// Where a capture stood (`StoreCapture.mark`): `EmbeddingStore.capture(since=mark)` then
/// copies only what changed after it. Small; it outlives the capture's release.
#[pyclass(name = "CaptureMark", module = "trillium_native", frozen)]
pub struct PyCaptureMark {
    pub(crate) inner: CaptureMark,
}

/// A point-in-time copy of an `EmbeddingStore` (from `EmbeddingStore.capture()`).
#[pyclass(name = "StoreCapture", module = "trillium_native", frozen)]
pub struct PyCapture {
    /// None once released. An `Arc` so that a write in progress (GIL released) keeps the
    /// copy alive while another thread releases it.
    inner: Mutex<Option<Arc<Capture>>>,
    mark: CaptureMark,
    delta: bool,
}

impl PyCapture {
    pub(crate) fn new(c: Capture) -> Self {
        let (mark, delta) = (c.mark(), c.is_delta());
        PyCapture { inner: Mutex::new(Some(Arc::new(c))), mark, delta }
    }

    fn get(&self) -> PyResult<Arc<Capture>> {
        self.inner.lock().clone().ok_or_else(|| PyValueError::new_err("the StoreCapture was released"))
    }
}

#[pymethods]
impl PyCapture {
    /// Write the capture to `path` atomically; returns (bytes, sha256 hex).
    fn write(&self, py: Python<'_>, path: PathBuf) -> PyResult<(u64, String)> {
        let c = self.get()?;
        py.detach(|| guard(|| c.write(&path))).map(written)
    }

    /// Write the captured tables' IDs and weights only, as `dtype` ("fp16" or "fp32"), to
    /// `path` as a values file (for serving) atomically; returns (bytes, sha256 hex).
    #[pyo3(signature = (path, dtype="fp16"))]
    fn write_values(&self, py: Python<'_>, path: PathBuf, dtype: &str) -> PyResult<(u64, String)> {
        let dtype = values_dtype(dtype)?;
        let c = self.get()?;
        py.detach(|| guard(|| c.write_values(&path, dtype))).map(written)
    }

    /// True when only the rows changed since the `since` mark were copied (load the file
    /// after the one that mark's capture wrote).
    #[getter]
    fn delta(&self) -> bool {
        self.delta
    }

    #[getter]
    fn mark(&self) -> PyCaptureMark {
        PyCaptureMark { inner: self.mark.clone() }
    }

    #[getter]
    fn rows(&self) -> PyResult<u64> {
        Ok(self.get()?.rows())
    }

    #[getter]
    fn memory_bytes(&self) -> usize {
        self.inner.lock().as_ref().map_or(0, |c| c.memory_bytes())
    }

    fn tables(&self) -> PyResult<Vec<String>> {
        Ok(self.get()?.table_names())
    }

    /// Free the copy now (once a write in progress has finished). Idempotent.
    fn release(&self, py: Python<'_>) {
        let c = self.inner.lock().take();
        // Unmapping gigabytes takes a while: not while holding the GIL.
        py.detach(move || drop(c));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: &Bound<'_, PyAny>,
        _exc: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) -> bool {
        self.release(py);
        false
    }

    fn __repr__(&self) -> String {
        match &*self.inner.lock() {
            Some(c) => format!(
                "StoreCapture(tables={:?}, delta={}, rows={}, memory_bytes={})",
                c.table_names(),
                self.delta,
                c.rows(),
                c.memory_bytes()
            ),
            None => "StoreCapture(released)".into(),
        }
    }
}
