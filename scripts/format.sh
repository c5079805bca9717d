#!/usr/bin/env bash
# clang-format over every C++ source git tracks (.clang-format: Google style, 120 columns).
#   scripts/format.sh           reformat in place
#   scripts/format.sh --check   list the files that differ and exit 1 (the test command runs this)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
command -v clang-format >/dev/null || bash "$root/scripts/deps.sh" >/dev/null
cd "$root"
mapfile -t files < <(git ls-files '*.cc' '*.h')
if [ "${1:-}" != "--check" ]; then
  clang-format -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "format: ${#bad[@]} file(s) differ from clang-format (run bash scripts/format.sh): ${bad[*]}" >&2
  exit 1
fi
echo "format: ${#files[@]} files match .clang-format"
