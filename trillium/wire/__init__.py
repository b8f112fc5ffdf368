"""How Trillium's processes talk: the data structures they exchange (`batch`), the one codec
that frames them (`codec`), and the clients of the three transports: Kafka (`kafka`: every
producer and consumer, with SASL/TLS when set), gRPC (`rpc`: servers and channels with the
token on every call; stubs generated from `proto/` into `pb/`) and Redis (`state`: the shared
state store and its key schema).

Imports run one way: `trillium.config` <- `batch` <- `codec`; the clients import only
`trillium.config`. Nothing here knows the job schema or a service.
"""
