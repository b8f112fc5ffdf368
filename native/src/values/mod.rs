//! The values file: what a training PS shard publishes for serving.
//!
//! A checkpoint snapshot (see `snapshot`) carries everything training needs to resume:
//! optimizer state, versions, TTL stamps, counters. A model replica needs only each row's
//! weights, at the precision it serves (fp16 halves them again), so training writes a
//! second, much smaller file from the same capture (`Capture::write_values`) and the
//! replicas apply it (`serving::ServingTables::apply`). The file stands on its own: a
//! reader detects a truncated or corrupted file (the trailer's CRC-32 covers every byte
//! before it) without a manifest.
//!
//! Layout (format version 1; all integers little-endian):
//!
//! ```text
//! HEADER   magic "TRLMVALS" (8) | format_version u32 = 1 | dtype u8 (0 fp32, 1 fp16)
//!          | flags u8 (bit 0: delta) | reserved u16 = 0 | num_tables u32
//!          | store_version u64 (the training store's version clock at the capture)
//! TABLE*   (num_tables times)
//!          name_len u16 | name (UTF-8) | dim u32 | rows u64 | zero bytes up to a multiple of 8
//!          | ids u64[rows] (strictly ascending)
//!          | values dtype[rows * dim] (row-major, row k belongs to ids[k])
//! TRAILER  "TRLMVEND" (8) | total_rows u64 | crc32 u32
//! ```
//!
//! `crc32` is CRC-32/ISO-HDLC (zlib's) of every byte of the file before it. The padding
//! puts every table's IDs (and so its values) at a multiple of 8 bytes from the start of
//! the file: a reader may map the file and use the arrays in place. Rows are sorted by ID
//! so a reader can build a sorted index (or merge with one) in a single pass. The
//! values are the weights converted to `dtype` exactly as `EmbeddingStore.lookup(...,
//! out_dtype="float16")` converts them (fp16 tables copied, fp32 rounded to nearest even,
//! bf16 widened to f32 then rounded), so a served value equals a read-only lookup's.
//! A **full** file holds every row of the tables it lists (of the PS shard that wrote it);
//! a **delta** file only the rows created or updated since the previous capture.
//!
//! `read` holds the reader; the writer of a capture is `snapshot/values.rs`, on top of the
//! primitives here; `forget` rewrites a file without the rows of given IDs.

use std::io::Write;

use crate::config::DType;
use crate::elem::Elem;

mod forget;
mod read;

pub use forget::forget_in_values;
pub use read::{read_values, ValuesError, ValuesFile, ValuesTable};

#[cfg(target_endian = "big")]
compile_error!("the values file format assumes a little-endian target");

pub const VALUES_MAGIC: &[u8; 8] = b"TRLMVALS";
pub const VALUES_END_MAGIC: &[u8; 8] = b"TRLMVEND";
pub const VALUES_FORMAT_VERSION: u32 = 1;
/// Header flag: the file holds only the rows changed since the previous capture.
pub const VALUES_FLAG_DELTA: u8 = 1 << 0;
/// Header bytes: magic, format version, dtype, flags, reserved, num_tables, store_version.
pub const HEADER_LEN: usize = 8 + 4 + 1 + 1 + 2 + 4 + 8;
/// Trailer bytes: end magic, total_rows, crc32.
pub const TRAILER_LEN: usize = 8 + 8 + 4;
/// Largest `dim` a reader accepts (guards allocations sized from a damaged header).
pub const MAX_DIM: usize = 1 << 20;

/// Storage type of the values in a file: fp32 or fp16 (a `DType` code).
pub fn dtype_code(d: DType) -> Option<u8> {
    match d {
        DType::F32 => Some(0),
        DType::F16 => Some(1),
        DType::BF16 => None,
    }
}

/// Writes the format's parts; every byte but the trailer's CRC goes through the CRC.
pub struct ValuesWriter<'a, F: Write> {
    w: &'a mut F,
    crc: crc32fast::Hasher,
    rows: u64,
    /// Bytes written so far.
    pos: u64,
}

impl<'a, F: Write> ValuesWriter<'a, F> {
    /// Start a file: writes the header.
    pub fn new(w: &'a mut F, dtype: DType, delta: bool, num_tables: u32, store_version: u64) -> std::io::Result<Self> {
        let code = dtype_code(dtype).ok_or_else(|| std::io::Error::other("values files hold fp32 or fp16"))?;
        let mut v = ValuesWriter { w, crc: crc32fast::Hasher::new(), rows: 0, pos: 0 };
        let mut hdr = Vec::with_capacity(HEADER_LEN);
        hdr.extend_from_slice(VALUES_MAGIC);
        hdr.extend_from_slice(&VALUES_FORMAT_VERSION.to_le_bytes());
        hdr.push(code);
        hdr.push(if delta { VALUES_FLAG_DELTA } else { 0 });
        hdr.extend_from_slice(&0u16.to_le_bytes());
        hdr.extend_from_slice(&num_tables.to_le_bytes());
        hdr.extend_from_slice(&store_version.to_le_bytes());
        v.put(&hdr)?;
        Ok(v)
    }

    fn put(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.crc.update(b);
        self.pos += b.len() as u64;
        self.w.write_all(b)
    }

    /// A table's head and all of its IDs (strictly ascending); its values follow
    /// (`values`, `rows * dim` elements in all, in as many calls as convenient).
    pub fn table(&mut self, name: &str, dim: usize, ids: &[u64]) -> std::io::Result<()> {
        let len = u16::try_from(name.len()).map_err(|_| std::io::Error::other("table name over 65535 bytes"))?;
        self.put(&len.to_le_bytes())?;
        self.put(name.as_bytes())?;
        self.put(&(dim as u32).to_le_bytes())?;
        self.put(&(ids.len() as u64).to_le_bytes())?;
        self.put(&[0u8; 8][..pad_to_8(self.pos)])?;
        for c in ids.chunks(1 << 16) {
            self.put(u64_bytes(c))?;
        }
        self.rows += ids.len() as u64;
        Ok(())
    }

    /// Some of the current table's values, in row order.
    pub fn values<O: Elem>(&mut self, v: &[O]) -> std::io::Result<()> {
        self.put(O::as_bytes(v))
    }

    /// End the file: the trailer.
    pub fn finish(mut self) -> std::io::Result<()> {
        self.put(VALUES_END_MAGIC)?;
        let rows = self.rows;
        self.put(&rows.to_le_bytes())?;
        let crc = std::mem::take(&mut self.crc).finalize();
        self.w.write_all(&crc.to_le_bytes())
    }
}

/// Zero bytes after offset `pos` up to a multiple of 8.
fn pad_to_8(pos: u64) -> usize {
    ((8 - pos % 8) % 8) as usize
}

/// Little-endian bytes of IDs.
fn u64_bytes(s: &[u64]) -> &[u8] {
    // SAFETY: u64 has no padding; the target is little-endian (checked above).
    unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, std::mem::size_of_val(s)) }
}

/// The same, writable: every bit pattern is a valid u64.
fn u64_bytes_mut(s: &mut [u64]) -> &mut [u8] {
    // SAFETY: as above; any bytes written make valid u64s.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut u8, std::mem::size_of_val(s)) }
}

#[cfg(test)]
mod forget_tests;
#[cfg(test)]
mod tests;
