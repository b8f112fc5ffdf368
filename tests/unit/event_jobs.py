"""The Kafka events job of the event decoding tests (test_events.py, test_events_batch.py): a
nested slot, a multi-valued one, dense columns and the label, read from one topic."""

from __future__ import annotations

from trillium.job import JobConfig


def events_job(dense: tuple[str, ...] = ("price",), **data) -> JobConfig:
    """The job of events on topic `events` keyed by `id` at `ts`, with these dense columns; `data`: more of its data."""
    return JobConfig.model_validate(
        {
            "name": "events",
            "data": {"source": "kafka", "topics": ["events"], "event_time": "ts", "key": "id"} | data,
            "slots": [
                {"name": "user", "column": "user.id"},
                {"name": "recent", "column": "user.recent", "pooling": "mean", "max_len": 3},
            ],
            "tables": {"user": {"dim": 4}, "recent": {"dim": 4}},
            "dense": [{"column": column, "normalization": "standard"} for column in dense],
            "label": {"column": "click", "positive": "1", "negative": "0"},
            "model": {"cls": "trillium.models:DNN", "kwargs": {"num_dense": len(dense), "embedding_dims": [4, 4]}},
            "training": {"batch_size": 8, "epochs": None, "staleness_bound": 0, "dense_optimizer": {"name": "sgd"}},
        }
    )
