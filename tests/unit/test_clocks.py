"""scripts/clockjump (trillium/stack/clocks.py): a process preloaded with it reads the wall clock
its clock file says, within a second of a jump, its monotonic clock untouched; the oracle is this
test's own clocks, which nothing preloads (the monotonic clock is one for the whole machine)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from trillium.stack import clocks

PROBE = """
import json, sys, time
for line in sys.stdin:  # a reading for each line
    print(json.dumps([time.time(), time.monotonic()]), flush=True)
"""


def test_a_process_reads_the_wall_clock_its_file_says_and_its_monotonic_clock_stays(tmp_path: Path) -> None:
    env = clocks.env(tmp_path, "embedding_ps-0")
    assert clocks.env(tmp_path, "kafka") == {}  # Kafka and Redis keep the machine's clock
    probe = subprocess.Popen(
        [sys.executable, "-c", PROBE],
        env=env | {"PATH": "/usr/bin:/bin"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert probe.stdin is not None and probe.stdout is not None

    def offsets() -> tuple[float, float, float]:
        """(its wall clock less ours, its monotonic clock less ours, how long the reading took)."""
        wall, mono = time.time(), time.monotonic()
        probe.stdin.write("\n")
        probe.stdin.flush()
        theirs = json.loads(probe.stdout.readline())
        return theirs[0] - wall, theirs[1] - mono, time.monotonic() - mono

    try:
        for seconds in (0, 3600.5, -120, 0):
            clocks.jump(tmp_path, "embedding_ps-0", seconds)
            time.sleep(1.1)  # the file is read again at most once a second
            wall, mono, took = offsets()
            assert -0.01 < wall - seconds < took + 0.01, (seconds, wall)
            assert -0.01 < mono < took + 0.01, (seconds, mono)
    finally:
        probe.kill()
        probe.wait()
