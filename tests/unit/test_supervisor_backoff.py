"""The stack's supervisor never gives up on a process: after RESTARTS_ALLOWED quick restarts, each
crash waits twice as long as the one before to restart (Kubernetes' CrashLoopBackOff), the stack
degraded meanwhile, and it is whole again once the process stays up. A real child process that
exits is the crash; the clock is the test's own."""

from __future__ import annotations

import asyncio
import time

from trillium.config import StackTopology
from trillium.stack import procs
from trillium.stack import supervisor as sup
from trillium.stack.procs import Proc


async def test_a_crash_looping_process_restarts_later_and_later_and_the_stack_heals(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(procs, "BACKOFF_FIRST_S", 0.5)
    supervisor = sup.Supervisor(tmp_path, StackTopology(), False, "127.0.0.1:9092", "redis://127.0.0.1:6379/0")
    supervisor.phase = "running"
    proc = Proc(name="kafka", role="kafka", argv=["sh", "-c", "exit 3"], log=str(tmp_path / "kafka.log"))
    supervisor.procs.append(proc)
    supervisor.spawn(proc)

    async def crash() -> int:
        """Wait for the process to exit; the pid that exited."""
        pid = proc.pid
        await asyncio.to_thread(supervisor.popen[proc.name].wait)
        await supervisor.restart_if_crashed(proc)
        return pid

    for restarts in range(1, procs.RESTARTS_ALLOWED + 1):  # the first crashes restart at once
        assert await crash() != proc.pid
        assert (proc.restarts, proc.state, supervisor.phase) == (restarts, "starting", "running")

    for crashes, delay in ((procs.RESTARTS_ALLOWED + 1, 0.5), (procs.RESTARTS_ALLOWED + 2, 1.0)):
        exited, at = await crash(), time.monotonic()
        assert (proc.state, proc.pid, supervisor.phase) == ("backoff", exited, "degraded")
        assert f"kafka crashed {crashes} times in 120s" in supervisor.error
        assert abs(proc.restart_at - (at + delay)) < 0.1
        await supervisor.restart_if_crashed(proc)
        assert proc.pid == exited, "restarted before its backoff ended"
        await asyncio.sleep(delay + 0.05)
        if crashes == procs.RESTARTS_ALLOWED + 2:
            proc.argv = ["sleep", "60"]  # the cause of death gone: the next start stays up
        await supervisor.restart_if_crashed(proc)
        assert proc.pid != exited and proc.restarts == crashes

    watching = asyncio.create_task(supervisor.supervise())
    try:
        for _ in range(40):
            if supervisor.phase == "running":
                break
            await asyncio.sleep(0.1)
        assert (supervisor.phase, supervisor.error, proc.state) == ("running", None, "running")
    finally:
        supervisor.stopping = True
        await watching
        supervisor.popen[proc.name].kill()
        supervisor.popen[proc.name].wait()
