"""The joiner of a multi-task job (trillium.data.sources.task_joiner): on random streams its samples
and corrections are what an oracle computes from the whole stream at once (each impression one
sample with the labels at or before its shortest window's end, each later label in its window one
correction of its task); its state survives a checkpoint mid-stream; the schema refuses what it
cannot join; the encoder reads a joined sample's labels per task."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import msgpack
import numpy as np
import pytest
from pydantic import ValidationError

from trillium.data import load_job
from trillium.data.features import Encoder, TextCells
from trillium.data.sources.events import FIELD_SEP, Event
from trillium.data.sources.task_joiner import PartitionTaskJoin
from trillium.job import JobConfig

DATA = Path(__file__).resolve().parents[1] / "data"
WINDOWS = {"click": 30.0, "conversion": 300.0}
TASKS = list(WINDOWS)


def joined_job(**join) -> JobConfig:
    """tests/data/tiny_multitask_job.yaml as a stream: a click and a conversion, each joined from
    its own topic (30 s and 5 min windows)."""
    raw = load_job(DATA / "tiny_multitask_job.yaml").model_dump(mode="json", exclude_none=True)
    raw["labels"] = [{"name": "click", "column": "click"}, {"name": "conversion", "column": "conversion"}]
    raw["model"]["kwargs"]["tasks"] = TASKS
    raw["dense"] = [{"column": "item_age_days", "normalization": "log1p"}]
    raw["evaluation"] = {}
    raw["data"] = {
        "source": "kafka",
        "join": {
            "impressions": "imps",
            "key": "id",
            "labels": [{"topic": f"{t}s", "task": t, "window_seconds": w} for t, w in WINDOWS.items()],
        }
        | join,
        "event_time": "ts",
    }
    raw["training"] |= {"epochs": None}
    return JobConfig.model_validate(raw)


def stream(
    rng: np.random.Generator, n: int, disorder: float, conversions_within: float
) -> list[tuple[str, int | None, str, float]]:
    """(kind, task, key, time) in arrival order: impressions a second apart, clicks on a third of
    them 0-40 s later, conversions on a third of those 5 s to `conversions_within` later, each
    label once; arrival order is event time plus up to `disorder` s of jitter.

    (A label after an impression's last window, 300 s or 600 s correcting late labels, finds it
    forgotten or not as the watermark has moved: none comes so late.)"""
    events = []
    for i in range(n):
        key, t = f"k{i}", float(i)
        events.append(("impression", None, key, t))
        if rng.random() < 1 / 3:
            events.append(("label", 0, key, t + rng.uniform(0, 40)))
            if rng.random() < 1 / 3:
                events.append(("label", 1, key, t + rng.uniform(5, conversions_within)))
    events.append(("label", 1, "nowhere", 10.0))  # no such impression: unmatched
    arrival = np.array([t for *_, t in events]) + rng.uniform(0, disorder, len(events))
    return [events[i] for i in np.argsort(arrival, kind="stable")]


def oracle(events, correct: bool) -> tuple[Counter, Counter]:
    """The samples (key, labels, time) and corrections (key, task, time) the whole stream makes,
    with the join's counts per task."""
    first = min(WINDOWS.values())
    shown = {key: t for kind, _, key, t in events if kind == "impression"}
    out: Counter = Counter()
    counts: Counter = Counter()
    labels: dict[str, dict[int, float]] = {}
    for kind, task, key, t in events:
        if kind == "label":
            if key not in shown:
                counts[TASKS[task], "unmatched_labels"] += 1
                continue
            window, shown_at = WINDOWS[TASKS[task]], shown[key]
            t = max(t, shown_at)
            if t > shown_at + window:
                counts[TASKS[task], "late_labels"] += 1
                if not (correct and t <= shown_at + 2 * window):
                    continue
            labels.setdefault(key, {})[task] = t
    for key, shown_at in shown.items():
        end = shown_at + first
        mine = labels.get(key, {})
        out["sample", key, tuple("1" if mine.get(k, np.inf) <= end else "0" for k in range(len(TASKS))), end] += 1
        for task, t in mine.items():
            if t <= end:
                counts[TASKS[task], "in_sample"] += 1
            else:
                counts[TASKS[task], "corrections"] += 1
                out["correction", key, tuple("1" if k == task else "" for k in range(len(TASKS))), t] += 1
    return out, counts


def run(join: PartitionTaskJoin, events, disorder: float, *, cut: int | None = None) -> list:
    """The samples the join hands out, fed in arrival order with the watermark at the latest
    event time less the disorder; at `cut`, its state through msgpack into a new join."""
    out, latest = [], -np.inf
    for i, (kind, task, key, t) in enumerate(events):
        if i == cut:
            state = msgpack.unpackb(msgpack.packb(join.state()), strict_map_key=False)
            join = PartitionTaskJoin.from_state(joined_job(), state)
        if kind == "impression":
            join.impression(Event(f"v{key}", key, t))
        else:
            join.label(task, key, t)
        latest = max(latest, t)
        out += _samples(join.advance(latest - disorder))
    return out + _samples(join.advance(np.inf)), join


def _samples(decided) -> list:
    return [
        ("correction" if c else "sample", e.key, tuple(labels), t)
        for e, labels, t, c in zip(decided.events, decided.labels, decided.times, decided.corrections, strict=True)
    ]


@pytest.mark.parametrize("late_labels", ["count", "correct"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_impression_is_one_sample_and_each_later_label_in_its_window_one_correction(seed, late_labels) -> None:
    rng = np.random.default_rng(seed)
    events = stream(rng, 600, disorder=5.0, conversions_within=450 if late_labels == "correct" else 299)
    job = joined_job(late_labels=late_labels)
    out, join = run(PartitionTaskJoin(job), events, disorder=5.0)
    expected, counts = oracle(events, late_labels == "correct")
    assert Counter(out) == expected
    times = [t for *_, t in out]
    assert times == sorted(times), "samples leave in the order of their decisions"
    for task, mine in join.task_counts.items():
        for name in ("in_sample", "corrections", "late_labels", "unmatched_labels"):
            assert mine[name] == counts[task, name], (task, name)
    assert join.counts == Counter(impressions=600, samples=600)
    assert join.tracked_count == 0
    assert sum(1 for kind, *_ in out if kind == "correction") > 10  # the stream has corrections to check


def test_a_checkpoint_mid_stream_changes_nothing_that_comes_out() -> None:
    events = stream(np.random.default_rng(5), 400, disorder=5.0, conversions_within=299)
    whole, _ = run(PartitionTaskJoin(joined_job()), events, disorder=5.0)
    for cut in (1, len(events) // 3, len(events) - 2):
        resumed, join = run(PartitionTaskJoin(joined_job()), events, disorder=5.0, cut=cut)
        assert resumed == whole
        assert join.counts == Counter(impressions=400, samples=400)


def test_the_cap_bounds_the_tracked_impressions_of_the_longest_window() -> None:
    job = joined_job(max_open_per_partition=50)
    join = PartitionTaskJoin(job)
    samples = 0
    for i in range(1000):  # an impression a second: 300 s of conversion window would track 300
        join.impression(Event("v", f"k{i}", float(i)))
        samples += len(join.advance(i - 1.0).events)
        assert join.tracked_count <= 50
    assert join.counts["dropped_early"] > 0 and "closed_early" not in join.counts
    assert samples + len(join.advance(np.inf).events) == 1000


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda raw: raw["data"]["join"].update(window_seconds=10), "each entry of data.join.labels has its own"),
        (lambda raw: raw["data"]["join"]["labels"].pop(), "task 'conversion': no label topic"),
        (lambda raw: raw["data"]["join"]["labels"][1].update(task="click"), "task 'click' has two label topics"),
        (lambda raw: raw["data"]["join"]["labels"][1].update(topic="imps"), "topic 'imps' is named twice"),
        (lambda raw: raw["data"]["join"]["labels"][1].update(task="like"), "task 'like' is not in labels"),
        (lambda raw: raw["labels"][1].update(mask="click"), "the joiner sets a joined task's label"),
        (
            lambda raw: raw["labels"][1].update(kind="regression", loss="mse"),
            "task 'conversion': a joined task is binary",
        ),
        (
            lambda raw: raw["data"]["join"].update(labels="clicks", window_seconds=30),
            "a multi-task job's join names each task's label topic",
        ),
    ],
)
def test_the_schema_refuses_a_join_it_cannot_make_naming_why(change, says) -> None:
    raw = joined_job().model_dump(mode="json", exclude_none=True)
    change(raw)
    with pytest.raises(ValidationError, match=says):
        JobConfig.model_validate(raw)


def test_a_one_label_job_names_one_label_topic() -> None:
    raw = joined_job().model_dump(mode="json", exclude_none=True)
    raw["label"] = {"column": "click", "positive": "1"}
    del raw["labels"]
    raw["model"] = {"cls": "trillium.models:DNN", "kwargs": {"num_dense": 1, "embedding_dims": [4, 8, 8, 4]}}
    with pytest.raises(ValidationError, match="a topic per task is for a multi-task job"):
        JobConfig.model_validate(raw)


def test_the_encoder_reads_a_joined_samples_labels_task_by_task() -> None:
    job = joined_job()
    paths = [s.column for s in job.slots] + [d.column for d in job.dense]
    text = FIELD_SEP.join(["u1", "i1", "i2", "3", "2.0"])
    labels = [("1", "0"), ("", "1"), ("0", "0")]
    cells = TextCells.of_rows(job, [text] * 3, FIELD_SEP, paths, labels)
    encoder = Encoder(job, {})
    checked = encoder.check_cells(cells, lambda i: (i, ""), file="kafka")
    assert not checked.bad
    got = encoder.encode_cells(cells, checked).labels
    np.testing.assert_array_equal(got, np.array([[1, 0], [np.nan, 1], [0, 0]], np.float32))


def test_the_online_multitask_example_joins_a_topic_per_task() -> None:
    job = load_job(DATA.parent.parent / "examples/multitask/online.yaml")
    assert job.data.join.per_task and job.data.join.sample_window == 600
    assert job.data.input_topics == ["feed-impressions", "feed-clicks", "feed-conversions"]
    join = PartitionTaskJoin(job)
    assert join.tasks == ["click", "conversion"]
