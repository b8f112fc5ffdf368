//! Bindings of forgetting IDs in files (`forget_in_snapshot`, `forget_in_values`); a live
//! store's `EmbeddingStore.forget` is in store.rs.

use std::collections::HashMap;
use std::path::PathBuf;

use numpy::Ix1;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::snapshot::written;
use super::{get_array, guard};

/// `{table: uint64 IDs}` as owned vectors (the GIL is released while they are used).
fn ids_by_table<'py>(py: Python<'py>, ids: &Bound<'py, PyDict>) -> PyResult<HashMap<String, Vec<u64>>> {
    let mut out = HashMap::with_capacity(ids.len());
    for (k, v) in ids.iter() {
        let name: String = k.extract()?;
        let a = get_array::<u64, Ix1>(py, &v, &format!("ids[{name:?}]"), "uint64", 1)?;
        out.insert(name, a.slice()?.to_vec());
    }
    Ok(out)
}

/// Rewrite the snapshot `src` to `dst` without the rows of `ids`; returns (rows removed,
/// bytes written, sha256 hex of `dst`).
#[pyfunction]
pub fn forget_in_snapshot(
    py: Python<'_>,
    src: PathBuf,
    dst: PathBuf,
    ids: &Bound<'_, PyDict>,
) -> PyResult<(u64, u64, String)> {
    let ids = ids_by_table(py, ids)?;
    let (n, w) = py.detach(|| guard(|| crate::snapshot::forget_in_snapshot(&src, &dst, &ids)))?;
    let (bytes, sha) = written(w);
    Ok((n, bytes, sha))
}

/// Rewrite the values file `src` to `dst` without the rows of `ids`; returns (rows removed,
/// bytes written, sha256 hex of `dst`).
#[pyfunction]
pub fn forget_in_values(
    py: Python<'_>,
    src: PathBuf,
    dst: PathBuf,
    ids: &Bound<'_, PyDict>,
) -> PyResult<(u64, u64, String)> {
    let ids = ids_by_table(py, ids)?;
    let (n, w) = py.detach(|| guard(|| crate::values::forget_in_values(&src, &dst, &ids)))?;
    let (bytes, sha) = written(w);
    Ok((n, bytes, sha))
}
