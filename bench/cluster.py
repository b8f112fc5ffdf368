"""What hybrid training buys when the network costs: PERSIA's headline, measured on a cluster.

The stack runs on a cluster of hosts on this machine (trillium/stack/hosts.py: every process,
Kafka and Redis included, on a network namespace of its own), every TCP connection into a host
through scripts/linkdelay. Each cell is one link round trip (about 0: the bridge alone, then 1,
5 and 20 ms added) and one cap per host (a token bucket each way on every link), and in it the
same job trains in each mode, the modes' order alternating from cell to cell:

    sync (staleness bound 0), hybrid (k = 4 and k = 16), async (no bound);
    and on request auto (`staleness_bound: auto`, its choice in the cell)

For each: samples/s, the test AUC, the staleness observed, the share of each NN rank's training
time spent waiting for its embeddings (and in its own step: forward, backward, the dense
all-reduce), and the bytes per trained sample that crossed each link during the job, its
evaluation included (nftables counters on the bridge, Ethernet frames with every header),
beside what docs/scaling.md's arithmetic (section 3.8) predicts for this job. Needs root.

    .venv/bin/python bench/cluster.py --json             # every cell (about 40 minutes)
    .venv/bin/python bench/cluster.py --rtts 0,5 --bandwidths 10000 --modes sync,hybrid4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trillium import stack
from trillium.cli import summarize
from trillium.config import StackTopology
from trillium.job import JobConfig
from trillium.stack.client import CoordinatorClient
from trillium.stack.links import Network

TOPOLOGY = StackTopology(nn_ranks=2, ps_shards=2, embedding_workers=1, data_loaders=1, serving_replicas=0)
MODES: dict[str, int | str | None] = {"sync": 0, "hybrid4": 4, "hybrid16": 16, "async": None, "auto": "auto"}
DEFAULT_MODES = "sync,hybrid4,hybrid16,async"
SLOTS = 26
DENSE = 13
DIM = 16
VOCAB = 100_000  # per slot, uniform: a step repeats about 1% of its IDs, so no dedup to speak of

# The links whose bytes the arithmetic predicts, each the (from, to) host pairs it sums.
_EW = "embedding_worker-0"
_NN = ("nn_worker-0", "nn_worker-1")
_PS = ("embedding_ps-0", "embedding_ps-1")
LINKS: dict[str, list[tuple[str, str]]] = {
    "loader->broker": [("data_loader-0", "kafka")],
    "broker->nn": [("kafka", n) for n in _NN],
    "nn->ew": [(n, _EW) for n in _NN],
    "ew->nn": [(_EW, n) for n in _NN],
    "ew->ps": [(_EW, p) for p in _PS],
    "ps->ew": [(p, _EW) for p in _PS],
    "gradients ew->broker": [(_EW, "kafka")],
    "gradients broker->ps": [("kafka", p) for p in _PS],
    "nn<->nn (all-reduce)": [(_NN[0], _NN[1]), (_NN[1], _NN[0])],
}


def predicted_bytes(wire_bytes: int, train_rows: int, test_rows: int) -> dict[str, float | None]:
    """docs/scaling.md 3.8's arithmetic for this job, per trained sample: message payloads, no
    dedup, no headers. The job's evaluation crosses the same links once per test row, without
    gradients, its embeddings and rows in fp32 (the embedding worker asks for fp16 only when
    training)."""
    sample = SLOTS * (8 + 4) + DENSE * 4 + 4 + 8
    train = {
        "loader->broker": sample,
        "broker->nn": sample,
        "nn->ew": sample + SLOTS * DIM * wire_bytes,  # the encoded batch, then its embeddings' gradients
        "ew->nn": SLOTS * DIM * wire_bytes,
        "ew->ps": SLOTS * 8,
        "ps->ew": SLOTS * DIM * wire_bytes,
        "gradients ew->broker": SLOTS * (8 + DIM * wire_bytes),
        "gradients broker->ps": SLOTS * (8 + DIM * wire_bytes),
    }
    evaluation = {
        "loader->broker": sample,
        "broker->nn": sample,
        "nn->ew": sample,
        "ew->nn": SLOTS * DIM * 4,
        "ew->ps": SLOTS * 8,
        "ps->ew": SLOTS * DIM * 4,
        "gradients ew->broker": 0,
        "gradients broker->ps": 0,
    }
    out: dict[str, float | None] = {
        hop: (train_rows * train[hop] + test_rows * evaluation[hop]) / train_rows for hop in train
    }
    out["nn<->nn (all-reduce)"] = None  # per step, not per sample: the dense model's gradients
    return out


def bench_job(steps: int, batch: int, bound: int | str | None) -> JobConfig:
    rows = steps * batch * TOPOLOGY.nn_ranks
    return JobConfig.model_validate(
        {
            "name": "cluster-bench",
            "data": {
                "source": "synthetic",
                "rows": rows,
                "test_rows": 20_000,
                "seed": 5,
                "vocab_sizes": [VOCAB] * SLOTS,
                "zipf_exponent": 0.0,
            },
            "slots": [{"name": f"c{i}", "column": f"C{i}", "table": f"t{i}"} for i in range(1, SLOTS + 1)],
            "tables": {
                f"t{i}": {"dim": DIM, "optimizer": {"name": "adagrad", "lr": 0.05}} for i in range(1, SLOTS + 1)
            },
            "dense": [{"column": f"I{i}", "normalization": "log1p"} for i in range(1, DENSE + 1)],
            "label": {"column": "label", "positive": "1", "negative": "0"},
            "model": {
                "cls": "trillium.models:DNN",
                "kwargs": {"num_dense": DENSE, "embedding_dims": [DIM] * SLOTS, "hidden": [128, 64]},
            },
            "training": {
                "batch_size": batch,
                "epochs": 1,
                "staleness_bound": bound,
                "dense_optimizer": {"name": "sgd", "lr": 0.1},
                "seed": 0,
                "eval_batch_size": 4096,
            },
            "topology": TOPOLOGY.model_dump(include={"nn_ranks", "ps_shards", "embedding_workers"}),
        }
    )


def run_cell_mode(run_dir: Path, network: Network, job: JobConfig, mode: str) -> dict[str, Any]:
    pairs = sorted({pair for hop in LINKS.values() for pair in hop})
    network.count(pairs)
    client = CoordinatorClient.for_stack(run_dir)
    started = time.monotonic()
    try:
        view = client.follow(client.submit(job)["id"], timeout_s=3600)
    finally:
        client.close()
    report = summarize(view, time.monotonic() - started)
    if report["state"] != "finished":
        raise RuntimeError(f"{mode}: the job {report['state']}: {report['error']}")
    # The whole job's bytes: a part of it (while the ranks train, say) would not do, since the
    # loader produces ahead, the ranks' consumers fetch ahead and gradient pushes fall behind.
    counted = network.counted()
    ranks = list(view["results"].values())
    wire = 2 if job.training.wire_dtype == "fp16" else 4
    predicted = predicted_bytes(wire, job.data.rows, job.data.test_rows)
    links = {}
    for hop, hop_pairs in LINKS.items():
        measured = sum(counted.get(p, 0) for p in hop_pairs) / job.data.rows
        links[hop] = {
            "bytes_per_sample": round(measured, 1),
            "predicted": predicted[hop],
            "ratio": round(measured / predicted[hop], 3) if predicted[hop] else None,
        }
    return {
        "mode": mode,
        "staleness_bound": job.training.staleness_bound,
        "samples_per_sec": round(report["samples_per_sec"], 1),
        "auc": report["auc"],
        "mean_staleness": round(report["mean_staleness_observed"], 3),
        "max_staleness": report["max_staleness_observed"],
        "wait_share_per_rank": [round(r["seconds"]["lookup_wait"] / r["train_seconds"], 3) for r in ranks],
        "step_share_per_rank": [round(r["seconds"]["step"] / r["train_seconds"], 3) for r in ranks],
        # The rest: waiting for the next batch from Kafka, progress reports, checkpoint cuts.
        "other_share_per_rank": [
            round(1 - (r["seconds"]["lookup_wait"] + r["seconds"]["step"]) / r["train_seconds"], 3) for r in ranks
        ],
        "auto_bound": view.get("auto_bound"),
        "steps": report["steps"],
        "train_seconds": round(report["train_seconds"], 2),
        "links": links,
    }


def measure_links(network: Network) -> dict[str, Any]:
    """The round trip and bandwidth actually measured, operator to a PS host and to the broker."""
    return {
        name: {"rtt_ms": round(network.rtt_ms(name), 3), "mbit_per_s": round(network.mbit_per_s(name, 0.5))}
        for name in ("embedding_ps-0", "kafka")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rtts", default="0,1,5,20", help="round trips to add, ms, comma-separated")
    parser.add_argument("--bandwidths", default="10000,1000", help="caps per host, Mbit/s, comma-separated")
    parser.add_argument("--modes", default=DEFAULT_MODES, help=f"of {', '.join(MODES)}")
    parser.add_argument("--steps", type=int, default=150, help="steps each run trains")
    parser.add_argument("--batch", type=int, default=1024, help="samples a step, per rank")
    parser.add_argument("--run-dir", type=Path, default=None, help="a running cluster's (else one of its own)")
    parser.add_argument(
        "--fast-nn-link",
        action="store_true",
        help="no round trip added into the NN hosts: the dense all-reduce between them on a fast link, as "
        "PERSIA's GPU hosts in one rack, the embeddings' and Kafka's links slow",
    )
    parser.add_argument("--plot", type=Path, default=None, help="write samples/s against RTT here (PNG)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("a cluster of hosts needs root (network namespaces, veth, a bridge)")
    rtts = [float(x) for x in args.rtts.split(",")]
    bandwidths = [float(x) for x in args.bandwidths.split(",")]
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes: unknown {sorted(unknown)}")
    own = args.run_dir is None
    run_dir = Path(tempfile.mkdtemp(prefix="trillium-cluster-bench-")) if own else args.run_dir
    if own:
        print("[cluster] starting a cluster of hosts", file=sys.stderr)
        stack.up(run_dir, TOPOLOGY, cluster=True, link_delay=True)
    network = Network(stack.read_state(run_dir)["hosts"])
    cells = []
    cell_count = 0
    try:
        for bandwidth in bandwidths:
            for rtt in rtts:
                network.heal()
                for name in network.hosts:
                    network.cap(name, bandwidth)
                network.round_trip(rtt)
                if args.fast_nn_link:
                    for name in _NN:
                        network.delay(name, 0)
                measured = measure_links(network)
                order = modes if cell_count % 2 == 0 else modes[::-1]
                cell_count += 1
                for mode in order:
                    print(f"[cluster] rtt {rtt} ms, {bandwidth:g} Mbit/s: {mode}", file=sys.stderr)
                    result = run_cell_mode(run_dir, network, bench_job(args.steps, args.batch, MODES[mode]), mode)
                    nn_link = "fast" if args.fast_nn_link else "delayed"
                    cell = {"rtt_ms": rtt, "mbit_per_s": bandwidth, "nn_link": nn_link, "measured_links": measured}
                    cells.append({**cell, **result})
                    print(f"[cluster]   {json.dumps(result)}", file=sys.stderr)
    finally:
        network.heal()
        if own:
            stack.down(run_dir)
    out = {"cells": cells, "summary": summarize_cells(cells)}
    if args.plot:
        plot(cells, args.plot)
    print(json.dumps(out, indent=2) if args.json else out)


def plot(cells: list[dict[str, Any]], path: Path) -> None:
    """Samples/s against the added round trip, a line per mode, a panel per cap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = sorted({c["mbit_per_s"] for c in cells}, reverse=True)
    fig, axes = plt.subplots(1, len(caps), figsize=(5 * len(caps), 3.6), sharey=True, squeeze=False)
    for ax, cap in zip(axes[0], caps, strict=True):
        for mode in MODES:
            points = sorted(
                (c["rtt_ms"], c["samples_per_sec"]) for c in cells if c["mode"] == mode and c["mbit_per_s"] == cap
            )
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=mode)
        ax.set_title(f"{cap / 1000:g} Gbit/s a host")
        ax.set_xlabel("round trip added, ms")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("samples/s")
    axes[0][0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def summarize_cells(cells: list[dict[str, Any]]) -> dict[str, Any]:
    def speed(mode: str, rtt: float) -> float | None:
        found = [c["samples_per_sec"] for c in cells if c["mode"] == mode and c["rtt_ms"] == rtt]
        return max(found) if found else None  # the best cap: bandwidth is not what this reads

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    auc_gaps = [
        c["auc"] - s["auc"]
        for c in cells
        if c["mode"].startswith("hybrid")
        for s in cells
        if s["mode"] == "sync" and s["rtt_ms"] == c["rtt_ms"] and s["mbit_per_s"] == c["mbit_per_s"]
    ]
    summary = {
        "hybrid_vs_sync_at_5ms": ratio(speed("hybrid4", 5.0), speed("sync", 5.0)),
        "hybrid_5ms_vs_0ms": ratio(speed("hybrid4", 5.0), speed("hybrid4", 0.0)),
        "min_auc_hybrid_minus_sync": round(min(auc_gaps), 5) if auc_gaps else None,
    }
    floors = {"hybrid_vs_sync_at_5ms": 2.0, "hybrid_5ms_vs_0ms": 0.85, "min_auc_hybrid_minus_sync": -0.001}
    summary["targets_met"] = {
        f"{key} >= {floor}": summary[key] >= floor if summary[key] is not None else None
        for key, floor in floors.items()
    }
    return summary


if __name__ == "__main__":
    main()
