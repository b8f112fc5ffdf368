"""What every Trillium service process shares: the admin HTTP server (its routes: admin.py),
registration and heartbeats with the coordinator (heartbeats.py), a job's attempts and the
reports of its parts, and a graceful stop on SIGTERM/SIGINT.

A service subclasses `Service`, overrides `start`/`stop` (and `add_routes` for an
HTTP API of its own, `run_job` to take part in jobs), and its `__main__` calls
`run_service(MyService)` (`trillium.runtime.process`).

Jobs reach a worker in the coordinator's answers to its heartbeats. A job runs in
attempts: the first, and one more for every recovery from a checkpoint. When an attempt
of a job names this worker (its index is below the job's count for its role), `run_job`
runs as a task; it reports its phase with `set_job_phase` ("setting_up" → "ready" →
"done"), a raised exception reports "failed" with the error, and the task is cancelled
when the job ends, is stopped, or moves on to a newer attempt (a service with
`fresh_per_attempt` then exits, to be started afresh and join it new). Every report carries the
attempt it is about, so the coordinator never mistakes a late word of an abandoned attempt
for the current one. The report travels back in the next heartbeat, sent at once.

Checkpoints: the coordinator asks PS shards and data loaders to capture their state at a
cut (`POST /job/capture`) and releases the NN ranks held at it (`POST /job/release`); a
role answers by overriding `capture`/`release`, and reports each written part with
`report_part`.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, ClassVar

import grpc
import httpx
import uvicorn
from fastapi import Depends, FastAPI, HTTPException, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from trillium.config import EXIT_REPLACED, EXIT_RESTART, Role, ServiceSettings
from trillium.job.record import TERMINAL, JobRecord
from trillium.job.trust import PathRoots
from trillium.runtime.admin import add_admin_routes
from trillium.runtime.checkpoint import (
    CaptureRequest,
    CaptureResult,
    CutReport,
    PartFile,
    PartReport,
    ReleaseRequest,
)
from trillium.runtime.forget import ShardForgetRequest, ShardForgetResult
from trillium.runtime.heartbeats import heartbeat_loop
from trillium.runtime.memory import (
    LEAN_ARENAS,
    MMAP_THRESHOLD,
    release_free_memory,
)
from trillium.runtime.model_store import ExportRequest, ModelPart, PublishCut
from trillium.scopes import Scope
from trillium.timeouts import COORDINATOR_CALL_S, DEREGISTER_S, JOB_CANCEL_S

logger = logging.getLogger("trillium.runtime.service")


_bearer = HTTPBearer(auto_error=False)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        # The service owns SIGTERM/SIGINT so it can stop its own work before HTTP goes away.
        yield


class Service:
    role: ClassVar[Role]
    # False: a process that takes part in no job (a serving replica) neither registers nor heartbeats.
    registers: ClassVar[bool] = True
    # True: trillium.runtime.memory.keep_malloc_lean, glibc's thresholds fixed where it would move
    # them, its threads sharing `malloc_arenas` arenas (None: glibc's, for threads that allocate
    # at once on the hot path), blocks of `malloc_mmap_threshold` bytes and more mapped (and
    # unmapped when freed; None: glibc's moving thresholds), free heap kept up to
    # `malloc_trim_threshold` (None: the mmap threshold).
    lean_malloc: ClassVar[bool] = False
    malloc_arenas: ClassVar[int | None] = LEAN_ARENAS
    malloc_mmap_threshold: ClassVar[int | None] = MMAP_THRESHOLD
    malloc_trim_threshold: ClassVar[int | None] = None
    # True: when the job it takes part in moves on to a newer attempt (a recovery), the process
    # starts afresh (`restart_process`) and joins the new attempt new, as an NN rank whose
    # collectives may block does. An attempt's state comes and goes whole (a joiner's window, a
    # restore, a catch-up's burst of objects), and what it left freed in the heap stayed: a long
    # job's data loader and PS shards rose by some percent at each of its first recoveries. Their
    # restart costs a second or two, beside the NN ranks' own.
    fresh_per_attempt: ClassVar[bool] = False

    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        self.name = settings.name
        self._keys = settings.keys
        self.started_at = time.time()
        self.ready = False
        self.stopping = asyncio.Event()
        # One client for every call to the coordinator: making one loads the CA bundle, 30 ms of CPU.
        self.coordinator = settings.http_client(COORDINATOR_CALL_S)
        self.heartbeat_now = asyncio.Event()
        self._job_heard = asyncio.Event()  # set whenever a heartbeat's answer updates `job`
        self.job: JobRecord | None = None  # the current job as last heard, state included
        self._job_task: asyncio.Task[None] | None = None
        self._job_attempt: tuple[str, int] | None = None  # (job id, attempt) of _job_task
        self._job_report: dict[str, Any] = {}
        self._parts: dict[int, dict[str, Any]] = {}  # checkpoint step -> PartReport, this attempt's
        self._publish_cuts: dict[int, dict[str, Any]] = {}  # step -> PublishCut, this attempt's latest
        self._model_parts: dict[int, dict[str, Any]] = {}  # step -> ModelPart, this attempt's latest
        # OpenAPI and docs are served below, behind the token like everything but health.
        self.app = FastAPI(title=f"Trillium {self.role}", version="1", openapi_url=None, docs_url=None, redoc_url=None)
        add_admin_routes(self)
        self.add_routes(self.app)

    # ---- hooks -----------------------------------------------------------------------
    def add_routes(self, app: FastAPI) -> None:
        """Add service-specific HTTP routes."""

    async def start(self) -> None:
        """Start the service's own work (servers, consumers); return once it is ready."""

    async def stop(self) -> None:
        """Stop the service's own work; finish or hand back what is in flight."""

    def accepts_traffic(self) -> bool:
        """Whether /readyz may say ready once `start` has returned (a role with more to load says
        when it has)."""
        return True

    def health(self) -> dict[str, Any]:
        """Service-specific fields reported by /healthz and in heartbeats."""
        return {}

    async def run_job(self, job: JobRecord) -> None:
        """Take part in one attempt of `job`; the default role has nothing to do in jobs."""
        self.set_job_phase("done")

    async def capture(self, request: CaptureRequest) -> CaptureResult:
        """Capture this worker's state at a checkpoint cut (PS shards and data loaders)."""
        raise HTTPException(status.HTTP_409_CONFLICT, f"a {self.role} has no state to capture")

    async def export(self, request: ExportRequest) -> None:
        """Export this worker's part of a version at the last step of a job (PS shards)."""
        raise HTTPException(status.HTTP_409_CONFLICT, f"a {self.role} has no rows to export")

    async def release(self, request: ReleaseRequest) -> None:
        """Go on after a checkpoint cut (NN ranks)."""
        raise HTTPException(status.HTTP_409_CONFLICT, f"a {self.role} does not hold at checkpoint cuts")

    async def forget(self, request: ShardForgetRequest) -> ShardForgetResult:
        """Remove rows of a job's table (PS shards)."""
        raise HTTPException(status.HTTP_409_CONFLICT, f"a {self.role} holds no rows")

    async def peers(self, role: Role, count: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """The registered workers `<role>-0 .. <role>-(count-1)`, waiting for them to register."""
        deadline = time.monotonic() + timeout_s
        while True:
            r = await self.coordinator.get(f"{self.settings.coordinator_url}/v1/workers")
            r.raise_for_status()
            found = {w["index"]: w for w in r.json() if w["role"] == role and w["status"] != "lost"}
            if all(i in found for i in range(count)):
                return [found[i] for i in range(count)]
            if time.monotonic() > deadline:
                raise RuntimeError(f"{count} {role} workers needed, registered: {sorted(found)}")
            await asyncio.sleep(0.5)

    # ---- jobs ------------------------------------------------------------------------
    def set_job_phase(self, phase: str, error: str | None = None) -> None:
        assert self._job_attempt is not None
        job_id, attempt = self._job_attempt
        self._report(job_id, attempt, phase, error)

    def _report(self, job_id: str, attempt: int, phase: str, error: str | None = None, *, final: bool = False) -> None:
        self._job_report = {"id": job_id, "attempt": attempt, "phase": phase} | ({"error": error} if error else {})
        if final:  # no new attempt can get past it: the coordinator fails the job at once
            self._job_report["final"] = True
        self.heartbeat_now.set()

    def report_cut(self, cut: CutReport | None) -> None:
        """Say that this NN rank holds at a cut (None: no longer)."""
        if cut is None:
            self._job_report.pop("cut", None)
        else:
            self._job_report["cut"] = cut.model_dump(mode="json")
        self.heartbeat_now.set()

    def report_part(self, part: PartReport) -> None:
        """Say that this worker's part of the checkpoint at `part.step` is written (or failed)."""
        _keep(self._parts, part.step, part, 4)  # the coordinator reads them within seconds
        self.heartbeat_now.set()

    async def write_part(
        self,
        step: int,
        files: list[tuple[str, Callable[[], Awaitable[tuple[int, str]]]]],
        *,
        deltas: dict[str, int] | None = None,
        metrics: dict[str, Any] | None = None,
    ) -> None:
        """Write this worker's files of the checkpoint at `step` — `(name, write)` each, `write`
        answering the file's size and sha256 — and report them (`report_part`), or why not: a
        write that fails fails the checkpoint, not the job. `deltas`: the files that are deltas,
        with the step of the checkpoint each is loaded on top of (`PartFile.delta_of`)."""
        written = []
        try:
            for name, write in files:
                started = time.monotonic()
                size, sha = await write()
                seconds = time.monotonic() - started
                written.append(
                    PartFile(
                        name=name,
                        role=self.role,
                        index=self.settings.index,
                        bytes=size,
                        sha256=sha,
                        seconds=seconds,
                        delta_of=(deltas or {}).get(name),
                    )
                )
        except Exception as err:  # noqa: BLE001 (the checkpoint fails, not the job)
            logger.exception("writing the checkpoint part failed", extra={"step": step})
            self.report_part(PartReport(step=step, error=describe_error(err)))
            return
        finally:
            release_free_memory()  # what encoding the part took (a loader's: tens of MB a time)
        self.report_part(PartReport(step=step, files=written, eval=metrics))

    def report_publish_cut(self, cut: PublishCut) -> None:
        """Say that this NN rank has passed a publish cut (services/coordinator/publish.py)."""
        _keep(self._publish_cuts, cut.step, cut, 8)  # cuts come every few seconds at most
        self.heartbeat_now.set()

    def report_model_part(self, part: ModelPart) -> None:
        """Say that this worker's files of the version cut at `part.step` are written (or failed)."""
        _keep(self._model_parts, part.step, part, 8)
        self.heartbeat_now.set()

    def job_is(self, *states: str) -> bool:
        """Whether the current attempt of the job this task runs is in one of `states`."""
        job = self.job
        return job is not None and (job.id, job.attempt) == self._job_attempt and job.state in states

    async def wait_until_running(self) -> None:
        """Wait until the coordinator has every participant ready and starts the job (or resumes
        it after a recovery); training before that would reach workers still setting up."""
        while not self.job_is("running", "paused"):
            self._job_heard.clear()
            await self._job_heard.wait()

    async def _run_job_task(self, job: JobRecord) -> None:
        try:
            # The record's locations as this process's own limits allow them, whoever wrote it.
            try:
                self.roots.check(job.config)
            except ValueError as err:
                raise JobCannotRecover(str(err)) from None
            await self.run_job(job)
        except asyncio.CancelledError:
            self._report(job.id, job.attempt, "stopped")
            raise
        except Exception as exc:
            logger.exception("job failed", extra={"job": job.id, "attempt": job.attempt})
            self._report(job.id, job.attempt, "failed", describe_error(exc), final=isinstance(exc, JobCannotRecover))

    async def _cancel_job_task(self) -> None:
        task, self._job_task = self._job_task, None
        if task is None:
            return
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=JOB_CANCEL_S)
            if not task.done():
                # Stuck where a cancel cannot reach: the heartbeats wait on this, so say where and
                # start afresh rather than fall silent (a process joins a new attempt new anyway).
                stack = io.StringIO()
                task.print_stack(file=stack)
                logger.error("the job's task did not end when cancelled", extra={"stack": stack.getvalue()})
                await self.restart_process()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.left_attempt()

    async def left_attempt(self) -> None:
        """Hook, after this worker's part in an attempt has ended (done, failed or cancelled):
        what the attempt leaves behind that this process cannot clean up."""

    async def restart_process(self) -> None:
        """Exit to be started afresh (EXIT_RESTART), deregistered first: the coordinator waits for
        the new process to register instead of taking the silence for a lost worker."""
        logger.warning("restarting the process")
        with contextlib.suppress(httpx.HTTPError):
            await self.coordinator.delete(
                f"{self.settings.coordinator_url}/v1/workers/{self.name}", timeout=DEREGISTER_S
            )
        logging.shutdown()
        os._exit(EXIT_RESTART)

    def exit_replaced(self, why: str | None) -> None:
        """Another host's process holds this role and index (we were replaced while cut off):
        exit at once, writing nothing more, with EXIT_REPLACED so that no supervisor restarts us."""
        logger.error("replaced by another process: exiting", extra={"why": why})
        logging.shutdown()
        os._exit(EXIT_REPLACED)

    async def on_job(self, job: JobRecord | None) -> None:
        if job is None:
            # No current job: ours was deleted, maybe before a heartbeat told us it had ended (the
            # warm-up job of `trillium up` is deleted the moment it finishes). A task left running
            # would follow the deleted topics for as long as the process lives.
            await self._cancel_job_task()
            return
        self.job = job
        self._job_heard.set()
        attempt = (job.id, job.attempt)
        if job.state in TERMINAL or job.state == "stopping":
            await self._cancel_job_task()
            return
        if self.settings.index >= job.config.topology.count(self.role):
            await self._cancel_job_task()  # not (or no longer: a job resharded away from us) one of its workers
            return
        if self._job_attempt == attempt:
            return
        recovering = self._job_attempt is not None and self._job_attempt[0] == job.id
        await self._cancel_job_task()  # an older attempt, or another job: abandoned
        if recovering and self.fresh_per_attempt and not self.stopping.is_set():
            await self.restart_process()
        self._job_attempt = attempt
        self._parts, self._publish_cuts, self._model_parts = {}, {}, {}
        if job.state in ("submitted", "starting", "recovering"):
            self._report(job.id, job.attempt, "setting_up")
            self._job_task = asyncio.create_task(self._run_job_task(job), name=f"job-{job.id}-{job.attempt}")
        else:
            # We (re)started while the attempt runs: whatever we held for it is gone, and joining
            # now would train on lost state or replay work. Say so: the job recovers from its
            # last checkpoint, in a new attempt that we join from the start.
            self._report(job.id, job.attempt, "failed", f"restarted while the job was {job.state}; its state is lost")

    @property
    def advertised_host(self) -> str:
        if self.settings.advertise_host:
            return self.settings.advertise_host
        # Bound to all interfaces (a container): peers reach us by our host name.
        return socket.gethostname() if self.settings.host in ("0.0.0.0", "::") else self.settings.host

    @property
    def grpc_address(self) -> str | None:
        port = self.settings.grpc_port
        return f"{self.advertised_host}:{port}" if port else None

    # ---- admin HTTP ------------------------------------------------------------------
    def requires(self, *scopes: Scope) -> Callable[..., Awaitable[None]]:
        """A FastAPI dependency: a bearer token of one of `scopes` (trillium.scopes), checked in
        time that tells nothing about it. A coroutine: FastAPI runs a plain function dependency on
        a worker thread, a thread hand-off on every request (every heartbeat)."""
        keys = self._keys

        async def require(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
            if not keys.granted(creds.credentials if creds is not None else None, scopes):
                raise HTTPException(
                    status.HTTP_401_UNAUTHORIZED,
                    f"missing or invalid bearer token (this needs the {' or '.join(scopes)} scope's)",
                    headers={"WWW-Authenticate": "Bearer"},
                )

        return require

    @property
    def roots(self) -> PathRoots:
        """Where this process lets a job read and write (trillium.job.trust)."""
        return PathRoots.from_env(self.settings.run_dir, self.settings.shared_dir)

    def require_location(self, location: str | None) -> None:
        """422 for a location outside this process's roots, or of a scheme no store has."""
        if location is not None and (why := self.roots.refusal(location)) is not None:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, why)

    def require_attempt(self, job_id: str, attempt: int) -> None:
        if self._job_attempt != (job_id, attempt) or self._job_task is None or self._job_task.done():
            raise HTTPException(
                status.HTTP_409_CONFLICT, f"{self.name} is not running attempt {attempt} of job {job_id}"
            )

    def health_report(self) -> dict[str, Any]:
        return {
            "status": "ok" if self.ready else "starting",
            "role": self.role,
            "index": self.settings.index,
            "name": self.name,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_at, 3),
            "job": self._job_report
            | {"parts": self._parts, "publish_cuts": self._publish_cuts, "model_parts": self._model_parts}
            if self._job_report
            else None,
            **self.health(),
        }

    def registration(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "role": self.role,
            "index": self.settings.index,
            "http_url": f"{self.settings.http_scheme}://{self.advertised_host}:{self.settings.http_port}",
            "grpc_address": self.grpc_address,
            "pid": os.getpid(),
        }

    # ---- lifecycle -------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        server = _Server(
            uvicorn.Config(
                self.app,
                host=self.settings.host,
                port=self.settings.http_port,
                log_config=None,
                lifespan="off",
                access_log=False,
                # With TLS configured, the HTTP port speaks only TLS (the token crosses no link in clear).
                ssl_certfile=str(tls.cert_file) if (tls := self.settings.grpc_tls) else None,
                ssl_keyfile=str(tls.key_file) if tls else None,
            )
        )
        http_task = asyncio.create_task(server.serve(), name="http")
        try:
            await self.start()
            self.ready = True
            logger.info("service ready", extra={"http_port": self.settings.http_port, "grpc": self.grpc_address})
            heartbeat = asyncio.create_task(
                heartbeat_loop(self) if self.registers else self.stopping.wait(), name="heartbeat"
            )
            stop_wait = asyncio.create_task(self.stopping.wait())
            # A dead HTTP server (e.g. port taken) is fatal, like a signal.
            await asyncio.wait({stop_wait, http_task}, return_when=asyncio.FIRST_COMPLETED)
            self.stopping.set()
            logger.info("stopping")
            await heartbeat
            await self._cancel_job_task()
        finally:
            self.ready = False
            await self.stop()
            await self.coordinator.aclose()
            server.should_exit = True
            await http_task
            logger.info("stopped")


def _keep(reports: dict[int, dict[str, Any]], step: int, report: Any, latest: int) -> None:
    """Record a report by step, keeping the `latest` steps' (the health stays small)."""
    reports[step] = report.model_dump(mode="json")
    for old in sorted(reports)[:-latest]:
        del reports[old]


class JobCannotRecover(RuntimeError):
    """A job's failure that a new attempt from a checkpoint would meet again (records gone from
    an input topic, say): the job fails at once with it, rather than spend its recoveries."""


def describe_error(exc: BaseException, limit: int = 1000) -> str:
    """An error as one readable line: a gRPC error as its status and details (not the raw dump
    of its debug string), anything else as its type and message, newlines folded."""
    if isinstance(exc, grpc.aio.AioRpcError):
        text = f"gRPC {exc.code().name}: {exc.details()}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"
