# One image for every Trillium service; docker-compose.yml picks the role per container.
FROM rust:1-bookworm AS native
RUN apt-get update && apt-get install -y --no-install-recommends python3-pip python3-venv && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /venv && /venv/bin/pip install --no-cache-dir maturin
WORKDIR /src
COPY native/ native/
RUN cd native && /venv/bin/maturin build --release -o /wheels

FROM python:3.11-slim-bookworm
WORKDIR /app
COPY pyproject.toml README.md ./
COPY trillium/ trillium/
COPY services/ services/
COPY proto/ proto/
COPY --from=native /wheels /wheels
# Stubs are generated, never committed: same command as the Makefile.
RUN pip install --no-cache-dir grpcio-tools \
 && python -m grpc_tools.protoc -Itrillium/pb=proto --python_out=. --pyi_out=. --grpc_python_out=. trillium/pb/embedding.proto \
 && pip install --no-cache-dir /wheels/*.whl .
