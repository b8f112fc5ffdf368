//! Versioned binary snapshot format (see native/README.md for the layout).
//!
//! `dump` streams each internal shard chunk by chunk while holding that shard's
//! read lock, so every internal shard is written as of a single instant and at
//! most one chunk's worth of rows is buffered. A `Capture` copies every shard
//! first (the whole store as of one instant, when no update runs meanwhile) and
//! is written later with the same writer. Loading first verifies the
//! whole file (structure and every checksum) and only then applies it, so a
//! corrupted file leaves the store untouched.
//!
//! `meta` encodes the table metadata block, `write` the writer (shared by `dump` and
//! captures), `read` the verifying reader and the loader, `capture` point-in-time copies,
//! `values` a capture's export of weights only for serving (the format of `crate::values`),
//! `forget` the rewrite of a file without the rows of given IDs.

use crate::config::{Result, StoreError, TableConfig};

mod capture;
mod forget;
mod meta;
mod read;
mod values;
mod write;

pub use capture::{Capture, CaptureMark};
pub use forget::forget_in_snapshot;
pub use read::{load_snapshot, read_snapshot, AnyBlock, Visitor};
pub(crate) use write::{write_atomically, FileOut};
pub use write::{write_snapshot, Written};

#[cfg(target_endian = "big")]
compile_error!("the snapshot writer assumes a little-endian target");

pub const MAGIC: &[u8; 8] = b"TRLMSNAP";
pub const END_MAGIC: &[u8; 8] = b"TRLMEND\0";
pub const FORMAT_VERSION: u32 = 1;
/// Header flag: the file is a delta, loaded after the file it was taken on top of.
pub const FLAG_DELTA: u32 = 1 << 0;

const fn tag(b: &[u8; 4]) -> u32 {
    u32::from_le_bytes(*b)
}
pub const TAG_META: u32 = tag(b"TMET");
pub const TAG_SKETCH: u32 = tag(b"SKCH");
pub const TAG_ROWS: u32 = tag(b"ROWS");
pub const TAG_TEND: u32 = tag(b"TEND");
pub const TAG_TRAILER: u32 = tag(b"TRLR");

pub const COL_IDS: u32 = 1 << 0;
pub const COL_VERSIONS: u32 = 1 << 1;
pub const COL_WEIGHTS: u32 = 1 << 2;
pub const COL_STATE: u32 = 1 << 3;
pub const COL_ACC: u32 = 1 << 4;
pub const COL_STEPS: u32 = 1 << 5;
pub const COL_UTIME: u32 = 1 << 6;
pub const COL_UTICK: u32 = 1 << 7;

const MAX_BLOCK_ROWS: u32 = 1 << 20;
const MAX_META_LEN: u32 = 1 << 20;

fn corrupt<T>(msg: impl Into<String>) -> Result<T> {
    Err(StoreError::Corrupt(msg.into()))
}

fn columns_of(cfg: &TableConfig) -> u32 {
    let mut c = COL_IDS | COL_VERSIONS | COL_WEIGHTS;
    if cfg.state_dim() > 0 {
        c |= COL_STATE;
    }
    if cfg.has_row_acc() {
        c |= COL_ACC;
    }
    if cfg.has_steps() {
        c |= COL_STEPS;
    }
    if cfg.has_utime() {
        c |= COL_UTIME;
    }
    if cfg.has_utick() {
        c |= COL_UTICK;
    }
    c
}

fn payload_len(cfg: &TableConfig, cols: u32, n: u64) -> u64 {
    let mut per = 16 + (cfg.dim * cfg.dtype.size()) as u64;
    if cols & COL_STATE != 0 {
        per += cfg.state_dim() as u64 * 4;
    }
    for c in [COL_ACC, COL_STEPS, COL_UTIME, COL_UTICK] {
        if cols & c != 0 {
            per += 4;
        }
    }
    per * n
}

fn bytes_of<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: only used with plain numeric types (no padding); little-endian target.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}
fn bytes_of_mut<T: Copy>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: as above; every bit pattern is valid for these types.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v)) }
}

#[cfg(test)]
mod forget_tests;
#[cfg(test)]
mod tests;
