#!/usr/bin/env bash
# Installs the real components of the session-store and load-balancer tests
# (tests/test_session_store.py, fixtures in tests/cluster.py) from the Debian packages
# redis-server and haproxy (a no-op when both are already on PATH): apt-get update once,
# then apt-get install -y. The tests start their own redis-server and haproxy processes on
# free loopback ports; the packages' system services are neither needed nor started here.
# The Debian versions are not pinned, like Chromium's in scripts/ci-browser.sh: the archive
# keeps only the current build of each.
#
# Without root, apt-get or network the script warns and exits 0: the tests that need the
# programs then skip with a reason. CI_TOOLS_STRICT=1 turns that into a failure.
set -euo pipefail

give_up() {
    echo "ci-services: $1; the Redis and haproxy tests will be skipped" >&2
    [ "${CI_TOOLS_STRICT:-0}" = 1 ] && exit 1
    exit 0
}

have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }

if have redis-server && have haproxy; then
    exit 0
fi
command -v apt-get >/dev/null 2>&1 || give_up "no apt-get (not a Debian-based system)"
sudo=""
if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null || give_up "not root"
    sudo="sudo -n"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q || give_up "apt-get update failed"
$sudo apt-get install -y -q --no-install-recommends redis-server haproxy \
    || give_up "apt-get install redis-server haproxy failed"
echo "ci-services: $(redis-server --version 2>/dev/null | cut -d' ' -f1-3);" \
     "$( (haproxy -v 2>/dev/null || /usr/sbin/haproxy -v) | head -1)"
