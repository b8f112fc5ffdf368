//! Bindings of the stream loader's event decoding fast path (`crate::events`).

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

use super::type_name;
use crate::events::{EventSpec, Kind};

/// EventDecoder(fields, event_time, event_key, max_message_bytes, max_value_bytes): decodes
/// JSON messages for the fields a job maps. `fields` is a list of (dotted path, kind), kind one
/// of "slot", "dense", "label".
#[pyclass(name = "EventDecoder", module = "trillium_native", frozen)]
pub(crate) struct PyEventDecoder {
    spec: EventSpec,
}

fn split(path: &str) -> Vec<String> {
    path.split('.').map(str::to_string).collect()
}

#[pymethods]
impl PyEventDecoder {
    #[new]
    fn new(
        fields: Vec<(String, String)>,
        event_time: &str,
        event_key: Option<&str>,
        max_message_bytes: usize,
        max_value_bytes: usize,
    ) -> PyResult<Self> {
        let mut spec_fields = Vec::with_capacity(fields.len());
        for (path, kind) in &fields {
            let kind = match kind.as_str() {
                "slot" => Kind::Slot,
                "dense" => Kind::Dense,
                "label" => Kind::Label,
                other => return Err(PyValueError::new_err(format!("field {path:?}: unknown kind {other:?}"))),
            };
            spec_fields.push((split(path), kind));
        }
        let spec =
            EventSpec::new(spec_fields, split(event_time), event_key.map(split), max_message_bytes, max_value_bytes);
        Ok(Self { spec })
    }

    /// decode(messages, with_fields) -> list of (values, key, time) or None per message, the
    /// values one text (each field's, `FIELD_SEP` between them, a missing one empty); None: not
    /// decoded here (the reference decoder says what it is). Without `with_fields` the values
    /// are empty.
    fn decode<'py>(
        &self,
        py: Python<'py>,
        messages: &Bound<'py, PyList>,
        with_fields: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for (i, item) in messages.iter().enumerate() {
            let decoded = if item.is_none() {
                None
            } else if let Ok(b) = item.cast::<PyBytes>() {
                self.spec.decode(b.as_bytes(), with_fields)
            } else {
                return Err(PyTypeError::new_err(format!(
                    "messages[{i}] must be bytes or None, got {}",
                    type_name(&item)
                )));
            };
            match decoded {
                None => out.append(py.None())?,
                Some(d) => {
                    let key = d.key.map(|k| PyString::new(py, &k));
                    out.append(PyTuple::new(
                        py,
                        [
                            PyString::new(py, &d.values).into_any(),
                            key.into_pyobject(py)?.into_any(),
                            d.time.into_pyobject(py)?.into_any(),
                        ],
                    )?)?;
                }
            }
        }
        Ok(out)
    }
}
