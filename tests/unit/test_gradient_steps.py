"""A step's gradients travel as one message per PS shard for all of an embedding worker's ranks:
the worker holds each rank's push until the last one's comes (`push_gradients`), and a shard
takes each message once for all of the ranks it holds (`_messages`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from trillium.services.embedding_ps.server import _messages, _take_complete
from trillium.services.embedding_worker.server import EmbeddingWorker
from trillium.wire.batch import EmbeddingRef, GradientUpdate


def _context(ranks: list[int], nn_ranks: int) -> SimpleNamespace:
    topology = SimpleNamespace(nn_ranks=nn_ranks)
    return SimpleNamespace(ranks=ranks, steps={}, job=SimpleNamespace(config=SimpleNamespace(topology=topology)))


def _worker(sent: list, fail: Exception | None = None, deliveries: list | None = None) -> EmbeddingWorker:
    """A worker whose sends are recorded; each step's two messages are durable at once, or, with
    `deliveries`, when the test resolves the futures put there."""
    worker = EmbeddingWorker.__new__(EmbeddingWorker)

    async def produce(ctx, step_id, epoch, step) -> list[asyncio.Future]:
        sent.append((step_id, sorted(step.ranks), step.publish))
        if fail is not None:
            raise fail
        loop = asyncio.get_running_loop()
        acks = [loop.create_future() for _ in range(2)]
        if deliveries is None:
            for ack in acks:
                ack.set_result(None)
        else:
            deliveries.extend(acks)
        return acks

    worker.produce_gradients = produce  # type: ignore[method-assign]
    return worker


def _push(worker: EmbeddingWorker, ctx, rank: int, step: int, publish: bool = False):
    """A rank's push as the servicer answers it: queued, then its messages once durable."""
    ref = EmbeddingRef("embedding_worker-0", rank, step * ctx.job.config.topology.nn_ranks + rank, 0)

    async def push() -> int:
        sent = await worker.push_gradients(ctx, ref, f"plan {rank}", {}, publish=publish)  # type: ignore[arg-type]
        return await asyncio.shield(sent)

    return asyncio.create_task(push())


async def test_a_step_goes_out_once_every_rank_has_pushed_it() -> None:
    sent: list = []
    worker, ctx = _worker(sent), _context([0, 1], 2)
    first = _push(worker, ctx, 0, 0)
    await asyncio.sleep(0.01)
    assert not first.done() and sent == []  # rank 1 has not pushed step 0 yet
    second = _push(worker, ctx, 1, 0, publish=True)
    assert await first == await second == 2
    assert sent == [(0, [0, 1], True)] and ctx.steps == {}  # one send for both, the publish cut kept


async def test_a_worker_of_one_rank_sends_each_push_at_once() -> None:
    sent: list = []
    worker, ctx = _worker(sent), _context([1], 2)  # the second of two workers: rank 1 only
    assert await _push(worker, ctx, 1, 5) == 2
    assert sent == [(5, [1], False)]


async def test_a_failed_send_fails_every_ranks_push_of_the_step() -> None:
    worker, ctx = _worker([], fail=RuntimeError("broker away")), _context([0, 1], 2)
    pushes = [_push(worker, ctx, 0, 0), _push(worker, ctx, 1, 0)]
    for push in pushes:
        with pytest.raises(RuntimeError, match="broker away"):
            await push


async def test_a_push_whose_stream_ends_leaves_the_others_waiting_for_the_step() -> None:
    sent: list = []
    worker, ctx = _worker(sent), _context([0, 1, 2], 3)
    gone, waiting = _push(worker, ctx, 0, 0), _push(worker, ctx, 1, 0)
    await asyncio.sleep(0.01)
    gone.cancel()
    await asyncio.sleep(0.01)
    assert await _push(worker, ctx, 2, 0) == 2 and await waiting == 2
    assert sent == [(0, [0, 1, 2], False)]


async def _turns() -> None:
    """Enough turns of the loop for the acks' callbacks to reach the answers."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_push_returns_once_queued_and_its_answer_waits_for_the_acks() -> None:
    # The next step is queued while the one before is unacknowledged: a rank's round trips to
    # Kafka overlap, in step order.
    sent: list = []
    acks: list[asyncio.Future] = []
    worker, ctx = _worker(sent, deliveries=acks), _context([0], 1)
    answers = []
    for step in range(3):
        ref = EmbeddingRef("embedding_worker-0", 0, step, 0)
        answers.append(await worker.push_gradients(ctx, ref, "plan", {}))  # type: ignore[arg-type]
    assert [s for s, _, _ in sent] == [0, 1, 2]
    assert not any(answer.done() for answer in answers)
    acks[0].set_result(None)
    await _turns()
    assert not answers[0].done()  # one of step 0's two messages is durable
    acks[1].set_result(None)
    await _turns()
    assert answers[0].result() == 2 and not answers[1].done()
    acks[3].set_exception(RuntimeError("broker away"))
    await _turns()
    with pytest.raises(RuntimeError, match="broker away"):
        answers[1].result()


def test_a_shard_applies_each_message_once_in_rank_order() -> None:
    def update(ranks: tuple[int, ...]) -> tuple[GradientUpdate, int, bool]:
        rows = (np.zeros(0, np.uint64), np.zeros((0, 4), np.float32))
        return GradientUpdate(ranks, 0, 0, 0, {"t": rows}), ranks[0], False

    merged, alone = update((0, 2)), update((1,))  # two workers: ranks 0 and 2 on one, 1 on the other
    step = {2: merged, 1: alone, 0: merged}
    assert _messages(step) == [merged, alone]


def test_a_shard_applies_no_step_past_a_missing_one() -> None:
    # Pushes overlap, so a step whose send failed can be followed by later ones on the topic.
    pending: dict[int, dict[int, str]] = {4: {0: "a", 1: "b"}, 6: {0: "c", 1: "d"}, 7: {0: "e"}}
    complete: list = []
    assert _take_complete(pending, 4, 2, complete) == 5
    assert [step for step, _ in complete] == [4]  # 6 waits for 5; 7 lacks rank 1
    assert _take_complete(pending, 5, 2, complete) == 5 and len(complete) == 1
    pending[5] = {0: "f", 1: "g"}
    assert _take_complete(pending, 5, 2, complete) == 7
    assert [step for step, _ in complete] == [4, 5, 6] and pending == {7: {0: "e"}}


def test_a_step_sent_again_is_taken_for_the_ledger_to_count() -> None:
    pending: dict[int, dict[int, str]] = {2: {0: "again"}}
    complete: list = []
    assert _take_complete(pending, 9, 1, complete) == 9
    assert complete == [(2, {0: "again"})]
