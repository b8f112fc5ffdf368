"""Records no reader of a stream expects, for the tests and bench/nemesis.py that write them into a
running job's input: each with the start of the reason the dead-letter topic keeps."""

from __future__ import annotations

import msgpack

# The first two stopped a stream job before.
POISON = [
    (b'{"request_id": "p1", "ts": ' + b"9" * 400 + b"}", "field 'ts' (event time): expected seconds"),
    (b"[" * 2000 + b"]" * 2000, "not valid json: nested too deep"),
    (b'{"a":' * 3000 + b"1" + b"}" * 3000, "not valid json: nested too deep"),
    (b'{"request_id": "p4", "ts": 1e999}', "field 'ts' (event time): expected seconds"),
    (b'{"request_id": "\xff\xfe", "ts": 1}', "not valid json"),
    (msgpack.packb({"request_id": "p6", "ts": 1.0}), "not valid json"),
    (b"\x00\x01\x02" * 50, "not valid json"),
    (b'{"request_id": "p8", "ts": 1, "I1": ' + b"9" * 5000 + b"}", "not valid json"),
]
