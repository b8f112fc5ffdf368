"""A flood of one log line is thinned to its rate, and the next line let through says how many
were held back: every line accounted for, as the oracle's own count of the calls says."""

from __future__ import annotations

import logging

from trillium.log import Throttle


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_is_thinned_and_every_line_held_back_is_counted(caplog) -> None:
    clock = _Clock()
    throttle = Throttle(logging.getLogger("test.throttle"), every_s=10.0, burst=3, clock=clock)
    calls = 0
    with caplog.at_level(logging.WARNING, logger="test.throttle"):
        for second in range(60):  # 100 lines a second for a minute
            clock.now = float(second)
            for _ in range(100):
                throttle.warning("bad event", reason="x")
                calls += 1
        clock.now = 1000.0
        throttle.warning("bad event", reason="last")
        calls += 1
    lines = caplog.records
    # The burst, then one every 10 s (at 10, 20, ..., 50), then the last.
    assert len(lines) == 3 + 5 + 1
    assert [r.reason for r in lines[:-1]] == ["x"] * 8 and lines[-1].reason == "last"
    held = [getattr(r, "held_back", 0) for r in lines]
    assert held[:3] == [0, 0, 0] and all(h > 0 for h in held[3:])
    assert len(lines) + sum(held) == calls + throttle.held_back
    assert throttle.held_back == 0


def test_lines_within_the_rate_all_pass(caplog) -> None:
    clock = _Clock()
    throttle = Throttle(logging.getLogger("test.throttle.slow"), every_s=1.0, burst=2, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.throttle.slow"):
        for second in range(20):
            clock.now = float(second)
            throttle.warning("line", n=second)
    assert [r.n for r in caplog.records] == list(range(20))
    assert not any(hasattr(r, "held_back") for r in caplog.records)
