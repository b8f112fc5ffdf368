//! Bindings of the stream loader's event decoding fast path (`trillium_stream::events`).

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyFloat, PyList, PyString, PyTuple, PyType};

use super::type_name;
use trillium_stream::events::{Decoded, EventSpec, Kind};

/// EventDecoder(fields, event_time, event_key, max_message_bytes, max_value_bytes, event_type):
/// decodes JSON messages for the fields a job maps. `fields` is a list of (dotted path, kind),
/// kind one of "slot", "dense", "label"; `event_type` is a subclass of tuple made in Python, of
/// (values, key, time): the loader's `Event`.
#[pyclass(name = "EventDecoder", module = "trillium_native", frozen)]
pub(crate) struct PyEventDecoder {
    pub(crate) spec: EventSpec,
    /// A subclass of tuple (a named tuple's class: a heap type).
    event_type: Py<PyType>,
}

/// Whether `t` allocates and frees its instances as a class made by a class statement does (the
/// same slots as such a class's): `PyEventDecoder::event` allocates them itself. A struct
/// sequence (`os.stat_result`) is a heap subclass of tuple too, but its deallocator reads hidden
/// items.
fn made_by_class_statement(t: &Bound<'_, PyType>) -> PyResult<bool> {
    let py = t.py();
    let probe = py.get_type::<PyType>().call1(("probe", (py.get_type::<PyTuple>(),), PyDict::new(py)))?;
    let probe = probe.cast::<PyType>()?;
    // SAFETY: reads slots of two live type objects (both heap types, or `t` a static one: 3.10+).
    Ok([ffi::Py_tp_alloc, ffi::Py_tp_dealloc].into_iter().all(|slot| unsafe {
        ffi::PyType_GetSlot(t.as_type_ptr(), slot) == ffi::PyType_GetSlot(probe.as_type_ptr(), slot)
    }))
}

fn split(path: &str) -> Vec<String> {
    path.split('.').map(str::to_string).collect()
}

impl PyEventDecoder {
    /// `decoded` as an `event_type`, made as `tuple.__new__` makes a subclass's instance (its
    /// type's allocator, then the items) without the call, its arguments and the temporary tuple
    /// it copies from: they were most of an event's cost.
    pub(crate) fn event<'py>(&self, py: Python<'py>, decoded: Decoded) -> PyResult<Bound<'py, PyAny>> {
        let items = [
            PyString::new(py, &decoded.values).into_any(),
            decoded.key.map_or_else(|| py.None().into_bound(py), |k| PyString::new(py, &k).into_any()),
            PyFloat::new(py, decoded.time).into_any(),
        ];
        // SAFETY: `event_type` is a subclass of tuple made as a class statement makes one (checked
        // in `new`), whose allocator is PyType_GenericAlloc: it answers a new reference to an instance of 3 empty items (or
        // NULL and an exception set). PyTuple_SetItem steals each item's reference, onto a new
        // tuple of reference count 1; no Python code runs in between.
        unsafe {
            let event = ffi::PyType_GenericAlloc(self.event_type.bind(py).as_type_ptr(), 3);
            let event = Bound::from_owned_ptr_or_err(py, event)?;
            for (i, item) in items.into_iter().enumerate() {
                if ffi::PyTuple_SetItem(event.as_ptr(), i as ffi::Py_ssize_t, item.into_ptr()) != 0 {
                    return Err(PyErr::fetch(py));
                }
            }
            Ok(event)
        }
    }
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
        event_type: &Bound<'_, PyType>,
    ) -> PyResult<Self> {
        if !event_type.is_subclass_of::<PyTuple>()? || !made_by_class_statement(event_type)? {
            return Err(PyTypeError::new_err("event_type must be a subclass of tuple made in Python"));
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
        Ok(Self { spec, event_type: event_type.clone().unbind() })
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
