// The headers most of Shardcast's translation units include and that cost the most to parse
// (about 4 s of a compile at -O2): precompiled once (shardcast_pch) and reused by every target
// that includes them. Nothing here is Shardcast's own: a change to one of our headers rebuilds
// no precompiled header.
#pragma once

#include <absl/status/status.h>
#include <absl/status/statusor.h>
#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include "shardcast/v1/layout.pb.h"
#include "shardcast/v1/service.grpc.pb.h"
#include "shardcast/v1/service.pb.h"
