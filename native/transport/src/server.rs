//! A gRPC server on a thread of its own: a tokio runtime (one thread: a shard's lookups are
//! short, and the machine's cores are the NN ranks'), the stack's token checked on every call,
//! TLS when configured, the message size and keepalive limits of `trillium/wire/rpc.py`.
//!
//! `serve_ps` and `serve_worker` bind before they return (a taken port is an error to its caller, not a dead
//! thread), and `RunningServer::stop` ends the server and waits for its thread; dropping the
//! handle stops it too.

use std::net::{SocketAddr, TcpListener as StdListener, ToSocketAddrs};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::oneshot;
use tonic::metadata::MetadataValue;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic::{Request, Status};

use tonic::service::interceptor::InterceptedService;

use crate::pb::embedding_parameter_server_server::EmbeddingParameterServerServer;
use crate::pb::embedding_worker_server::EmbeddingWorkerServer;
use crate::ps::{LookupMetrics, PsService, Shard};
use crate::worker::{Worker, WorkerService};

/// What a server needs of the stack's settings (`trillium.config.GrpcCredentials` and rpc.py's limits).
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    pub token: String,
    /// The certificate chain and key, PEM, for TLS; None: plaintext (loopback, a private network).
    pub tls: Option<(Vec<u8>, Vec<u8>)>,
    pub max_message_bytes: usize,
    pub keepalive: Duration,
    pub keepalive_timeout: Duration,
}

/// Refuses a call without the stack's token, in time that does not depend on how much of it is right.
#[derive(Clone)]
struct RequireToken {
    expected: Arc<Vec<u8>>,
}

impl tonic::service::Interceptor for RequireToken {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let given = request.metadata().get("authorization").map(MetadataValue::as_bytes).unwrap_or_default();
        if constant_time_eq(given, &self.expected) {
            Ok(request)
        } else {
            Err(Status::unauthenticated("missing or invalid token"))
        }
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    // The length is not secret (the token's is fixed); the bytes are compared in full.
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub struct RunningServer {
    pub port: u16,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<Result<(), String>>>,
}

impl RunningServer {
    /// Stop serving (streams in flight end) and wait for the server's thread; idempotent.
    pub fn stop(&mut self) -> Result<(), String> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(()); // a server already gone has nothing to stop
        }
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| "the gRPC server's thread panicked".to_string())?,
            None => Ok(()),
        }
    }

    /// Whether the server's thread has ended (with an error, or stopped).
    pub fn ended(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

fn bind(host: &str, port: u16) -> Result<StdListener, String> {
    let addrs: Vec<SocketAddr> =
        (host, port).to_socket_addrs().map_err(|e| format!("gRPC address {host}:{port}: {e}"))?.collect();
    let listener = StdListener::bind(addrs.as_slice()).map_err(|e| format!("gRPC bind {host}:{port}: {e}"))?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    Ok(listener)
}

const MAX_STREAMS_PER_CONNECTION: u32 = 128;

/// A server's thread: its runtime, handed out too (the worker's PS streams run on it).
struct Spawned {
    running: RunningServer,
    runtime: tokio::runtime::Handle,
}

type Serving = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), tonic::transport::Error>> + Send>>;

/// Bind `config`'s address and run `serve(builder, incoming, shutdown)` on a thread of its own.
fn spawn(
    config: &ServerConfig,
    serve: impl FnOnce(Server, TcpIncoming, oneshot::Receiver<()>) -> Serving + Send + 'static,
) -> Result<Spawned, String> {
    let listener = bind(&config.host, config.port)?;
    let port = listener.local_addr().map_err(|e| e.to_string())?.port();
    // What any caller may hold open, token or not, as the Python servers bound it (trillium.wire.rpc):
    // streams on one connection, and requests in flight on it.
    let mut builder = Server::builder()
        .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION))
        .concurrency_limit_per_connection(MAX_STREAMS_PER_CONNECTION as usize)
        .http2_keepalive_interval(Some(config.keepalive))
        .http2_keepalive_timeout(Some(config.keepalive_timeout));
    if let Some((cert, key)) = &config.tls {
        let tls = ServerTlsConfig::new().identity(Identity::from_pem(cert, key));
        builder = builder.tls_config(tls).map_err(|e| format!("gRPC TLS: {e}"))?;
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("the gRPC server's runtime: {e}"))?;
    let handle = runtime.handle().clone();
    let (tx, rx) = oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name(format!("grpc:{port}"))
        .spawn(move || {
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).map_err(|e| e.to_string())?;
                let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
                serve(builder, incoming, rx).await.map_err(|e| format!("the gRPC server on port {port}: {e}"))
            })
        })
        .map_err(|e| format!("the gRPC server's thread: {e}"))?;
    Ok(Spawned { running: RunningServer { port, shutdown: Some(tx), thread: Some(thread) }, runtime: handle })
}

fn token_check(config: &ServerConfig) -> RequireToken {
    RequireToken { expected: Arc::new(format!("Bearer {}", config.token).into_bytes()) }
}

/// What `spawn` runs for one generated service: it with the stack's message limits and token,
/// served until the stop signal. One service, no router: a call of another service's method is
/// UNIMPLEMENTED.
macro_rules! served {
    ($server:expr, $config:expr) => {{
        let service = $server
            .max_decoding_message_size($config.max_message_bytes)
            .max_encoding_message_size($config.max_message_bytes);
        let service = InterceptedService::new(service, token_check($config));
        move |builder: Server, incoming, stop: oneshot::Receiver<()>| -> Serving {
            Box::pin(async move {
                builder
                    .serve_with_incoming_shutdown(service, incoming, async {
                        let _ = stop.await; // a dropped sender stops the server too
                    })
                    .await
            })
        }
    }};
}

/// Serve a PS shard's lookups from `shard` on `config`'s address until stopped.
pub fn serve_ps<S: Shard>(
    config: ServerConfig,
    shard: Arc<S>,
    metrics: Arc<LookupMetrics>,
) -> Result<RunningServer, String> {
    let serve = served!(EmbeddingParameterServerServer::new(PsService::new(shard, metrics)), &config);
    Ok(spawn(&config, serve)?.running)
}

/// Serve an embedding worker's lookups and pushes from `worker` on `config`'s address until
/// stopped; with the runtime it runs on, where the worker's own calls (to the PS shards) run too.
pub fn serve_worker<W: Worker>(
    config: ServerConfig,
    worker: Arc<W>,
) -> Result<(RunningServer, tokio::runtime::Handle), String> {
    let spawned = spawn(&config, served!(EmbeddingWorkerServer::new(WorkerService::new(worker)), &config))?;
    Ok((spawned.running, spawned.runtime))
}
