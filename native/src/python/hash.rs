//! Bindings of the stable hashes: shard ownership and feature hashing.

use numpy::{Ix1, PyArray1, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

use super::{get_array, guard, type_name};
use crate::hash::{hash_strings as hash_strings_core, kafka_partition, shard_of as shard_of_one, ValueHasher};

/// shard_of(ids, num_shards) -> uint32 array: splitmix64_mix(id) % num_shards.
#[pyfunction]
pub(crate) fn shard_of<'py>(
    py: Python<'py>,
    ids: &Bound<'py, PyAny>,
    num_shards: i64,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    if num_shards < 1 || num_shards > u32::MAX as i64 {
        return Err(PyValueError::new_err(format!("num_shards must be in [1, 2**32), got {num_shards}")));
    }
    let n = num_shards as u32;
    let ids = get_array::<u64, Ix1>(py, ids, "ids", "uint64", 1)?;
    let s = ids.slice()?;
    let out = py.detach(|| guard(|| Ok(s.iter().map(|&i| shard_of_one(i, n)).collect::<Vec<u32>>())))?;
    Ok(PyArray1::from_vec(py, out))
}

/// kafka_partitions(keys, partitions) -> uint32 array: the partition Kafka's default partitioner
/// gives each key (bytes), `(murmur2(key) & 0x7fffffff) % partitions`.
#[pyfunction]
pub(crate) fn kafka_partitions<'py>(
    py: Python<'py>,
    keys: &Bound<'py, PyList>,
    partitions: i64,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    if partitions < 1 || partitions > i64::from(i32::MAX) {
        return Err(PyValueError::new_err(format!("partitions must be in [1, 2**31), got {partitions}")));
    }
    let mut out = Vec::with_capacity(keys.len());
    for (i, key) in keys.iter().enumerate() {
        let key = key
            .cast::<PyBytes>()
            .map_err(|_| PyTypeError::new_err(format!("keys[{i}] must be bytes, got {}", type_name(&key))))?;
        out.push(kafka_partition(key.as_bytes(), partitions as u32));
    }
    Ok(PyArray1::from_vec(py, out))
}

/// hash_ids(namespace, values) -> uint64 array of xxh3_64(namespace ++ b"\0" ++ utf8(value)).
#[pyfunction]
pub(crate) fn hash_ids<'py>(
    py: Python<'py>,
    namespace: &str,
    values: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    if values.is_instance_of::<PyString>() || values.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err("values must be a sequence of str, not a single str/bytes"));
    }
    let mut h = ValueHasher::new(namespace.as_bytes());
    let one = |h: &mut ValueHasher, i: usize, item: &Bound<'py, PyAny>| -> PyResult<u64> {
        if let Ok(s) = item.cast::<PyString>() {
            Ok(h.hash_bytes(s.to_str()?.as_bytes()))
        } else if let Ok(b) = item.cast::<PyBytes>() {
            Ok(h.hash_bytes(b.as_bytes()))
        } else {
            Err(PyTypeError::new_err(format!("values[{i}] must be str or bytes, got {}", type_name(item))))
        }
    };
    let mut out = Vec::new();
    if let Ok(l) = values.cast::<PyList>() {
        out.reserve(l.len());
        for (i, item) in l.iter().enumerate() {
            out.push(one(&mut h, i, &item)?);
        }
    } else if let Ok(t) = values.cast::<PyTuple>() {
        out.reserve(t.len());
        for (i, item) in t.iter().enumerate() {
            out.push(one(&mut h, i, &item)?);
        }
    } else {
        let it = values.try_iter().map_err(|_| {
            PyTypeError::new_err(format!("values must be a sequence of str, got {}", type_name(values)))
        })?;
        for (i, item) in it.enumerate() {
            out.push(one(&mut h, i, &item?)?);
        }
    }
    Ok(PyArray1::from_vec(py, out))
}

fn hash_int_slice<T: Copy + Into<i128> + Sync>(ns: &[u8], v: &[T]) -> Vec<u64> {
    use rayon::prelude::*;
    let mut out = vec![0u64; v.len()];
    if v.len() < 1 << 16 {
        let mut h = ValueHasher::new(ns);
        for (o, x) in out.iter_mut().zip(v) {
            *o = h.hash_int((*x).into());
        }
    } else {
        out.par_chunks_mut(1 << 14).zip(v.par_chunks(1 << 14)).for_each(|(o, x)| {
            let mut h = ValueHasher::new(ns);
            for (a, b) in o.iter_mut().zip(x) {
                *a = h.hash_int((*b).into());
            }
        });
    }
    out
}

/// hash_ints(namespace, values) -> uint64 array; equal to hash_ids(namespace, [str(v) ...]).
#[pyfunction]
pub(crate) fn hash_ints<'py>(
    py: Python<'py>,
    namespace: &str,
    values: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let ns = namespace.as_bytes();
    let arr = values.cast::<PyUntypedArray>().map_err(|_| {
        PyTypeError::new_err(format!("values must be a numpy.ndarray of dtype int64, got {}", type_name(values)))
    })?;
    let dt = arr.dtype();
    let out = if dt.is_equiv_to(&numpy::dtype::<i64>(py)) {
        let a = get_array::<i64, Ix1>(py, values, "values", "int64", 1)?;
        let s = a.slice()?;
        py.detach(|| hash_int_slice(ns, s))
    } else if dt.is_equiv_to(&numpy::dtype::<i32>(py)) {
        let a = get_array::<i32, Ix1>(py, values, "values", "int32", 1)?;
        let s = a.slice()?;
        py.detach(|| hash_int_slice(ns, s))
    } else if dt.is_equiv_to(&numpy::dtype::<u64>(py)) {
        let a = get_array::<u64, Ix1>(py, values, "values", "uint64", 1)?;
        let s = a.slice()?;
        py.detach(|| hash_int_slice(ns, s))
    } else if dt.is_equiv_to(&numpy::dtype::<u32>(py)) {
        let a = get_array::<u32, Ix1>(py, values, "values", "uint32", 1)?;
        let s = a.slice()?;
        py.detach(|| hash_int_slice(ns, s))
    } else {
        let d = dt.str().map(|s| s.to_string()).unwrap_or_default();
        return Err(PyTypeError::new_err(format!("values must have dtype int64 (or int32/uint64/uint32), got {d}")));
    };
    Ok(PyArray1::from_vec(py, out))
}

/// hash_strings(namespace, data, offsets) -> uint64 array: the hash_ids of each value of an
/// Arrow-layout string column (value i = data[offsets[i]:offsets[i + 1]]), without a Python
/// object per value; the GIL is released while hashing.
#[pyfunction]
pub(crate) fn hash_strings<'py>(
    py: Python<'py>,
    namespace: &str,
    data: &Bound<'py, PyAny>,
    offsets: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let ns = namespace.as_bytes();
    let data = get_array::<u8, Ix1>(py, data, "data", "uint8", 1)?;
    let bytes = data.slice()?;
    let arr = offsets.cast::<PyUntypedArray>().map_err(|_| {
        PyTypeError::new_err(format!(
            "offsets must be a numpy.ndarray of dtype int32 or int64, got {}",
            type_name(offsets)
        ))
    })?;
    let out = if arr.dtype().is_equiv_to(&numpy::dtype::<i32>(py)) {
        let a = get_array::<i32, Ix1>(py, offsets, "offsets", "int32", 1)?;
        let s = a.slice()?;
        py.detach(|| hash_strings_core(ns, bytes, s))
    } else {
        let a = get_array::<i64, Ix1>(py, offsets, "offsets", "int64", 1)?;
        let s = a.slice()?;
        py.detach(|| hash_strings_core(ns, bytes, s))
    };
    Ok(PyArray1::from_vec(py, out.map_err(PyValueError::new_err)?))
}
