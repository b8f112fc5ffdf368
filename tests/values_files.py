"""An independent reader of the values files training publishes (native/README.md, "Values file
format"): what the serving tests check the native writer and the serving store against."""

from __future__ import annotations

import struct
import zlib

import numpy as np


def read_values(path):
    """An independent reader of the values format (native/README.md): (delta, {table: (ids, rows)})."""
    data = path.read_bytes()
    body, (crc,) = data[:-4], struct.unpack("<I", data[-4:])
    assert zlib.crc32(body) == crc
    magic, version, dtype, flags, reserved, ntables, _store_version = struct.unpack_from("<8sIBBHIQ", data, 0)
    assert (magic, version, reserved) == (b"TRLMVALS", 1, 0)
    vtype = {0: np.float32, 1: np.float16}[dtype]
    pos, tables = 28, {}
    for _ in range(ntables):
        (nlen,) = struct.unpack_from("<H", data, pos)
        name = data[pos + 2 : pos + 2 + nlen].decode()
        dim, rows = struct.unpack_from("<IQ", data, pos + 2 + nlen)
        pos += 2 + nlen + 12
        pad = -pos % 8  # the IDs start at a multiple of 8
        assert data[pos : pos + pad] == bytes(pad)
        pos += pad
        ids = np.frombuffer(data, "<u8", rows, pos)
        pos += 8 * rows
        vals = np.frombuffer(data, vtype, rows * dim, pos).reshape(rows, dim)
        pos += vals.nbytes
        assert (ids[1:] > ids[:-1]).all()
        tables[name] = (ids, vals)
    assert data[pos : pos + 8] == b"TRLMVEND"
    assert struct.unpack_from("<Q", data, pos + 8)[0] == sum(len(i) for i, _ in tables.values())
    assert pos + 20 == len(data)
    return bool(flags & 1), tables
