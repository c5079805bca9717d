// cuMem allocations on a real GPU (what torch's expandable segments make), handed to daemons by
// file descriptor on their sockets' side channel: a source and a destination buffer, each across
// two allocations at an offset, synced between two daemons; every byte of both ranges checked.
#include <catch2/catch.hpp>
#include <cstring>
#include <vector>

#include "common/fd_passing.h"
#include "planner/layout.h"
#include "tests/daemon/daemon_harness.h"
#include "tests/support/device_buffer.h"
#include "tests/support/gpu.h"

using namespace shardcast;
using namespace shardcast::testing;

TEST_CASE("cuMem allocations handed over by descriptor sync byte-exact between daemons on a GPU",
          "[daemon][sync][gpu]") {
  SHARDCAST_SKIP_WITHOUT_GPU();
  const std::vector<int> ports = {freePort(), freePort()};
  const std::vector<std::string> peers = {"127.0.0.1:" + std::to_string(ports[0]),
                                          "127.0.0.1:" + std::to_string(ports[1])};
  Daemon n0("n0", ports[0], peers), n1("n1", ports[1], peers);
  REQUIRE(n0.ready());
  REQUIRE(n1.ready());
  auto src = allocateCuMem(2, 0);
  auto dst = allocateCuMem(2, 0);
  REQUIRE(src.ok());
  REQUIRE(dst.ok());
  const size_t whole = (*src)->size(), granularity = (*src)->allocationBytes();
  // The buffer: from a quarter of the first allocation, three quarters of the range long (both
  // allocations), 36 bytes off any alignment; int32 elements.
  const size_t offset = granularity / 4 + 36, bytes = (whole * 3 / 4) / 4 * 4;
  const size_t elements = bytes / 4;
  std::vector<int32_t> values(elements);
  for (size_t i = 0; i < elements; ++i) values[i] = static_cast<int32_t>(i * 2654435761u);
  std::vector<std::byte> src_host(whole, std::byte{0x5A}), dst_host(whole, std::byte{0xA5});
  std::memcpy(src_host.data() + offset, values.data(), bytes);
  REQUIRE(copyToDevice((*src)->data(), src_host.data(), whole).ok());
  REQUIRE(copyToDevice((*dst)->data(), dst_host.data(), whole).ok());
  const std::string layout_json = R"({"group":"G","mesh":{"shape":[1]},"nodes":["N"],"tensors":[
    {"name":"w","shape":[)" + std::to_string(elements) +
                                  R"(],"dtype":"int32","placements":[{"replicate":{}}]}]})";
  auto registerOn = [&](Daemon& d, const CuMemBuffer& mem, const std::string& group, const std::string& node,
                        bool source) {
    std::string json = layout_json;
    json.replace(json.find("\"G\""), 3, "\"" + group + "\"");
    json.replace(json.find("\"N\""), 3, "\"" + node + "\"");
    v1::RegisterRequest req;
    req.set_group(group);
    req.set_rank(0);
    req.set_world_size(1);
    *req.mutable_layout() = *planner::parseLayoutJson(json, group);
    if (source) {
      req.set_role(v1::ROLE_SOURCE);
      req.set_version(1);
    }
    auto fds = mem.exportFds();
    REQUIRE(fds.ok());
    std::vector<int> raw;
    for (const auto& f : *fds) raw.push_back(f.get());
    auto token = handOverFds(fdChannelPath(d.socketPath()), raw);
    INFO(token.status().message());
    REQUIRE(token.ok());
    auto* a = req.add_buffers();
    a->set_buffer("w");
    auto* c = a->mutable_cuda_allocations();
    c->set_token(*token);
    c->add_allocation_bytes(mem.allocationBytes());
    c->add_allocation_bytes(mem.allocationBytes());
    c->set_offset(offset);
    c->set_size(bytes);
    c->set_device(0);
    v1::RegisterResponse resp;
    const auto st = d.client()->Register(ctx().get(), req, &resp);
    INFO(st.error_message());
    REQUIRE(st.ok());
  };
  registerOn(n0, **src, "cumem-src", "n0", true);
  registerOn(n1, **dst, "cumem-dst", "n1", false);
  v1::SyncRequest sync;
  sync.set_src_group("cumem-src");
  sync.set_dst_group("cumem-dst");
  sync.set_version(1);
  sync.mutable_options()->set_verify(true);
  v1::SyncResponse out;
  const auto st = n0.client()->Sync(ctx(120).get(), sync, &out);
  INFO(st.error_message());
  REQUIRE(st.ok());
  std::vector<std::byte> got(whole);
  REQUIRE(copyFromDevice(got.data(), (*dst)->data(), whole).ok());
  size_t wrong = 0;
  for (size_t i = 0; i < whole; ++i) {
    const bool inside = i >= offset && i < offset + bytes;
    wrong += got[i] != (inside ? src_host[i] : std::byte{0xA5});
  }
  CHECK(wrong == 0);
}
