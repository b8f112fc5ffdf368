"""The embedding_worker service."""

from __future__ import annotations

from trillium.service import Service, run_service


class EmbeddingWorker(Service):
    role = "embedding_worker"


def main() -> None:
    run_service(EmbeddingWorker)
