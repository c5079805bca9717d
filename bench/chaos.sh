#!/usr/bin/env bash
# The chaos soaks for minutes (docs/reliability.md). By default: 5 daemons on loopback, a SIGKILL
# or SIGSTOP of a random daemon (coordinator included) at a random moment of every third sync,
# every rank's bytes checked against its reported state after every sync; exits 1 on any torn,
# mislabeled, wedged or unnamed failure, or an untargeted crash. With --replicas: the replica-set
# soak (replica_chaos.py): replicas join, leave, and are killed, frozen or (with --netns, as root)
# partitioned while the trainer syncs every step; exits 1 on any problem it counts. Prints the figures.
#   bash bench/chaos.sh [--syncs 300] [--seed 1] [--lease-ms 1000] [--json] [--verbose]
#   bash bench/chaos.sh --replicas [--syncs 300] [--seed 1] [--netns] [--deadline-s 1] [--delta auto] [--json] [--verbose]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
soak=chaos.py
if [ "${1:-}" = "--replicas" ]; then
  soak=replica_chaos.py
  shift
fi
bash "$root/scripts/deps.sh" >/dev/null
bash "$root/scripts/build.sh" >/dev/null
py="$root/.venv/bin/python"
"$py" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$root/client/python" >/dev/null
export SHARDCAST_BUILD="${SHARDCAST_BUILD:-$root/build}"
cd "$root/client/python/tests"
exec "$py" "$soak" "$@"
