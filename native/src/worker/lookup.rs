//! A batch's lookup: the bound, the plan, the masks, one request per owning PS shard (their IDs
//! written straight from the plan into the request's frame, all shards asked at once), the rows
//! widened into place as they come, and the pooling written straight into the answer's frames.

use std::sync::Arc;
use std::time::Instant;

use half::f16;
use half::slice::HalfFloatSliceExt;
use tonic::Status;
use trillium_transport::batch::read_batch_ids;
use trillium_transport::client::code_name;
use trillium_transport::frame::{read_array, ArrayWriter};
use trillium_transport::pb;

use super::{Held, Job, WorkerMetrics};
use crate::elem::widen_f16;
use crate::pooling::{Layout, Plan, Pooling};

fn ended(name: &str) -> Status {
    Status::unavailable(format!("{name}: the job ended while the lookup waited"))
}

pub(super) async fn lookup(
    name: &str,
    job: Arc<Job>,
    metrics: &WorkerMetrics,
    request: pb::BatchLookupRequest,
) -> Result<pb::BatchLookupResponse, Status> {
    let started = Instant::now();
    let batch = read_batch_ids(&request.batch).map_err(|e| Status::invalid_argument(e.0))?;
    let spec = &job.spec;
    let staleness = if request.training {
        let waited = Instant::now();
        let staleness = job.gate.within_bound(batch.batch_id / spec.nn_ranks).await.map_err(|_| ended(name))?;
        metrics.staleness_wait.observe(waited.elapsed().as_secs_f64());
        staleness
    } else {
        // Evaluation reads the tables as the steps before it left them, and changes nothing.
        job.gate.applied(request.applied).await.map_err(|_| ended(name))?;
        0
    };
    let plan = spec
        .layout
        .plan(&batch.keys, &batch.values, &batch.lengths)
        .map_err(|e| Status::invalid_argument(format!("batch {}: {e}", batch.batch_id)))?;
    // A training batch's forgotten IDs go to no shard: no lookup, no gradient.
    let kept = if request.training && spec.forgotten.masks_any(batch.batch_id) {
        masked(spec, &plan, batch.batch_id)
    } else {
        vec![None; plan.ids.len()]
    };
    let held = Held { plan, kept };
    // An evaluation's rows come as a model version serves them: the job's evaluation measures
    // what replicas answer.
    let row_fp16 = request.fp16 || (!request.training && spec.served_fp16);
    let rows = rows(&job, &held, !request.training, row_fp16).await?;
    let (pooled, slots) = pool(&spec.layout, &held.plan, &rows, request.fp16);
    let widths = spec
        .layout
        .slots
        .iter()
        .map(|s| if matches!(s.pooling, Pooling::Sequence { .. }) { 0 } else { s.dim as i32 })
        .collect();
    if request.training {
        job.hold(batch.rank, batch.batch_id, held);
    }
    metrics.lookup.observe(started.elapsed().as_secs_f64());
    Ok(pb::BatchLookupResponse {
        r#ref: Some(pb::EmbeddingRef {
            worker: name.to_owned(),
            rank: batch.rank,
            batch_id: batch.batch_id,
            epoch: batch.epoch,
            attempt: spec.attempt,
        }),
        slots,
        staleness,
        pooled: Some(array(pooled)),
        widths,
    })
}

fn array(data: bytes::Bytes) -> pb::Array {
    pb::Array { dtype: String::new(), shape: vec![], data }
}

/// Per table, the positions each shard is asked for with the masked IDs left out; None for a
/// table none of whose IDs is masked.
fn masked(spec: &super::JobSpec, plan: &Plan, batch_id: i64) -> Vec<Option<Vec<Vec<usize>>>> {
    let forgotten = &spec.forgotten;
    plan.ids
        .iter()
        .zip(&plan.offsets)
        .zip(&spec.layout.tables)
        .map(|((ids, off), (table, _))| {
            if !ids.iter().any(|&id| forgotten.masked(table, id, batch_id)) {
                return None;
            }
            let kept = off
                .windows(2)
                .map(|r| (r[0]..r[1]).filter(|&p| !forgotten.masked(table, ids[p], batch_id)).collect())
                .collect();
            Some(kept)
        })
        .collect()
}

/// Each table's rows for its unique IDs (float32, plan order; masked ones zeros), from every
/// owning shard at once.
async fn rows(job: &Job, held: &Held, evaluation: bool, fp16: bool) -> Result<Vec<Vec<f32>>, Status> {
    let layout = &job.spec.layout;
    let mut rows: Vec<Vec<f32>> =
        layout.tables.iter().zip(&held.plan.ids).map(|((_, dim), ids)| vec![0f32; ids.len() * dim]).collect();
    let mut asked = Vec::new();
    let mut calls = Vec::new();
    for (s, shard) in job.spec.shards.iter().enumerate() {
        let these: Vec<(usize, Vec<usize>)> = (0..layout.tables.len())
            .map(|t| (t, held.positions(t, s).into_owned()))
            .filter(|(_, positions)| !positions.is_empty())
            .collect();
        if these.is_empty() {
            continue;
        }
        let mut ids = ArrayWriter::<u64>::new(these.iter().map(|(_, p)| p.len()).sum());
        let mut at = 0;
        let out = ids.values();
        for (t, positions) in &these {
            for (o, &p) in out[at..at + positions.len()].iter_mut().zip(positions) {
                *o = held.plan.ids[*t][p];
            }
            at += positions.len();
        }
        let request = pb::ShardLookupRequest {
            tables: these.iter().map(|(t, _)| layout.tables[*t].0.clone()).collect(),
            counts: these.iter().map(|(_, p)| p.len() as i64).collect(),
            ids: Some(array(ids.finish())),
            row_dtype: if fp16 { "float16" } else { "float32" }.to_owned(),
            read_only: evaluation,
            job_id: job.spec.job_id.clone(),
            attempt: job.spec.attempt,
        };
        calls.push(shard.stream.call(request));
        asked.push((s, these));
    }
    let answers = futures_util::future::join_all(calls).await;
    for ((s, these), answer) in asked.into_iter().zip(answers) {
        let address = &job.spec.shards[s].address;
        let answer = answer.map_err(|e| {
            Status::unavailable(format!("embedding_ps-{s} at {address}: {}: {}", code_name(e.code()), e.message()))
        })?;
        let expected: Vec<i64> = these.iter().map(|(t, _)| layout.tables[*t].1 as i64).collect();
        if answer.dims != expected {
            return Err(Status::internal(format!(
                "embedding_ps-{s} answered rows of dims {:?} for tables of dims {expected:?}",
                answer.dims
            )));
        }
        let frame = answer.rows.map(|r| r.data).unwrap_or_default();
        let flat = read_array(&frame).map_err(|e| Status::internal(format!("embedding_ps-{s}'s rows: {e}")))?;
        let wanted: usize = these.iter().map(|(t, p)| p.len() * layout.tables[*t].1).sum();
        let mut start = 0;
        let mut place = |src: RowsOf<'_>| -> Result<(), Status> {
            if src.len() != wanted {
                return Err(Status::internal(format!("embedding_ps-{s} answered {} values, not {wanted}", src.len())));
            }
            for (t, positions) in &these {
                let dim = layout.tables[*t].1;
                for &p in positions {
                    src.widen(start, &mut rows[*t][p * dim..(p + 1) * dim]);
                    start += dim;
                }
            }
            Ok(())
        };
        let bad = |e: trillium_transport::frame::FrameError| Status::internal(format!("embedding_ps-{s}'s rows: {e}"));
        if flat.dtype == "<f2" {
            place(RowsOf::F16(&flat.typed::<f16>("rows").map_err(bad)?))?;
        } else {
            place(RowsOf::F32(&flat.typed::<f32>("rows").map_err(bad)?))?;
        }
    }
    Ok(rows)
}

/// A shard's rows as they came.
enum RowsOf<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
}

impl RowsOf<'_> {
    fn len(&self) -> usize {
        match self {
            RowsOf::F32(v) => v.len(),
            RowsOf::F16(v) => v.len(),
        }
    }

    fn widen(&self, at: usize, dst: &mut [f32]) {
        match self {
            RowsOf::F32(v) => dst.copy_from_slice(&v[at..at + dst.len()]),
            RowsOf::F16(v) => widen_f16(&v[at..at + dst.len()], dst),
        }
    }
}

/// The pooled slots side by side (`[B, width]`) and each sequence slot's values and mask, as
/// frames of float32, or float16 with `fp16`.
fn pool(layout: &Layout, plan: &Plan, rows: &[Vec<f32>], fp16: bool) -> (bytes::Bytes, Vec<pb::SlotEmbedding>) {
    let b = plan.batch as u64;
    let rows: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
    let sequences: Vec<(&str, u64, u64)> = layout
        .slots
        .iter()
        .filter_map(|s| match s.pooling {
            Pooling::Sequence { max_len } => Some((s.name.as_str(), max_len as u64, s.dim as u64)),
            _ => None,
        })
        .collect();
    let mut masks: Vec<ArrayWriter<bool>> =
        sequences.iter().map(|&(_, l, _)| ArrayWriter::with_shape(vec![b, l])).collect();
    let (pooled, values) = if fp16 {
        // Pooled in float32 (its sums), then narrowed once into the frames.
        let mut pooled = vec![0f32; plan.batch * layout.width];
        let mut values: Vec<Vec<f32>> = sequences.iter().map(|&(_, l, d)| vec![0f32; (b * l * d) as usize]).collect();
        {
            let mut seqs: Vec<(&mut [f32], &mut [bool])> =
                values.iter_mut().zip(masks.iter_mut()).map(|(v, m)| (v.as_mut_slice(), m.values())).collect();
            plan.pool(layout, &rows, &mut pooled, &mut seqs);
        }
        let narrow = |src: &[f32], shape: Vec<u64>| {
            let mut out = ArrayWriter::<f16>::with_shape(shape);
            out.values().convert_from_f32_slice(src);
            out.finish()
        };
        let values: Vec<bytes::Bytes> =
            values.iter().zip(&sequences).map(|(v, &(_, l, d))| narrow(v, vec![b, l, d])).collect();
        (narrow(&pooled, vec![b, layout.width as u64]), values)
    } else {
        let mut pooled = ArrayWriter::<f32>::with_shape(vec![b, layout.width as u64]);
        let mut values: Vec<ArrayWriter<f32>> =
            sequences.iter().map(|&(_, l, d)| ArrayWriter::with_shape(vec![b, l, d])).collect();
        {
            let mut seqs: Vec<(&mut [f32], &mut [bool])> =
                values.iter_mut().zip(masks.iter_mut()).map(|(v, m)| (v.values(), m.values())).collect();
            plan.pool(layout, &rows, pooled.values(), &mut seqs);
        }
        (pooled.finish(), values.into_iter().map(ArrayWriter::finish).collect())
    };
    let slots = sequences
        .iter()
        .zip(values)
        .zip(masks)
        .map(|((&(name, _, _), values), mask)| pb::SlotEmbedding {
            slot: name.to_owned(),
            values: Some(array(values)),
            mask: Some(array(mask.finish())),
        })
        .collect();
    (pooled, slots)
}
