//! A PS shard's calls that take every table at once: a lookup request (the IDs of every table,
//! one flat array cut by counts, answered with one flat array of rows; a lookup and a
//! concatenation per table from Python cost a 26-table request about a fifth of its time), and
//! steps of gradient messages applied as they came off Kafka.

use std::sync::Arc;

use half::f16;
use numpy::{Element, Ix1, PyArray1, PyArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::{get_array, guard};
use crate::elem::OutElem;
use crate::ps_apply::{apply_step, read_gradients};
use crate::store::Store;
use crate::table::Table;

/// `tables[i]`'s rows for the next `counts[i]` IDs of `ids`, all in one flat array of
/// `out_dtype`, and each table's dim.
pub(crate) fn lookup_tables<'py>(
    py: Python<'py>,
    store: &Store,
    tables: &[Arc<Table>],
    counts: &[usize],
    ids: &Bound<'py, PyAny>,
    create: bool,
    out_dtype: &str,
) -> PyResult<(Bound<'py, PyAny>, Vec<usize>)> {
    let ids = get_array::<u64, Ix1>(py, ids, "ids", "uint64", 1)?;
    let ids = ids.slice()?;
    if tables.len() != counts.len() || counts.iter().sum::<usize>() != ids.len() {
        let names: Vec<&str> = tables.iter().map(|t| t.cfg.name.as_str()).collect();
        return Err(PyValueError::new_err(format!(
            "{} ids do not fit the counts {counts:?} of tables {names:?}",
            ids.len()
        )));
    }
    let dims: Vec<usize> = tables.iter().map(|t| t.cfg.dim).collect();
    let rows = match out_dtype {
        "float32" | "fp32" | "f32" => filled::<f32>(py, store, tables, counts, ids, create)?,
        "float16" | "fp16" | "f16" => filled::<f16>(py, store, tables, counts, ids, create)?,
        other => {
            return Err(PyValueError::new_err(format!("unknown out_dtype {other:?}: expected 'float32' or 'float16'")))
        }
    };
    Ok((rows, dims))
}

fn filled<'py, O: OutElem + Element>(
    py: Python<'py>,
    store: &Store,
    tables: &[Arc<Table>],
    counts: &[usize],
    ids: &[u64],
    create: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let total = counts.iter().zip(tables).map(|(n, t)| n * t.cfg.dim).sum();
    // SAFETY: every element is written below (the tables' rows cover it) before it is returned.
    let out = unsafe { PyArray1::<O>::new(py, [total], false) };
    if total > 0 {
        // SAFETY: the array was just created, is C-contiguous, and not shared yet.
        let mut rest = unsafe { std::slice::from_raw_parts_mut(out.data(), total) };
        let mut ids = ids;
        py.detach(|| {
            guard(|| {
                for (t, &n) in tables.iter().zip(counts) {
                    let (these, more) = std::mem::take(&mut rest).split_at_mut(n * t.cfg.dim);
                    store.lookup(t, &ids[..n], these, create);
                    (rest, ids) = (more, &ids[n..]);
                }
                Ok(())
            })
        })?;
    }
    tiers_ok(tables.iter())?;
    Ok(out.into_any())
}

/// An OSError if a table's disk tier failed (as `EmbeddingStore.lookup` and `update` raise).
fn tiers_ok<'a>(mut tables: impl Iterator<Item = &'a Arc<Table>>) -> PyResult<()> {
    match tables.find_map(|t| t.tier_error()) {
        Some(e) => Err(pyo3::exceptions::PyOSError::new_err(e)),
        None => Ok(()),
    }
}

/// A PS shard's steps of gradient messages (`encode_gradients` frames), each step's in rank
/// order, applied in order (`crate::ps_apply`), GIL released: the rows updated. A message that is
/// no gradients frame is a ValueError before any step is applied; a failed disk tier an OSError.
#[pyfunction]
pub(crate) fn apply_gradients(
    py: Python<'_>,
    store: PyRef<'_, super::store::PyStore>,
    steps: Vec<Vec<pyo3::pybacked::PyBackedBytes>>,
) -> PyResult<u64> {
    let frames = steps
        .iter()
        .map(|step| step.iter().map(|m| read_gradients(m)).collect::<Result<Vec<_>, _>>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| PyValueError::new_err(e.0))?;
    let store: &Store = &store.store;
    let rows = py.detach(|| guard(|| frames.iter().try_fold(0, |rows, step| Ok(rows + apply_step(store, step)?))))?;
    if let Some(error) = store.tables_ordered().iter().find_map(|t| t.tier_error()) {
        return Err(pyo3::exceptions::PyOSError::new_err(error));
    }
    Ok(rows)
}
