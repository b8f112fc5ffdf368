"""The model zoo: the model contract (`contract`), the default `DNN`, and models from the CTR
literature under the same contract, each named in a job file as `trillium.models:<Name>`
(docs/jobs.md, "Models"). Each returns one logit per sample, (B,), except the multi-task `MMoE`,
`ESMM` and `PLE`: one per task, (B, T), for a job's `labels:`."""

from __future__ import annotations

from .contract import SlotTensors, build_dense_optimizer, build_model, load_model, logits
from .dcn import DCNv2
from .deepfm import DeepFM
from .din import DIN
from .dlrm import DLRM
from .dnn import DNN
from .esmm import ESMM
from .mmoe import MMoE
from .objective import Objective
from .ple import PLE

__all__ = [
    "Objective",
    "DCNv2",
    "DIN",
    "DLRM",
    "DNN",
    "DeepFM",
    "ESMM",
    "MMoE",
    "PLE",
    "SlotTensors",
    "build_dense_optimizer",
    "build_model",
    "load_model",
    "logits",
]
