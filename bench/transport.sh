#!/usr/bin/env bash
# Transport figures beside ucx_perftest on the same machine, transports and message sizes.
# Usage: bench/transport.sh [sizes in MiB, default "64 256 1024"] — prints one table; see docs/transport.md.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/build.sh" transport_bench >/dev/null
bench="$root/build/bin/transport_bench"
sizes=(${1:-64 256 1024})
iters=${ITERS:-8}
port=$((20000 + RANDOM % 20000))

perftest() {  # tls test size -> GB/s
  local tls=$1 test=$2 size=$3
  UCX_TLS=$tls timeout 120 ucx_perftest -p "$port" >/dev/null 2>&1 &
  local srv=$!
  sleep 0.5
  local mbs
  mbs=$(UCX_TLS=$tls timeout 120 ucx_perftest localhost -p "$port" -t "$test" -s "$size" -n "$iters" -w 2 2>/dev/null |
        awk '/^Final:/ {print $6}')
  wait "$srv" 2>/dev/null || true
  port=$((port + 1))
  # ucx_perftest's MB/s is MiB/s.
  awk -v m="${mbs:-0}" 'BEGIN {printf "%.2f", m * 1048576 / 1e9}'
}

csv=$(IFS=,; echo "${sizes[*]}")
printf "%-22s %-8s %9s %12s %12s %7s\n" "UCX_TLS" "size" "shardcast" "perftest put" "perftest am" "ratio"
for tls in "posix,sysv,self" "tcp" "posix,sysv,cma,self"; do
  out=$(ITERS=$iters "$bench" --tls "$tls" --sizes "$csv" --iters "$iters")
  proto=$(echo "$out" | sed -n 's/.*protocol=\([a-z]*\).*/\1/p' | head -1)
  for mib in "${sizes[@]}"; do
    bytes=$((mib << 20))
    ours=$(echo "$out" | awk -v b="$bytes" '$1 == "RESULT" && $2 == "transport" && $3 == b {print $4}')
    if [ "$tls" = "tcp" ] && [ "$mib" -gt 64 ]; then
      put="-"  # UCX 1.13's put over TCP runs at ~0.03 GB/s in ucx_perftest: minutes per point
    else
      put=$(perftest "$tls" ucp_put_bw "$bytes")
    fi
    am=$(perftest "$tls" ucp_am_bw "$bytes")
    best=$(awk -v p="${put/-/0}" -v a="$am" 'BEGIN {print (p + 0 > a + 0 ? p : a)}')
    ratio=$(awk -v o="$ours" -v b="$best" 'BEGIN {printf "%.0f%%", (b > 0 ? 100 * o / b : 0)}')
    printf "%-22s %-8s %9.2f %12s %12s %7s  (%s)\n" "$tls" "${mib}MiB" "$ours" "$put" "$am" "$ratio" "$proto"
  done
done
echo
"$bench" --tls "posix,sysv,self" --sizes "$csv" --iters "$iters" | grep -E "local copy|register"
