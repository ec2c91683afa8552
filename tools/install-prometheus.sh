#!/bin/sh
# `make install` runs this: the tests need Prometheus's `prometheus` and `promtool` binaries (the live
# dashboard test scrapes a local run; the rule and metric checks run promtool). When either is missing
# and apt is there, install Debian's `prometheus` package (it ships both; its systemd service is not
# needed and is not started here). Otherwise say what to install; the tests fail naming it too.
set -eu
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-prometheus: no apt-get here; install Prometheus (prometheus and promtool on PATH) yourself" >&2
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    SUDO=
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
else
    echo "install-prometheus: run as root: apt-get install -y --no-install-recommends prometheus" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
# The tests run the binaries on their own ports: keep the package's service from starting (policy-rc.d
# exit 101, Debian's way to say "no daemons now"), unless the machine has its own policy already.
POLICY=/usr/sbin/policy-rc.d
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null && $SUDO chmod 755 "$POLICY"
    trap '$SUDO rm -f "$POLICY"' EXIT
fi
if $SUDO apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1 || {
    $SUDO apt-get update -qq && $SUDO apt-get install -y --no-install-recommends prometheus >/dev/null
}; then
    echo "install-prometheus: installed $(prometheus --version 2>&1 | head -n 1)"
else
    echo "install-prometheus: apt-get install prometheus failed; the Prometheus tests will fail until it is installed" >&2
fi
