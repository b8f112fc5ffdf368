"""TorchRec beside the stack: the same job on the same data, in one run.

The job: `trillium datagen` rows (seed 11; --rows for training, a quarter as many for the test
split), 26 ID slots of dim 16 each in a table of its own trained by Adagrad (lr 0.05), 13 dense
columns (log1p), the default DNN (128, 64), batch 512 a step, one epoch, then the test AUC
(bench/jobs.py's Criteo-layout job, hybrid k = 4 on the stack). In order:

1. TorchRec on CPU: bench/peer_torchrec.py in the peer environment (.cache/peer-venv, about
   5.5 GB, built by `make peer` when missing or out of date), once with one torch thread and
   once with two, each a process of its own reading the same files.
2. The stack on loopback at 1 NN rank × 1 PS shard, then at 2 × 2 (one embedding worker and one
   loader each): each started, warmed (its warm-up job), given the job, and stopped, also on
   error. At 2 ranks each trains half the batch a step: the same global batch as TorchRec.

For each run: samples/s while training, the test AUC, and CPU µs per trained sample. TorchRec's
is its process's CPU (every thread) reading both files, training and evaluating, each phase
also apart; the stack's is every process's CPU (/proc/<pid>/stat, Kafka and Redis included)
between the job's submission and its end (bench/e2e.py's `run_mode`), also per process, each
role's beside `BUDGET_US_PER_SAMPLE`. The ratios take TorchRec's best: the least CPU per sample
of its runs, the most samples/s and that fastest run's AUC.

    .venv/bin/python bench/peer.py --json              # 300k rows (about 4 minutes)
    .venv/bin/python bench/peer.py --rows 50000        # a quick check; a table, not JSON
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from e2e import run_mode  # bench/e2e.py: the script's own folder is on sys.path
from jobs import criteo_layout_job

from trillium import stack
from trillium.config import StackTopology
from trillium.data.sources.datagen import generate_criteo
from trillium.job import JobConfig

PEER_PYTHON = stack.REPO_ROOT / ".cache/peer-venv/bin/python"
PEER_SCRIPT = Path(__file__).with_name("peer_torchrec.py")
SEED = 11
TOPOLOGIES = {"1x1": StackTopology(nn_ranks=1, ps_shards=1), "2x2": StackTopology(nn_ranks=2, ps_shards=2)}

# What each role of the stack may spend, in CPU µs per trained sample (all its processes
# together): 28 in all, for the whole stack to cost no more than TorchRec does on this machine
# (28-39 µs a sample with one thread, reading and evaluation included). The work each role exists
# for is a fraction of it: the dense step's forward, backward and update 5.6 µs a sample, the
# worker's plan, pooling and scatter and the PS's lookups and updates about 1 µs each
# (docs/performance.md); the rest of each is what moving a batch between processes may cost.
# `idle rest`: the processes no sample passes through (coordinator, Redis, the serving replica),
# mostly heartbeats.
BUDGET_US_PER_SAMPLE = {
    "nn_worker": 10.0,
    "embedding_worker": 3.0,
    "embedding_ps": 3.0,
    "data_loader": 5.0,
    "kafka": 3.0,
    "idle rest": 4.0,
}


def peer_job(train: Path, test: Path, topology: StackTopology, global_batch: int) -> JobConfig:
    """The job, for `topology`: each NN rank trains `global_batch / nn_ranks` a step."""
    if global_batch % topology.nn_ranks:
        raise ValueError(f"--batch {global_batch} does not split over {topology.nn_ranks} NN ranks")
    names = [f"c{i}" for i in range(1, 27)]
    tables = {n: {"dim": 16, "optimizer": {"name": "adagrad", "lr": 0.05}} for n in names}
    data = {"source": "criteo", "train": str(train), "test": str(test)}
    training = {"batch_size": global_batch // topology.nn_ranks}
    return criteo_layout_job("peer-criteo", data, tables, names, 16, topology, training)


def ensure_peer_env() -> None:
    """.cache/peer-venv, built (or found up to date) by `make peer`."""
    subprocess.run(["make", "-s", "peer"], cwd=stack.REPO_ROOT, check=True, stdout=sys.stderr)


def torchrec(job: JobConfig, threads: int) -> dict[str, Any]:
    """bench/peer_torchrec.py on the job's files and settings, in the peer environment."""
    table = next(iter(job.tables.values()))
    dense_lr = job.training.dense_optimizer.lr
    argv = [str(PEER_PYTHON), str(PEER_SCRIPT), "--train", job.data.train, "--test", job.data.test]
    argv += ["--threads", str(threads), "--batch", str(job.training.batch_size * job.topology.nn_ranks)]
    argv += ["--eval-batch", str(job.training.eval_batch_size), "--dim", str(table.dim)]
    argv += ["--hidden", ",".join(str(h) for h in job.model.kwargs["hidden"])]
    argv += ["--lr", str(table.optimizer.lr), "--eps", str(table.optimizer.eps), "--dense-lr", str(dense_lr)]
    argv += ["--init-low", str(table.init_low), "--init-high", str(table.init_high)]
    argv += ["--seed", str(job.training.seed)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"peer_torchrec.py failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def on_stack(tmp: Path, name: str, topology: StackTopology, job: JobConfig) -> dict[str, Any]:
    """The job on a stack of `topology` on loopback, stopped whatever happens."""
    run_dir = tmp / f"stack-{name}"
    try:
        stack.up(run_dir, topology, allow_paths=[tmp])  # the data beside the run directory
        roles = {p["name"]: p["role"] for p in stack.read_state(run_dir)["processes"]}
        report = run_mode(run_dir, job, job.training.staleness_bound, name)
    finally:
        stack.down(run_dir)
    per_process = {k: v for k, v in report["cpu_us_per_sample"].items() if k != "total"}
    by_role: dict[str, float] = dict.fromkeys(BUDGET_US_PER_SAMPLE, 0.0)
    for proc, us in per_process.items():
        role = roles.get(proc, proc)
        by_role[role if role in BUDGET_US_PER_SAMPLE else "idle rest"] += us
    return {
        "nn_ranks": report["nn_ranks"],
        "ps_shards": report["ps_shards"],
        "batch_per_rank": job.training.batch_size,
        "staleness_bound": report["staleness_bound"],
        "samples_trained": report["samples_trained"],
        "samples_per_sec": round(report["samples_per_sec"], 1),
        "auc": report["auc"],
        "logloss": report["logloss"],
        "cpu_us_per_sample": report["cpu_us_per_sample"],
        "cpu_us_per_sample_by_role": {
            role: {"measured": round(us, 1), "budget": BUDGET_US_PER_SAMPLE[role]} for role, us in by_role.items()
        },
        "machine_busy_while_training": report["machine_busy_while_training"],
    }


def compare(peers: dict[str, dict[str, Any]], stacks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each stack run over TorchRec's best: its least CPU a sample, its most samples/s (and AUC)."""
    leanest = min(peers, key=lambda k: peers[k]["cpu_us_per_sample"]["total"])
    fastest = max(peers, key=lambda k: peers[k]["samples_per_sec"])
    out: dict[str, Any] = {"torchrec_cpu_reference": leanest, "torchrec_speed_reference": fastest}
    leanest_cpu = peers[leanest]["cpu_us_per_sample"]["total"]
    fastest_speed, fastest_auc = peers[fastest]["samples_per_sec"], peers[fastest]["auc"]
    for name, run in stacks.items():
        out[name] = {
            "cpu_per_sample_vs_torchrec": round(run["cpu_us_per_sample"]["total"] / leanest_cpu, 3),
            "samples_per_sec_vs_torchrec": round(run["samples_per_sec"] / fastest_speed, 3),
            "auc_minus_torchrec": round(run["auc"] - fastest_auc, 4),
        }
    return out


def targets(ratios: dict[str, Any]) -> dict[str, bool]:
    """The acceptance of issue 65, where the run has the topology."""
    out = {}
    for name, cpu_limit in (("1x1", 1.0), ("2x2", 1.2)):
        if name in ratios:
            r = ratios[name]
            out[f"{name} cpu_per_sample_vs_torchrec <= {cpu_limit}"] = r["cpu_per_sample_vs_torchrec"] <= cpu_limit
            out[f"{name} samples_per_sec_vs_torchrec >= 1.0"] = r["samples_per_sec_vs_torchrec"] >= 1.0
            out[f"{name} abs(auc_minus_torchrec) <= 0.002"] = abs(r["auc_minus_torchrec"]) <= 0.002
    return out


def table(result: dict[str, Any]) -> str:
    """The result as text: one line a run, the ratios, then each role beside its budget."""
    lines = [f"{'':26} {'CPU µs/sample':>14} {'samples/s':>10} {'AUC':>7}"]
    for threads, run in result["torchrec"].items():
        cpu = run["cpu_us_per_sample"]
        phases = f"  (read {cpu['read']}, train {cpu['train']}, evaluate {cpu['evaluate']})"
        figures = f"{cpu['total']:14.1f} {run['samples_per_sec']:10,.0f} {run['auc']:7.4f}"
        lines.append(f"{'TorchRec, ' + threads:26} {figures}{phases}")
    for run in result["stack"].values():
        label = f"Trillium {run['nn_ranks']} × {run['ps_shards']}"
        lines.append(
            f"{label:26} {run['cpu_us_per_sample']['total']:14.1f} {run['samples_per_sec']:10,.0f} {run['auc']:7.4f}"
        )
    lines.append("")
    ratios = result["ratios"]
    lines.append(
        f"over TorchRec (CPU: its {ratios['torchrec_cpu_reference']}; samples/s and AUC: "
        f"its {ratios['torchrec_speed_reference']})"
    )
    for name in result["stack"]:
        r = ratios[name]
        lines.append(
            f"  {name}: CPU a sample {r['cpu_per_sample_vs_torchrec']:.2f}×, samples/s "
            f"{r['samples_per_sec_vs_torchrec']:.2f}×, AUC {r['auc_minus_torchrec']:+.4f}"
        )
    lines.append("")
    names = list(result["stack"])
    lines.append(f"{'CPU µs/sample by role':26} {'budget':>7}" + "".join(f" {n:>8}" for n in names))
    for role, budget in BUDGET_US_PER_SAMPLE.items():
        cells = "".join(f" {result['stack'][n]['cpu_us_per_sample_by_role'][role]['measured']:8.1f}" for n in names)
        lines.append(f"{role:26} {budget:7.1f}{cells}")
    lines.append("")
    for name in names:
        per = {k: v for k, v in result["stack"][name]["cpu_us_per_sample"].items() if k != "total"}
        lines.append(f"{name} per process: " + ", ".join(f"{k} {v}" for k, v in per.items()))
    lines += ["", "targets: " + ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in result["targets"].items())]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--rows", type=int, default=300_000, help="train rows (the test split: a quarter as many)")
    parser.add_argument("--batch", type=int, default=512, help="samples a step, all NN ranks together")
    parser.add_argument("--threads", default="1,2", help="TorchRec's torch threads, a run each, comma-separated")
    parser.add_argument("--topologies", default="1x1,2x2", help=f"the stack's, of {', '.join(TOPOLOGIES)}")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    names = args.topologies.split(",")
    if unknown := set(names) - set(TOPOLOGIES):
        parser.error(f"--topologies: unknown {sorted(unknown)}")
    # A `kill` of the bench runs the `finally`s that stop its stacks, as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    ensure_peer_env()
    load = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="trillium-peer-") as tmp:
        tmp_path = Path(tmp)
        train = generate_criteo(tmp_path / "train.tsv", args.rows, seed=SEED)
        test = generate_criteo(tmp_path / "test.tsv", max(args.rows // 4, 1000), seed=SEED, split="test")
        peers = {}
        for n in threads:
            label = f"{n} thread" + ("s" if n > 1 else "")
            print(f"[peer] TorchRec, {label}", file=sys.stderr)
            peers[label] = torchrec(peer_job(train.path, test.path, TOPOLOGIES["1x1"], args.batch), n)
        stacks = {}
        for name in names:
            print(f"[peer] the stack, {name}", file=sys.stderr)
            job = peer_job(train.path, test.path, TOPOLOGIES[name], args.batch)
            stacks[name] = on_stack(tmp_path, name, TOPOLOGIES[name], job)
    ratios = compare(peers, stacks)
    result = {
        # This machine's load when the bench began: other work on it slows every run here.
        "load_average_at_start": load,
        "train_rows": train.rows,
        "test_rows": test.rows,
        "bayes_optimal_test_auc": test.auc,
        "global_batch": args.batch,
        "torchrec": peers,
        "stack": stacks,
        "ratios": ratios,
        "targets": targets(ratios),
    }
    print(json.dumps(result) if args.json else table(result))


if __name__ == "__main__":
    main()
