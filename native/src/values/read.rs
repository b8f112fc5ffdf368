//! The values-file reader: reads a whole file into memory, checking its structure against
//! the file's length as it goes (a damaged count never sizes an allocation past the file),
//! then the trailer's CRC-32, then the format's invariants (IDs strictly ascending, the
//! row count). The values land in the buffer they will be served from (`RawBuf::zeroed`,
//! huge pages when asked), so a full file costs no copy after the read.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use super::{
    dtype_code, pad_to_8, u64_bytes_mut, HEADER_LEN, MAX_DIM, TRAILER_LEN, VALUES_END_MAGIC, VALUES_FLAG_DELTA,
};
use super::{VALUES_FORMAT_VERSION, VALUES_MAGIC};
use crate::elem::Elem;
use crate::mem::{Pod, RawBuf};

/// Why a values file was refused: an I/O error, or a file that is not a valid values file
/// of the expected dtype (the message says what is wrong).
#[derive(Debug)]
pub enum ValuesError {
    Io(std::io::Error),
    Bad(String),
}

impl std::fmt::Display for ValuesError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ValuesError::Io(e) => write!(f, "{e}"),
            ValuesError::Bad(s) => f.write_str(s),
        }
    }
}

impl From<std::io::Error> for ValuesError {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            ValuesError::Bad("file is truncated".into())
        } else {
            ValuesError::Io(e)
        }
    }
}

pub(super) fn bad<T>(msg: impl Into<String>) -> Result<T, ValuesError> {
    Err(ValuesError::Bad(msg.into()))
}

/// One table of a values file.
pub struct ValuesTable<W: Copy> {
    pub name: String,
    pub dim: usize,
    /// Strictly ascending.
    pub ids: Vec<u64>,
    /// `ids.len() * dim` values, row-major in the IDs' order.
    pub values: RawBuf<W>,
}

/// A whole values file, verified.
pub struct ValuesFile<W: Copy> {
    pub delta: bool,
    pub store_version: u64,
    pub tables: Vec<ValuesTable<W>>,
    /// The file's length in bytes.
    pub bytes: u64,
}

/// Reads through a buffer, feeding every byte to the CRC and counting them.
pub(super) struct CrcReader {
    pub(super) inner: BufReader<File>,
    pub(super) crc: crc32fast::Hasher,
    pub(super) pos: u64,
}

impl CrcReader {
    pub(super) fn read(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        // Large reads in slices, so the CRC runs on data still in cache.
        for c in buf.chunks_mut(4 << 20) {
            self.inner.read_exact(c)?;
            self.crc.update(c);
        }
        self.pos += buf.len() as u64;
        Ok(())
    }
    pub(super) fn array<const N: usize>(&mut self) -> std::io::Result<[u8; N]> {
        let mut b = [0u8; N];
        self.read(&mut b)?;
        Ok(b)
    }
    pub(super) fn u16(&mut self) -> std::io::Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub(super) fn u32(&mut self) -> std::io::Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub(super) fn u64(&mut self) -> std::io::Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
}

fn dtype_name(code: u8) -> &'static str {
    match code {
        0 => "fp32",
        1 => "fp16",
        _ => "unknown",
    }
}

/// Read and verify the values file at `path`, whose values must be of `W`'s dtype (fp32 or
/// fp16). `huge`: value buffers of >= 2 MiB get huge-page mappings (`RawBuf::zeroed`).
pub fn read_values<W: Elem + Pod>(path: &Path, huge: bool) -> Result<ValuesFile<W>, ValuesError> {
    let want = match dtype_code(W::DTYPE) {
        Some(c) => c,
        None => return bad("values files hold fp32 or fp16"),
    };
    let f = File::open(path)?;
    let len = f.metadata()?.len();
    if len < (HEADER_LEN + TRAILER_LEN) as u64 {
        return bad(format!("file is truncated: {len} bytes, shorter than a header and a trailer"));
    }
    let mut r = CrcReader { inner: BufReader::with_capacity(1 << 20, f), crc: crc32fast::Hasher::new(), pos: 0 };
    let magic: [u8; 8] = r.array()?;
    if &magic != VALUES_MAGIC {
        return bad("not a values file (bad magic)");
    }
    let version = r.u32()?;
    if version != VALUES_FORMAT_VERSION {
        return bad(format!("format version {version}; this reader knows version {VALUES_FORMAT_VERSION}"));
    }
    let [code, flags] = r.array()?;
    if code != want {
        return bad(format!("values are {} (dtype code {code}), expected {}", dtype_name(code), W::DTYPE.name()));
    }
    if flags & !VALUES_FLAG_DELTA != 0 || r.u16()? != 0 {
        return bad(format!("unknown header flags {flags:#x} or non-zero reserved bytes"));
    }
    let num_tables = r.u32()? as u64;
    let store_version = r.u64()?;
    let size = std::mem::size_of::<W>() as u64;
    let mut tables: Vec<ValuesTable<W>> = Vec::new();
    for k in 0..num_tables {
        // The smallest table (an empty name, no rows) takes 14 bytes.
        if len - r.pos < 14 + TRAILER_LEN as u64 {
            return bad(format!(
                "file is truncated: table {k} of {num_tables} starts {} bytes before the end",
                len - r.pos
            ));
        }
        let name_len = r.u16()? as usize;
        let mut name = vec![0u8; name_len];
        if len - r.pos < (name_len + 12 + TRAILER_LEN) as u64 {
            return bad(format!("file is truncated in the head of table {k}"));
        }
        r.read(&mut name)?;
        let Ok(name) = String::from_utf8(name) else {
            return bad(format!("table {k}: name is not UTF-8"));
        };
        let dim = r.u32()? as usize;
        let rows = r.u64()?;
        if dim == 0 || dim > MAX_DIM {
            return bad(format!("table {name:?}: dim {dim} out of range [1, {MAX_DIM}]"));
        }
        let mut pad = [0u8; 8];
        let pad = &mut pad[..pad_to_8(r.pos)];
        if len - r.pos < (pad.len() + TRAILER_LEN) as u64 {
            return bad(format!("file is truncated in the head of table {name:?}"));
        }
        r.read(pad)?;
        if pad.iter().any(|&b| b != 0) {
            return bad(format!("table {name:?}: non-zero padding"));
        }
        let left = len - r.pos - TRAILER_LEN as u64;
        let need = rows.checked_mul(8 + dim as u64 * size);
        if !matches!(need, Some(n) if n <= left) {
            return bad(format!(
                "file is truncated: table {name:?} declares {rows} rows of dim {dim}, {left} bytes remain"
            ));
        }
        let rows = rows as usize;
        let mut ids = vec![0u64; rows];
        r.read(u64_bytes_mut(&mut ids))?;
        let mut values = RawBuf::<W>::zeroed(rows * dim, huge);
        r.read(W::as_bytes_mut(&mut values))?;
        tables.push(ValuesTable { name, dim, ids, values });
    }
    let end: [u8; 8] = r.array()?;
    let total_rows = r.u64()?;
    let computed = std::mem::take(&mut r.crc).finalize();
    let mut stored = [0u8; 4];
    r.inner.read_exact(&mut stored)?;
    r.pos += 4;
    if u32::from_le_bytes(stored) != computed {
        return bad(format!(
            "CRC-32 mismatch (stored {:#010x}, computed {computed:#010x}): the file is corrupt",
            u32::from_le_bytes(stored)
        ));
    }
    if &end != VALUES_END_MAGIC {
        return bad("bad trailer magic");
    }
    if r.pos != len {
        return bad(format!("{} bytes after the trailer", len - r.pos));
    }
    let sum: u64 = tables.iter().map(|t| t.ids.len() as u64).sum();
    if total_rows != sum {
        return bad(format!("trailer counts {total_rows} rows, the tables hold {sum}"));
    }
    for (k, t) in tables.iter().enumerate() {
        if tables[..k].iter().any(|u| u.name == t.name) {
            return bad(format!("table {:?} appears twice", t.name));
        }
        if let Some(i) = t.ids.windows(2).position(|w| w[0] >= w[1]) {
            return bad(format!(
                "table {:?}: IDs not strictly ascending at row {} ({} then {})",
                t.name,
                i + 1,
                t.ids[i],
                t.ids[i + 1]
            ));
        }
    }
    Ok(ValuesFile { delta: flags & VALUES_FLAG_DELTA != 0, store_version, tables, bytes: len })
}
