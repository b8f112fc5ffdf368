"""Runtime settings shared by the launcher, the CLI and every service.

Where things are (Kafka, Redis, the coordinator) comes from the environment, so the
same service binary runs in the local stack, in docker compose or against external
clusters. A bad value fails at start with a message naming the field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ENV_KAFKA_BOOTSTRAP = "TRILLIUM_KAFKA_BOOTSTRAP"
ENV_REDIS_URL = "TRILLIUM_REDIS_URL"
ENV_COORDINATOR_URL = "TRILLIUM_COORDINATOR_URL"
ENV_TOKEN = "TRILLIUM_TOKEN"
ENV_RUN_DIR = "TRILLIUM_RUN_DIR"

# A service exits with this code (EX_TEMPFAIL) to be started afresh, e.g. an NN rank leaving an
# abandoned attempt whose collectives may still block its threads. Supervisors restart it at once
# and do not count it as a crash.
EXIT_RESTART = 75

Role = Literal["coordinator", "embedding_ps", "embedding_worker", "nn_worker", "data_loader"]
ROLES: tuple[Role, ...] = ("coordinator", "embedding_ps", "embedding_worker", "nn_worker", "data_loader")


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names the field."""


def describe_validation_error(err: ValidationError, prefix: str = "") -> str:
    """One line per bad field: `field.path: problem (got value)`."""
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<root>"
        got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
        lines.append(f"{prefix}{field}: {e['msg']}{got}")
    return "\n".join(lines)


def default_run_dir() -> Path:
    return Path(os.environ.get(ENV_RUN_DIR, ".trillium/run")).absolute()


class Topology(BaseModel):
    """How many instances of each service the local stack starts (one coordinator always)."""

    model_config = ConfigDict(extra="forbid")

    ps_shards: int = Field(2, ge=1, le=64)
    embedding_workers: int = Field(1, ge=1, le=64)
    nn_ranks: int = Field(2, ge=1, le=64)
    data_loaders: int = Field(1, ge=1, le=64)

    def count(self, role: Role) -> int:
        return {
            "coordinator": 1,
            "embedding_ps": self.ps_shards,
            "embedding_worker": self.embedding_workers,
            "nn_worker": self.nn_ranks,
            "data_loader": self.data_loaders,
        }[role]


class ServiceSettings(BaseModel):
    """Everything one service process needs to start."""

    model_config = ConfigDict(extra="forbid")

    role: Role
    index: int = Field(0, ge=0, description="rank of an NN worker, shard of a PS, else instance number")
    host: str = "127.0.0.1"
    http_port: int = Field(ge=0, le=65535, description="health, metrics and (coordinator) REST API")
    grpc_port: int | None = Field(None, ge=0, le=65535)
    kafka_bootstrap: str = Field(min_length=1)
    redis_url: str = Field(min_length=1)
    coordinator_url: str = Field(min_length=1)
    token: str = Field(min_length=16, repr=False)
    run_dir: Path
    heartbeat_s: float = Field(1.0, gt=0, le=60)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str) -> str:
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return v

    @field_validator("coordinator_url")
    @classmethod
    def _http_scheme(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/")

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @classmethod
    def from_env(cls, **values: object) -> "ServiceSettings":
        """Build from explicit values plus the TRILLIUM_* environment; raises ConfigError."""
        env = {
            "kafka_bootstrap": os.environ.get(ENV_KAFKA_BOOTSTRAP),
            "redis_url": os.environ.get(ENV_REDIS_URL),
            "coordinator_url": os.environ.get(ENV_COORDINATOR_URL),
            "token": os.environ.get(ENV_TOKEN),
            "run_dir": os.environ.get(ENV_RUN_DIR),
        }
        merged = {k: v for k, v in env.items() if v is not None} | {k: v for k, v in values.items() if v is not None}
        try:
            return cls(**merged)
        except ValidationError as err:
            env_names = {"kafka_bootstrap": ENV_KAFKA_BOOTSTRAP, "redis_url": ENV_REDIS_URL,
                         "coordinator_url": ENV_COORDINATOR_URL, "token": ENV_TOKEN, "run_dir": ENV_RUN_DIR}
            msg = describe_validation_error(err)
            for field, var in env_names.items():
                msg = msg.replace(f"{field}: Field required", f"{field}: Field required (set {var})")
            raise ConfigError(msg) from None
