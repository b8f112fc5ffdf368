//! Bindings over columns of Python text cells, as a stream's events and prediction requests
//! arrive (`Encoder.check_cells` / `encode_cells`): a slot's IDs and a dense column's values a
//! column per call, not a Python step per cell.

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString};

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

/// A slot's IDs of one cell, as `hash_cells` reads it: one ID, or the non-empty values between
/// separators, the first `limit`.
fn cell_ids(h: &mut ValueHasher, cell: &str, separator: Option<&str>, limit: usize, ids: &mut Vec<u64>) {
    match separator {
        _ if cell.is_empty() => {}
        None => ids.extend(std::iter::once(cell).take(limit).map(|p| h.hash_bytes(p.as_bytes()))),
        Some(sep) => {
            ids.extend(cell.split(sep).filter(|p| !p.is_empty()).take(limit).map(|p| h.hash_bytes(p.as_bytes())))
        }
    }
}

/// A dense cell as `parse_floats` reads it: NaN when missing, None when left to the caller.
fn cell_value(cell: &str) -> Option<f64> {
    if cell.is_empty() {
        return Some(f64::NAN);
    }
    cell.parse::<f64>().ok().filter(|v| v.is_finite())
}

/// A slot of `row_cells`: (namespace, field, separator, max_len).
type SlotSpec = (String, usize, Option<String>, Option<usize>);

/// row_cells(texts, separator, fields, slots, dense) -> (int32 lengths[len(slots), rows], [uint64
/// ids] per slot, float64 values[rows, len(dense)], int64 odd[n, 2]): rows given as one text each,
/// their `fields` cells joined by `separator` (a stream's events), read in one pass as
/// `hash_cells` reads each slot's column and `parse_floats` each dense one. A slot is (namespace,
/// field, separator, max_len); a dense column its field. `odd`: (row, dense column) of each cell
/// left to Python's float(), as `parse_floats` leaves them.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub(crate) fn row_cells<'py>(
    py: Python<'py>,
    texts: &Bound<'py, PyList>,
    separator: char,
    fields: usize,
    slots: Vec<SlotSpec>,
    dense: Vec<usize>,
) -> PyResult<(
    Bound<'py, PyArray2<i32>>,
    Vec<Bound<'py, PyArray1<u64>>>,
    Bound<'py, PyArray2<f64>>,
    Bound<'py, PyArray2<i64>>,
)> {
    if let Some(bad) = slots.iter().map(|s| s.1).chain(dense.iter().copied()).find(|&f| f >= fields) {
        return Err(PyValueError::new_err(format!("field {bad} of rows of {fields} fields")));
    }
    if slots.iter().any(|s| s.2.as_deref() == Some("")) {
        return Err(PyValueError::new_err("separator must not be empty"));
    }
    let rows = texts.len();
    let mut hashers: Vec<ValueHasher> = slots.iter().map(|s| ValueHasher::new(s.0.as_bytes())).collect();
    let mut lengths = vec![0i32; slots.len() * rows];
    let mut ids: Vec<Vec<u64>> = vec![Vec::with_capacity(rows); slots.len()];
    let mut values = vec![f64::NAN; rows * dense.len()];
    let mut odd: Vec<i64> = Vec::new();
    for (r, item) in texts.iter().enumerate() {
        let text = item
            .cast::<PyString>()
            .map_err(|_| PyTypeError::new_err(format!("texts[{r}] must be str, got {}", type_name(&item))))?;
        let text = text.to_str()?;
        let cells: Vec<&str> = text.split(separator).collect();
        if cells.len() != fields {
            return Err(PyValueError::new_err(format!("row {r} has {} fields, not {fields}", cells.len())));
        }
        for (k, (_, field, separator, max_len)) in slots.iter().enumerate() {
            let before = ids[k].len();
            cell_ids(&mut hashers[k], cells[*field], separator.as_deref(), max_len.unwrap_or(usize::MAX), &mut ids[k]);
            lengths[k * rows + r] = (ids[k].len() - before) as i32;
        }
        for (j, &field) in dense.iter().enumerate() {
            match cell_value(cells[field]) {
                Some(v) => values[r * dense.len() + j] = v,
                None => odd.extend([r as i64, j as i64]),
            }
        }
    }
    let odd_rows = odd.len() / 2;
    Ok((
        PyArray1::from_vec(py, lengths).reshape([slots.len(), rows])?,
        ids.into_iter().map(|v| PyArray1::from_vec(py, v)).collect(),
        PyArray1::from_vec(py, values).reshape([rows, dense.len()])?,
        PyArray1::from_vec(py, odd).reshape([odd_rows, 2])?,
    ))
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
        cell_ids(&mut h, cell, separator, limit, &mut ids);
        lengths.push((ids.len() - before) as i32);
    })?;
    Ok((PyArray1::from_vec(py, lengths), PyArray1::from_vec(py, ids)))
}

/// parse_floats(cells) -> (float64 values[rows], int64 odd): NaN where a cell is missing.
#[pyfunction]
pub(crate) fn parse_floats<'py>(py: Python<'py>, cells: &Bound<'py, PyAny>) -> PyResult<Arrays<'py, f64, i64>> {
    let (mut values, mut odd) = (Vec::new(), Vec::new());
    each_cell(cells, |i, cell| match cell_value(cell) {
        Some(v) => values.push(v),
        None => {
            values.push(f64::NAN);
            odd.push(i as i64) // not a number to Rust, or not finite: the caller's to judge
        }
    })?;
    Ok((PyArray1::from_vec(py, values), PyArray1::from_vec(py, odd)))
}
