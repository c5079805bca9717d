#!/usr/bin/env bash
# Syncs measured on a network rather than loopback: every node a Linux network namespace
# ("sc-<node>", 10.77.0.<k+2>/24) joined through a bridge in a switch namespace ("sc-switch"), its
# link rate-limited both ways (tc tbf, optional netem delay; jumbo frames, MTU 9000, as datacenter
# fabrics run, unless --mtu); one shardcastd per node inside its
# namespace (shardcast-demo --netns), UCX over TCP. Per scenario it reports the measured sync time
# (best of the cached syncs), the plan's predicted time for the link rate, the network lower bound
# (the busiest node's ingress over the link rate), each baseline's measured time (every rank
# pulling its own slices; everything through one node) and their ratios. With --control-plane: syncs of a
# tiny model across 8..64 daemons on loopback, the time per phase against the node count; then whole
# syncs of a real coordinating daemon over 256 and 1024 simulated daemons (build/bin/relay_bench
# --whole-syncs: the coordinator's time and CPU per sync, directly and through relay trees).
# Traffic stays inside the namespaces this script makes; they are removed on exit, whatever happens.
# Needs root (ip netns, tc). Usage:
#   bench/cluster.sh [--rate-mbit R] [--delay-ms 0] [--queue-ms 200] [--mtu 9000] [--scenario relay|fsdp-tp|moe|16-node|all]
#                    (links of 1000 Mbit/s, the 16-node case's 500: what 2 cores forward for 16 nodes;
#                    --rate-mbit sets every scenario's)
#                    [--syncs 3] [--strategies planned,rank-pull,gather-broadcast]
#                    (the baselines run by the same daemons, after Shardcast's plan: sync --strategy)
#   bench/cluster.sh --scenario delta [--delta-arg ARG]...  (bench/delta_bench.py on 2 nodes: AdamW steps,
#                    dense and delta syncs side by side; not part of "all")
#                    [--demo-arg ARG]...   (passed to shardcast-demo, e.g. --demo-arg=--chunk-mib=4)
#   bench/cluster.sh --control-plane [--nodes "8 16 32 64"] [--cp-syncs 21] [--simulated "256 1024"]
#                    [--simulated-fanouts "0 32 64"] [--demo-arg=--double-buffered] (folded Prepares)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
rate="" delay=0 queue_ms=200 mtu=9000 scenario=all syncs=3 control=0 cp_nodes="8 16 32 64" cp_syncs=21 cp_simulated="256 1024" cp_fanouts="0 32 64" demo_args=() delta_args=()
strategies=planned,rank-pull,gather-broadcast
while [ $# -gt 0 ]; do
  case "$1" in
    --rate-mbit) rate="$2"; shift 2 ;;
    --delay-ms) delay="$2"; shift 2 ;;
    --queue-ms) queue_ms="$2"; shift 2 ;;
    --mtu) mtu="$2"; shift 2 ;;
    --scenario) scenario="$2"; shift 2 ;;
    --syncs) syncs="$2"; shift 2 ;;
    --strategies) strategies="$2"; shift 2 ;;
    --control-plane) control=1; shift ;;
    --nodes) cp_nodes="$2"; shift 2 ;;
    --cp-syncs) cp_syncs="$2"; shift 2 ;;
    --simulated) cp_simulated="$2"; shift 2 ;;
    --simulated-fanouts) cp_fanouts="$2"; shift 2 ;;
    --demo-arg) demo_args+=("$2"); shift 2 ;;
    --demo-arg=*) demo_args+=("${1#--demo-arg=}"); shift ;;
    --delta-arg) delta_args+=("$2"); shift 2 ;;
    --delta-arg=*) delta_args+=("${1#--delta-arg=}"); shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "bench/cluster.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
bash "$root/scripts/build.sh" shardcast-demo shardcastd relay_bench >/dev/null
demo="$root/build/bin/shardcast-demo"
py=/usr/bin/python3

made=()
teardown() {
  for ns in "${made[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
  made=()
}
trap teardown EXIT INT TERM

# shape NS DEV RATE: the link's rate in Mbit/s (and delay) on DEV's egress inside NS.
shape() {
  local ns="$1" dev="$2" rate="$3"
  local burst=$((rate * 1000000 / 8 / 100))  # 10 ms at the rate
  [ "$burst" -lt 65536 ] && burst=65536
  if [ "$delay" != 0 ]; then
    ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: netem delay "${delay}ms"
    ip netns exec "$ns" tc qdisc add dev "$dev" parent 1: handle 2: tbf rate "${rate}mbit" burst "$burst" latency ${queue_ms}ms
  else
    ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "${rate}mbit" burst "$burst" latency ${queue_ms}ms
  fi
}

# network RATE NODE...: a switch namespace and one namespace per node, node k at 10.77.0.<k+2>,
# each linked to the switch at RATE Mbit/s.
network() {
  local rate="$1"
  shift
  teardown
  ip netns add sc-switch
  made+=(sc-switch)
  ip netns exec sc-switch ip link add br0 mtu "$mtu" type bridge
  ip netns exec sc-switch ip link set br0 up
  local k=0
  for node in "$@"; do
    local ns="sc-$node"
    ip netns add "$ns"
    made+=("$ns")
    ip link add "scv$k" netns "$ns" mtu "$mtu" type veth peer name "p$k" netns sc-switch mtu "$mtu"
    ip netns exec "$ns" ip link set "scv$k" name eth0
    ip netns exec "$ns" ip addr add "10.77.0.$((k + 2))/24" dev eth0
    ip netns exec "$ns" ip link set eth0 up
    ip netns exec "$ns" ip link set lo up
    ip netns exec sc-switch ip link set "p$k" master br0
    ip netns exec sc-switch ip link set "p$k" up
    shape "$ns" eth0 "$rate"       # the node's egress
    shape sc-switch "p$k" "$rate"  # its ingress
    k=$((k + 1))
  done
}

# scenario NAME RATE TRAINERS INFERENCE DEMO-FLAGS...: one row of the table, links of RATE Mbit/s
# (--rate-mbit wins). The same daemons run the syncs with Shardcast's plan, then with each
# baseline (shardcast-demo --strategies).
run_scenario() {
  local name="$1" rate="${rate:-$2}" t="$3" i="$4"
  shift 4
  local nodes=()
  for ((n = 0; n < t; n++)); do nodes+=("trainer-$n"); done
  for ((n = 0; n < i; n++)); do nodes+=("inference-$n"); done
  network "$rate" "${nodes[@]}"
  local out gbps
  gbps=$($py -c "print($rate / 1000)")  # the daemons size chunks and windows for it (shardcastd --nic-gbps)
  if ! out=$("$demo" --netns --report --trainer-nodes "$t" --inference-nodes "$i" --syncs "$syncs" \
               --strategies "$strategies" --nic-gbps "$gbps" --daemon-arg "--nic-gbps=$gbps" "$@" "${demo_args[@]}" 2>&1); then
    echo "$out" | tail -20 >&2
    echo "| $name | $((t + i)) | sync failed (above) |"
    return
  fi
  echo "$out" >"${TMPDIR:-/tmp}/shardcast-cluster-${name%%[: ]*}.log" 2>/dev/null || true  # the raw run, for a second look
  echo "$out" | $py -c '
import json, sys
name, nodes, rate_mbit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
plans, syncs = {}, {}
for line in sys.stdin:
    if line.startswith("RESULT plan "):
        strategy, body = line[len("RESULT plan "):].split(" ", 1)
        plans[strategy.split("=")[1]] = json.loads(body)
    elif line.startswith("RESULT sync "):
        row = dict(kv.split("=") for kv in line.split()[2:])
        syncs.setdefault(row["strategy"], []).append(row)
rate = rate_mbit * 1e6 / 8
def best(strategy):  # best of the cached syncs (the first one plans, allocates and connects)
    rows = syncs.get(strategy, [])
    cached = rows[1:] or rows
    return min(float(r["seconds"]) for r in cached) if cached else float("nan")
plan = plans["planned"]
measured = best("planned")
bound = max(plan["max_node_ingress_bytes"], plan["max_node_egress_bytes"]) / rate
predicted = plan["predicted_seconds"]
wrong = sum(int(r["wrong"]) for rows in syncs.values() for r in rows)
gb = float(syncs["planned"][-1]["network_bytes"]) / 1e9
cells = []
for s in ("rank-pull", "gather-broadcast"):
    if s in syncs:
        m, p = best(s), plans[s]["predicted_seconds"]
        cells.append(f"{m:.2f} s ({m / measured:.1f}x; predicted {p:.2f} s)")
    else:
        cells.append("not run")
print(f"| {name} | {nodes} | {rate_mbit:g} Mbit/s | {gb:.3f} GB | {measured:.2f} s | {predicted:.2f} s | {bound:.2f} s | "
      f"{measured / bound:.2f}x | {cells[0]} | {cells[1]} | {predicted / measured:.2f} | {wrong} |")
' "$name" "$((t + i))" "$rate"
}

if [ "$control" = 1 ]; then
  echo "== control plane: a tiny model (1 layer, hidden 64, vocab 256: 0.2 MB) from 1 trainer node into N-1 inference nodes, loopback"
  echo "   ($cp_syncs syncs each: the first gathers and plans, the rest repeat it; time: best and median of the rest;"
  echo "   CPU: mean per sync over the rest, from /proc, of the coordinator and of every daemon together)"
  echo "   (relay fanout: ${SHARDCAST_RELAY_FANOUT:-64}, the daemons' --relay-fanout; calls: the coordinator's own per phase)"
  echo "   (--demo-arg=--double-buffered: inference ranks double-buffered, so repeated syncs fold their Prepare into the first wave)"
  echo "| daemons | gather+plan | prepare | execute | finish | whole sync, best | median | repeated | folded | calls | coordinator CPU | all daemons' CPU | per daemon |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
  for n in $cp_nodes; do
    out=$("$demo" --report --layers 1 --hidden 64 --vocab 256 --trainer-nodes 1 --inference-nodes $((n - 1)) --syncs "$cp_syncs" ${demo_args[@]+"${demo_args[@]}"} 2>&1) || {
      echo "$out" | tail -5 >&2
      echo "| $n | failed |"
      continue
    }
    echo "$out" | $py -c '
import statistics, sys
n = int(sys.argv[1])
rows = [dict(kv.split("=") for kv in l.split()[2:]) for l in sys.stdin if l.startswith("RESULT sync ")]
rest = rows[1:]
best = min(rest, key=lambda r: float(r["seconds"]))
cells = " | ".join("%.1f ms" % (float(best[k]) * 1000) for k in ("gather", "prepare", "execute", "finish", "seconds"))
median = statistics.median(float(r["seconds"]) for r in rest) * 1000
repeated = sum(int(r.get("repeated", 0)) for r in rest)
folded = sum(int(r.get("folded", 0)) for r in rest)
coord = statistics.mean(float(r["coordinator_cpu"]) for r in rest) * 1000
every = statistics.mean(float(r["daemons_cpu"]) for r in rest) * 1000
calls = max(int(r.get("coordinator_calls", 0)) for r in rest)
print("| %d | %s | %.1f ms | %d of %d | %d of %d | %d | %.1f ms | %.1f ms | %.2f ms |" % (n, cells, median, repeated, len(rest), folded, len(rest), calls, coord, every, every / n))
' "$n"
  done
  if [ -n "$cp_simulated" ]; then
    echo "== whole syncs of a real coordinating daemon over simulated daemons (relay_bench --whole-syncs, $((cp_syncs - 1)) repeated syncs)"
    echo "   (the trainer's rank on one, an inference rank on each other; they answer at once and move no bytes;"
    echo "   fanout: the coordinator's --relay-fanout, 0 direct; fold: its --fold-prepare (the inference ranks are"
    echo "   double-buffered: auto folds each repeated Prepare into the first wave); CPU: the coordinator's process alone)"
    "$root/build/bin/relay_bench" --whole-syncs --daemons "$cp_simulated" --fanouts "$cp_fanouts" --fold "never auto" \
      --rounds "$((cp_syncs - 1))"
  fi
  exit 0
fi

if [ "$scenario" = delta ]; then
  rate="${rate:-1000}"
  echo "== delta syncs over emulated links: ${rate} Mbit/s each way per node, ${delay} ms delay, UCX over TCP"
  network "$rate" trainer-0 inference-0
  [ -x "$root/.venv/bin/python" ] || bash "$root/scripts/deps.sh" >/dev/null  # the test venv (torch)
  SHARDCAST_BUILD="$root/build" "$root/.venv/bin/python" "$root/bench/delta_bench.py" --netns "${delta_args[@]}"
  exit 0
fi

echo "== syncs over emulated links (each way per node), ${delay} ms delay, MTU ${mtu}, UCX over TCP"
echo "| scenario | nodes | link | network bytes per sync | measured | predicted | lower bound | measured / bound | rank pull | gather+broadcast | predicted / measured | wrong elements |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
case "$scenario" in
  relay | all) run_scenario "relay: 1 trainer node into 6 inference nodes" 1000 1 6 --layers 2 --hidden 1024 ;;&
  fsdp-tp | all) run_scenario "FSDP (8 ranks) into TP=4 x 2 nodes, fused qkv/gate_up" 1000 2 2 --layers 4 --hidden 1024 ;;&
  moe | all) run_scenario "MoE: 16 whole experts per layer (FSDP, 8 ranks) into EP=3 x TP=4" 1000 2 3 --layers 2 --hidden 1024 --experts 16 --vocab 8192 ;;&
  # 16 links of 1000 Mbit/s are more than 2 cores forward through veth, bridge and tbf (about
  # 10% idle and +-15% between syncs there): 500 keeps the network the limit (docs/performance.md).
  16-node | all) run_scenario "16 nodes: 4 trainer, 12 inference" 500 4 12 --layers 2 --hidden 512 ;;&
  relay | fsdp-tp | moe | 16-node | all) ;;
  *) echo "unknown scenario $scenario" >&2; exit 2 ;;
esac
