//! The snapshot writer, shared by `dump` (streaming the live store) and `Capture::write`
//! (a point-in-time copy): both describe their tables through `TableSource`.
//!
//! The file is written to `path.tmp-<pid>`, fsynced, renamed to `path`, and the directory
//! is fsynced so that the rename survives a crash (`write_atomically`, which values files
//! share). The SHA-256 of the file is computed over the bytes on their way to it, so
//! checking a checkpoint's manifest needs no second read.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::atomic::Ordering;

use sha2::{Digest, Sha256};

use super::meta::encode_meta;
use super::*;
use crate::elem::Elem;
use crate::store::{now_secs, Store};
use crate::table::{Chunk, Layout, RowColumns, Table};
use crate::with_shards;

/// Bytes written and the SHA-256 of the file.
pub type Written = (u64, [u8; 32]);

/// Counts and hashes every byte on its way to the file.
pub(crate) struct HashingWriter<F: Write> {
    inner: F,
    sha: Sha256,
    bytes: u64,
}

impl<F: Write> Write for HashingWriter<F> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.sha.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes the blocks of the format (see native/README.md) and counts tables and rows
/// for the trailer.
pub(super) struct SnapWriter<'a> {
    w: &'a mut FileOut,
    tables: u32,
    rows: u64,
    blk_rows: u64,
}

impl<'a> SnapWriter<'a> {
    pub(super) fn new(w: &'a mut FileOut) -> Self {
        SnapWriter { w, tables: 0, rows: 0, blk_rows: 0 }
    }

    /// Write `b` and feed it to the block checksum `h`.
    fn put(&mut self, h: &mut crc32fast::Hasher, b: &[u8]) -> std::io::Result<()> {
        h.update(b);
        self.w.write_all(b)
    }

    fn raw(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.w.write_all(b)
    }

    pub(super) fn header(
        &mut self,
        next_version: u64,
        num_tables: u32,
        created_secs: u64,
        flags: u32,
    ) -> std::io::Result<()> {
        let mut h = crc32fast::Hasher::new();
        let mut hdr = Vec::with_capacity(36);
        hdr.extend_from_slice(MAGIC);
        hdr.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        hdr.extend_from_slice(&flags.to_le_bytes());
        hdr.extend_from_slice(&next_version.to_le_bytes());
        hdr.extend_from_slice(&num_tables.to_le_bytes());
        hdr.extend_from_slice(&created_secs.to_le_bytes());
        self.put(&mut h, &hdr)?;
        self.raw(&h.finalize().to_le_bytes())
    }

    pub(super) fn meta(&mut self, cfg: &TableConfig, counters: &[u64; 9]) -> std::io::Result<()> {
        let meta = encode_meta(cfg, counters);
        self.raw(&TAG_META.to_le_bytes())?;
        self.raw(&(meta.len() as u32).to_le_bytes())?;
        let mut h = crc32fast::Hasher::new();
        self.put(&mut h, &meta)?;
        self.raw(&h.finalize().to_le_bytes())?;
        self.tables += 1;
        self.blk_rows = 0;
        Ok(())
    }

    /// The admission sketch: `width * depth` counters, row-major.
    pub(super) fn sketch(
        &mut self,
        width: usize,
        depth: usize,
        cells: impl Iterator<Item = u32>,
    ) -> std::io::Result<()> {
        self.raw(&TAG_SKETCH.to_le_bytes())?;
        let mut h = crc32fast::Hasher::new();
        self.put(&mut h, &(width as u32).to_le_bytes())?;
        self.put(&mut h, &(depth as u32).to_le_bytes())?;
        let mut buf: Vec<u32> = Vec::with_capacity(1 << 16);
        let mut cells = cells.peekable();
        while cells.peek().is_some() {
            buf.clear();
            buf.extend(cells.by_ref().take(1 << 16));
            self.put(&mut h, bytes_of(&buf))?;
        }
        self.raw(&h.finalize().to_le_bytes())
    }

    pub(super) fn rows_block<W: Elem>(&mut self, cfg: &TableConfig, blk: &RowColumns<W>) -> std::io::Result<()> {
        let cols = columns_of(cfg);
        let n = blk.len() as u64;
        let plen = payload_len(cfg, cols, n);
        self.raw(&TAG_ROWS.to_le_bytes())?;
        let mut h = crc32fast::Hasher::new();
        self.put(&mut h, &(n as u32).to_le_bytes())?;
        self.put(&mut h, &cols.to_le_bytes())?;
        self.put(&mut h, &plen.to_le_bytes())?;
        self.put(&mut h, bytes_of(&blk.ids))?;
        self.put(&mut h, bytes_of(&blk.versions))?;
        self.put(&mut h, W::as_bytes(&blk.weights))?;
        for (col, data) in [
            (COL_STATE, bytes_of(&blk.state)),
            (COL_ACC, bytes_of(&blk.acc)),
            (COL_STEPS, bytes_of(&blk.steps)),
            (COL_UTIME, bytes_of(&blk.utime)),
            (COL_UTICK, bytes_of(&blk.utick)),
        ] {
            if cols & col != 0 {
                self.put(&mut h, data)?;
            }
        }
        self.raw(&h.finalize().to_le_bytes())?;
        self.blk_rows += n;
        Ok(())
    }

    /// One row block per chunk holding live rows (at most one chunk is buffered in `blk`).
    pub(super) fn chunks<W: Elem>(
        &mut self,
        cfg: &TableConfig,
        l: &Layout,
        chunks: &[Chunk<W>],
        vbase: u64,
        blk: &mut RowColumns<W>,
    ) -> std::io::Result<()> {
        for ch in chunks {
            ch.gather(l, vbase, 0, blk);
            if !blk.is_empty() {
                self.rows_block(cfg, blk)?;
            }
        }
        Ok(())
    }

    pub(super) fn table_end(&mut self) -> std::io::Result<()> {
        let rows = self.blk_rows;
        self.raw(&TAG_TEND.to_le_bytes())?;
        let mut h = crc32fast::Hasher::new();
        self.put(&mut h, &rows.to_le_bytes())?;
        self.raw(&h.finalize().to_le_bytes())?;
        self.rows += rows;
        Ok(())
    }

    pub(super) fn trailer(&mut self, next_version: u64) -> std::io::Result<()> {
        self.raw(&TAG_TRAILER.to_le_bytes())?;
        let mut h = crc32fast::Hasher::new();
        let (tables, rows) = (self.tables, self.rows);
        self.put(&mut h, &tables.to_le_bytes())?;
        self.put(&mut h, &rows.to_le_bytes())?;
        self.put(&mut h, &next_version.to_le_bytes())?;
        self.put(&mut h, END_MAGIC)?;
        self.raw(&h.finalize().to_le_bytes())
    }
}

/// A table as the writer sees it: the live table (`dump`) or a captured copy.
pub(super) trait TableSource {
    fn config(&self) -> &TableConfig;
    fn counters(&self) -> [u64; 9];
    /// Write the SKCH block, if the table has an admission sketch.
    fn write_sketch(&self, w: &mut SnapWriter<'_>) -> std::io::Result<()>;
    /// Write the table's ROWS blocks.
    fn write_rows(&self, w: &mut SnapWriter<'_>) -> std::io::Result<()>;
}

/// The buffered, hashing writer of a file being written atomically.
pub(crate) type FileOut = BufWriter<HashingWriter<File>>;

/// Write a file atomically: `body` writes it to `path.tmp-<pid>` (through a 4 MiB buffer,
/// counting and hashing every byte), which is fsynced and renamed to `path`; then the
/// directory is fsynced so that the rename survives a crash. On an error the temporary
/// file is removed and `path` is untouched. Shared by snapshots and values files.
pub(crate) fn write_atomically<E: Into<StoreError>>(
    path: &Path,
    body: impl FnOnce(&mut FileOut) -> std::result::Result<(), E>,
) -> Result<Written> {
    let file_name =
        path.file_name().ok_or_else(|| StoreError::Value(format!("invalid file path {}", path.display())))?;
    let tmp = path.with_file_name(format!("{}.tmp-{}", file_name.to_string_lossy(), std::process::id()));
    let res = (|| -> Result<Written> {
        let f = File::create(&tmp)?;
        let mut w = BufWriter::with_capacity(4 << 20, HashingWriter { inner: f, sha: Sha256::new(), bytes: 0 });
        body(&mut w).map_err(Into::into)?;
        let hw = w.into_inner().map_err(|e| StoreError::Io(e.into_error()))?;
        hw.inner.sync_all()?;
        drop(hw.inner);
        std::fs::rename(&tmp, path)?;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        File::open(dir)?.sync_all()?;
        Ok((hw.bytes, hw.sha.finalize().into()))
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// Write a snapshot of `tables` atomically. `next_version` is read for the header and
/// again for the trailer (the loader takes the larger). `flags`: the header's (`FLAG_DELTA`).
pub(super) fn write_file<T: std::ops::Deref<Target: TableSource>>(
    path: &Path,
    created_secs: u64,
    flags: u32,
    next_version: impl Fn() -> u64,
    tables: &[T],
) -> Result<Written> {
    write_atomically(path, |out| {
        let mut w = SnapWriter::new(out);
        w.header(next_version(), tables.len() as u32, created_secs, flags)?;
        for t in tables {
            w.meta(t.config(), &t.counters())?;
            t.write_sketch(&mut w)?;
            t.write_rows(&mut w)?;
            w.table_end()?;
        }
        w.trailer(next_version())
    })
}

impl TableSource for Table {
    fn config(&self) -> &TableConfig {
        &self.cfg
    }
    fn counters(&self) -> [u64; 9] {
        self.counters.snapshot()
    }
    fn write_sketch(&self, w: &mut SnapWriter<'_>) -> std::io::Result<()> {
        match &self.sketch {
            Some(sk) => w.sketch(sk.width, sk.depth, sk.counters.iter().map(|c| c.load(Ordering::Relaxed))),
            None => Ok(()),
        }
    }
    fn write_rows(&self, w: &mut SnapWriter<'_>) -> std::io::Result<()> {
        with_shards!(&self.shards, shards => {
            let mut blk = RowColumns::default();
            for sh in shards {
                // The shard's read lock is held while its rows are streamed: each internal
                // shard is written as of one instant.
                let g = sh.read();
                w.chunks(&self.cfg, &self.layout, &g.chunks, g.vbase, &mut blk)?;
                g.cold_blocks(&self.layout, 0, |b| w.rows_block(&self.cfg, b))?;
            }
            Ok(())
        })
    }
}

/// Stream the live store to `path`, in the format and with the writer of `Capture::write`,
/// without copying the store (at most one chunk of rows is buffered).
///
/// **Locking behaviour:** takes the table registry's read lock only to list the tables;
/// then each internal shard's *read* lock in turn, held while that shard's rows are
/// gathered, hashed and written (as long as the file system takes to absorb them):
/// lookups that create rows in that shard, and updates to it, wait meanwhile.
pub fn write_snapshot(store: &Store, path: &Path) -> Result<Written> {
    write_file(path, now_secs() as u64, 0, || store.clock.next_value(), &store.tables_ordered())
}
