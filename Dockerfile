# kvferry images: one target per component, built from the same pyproject extras.
#   docker build --target engine   -t ghcr.io/kvferry/kvferry-engine:0.1.0 .
#   docker build --target router   -t ghcr.io/kvferry/kvferry-router:0.1.0 .
#   docker build --target kvstore  -t ghcr.io/kvferry/kvferry-kvstore:0.1.0 .
#   docker build --target operator -t ghcr.io/kvferry/kvferry-operator:0.1.0 .
# (`make images` builds all four.) Every image runs as UID 10001 and works with a read-only root.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- wheels: build the kvferry wheel once --------------------------------------------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md* ./
COPY services ./services
COPY kernels ./kernels
COPY operator ./operator
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---- slim base for the torch-free components ----------------------------------------------
FROM ${PYTHON_IMAGE} AS slim
RUN useradd --uid 10001 --create-home --home-dir /home/kvferry kvferry
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
COPY --from=wheel /wheels /wheels

FROM slim AS router
RUN pip install --no-cache-dir "$(ls /wheels/kvferry-*.whl)[router]" && rm -rf /wheels
USER 10001
EXPOSE 8000
ENTRYPOINT ["kvferry"]
CMD ["router", "--help"]

FROM slim AS kvstore
RUN pip install --no-cache-dir "$(ls /wheels/kvferry-*.whl)[kvstore]" && rm -rf /wheels
USER 10001
EXPOSE 50051
ENTRYPOINT ["kvferry"]
CMD ["kvstore", "--help"]

FROM slim AS operator
RUN pip install --no-cache-dir "$(ls /wheels/kvferry-*.whl)[operator]" && rm -rf /wheels
USER 10001
EXPOSE 8080 8081
ENTRYPOINT ["kvferry"]
CMD ["operator"]

# ---- engine: CUDA runtime + torch + triton + nixl -----------------------------------------
FROM ${CUDA_IMAGE} AS engine
# g++ and the Python headers build the C++ CPU kernels for the node's ISA on first start (into
# $KVFERRY_HOME); tcmalloc is preloaded by `kvferry serve` (services/engine/cpu_runtime.py).
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
        libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --create-home --home-dir /home/kvferry kvferry \
    && python3 -m venv /opt/kvferry
ENV PATH=/opt/kvferry/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
COPY --from=wheel /wheels /wheels
# One pip command: torch pinned next to everything that depends on it (else pip takes a CUDA torch).
RUN pip install --no-cache-dir torch==2.13.0 nixl==1.5.1 "$(ls /wheels/kvferry-*.whl)[engine,gpu]" \
    && rm -rf /wheels
USER 10001
EXPOSE 8000
ENTRYPOINT ["kvferry"]
CMD ["serve", "--help"]
