"""A stream's low watermark (`complete_through`, stamped on each step by the data loader): every
impression of an earlier event time is in that step or one before it. Checked on a simulated
loader (the real joiner, pool and draws) against the impressions the test made."""

from __future__ import annotations

import numpy as np
import pytest

from trillium.data.sources.events import FIELD_SEP, Event, EventRows
from trillium.data.sources.joiner import PartitionJoin
from trillium.job import JobConfig
from trillium.job.data import JoinConfig
from trillium.services.data_loader.stream import complete_through, due_steps

WINDOW, LATENESS = 2.0, 0.5
TIMEOUT = 1.0  # data.batch_timeout_seconds: no sample waits in the pool longer


def _job() -> JobConfig:
    return JobConfig.model_validate(
        {
            "name": "low-watermark",
            "data": {"source": "kafka", "topics": ["events"], "event_time": "ts", "key": "id"},
            "slots": [{"name": "user", "column": "user"}],
            "tables": {"user": {"dim": 4}},
            "label": {"column": "click", "positive": "1", "negative": "0"},
            "model": {"cls": "trillium.models:DNN", "kwargs": {"num_dense": 0, "embedding_dims": [4]}},
            "training": {"batch_size": 8, "epochs": None, "staleness_bound": 0, "dense_optimizer": {"name": "sgd"}},
        }
    )


def _stream(rng: np.random.Generator, n: int) -> list[tuple[float, str, bool, float]]:
    """Events in arrival order: (arrival, key, is an impression, event time). Impressions 20 a
    second, each arriving up to LATENESS late; a third clicked, some after the window."""
    events = []
    for i in range(n):
        at = i / 20
        events.append((at + rng.uniform(0, LATENESS), f"k{i}", True, at))
        if rng.random() < 1 / 3:
            click = at + rng.uniform(0, 1.5 * WINDOW)
            events.append((click + rng.uniform(0, LATENESS), f"k{i}", False, click))
    return sorted(events)


@pytest.mark.parametrize("seed", range(4))
def test_every_impression_before_a_steps_stamp_was_sent_by_that_step(seed: int) -> None:
    rng = np.random.default_rng(seed)
    stream = _stream(rng, 3000)
    impressions = {key: t for _, key, is_impression, t in stream if is_impression}
    join = PartitionJoin(
        JoinConfig(impressions="i", labels="c", key="id", window_seconds=WINDOW, late_labels="correct")
    )
    rows, sent, stamps = EventRows(_job()), set(), []
    newest, watermark = -np.inf, -np.inf
    for start in range(0, len(stream), 37):  # a fetch at a time, as the loader takes them
        fetch = stream[start : start + 37]
        now = fetch[-1][0]  # the stream's clock: when the fetch's last event arrived
        for _, key, is_impression, t in fetch:
            if is_impression:
                join.impression(Event(FIELD_SEP.join(["u", "0"]), key, t))
            else:
                join.label(key, t)
            newest = max(newest, t)
        watermark = max(watermark, newest - LATENESS)
        decided = join.advance(watermark)
        rows.extend(decided.events, ["1" if p else "0" for p in decided.positive], decided.times)
        rows.arrived[len(rows) - len(decided.events) :] = [now] * len(decided.events)  # on the stream's clock
        steps = list(due_steps(rows, rng, step=16, pool=64, timeout=TIMEOUT, now=now))
        oldest = [min(step.times, default=np.inf) for step in steps]
        through = complete_through(watermark, oldest, min(rows.times, default=np.inf), WINDOW)
        for step, stamp in zip(steps, through, strict=True):
            sent.update(event.key for event in step.events)
            if stamp is None:
                continue
            missing = [key for key, t in impressions.items() if t < stamp and key not in sent]
            assert not missing, (stamp, missing[:5])
            stamps.append((stamp, watermark))
    # Not vacuous: the stamps keep up with the stream, a window and the pool's wait behind (a
    # stamp that stopped halfway would be 75 s behind by the end). The pool holds a row up to
    # TIMEOUT, and the watermark moves a fetch (about 1.4 s of the stream) at a time.
    assert len(stamps) > 100
    lags = [at - WINDOW - stamp for stamp, at in stamps[len(stamps) // 2 :]]
    assert 0.0 <= min(lags) and max(lags) < 5.0 and np.mean(lags) < 2.0, (min(lags), max(lags), np.mean(lags))


def test_a_round_of_steps_is_stamped_by_what_is_still_to_send() -> None:
    # Three steps of one round, oldest samples 5, 3 and 9; the pool keeps one of 7.
    assert complete_through(10.0, [5.0, 3.0, 9.0], 7.0, 1.0) == pytest.approx([2.0, 6.0, 6.0], abs=1e-12)
    assert complete_through(4.0, [5.0], np.inf, 1.0) == pytest.approx([3.0], abs=1e-12)  # the watermark bounds it
    assert complete_through(-np.inf, [5.0], 7.0, 1.0) == [None]  # no watermark yet
    assert complete_through(10.0, [], 7.0, 1.0) == []


def test_a_stamp_never_claims_the_impression_whose_window_end_made_it() -> None:
    # (t + window) - window rounds to t, or one ulp either side of it, at UNIX times too.
    rng = np.random.default_rng(0)
    for t in np.concatenate([rng.uniform(0, 10, 2000), rng.uniform(1.7e9, 1.8e9, 2000)]):
        window = float(rng.choice([2.0, 0.1, 600.0, 86400.0]))
        [stamp] = complete_through(np.inf, [np.inf], float(t + window), window)
        assert stamp <= t and t - stamp < 1e-6 * max(1.0, t)
