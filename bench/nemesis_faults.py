"""bench/nemesis.py's faults: a seeded schedule of them, overlapping, and how each is done and
undone on a cluster (trillium/stack/hosts.py, links.py).

A schedule is a list of `Fault`s: when it begins (seconds into the run), how long it holds, its
kind and its targets, all drawn from `random.Random(seed)`, so a seed replays the same schedule
(which processes exist is fixed by the topology). Faults begin every 4-16 s and hold 3-25 s; at
most `overlap` hold at once. The kinds, each as likely as the others:

- `kill`: kill -9 of one process, of any role, Kafka and Redis included (its supervisor starts it
  again; `hold` is unused);
- `stop`: SIGSTOP of one process for `hold` seconds, then SIGCONT (a process that stalls: a GC
  pause, a VM frozen), its peers' connections to it open and silent;
- `partition`: one host cut off from every other and the operator, both ways;
- `cut`: two hosts cut off from each other, both ways; `one_way`: what one sends the other dropped;
- `loss`: 1-5% of every frame between any two hosts dropped;
- `slow`: every connection into one host 5-40 ms longer each way (linkdelay);
- `cap`: one host's link capped at 2-20 Mbit/s each way (tbf);
- `broker` and `redis`: a clean restart (SIGTERM) of the broker or of Redis;
- `clock`: one service's wall clock 5-600 s ahead or behind for `hold` seconds, then back (a jump
  both ways; trillium/stack/clocks.py), its monotonic clock untouched;
- `disk`: the checkpoint directory's disk full for `hold` seconds (a tmpfs of its own, filled with
  a ballast file): every checkpoint writer meets ENOSPC, the PS shards' snapshots included (the
  processes share one mount namespace, so one PS's disk alone is not to be had here).

Not here yet: poison records (the jobs here read a synthetic source; the stream jobs' own e2e
test writes them into a running job's input).
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trillium.stack import clocks
from trillium.stack.links import Network
from trillium.stack.procs import pid_of

KINDS = ("kill", "stop", "partition", "cut", "one_way", "loss", "slow", "cap", "broker", "redis", "clock", "disk")
NETWORK_KINDS = frozenset({"partition", "cut", "one_way", "loss", "slow", "cap"})


@dataclass
class Fault:
    number: int
    at_s: float  # when it begins, from the run's start
    hold_s: float
    kind: str
    targets: list[str]
    amount: float | None = None  # loss per mille, delay ms, cap Mbit/s, clock jump s
    # What happened, filled in as it runs.
    began: float | None = None  # time.monotonic()
    ended: float | None = None
    pid: int | None = None
    error: str | None = None

    @property
    def tag(self) -> str:
        return f"nemesis-{self.number}"

    def public(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("began", "ended"):
            out.pop(key)
        return out


def schedule(
    seed: int, seconds: float, hosts: list[str], processes: list[str], overlap: int = 2, kinds: tuple[str, ...] = KINDS
) -> list[Fault]:
    """The faults of a run of `seconds`, from `seed`: see the module's docstring. `hosts` are the
    cluster's hosts, `processes` the stack's processes (every host holds one)."""
    rng = random.Random(seed)
    services = [p for p in processes if p not in clocks.UNJUMPED]
    faults: list[Fault] = []
    at = rng.uniform(4, 16)
    while at < seconds:
        holding = [f for f in faults if f.at_s + f.hold_s > at]
        if len(holding) >= overlap:
            at = min(f.at_s + f.hold_s for f in holding) + 0.5
            continue
        kind = rng.choice(kinds)
        hold = round(rng.uniform(3, 25), 1)
        amount: float | None = None
        if kind in ("kill", "stop"):
            targets = [rng.choice(processes)]
        elif kind in ("partition", "slow", "cap"):
            targets = [rng.choice(hosts)]
        elif kind in ("cut", "one_way"):
            targets = rng.sample(hosts, 2)
        elif kind == "clock":
            targets = [rng.choice(services)]
        else:
            targets = []
        if kind == "loss":
            amount = rng.randint(10, 50)
        elif kind == "slow":
            amount = rng.randint(5, 40)
        elif kind == "cap":
            amount = rng.randint(2, 20)
        elif kind == "clock":
            amount = rng.choice((-1, 1)) * rng.randint(5, 600)
        if kind in ("kill", "broker", "redis"):
            hold = 0.0  # done at once; the supervisor brings the process back
        if any(f.kind == kind and (set(f.targets) & set(targets) or not targets) for f in holding):
            at += 0.5  # one fault of a kind on a target at a time: each undoes only its own
            continue
        faults.append(Fault(len(faults), round(at, 1), hold, kind, targets, amount))
        at += rng.uniform(4, 16)
    return faults


@dataclass
class Injector:
    """Does and undoes faults on one cluster."""

    run_dir: Path
    network: Network
    disk: Path | None = None  # the checkpoint directory's own mount (a `disk` fault fills it)
    stopped: dict[int, int] = field(default_factory=dict)  # pid -> the fault that stopped it
    jumped: set[str] = field(default_factory=set)  # services whose clock a fault moved

    def begin(self, fault: Fault) -> None:
        fault.began = time.monotonic()
        try:
            self._begin(fault)
        except (OSError, RuntimeError) as err:  # a process between a kill and its restart
            fault.error = f"{type(err).__name__}: {err}"

    def _begin(self, fault: Fault) -> None:
        kind, targets, net = fault.kind, fault.targets, self.network
        if kind in ("kill", "stop", "broker", "redis"):
            name = {"broker": "kafka", "redis": "redis"}.get(kind, targets[0] if targets else "")
            fault.pid = pid_of(self.run_dir, name)
            if fault.pid is None:
                raise RuntimeError(f"{name} has no process now")
            sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}.get(kind, signal.SIGTERM)
            os.kill(fault.pid, sig)
            if kind == "stop":
                self.stopped[fault.pid] = fault.number
        elif kind == "partition":
            net.partition(targets[0], fault.tag)
        elif kind == "cut":
            net.cut(targets[0], targets[1], fault.tag)
        elif kind == "one_way":
            net.one_way(targets[0], targets[1], fault.tag)
        elif kind == "loss":
            net.loss(int(fault.amount or 0), fault.tag)
        elif kind == "slow":
            net.delay(targets[0], float(fault.amount or 0))
        elif kind == "cap":
            net.cap(targets[0], float(fault.amount or 0))
        elif kind == "clock":
            clocks.jump(self.run_dir, targets[0], float(fault.amount or 0))
            self.jumped.add(targets[0])
        elif kind == "disk":
            self._fill()

    def end(self, fault: Fault) -> None:
        """Undo `fault` (a kill or restart needs nothing: the supervisor restarted the process)."""
        fault.ended = time.monotonic()
        if fault.error is not None:
            return
        kind, targets, net = fault.kind, fault.targets, self.network
        if kind == "stop" and fault.pid is not None:
            self.stopped.pop(fault.pid, None)
            try:
                os.kill(fault.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # killed meanwhile by another fault
        elif kind in ("partition", "cut", "one_way", "loss"):
            net.lift(fault.tag)
        elif kind == "slow":
            net.delay(targets[0], 0)
        elif kind == "cap":
            net.uncap(targets[0])
        elif kind == "clock":
            clocks.jump(self.run_dir, targets[0], 0)
            self.jumped.discard(targets[0])
        elif kind == "disk":
            self._ballast().unlink(missing_ok=True)

    def _ballast(self) -> Path:
        if self.disk is None:
            raise RuntimeError("no disk of the checkpoints' own to fill")
        return self.disk / ".nemesis-ballast"

    def _fill(self) -> None:
        """Take every free block of the checkpoints' disk (fallocate: at once, no writes)."""
        ballast = self._ballast()
        free = os.statvfs(self.disk)
        fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, free.f_bavail * free.f_frsize)
        finally:
            os.close(fd)

    def heal_all(self) -> None:
        """Every fault still holding undone: the run's end, or an error in it."""
        for pid in list(self.stopped):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.stopped.clear()
        for name in self.jumped:
            clocks.jump(self.run_dir, name, 0)
        self.jumped.clear()
        if self.disk is not None:
            self._ballast().unlink(missing_ok=True)
        self.network.heal()


def kinds_of(faults: list[Fault]) -> dict[str, int]:
    """Faults injected by kind (those that found no process to act on left out)."""
    out: dict[str, int] = {}
    for fault in faults:
        if fault.began is not None and fault.error is None:
            out[fault.kind] = out.get(fault.kind, 0) + 1
    return out
