//! A PS shard's gRPC service (`EmbeddingParameterServer`): an embedding worker's lookups on its
//! bidi stream, answered in order, and the tables' stats. The rows come from a `Shard`, which
//! writes them straight into the answer's frame (`frame::ArrayWriter`): the IDs are read in place
//! from the request's buffer, each row written once, then copied once into the HTTP/2 frame.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::frame::{read_array, FrameError};
use crate::pb;
use crate::pb::embedding_parameter_server_server::EmbeddingParameterServer;

/// One lookup of a request: `ids` holds `counts[i]` IDs of `tables[i]` in turn, for attempt
/// `attempt` of job `job_id`.
pub struct Lookup<'a> {
    pub job_id: &'a str,
    pub attempt: i32,
    pub tables: &'a [String],
    pub counts: &'a [i64],
    pub ids: &'a [u64],
    /// False for evaluation: an ID the shard lacks reads as zeros and creates no row.
    pub create: bool,
    pub fp16: bool,
}

/// The rows of a lookup: a codec array frame of every table's rows in the request's order, and
/// each table's dim.
pub struct Rows {
    pub frame: Bytes,
    pub dims: Vec<i64>,
}

/// Why a shard cannot answer.
#[derive(Debug)]
pub enum ShardError {
    /// It holds no tables yet (no job set up): the caller may try again.
    Unavailable(String),
    /// The request names what is not there (an unknown table, counts that do not fit).
    Invalid(String),
    /// The shard itself failed (a table's disk tier): its part of the job fails.
    Failed(String),
    /// The request's attempt was fenced out: the shard serves a later one. Never retried.
    Fenced(String),
}

impl From<ShardError> for Status {
    fn from(e: ShardError) -> Status {
        match e {
            ShardError::Unavailable(m) => Status::unavailable(m),
            ShardError::Invalid(m) => Status::invalid_argument(m),
            ShardError::Failed(m) => Status::internal(m),
            ShardError::Fenced(m) => Status::failed_precondition(m),
        }
    }
}

impl From<FrameError> for ShardError {
    fn from(e: FrameError) -> ShardError {
        ShardError::Invalid(e.0)
    }
}

/// What a PS shard serves from: its store, as the root crate binds it.
pub trait Shard: Send + Sync + 'static {
    fn lookup(&self, lookup: Lookup<'_>) -> Result<Rows, ShardError>;
    /// Whether a lookup may wait on a disk (a table with a disk tier): then it runs off the
    /// server's thread, which must go on reading the other streams.
    fn may_block(&self) -> bool;
    fn stats(&self) -> Result<pb::ShardStatsResponse, ShardError>;
}

/// Upper bounds (seconds) of the lookup latency histogram's buckets: prometheus_client's
/// default, so the PS's `trillium_ps_lookup_seconds` keeps the buckets its dashboards read.
pub const LATENCY_BUCKETS: [f64; 14] =
    [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0];

/// Lookups answered, their seconds, in buckets (not cumulative; the last one is +Inf).
#[derive(Default)]
pub struct LookupMetrics {
    pub count: AtomicU64,
    pub nanos: AtomicU64,
    pub buckets: [AtomicU64; LATENCY_BUCKETS.len() + 1],
}

impl LookupMetrics {
    pub fn observe(&self, seconds: f64) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.nanos.fetch_add((seconds * 1e9) as u64, Ordering::Relaxed);
        let at = LATENCY_BUCKETS.iter().position(|&b| seconds <= b).unwrap_or(LATENCY_BUCKETS.len());
        self.buckets[at].fetch_add(1, Ordering::Relaxed);
    }
}

/// How many answers of a stream may wait for the caller to read them.
const STREAM_WINDOW: usize = 16;

pub struct PsService<S: Shard> {
    shard: Arc<S>,
    metrics: Arc<LookupMetrics>,
}

impl<S: Shard> PsService<S> {
    pub fn new(shard: Arc<S>, metrics: Arc<LookupMetrics>) -> Self {
        Self { shard, metrics }
    }
}

fn answer<S: Shard>(shard: &S, request: &pb::ShardLookupRequest) -> Result<pb::ShardLookupResponse, ShardError> {
    let fp16 = match request.row_dtype.as_str() {
        "" | "float32" => false,
        "float16" => true,
        other => {
            return Err(ShardError::Invalid(format!("unknown row_dtype {other:?}: expected 'float32' or 'float16'")))
        }
    };
    let Some(ids) = request.ids.as_ref() else { return Err(ShardError::Invalid("the request has no ids".into())) };
    let ids = read_array(&ids.data)?;
    let ids = ids.u64s("ids")?;
    let lookup = Lookup {
        job_id: &request.job_id,
        attempt: request.attempt,
        tables: &request.tables,
        counts: &request.counts,
        ids: &ids,
        create: !request.read_only,
        fp16,
    };
    let rows = shard.lookup(lookup)?;
    Ok(pb::ShardLookupResponse {
        rows: Some(pb::Array { dtype: String::new(), shape: vec![], data: rows.frame }),
        dims: rows.dims,
    })
}

#[tonic::async_trait]
impl<S: Shard> EmbeddingParameterServer for PsService<S> {
    type LookupsStream = Pin<Box<dyn Stream<Item = Result<pb::ShardLookupResponse, Status>> + Send>>;

    async fn lookups(
        &self,
        request: Request<Streaming<pb::ShardLookupRequest>>,
    ) -> Result<Response<Self::LookupsStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(STREAM_WINDOW);
        let (shard, metrics) = (self.shard.clone(), self.metrics.clone());
        tokio::spawn(async move {
            // In order, one at a time: a stream's answers come in its requests' order, and its
            // first error ends it (as `trillium/wire/rpc.py`'s `streamed` servers do).
            while let Some(next) = inbound.next().await {
                let answered = match next {
                    Err(status) => Err(status),
                    Ok(request) => {
                        let started = Instant::now();
                        let answered = if shard.may_block() {
                            let shard = shard.clone();
                            tokio::task::spawn_blocking(move || answer(&*shard, &request))
                                .await
                                .unwrap_or_else(|e| Err(ShardError::Failed(format!("a lookup panicked: {e}"))))
                        } else {
                            answer(&*shard, &request)
                        };
                        metrics.observe(started.elapsed().as_secs_f64());
                        answered.map_err(Status::from)
                    }
                };
                let ended = answered.is_err();
                if tx.send(answered).await.is_err() || ended {
                    break; // the caller went away, or the stream ends with its first error
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn stats(&self, _: Request<pb::ShardStatsRequest>) -> Result<Response<pb::ShardStatsResponse>, Status> {
        let shard = self.shard.clone();
        // It waits for each internal shard's lock, which an update reading rows from disk holds.
        let stats = tokio::task::spawn_blocking(move || shard.stats())
            .await
            .map_err(|e| Status::internal(format!("stats panicked: {e}")))?;
        Ok(Response::new(stats?))
    }
}
