"""The embedding_ps service."""

from __future__ import annotations

from trillium.service import Service, run_service


class EmbeddingPS(Service):
    role = "embedding_ps"


def main() -> None:
    run_service(EmbeddingPS)
