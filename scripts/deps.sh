#!/usr/bin/env bash
# Installs the Debian 12 packages Shardcast needs to build and test. Idempotent: when everything is
# already installed it only runs dpkg-query and exits (well under a second).
set -euo pipefail

# `deps.sh build`: what building shardcastd and the CLI needs (the container image uses this).
# `deps.sh` (all): also what the tests and examples need.
packages=(
  build-essential cmake pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  libucx-dev ucx-utils libspdlog-dev libfmt-dev catch2 libcli11-dev libxxhash-dev
  libcpp-httplib-dev
)
if [ "${1:-all}" != "build" ]; then
  packages+=(
    python3-grpcio python3-protobuf python3-pytest python3-numpy python3-yaml
    python3-torch  # optional for the Python client; its torch tests run when present
    iproute2       # network-namespace tests
  )
  # The Node.js example and the manifest checks need node and npm; machines that already have
  # them (e.g. from NodeSource) keep theirs, since Debian's npm would conflict with those.
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    packages+=(nodejs npm)
  fi
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "deps: installing ${missing[*]}" >&2
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
