//! trillium_transport: the transport of Trillium's native data plane.
//!
//! The services of `proto/embedding.proto` served from Rust threads (tonic, on a tokio runtime
//! of the server's own), speaking the same wire as the Python services: the same messages, the
//! codec's array frames inside them (`frame`, as `trillium/wire/codec.py` writes them), the
//! stack's token on every call and TLS when it is configured (`server`). A service's work is a
//! trait its user implements (`ps::Shard`): this crate knows nothing of the embedding store or
//! of Python (the root crate, `trillium-native`, binds both).

pub mod codec;
pub mod frame;
pub mod ps;
pub mod server;

/// The generated messages and services of `proto/embedding.proto` (package `trillium.v1`).
pub mod pb {
    #![allow(clippy::all, clippy::pedantic)]
    tonic::include_proto!("trillium.v1");
}
