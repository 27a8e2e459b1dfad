#!/usr/bin/env bash
# make images: builds the serving image orthornn:<version>-<variant> and the training image
# orthornn-train:<version>-<variant> from the Dockerfile, with docker where its engine runs,
# else podman (with scripts/containers.conf). VARIANT=cpu (default) or gpu.
#
#   1. the orthornn wheel (pip wheel, as `python -m build` would make it) into
#      build/wheelhouse/orthornn/, and every wheel it needs, resolved by this machine's pip
#      under the project's pins, into build/wheelhouse/serve-VARIANT/ and train-VARIANT/;
#      the Dockerfile installs from there only (no index);
#   2. the base image: BASE_IMAGE and IMAGE_PYTHON when set (e.g. ubuntu:24.04 and
#      python3.12, where a registry is reachable); else a local Debian base with python3.11, built once
#      with mmdebstrap from this machine's apt sources and imported as
#      localhost/orthornn-base:bookworm (no registry image is pulled);
#   3. the two images (docker/podman build --target serve|train).
#
# `scripts/images.sh --or-skip` (make test): where something is absent (no engine, no root,
# not Linux, no mmdebstrap), it says why and exits 0, and the container tests skip with that
# reason; CI_TOOLS_STRICT=1 makes it a failure. A tool that is there and fails (podman that
# cannot start, mmdebstrap, a build) always fails, as does plain `make images`.
set -euo pipefail
cd "$(dirname "$0")/.."

or_skip=0
[ "${1:-}" = --or-skip ] && or_skip=1
VENV=${VENV:-.venv}
VARIANT=${VARIANT:-cpu}
py="$VENV/bin/python"
give_up() {
    echo "images: $1" >&2
    if [ "$or_skip" = 1 ] && [ "${CI_TOOLS_STRICT:-0}" != 1 ]; then
        echo "images: not built; the container tests will be skipped" >&2
        exit 0
    fi
    exit 1
}
fail() { echo "images: $1" >&2; exit 1; }
case "$VARIANT" in cpu|gpu) ;; *) fail "VARIANT=$VARIANT: allowed values are cpu, gpu" ;; esac
[ -x "$py" ] || give_up "no virtual environment at $VENV (make test creates it)"
version=$("$py" -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['version'])")
torch_version=$(sed -n 's/^TORCH_VERSION := //p' Makefile)

# ------------------------------------------------------------------ the engine
if [ -n "${ENGINE:-}" ]; then
    engine=$ENGINE
elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    engine=docker
elif command -v podman >/dev/null 2>&1; then
    engine=podman
else
    give_up "no container engine: neither a running docker nor podman (make test's tools step installs podman on Debian as root)"
fi
if [ "$engine" = podman ]; then
    [ "$(uname -s)" = Linux ] || give_up "podman here needs Linux"
    [ "$(id -u)" = 0 ] || give_up "rootful podman needs root (the tests run the images as UID 10001 on a read-only root)"
    export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/scripts/containers.conf}
    podman info >/dev/null 2>&1 || fail "podman cannot start: $(podman info 2>&1 | tail -1)"
fi

start=$(date +%s)
mkdir -p build
exec 9> build/images.lock  # one build at a time in this checkout
flock 9
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# ------------------------------------------------------------------ 1. the wheelhouse
house=build/wheelhouse
rm -rf "$house/orthornn"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    # from a copy of the files a clone has (tracked, and untracked but not ignored; not
    # those deleted since): nothing an earlier in-tree build left in build/ reaches the wheel
    mkdir -p "$tmp/src"
    git ls-files -z --cached --others --exclude-standard \
        | (cd "$tmp/src" && while IFS= read -r -d '' name; do
               [ -f "$OLDPWD/$name" ] || continue
               mkdir -p "$(dirname "$name")" && cp "$OLDPWD/$name" "$name"
           done)
    # the last commit's time in the wheel: the same files make the same wheel, so the
    # images' orthornn layer is rebuilt only when the code changed
    SOURCE_DATE_EPOCH=$(git log -1 --format=%ct) \
        "$py" -m pip wheel --quiet --no-deps "$tmp/src" -w "$tmp/dist"
else  # a source tree without git (an unpacked sdist)
    "$py" -m pip wheel --quiet --no-deps . -w "$tmp/dist"
fi
wheel=$(ls "$tmp"/dist/orthornn-"$version"-*.whl)
mkdir -p "$house/orthornn" "$house/serve-$VARIANT" "$house/train-$VARIANT"
cp "$wheel" "$house/orthornn/"

# ------------------------------------------------------------------ 2. the base image
# (IMAGE_PYTHON, not PYTHON: the Makefile's PYTHON is this machine's, for the venv)
if [ -z "${BASE_IMAGE:-}" ]; then
    BASE_IMAGE=localhost/orthornn-base:bookworm
    IMAGE_PYTHON=python3.11
fi
IMAGE_PYTHON=${IMAGE_PYTHON:-python3.12}
if [ "$BASE_IMAGE" = localhost/orthornn-base:bookworm ] && ! "$engine" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    command -v mmdebstrap >/dev/null 2>&1 || give_up "no mmdebstrap to build the Debian base (or set BASE_IMAGE and IMAGE_PYTHON)"
    sources=/etc/apt/sources.list.d/debian.sources
    [ -f "$sources" ] || sources=/etc/apt/sources.list
    # minbase + Python; no documentation, manual pages or translations (copyright notices kept)
    mmdebstrap --quiet --variant=minbase --include=python3.11,python3.11-venv,ca-certificates \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        bookworm "$tmp/base.tar" "$sources" || fail "mmdebstrap failed"
    "$engine" import "$tmp/base.tar" "$BASE_IMAGE" >/dev/null 2>&1 || fail "$engine import failed"
    echo "images: $BASE_IMAGE from mmdebstrap in $(( $(date +%s) - start )) s"
fi

# The image's exact Python decides the set (scripts/wheelhouse.py: markers such as
# python_full_version); a base without Python yet (ubuntu) gets PYTHON's minor version.
image_py=$("$engine" run --rm --network none "$BASE_IMAGE" "$IMAGE_PYTHON" -c \
    "import platform; print(platform.python_version())" 2>/dev/null || echo "${IMAGE_PYTHON#python}")
fill() {  # fill DIR REQUIREMENT... [-- PIP_OPTION...]
    local dir=$1; shift
    # (this machine's pip configuration may name local indexes that lack some projects)
    "$py" scripts/wheelhouse.py "$dir" "$image_py" "$@" \
        2> >(grep -v "is neither a file nor a directory" >&2)
    rm -f "$dir"/orthornn-*.whl
}
if [ "$VARIANT" = gpu ]; then
    ort=$("$py" -c "import importlib.metadata as m; print(m.version('onnxruntime'))")
    fill "$house/serve-gpu" "$wheel[serve]" "onnxruntime-gpu[cuda,cudnn]==$ort"
    rm -f "$house/serve-gpu"/onnxruntime-"$ort"-*.whl
    # --isolated: the CUDA build of torch from the index, not a CPU file of this machine's
    fill "$house/train-gpu" "torch==$torch_version" "$wheel[train]" -- --isolated
else
    # torch's CPU build: the pip configuration of this machine finds it
    fill "$house/train-cpu" "torch==$torch_version" "$wheel[train]"
    fill "$house/serve-cpu" "$wheel[serve]"
fi
echo "images: wheelhouse $(du -shc "$house/orthornn" "$house/serve-$VARIANT" "$house/train-$VARIANT" | tail -1 | cut -f1) in $(( $(date +%s) - start )) s"

# ------------------------------------------------------------------ 3. the images
format=()  # podman's default OCI format drops SHELL and HEALTHCHECK
[ "$engine" = podman ] && format=(--format docker)
digest() { cat "$@" | sha256sum | cut -c1-16; }
build() {  # build TARGET TAG
    "$engine" build --quiet "${format[@]}" --target "$1" --tag "$2" \
        --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg PYTHON="$IMAGE_PYTHON" \
        --build-arg VARIANT="$VARIANT" \
        --build-arg DEPS_DIGEST="$(digest "$house/$1-$VARIANT"/*.whl)" \
        --build-arg WHEEL_DIGEST="$(digest "$house"/orthornn/*.whl)" \
        --file Dockerfile . >/dev/null
    echo "images: $2 $("$engine" image inspect --format '{{.Size}}' "$2" | awk '{printf "%.0f MiB", $1/1048576}') at $(( $(date +%s) - start )) s"
}
build serve "orthornn:$version-$VARIANT"
build train "orthornn-train:$version-$VARIANT"
