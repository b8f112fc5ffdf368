"""The embedding worker's native plane (`trillium_native.WorkerServer`) over real PS shards (native
stores behind their native servers), on loopback, for the tiny job (26 slots over tables a and b,
a mean slot among them, 2 shards, 2 ranks). Checked against numpy oracles: the pooled embeddings
are the sums (means) of the rows the shards hold, and a step's gradient messages, one per shard,
hold each rank's gradients summed per unique ID, of the IDs that shard owns, once both ranks
pushed; the staleness gate holds a lookup until its bound allows it; the errors are the codes the
NN ranks act on."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import grpc
import numpy as np
import pytest
from tiny_record import tiny_record
from worker_oracle import SIZE, Ranks, encoded, gradient_oracle, pooled_oracle, push_of, random_ids, tiny_job
from worker_plane import METADATA, shard_servers, start_job, tiny_shards, worker_plane

from trillium.wire import codec
from trillium.wire.pb import embedding_pb2 as pb
from trillium.wire.pb import embedding_pb2_grpc as pb_grpc


async def test_a_step_pools_the_shards_rows_and_sends_each_shard_its_ids_gradients() -> None:
    stores, record = tiny_shards(), tiny_job("fp32")
    with shard_servers(stores, record) as ports, worker_plane(record, ports) as plane:
        ranks = Ranks(plane.server.port)
        try:
            ids = {rank: random_ids(rank) for rank in (0, 1)}
            answers = {}
            for rank in (0, 1):
                request = pb.BatchLookupRequest(batch=encoded(rank, ids[rank]), training=True, attempt=1)
                answers[rank] = await ranks.lookup(rank, request)
            for rank, answer in answers.items():
                assert (answer.ref.rank, answer.ref.batch_id, answer.ref.attempt, answer.staleness) == (
                    rank,
                    rank,
                    1,
                    0,
                )
                pooled = codec.unpack_array(answer.pooled.data)
                np.testing.assert_allclose(pooled, pooled_oracle(stores, ids[rank]), rtol=1e-6, atol=1e-7)
            width = sum(answers[0].widths)
            grads = {r: np.random.default_rng(10 + r).normal(size=(SIZE, width)).astype(np.float32) for r in (0, 1)}
            first = await ranks.push(0, push_of(answers[0], grads[0]))
            await asyncio.sleep(0.1)
            assert plane.steps == [] and not first.done()  # rank 1 has not pushed step 0 yet
            second = await ranks.push(1, push_of(answers[1], grads[1]))
            assert (await first).messages == (await second).messages == 2
            [(attempt, step, epoch, publish, key_rank, frames)] = plane.steps
            assert (attempt, step, epoch, publish, key_rank, len(frames)) == (1, 0, 0, False, 0, 2)
            expected: dict[tuple[str, int], np.ndarray] = defaultdict(lambda: 0.0)
            for rank in (0, 1):
                for key, g in gradient_oracle(ids[rank], grads[rank], list(answers[rank].widths)).items():
                    expected[key] = expected[key] + g
            got: dict[tuple[str, int], np.ndarray] = defaultdict(lambda: 0.0)
            for shard, frame in enumerate(frames):
                update = codec.decode_gradients(frame)
                assert (update.ranks, update.step, update.shard) == ((0, 1), 0, shard)
                for table, (table_ids, table_grads) in update.tables.items():
                    for id_, g in zip(table_ids.tolist(), table_grads, strict=True):
                        assert stores[shard].get_row(table, id_) is not None  # the shard owns it
                        got[(table, id_)] = got[(table, id_)] + g
            assert got.keys() == expected.keys()
            for key, g in expected.items():
                np.testing.assert_allclose(got[key], g, rtol=1e-5, atol=1e-6, err_msg=str(key))
        finally:
            await ranks.close()


async def test_fp16_embeddings_and_gradients_keep_their_values_within_fp16() -> None:
    stores, record = tiny_shards(), tiny_job("fp16")
    with shard_servers(stores, record) as ports, worker_plane(record, ports, ranks=[0]) as plane:
        ranks = Ranks(plane.server.port)
        try:
            ids = random_ids(3)
            request = pb.BatchLookupRequest(batch=encoded(0, ids), training=True, fp16=True, attempt=1)
            answer = await ranks.lookup(0, request)
            pooled = codec.unpack_array(answer.pooled.data)
            assert pooled.dtype == np.float16
            np.testing.assert_allclose(pooled.astype(np.float32), pooled_oracle(stores, ids), rtol=2e-3, atol=1e-5)
            grad = np.random.default_rng(5).normal(scale=1e-6, size=pooled.shape).astype(np.float32)
            narrow, scale = codec.to_fp16(grad)
            push = pb.PushGradientsRequest(
                ref=answer.ref, pooled=pb.Array(data=codec.pack_array(narrow)), pooled_scale=scale
            )
            assert (await (await ranks.push(0, push))).messages == 2
            [(*_, frames)] = plane.steps
            got = {}
            for frame in frames:
                for table, (table_ids, table_grads) in codec.decode_gradients(frame).tables.items():
                    got.update({(table, i): g for i, g in zip(table_ids.tolist(), table_grads, strict=True)})
            expected = gradient_oracle(ids, grad, list(answer.widths))
            assert got.keys() == expected.keys()
            for key, g in expected.items():  # tiny gradients, scaled into fp16's range and back
                np.testing.assert_allclose(got[key], g, rtol=5e-3, atol=1e-9, err_msg=str(key))
        finally:
            await ranks.close()


async def test_a_lookup_waits_for_its_staleness_bound_and_an_evaluation_for_the_steps_it_follows() -> None:
    stores, record = tiny_shards(), tiny_record("running", 1)
    with shard_servers(stores, record) as ports, worker_plane(record, ports, gate=(0, 1)) as plane:
        ranks = Ranks(plane.server.port)
        try:
            ahead = pb.BatchLookupRequest(batch=encoded(4, random_ids(4)), training=True, attempt=1)  # step 2
            waiting = asyncio.create_task(ranks.lookup(0, ahead))
            evaluation = pb.BatchLookupRequest(batch=encoded(1, random_ids(5)), training=False, applied=3, attempt=1)
            evaluating = asyncio.create_task(ranks.lookup(1, evaluation))
            await asyncio.sleep(0.2)
            assert not waiting.done() and not evaluating.done()  # 2 - 0 > 1; 3 steps not applied
            plane.server.set_watermark(1, 1, 1, True)
            assert (await waiting).staleness == 1
            await asyncio.sleep(0.1)
            assert not evaluating.done()
            plane.server.set_watermark(1, 3, 1, True)
            assert (await evaluating).staleness == 0
            assert plane.server.pending() == (1, 0)  # the evaluation's plan is not held: no gradients follow
        finally:
            await ranks.close()


async def test_a_failed_send_fails_every_ranks_push_of_the_step_with_its_error() -> None:
    stores, record = tiny_shards(), tiny_record("running", 1)
    with shard_servers(stores, record) as ports, worker_plane(record, ports, durable=False) as plane:
        ranks = Ranks(plane.server.port)
        try:
            answers = [
                await ranks.lookup(r, pb.BatchLookupRequest(batch=encoded(r, random_ids(r)), training=True, attempt=1))
                for r in (0, 1)
            ]
            pushes = [
                await ranks.push(r, push_of(a, np.zeros((SIZE, sum(a.widths)), np.float32)))
                for r, a in enumerate(answers)
            ]
            [(attempt, step, *_)] = plane.wait_steps(1)
            plane.server.step_failed(attempt, step, "KafkaConnectionError: broker away")
            for push in pushes:
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await push
                assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
                assert (
                    "the gradients of step 0 were not sent: KafkaConnectionError: broker away" in failed.value.details()
                )
        finally:
            await ranks.close()


async def test_a_push_whose_stream_ends_leaves_the_others_waiting_for_the_step() -> None:
    stores, record = tiny_shards(), tiny_record("running", 1)
    with shard_servers(stores, record) as ports, worker_plane(record, ports) as plane:
        ranks = Ranks(plane.server.port)
        try:
            answers = [
                await ranks.lookup(r, pb.BatchLookupRequest(batch=encoded(r, random_ids(r)), training=True, attempt=1))
                for r in (0, 1)
            ]
            gone = await ranks.push(0, push_of(answers[0], np.ones((SIZE, sum(answers[0].widths)), np.float32)))
            await asyncio.sleep(0.1)
            ranks.calls[("push", 0)].cancel()  # rank 0's stream ends before its answer
            with pytest.raises(asyncio.CancelledError):
                await gone
            assert (
                await (await ranks.push(1, push_of(answers[1], np.ones((SIZE, sum(answers[1].widths)), np.float32))))
            ).messages == 2
            [(*_, frames)] = plane.steps
            assert codec.decode_gradients(frames[0]).ranks == (0, 1)  # rank 0's gradients went with the step
        finally:
            await ranks.close()


async def test_a_push_is_taken_at_once_and_answered_once_its_step_is_durable_in_step_order() -> None:
    # The next steps are queued while the one before is unacknowledged: a rank's round trips to
    # Kafka overlap, in step order.
    stores, record = tiny_shards(), tiny_job("fp32")
    with shard_servers(stores, record) as ports, worker_plane(record, ports, ranks=[0], durable=False) as plane:
        ranks = Ranks(plane.server.port)
        try:
            answers = []
            for step in range(3):
                request = pb.BatchLookupRequest(batch=encoded(2 * step, random_ids(step)), training=True, attempt=1)
                answer = await ranks.lookup(0, request)
                answers.append(await ranks.push(0, push_of(answer, np.zeros((SIZE, sum(answer.widths)), np.float32))))
            assert [step for _, step, *_ in plane.wait_steps(3)] == [0, 1, 2]
            await asyncio.sleep(0.1)
            assert not any(a.done() for a in answers)
            plane.server.step_sent(1, 1, 2)
            await asyncio.sleep(0.1)
            assert not any(a.done() for a in answers)  # answered in order: step 0's comes first
            plane.server.step_sent(1, 0, 2)
            assert [(await a).messages for a in answers[:2]] == [2, 2]
            plane.server.step_failed(1, 2, "broker away")
            with pytest.raises(grpc.aio.AioRpcError, match="broker away"):
                await answers[2]
        finally:
            await ranks.close()


def _code(port: int, method: str, request) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = getattr(pb_grpc.EmbeddingWorkerStub(channel), method)
        try:
            next(iter(call(iter([request]), metadata=METADATA, timeout=20)))
        except grpc.RpcError as err:
            return err.code(), err.details()
    return grpc.StatusCode.OK, ""


def test_what_the_plane_cannot_serve_has_the_code_a_rank_acts_on() -> None:
    stores, record = tiny_shards(), tiny_record("running", 1)
    lookup = pb.BatchLookupRequest(batch=encoded(0, random_ids(0)), training=True, attempt=1)
    with shard_servers(stores, record) as ports, worker_plane() as plane:
        port = plane.server.port
        code, details = _code(port, "LookupBatches", lookup)
        assert code == grpc.StatusCode.UNAVAILABLE and "embedding_worker-0 has no job set up" in details
        start_job(plane.server, record, ports, ranks=[0])
        stale = pb.BatchLookupRequest(batch=lookup.batch, training=True, attempt=0)
        code, details = _code(port, "LookupBatches", stale)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "serves attempt 1 of job tiny-0123abcd" in details
        ref = pb.EmbeddingRef(worker="embedding_worker-0", rank=1, batch_id=1, epoch=0, attempt=1)
        code, details = _code(port, "PushGradients", pb.PushGradientsRequest(ref=ref))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "ranks [0], not of rank 1" in details
        ref.rank, ref.batch_id = 0, 8
        code, details = _code(port, "PushGradients", pb.PushGradientsRequest(ref=ref))
        assert code == grpc.StatusCode.NOT_FOUND and "no embeddings handed out for EmbeddingRef(" in details
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # no token
            with pytest.raises(grpc.RpcError) as refused:
                next(iter(pb_grpc.EmbeddingWorkerStub(channel).LookupBatches(iter([lookup]), timeout=20)))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The shards gone: the lookup names the shard that did not answer.
    with worker_plane(record, ports, ranks=[0]) as plane:
        code, details = _code(plane.server.port, "LookupBatches", lookup)
        assert code == grpc.StatusCode.UNAVAILABLE and "embedding_ps-0 at 127.0.0.1:" in details, details


def test_a_worker_of_an_attempt_fenced_out_makes_no_row_on_the_shards() -> None:
    """The shards moved on to attempt 2; a worker still serving attempt 1 (cut off when the
    coordinator started the next) is refused by every shard, and no ID it asks for becomes a row."""
    stores, stale = tiny_shards(), tiny_record("running", 1)
    lookup = pb.BatchLookupRequest(batch=encoded(0, random_ids(0)), training=True, attempt=1)
    with shard_servers(stores, tiny_record("running", 2)) as ports, worker_plane(stale, ports, ranks=[0]) as plane:
        code, details = _code(plane.server.port, "LookupBatches", lookup)
    assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
    assert "FAILED_PRECONDITION" in details and "attempt 1 is fenced out" in details, details
    assert all(store.num_rows(table) == 0 for store in stores for table in store.tables())
