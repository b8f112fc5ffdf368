"""Structured logging: one JSON object per line on stderr, the same in every process."""

from __future__ import annotations

import json
import logging
import sys
import time

# Attributes every LogRecord has; anything else was passed with `extra=` and is logged as a field.
_STANDARD_ATTRS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName", "color_message"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS:
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(service: str, level: str = "INFO") -> None:
    """Route all logging of this process through the JSON formatter."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Kafka and HTTP client libraries are chatty at INFO.
    for noisy in ("aiokafka", "kafka", "httpx", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class Throttle:
    """A log line that can come in floods (a bad event a message, from whoever writes the input
    topic) at a bounded rate: `burst` lines at once, then one every `every_s`; the next line let
    through says how many were held back (`held_back`). What is counted elsewhere (the dead
    letters in the job view and /metrics) stays exact: only the lines are thinned."""

    def __init__(
        self,
        logger: logging.Logger,
        every_s: float = 10.0,
        burst: int = 10,
        clock=time.monotonic,
    ) -> None:
        self.logger = logger
        self.every_s = every_s
        self.burst = burst
        self.clock = clock
        self.allowance = float(burst)
        self.last = clock()
        self.held_back = 0

    def warning(self, msg: str, **fields: object) -> None:
        now = self.clock()
        self.allowance = min(float(self.burst), self.allowance + (now - self.last) / self.every_s)
        self.last = now
        if self.allowance < 1.0:
            self.held_back += 1
            return
        self.allowance -= 1.0
        if self.held_back:
            fields["held_back"] = self.held_back
            self.held_back = 0
        self.logger.warning(msg, extra=fields)
