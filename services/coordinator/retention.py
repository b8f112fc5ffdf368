"""How much Kafka disk a job's topics hold: bounded by its checkpoints, not by time.

- A running job's samples and gradients topics are trimmed (Kafka's DeleteRecords) behind the
  oldest of its newest `keep_last` checkpoints, after each checkpoint is written. No record
  before that cut is read again: a recovery takes the newest checkpoint, or an older one of
  those when the newest is refused, and reads on from its positions (an older checkpoint kept
  only as the base of their deltas lends its embedding rows, not its positions). A topic so holds about `keep_last`
  checkpoint intervals of records; the broker frees them a segment at a time (see
  `JOB_TOPIC_CONFIGS` in jobs.py).
- A finished job's samples, eval and gradients topics are deleted once its workers are done
  with them: nothing can resume a finished job. Its dead-letter topic stays (quarantined input,
  for a human to read) until the job is deleted (`DELETE /v1/jobs/{id}`), as every topic of a
  stopped or failed job does: `resume` reads them.
"""

from __future__ import annotations

import logging

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete

from trillium.job.record import JobRecord
from trillium.runtime.checkpoint import Manifest
from trillium.timeouts import KAFKA_TRIM_S
from trillium.wire import kafka
from trillium.wire.kafka import KafkaConnection

from .jobs import JobNotFound, JobStore
from .lifecycle import needed
from .registry import WorkerRegistry

logger = logging.getLogger("trillium.coordinator.retention")


class TopicRetention:
    def __init__(self, conn: KafkaConnection) -> None:
        self.conn = conn
        self._admin: AIOKafkaAdminClient | None = None

    async def _client(self) -> AIOKafkaAdminClient:
        if self._admin is None:
            admin = kafka.admin(self.conn, request_timeout_ms=int(KAFKA_TRIM_S * 1000))
            await admin.start()
            self._admin = admin
        return self._admin

    async def trim(self, job: JobRecord, oldest: Manifest) -> dict[TopicPartition, int]:
        """Delete the records of the job's samples and gradients topics before the positions of
        the checkpoint `oldest`; returns each partition's new first offset. Best
        effort: a broker away now is trimmed at the next checkpoint."""
        if job.config.checkpoint is None or not job.config.checkpoint.trim_topics:
            return {}
        cut = {
            TopicPartition(topic, int(partition)): RecordsToDelete(before_offset=offset)
            for topic in (job.topics.samples, job.topics.gradients)
            for partition, offset in oldest.positions.get(topic, {}).items()
            if offset > 0
        }
        if not cut:
            return {}
        try:
            return await (await self._client()).delete_records(cut)
        except Exception as err:  # noqa: BLE001 (the disk waits for the next checkpoint)
            logger.warning("topics not trimmed", extra={"job": job.id, "step": oldest.step, "error": str(err)})
            await self.close()  # reconnect next time
            return {}

    async def tick(self, jobs: JobStore, registry: WorkerRegistry, job: JobRecord | None) -> None:
        """Delete a finished job's samples, eval and gradients topics once none of its workers is
        still in its attempt (a consumer left on a deleted topic would only warn, but need not)."""
        if job is None or job.state != "finished" or job.topics_deleted:
            return
        workers = {w.name: w for w in await registry.workers()}
        phases = [workers[n].job_phase(job.id, job.attempt) for n in needed(job.config) if n in workers]
        if any(phase in ("setting_up", "ready") for phase in phases):
            return
        await kafka.delete_topics(self.conn, [job.topics.samples, job.topics.eval, job.topics.gradients])
        try:
            await jobs.update(job.id, _topics_deleted)
        except JobNotFound:
            return  # the job was deleted meanwhile (the warm-up's is, once finished), topics and all
        logger.info("finished job's topics deleted", extra={"job": job.id})

    async def close(self) -> None:
        if self._admin is not None:
            admin, self._admin = self._admin, None
            await admin.close()


def _topics_deleted(job: JobRecord) -> None:
    job.topics_deleted = True
