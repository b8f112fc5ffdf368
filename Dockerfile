# The images of Trillium's services, built by `make images` from the wheels scripts/wheels.sh makes on
# the host: the build itself reads no network. BuildKit builds it (Docker 23+, or Docker 20.10's own
# client with DOCKER_BUILDKIT=1): the wheels are bind-mounted, never copied into a layer.
#   --target lean   trillium/lean: coordinator, embedding_ps, data_loader (no torch)
#   --target full   trillium/full: the same plus torch (CUDA-enabled), for embedding_worker and nn_worker
# Both share the base and dependency layers; the project's own wheels come last, so a code change
# rebuilds one small layer. BASE: any Debian bookworm image with Python 3.11 and its venv module: the
# public default, or trillium/base-python:bookworm, which scripts/base-image.sh builds from Debian's packages.
ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS deps
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/trillium --create-home trillium
RUN --mount=type=bind,source=.cache/wheels/deps,target=/wheels \
    python3 -m venv /opt/trillium && /opt/trillium/bin/pip install -q --no-cache-dir --no-index /wheels/*.whl
# PYTHONSAFEPATH: the working directory (the run directory, where jobs write) is not on sys.path,
# so nothing a job leaves there shadows a module; a model is imported from trillium.models alone.
ENV PATH=/opt/trillium/bin:$PATH PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 TRILLIUM_RUN_DIR=/var/lib/trillium \
    TRILLIUM_MODEL_MODULES=trillium.models
LABEL org.opencontainers.image.vendor=trillium
# The run directory (checkpoints, quarantine): a volume the stack's containers share.
WORKDIR /var/lib/trillium

FROM deps AS lean
RUN --mount=type=bind,source=.cache/wheels/project,target=/wheels \
    pip install -q --no-cache-dir --no-index --no-deps /wheels/*.whl && pip check
LABEL org.opencontainers.image.title="Trillium services (lean)"
USER trillium

FROM deps AS full
RUN --mount=type=bind,source=.cache/wheels/train,target=/wheels \
    pip install -q --no-cache-dir --no-index --no-deps /wheels/*.whl
RUN --mount=type=bind,source=.cache/wheels/project,target=/wheels \
    pip install -q --no-cache-dir --no-index --no-deps /wheels/*.whl && pip check
LABEL org.opencontainers.image.title="Trillium services (with torch)"
USER trillium
