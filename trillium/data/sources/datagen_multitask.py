"""Multi-task feed data drawn from a planted model: impressions of items shown to users, each with
three objectives (a click, the seconds watched, a conversion), for multi-task models and grouped
metrics (issue 52; `trillium datagen --multitask`).

A row is one impression, written as CSV with a header:

    user, item, history, hour, item_age_days, click, watch_seconds, conversion

`history` is the user's recent items at that moment, `|`-separated, most recent first (a
`pooling: none` slot with `separator: "|"`). Users and items have power-law popularity; each item
has a category, each user a favourite category and latent tastes. Fixed by the seed:

    match    = the fraction of `history` in the item's category
    P(click) = sigmoid(b_click + a_u . q_i + user_bias_u + item_bias_i + beta * match
                       + h(hour) - 0.3 * log1p(item_age_days))
    log(watch_seconds) = mu + c_u . r_i + 0.8 * match + noise,   noise ~ N(0, watch_noise^2)
    P(conversion) = P(click) * sigmoid(b_conv + item_value_i + user_buyer_u)

A conversion needs a click (it is drawn only where the click was), the watch time is drawn for
every impression (a skipped item is watched a little). Knowing the planted probabilities gives
each binary task's Bayes-optimal AUC and GAUC (grouped by user), and the watch noise's variance is
the Bayes-optimal MSE of log(watch_seconds): the ceilings a trained model can approach.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trillium.data.sources.rows import Split

__all__ = ["MultitaskModel", "MultitaskReport", "MultitaskRows", "TaskCeiling", "generate_multitask"]

_SPLIT_STREAM = {"train": 1, "test": 2}  # stream 0 draws the model itself
_BLOCK_ROWS = 1 << 17  # rows drawn at a time
COLUMNS = ("user", "item", "history", "hour", "item_age_days", "click", "watch_seconds", "conversion")


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(stream, 52)))


def _zipf(rng: np.random.Generator, size: int, n: int, exponent: float) -> np.ndarray:
    """Indices in [0, size) with power-law popularity: the inverse CDF of density x^-a on
    [1, size + 1) (as the Criteo generator draws its IDs)."""
    e = 1.0 - exponent
    x = ((np.float64(size + 1) ** e - 1.0) * rng.random(n) + 1.0) ** (1.0 / e)
    return np.minimum(x.astype(np.int64), size) - 1


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


@dataclass(frozen=True, eq=False)
class MultitaskRows:
    """A block of impressions and the planted model's answers for them."""

    user: np.ndarray  # int64[n]
    item: np.ndarray  # int64[n]
    history: np.ndarray  # int64[n, history_len]
    hour: np.ndarray  # int64[n]: 0..23
    item_age_days: np.ndarray  # int64[n]
    click_prob: np.ndarray  # float64[n]
    conversion_prob: np.ndarray  # float64[n]: P(click and conversion)
    log_watch_mean: np.ndarray  # float64[n]: E[log(watch_seconds)]
    click: np.ndarray  # uint8[n]
    watch_seconds: np.ndarray  # float64[n], to the millisecond
    conversion: np.ndarray  # uint8[n]


@dataclass(frozen=True, eq=False)
class MultitaskModel:
    """The planted feed model; `create` makes one from a seed."""

    seed: int
    users: int
    items: int
    history_len: int
    zipf_exponent: float
    categories: int
    item_category: np.ndarray  # int64[items]
    user_favourite: np.ndarray  # int64[users]
    user_taste: np.ndarray  # float64[users, k]: a_u
    item_taste: np.ndarray  # float64[items, k]: q_i
    user_bias: np.ndarray
    item_bias: np.ndarray
    user_watch: np.ndarray  # float64[users, k]: c_u
    item_watch: np.ndarray  # float64[items, k]: r_i
    item_value: np.ndarray
    user_buyer: np.ndarray
    hour_effect: np.ndarray  # float64[24]: h(hour)
    click_bias: float
    conversion_bias: float
    beta: float = 2.0  # how much the history says about a click
    taste: float = 0.6  # P(a history item is from the user's favourite category)
    watch_mu: float = 2.5
    watch_noise: float = 0.5

    @classmethod
    def create(
        cls,
        seed: int = 0,
        *,
        users: int = 10_000,
        items: int = 50_000,
        categories: int = 20,
        history_len: int = 5,
        zipf_exponent: float = 1.1,
    ) -> MultitaskModel:
        for name, value, least in (("users", users, 1), ("items", items, 1), ("categories", categories, 2)):
            if value < least:
                raise ValueError(f"{name} must be >= {least}, got {value}")
        if history_len < 1:
            raise ValueError(f"history_len must be >= 1, got {history_len}")
        if zipf_exponent < 0.0 or zipf_exponent == 1.0:
            raise ValueError(f"zipf_exponent must be >= 0 and not 1 (0: uniform), got {zipf_exponent}")
        rng = _rng(seed, 0)
        k = 4
        return cls(
            seed=seed,
            users=users,
            items=items,
            history_len=history_len,
            zipf_exponent=zipf_exponent,
            categories=categories,
            item_category=rng.integers(0, categories, items),
            user_favourite=rng.integers(0, categories, users),
            user_taste=rng.normal(0.0, 0.6, (users, k)),
            item_taste=rng.normal(0.0, 0.6, (items, k)),
            user_bias=rng.normal(0.0, 0.5, users),
            item_bias=rng.normal(0.0, 0.5, items),
            user_watch=rng.normal(0.0, 0.5, (users, k)),
            item_watch=rng.normal(0.0, 0.5, (items, k)),
            item_value=rng.normal(0.0, 0.8, items),
            user_buyer=rng.normal(0.0, 0.8, users),
            hour_effect=0.4 * np.sin(np.arange(24) * (2 * np.pi / 24)),
            click_bias=-1.5,
            conversion_bias=-1.0,
        )

    def _history(self, user: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Each history item from the user's favourite category with probability `taste` (an item
        of that category drawn uniformly), else any item by popularity."""
        n = len(user)
        shape = (n, self.history_len)
        by_category = np.argsort(self.item_category, kind="stable")
        starts = np.searchsorted(self.item_category[by_category], np.arange(self.categories + 1))
        favourite = np.broadcast_to(self.user_favourite[user][:, None], shape)
        first, count = starts[favourite], starts[favourite + 1] - starts[favourite]
        liked = by_category[np.minimum(first + (rng.random(shape) * count).astype(np.int64), len(by_category) - 1)]
        liked = np.where(count > 0, liked, 0)  # a category with no item: any item stands in
        anything = _zipf(rng, self.items, n * self.history_len, self.zipf_exponent).reshape(shape)
        return np.where((rng.random(shape) < self.taste) & (count > 0), liked, anything)

    def sample(self, rows: int, split: Split = "train") -> list[MultitaskRows]:
        """`rows` impressions of `split` (an independent stream per split), in blocks."""
        rng = _rng(self.seed, _SPLIT_STREAM[split])
        return [self._block(min(_BLOCK_ROWS, rows - start), rng) for start in range(0, rows, _BLOCK_ROWS)]

    def _block(self, n: int, rng: np.random.Generator) -> MultitaskRows:
        user = _zipf(rng, self.users, n, self.zipf_exponent)
        item = _zipf(rng, self.items, n, self.zipf_exponent)
        history = self._history(user, rng)
        hour = rng.integers(0, 24, n)
        age = np.floor(rng.lognormal(1.5, 1.2, n)).astype(np.int64)
        match = (self.item_category[history] == self.item_category[item][:, None]).mean(axis=1)
        click_logit = (
            self.click_bias
            + np.einsum("nk,nk->n", self.user_taste[user], self.item_taste[item])
            + self.user_bias[user]
            + self.item_bias[item]
            + self.beta * match
            + self.hour_effect[hour]
            - 0.3 * np.log1p(age)
        )
        click_prob = _sigmoid(click_logit)
        buy_prob = _sigmoid(self.conversion_bias + self.item_value[item] + self.user_buyer[user])
        log_watch_mean = (
            self.watch_mu + np.einsum("nk,nk->n", self.user_watch[user], self.item_watch[item]) + 0.8 * match
        )
        click = (rng.random(n) < click_prob).astype(np.uint8)
        conversion = (click & (rng.random(n) < buy_prob)).astype(np.uint8)
        # To the millisecond, as written; never 0 s, whose log the regression could not take.
        watch = np.maximum(np.round(np.exp(log_watch_mean + rng.normal(0.0, self.watch_noise, n)), 3), 0.001)
        return MultitaskRows(
            user=user,
            item=item,
            history=history,
            hour=hour,
            item_age_days=age,
            click_prob=click_prob,
            conversion_prob=click_prob * buy_prob,
            log_watch_mean=log_watch_mean,
            click=click,
            watch_seconds=watch,
            conversion=conversion,
        )


@dataclass(frozen=True)
class TaskCeiling:
    """What the planted model itself scores on one task of the generated rows: the ceiling."""

    kind: str  # "binary" or "regression"
    positive_rate: float | None = None
    auc: float | None = None
    gauc: float | None = None  # grouped by user
    mse_log: float | None = None  # of log(watch_seconds), against its planted mean


@dataclass(frozen=True)
class MultitaskReport:
    path: Path
    rows: int
    users: int  # distinct users in the rows
    tasks: dict[str, TaskCeiling]


def _write_csv(path: Path, block: MultitaskRows, header: bool) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv

    history = pc.binary_join_element_wise(*(pa.array(col).cast(pa.string()) for col in block.history.T), "|")
    table = pa.table(
        [
            block.user,
            block.item,
            history,
            block.hour,
            block.item_age_days,
            block.click,
            block.watch_seconds,
            block.conversion,
        ],
        names=list(COLUMNS),
    )
    with path.open("ab") as f:
        pacsv.write_csv(table, f, pacsv.WriteOptions(include_header=header, quoting_style="none"))


def generate_multitask(
    path: str | Path,
    rows: int,
    seed: int = 0,
    *,
    split: Split = "train",
    users: int = 10_000,
    items: int = 50_000,
) -> MultitaskReport:
    """Write `rows` impressions of the planted feed model of `seed` as CSV (`COLUMNS`), and report
    each task's Bayes-optimal figures on them. The same seed always gives the same file; `split`
    `"test"` gives independent rows of the same model."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    model = MultitaskModel.create(seed, users=users, items=items)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    blocks = model.sample(rows, split)
    for i, block in enumerate(blocks):
        _write_csv(path, block, header=i == 0)

    def joined(name: str) -> np.ndarray:
        return np.concatenate([getattr(b, name) for b in blocks])

    # Here, not at the top: the data loader reads data through this package, and its image
    # carries no scikit-learn (the `train` extra).
    from trillium.metrics import auc, gauc

    user = joined("user")
    tasks = {}
    for task, prob in (("click", "click_prob"), ("conversion", "conversion_prob")):
        labels, probs = joined(task), joined(prob)
        tasks[task] = TaskCeiling("binary", float(labels.mean()), auc(labels, probs), gauc(labels, probs, user))
    residual = np.log(joined("watch_seconds")) - joined("log_watch_mean")
    tasks["watch_seconds"] = TaskCeiling("regression", mse_log=float(np.mean(residual**2)))
    return MultitaskReport(path=path, rows=rows, users=len(np.unique(user)), tasks=tasks)
