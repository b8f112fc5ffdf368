//! An embedding worker's data plane: a rank's lookups and gradient pushes served without Python
//! (`trillium_transport::worker::Worker`).
//!
//! Lookup: wait while it would exceed the staleness bound (`gate`), plan the batch (dedup per
//! table, route by shard: `crate::pooling`), mask the IDs a forget removed (`forget`), ask every
//! owning PS shard on its stream at once (`trillium_transport::client`), widen the rows into
//! place, pool them straight into the answer's frames (`lookup`). Push: scatter the gradients to
//! one per unique ID, hold them until every rank the worker serves has pushed the step, then write
//! one gradient frame per PS shard (`push`) and hand them to the service, which produces them to
//! Kafka in step order and says when they are durable; each push is answered then.
//!
//! The service (services/embedding_worker/server.py) sets each job up (`WorkerCore::start_job`)
//! and ends it, and feeds the gate what the PS shards announce.

mod forget;
mod gate;
mod lookup;
mod push;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, RwLock};

use bytes::Bytes;
use tokio::sync::watch;
use tonic::Status;
use trillium_transport::client::LookupStream;
use trillium_transport::ps::LookupMetrics;

pub use forget::{Forgotten, Mask};
use gate::Gate;
pub use gate::Watermark;

use crate::pooling::{Layout, Plan};

/// Plans kept for gradients not pushed yet; far more than any staleness bound keeps in flight.
const MAX_PENDING: usize = 4096;

/// One PS shard as the worker calls it.
pub struct PsShard {
    pub address: String,
    pub stream: LookupStream,
}

/// What a job's lookups and pushes need to know, set once per job.
pub struct JobSpec {
    pub job_id: String,
    pub attempt: i32,
    pub nn_ranks: i64,
    /// The ranks whose lookups and gradients come here (rank % workers == this worker's index).
    pub ranks: Vec<i32>,
    pub layout: Arc<Layout>,
    pub shards: Vec<PsShard>,
    /// An evaluation reads rows as a published version serves them (`publish.dtype: fp16`).
    pub served_fp16: bool,
    /// The gradients topic carries fp16 (`training.wire_dtype`).
    pub gradients_fp16: bool,
    pub forgotten: Forgotten,
}

/// A batch's plan as its lookup made it, kept until its gradients come: with a forget's masks,
/// per table and shard the positions in its IDs that were asked (None: all of the shard's).
pub struct Held {
    pub plan: Plan,
    pub kept: Vec<Option<Vec<Vec<usize>>>>,
}

impl Held {
    /// Positions of table `t`'s IDs that shard `s` was asked for.
    fn positions(&self, t: usize, s: usize) -> std::borrow::Cow<'_, [usize]> {
        match &self.kept[t] {
            Some(kept) => std::borrow::Cow::Borrowed(&kept[s]),
            None => {
                let off = &self.plan.offsets[t];
                std::borrow::Cow::Owned((off[s]..off[s + 1]).collect())
            }
        }
    }
}

/// Where a step's pushes learn its fate: the messages sent once durable, or why not.
type Outcome = watch::Sender<Option<Result<i32, String>>>;

/// A step's gradients as its ranks push them, until the last one's: they go out together.
struct StepGradients {
    epoch: i32,
    publish: bool,
    ranks: BTreeMap<i32, (Arc<Held>, Vec<Vec<f32>>)>,
    sent: Outcome,
}

/// A step's gradient frames, one per PS shard, for the service to produce.
pub struct StepFrames {
    pub attempt: i32,
    pub step: i64,
    pub epoch: i32,
    pub publish: bool,
    /// The first of the step's ranks: the messages' key.
    pub key_rank: i32,
    pub frames: Vec<Bytes>,
}

/// Told of each complete step (from the server's thread, in step order).
pub type OnStep = Box<dyn Fn(StepFrames) + Send + Sync>;

pub struct Job {
    spec: JobSpec,
    gate: Gate,
    pending: Mutex<Pending>,
    steps: Mutex<HashMap<i64, StepGradients>>,
    /// Complete steps not yet durable: their pushes' answers wait on these.
    sending: Mutex<HashMap<i64, Outcome>>,
}

#[derive(Default)]
struct Pending {
    plans: HashMap<(i32, i64), Arc<Held>>,
    order: VecDeque<(i32, i64)>,
    dropped: u64,
}

/// Latency histograms of the worker's calls (`trillium_lookup_seconds` and its kin).
#[derive(Default)]
pub struct WorkerMetrics {
    pub lookup: LookupMetrics,
    pub staleness_wait: LookupMetrics,
    pub push: LookupMetrics,
}

pub struct WorkerCore {
    /// The worker's name (`embedding_worker-0`), for what a caller is told.
    pub name: String,
    job: RwLock<Option<Arc<Job>>>,
    on_step: OnStep,
    pub metrics: Arc<WorkerMetrics>,
}

impl WorkerCore {
    pub fn new(name: String, on_step: OnStep) -> Self {
        Self { name, job: RwLock::new(None), on_step, metrics: Arc::default() }
    }

    /// Serve `spec`'s job from now on, ending the one before (its waiting calls fail).
    pub fn start_job(&self, spec: JobSpec) {
        let gate = Gate::new();
        let job =
            Arc::new(Job { spec, gate, pending: Mutex::default(), steps: Mutex::default(), sending: Mutex::default() });
        if let Some(old) = self.job.write().unwrap_or_else(|e| e.into_inner()).replace(job) {
            old.end();
        }
    }

    /// Serve no job: lookups are UNAVAILABLE, and every call waiting fails.
    pub fn end_job(&self) {
        if let Some(old) = self.job.write().unwrap_or_else(|e| e.into_inner()).take() {
            old.end();
        }
    }

    /// The job of `attempt`, if it is the one served.
    pub fn job(&self, attempt: Option<i32>) -> Option<Arc<Job>> {
        let job = self.job.read().unwrap_or_else(|e| e.into_inner()).clone()?;
        attempt.is_none_or(|a| a == job.spec.attempt).then_some(job)
    }

    fn job_for(&self, attempt: i32) -> Result<Arc<Job>, Status> {
        let job = self.job.read().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(job) = job else { return Err(Status::unavailable(format!("{} has no job set up", self.name))) };
        if job.spec.attempt != attempt {
            return Err(Status::failed_precondition(format!(
                "{} serves attempt {} of job {}, not attempt {attempt}",
                self.name, job.spec.attempt, job.spec.job_id
            )));
        }
        Ok(job)
    }
}

impl Job {
    pub fn attempt(&self) -> i32 {
        self.spec.attempt
    }

    pub fn set_watermark(&self, mark: Watermark) {
        self.gate.set(mark);
    }

    /// Plans held for gradients not pushed yet, and how many were dropped (never pushed).
    pub fn pending(&self) -> (usize, u64) {
        let p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        (p.plans.len(), p.dropped)
    }

    fn hold(&self, rank: i32, batch_id: i64, held: Held) {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if p.plans.insert((rank, batch_id), Arc::new(held)).is_none() {
            p.order.push_back((rank, batch_id));
        }
        while p.plans.len() > MAX_PENDING {
            let Some(oldest) = p.order.pop_front() else { break };
            if p.plans.remove(&oldest).is_some() {
                p.dropped += 1;
            }
        }
    }

    fn take(&self, rank: i32, batch_id: i64) -> Option<Arc<Held>> {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let held = p.plans.remove(&(rank, batch_id))?;
        if let Some(at) = p.order.iter().position(|k| *k == (rank, batch_id)) {
            p.order.remove(at);
        }
        Some(held)
    }

    /// The job ends: waiting lookups fail, and pushes waiting for ranks or acks that will not come.
    fn end(&self) {
        self.gate.close();
        let ended = || Some(Err("the job ended before the step's gradients were sent".to_string()));
        for (_, step) in self.steps.lock().unwrap_or_else(|e| e.into_inner()).drain() {
            step.sent.send_replace(ended());
        }
        for (_, sent) in self.sending.lock().unwrap_or_else(|e| e.into_inner()).drain() {
            sent.send_replace(ended());
        }
    }

    /// The service's word on a step it produced: durable (its messages), or why not.
    pub fn step_done(&self, step: i64, outcome: Result<i32, String>) {
        if let Some(sent) = self.sending.lock().unwrap_or_else(|e| e.into_inner()).remove(&step) {
            sent.send_replace(Some(outcome));
        }
    }
}

impl trillium_transport::worker::Worker for WorkerCore {
    fn lookup(
        &self,
        request: trillium_transport::pb::BatchLookupRequest,
    ) -> trillium_transport::worker::Answer<trillium_transport::pb::BatchLookupResponse> {
        let job = self.job_for(request.attempt);
        let (name, metrics) = (self.name.clone(), self.metrics.clone());
        Box::pin(async move { lookup::lookup(&name, job?, &metrics, request).await })
    }

    fn push(
        &self,
        request: trillium_transport::pb::PushGradientsRequest,
    ) -> trillium_transport::worker::Answer<
        trillium_transport::worker::Answer<trillium_transport::pb::PushGradientsResponse>,
    > {
        let answer = push::push(self, request);
        Box::pin(std::future::ready(answer))
    }
}
