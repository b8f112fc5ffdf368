"""Write the checkpoint fixture of the current checkpoint format: `checkpoint-v<N>/`.

A checkpoint written by today's code must restore with tomorrow's. So each checkpoint format
keeps one small checkpoint under tests/data, written by the code of its day, and
tests/e2e/test_recovery.py restores every one of them and checks that it evaluates to the metrics
its manifest recorded. When `trillium.runtime.checkpoint.FORMAT_VERSION` goes up, run this once
(`.venv/bin/python tests/data/make_checkpoint_fixture.py`) and commit the new directory beside
the old ones, which stay.

The checkpoint is the tiny multi-task job's (tests/data/tiny_multitask_job.yaml; formats 1-3 have
the one-label tiny_job.yaml's) after one epoch, full (no delta), its test split evaluated at the
cut, on a stack of its own Kafka and Redis (a few minutes).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from trillium import stack
from trillium.config import StackTopology
from trillium.data import load_job
from trillium.job import JobConfig
from trillium.runtime.checkpoint import FORMAT_VERSION, JobCheckpoints
from trillium.stack.client import CoordinatorClient

DATA = Path(__file__).resolve().parent


def fixture_dir(version: int = FORMAT_VERSION) -> Path:
    return DATA / f"checkpoint-v{version}"


def _job() -> JobConfig:
    job = load_job(DATA / "tiny_multitask_job.yaml")
    return JobConfig.model_validate(
        job.model_dump()
        | {
            "name": f"checkpoint-v{FORMAT_VERSION}",
            "training": job.training.model_dump() | {"epochs": 1},
            "checkpoint": {"every_steps": None, "every_seconds": None, "full_every": 1, "evaluate": True},
        }
    )


def main() -> int:
    out = fixture_dir()
    if out.exists():
        print(f"{out} exists: a format's fixture is written once, by the code of its day", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="trillium-fixture-") as tmp:
        run_dir = Path(tmp)
        job = _job()
        topo = job.topology
        stack.up(
            run_dir,
            StackTopology(
                nn_ranks=topo.nn_ranks,
                ps_shards=topo.ps_shards,
                embedding_workers=topo.embedding_workers,
                data_loaders=topo.data_loaders,
                serving_replicas=0,
            ),
            allow_paths=[DATA],  # the job's data (tests/data/tiny_multitask)
        )
        try:
            client = CoordinatorClient.for_stack(run_dir)
            try:
                job_id = client.submit(job)["id"]
                view = client.follow(job_id, timeout_s=600)
            finally:
                client.close()
        finally:
            stack.down(run_dir)
        if view["job"]["state"] != "finished":
            print(f"the fixture job ended {view['job']['state']}: {view['job']['error']}", file=sys.stderr)
            return 1
        checkpoints = JobCheckpoints.of(job, job_id, run_dir)
        assert checkpoints is not None
        final = checkpoints.complete()[-1]
        shutil.copytree(checkpoints.dir(final.step).path, out / job_id / str(final.step))
    print(f"wrote {out}/{job_id}/{final.step}: eval {final.eval}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
