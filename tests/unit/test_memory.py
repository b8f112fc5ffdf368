"""`keep_malloc_lean`, in a fresh interpreter each (glibc's malloc settings are per process):
threads share the capped arenas (glibc's `malloc_stats` lists them; uncapped, as a PS shard asks,
each has its own), and freed large buffers leave the RSS even after a larger one was freed first;
without it, neither holds. A data loader maps only blocks larger than its batch records, so the
buffers of each record reuse the heap's pages instead of faulting fresh ones in."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

PROGRAM = """
import ctypes, sys, threading
from trillium.runtime.memory import keep_malloc_lean
if sys.argv[1] == "lean":
    keep_malloc_lean()
elif sys.argv[1] == "lean, glibc's arenas":
    keep_malloc_lean(arenas=None)
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 1e6
start = rss_mb()
big = bytearray(20_000_000)
del big  # one large state encoded and dropped
buffers = [bytearray(1_000_000) for _ in range(60)]  # then 60 MB of checkpoint parts
held = bytearray(100)  # something small allocated after them, still alive
del buffers
print(rss_mb() - start)
go = threading.Barrier(8)
def work():
    go.wait()  # all at once: each finds the arenas in use
    held.extend(bytes(ctypes.create_string_buffer(4096)))
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
ctypes.CDLL("libc.so.6").malloc_stats()
"""


def _run(mode: str) -> tuple[float, int]:
    """(MB of RSS kept after freeing the buffers, arenas)"""
    done = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True)
    arenas = sum(line.startswith("Arena ") for line in done.stderr.splitlines())
    return float(done.stdout), arenas


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_a_lean_process_gives_freed_buffers_back_and_shares_its_arenas() -> None:
    kept, arenas = _run("glibc defaults")
    assert kept > 10 and arenas > 2
    kept, arenas = _run("lean")
    assert kept < 2 and arenas == 2
    kept, arenas = _run("lean, glibc's arenas")  # a PS shard's: its hot path's threads each have one
    assert kept < 2 and arenas > 2


FAULTS = """
import resource, sys
from trillium.runtime.memory import LOADER_MMAP_THRESHOLD, keep_malloc_lean
keep_malloc_lean(mmap_threshold=LOADER_MMAP_THRESHOLD if sys.argv[1] == "loader" else 128 * 1024)
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 1e6
held = [bytearray(1000) for _ in range(1000)]  # what else lives in the heap
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(100):
    record = bytearray(1_000_000)  # a batch record and its copies, 100 of them
    del record
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
state = bytearray(20_000_000)
grown = rss_mb()
del state  # a state above the threshold: mapped, so given back as it is freed
print(faults, grown - rss_mb())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_a_loader_reuses_the_pages_of_its_batch_records_and_maps_its_states() -> None:
    def run(mode: str) -> tuple[int, float]:
        out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True).stdout
        faults, given_back = out.split()
        return int(faults), float(given_back)

    lean_faults, lean_given_back = run("lean")
    loader_faults, loader_given_back = run("loader")
    assert lean_faults > 100 * 200  # each 1 MB record mapped afresh: 245 pages faulted in each time
    assert loader_faults < 1000  # the first record's pages, then the same ones again
    assert lean_given_back > 15 and loader_given_back > 15
