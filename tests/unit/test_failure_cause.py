"""The one line a failed job's error gives: the process at fault, not those that failed calling it."""

from __future__ import annotations

import pytest

from trillium.services.coordinator.registry import Worker, failure_cause, failure_explained

WORKERS = {
    w.name: w
    for w in (
        Worker(
            name=name,
            role=name.split("-")[0],
            index=int(name.split("-")[1]),
            http_url=f"http://127.0.0.1:{port}",
            grpc_address=f"127.0.0.1:{port + 1}",
            pid=1,
            registered_at=0.0,
            last_heartbeat=0.0,
        )
        for name, port in (("nn_worker-0", 7000), ("embedding_worker-0", 7100), ("embedding_ps-1", 7200))
    )
}
DISK = "OSError: [Errno 28] No space left on device: '/d/spill/a.spill'"
CALLER = "gRPC UNAVAILABLE: embedding_ps-1 at 127.0.0.1:7201: INTERNAL: Internal error from Core"


@pytest.mark.parametrize("order", [1, -1])
def test_the_process_whose_error_names_no_failed_one_is_thefailure_cause(order: int) -> None:
    """A PS's disk fills: it reports that, and an NN rank reports the stream to it broken, in
    whichever order they are listed."""
    failed = [("nn_worker-0", CALLER), ("embedding_ps-1", DISK)][::order]
    assert failure_cause(failed, [], WORKERS) == f"embedding_ps-1: {DISK}"


def test_a_caller_alone_names_the_process_it_could_not_reach() -> None:
    assert (
        failure_cause([("nn_worker-0", CALLER)], [], WORKERS) == f"embedding_ps-1 unreachable (nn_worker-0: {CALLER})"
    )


def test_restarts_and_silence_come_first() -> None:
    restarted = ("embedding_worker-0", "restarted while the job ran")
    assert (
        failure_cause([("nn_worker-0", CALLER), restarted], [], WORKERS)
        == "embedding_worker-0: restarted while the job ran"
    )
    assert failure_cause([("nn_worker-0", CALLER)], ["embedding_ps-1"], WORKERS) == "lost contact with embedding_ps-1"


def test_a_call_hidden_by_grpc_alone_does_not_explain_a_failure() -> None:
    """A caller's write racing the status its server ended the stream with: gRPC reports its own
    INTERNAL error, naming no process; the state machine waits for a report that does."""
    hidden = ("nn_worker-0", "gRPC INTERNAL: Internal error from Core")
    assert not failure_explained([hidden], [], WORKERS)
    assert failure_explained([hidden, ("embedding_ps-1", "restarted while the job was running")], [], WORKERS)
    assert failure_explained([hidden, ("embedding_worker-0", CALLER)], [], WORKERS)
    assert failure_explained([hidden], ["embedding_ps-1"], WORKERS)
    assert failure_explained([("embedding_ps-1", DISK)], [], WORKERS)
