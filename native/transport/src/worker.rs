//! An embedding worker's gRPC service (`EmbeddingWorker`): a rank's lookups on its bidi stream,
//! several in flight and answered in request order; its gradient pushes taken one at a time, in
//! the rank's order, each answered once its step's gradients are durable while the next is taken
//! meanwhile. The work is a `Worker`'s, which the root crate implements over the pooling core and
//! the PS shards' streams: this module only keeps the streams' order and their windows.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::pb;
use crate::pb::embedding_worker_server::EmbeddingWorker;

/// A call's answer, still to come.
pub type Answer<T> = Pin<Box<dyn Future<Output = Result<T, Status>> + Send>>;

/// What an embedding worker does with a request (the root crate's `worker`).
pub trait Worker: Send + Sync + 'static {
    /// A batch's embeddings: it may wait (the staleness bound, the PS shards).
    fn lookup(&self, request: pb::BatchLookupRequest) -> Answer<pb::BatchLookupResponse>;
    /// Take a push, in the rank's order: it resolves once the push is taken (its step's
    /// gradients queued, if it was the step's last), to the answer that comes once they are durable.
    fn push(&self, request: pb::PushGradientsRequest) -> Answer<Answer<pb::PushGradientsResponse>>;
}

/// Lookups of one stream in flight at once: more than a rank keeps (services/nn_worker).
pub const LOOKUP_WINDOW: usize = 16;
/// Pushes of one stream taken but not yet answered (durable): the rank waits for its pushes'
/// answers before a checkpoint only, so this is far more than it keeps.
const PUSH_WINDOW: usize = 64;

pub struct WorkerService<W: Worker> {
    worker: Arc<W>,
}

impl<W: Worker> WorkerService<W> {
    pub fn new(worker: Arc<W>) -> Self {
        Self { worker }
    }
}

type Outbound<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// Answer `inbound`'s requests in order, `window` at a time, with `start`'s answers; `take`
/// runs before the next request is read (a push's taking, in order). The stream's first error
/// ends it, as `trillium/wire/rpc.py`'s `streamed` servers end theirs.
fn ordered<Req, Resp, F>(mut inbound: Streaming<Req>, window: usize, start: F) -> Outbound<Resp>
where
    Req: Send + 'static,
    Resp: Send + 'static,
    F: Fn(Req) -> Answer<Answer<Resp>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(window);
    tokio::spawn(async move {
        let mut answers = futures_util::stream::FuturesOrdered::new();
        let mut reading = true;
        loop {
            tokio::select! {
                next = inbound.next(), if reading && answers.len() < window => match next {
                    Some(Ok(request)) => match start(request).await {
                        Ok(answer) => answers.push_back(answer),
                        Err(status) => {
                            answers.push_back(Box::pin(std::future::ready(Err(status))) as Answer<Resp>);
                            reading = false;
                        }
                    },
                    Some(Err(status)) => {
                        answers.push_back(Box::pin(std::future::ready(Err(status))) as Answer<Resp>);
                        reading = false;
                    }
                    None => reading = false,
                },
                Some(answer) = answers.next(), if !answers.is_empty() => {
                    let ended = answer.is_err();
                    if tx.send(answer).await.is_err() || ended {
                        return; // the caller went away, or the stream ends with its first error
                    }
                }
                else => return,
            }
        }
    });
    Box::pin(ReceiverStream::new(rx))
}

#[tonic::async_trait]
impl<W: Worker> EmbeddingWorker for WorkerService<W> {
    type LookupBatchesStream = Outbound<pb::BatchLookupResponse>;
    type PushGradientsStream = Outbound<pb::PushGradientsResponse>;

    async fn lookup_batches(
        &self,
        request: Request<Streaming<pb::BatchLookupRequest>>,
    ) -> Result<Response<Self::LookupBatchesStream>, Status> {
        let worker = self.worker.clone();
        // A lookup starts at once: its waits (the bound, the shards) overlap the next ones'.
        let start = move |r| {
            let answer = worker.lookup(r);
            Box::pin(std::future::ready(Ok(answer))) as Answer<Answer<pb::BatchLookupResponse>>
        };
        Ok(Response::new(ordered(request.into_inner(), LOOKUP_WINDOW, start)))
    }

    async fn push_gradients(
        &self,
        request: Request<Streaming<pb::PushGradientsRequest>>,
    ) -> Result<Response<Self::PushGradientsStream>, Status> {
        let worker = self.worker.clone();
        Ok(Response::new(ordered(request.into_inner(), PUSH_WINDOW, move |r| worker.push(r))))
    }
}
