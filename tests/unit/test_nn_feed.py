"""A rank's background tasks fail whoever waits on them the moment they die, and stop with what used them."""

from __future__ import annotations

import asyncio
import gc

import pytest

from trillium.data import load_job
from trillium.job import JobConfig
from trillium.models import Objective
from trillium.runtime.autobound import MAX_BOUND
from trillium.services.nn_worker.evaluate import score
from trillium.services.nn_worker.feed import (
    PREFETCH,
    PUSH_WINDOW,
    EpochEnd,
    GradientPusher,
    prefetch,
    push_window,
    started,
)
from trillium.stack import REPO_ROOT
from trillium.wire.pb import embedding_pb2 as pb


def _sender(answer):
    """A pusher's `send` over a fake stream: each request written at once, answered by `answer`."""

    async def send(request: pb.PushGradientsRequest) -> asyncio.Future:
        return asyncio.ensure_future(answer(request))

    return send


async def test_a_dead_push_loop_fails_the_wait_for_pushes_at_once() -> None:
    pushed = []

    async def answer(request: pb.PushGradientsRequest) -> None:
        if request.ref.batch_id == 2:
            raise ConnectionError("embedding worker gone")
        pushed.append(request.ref.batch_id)

    pusher = GradientPusher(_sender(answer)).run()
    for batch_id in range(5):
        pusher.put(pb.PushGradientsRequest(ref=pb.EmbeddingRef(worker="w", batch_id=batch_id)))
    with pytest.raises(RuntimeError, match="gradient pusher stopped: ConnectionError"):
        await asyncio.wait_for(pusher.join(), timeout=5)  # before, this waited forever
    assert pushed[:2] == [0, 1]
    await pusher.stop()


async def test_pushes_are_joined_in_order_when_all_goes_well() -> None:
    written, answered = [], []

    async def send(request: pb.PushGradientsRequest) -> asyncio.Future:
        written.append(request.ref.batch_id)

        async def answer() -> None:
            await asyncio.sleep(0.001 * (20 - request.ref.batch_id))
            answered.append(request.ref.batch_id)

        return asyncio.ensure_future(answer())

    pusher = GradientPusher(send).run()
    for batch_id in range(20):
        pusher.put(pb.PushGradientsRequest(ref=pb.EmbeddingRef(worker="w", batch_id=batch_id)))
    await asyncio.wait_for(pusher.join(), timeout=5)
    assert written == list(range(20))
    assert sorted(answered) == list(range(20))
    await pusher.stop()


async def test_pushes_overlap_up_to_the_window_and_join_waits_for_every_answer() -> None:
    # One at a time, a push cost its round trips a step; the rank's pushes now overlap.
    answers: list[asyncio.Future] = []

    async def send(request: pb.PushGradientsRequest) -> asyncio.Future:
        answers.append(asyncio.get_running_loop().create_future())
        return answers[-1]

    pusher = GradientPusher(send, window=4).run()
    for batch_id in range(10):
        pusher.put(pb.PushGradientsRequest(ref=pb.EmbeddingRef(worker="w", batch_id=batch_id)))
    joined = asyncio.ensure_future(pusher.join())
    for _ in range(10):
        await asyncio.sleep(0)
    assert len(answers) == 4  # the window: four written, unanswered
    for answered in range(10):
        assert not joined.done()
        answers[answered].set_result(None)
        for _ in range(10):
            await asyncio.sleep(0)
        assert len(answers) == min(10, answered + 5)
    await asyncio.wait_for(joined, timeout=5)
    await pusher.stop()


async def test_a_lookup_no_step_awaits_fails_without_noise_and_one_awaited_still_raises() -> None:
    # A rank whose step failed (or whose feed stopped) with lookups prefetched logged each of
    # them as "Task exception was never retrieved" when the stream they were on failed too.
    loop = asyncio.get_running_loop()
    logged: list[dict] = []
    loop.set_exception_handler(lambda _, context: logged.append(context))

    async def lookup() -> pb.BatchLookupResponse:
        await asyncio.sleep(0)
        raise ConnectionError("the lookup stream ended")

    left = started(lookup())
    awaited = started(lookup())
    await asyncio.wait({left, awaited})
    with pytest.raises(ConnectionError, match="stream ended"):
        await awaited  # whoever awaits a lookup still gets its error
    del left, awaited
    gc.collect()
    assert logged == []


class _EndedFeed:
    """A feed whose first epoch is over at once; it says whether it was stopped."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.stopped = False

    async def get(self) -> EpochEnd:
        if self.fail:
            raise RuntimeError("feed died")
        return EpochEnd(offset=0, epoch=0)

    async def stop(self) -> None:
        self.stopped = True


@pytest.mark.parametrize("fail", [False, True])
async def test_scoring_stops_its_feed_however_it_ends(fail: bool) -> None:
    # a feed left running kept its Kafka consumer polling (and, once the job's topics were
    # deleted, spinning on metadata) for the life of the NN worker
    feed = _EndedFeed(fail)

    async def scores(*_: object) -> None:
        raise AssertionError("an empty feed has nothing to score")

    if fail:
        with pytest.raises(RuntimeError, match="feed died"):
            await score(feed, scores, None, Objective.one_label())  # type: ignore[arg-type]
    else:
        scored = await score(feed, scores, None, Objective.one_label())  # type: ignore[arg-type]
        assert len(scored.labels) == len(scored.probs) == len(scored.batch_ids) == 0
    assert feed.stopped


def test_a_wide_job_keeps_fewer_lookups_ahead_and_never_none() -> None:
    adult = load_job(REPO_ROOT / "examples/adult/job.yaml")  # 8 slots of dim 8, batch 128, evaluation 1,024
    assert prefetch(adult, evaluation=False) == prefetch(adult, evaluation=True) == PREFETCH
    wide = adult.model_copy(update={"tables": {n: t.model_copy(update={"dim": 2048}) for n, t in adult.tables.items()}})
    assert wide.training.wire_dtype == "fp16"
    assert wide.embedding_batch_bytes(evaluation=False) == 128 * 8 * 2048 * 2  # 4 MiB: still 8 ahead
    assert prefetch(wide, evaluation=False) == PREFETCH
    assert wide.embedding_batch_bytes(evaluation=True) == 64 << 20  # fp32 batches of 1,024: one at a time
    assert prefetch(wide, evaluation=True) == 1
    wider = wide.model_copy(update={"training": wide.training.model_copy(update={"batch_size": 512})})
    assert prefetch(wider, evaluation=False) == 4  # 16 MiB a batch
    fp32 = wider.model_copy(update={"training": wider.training.model_copy(update={"wire_dtype": "fp32"})})
    assert prefetch(fp32, evaluation=False) == 2  # 32 MiB a batch


def test_training_keeps_as_many_lookups_ahead_as_the_bound_lets_run() -> None:
    adult = load_job(REPO_ROOT / "examples/adult/job.yaml")  # dim 8: 8 KiB a batch, no byte cap near

    def bound(k: int | str | None) -> JobConfig:
        return adult.model_copy(update={"training": adult.training.model_copy(update={"staleness_bound": k})})

    assert prefetch(bound(0), evaluation=False) == PREFETCH  # sync: the next ones wait at the embedding worker
    assert prefetch(bound(None), evaluation=False) == PREFETCH  # asynchronous: no bound to size it by
    assert prefetch(bound(16), evaluation=False) == 17
    assert prefetch(bound("auto"), evaluation=False) == MAX_BOUND + 1
    assert prefetch(bound(16), evaluation=True) == PREFETCH  # evaluation waits for no gradient
    wide = bound(16).model_copy(
        update={"tables": {n: t.model_copy(update={"dim": 2048}) for n, t in adult.tables.items()}}
    )
    assert prefetch(wide, evaluation=False) == 16  # 4 MiB a batch: PREFETCH_BYTES caps it


def test_a_wide_job_keeps_fewer_pushes_unanswered_and_never_none() -> None:
    adult = load_job(REPO_ROOT / "examples/adult/job.yaml")  # dim 8: 8 KiB of gradients a step
    assert push_window(adult) == PUSH_WINDOW
    wide = adult.model_copy(update={"tables": {n: t.model_copy(update={"dim": 2048}) for n, t in adult.tables.items()}})
    assert push_window(wide) == 16  # 4 MiB a step
    widest = wide.model_copy(update={"training": wide.training.model_copy(update={"batch_size": 8192})})
    assert widest.embedding_batch_bytes(evaluation=False) > 64 << 20
    assert push_window(widest) == 1
