"""Every deadline and keepalive between hosts, named once, with the detection time it gives.

Across a network a peer that is cut off answers nothing: no reset comes, a TCP connection to it
stays established while its retransmissions back off towards minutes, and whoever waits on it
waits until something gives up. Each wait between two hosts is bounded by a value here, and
docs/operations.md ("Running across hosts") lists them with what a partition of each role does.
"""

from __future__ import annotations

# A worker heartbeats the coordinator every HEARTBEAT_S (at once when a job changes), and the
# coordinator declares it lost after LOST_AFTER_MISSED intervals without one: a worker cut off
# from the coordinator is lost, and the job it serves recovers, 10 s after its last heartbeat.
HEARTBEAT_S = 2.0
LOST_AFTER_MISSED = 5

# A service's call to the coordinator (registration, heartbeat): connecting and each read. One
# that hangs fails, and the next heartbeat opens a new connection, so a healed worker is heard
# again within COORDINATOR_CALL_S + HEARTBEAT_S = 7 s, whatever TCP's backoff on the old one.
COORDINATOR_CALL_S = 5.0

# A worker's part in an attempt, cancelled (the job moved on, stopped or ended), ends within
# JOB_CANCEL_S, or the process restarts (naming where it was stuck in its log): its heartbeats
# wait for that end, and a worker silent for 10 s is taken for lost.
JOB_CANCEL_S = 8.0
# A process restarting itself deregisters first, waiting DEREGISTER_S at most: the coordinator then
# waits for its new process rather than taking the silence for a lost worker (or, with no answer,
# it does after the loss's 10 s).
DEREGISTER_S = 2.0

# The NN ranks end a job within RANK_FINISH_S of each other: a barrier, then the process group torn
# down. A rank whose peer never comes (killed, or cut off) gives up after it.
RANK_FINISH_S = 60.0
# A torch.distributed collective between the ranks waits COLLECTIVE_S for its peers: a peer gone for
# good fails it, where the coordinator's heartbeats find a partition first (in 10 s).
COLLECTIVE_S = 600.0

# Redis: connecting, and each command's reply (a pub/sub wait names its own). A command to a Redis
# cut off fails after REDIS_SOCKET_S and is retried on a new connection: after a heal, clients
# are back within 5 s, where a connection left to TCP's backoff waited 20-25 s (measured).
REDIS_SOCKET_S = 5.0

# Kafka: an admin request with no answer in KAFKA_REQUEST_S fails (aiokafka's default is 40 s),
# and the next one opens a new connection. Consumers keep aiokafka's 40 s: a group's join may wait
# that long for its peers.
KAFKA_REQUEST_S = 15.0
# A produced record waits up to KAFKA_DELIVERY_S for the broker (aiokafka expires a batch after its
# producer's request timeout: one value for both). It rides out a broker's restart: 14 s measured
# on an idle machine here (the JVM's start, then the controller holding the killed incarnation's
# registration for its 9 s broker session), more with many partitions to recover; 15 s failed a
# data loader's attempt in a clean-clone `make test`. A data loader or embedding worker cut off
# from the broker for longer fails its attempt, and the job recovers once the broker is back.
KAFKA_DELIVERY_S = 45.0
# Whether the broker is there (a metadata request, tried again until the caller's deadline): each
# try waits KAFKA_PROBE_S.
KAFKA_PROBE_S = 5.0
# Deleting records a job no longer needs (retention's trim, a PS shard's applied gradients): a
# request without an answer in KAFKA_TRIM_S fails, and the next trim deletes those records too.
KAFKA_TRIM_S = 10.0
# What the coordinator's observer asks for its gauges (a shard's table stats, Kafka's consumer
# lag): best effort, each request given up after OBSERVE_CALL_S so a peer away stalls no sampling.
OBSERVE_CALL_S = 5.0

# gRPC (lookups and gradients between NN ranks, embedding workers and PS shards; the coordinator's
# stats calls; serving): both ends ping each connection every GRPC_KEEPALIVE_S, calls or none, and
# close it when a ping has no answer within GRPC_KEEPALIVE_TIMEOUT_S. A call to a peer cut off
# fails UNAVAILABLE within 10 s, not after TCP's retransmissions run out (about 15 minutes).
GRPC_KEEPALIVE_S = 5.0
GRPC_KEEPALIVE_TIMEOUT_S = 5.0
# A server accepts a client's pings this often (gRPC's default refuses pings more often than
# every 5 minutes without data, and answers them with GOAWAY).
GRPC_MIN_PING_INTERVAL_S = 4.0

# An object store (checkpoints and published models at an s3:// URL): connecting, and each read of
# a reply (a wait between bytes, not a whole transfer). A call with no answer fails after these and
# is tried STORE_TRIES times in all: a store cut off is known within 3 x (5 + backoff) = 16 s, or
# 10 s when no connection to it was open, and a serving replica's next poll finds it after the heal.
STORE_CONNECT_S = 3.0
STORE_READ_S = 5.0
STORE_TRIES = 3
