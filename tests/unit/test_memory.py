"""malloc arenas: threads started after `limit_malloc_arenas` share the capped arenas (glibc's
`malloc_stats` lists them), where without it each thread that allocates gets one of its own."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

PROGRAM = """
import ctypes, sys, threading
from trillium.runtime.memory import limit_malloc_arenas
if sys.argv[1] != "none":
    limit_malloc_arenas(int(sys.argv[1]))
held, go = [], threading.Barrier(8)
def work():
    go.wait()  # all at once: each finds the arenas in use
    held.append([ctypes.create_string_buffer(4096) for _ in range(200)])
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
ctypes.CDLL("libc.so.6").malloc_stats()
"""


def _arenas(limit: str) -> int:
    done = subprocess.run([sys.executable, "-c", PROGRAM, limit], capture_output=True, text=True, check=True)
    return sum(line.startswith("Arena ") for line in done.stderr.splitlines())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc arenas are glibc's")
def test_threads_share_the_capped_arenas() -> None:
    assert _arenas("none") > 2
    assert _arenas("2") == 2
