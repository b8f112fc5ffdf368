"""The coordinator's REST admin API under /v1: jobs and their control (resharding included), live
staleness, embedding tables and checkpoints, models and forgets, behind an operator's token
(trillium.scopes). The workers' own routes are registry_api.py's."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import yaml
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, Field

from trillium.job import JobConfig
from trillium.job.record import ACTIVE, IllegalTransition, JobRecord
from trillium.job.trust import PathRoots, check_model_module
from trillium.runtime.forget import ForgetReceipt
from trillium.runtime.progress import JobProgress
from trillium.wire import state

from .bodies import bounded, errors
from .checkpoints import CheckpointInfo
from .forget import ForgetRequest
from .jobs import CheckpointRequested, JobNotFound
from .lifecycle import lost_workers
from .observe import (
    ProgressiveView,
    StreamView,
    TablesUnavailable,
    TablesView,
    job_tables,
    progressive_view,
    stream_view,
)
from .parts import CoordinatorParts as Coordinator
from .registry import unreachable
from .reshard import request_reshard

YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml")


# ---- models ------------------------------------------------------------------------------------


class JobProgressView(BaseModel):
    samples: int
    steps: int
    epoch: int
    samples_per_sec: float = Field(description="mean over the job's running time")
    recent_samples_per_sec: float | None = Field(
        description="over the last few seconds (0 while paused); null when not measured"
    )
    mean_loss: float | None
    last_loss: float | None


class StalenessView(BaseModel):
    bound: int | None
    max: int
    mean: float
    count: int
    histogram: list[int] = Field(description="lookups by staleness 0, 1, ..., 15 and 16 or more")


class AutoBoundView(BaseModel):
    bound: int = Field(description="the bound chosen")
    wait_ms: float = Field(description="a step's wait for its embeddings at k = 0 (the slowest rank's)")
    step_ms: float = Field(description="a step's own time: forward, backward, the dense all-reduce")
    steps: int = Field(description="the steps measured")
    reason: str
    refinements: list[dict[str, float]] = Field(
        default_factory=list,
        description="each check at the bound set that found a wait left and raised it: the bound, the wait "
        "and the step it measured, over how many steps",
    )


class JobView(BaseModel):
    job: JobRecord = Field(
        description="the record: state, config, timestamps, error, and the last "
        "evaluation metrics (`metrics`) once finished"
    )
    progress: JobProgressView
    staleness: dict[int, StalenessView]  # per NN rank
    auto_bound: AutoBoundView | None = Field(
        None,
        description="`staleness_bound: auto`: the bound chosen from the job's own timings, and why "
        "(null while it calibrates at k = 0, and for a job with a bound of its own)",
    )
    results: dict[int, dict[str, Any]]  # per NN rank, once it is done: samples, steps, loss curve, eval
    ledgers: dict[int, dict[int, dict[str, Any]]] = Field(
        default_factory=dict,
        description="per attempt, per PS shard: the gradient ledger of its state as of its last applied step "
        "(trillium.runtime.ledger: which (step, rank) it holds, applied by which attempt, and any applied twice); "
        "the job's current attempt's are the model's",
    )
    lost_workers: list[str] = Field(description="workers of this active job not heard from in time")
    waiting_for: list[str] = Field(
        default_factory=list,
        description="what the active job waits for: each lost worker and since when it is unreachable "
        "(its last heartbeat), e.g. 'embedding_ps-1 unreachable since 2026-11-29T00:51:02Z (no heartbeat for 42 s)'",
    )
    last_checkpoint: CheckpointInfo | None = Field(description="the newest complete checkpoint")
    checkpoint_in_progress: bool
    ps_shards: int = Field(description="the PS shards the job runs on now (`job.reshards`: its live changes)")
    reshard_in_progress: bool = Field(
        description="a reshard asked for and not yet running on its new shards (its checkpoint, then `recovering`)"
    )
    publish_failures: list[str] = Field(
        default_factory=list,
        description="model versions abandoned (the latest), and why; `job.published` is the newest",
    )
    progressive: ProgressiveView
    stream: StreamView | None = Field(
        description="a stream's input (data.source: kafka): lag per partition, dead letters, the joiner's counts"
    )


class ModelEntry(BaseModel):
    """A published model, as the registry has it: serving replicas find its versions there."""

    model: str
    dir: str = Field(description="the model store its versions are in")
    topic: str = Field(description="where its versions are announced")
    version: int = Field(description="the newest version")
    job_id: str = Field(description="the job that published it")
    updated_at: float


class SeriesPoint(BaseModel):
    time: float
    samples: int
    auc: float | None = Field(description="the rolling progressive AUC then")
    loss: float | None = Field(description="the latest step's mean loss then")


class StopRequest(BaseModel):
    checkpoint: bool = Field(True, description="take a final checkpoint at the step the job stops at")


class ResumeRequest(BaseModel):
    checkpoint: Annotated[int, Field(ge=0)] | None = Field(
        None,
        description="a stopped or failed job: the step of the checkpoint to resume from (default: the "
        "newest); a paused job takes none",
    )


class ReshardRequest(BaseModel):
    ps_shards: Annotated[int, Field(ge=1, le=64)] = Field(
        description="the PS shards the job goes on with: embedding_ps-0..N-1, which the stack must run"
    )


class StalenessReport(BaseModel):
    job_id: str
    bound: int | None = Field(description="the live bound; null: unbounded")
    ranks: dict[int, StalenessView]  # observed per NN rank since the job started


class StalenessUpdate(BaseModel):
    bound: Annotated[int, Field(ge=0, le=(1 << 31) - 1)] | None = Field(
        description="0: synchronous; k: up to k steps of gradients not yet applied; null: unbounded"
    )


def _parsed(value: Any) -> Any:
    """FastAPI decodes only JSON bodies: a YAML one reaches the model as bytes."""
    if isinstance(value, bytes):
        try:
            value = yaml.safe_load(value)
        except (yaml.YAMLError, RecursionError, UnicodeDecodeError) as err:
            raise ValueError(f"invalid YAML: {err}") from None
    return bounded(value)


JobConfigBody = Annotated[JobConfig, BeforeValidator(_parsed)]


def _absolute_data_paths(config: JobConfig) -> None:
    # Files are opened by the data loader, wherever it runs: a path relative to the
    # client's directory would mean nothing there.
    for field in ("train", "test"):
        paths = getattr(config.data, field, None)
        for i, path in enumerate(paths if isinstance(paths, list) else [paths] if paths is not None else []):
            if not path.is_absolute():
                where = ("body", "data", field, i) if isinstance(paths, list) else ("body", "data", field)
                raise RequestValidationError(
                    [
                        {
                            "type": "value_error",
                            "loc": where,
                            "input": str(path),
                            "msg": "data paths sent to the API must be absolute",
                        }
                    ]
                )


def _trusted(config: JobConfig, roots: PathRoots) -> None:
    """422 for model code or a location the operator does not allow (trillium.job.trust)."""
    errors = [
        {"type": "value_error", "loc": ("body", *where), "input": location, "msg": why}
        for where, location, why in roots.refusals(config)
    ]
    try:
        check_model_module(config.model.cls)
    except ValueError as err:
        errors.append(
            {"type": "value_error", "loc": ("body", "model", "cls"), "input": config.model.cls, "msg": str(err)}
        )
    if errors:
        raise RequestValidationError(errors)


async def _job_media_type(request: Request) -> None:
    media = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if media not in ("application/json", *YAML_TYPES):
        raise HTTPException(
            status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, f"send a job as application/json or application/yaml, not {media}"
        )


# ---- routes ------------------------------------------------------------------------------------


def add_api(app: FastAPI, coord: Coordinator) -> None:
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(coord.requires("operate"))], responses=errors(401, 413))

    # ---- models
    @v1.get("/models", response_model=list[ModelEntry], tags=["models"])
    async def list_models() -> list[ModelEntry]:
        """Every model the stack's jobs have published: where its versions are, the newest, its job.
        Predictions come from the serving replicas (`trillium status` lists them)."""
        entries = await coord.redis.hgetall(state.MODELS)
        return [ModelEntry(model=name, **json.loads(entry)) for name, entry in sorted(entries.items())]

    # ---- jobs
    @v1.post(
        "/jobs",
        response_model=JobRecord,
        status_code=status.HTTP_201_CREATED,
        tags=["jobs"],
        dependencies=[Depends(_job_media_type)],
        responses=errors(409, 415),
    )
    async def submit_job(config: JobConfigBody) -> JobRecord:
        """Submit a job: the job file's schema, as JSON or YAML (`Content-Type:
        application/yaml`). Data paths must be absolute. 409 while another job is active."""
        _absolute_data_paths(config)
        _trusted(config, PathRoots.from_env(coord.settings.run_dir))
        return await coord.jobs.create(config)

    @v1.get("/jobs", response_model=list[JobRecord], tags=["jobs"])
    async def list_jobs() -> list[JobRecord]:
        """Every job not deleted, oldest first."""
        return await coord.jobs.all()

    @v1.get("/jobs/{job_id}", response_model=JobView, tags=["jobs"], responses=errors(404))
    async def get_job(job_id: str) -> JobView:
        """A job's state and progress: samples, steps, epoch, samples/s, loss, staleness per
        rank, per-rank results and evaluation metrics once done, lost workers."""
        return await job_view(coord, await coord.jobs.require(job_id))

    @v1.delete("/jobs/{job_id}", status_code=status.HTTP_204_NO_CONTENT, tags=["jobs"], responses=errors(404, 409))
    async def delete_job(job_id: str) -> None:
        """Forget a finished, failed or stopped job and all its state in Redis."""
        await coord.jobs.delete(job_id)

    @v1.post("/jobs/{job_id}/pause", response_model=JobRecord, tags=["job control"], responses=errors(404, 409))
    async def pause_job(job_id: str) -> JobRecord:
        """Pause a running job: the NN ranks stop before their next step (within a heartbeat)."""
        return await coord.jobs.transition(job_id, "paused", expect=frozenset({"running"}))

    @v1.post("/jobs/{job_id}/resume", response_model=JobRecord, tags=["job control"], responses=errors(404, 409))
    async def resume_job(job_id: str, body: ResumeRequest | None = None) -> JobRecord:
        """Resume a paused job; or a stopped or failed one from a checkpoint (the newest, or the
        one at `checkpoint`): a new attempt restores it and goes on (`recovering`, then `running`)."""
        job = await coord.jobs.require(job_id)
        if job.state in ("stopped", "failed"):
            return await coord.jobs.resume(job_id, body.checkpoint if body else None)
        if body is not None and body.checkpoint is not None:
            raise IllegalTransition(
                f"job {job_id} is {job.state}: only a stopped or failed job resumes from a checkpoint"
            )
        return await coord.jobs.transition(job_id, "running", expect=frozenset({"paused"}))

    @v1.post(
        "/jobs/{job_id}/stop",
        response_model=JobRecord,
        status_code=status.HTTP_202_ACCEPTED,
        tags=["job control"],
        responses=errors(404, 409),
    )
    async def stop_job(job_id: str, body: StopRequest | None = None) -> JobRecord:
        """Stop an active job: it is `stopping` until every worker has ended its part, then `stopped`.
        By default (`{"checkpoint": true}`) a running or paused job that takes checkpoints first takes
        a final one at the step it stops at, and goes `stopping` once it is written: `resume` goes on
        from there with nothing retrained. `{"checkpoint": false}` stops at once."""
        return await coord.jobs.request_stop(job_id, checkpoint=(body or StopRequest()).checkpoint)

    @v1.post(
        "/jobs/{job_id}/reshard",
        response_model=JobRecord,
        status_code=status.HTTP_202_ACCEPTED,
        tags=["job control"],
        responses=errors(404, 409),
    )
    async def reshard_job(job_id: str, body: ReshardRequest) -> JobRecord:
        """Move a running job onto `ps_shards` PS shards, live: the ranks stop at a cut, a checkpoint is
        taken there, and a new attempt restores it resharded onto the new shards (`recovering`, then
        `running`), nothing trained twice or lost. The job's `reshards` says how it went. 409 when the
        job is not running, takes no checkpoints, is stopping or already resharding, already has that
        many shards, or the stack does not run embedding_ps-0..N-1."""
        return await request_reshard(coord.jobs, coord.registry, job_id, body.ps_shards)

    # ---- forgetting
    @v1.post("/jobs/{job_id}/forget", response_model=ForgetReceipt, tags=["forget"], responses=errors(404, 409, 422))
    async def forget(job_id: str, body: ForgetRequest) -> ForgetReceipt:
        """Remove IDs (a user's, under the GDPR's Art. 17) from everything of the job that holds them:
        the live PS shards, every checkpoint, every version of its model and the replicas serving it,
        and, masked, the batches its later attempts replay; and from every job linked to it (warm-started
        from it, or publishing its model), each a forget of its own whose receipt this one names in
        `linked`. Returns the receipt (every place checked, the rows removed there), also kept as an
        audit record. 409 unless the job and those linked are stopped, failed or finished; 422 for a
        table the job lacks."""
        return await coord.forgetter.forget(job_id, body)

    @v1.get("/forgets", response_model=list[ForgetReceipt], tags=["forget"])
    async def forget_receipts(job_id: str | None = None) -> list[ForgetReceipt]:
        """The receipts of every forget (or of one job's: `?job_id=`), oldest first: audit records,
        kept after their job is deleted."""
        return await coord.forgetter.receipts(job_id)

    # ---- staleness
    @v1.get("/jobs/{job_id}/staleness", response_model=StalenessReport, tags=["staleness"], responses=errors(404))
    async def get_staleness(job_id: str) -> StalenessReport:
        """The live staleness bound and the staleness observed per NN rank (max, mean, histogram)."""
        return await staleness_report(coord, await coord.jobs.require(job_id))

    @v1.put("/jobs/{job_id}/staleness", response_model=StalenessReport, tags=["staleness"], responses=errors(404, 409))
    @v1.patch(
        "/jobs/{job_id}/staleness", response_model=StalenessReport, tags=["staleness"], responses=errors(404, 409)
    )
    async def set_staleness(job_id: str, update: StalenessUpdate) -> StalenessReport:
        """Change the bound of an active job, live: the embedding workers apply it to their next lookup."""
        job = await coord.jobs.require(job_id)
        if job.state not in ACTIVE - {"stopping"}:
            raise IllegalTransition(f"job {job_id} is {job.state}; its staleness bound can no longer change")
        await JobProgress(coord.redis, job_id).set_bound(update.bound)
        return await staleness_report(coord, job)

    # ---- tables and checkpoints
    @v1.get("/jobs/{job_id}/tables", response_model=TablesView, tags=["tables"], responses=errors(404, 409, 503))
    async def get_tables(job_id: str) -> TablesView:
        """Per embedding table: rows, memory, admitted/evicted/expired rows, summed over the
        PS shards (and per shard), asked of each shard now. Only the current job's tables are held."""
        return await job_tables(
            coord.registry, await coord.jobs.require(job_id), await coord.jobs.current(), coord.settings.grpc
        )

    @v1.get(
        "/jobs/{job_id}/checkpoints", response_model=list[CheckpointInfo], tags=["checkpoints"], responses=errors(404)
    )
    async def list_checkpoints(job_id: str) -> list[CheckpointInfo]:
        """A job's complete checkpoints, oldest first: step, epoch, size, seconds to write, how
        long training held for the cut, the Kafka positions, and test metrics when taken."""
        return await coord.checkpointer.list(await coord.jobs.require(job_id))

    @v1.post(
        "/jobs/{job_id}/checkpoints",
        response_model=CheckpointRequested,
        status_code=status.HTTP_202_ACCEPTED,
        tags=["checkpoints"],
        responses=errors(404, 409),
    )
    async def request_checkpoint(job_id: str) -> CheckpointRequested:
        """Ask for a checkpoint of a running or paused job: the NN ranks cut after the step on
        which they agree on it (within about a heartbeat); it is listed once its manifest is written."""
        return await coord.jobs.request_checkpoint(job_id)

    @v1.get("/jobs/{job_id}/series", response_model=list[SeriesPoint], tags=["jobs"], responses=errors(404))
    async def get_series(job_id: str) -> list[SeriesPoint]:
        """The job's series for plots: samples, rolling AUC, loss; a point a second while it trains,
        the older ones thinned to span the whole job in a bounded number of points."""
        job = await coord.jobs.require(job_id)
        return [
            SeriesPoint(time=t, samples=n, auc=auc, loss=loss)
            for t, n, auc, loss in await JobProgress(coord.redis, job.id).series()
        ]

    @v1.delete(
        "/jobs/{job_id}/checkpoints/{step}",
        status_code=status.HTTP_204_NO_CONTENT,
        tags=["checkpoints"],
        responses=errors(404, 409),
    )
    async def delete_checkpoint(job_id: str, step: int) -> None:
        """Delete one checkpoint of a job (complete or not); 409 while another checkpoint's delta
        is loaded on top of it."""
        if not await coord.checkpointer.delete(await coord.jobs.require(job_id), step):
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} has no checkpoint at step {step}")

    app.include_router(v1)
    _error_handlers(app)
    _yaml_in_openapi(app)


def _error_handlers(app: FastAPI) -> None:
    """The domain's errors as HTTP answers, with their message as the detail."""

    async def answer(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, JobNotFound):
            code = status.HTTP_404_NOT_FOUND
        elif isinstance(exc, TablesUnavailable) and not exc.conflict:
            code = status.HTTP_503_SERVICE_UNAVAILABLE
        else:  # IllegalTransition, or tables that are not the job's
            code = status.HTTP_409_CONFLICT
        return JSONResponse({"detail": str(exc)}, status_code=code)

    for error in (JobNotFound, IllegalTransition, TablesUnavailable):
        app.add_exception_handler(error, answer)


def _yaml_in_openapi(app: FastAPI) -> None:
    """Document that POST /v1/jobs takes YAML too, with the same schema as its JSON."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        fresh = app.openapi_schema is None
        schema = generate()
        if fresh:
            content = schema["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]
            for media in YAML_TYPES:
                content[media] = content["application/json"]
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


# ---- views -------------------------------------------------------------------------------------


async def staleness_report(coord: Coordinator, job: JobRecord) -> StalenessReport:
    progress = JobProgress(coord.redis, job.id)
    stats = await progress.staleness(job.config.topology.nn_ranks)
    return StalenessReport(
        job_id=job.id, bound=await progress.bound(), ranks={r: StalenessView(**s.as_dict()) for r, s in stats.items()}
    )


async def job_view(coord: Coordinator, job: JobRecord) -> JobView:
    progress = JobProgress(coord.redis, job.id)
    ranks = job.config.topology.nn_ranks
    training = await progress.training(ranks)
    elapsed = (job.finished_at or time.time()) - job.started_at if job.started_at else 0.0
    nan_to_none = lambda x: None if x != x else x  # noqa: E731 (JSON has no NaN)
    lost = await lost_workers(coord.registry, job)
    workers = {w.name: w for w in await coord.registry.workers()} if lost else {}
    return JobView(
        job=job,
        progress=JobProgressView(
            samples=training["samples"],
            steps=training["steps"],
            epoch=training["epoch"],
            samples_per_sec=training["samples"] / elapsed if elapsed > 0 else 0.0,
            recent_samples_per_sec=coord.observer.samples_per_sec(job.id),
            mean_loss=nan_to_none(training["mean_loss"]),
            last_loss=nan_to_none(training["last_loss"]),
        ),
        staleness={r: StalenessView(**s.as_dict()) for r, s in (await progress.staleness(ranks)).items()},
        auto_bound=await progress.auto_bound(),
        results=await progress.rank_results(),
        ledgers=await progress.ledgers(job.attempt + 1),
        lost_workers=lost,
        waiting_for=[unreachable(name, workers.get(name), time.time()) for name in lost],
        last_checkpoint=await coord.checkpointer.latest(job),
        checkpoint_in_progress=coord.checkpointer.busy(job.id),
        ps_shards=job.config.topology.ps_shards,
        reshard_in_progress=job.pending_reshard is not None
        or (job.state == "recovering" and bool(job.recoveries) and job.recoveries[-1].kind == "reshard"),
        publish_failures=coord.publisher.failures(job),
        progressive=await progressive_view(coord.redis, job),
        stream=await stream_view(coord.registry, job),
    )
