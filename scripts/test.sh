#!/usr/bin/env bash
# make test: Debian's tools beside the venv's installs, then the long background jobs
# (the quickstart's trainings, the service tests' packages, then the images' build;
# tests/background.py), so that they use the cores the installs and the lint leave idle;
# then the dev extra and the tools, and the three phases of the Makefile: BESIDE on two
# workers, the rest but IDLE and ALONE on two workers a file each with IDLE niced beside
# it (the lint and the docs niced beside those; the phases adopt the jobs:
# ORTHORNN_BACKGROUND), ALONE in one process. The exit trap ends whatever is still
# running.
#
#   bash scripts/test.sh VENV "BESIDE..." "IDLE..." "ALONE..."
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$1
beside=$2
idle=$3
alone=$4
py="$venv/bin/python"
jobs=build/background
step() { echo "make test: $1 at $(( $(date +%s) - start )) s" >&2; }
# the background command PID's log LOG, once it ended; its exit status
finish() { local code=0; wait "$1" || code=$?; cat "$2" >&2; return "$code"; }
start=$(date +%s)

# Debian's packages (apt's downloads) beside the venv's (pip's downloads and unzipping:
# one core), waited for before the tools step; a no-op where every program is there
mkdir -p build
bash scripts/ci-debian.sh > build/ci-debian.log 2>&1 &
debian=$!
make --no-print-directory "$venv/.installed-train"
step "torch and the train extra installed"
export ORTHORNN_BACKGROUND=$PWD/$jobs
rm -rf "$jobs"
mkdir -p "$jobs"
lint=""
idler=""
trap 'for p in $lint $idler; do kill "$p" 2>/dev/null || true; done; "$py" -m tests.background stop "$jobs" || true' EXIT

# the quickstart's trainings and the service tests' packages need only torch and the
# train extra
"$py" -m tests.background start-quickstart "$jobs"
"$py" -m tests.background start-packages "$jobs"
step "quickstart trainings and packages started"
finish "$debian" build/ci-debian.log
make --no-print-directory "$venv/.installed" tools
step "serve and dev extras and tools installed"
# the images need podman (the tools) and the wheel the venv builds
"$py" -m tests.background start-images "$jobs"
step "images' build started"
# the lint and the docs at the lowest priority beside the first two phases: they take the
# cycles those leave idle (a worker waiting for the other's last test, servers waiting
# on each other), and are waited for before the third phase, which runs alone
nice -n 19 make --no-print-directory lint docs > build/lint.log 2>&1 &
lint=$!
# shellcheck disable=SC2086  # BESIDE is a list of paths
"$py" -m pytest -q -n 2 --dist worksteal $beside
step "first phase done"
# IDLE niced beside the second phase, whose servers leave a core idle half the time (its
# own session, its own temporary folder); waited for before the third phase
# shellcheck disable=SC2086  # IDLE is a list of paths
nice -n 19 "$py" -m pytest -q -n 2 --dist worksteal --basetemp=build/pytest-idle $idle \
    > build/idle.log 2>&1 &
idler=$!
# shellcheck disable=SC2046  # the --ignore flags are words
"$py" -m pytest -q -n 2 --dist loadfile \
    $(for path in $beside $idle $alone; do printf -- '--ignore=%s ' "$path"; done)
step "second phase done"
finish "$idler" build/idle.log
step "the idle tests done"
finish "$lint" build/lint.log
step "lint and docs done"
# shellcheck disable=SC2086  # ALONE is a list of paths
"$py" -m pytest -q $alone
step "third phase done"
