"""Trillium's shared library and command line. The services (`trillium.services.<role>`, in
`services/` at the top of the repository) build on it; it never imports them.

Packages, each opening with what it owns, in layers (each imports only those above it here):

- `config`, `log`, `metrics`: runtime settings from TRILLIUM_* variables, JSON logs, AUC and log loss.
- `job/`: the job schema and the coordinator's record of a job (configuration only).
- `wire/`: the batch, the one codec, and the Kafka, gRPC and Redis clients.
- `models`: the model contract and the default DNN (job files name models here); `pooling`: a
  batch's embedding work (dedup, routing, pooling, gradient scatter) in the native core.
- `data/`: sources (files, streams, planted data), features (rows -> batches), replay.
- `train/`: the single-process reference trainer, progressive validation, reports.
- `runtime/`: what every service process shares (the service skeleton, progress, checkpoints).
- `stack/`: the local stack (supervisor, local Kafka, processes) and the coordinator's client.
- `cli/`: the `trillium` command, on top of everything.

`tests/unit/test_layout.py` keeps these arrows pointing one way.
"""
