"""The job: what a user asks for, and what the coordinator records of it. Configuration only:
pydantic and yaml, nothing that reads data or talks to a server; every other package imports it.

- `schema.py`: `JobConfig`, the YAML/JSON document (`read_job`), and its parts in `data.py`
  (where the data comes from), `tables.py` (embedding tables) and `tasks.py` (what it learns:
  `label` or several `labels`). Every model forbids unknown keys, so a misspelt key fails naming
  the field; enumerations are `Literal`s, so a bad value fails listing the allowed ones;
  cross-field checks name the slot or field at fault.
- `record.py`: a submitted job as the coordinator keeps it: state machine, attempts, lineage.

Imports run one way: `trillium.config` (the role names) <- `base` <- `data`, `tables`, `tasks`
<- `schema` <- `record`. Checking a job's columns against its files is the data package's
(`trillium.data.load_job`).
"""

from .data import (
    ADULT_COLUMNS,
    CRITEO_COLUMNS,
    PRESET_COLUMNS,
    AdultData,
    ColumnSplit,
    CriteoData,
    CsvData,
    DataConfig,
    EventClock,
    FractionSplit,
    JoinConfig,
    JoinedLabels,
    KafkaData,
    ParquetData,
    SplitPolicy,
    SyntheticData,
)
from .schema import (
    CheckpointConfig,
    DenseAdagrad,
    DenseAdam,
    DenseColumn,
    DenseOptimizerConfig,
    DenseSgd,
    EvaluationConfig,
    FeatureSlot,
    InitFrom,
    JobConfig,
    ModelSpec,
    PublishConfig,
    TopologyConfig,
    TrainingConfig,
    read_job,
)
from .tables import (
    AdagradConfig,
    AdamConfig,
    AdmissionConfig,
    AdmissionOff,
    AdmissionProbability,
    AdmissionThreshold,
    EmbeddingOptimizerConfig,
    FtrlConfig,
    SgdConfig,
    TableConfig,
    stored_config,
)
from .tasks import LabelConfig, TaskConfig

__all__ = [
    "ADULT_COLUMNS",
    "CRITEO_COLUMNS",
    "PRESET_COLUMNS",
    "AdagradConfig",
    "AdamConfig",
    "AdmissionConfig",
    "AdmissionOff",
    "AdmissionProbability",
    "AdmissionThreshold",
    "AdultData",
    "CheckpointConfig",
    "ColumnSplit",
    "CriteoData",
    "CsvData",
    "DataConfig",
    "DenseAdagrad",
    "DenseAdam",
    "DenseColumn",
    "DenseOptimizerConfig",
    "DenseSgd",
    "EmbeddingOptimizerConfig",
    "EvaluationConfig",
    "EventClock",
    "FeatureSlot",
    "FractionSplit",
    "FtrlConfig",
    "InitFrom",
    "JobConfig",
    "JoinConfig",
    "JoinedLabels",
    "KafkaData",
    "LabelConfig",
    "ModelSpec",
    "ParquetData",
    "PublishConfig",
    "SgdConfig",
    "SplitPolicy",
    "SyntheticData",
    "TableConfig",
    "TaskConfig",
    "TopologyConfig",
    "TrainingConfig",
    "read_job",
    "stored_config",
]
