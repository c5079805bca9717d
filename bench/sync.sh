#!/usr/bin/env bash
# End-to-end sync throughput: a ~1.3 GiB bf16 model (hidden 2048, 12 layers) from 2 trainer nodes
# into 2 inference nodes (4 daemons on loopback, UCX over TCP), beside the transport's own figures
# for the same transport, measured just before and just after the syncs: one sender/receiver pair
# alone (2 processes on the machine's cores), and two pairs at once (4 processes, as the 4
# daemons share the cores during a sync).
# Usage: bench/sync.sh [extra shardcast-demo flags, e.g. --syncs 8 --window-mib 64]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/build.sh" shardcast-demo shardcastd transport_bench >/dev/null
transport() { "$root/build/bin/transport_bench" --tls tcp --sizes 256 --iters 16 2>/dev/null | awk '/^RESULT transport / {print $4}'; }
transport_pairs() {
  "$root/build/bin/transport_bench" --tls tcp --sizes 256 --iters 16 --pairs 2 2>/dev/null | awk '/^RESULT transport_pairs/ {print $5}'
}

# Proactive reclaim (DAMON) monitoring physical memory slows memory-bound work on some VMs (this
# one: syncs at ~40-65% of the transport figure with it, ~85-115% without); say when it runs.
for state in /sys/kernel/mm/damon/admin/kdamonds/*/state; do
  if [ -r "$state" ] && [ "$(cat "$state")" = on ]; then
    echo "note: DAMON (kdamond) is monitoring memory on this machine; figures vary more and run lower (docs/performance.md, \"One machine, loopback\")"
    break
  fi
done
before=$(transport)
before2=$(transport_pairs)
echo "== transport (UCX_TLS=tcp, 16 x 256 MiB writes, 2 in flight): one pair alone ${before} GB/s; two pairs at once ${before2} GB/s in all"
echo "== end-to-end syncs through shardcastd (4 daemons)"
out=$("$root/build/bin/shardcast-demo" --hidden 2048 --layers 12 --trainer-nodes 2 --inference-nodes 2 --syncs 6 "$@" 2>/dev/null)
echo "$out" | grep -E "^sync|^ +gather|network|max node"
after=$(transport)
after2=$(transport_pairs)
echo "== transport again: one pair alone ${after} GB/s; two pairs at once ${after2} GB/s in all"
# Steady state: every sync after the first (which plans, allocates, connects and touches memory).
steady=$(echo "$out" | awk '/^sync v[0-9]+:/ { n++; for (i = 1; i <= NF; i++) if ($i == "GB/s") g = $(i - 1); if (n > 1) print g }' | sort -g)
[ -n "$steady" ] || { echo "no syncs completed" >&2; exit 1; }
echo "$steady" | awk -v a="$before" -v b="$after" -v a2="$before2" -v b2="$after2" '
  { v[++m] = $1 }
  END {
    med = (m % 2) ? v[(m + 1) / 2] : (v[m / 2] + v[m / 2 + 1]) / 2; t = (a + b) / 2; t2 = (a2 + b2) / 2
    printf "== steady state (syncs 2..%d): median %.2f GB/s, best %.2f GB/s\n", m + 1, med, v[m]
    printf "   = %.0f%% / %.0f%% of one transport pair alone (%.2f GB/s)\n", 100 * med / t, 100 * v[m] / t, t
    printf "   = %.0f%% / %.0f%% of two transport pairs at once (%.2f GB/s, 4 processes like the 4 daemons)\n",
           100 * med / t2, 100 * v[m] / t2, t2
  }'
