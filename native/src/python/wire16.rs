//! Bindings of the wire's scaled fp16 (`crate::wire16`), for `trillium.wire.codec`.

use half::f16;
use numpy::{IxDyn, PyArray, PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::wire16::{narrow_scaled, scale_for, widen_scaled};

/// to_fp16_scaled(values: float32 array) -> (float16 array of its shape, scale): the values times
/// a power of two (`scale`) that brings the largest near 2^14, rounded to fp16; scale 1.0 when a
/// value is not finite. GIL released.
#[pyfunction]
pub(crate) fn to_fp16_scaled<'py>(
    py: Python<'py>,
    values: &Bound<'py, PyArrayDyn<f32>>,
) -> PyResult<(Bound<'py, PyArrayDyn<f16>>, f64)> {
    let ro = values.readonly();
    let src = ro.as_slice().map_err(|e| PyValueError::new_err(format!("values are not contiguous: {e}")))?;
    // SAFETY: every element is written below before the array is returned.
    let out = unsafe { PyArray::<f16, IxDyn>::new(py, values.shape(), false) };
    // SAFETY: the array was just created, is C-contiguous and not shared yet.
    let dst = unsafe { std::slice::from_raw_parts_mut(out.data(), src.len()) };
    let scale = py.detach(|| {
        let scale = scale_for(src).unwrap_or(1.0);
        narrow_scaled(src, scale, dst);
        scale
    });
    Ok((out, scale as f64))
}

/// from_fp16_scaled(values: float16 array, scale) -> float32 array of its shape: `to_fp16_scaled`'s
/// values back (divided by `scale`, a power of two: exact). GIL released.
#[pyfunction]
pub(crate) fn from_fp16_scaled<'py>(
    py: Python<'py>,
    values: &Bound<'py, PyArrayDyn<f16>>,
    scale: f64,
) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
    if !(scale > 0.0 && scale.is_finite()) {
        return Err(PyValueError::new_err(format!("scale must be a positive finite number, got {scale}")));
    }
    let ro = values.readonly();
    let src = ro.as_slice().map_err(|e| PyValueError::new_err(format!("values are not contiguous: {e}")))?;
    // SAFETY: every element is written below before the array is returned.
    let out = unsafe { PyArray::<f32, IxDyn>::new(py, values.shape(), false) };
    // SAFETY: the array was just created, is C-contiguous and not shared yet.
    let dst = unsafe { std::slice::from_raw_parts_mut(out.data(), src.len()) };
    let factor = (1.0 / scale) as f32;
    py.detach(|| widen_scaled(src, factor, dst));
    Ok(out)
}
