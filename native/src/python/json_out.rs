//! Binding of the JSON event writer (`trillium_stream::json_out`): a chunk of rows' messages in one call.

use numpy::Ix1;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyString, PyTuple};

use super::{get_array, type_name};
use trillium_stream::json_out::{write_rows, Column, Piece};

/// json_rows(template, columns) -> list[bytes]: row i's message is the template (`bytes`
/// literals and `int` column numbers) with column c's row i at each `c`. A column is
/// `(cells: list[str | bytes | None], empty_is_null: bool)`, written as JSON strings, or
/// `(values: float64 array, missing: bool array)`, written as numbers.
#[pyfunction]
pub(crate) fn json_rows<'py>(
    py: Python<'py>,
    template: &Bound<'py, PyList>,
    columns: &Bound<'py, PyList>,
) -> PyResult<Bound<'py, PyList>> {
    let mut pieces = Vec::with_capacity(template.len());
    for (i, piece) in template.iter().enumerate() {
        pieces.push(if let Ok(text) = piece.cast::<PyBytes>() {
            Piece::Literal(text.as_bytes().to_vec())
        } else if piece.cast::<PyInt>().is_ok() {
            Piece::Field(piece.extract()?)
        } else {
            return Err(PyTypeError::new_err(format!("template[{i}] must be bytes or int, got {}", type_name(&piece))));
        });
    }
    // The cells' Python objects, held while the columns borrow their text.
    let mut held: Vec<Vec<Bound<'py, PyAny>>> = Vec::new();
    let mut numbers = Vec::new();
    let mut kinds = Vec::with_capacity(columns.len());
    for (c, column) in columns.iter().enumerate() {
        let pair =
            column.cast::<PyTuple>().ok().filter(|t| t.len() == 2).ok_or_else(|| {
                PyTypeError::new_err(format!("columns[{c}] must be a pair, got {}", type_name(&column)))
            })?;
        let (first, second) = (pair.get_item(0)?, pair.get_item(1)?);
        if let Ok(cells) = first.cast::<PyList>() {
            held.push(cells.iter().collect());
            kinds.push(Err(second.extract::<bool>()?));
        } else {
            let values = get_array::<f64, Ix1>(py, &first, &format!("columns[{c}] values"), "float64", 1)?;
            let missing = get_array::<bool, Ix1>(py, &second, &format!("columns[{c}] missing"), "bool", 1)?;
            kinds.push(Ok(numbers.len()));
            numbers.push((values, missing));
        }
    }
    let mut texts = held.iter();
    let mut built = Vec::with_capacity(kinds.len());
    for (c, kind) in kinds.into_iter().enumerate() {
        built.push(match kind {
            Ok(n) => {
                let (values, missing) = &numbers[n];
                let (values, missing) = (values.slice()?, missing.slice()?);
                if values.len() != missing.len() {
                    return Err(PyValueError::new_err(format!(
                        "columns[{c}]: {} values, {} missing",
                        values.len(),
                        missing.len()
                    )));
                }
                Column::Number { values, missing }
            }
            Err(empty_is_null) => {
                let cells =
                    texts.next().expect("a text column's cells are held").iter().enumerate().map(|(i, cell)| {
                        if cell.is_none() {
                            Ok(None)
                        } else if let Ok(s) = cell.cast::<PyString>() {
                            Ok(Some(s.to_str()?.as_bytes()))
                        } else if let Ok(b) = cell.cast::<PyBytes>() {
                            Ok(Some(b.as_bytes()))
                        } else {
                            Err(PyTypeError::new_err(format!(
                                "columns[{c}][{i}] must be str, bytes or None, got {}",
                                type_name(cell)
                            )))
                        }
                    });
                Column::Text { cells: cells.collect::<PyResult<_>>()?, empty_is_null }
            }
        });
    }
    let (text, ends) = write_rows(&pieces, &built).map_err(PyValueError::new_err)?;
    let mut start = 0;
    let messages = PyList::empty(py);
    for end in ends {
        messages.append(PyBytes::new(py, &text[start..end]))?;
        start = end;
    }
    Ok(messages)
}
