//! Bindings of the stream loader's joiner (`trillium_stream::join`); `trillium/data/sources/joiner.py`
//! subclasses it as `PartitionJoin`, adding its config and its checkpointed state.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

use super::events::PyEventDecoder;
use super::type_name;
use trillium_stream::join::{Closed, Join, Kind, Sample, COUNTS};

/// An event as the loader has it; a copy is another reference (the core keeps one to correct a
/// negative).
pub(crate) struct Event(pub(crate) Py<PyAny>);

impl Clone for Event {
    fn clone(&self) -> Self {
        Python::attach(|py| Self(self.0.clone_ref(py)))
    }
}

const KINDS: [(Kind, &str); 3] =
    [(Kind::Positive, "positive"), (Kind::Negative, "negative"), (Kind::Correction, "correction")];

/// EventJoin(window_seconds, correct_late_labels, max_open): the join of one input partition.
/// Its events are `(values, key, time)` tuples (an `Event`), kept as they are.
#[pyclass(name = "EventJoin", module = "trillium_native", subclass)]
pub(crate) struct PyEventJoin {
    join: Join<Event>,
    kinds: [Py<PyString>; 3],
}

pub(crate) fn key_and_time<'py>(event: &Bound<'py, PyAny>) -> PyResult<(Bound<'py, PyString>, f64)> {
    let tuple = event.cast::<PyTuple>().map_err(|_| {
        PyTypeError::new_err(format!("an event is a (values, key, time) tuple, got {}", type_name(event)))
    })?;
    if tuple.len() != 3 {
        return Err(PyTypeError::new_err(format!(
            "an event is a (values, key, time) tuple, got {} items",
            tuple.len()
        )));
    }
    let key = tuple.get_item(1)?;
    let key = key.cast_into::<PyString>().map_err(|e| {
        PyValueError::new_err(format!("a joined event needs a key (a str), got {}", type_name(e.into_inner().as_any())))
    })?;
    Ok((key, tuple.get_item(2)?.extract::<f64>()?))
}

fn kind_of(name: &str) -> PyResult<Kind> {
    KINDS
        .iter()
        .find(|(_, n)| *n == name)
        .map(|(k, _)| *k)
        .ok_or_else(|| PyValueError::new_err(format!("unknown sample kind {name:?}")))
}

/// Samples as `advance` hands them out: (events, positive, times, kinds), a list per field.
type Columns<'py> = (Vec<Py<PyAny>>, Vec<bool>, Vec<f64>, Vec<Bound<'py, PyString>>);

impl PyEventJoin {
    fn columns<'py>(&self, py: Python<'py>, samples: impl ExactSizeIterator<Item = Sample<Event>>) -> Columns<'py> {
        let n = samples.len();
        let mut out: Columns<'py> =
            (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
        for s in samples {
            out.0.push(s.event.0);
            out.1.push(s.positive);
            out.2.push(s.time);
            let kind = KINDS.iter().position(|(k, _)| *k == s.kind).expect("every kind is named");
            out.3.push(self.kinds[kind].bind(py).clone());
        }
        out
    }
}

#[pymethods]
impl PyEventJoin {
    #[new]
    fn new(py: Python<'_>, window_seconds: f64, correct_late_labels: bool, max_open: usize) -> Self {
        Self {
            join: Join::new(window_seconds, correct_late_labels, max_open),
            kinds: KINDS.map(|(_, name)| PyString::intern(py, name).unbind()),
        }
    }

    /// impression(event): an impression, keyed (a duplicate of one open or recently closed is counted).
    fn impression(&mut self, event: &Bound<'_, PyAny>) -> PyResult<()> {
        let (key, time) = key_and_time(event)?;
        self.join.impression(key.to_str()?, time, Event(event.clone().unbind()));
        Ok(())
    }

    /// label(key, time): a label (a click) of the impression `key`.
    fn label(&mut self, key: &str, time: f64) {
        self.join.label(key, time);
    }

    /// take(decoder, messages, start, impressions, earliest, newest) -> (stop, latest): the
    /// messages from `start` on decoded (as `decoder.decode` does) and joined here, in order, as
    /// impressions or as labels, up to the first one this leaves to the caller: one the decoder
    /// does not decide, one without a key, or one whose event time is outside [earliest, newest].
    /// `stop` is its index (len(messages): none), `latest` the newest event time joined (-inf: none).
    /// A label makes no Python object at all.
    #[allow(clippy::too_many_arguments)]
    fn take(
        &mut self,
        py: Python<'_>,
        decoder: &Bound<'_, PyEventDecoder>,
        messages: &Bound<'_, PyList>,
        start: usize,
        impressions: bool,
        earliest: f64,
        newest: f64,
    ) -> PyResult<(usize, f64)> {
        let decoder = decoder.get();
        let mut latest = f64::NEG_INFINITY;
        for i in start..messages.len() {
            let item = messages.get_item(i)?;
            let Ok(raw) = item.cast::<PyBytes>() else { return Ok((i, latest)) };
            let decoded = match decoder.spec.decode(raw.as_bytes(), impressions) {
                Some(d) if d.key.is_some() && earliest <= d.time && d.time <= newest => d,
                _ => return Ok((i, latest)),
            };
            // The key borrows from the message: cloning it copies nothing.
            let (time, key) = (decoded.time, decoded.key.clone().expect("checked above"));
            if impressions {
                let event = decoder.event(py, decoded)?;
                self.join.impression(&key, time, Event(event.unbind()));
            } else {
                self.join.label(&key, time);
            }
            latest = latest.max(time);
        }
        Ok((messages.len(), latest))
    }

    /// advance(watermark) -> (events, positive, times, kinds): the samples decided at or before
    /// it, in the order of their decisions, a list per field.
    fn advance<'py>(&mut self, py: Python<'py>, watermark: f64) -> Columns<'py> {
        let samples = self.join.advance(watermark);
        self.columns(py, samples.into_iter())
    }

    /// The counts, in the order of joiner.py's COUNTS.
    fn count_values(&self) -> Vec<u64> {
        self.join.counts().to_vec()
    }

    /// How many impressions are open.
    #[getter]
    fn open_count(&self) -> usize {
        self.join.open_len()
    }

    /// parts() -> (open events, held [(key, time)], closed [(key, (event or None, positive, end))],
    /// decided samples as `advance` gives them): the state but its counts, each part in a fixed order.
    #[allow(clippy::type_complexity)]
    fn parts<'py>(
        &self,
        py: Python<'py>,
    ) -> (Vec<Py<PyAny>>, Vec<(String, f64)>, Vec<(String, (Option<Py<PyAny>>, bool, f64))>, Columns<'py>) {
        let open = self.join.open_entries().into_iter().map(|(_, e, _)| e.0.clone_ref(py)).collect();
        let held = self.join.held_entries().into_iter().map(|(k, t)| (k.to_owned(), t)).collect();
        let closed = self
            .join
            .closed_entries()
            .into_iter()
            .map(|(k, c)| (k.to_owned(), (c.event.as_ref().map(|e| e.0.clone_ref(py)), c.positive, c.end)))
            .collect();
        let decided: Vec<_> = self.join.decided_entries().into_iter().cloned().collect();
        (open, held, closed, self.columns(py, decided.into_iter()))
    }

    /// restore_open(event): an open impression of a checkpointed state (nothing counted).
    fn restore_open(&mut self, event: &Bound<'_, PyAny>) -> PyResult<()> {
        let (key, time) = key_and_time(event)?;
        self.join.restore_open(key.to_str()?, time, Event(event.clone().unbind()));
        Ok(())
    }

    /// restore_held(key, time): a held label of a checkpointed state.
    fn restore_held(&mut self, key: &str, time: f64) {
        self.join.restore_held(key, time);
    }

    /// restore_closed(key, event or None, positive, end): a recently closed impression, oldest first.
    fn restore_closed(&mut self, key: &str, event: Option<Py<PyAny>>, positive: bool, end: f64) {
        self.join.restore_closed(key, Closed { event: event.map(Event), positive, end });
    }

    /// restore_decided(event, positive, time, kind): a sample decided and not handed out, in order.
    fn restore_decided(&mut self, event: Py<PyAny>, positive: bool, time: f64, kind: &str) -> PyResult<()> {
        let kind = kind_of(kind)?;
        self.join.restore_decided(Sample { event: Event(event), positive, time, kind });
        Ok(())
    }

    /// restore_counts(values): counts of a checkpointed state, in the order of COUNTS.
    fn restore_counts(&mut self, values: Vec<u64>) -> PyResult<()> {
        let values: [u64; COUNTS] = values
            .try_into()
            .map_err(|v: Vec<u64>| PyValueError::new_err(format!("expected {COUNTS} counts, got {}", v.len())))?;
        self.join.restore_counts(values);
        Ok(())
    }
}
