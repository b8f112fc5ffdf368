"""Who may call what: four bearer tokens, one per scope, each its own secret.

- `services`: the stack's processes among themselves (registration and heartbeats, the
  coordinator's calls on the workers, every internal gRPC stream). Every service holds it.
- `operate`: an operator's (jobs, job control, forget, checkpoints, a model's rollback); the CLI's.
- `predict`: a client of the serving replicas, which may ask for predictions and nothing more.
- `observe`: a scraper's (`/metrics`, `/status`), which may read and nothing more.

A service holds the one token it sends (`services`) and, for the others, only their SHA-256
digests, so that a process that checks an operator's token cannot act as one: a compromised
serving replica learns no operator's secret. Tokens are 32 random bytes, so an unsalted digest
reveals nothing a guess could recover.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from typing import Literal

Scope = Literal["services", "operate", "predict", "observe"]
SCOPES: tuple[Scope, ...] = ("services", "operate", "predict", "observe")
DIGEST_PATTERN = r"^[0-9a-f]{64}$"

# Who else may do what a scope does: an operator may read status and ask for a prediction.
# Nobody but the services may act as one (register at an address, capture a worker's state).
ALSO_ACCEPTED: dict[Scope, tuple[Scope, ...]] = {
    "services": (),
    "operate": (),
    "predict": ("operate",),
    "observe": ("operate",),
}


def token_digest(token: str) -> str:
    """The SHA-256 of a token, as hex: what a service is given to check a scope it does not hold."""
    return hashlib.sha256(token.encode()).hexdigest()


class ScopeKeys:
    """The digests of each scope's token that one process accepts; `granted` answers which of the
    asked scopes a presented token holds, in time that does not depend on how close a guess is."""

    def __init__(self, digests: dict[Scope, str | None]) -> None:
        self._digests = {scope: bytes.fromhex(d) for scope, d in digests.items() if d is not None}

    def holds(self, scope: Scope) -> bool:
        return scope in self._digests

    def granted(self, token: str | None, scopes: Iterable[Scope]) -> bool:
        if token is None:
            return False
        given = hashlib.sha256(token.encode()).digest()
        ok = False
        for scope in scopes:
            for accepted in (scope, *ALSO_ACCEPTED[scope]):
                expected = self._digests.get(accepted)
                # Every asked scope is compared: no early exit that a clock could see.
                ok |= expected is not None and hmac.compare_digest(given, expected)
        return ok
