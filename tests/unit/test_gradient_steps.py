"""A step's gradients travel as one message per PS shard for all of an embedding worker's ranks (the
worker's side: tests/unit/test_native_worker.py): a shard takes each message once for all of the
ranks it holds (`_messages`), and applies no step past a missing one (`_take_complete`)."""

from __future__ import annotations

import numpy as np

from trillium.services.embedding_ps.server import _messages, _take_complete
from trillium.wire import codec
from trillium.wire.batch import GradientUpdate


def test_a_shard_applies_each_message_once_in_rank_order() -> None:
    def update(ranks: tuple[int, ...]) -> tuple[bytes, int, bool]:
        rows = (np.zeros(0, np.uint64), np.zeros((0, 4), np.float32))
        return codec.encode_gradients(GradientUpdate(ranks, 0, 0, 0, {"t": rows})), ranks[0], False

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
