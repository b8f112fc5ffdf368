#!/bin/sh
# A single-node Kafka (KRaft: broker and controller in one process) whose clients must log in with
# SASL/SCRAM-SHA-512, for docker-compose.yml. It runs in the public apache/kafka:3.9.2 image and in the
# offline trillium/kafka:3.9.2 alike: both have `java` and Kafka's jars in /opt/kafka/libs.
#   sh kafka.sh          format the storage on first start (creating the SCRAM user), then run the broker
#   sh kafka.sh health   ask the broker for its API versions, logged in as that user
# From the environment: TRILLIUM_KAFKA_USERNAME, TRILLIUM_KAFKA_PASSWORD (the user the services log in as),
# and TRILLIUM_KAFKA_ADVERTISED_HOST (optional: the name clients reach it by; its host name otherwise).
set -eu
: "${TRILLIUM_KAFKA_USERNAME:?}" "${TRILLIUM_KAFKA_PASSWORD:?}"
data=/var/lib/kafka/data
conf=/tmp/trillium-kafka
# The name clients reach the broker by: its host name, unless a cluster names it otherwise (a Service).
host=${TRILLIUM_KAFKA_ADVERTISED_HOST:-$(hostname)}
jaas="org.apache.kafka.common.security.scram.ScramLoginModule required"
jaas="$jaas username=\"$TRILLIUM_KAFKA_USERNAME\" password=\"$TRILLIUM_KAFKA_PASSWORD\";"
umask 077  # the files below hold the password
mkdir -p "$conf"

if [ "${1:-}" = health ]; then
  # Each check its own file: compose's periodic check and one run by hand (another user, another
  # password) may overlap, and a shared file would let one read the other's credentials.
  client=$(mktemp "$conf/client.XXXXXX")
  trap 'rm -f "$client"' EXIT
  printf '%s\n' "security.protocol=SASL_PLAINTEXT" "sasl.mechanism=SCRAM-SHA-512" "sasl.jaas.config=$jaas" > "$client"
  # A small, short-lived JVM: this runs every few seconds beside the broker.
  java -Xmx64m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Dlog4j.configuration=file:"$conf/log4j.properties" \
    -cp '/opt/kafka/libs/*' kafka.admin.BrokerApiVersionsCommand --bootstrap-server "$host:9092" \
    --command-config "$client" > /dev/null
  exit
fi

cat > "$conf/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:9093
# Clients log in on 9092; the controller listens on loopback only (one node).
listeners=SASL_PLAINTEXT://:9092,CONTROLLER://127.0.0.1:9093
advertised.listeners=SASL_PLAINTEXT://$host:9092
listener.security.protocol.map=CONTROLLER:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT
controller.listener.names=CONTROLLER
inter.broker.listener.name=SASL_PLAINTEXT
sasl.enabled.mechanisms=SCRAM-SHA-512
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512
listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config=$jaas
log.dirs=$data
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
# Batches of embeddings/gradients are large: 16 MiB messages, as in the local stack.
message.max.bytes=16777216
replica.fetch.max.bytes=16777216
log.retention.hours=24
log.retention.check.interval.ms=30000
num.network.threads=2
num.io.threads=2
PROPS
printf '%s\n' "log4j.rootLogger=INFO, stdout" "log4j.appender.stdout=org.apache.log4j.ConsoleAppender" \
  "log4j.appender.stdout.layout=org.apache.log4j.PatternLayout" \
  "log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n" "log4j.logger.org.apache.kafka=WARN" \
  > "$conf/log4j.properties"

java_run() {
  java -Djava.awt.headless=true -Dlog4j.configuration=file:"$conf/log4j.properties" -cp '/opt/kafka/libs/*' "$@"
}
if [ ! -f "$data/meta.properties" ]; then
  # KRaft keeps the SCRAM credentials in its metadata log: they are written when the storage is formatted.
  java_run kafka.tools.StorageTool format --cluster-id="$(java_run kafka.tools.StorageTool random-uuid)" \
    -c "$conf/server.properties" \
    --add-scram "SCRAM-SHA-512=[name=$TRILLIUM_KAFKA_USERNAME,password=$TRILLIUM_KAFKA_PASSWORD]"
fi
exec java -Xms768m -Xmx768m -XX:+AlwaysPreTouch -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true \
  -Dlog4j.configuration=file:"$conf/log4j.properties" -cp '/opt/kafka/libs/*' kafka.Kafka "$conf/server.properties"
