"""Giving freed heap memory back to the operating system.

A service that parses or encodes a large state frees it again, but glibc's malloc keeps freed
pages that are not at the top of its heaps: the RSS stays at the high-water mark. A data loader
restoring its joiner (tens of MB of JSON, several times that as Python objects) rose by about as
much at every recovery of a long-running job. `malloc_trim(0)` returns every free whole page
(glibc 2.8 and later); without glibc (musl, macOS) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["release_free_memory"]


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def release_free_memory() -> None:
    """Hand the heap's free pages back (after a large state was parsed or encoded and dropped)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
