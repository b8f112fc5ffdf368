"""Giving freed heap memory back to the operating system, and collecting cycles less often.

A service that parses or encodes a large state frees it again, but glibc's malloc keeps freed
pages that are not at the top of its heaps: the RSS stays at the high-water mark. A data loader
restoring its joiner (tens of MB of JSON, several times that as Python objects) rose by about as
much at every recovery of a long-running job. `malloc_trim(0)` returns every free whole page
(glibc 2.8 and later), and `keep_malloc_lean` keeps a service from growing on what it freed;
without glibc (musl, macOS) both are no-ops. `collect_cycles_less_often` is the other side of the
same trade: Python's cycle collector, tuned for a service's data plane.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

__all__ = [
    "EMBEDDING_WORKER_MMAP_THRESHOLD",
    "EMBEDDING_WORKER_TRIM_THRESHOLD",
    "LOADER_MMAP_THRESHOLD",
    "YOUNG_COLLECTION_THRESHOLD",
    "PS_MMAP_THRESHOLD",
    "PS_TRIM_THRESHOLD",
    "collect_cycles_less_often",
    "keep_malloc_lean",
    "release_free_memory",
]


def _libc(name: str):
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc("malloc_trim")
_MALLOPT = _libc("mallopt")


def release_free_memory() -> None:
    """Hand the heap's free pages back (after a large state was parsed or encoded and dropped)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


# mallopt's parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
LEAN_ARENAS = 2
MMAP_THRESHOLD = 128 * 1024  # glibc's starting value, pinned
# A data loader's: above the buffers of its hot path (a batch record and its copies: 215 KB at 512
# samples of 26 slots, a few MB at 8k), below the states and checkpoint parts it gives back. Each
# freshly mapped page faults once when first written, about 4 us on a VM: at glibc's 128 KiB
# the loader took a fault for every 4 KiB of every record it encoded and sent (1.3 per sample).
LOADER_MMAP_THRESHOLD = 8 * 1024 * 1024
# A PS shard's: above each step's buffers (a gradient message and its fp32 widening, a lookup's
# ids and rows: hundreds of KB), below a fetch of many messages at once (MBs, of varying sizes,
# which grew its heap for as long as it ran when they came from it).
PS_MMAP_THRESHOLD = 1024 * 1024
PS_TRIM_THRESHOLD = 8 * 1024 * 1024  # a step's buffers together: MBs of free heap kept for the next
# An embedding worker's: where glibc would raise its thresholds at most (its mmap threshold to
# 32 MiB, above a step's pooled embeddings even at 8k samples), but kept there. The buffers of
# the lookups in flight (a batch, its rows, its pooled embeddings, each answer, for every rank up
# to the staleness bound) are freed tens of MB at once; at glibc's moving trim threshold (twice
# the largest block freed) their pages went back and faulted in afresh, 0.3-0.5 a sample.
EMBEDDING_WORKER_MMAP_THRESHOLD = 32 * 1024 * 1024
EMBEDDING_WORKER_TRIM_THRESHOLD = 64 * 1024 * 1024


def keep_malloc_lean(
    *, arenas: int | None = LEAN_ARENAS, mmap_threshold: int | None = MMAP_THRESHOLD, trim_threshold: int | None = None
) -> None:
    """Trade a little allocation speed for an RSS that follows what the process uses (the
    coordinator, a data loader, a PS shard, an embedding worker: each with thresholds above its
    hot path's buffers, so that those reuse the heap's pages):

    - blocks of `mmap_threshold` and more are always mapped, so freeing one unmaps it. glibc
      raises that threshold to the size of each mapped block freed (up to 32 MiB): after one
      large state was encoded, every later block up to its size came from the heap and stayed
      in the RSS once freed. A PS shard's heap grew so by a fetch of gradients at a time (a few
      MB each, of varying sizes), 0.1 MB a minute for as long as it ran;
    - its threads share `arenas` malloc arenas (None: glibc's, up to 8 per core). glibc gives
      each new thread an arena of its own, each with its own high-water mark: a service that
      hands work to a pool of threads now and then (file writes, the JSON of a large state)
      grew by an arena's worth whenever one more thread first allocated;
    - free memory at the top of a heap (every arena's) up to `trim_threshold` (None: the mmap
      threshold) stays for the next blocks: trimmed at once, each would fault in anew.

    `mmap_threshold` None leaves both thresholds to glibc, which moves them itself (an NN rank:
    its faults did not fall with them fixed), and caps the arenas alone."""
    if _MALLOPT is not None:
        if mmap_threshold is not None:
            _MALLOPT(_M_MMAP_THRESHOLD, mmap_threshold)
            _MALLOPT(_M_TRIM_THRESHOLD, mmap_threshold if trim_threshold is None else trim_threshold)
        if arenas is not None:
            _MALLOPT(_M_ARENA_MAX, arenas)


# Net container allocations between two collections of the youngest generation (CPython's: 700).
# A data loader holds a join window of events (5 s of them live at 15,000 impressions/s, each a
# tuple the collector tracks) and a fetch's records at once: at 700 each was walked by several
# young collections, every event reached the oldest generation, and full collections walked the
# heap every few seconds: 9.2-9.3% of a loader's CPU live, none at 50,000. An object that dies
# young (a fetch's records, a step's futures) is never walked at all; a cycle of garbage still
# goes at the next young collection, a few MB of allocations away.
YOUNG_COLLECTION_THRESHOLD = 50_000


def collect_cycles_less_often() -> None:
    """Run the cycle collector's youngest generation every `YOUNG_COLLECTION_THRESHOLD` net
    allocations (the older generations' ratios stay CPython's)."""
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])
