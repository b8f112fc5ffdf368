//! Storage element types (fp32 / fp16 / bf16) with fp32 arithmetic.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::config::DType;

/// A weight storage element. Conversions round to nearest-even.
pub trait Elem: Copy + Default + Send + Sync + 'static {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    /// Widen a row to f32.
    fn load_row(src: &[Self], dst: &mut [f32]);
    /// Narrow an f32 row into storage.
    fn store_row(src: &[f32], dst: &mut [Self]);
    /// Raw little-endian bytes of a slice.
    fn as_bytes(s: &[Self]) -> &[u8] {
        // SAFETY: Self is a plain-old-data numeric type without padding.
        unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, std::mem::size_of_val(s)) }
    }
    fn as_bytes_mut(s: &mut [Self]) -> &mut [u8] {
        // SAFETY: as above; every bit pattern is a valid value.
        unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut u8, std::mem::size_of_val(s)) }
    }
}

impl Elem for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn load_row(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
    #[inline(always)]
    fn store_row(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src)
    }
}

impl Elem for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    #[inline(always)]
    fn load_row(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
    #[inline(always)]
    fn store_row(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src)
    }
}

impl Elem for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    #[inline(always)]
    fn load_row(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }
    #[inline(always)]
    fn store_row(src: &[f32], dst: &mut [Self]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = bf16::from_f32(*s);
        }
    }
}

/// Output element of lookups (float32 or float16 numpy arrays).
pub trait OutElem: Copy + Default + Send + Sync + 'static {
    fn write_row<W: Elem>(src: &[W], dst: &mut [Self]);
}

impl OutElem for f32 {
    #[inline(always)]
    fn write_row<W: Elem>(src: &[W], dst: &mut [Self]) {
        W::load_row(src, dst)
    }
}

impl OutElem for f16 {
    #[inline(always)]
    fn write_row<W: Elem>(src: &[W], dst: &mut [Self]) {
        match W::DTYPE {
            DType::F16 => {
                // SAFETY: W is f16 here (same size and representation).
                let s = unsafe { std::slice::from_raw_parts(src.as_ptr() as *const f16, src.len()) };
                dst.copy_from_slice(s)
            }
            _ => {
                let mut tmp = [0f32; 64];
                for (sc, dc) in src.chunks(64).zip(dst.chunks_mut(64)) {
                    let t = &mut tmp[..sc.len()];
                    W::load_row(sc, t);
                    dc.convert_from_f32_slice(t);
                }
            }
        }
    }
}
