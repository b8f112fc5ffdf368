//! trillium_transport: the transport of Trillium's native data plane.
//!
//! The services of `proto/embedding.proto` served from Rust threads (tonic, on a tokio runtime
//! of the server's own), speaking the same wire as the Python services: the same messages, the
//! codec's array frames inside them (`frame`, as `trillium/wire/codec.py` writes them), the
//! stack's token on every call and TLS when it is configured (`server`), and the PS shards'
//! lookups called from Rust (`client`). A service's work is a trait its user implements
//! (`ps::Shard`, `worker::Worker`): this crate knows nothing of the embedding store, the pooling
//! or Python (the root crate, `trillium-native`, binds them).

pub mod batch;
pub mod client;
pub mod codec;
pub mod frame;
pub mod ps;
pub mod server;
pub mod worker;

/// The generated messages and services of `proto/embedding.proto` (package `trillium.v1`).
pub mod pb {
    #![allow(clippy::all, clippy::pedantic)]
    tonic::include_proto!("trillium.v1");
}
