"""The limits an operator sets on what a job file may make the stack do: which model code it may
import, and where it may keep its state."""

from __future__ import annotations

import os
import sys

import pytest

from trillium.job import ModelSpec
from trillium.job.trust import ENV_ALLOWED_PATHS, ENV_MODEL_MODULES, PathRoots, check_model_module
from trillium.models import load_model


def test_only_the_allowed_modules_are_imported(monkeypatch) -> None:
    monkeypatch.delenv(ENV_MODEL_MODULES, raising=False)
    check_model_module("trillium.models:DNN")
    check_model_module("examples.criteo.model:Net")
    for cls in ("subprocess:Popen", "trillium.modelsx:DNN", "trillium:models", "os.path:join"):
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
