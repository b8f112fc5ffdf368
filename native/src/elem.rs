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
        widen_f16(src, dst)
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

/// Widen f16 values to f32 (exact; `dst` as long as `src`). With F16C, one call converts
/// the whole slice, 8 values per instruction: `half`'s slice conversion makes a call per 8
/// values, which took a sixth of a served lookup's time (serving/lookup.rs).
#[inline]
pub fn widen_f16(src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "slices of different lengths");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU has F16C (checked just above; AVX comes with it).
        unsafe { widen_f16_f16c(src, dst) };
        return;
    }
    src.convert_to_f32_slice(dst)
}

/// # Safety
/// The CPU must support F16C and AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "f16c,avx")]
unsafe fn widen_f16_f16c(src: &[f16], dst: &mut [f32]) {
    use std::arch::x86_64::{__m128i, _mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n: 16 bytes read from `src` and 32 written to `dst`, in bounds;
        // both intrinsics take unaligned pointers.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    for k in i..n {
        dst[k] = src[k].to_f32();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widen_f16_is_exact() {
        // Every f16 bit pattern (NaNs compared by bits: both paths quiet them alike).
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        for len in [all.len(), 13, 7] {
            let mut fast = vec![0f32; len];
            let mut slow = vec![0f32; len];
            widen_f16(&all[..len], &mut fast);
            all[..len].convert_to_f32_slice(&mut slow);
            assert!(fast.iter().zip(&slow).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
}
