"""Generated protobuf and gRPC stubs of shardcast.v1 (see scripts/gen_python_stubs.sh)."""
