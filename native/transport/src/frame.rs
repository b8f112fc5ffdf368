//! The codec's array frame (`pack_array` / `unpack_array` in `trillium/wire/codec.py`), read and
//! written in Rust: the same bytes on the wire, whichever side wrote them.
//!
//! ```text
//! b"TRLM"  u8 format version  u32 header length  msgpack header  padding  buffer
//! ```
//!
//! The header is `{"kind": "array", "meta": {}, "arrays": [[dtype, shape, offset]]}`, `offset`
//! counting from the start of the frame, on a 64-byte boundary. Reading checks what codec.py
//! checks and yields a view of the buffer in place; writing puts the header first and hands out
//! the buffer's bytes, 8-byte aligned, for rows to be written once, where the wire reads them.

use bytes::Bytes;
use rmpv::Value;

pub const MAGIC: &[u8; 4] = b"TRLM";
pub const FORMAT_VERSION: u8 = 1;
const PREFIX: usize = 9; // magic, version, header length
const ALIGN: usize = 64;
/// The msgpack depth a header may have, as rmpv counts it (a container and each value in it count
/// a level each): an array frame's is four containers deep.
const MAX_DEPTH: usize = 16;

/// Why bytes are no array frame (the caller's fault: INVALID_ARGUMENT on the wire).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameError(pub String);

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn bad<T>(why: impl Into<String>) -> Result<T, FrameError> {
    Err(FrameError(why.into()))
}

const fn aligned(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// One array of a frame, in place: its dtype as numpy writes it (`"<u8"`), shape, and bytes.
#[derive(Debug)]
pub struct ArrayRef<'a> {
    pub dtype: String,
    pub shape: Vec<u64>,
    pub data: &'a [u8],
}

impl<'a> ArrayRef<'a> {
    /// The values as `u64` if the dtype is numpy's little-endian uint64, one-dimensional.
    pub fn u64s(&self, what: &str) -> Result<std::borrow::Cow<'a, [u64]>, FrameError> {
        self.one_dimensional(what)?;
        self.typed::<u64>(what)
    }

    fn one_dimensional(&self, what: &str) -> Result<(), FrameError> {
        if self.shape.len() != 1 {
            return bad(format!("{what} must be 1-dimensional, got shape {:?}", self.shape));
        }
        Ok(())
    }

    /// The values as `T` if the dtype is `T`'s (little-endian, or native on this little-endian
    /// wire), of any shape, copied only where the frame left them unaligned.
    pub fn typed<T: PlainElem>(&self, what: &str) -> Result<std::borrow::Cow<'a, [T]>, FrameError> {
        let native = format!("={}", &T::DTYPE[1..]);
        if self.dtype != T::DTYPE && self.dtype != native {
            return bad(format!("{what} must be {}, got an array of dtype {:?}", T::NAME, self.dtype));
        }
        let data: &'a [u8] = self.data;
        // SAFETY: T is a plain number (PlainElem), with no invalid bit patterns; align_to
        // yields an aligned middle only.
        let (head, middle, tail) = unsafe { data.align_to::<T>() };
        if head.is_empty() && tail.is_empty() {
            return Ok(std::borrow::Cow::Borrowed(middle));
        }
        let size = std::mem::size_of::<T>();
        let mut owned = vec![T::default(); data.len() / size];
        // SAFETY: `owned` holds exactly data.len() bytes of T, which any bytes make valid.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), owned.as_mut_ptr().cast::<u8>(), data.len()) };
        Ok(std::borrow::Cow::Owned(owned))
    }
}

fn itemsize(dtype: &str) -> Option<usize> {
    // numpy's dtype.str: a byte order (<, >, =, |), a kind, the item size in bytes.
    let (order, rest) = dtype.split_at_checked(1)?;
    let (kind, size) = rest.split_at_checked(1)?;
    if !matches!(order, "<" | ">" | "=" | "|") || !matches!(kind, "b" | "i" | "u" | "f") {
        return None;
    }
    size.parse::<usize>().ok().filter(|s| matches!(s, 1 | 2 | 4 | 8 | 16))
}

/// A frame's header and arrays, in place.
pub struct Frame<'a> {
    /// The header's `meta` map.
    pub meta: Vec<(Value, Value)>,
    pub arrays: Vec<ArrayRef<'a>>,
}

impl Frame<'_> {
    /// A `meta` field, if present.
    pub fn field(&self, name: &str) -> Option<&Value> {
        self.meta.iter().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v)
    }
}

/// A frame of `kind` (`batch`, `gradients`, `array`), checked as codec.py's `_decode` checks it.
pub fn read_frame<'a>(frame: &'a [u8], kind: &str) -> Result<Frame<'a>, FrameError> {
    if frame.len() < PREFIX {
        return bad(format!("message too short ({} bytes) to be a Trillium message", frame.len()));
    }
    if &frame[..4] != MAGIC {
        return bad(format!("not a Trillium message: bad magic {:?}", &frame[..4]));
    }
    if frame[4] != FORMAT_VERSION {
        return bad(format!("unsupported codec format version {} (this build reads {FORMAT_VERSION})", frame[4]));
    }
    let header_len = u32::from_le_bytes(frame[5..9].try_into().expect("4 bytes")) as usize;
    let header_end = PREFIX.checked_add(header_len).filter(|&e| e <= frame.len());
    let Some(header_end) = header_end else {
        return bad(format!("truncated message: header of {header_len} bytes, message of {}", frame.len()));
    };
    let mut reader = &frame[PREFIX..header_end];
    let header = match rmpv::decode::read_value_with_max_depth(&mut reader, MAX_DEPTH) {
        Ok(v) => v,
        Err(e) => return bad(format!("corrupt message header: {e}")),
    };
    let Value::Map(entries) = header else { return bad("corrupt message header: expected a map") };
    let field = |name: &str| entries.iter().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v);
    if entries.len() != 3 {
        return bad("corrupt message header: expected keys kind, meta, arrays");
    }
    let (Some(found), Some(meta), Some(arrays)) = (field("kind"), field("meta"), field("arrays")) else {
        return bad("corrupt message header: expected keys kind, meta, arrays");
    };
    if found.as_str() != Some(kind) {
        return bad(format!("expected a '{kind}' message, got {found}"));
    }
    let (Value::Map(meta), Value::Array(arrays)) = (meta, arrays) else {
        return bad("corrupt message header: meta must be a map and arrays a list");
    };
    let arrays = arrays.iter().map(|d| array_at(frame, d, header_end)).collect::<Result<Vec<_>, _>>()?;
    Ok(Frame { meta: meta.clone(), arrays })
}

fn array_at<'a>(frame: &'a [u8], descriptor: &Value, header_end: usize) -> Result<ArrayRef<'a>, FrameError> {
    let Value::Array(parts) = descriptor else { return bad(format!("corrupt array descriptor {descriptor}")) };
    let [Value::String(dtype), Value::Array(shape), offset] = parts.as_slice() else {
        return bad(format!("corrupt array descriptor {descriptor}"));
    };
    let Some(dtype) = dtype.as_str() else { return bad(format!("unsupported array dtype {descriptor}")) };
    let Some(size) = itemsize(dtype) else { return bad(format!("unsupported array dtype {dtype:?}")) };
    let shape: Option<Vec<u64>> = shape.iter().map(Value::as_u64).collect();
    let offset = offset.as_u64().filter(|&o| o >= header_end as u64);
    let (Some(shape), Some(offset)) = (shape, offset) else {
        return bad(format!("corrupt array descriptor {descriptor}"));
    };
    let bytes = shape.iter().try_fold(size as u64, |n, &d| n.checked_mul(d));
    let end = bytes.and_then(|b| b.checked_add(offset)).filter(|&e| e <= frame.len() as u64);
    let Some(end) = end else {
        return bad(format!(
            "truncated message: an array of {dtype} {shape:?} at {offset}, message of {}",
            frame.len()
        ));
    };
    Ok(ArrayRef { dtype: dtype.to_owned(), shape, data: &frame[offset as usize..end as usize] })
}

/// The array of a frame `pack_array` wrote (or `ArrayWriter`), checked as codec.py checks it.
pub fn read_array(frame: &[u8]) -> Result<ArrayRef<'_>, FrameError> {
    let mut frame = read_frame(frame, "array")?;
    if frame.arrays.len() != 1 {
        return bad(format!("corrupt array message: expected 1 array, got {}", frame.arrays.len()));
    }
    Ok(frame.arrays.remove(0))
}

/// A frame's bytes in 8-byte words: the values written into it are aligned for any element type.
struct Words {
    words: Vec<u64>,
    len: usize,
}

impl AsRef<[u8]> for Words {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `len` is within the words' bytes; u8 has no alignment to keep.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }
}

/// An element a frame's array holds: its dtype string as numpy writes it.
pub trait FrameElem: Copy + Default {
    const DTYPE: &'static str;
    /// numpy's name of it, for errors.
    const NAME: &'static str;
}

impl FrameElem for f32 {
    const DTYPE: &'static str = "<f4";
    const NAME: &'static str = "float32";
}

impl FrameElem for half::f16 {
    const DTYPE: &'static str = "<f2";
    const NAME: &'static str = "float16";
}

impl FrameElem for u64 {
    const DTYPE: &'static str = "<u8";
    const NAME: &'static str = "uint64";
}

impl FrameElem for i32 {
    const DTYPE: &'static str = "<i4";
    const NAME: &'static str = "int32";
}

/// A number every bit pattern of which is valid: read in place from a frame's bytes.
pub trait PlainElem: FrameElem {}

impl PlainElem for f32 {}
impl PlainElem for half::f16 {}
impl PlainElem for u64 {}
impl PlainElem for i32 {}

impl FrameElem for bool {
    const DTYPE: &'static str = "|b1";
    const NAME: &'static str = "bool";
}

/// One array of a frame to write: its dtype, item size and shape.
pub struct ArraySpec {
    pub dtype: &'static str,
    pub itemsize: usize,
    pub shape: Vec<u64>,
}

impl ArraySpec {
    pub fn of<T: FrameElem>(shape: Vec<u64>) -> Self {
        Self { dtype: T::DTYPE, itemsize: std::mem::size_of::<T>(), shape }
    }

    fn bytes(&self) -> usize {
        self.shape.iter().product::<u64>() as usize * self.itemsize
    }
}

/// A frame of any kind: the header first (its `meta` and the arrays' descriptors), then
/// `values(i)` to write array `i` in place, then `finish()` for the wire.
pub struct FrameWriter {
    buf: Words,
    /// Each array's (offset, bytes).
    at: Vec<(usize, usize)>,
}

impl FrameWriter {
    pub fn new(kind: &str, meta: Value, arrays: &[ArraySpec]) -> Self {
        // The header names the arrays' offsets, which follow it: to a fixed point, as codec.py does.
        let mut start = aligned(PREFIX);
        let (header, at) = loop {
            let mut at = Vec::with_capacity(arrays.len());
            let mut offset = start;
            for a in arrays {
                at.push((offset, a.bytes()));
                offset = aligned(offset + a.bytes());
            }
            let header = frame_header(kind, meta.clone(), arrays, &at);
            let needed = aligned(PREFIX + header.len());
            if needed <= start {
                break (header, at);
            }
            start = needed;
        };
        let total = at.last().map_or(start, |&(o, n)| o + n);
        let mut buf = Words { words: vec![0u64; total.div_ceil(8)], len: total };
        // SAFETY: within the words' bytes, as `as_ref`; the words are this writer's alone.
        let bytes = unsafe { std::slice::from_raw_parts_mut(buf.words.as_mut_ptr().cast::<u8>(), total) };
        bytes[..4].copy_from_slice(MAGIC);
        bytes[4] = FORMAT_VERSION;
        bytes[5..9].copy_from_slice(&(header.len() as u32).to_le_bytes());
        bytes[PREFIX..PREFIX + header.len()].copy_from_slice(&header);
        Self { buf, at }
    }

    /// Array `i`'s values, zeroed, to write once; `T` must be the dtype its spec named.
    pub fn values<T: FrameElem>(&mut self, i: usize) -> &mut [T] {
        let (offset, bytes) = self.at[i];
        assert!(bytes % std::mem::size_of::<T>() == 0, "array {i} holds no whole number of these values");
        // SAFETY: `offset` is a multiple of 64 within the 8-byte-aligned words, the array's bytes
        // fit after it (`new` sized them so), zeros are a valid f32/f16/u64/bool, and `&mut self`
        // keeps the slice unique.
        unsafe {
            let at = self.buf.words.as_mut_ptr().cast::<u8>().add(offset).cast::<T>();
            std::slice::from_raw_parts_mut(at, bytes / std::mem::size_of::<T>())
        }
    }

    pub fn finish(self) -> Bytes {
        Bytes::from_owner(self.buf)
    }
}

/// The array frame of one array (`pack_array`'s): `FrameWriter` with no meta.
pub struct ArrayWriter<T: FrameElem> {
    frame: FrameWriter,
    _elem: std::marker::PhantomData<T>,
}

impl<T: FrameElem> ArrayWriter<T> {
    /// A one-dimensional array of `len` values.
    pub fn new(len: usize) -> Self {
        Self::with_shape(vec![len as u64])
    }

    pub fn with_shape(shape: Vec<u64>) -> Self {
        let frame = FrameWriter::new("array", Value::Map(vec![]), &[ArraySpec::of::<T>(shape)]);
        Self { frame, _elem: std::marker::PhantomData }
    }

    /// The frame's values, zeroed, to write once.
    pub fn values(&mut self) -> &mut [T] {
        self.frame.values(0)
    }

    pub fn finish(self) -> Bytes {
        self.frame.finish()
    }
}

fn frame_header(kind: &str, meta: Value, arrays: &[ArraySpec], at: &[(usize, usize)]) -> Vec<u8> {
    let descriptors = arrays
        .iter()
        .zip(at)
        .map(|(a, &(offset, _))| {
            let shape = a.shape.iter().map(|&d| Value::from(d)).collect();
            Value::Array(vec![Value::from(a.dtype), Value::Array(shape), Value::from(offset as u64)])
        })
        .collect();
    let header = Value::Map(vec![
        (Value::from("kind"), Value::from(kind)),
        (Value::from("meta"), meta),
        (Value::from("arrays"), Value::Array(descriptors)),
    ]);
    let mut out = Vec::with_capacity(64);
    rmpv::encode::write_value(&mut out, &header).expect("a Vec takes every write");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_frame_reads_back_with_its_values_in_place() {
        let mut w = ArrayWriter::<f32>::new(5);
        w.values().copy_from_slice(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        let frame = w.finish();
        assert_eq!(frame.len() % 4, 0);
        let a = read_array(&frame).unwrap();
        assert_eq!((a.dtype.as_str(), a.shape.as_slice()), ("<f4", &[5u64][..]));
        let values: Vec<f32> = a.data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(values, [1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!((a.data.as_ptr() as usize - frame.as_ptr() as usize) % ALIGN, 0);
    }

    #[test]
    fn an_empty_array_is_a_frame_too() {
        let frame = ArrayWriter::<half::f16>::new(0).finish();
        let a = read_array(&frame).unwrap();
        assert_eq!((a.dtype.as_str(), a.shape.as_slice(), a.data.len()), ("<f2", &[0u64][..], 0));
    }

    #[test]
    fn what_is_no_frame_says_why() {
        let good = ArrayWriter::<f32>::new(3).finish();
        let cases: [(&[u8], &str); 4] = [
            (b"TRL", "too short"),
            (b"XXXX\x01\x00\x00\x00\x00", "bad magic"),
            (b"TRLM\x02\x00\x00\x00\x00", "format version 2"),
            (b"TRLM\x01\xff\x00\x00\x00", "truncated message: header"),
        ];
        for (bytes, why) in cases {
            assert!(read_array(bytes).unwrap_err().0.contains(why), "{why}");
        }
        // Cut short inside the buffer: the descriptor says more bytes than there are.
        assert!(read_array(&good[..good.len() - 1]).unwrap_err().0.contains("truncated message: an array"));
        let ids = read_array(&good).unwrap();
        assert!(ids.u64s("ids").unwrap_err().0.contains("must be uint64"));
    }
}
