"""Where one split's malformed rows go: counted by kind, logged with file and line, appended to a
JSONL file."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from trillium.data.sources import Malformed

logger = logging.getLogger("trillium.data.features")

_LOGGED_PER_SPLIT = 100  # log this many malformed rows individually, then only the totals


class Quarantine:
    """Where one split's malformed rows go: counted by kind, the first 100 logged with file and
    line, each appended to `path` (JSONL) when given. `finish()` logs the total.

    A row already in the file (by file and line) is not appended again: a data loader restored
    from a checkpoint reads rows it read before."""

    def __init__(self, split: str, path: str | Path | None = None) -> None:
        self.split = split
        self.path = Path(path) if path is not None else None
        self.counts: Counter[str] = Counter()
        self._seen: set[tuple[str, int]] = set()
        if self.path is not None and self.path.exists():
            with self.path.open(encoding="utf-8") as f:
                for line in f:
                    entry = json.loads(line)
                    if isinstance(entry, dict) and "file" in entry and "line" in entry:
                        self._seen.add((entry["file"], entry["line"]))

    def add(self, rows: Sequence[Malformed]) -> None:
        if not rows:
            return
        for row in rows:
            self.counts[row.kind] += 1
            if self.total <= _LOGGED_PER_SPLIT:
                logger.warning("%s:%d: skipped malformed row: %s", row.file, row.line, row.reason)
        new = [row for row in rows if (row.file, row.line) not in self._seen]
        if self.path is not None and new:
            self._seen.update((row.file, row.line) for row in new)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as f:
                for row in new:
                    record = {"file": row.file, "line": row.line, "reason": row.reason, "raw": row.raw}
                    f.write(json.dumps(record) + "\n")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def finish(self) -> None:
        if self.counts:
            logger.warning("%s split: skipped %d malformed rows %s", self.split, self.total, dict(self.counts))
