#!/usr/bin/env bash
# The main job on an embedded default: plans the sync of the example model from its trainer layout
# (FSDP2 x TP=4 on 2 nodes) into its vLLM layout (TP=4 x DP=2, fused qkv/gate_up) and prints the
# plan summary. Extra arguments go to `shardcast plan` (e.g. --json, --nic-gbps 200).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/build.sh" shardcast >/dev/null
layouts="$root/client/examples/layouts"
exec "$root/build/bin/shardcast" plan --src "$layouts/trainer_fsdp2_tp4.json" --dst "$layouts/vllm_tp4_dp2.json" "$@"
