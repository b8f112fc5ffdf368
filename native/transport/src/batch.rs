//! The part of a batch frame (`encode_batch` in `trillium/wire/codec.py`) an embedding worker
//! reads: the batch's identity and its IDs (`KeyedIds`), in place; the dense features and labels
//! are the NN rank's. Checked as codec.py's `decode_batch` checks them.

use std::borrow::Cow;

use rmpv::Value;

use crate::frame::{read_frame, FrameError};

/// Arrays a batch may carry after the four it always has (codec.py's `_BATCH_EXTRAS`).
const EXTRAS: [&str; 2] = ["sample_ids", "event_times"];

pub struct BatchIds<'a> {
    pub batch_id: i64,
    pub epoch: i32,
    pub rank: i32,
    pub keys: Vec<String>,
    /// Every ID, key-major.
    pub values: Cow<'a, [u64]>,
    /// `lengths[k * B + i]`: how many IDs sample `i` has under `keys[k]`.
    pub lengths: Cow<'a, [i32]>,
}

fn bad<T>(why: impl Into<String>) -> Result<T, FrameError> {
    Err(FrameError(why.into()))
}

fn index(meta: &crate::frame::Frame<'_>, name: &str) -> Result<i64, FrameError> {
    match meta.field(name).and_then(Value::as_i64) {
        Some(v) if v >= 0 => Ok(v),
        _ => bad(format!("invalid batch message: {name} must be a non-negative int, got {:?}", meta.field(name))),
    }
}

pub fn read_batch_ids(frame: &[u8]) -> Result<BatchIds<'_>, FrameError> {
    let f = read_frame(frame, "batch")?;
    let known = ["batch_id", "epoch", "rank", "keys", "extras", "complete_through"];
    let required = &known[..4];
    if required.iter().any(|n| f.field(n).is_none())
        || f.meta.iter().any(|(k, _)| !k.as_str().is_some_and(|k| known.contains(&k)))
    {
        let names: Vec<String> = f.meta.iter().map(|(k, _)| k.to_string()).collect();
        return bad(format!(
            "corrupt message: meta has {names:?}, expected {required:?} (and maybe extras, complete_through)"
        ));
    }
    let (batch_id, epoch, rank) = (index(&f, "batch_id")?, index(&f, "epoch")?, index(&f, "rank")?);
    let (Ok(epoch), Ok(rank)) = (i32::try_from(epoch), i32::try_from(rank)) else {
        return bad("invalid batch message: epoch and rank must fit 32 bits");
    };
    let extras = match f.field("extras") {
        None => 0,
        Some(Value::Array(names)) => {
            let mut seen: Vec<&str> = Vec::new();
            for n in names {
                match n.as_str() {
                    Some(n) if EXTRAS.contains(&n) && !seen.contains(&n) => seen.push(n),
                    _ => {
                        return bad(format!("corrupt batch message: extras must be some of {EXTRAS:?}, got {names:?}"))
                    }
                }
            }
            seen.len()
        }
        Some(other) => return bad(format!("corrupt batch message: extras must be some of {EXTRAS:?}, got {other}")),
    };
    if let Some(t) = f.field("complete_through") {
        if !t.is_f64() {
            return bad(format!("corrupt batch message: complete_through must be a float, got {t}"));
        }
    }
    let Some(Value::Array(keys)) = f.field("keys") else {
        return bad(format!("corrupt batch message: expected {} arrays and a list of keys", 4 + extras));
    };
    if f.arrays.len() != 4 + extras {
        return bad(format!("corrupt batch message: expected {} arrays and a list of keys", 4 + extras));
    }
    let keys: Vec<String> = keys
        .iter()
        .map(|k| k.as_str().filter(|k| !k.is_empty()).map(str::to_owned))
        .collect::<Option<_>>()
        .ok_or_else(|| FrameError(format!("invalid batch message: keys must be non-empty strings, got {keys:?}")))?;
    if keys.iter().enumerate().any(|(i, k)| keys[..i].contains(k)) {
        return bad(format!("invalid batch message: keys must be unique, got {keys:?}"));
    }
    let values = f.arrays[0].u64s("values")?;
    if f.arrays[1].shape.len() != 1 {
        return bad(format!("invalid batch message: lengths must be 1-D, got shape {:?}", f.arrays[1].shape));
    }
    let lengths = f.arrays[1].typed::<i32>("lengths")?;
    Ok(BatchIds { batch_id, epoch, rank, keys, values, lengths })
}
