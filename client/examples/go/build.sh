#!/usr/bin/env bash
# Builds the Go example client into OUT (default: build/go/shardcast-sync) with Debian's Go
# toolchain and packages only: stubs generated from proto/ with protoc-gen-go and
# protoc-gen-go-grpc, compiled in GOPATH mode against /usr/share/gocode (no module downloads).
#   client/examples/go/build.sh [OUT]
# Go's build cache lives in build/go/cache (kept between builds, so the tests' builds after the
# first one take a second; Go's cache is safe to share between concurrent builds).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
out="${1:-$root/build/go/shardcast-sync}"
work="$(dirname "$out")/gopath"
rm -rf "$work/src"
mkdir -p "$work/src/shardcast-sync"
map="Mshardcast/v1/layout.proto=shardcast/v1,Mshardcast/v1/service.proto=shardcast/v1"
protoc -I "$root/proto" --go_out="$work/src" --go_opt="$map" --go-grpc_out="$work/src" --go-grpc_opt="$map" \
  shardcast/v1/layout.proto shardcast/v1/service.proto
cp "$here/sync.go" "$work/src/shardcast-sync/"
cd "$work/src/shardcast-sync"
GOPATH="$work:/usr/share/gocode" GO111MODULE=off GOFLAGS= GOCACHE="$root/build/go/cache" GOPROXY=off \
  go build -o "$out" .
