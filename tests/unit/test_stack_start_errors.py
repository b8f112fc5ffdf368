"""A stack that cannot start says why, and what to do, where `trillium up` reads it: a tool of
the cluster harness missing was "supervisor exited (logs in ...)", the one useful line left in
the supervisor's log. Nothing is started (the check comes before any namespace is made)."""

from __future__ import annotations

import pytest

from trillium import stack
from trillium.stack import LauncherError, clocks, hosts


@pytest.mark.parametrize(
    ("variable", "options", "says"),
    [
        (hosts.ENV_LINKDELAY, {"link_delay": True}, "`make .cache/bin/linkdelay`, or set TRILLIUM_LINKDELAY"),
        (clocks.ENV_CLOCKJUMP, {"clock_jumps": True}, "`make .cache/lib/clockjump.so`, or set TRILLIUM_CLOCKJUMP"),
    ],
)
def test_a_harness_tool_missing_fails_the_start_naming_how_to_build_it(
    tmp_path, monkeypatch, variable, options, says
) -> None:
    monkeypatch.setenv(variable, str(tmp_path / "not-built"))
    with pytest.raises(LauncherError, match="the stack failed to start") as failed:
        stack.up(tmp_path / "run", cluster=True, timeout_s=60, **options)
    assert says in str(failed.value) and str(tmp_path / "not-built") in str(failed.value)
    assert "supervisor exited" not in str(failed.value)
    assert stack.read_state(tmp_path / "run")["phase"] == "failed"
