#!/usr/bin/env bash
# Builds everything and runs every test: pytest for the Python client (when present), then ctest.
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
if [ -d "$root/client/python/tests" ]; then
  SHARDCAST_BUILD="$build" /usr/bin/python3 -m pytest -q "$root/client/python/tests"
fi
cd "$build"
ctest --output-on-failure -j "$(nproc 2>/dev/null || echo 2)"
