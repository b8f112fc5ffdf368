//! A rank's gradient push: the gradients of its lookup's embeddings, widened and scattered to one
//! summed gradient per unique ID (`Plan::scatter`), held until every rank the worker serves has
//! pushed the step; then one frame per PS shard with every rank's gradients of the step, in rank
//! order (codec.py's `encode_gradients`: all tables in two arrays, fp16 scaled when the job says
//! so) — empty ones too: they advance that shard's watermark, and at a publish cut carry the cut
//! to it in step order. The service produces them and says when they are durable; each of the
//! step's pushes is answered then, with the messages sent or why not.

use std::collections::BTreeMap;
use std::time::Instant;

use half::f16;
use rmpv::Value;
use tokio::sync::watch;
use tonic::Status;
use trillium_transport::frame::{read_array, ArraySpec, FrameWriter};
use trillium_transport::pb;
use trillium_transport::worker::Answer;

use super::{JobSpec, StepFrames, StepGradients, WorkerCore};
use crate::pooling::{Layout, Plan, Pooling, SlotGrad};
use crate::wire16::{narrow_scaled, scale_for, widen_scaled};

/// How a ref reads in an error: as the Python services wrote it (`trillium.wire.batch.EmbeddingRef`).
fn describe(r: &pb::EmbeddingRef) -> String {
    format!(
        "EmbeddingRef(worker='{}', rank={}, batch_id={}, epoch={}, attempt={})",
        r.worker, r.rank, r.batch_id, r.epoch, r.attempt
    )
}

pub(super) fn push(
    core: &WorkerCore,
    request: pb::PushGradientsRequest,
) -> Result<Answer<pb::PushGradientsResponse>, Status> {
    let started = Instant::now();
    let Some(r) = request.r#ref.clone() else {
        return Err(Status::invalid_argument("a push must name the embeddings it is the gradient of (ref)"));
    };
    let job = core.job_for(r.attempt)?;
    let spec = &job.spec;
    if !spec.ranks.contains(&r.rank) {
        return Err(Status::failed_precondition(format!(
            "{} takes the gradients of ranks {:?}, not of rank {}",
            core.name, spec.ranks, r.rank
        )));
    }
    let Some(held) = job.take(r.rank, r.batch_id) else {
        return Err(Status::not_found(format!("no embeddings handed out for {}", describe(&r))));
    };
    let grads = scatter(&spec.layout, &held.plan, &request)
        .map_err(|e| Status::invalid_argument(format!("bad gradients for {}: {e}", describe(&r))))?;
    let step_id = r.batch_id / spec.nn_ranks;
    let (mut answer, complete) = {
        let mut steps = job.steps.lock().unwrap_or_else(|e| e.into_inner());
        let step = steps.entry(step_id).or_insert_with(|| StepGradients {
            epoch: r.epoch,
            publish: false,
            ranks: BTreeMap::new(),
            sent: watch::Sender::new(None),
        });
        step.ranks.insert(r.rank, (held, grads));
        step.publish |= request.publish;
        let answer = step.sent.subscribe();
        let complete = if step.ranks.len() == spec.ranks.len() { steps.remove(&step_id) } else { None };
        (answer, complete)
    };
    if let Some(step) = complete {
        let frames = (0..spec.shards.len()).map(|s| frame(spec, step_id, &step, s)).collect();
        let key_rank = *step.ranks.keys().next().expect("a complete step has ranks");
        // Waited on before the service can say it is durable.
        job.sending.lock().unwrap_or_else(|e| e.into_inner()).insert(step_id, step.sent);
        (core.on_step)(StepFrames {
            attempt: spec.attempt,
            step: step_id,
            epoch: step.epoch,
            publish: step.publish,
            key_rank,
            frames,
        });
    }
    let metrics = core.metrics.clone();
    Ok(Box::pin(async move {
        let outcome = match answer.wait_for(Option::is_some).await {
            Ok(outcome) => outcome.clone().expect("waited for it"),
            Err(_) => Err("the job ended before the step's gradients were sent".to_string()),
        };
        let messages =
            outcome.map_err(|e| Status::unavailable(format!("the gradients of step {step_id} were not sent: {e}")))?;
        metrics.push.observe(started.elapsed().as_secs_f64());
        Ok(pb::PushGradientsResponse { messages })
    }))
}

/// Per table, the gradient of each unique ID (`[U_t, dim]`, plan order), from the push's
/// gradients of the lookup's embeddings: the pooled slots' as one `[B, width]` array (float32, or
/// float16 scaled by `pooled_scale`), each sequence slot's `[B, max_len, dim]` float32.
fn scatter(layout: &Layout, plan: &Plan, request: &pb::PushGradientsRequest) -> Result<Vec<Vec<f32>>, String> {
    let b = plan.batch;
    let data = request.pooled.as_ref().map(|a| a.data.clone()).unwrap_or_default();
    let pooled = read_array(&data).map_err(|e| format!("pooled: {e}"))?;
    if pooled.shape != [b as u64, layout.width as u64] {
        return Err(format!("pooled: expected shape [{b}, {}], got {:?}", layout.width, pooled.shape));
    }
    let pooled: Vec<f32> = if pooled.dtype == "<f2" {
        let scale = if request.pooled_scale == 0.0 { 1.0 } else { request.pooled_scale };
        if !(scale > 0.0 && scale.is_finite()) {
            return Err(format!("pooled_scale must be a positive finite number, got {scale}"));
        }
        let halves = pooled.typed::<f16>("pooled").map_err(|e| e.0)?;
        let mut out = vec![0f32; halves.len()];
        widen_scaled(&halves, (1.0 / scale) as f32, &mut out);
        out
    } else {
        pooled.typed::<f32>("pooled").map_err(|e| e.0)?.into_owned()
    };
    let sequence_slots: Vec<_> =
        layout.slots.iter().filter(|s| matches!(s.pooling, Pooling::Sequence { .. })).collect();
    if request.slots.len() != sequence_slots.len() {
        return Err(format!(
            "expected a gradient per sequence slot {:?}, got {}",
            sequence_slots.iter().map(|s| &s.name).collect::<Vec<_>>(),
            request.slots.len()
        ));
    }
    let mut sequences = Vec::with_capacity(sequence_slots.len());
    for (slot, given) in sequence_slots.iter().zip(&request.slots) {
        let Pooling::Sequence { max_len } = slot.pooling else { unreachable!("a sequence slot") };
        let data = given.grad.as_ref().map(|a| a.data.clone()).unwrap_or_default();
        let what = format!("gradient of slot {:?}", slot.name);
        let grad = read_array(&data).map_err(|e| format!("{what}: {e}"))?;
        if grad.shape != [b as u64, max_len as u64, slot.dim as u64] {
            return Err(format!("{what}: expected shape [{b}, {max_len}, {}], got {:?}", slot.dim, grad.shape));
        }
        sequences.push(grad.typed::<f32>(&what).map_err(|e| e.0)?.into_owned());
    }
    let mut next = sequences.iter();
    let grads: Vec<SlotGrad> = layout
        .slots
        .iter()
        .map(|slot| match slot.pooling {
            Pooling::Sequence { max_len } => {
                SlotGrad { data: next.next().expect("counted above"), stride: max_len * slot.dim, offset: 0 }
            }
            _ => SlotGrad { data: &pooled, stride: layout.width, offset: slot.out },
        })
        .collect();
    let mut out: Vec<Vec<f32>> =
        layout.tables.iter().zip(&plan.ids).map(|((_, d), ids)| vec![0f32; ids.len() * d]).collect();
    let mut views: Vec<&mut [f32]> = out.iter_mut().map(Vec::as_mut_slice).collect();
    plan.scatter(layout, &grads, &mut views);
    Ok(out)
}

/// Shard `s`'s gradients of the step: every table, every rank's, in rank order.
fn frame(spec: &JobSpec, step_id: i64, step: &StepGradients, s: usize) -> bytes::Bytes {
    let layout = &spec.layout;
    let mut ids: Vec<u64> = Vec::new();
    let mut grads: Vec<f32> = Vec::new();
    let mut counts = Vec::with_capacity(layout.tables.len());
    for (t, (_, dim)) in layout.tables.iter().enumerate() {
        let before = ids.len();
        for (held, rank_grads) in step.ranks.values() {
            for &p in held.positions(t, s).iter() {
                ids.push(held.plan.ids[t][p]);
                grads.extend_from_slice(&rank_grads[t][p * dim..(p + 1) * dim]);
            }
        }
        counts.push(Value::from((ids.len() - before) as u64));
    }
    let scale = spec.gradients_fp16.then(|| scale_for(&grads).unwrap_or(1.0));
    let mut meta = vec![
        (Value::from("ranks"), Value::Array(step.ranks.keys().map(|&r| Value::from(r)).collect())),
        (Value::from("step"), Value::from(step_id)),
        (Value::from("epoch"), Value::from(step.epoch)),
        (Value::from("shard"), Value::from(s as u64)),
        (Value::from("tables"), Value::Array(layout.tables.iter().map(|(n, _)| Value::from(n.as_str())).collect())),
        (Value::from("counts"), Value::Array(counts)),
        (Value::from("dims"), Value::Array(layout.tables.iter().map(|(_, d)| Value::from(*d as u64)).collect())),
    ];
    if let Some(scale) = scale {
        meta.push((Value::from("scale"), Value::F64(scale as f64)));
    }
    let values = if scale.is_some() {
        ArraySpec::of::<f16>(vec![grads.len() as u64])
    } else {
        ArraySpec::of::<f32>(vec![grads.len() as u64])
    };
    let mut frame =
        FrameWriter::new("gradients", Value::Map(meta), &[ArraySpec::of::<u64>(vec![ids.len() as u64]), values]);
    frame.values::<u64>(0).copy_from_slice(&ids);
    match scale {
        Some(scale) => narrow_scaled(&grads, scale, frame.values::<f16>(1)),
        None => frame.values::<f32>(1).copy_from_slice(&grads),
    }
    frame.finish()
}
