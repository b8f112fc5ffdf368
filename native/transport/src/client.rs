//! Calls to a PS shard from Rust: a channel with the stack's token, TLS and limits (as
//! `trillium/wire/rpc.py`'s `channel`), and the lookups as unary calls on one bidi stream,
//! answered in order (rpc.py's `OrderedStream`): the stream opens at the first call, and its
//! first error ends it, failing every call pending and every later one with that error; whoever
//! made them decides what follows (a job's context is built afresh with new streams).

use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;
use tonic::metadata::MetadataValue;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Request, Status};

use crate::pb;
use crate::pb::embedding_parameter_server_client::EmbeddingParameterServerClient;

/// What a client needs of the stack's settings (`trillium.config.GrpcCredentials`, rpc.py's limits).
#[derive(Clone)]
pub struct ClientConfig {
    pub token: String,
    /// The CA bundle, PEM, that the servers' certificates chain to; None: plaintext.
    pub tls_ca: Option<Vec<u8>>,
    pub max_message_bytes: usize,
    pub keepalive: Duration,
    pub keepalive_timeout: Duration,
}

/// A channel to `address` (`host:port`), connected at its first call. Must be made inside a
/// tokio runtime (the channel's worker task is spawned on it).
pub fn channel(address: &str, config: &ClientConfig) -> Result<Channel, String> {
    let scheme = if config.tls_ca.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{address}"))
        .map_err(|e| format!("gRPC address {address}: {e}"))?
        .tcp_nodelay(true)
        .http2_keep_alive_interval(config.keepalive)
        .keep_alive_timeout(config.keepalive_timeout)
        .keep_alive_while_idle(true);
    if let Some(ca) = &config.tls_ca {
        let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
        endpoint = endpoint.tls_config(tls).map_err(|e| format!("gRPC TLS to {address}: {e}"))?;
    }
    Ok(endpoint.connect_lazy())
}

/// A status code as gRPC names it (`UNAVAILABLE`), as Python's `StatusCode.name` reads.
pub fn code_name(code: tonic::Code) -> String {
    let camel = format!("{code:?}");
    let mut out = String::with_capacity(camel.len() + 4);
    for (i, c) in camel.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

type Pending = VecDeque<oneshot::Sender<Result<pb::ShardLookupResponse, Status>>>;

enum State {
    Closed,
    Open { requests: mpsc::UnboundedSender<pb::ShardLookupRequest>, pending: Pending },
    Failed(Status),
}

/// A PS shard's `Lookups` stream, as unary calls answered in order.
pub struct LookupStream {
    client: EmbeddingParameterServerClient<Channel>,
    token: MetadataValue<tonic::metadata::Ascii>,
    state: Arc<Mutex<State>>,
}

impl LookupStream {
    pub fn new(channel: Channel, config: &ClientConfig) -> Result<Self, String> {
        let client = EmbeddingParameterServerClient::new(channel)
            .max_decoding_message_size(config.max_message_bytes)
            .max_encoding_message_size(config.max_message_bytes);
        let token = format!("Bearer {}", config.token).parse().map_err(|_| "the token is not ASCII".to_string())?;
        Ok(Self { client, token, state: Arc::new(Mutex::new(State::Closed)) })
    }

    /// Send `request` after every one sent before it; the future gives its answer. Must be
    /// called inside the runtime (the stream's reader is spawned on it).
    pub fn call(
        &self,
        request: pb::ShardLookupRequest,
    ) -> impl Future<Output = Result<pb::ShardLookupResponse, Status>> {
        let (answer, answered) = oneshot::channel();
        {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if matches!(*state, State::Closed) {
                *state = self.open();
            }
            match &mut *state {
                State::Failed(status) => {
                    let _ = answer.send(Err(status.clone()));
                }
                State::Open { requests, pending } => {
                    // In one critical section: the answers come in the order the requests went.
                    pending.push_back(answer);
                    let _ = requests.send(request); // a stream gone fails the pending calls itself
                }
                State::Closed => unreachable!("opened just above"),
            }
        }
        async move { answered.await.unwrap_or_else(|_| Err(Status::unavailable("the stream was closed"))) }
    }

    fn open(&self) -> State {
        let (requests, outbound) = mpsc::unbounded_channel();
        let mut call = Request::new(UnboundedReceiverStream::new(outbound));
        call.metadata_mut().insert("authorization", self.token.clone());
        let (mut client, state) = (self.client.clone(), self.state.clone());
        tokio::spawn(async move {
            let failure = match client.lookups(call).await {
                Err(status) => status,
                Ok(response) => {
                    let mut answers = response.into_inner();
                    loop {
                        match answers.next().await {
                            Some(Ok(answer)) => {
                                let next = match &mut *state.lock().unwrap_or_else(|e| e.into_inner()) {
                                    State::Open { pending, .. } => pending.pop_front(),
                                    _ => None,
                                };
                                match next {
                                    Some(caller) => {
                                        let _ = caller.send(Ok(answer)); // its caller may have given up
                                    }
                                    None => break Status::internal("the shard answered a call never made"),
                                }
                            }
                            Some(Err(status)) => break status,
                            None => break Status::unavailable("the stream ended with calls unanswered"),
                        }
                    }
                }
            };
            fail(&state, failure);
        });
        State::Open { requests, pending: VecDeque::new() }
    }
}

fn fail(state: &Mutex<State>, status: Status) {
    let previous =
        std::mem::replace(&mut *state.lock().unwrap_or_else(|e| e.into_inner()), State::Failed(status.clone()));
    if let State::Open { pending, .. } = previous {
        for caller in pending {
            let _ = caller.send(Err(status.clone()));
        }
    }
}

impl Drop for LookupStream {
    fn drop(&mut self) {
        // The requests' sender is dropped: the shard sees the stream end, and its reader goes.
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(*state, State::Open { .. }) {
            *state = State::Failed(Status::unavailable("the stream was closed"));
        }
    }
}
