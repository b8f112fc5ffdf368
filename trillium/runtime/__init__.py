"""What every service process shares at run time: the service skeleton (`service`: health,
metrics, registration and heartbeats, jobs in attempts, a graceful stop), a running job's shared
state in Redis (`progress`: applied watermarks, staleness, training progress), checkpoints
(`checkpoint`: their layout, manifest and the messages of the cut protocol), and the PS shards'
gradient ledger (`ledger`: which steps' gradients a state holds, travelling with its checkpoint).

Imports run one way: `ledger` (a leaf), `trillium.config`, `trillium.job`, `trillium.wire` <-
`checkpoint`, `progress` <- `service`. The services (`trillium.services.*`) build on this package;
nothing here imports a service.
"""
