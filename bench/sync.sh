#!/usr/bin/env bash
# End-to-end sync throughput: a ~1 GiB bf16 model (hidden 2048, 8 layers) from 2 trainer nodes
# into 2 inference nodes (4 daemons on loopback, UCX over TCP), beside the transport's own figure
# for the same transport. Usage: bench/sync.sh [extra shardcast-demo flags]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/build.sh" shardcast-demo shardcastd transport_bench >/dev/null
echo "== transport alone (UCX_TLS=tcp, 256 MiB writes)"
"$root/build/bin/transport_bench" --tls tcp --sizes 256 --iters 8 2>/dev/null | grep "write"
echo "== end-to-end syncs through shardcastd (4 daemons)"
"$root/build/bin/shardcast-demo" --hidden 2048 --layers 8 --trainer-nodes 2 --inference-nodes 2 --syncs 3 "$@" 2>/dev/null |
  grep -E "^sync|network|max node"
