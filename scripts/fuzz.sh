#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan, in build-fuzz/) and runs each for a fixed time
# from its seed corpus: layout JSON -> resolve -> plan, registration, peer notifications, deltas,
# UCX message headers, peer requests (Prepare, Execute, Finish).
#   scripts/fuzz.sh [--seconds N] [--jobs J] [target...]      (default: 20 s each, all targets)
#   scripts/fuzz.sh --build-only [target...]                  (builds them, runs nothing)
# Prints one line per target (executions, corpus size, crashes) and exits 1 if any input crashed
# or tripped a sanitizer; the input is kept in build-fuzz/crashes/. bench/fuzz.sh runs it longer.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
seconds=20
jobs=1
build_only=0
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    --build-only) build_only=1; shift ;;
    -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=(layout register notification delta ucx_header peer)

bash "$root/scripts/deps.sh" build
# clang and its runtime (libFuzzer, the sanitizers), Debian's
missing=()
for p in clang libclang-rt-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq && $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

build="$root/build-fuzz"
if [ ! -f "$build/CMakeCache.txt" ]; then
  # A unity build (the generated protobuf code excepted) at -O1 with line tables only: a third
  # less compiler time than -O2 -g per file, and sanitizer reports still name file and line.
  CC=clang CXX=clang++ cmake -S "$root" -B "$build" -DSHARDCAST_FUZZ=ON -DSHARDCAST_CUDA_KERNELS=OFF \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only" \
    -DCMAKE_UNITY_BUILD=ON >/dev/null
else
  cmake "$build" >/dev/null  # a target added since it was configured (make cannot name it before)
fi
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)" --target fuzz_seeds $(printf 'fuzz_%s ' "${targets[@]}") >/dev/null
[ "$build_only" -eq 1 ] && exit 0

corpus="$build/corpus"
rm -rf "$build/crashes"  # this run's crashes only (an earlier run's stay in its log)
mkdir -p "$build/crashes"
"$build/bin/fuzz_seeds" "$corpus/seeds" >/dev/null
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:${ASAN_OPTIONS:-}"  # leaks of the fuzz loop's caches are not bugs
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
failed=0
for t in "${targets[@]}"; do
  case "$t" in
    layout) seeds=("$root/fuzz/corpus/layout" "$root/client/examples/layouts"); max_len=16384 ;;
    register) seeds=("$corpus/seeds/register"); max_len=16384 ;;
    notification) seeds=("$corpus/seeds/notification"); max_len=8192 ;;
    delta) seeds=("$corpus/seeds/delta"); max_len=4096 ;;
    ucx_header) seeds=("$corpus/seeds/ucx_header"); max_len=1024 ;;
    peer) seeds=("$corpus/seeds/peer"); max_len=65536 ;;
    *) echo "fuzz: unknown target $t (layout, register, notification, delta, ucx_header, peer)" >&2; exit 2 ;;
  esac
  mkdir -p "$corpus/$t"
  log="$build/fuzz_$t.log"
  # Several jobs: libFuzzer runs them as child processes, each logging to fuzz-N.log in its cwd.
  parallel=()
  [ "$jobs" -gt 1 ] && parallel=(-jobs="$jobs" -workers="$jobs")
  run="$build/run-$t"
  rm -rf "$run" && mkdir -p "$run"
  set +e
  (cd "$run" && "$build/bin/fuzz_$t" -max_total_time="$seconds" "${parallel[@]}" -max_len="$max_len" \
      -rss_limit_mb=4096 -timeout=30 -print_final_stats=1 -artifact_prefix="$build/crashes/$t-" \
      "$corpus/$t" "${seeds[@]}" >"$log" 2>&1)
  rc=$?
  set -e
  cat "$run"/fuzz-*.log >>"$log" 2>/dev/null || true
  execs=$(grep -a -o 'stat::number_of_executed_units: *[0-9]*' "$log" | awk '{s+=$2} END {print s+0}')
  units=$(ls "$corpus/$t" | wc -l)
  crashes=$(ls "$build/crashes" 2>/dev/null | grep -c "^$t-" || true)
  echo "fuzz $t: $execs executions in ${seconds} s, corpus $units inputs, crashes $crashes"
  if [ $rc -ne 0 ] || [ "$crashes" -gt 0 ]; then
    failed=1
    grep -a -E "ERROR|runtime error|SUMMARY|Test unit written" "$log" | head -20 >&2
  fi
done
exit $failed
