#!/usr/bin/env bash
# Installs the real components that the tests start or drive, from Debian's packages, in
# one `apt-get update` and one `apt-get install -y` (make test's tools step):
#   headless Chromium          chromium, chromium-driver  tests/system/test_docs_browser.py
#   Redis and haproxy          redis-server, haproxy      tests/integration/test_session_store.py and
#                                                         the cluster tests (tests/cluster.py)
#   Prometheus and promtool    prometheus                 tests/integration/test_monitoring.py (the chart's
#                                                         rules and dashboard)
#   podman and a Debian base   podman, runc, mmdebstrap   make images, tests/system/test_images.py
#   wrk (the load generator)   wrk                        tests/integration/test_bench.py (bench/load/)
# Only what is missing is installed (a no-op when every program is on PATH). The tests
# start their own processes on free loopback ports; the packages' system services are
# neither needed nor started. The versions are not pinned: Debian's archive keeps only the
# current build of each, so a pin would break within weeks.
#
# Without root, apt-get or network the script warns and exits 0: the tests that need a
# missing program then skip with a reason. CI_TOOLS_STRICT=1 turns that into a failure.
set -euo pipefail

give_up() {
    if [ "${CI_TOOLS_STRICT:-0}" = 1 ]; then
        echo "ci-debian: $1; cannot install ${missing[*]} (CI_TOOLS_STRICT=1: failing)" >&2
        exit 1
    fi
    echo "ci-debian: $1; the tests that need ${missing[*]} will be skipped" >&2
    exit 0
}

have() {  # any of the programs, on PATH or in /usr/sbin
    for name in "$@"; do
        command -v "$name" >/dev/null 2>&1 || [ -x "/usr/sbin/$name" ] && return 0
    done
    return 1
}

packages=() missing=()
need() {  # need "PROGRAM [ALTERNATIVE...]" PACKAGE...
    local programs=$1; shift
    # shellcheck disable=SC2086  # the alternatives are words
    have $programs || { missing+=("${programs%% *}"); packages+=("$@"); }
}
need "chromium chromium-browser google-chrome" chromium chromium-driver
need redis-server redis-server
need haproxy haproxy
need prometheus prometheus  # promtool comes with it
need podman podman
need runc runc
need mmdebstrap mmdebstrap
need wrk wrk

[ "${#packages[@]}" = 0 ] && exit 0
command -v apt-get >/dev/null 2>&1 || give_up "no apt-get (not a Debian-based system)"
sudo=""
if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null || give_up "not root"
    sudo="sudo -n"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q || give_up "apt-get update failed"
$sudo apt-get install -y -q --no-install-recommends "${packages[@]}" \
    || give_up "apt-get install ${packages[*]} failed"
echo "ci-debian: installed ${packages[*]}"
