"""Which jobs a forget reaches beyond its own (services/coordinator/forget.py::linked_jobs): those
warm-started from it and from those in turn, those publishing the same model (by its store and
name), and no other; a chain of links is followed, a cycle ends."""

from __future__ import annotations

from pathlib import Path

from tiny_record import tiny_record

from trillium.job.record import JobRecord
from trillium.job.schema import InitFrom, PublishConfig
from trillium.services.coordinator.forget import linked_jobs

RUN_DIR = Path("/var/lib/trillium")


def job(job_id: str, *, init_from: str | None = None, model: str | None = None, store: str | None = None) -> JobRecord:
    record = tiny_record("finished")
    config = record.config.model_copy(
        update={
            "init_from": InitFrom(job=init_from) if init_from else None,
            "publish": PublishConfig(model=model, dir=store) if model else None,
        }
    )
    return record.model_copy(update={"id": job_id, "config": config})


def test_a_forget_reaches_the_warm_starts_and_the_models_publishers_in_turn() -> None:
    origin = job("ads-1", model="ads")
    records = [
        origin,
        job("ads-2", init_from="ads-1"),  # warm-started from it
        job("ads-3", init_from="ads-2"),  # and from that one
        job("ads-4", model="ads"),  # the same model
        job("ads-5", init_from="ads-4"),  # warm-started from the other publisher
        job("ads-6", model="ads", store="s3://elsewhere/models"),  # a model of that name elsewhere
        job("feed-1", model="feed"),
        job("feed-2", init_from="feed-1"),
        job("ads-0"),  # the job origin started from: its rows are its own data's
    ]
    assert linked_jobs(records, origin, RUN_DIR) == {
        "ads-2": "warm-started from ads-1",
        "ads-3": "warm-started from ads-2",
        "ads-4": "publishes model ads, as ads-1 does",
        "ads-5": "warm-started from ads-4",
    }


def test_a_job_alone_reaches_nothing_and_a_cycle_ends() -> None:
    alone = job("solo-1")
    assert linked_jobs([alone, job("other-1", model="solo-1")], alone, RUN_DIR) == {}
    # Two jobs warm-started from each other (a record edited by hand): each is reached once.
    first, second = job("loop-1", init_from="loop-2"), job("loop-2", init_from="loop-1")
    assert linked_jobs([first, second], first, RUN_DIR) == {"loop-2": "warm-started from loop-1"}
