#!/usr/bin/env bash
# Shardcast from a shell script: check the daemon, sync a version, wait for it on the inference
# side, and script around the JSON output. Needs a running shardcastd with both groups registered.
#
#   client/examples/shell/sync.sh SRC_GROUP DST_GROUP VERSION [DST_DAEMON]
#
# DST_DAEMON is a daemon on a node of the destination group (default: the same daemon), where the
# script waits for the version as an inference server would.
# SHARDCAST_ADDRESS / SHARDCAST_SOCKET choose the daemon (default: the node's socket);
# SHARDCAST_CLI is the CLI to use (default: `shardcast` on PATH).
set -euo pipefail
src="${1:?usage: sync.sh SRC_GROUP DST_GROUP VERSION}"
dst="${2:?usage: sync.sh SRC_GROUP DST_GROUP VERSION}"
version="${3:?usage: sync.sh SRC_GROUP DST_GROUP VERSION}"
shardcast="${SHARDCAST_CLI:-shardcast}"

# Exit codes: 2 usage, 4 daemon unreachable, 5 the operation failed.
if ! "$shardcast" status >/dev/null; then
  echo "sync.sh: no daemon to talk to" >&2
  exit 4
fi
"$shardcast" layouts

# Progress goes to stderr (a bar on a terminal, lines otherwise); --json puts the result on stdout.
result="$("$shardcast" sync --src "$src" --dst "$dst" --version "$version" --verify --json)"
echo "sync result: $result"

# Inference servers would run this on their own node before resuming with the new weights.
if [ -n "${4:-}" ]; then
  "$shardcast" wait --group "$dst" --version "$version" --timeout-s 60 --daemon "$4"
else
  "$shardcast" wait --group "$dst" --version "$version" --timeout-s 60
fi
