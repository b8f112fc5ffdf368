"""The NN ranks' rendezvous: rank 0's TCPStore, where the ranks find each other's devices and
gloo's (or NCCL's) addresses before their process group forms.

The store itself checks no credential: anyone who reaches its port may read and write keys. So
every key of an attempt lives under a secret prefix that rank 0 draws and publishes, with the
store's address, in Redis (which only the stack reaches): a stranger on the network can connect,
but cannot name a key the ranks read or write, so it can neither join the group nor feed a rank
a wrong address, nor make a rank wait on a key of its making.
"""

from __future__ import annotations

import secrets

import torch.distributed as dist


def new_secret() -> str:
    return secrets.token_hex(16)


def secured(store: dist.Store, secret: str) -> dist.Store:
    """`store` with every key under the attempt's secret prefix."""
    return dist.PrefixStore(f"trillium/{secret}", store)


def exchange_idents(store: dist.Store, rank: int, world: int, ident: str) -> list[str]:
    """Every rank's device identity (which host and GPU it trains on), by rank."""
    store.set(f"device/{rank}", ident)
    return [store.get(f"device/{r}").decode() for r in range(world)]
