"""What an NN rank cuts after a step, decided before the step's gradients leave (a publish cut
rides on them, services/coordinator/publish.py): a checkpoint the ranks agreed was asked for (a
newer request in their control words) or scheduled (every `checkpoint.every_steps`), and a model
version asked for, or one at that checkpoint when `publish.at_checkpoints`. Every rank decides
from the same words and step, so all cut at the same step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trillium.job.schema import CheckpointConfig, PublishConfig

from .step import Control


@dataclass(frozen=True)
class Cuts:
    checkpoint: tuple[Literal["request", "schedule"], int] | None  # why, and the request it serves
    publish: Literal["schedule", "checkpoint"] | None


def decide_cuts(
    checkpoint: CheckpointConfig | None,
    publish: PublishConfig | None,
    control: Control,
    *,
    step: int,
    served_checkpoint: int,
    served_publish: int,
) -> Cuts:
    """The cuts after `step` (0-based, just trained), given the newest checkpoint and model
    version requests this rank has served."""
    cut: tuple[Literal["request", "schedule"], int] | None = None
    if checkpoint is not None and control.seq > served_checkpoint:
        cut = ("request", control.seq)
    elif checkpoint is not None and checkpoint.every_steps and (step + 1) % checkpoint.every_steps == 0:
        cut = ("schedule", served_checkpoint)
    published: Literal["schedule", "checkpoint"] | None = None
    if publish is not None and control.publish > served_publish:
        published = "schedule"
    elif publish is not None and cut is not None and publish.at_checkpoints:
        published = "checkpoint"
    return Cuts(cut, published)
