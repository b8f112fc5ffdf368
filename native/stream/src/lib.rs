//! trillium_stream: the stream data plane of Trillium, in plain Rust.
//!
//! The stream loader's JSON event decoding fast path (`events`, over the strict JSON reader
//! `json_in`), its event-time joins (`join`; `task_join`, of several tasks' labels), and replay's JSON event writer (`json_out`).
//!
//! The boundary: this crate knows nothing of the embedding store or of Python (no PyO3). The
//! root crate, `trillium-native` (`native/`), is the embedding store and the Python bindings of
//! both; its `python` module binds these modules.

pub mod events;
pub mod join;
pub mod json_in;
pub mod json_out;
pub mod task_join;
