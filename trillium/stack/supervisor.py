"""The stack supervisor: a detached process per run directory (`python -m trillium.stack.supervisor`,
started by `trillium up`) that starts Redis, Kafka and the services, restarts a crashed process
(with a bounded budget, then reports it failed), records endpoints and pids in
`<run_dir>/stack.json`, and on SIGTERM stops everything in reverse order."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from trillium import log
from trillium.config import (
    ENV_COORDINATOR_URL,
    ENV_GRPC_TLS_CERT,
    ENV_KAFKA_BOOTSTRAP,
    ENV_KAFKA_SECURITY_PROTOCOL,
    ENV_REDIS_URL,
    ENV_RUN_DIR,
    ENV_SERVING_SHARD,
    ENV_SERVING_SHARDS,
    ENV_THREADS,
    EXIT_REPLACED,
    EXIT_RESTART,
    ROLES,
    KafkaConnection,
    StackTopology,
    default_run_dir,
)
from trillium.job.trust import ENV_ALLOWED_PATHS
from trillium.wire.kafka import wait_for_kafka
from trillium.wire.state import wait_for_redis

from . import object_store, tls
from .broker import format_argv, java_argv, kafka_config, kafka_connection
from .hosts import Cluster, Loopback
from .procs import (
    REPO_ROOT,
    RESTART_WINDOW_S,
    SAFE_IMPORTS,
    STATE_FILE,
    TOKEN_FILES,
    LauncherError,
    Proc,
    die_with_parent,
    make_tokens,
    scope_env,
    write_json,
    write_private,
)

logger = logging.getLogger("trillium.stack.supervisor")

STOP_GRACE_S = 20.0
# The processes whose compute takes threads (ServiceSettings.threads): they share the host's cores.
COMPUTE_ROLES = ("embedding_ps", "nn_worker")
GRPC_ROLES = ("embedding_ps", "embedding_worker", "serving_shard", "serving")
# A role whose entry point is not `trillium.services.<role>`: a serving shard is serving's.
SERVICE_MODULES = {"serving_shard": "trillium.services.serving.shard"}


class Supervisor:
    def __init__(
        self,
        run_dir: Path,
        topology: StackTopology,
        services: bool,
        kafka_bootstrap: str | None,
        redis_url: str | None,
        cluster: bool = False,
        link_delay: bool = False,
        clock_jumps: bool = False,
        with_object_store: bool = False,
        with_tls: bool = False,
        allow_paths: tuple[str, ...] = (),
    ) -> None:
        self.run_dir = run_dir
        self.allow_paths = allow_paths
        self.with_tls = with_tls
        self.tls: tls.StackTls | None = None  # made at start, when the hosts have addresses
        self.with_object_store = with_object_store
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
        make_tokens(run_dir)
        self.place: Loopback | Cluster = (
            Cluster(run_dir, self._host_names(), link_delay=link_delay, clock_jumps=clock_jumps)
            if cluster
            else Loopback(self._load_ports(), self._save_ports)
        )

    # On loopback, ports are remembered per run directory (Kafka's data dir outlives a stack)
    # and re-chosen only when taken; a cluster's hosts use compose's fixed ports.
    def _load_ports(self) -> dict[str, int]:
        try:
            return json.loads((self.run_dir / "ports.json").read_text())
        except (OSError, ValueError):
            return {}

    def _save_ports(self, ports: dict[str, int]) -> None:
        write_json(self.run_dir / "ports.json", ports)

    def _host_names(self) -> list[str]:
        """A host each for what this supervisor starts: Kafka, Redis, the object store, then every
        service process."""
        names = [] if self.kafka_external else ["kafka"]
        names += [] if self.redis_external else ["redis"]
        names += [object_store.HOST] if self.with_object_store else []
        if self.with_services:
            names += [f"{role}-{i}" for role in ROLES for i in range(self.topology.count(role))]
        return names

    def save(self) -> None:
        write_json(
            self.run_dir / STATE_FILE,
            {
                "phase": self.phase,
                "error": self.error,
                "supervisor_pid": os.getpid(),
                "run_dir": str(self.run_dir),
                "kafka": {"bootstrap": self.kafka_bootstrap, "external": self.kafka_external},
                "redis": {"url": self.public_redis_url, "external": self.redis_external},
                "object_store": self.object_store_public,
                "coordinator_url": self.coordinator_url if self.with_services else None,
                "token_files": {scope: str(self.run_dir / name) for scope, name in TOKEN_FILES.items()},
                "processes": [p.public() for p in self.procs],
                "hosts": self.place.public(),
                "tls": {"ca_file": str(self.tls.ca_file)} if self.tls else None,
                "updated_at": time.time(),
            },
        )

    # ---- processes
    def spawn(self, proc: Proc) -> None:
        logfile = open(proc.log, "ab")
        env = os.environ | SAFE_IMPORTS | self.place.env(proc.name) | proc.env
        self.popen[proc.name] = subprocess.Popen(
            self.place.exec_prefix(proc.name) + proc.argv,
            stdout=logfile,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=self.run_dir,
            preexec_fn=die_with_parent,
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
        address, port = self.place.address("redis"), self.place.port("redis", "redis")
        data = self.run_dir / "redis"
        data.mkdir(exist_ok=True)
        self.redis_url = f"redis://{address}:{port}/0"
        listen = ["--port", str(port)]
        if self.tls is not None:
            self.redis_url = self.tls.redis_url(address, port)
            listen = ["--port", "0", "--tls-port", str(port), "--tls-auth-clients", "no"]
            listen += ["--tls-cert-file", str(self.tls.cert_file("redis"))]
            listen += ["--tls-key-file", str(self.tls.key_file("redis"))]
            listen += ["--tls-ca-cert-file", str(self.tls.ca_file)]
        # Append-only persistence: a restarted Redis (or coordinator) loses no state.
        proc = Proc(
            "redis",
            "redis",
            [
                server,
                *self.redis_password_file(),
                "--bind",
                address,
                *listen,
                "--dir",
                str(data),
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--save",
                "",
                # Protected mode refuses every client but loopback's while Redis has no password:
                # a cluster's hosts reach it over the bridge.
                "--protected-mode",
                "yes" if address == "127.0.0.1" and self.tls is None else "no",
                "--daemonize",
                "no",
            ],
            log=str(self.logs / "redis.log"),
            address=address,
        )
        self.procs.append(proc)
        self.spawn(proc)
        await self.wait_ready(proc, lambda: wait_for_redis(self.redis_url, timeout_s=2), 30)

    def redis_password_file(self) -> list[str]:
        """With TLS, Redis's configuration file holding its password (argv is readable by every
        user: /proc/<pid>/cmdline); it goes first, as redis-server takes a file only there."""
        if self.tls is None:
            return []
        conf = self.run_dir / "redis" / "password.conf"
        write_private(conf, f"requirepass {self.tls.redis_password}\n")
        return [str(conf)]

    def allowed_roots(self) -> list[str]:
        """Where this stack's jobs may read data and keep state, unless TRILLIUM_ALLOWED_PATHS
        says: the run directory, the shipped examples' data, what `--allow-path` named and the
        object store's bucket (trillium.job.trust)."""
        roots = [str(self.run_dir), str(REPO_ROOT / "examples"), *self.allow_paths]
        if store := self.object_store_public:
            roots.append(store["url"])
        return roots

    @property
    def object_store_public(self) -> dict[str, Any] | None:
        if not self.with_object_store:
            return None
        return object_store.public(self.place.address(object_store.HOST), self.place.port(object_store.HOST, "s3"))

    async def start_object_store(self) -> None:
        address, port = self.place.address(object_store.HOST), self.place.port(object_store.HOST, "s3")
        proc = object_store.proc(self.run_dir, address, port, str(self.logs / "store.log"))
        self.procs.append(proc)
        self.spawn(proc)

        async def answers() -> None:  # any HTTP answer: S3 refuses an unsigned request with 403
            async with httpx.AsyncClient(timeout=2.0) as http:
                await http.get(f"http://{address}:{port}/")

        await self.wait_ready(proc, answers, 30)

    async def start_kafka(self) -> None:
        address = self.place.address("kafka")
        port, cport = self.place.port("kafka", "kafka"), self.place.port("kafka", "kafka_controller")
        if KafkaConnection.from_env(f"{address}:{port}").secured:
            # The services would inherit the setting and fail against our plaintext broker.
            raise LauncherError(
                f"{ENV_KAFKA_SECURITY_PROTOCOL} is set, but the launcher's own broker is plaintext "
                f"on loopback: unset it, or set {ENV_KAFKA_BOOTSTRAP} to use an external Kafka"
            )
        props = kafka_config(self.run_dir, address, port, cport, self.tls)
        self.kafka_bootstrap = f"{address}:{port}"
        if not (self.run_dir / "kafka" / "data" / "meta.properties").exists():
            cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
            argv = format_argv(self.run_dir, cluster_id, props, self.tls)
            try:
                fmt = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True)
            finally:
                (self.run_dir / "kafka" / "format.args").unlink(missing_ok=True)
            if fmt.returncode != 0:
                raise LauncherError(f"formatting Kafka storage failed:\n{fmt.stdout[-2000:]}{fmt.stderr[-2000:]}")
        proc = Proc(
            "kafka",
            "kafka",
            java_argv(self.run_dir, ["kafka.Kafka", str(props)]),
            log=str(self.logs / "kafka.log"),
            address=address,
        )
        self.procs.append(proc)
        self.spawn(proc)
        conn = kafka_connection(self.kafka_bootstrap, external=False, tls=self.tls)
        await self.wait_ready(proc, lambda: wait_for_kafka(conn, timeout_s=2), 90)

    @property
    def coordinator_url(self) -> str:
        scheme = "https" if self.with_tls else "http"
        return f"{scheme}://{self.place.address('coordinator-0')}:{self.place.port('coordinator-0', 'http')}"

    def service_proc(self, role: str, index: int) -> Proc:
        name = f"{role}-{index}"
        address, http_port = self.place.address(name), self.place.port(name, "http")
        grpc_port = self.place.port(name, "grpc") if role in GRPC_ROLES else None
        module = SERVICE_MODULES.get(role, f"trillium.services.{role}")
        argv = [sys.executable, "-m", module, "--index", str(index), "--http-port", str(http_port)]
        argv += ["--host", address]
        if grpc_port:
            argv += ["--grpc-port", str(grpc_port)]
        env = {
            ENV_KAFKA_BOOTSTRAP: self.kafka_bootstrap,
            ENV_REDIS_URL: self.redis_url,
            ENV_COORDINATOR_URL: self.coordinator_url,
            **scope_env(self.run_dir),
            ENV_RUN_DIR: str(self.run_dir),
            "PYTHONUNBUFFERED": "1",
        }
        if ENV_ALLOWED_PATHS not in os.environ:  # the operator's roots stand as given
            env[ENV_ALLOWED_PATHS] = ",".join(self.allowed_roots())
        if store := self.object_store_public:
            env |= object_store.client_env(self.run_dir, store["endpoint"])
        if self.tls is not None:
            env |= self.tls.service_env(name)
        if role in COMPUTE_ROLES and ENV_THREADS not in os.environ:
            env[ENV_THREADS] = str(self.compute_threads())
        if role == "serving_shard":
            env[ENV_SERVING_SHARD] = f"{index % self.topology.serving_shards}/{self.topology.serving_shards}"
        if role == "serving" and self.topology.serving_shards:
            env[ENV_SERVING_SHARDS] = self.serving_shards()
        return Proc(
            name,
            role,
            argv,
            log=str(self.logs / f"{name}.log"),
            index=index,
            http_port=http_port,
            grpc_port=grpc_port,
            env=env,
            address=address,
            tls=self.tls is not None,
        )

    def serving_shards(self) -> str:
        """A frontend's `TRILLIUM_SERVING_SHARDS`: shard s's replicas are processes s, s + N, ..."""
        count = self.topology.serving_shards
        return ",".join(
            "|".join(
                f"{self.place.address(name)}:{self.place.port(name, 'grpc')}"
                for name in (f"serving_shard-{i}" for i in range(shard, self.topology.serving_shard_processes, count))
            )
            for shard in range(count)
        )

    def compute_threads(self) -> int:
        """The cores each PS shard and NN rank of this one-host stack may keep busy: a share each.
        More threads than cores only trade work for handoffs (a PS shard's pool spinning and
        yielding while the other processes want the core)."""
        processes = sum(self.topology.count(role) for role in COMPUTE_ROLES)
        return max(1, (os.cpu_count() or 1) // max(processes, 1))

    @property
    def public_redis_url(self) -> str | None:
        """Redis's URL as the stack's state shows it: without the password (in `<run-dir>/tls/`)."""
        if self.tls is None or self.redis_url is None or self.redis_external:
            return self.redis_url
        return self.redis_url.replace(f":{self.tls.redis_password}@", "")

    async def start_services(self) -> None:
        # One client for every readiness poll: making one loads the CA bundle, 32 ms of CPU here.
        verify = ssl.create_default_context(cafile=str(self.tls.ca_file)) if self.tls else True
        async with httpx.AsyncClient(timeout=2.0, verify=verify) as http:

            async def ready(proc: Proc) -> None:
                (await http.get(f"{proc.http_url}/readyz")).raise_for_status()

            for role in ROLES:  # coordinator first: the others register with it
                group = [self.service_proc(role, i) for i in range(self.topology.count(role))]
                for proc in group:
                    self.procs.append(proc)
                    self.spawn(proc)
                await asyncio.gather(*(self.wait_ready(p, lambda p=p: ready(p), 90) for p in group))

    async def start(self) -> None:
        if os.environ.get(ENV_GRPC_TLS_CERT):
            # The services would take a deployment's certificates, which name its hosts, not ours.
            raise LauncherError(
                f"{ENV_GRPC_TLS_CERT} is set, but the launcher makes its stack's own certificates "
                "(`trillium up --tls`): unset it"
            )
        await asyncio.to_thread(self.place.create)
        if self.with_tls:
            hosts = {name: self.place.address(name) for name in self._host_names()}
            self.tls = await asyncio.to_thread(tls.ensure, self.run_dir, hosts)
        self.save()
        if not self.redis_external:
            await self.start_redis()
        else:
            await wait_for_redis(self.redis_url)
        if not self.kafka_external:
            await self.start_kafka()
        else:
            await wait_for_kafka(kafka_connection(self.kafka_bootstrap, external=True))
        if self.with_object_store:
            await self.start_object_store()
        if self.with_services:
            await self.start_services()

    # ---- supervision
    async def restart_if_crashed(self, proc: Proc) -> None:
        popen = self.popen.get(proc.name)
        if popen is None or popen.poll() is None or proc.state in ("stopped", "replaced"):
            return
        if proc.state == "backoff":
            if time.monotonic() >= (proc.restart_at or 0.0):
                proc.restarts += 1
                proc.restart_at = None
                self.spawn(proc)
            return
        if popen.returncode == EXIT_REPLACED:  # another host's process holds its role: not ours to restart
            logger.warning("replaced by another host's process", extra={"proc": proc.name})
            proc.state = "replaced"
            self.save()
            return
        if popen.returncode == EXIT_RESTART:  # asked to be started afresh: not a crash
            logger.info("restart requested", extra={"proc": proc.name})
            proc.restarts += 1
            self.spawn(proc)
            return
        delay = proc.crashed(time.monotonic())
        logger.error(
            "process exited", extra={"proc": proc.name, "code": popen.returncode, "log_tail": self.tail(proc, 5)}
        )
        if delay:
            self.phase = "degraded"
            self.error = (
                f"{proc.name} crashed {len(proc.crash_times)} times in {RESTART_WINDOW_S:.0f}s: "
                f"restarting it in {delay:.0f}s; see {proc.log}"
            )
            logger.error("process crash-looping: its restart waits", extra={"proc": proc.name, "delay_s": delay})
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
            if self.phase == "degraded" and not any(p.state == "backoff" for p in self.procs):
                self.phase, self.error = "running", None  # every crash-looping process restarted
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
        self.place.destroy()
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m trillium.stack.supervisor", description="The stack supervisor (started by `trillium up`)."
    )
    parser.add_argument("--run-dir", type=Path, default=None, help=f"default: ${ENV_RUN_DIR} or .trillium/run")
    parser.add_argument("--topology", default="{}", help="StackTopology as JSON")
    parser.add_argument("--no-services", action="store_true", help="only Kafka and Redis")
    parser.add_argument("--cluster", action="store_true", help="each process on a host of its own (root)")
    parser.add_argument(
        "--link-delay", action="store_true", help="with --cluster: latency can be added to each host's links"
    )
    parser.add_argument(
        "--clock-jumps",
        action="store_true",
        help="with --cluster: each service's wall clock can be moved (stack/clocks.py)",
    )
    parser.add_argument(
        "--object-store", action="store_true", help="an S3 object store (versitygw) for s3://trillium/... paths"
    )
    parser.add_argument(
        "--tls", action="store_true", help="TLS on every listener, Redis and Kafka with passwords (stack/tls.py)"
    )
    parser.add_argument(
        "--allow-path",
        action="append",
        default=[],
        help="a directory or URL prefix jobs may also read data from and keep state under (repeatable)",
    )
    args = parser.parse_args(argv)
    if args.link_delay and not args.cluster:
        parser.error("--link-delay needs --cluster")
    if args.clock_jumps and not args.cluster:
        parser.error("--clock-jumps needs --cluster")
    run_dir = (args.run_dir or default_run_dir()).absolute()
    log.configure("launcher")
    try:
        sup = Supervisor(
            run_dir,
            StackTopology.model_validate_json(args.topology),
            not args.no_services,
            os.environ.get(ENV_KAFKA_BOOTSTRAP),
            os.environ.get(ENV_REDIS_URL),
            cluster=args.cluster,
            link_delay=args.link_delay,
            clock_jumps=args.clock_jumps,
            with_object_store=args.object_store,
            with_tls=args.tls,
            allow_paths=tuple(str(Path(p).absolute()) if "://" not in p else p for p in args.allow_path),
        )
    except LauncherError as err:
        # What to do (a tool to build, a setting to fix) goes where `up` reads it, not only to the log.
        logger.error("the stack cannot start", extra={"error": str(err)})
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(run_dir / STATE_FILE, {"phase": "failed", "error": str(err), "supervisor_pid": os.getpid()})
        raise SystemExit(1) from None
    raise SystemExit(asyncio.run(sup.main()))


if __name__ == "__main__":
    main()
