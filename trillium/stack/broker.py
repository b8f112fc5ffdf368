"""The local Kafka broker: a single KRaft node (broker and controller) on loopback, its
configuration files and the `java` command line that runs it from the Maven-resolved jars."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from trillium.config import ENV_KAFKA_BOOTSTRAP, KafkaConnection

from .procs import REPO_ROOT, LauncherError, write_private
from .tls import KAFKA_MECHANISM, KAFKA_USER, StackTls

KAFKA_LIBS = Path(os.environ.get("TRILLIUM_KAFKA_LIBS", REPO_ROOT / ".cache" / "kafka" / "libs"))
ENV_KAFKA_HEAP = "TRILLIUM_KAFKA_HEAP"
# A 2-core machine: keep the broker small and predictable.
DEFAULT_KAFKA_HEAP = "768m"
SCRAM_LOGIN = "org.apache.kafka.common.security.scram.ScramLoginModule required"


def kafka_heap() -> str:
    """The broker's fixed Java heap, as `-Xmx` takes it; checked here so that a typo stops
    `trillium up` with its name rather than a JVM that never opens its port."""
    heap = os.environ.get(ENV_KAFKA_HEAP, DEFAULT_KAFKA_HEAP)
    if not re.fullmatch(r"[1-9][0-9]*[kKmMgG]?", heap):
        raise LauncherError(f"{ENV_KAFKA_HEAP}={heap!r}: expected a size such as 768m or 2g")
    return heap


def kafka_connection(bootstrap: str, external: bool, tls: StackTls | None = None) -> KafkaConnection:
    """Our own broker: plaintext, or with `tls` SCRAM over TLS; an external one is reached as the
    environment says."""
    if external:
        return KafkaConnection.from_env(bootstrap)
    return tls.kafka_connection(bootstrap) if tls else KafkaConnection(bootstrap=bootstrap)


def _listeners(address: str, port: int, controller_port: int, tls: StackTls | None) -> list[str]:
    """Plaintext on the host's address; with `tls`, clients log in with SCRAM over TLS, and the
    controller, which only the broker beside it calls, takes only a client with a certificate of
    the stack's CA (the broker presents its host's)."""
    voters = f"controller.quorum.voters=1@{address}:{controller_port}"
    if tls is None:
        return [
            voters,
            f"listeners=PLAINTEXT://{address}:{port},CONTROLLER://{address}:{controller_port}",
            f"advertised.listeners=PLAINTEXT://{address}:{port}",
            "inter.broker.listener.name=PLAINTEXT",
            "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        ]
    jaas = f'{SCRAM_LOGIN} username="{KAFKA_USER}" password="{tls.kafka_password}";'
    return [
        voters,
        f"listeners=SASL_SSL://{address}:{port},CONTROLLER://{address}:{controller_port}",
        f"advertised.listeners=SASL_SSL://{address}:{port}",
        "inter.broker.listener.name=SASL_SSL",
        "listener.security.protocol.map=CONTROLLER:SSL,SASL_SSL:SASL_SSL",
        "listener.name.controller.ssl.client.auth=required",
        f"sasl.enabled.mechanisms={KAFKA_MECHANISM}",
        f"sasl.mechanism.inter.broker.protocol={KAFKA_MECHANISM}",
        f"listener.name.sasl_ssl.{KAFKA_MECHANISM.lower()}.sasl.jaas.config={jaas}",
        "ssl.keystore.type=PEM",
        f"ssl.keystore.location={tls.keystore('kafka')}",
        "ssl.truststore.type=PEM",
        f"ssl.truststore.location={tls.ca_file}",
    ]


def scram_user(tls: StackTls) -> list[str]:
    """The storage format's options that create the clients' SCRAM user (KRaft keeps it in its
    metadata log, written when the storage is formatted)."""
    return ["--add-scram", f"{KAFKA_MECHANISM}=[name={KAFKA_USER},password={tls.kafka_password}]"]


def format_argv(run_dir: Path, cluster_id: str, props: Path, tls: StackTls | None) -> list[str]:
    """The command that formats the broker's storage. Its arguments (the SCRAM password among
    them, with TLS) go in a file only the owner reads, which the java launcher expands (`@file`):
    a command line is readable by every user of the host (/proc/<pid>/cmdline)."""
    # "--cluster-id=" binds the value: an id starting with "-" (1 in 64) is no option.
    args = ["kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}", "-c", str(props)]
    args += scram_user(tls) if tls else []
    argfile = run_dir / "kafka" / "format.args"
    write_private(argfile, "".join(java_arg(a) + "\n" for a in args))
    return java_argv(run_dir, [f"@{argfile}"])


def java_arg(arg: str) -> str:
    """One argument as a java @-file holds it: quoted, a backslash and a quote escaped."""
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def kafka_config(run_dir: Path, address: str, port: int, controller_port: int, tls: StackTls | None = None) -> Path:
    kdir = run_dir / "kafka"
    kdir.mkdir(parents=True, exist_ok=True)
    props = kdir / "server.properties"
    write_private(  # with TLS, it holds the password
        props,
        "\n".join(
            [
                "process.roles=broker,controller",
                "node.id=1",
                *_listeners(address, port, controller_port, tls),
                "controller.listener.names=CONTROLLER",
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
                # A trim of a job's topics (DeleteRecords behind a checkpoint) frees disk within this.
                "log.retention.check.interval.ms=30000",
                "num.network.threads=2",
                "num.io.threads=2",
                "",
            ]
        ),
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


def java_argv(run_dir: Path, main: list[str]) -> list[str]:
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
    # bench/e2e.py; see docs/performance.md), at no cost a local job can see. The heap is fixed
    # and touched at start (Kafka's own start script sets Xms = Xmx): a broker that grew its heap
    # to the cap over its first hour looked like a leak to anything watching its RSS.
    heap = kafka_heap()
    return [
        java,
        f"-Xms{heap}",
        f"-Xmx{heap}",
        "-XX:+AlwaysPreTouch",
        "-XX:+UseSerialGC",
        "-XX:TieredStopAtLevel=1",
        "-XX:-UsePerfData",
        "-Djava.awt.headless=true",
        f"-Dlog4j.configuration=file:{run_dir / 'kafka' / 'log4j.properties'}",
        "-cp",
        str(KAFKA_LIBS / "*"),
        *main,
    ]
