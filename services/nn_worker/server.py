"""The nn_worker service."""

from __future__ import annotations

from trillium.service import Service, run_service


class NNWorker(Service):
    role = "nn_worker"


def main() -> None:
    run_service(NNWorker)
