"""An NN rank's cuts after a step (services/nn_worker/cuts.py): a checkpoint asked for or due by
the schedule, and a model version asked for or riding on the checkpoint, each worked out by hand."""

from __future__ import annotations

from trillium.job.schema import CheckpointConfig, PublishConfig
from trillium.services.nn_worker.cuts import Cuts, decide_cuts
from trillium.services.nn_worker.step import Control

EVERY_40 = CheckpointConfig(every_steps=40, every_seconds=None)
AT_CHECKPOINTS = PublishConfig(at_checkpoints=True)


def control(seq: int = 0, publish: int = 0) -> Control:
    return Control(samples=512, paused=False, seq=seq, publish=publish)


def cuts(checkpoint, publish, words: Control, step: int, served: tuple[int, int] = (0, 0)) -> Cuts:
    return decide_cuts(checkpoint, publish, words, step=step, served_checkpoint=served[0], served_publish=served[1])


def test_a_scheduled_checkpoint_falls_after_every_40th_step() -> None:
    assert cuts(EVERY_40, None, control(), step=39) == Cuts(("schedule", 0), None)
    assert cuts(EVERY_40, None, control(), step=79, served=(2, 0)) == Cuts(("schedule", 2), None)
    assert cuts(EVERY_40, None, control(), step=38) == Cuts(None, None)
    assert cuts(CheckpointConfig(every_steps=None), None, control(), step=39) == Cuts(None, None)


def test_a_request_the_ranks_agreed_on_is_served_once() -> None:
    assert cuts(EVERY_40, None, control(seq=3), step=5, served=(2, 0)) == Cuts(("request", 3), None)
    assert cuts(EVERY_40, None, control(seq=3), step=6, served=(3, 0)) == Cuts(None, None)
    # A request due on a scheduled step is the request's cut (one checkpoint, not two).
    assert cuts(EVERY_40, None, control(seq=3), step=39, served=(2, 0)) == Cuts(("request", 3), None)


def test_a_job_without_checkpoints_never_cuts_for_one() -> None:
    assert cuts(None, None, control(seq=5), step=39) == Cuts(None, None)
    assert cuts(None, AT_CHECKPOINTS, control(seq=5), step=39) == Cuts(None, None)


def test_a_model_version_asked_for_or_riding_on_a_checkpoint() -> None:
    assert cuts(EVERY_40, PublishConfig(), control(publish=4), step=7, served=(0, 3)) == Cuts(None, "schedule")
    assert cuts(EVERY_40, PublishConfig(), control(publish=3), step=7, served=(0, 3)) == Cuts(None, None)
    assert cuts(EVERY_40, AT_CHECKPOINTS, control(), step=39) == Cuts(("schedule", 0), "checkpoint")
    assert cuts(EVERY_40, PublishConfig(), control(), step=39) == Cuts(("schedule", 0), None)
    # Both asked: the version is the scheduled one (it rides on the same gradients either way).
    assert cuts(EVERY_40, AT_CHECKPOINTS, control(seq=1, publish=1), step=2) == Cuts(("request", 1), "schedule")
