"""A service process: its command line and settings (a bad one stops it, naming the field), its
allocator's tuning, and the event loop its `Service` runs in until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Coroutine
from typing import Any

from trillium import log
from trillium.config import ConfigError, ServiceSettings
from trillium.runtime.memory import collect_cycles_less_often, keep_malloc_lean
from trillium.runtime.service import Service


def run_service(cls: type[Service], argv: list[str] | None = None) -> None:
    """Entry point of a service process: parse args + environment, run until SIGTERM."""
    parser = argparse.ArgumentParser(
        prog=f"python -m trillium.services.{cls.role}",
        description=f"Trillium {cls.role} service. Endpoints come from the TRILLIUM_* environment (see docs/operations.md, Settings).",
    )
    parser.add_argument("--index", type=int, default=0, help="NN rank, PS shard, or instance number")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--http-port", type=int, required=True, help="health/metrics/API port")
    parser.add_argument("--grpc-port", type=int, default=None, help="gRPC port (PS and embedding worker)")
    parser.add_argument("--log-level", default=os.environ.get("TRILLIUM_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    try:
        settings = ServiceSettings.from_env(
            role=cls.role,
            index=args.index,
            host=args.host,
            http_port=args.http_port,
            grpc_port=args.grpc_port,
            log_level=args.log_level.upper(),
        )
    except ConfigError as err:
        print(f"{cls.role}: configuration error:\n{err}", file=sys.stderr)
        raise SystemExit(2) from None
    log.configure(settings.name, settings.log_level)
    collect_cycles_less_often()
    if cls.lean_malloc:
        keep_malloc_lean(
            arenas=cls.malloc_arenas, mmap_threshold=cls.malloc_mmap_threshold, trim_threshold=cls.malloc_trim_threshold
        )
    _run_loop(cls(settings).run())


def _run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run a service's event loop: uvloop's (libuv) where uvicorn[standard] installed it (the
    stack trained 3.5-5% more samples/s on it than on asyncio's own loop); asyncio's elsewhere."""
    try:
        import uvloop
    except ImportError:  # uvicorn[standard] leaves it out on Windows and PyPy
        asyncio.run(main)
    else:
        uvloop.run(main)
