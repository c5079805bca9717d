#!/usr/bin/env bash
# The chaos soak for minutes (docs/reliability.md): 5 daemons on loopback, a SIGKILL or SIGSTOP of a
# random daemon (coordinator included) at a random moment of every third sync, every rank's bytes
# checked against its reported state after every sync. Prints the figures; exits 1 on any torn,
# mislabeled, wedged or unnamed failure, or an untargeted crash.
#   bash bench/chaos.sh [--syncs 300] [--seed 1] [--lease-ms 1000] [--json] [--verbose]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/deps.sh" >/dev/null
bash "$root/scripts/build.sh" >/dev/null
py="$root/.venv/bin/python"
"$py" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$root/client/python" >/dev/null
export SHARDCAST_BUILD="${SHARDCAST_BUILD:-$root/build}"
cd "$root/client/python/tests"
exec "$py" chaos.py "$@"
