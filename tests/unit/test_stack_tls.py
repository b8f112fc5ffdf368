"""A stack with TLS (`trillium up --tls`, trillium/stack/tls.py): the certificates the launcher
makes are checked by OpenSSL against its CA for the addresses they name, the secrets are kept
where only their owner reads them and kept across starts, and Kafka's configuration takes SCRAM
over TLS only."""

from __future__ import annotations

import ssl
import stat
import subprocess
from pathlib import Path

from trillium.stack import tls
from trillium.stack.broker import format_argv, java_arg, kafka_config


def _verify(ca: str, cert: str, address: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["openssl", "verify", "-CAfile", ca, "-verify_ip", address, cert], capture_output=True, text=True
    )


def test_each_host_gets_a_certificate_for_its_address_signed_by_the_stack_ca(tmp_path) -> None:
    made = tls.ensure(tmp_path, {"kafka": "10.250.0.10", "embedding_ps-0": "10.250.0.11"})
    for host, address in (("kafka", "10.250.0.10"), ("embedding_ps-0", "10.250.0.11")):
        assert _verify(str(made.ca_file), str(made.cert_file(host)), address).returncode == 0
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(made.cert_file(host), made.key_file(host))
    # A certificate names its own host's address only.
    assert _verify(str(made.ca_file), str(made.cert_file("kafka")), "10.250.0.11").returncode != 0
    private = [made.key_file("kafka"), made.keystore("kafka"), tmp_path / "tls" / "ca.key"]
    private.append(tmp_path / "tls" / "passwords.json")
    for path in private:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_a_restart_keeps_the_ca_and_passwords_and_a_new_host_gets_a_certificate(tmp_path) -> None:
    first = tls.ensure(tmp_path, {"redis": "10.250.0.10"})
    ca, cert = first.ca_file.read_bytes(), first.cert_file("redis").read_bytes()
    again = tls.ensure(tmp_path, {"redis": "10.250.0.10", "embedding_ps-1-b": "10.250.0.30"})
    assert again.secrets() == first.secrets() and again.ca_file.read_bytes() == ca
    assert again.cert_file("redis").read_bytes() == cert
    assert _verify(str(again.ca_file), str(again.cert_file("embedding_ps-1-b")), "10.250.0.30").returncode == 0
    assert len(set(first.secrets())) == 2 and all(len(s) >= 32 for s in first.secrets())


def test_a_process_started_by_hand_gets_its_host_certificate_and_the_passwords(tmp_path) -> None:
    made = tls.ensure(tmp_path, {"redis": "10.250.0.10"})
    state = {
        "run_dir": str(tmp_path),
        "tls": {"ca_file": str(made.ca_file)},
        "redis": {"url": f"rediss://10.250.0.10:6379/0?ssl_ca_certs={made.ca_file}"},
    }
    env = tls.process_env(state, "nn_worker-1-b", "10.250.0.31")
    assert env["TRILLIUM_REDIS_URL"] == made.redis_url("10.250.0.10", 6379)
    assert (
        env["TRILLIUM_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL" and env["TRILLIUM_KAFKA_PASSWORD"] == made.kafka_password
    )
    assert _verify(str(made.ca_file), env["TRILLIUM_GRPC_TLS_CERT"], "10.250.0.31").returncode == 0
    assert tls.process_env({"run_dir": str(tmp_path), "tls": None}, "x", "10.250.0.32") == {}


def test_kafka_takes_scram_over_tls_only_and_its_configuration_is_private(tmp_path) -> None:
    made = tls.ensure(tmp_path, {"kafka": "10.250.0.10"})
    props = kafka_config(tmp_path, "10.250.0.10", 9092, 9093, made)
    lines = dict(line.split("=", 1) for line in props.read_text().splitlines() if "=" in line)
    assert lines["listeners"] == "SASL_SSL://10.250.0.10:9092,CONTROLLER://10.250.0.10:9093"
    assert lines["listener.security.protocol.map"] == "CONTROLLER:SSL,SASL_SSL:SASL_SSL"
    assert lines["listener.name.controller.ssl.client.auth"] == "required"
    assert lines["ssl.keystore.location"] == str(made.keystore("kafka"))
    assert made.kafka_password in props.read_text() and stat.S_IMODE(props.stat().st_mode) == 0o600
    plain = kafka_config(tmp_path, "10.250.0.10", 9092, 9093)
    assert "SASL" not in plain.read_text() and made.kafka_password not in plain.read_text()


def test_the_scram_password_is_on_no_command_line(tmp_path) -> None:
    """The storage format's arguments, the SCRAM user's password among them, reach the java
    launcher in a private @-file: its command line (readable by every user) holds only the file's
    name, and the launcher reads each argument back as it was."""
    made = tls.ensure(tmp_path, {"kafka": "10.250.0.10"})
    props = kafka_config(tmp_path, "10.250.0.10", 9092, 9093, made)
    argv = format_argv(tmp_path, "-starts-with-a-dash", props, made)
    assert not any(made.kafka_password in arg for arg in argv), argv
    argfile = Path(argv[-1].removeprefix("@"))
    assert argv[-1].startswith("@") and stat.S_IMODE(argfile.stat().st_mode) == 0o600
    assert made.kafka_password in argfile.read_text()
    # What the launcher makes of such a file: a java program that prints its arguments.
    echo = tmp_path / "Echo.java"
    echo.write_text("class Echo { public static void main(String[] a) { for (String s : a) System.out.println(s); } }")
    tricky = ["--cluster-id=-x", 'a "quoted" word', "back\\slash\\", "[name=u,password=p]", "new\tline's"]
    (tmp_path / "echo.args").write_text("".join(java_arg(a) + "\n" for a in [str(echo), *tricky]))
    ran = subprocess.run(["java", f"@{tmp_path / 'echo.args'}"], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == tricky
