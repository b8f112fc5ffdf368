//! Bindings of a multi-task job's joiner (`trillium_stream::task_join`);
//! `trillium/data/sources/task_joiner.py` subclasses it as `PartitionTaskJoin`, adding its config
//! and its checkpointed state.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

use super::events::PyEventDecoder;
use super::join::{key_and_time, Event};
use trillium_stream::task_join::{TaskJoin, TaskSample, COUNTS, TASK_COUNTS};

/// TaskJoin(windows, correct_late_labels, max_open): the join of one input partition of a
/// multi-task job, a window per task. Its events are `(values, key, time)` tuples (an `Event`).
#[pyclass(name = "TaskJoin", module = "trillium_native", subclass)]
pub(crate) struct PyTaskJoin {
    join: TaskJoin<Event>,
    // A label as the encoder reads it: "1", "0", or "" (none).
    texts: [Py<PyString>; 3],
}

/// Samples as `advance` hands them out: (events, labels, times, corrections), a list per field;
/// a sample's labels are a tuple of "1", "0" or "" (no label), a text per task.
type Columns<'py> = (Vec<Py<PyAny>>, Vec<Bound<'py, PyTuple>>, Vec<f64>, Vec<bool>);

impl PyTaskJoin {
    fn columns<'py>(
        &self,
        py: Python<'py>,
        samples: impl ExactSizeIterator<Item = TaskSample<Event>>,
    ) -> PyResult<Columns<'py>> {
        let n = samples.len();
        let mut out: Columns<'py> =
            (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
        for s in samples {
            let labels = s.labels.iter().map(|label| {
                let text = match label {
                    Some(true) => &self.texts[0],
                    Some(false) => &self.texts[1],
                    None => &self.texts[2],
                };
                text.bind(py).clone()
            });
            out.1.push(PyTuple::new(py, labels)?);
            out.0.push(s.event.0);
            out.2.push(s.time);
            out.3.push(s.correction);
        }
        Ok(out)
    }

    fn task(&self, task: usize) -> PyResult<usize> {
        if task < self.join.tasks() {
            Ok(task)
        } else {
            Err(PyValueError::new_err(format!("task {task} of a join of {} tasks", self.join.tasks())))
        }
    }
}

fn label_of(text: &str) -> PyResult<Option<bool>> {
    match text {
        "1" => Ok(Some(true)),
        "0" => Ok(Some(false)),
        "" => Ok(None),
        other => Err(PyValueError::new_err(format!("a joined label is \"1\", \"0\" or \"\", got {other:?}"))),
    }
}

#[pymethods]
impl PyTaskJoin {
    #[new]
    fn new(py: Python<'_>, windows: Vec<f64>, correct_late_labels: bool, max_open: usize) -> PyResult<Self> {
        if windows.is_empty() || windows.iter().any(|w| !(w.is_finite() && *w > 0.0)) {
            return Err(PyValueError::new_err(format!("a window per task, each positive: got {windows:?}")));
        }
        Ok(Self {
            join: TaskJoin::new(windows, correct_late_labels, max_open),
            texts: ["1", "0", ""].map(|t| PyString::intern(py, t).unbind()),
        })
    }

    /// impression(event): an impression, keyed (a duplicate of one tracked is counted).
    fn impression(&mut self, event: &Bound<'_, PyAny>) -> PyResult<()> {
        let (key, time) = key_and_time(event)?;
        self.join.impression(key.to_str()?, time, Event(event.clone().unbind()));
        Ok(())
    }

    /// label(task, key, time): a label of task `task` (its index) for the impression `key`.
    fn label(&mut self, task: usize, key: &str, time: f64) -> PyResult<()> {
        let task = self.task(task)?;
        self.join.label(task, key, time);
        Ok(())
    }

    /// take(decoder, messages, start, task, earliest, newest) -> (stop, latest): as
    /// `EventJoin.take`, the messages from `start` on as impressions (`task` None) or as labels
    /// of `task`.
    #[allow(clippy::too_many_arguments)]
    fn take(
        &mut self,
        py: Python<'_>,
        decoder: &Bound<'_, PyEventDecoder>,
        messages: &Bound<'_, PyList>,
        start: usize,
        task: Option<usize>,
        earliest: f64,
        newest: f64,
    ) -> PyResult<(usize, f64)> {
        let task = task.map(|t| self.task(t)).transpose()?;
        let decoder = decoder.get();
        let mut latest = f64::NEG_INFINITY;
        for i in start..messages.len() {
            let item = messages.get_item(i)?;
            let Ok(raw) = item.cast::<PyBytes>() else { return Ok((i, latest)) };
            let decoded = match decoder.spec.decode(raw.as_bytes(), task.is_none()) {
                Some(d) if d.key.is_some() && earliest <= d.time && d.time <= newest => d,
                _ => return Ok((i, latest)),
            };
            let (time, key) = (decoded.time, decoded.key.clone().expect("checked above"));
            match task {
                None => {
                    let event = decoder.event(py, decoded)?;
                    self.join.impression(&key, time, Event(event.unbind()));
                }
                Some(task) => self.join.label(task, &key, time),
            }
            latest = latest.max(time);
        }
        Ok((messages.len(), latest))
    }

    /// advance(watermark) -> (events, labels, times, corrections): the samples decided at or
    /// before it, in the order of their decisions, a list per field.
    fn advance<'py>(&mut self, py: Python<'py>, watermark: f64) -> PyResult<Columns<'py>> {
        let samples = self.join.advance(watermark);
        self.columns(py, samples.into_iter())
    }

    /// The counts of impressions, in the order of task_joiner.py's COUNTS.
    fn count_values(&self) -> Vec<u64> {
        self.join.counts().to_vec()
    }

    /// Each task's counts of labels, in the order of task_joiner.py's TASK_COUNTS.
    fn task_count_values(&self) -> Vec<Vec<u64>> {
        self.join.task_counts().iter().map(|c| c.to_vec()).collect()
    }

    /// How many impressions the join tracks (waiting for their sample or for later labels).
    #[getter]
    fn tracked_count(&self) -> usize {
        self.join.tracked_len()
    }

    /// parts() -> (tracked [(event, label times, emitted)], held [[(key, time)] per task],
    /// decided samples as `advance` gives them): the state but its counts, in a fixed order.
    #[allow(clippy::type_complexity)]
    fn parts<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Vec<(Py<PyAny>, Vec<f64>, bool)>, Vec<Vec<(String, f64)>>, Columns<'py>)> {
        let tracked = self
            .join
            .tracked_entries()
            .into_iter()
            .map(|(_, t)| (t.event.0.clone_ref(py), t.labels.clone(), t.emitted))
            .collect();
        let held = (0..self.join.tasks())
            .map(|task| self.join.held_entries(task).into_iter().map(|(k, t)| (k.to_owned(), t)).collect())
            .collect();
        let decided: Vec<_> = self.join.decided_entries().into_iter().cloned().collect();
        Ok((tracked, held, self.columns(py, decided.into_iter())?))
    }

    /// restore_tracked(event, label times, emitted): a tracked impression of a checkpointed
    /// state, in the order `parts` lists them (nothing counted).
    fn restore_tracked(&mut self, event: &Bound<'_, PyAny>, labels: Vec<f64>, emitted: bool) -> PyResult<()> {
        let (key, time) = key_and_time(event)?;
        if labels.len() != self.join.tasks() {
            return Err(PyValueError::new_err(format!(
                "expected {} label times, got {}",
                self.join.tasks(),
                labels.len()
            )));
        }
        self.join.restore_tracked(key.to_str()?, time, Event(event.clone().unbind()), labels, emitted);
        Ok(())
    }

    /// restore_held(task, key, time): a held label of a checkpointed state.
    fn restore_held(&mut self, task: usize, key: &str, time: f64) -> PyResult<()> {
        let task = self.task(task)?;
        self.join.restore_held(task, key, time);
        Ok(())
    }

    /// restore_decided(event, labels, time, correction): a sample decided and not handed out, in order.
    fn restore_decided(&mut self, event: Py<PyAny>, labels: Vec<String>, time: f64, correction: bool) -> PyResult<()> {
        if labels.len() != self.join.tasks() {
            return Err(PyValueError::new_err(format!("expected {} labels, got {}", self.join.tasks(), labels.len())));
        }
        let labels = labels.iter().map(|l| label_of(l)).collect::<PyResult<_>>()?;
        self.join.restore_decided(TaskSample { event: Event(event), labels, time, correction });
        Ok(())
    }

    /// restore_counts(values, task values): counts of a checkpointed state, in the orders of
    /// COUNTS and TASK_COUNTS.
    fn restore_counts(&mut self, values: Vec<u64>, task_values: Vec<Vec<u64>>) -> PyResult<()> {
        let values: [u64; COUNTS] = values
            .try_into()
            .map_err(|v: Vec<u64>| PyValueError::new_err(format!("expected {COUNTS} counts, got {}", v.len())))?;
        if task_values.len() != self.join.tasks() {
            return Err(PyValueError::new_err(format!("expected {} tasks' counts", self.join.tasks())));
        }
        let task_values = task_values
            .into_iter()
            .map(|v| {
                v.try_into().map_err(|v: Vec<u64>| {
                    PyValueError::new_err(format!("expected {TASK_COUNTS} counts a task, got {}", v.len()))
                })
            })
            .collect::<PyResult<Vec<[u64; TASK_COUNTS]>>>()?;
        self.join.restore_counts(values, &task_values);
        Ok(())
    }
}
