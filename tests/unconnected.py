"""Settings of a service that is built but never started: its app and its job logic, no peers."""

from __future__ import annotations

from trillium.config import ServiceSettings


def unconnected_settings(role: str) -> ServiceSettings:
    return ServiceSettings(
        role=role,
        http_port=0,
        kafka={"bootstrap": "unused:9092"},
        redis_url="redis://unused",
        coordinator_url="http://unused",
        token="unused-token-unused",
        run_dir="/nonexistent",
    )
