//! Bindings of the stream loader's event decoding fast path (`crate::events`).

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple, PyType};

use super::type_name;
use crate::events::{Decoded, EventSpec, Kind};

/// EventDecoder(fields, event_time, event_key, max_message_bytes, max_value_bytes, event_type):
/// decodes JSON messages for the fields a job maps. `fields` is a list of (dotted path, kind),
/// kind one of "slot", "dense", "label"; `event_type` is a tuple type of (values, key, time), the
/// loader's `Event`.
#[pyclass(name = "EventDecoder", module = "trillium_native", frozen)]
pub(crate) struct PyEventDecoder {
    pub(crate) spec: EventSpec,
    event_type: Py<PyAny>,
    /// `tuple.__new__`: makes an `event_type` of a tuple without running the named tuple's
    /// Python constructor (a frame an event).
    tuple_new: Py<PyAny>,
}

fn split(path: &str) -> Vec<String> {
    path.split('.').map(str::to_string).collect()
}

impl PyEventDecoder {
    /// `decoded` as an `event_type`.
    pub(crate) fn event<'py>(&self, py: Python<'py>, decoded: Decoded) -> PyResult<Bound<'py, PyAny>> {
        let fields = (PyString::new(py, &decoded.values), decoded.key.map(|k| PyString::new(py, &k)), decoded.time);
        self.tuple_new.bind(py).call1((self.event_type.bind(py), fields))
    }
}

#[pymethods]
impl PyEventDecoder {
    #[new]
    fn new(
        py: Python<'_>,
        fields: Vec<(String, String)>,
        event_time: &str,
        event_key: Option<&str>,
        max_message_bytes: usize,
        max_value_bytes: usize,
        event_type: &Bound<'_, PyType>,
    ) -> PyResult<Self> {
        if !event_type.is_subclass_of::<PyTuple>()? {
            return Err(PyTypeError::new_err("event_type must be a tuple type"));
        }
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
        let tuple_new = py.get_type::<PyTuple>().getattr("__new__")?.unbind();
        Ok(Self { spec, event_type: event_type.clone().into_any().unbind(), tuple_new })
    }

    /// decode(messages, with_fields) -> (events, undecided): an `event_type` of (values, key,
    /// time) per message, the values one text (each field's, `FIELD_SEP` between them, a missing
    /// one empty), or None where it is not decoded here (`undecided`, their indices: the
    /// reference decoder says what they are). Without `with_fields` the values are empty.
    fn decode<'py>(
        &self,
        py: Python<'py>,
        messages: &Bound<'py, PyList>,
        with_fields: bool,
    ) -> PyResult<(Bound<'py, PyList>, Vec<usize>)> {
        let events = PyList::empty(py);
        let mut undecided = Vec::new();
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
                None => {
                    undecided.push(i);
                    events.append(py.None())?;
                }
                Some(d) => events.append(self.event(py, d)?)?,
            }
        }
        Ok((events, undecided))
    }
}
