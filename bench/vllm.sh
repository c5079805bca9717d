#!/usr/bin/env bash
# Figures of a Shardcast update of a real vLLM on this machine's CPU, beside vLLM's own reload from
# a saved checkpoint, without and with double buffering (bench/vllm_bench.py; docs/vllm.md quotes
# them). Extra arguments go to vllm_bench.py (--hidden, --layers, --updates). With --lora first: a
# LoRA adapter's updates beside vLLM's load of it from disk (bench/vllm_lora_bench.py). With
# --moe-init first: trainer_init and updates at a MoE's tensor count (bench/vllm_moe_init.py).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/deps.sh" vllm
bash "$root/scripts/build.sh" shardcastd >/dev/null
py="$root/.venv-vllm/bin/python"
"$py" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$root/client/python"
export SHARDCAST_BUILD="${SHARDCAST_BUILD:-$root/build}"
if [ "${1:-}" = "--moe-init" ]; then  # trainer_init at a MoE's tensor count (bench/vllm_moe_init.py)
  shift
  exec "$py" "$root/bench/vllm_moe_init.py" "$@"
fi
if [ "${1:-}" = "--lora" ]; then  # a LoRA adapter's updates (bench/vllm_lora_bench.py), ranks 16 and 64
  shift
  for rank in 16 64; do
    err="$(mktemp)"
    out="$("$py" "$root/bench/vllm_lora_bench.py" --rank "$rank" "$@" 2>"$err")" ||
      { echo "vllm_lora_bench.py --rank $rank failed:" >&2; tail -20 "$err" >&2; rm -f "$err"; exit 1; }
    rm -f "$err"
    printf '%s\n\n' "$out" | grep -v '^RESULT\|^(' || true
  done
  exit 0
fi
for mode in "" --double-buffer; do
  "$py" "$root/bench/vllm_bench.py" $mode "$@" 2>/dev/null | grep -v '^RESULT'
  echo
done
