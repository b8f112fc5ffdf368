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
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

CALIBRATION_STEPS = 20
MAX_BOUND = 32  # the NN ranks' feeds keep this many lookups ahead (and one more) for an `auto` job


@dataclass(frozen=True)
class BoundChoice:
    bound: int
    wait_ms: float  # a step's wait for its embeddings at k = 0 (the slowest rank's)
    step_ms: float  # a step's own time (the ranks' mean)
    steps: int  # the steps it was measured over
    reason: str

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
    return BoundChoice(bound, round(wait * 1e3, 2), round(step * 1e3, 2), steps, reason)
