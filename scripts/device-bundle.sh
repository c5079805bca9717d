#!/usr/bin/env bash
# Builds here what scripts/device-check.sh runs on a machine with a GPU, and packs it with its
# shared-library closure into .device-bundle/ (git-ignored; copy it to the GPU machine beside the
# checkout, docs/gpu.md, "The device check"). That machine has the CUDA driver, torch, grpcio and protobuf but no gRPC,
# UCX or spdlog libraries and no downloads, so the bundle holds:
#   bin/   one wrapper per program (sets LD_LIBRARY_PATH and UCX_MODULE_DIR to the bundle, then
#          runs the real program from bin/.real/), and shardcast-certs
#   lib/   every shared library the programs need but the C runtime (glibc >= 2.34 there) and
#          the CUDA driver (>= 580 for the CUDA 13 runtime); libstdc++ too, which only the
#          wrapped programs see; lib/ucx/ UCX's transport modules
# Everything stripped; fails when the bundle is over 50 MiB. Prints its size.
# Usage: scripts/device-bundle.sh [output directory]
set -euo pipefail
shopt -s nullglob
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/.device-bundle}"
programs=(shardcastd shardcast transport_tests daemon_tests client_tests transport_peer foreign_caller device_bench)
bash "$root/scripts/build.sh" "${programs[@]}" >/dev/null
rm -rf "$out"
mkdir -p "$out/bin/.real" "$out/lib/ucx"
for p in "${programs[@]}"; do
  install -m 0755 "$root/build/bin/$p" "$out/bin/.real/$p"
  strip --strip-unneeded "$out/bin/.real/$p"
  cat >"$out/bin/$p" <<WRAP
#!/bin/sh
# The bundled $p with the bundle's libraries (scripts/device-bundle.sh).
here=\$(cd "\$(dirname "\$0")" && pwd)
LD_LIBRARY_PATH="\$here/../lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" UCX_MODULE_DIR="\$here/../lib/ucx" exec "\$here/.real/$p" "\$@"
WRAP
  chmod 0755 "$out/bin/$p"
done
install -m 0755 "$root/build/bin/shardcast-certs" "$out/bin/shardcast-certs"
# UCX: NVIDIA's CUDA-aware build where scripts/deps.sh unpacked it (.ucx-cuda: its cuda_copy and
# cuda_ipc load on the GPU machine, whose driver brings libcuda and libnvidia-ml; its libucp.so.0
# replaces the system's the programs were built against, docs/transport.md "A CUDA-aware UCX"),
# else the system's with its transport modules (loaded at run time, not seen by ldd on the
# programs) whose own libraries are present here. lib/ucx/VERSION names the one carried.
cuda_ucx="$root/.ucx-cuda/libucx/lib"
if [ -e "$cuda_ucx/libucp.so.0" ]; then
  for l in libucp libuct libucs libucm libucs_signal; do cp -L "$cuda_ucx/$l.so.0" "$out/lib/"; done
  for m in "$cuda_ucx"/ucx/libuct_*.so.0 "$cuda_ucx"/ucx/libucm_*.so.0; do cp -L "$m" "$out/lib/ucx/"; done
  cat "$root/.ucx-cuda/.shardcast-stamp" >"$out/lib/ucx/VERSION"
else
  ucx_modules="$(dirname "$(readlink -f "$(ldconfig -p | awk '/libucp\.so\.0 / {print $NF; exit}')")")/ucx"
  for m in "$ucx_modules"/libuct_*.so.0; do
    [ -e "$m" ] || continue
    if ! ldd "$m" | grep -q "not found"; then cp -L "$m" "$out/lib/ucx/"; fi
  done
  : >"$out/lib/ucx/VERSION"
fi
# The closure: every library ldd resolves (the bundle's own first), but the ones the machine must
# bring itself.
skip='^(libc|libm|libdl|libpthread|librt|libresolv|ld-linux-x86-64|libcuda|libnvidia-ml)\.so'
{ LD_LIBRARY_PATH="$out/lib" ldd "$out"/bin/.real/* "$out"/lib/ucx/*.so.0 2>/dev/null || true; } |
  awk '/=> \// {print $3}' | sort -u | while read -r lib; do
    name="$(basename "$lib")"
    [[ "$name" =~ $skip ]] && continue
    [ "$lib" -ef "$out/lib/$name" ] && continue
    cp -L "$lib" "$out/lib/$name"
  done
find "$out/lib" -name '*.so*' -exec strip --strip-unneeded {} +
if missing="$(LD_LIBRARY_PATH="$out/lib" ldd "$out"/bin/.real/* | grep "not found")"; then
  echo "device bundle: unresolved libraries:" >&2
  echo "$missing" >&2
  exit 1
fi
bytes=$(du -sb "$out" | cut -f1)
echo "device bundle: $out, $(find "$out" -type f | wc -l) files, $((bytes / 1024 / 1024)) MiB ($bytes bytes)"
if [ "$bytes" -gt $((50 * 1024 * 1024)) ]; then
  echo "device bundle: over 50 MiB" >&2
  exit 1
fi
