//! The snapshot writer.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::atomic::Ordering;

use parking_lot::RwLock;

use super::meta::encode_meta;
use super::*;
use crate::elem::Elem;
use crate::store::{now_secs, Store};
use crate::table::{RowBlock, Shard, Table};
use crate::with_shards;

struct CrcWriter<W: Write> {
    w: W,
}
impl<W: Write> CrcWriter<W> {
    fn put(&mut self, h: &mut crc32fast::Hasher, b: &[u8]) -> std::io::Result<()> {
        h.update(b);
        self.w.write_all(b)
    }
}

fn write_rows_block<W: Elem, F: Write>(
    out: &mut CrcWriter<F>,
    cfg: &TableConfig,
    blk: &RowBlock<W>,
) -> std::io::Result<()> {
    let cols = columns_of(cfg);
    let n = blk.len() as u64;
    let plen = payload_len(cfg, cols, n);
    out.w.write_all(&TAG_ROWS.to_le_bytes())?;
    let mut h = crc32fast::Hasher::new();
    out.put(&mut h, &(n as u32).to_le_bytes())?;
    out.put(&mut h, &cols.to_le_bytes())?;
    out.put(&mut h, &plen.to_le_bytes())?;
    out.put(&mut h, bytes_of(&blk.ids))?;
    out.put(&mut h, bytes_of(&blk.versions))?;
    out.put(&mut h, W::as_bytes(&blk.weights))?;
    if cols & COL_STATE != 0 {
        out.put(&mut h, bytes_of(&blk.state))?;
    }
    if cols & COL_ACC != 0 {
        out.put(&mut h, bytes_of(&blk.acc))?;
    }
    if cols & COL_STEPS != 0 {
        out.put(&mut h, bytes_of(&blk.steps))?;
    }
    if cols & COL_UTIME != 0 {
        out.put(&mut h, bytes_of(&blk.utime))?;
    }
    if cols & COL_UTICK != 0 {
        out.put(&mut h, bytes_of(&blk.utick))?;
    }
    out.w.write_all(&h.finalize().to_le_bytes())
}

fn write_table_rows<W: Elem, F: Write>(
    out: &mut CrcWriter<F>,
    t: &Table,
    shards: &[RwLock<Shard<W>>],
) -> std::io::Result<u64> {
    let mut blk = RowBlock::<W>::default();
    let mut total = 0u64;
    for sh in shards {
        // The shard lock is held while all of its rows are streamed: each
        // internal shard is captured at one instant.
        let g = sh.read();
        for c in 0..g.chunks.len() {
            g.gather_chunk(&t.layout, c, &mut blk);
            if !blk.is_empty() {
                write_rows_block(out, &t.cfg, &blk)?;
                total += blk.len() as u64;
            }
        }
    }
    Ok(total)
}

pub fn write_snapshot(store: &Store, path: &Path) -> Result<()> {
    let file_name =
        path.file_name().ok_or_else(|| StoreError::Value(format!("invalid snapshot path {}", path.display())))?;
    let tmp = path.with_file_name(format!("{}.tmp-{}", file_name.to_string_lossy(), std::process::id()));
    let res = (|| -> Result<()> {
        let f = File::create(&tmp)?;
        let mut out = CrcWriter { w: BufWriter::with_capacity(4 << 20, f) };
        let tables = store.tables_ordered();
        // header
        let mut h = crc32fast::Hasher::new();
        let mut hdr = Vec::with_capacity(40);
        hdr.extend_from_slice(MAGIC);
        hdr.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        hdr.extend_from_slice(&0u32.to_le_bytes());
        hdr.extend_from_slice(&store.clock.next_value().to_le_bytes());
        hdr.extend_from_slice(&(tables.len() as u32).to_le_bytes());
        hdr.extend_from_slice(&(now_secs() as u64).to_le_bytes());
        out.put(&mut h, &hdr)?;
        out.w.write_all(&h.finalize().to_le_bytes())?;
        let mut all_rows = 0u64;
        for t in &tables {
            let meta = encode_meta(&t.cfg, &t.counters.snapshot());
            out.w.write_all(&TAG_META.to_le_bytes())?;
            out.w.write_all(&(meta.len() as u32).to_le_bytes())?;
            let mut h = crc32fast::Hasher::new();
            out.put(&mut h, &meta)?;
            out.w.write_all(&h.finalize().to_le_bytes())?;
            if let Some(sk) = &t.sketch {
                out.w.write_all(&TAG_SKETCH.to_le_bytes())?;
                let mut h = crc32fast::Hasher::new();
                out.put(&mut h, &(sk.width as u32).to_le_bytes())?;
                out.put(&mut h, &(sk.depth as u32).to_le_bytes())?;
                let mut buf: Vec<u32> = Vec::with_capacity(1 << 16);
                for chunk in sk.counters.chunks(1 << 16) {
                    buf.clear();
                    buf.extend(chunk.iter().map(|c| c.load(Ordering::Relaxed)));
                    out.put(&mut h, bytes_of(&buf))?;
                }
                out.w.write_all(&h.finalize().to_le_bytes())?;
            }
            let rows = with_shards!(&t.shards, s => write_table_rows(&mut out, t, s))?;
            all_rows += rows;
            out.w.write_all(&TAG_TEND.to_le_bytes())?;
            let mut h = crc32fast::Hasher::new();
            out.put(&mut h, &rows.to_le_bytes())?;
            out.w.write_all(&h.finalize().to_le_bytes())?;
        }
        out.w.write_all(&TAG_TRAILER.to_le_bytes())?;
        let mut h = crc32fast::Hasher::new();
        out.put(&mut h, &(tables.len() as u32).to_le_bytes())?;
        out.put(&mut h, &all_rows.to_le_bytes())?;
        out.put(&mut h, &store.clock.next_value().to_le_bytes())?;
        out.put(&mut h, END_MAGIC)?;
        out.w.write_all(&h.finalize().to_le_bytes())?;
        let f = out.w.into_inner().map_err(|e| StoreError::Io(e.into_error()))?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)?;
        Ok(())
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}
