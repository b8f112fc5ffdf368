//! Bindings of a PS shard's native gRPC server (`ShardServer`): Python starts it, hands it each
//! job's store, reads its lookup metrics and stops it; the lookups never reach Python.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::{PyOSError, PyRuntimeError};
use pyo3::prelude::*;
use trillium_transport::ps::{LookupMetrics, LATENCY_BUCKETS};
use trillium_transport::server::{serve_ps, RunningServer, ServerConfig};

use super::store::PyStore;
use crate::ps_shard::{Served, ServedStore};

/// A gRPC server's settings from its binding's arguments (the stack's token, TLS, limits).
#[allow(clippy::too_many_arguments)]
pub(super) fn server_config(
    host: String,
    port: u16,
    token: String,
    tls_cert: Option<Vec<u8>>,
    tls_key: Option<Vec<u8>>,
    max_message_bytes: usize,
    keepalive_s: f64,
    keepalive_timeout_s: f64,
) -> PyResult<ServerConfig> {
    let tls = match (tls_cert, tls_key) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        _ => return Err(PyRuntimeError::new_err("TLS needs both a certificate and a key")),
    };
    Ok(ServerConfig {
        host,
        port,
        token,
        tls,
        max_message_bytes,
        keepalive: Duration::from_secs_f64(keepalive_s),
        keepalive_timeout: Duration::from_secs_f64(keepalive_timeout_s),
    })
}

/// (calls answered, their seconds, the count of each of `LATENCY_BUCKETS`' buckets and of +Inf).
pub(super) fn histogram(m: &LookupMetrics) -> (u64, f64, Vec<u64>) {
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    (load(&m.count), load(&m.nanos) as f64 / 1e9, m.buckets.iter().map(load).collect())
}

/// A PS shard's `EmbeddingParameterServer` (lookups, stats) on its own thread.
#[pyclass(name = "ShardServer", module = "trillium_native", frozen)]
pub struct PyShardServer {
    served: Arc<ServedStore>,
    metrics: Arc<LookupMetrics>,
    running: Mutex<Option<RunningServer>>,
    port: u16,
}

#[pymethods]
impl PyShardServer {
    /// Bind `host:port` and serve; `on_failure(error)` is called (from the server's thread)
    /// when a lookup finds the shard itself failed (a table's disk tier), before the caller
    /// is answered.
    #[new]
    #[pyo3(signature = (
        host, port, token, *, name, shard, on_failure, tls_cert=None, tls_key=None,
        max_message_bytes, keepalive_s, keepalive_timeout_s
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        host: String,
        port: u16,
        token: String,
        name: String,
        shard: i32,
        on_failure: Py<PyAny>,
        tls_cert: Option<Vec<u8>>,
        tls_key: Option<Vec<u8>>,
        max_message_bytes: usize,
        keepalive_s: f64,
        keepalive_timeout_s: f64,
    ) -> PyResult<Self> {
        let notify = move |error: &str| {
            Python::attach(|py| {
                if let Err(e) = on_failure.call1(py, (error,)) {
                    e.print(py); // a failing hook must not take the server's thread with it
                }
            })
        };
        let served = Arc::new(ServedStore::new(name, shard, Box::new(notify)));
        let metrics = Arc::new(LookupMetrics::default());
        let config =
            server_config(host, port, token, tls_cert, tls_key, max_message_bytes, keepalive_s, keepalive_timeout_s)?;
        let running = py.detach(|| serve_ps(config, served.clone(), metrics.clone())).map_err(PyOSError::new_err)?;
        let port = running.port;
        Ok(Self { served, metrics, running: Mutex::new(Some(running)), port })
    }

    /// The port it listens on (the one asked for, or the one given for port 0).
    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// Serve this store's tables to the lookups of attempt `attempt` of job `job_id` from now on:
    /// an earlier attempt's are FAILED_PRECONDITION, a later one's or another job's UNAVAILABLE.
    #[pyo3(signature = (store, *, job_id, attempt))]
    fn serve(&self, store: PyRef<'_, PyStore>, job_id: String, attempt: i32) {
        self.served.serve(Some(Served { store: store.store.clone(), job_id, attempt }));
    }

    /// Serve no tables from now on: lookups are UNAVAILABLE.
    fn clear(&self) {
        self.served.serve(None);
    }

    /// (lookups answered, their seconds, the count of each of `buckets()`'s buckets and of +Inf).
    fn lookup_metrics(&self) -> (u64, f64, Vec<u64>) {
        histogram(&self.metrics)
    }

    /// The latency buckets' upper bounds, in seconds.
    #[staticmethod]
    fn buckets() -> Vec<f64> {
        LATENCY_BUCKETS.to_vec()
    }

    /// Whether the server's thread has ended (stopped, or failed).
    fn ended(&self) -> bool {
        self.running.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_none_or(RunningServer::ended)
    }

    /// Stop serving and wait for the server's thread; idempotent.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        let running = self.running.lock().unwrap_or_else(|e| e.into_inner()).take();
        match running {
            Some(mut r) => py.detach(move || r.stop()).map_err(PyRuntimeError::new_err),
            None => Ok(()),
        }
    }
}
