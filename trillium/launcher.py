"""The local stack: Kafka (KRaft), Redis and the five services as supervised processes.

`up()` starts a detached supervisor process for a run directory and waits until the
stack is ready; the supervisor starts everything, restarts a crashed process (with a
bounded budget, then reports it failed), records endpoints and pids in
`<run_dir>/stack.json`, and on SIGTERM stops everything in reverse order. `status()`
probes every endpoint with its real protocol; `down()` stops the supervisor.

Kafka and Redis are started only when no external server is configured
(TRILLIUM_KAFKA_BOOTSTRAP / TRILLIUM_REDIS_URL). Ports are free ones chosen per run
directory, so several stacks (tests and a demo, say) run side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import ctypes
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from trillium import log
from trillium.config import (
    ENV_COORDINATOR_URL,
    ENV_KAFKA_BOOTSTRAP,
    ENV_KAFKA_SECURITY_PROTOCOL,
    ENV_REDIS_URL,
    ENV_RUN_DIR,
    ENV_THREADS,
    ENV_TOKEN,
    EXIT_RESTART,
    ROLES,
    KafkaConnection,
    Topology,
    default_run_dir,
)
from trillium.kafka import wait_for_kafka
from trillium.state import wait_for_redis

logger = logging.getLogger("trillium.launcher")

REPO_ROOT = Path(__file__).resolve().parents[1]
KAFKA_LIBS = Path(os.environ.get("TRILLIUM_KAFKA_LIBS", REPO_ROOT / ".cache" / "kafka" / "libs"))
# A 2-core machine: keep the broker small and predictable.
KAFKA_HEAP = os.environ.get("TRILLIUM_KAFKA_HEAP", "768m")
STATE_FILE = "stack.json"
# Restart budget per process: more crashes than this within the window means "failed".
RESTARTS_ALLOWED = 3
RESTART_WINDOW_S = 120.0
STOP_GRACE_S = 20.0
# The processes whose compute takes threads (ServiceSettings.threads): they share the host's cores.
COMPUTE_ROLES = ("embedding_ps", "nn_worker")


class LauncherError(RuntimeError):
    """The stack could not be started or stopped; the message says why."""


# ---- small helpers ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _die_with_parent() -> None:
    """In a child: get SIGTERM if the supervisor dies, so nothing is left behind."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def read_state(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def _kafka_connection(bootstrap: str, external: bool) -> KafkaConnection:
    """Our own broker listens in plaintext on loopback; an external one is reached as the environment says."""
    return KafkaConnection.from_env(bootstrap) if external else KafkaConnection(bootstrap=bootstrap)


def read_token(run_dir: Path) -> str:
    return (run_dir / "token").read_text().strip()


# ---- process specs --------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    role: str  # "kafka", "redis" or a service role
    argv: list[str]
    log: str
    index: int = 0
    http_port: int | None = None
    grpc_port: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    pid: int | None = None
    restarts: int = 0
    state: str = "pending"  # pending, starting, running, restarting, failed, stopped
    crash_times: list[float] = field(default_factory=list)

    def public(self) -> dict[str, Any]:
        d = asdict(self)
        for private in ("argv", "env", "crash_times"):
            d.pop(private)
        if self.http_port:
            d["http_url"] = f"http://127.0.0.1:{self.http_port}"
        d["grpc_address"] = f"127.0.0.1:{self.grpc_port}" if self.grpc_port else None
        return d


def _kafka_config(run_dir: Path, port: int, controller_port: int) -> Path:
    kdir = run_dir / "kafka"
    kdir.mkdir(parents=True, exist_ok=True)
    props = kdir / "server.properties"
    props.write_text(
        "\n".join(
            [
                "process.roles=broker,controller",
                "node.id=1",
                f"controller.quorum.voters=1@127.0.0.1:{controller_port}",
                f"listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
                f"advertised.listeners=PLAINTEXT://127.0.0.1:{port}",
                "controller.listener.names=CONTROLLER",
                "inter.broker.listener.name=PLAINTEXT",
                "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
                f"log.dirs={kdir / 'data'}",
                "num.partitions=1",
                "offsets.topic.replication.factor=1",
                "offsets.topic.num.partitions=8",
                "transaction.state.log.replication.factor=1",
                "transaction.state.log.min.isr=1",
                "group.initial.rebalance.delay.ms=0",
                "auto.create.topics.enable=false",
                # Batches of embeddings/gradients are large; 16 MiB messages.
                "message.max.bytes=16777216",
                "replica.fetch.max.bytes=16777216",
                "log.retention.hours=24",
                "num.network.threads=2",
                "num.io.threads=2",
                "",
            ]
        )
    )
    (kdir / "log4j.properties").write_text(
        "\n".join(
            [
                "log4j.rootLogger=INFO, stdout",
                "log4j.appender.stdout=org.apache.log4j.ConsoleAppender",
                "log4j.appender.stdout.layout=org.apache.log4j.PatternLayout",
                "log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n",
                "log4j.logger.kafka=INFO",
                "log4j.logger.org.apache.kafka=WARN",
                "",
            ]
        )
    )
    return props


def _java_argv(run_dir: Path, main: list[str]) -> list[str]:
    java = shutil.which("java")
    if java is None:
        raise LauncherError(
            "'java' not found: install a JDK 17+ (Debian: apt-get install openjdk-17-jre-headless), "
            f"or set {ENV_KAFKA_BOOTSTRAP} to use an external Kafka"
        )
    if not (KAFKA_LIBS / ".complete").exists():
        raise LauncherError(
            f"Kafka jars not found in {KAFKA_LIBS}: run `make setup`, "
            f"or set {ENV_KAFKA_BOOTSTRAP} to use an external Kafka"
        )
    # A single dev node serves one machine's traffic: the serial collector and the C1 compiler
    # alone cost a fraction of G1's GC threads and C2's compilations (measured per sample in
    # bench/e2e.py; see docs/performance.md), at no cost a local job can see.
    return [
        java,
        "-Xms256m",
        f"-Xmx{KAFKA_HEAP}",
        "-XX:+UseSerialGC",
        "-XX:TieredStopAtLevel=1",
        "-XX:-UsePerfData",
        "-Djava.awt.headless=true",
        f"-Dlog4j.configuration=file:{run_dir / 'kafka' / 'log4j.properties'}",
        "-cp",
        str(KAFKA_LIBS / "*"),
        *main,
    ]


# ---- the supervisor (runs in its own detached process) -----------------------------------


class Supervisor:
    def __init__(
        self, run_dir: Path, topology: Topology, services: bool, kafka_bootstrap: str | None, redis_url: str | None
    ) -> None:
        self.run_dir = run_dir
        self.topology = topology
        self.with_services = services
        self.kafka_bootstrap = kafka_bootstrap
        self.redis_url = redis_url
        self.kafka_external = kafka_bootstrap is not None
        self.redis_external = redis_url is not None
        self.procs: list[Proc] = []
        self.popen: dict[str, subprocess.Popen[bytes]] = {}
        self.phase = "starting"
        self.error: str | None = None
        self.stopping = False
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.ports = self._load_ports()

    # Ports are remembered per run directory (Kafka's data dir outlives a stack) and
    # re-chosen only when taken.
    def _load_ports(self) -> dict[str, int]:
        path = self.run_dir / "ports.json"
        try:
            ports = json.loads(path.read_text())
        except (OSError, ValueError):
            ports = {}
        return {k: v for k, v in ports.items() if _port_free(v)}

    def port(self, name: str) -> int:
        if name not in self.ports:
            taken = set(self.ports.values())
            port = _free_port()
            while port in taken:
                port = _free_port()
            self.ports[name] = port
            _write_json(self.run_dir / "ports.json", self.ports)
        return self.ports[name]

    def save(self) -> None:
        _write_json(
            self.run_dir / STATE_FILE,
            {
                "phase": self.phase,
                "error": self.error,
                "supervisor_pid": os.getpid(),
                "run_dir": str(self.run_dir),
                "kafka": {"bootstrap": self.kafka_bootstrap, "external": self.kafka_external},
                "redis": {"url": self.redis_url, "external": self.redis_external},
                "coordinator_url": self.coordinator_url if self.with_services else None,
                "token_file": str(self.run_dir / "token"),
                "processes": [p.public() for p in self.procs],
                "updated_at": time.time(),
            },
        )

    # ---- processes
    def spawn(self, proc: Proc) -> None:
        logfile = open(proc.log, "ab")
        env = os.environ | proc.env
        self.popen[proc.name] = subprocess.Popen(
            proc.argv,
            stdout=logfile,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=self.run_dir,
            preexec_fn=_die_with_parent,
        )
        logfile.close()
        proc.pid = self.popen[proc.name].pid
        proc.state = "starting"
        logger.info("started", extra={"proc": proc.name, "pid": proc.pid})
        self.save()

    def tail(self, proc: Proc, lines: int = 15) -> str:
        try:
            return "\n".join(Path(proc.log).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def wait_ready(self, proc: Proc, check, timeout_s: float) -> None:
        """Wait for `check()` to pass while the process stays alive."""
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.popen[proc.name].poll() is not None:
                raise LauncherError(
                    f"{proc.name} exited with code {self.popen[proc.name].returncode} "
                    f"while starting; last log lines ({proc.log}):\n{self.tail(proc)}"
                )
            try:
                await check()
                proc.state = "running"
                self.save()
                return
            except Exception as exc:  # any failed probe means "not yet"
                last = exc
            await asyncio.sleep(0.3)
        raise LauncherError(f"{proc.name} not ready after {timeout_s:.0f}s ({last}); log: {proc.log}")

    async def start_redis(self) -> None:
        server = shutil.which("redis-server")
        if server is None:
            raise LauncherError(
                "'redis-server' not found: install it (Debian: apt-get install redis-server), "
                f"or set {ENV_REDIS_URL} to use an external Redis"
            )
        port = self.port("redis")
        data = self.run_dir / "redis"
        data.mkdir(exist_ok=True)
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        # Append-only persistence: a restarted Redis (or coordinator) loses no state.
        proc = Proc(
            "redis",
            "redis",
            [
                server,
                "--bind",
                "127.0.0.1",
                "--port",
                str(port),
                "--dir",
                str(data),
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--save",
                "",
                "--protected-mode",
                "yes",
                "--daemonize",
                "no",
            ],
            log=str(self.logs / "redis.log"),
        )
        self.procs.append(proc)
        self.spawn(proc)
        await self.wait_ready(proc, lambda: wait_for_redis(self.redis_url, timeout_s=2), 30)

    async def start_kafka(self) -> None:
        port, cport = self.port("kafka"), self.port("kafka_controller")
        if KafkaConnection.from_env(f"127.0.0.1:{port}").secured:
            # The services would inherit the setting and fail against our plaintext broker.
            raise LauncherError(
                f"{ENV_KAFKA_SECURITY_PROTOCOL} is set, but the launcher's own broker is plaintext "
                f"on loopback: unset it, or set {ENV_KAFKA_BOOTSTRAP} to use an external Kafka"
            )
        props = _kafka_config(self.run_dir, port, cport)
        self.kafka_bootstrap = f"127.0.0.1:{port}"
        if not (self.run_dir / "kafka" / "data" / "meta.properties").exists():
            cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
            # "--cluster-id=" binds the value: an id starting with "-" (1 in 64) is no option.
            fmt = await asyncio.to_thread(
                subprocess.run,
                _java_argv(
                    self.run_dir, ["kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}", "-c", str(props)]
                ),
                capture_output=True,
                text=True,
            )
            if fmt.returncode != 0:
                raise LauncherError(f"formatting Kafka storage failed:\n{fmt.stdout[-2000:]}{fmt.stderr[-2000:]}")
        proc = Proc(
            "kafka", "kafka", _java_argv(self.run_dir, ["kafka.Kafka", str(props)]), log=str(self.logs / "kafka.log")
        )
        self.procs.append(proc)
        self.spawn(proc)
        conn = _kafka_connection(self.kafka_bootstrap, external=False)
        await self.wait_ready(proc, lambda: wait_for_kafka(conn, timeout_s=2), 90)

    def token(self) -> str:
        path = self.run_dir / "token"
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32))
        return read_token(self.run_dir)

    @property
    def coordinator_url(self) -> str:
        return f"http://127.0.0.1:{self.port('coordinator-0.http')}"

    def service_proc(self, role: str, index: int) -> Proc:
        name = f"{role}-{index}"
        http_port = self.port(f"{name}.http")
        grpc_port = self.port(f"{name}.grpc") if role in ("embedding_ps", "embedding_worker") else None
        argv = [sys.executable, "-m", f"trillium.services.{role}", "--index", str(index), "--http-port", str(http_port)]
        if grpc_port:
            argv += ["--grpc-port", str(grpc_port)]
        env = {
            ENV_KAFKA_BOOTSTRAP: self.kafka_bootstrap,
            ENV_REDIS_URL: self.redis_url,
            ENV_COORDINATOR_URL: self.coordinator_url,
            ENV_TOKEN: self.token(),
            ENV_RUN_DIR: str(self.run_dir),
            "PYTHONUNBUFFERED": "1",
        }
        if role in COMPUTE_ROLES and ENV_THREADS not in os.environ:
            env[ENV_THREADS] = str(self.compute_threads())
        return Proc(
            name,
            role,
            argv,
            log=str(self.logs / f"{name}.log"),
            index=index,
            http_port=http_port,
            grpc_port=grpc_port,
            env=env,
        )

    def compute_threads(self) -> int:
        """The cores each PS shard and NN rank of this one-host stack may keep busy: a share each.
        More threads than cores only trade work for handoffs (a PS shard's pool spinning and
        yielding while the other processes want the core)."""
        processes = sum(self.topology.count(role) for role in COMPUTE_ROLES)
        return max(1, (os.cpu_count() or 1) // max(processes, 1))

    @staticmethod
    async def _http_ready(url: str) -> None:
        async with httpx.AsyncClient(timeout=2.0) as client:
            (await client.get(url)).raise_for_status()

    async def start_services(self) -> None:
        for role in ROLES:  # coordinator first: the others register with it
            group = [self.service_proc(role, i) for i in range(self.topology.count(role))]
            for proc in group:
                self.procs.append(proc)
                self.spawn(proc)
            await asyncio.gather(
                *(
                    self.wait_ready(p, lambda p=p: self._http_ready(f"http://127.0.0.1:{p.http_port}/readyz"), 90)
                    for p in group
                )
            )

    async def start(self) -> None:
        if not self.redis_external:
            await self.start_redis()
        else:
            await wait_for_redis(self.redis_url)
        if not self.kafka_external:
            await self.start_kafka()
        else:
            await wait_for_kafka(_kafka_connection(self.kafka_bootstrap, external=True))
        if self.with_services:
            await self.start_services()

    # ---- supervision
    async def restart_if_crashed(self, proc: Proc) -> None:
        popen = self.popen.get(proc.name)
        if popen is None or popen.poll() is None or proc.state in ("failed", "stopped"):
            return
        if popen.returncode == EXIT_RESTART:  # asked to be started afresh: not a crash
            logger.info("restart requested", extra={"proc": proc.name})
            proc.restarts += 1
            self.spawn(proc)
            return
        now = time.monotonic()
        proc.crash_times = [t for t in proc.crash_times if now - t < RESTART_WINDOW_S] + [now]
        logger.error(
            "process exited", extra={"proc": proc.name, "code": popen.returncode, "log_tail": self.tail(proc, 5)}
        )
        if len(proc.crash_times) > RESTARTS_ALLOWED:
            proc.state = "failed"
            self.phase = "degraded"
            self.error = f"{proc.name} crashed {len(proc.crash_times)} times in {RESTART_WINDOW_S:.0f}s; see {proc.log}"
            logger.error("giving up on process", extra={"proc": proc.name})
            self.save()
            return
        proc.restarts += 1
        proc.state = "restarting"
        self.spawn(proc)

    async def supervise(self) -> None:
        while not self.stopping:
            for proc in self.procs:
                await self.restart_if_crashed(proc)
                if proc.state == "starting" and self.popen[proc.name].poll() is None:
                    proc.state = "running"  # a restarted process; readiness is in status()
                    self.save()
            await asyncio.sleep(0.5)

    def stop_all(self) -> None:
        # Reverse order: services before the infrastructure they flush to.
        for proc in reversed(self.procs):
            popen = self.popen.get(proc.name)
            if popen is None or popen.poll() is not None:
                proc.state = "stopped"
                continue
            popen.terminate()
            try:
                popen.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                logger.warning("did not stop in time; killing", extra={"proc": proc.name})
                popen.kill()
                popen.wait()
            proc.state = "stopped"
            logger.info("stopped", extra={"proc": proc.name, "code": popen.returncode})
        self.save()

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        main_task = asyncio.current_task()

        def on_signal() -> None:
            self.stopping = True
            if self.phase == "starting" and main_task is not None:
                main_task.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        self.save()
        code = 0
        try:
            await self.start()
            self.phase = "running"
            self.save()
            logger.info("stack running")
            await self.supervise()
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            self.phase, self.error, code = "failed", str(exc), 1
            logger.error("stack failed", extra={"error": str(exc)})
        finally:
            self.stop_all()
            if self.phase != "failed":
                self.phase = "stopped"
            self.save()
        return code


# ---- client side: up / status / down ----------------------------------------------------


def up(
    run_dir: Path,
    topology: Topology | None = None,
    *,
    services: bool = True,
    kafka_bootstrap: str | None = None,
    redis_url: str | None = None,
    timeout_s: float = 240.0,
) -> dict[str, Any]:
    """Start the stack in `run_dir` (or find it running) and return its state."""
    run_dir = run_dir.absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    current = read_state(run_dir)
    if current and _pid_alive(current.get("supervisor_pid")) and current["phase"] in ("starting", "running"):
        raise LauncherError(
            f"a stack is already running in {run_dir} (supervisor pid {current['supervisor_pid']}); "
            "use `trillium status` or `trillium down`"
        )
    (run_dir / STATE_FILE).unlink(missing_ok=True)
    argv = [
        sys.executable,
        "-m",
        "trillium.launcher",
        "--run-dir",
        str(run_dir),
        "--topology",
        (topology or Topology()).model_dump_json(),
    ]
    if not services:
        argv.append("--no-services")
    env = dict(os.environ)
    env.pop(ENV_KAFKA_BOOTSTRAP, None)
    env.pop(ENV_REDIS_URL, None)
    kafka_bootstrap = kafka_bootstrap or os.environ.get(ENV_KAFKA_BOOTSTRAP)
    redis_url = redis_url or os.environ.get(ENV_REDIS_URL)
    if kafka_bootstrap:
        env[ENV_KAFKA_BOOTSTRAP] = kafka_bootstrap
    if redis_url:
        env[ENV_REDIS_URL] = redis_url
    (run_dir / "logs").mkdir(exist_ok=True)
    with open(run_dir / "logs" / "supervisor.log", "ab") as logfile:
        sup = subprocess.Popen(
            argv, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = read_state(run_dir)
        if st and st.get("supervisor_pid") == sup.pid and st["phase"] == "running":
            return st
        if sup.poll() is not None:
            st = read_state(run_dir) or {}
            raise LauncherError(
                f"the stack failed to start: {st.get('error') or 'supervisor exited'} (logs in {run_dir / 'logs'})"
            )
        time.sleep(0.2)
    down(run_dir)
    raise LauncherError(f"the stack was not ready in {timeout_s:.0f}s (logs in {run_dir / 'logs'})")


async def _probe(st: dict[str, Any]) -> dict[str, Any]:
    async def kafka() -> dict[str, Any]:
        try:
            conn = _kafka_connection(st["kafka"]["bootstrap"], st["kafka"]["external"])
            return {"ok": True, "brokers": await wait_for_kafka(conn, timeout_s=5)}
        except Exception as exc:
            return {"ok": False, "error": str(exc)}

    async def redis() -> dict[str, Any]:
        try:
            await wait_for_redis(st["redis"]["url"], timeout_s=3)
            return {"ok": True}
        except Exception as exc:
            return {"ok": False, "error": str(exc)}

    async def health(client: httpx.AsyncClient, proc: dict[str, Any]) -> dict[str, Any]:
        try:
            r = await client.get(f"{proc['http_url']}/healthz")
            return {"ok": r.status_code == 200 and r.json().get("status") == "ok", **r.json()}
        except (httpx.HTTPError, ValueError) as exc:
            return {"ok": False, "error": str(exc)}

    services = [p for p in st["processes"] if p.get("http_port")]
    async with httpx.AsyncClient(timeout=3.0) as client:
        k, r, *h = await asyncio.gather(kafka(), redis(), *(health(client, p) for p in services))
    return {"kafka": k, "redis": r, "services": dict(zip((p["name"] for p in services), h, strict=True))}


def status(run_dir: Path) -> dict[str, Any]:
    """The stack's endpoints and each part's health, probed now with its own protocol."""
    run_dir = run_dir.absolute()
    st = read_state(run_dir)
    if st is None:
        return {"run_dir": str(run_dir), "phase": "not running", "healthy": False}
    if not _pid_alive(st.get("supervisor_pid")):
        st["phase"] = "not running" if st["phase"] in ("stopped", "failed") else "dead"
        st["healthy"] = False
        return st
    probes = asyncio.run(_probe(st))
    st["kafka"].update(probes["kafka"])
    st["redis"].update(probes["redis"])
    for proc in st["processes"]:
        if proc["name"] in probes["services"]:
            proc["health"] = probes["services"][proc["name"]]
    st["healthy"] = (
        st["phase"] == "running"
        and probes["kafka"]["ok"]
        and probes["redis"]["ok"]
        and all(h["ok"] for h in probes["services"].values())
    )
    return st


def down(run_dir: Path, timeout_s: float = 90.0) -> bool:
    """Stop the stack in `run_dir`; returns False if none was running."""
    run_dir = run_dir.absolute()
    st = read_state(run_dir)
    pid = st.get("supervisor_pid") if st else None
    if not _pid_alive(pid):
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _pid_alive(pid):
        # Last resort: the supervisor hung; take down everything it recorded.
        for proc in (read_state(run_dir) or st)["processes"]:
            if _pid_alive(proc.get("pid")):
                os.kill(proc["pid"], signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m trillium.launcher", description="The stack supervisor (started by `trillium up`)."
    )
    parser.add_argument("--run-dir", type=Path, default=None, help=f"default: ${ENV_RUN_DIR} or .trillium/run")
    parser.add_argument("--topology", default="{}", help="Topology as JSON")
    parser.add_argument("--no-services", action="store_true", help="only Kafka and Redis")
    args = parser.parse_args(argv)
    run_dir = (args.run_dir or default_run_dir()).absolute()
    log.configure("launcher")
    sup = Supervisor(
        run_dir,
        Topology.model_validate_json(args.topology),
        not args.no_services,
        os.environ.get(ENV_KAFKA_BOOTSTRAP),
        os.environ.get(ENV_REDIS_URL),
    )
    raise SystemExit(asyncio.run(sup.main()))


if __name__ == "__main__":
    main()
