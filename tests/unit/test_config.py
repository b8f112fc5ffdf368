"""Settings from the environment (security, threads): each bad one fails at start, naming the field and the
variable it came from."""

from __future__ import annotations

import asyncio

import pytest
import redis

from trillium import config
from trillium.config import ConfigError, KafkaConnection, ServiceSettings
from trillium.wire.state import wait_for_redis

BASE = {
    config.ENV_KAFKA_BOOTSTRAP: "kafka:9092",
    config.ENV_REDIS_URL: "redis://trillium@redis:6379/0",
    config.ENV_COORDINATOR_URL: "http://coordinator:8080",
    config.ENV_TOKEN: "t" * 24,
    config.ENV_OPERATE_DIGEST: "0" * 64,
    config.ENV_PREDICT_DIGEST: "1" * 64,
    config.ENV_RUN_DIR: "/tmp",
}


@pytest.fixture
def env(monkeypatch):
    for name in dir(config):
        if name.startswith("ENV_"):
            monkeypatch.delenv(getattr(config, name), raising=False)
    for var, value in BASE.items():
        monkeypatch.setenv(var, value)
    return monkeypatch


def _settings() -> ServiceSettings:
    return ServiceSettings.from_env(role="embedding_ps", http_port=8080)


def test_the_redis_password_joins_the_urls_user(env) -> None:
    env.setenv(config.ENV_REDIS_PASSWORD, "p@ss/word:1")
    url = _settings().redis_url
    assert url == "redis://trillium:p%40ss%2Fword%3A1@redis:6379/0"
    # redis-py reads it back as it was given.
    kwargs = redis.connection.parse_url(url)
    assert (kwargs["username"], kwargs["password"]) == ("trillium", "p@ss/word:1")
    assert "p@ss" not in repr(_settings())


def test_a_password_given_twice_is_refused(env) -> None:
    env.setenv(config.ENV_REDIS_URL, "redis://trillium:one@redis:6379/0")
    env.setenv(config.ENV_REDIS_PASSWORD, "two")
    with pytest.raises(ConfigError, match="redis_password: the Redis URL carries a password already"):
        _settings()


def test_kafka_sasl_needs_a_user_and_a_password(env) -> None:
    env.setenv(config.ENV_KAFKA_SECURITY_PROTOCOL, "SASL_PLAINTEXT")
    with pytest.raises(ConfigError, match="kafka: .*SASL_PLAINTEXT needs a username and a password"):
        _settings()
    env.setenv(config.ENV_KAFKA_USERNAME, "trillium")
    env.setenv(config.ENV_KAFKA_PASSWORD, "secret")
    kafka = _settings().kafka
    assert (kafka.security_protocol, kafka.sasl_mechanism, kafka.username) == (
        "SASL_PLAINTEXT",
        "SCRAM-SHA-512",
        "trillium",
    )
    assert "secret" not in repr(kafka)


def test_a_bad_kafka_setting_names_its_variable(env) -> None:
    env.setenv(config.ENV_KAFKA_SECURITY_PROTOCOL, "SASL")
    with pytest.raises(ConfigError, match=r"kafka\.security_protocol: .*\(from TRILLIUM_KAFKA_SECURITY_PROTOCOL\)"):
        _settings()
    env.setenv(config.ENV_KAFKA_SECURITY_PROTOCOL, "PLAINTEXT")
    env.setenv(config.ENV_KAFKA_PASSWORD, "secret")
    with pytest.raises(ConfigError, match="only used with SASL"):
        KafkaConnection.from_env()


def test_grpc_tls_needs_all_three_files(env, tmp_path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("not checked here")
    env.setenv(config.ENV_GRPC_TLS_CERT, str(cert))
    with pytest.raises(ConfigError) as err:
        _settings()
    assert "grpc_tls.key_file: Field required (set TRILLIUM_GRPC_TLS_KEY)" in str(err.value)
    assert "grpc_tls.ca_file: Field required (set TRILLIUM_GRPC_TLS_CA)" in str(err.value)


@pytest.mark.parametrize(
    ("field", "variable", "good", "parsed", "bad"),
    [
        ("threads", config.ENV_THREADS, "3", 3, "0"),  # unset: each role's own default
        ("serving_memory_gb", config.ENV_SERVING_MEMORY_GB, "1.5", 1.5, "0"),  # unset: no cap
    ],
)
def test_a_setting_comes_from_the_environment_and_a_bad_value_names_its_variable(
    env, field, variable, good, parsed, bad
) -> None:
    assert getattr(_settings(), field) is None
    env.setenv(variable, good)
    assert getattr(_settings(), field) == parsed
    env.setenv(variable, bad)
    with pytest.raises(ConfigError, match=rf"{field}: .*\(from {variable}\)"):
        _settings()


def test_a_serving_shards_place_and_a_frontends_shards_are_checked_at_start(env) -> None:
    shard = dict(role="serving_shard", http_port=8080)
    with pytest.raises(ConfigError, match=r"serving_shard: a serving shard needs its place"):
        ServiceSettings.from_env(**shard)
    env.setenv(config.ENV_SERVING_SHARD, "3/3")
    with pytest.raises(ConfigError, match=r"serving_shard: index 3 of 3 shards"):
        ServiceSettings.from_env(**shard)
    env.setenv(config.ENV_SERVING_SHARD, "2/3")
    assert ServiceSettings.from_env(**shard).serving_shard == "2/3"
    frontend = dict(role="serving", http_port=8080)
    env.setenv(config.ENV_SERVING_SHARDS, "a:7000|b:7000,c:7000")
    assert ServiceSettings.from_env(**frontend).serving_shard_addresses == [["a:7000", "b:7000"], ["c:7000"]]
    env.setenv(config.ENV_SERVING_SHARDS, "a:7000,c")
    with pytest.raises(ConfigError, match=r"serving_shards: .*shard 1: 'c' is not HOST:PORT.*TRILLIUM_SERVING_SHARDS"):
        ServiceSettings.from_env(**frontend)


def test_each_scope_is_checked_by_its_digest(env) -> None:
    """A service is given the operators' and prediction clients' tokens as digests only; a bad
    or missing one fails at start naming the field and its variable."""
    env.setenv(config.ENV_OPERATE_DIGEST, "not-a-digest")
    with pytest.raises(ConfigError, match=r"operate_token_sha256: .*TRILLIUM_OPERATE_TOKEN_SHA256"):
        _settings()
    env.delenv(config.ENV_OPERATE_DIGEST)
    with pytest.raises(ConfigError, match=r"operate_token_sha256: .*set TRILLIUM_OPERATE_TOKEN_SHA256"):
        _settings()
    env.setenv(config.ENV_OPERATE_DIGEST, "0" * 64)
    env.delenv(config.ENV_PREDICT_DIGEST)
    _settings()  # only serving replicas check a prediction client's token
    with pytest.raises(ConfigError, match=r"predict_token_sha256: a serving replica"):
        ServiceSettings.from_env(role="serving", http_port=8080)


def test_no_error_echoes_a_secret(env) -> None:
    env.setenv(config.ENV_TOKEN, "short-token")  # under 16 characters: refused
    with pytest.raises(ConfigError, match="token: .*16 characters") as refused:
        _settings()
    assert "short-token" not in str(refused.value) and "withheld" in str(refused.value)
    env.setenv(config.ENV_TOKEN, "t" * 24)
    env.setenv(config.ENV_REDIS_URL, "http://trillium:hunter2-redis@redis:6379/0")  # the wrong scheme
    with pytest.raises(ConfigError, match="redis_url: .*redis://") as refused:
        _settings()
    assert "hunter2" not in str(refused.value) and "trillium:***@redis:6379" in str(refused.value)
    env.setenv(config.ENV_REDIS_URL, "redis://trillium@redis:6379/0")
    env.setenv(config.ENV_KAFKA_SECURITY_PROTOCOL, "SASL_PLAINTEXT")
    env.setenv(config.ENV_KAFKA_USERNAME, "trillium")
    env.setenv(config.ENV_KAFKA_PASSWORD, "hunter2-kafka")
    env.setenv(config.ENV_KAFKA_SASL_MECHANISM, "MD5")  # no such mechanism
    with pytest.raises(ConfigError, match="kafka.sasl_mechanism") as refused:
        _settings()
    assert "hunter2" not in str(refused.value)


def test_a_redis_that_does_not_answer_is_named_without_its_password() -> None:
    with pytest.raises(redis.exceptions.TimeoutError) as refused:
        asyncio.run(wait_for_redis("redis://trillium:hunter2@127.0.0.1:1/0", timeout_s=0.3))
    assert "hunter2" not in str(refused.value) and "trillium:***@127.0.0.1:1" in str(refused.value)


def test_the_stacks_kafka_credentials_go_to_its_own_brokers_only(env, tmp_path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-")
    ours = KafkaConnection(
        bootstrap="kafka-0:9093,kafka-1:9093",
        security_protocol="SASL_SSL",
        username="trillium",
        password="hunter2",
        ca_file=ca,
    )
    assert ours.for_brokers(None) is ours
    assert ours.for_brokers(" KAFKA-1:9093,kafka-0:9093") is ours  # the same brokers, named otherwise
    theirs = ours.for_brokers("evil.example:9093")
    assert (theirs.bootstrap, theirs.security_protocol, theirs.username, theirs.password) == (
        "evil.example:9093",
        "SSL",
        None,
        None,
    )
    assert theirs.ca_file == ca  # TLS kept, verified against our CA
    plain = KafkaConnection(bootstrap="kafka:9092", security_protocol="SASL_PLAINTEXT", username="u", password="p")
    assert plain.for_brokers("other:9092").security_protocol == "PLAINTEXT"
