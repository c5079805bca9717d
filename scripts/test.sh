#!/usr/bin/env bash
# Builds everything and runs every test. ctest's summary is the last thing printed.
#
#   scripts/test.sh             the complete suite (what .ci/run runs): format check, build, the GPU
#                               bundle, pytest (Python client, examples, real PyTorch DTensor syncs,
#                               deployment), the vLLM backend against a real vLLM on the CPU, then
#                               every ctest test (the fuzz targets' seed corpora replayed among them)
#   scripts/test.sh --quick     the inner loop (a few minutes after a build): unit, property and
#                               contract tests and single real syncs; everything tagged slow is left
#                               out (ctest label `slow`, pytest marker `slow`, the vLLM tests)
#   scripts/test.sh --sanitize  the complete suite on an ASan/UBSan build in build-asan/ (the daemons
#                               the Python tests start too), and the fuzzers for a short fixed time
#                               on their clang ASan/UBSan build in build-fuzz/; no vLLM tests
#
# Each phase prints its time; the times are summed up again before ctest runs.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build"
tier=full
case "${1:-}" in
  "") ;;
  --quick) tier=quick ;;
  --sanitize)
    tier=sanitize
    build="$root/build-asan"
    export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
    ;;
  -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "test.sh: unknown option $1 (--quick, --sanitize, --help)" >&2; exit 2 ;;
esac

times=()
phase() {  # phase NAME COMMAND...: runs it, prints and records how long it took
  local name="$1" start=$SECONDS
  shift
  "$@"
  times+=("$(printf '%-28s %4d s' "$name" $((SECONDS - start)))")
  echo "== $name: $((SECONDS - start)) s" >&2
}

# Debian's packages first (the build needs them); the venvs from PyPI (a few GB each on a fresh
# machine: mostly waiting on the network) are made while the build runs.
phase "deps (Debian packages)" bash "$root/scripts/deps.sh" system
deps=()
[ "$tier" = full ] && deps=(vllm)  # the vLLM venv as well (once)
deps_log="$(mktemp)"
setsid bash "$root/scripts/deps.sh" "${deps[@]}" >"$deps_log" 2>&1 &
venvs=$!
background=("$venvs")  # each in its own process group, stopped when this script stops early
trap 'for p in "${background[@]}"; do kill -- "-$p" 2>/dev/null || kill "$p" 2>/dev/null || true; done' EXIT
phase "format check" bash "$root/scripts/format.sh" --check  # first: it fails fast
venvs_ready() {
  local rc=0
  wait "$venvs" || rc=$?
  cat "$deps_log" >&2
  rm -f "$deps_log"
  [ $rc -eq 0 ] || echo "test.sh: making the venvs failed (scripts/deps.sh ${deps[*]})" >&2
  return $rc
}
# Runs COMMAND in a session of its own (a process group, stopped when this script stops early) at
# nice level NICE, its output into LOG; its pid in $job. Where the kernel schedules each session's
# processes as one group (sched_autogroup, on in Debian's kernels), groups share the CPU equally
# whatever their processes' nice levels: the job's group gets the level as well, or it would mean
# nothing beside the other jobs.
session_job() {  # session_job NICE LOG COMMAND...
  local level="$1" log="$2"
  shift 2
  nice -n "$level" setsid bash -c '
    if [ "$1" != 0 ] && [ -w /proc/self/autogroup ]; then
      for _ in 1 2 3 4 5; do  # an unprivileged change may be refused (EAGAIN) within 100 ms of another
        echo "$1" 2>/dev/null >/proc/self/autogroup && break
        sleep 0.1
      done
    fi
    shift
    exec "$@"' _ "$level" "$@" >"$log" 2>&1 &
  job=$!
  background+=("$job")
}
# waits for background job $1 and prints its log $2; $3: what to say when it failed
finished() {
  local rc=0
  wait "$1" || rc=$?
  cat "$2"
  [ $rc -eq 0 ] || [ -z "${3:-}" ] || echo "test.sh: $3" >&2
  return $rc
}
if [ "$tier" = full ]; then
  # The vLLM tests are the longest chain and need only shardcastd: it is built first, and they run
  # (in the vLLM venv) while everything else builds and runs beside them. The rest of the build
  # starts at once, not after the venvs (on a fresh machine they are still downloading then, about
  # 200 s, a core's worth of CPU at most), at the vLLM tests' priority: the client's tests, the
  # other long chain, wait for it. Each job's output follows when it is waited for.
  phase "build (shardcastd)" bash "$root/scripts/build.sh" shardcastd
  build_log="$build/build-rest.log"
  session_job 0 "$build_log" bash "$root/scripts/build.sh"
  build_rest=$job
  phase "deps (venvs, the rest)" venvs_ready
  vllm_log="$build/pytest-vllm.log"
  session_job 0 "$vllm_log" env SHARDCAST_BUILD="$build" bash "$root/scripts/test-vllm.sh" -p no:cacheprovider \
    --durations=12
  vllm_tests=$job
  phase "build (the rest)" finished "$build_rest" "$build_log" "the build failed (scripts/build.sh)"
else
  if [ "$tier" = sanitize ]; then
    phase "build (ASan/UBSan)" bash "$root/scripts/build.sh" --sanitize
    # The fuzzers (every libFuzzer target for a short fixed time on its ASan + UBSan clang build in
    # build-fuzz/) build and run meanwhile at the lowest priority; their output follows pytest's.
    fuzz_log="$build/fuzz.log"
    session_job 19 "$fuzz_log" env -u ASAN_OPTIONS -u UBSAN_OPTIONS bash "$root/scripts/fuzz.sh" \
      --seconds "${SHARDCAST_FUZZ_SECONDS:-6}"
    fuzz=$job
  else
    phase "build" bash "$root/scripts/build.sh"
  fi
  phase "deps (venvs, the rest)" venvs_ready
fi
# The GPU bundle scripts/device-check.sh runs where a GPU is: built and size-checked every time.
[ "$tier" = full ] && phase "device bundle" nice -n 5 bash "$root/scripts/device-bundle.sh"

py="$root/.venv/bin/python"
# The client package as installed by pip, from this checkout (the venv may hold an older one).
"$py" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$root/client/python"
"$py" -c 'import google.protobuf, grpc, torch; print(f"test venv: torch {torch.__version__}, grpcio {grpc.__version__}, protobuf {google.protobuf.__version__}")'
export SHARDCAST_BUILD="$build"
markers=()
[ "$tier" = quick ] && markers=(-m "not slow")
niced=()
[ "$tier" = full ] && niced=(nice -n 5)  # below the vLLM tests
# pytest: the Python client and the examples, then the deployment checks (manifests validated
# against Kubernetes' schemas, consistency with the daemon's flags, the daemon run as the
# DaemonSet says). Separate runs: each directory has its own conftest. The deployment checks run
# beside the client's (they mostly wait on kubectl); their output follows.
deploy_log="$build/pytest-deploy.log"
"${niced[@]}" "$py" -m pytest -q -rs -p no:cacheprovider "${markers[@]}" "$root/deploy/tests" >"$deploy_log" 2>&1 &
deploy_tests=$!
background+=("$deploy_tests")
labels=()
[ "$tier" = quick ] && labels=(-LE slow)
ctest_job=""
if [ "$tier" = full ]; then
  # ctest runs beside the client's tests (both spend much of their time waiting on daemons, so
  # together they fill what the vLLM tests leave of the two cores), below them: it is the shorter
  # chain, and the client's tests, the longer one, ended the run alone for 90 s when they shared
  # equally. Its output comes last all the same, and its status is the script's.
  ctest_log="$build/ctest.log"
  session_job 5 "$ctest_log" bash -c 'cd "$1" && exec ctest --output-on-failure -j "$2"' _ "$build" \
    "$(nproc 2>/dev/null || echo 2)"
  ctest_job=$job
fi
phase "pytest client" "${niced[@]}" "$py" -m pytest -q -rs -p no:cacheprovider --durations=12 "${markers[@]}" \
  "$root/client/python/tests"
phase "pytest deploy (the rest)" finished "$deploy_tests" "$deploy_log"
[ "$tier" = full ] && phase "pytest vllm (the rest)" finished "$vllm_tests" "$vllm_log"
[ "$tier" = sanitize ] && phase "fuzz (the rest)" finished "$fuzz" "$fuzz_log" "the fuzzers failed (build-fuzz/crashes/)"
if [ -n "$ctest_job" ]; then
  started=$SECONDS ctest_rc=0
  wait "$ctest_job" || ctest_rc=$?
  times+=("$(printf '%-28s %4d s' "ctest (the rest)" $((SECONDS - started)))")
  trap - EXIT
  echo "test.sh ($tier): time per phase" >&2
  printf '  %s\n' "${times[@]}" >&2
  cat "$ctest_log"
  exit $ctest_rc
fi
trap - EXIT
echo "test.sh ($tier): time per phase" >&2
printf '  %s\n' "${times[@]}" >&2
cd "$build" && ctest --output-on-failure -j "$(nproc 2>/dev/null || echo 2)" "${labels[@]}"
