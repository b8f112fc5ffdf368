"""The ranks' scores as they cross to the other ranks (evaluate.encode, evaluate.decode): the
arrays come back as they were, and bytes that are not scores of that layout, a pickle among
them, are refused without being run. (Two ranks gathering: tests/unit/test_rendezvous.py.)"""

from __future__ import annotations

import pickle
from typing import Any

import msgpack
import numpy as np
import pytest

from trillium.services.nn_worker.evaluate import Scored, decode, encode
from trillium.wire.codec import CodecError

RAN: list[str] = []


def _scored(n: int, tasks: int | None = None) -> Scored:
    rng = np.random.default_rng(n)
    shape = (n,) if tasks is None else (n, tasks)
    labels = (rng.random(shape) < 0.4).astype(np.float32)
    labels[rng.random(shape) < 0.2] = np.nan  # a multi-task job's missing labels
    return Scored(
        labels,
        rng.random(shape, np.float32),
        rng.integers(0, 9, n, np.int64),
        rng.integers(0, 2**64, n, np.uint64, endpoint=False),  # hashed IDs: the high bits set
        rng.random(n) < 0.7,
    )


@pytest.mark.parametrize(("n", "tasks"), [(37, None), (12, 3), (0, None), (0, 2)])
def test_scores_come_back_as_they_were(n: int, tasks: int | None) -> None:
    scored = _scored(n, tasks)
    back = decode(encode(scored))
    for field, got, want in zip(Scored._fields, back, scored, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape, field
        np.testing.assert_array_equal(got, want, err_msg=field)  # NaN where NaN was


def _mark() -> None:
    RAN.append("unpickled")


class _Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (_mark, ())


def test_a_pickle_is_refused_and_never_run() -> None:
    assert pickle.loads(pickle.dumps(_Payload())) is None and RAN == ["unpickled"]  # what a pickle would do
    RAN.clear()
    with pytest.raises(CodecError, match="not msgpack|fields"):
        decode(pickle.dumps(_Payload()))
    assert RAN == []


def _altered(change) -> bytes:
    fields = msgpack.unpackb(encode(_scored(4)))
    change(fields)
    return msgpack.packb(fields)


@pytest.mark.parametrize(
    "raw",
    [
        encode(_scored(4))[:-1],  # cut short
        _altered(lambda f: f.pop("groups")),
        _altered(lambda f: f.update(code=[[1], b"x"])),
        _altered(lambda f: f.update(labels=[[4], f["labels"][1][:-4]])),  # bytes short
        _altered(lambda f: f.update(batch_ids=[[4, 1], f["batch_ids"][1]])),  # 2 dimensions
        _altered(lambda f: f.update(grouped=[[-4], f["grouped"][1]])),
        _altered(lambda f: f.update(probs=[[2, 2], f["probs"][1]])),  # not as labels
        _altered(lambda f: f.update(grouped=[[2], b"\x01\x00"])),  # another count of samples
        _altered(lambda f: f.update(labels="text")),
        msgpack.packb([1, 2]),
    ],
)
def test_bytes_that_are_not_scores_are_refused(raw: bytes) -> None:
    with pytest.raises(CodecError):
        decode(raw)
