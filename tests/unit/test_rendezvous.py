"""The NN ranks' rendezvous store, reached by a stranger: every key the ranks use is under the
attempt's secret prefix, so what a stranger writes is never what a rank reads."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from trillium.services.nn_worker import rendezvous

TIMEOUT = timedelta(seconds=20)


def test_a_stranger_on_the_store_neither_joins_nor_feeds_a_rank() -> None:
    master = dist.TCPStore("127.0.0.1", 0, 2, True, TIMEOUT, wait_for_workers=False)
    secret = rendezvous.new_secret()
    stranger = dist.TCPStore("127.0.0.1", master.port, 2, False, TIMEOUT)
    # What the stranger can name: the keys without a prefix, or with a guessed one.
    for key in ("device/0", "device/1", "trillium//device/1", "trillium/0/device/1"):
        stranger.set(key, "stranger-host/cuda:0")

    ranks = [rendezvous.secured(master, secret), None]
    seen: dict[int, list[str]] = {}

    def rank(r: int) -> None:
        seen[r] = rendezvous.exchange_idents(ranks[r], r, 2, f"host-{r}/cpu")

    first = threading.Thread(target=rank, args=(0,))
    first.start()  # rank 0 reads device/1 before rank 1 has written it: it must wait for rank 1
    ranks[1] = rendezvous.secured(dist.TCPStore("127.0.0.1", master.port, 2, False, TIMEOUT), secret)
    rank(1)
    first.join(TIMEOUT.total_seconds())
    assert not first.is_alive()
    assert seen == {0: ["host-0/cpu", "host-1/cpu"], 1: ["host-0/cpu", "host-1/cpu"]}
    assert stranger.get("device/1") == b"stranger-host/cuda:0"  # its own writes, untouched by the ranks
