#!/usr/bin/env bash
# Builds .gpu/ (git-ignored, under the device tool's 64 MiB): what a lent GPU machine lacks to run
# the local stack. Its image has Python 3.12, torch, grpcio, numpy, pyarrow, but no Java, Redis or
# web stack. Run after `make setup`; then scripts/device-check.sh runs there with carry [".gpu"].
set -eu
cd "$(dirname "$0")/.."
out=.gpu tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rm -rf "$out" && mkdir -p "$out/whl" "$tmp/stage/kafka/libs" "$tmp/stage/redis/lib" "$tmp/stage/native" "$tmp/stage/pb"

# A JRE of only what the broker and log4j's bean-based configuration load; stripped.
jlink --add-modules java.base,java.compiler,java.desktop,java.instrument,java.logging,java.management,java.naming,java.scripting,java.security.jgss,java.security.sasl,java.sql,java.xml,jdk.crypto.ec,jdk.management,jdk.naming.dns,jdk.unsupported,jdk.zipfs \
  --strip-debug --no-header-files --no-man-pages --compress=0 --output "$tmp/stage/jre"
find "$tmp/stage/jre" -name '*.so' -exec strip --strip-unneeded {} +

# Kafka's jars re-stored uncompressed (xz packs them to half what deflate does), with only
# linux/amd64 of the compression codecs' natives.
for jar in .cache/kafka/libs/*.jar; do
  rm -rf "$tmp/x" && mkdir "$tmp/x" && (cd "$tmp/x" && unzip -q "$OLDPWD/$jar")
  find "$tmp/x" -type f | grep -E '\.(so|dylib|dll|a|jnilib)$' \
    | grep -vE '/(linux/amd64|Linux/x86_64)/|linux[-_]x86[-_]64|_x86_64\.so$' | xargs -r rm -f
  (cd "$tmp/x" && zip -q -0 -r -X "$tmp/stage/kafka/libs/$(basename "$jar")" .)
done
touch "$tmp/stage/kafka/libs/.complete"

# Debian's redis-server with the libraries it links beyond glibc (run through a wrapper there).
cp "$(command -v redis-server)" "$tmp/stage/redis/"
ldd "$(command -v redis-server)" | awk '/=>/ {print $3}' | grep -vE '/lib(c|m)\.so' | xargs -I{} cp -L {} "$tmp/stage/redis/lib/"

# The abi3 native module as built, and the generated protobuf modules.
cp -r .venv/lib/python3.*/site-packages/trillium_native "$tmp/stage/native/"
rm -rf "$tmp/stage/native/trillium_native/__pycache__"
cp trillium/wire/pb/*_pb2*.py "$tmp/stage/pb/"
tar cf - -C "$tmp/stage" . | xz -T0 -9 > "$out/bundle.tar.xz"

# The web and messaging packages, at this venv's versions, as cp312 wheels.
reqs=$(.venv/bin/pip list --format=freeze | grep -iE '^(fastapi|starlette|pydantic|pydantic[-_]core|annotated[-_](types|doc)|typing[-_](inspection|extensions)|uvicorn|aiokafka|async[-_]timeout|redis|hiredis|protobuf|grpcio|anyio|h11|click|opentelemetry[-_]api)==')
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$out/whl" $reqs
du -sh "$out"
