#!/usr/bin/env bash
# The GPU check, run from the repository root on a machine with an NVIDIA GPU (driver >= 580,
# glibc >= 2.34): first `bash scripts/device-bundle.sh` on the build machine, which packs
# .device-bundle/; copy the checkout with it to the GPU machine (or set SHARDCAST_BUNDLE to the
# bundle's path), then `bash scripts/device-check.sh` there. About 3-5 min.
# Prints, and writes to $OUT/device-check.log when OUT is set:
#   the GPU; the UCX the bundle carries (NVIDIA's CUDA-aware one) and whether it reaches device
#   memory; the [gpu] tests (CUDA copies, the strided-copy kernel, staging through pinned memory,
#   a sync between daemons with device buffers on both sides, every byte checked, the fp8
#   quantisation kernel against the host quantiser bit for bit, the delta kernels against the
#   daemons' delta encoder byte for byte); pack/unpack
#   GB/s of the kernel beside a device-to-device copy of the same bytes, and the delta kernels'
#   encode/apply/hash GB/s; delta syncs against dense ones of device tensors (3 daemons, 1% of the
#   rows changing, encoded and rebuilt on the GPUs); sync GB/s with device
#   tensors (bench/device_bench.cc), staged over TCP, staged over shared memory (the staged
#   pipeline where the wire is not the bottleneck), then straight between GPUs through cuda_ipc
#   with 2 daemons and with a 3-daemon relay chain; torch's CUDA shareable handles decoded as the client reads
#   them (client/python/tests/test_cuda_handle.py against the GPU machine's torch, and test_gpu.py
#   on its GPU); a real torch DTensor on a CUDA mesh registered by CUDA IPC and synced into CUDA
#   destination tensors; FSDP2-style shards of $SHARDCAST_GPU_SHARD_GIB GiB (default 2), views at
#   offsets inside one allocation per rank, synced into CUDA views inside one allocation on a
#   second daemon, every byte and guard byte checked; under
#   PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True tensors registered by their cuMem allocations'
#   file descriptors and synced between two daemons, every byte checked
#   (client/python/tests/test_gpu.py; the daemons' own import of cuMem allocations in the [gpu]
#   daemon tests); the vLLM backend's direct path: views into live CUDA
#   parameters registered by IPC, bytes landing in place (client/python/tests/test_vllm_direct.py).
# docs/gpu.md, "Figures", records the figures with their provenance. Exit status: the number of
# steps that failed.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bundle="${SHARDCAST_BUNDLE:-$root/.device-bundle}"
[ -x "$bundle/bin/shardcastd" ] || { echo "no bundle at $bundle: run scripts/device-bundle.sh where it builds" >&2; exit 2; }
log="${OUT:-/tmp}/device-check.log"
export SHARDCAST_BIN_DIR="$bundle/bin" SHARDCAST_BUILD="$bundle" PYTHONUNBUFFERED=1
# On a GPU machine a GPU test that skips is a failure (tests/support/gpu.h, test_gpu.py, device_bench).
export SHARDCAST_REQUIRE_GPU="${SHARDCAST_REQUIRE_GPU:-1}"
export SHARDCAST_GPU_SHARD_GIB="${SHARDCAST_GPU_SHARD_GIB:-2}"
export PYTHONPATH="$root/client/python:$root/client/python/tests${PYTHONPATH:+:$PYTHONPATH}"
failed=0
step() {
  local name="$1" limit="$2"
  shift 2
  echo
  echo "== $name"
  local t0=$SECONDS
  if timeout "$limit" "$@"; then
    echo "-- $name: ok ($((SECONDS - t0)) s)"
  else
    echo "-- $name: FAILED (exit $?, $((SECONDS - t0)) s)"
    failed=$((failed + 1))
  fi
}
check() {
  echo "device check $(date -u +%Y-%m-%dT%H:%MZ), commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  # Preflight: a GPU and a driver new enough for the bundled CUDA 13 runtime (>= 580).
  if ! nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; then
    echo "-- preflight: FAILED (nvidia-smi sees no GPU)"
    failed=$((failed + 1))
  fi
  local driver
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 | cut -d. -f1)
  if [ -n "$driver" ] && [ "$driver" -lt 580 ]; then
    echo "-- preflight: FAILED (driver $driver: the bundled CUDA 13 runtime needs 580 or newer)"
    failed=$((failed + 1))
  fi
  cd "$(mktemp -d)"  # the tests' scratch files
  # Limits add up to under 10 minutes (a GPU machine lent for a check allows 10 per command); a
  # run takes 3-5.
  # The UCX the bundle carries (NVIDIA's CUDA-aware one, scripts/device-bundle.sh) loaded, its
  # CUDA transports too: a context reaches device memory (Status.transport says cuda=yes).
  local ucx_version
  ucx_version="$(cat "$bundle/lib/ucx/VERSION" 2>/dev/null)"
  if [ -n "$ucx_version" ]; then
    step "UCX $ucx_version: loaded, its CUDA transports reach device memory" 15 \
      env SHARDCAST_EXPECT_UCX="$ucx_version" SHARDCAST_EXPECT_UCX_CUDA=1 \
      "$bundle/bin/transport_tests" "the UCX loaded is the one a run names" --reporter compact
  fi
  step "transport [gpu] and kernel geometry" 40 "$bundle/bin/transport_tests" "[gpu],[strided-copy]" --reporter compact
  step "daemon [gpu]: device buffers on both sides of a sync, cuMem allocations by descriptor, the fp8 kernel, the delta kernels" 90 "$bundle/bin/daemon_tests" "[gpu]" --reporter compact
  step "client [gpu]: CUDA pointers become IPC handles" 30 "$bundle/bin/client_tests" "[gpu]" --reporter compact
  step "device bench: kernel pack/unpack vs device copy, sync GB/s (staged: UCX over TCP)" 80 "$bundle/bin/device_bench" --mib "${DEVICE_MIB:-1024}" --syncs 5
  # Issue 51: 3 daemons (a relay chain), 1% of the rows changing per version, delta syncs
  # encoded and rebuilt on the GPUs against dense ones of the same versions, staged over TCP.
  step "device bench: delta syncs against dense, 3 daemons, deltas on the GPUs" 45 "$bundle/bin/device_bench" --sync-only --delta --daemons 3 --mib "${DEVICE_MIB:-1024}" --syncs 7 \
    --daemon-flag --delta-device-mib --daemon-flag 4096
  # Issue 51: trainer and 2 inference replicas on one daemon: device-to-device copies only, beside
  # the D2D bound of the first bench step.
  step "device bench: colocated sync, one daemon" 30 "$bundle/bin/device_bench" --sync-only --daemons 1 --mib "${DEVICE_MIB:-1024}" --syncs 5
  if [ -n "$ucx_version" ]; then
    # The same sync straight between GPUs: the daemons on one host put into each other's device
    # memory through cuda_ipc (plaintext daemons: put over a list with tcp needs --insecure), then a
    # relay chain of two destination nodes. Every byte checked; beside the rows above (D2D, PCIe).
    local ipc=(--daemon-flag --insecure --daemon-flag --ucx-tls --daemon-flag cuda_ipc,cuda_copy,tcp,self
      --daemon-flag --protocol --daemon-flag put)
    # The staged pipeline (D2H, send, land, H2D per chunk, one chunk behind) on a transport that is
    # not the bottleneck: shared memory and cma between the daemons, device memory staged
    # (--device-memory staged), beside the PCIe rate above.
    step "device bench: 2 daemons staged through shared memory" 40 "$bundle/bin/device_bench" --sync-only --mib "${DEVICE_MIB:-1024}" --syncs 4 \
      --daemon-flag --insecure --daemon-flag --ucx-tls --daemon-flag posix,sysv,cma,self --daemon-flag --protocol \
      --daemon-flag put --daemon-flag --device-memory --daemon-flag staged
    step "device bench: 2 daemons through cuda_ipc" 40 "$bundle/bin/device_bench" --sync-only --mib "${DEVICE_MIB:-1024}" --syncs 4 "${ipc[@]}"
    step "device bench: 3 daemons, a relay chain through cuda_ipc" 40 "$bundle/bin/device_bench" --sync-only --daemons 3 --mib "${DEVICE_MIB:-1024}" --syncs 4 "${ipc[@]}"
  fi
  # -s: the tests print torch's handle version and the GB/s of the FSDP2-style sync.
  step "python: torch's CUDA handles; a CUDA DTensor and ${SHARDCAST_GPU_SHARD_GIB} GiB of FSDP2-style shards synced into CUDA views; expandable segments synced; vLLM's direct path" 140 \
    "${PYTHON:-python3}" -m pytest -q -s -rs "$root/client/python/tests/test_cuda_handle.py" \
    "$root/client/python/tests/test_gpu.py" "$root/client/python/tests/test_vllm_direct.py"
  echo
  echo "device check: $failed step(s) failed; log in $log"
  return "$failed"
}
check 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
