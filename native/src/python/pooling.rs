//! Bindings of the embedding worker's batch plan, pooling and gradient scatter
//! (`PoolingLayout`, `PoolingPlan`; see pooling.rs).

use std::collections::HashMap;
use std::sync::Arc;

use half::f16;
use half::slice::HalfFloatSliceExt;
use numpy::ndarray::Dimension;
use numpy::{
    Ix1, Ix2, Ix3, PyArray, PyArray1, PyArray2, PyArray3, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use super::{get_array, guard, type_name};
use crate::config::MAX_DIM;
use crate::pooling::{Layout, Plan, Pooling, Slot, SlotGrad};

/// The job's feature slots over its tables and PS shards.
#[pyclass(name = "PoolingLayout", module = "trillium_native", frozen)]
pub struct PyLayout {
    pub(crate) layout: Arc<Layout>,
}

#[pymethods]
impl PyLayout {
    /// `slots`: (name, table, pooling "sum" | "mean" | "none", max_len) in the model's order;
    /// `dims`: table name -> dim.
    #[new]
    fn new(
        slots: Vec<(String, String, String, Option<i64>)>,
        dims: HashMap<String, i64>,
        num_shards: i64,
    ) -> PyResult<Self> {
        if num_shards < 1 || num_shards > u32::MAX as i64 {
            return Err(PyValueError::new_err(format!("num_shards must be in [1, 2**32), got {num_shards}")));
        }
        let mut specs = Vec::with_capacity(slots.len());
        for (name, table, pooling, max_len) in slots {
            let p = match (pooling.as_str(), max_len) {
                ("sum", _) => Pooling::Sum,
                ("mean", _) => Pooling::Mean,
                ("none", Some(m)) if m >= 1 => Pooling::Sequence { max_len: m as usize },
                ("none", m) => {
                    return Err(PyValueError::new_err(format!(
                        "slot {name:?}: pooling 'none' (a sequence) needs max_len >= 1, got {m:?}"
                    )))
                }
                (other, _) => {
                    return Err(PyValueError::new_err(format!(
                        "slot {name:?}: unknown pooling {other:?}: expected 'sum', 'mean' or 'none'"
                    )))
                }
            };
            specs.push((name, table, p));
        }
        if let Some((t, d)) = dims.iter().find(|(_, &d)| d < 1 || d > MAX_DIM as i64) {
            return Err(PyValueError::new_err(format!("dims[{t:?}] must be in [1, {MAX_DIM}], got {d}")));
        }
        let dim_of = |t: &str| dims.get(t).map(|&d| d as usize);
        let layout = guard(|| Layout::new(&specs, dim_of, num_shards as u32))?;
        Ok(PyLayout { layout: Arc::new(layout) })
    }

    /// Columns of the pooled output (the pooled slots' dims added up).
    #[getter]
    fn width(&self) -> usize {
        self.layout.width
    }

    /// Per slot: its `(start, stop)` columns in the pooled output, or None for a sequence slot.
    #[getter]
    fn columns(&self) -> Vec<Option<(usize, usize)>> {
        self.layout
            .slots
            .iter()
            .map(|s| match s.pooling {
                Pooling::Sequence { .. } => None,
                _ => Some((s.out, s.out + s.dim)),
            })
            .collect()
    }

    /// Names of the tables the slots read, in order of first use (the order of
    /// `PoolingPlan.ids` and of `pool`'s rows).
    #[getter]
    fn tables(&self) -> Vec<String> {
        self.layout.tables.iter().map(|t| t.0.clone()).collect()
    }

    /// Plan a batch from its `KeyedIds` arrays (see `PoolingPlan`); GIL released.
    fn plan<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        values: &Bound<'py, PyAny>,
        lengths: &Bound<'py, PyAny>,
    ) -> PyResult<PyPlan> {
        let values = get_array::<u64, Ix1>(py, values, "values", "uint64", 1)?;
        let lengths = get_array::<i32, Ix1>(py, lengths, "lengths", "int32", 1)?;
        let (v, l) = (values.slice()?, lengths.slice()?);
        let layout = &*self.layout;
        let mut plan = py.detach(|| guard(|| layout.plan(&keys, v, l)))?;
        let ids = std::mem::take(&mut plan.ids).into_iter().map(|ids| PyArray1::from_vec(py, ids).unbind()).collect();
        let offsets = plan
            .offsets
            .iter()
            .map(|o| PyArray1::from_vec(py, o.iter().map(|&x| x as i64).collect::<Vec<i64>>()).unbind())
            .collect();
        Ok(PyPlan { layout: self.layout.clone(), plan, ids, offsets })
    }
}

/// One batch's plan: each table's unique IDs grouped by owning PS shard, and where every ID
/// occurrence goes. Read-only; `pool` and `scatter` may run from several threads.
#[pyclass(name = "PoolingPlan", module = "trillium_native", frozen)]
pub struct PyPlan {
    pub(crate) layout: Arc<Layout>,
    /// Its `ids` were moved into the numpy arrays of `ids`.
    plan: Plan,
    ids: Vec<Py<PyArray1<u64>>>,
    offsets: Vec<Py<PyArray1<i64>>>,
}

impl PyPlan {
    /// Number of unique IDs of table `t`.
    fn unique(&self, t: usize) -> usize {
        self.plan.offsets[t][self.layout.num_shards as usize]
    }

    // The Python-visible (pooled, [(values, mask)]) of `pool`, spelled out as the stub has it.
    #[allow(clippy::type_complexity)]
    fn pool_f32<'py>(
        &self,
        py: Python<'py>,
        rows: &[&[f32]],
    ) -> PyResult<(Bound<'py, PyArray2<f32>>, Vec<(Bound<'py, PyArray3<f32>>, Bound<'py, PyArray2<bool>>)>)> {
        let (layout, b) = (&*self.layout, self.plan.batch);
        // SAFETY: `Plan::pool` writes every element of the pooled output.
        let pooled = unsafe { PyArray2::<f32>::new(py, [b, layout.width], false) };
        let seqs: Vec<_> = layout
            .slots
            .iter()
            .filter_map(|s| match s.pooling {
                Pooling::Sequence { max_len } => Some((
                    PyArray3::<f32>::zeros(py, [b, max_len, s.dim], false),
                    PyArray2::<bool>::zeros(py, [b, max_len], false),
                )),
                _ => None,
            })
            .collect();
        // SAFETY: the arrays were just created, are C-contiguous and not shared yet.
        let p = unsafe { std::slice::from_raw_parts_mut(pooled.data(), b * layout.width) };
        let mut s: Vec<(&mut [f32], &mut [bool])> = seqs
            .iter()
            // SAFETY: as above.
            .map(|(v, m)| unsafe {
                (
                    std::slice::from_raw_parts_mut(v.data(), PyUntypedArrayMethods::len(v)),
                    std::slice::from_raw_parts_mut(m.data(), PyUntypedArrayMethods::len(m)),
                )
            })
            .collect();
        let plan = &self.plan;
        py.detach(|| {
            guard(|| {
                plan.pool(layout, rows, p, &mut s);
                Ok(())
            })
        })?;
        Ok((pooled, seqs))
    }
}

/// "`what` must have shape (a, b), got (c, d)", shapes written as Python tuples.
fn shape_err(what: &str, want: &[usize], got: &[usize]) -> PyErr {
    let tuple = |s: &[usize]| match s {
        [one] => format!("({one},)"),
        _ => format!("({})", s.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")),
    };
    PyValueError::new_err(format!("{what} must have shape {}, got {}", tuple(want), tuple(got)))
}

/// A float16 copy of a float32 array (round to nearest even), GIL released.
fn to_f16<'py, D: Dimension>(
    py: Python<'py>,
    a: &Bound<'py, PyArray<f32, D>>,
) -> PyResult<Bound<'py, PyArray<f16, D>>> {
    let ro = a.readonly();
    let src = ro.as_slice().map_err(|e| PyValueError::new_err(format!("array is not contiguous: {e}")))?;
    // SAFETY: every element is written below before the array is returned.
    let out = unsafe { PyArray::<f16, D>::new(py, a.dims(), false) };
    // SAFETY: the array was just created, is C-contiguous and not shared yet.
    let dst = unsafe { std::slice::from_raw_parts_mut(out.data(), src.len()) };
    py.detach(|| dst.convert_from_f32_slice(src));
    Ok(out)
}

#[pymethods]
impl PyPlan {
    #[getter]
    fn batch_size(&self) -> usize {
        self.plan.batch
    }

    /// Per table (`PoolingLayout.tables` order): its unique IDs, uint64, grouped by shard.
    #[getter]
    fn ids(&self, py: Python<'_>) -> Vec<Py<PyArray1<u64>>> {
        self.ids.iter().map(|a| a.clone_ref(py)).collect()
    }

    /// Per table: int64[num_shards + 1]; shard `s` owns `ids[t][o[s]:o[s + 1]]`.
    #[getter]
    fn shard_offsets(&self, py: Python<'_>) -> Vec<Py<PyArray1<i64>>> {
        self.offsets.iter().map(|a| a.clone_ref(py)).collect()
    }

    /// Pool the looked-up rows (per table, float32 `[len(ids[t]), dim]` in plan order) into
    /// `(pooled [B, width], [(values [B, max_len, dim], mask bool [B, max_len]) per sequence
    /// slot])`, in `out_dtype` (float32 or float16); GIL released.
    #[pyo3(signature = (rows, *, out_dtype="float32"))]
    fn pool<'py>(&self, py: Python<'py>, rows: Vec<Bound<'py, PyAny>>, out_dtype: &str) -> PyResult<Bound<'py, PyAny>> {
        let fp16 = match out_dtype {
            "float32" => false,
            "float16" => true,
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown out_dtype {other:?}: expected 'float32' or 'float16'"
                )))
            }
        };
        let layout = &*self.layout;
        if rows.len() != layout.tables.len() {
            return Err(PyValueError::new_err(format!(
                "rows must hold one array per table {:?}, got {}",
                self.tables_names(),
                rows.len()
            )));
        }
        let mut arrs = Vec::with_capacity(rows.len());
        for (t, (obj, (name, dim))) in rows.iter().zip(&layout.tables).enumerate() {
            let a = get_array::<f32, Ix2>(py, obj, &format!("rows of table {name:?}"), "float32", 2)?;
            if a.shape() != [self.unique(t), *dim] {
                return Err(shape_err(&format!("rows of table {name:?}"), &[self.unique(t), *dim], &a.shape()));
            }
            arrs.push(a);
        }
        let slices = arrs.iter().map(|a| a.slice()).collect::<PyResult<Vec<&[f32]>>>()?;
        let (pooled, seqs) = self.pool_f32(py, &slices)?;
        if fp16 {
            let seqs = seqs.iter().map(|(v, m)| Ok((to_f16(py, v)?, m.clone()))).collect::<PyResult<Vec<_>>>()?;
            Ok((to_f16(py, &pooled)?, seqs).into_pyobject(py)?.into_any())
        } else {
            Ok((pooled, seqs).into_pyobject(py)?.into_any())
        }
    }

    /// The gradient of `pool`'s output -> per table, float32 `[len(ids[t]), dim]` in plan
    /// order: each unique ID's gradient summed over its occurrences; GIL released.
    /// `pooled_grad`: float32 `[B, width]`, or one float32 `[B, dim]` per pooled slot (the
    /// same columns, apart); `sequence_grads`: one float32 `[B, max_len, dim]` per sequence slot.
    fn scatter<'py>(
        &self,
        py: Python<'py>,
        pooled_grad: &Bound<'py, PyAny>,
        sequence_grads: Vec<Bound<'py, PyAny>>,
    ) -> PyResult<Vec<Bound<'py, PyArray2<f32>>>> {
        let (layout, b) = (&*self.layout, self.plan.batch);
        let pooled_slots: Vec<&Slot> =
            layout.slots.iter().filter(|s| !matches!(s.pooling, Pooling::Sequence { .. })).collect();
        let seq_slots: Vec<(&Slot, usize)> = layout
            .slots
            .iter()
            .filter_map(|s| match s.pooling {
                Pooling::Sequence { max_len } => Some((s, max_len)),
                _ => None,
            })
            .collect();
        // The pooled gradient: one array (`joined`) or one per pooled slot (`apart`).
        let (joined, apart) = if pooled_grad.cast::<PyUntypedArray>().is_ok() {
            let a = get_array::<f32, Ix2>(py, pooled_grad, "pooled_grad", "float32", 2)?;
            if a.shape() != [b, layout.width] {
                return Err(shape_err("pooled_grad", &[b, layout.width], &a.shape()));
            }
            (Some(a), Vec::new())
        } else {
            let list: Vec<Bound<'py, PyAny>> = pooled_grad.extract().map_err(|_| {
                PyTypeError::new_err(format!(
                    "pooled_grad must be a numpy.ndarray or a sequence of them, got {}",
                    type_name(pooled_grad)
                ))
            })?;
            if list.len() != pooled_slots.len() {
                return Err(PyValueError::new_err(format!(
                    "pooled_grad must hold one array per pooled slot {:?}, got {}",
                    pooled_slots.iter().map(|s| &s.name).collect::<Vec<_>>(),
                    list.len()
                )));
            }
            let mut arrs = Vec::with_capacity(list.len());
            for (obj, slot) in list.iter().zip(&pooled_slots) {
                let what = format!("gradient of slot {:?}", slot.name);
                let a = get_array::<f32, Ix2>(py, obj, &what, "float32", 2)?;
                if a.shape() != [b, slot.dim] {
                    return Err(shape_err(&what, &[b, slot.dim], &a.shape()));
                }
                arrs.push(a);
            }
            (None, arrs)
        };
        if sequence_grads.len() != seq_slots.len() {
            return Err(PyValueError::new_err(format!(
                "sequence_grads must hold one array per sequence slot {:?}, got {}",
                seq_slots.iter().map(|(s, _)| &s.name).collect::<Vec<_>>(),
                sequence_grads.len()
            )));
        }
        let mut seqs = Vec::with_capacity(seq_slots.len());
        for (obj, (slot, max_len)) in sequence_grads.iter().zip(&seq_slots) {
            let what = format!("gradient of slot {:?}", slot.name);
            let a = get_array::<f32, Ix3>(py, obj, &what, "float32", 3)?;
            if a.shape() != [b, *max_len, slot.dim] {
                return Err(shape_err(&what, &[b, *max_len, slot.dim], &a.shape()));
            }
            seqs.push(a);
        }
        let mut grads = Vec::with_capacity(layout.slots.len());
        let (mut k, mut q) = (0, 0);
        for slot in &layout.slots {
            grads.push(match slot.pooling {
                Pooling::Sequence { max_len } => {
                    q += 1;
                    SlotGrad { data: seqs[q - 1].slice()?, stride: max_len * slot.dim, offset: 0 }
                }
                _ => match &joined {
                    Some(a) => SlotGrad { data: a.slice()?, stride: layout.width, offset: slot.out },
                    None => {
                        k += 1;
                        SlotGrad { data: apart[k - 1].slice()?, stride: slot.dim, offset: 0 }
                    }
                },
            });
        }
        let out: Vec<_> = (0..layout.tables.len())
            .map(|t| PyArray2::<f32>::zeros(py, [self.unique(t), layout.tables[t].1], false))
            .collect();
        // SAFETY: the arrays were just created, are C-contiguous and not shared yet.
        let mut o: Vec<&mut [f32]> = out
            .iter()
            .map(|a| unsafe { std::slice::from_raw_parts_mut(a.data(), PyUntypedArrayMethods::len(a)) })
            .collect();
        let plan = &self.plan;
        py.detach(|| {
            guard(|| {
                plan.scatter(layout, &grads, &mut o);
                Ok(())
            })
        })?;
        Ok(out)
    }
}

impl PyPlan {
    fn tables_names(&self) -> Vec<&str> {
        self.layout.tables.iter().map(|t| t.0.as_str()).collect()
    }
}
