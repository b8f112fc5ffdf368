//! A capture's copy of a disk tier: the cold rows' bookkeeping as of the capture and a handle
//! on the spill file, whose records are read only when the capture is written. A table mostly
//! on disk is thus captured without a second copy of its rows in RAM.
//!
//! The records must not change before then, while training goes on: the copy *pins* the file.
//! A record slot freed while any copy is alive (its row read back into RAM, evicted, expired)
//! is set aside instead of reused, and a row spilled again goes to another slot; the slots set
//! aside are reused once the last copy has dropped (`Tier::put`). Pinning takes a count, not a
//! lock: a copy can be written from any thread while the shard serves lookups and updates.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::elem::Elem;

use super::spill::decode_record;
use super::{Cold, Layout, RowColumns};

/// Rows per block when a copy's records are read.
const BLOCK_ROWS: usize = 4096;

/// Cold rows of one internal shard, pinned in its spill file for a capture.
pub struct ColdCopy {
    file: File,
    path: PathBuf,
    rec_bytes: usize,
    /// In file order.
    rows: Vec<Cold>,
    pins: Arc<AtomicUsize>,
}

impl ColdCopy {
    pub(super) fn new(
        file: File,
        path: PathBuf,
        rec_bytes: usize,
        mut rows: Vec<Cold>,
        pins: Arc<AtomicUsize>,
    ) -> Self {
        rows.sort_unstable_by_key(|c| c.fslot);
        pins.fetch_add(1, Ordering::AcqRel);
        ColdCopy { file, path, rec_bytes, rows, pins }
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
    pub fn ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.rows.iter().map(|c| c.id)
    }
    pub fn memory_bytes(&self) -> usize {
        self.rows.capacity() * std::mem::size_of::<Cold>() + std::mem::size_of::<Self>()
    }

    fn read(&self, c: &Cold, buf: &mut [u8]) -> std::io::Result<()> {
        self.file.read_exact_at(buf, c.fslot as u64 * self.rec_bytes as u64).map_err(|e| {
            std::io::Error::new(e.kind(), format!("disk tier: reading {} failed: {e}", self.path.display()))
        })
    }

    /// The rows decoded in blocks of up to `BLOCK_ROWS`, in file order (as snapshots write them).
    pub fn blocks<W: Elem>(
        &self,
        l: &Layout,
        mut f: impl FnMut(&RowColumns<W>) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let mut buf = vec![0u8; self.rec_bytes];
        let mut blk = RowColumns::default();
        for part in self.rows.chunks(BLOCK_ROWS) {
            blk.clear();
            for c in part {
                self.read(c, &mut buf)?;
                decode_record(l, c, &buf, &mut blk);
            }
            f(&blk)?;
        }
        Ok(())
    }

    /// The weights of row `k` (in `ids()` order) into `out` (`dim` long).
    pub fn weights<W: Elem>(&self, l: &Layout, k: usize, out: &mut [W]) -> std::io::Result<()> {
        debug_assert_eq!(out.len(), l.dim);
        let mut buf = vec![0u8; self.rec_bytes];
        self.read(&self.rows[k], &mut buf)?;
        let wb = W::as_bytes_mut(out);
        let n = wb.len();
        wb.copy_from_slice(&buf[8..8 + n]);
        Ok(())
    }
}

impl Drop for ColdCopy {
    fn drop(&mut self) {
        self.pins.fetch_sub(1, Ordering::AcqRel);
    }
}
