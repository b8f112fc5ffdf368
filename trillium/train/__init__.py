"""Training helpers beside the services: the single-process PyTorch trainers (`reference`: the
golden reference the e2e tests compare the stack with, and the baseline the benchmarks measure
it against), progressive validation (`progressive_validation`: a rank's rolling scores, merged
by the coordinator), and the plots of a job's report (`report`).

Imports run one way: `trillium.job`, `trillium.wire`, `trillium.data`, `trillium.models` and
`trillium.metrics` <- these modules. `progressive_validation` needs numpy only (the coordinator
imports it without torch).
"""
