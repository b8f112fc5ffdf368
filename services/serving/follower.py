"""A replica's copy of one model, kept at the newest committed version, or pinned to one.

1. **Start.** Load the newest version whose chain loads (its full version, then each delta after
   it) from the model store; a version whose files fail their checks is refused, said so in the
   model's view and metrics, and the newest older one is tried.
2. **Follow.** Each committed version is announced on the model's topic (`trillium.<model>.model`).
   On a notice, or every `POLL_S` should one be lost, the versions the store holds past the one
   served are applied in order: on top of the tables when the version fits (a delta on a base they
   have reached in the same attempt), else its chain is loaded into a new `ServedModel` that
   replaces the old one whole, as a replica that slept past the retention horizon does.
3. **Pin.** `pin(N)` loads version N's chain into a new `ServedModel` and stops following;
   `unpin()` loads the newest and follows again.
4. **Forget.** A forget rewrites the model's files without some IDs and raises the model's forget
   count (`ModelStore.forget_seq`); a replica that reads a higher count than the one it loaded
   under loads the version it serves (pinned or not) anew from the rewritten files.

A version refused on the way (a checksum, a row on the wrong shard, a chain that no longer loads)
leaves the previous one serving; the follower goes on with the next. A store that does not answer
(cut off, down) refuses nothing: the version served goes on, the view says since when the store
is unreachable, and the next poll tries again from the same version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka import TopicPartition

from trillium.config import KafkaConnection
from trillium.runtime.model_store import CorruptVersion, ModelStore, VersionManifest
from trillium.runtime.storage import unreachable
from trillium.wire import kafka

from .served import WHOLE, ServedModel, Slice, check_memory

logger = logging.getLogger("trillium.serving")

POLL_S = 5.0  # the store is read at least this often, should a notice be lost
REFUSALS_KEPT = 20
SERVED_KEPT = 100  # versions whose first serving time the view keeps (freshness measurements)


@dataclass
class Refusal:
    version: int
    at: float
    reason: str
    forget_seq: int  # the files were rewritten since when the count rose: worth another try


@dataclass
class FollowerState:
    """What the model view says of the follower."""

    pinned: int | None = None
    refused: list[Refusal] = field(default_factory=list)
    applied: int = 0  # versions applied since the replica started
    forgets: int = 0  # the model's forget count the tables served were loaded under
    first_served_at: dict[int, float] = field(default_factory=dict)  # version -> when it began serving (latest few)
    error: str | None = None  # why nothing is served, while nothing is
    store_unreachable_since: float | None = None  # the first read of the store that failed, while they fail
    store_error: str | None = None  # what the last of those said


class ModelFollower:
    def __init__(
        self,
        store: ModelStore,
        topic: str,
        conn: KafkaConnection,
        make: Callable[[VersionManifest], Any],
        *,
        rows: Slice | None = WHOLE,
        memory_cap: int | None = None,
    ) -> None:
        self.store = store
        self.topic = topic
        self.conn = conn
        # A new model from a chain's first version: a ServedModel (a replica's, a serving shard's)
        # or a frontend's (sharded.py), holding `rows` of the tables (None: none, a frontend's).
        self.make = make
        self.rows = rows
        self.memory_cap = memory_cap  # bytes the tables may take (None: no cap); a version over it is refused
        self.served: ServedModel | None = None
        self.state = FollowerState()
        self.loaded = asyncio.Event()  # set once a version serves (or the store holds none yet: see `ready`)
        self._wake = asyncio.Event()
        # Held while a version is applied or a pin loads: a pin never lands in the middle of a
        # catch-up's version, to be overwritten by it when that version's load ends.
        self._applying = asyncio.Lock()
        self._forget_seq = 0  # the model's forget count read before the tables served were loaded
        self._task: asyncio.Task[None] | None = None
        self._on_change: Callable[[ModelFollower, VersionManifest | None, float], None] = lambda *_: None

    @property
    def name(self) -> str:
        return self.store.model

    def start(self, on_change: Callable[[ModelFollower, VersionManifest | None, float], None]) -> ModelFollower:
        """`on_change(follower, manifest, seconds)` is called when a version begins to serve (after
        `seconds` of applying it), and with None when one is refused."""
        self._on_change = on_change
        self._task = asyncio.create_task(self._run(), name=f"follow {self.name}")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # ---- pinning -------------------------------------------------------------------------------
    async def pin(self, version: int) -> VersionManifest:
        """Serve version `version` (its chain from the store) and stop following; CorruptVersion
        (or LookupError when there is no such version) leaves things as they were."""
        if version not in await asyncio.to_thread(self.store.versions):
            raise LookupError(f"model {self.name} has no version {version}")
        async with self._applying:
            served = await self._load_chain(version)
            self.state.pinned = version
            self._serve(served)
        return served.manifest

    async def unpin(self) -> None:
        self.state.pinned = None
        self._wake.set()

    # ---- following -----------------------------------------------------------------------------
    async def _run(self) -> None:
        listening = asyncio.Event()
        notices = asyncio.create_task(self._notices(listening), name=f"notices {self.name}")
        try:
            # The store is first read once the notices are followed, so that no version committed
            # in between waits for the poll (unless Kafka is away: then the poll it is).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(listening.wait(), POLL_S)
            while True:
                self._wake.clear()  # before reading the store: a notice meanwhile reads it again
                await self._read_store()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), POLL_S)
        finally:
            notices.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await notices

    async def _notices(self, listening: asyncio.Event) -> None:
        """Wake the follower for every notice on the topic (from its end: the store says the rest);
        `listening` is set once the end is found."""
        while True:
            consumer = kafka.consumer(self.conn, group_id=None)
            try:
                partition = TopicPartition(self.topic, 0)
                consumer.assign([partition])
                await consumer.start()
                await consumer.seek_to_end(partition)
                await consumer.position(partition)  # the end, resolved now rather than at the first fetch
                listening.set()
                while True:
                    records = await consumer.getmany(partition, timeout_ms=1000)
                    if records.get(partition):
                        self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 (the poll covers for the notices meanwhile)
                logger.warning("model notices unavailable", extra={"model": self.name, "error": str(err)})
                await asyncio.sleep(POLL_S)
            finally:
                with contextlib.suppress(Exception):
                    await consumer.stop()

    async def _read_store(self) -> None:
        """Catch up with the store (unless pinned), or, while it does not answer, say so and serve on."""
        try:
            await self._reload_if_forgotten()
            if self.state.pinned is None:
                await self._catch_up()
        except Exception as err:
            if not unreachable(err):
                raise
            if self.state.store_unreachable_since is None:
                self.state.store_unreachable_since = time.time()
                logger.warning("model store unreachable", extra={"model": self.name, "error": str(err)})
            self.state.store_error = str(err)

    def _store_answered(self) -> None:
        """The store answered: it is reachable from now, whatever its versions hold."""
        if self.state.store_unreachable_since is not None:
            after_s = round(time.time() - self.state.store_unreachable_since, 1)
            logger.info("model store reachable again", extra={"model": self.name, "after_s": after_s})
        self.state.store_unreachable_since = self.state.store_error = None

    async def _reload_if_forgotten(self) -> None:
        """Load the version served anew when a forget rewrote the files since it was loaded."""
        seq = await asyncio.to_thread(self.store.forget_seq)
        if seq == self._forget_seq:
            return
        self._forget_seq = seq  # first: a forget while this loads raises it again, and is seen next
        async with self._applying:
            held = self.served.manifest if self.served is not None else None
            if held is None:
                return  # nothing served yet: what loads next is read from the rewritten files
            try:
                self._serve(await self._load_chain(held.version))
            except (CorruptVersion, OSError, ValueError) as err:
                if unreachable(err):
                    raise
                self._refuse(held.version, err)
                self.served, self.state.error = None, "the version served was forgotten from and no longer loads"

    async def _catch_up(self) -> None:
        listed = await asyncio.to_thread(self.store.versions)
        self._store_answered()  # before applying them: a version served is a store that answered
        versions = [v for v in listed if not self._refused(v)]
        if self.served is None:
            async with self._applying:
                await self._start_at_newest(versions, published=bool(listed))
        for version in versions:
            async with self._applying:  # a pin asked meanwhile waits for this version, then wins
                if self.state.pinned is not None:
                    break
                if self.served is not None and version > self.served.version:
                    await self._apply(version)
        self.loaded.set()

    async def _start_at_newest(self, versions: list[int], published: bool) -> None:
        """A replica starts at the newest version that loads: its chain brings the rest. With
        none, its error says why (what `/predict`'s 503 answers): none `published`, or the
        newest refusal, however long ago it was refused."""
        for version in reversed(versions):
            if self.served is not None:  # a pin loaded one meanwhile
                return
            try:
                self._serve(await self._load_chain(version))
                return
            except (CorruptVersion, OSError, ValueError) as err:
                if unreachable(err):
                    raise
                self._refuse(version, err)
        if not published:
            self.state.error = "no version published yet"
            return
        last = self.state.refused[-1] if self.state.refused else None
        why = f": version {last.version} refused: {last.reason}" if last is not None else ""
        self.state.error = f"no version of {self.name} loads{why}"

    async def _apply(self, version: int) -> None:
        """`version` on top of the tables served when it fits them, else its chain anew."""
        assert self.served is not None
        try:
            manifest = await asyncio.to_thread(self.store.manifest, version)
            if self.served.fits(manifest):
                # A delta goes on top of tables within the cap (so they pass it by one delta's new
                # rows at most: how many of its rows are new is known only once it is applied).
                held = self._loads([manifest]) if manifest.kind == "full" else self.served.memory_bytes()
                check_memory(manifest, held, self.memory_cap)
                seconds = await asyncio.to_thread(self.served.apply, manifest)
                self._served_version(manifest, seconds)
            else:  # a new lineage, other tables, a base these tables never reached
                self._serve(await self._load_chain(version))
        except (CorruptVersion, OSError, ValueError) as err:
            if unreachable(err):
                raise
            self._refuse(version, err)

    def _refused(self, version: int) -> bool:
        return any(r.version == version and r.forget_seq == self._forget_seq for r in self.state.refused)

    async def _load_chain(self, version: int) -> ServedModel:
        """A new ServedModel holding `version`, loaded from its full version on."""
        started = time.monotonic()
        chain = await asyncio.to_thread(self.store.chain, version)
        # Before any of it is read: its full version's files (a delta's rows mostly replace rows of
        # it, so the chain's files would count them again and again); then what the tables took.
        check_memory(chain[-1], self._loads(chain[:1]), self.memory_cap)
        served = self.make(chain[0])
        for manifest in chain:
            await asyncio.to_thread(served.apply, manifest)
        check_memory(chain[-1], served.memory_bytes(), self.memory_cap)
        logger.info(
            "model loaded",
            extra={
                "model": self.name,
                "version": version,
                "chain": [m.version for m in chain],
                "seconds": round(time.monotonic() - started, 3),
            },
        )
        return served

    def _loads(self, manifests: list[VersionManifest]) -> int:
        return 0 if self.rows is None else self.rows.values_bytes(manifests)

    def _serve(self, served: ServedModel) -> None:
        self.served = served  # one assignment: a request holds the old one or the new one
        self.state.forgets = self._forget_seq
        self.state.error = None
        manifest = served.manifest
        assert manifest is not None
        self._served_version(manifest, 0.0)

    def _served_version(self, manifest: VersionManifest, seconds: float) -> None:
        self.state.applied += 1
        self.state.first_served_at[manifest.version] = time.time()
        for old in sorted(self.state.first_served_at)[:-SERVED_KEPT]:
            del self.state.first_served_at[old]
        self._on_change(self, manifest, seconds)

    def _refuse(self, version: int, err: Exception) -> None:
        logger.error("version refused", extra={"model": self.name, "version": version, "error": str(err)})
        self.state.refused = [
            *self.state.refused[-(REFUSALS_KEPT - 1) :],
            Refusal(version, time.time(), str(err), self._forget_seq),
        ]
        self._on_change(self, None, 0.0)
