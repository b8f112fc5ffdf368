"""The limits an operator sets on what a job file may make the stack do: which model code it may
import, where it may read its data and where it may keep its state."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trillium.data import load_job
from trillium.data.sources.files import COLUMN_SHOWN, COLUMNS_SHOWN, column_list
from trillium.job import JobConfig, ModelSpec
from trillium.job.trust import ENV_ALLOWED_PATHS, ENV_MODEL_MODULES, PathRoots, check_model_module
from trillium.models import load_model
from trillium.runtime.checkpoint import JobCheckpoints
from trillium.runtime.model_store import ModelStore
from trillium.services.data_loader.server import _confine
from trillium.stack.procs import SAFE_IMPORTS

DATA = Path(__file__).parents[1] / "data"


def test_only_the_allowed_modules_are_imported(monkeypatch) -> None:
    monkeypatch.delenv(ENV_MODEL_MODULES, raising=False)
    check_model_module("trillium.models:DNN")
    for cls in (
        "examples.criteo.model:Net",
        "subprocess:Popen",
        "trillium.modelsx:DNN",
        "trillium:models",
        "os.path:join",
    ):
        with pytest.raises(ValueError, match="is not one this stack may import"):
            check_model_module(cls)
    monkeypatch.setenv(ENV_MODEL_MODULES, "acme.rankers")
    check_model_module("acme.rankers.v2:Tower")
    with pytest.raises(ValueError, match=f"{ENV_MODEL_MODULES}=acme.rankers"):
        check_model_module("trillium.models:DNN")


def test_a_refused_module_is_never_imported(monkeypatch) -> None:
    monkeypatch.delenv(ENV_MODEL_MODULES, raising=False)
    name = "trillium_trust_probe_module"
    with pytest.raises(ValueError, match="is not one this stack may import"):
        load_model(ModelSpec(cls=f"{name}:Anything"))
    assert name not in sys.modules


def test_state_stays_under_the_allowed_roots(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(ENV_ALLOWED_PATHS, raising=False)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    roots = PathRoots.from_env(run_dir)
    assert roots.roots == (str(run_dir),)
    assert roots.allows(str(run_dir / "checkpoints"))
    assert roots.allows(str(run_dir / "not-yet" / "made"))
    assert not roots.allows(str(tmp_path / "elsewhere"))
    assert not roots.allows(str(run_dir / ".." / "elsewhere"))
    assert not roots.allows(str(tmp_path / "run-sibling"))  # a prefix of the name is no parent
    os.symlink("/etc", run_dir / "link")
    assert not roots.allows(str(run_dir / "link" / "cron.d"))
    assert not roots.allows("s3://bucket/models")


def test_an_object_store_root_is_a_url_prefix(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_ALLOWED_PATHS, f"{tmp_path}, s3://trillium/jobs/")
    roots = PathRoots.from_env(tmp_path / "ignored")
    assert roots.roots == (str(tmp_path), "s3://trillium/jobs/")
    assert roots.allows("s3://trillium/jobs/models")
    assert roots.allows("s3://trillium/jobs")
    assert not roots.allows("s3://trillium/jobsx/models")
    assert not roots.allows("s3://trillium/jobs/../other")
    assert not roots.allows("gs://trillium/jobs/models")
    assert roots.allows(str(tmp_path / "spill"))


def test_the_shared_dir_is_where_state_goes_by_default_and_always_allowed(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_ALLOWED_PATHS, "/data")
    roots = PathRoots.from_env(tmp_path / "run", "s3://trillium/stack")
    assert roots.roots == ("/data", "s3://trillium/stack")
    assert roots.allows("s3://trillium/stack/checkpoints") and not roots.allows(str(tmp_path / "run"))
    job = load_job(DATA / "tiny_job.yaml").model_dump(mode="json")
    job["checkpoint"] = {"every_steps": 2}
    job["publish"] = {}
    config = JobConfig.model_validate(job)
    assert (
        JobCheckpoints.of(config, "tiny-1", "s3://trillium/stack").location(4)
        == "s3://trillium/stack/checkpoints/tiny-1/4"
    )
    assert ModelStore.key(config, "s3://trillium/stack") == ("s3://trillium/stack/models", config.name)
    run_dir = tmp_path / "run"
    assert JobCheckpoints.of(config, "tiny-1", run_dir).location(4) == f"{run_dir}/checkpoints/tiny-1/4"


def _file_job(train, test=None) -> JobConfig:
    raw = load_job(DATA / "tiny_job.yaml").model_dump(mode="json")
    raw["data"] |= {"train": train, "test": test}
    raw["checkpoint"] = None
    return JobConfig.model_validate(raw)


def test_data_files_are_read_only_under_the_allowed_roots(tmp_path) -> None:
    """`data.train` and `data.test` are locations like the state's: a path, each entry of a list,
    and a glob whose `..` climbs out, are refused naming where the job sets them."""
    root = tmp_path / "data"
    root.mkdir()
    roots = PathRoots((str(root),))
    inside = str(root / "day_*.tsv")
    assert list(roots.refusals(_file_job(inside))) == []
    refused = {
        where: location
        for where, location, _ in roots.refusals(
            _file_job([inside, "/proc/self/environ"], str(root / "*" / ".." / ".." / "etc" / "*"))
        )
    }
    assert refused == {("data", "train", 1): "/proc/self/environ", ("data", "test"): str(root / "*/../../etc/*")}
    with pytest.raises(ValueError, match=r"data\.train\.1: '/proc/self/environ' is outside the roots"):
        roots.check(_file_job([inside, "/proc/self/environ"]))


def test_the_loader_refuses_a_match_that_links_out_of_the_roots(tmp_path) -> None:
    """The coordinator checks a glob as written; the loader checks every file it matches where it
    reads them: a link under the root leading out is refused, naming it, before a byte is read."""
    root = tmp_path / "data"
    root.mkdir()
    (root / "day_1.tsv").write_text("label\tI1\n")
    secret = tmp_path / "secret.tsv"
    secret.write_text("AWS_SECRET_ACCESS_KEY=hunter2\n")
    roots = PathRoots((str(root),))
    job = _file_job(str(root / "day_*.tsv"))
    _confine(job, roots)  # one real file: nothing to refuse
    os.symlink(secret, root / "day_2.tsv")
    with pytest.raises(ValueError, match=r"data\.train: '.*day_2\.tsv' is outside the roots") as refused:
        _confine(job, roots)
    assert "hunter2" not in str(refused.value)


def test_an_error_shows_a_bounded_part_of_a_header() -> None:
    """A header the job may read is named in an error, cut short: the first COLUMNS_SHOWN names,
    each at most COLUMN_SHOWN characters."""
    names = [f"c{i}" for i in range(COLUMNS_SHOWN + 5)]
    assert column_list(names) == ", ".join(names[:COLUMNS_SHOWN]) + ", … (5 more)"
    long = "x" * (COLUMN_SHOWN + 100)
    assert column_list(["a", long]) == f"a, {'x' * COLUMN_SHOWN}…"


def test_a_url_is_allowed_only_at_an_object_store() -> None:
    """A root naming a web, FTP or in-process filesystem allows nothing: a checkpoint uploaded to
    someone's server, or kept in no durable place, is never a location."""
    roots = PathRoots(("s3://trillium", "ftp://files.example", "https://files.example", "memory://", "file:///tmp"))
    assert roots.allows("s3://trillium/checkpoints/job-1/9")
    for location in ("ftp://files.example/x", "https://files.example/x", "memory://x", "file:///tmp/x"):
        assert not roots.allows(location), location
        assert "outside the roots this stack allows" in roots.refusal(location)
    assert roots.refusal("s3://trillium/models") is None


def test_a_module_a_job_leaves_in_the_working_directory_shadows_nothing(tmp_path) -> None:
    """The stack's processes run in the run directory, where jobs write: a package there named as
    one the allowlist names is not what they import (SAFE_IMPORTS, which the launcher and the
    images set); without it, it would be (the check can fail)."""
    shadow = tmp_path / "trillium" / "models"
    shadow.mkdir(parents=True)
    (tmp_path / "trillium" / "__init__.py").write_text("")
    (shadow / "__init__.py").write_text("raise SystemExit('the shadow ran')")
    probe = [sys.executable, "-c", "import trillium.models"]
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    safe = subprocess.run(probe, cwd=tmp_path, env=base | SAFE_IMPORTS, capture_output=True, text=True)
    assert safe.returncode == 0 and "the shadow ran" not in safe.stderr, safe.stderr
    unsafe = subprocess.run(probe, cwd=tmp_path, env=base, capture_output=True, text=True)
    assert "the shadow ran" in unsafe.stderr
