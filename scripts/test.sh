#!/usr/bin/env bash
# Builds everything and runs every test: pytest (Python client, examples, deployment), then ctest.
# ctest's summary is the last thing printed. With --sanitize: an ASan/UBSan build in build-asan/.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build"
mode=()
if [ "${1:-}" = "--sanitize" ]; then
  mode=(--sanitize)
  build="$root/build-asan"
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
fi
bash "$root/scripts/build.sh" "${mode[@]}"
# pytest: the Python client and the examples, then the deployment checks (manifests validated
# against Kubernetes' API types, consistency with the daemon's flags, the daemon run as the
# DaemonSet says). Separate runs: each directory has its own conftest.
SHARDCAST_BUILD="$build" /usr/bin/python3 -m pytest -q -rs "$root/client/python/tests"
SHARDCAST_BUILD="$build" /usr/bin/python3 -m pytest -q -rs "$root/deploy/tests"
cd "$build"
ctest --output-on-failure -j "$(nproc 2>/dev/null || echo 2)"
