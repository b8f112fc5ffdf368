"""`keep_malloc_lean`, in a fresh interpreter each (glibc's malloc settings are per process):
threads share the capped arenas (glibc's `malloc_stats` lists them; uncapped, as a PS shard asks,
each has its own), and freed large buffers leave the RSS even after a larger one was freed first;
without it, neither holds. An NN rank caps its arenas alone, glibc tuning its thresholds. A data
loader, a PS shard and an embedding worker map only blocks larger than their hot path's buffers
and keep as much free heap as those take, so each step's buffers reuse the heap's pages instead
of faulting fresh ones in. `collect_cycles_less_often` leaves a stream's window of live events to
the young generation, and still collects a garbage cycle."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from trillium.runtime.memory import (
    EMBEDDING_WORKER_MMAP_THRESHOLD,
    EMBEDDING_WORKER_TRIM_THRESHOLD,
    LOADER_MMAP_THRESHOLD,
    MMAP_THRESHOLD,
    PS_MMAP_THRESHOLD,
    PS_TRIM_THRESHOLD,
    YOUNG_COLLECTION_THRESHOLD,
)

PROGRAM = """
import ctypes, sys, threading
from trillium.runtime.memory import keep_malloc_lean
if sys.argv[1] == "lean":
    keep_malloc_lean()
elif sys.argv[1] == "lean, glibc's arenas":
    keep_malloc_lean(arenas=None)
elif sys.argv[1] == "lean, glibc's thresholds":
    keep_malloc_lean(mmap_threshold=None)
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
    kept, arenas = _run("lean, glibc's thresholds")  # an NN rank's: each job's threads share two arenas
    assert kept > 10 and arenas == 2


FAULTS = """
import resource, sys
from trillium.runtime.memory import keep_malloc_lean
mmap_threshold, trim_threshold, block, blocks = (int(a) for a in sys.argv[1:])
if mmap_threshold:  # else glibc's own, moving thresholds
    keep_malloc_lean(mmap_threshold=mmap_threshold, trim_threshold=trim_threshold)
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 1e6
held = [bytearray(1000) for _ in range(1000)]  # what else lives in the heap
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    buffers = [bytearray(block) for _ in range(blocks)]  # a step's buffers, all freed after it
    del buffers
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
state = bytearray(40_000_000)
grown = rss_mb()
del state  # a state above the threshold: mapped, so given back as it is freed
print(faults, grown - rss_mb())
"""


def _faults(mmap_threshold: int, block: int, blocks: int, trim_threshold: int | None = None) -> tuple[int, float]:
    """(page faults over 20 steps that each allocate and free `blocks` buffers of `block` bytes,
    MB of RSS given back when a 40 MB state is freed after them); `mmap_threshold` 0: glibc's own"""
    args = [str(a) for a in (mmap_threshold, trim_threshold or mmap_threshold, block, blocks)]
    out = subprocess.run([sys.executable, "-c", FAULTS, *args], capture_output=True, text=True, check=True).stdout
    faults, given_back = out.split()
    return int(faults), float(given_back)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_hot_path_buffers_reuse_the_heaps_pages_and_states_are_still_given_back() -> None:
    def pages(block: int, blocks: int) -> int:  # a step's buffers, in pages
        return block * blocks // 4096

    lean = _faults(MMAP_THRESHOLD, 1_000_000, 1)  # each 1 MB buffer mapped afresh, every step
    assert lean[0] > 0.8 * 20 * pages(1_000_000, 1)
    loader = _faults(LOADER_MMAP_THRESHOLD, 1_000_000, 1)  # a batch record and its copies
    assert loader[0] < 2 * pages(1_000_000, 1)  # the first step's pages, then the same ones again
    ps = _faults(PS_MMAP_THRESHOLD, 500_000, 4, PS_TRIM_THRESHOLD)  # gradient messages, their widening
    assert ps[0] < 2 * pages(500_000, 4)
    # An embedding worker's lookups in flight, 20 MB freed at once: above glibc's own trim threshold
    # (twice the largest block freed) they fault in again every step, below the worker's not.
    glibcs = _faults(0, 2_000_000, 10)
    kept = _faults(EMBEDDING_WORKER_MMAP_THRESHOLD, 2_000_000, 10, EMBEDDING_WORKER_TRIM_THRESHOLD)
    assert glibcs[0] > 10 * pages(2_000_000, 10) and kept[0] < 2 * pages(2_000_000, 10)
    for _, given_back in (lean, loader, ps, glibcs, kept):
        assert given_back > 35


WINDOW = """
import collections, gc, sys, weakref
from typing import NamedTuple
from trillium.runtime.memory import collect_cycles_less_often
if sys.argv[1] == "less often":
    collect_cycles_less_often()
class Event(NamedTuple):  # a tuple subclass: tracked for as long as it lives
    values: str
    key: str
    time: float
window = collections.deque(Event(str(i), str(i), float(i)) for i in range(50_000))
full = []
gc.callbacks.append(lambda phase, info: full.append(1) if phase == "stop" and info["generation"] == 2 else None)
for i in range(500_000):  # events in, the window's oldest out: a join at a steady rate
    window.append(Event(str(i), str(i), float(i)))
    window.popleft()
class Node:
    pass
cycle = Node()
cycle.me = cycle
dead = weakref.ref(cycle)
del cycle
garbage = [[] for _ in range(60_000)]  # a young generation's worth of allocations later
print(len(full), dead() is None)
"""


def _window(mode: str) -> tuple[int, bool]:
    """(full collections while a window of 50k events turned over ten times, whether a garbage
    cycle was collected after the young generation's threshold of allocations)"""
    out = subprocess.run([sys.executable, "-c", WINDOW, mode], capture_output=True, text=True, check=True).stdout
    full, collected = out.split()
    return int(full), collected == "True"


def test_a_window_of_live_events_costs_no_full_collections_and_cycles_still_go() -> None:
    assert YOUNG_COLLECTION_THRESHOLD < 60_000  # the garbage list above is a young generation's worth
    full, _ = _window("CPython's")
    assert full > 0  # the window's events reached the oldest generation, walked whole
    full, collected = _window("less often")
    assert full == 0 and collected
