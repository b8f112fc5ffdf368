//! Bindings of an embedding worker's native data plane (`WorkerServer`): Python starts it, sets
//! each job up and ends it, feeds its staleness gate what the PS shards announce, produces each
//! step's gradient frames to Kafka and says when they are durable, and reads its histograms; the
//! lookups and pushes never reach Python.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use trillium_transport::client::{channel, ClientConfig, LookupStream};
use trillium_transport::server::{serve_worker, RunningServer};

use super::pooling::PyLayout;
use super::ps_server::{histogram, server_config};
use crate::worker::{Forgotten, JobSpec, Mask, PsShard, StepFrames, Watermark, WorkerCore};

/// An embedding worker's `EmbeddingWorker` service (lookups, pushes) on its own thread.
#[pyclass(name = "WorkerServer", module = "trillium_native", frozen)]
pub struct PyWorkerServer {
    core: Arc<WorkerCore>,
    runtime: tokio::runtime::Handle,
    running: Mutex<Option<RunningServer>>,
    port: u16,
}

/// A step's frames as Python takes them: (attempt, step, epoch, publish, key_rank, [bytes per shard]).
type StepTuple<'py> = (i32, i64, i32, bool, i32, Vec<Bound<'py, PyBytes>>);

#[pymethods]
impl PyWorkerServer {
    /// Bind `host:port` and serve. `on_step(attempt, step, epoch, publish, key_rank, frames)` is
    /// called from the server's thread, in step order, with each complete step's gradient frames
    /// (one per PS shard); the service produces them and answers with `step_sent` / `step_failed`.
    #[new]
    #[pyo3(signature = (
        host, port, token, *, name, on_step, tls_cert=None, tls_key=None,
        max_message_bytes, keepalive_s, keepalive_timeout_s
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        host: String,
        port: u16,
        token: String,
        name: String,
        on_step: Py<PyAny>,
        tls_cert: Option<Vec<u8>>,
        tls_key: Option<Vec<u8>>,
        max_message_bytes: usize,
        keepalive_s: f64,
        keepalive_timeout_s: f64,
    ) -> PyResult<Self> {
        let notify = move |step: StepFrames| {
            Python::attach(|py| {
                let frames = step.frames.iter().map(|f| PyBytes::new(py, f)).collect();
                let args: StepTuple<'_> = (step.attempt, step.step, step.epoch, step.publish, step.key_rank, frames);
                if let Err(e) = on_step.call1(py, args) {
                    e.print(py); // a failing hook must not take the server's thread with it
                }
            })
        };
        let core = Arc::new(WorkerCore::new(name, Box::new(notify)));
        let config =
            server_config(host, port, token, tls_cert, tls_key, max_message_bytes, keepalive_s, keepalive_timeout_s)?;
        let (running, runtime) = py.detach(|| serve_worker(config, core.clone())).map_err(PyOSError::new_err)?;
        let port = running.port;
        Ok(Self { core, runtime, running: Mutex::new(Some(running)), port })
    }

    /// The port it listens on (the one asked for, or the one given for port 0).
    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// Serve a job from now on (the one before ends: its waiting calls fail). `shards`: each PS
    /// shard's address, in shard order, called with `ps_token` (over TLS with `ps_tls_ca`);
    /// `forgotten`: the job's forget masks as (through_batch, {table: IDs}).
    #[pyo3(signature = (
        *, job_id, attempt, nn_ranks, ranks, layout, shards, served_fp16, gradients_fp16, forgotten,
        ps_token, ps_tls_ca=None, max_message_bytes, keepalive_s, keepalive_timeout_s
    ))]
    #[allow(clippy::too_many_arguments)]
    fn start_job(
        &self,
        job_id: String,
        attempt: i32,
        nn_ranks: i64,
        ranks: Vec<i32>,
        layout: PyRef<'_, PyLayout>,
        shards: Vec<String>,
        served_fp16: bool,
        gradients_fp16: bool,
        forgotten: Vec<(i64, HashMap<String, Vec<u64>>)>,
        ps_token: String,
        ps_tls_ca: Option<Vec<u8>>,
        max_message_bytes: usize,
        keepalive_s: f64,
        keepalive_timeout_s: f64,
    ) -> PyResult<()> {
        if nn_ranks < 1 {
            return Err(PyValueError::new_err(format!("nn_ranks must be >= 1, got {nn_ranks}")));
        }
        if shards.len() != layout.layout.num_shards as usize {
            return Err(PyValueError::new_err(format!(
                "{} shard addresses for a layout over {} shards",
                shards.len(),
                layout.layout.num_shards
            )));
        }
        let config = ClientConfig {
            token: ps_token,
            tls_ca: ps_tls_ca,
            max_message_bytes,
            keepalive: Duration::from_secs_f64(keepalive_s),
            keepalive_timeout: Duration::from_secs_f64(keepalive_timeout_s),
        };
        // The channels' tasks run on the server's runtime.
        let _entered = self.runtime.enter();
        let shards = shards
            .into_iter()
            .map(|address| {
                let stream = LookupStream::new(channel(&address, &config)?, &config)?;
                Ok(PsShard { address, stream })
            })
            .collect::<Result<Vec<_>, String>>()
            .map_err(PyValueError::new_err)?;
        let masks: Vec<Mask> =
            forgotten.into_iter().map(|(through, tables)| (through, tables.into_iter().collect())).collect();
        self.core.start_job(JobSpec {
            job_id,
            attempt,
            nn_ranks,
            ranks,
            layout: layout.layout.clone(),
            shards,
            served_fp16,
            gradients_fp16,
            forgotten: Forgotten::new(&masks),
        });
        Ok(())
    }

    /// Serve no job: lookups are UNAVAILABLE, and every call waiting fails.
    fn end_job(&self) {
        self.core.end_job();
    }

    /// What the PS shards have announced for `attempt`: `steps` applied on every shard, the
    /// live `bound` (None: none), `loaded` once both are known. Ignored for another attempt.
    #[pyo3(signature = (attempt, steps, bound, loaded))]
    fn set_watermark(&self, attempt: i32, steps: i64, bound: Option<i64>, loaded: bool) {
        if let Some(job) = self.core.job(Some(attempt)) {
            job.set_watermark(Watermark { steps, bound, loaded });
        }
    }

    /// Step `step` of `attempt` is durable as `messages` messages: its pushes are answered.
    fn step_sent(&self, attempt: i32, step: i64, messages: i32) {
        if let Some(job) = self.core.job(Some(attempt)) {
            job.step_done(step, Ok(messages));
        }
    }

    /// Step `step` of `attempt` could not be sent: each of its pushes fails with `error`.
    fn step_failed(&self, attempt: i32, step: i64, error: String) {
        if let Some(job) = self.core.job(Some(attempt)) {
            job.step_done(step, Err(error));
        }
    }

    /// (plans held for gradients not pushed yet, plans dropped because none came) of the job served.
    fn pending(&self) -> (usize, u64) {
        self.core.job(None).map_or((0, 0), |job| job.pending())
    }

    /// {"lookup" | "staleness_wait" | "push": (count, seconds, per-bucket counts)}: the
    /// histograms of `ShardServer.buckets()`' bounds.
    fn metrics(&self) -> HashMap<&'static str, (u64, f64, Vec<u64>)> {
        let m = &self.core.metrics;
        HashMap::from([
            ("lookup", histogram(&m.lookup)),
            ("staleness_wait", histogram(&m.staleness_wait)),
            ("push", histogram(&m.push)),
        ])
    }

    /// Whether the server's thread has ended (stopped, or failed).
    fn ended(&self) -> bool {
        self.running.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_none_or(RunningServer::ended)
    }

    /// End the job, stop serving and wait for the server's thread; idempotent.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        self.core.end_job();
        let running = self.running.lock().unwrap_or_else(|e| e.into_inner()).take();
        match running {
            Some(mut r) => py.detach(move || r.stop()).map_err(PyRuntimeError::new_err),
            None => Ok(()),
        }
    }
}
