"""`trillium forget` with more IDs than one request holds: the client cuts them into requests
whose bodies each fit the coordinator's limit (as the API will measure them) and keep every ID,
in order, once."""

from __future__ import annotations

import json

import pytest

from trillium.config import API_MAX_BODY_BYTES as MAX_BODY_BYTES
from trillium.config import MAX_FORGET_VALUES
from trillium.stack.client import forget_batches


def _body(batch: list[str]) -> bytes:
    # What httpx sends for `json=`: the bytes the coordinator's BodyLimit counts.
    return json.dumps({"table": "a-table-name-of-a-fair-length", "values": batch}).encode()


@pytest.mark.parametrize(
    "values",
    [
        [f"user-{n:08d}" for n in range(100_000)],  # 1.6 MB of JSON: two requests
        [f"u{n}" for n in range(250_000)],  # short values: the count binds first
        ['"\\é' * 60 + str(n) for n in range(20_000)],  # escapes and non-ASCII grow in JSON
        ["one"],
    ],
)
def test_every_id_once_in_order_and_each_body_within_the_limit(values) -> None:
    batches = forget_batches(values)
    assert [v for batch in batches for v in batch] == values
    assert all(batch for batch in batches)
    assert all(len(_body(batch)) <= MAX_BODY_BYTES for batch in batches)
    assert all(len(batch) <= MAX_FORGET_VALUES for batch in batches)
    # No more requests than the bytes and the count need, but for one cut short at each.
    total = sum(len(json.dumps(v)) + 2 for v in values)
    assert len(batches) <= max(total // (MAX_BODY_BYTES // 2), len(values) // MAX_FORGET_VALUES) + 1


def test_a_hundred_thousand_ids_of_a_real_length_take_the_requests_their_bytes_need() -> None:
    values = [f"{n:016x}-{n:08d}" for n in range(100_000)]  # 27 bytes each in JSON, 2.7 MB
    assert len(b"".join(_body(batch) for batch in [values])) > MAX_BODY_BYTES
    assert len(forget_batches(values)) == 3
