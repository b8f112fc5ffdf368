//! Versioned binary snapshot format (see native/README.md for the layout).
//!
//! Writing streams each internal shard chunk by chunk while holding that
//! shard's lock, so every internal shard is captured at a single instant and
//! at most one chunk's worth of rows is buffered. Loading first verifies the
//! whole file (structure and every checksum) and only then applies it, so a
//! corrupted file leaves the store untouched.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use half::{bf16, f16};
use parking_lot::RwLock;
use rayon::prelude::*;

use crate::config::*;
use crate::elem::Elem;
use crate::hash::{internal_hash, internal_shard, shard_of};
use crate::store::{now_secs, Store};
use crate::table::{Local, RowBlock, Shard, Shards, Table, COUNTER_NAMES};
use crate::with_shards;

#[cfg(target_endian = "big")]
compile_error!("the snapshot writer assumes a little-endian target");

pub const MAGIC: &[u8; 8] = b"TRLMSNAP";
pub const END_MAGIC: &[u8; 8] = b"TRLMEND\0";
pub const FORMAT_VERSION: u32 = 1;

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

// ---------------------------------------------------------------- metadata

struct Enc(Vec<u8>);
impl Enc {
    fn u8(&mut self, v: u8) {
        self.0.push(v)
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    fn f64(&mut self, v: f64) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    fn opt_u64(&mut self, v: Option<u64>) {
        self.u8(v.is_some() as u8);
        self.u64(v.unwrap_or(0));
    }
}

struct Dec<'a>(&'a [u8]);
impl Dec<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        if self.0.len() < n {
            return corrupt("table metadata block is too short");
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap_or_default()))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap_or_default()))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap_or_default()))
    }
    fn f64(&mut self) -> Result<f64> {
        Ok(f64::from_le_bytes(self.take(8)?.try_into().unwrap_or_default()))
    }
    fn opt_u64(&mut self) -> Result<Option<u64>> {
        let has = self.u8()?;
        let v = self.u64()?;
        Ok(if has != 0 { Some(v) } else { None })
    }
}

fn encode_meta(cfg: &TableConfig, counters: &[u64; 9]) -> Vec<u8> {
    let mut e = Enc(Vec::with_capacity(512));
    e.u16(cfg.name.len() as u16);
    e.0.extend_from_slice(cfg.name.as_bytes());
    e.u32(cfg.dim as u32);
    e.u8(cfg.dtype as u8);
    e.u8(cfg.initializer as u8);
    for v in [cfg.init_low, cfg.init_high, cfg.init_mean, cfg.init_std] {
        e.f64(v);
    }
    e.u64(cfg.seed);
    e.u8(cfg.optimizer as u8);
    for v in [
        cfg.lr,
        cfg.weight_decay,
        cfg.eps,
        cfg.beta1,
        cfg.beta2,
        cfg.initial_accumulator,
        cfg.ftrl_alpha,
        cfg.ftrl_beta,
        cfg.ftrl_l1,
        cfg.ftrl_l2,
    ] {
        e.f64(v);
    }
    e.u8(cfg.weight_bound.is_some() as u8);
    e.f64(cfg.weight_bound.unwrap_or(0.0));
    e.u8(cfg.admission as u8);
    e.f64(cfg.admission_probability);
    e.u32(cfg.admission_threshold);
    e.u32(cfg.sketch_width);
    e.u32(cfg.sketch_depth);
    e.opt_u64(cfg.capacity);
    e.opt_u64(cfg.ttl_seconds);
    e.opt_u64(cfg.ttl_updates);
    e.u32(COUNTER_NAMES.len() as u32);
    for c in counters {
        e.u64(*c);
    }
    e.0
}

fn decode_meta(b: &[u8]) -> Result<(TableConfig, [u64; 9])> {
    let mut d = Dec(b);
    let nlen = d.u16()? as usize;
    let name = std::str::from_utf8(d.take(nlen)?)
        .map_err(|_| StoreError::Corrupt("table name is not valid UTF-8".into()))?
        .to_string();
    let mut c = TableConfig::new(&name, 1);
    c.dim = d.u32()? as usize;
    c.dtype = DType::from_u8(d.u8()?).ok_or_else(|| StoreError::Corrupt("bad dtype code".into()))?;
    c.initializer = match d.u8()? {
        0 => InitKind::Uniform,
        1 => InitKind::Normal,
        _ => return corrupt("bad initializer code"),
    };
    c.init_low = d.f64()?;
    c.init_high = d.f64()?;
    c.init_mean = d.f64()?;
    c.init_std = d.f64()?;
    c.seed = d.u64()?;
    c.optimizer = OptKind::from_u8(d.u8()?).ok_or_else(|| StoreError::Corrupt("bad optimizer code".into()))?;
    c.lr = d.f64()?;
    c.weight_decay = d.f64()?;
    c.eps = d.f64()?;
    c.beta1 = d.f64()?;
    c.beta2 = d.f64()?;
    c.initial_accumulator = d.f64()?;
    c.ftrl_alpha = d.f64()?;
    c.ftrl_beta = d.f64()?;
    c.ftrl_l1 = d.f64()?;
    c.ftrl_l2 = d.f64()?;
    let has_b = d.u8()?;
    let b = d.f64()?;
    c.weight_bound = if has_b != 0 { Some(b) } else { None };
    c.admission = match d.u8()? {
        0 => AdmissionKind::Off,
        1 => AdmissionKind::Probability,
        2 => AdmissionKind::Threshold,
        _ => return corrupt("bad admission code"),
    };
    c.admission_probability = d.f64()?;
    c.admission_threshold = d.u32()?;
    c.sketch_width = d.u32()?;
    c.sketch_depth = d.u32()?;
    c.capacity = d.opt_u64()?;
    c.ttl_seconds = d.opt_u64()?;
    c.ttl_updates = d.opt_u64()?;
    let nc = d.u32()? as usize;
    if nc != COUNTER_NAMES.len() {
        return corrupt("unexpected number of counters");
    }
    let mut counters = [0u64; 9];
    for x in counters.iter_mut() {
        *x = d.u64()?;
    }
    if !d.0.is_empty() {
        return corrupt("trailing bytes in table metadata block");
    }
    c.validate().map_err(|e| StoreError::Corrupt(format!("invalid table configuration: {e}")))?;
    Ok((c, counters))
}

// ---------------------------------------------------------------- writer

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

// ---------------------------------------------------------------- reader

struct Rd<R: Read> {
    r: R,
}
impl<R: Read> Rd<R> {
    fn exact(&mut self, buf: &mut [u8], what: &str) -> Result<()> {
        self.r.read_exact(buf).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                StoreError::Corrupt(format!("file is truncated (while reading {what})"))
            } else {
                StoreError::Io(e)
            }
        })
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        let mut b = [0u8; 4];
        self.exact(&mut b, what)?;
        Ok(u32::from_le_bytes(b))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        let mut b = [0u8; 8];
        self.exact(&mut b, what)?;
        Ok(u64::from_le_bytes(b))
    }
    /// Read into a typed column, feeding the crc.
    fn col<T: Copy + Default>(&mut self, h: &mut crc32fast::Hasher, n: usize, what: &str) -> Result<Vec<T>> {
        let mut v = vec![T::default(); n];
        let b = bytes_of_mut(&mut v);
        self.exact(b, what)?;
        h.update(b);
        Ok(v)
    }
}

/// A decoded row block, by storage type.
pub enum AnyBlock {
    F32(RowBlock<f32>),
    F16(RowBlock<f16>),
    BF16(RowBlock<bf16>),
}

pub trait Visitor {
    fn header(&mut self, next_version: u64) -> Result<()>;
    fn table(&mut self, cfg: &TableConfig, counters: &[u64; 9]) -> Result<()>;
    fn sketch(&mut self, width: u32, depth: u32, counters: &[u32]) -> Result<()>;
    fn rows(&mut self, blk: AnyBlock) -> Result<()>;
    fn end(&mut self, next_version: u64) -> Result<()>;
}

fn read_block_typed<W: Elem, R: Read>(
    rd: &mut Rd<R>,
    h: &mut crc32fast::Hasher,
    cfg: &TableConfig,
    cols: u32,
    n: usize,
) -> Result<RowBlock<W>> {
    let mut b =
        RowBlock::<W> { ids: rd.col(h, n, "row ids")?, versions: rd.col(h, n, "row versions")?, ..Default::default() };
    let mut w = vec![W::default(); n * cfg.dim];
    let bytes = W::as_bytes_mut(&mut w);
    rd.exact(bytes, "row weights")?;
    h.update(bytes);
    b.weights = w;
    if cols & COL_STATE != 0 {
        b.state = rd.col(h, n * cfg.state_dim(), "optimizer state")?;
    }
    if cols & COL_ACC != 0 {
        b.acc = rd.col(h, n, "row accumulators")?;
    }
    if cols & COL_STEPS != 0 {
        b.steps = rd.col(h, n, "adam steps")?;
    }
    if cols & COL_UTIME != 0 {
        b.utime = rd.col(h, n, "update times")?;
    }
    if cols & COL_UTICK != 0 {
        b.utick = rd.col(h, n, "update batches")?;
    }
    Ok(b)
}

pub fn read_snapshot(path: &Path, v: &mut dyn Visitor) -> Result<()> {
    let f = File::open(path)?;
    let mut rd = Rd { r: BufReader::with_capacity(4 << 20, f) };
    let mut hdr = [0u8; 36];
    rd.exact(&mut hdr, "header")?;
    if &hdr[0..8] != MAGIC {
        return corrupt("bad magic: not a Trillium embedding snapshot");
    }
    let ver = u32::from_le_bytes(hdr[8..12].try_into().unwrap_or_default());
    if ver != FORMAT_VERSION {
        return corrupt(format!(
            "unsupported snapshot format version {ver} (this build reads version {FORMAT_VERSION})"
        ));
    }
    let crc = rd.u32("header checksum")?;
    if crc32fast::hash(&hdr) != crc {
        return corrupt("header checksum mismatch");
    }
    let next_version = u64::from_le_bytes(hdr[16..24].try_into().unwrap_or_default());
    let num_tables = u32::from_le_bytes(hdr[24..28].try_into().unwrap_or_default());
    v.header(next_version)?;
    let mut names = HashSet::new();
    let mut all_rows = 0u64;
    for _ in 0..num_tables {
        let t = rd.u32("table metadata tag")?;
        if t != TAG_META {
            return corrupt("expected a table metadata block");
        }
        let len = rd.u32("table metadata length")?;
        if len > MAX_META_LEN {
            return corrupt("table metadata block is too large");
        }
        let mut meta = vec![0u8; len as usize];
        rd.exact(&mut meta, "table metadata")?;
        if crc32fast::hash(&meta) != rd.u32("table metadata checksum")? {
            return corrupt("table metadata checksum mismatch");
        }
        let (cfg, counters) = decode_meta(&meta)?;
        if !names.insert(cfg.name.clone()) {
            return corrupt(format!("duplicate table {:?}", cfg.name));
        }
        v.table(&cfg, &counters)?;
        let expect_cols = columns_of(&cfg);
        let mut rows = 0u64;
        loop {
            let t = rd.u32("block tag")?;
            let mut h = crc32fast::Hasher::new();
            match t {
                TAG_SKETCH => {
                    let width = rd.u32("sketch width")?;
                    let depth = rd.u32("sketch depth")?;
                    h.update(&width.to_le_bytes());
                    h.update(&depth.to_le_bytes());
                    if !width.is_power_of_two() || width > (1 << 28) || depth == 0 || depth > 16 {
                        return corrupt("bad sketch dimensions");
                    }
                    let c: Vec<u32> = rd.col(&mut h, (width * depth) as usize, "sketch")?;
                    if h.finalize() != rd.u32("sketch checksum")? {
                        return corrupt("sketch checksum mismatch");
                    }
                    v.sketch(width, depth, &c)?;
                }
                TAG_ROWS => {
                    let n = rd.u32("row block header")?;
                    let cols = rd.u32("row block header")?;
                    let plen = rd.u64("row block header")?;
                    h.update(&n.to_le_bytes());
                    h.update(&cols.to_le_bytes());
                    h.update(&plen.to_le_bytes());
                    if n == 0 || n > MAX_BLOCK_ROWS {
                        return corrupt(format!("row block has an invalid row count {n}"));
                    }
                    if cols != expect_cols {
                        return corrupt("row block columns do not match the table configuration");
                    }
                    if plen != payload_len(&cfg, cols, n as u64) {
                        return corrupt("row block payload length does not match its header");
                    }
                    let n = n as usize;
                    let blk = match cfg.dtype {
                        DType::F32 => AnyBlock::F32(read_block_typed(&mut rd, &mut h, &cfg, cols, n)?),
                        DType::F16 => AnyBlock::F16(read_block_typed(&mut rd, &mut h, &cfg, cols, n)?),
                        DType::BF16 => AnyBlock::BF16(read_block_typed(&mut rd, &mut h, &cfg, cols, n)?),
                    };
                    if h.finalize() != rd.u32("row block checksum")? {
                        return corrupt("row block checksum mismatch");
                    }
                    rows += n as u64;
                    v.rows(blk)?;
                }
                TAG_TEND => {
                    let r = rd.u64("table end")?;
                    h.update(&r.to_le_bytes());
                    if h.finalize() != rd.u32("table end checksum")? {
                        return corrupt("table end checksum mismatch");
                    }
                    if r != rows {
                        return corrupt(format!("table {:?}: expected {r} rows, found {rows}", cfg.name));
                    }
                    break;
                }
                _ => return corrupt(format!("unexpected block tag 0x{t:08x}")),
            }
        }
        all_rows += rows;
    }
    if rd.u32("trailer")? != TAG_TRAILER {
        return corrupt("missing trailer");
    }
    let mut tr = [0u8; 28];
    rd.exact(&mut tr, "trailer")?;
    if crc32fast::hash(&tr) != rd.u32("trailer checksum")? {
        return corrupt("trailer checksum mismatch");
    }
    let nt = u32::from_le_bytes(tr[0..4].try_into().unwrap_or_default());
    let nr = u64::from_le_bytes(tr[4..12].try_into().unwrap_or_default());
    let end_next = u64::from_le_bytes(tr[12..20].try_into().unwrap_or_default());
    if nt != num_tables || nr != all_rows || &tr[20..28] != END_MAGIC {
        return corrupt("trailer does not match the file contents");
    }
    let mut extra = [0u8; 1];
    match rd.r.read(&mut extra) {
        Ok(0) => {}
        Ok(_) => return corrupt("unexpected data after the trailer"),
        Err(e) => return Err(StoreError::Io(e)),
    }
    v.end(next_version.max(end_next))
}

/// Pass 1: structural checks + compatibility with existing tables.
struct Verify<'a> {
    store: &'a Store,
}

fn check_compatible(existing: &TableConfig, cfg: &TableConfig) -> Result<()> {
    if existing.dim != cfg.dim || existing.dtype != cfg.dtype || existing.optimizer != cfg.optimizer {
        return Err(StoreError::Value(format!(
            "snapshot table {:?} (dim={}, dtype={}, optimizer={}) is incompatible with the existing table (dim={}, dtype={}, optimizer={})",
            cfg.name,
            cfg.dim,
            cfg.dtype.name(),
            cfg.optimizer.name(),
            existing.dim,
            existing.dtype.name(),
            existing.optimizer.name()
        )));
    }
    Ok(())
}

impl Visitor for Verify<'_> {
    fn header(&mut self, _: u64) -> Result<()> {
        Ok(())
    }
    fn table(&mut self, cfg: &TableConfig, _: &[u64; 9]) -> Result<()> {
        if let Ok(t) = self.store.table(&cfg.name) {
            check_compatible(&t.cfg, cfg)?;
        }
        Ok(())
    }
    fn sketch(&mut self, _: u32, _: u32, _: &[u32]) -> Result<()> {
        Ok(())
    }
    fn rows(&mut self, _: AnyBlock) -> Result<()> {
        Ok(())
    }
    fn end(&mut self, _: u64) -> Result<()> {
        Ok(())
    }
}

/// Pass 2: apply to the store.
struct Apply<'a> {
    store: &'a Store,
    filter: Option<(u32, u32)>,
    table: Option<Arc<Table>>,
}

fn apply_block<W: Elem>(
    store: &Store,
    t: &Table,
    shards: &[RwLock<Shard<W>>],
    blk: &RowBlock<W>,
    filter: Option<(u32, u32)>,
) -> u64 {
    let n = blk.len();
    let hashes: Vec<u64> = blk.ids.iter().map(|&id| internal_hash(id)).collect();
    let ns = shards.len();
    let mut per: Vec<Vec<u32>> = vec![Vec::new(); ns];
    for k in 0..n {
        if let Some((i, m)) = filter {
            if shard_of(blk.ids[k], m) != i {
                continue;
            }
        }
        per[internal_shard(hashes[k], ns)].push(k as u32);
    }
    let batch = t.counters.update_batches.load(Ordering::Relaxed) as u32;
    let ctx = t.ctx(0, now_secs(), batch);
    let loaded: u64 = per.iter().map(|p| p.len() as u64).sum();
    let total = store.pool.install(|| {
        per.par_iter()
            .enumerate()
            .map(|(s, which)| {
                let mut local = Local::default();
                if !which.is_empty() {
                    shards[s].write().load_rows(&ctx, blk, which, &hashes, &mut local);
                }
                local
            })
            .reduce(Local::default, |a, b| a + b)
    });
    t.counters.evicted.fetch_add(total.evicted, Ordering::Relaxed);
    t.counters.expired.fetch_add(total.expired, Ordering::Relaxed);
    loaded
}

impl Visitor for Apply<'_> {
    fn header(&mut self, next_version: u64) -> Result<()> {
        self.store.clock.advance_to(next_version);
        Ok(())
    }
    fn table(&mut self, cfg: &TableConfig, counters: &[u64; 9]) -> Result<()> {
        let t = match self.store.table(&cfg.name) {
            Ok(t) => {
                check_compatible(&t.cfg, cfg)?;
                t
            }
            Err(_) => {
                // A concurrent create_table may win the race; fall back to it.
                match self.store.create_table(cfg.clone()) {
                    Ok(()) => {}
                    Err(StoreError::Value(_)) => {}
                    Err(e) => return Err(e),
                }
                let t = self.store.table(&cfg.name)?;
                check_compatible(&t.cfg, cfg)?;
                t
            }
        };
        if self.filter.is_none() {
            let mut c = *counters;
            c[8] = 0; // update_batches handled below
            t.counters.add_all(&c);
        }
        t.counters.update_batches.fetch_max(counters[8], Ordering::Relaxed);
        self.table = Some(t);
        Ok(())
    }
    fn sketch(&mut self, width: u32, depth: u32, counters: &[u32]) -> Result<()> {
        if let Some(t) = &self.table {
            if let Some(sk) = &t.sketch {
                if sk.width == width as usize && sk.depth == depth as usize {
                    for (c, v) in sk.counters.iter().zip(counters) {
                        let cur = c.load(Ordering::Relaxed);
                        c.store(cur.saturating_add(*v), Ordering::Relaxed);
                    }
                }
            }
        }
        Ok(())
    }
    fn rows(&mut self, blk: AnyBlock) -> Result<()> {
        let t = match &self.table {
            Some(t) => t.clone(),
            None => return corrupt("row block outside of a table"),
        };
        match (&t.shards, &blk) {
            (Shards::F32(s), AnyBlock::F32(b)) => apply_block(self.store, &t, s, b, self.filter),
            (Shards::F16(s), AnyBlock::F16(b)) => apply_block(self.store, &t, s, b, self.filter),
            (Shards::BF16(s), AnyBlock::BF16(b)) => apply_block(self.store, &t, s, b, self.filter),
            _ => return corrupt("row block dtype does not match the table"),
        };
        Ok(())
    }
    fn end(&mut self, next_version: u64) -> Result<()> {
        self.store.clock.advance_to(next_version);
        Ok(())
    }
}

/// Load (merge) a snapshot into the store, optionally keeping only the rows
/// with `shard_of(id, num_shards) == shard_index`.
pub fn load_snapshot(store: &Store, path: &Path, filter: Option<(u32, u32)>) -> Result<()> {
    read_snapshot(path, &mut Verify { store })?;
    read_snapshot(path, &mut Apply { store, filter, table: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("trl-snap-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn filled_store() -> Store {
        let s = Store::new(Some(4), Some(2)).unwrap();
        let mut c = TableConfig::new("a", 5);
        c.optimizer = OptKind::Adam;
        c.dtype = DType::F16;
        c.ttl_updates = Some(100);
        s.create_table(c).unwrap();
        let mut c = TableConfig::new("b", 3);
        c.optimizer = OptKind::RowwiseAdagrad;
        c.admission = AdmissionKind::Threshold;
        c.admission_threshold = 2;
        c.sketch_width = 1024;
        s.create_table(c).unwrap();
        for name in ["a", "b"] {
            let t = s.table(name).unwrap();
            let dim = t.cfg.dim;
            let ids: Vec<u64> = (0..3000u64).map(|i| i * 31 + 7).collect();
            let mut out = vec![0f32; ids.len() * dim];
            s.lookup(&t, &ids, &mut out, true);
            s.lookup(&t, &ids, &mut out, true);
            let g: Vec<f32> = (0..ids.len() * dim).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect();
            s.update(&t, &ids, &g);
        }
        s
    }

    #[test]
    fn round_trip_and_reshard() {
        let dir = tmpdir("rt");
        let p = dir.join("s.bin");
        let s = filled_store();
        write_snapshot(&s, &p).unwrap();
        let full = Store::new(Some(7), Some(1)).unwrap();
        load_snapshot(&full, &p, None).unwrap();
        for name in ["a", "b"] {
            let (t0, t1) = (s.table(name).unwrap(), full.table(name).unwrap());
            assert_eq!(t0.rows(), t1.rows());
            assert_eq!(t0.cfg, t1.cfg);
            assert_eq!(t0.counters.snapshot(), t1.counters.snapshot());
            for i in 0..3000u64 {
                let id = i * 31 + 7;
                let (a, b) = (t0.get_state(id).unwrap(), t1.get_state(id).unwrap());
                assert_eq!(a.weights, b.weights);
                assert_eq!(a.state, b.state);
                assert_eq!(a.acc, b.acc);
                assert_eq!(a.step, b.step);
                assert_eq!(a.version, b.version);
                assert_eq!(a.utick, b.utick);
            }
        }
        assert_eq!(full.clock.next_value(), s.clock.next_value());
        // reshard into 3
        let parts: Vec<Store> = (0..3).map(|_| Store::new(Some(2), Some(1)).unwrap()).collect();
        for (i, st) in parts.iter().enumerate() {
            load_snapshot(st, &p, Some((i as u32, 3))).unwrap();
        }
        let total: usize = parts.iter().map(|st| st.table("a").unwrap().rows()).sum();
        assert_eq!(total, 3000);
        for i in 0..3000u64 {
            let id = i * 31 + 7;
            let owner = shard_of(id, 3) as usize;
            for (k, st) in parts.iter().enumerate() {
                assert_eq!(st.table("a").unwrap().get_state(id).is_some(), k == owner);
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn corruption_detected_everywhere() {
        let dir = tmpdir("corrupt");
        let p = dir.join("c.bin");
        let s = filled_store();
        write_snapshot(&s, &p).unwrap();
        let good = std::fs::read(&p).unwrap();
        let q = dir.join("bad.bin");
        // Flip one byte at many positions; truncate at many lengths.
        let step = (good.len() / 97).max(1);
        for pos in (0..good.len()).step_by(step) {
            let mut b = good.clone();
            b[pos] ^= 0x40;
            std::fs::write(&q, &b).unwrap();
            let st = Store::new(Some(2), Some(1)).unwrap();
            match load_snapshot(&st, &q, None) {
                Err(StoreError::Corrupt(_)) => {}
                other => panic!("flip at {pos}: {:?}", other.err()),
            }
            assert!(st.table_names().is_empty(), "store modified by a corrupt load");
        }
        for len in (0..good.len()).step_by(step) {
            std::fs::write(&q, &good[..len]).unwrap();
            let st = Store::new(Some(2), Some(1)).unwrap();
            let r = load_snapshot(&st, &q, None);
            assert!(matches!(r, Err(StoreError::Corrupt(_))), "truncated at {len} of {}: {:?}", good.len(), r.err());
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
