//! Bindings over columns of Python text cells, as a stream's events and prediction requests
//! arrive (`Encoder.check_cells` / `encode_cells`): a slot's IDs and a dense column's values a
//! column per call, not a Python step per cell.

use numpy::PyArray1;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyString;

use super::type_name;
use crate::hash::ValueHasher;

/// Two arrays of a column's rows, as the functions below answer.
type Arrays<'py, A, B> = (Bound<'py, PyArray1<A>>, Bound<'py, PyArray1<B>>);

/// Each item of a sequence of `str | None`, `f(index, text)`; None reads as "".
fn each_cell<'py>(cells: &Bound<'py, PyAny>, mut f: impl FnMut(usize, &str)) -> PyResult<()> {
    let items = cells.try_iter().map_err(|_| {
        PyTypeError::new_err(format!("cells must be a sequence of str | None, got {}", type_name(cells)))
    })?;
    for (i, item) in items.enumerate() {
        let item = item?;
        if item.is_none() {
            f(i, "");
        } else if let Ok(s) = item.cast::<PyString>() {
            f(i, s.to_str()?);
        } else {
            return Err(PyTypeError::new_err(format!("cells[{i}] must be str or None, got {}", type_name(&item))));
        }
    }
    Ok(())
}

/// hash_cells(namespace, cells, separator=None, max_len=None) -> (int32 lengths[rows], uint64 ids)
#[pyfunction]
#[pyo3(signature = (namespace, cells, separator=None, max_len=None))]
pub(crate) fn hash_cells<'py>(
    py: Python<'py>,
    namespace: &str,
    cells: &Bound<'py, PyAny>,
    separator: Option<&str>,
    max_len: Option<usize>,
) -> PyResult<Arrays<'py, i32, u64>> {
    if separator == Some("") {
        return Err(PyValueError::new_err("separator must not be empty"));
    }
    let limit = max_len.unwrap_or(usize::MAX);
    let mut h = ValueHasher::new(namespace.as_bytes());
    let (mut lengths, mut ids) = (Vec::new(), Vec::new());
    each_cell(cells, |_, cell| {
        let before = ids.len();
        match separator {
            _ if cell.is_empty() => {}
            None => ids.extend(std::iter::once(cell).take(limit).map(|p| h.hash_bytes(p.as_bytes()))),
            Some(sep) => {
                ids.extend(cell.split(sep).filter(|p| !p.is_empty()).take(limit).map(|p| h.hash_bytes(p.as_bytes())))
            }
        }
        lengths.push((ids.len() - before) as i32);
    })?;
    Ok((PyArray1::from_vec(py, lengths), PyArray1::from_vec(py, ids)))
}

/// parse_floats(cells) -> (float64 values[rows], int64 odd): NaN where a cell is missing.
#[pyfunction]
pub(crate) fn parse_floats<'py>(py: Python<'py>, cells: &Bound<'py, PyAny>) -> PyResult<Arrays<'py, f64, i64>> {
    let (mut values, mut odd) = (Vec::new(), Vec::new());
    each_cell(cells, |i, cell| {
        values.push(f64::NAN);
        if cell.is_empty() {
            return;
        }
        match cell.parse::<f64>() {
            Ok(v) if v.is_finite() => values[i] = v,
            _ => odd.push(i as i64), // not a number to Rust, or not finite: the caller's to judge
        }
    })?;
    Ok((PyArray1::from_vec(py, values), PyArray1::from_vec(py, odd)))
}
