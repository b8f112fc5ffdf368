//! trillium_native: native embedding parameter store for Trillium.
//!
//! The Rust core (`store`, `table`, `index`, `optim`, `snapshot`, `hash`, the embedding
//! worker's `pooling`, for model replicas the `values` file format and the read-only `serving`
//! store, for the stream loader the JSON `events` fast path and the `join`, for replay the JSON
//! writer `json_out`, and the wire's scaled fp16, `wire16`) is independent of Python; `python`
//! holds the PyO3 bindings.

pub mod config;
pub mod elem;
pub mod events;
pub mod hash;
pub mod index;
pub mod join;
pub mod json_in;
pub mod json_out;
pub mod mem;
pub mod optim;
pub mod pooling;
pub mod serving;
pub mod snapshot;
pub mod store;
pub mod table;
#[cfg(test)]
mod test_dir;
pub mod values;
pub mod wire16;

mod python;
