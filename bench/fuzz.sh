#!/usr/bin/env bash
# The fuzzers for longer than scripts/test.sh --sanitize runs them: each target SECONDS (default 300), on JOBS parallel
# workers (default 1), from the corpus build-fuzz/corpus grows run after run. Prints executions,
# corpus size and crashes per target (docs/security.md keeps the figures).
#   bash bench/fuzz.sh [SECONDS] [JOBS]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
exec bash "$root/scripts/fuzz.sh" --seconds "${1:-300}" --jobs "${2:-1}"
