# syntax=docker/dockerfile:1
#
# orthornn images (see README "Deployment"):
#   docker build -t orthornn:gpu .                                  # serving, onnxruntime-gpu on CUDA
#   docker build -t orthornn:cpu --build-arg VARIANT=cpu .          # serving, CPU only
#   docker build -t orthornn-train --target train .                 # retraining jobs (torch, CUDA build)
#   docker build -t orthornn-train:cpu --target train --build-arg VARIANT=cpu .
#
# The serving image holds the base package, the `serve` extra and onnxruntime; never torch.
# It runs as UID/GID 10001 and writes only to volumes: /models (model repository) and /tmp.
#
# Both variants run Ubuntu 24.04's Python 3.12 (the project needs >= 3.11), so the CPU and
# GPU images are built by the same steps and differ only in the base image and onnxruntime.

ARG VARIANT=gpu
# onnxruntime-gpu 1.31.x is built for CUDA 13 and cuDNN 9.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04
ARG UBUNTU_IMAGE=ubuntu:24.04

# ---------------------------------------------------------------- operating systems
FROM ${UBUNTU_IMAGE} AS os-cpu
FROM ${CUDA_IMAGE} AS os-gpu

# Python on the serving variant's OS. Distribution packages are left unpinned on purpose:
# the base tag fixes the release, and Ubuntu drops superseded patch versions from its
# archive, so pinned apt versions would break rebuilds (and miss security fixes).
# (DL3006 on the FROM: os-${VARIANT} names one of the two stages above, both tagged.)
# hadolint ignore=DL3006
FROM os-${VARIANT} AS python
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# ---------------------------------------------------------------- serving: build
FROM python AS serve-build
ARG VARIANT
ARG ONNXRUNTIME_VERSION=1.31.1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY orthornn ./orthornn
COPY models ./models
COPY training ./training
COPY export ./export
COPY service ./service
# The base dependencies pin the CPU wheel `onnxruntime`; `onnxruntime-gpu` is a different
# distribution that installs the same `onnxruntime` module. Installing one over the other
# would mix their files, so on the GPU variant the CPU wheel is uninstalled first and the
# GPU wheel (same version; its own dependencies are already present) goes in after it.
# `pip check` would then report orthornn's unmet `onnxruntime` requirement, so the check is
# that the CUDA execution provider is compiled in.
RUN python3.12 -m venv /opt/venv \
    && pip install "/src[serve]" \
    && if [ "$VARIANT" = gpu ]; then \
         pip uninstall -y onnxruntime \
         && pip install "onnxruntime-gpu==${ONNXRUNTIME_VERSION}" \
         && python -c "import onnxruntime as o; assert 'CUDAExecutionProvider' in o.get_available_providers()"; \
       else \
         pip check; \
       fi \
    && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"

# ---------------------------------------------------------------- retraining jobs
# `docker build --target train`: torch 2.13.0 for `orthornn train` and `orthornn export`.
# Plain Ubuntu base: the PyPI torch wheel (the default index) is the CUDA build and brings
# its CUDA libraries as wheels (and the triton it pins), so a CUDA base would only duplicate
# them; VARIANT=cpu takes the CPU wheel from the PyTorch index instead. Containers are built
# elsewhere, so the multi-GB CUDA wheel is fine here (CI on this repo never builds images).
FROM os-cpu AS train
ARG VARIANT
ARG TORCH_VERSION=2.13.0
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib
WORKDIR /src
COPY pyproject.toml README.md ./
COPY orthornn ./orthornn
COPY models ./models
COPY training ./training
COPY export ./export
COPY service ./service
RUN python3.12 -m venv /opt/venv \
    && if [ "$VARIANT" = cpu ]; then \
         pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"; \
       else \
         pip install "torch==${TORCH_VERSION}"; \
       fi \
    && pip install "/src[train]" \
    && pip check
# Mount points owned by the runtime user, so fresh Docker volumes are writable for it too.
RUN install -d -o 10001 -g 10001 /models /runs
WORKDIR /runs
USER 10001:10001
VOLUME ["/models", "/runs", "/tmp"]
ENTRYPOINT ["orthornn"]
CMD ["--help"]

# ---------------------------------------------------------------- serving (default target)
FROM python AS serve
ARG VARIANT
LABEL org.opencontainers.image.title="orthornn" \
      org.opencontainers.image.description="orthornn inference service (ONNX Runtime, Open Inference Protocol)" \
      org.opencontainers.image.licenses="Apache-2.0" \
      ai.orthornn.variant="${VARIANT}"
COPY --from=serve-build /opt/venv /opt/venv
# Settings (service/settings.py reads ORTHORNN_*); the command line below repeats them.
# HOME=/tmp: the root file system may be read-only, /tmp is a volume.
ENV ORTHORNN_REPO=/models \
    ORTHORNN_HOST=0.0.0.0 \
    ORTHORNN_PORT=8000 \
    HOME=/tmp
RUN install -d -o 10001 -g 10001 /models
WORKDIR /tmp
# A numeric user (no passwd entry needed): Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
VOLUME ["/models", "/tmp"]
EXPOSE 8000
# Liveness, not readiness: a draining or still-loading server is alive. Python's urllib,
# because the image carries no curl; any HTTP error status raises and fails the check.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/v2/health/live' % os.environ.get('ORTHORNN_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["orthornn"]
CMD ["serve", "--repo", "/models", "--host", "0.0.0.0", "--port", "8000"]
