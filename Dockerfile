# orthornn images (README "Deployment", docs/deployment.md). Build them with `make images`
# (scripts/images.sh), which first fills build/wheelhouse/ with the orthornn wheel and every
# wheel it needs, then runs this file with docker or podman:
#   orthornn:<version>-cpu         serving, onnxruntime on the CPU          (target serve)
#   orthornn-train:<version>-cpu   retraining jobs, torch's CPU build       (target train)
#   orthornn:<version>-gpu         serving, onnxruntime-gpu (VARIANT=gpu)
#
# The images install the built wheel, as users do, from the wheelhouse only (--no-index):
# the build needs no network and installs exactly the pinned versions.
# The serving image holds the base package, the `serve` extra and onnxruntime; never torch.
# Both run as UID/GID 10001 and write only to volumes: /models (model repository) and /tmp.
#
# The base image and its Python are build arguments: ubuntu:24.04 with python3.12 where a
# registry is reachable, or a local Debian base (scripts/images.sh builds one with
# mmdebstrap, python3.11 included). The GPU variant needs no CUDA base image: onnxruntime-gpu
# takes CUDA and cuDNN from NVIDIA's wheels (its cuda and cudnn extras), and the node's
# driver comes in through the NVIDIA container toolkit.

ARG BASE_IMAGE=ubuntu:24.04
ARG PYTHON=python3.12

# ---------------------------------------------------------------- the base with Python
FROM ${BASE_IMAGE} AS python
ARG PYTHON
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Distribution packages are left unpinned on purpose: the base tag fixes the release, and
# the archives drop superseded patch versions, so pinned apt versions would break rebuilds.
# A base that already has this Python and the pip wheel of its venv package (the local
# Debian base) skips apt; the installs below run that wheel.
# hadolint ignore=DL3008
RUN if ! "${PYTHON}" -c "import ensurepip" 2>/dev/null \
        || ! ls /usr/share/python-wheels/pip-*.whl >/dev/null 2>&1; then \
        apt-get update \
        && apt-get install -y --no-install-recommends "${PYTHON}" "${PYTHON}-venv" ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && ls /usr/share/python-wheels/pip-*.whl > /dev/null
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INDEX=1 \
    ORT_DISABLE_TELEMETRY=1 \
    HOME=/tmp
# (onnxruntime-gpu's telemetry is off: pods send nothing out, and its device-ID store warns
# at every start where it cannot persist one)
# Installing: pip, run from the wheel that the base's venv package ships
# (/usr/share/python-wheels), installs into a venv made without it, so the images carry no
# pip, and only from the wheelhouse (no index). The wheelhouse is bind-mounted from the build
# context, so it is never a layer; its digests (build arguments from scripts/images.sh)
# decide when the two install layers are rebuilt: the dependencies while the pins stay, and
# orthornn on every change of its wheel.

# ---------------------------------------------------------------- retraining jobs
# `--target train`: `orthornn train` and `orthornn export`, run by the chart's CronJob.
# build/wheelhouse/train-VARIANT holds torch (its CPU build for VARIANT=cpu, its CUDA build
# for VARIANT=gpu) and the train extra's dependencies.
FROM python AS train
ARG PYTHON
ARG VARIANT=cpu
ARG DEPS_DIGEST=none
LABEL org.opencontainers.image.title="orthornn-train" \
      org.opencontainers.image.description="orthornn retraining: train, export, gate, publish" \
      org.opencontainers.image.licenses="Apache-2.0" \
      ai.orthornn.variant="${VARIANT}"
RUN --mount=type=bind,source=build/wheelhouse,target=/wheelhouse \
    echo "dependencies ${DEPS_DIGEST}" \
    && "${PYTHON}" -m venv --without-pip /opt/venv \
    && python "$(echo /usr/share/python-wheels/pip-*.whl)/pip" install "/wheelhouse/train-${VARIANT}"/*.whl
# (declared here: a build argument changes the cache key of every RUN after it)
ARG WHEEL_DIGEST=none
RUN --mount=type=bind,source=build/wheelhouse,target=/wheelhouse \
    echo "orthornn ${WHEEL_DIGEST}" \
    && pip="$(echo /usr/share/python-wheels/pip-*.whl)/pip" \
    && python "$pip" install --find-links "/wheelhouse/train-${VARIANT}" --find-links /wheelhouse/orthornn "orthornn[train]" \
    && python "$pip" check \
    && orthornn train --help > /dev/null
ENV MPLCONFIGDIR=/tmp/matplotlib
# Mount points owned by the runtime user, so fresh Docker volumes are writable for it too.
RUN install -d -o 10001 -g 10001 /models /runs
WORKDIR /runs
USER 10001:10001
VOLUME ["/models", "/runs", "/tmp"]
ENTRYPOINT ["orthornn"]
CMD ["--help"]

# ---------------------------------------------------------------- serving (default target)
# build/wheelhouse/serve-VARIANT holds the serve extra's dependencies. onnxruntime-gpu is a
# different distribution that installs the same `onnxruntime` module as the CPU wheel
# orthornn pins; the GPU wheelhouse holds it (same version, with NVIDIA's CUDA and cuDNN
# wheels) instead of the CPU wheel, so there orthornn goes in without its dependencies, and
# the check is that the CUDA provider is built in rather than `pip check`. Third-party
# test suites are removed (numpy's alone is 17 MB).
FROM python AS serve
ARG PYTHON
ARG VARIANT=cpu
ARG DEPS_DIGEST=none
LABEL org.opencontainers.image.title="orthornn" \
      org.opencontainers.image.description="orthornn inference service (ONNX Runtime, Open Inference Protocol)" \
      org.opencontainers.image.licenses="Apache-2.0" \
      ai.orthornn.variant="${VARIANT}"
RUN --mount=type=bind,source=build/wheelhouse,target=/wheelhouse \
    echo "dependencies ${DEPS_DIGEST}" \
    && "${PYTHON}" -m venv --without-pip /opt/venv \
    && python "$(echo /usr/share/python-wheels/pip-*.whl)/pip" install "/wheelhouse/serve-${VARIANT}"/*.whl \
    && find /opt/venv/lib -depth -type d -path '*/site-packages/*' -name tests -exec rm -rf {} +
# (declared here: a build argument changes the cache key of every RUN after it)
ARG WHEEL_DIGEST=none
RUN --mount=type=bind,source=build/wheelhouse,target=/wheelhouse \
    echo "orthornn ${WHEEL_DIGEST}" \
    && pip="$(echo /usr/share/python-wheels/pip-*.whl)/pip" \
    && if [ "$VARIANT" = gpu ]; then \
        python "$pip" install --find-links /wheelhouse/orthornn --no-deps orthornn \
        && python -c "import onnxruntime as o; assert 'CUDAExecutionProvider' in o.get_available_providers()"; \
    else \
        python "$pip" install --find-links /wheelhouse/serve-cpu --find-links /wheelhouse/orthornn "orthornn[serve]" \
        && python "$pip" check; \
    fi \
    && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)" \
    && orthornn --help > /dev/null
# Settings (service/settings.py reads ORTHORNN_*); the command line below repeats them.
# ORTHORNN_ADDRESS_FILE: the server writes the URL it listens on there (in /tmp, a volume:
# the root file system may be read-only), which the HEALTHCHECK reads.
ENV ORTHORNN_REPO=/models \
    ORTHORNN_HOST=0.0.0.0 \
    ORTHORNN_PORT=8000 \
    ORTHORNN_ADDRESS_FILE=/tmp/orthornn-address
RUN install -d -o 10001 -g 10001 /models
WORKDIR /tmp
# A numeric user (no passwd entry needed): Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
VOLUME ["/models", "/tmp"]
EXPOSE 8000
# Liveness, not readiness: a draining or still-loading server is alive. Python's urllib,
# because the image carries no curl; any HTTP error status raises and fails the check.
# The address is the one the server wrote at start-up (ORTHORNN_ADDRESS_FILE), so the check
# follows the port however it was set (`serve --port 9000`, ORTHORNN_PORT, the default);
# without the file, ORTHORNN_PORT or 8000 on loopback.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; f = os.environ.get('ORTHORNN_ADDRESS_FILE', ''); url = open(f).read().strip() if f and os.path.isfile(f) else 'http://127.0.0.1:%s' % os.environ.get('ORTHORNN_PORT', '8000'); urllib.request.urlopen(url + '/v2/health/live', timeout=4)"]
ENTRYPOINT ["orthornn"]
CMD ["serve", "--repo", "/models", "--host", "0.0.0.0", "--port", "8000"]
