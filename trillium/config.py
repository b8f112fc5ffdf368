"""Runtime settings shared by the launcher, the CLI and every service.

Where things are (Kafka, Redis, the coordinator) comes from the environment, so the
same service binary runs in the local stack, in docker compose or against external
clusters. A bad value fails at start with a message naming the field.
"""

from __future__ import annotations

import os
import re
import ssl
from pathlib import Path
from typing import ClassVar, Literal
from urllib.parse import quote, urlsplit

import httpx
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FilePath,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from trillium.scopes import DIGEST_PATTERN, ScopeKeys, token_digest
from trillium.timeouts import HEARTBEAT_S

ENV_KAFKA_BOOTSTRAP = "TRILLIUM_KAFKA_BOOTSTRAP"
ENV_REDIS_URL = "TRILLIUM_REDIS_URL"
ENV_COORDINATOR_URL = "TRILLIUM_COORDINATOR_URL"
ENV_TOKEN = "TRILLIUM_TOKEN"  # the services' own token (trillium.scopes); the others' digests below
ENV_OPERATE_DIGEST = "TRILLIUM_OPERATE_TOKEN_SHA256"
ENV_PREDICT_DIGEST = "TRILLIUM_PREDICT_TOKEN_SHA256"
ENV_OBSERVE_DIGEST = "TRILLIUM_OBSERVE_TOKEN_SHA256"
ENV_RUN_DIR = "TRILLIUM_RUN_DIR"
# Where jobs keep checkpoints and models unless their file says (a stack of several hosts: storage
# every process reaches).
ENV_SHARED_DIR = "TRILLIUM_SHARED_DIR"
# An S3 store's client variables (botocore's own, read under s3fs): a shared directory `s3://...`
# needs them beside it in every process, as a Kubernetes ConfigMap and Secret give them.
OBJECT_STORE_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
# Security once services leave loopback (see docs/operations.md).
ENV_REDIS_PASSWORD = "TRILLIUM_REDIS_PASSWORD"
ENV_KAFKA_SECURITY_PROTOCOL = "TRILLIUM_KAFKA_SECURITY_PROTOCOL"
ENV_KAFKA_SASL_MECHANISM = "TRILLIUM_KAFKA_SASL_MECHANISM"
ENV_KAFKA_USERNAME = "TRILLIUM_KAFKA_USERNAME"
ENV_KAFKA_PASSWORD = "TRILLIUM_KAFKA_PASSWORD"
ENV_KAFKA_CA_FILE = "TRILLIUM_KAFKA_CA_FILE"
ENV_GRPC_TLS_CERT = "TRILLIUM_GRPC_TLS_CERT"
ENV_GRPC_TLS_KEY = "TRILLIUM_GRPC_TLS_KEY"
ENV_GRPC_TLS_CA = "TRILLIUM_GRPC_TLS_CA"
# The address peers reach this service at, when its host name is not it (a Kubernetes pod: its IP).
ENV_ADVERTISE_HOST = "TRILLIUM_ADVERTISE_HOST"
ENV_THREADS = "TRILLIUM_THREADS"
# What a job may make the stack do (trillium.job.trust): the model code it may import, and
# where it may read data and keep state.
ENV_MODEL_MODULES = "TRILLIUM_MODEL_MODULES"
ENV_ALLOWED_PATHS = "TRILLIUM_ALLOWED_PATHS"
# The largest gRPC message a service sends or takes: a batch's embeddings or a shard's rows can
# be tens of MiB (a job whose batch could exceed it is refused at submit, trillium.job.schema).
GRPC_MAX_MESSAGE_BYTES = 64 << 20
# The largest body the coordinator's API takes (trillium.runtime.limits.BodyLimit).
API_MAX_BODY_BYTES = 1 << 20
# The most values one forget takes: its IDs travel in one request to every PS shard and stay in
# the job record (a `ForgetMask`) for the job's later attempts; `trillium forget` splits a longer list.
MAX_FORGET_VALUES = 100_000
# A serving replica: the one model it serves (default: every model the stack publishes), the
# version it is pinned to at start, and what one request may ask.
ENV_SERVING_MODEL = "TRILLIUM_SERVING_MODEL"
ENV_SERVING_VERSION = "TRILLIUM_SERVING_VERSION"
ENV_SERVING_MAX_BATCH = "TRILLIUM_SERVING_MAX_BATCH"
ENV_SERVING_MAX_BODY_BYTES = "TRILLIUM_SERVING_MAX_BODY_BYTES"
ENV_SERVING_MEMORY_GB = "TRILLIUM_SERVING_MEMORY_GB"
ENV_SERVING_SHARD = "TRILLIUM_SERVING_SHARD"
ENV_SERVING_SHARDS = "TRILLIUM_SERVING_SHARDS"

# A service exits with this code (EX_TEMPFAIL) to be started afresh, e.g. an NN rank leaving an
# abandoned attempt whose collectives may still block its threads. Supervisors restart it at once
# and do not count it as a crash.
EXIT_RESTART = 75
# A service exits with this code when the coordinator refused its registration because a process
# on another host has taken its role and index (it was replaced while cut off). Supervisors leave it
# stopped: restarting it would only be refused again.
EXIT_REPLACED = 76

Role = Literal[
    "coordinator", "embedding_ps", "embedding_worker", "nn_worker", "data_loader", "serving_shard", "serving"
]
# In the order a stack starts them: the coordinator first (the others register with it), the
# serving shards before the frontends that ask them.
ROLES: tuple[Role, ...] = (
    "coordinator",
    "embedding_ps",
    "embedding_worker",
    "nn_worker",
    "data_loader",
    "serving_shard",
    "serving",
)


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names the field."""


# A field whose name holds one of these is a secret: its value is never echoed.
SECRET_WORDS = ("token", "password", "secret", "credential")
_URL_PASSWORD = re.compile(r"(?<=://)([^/@\s:]*):[^/@\s]*@")


def redact(text: str) -> str:
    """`text` with the password of every URL in it (`scheme://user:password@host`) as `***`."""
    return _URL_PASSWORD.sub(r"\1:***@", text)


def describe_validation_error(err: ValidationError, prefix: str = "") -> str:
    """One line per bad field: `field.path: problem (got value)`, a secret's value withheld and a
    URL's password masked, so that the message can go to a log."""
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<root>"
        got = ""
        if "input" in e and not isinstance(e["input"], dict):
            secret = any(word in str(e["loc"][-1]).lower() for word in SECRET_WORDS) if e["loc"] else False
            got = " (its value withheld: a secret)" if secret else f" (got {redact(repr(e['input']))})"
        lines.append(f"{prefix}{field}: {redact(e['msg'])}{got}")
    return "\n".join(lines)


def _from_env(names: dict[str, str]) -> dict[str, str]:
    return {field: os.environ[var] for field, var in names.items() if os.environ.get(var)}


def _validate(cls: type[BaseModel], values: dict[str, object], env_names: dict[str, str]) -> BaseModel:
    """`cls(**values)`, or a ConfigError naming each bad field and the variable it comes from."""
    try:
        return cls(**values)
    except ValidationError as err:
        lines = describe_validation_error(err).splitlines()
        for i, line in enumerate(lines):
            field = line.split(":", 1)[0]
            if field in env_names:
                lines[i] = (
                    f"{line} (set {env_names[field]})"
                    if "Field required" in line
                    else f"{line} (from {env_names[field]})"
                )
        raise ConfigError("\n".join(lines)) from None


class KafkaConnection(BaseModel):
    """How every Kafka client of a process connects; `trillium.wire.kafka` applies it to all of them.
    PLAINTEXT suits the local stack on loopback; anywhere else, SASL (SCRAM) and optionally TLS."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bootstrap: str = Field(min_length=1)
    security_protocol: Literal["PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL", "SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"] = "SCRAM-SHA-512"
    username: str | None = None
    password: SecretStr | None = None
    ca_file: FilePath | None = Field(None, description="CA bundle for SSL/SASL_SSL (default: the system's)")

    @model_validator(mode="after")
    def _credentials(self) -> "KafkaConnection":
        sasl = self.security_protocol.startswith("SASL")
        if sasl and not (self.username and self.password):
            raise ValueError(f"security_protocol {self.security_protocol} needs a username and a password")
        if not sasl and (self.username or self.password):
            raise ValueError(
                f"a username/password is only used with SASL, not security_protocol {self.security_protocol}"
            )
        return self

    ENV: ClassVar[dict[str, str]] = {
        "bootstrap": ENV_KAFKA_BOOTSTRAP,
        "security_protocol": ENV_KAFKA_SECURITY_PROTOCOL,
        "sasl_mechanism": ENV_KAFKA_SASL_MECHANISM,
        "username": ENV_KAFKA_USERNAME,
        "password": ENV_KAFKA_PASSWORD,
        "ca_file": ENV_KAFKA_CA_FILE,
    }

    @classmethod
    def from_env(cls, bootstrap: str | None = None) -> "KafkaConnection":
        """The TRILLIUM_KAFKA_* environment (`bootstrap` overrides its address); raises ConfigError."""
        values = _from_env(cls.ENV) | ({"bootstrap": bootstrap} if bootstrap else {})
        return _validate(cls, values, cls.ENV)

    @property
    def secured(self) -> bool:
        return self.security_protocol != "PLAINTEXT"

    def for_brokers(self, bootstrap: str | None) -> KafkaConnection:
        """The connection to the brokers a job names: this one when they are ours (or none are
        named); else one with no credentials of ours, TLS kept where ours has it: a job file that
        names any host must not have the stack's password sent there."""
        if bootstrap is None or _brokers(bootstrap) == _brokers(self.bootstrap):
            return self
        tls = self.security_protocol in ("SSL", "SASL_SSL")
        return KafkaConnection(
            bootstrap=bootstrap, security_protocol="SSL" if tls else "PLAINTEXT", ca_file=self.ca_file if tls else None
        )


def _brokers(bootstrap: str) -> set[str]:
    return {b.strip().lower() for b in bootstrap.split(",") if b.strip()}


class GrpcTls(BaseModel):
    """TLS for every gRPC server and channel of a process: its own certificate and key, and the CA
    that signed its peers' (a stack shares one CA). Peers are addressed by the host names they
    register, which the certificates must name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cert_file: FilePath
    key_file: FilePath
    ca_file: FilePath


class GrpcCredentials(BaseModel):
    """What `trillium.wire.rpc` needs to serve and to call: the stack's token (always checked) and TLS."""

    model_config = ConfigDict(frozen=True)

    token: SecretStr
    tls: GrpcTls | None = None


def default_run_dir() -> Path:
    return Path(os.environ.get(ENV_RUN_DIR, ".trillium/run")).absolute()


# The field of a topology that counts each role's instances.
_COUNTED_BY: dict[str, str] = {
    "embedding_ps": "ps_shards",
    "embedding_worker": "embedding_workers",
    "nn_worker": "nn_ranks",
    "data_loader": "data_loaders",
    "serving_shard": "serving_shard_processes",
    "serving": "serving_replicas",
}


class RoleCounts:
    """How many instances of each worker role: the one map from role to count, shared by the
    stack's topology (its processes) and a job's (the workers it uses, indices 0..n-1)."""

    COORDINATORS: ClassVar[int] = 0  # a job asks for none: every stack has its one

    def count(self, role: Role) -> int:
        if role == "coordinator":
            return self.COORDINATORS
        return getattr(self, _COUNTED_BY[role], 0)  # a job's topology has no serving replicas

    def workers(self) -> dict[Role, int]:
        """Role -> instances, for every role with any."""
        return {role: n for role in ROLES if (n := self.count(role))}


class StackTopology(RoleCounts, BaseModel):
    """How many instances of each service the local stack starts (one coordinator always)."""

    model_config = ConfigDict(extra="forbid")
    COORDINATORS: ClassVar[int] = 1

    ps_shards: int = Field(2, ge=1, le=64)
    embedding_workers: int = Field(1, ge=1, le=64)
    nn_ranks: int = Field(2, ge=1, le=64)
    data_loaders: int = Field(1, ge=1, le=64)
    serving_replicas: int = Field(1, ge=0, le=16)
    serving_shards: int = Field(
        0, ge=0, le=64, description="serving shards the replicas ask for rows (0: each replica holds every row)"
    )
    serving_shard_replicas: int = Field(1, ge=1, le=8, description="processes holding each serving shard")

    @property
    def serving_shard_processes(self) -> int:
        """Serving shard process i holds shard i % serving_shards (replica i // serving_shards)."""
        return self.serving_shards * self.serving_shard_replicas


class ServiceSettings(BaseModel):
    """Everything one service process needs to start."""

    model_config = ConfigDict(extra="forbid")

    role: Role
    index: int = Field(0, ge=0, description="rank of an NN worker, shard of a PS, else instance number")
    host: str = "127.0.0.1"
    advertise_host: str | None = Field(
        None,
        min_length=1,
        description="peers' address of this service (default: the bound address, or the host name when bound to all)",
    )
    http_port: int = Field(ge=0, le=65535, description="health, metrics and (coordinator) REST API")
    grpc_port: int | None = Field(None, ge=0, le=65535)
    kafka: KafkaConnection
    redis_url: str = Field(min_length=1, repr=False)
    redis_password: SecretStr | None = Field(None, description="for the URL's user, when the URL carries none")
    coordinator_url: str = Field(min_length=1)
    token: str = Field(min_length=16, repr=False, description="the services' token, sent on every call among them")
    operate_token_sha256: str = Field(
        pattern=DIGEST_PATTERN, repr=False, description="the SHA-256 (hex) of the operators' token, checked here"
    )
    predict_token_sha256: str | None = Field(
        None, pattern=DIGEST_PATTERN, repr=False, description="the prediction clients' token's, on a serving replica"
    )
    observe_token_sha256: str | None = Field(
        None,
        pattern=DIGEST_PATTERN,
        repr=False,
        description="a metrics scraper's token's (default: none; an operator's token reads /metrics too)",
    )
    grpc_tls: GrpcTls | None = None
    run_dir: Path
    shared_dir: str | None = Field(
        None,
        min_length=1,
        description="where a job keeps its checkpoints and model versions when its file names no `dir`: a "
        "directory every process of the stack reaches, or an fsspec URL (s3://bucket/prefix); default: the run "
        "dir, which only a stack on one host shares",
    )
    heartbeat_s: float = Field(
        HEARTBEAT_S,
        gt=0,
        le=60,
        description="between periodic heartbeats; a changed job record is heard at once (Redis pub/sub)",
    )
    threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="compute threads: a PS shard's native store "
        "pool (default: every core), an NN rank's torch intra-op threads (default: 1)",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    serving_model: str | None = Field(None, min_length=1, description="a serving replica's one model")
    serving_version: int | None = Field(None, ge=1, description="the version a serving replica is pinned to")
    serving_max_batch: int = Field(1024, ge=1, le=1 << 20, description="instances one prediction request may hold")
    serving_max_body_bytes: int = Field(8 << 20, ge=1024, le=1 << 30, description="a prediction request's body")
    serving_memory_gb: float | None = Field(
        None,
        gt=0,
        description="the most memory (GB, 10^9 bytes) a serving replica's embedding tables may take: a version "
        "that would take more is refused, and says so (default: no cap)",
    )
    serving_shard: str | None = Field(
        None,
        pattern=r"^[0-9]+/[1-9][0-9]*$",
        description="a serving shard's place, `INDEX/COUNT`: it holds every table's rows of the training PS "
        "shards t with t % COUNT == INDEX, and answers a frontend's lookups",
    )
    serving_shards: str | None = Field(
        None,
        min_length=1,
        description="a frontend's serving shards, in shard order, comma-separated; a shard's replicas "
        "separated by `|` (`a:7000|b:7000,c:7000`): it asks each shard for the rows it holds",
    )

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str) -> str:
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return v

    @model_validator(mode="after")
    def _redis_credentials(self) -> "ServiceSettings":
        # The password may live apart from the address (a Kubernetes Secret beside a ConfigMap).
        if self.redis_password is not None:
            parts = urlsplit(self.redis_url)
            if parts.password is not None:
                raise ValueError("redis_password: the Redis URL carries a password already; give it once")
            user = quote(parts.username or "", safe="")
            secret = quote(self.redis_password.get_secret_value(), safe="")
            self.redis_url = parts._replace(netloc=f"{user}:{secret}@{parts.netloc.rpartition('@')[2]}").geturl()
            self.redis_password = None
        return self

    @model_validator(mode="after")
    def _predict_scope(self) -> "ServiceSettings":
        if self.role == "serving" and self.predict_token_sha256 is None:
            raise ValueError("predict_token_sha256: a serving replica checks its clients' token (its SHA-256)")
        return self

    @property
    def keys(self) -> ScopeKeys:
        """The scopes this process accepts a token of (trillium.scopes)."""
        return ScopeKeys(
            {
                "services": token_digest(self.token),
                "operate": self.operate_token_sha256,
                "predict": self.predict_token_sha256,
                "observe": self.observe_token_sha256,
            }
        )

    @model_validator(mode="after")
    def _serving_shard_in_range(self) -> "ServiceSettings":
        if self.role == "serving_shard" and self.serving_shard is None:
            raise ValueError("serving_shard: a serving shard needs its place, INDEX/COUNT")
        if self.serving_shard is not None:
            index, count = (int(x) for x in self.serving_shard.split("/"))
            if index >= count:
                raise ValueError(f"serving_shard: index {index} of {count} shards (0 to {count - 1})")
        return self

    @field_validator("serving_shards")
    @classmethod
    def _shard_addresses(cls, v: str | None) -> str | None:
        for shard, replicas in enumerate(v.split(",") if v is not None else []):
            for address in replicas.split("|"):
                host, _, port = address.rpartition(":")
                if not host or not port.isdigit():
                    raise ValueError(f"shard {shard}: {address!r} is not HOST:PORT")
        return v

    @property
    def serving_shard_addresses(self) -> list[list[str]]:
        """Per serving shard, its replicas' addresses (a frontend's; empty elsewhere)."""
        return [replicas.split("|") for replicas in self.serving_shards.split(",")] if self.serving_shards else []

    @field_validator("coordinator_url")
    @classmethod
    def _http_scheme(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/")

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def shared_root(self) -> str:
        """Below which a job's default checkpoint and model directories are (`shared_dir`, else the run dir)."""
        return self.shared_dir.rstrip("/") if self.shared_dir else str(self.run_dir)

    @property
    def grpc(self) -> GrpcCredentials:
        return GrpcCredentials(token=self.token, tls=self.grpc_tls)

    @property
    def http_scheme(self) -> str:
        """With TLS configured, every listener speaks it: the HTTP ports too."""
        return "https" if self.grpc_tls is not None else "http"

    def http_client(self, timeout: float | httpx.Timeout) -> httpx.AsyncClient:
        """A client of the stack's other services: the token on every call and, with TLS, their
        certificates checked against the stack's CA."""
        verify: ssl.SSLContext | bool = True
        if self.grpc_tls is not None:
            verify = ssl.create_default_context(cafile=str(self.grpc_tls.ca_file))
        return httpx.AsyncClient(timeout=timeout, verify=verify, headers={"Authorization": f"Bearer {self.token}"})

    ENV: ClassVar[dict[str, str]] = {
        "redis_url": ENV_REDIS_URL,
        "redis_password": ENV_REDIS_PASSWORD,
        "coordinator_url": ENV_COORDINATOR_URL,
        "token": ENV_TOKEN,
        "operate_token_sha256": ENV_OPERATE_DIGEST,
        "predict_token_sha256": ENV_PREDICT_DIGEST,
        "observe_token_sha256": ENV_OBSERVE_DIGEST,
        "run_dir": ENV_RUN_DIR,
        "shared_dir": ENV_SHARED_DIR,
        "advertise_host": ENV_ADVERTISE_HOST,
        "threads": ENV_THREADS,
        "serving_model": ENV_SERVING_MODEL,
        "serving_version": ENV_SERVING_VERSION,
        "serving_max_batch": ENV_SERVING_MAX_BATCH,
        "serving_max_body_bytes": ENV_SERVING_MAX_BODY_BYTES,
        "serving_memory_gb": ENV_SERVING_MEMORY_GB,
        "serving_shard": ENV_SERVING_SHARD,
        "serving_shards": ENV_SERVING_SHARDS,
    }
    TLS_ENV: ClassVar[dict[str, str]] = {
        "cert_file": ENV_GRPC_TLS_CERT,
        "key_file": ENV_GRPC_TLS_KEY,
        "ca_file": ENV_GRPC_TLS_CA,
    }

    @classmethod
    def from_env(cls, **values: object) -> "ServiceSettings":
        """Build from explicit values plus the TRILLIUM_* environment; raises ConfigError."""
        env: dict[str, object] = dict(_from_env(cls.ENV))
        env["kafka"] = _from_env(KafkaConnection.ENV)
        if tls := _from_env(cls.TLS_ENV):
            env["grpc_tls"] = tls
        merged = env | {k: v for k, v in values.items() if v is not None}
        names = (
            cls.ENV
            | {f"kafka.{k}": v for k, v in KafkaConnection.ENV.items()}
            | {f"grpc_tls.{k}": v for k, v in cls.TLS_ENV.items()}
        )
        return _validate(cls, merged, names)
