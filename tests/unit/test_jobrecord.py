"""The job record's lineage: which Kafka records belong to the current attempt of a job."""

from __future__ import annotations

from trillium.job.record import TRANSITIONS, PartitionLineage, extend_lineage


def test_a_first_attempt_counts_its_own_records_only() -> None:
    lineage = PartitionLineage(None)
    assert lineage.counts(0, 0) and lineage.counts(10**9, 0)
    assert not lineage.counts(5, 1)  # a record of an attempt that never was


def test_a_recovery_skips_what_the_abandoned_attempt_wrote_after_the_checkpoint() -> None:
    # Attempt 0 wrote offsets 0..99; its checkpoint saw the loader at 80; attempt 1 restores it.
    lineage = extend_lineage({}, {"samples": {0: 80, 1: 40}}, 1)
    p0 = PartitionLineage(lineage["samples"][0])
    assert all(p0.counts(o, 0) for o in range(80))
    assert not any(p0.counts(o, 0) for o in range(80, 100))  # attempt 0's, after the cut: dead
    assert p0.counts(100, 1) and not p0.counts(100, 0) and not p0.counts(79, 1)
    # A zombie of attempt 0 writing after attempt 1 started is skipped too.
    assert not p0.counts(150, 0)
    assert PartitionLineage(lineage["samples"][1]).counts(39, 0)


def test_recovering_twice_keeps_earlier_dead_ranges_dead() -> None:
    first = extend_lineage({}, {"samples": {0: 80}}, 1)  # attempt 0 died at 100; attempt 1 writes from 100
    # A checkpoint of attempt 1 saw the loader at 150; attempt 2 restores it.
    second = extend_lineage(first, {"samples": {0: 150}}, 2)
    p = PartitionLineage(second["samples"][0])
    assert p.counts(50, 0) and not p.counts(90, 0)  # attempt 0: up to 80 only
    assert p.counts(120, 1) and not p.counts(160, 1)  # attempt 1: from 80 (after its dead range) to 150
    assert p.counts(170, 2) and not p.counts(170, 1)
    # Restoring the older checkpoint again (the newer one was corrupt) drops attempt 1 entirely.
    again = extend_lineage({}, {"samples": {0: 80}}, 3)
    assert not PartitionLineage(again["samples"][0]).counts(120, 1)


def test_a_partition_never_written_starts_the_new_attempt_at_its_end() -> None:
    lineage = extend_lineage({}, {"eval": {0: 0}}, 2)
    assert lineage["eval"][0] == [(0, 2)]


def test_failed_and_stopped_jobs_can_only_resume_by_recovering() -> None:
    assert TRANSITIONS["failed"] == {"recovering"} and TRANSITIONS["stopped"] == {"recovering"}
    assert "recovering" in TRANSITIONS["running"] and "recovering" in TRANSITIONS["recovering"]
    assert not TRANSITIONS["finished"]
