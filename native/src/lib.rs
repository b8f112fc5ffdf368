//! trillium_native: native embedding parameter store for Trillium, and the Python module.
//!
//! The Rust core (`store`, `table`, `index`, `optim`, `snapshot`, `hash`, the embedding
//! worker's `pooling`, for model replicas the `values` file format and the read-only `serving`
//! store, and the wire's scaled fp16, `wire16`) is independent of Python; `python` holds the PyO3
//! bindings: of this crate's store, and of the stream data plane (the stream loader's JSON
//! `events` fast path and `join`, replay's JSON writer `json_out`), which is the workspace's other
//! crate, `trillium_stream` (`stream/`), knowing nothing of the store or of Python.

pub mod config;
pub mod elem;
pub mod hash;
pub mod index;
pub mod mem;
pub mod optim;
pub mod pooling;
pub mod ps_apply;
pub mod ps_shard;
pub mod serving;
pub mod snapshot;
pub mod store;
pub mod table;
#[cfg(test)]
mod test_dir;
pub mod values;
pub mod wire16;
pub mod worker;

mod python;
