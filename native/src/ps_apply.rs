//! A PS shard's gradient updates straight from the messages off Kafka (codec.py's
//! `encode_gradients` frames, as the embedding workers' planes write them), without Python: a
//! step's messages, in rank order, are one optimizer update per table, with every message's IDs
//! and gradients of that table in that order (duplicate IDs summed in that order). The frames
//! are checked as codec.py's `decode_gradients` checks them; fp16 gradients are widened once.

use std::borrow::Cow;

use half::f16;
use rmpv::Value;
use trillium_transport::frame::{read_frame, FrameError};

use crate::config::StoreError;
use crate::store::Store;
use crate::wire16::widen_scaled;

/// One gradient message's tables, IDs and gradient rows, in place (widened from fp16 if it was).
pub struct GradientFrame<'a> {
    pub tables: Vec<String>,
    pub counts: Vec<usize>,
    pub dims: Vec<usize>,
    pub ids: Cow<'a, [u64]>,
    pub grads: Cow<'a, [f32]>,
}

fn corrupt<T>(why: impl std::fmt::Display) -> Result<T, FrameError> {
    Err(FrameError(format!("corrupt gradients message: {why}")))
}

fn sizes(value: Option<&Value>, name: &str) -> Result<Vec<usize>, FrameError> {
    let Some(Value::Array(items)) = value else { return corrupt(format!("{name} must be a list")) };
    items
        .iter()
        .map(|v| {
            v.as_u64().map(|n| n as usize).ok_or_else(|| FrameError(format!("corrupt gradients message: {name} {v}")))
        })
        .collect()
}

pub fn read_gradients(frame: &[u8]) -> Result<GradientFrame<'_>, FrameError> {
    let f = read_frame(frame, "gradients")?;
    let Some(Value::Array(names)) = f.field("tables") else { return corrupt("tables must be a list") };
    let tables = names
        .iter()
        .map(|n| {
            n.as_str().map(str::to_owned).ok_or_else(|| FrameError(format!("corrupt gradients message: table {n}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let (counts, dims) = (sizes(f.field("counts"), "counts")?, sizes(f.field("dims"), "dims")?);
    if tables.len() != counts.len() || counts.len() != dims.len() || f.arrays.len() != 2 {
        return corrupt("expected tables, counts and dims of one length, and 2 arrays");
    }
    let ids = f.arrays[0].u64s("ids")?;
    let values = &f.arrays[1];
    if values.shape.len() != 1 {
        return corrupt(format!("gradients must be 1-dimensional, got shape {:?}", values.shape));
    }
    let grads = if values.dtype == "<f2" {
        let scale = f.field("scale").and_then(Value::as_f64).unwrap_or(1.0);
        if !(scale > 0.0 && scale.is_finite()) {
            return corrupt(format!("fp16 scale {scale}"));
        }
        let halves = values.typed::<f16>("gradients")?;
        let mut widened = vec![0f32; halves.len()];
        widen_scaled(&halves, (1.0 / scale) as f32, &mut widened);
        Cow::Owned(widened)
    } else {
        values.typed::<f32>("gradients")?
    };
    let rows: usize = counts.iter().sum();
    let values: usize = counts.iter().zip(&dims).map(|(n, d)| n * d).sum();
    if ids.len() != rows || grads.len() != values {
        return corrupt(format!(
            "{} ids and {} gradient values do not fit row counts {counts:?} of dims {dims:?}",
            ids.len(),
            grads.len()
        ));
    }
    Ok(GradientFrame { tables, counts, dims, ids, grads })
}

/// Apply a step's messages (in rank order): per table of the first, one update with every
/// message's rows of it. Returns the rows updated.
pub fn apply_step(store: &Store, frames: &[GradientFrame<'_>]) -> Result<u64, StoreError> {
    let Some(first) = frames.first() else { return Ok(0) };
    // Checked whole before any table is updated: a step is applied entirely or not at all.
    for f in frames {
        for name in &first.tables {
            if !f.tables.contains(name) {
                return Err(StoreError::Value(format!("a message of the step has no table {name:?}")));
            }
        }
        for (name, &dim) in f.tables.iter().zip(&f.dims) {
            let t = store.table(name)?;
            if t.cfg.dim != dim {
                return Err(StoreError::Value(format!("table {name:?} has dim {}, a message's {dim}", t.cfg.dim)));
            }
        }
    }
    // Where each message's rows of each table start.
    let starts: Vec<Vec<(usize, usize)>> = frames
        .iter()
        .map(|f| {
            let mut at = (0, 0);
            f.counts
                .iter()
                .zip(&f.dims)
                .map(|(n, d)| {
                    let here = at;
                    at = (at.0 + n, at.1 + n * d);
                    here
                })
                .collect()
        })
        .collect();
    let mut rows = 0;
    for name in &first.tables {
        let t = store.table(name)?;
        let dim = t.cfg.dim;
        let mut parts: Vec<(&[u64], &[f32])> = Vec::with_capacity(frames.len());
        for (f, starts) in frames.iter().zip(&starts) {
            let i = f.tables.iter().position(|n| n == name).expect("checked above");
            let (row, value) = starts[i];
            let n = f.counts[i];
            if n > 0 {
                parts.push((&f.ids[row..row + n], &f.grads[value..value + n * dim]));
            }
        }
        rows += match parts.as_slice() {
            [] => 0,
            [(ids, grads)] => store.update(&t, ids, grads),
            _ => {
                let ids: Vec<u64> = parts.iter().flat_map(|(i, _)| i.iter().copied()).collect();
                let grads: Vec<f32> = parts.iter().flat_map(|(_, g)| g.iter().copied()).collect();
                store.update(&t, &ids, &grads)
            }
        };
    }
    Ok(rows)
}
