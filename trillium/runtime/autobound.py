"""`staleness_bound: auto`: the smallest bound that keeps the NN ranks from waiting, chosen from
what the job measures.

A job so set starts synchronous (k = 0) and calibrates. At k = 0 a rank waits, each step, for the
whole round of the previous step's gradients: pushed, applied on every PS shard, and the next
lookup done after that. Call that wait W a step and the rank's own step (forward, backward, the
dense all-reduce) C. With bound k, step s's embeddings are ready W after step s - k - 1 ends,
at (s - k) * C + W on a clock where steps run back to back, and step s begins at s * C: the
rank does not wait when W <= k * C, so

    k = ceil(W / C), at least 1, at most MAX_BOUND

Both come from the ranks' own timings (`lookup_wait` and `step` seconds) over the calibration
steps; W is the slowest rank's, since every rank's step waits for the slowest. The coordinator
sets the bound live once every rank has trained CALIBRATION_STEPS steps, and the job view says
what it chose and why.

The choice assumes a step takes at bound k what it took at k = 0, and a lookup's round what it
took then. Where the ranks and the rest share cores, or every byte is encrypted (TLS), both grow
once the lookups run ahead, and a wait is left: measured across 20 ms with TLS, k = 9 left 37 ms
of a 139 ms wait. So after another CALIBRATION_STEPS steps at k the bound is checked: a wait left
W' above REFINE_SHARE of the step C' it now takes raises it to k + ceil(W' / C') (the lookups
asked k steps ahead come W' late: that many more steps ahead cover it), at most REFINEMENTS times.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

CALIBRATION_STEPS = 20
MAX_BOUND = 32  # the NN ranks' feeds keep this many lookups ahead (and one more) for an `auto` job
REFINE_SHARE = 0.25
REFINEMENTS = 3


@dataclass(frozen=True)
class BoundChoice:
    bound: int
    wait_ms: float  # a step's wait for its embeddings at k = 0 (the slowest rank's)
    step_ms: float  # a step's own time (the ranks' mean)
    steps: int  # the steps it was measured over
    reason: str
    at: dict[str, dict[str, float]]  # each rank's totals when the bound was set (for a later check)
    refinements: list[dict[str, float]] = field(default_factory=list)  # the checks that raised it
    settled: bool = False  # checked and found to hide the wait (or at MAX_BOUND, or checked enough)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_bound(ranks: dict[int, dict[str, Any]]) -> BoundChoice | None:
    """The choice from each rank's totals (`steps`, `lookup_wait_s`, `step_s` since the job's
    start at k = 0); None until every rank has trained CALIBRATION_STEPS steps."""
    if not ranks or any(r.get("steps", 0) < CALIBRATION_STEPS or "step_s" not in r for r in ranks.values()):
        return None
    steps = min(r["steps"] for r in ranks.values())
    wait = max(r["lookup_wait_s"] / r["steps"] for r in ranks.values())
    step = sum(r["step_s"] / r["steps"] for r in ranks.values()) / len(ranks)
    needed = math.ceil(wait / step) if step > 0 else MAX_BOUND
    bound = min(max(needed, 1), MAX_BOUND)
    reason = (
        f"at k=0 a step waited {wait * 1e3:.1f} ms for its embeddings and took {step * 1e3:.1f} ms itself "
        f"(over {steps} steps): k = ceil({wait * 1e3:.1f} / {step * 1e3:.1f}) = {needed}"
    )
    if bound != needed:
        reason += f", kept within 1..{MAX_BOUND}"
    return BoundChoice(bound, round(wait * 1e3, 2), round(step * 1e3, 2), steps, reason, _totals(ranks))


def refine_bound(choice: dict[str, Any], ranks: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The choice (as recorded) checked against the ranks' timings since the bound was set: raised
    when the wait left is more than REFINE_SHARE of a step, marked settled when it is not; None
    while there is nothing to decide yet (fewer than CALIBRATION_STEPS steps since, on every rank)."""
    if choice.get("settled"):
        return None
    since = choice.get("at") or {}
    if not ranks or any(str(r) not in since or t["steps"] < since[str(r)]["steps"] for r, t in ranks.items()):
        return {**choice, "at": _totals(ranks)}  # a new attempt counts afresh
    delta = {r: {k: t[k] - since[str(r)][k] for k in ("steps", "lookup_wait_s", "step_s")} for r, t in ranks.items()}
    if any(d["steps"] < CALIBRATION_STEPS for d in delta.values()):
        return None
    wait = max(d["lookup_wait_s"] / d["steps"] for d in delta.values())
    step = sum(d["step_s"] / d["steps"] for d in delta.values()) / len(delta)
    bound = choice["bound"]
    if wait <= REFINE_SHARE * step or bound >= MAX_BOUND or len(choice.get("refinements", [])) >= REFINEMENTS:
        return {**choice, "settled": True}
    raised = min(bound + math.ceil(wait / step), MAX_BOUND) if step > 0 else MAX_BOUND
    steps = min(int(d["steps"]) for d in delta.values())
    check = {"bound": raised, "wait_ms": round(wait * 1e3, 2), "step_ms": round(step * 1e3, 2), "steps": steps}
    reason = (
        f"; at k={bound} a step still waited {wait * 1e3:.1f} ms and took {step * 1e3:.1f} ms: "
        f"k = {bound} + ceil({wait * 1e3:.1f} / {step * 1e3:.1f}) = {raised}"
    )
    return {
        **choice,
        "bound": raised,
        "reason": choice["reason"] + reason,
        "at": _totals(ranks),
        "refinements": [*choice.get("refinements", []), check],
    }


def _totals(ranks: dict[int, dict[str, Any]]) -> dict[str, dict[str, float]]:
    return {str(r): {k: t[k] for k in ("steps", "lookup_wait_s", "step_s")} for r, t in ranks.items()}
