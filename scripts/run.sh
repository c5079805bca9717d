#!/usr/bin/env bash
# The main job on an embedded default: a local Shardcast cluster (one shardcastd per node: 2 trainer
# nodes, 3 inference nodes, on loopback), a Llama-like model in shared memory in the trainer's
# layout (FSDP over 8 ranks), synced 3 versions in a row into a vLLM-like layout (TP=4 per
# inference node, fused qkv / gate_up); every destination byte is verified after each sync and the
# plan summary and throughput are printed. Extra arguments go to shardcast-demo (--layers,
# --hidden, --syncs, --trainer-nodes, --inference-nodes, --ucx-tls, --verify, --daemon-arg; --help).
# `scripts/run.sh plan` instead plans the example layout files (client/examples/layouts).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
if [ "${1:-}" = "plan" ]; then
  shift
  bash "$root/scripts/build.sh" shardcast >/dev/null
  layouts="$root/client/examples/layouts"
  exec "$root/build/bin/shardcast" plan --src "$layouts/trainer_fsdp2_tp4.json" --dst "$layouts/vllm_tp4_dp2.json" "$@"
fi
bash "$root/scripts/build.sh" shardcast-demo shardcastd >/dev/null
exec "$root/build/bin/shardcast-demo" "$@"
