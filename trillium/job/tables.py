"""An embedding table on the parameter servers: its dim and storage, initializer, optimizer,
admission policy, eviction (capacity, TTL) and disk tier (a RAM budget, rows beyond it on disk)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from .base import NonNegativeFloat, PositiveFloat, PositiveInt, Probability, Strict


class SgdConfig(Strict):
    name: Literal["sgd"]
    lr: NonNegativeFloat = 0.01
    weight_decay: NonNegativeFloat = 0.0


class AdagradConfig(Strict):
    """`acc += g*g; w -= lr * g / (sqrt(acc) + eps)`; rowwise: `acc += mean(g*g)` per row."""

    name: Literal["adagrad", "rowwise_adagrad"]
    lr: NonNegativeFloat = 0.01
    eps: PositiveFloat = 1e-8
    initial_accumulator: NonNegativeFloat = 0.0
    weight_decay: NonNegativeFloat = 0.0


class AdamConfig(Strict):
    """Adam with a per-row step count for the bias corrections (rows are updated sparsely)."""

    name: Literal["adam"]
    lr: NonNegativeFloat = 0.001
    beta1: Probability = 0.9
    beta2: Probability = 0.999
    eps: PositiveFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.0


class FtrlConfig(Strict):
    """FTRL-Proximal (McMahan et al. 2013); `alpha` is the learning rate."""

    name: Literal["ftrl"]
    alpha: PositiveFloat = 0.05
    beta: NonNegativeFloat = 1.0
    l1: NonNegativeFloat = 0.0
    l2: NonNegativeFloat = 0.0
    initial_accumulator: NonNegativeFloat = 0.0


EmbeddingOptimizerConfig = Annotated[SgdConfig | AdagradConfig | AdamConfig | FtrlConfig, Field(discriminator="name")]


class AdmissionOff(Strict):
    policy: Literal["off"]


class AdmissionProbability(Strict):
    """Admit a new ID into the table with this probability per sighting."""

    policy: Literal["probability"]
    probability: Annotated[float, Field(ge=0, le=1)]


class AdmissionThreshold(Strict):
    """Admit a new ID once a count-min sketch has seen it `threshold` times."""

    policy: Literal["threshold"]
    threshold: PositiveInt
    sketch_width: PositiveInt = 1 << 20
    sketch_depth: Annotated[int, Field(ge=1, le=16)] = 4


AdmissionConfig = Annotated[AdmissionOff | AdmissionProbability | AdmissionThreshold, Field(discriminator="policy")]


class TableConfig(Strict):
    """An embedding table on the parameter servers (rows created on first sight of an ID)."""

    dim: Annotated[int, Field(ge=1, le=1 << 16)]
    dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    initializer: Literal["uniform", "normal"] = "uniform"
    init_low: float = -0.01
    init_high: float = 0.01
    init_mean: float = 0.0
    init_std: NonNegativeFloat = 0.01
    optimizer: EmbeddingOptimizerConfig = Field(default_factory=lambda: SgdConfig(name="sgd"))
    weight_bound: PositiveFloat | None = None  # clip weights to [-bound, bound] after each update
    admission: AdmissionConfig = Field(default_factory=lambda: AdmissionOff(policy="off"))
    capacity: PositiveInt | None = None  # rows kept per table (least recently used evicted)
    ttl_seconds: Annotated[int, Field(ge=1, lt=1 << 31)] | None = None  # evict rows idle this long
    ttl_updates: Annotated[int, Field(ge=1, le=1 << 31)] | None = None  # ... or this many updates
    # The disk tier, both or neither: each PS shard keeps at most `memory_budget_gb` GiB of the
    # table's rows in RAM (the most recently looked up) and spills the rest, with their optimizer
    # state, to a file in the directory `disk` (a local SSD). Answers are those of the table all
    # in RAM; rows on disk are read back when a lookup or update needs them.
    memory_budget_gb: PositiveFloat | None = None
    disk: Annotated[str, Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _bounds(self) -> TableConfig:
        if self.init_low > self.init_high:
            raise ValueError(f"init_low ({self.init_low}) must be <= init_high ({self.init_high})")
        if (self.memory_budget_gb is None) != (self.disk is None):
            given, missing = ("memory_budget_gb", "disk") if self.disk is None else ("disk", "memory_budget_gb")
            raise ValueError(f"{given} needs {missing}: a disk tier is a RAM budget and a directory for the rest")
        return self

    def tier_kwargs(self) -> dict[str, Any]:
        """`create_table` keyword arguments of the table's disk tier on one PS shard (none without
        one). Apart from `store_kwargs`: a tier changes where rows live, never what they hold."""
        if self.memory_budget_gb is None:
            return {}
        return {"memory_budget_bytes": int(self.memory_budget_gb * (1 << 30)), "disk": self.disk}

    def store_kwargs(self, seed: int) -> dict[str, Any]:
        """Keyword arguments of `trillium_native.EmbeddingStore.create_table(name, **kwargs)`."""
        kwargs: dict[str, Any] = {
            "dim": self.dim,
            "dtype": self.dtype,
            "initializer": self.initializer,
            "init_low": self.init_low,
            "init_high": self.init_high,
            "init_mean": self.init_mean,
            "init_std": self.init_std,
            "seed": seed,
            "optimizer": self.optimizer.name,
            "weight_bound": self.weight_bound,
            "admission": self.admission.policy,
            "capacity": self.capacity,
            "ttl_seconds": self.ttl_seconds,
            "ttl_updates": self.ttl_updates,
        }
        opt = self.optimizer
        if isinstance(opt, FtrlConfig):
            kwargs.update(
                ftrl_alpha=opt.alpha,
                ftrl_beta=opt.beta,
                ftrl_l1=opt.l1,
                ftrl_l2=opt.l2,
                initial_accumulator=opt.initial_accumulator,
            )
        else:
            kwargs.update(opt.model_dump(exclude={"name"}))
        adm = self.admission
        if isinstance(adm, AdmissionProbability):
            kwargs["admission_probability"] = adm.probability
        elif isinstance(adm, AdmissionThreshold):
            kwargs.update(
                admission_threshold=adm.threshold,
                admission_sketch_width=adm.sketch_width,
                admission_sketch_depth=adm.sketch_depth,
            )
        return kwargs
