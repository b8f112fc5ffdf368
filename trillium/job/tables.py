"""An embedding table on the parameter servers: its dim and storage, initializer, optimizer,
admission policy, eviction (capacity, TTL) and disk tier (a RAM budget, rows beyond it on disk)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from .base import NonNegativeFloat, PositiveFloat, PositiveInt, Probability, Strict


class SgdConfig(Strict):
    """`w -= lr * g`, for the rows a step touched."""

    name: Literal["sgd"]
    """`sgd`."""
    lr: NonNegativeFloat = 0.01
    """The learning rate."""
    weight_decay: NonNegativeFloat = 0.0
    """L2 penalty."""


class AdagradConfig(Strict):
    """`acc += g*g; w -= lr * g / (sqrt(acc) + eps)`; rowwise: `acc += mean(g*g)` per row."""

    name: Literal["adagrad", "rowwise_adagrad"]
    """`adagrad` (an accumulator per value) or `rowwise_adagrad` (one per row: less state)."""
    lr: NonNegativeFloat = 0.01
    """The learning rate."""
    eps: PositiveFloat = 1e-8
    """Added to the denominator."""
    initial_accumulator: NonNegativeFloat = 0.0
    """The accumulator of a new row."""
    weight_decay: NonNegativeFloat = 0.0
    """L2 penalty."""


class AdamConfig(Strict):
    """Adam with a per-row step count for the bias corrections (rows are updated sparsely)."""

    name: Literal["adam"]
    """`adam`."""
    lr: NonNegativeFloat = 0.001
    """The learning rate."""
    beta1: Probability = 0.9
    """The decay of the gradient's running mean."""
    beta2: Probability = 0.999
    """The decay of the squared gradient's running mean."""
    eps: PositiveFloat = 1e-8
    """Added to the denominator."""
    weight_decay: NonNegativeFloat = 0.0
    """L2 penalty."""


class FtrlConfig(Strict):
    """FTRL-Proximal (McMahan et al. 2013); `alpha` is the learning rate."""

    name: Literal["ftrl"]
    """`ftrl`."""
    alpha: PositiveFloat = 0.05
    """The learning rate."""
    beta: NonNegativeFloat = 1.0
    """Smooths the per-value learning rate early on."""
    l1: NonNegativeFloat = 0.0
    """L1 regularization: weights below it in magnitude are exactly 0 (sparse models)."""
    l2: NonNegativeFloat = 0.0
    """L2 regularization."""
    initial_accumulator: NonNegativeFloat = 0.0
    """The squared-gradient sum of a new row."""


EmbeddingOptimizerConfig = Annotated[SgdConfig | AdagradConfig | AdamConfig | FtrlConfig, Field(discriminator="name")]


class AdmissionOff(Strict):
    """Every ID gets a row at its first sighting."""

    policy: Literal["off"]
    """`off`."""


class AdmissionProbability(Strict):
    """Admit a new ID into the table with this probability per sighting."""

    policy: Literal["probability"]
    """`probability`."""
    probability: Annotated[float, Field(ge=0, le=1)]
    """The chance a sighting of a new ID admits it; until then it reads as zeros."""


class AdmissionThreshold(Strict):
    """Admit a new ID once a count-min sketch has seen it `threshold` times."""

    policy: Literal["threshold"]
    """`threshold`."""
    threshold: PositiveInt
    """Sightings before a new ID gets a row; until then it reads as zeros."""
    sketch_width: PositiveInt = 1 << 20
    """Counters a row of the sketch (its memory: width x depth x 4 bytes)."""
    sketch_depth: Annotated[int, Field(ge=1, le=16)] = 4
    """Rows of the sketch (more: fewer IDs counted too high)."""


AdmissionConfig = Annotated[AdmissionOff | AdmissionProbability | AdmissionThreshold, Field(discriminator="policy")]


class TableConfig(Strict):
    """An embedding table on the parameter servers (rows created on first sight of an ID)."""

    dim: Annotated[int, Field(ge=1, le=1 << 16)]
    """Values a row."""
    dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    """How the PS stores a row's values (the optimizer's state stays fp32)."""
    initializer: Literal["uniform", "normal"] = "uniform"
    """How a new row's values are drawn (from the ID and the seed: the same on every shard)."""
    init_low: float = -0.01
    """`uniform`'s lower bound."""
    init_high: float = 0.01
    """`uniform`'s upper bound."""
    init_mean: float = 0.0
    """`normal`'s mean."""
    init_std: NonNegativeFloat = 0.01
    """`normal`'s standard deviation."""
    optimizer: EmbeddingOptimizerConfig = Field(default_factory=lambda: SgdConfig(name="sgd"))
    """The rows' optimizer, by `name`: `sgd`, `adagrad`, `rowwise_adagrad`, `adam` or `ftrl`."""
    weight_bound: PositiveFloat | None = None
    """Clip the values to [-bound, bound] after each update."""
    admission: AdmissionConfig = Field(default_factory=lambda: AdmissionOff(policy="off"))
    """When a new ID gets a row, by `policy`: `off` (at once), `probability` or `threshold`."""
    capacity: PositiveInt | None = None
    """Rows kept per table; the least recently used are evicted."""
    ttl_seconds: Annotated[int, Field(ge=1, lt=1 << 31)] | None = None
    """Evict rows idle this long."""
    ttl_updates: Annotated[int, Field(ge=1, le=1 << 31)] | None = None
    """Evict rows not updated in this many of the table's updates."""
    memory_budget_gb: PositiveFloat | None = None
    """The disk tier's RAM (with `disk`): each PS shard keeps at most this many GiB of the table's
    rows in RAM (the most recently looked up) and spills the rest, with their optimizer state, to
    `disk`. Answers are those of the table all in RAM."""
    disk: Annotated[str, Field(min_length=1)] | None = None
    """The disk tier's directory (with `memory_budget_gb`), on a local SSD, under
    `TRILLIUM_ALLOWED_PATHS`; rows there are read back when a lookup or update needs them."""
    ids: Literal["shared", "per_slot"] = "shared"
    """The ID space of the slots reading the table: `shared`, one value one ID and one row,
    whichever slot reads it (an item in a history and as the target); `per_slot`, each slot hashes
    its values apart, so the same value in two slots is two rows. A job stored by an earlier
    Trillium, which hashed within the slot, reads as `per_slot` (`stored_config`)."""

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


def stored_config(raw: Any) -> Any:
    """A job config as stored with a job, a checkpoint or a model version: one stored by a Trillium
    before tables had `ids` (and hashed every slot's IDs within the slot) reads as it trained,
    its tables `per_slot`. One stored since names every table's `ids`."""
    if not isinstance(raw, dict) or not isinstance(raw.get("tables"), dict):
        return raw
    tables = raw["tables"]
    if all(not isinstance(t, dict) or "ids" in t for t in tables.values()):
        return raw
    return {
        **raw,
        "tables": {name: {"ids": "per_slot", **t} if isinstance(t, dict) else t for name, t in tables.items()},
    }
