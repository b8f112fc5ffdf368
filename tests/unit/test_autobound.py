"""`staleness_bound: auto`: the bound chosen from the ranks' own timings at k = 0."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trillium.job.schema import TrainingConfig
from trillium.runtime.autobound import CALIBRATION_STEPS, MAX_BOUND, choose_bound


def _rank(steps: int, wait_ms: float, step_ms: float) -> dict:
    return {"steps": steps, "lookup_wait_s": steps * wait_ms / 1e3, "step_s": steps * step_ms / 1e3}


def test_the_bound_covers_the_slowest_ranks_wait_in_whole_steps() -> None:
    # Rank 1 waits 31 ms a step, the ranks step 10 and 12 ms (mean 11): 31 / 11 = 2.8, so 3 steps.
    choice = choose_bound({0: _rank(40, 20.0, 10.0), 1: _rank(40, 31.0, 12.0)})
    assert choice is not None
    assert (choice.bound, choice.wait_ms, choice.step_ms, choice.steps) == (3, 31.0, 11.0, 40)
    assert "ceil(31.0 / 11.0) = 3" in choice.reason


def test_no_choice_until_every_rank_has_calibrated() -> None:
    assert choose_bound({}) is None
    early = {0: _rank(CALIBRATION_STEPS, 5.0, 1.0), 1: _rank(CALIBRATION_STEPS - 1, 5.0, 1.0)}
    assert choose_bound(early) is None
    assert choose_bound({0: _rank(CALIBRATION_STEPS, 5.0, 1.0), 1: _rank(CALIBRATION_STEPS, 5.0, 1.0)}).bound == 5


def test_a_wait_under_a_step_still_overlaps_one_step_and_a_huge_one_is_capped() -> None:
    assert choose_bound({0: _rank(30, 0.2, 10.0)}).bound == 1
    huge = choose_bound({0: _rank(30, 5000.0, 1.0)})
    assert huge.bound == MAX_BOUND and f"kept within 1..{MAX_BOUND}" in huge.reason


def test_the_job_file_takes_auto_and_names_the_field_for_anything_else() -> None:
    base = {"batch_size": 8, "dense_optimizer": {"name": "sgd"}}
    assert TrainingConfig.model_validate({**base, "staleness_bound": "auto"}).staleness_bound == "auto"
    with pytest.raises(ValidationError, match="staleness_bound"):
        TrainingConfig.model_validate({**base, "staleness_bound": "fast"})
