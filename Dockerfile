# kvferry images: one target per component, all on Debian bookworm's own Python 3.11.
#   make images                      # every target below, named by operator/pool_operator/images.py
#   docker build --target engine-cpu -t ghcr.io/kvferry/kvferry-engine-cpu:0.1.0 .
# Targets: engine (CUDA), engine-cpu, router, kvstore, operator. Every image runs as UID 10001 with a
# read-only root filesystem; the only writable paths are the volumes the operator mounts (/tmp, /dev/shm).
#
# BASE_IMAGE is any Debian bookworm root filesystem: the registry's debian:bookworm-slim, or (where no
# registry is reachable) the `debootstrap --variant=minbase bookworm` image `make images` imports.
ARG BASE_IMAGE=docker.io/library/debian:bookworm-slim
# The CPU torch wheel: from the wheels/ folder of the build context when one lies there (make images
# copies the local one), else from this index.
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
# The C++ CPU kernels built into engine-cpu (kvkernels/cpu/variants.py; the engine picks the best one its
# CPU runs at start-up).
ARG CPU_KERNEL_VARIANTS="x86-64-v2 x86-64-v3 x86-64-v4 x86-64-v4-bf16 x86-64-v4-amx"

# ---- python: the runtime every image starts from -------------------------------------------
FROM ${BASE_IMAGE} AS python
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 ca-certificates \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/* /usr/share/doc /usr/share/man \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kvferry
ENV PATH=/opt/kvferry/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp

# ---- builder: a venv with the kvferry wheel's dependencies (never shipped) ---------------------
# The CA of a TLS-inspecting proxy between this machine and PyPI (the `pip-ca` build secret; make images
# passes $PIP_CERT) is trusted in the builder only. Downloads stay in a cache mount between builds.
FROM python AS builder
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_CACHE_DIR=/var/cache/kvferry-pip \
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
RUN --mount=type=secret,id=pip-ca --mount=type=cache,target=/var/cache/kvferry-pip,id=kvferry-pip \
    apt-get update \
    && apt-get install -y --no-install-recommends python3-venv python3-dev g++ \
    && if [ -s /run/secrets/pip-ca ]; then cat /run/secrets/pip-ca >> /etc/ssl/certs/ca-certificates.crt; fi \
    && python3 -m venv /opt/kvferry && pip install -q --upgrade pip setuptools wheel
RUN --mount=type=bind,target=/src --mount=type=cache,target=/var/cache/kvferry-pip,id=kvferry-pip \
    mkdir /tmp/src && cp -r /src/pyproject.toml /src/README.md /src/services /src/kvkernels /src/operator /tmp/src \
    && pip wheel -q --no-deps --wheel-dir /wheels /tmp/src && rm -rf /tmp/src

# One pip command per image: every package there and nothing else; pip and wheel are not shipped.
FROM builder AS router-venv
RUN --mount=type=cache,target=/var/cache/kvferry-pip,id=kvferry-pip \
    pip install -q "$(ls /wheels/kvferry-*.whl)[router]" && pip uninstall -q -y wheel setuptools pip

FROM builder AS kvstore-venv
RUN --mount=type=cache,target=/var/cache/kvferry-pip,id=kvferry-pip \
    pip install -q "$(ls /wheels/kvferry-*.whl)[kvstore]" && pip uninstall -q -y wheel setuptools pip

FROM builder AS operator-venv
RUN --mount=type=cache,target=/var/cache/kvferry-pip,id=kvferry-pip \
    pip install -q "$(ls /wheels/kvferry-*.whl)[operator]" && pip uninstall -q -y wheel setuptools pip

# engine-cpu: torch's CPU wheel, then the C++ kernels for every CPU_KERNEL_VARIANTS ISA (ninja's build
# folders stay in a cache mount, so a rebuild compiles only what changed).
FROM builder AS engine-cpu-venv
ARG TORCH_CPU_INDEX
ARG TORCH_VERSION
ARG CPU_KERNEL_VARIANTS
RUN --mount=type=bind,target=/src --mount=type=cache,target=/var/cache/kvferry-pip,id=kvferry-pip \
    --mount=type=cache,target=/var/cache/kvferry-kernels,id=kvferry-kernels \
    pip install -q --find-links /src/wheels ${TORCH_CPU_INDEX:+--extra-index-url "$TORCH_CPU_INDEX"} \
        "torch==${TORCH_VERSION}+cpu" "$(ls /wheels/kvferry-*.whl)[engine]" \
    && python -m kvkernels.cpu.build --prebuild /opt/kvferry/cpu-kernels --work /var/cache/kvferry-kernels \
        ${CPU_KERNEL_VARIANTS} \
    && pip uninstall -q -y wheel pip

# engine (CUDA): PyPI's torch wheel brings the CUDA user-space libraries; the driver comes from the node.
# Triton is the one PyPI's torch pins (torch 2.13.0 requires triton==3.7.1, so the `gpu` extra's
# triton==3.9.0 cannot be installed beside it: pip refuses the pair).
FROM builder AS engine-venv
ARG TORCH_VERSION
RUN --mount=type=cache,target=/var/cache/kvferry-pip,id=kvferry-pip \
    pip install -q "torch==${TORCH_VERSION}" "$(ls /wheels/kvferry-*.whl)[engine]" \
    && pip uninstall -q -y wheel pip

# ---- runtime images ---------------------------------------------------------------------------
FROM python AS router
COPY --from=router-venv /opt/kvferry /opt/kvferry
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["kvferry"]
CMD ["router", "--help"]

FROM python AS kvstore
COPY --from=kvstore-venv /opt/kvferry /opt/kvferry
USER 10001:10001
EXPOSE 50051
ENTRYPOINT ["kvferry"]
CMD ["kvstore", "--help"]

FROM python AS operator
COPY --from=operator-venv /opt/kvferry /opt/kvferry
USER 10001:10001
EXPOSE 8080 8081
ENTRYPOINT ["kvferry"]
CMD ["operator"]

# libgomp1: the prebuilt kernels link GNU OpenMP; tcmalloc is preloaded by `kvferry serve`
# (services/engine/cpu_runtime.py). No compiler: the kernels are built above, one per ISA.
FROM python AS engine-cpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/*
COPY --from=engine-cpu-venv /opt/kvferry /opt/kvferry
ENV KVFERRY_CPU_KERNELS=/opt/kvferry/cpu-kernels
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["kvferry"]
CMD ["serve", "--help"]

# Triton compiles its launcher stubs with the C compiler and Python's headers when a kernel first runs.
FROM python AS engine
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev python3-dev libgomp1 libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/*
COPY --from=engine-venv /opt/kvferry /opt/kvferry
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["kvferry"]
CMD ["serve", "--help"]
