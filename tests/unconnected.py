"""Settings of a service that is built but never started: its app and its job logic, no peers."""

from __future__ import annotations

from trillium.config import ServiceSettings
from trillium.scopes import token_digest


def unconnected_settings(role: str) -> ServiceSettings:
    return ServiceSettings(
        role=role,
        http_port=0,
        kafka={"bootstrap": "unused:9092"},
        redis_url="redis://unused",
        coordinator_url="http://unused",
        token="unused-token-unused",
        operate_token_sha256=token_digest("unused-operator-token"),
        predict_token_sha256=token_digest("unused-predict-token"),
        run_dir="/nonexistent",
    )
