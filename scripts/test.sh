#!/usr/bin/env bash
# Builds everything and runs every test: pytest (Python client, examples, real PyTorch DTensor
# syncs, deployment) in the test venv, the fuzzers for 20 s each, then ctest. ctest's summary is
# the last thing printed.
# With --sanitize: an ASan/UBSan build in build-asan/ (the daemons the Python tests start too).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build"
mode=()
if [ "${1:-}" = "--sanitize" ]; then
  mode=(--sanitize)
  build="$root/build-asan"
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
fi
bash "$root/scripts/deps.sh"  # Debian packages and the test venv (torch, grpcio, protobuf from PyPI)
bash "$root/scripts/format.sh" --check  # sources as .clang-format says (first: it fails fast)
bash "$root/scripts/build.sh" "${mode[@]}"
# The GPU bundle scripts/device-check.sh runs where a GPU is: built and size-checked every time.
if [ ${#mode[@]} -eq 0 ]; then bash "$root/scripts/device-bundle.sh"; fi
py="$root/.venv/bin/python"
# The client package as installed by pip, from this checkout (the venv may hold an older one).
"$py" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$root/client/python"
"$py" -c 'import google.protobuf, grpc, torch; print(f"test venv: torch {torch.__version__}, grpcio {grpc.__version__}, protobuf {google.protobuf.__version__}")'
# pytest: the Python client and the examples, then the deployment checks (manifests validated
# against Kubernetes' schemas, consistency with the daemon's flags, the daemon run as the
# DaemonSet says). Separate runs: each directory has its own conftest.
export SHARDCAST_BUILD="$build"
"$py" -m pytest -q -rs "$root/client/python/tests"
"$py" -m pytest -q -rs "$root/deploy/tests"
# Every libFuzzer target for a short fixed time on its ASan + UBSan build (build-fuzz/, clang).
bash "$root/scripts/fuzz.sh" --seconds "${SHARDCAST_FUZZ_SECONDS:-20}"
cd "$build"
ctest --output-on-failure -j "$(nproc 2>/dev/null || echo 2)"
