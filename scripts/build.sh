#!/usr/bin/env bash
# Configures and builds Shardcast into build/ (or build-asan/ with --sanitize). Incremental.
# Usage: scripts/build.sh [--sanitize] [make targets...]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build"
flags=()
if [ "${1:-}" = "--sanitize" ]; then
  shift
  build="$root/build-asan"
  flags+=(-DSHARDCAST_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug)
fi
bash "$root/scripts/deps.sh" build
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" "${flags[@]}" >/dev/null
fi
jobs=$(nproc 2>/dev/null || echo 2)
cmake --build "$build" -j "$jobs" ${1:+--target "$@"}
