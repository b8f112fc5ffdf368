#!/usr/bin/env bash
# Resolves the Apache Kafka broker (deps/kafka/pom.xml) and its runtime jars into
# .cache/kafka/libs with Maven; Maven's own ~/.m2 cache makes repeats fast.
set -eu
dest="$1"
rm -rf "$dest.partial"
mvn -B -q -f deps/kafka/pom.xml \
  org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies \
  -DincludeScope=runtime -DoutputDirectory="$PWD/$dest.partial"
rm -rf "$dest" && mv "$dest.partial" "$dest"
