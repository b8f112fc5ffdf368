"""The data_loader service."""

from __future__ import annotations

from trillium.service import Service, run_service


class DataLoader(Service):
    role = "data_loader"


def main() -> None:
    run_service(DataLoader)
