#!/usr/bin/env bash
# Figures of a Shardcast update of a real vLLM on this machine's CPU, beside vLLM's own reload from
# a saved checkpoint, without and with double buffering (bench/vllm_bench.py; docs/vllm.md quotes
# them). Extra arguments go to vllm_bench.py (--hidden, --layers, --updates).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/deps.sh" vllm
bash "$root/scripts/build.sh" shardcastd >/dev/null
py="$root/.venv-vllm/bin/python"
"$py" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$root/client/python"
export SHARDCAST_BUILD="${SHARDCAST_BUILD:-$root/build}"
for mode in "" --double-buffer; do
  "$py" "$root/bench/vllm_bench.py" $mode "$@" 2>/dev/null | grep -v '^RESULT'
  echo
done
