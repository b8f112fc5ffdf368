"""Giving freed heap memory back to the operating system.

A service that parses or encodes a large state frees it again, but glibc's malloc keeps freed
pages that are not at the top of its heaps: the RSS stays at the high-water mark. A data loader
restoring its joiner (tens of MB of JSON, several times that as Python objects) rose by about as
much at every recovery of a long-running job. `malloc_trim(0)` returns every free whole page
(glibc 2.8 and later), and `limit_malloc_arenas` keeps worker threads from each growing an
arena of their own; without glibc (musl, macOS) both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["limit_malloc_arenas", "release_free_memory"]


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


_M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)


def limit_malloc_arenas(arenas: int) -> None:
    """Let the threads this process starts from now on share at most `arenas` malloc arenas.

    glibc gives each new thread an arena of its own, up to 8 per core, and each keeps its own
    high-water mark: a service that hands work to a pool of threads now and then (file writes,
    JSON of a large state) grows by an arena's worth whenever one more thread first allocates.
    An asyncio service has no allocation-heavy threads to keep apart: a shared arena costs it
    nothing, and its RSS stops stepping up with its age."""
    if _MALLOPT is not None:
        _MALLOPT(_M_ARENA_MAX, arenas)
