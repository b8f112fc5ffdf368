"""`staleness_bound: auto`: the bound chosen from the ranks' own timings at k = 0."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trillium.job.schema import TrainingConfig
from trillium.runtime.autobound import CALIBRATION_STEPS, MAX_BOUND, REFINEMENTS, choose_bound, refine_bound


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


def _after(choice: dict, extra: dict[int, tuple[int, float, float]]) -> dict[int, dict]:
    """Each rank's totals once it has trained `steps` more at the bound set, waiting `wait_ms` and
    stepping `step_ms` a step."""
    return {
        r: {
            "steps": choice["at"][str(r)]["steps"] + steps,
            "lookup_wait_s": choice["at"][str(r)]["lookup_wait_s"] + steps * wait_ms / 1e3,
            "step_s": choice["at"][str(r)]["step_s"] + steps * step_ms / 1e3,
        }
        for r, (steps, wait_ms, step_ms) in extra.items()
    }


def test_a_wait_left_at_the_bound_raises_it_by_the_steps_it_takes() -> None:
    # The cluster's case with TLS: k = ceil(139.1 / 16.1) = 9, then at k = 9 a step still waited
    # 36.9 ms and took 20 ms: 9 + ceil(36.9 / 20) = 11.
    first = choose_bound({0: _rank(25, 139.1, 16.1), 1: _rank(25, 120.0, 16.1)}).as_dict()
    assert first["bound"] == 9
    assert refine_bound(first, _after(first, {0: (CALIBRATION_STEPS - 1, 36.9, 20.0), 1: (30, 1.0, 20.0)})) is None
    raised = refine_bound(first, _after(first, {0: (CALIBRATION_STEPS, 36.9, 20.0), 1: (25, 10.0, 20.0)}))
    assert raised["bound"] == 11 and raised["refinements"] == [
        {"bound": 11, "wait_ms": 36.9, "step_ms": 20.0, "steps": CALIBRATION_STEPS}
    ]
    assert "at k=9 a step still waited 36.9 ms and took 20.0 ms: k = 9 + ceil(36.9 / 20.0) = 11" in raised["reason"]
    assert (raised["steps"], raised["wait_ms"]) == (25, 139.1)  # the first calibration's, as it was
    # At 11 the wait left is a fifth of a step: settled, and never checked again.
    settled = refine_bound(raised, _after(raised, {0: (30, 4.0, 20.0), 1: (30, 4.0, 20.0)}))
    assert settled["settled"] and settled["bound"] == 11
    assert refine_bound(settled, _after(settled, {0: (30, 90.0, 20.0), 1: (30, 90.0, 20.0)})) is None


def test_the_checks_stop_at_the_cap_and_after_a_few_and_a_new_attempt_counts_afresh() -> None:
    capped = choose_bound({0: _rank(30, 5000.0, 1.0)}).as_dict()
    assert refine_bound(capped, _after(capped, {0: (30, 50.0, 1.0)}))["settled"]
    choice = choose_bound({0: _rank(30, 40.0, 10.0)}).as_dict()
    for _ in range(REFINEMENTS):
        choice = refine_bound(choice, _after(choice, {0: (30, 40.0, 10.0)}))
    assert choice["bound"] == 4 + 4 * REFINEMENTS and not choice.get("settled")
    assert refine_bound(choice, _after(choice, {0: (30, 40.0, 10.0)}))["settled"]
    # A recovery's attempt starts its totals from zero: the check starts again from there.
    again = choose_bound({0: _rank(30, 40.0, 10.0)}).as_dict()
    rebased = refine_bound(again, {0: _rank(5, 40.0, 10.0)})
    assert rebased["bound"] == 4 and rebased["at"] == {"0": _rank(5, 40.0, 10.0)}
