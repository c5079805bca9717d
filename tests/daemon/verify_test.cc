// The verifier on its own (daemon/engine/verify.h): a checksum that differs, and a rank that does not
// hold what landed, each fail as DATA_LOSS naming the chunk or the rank and tensor; strided rank
// memory that holds the landed bytes passes. The syncs that use it are in sync_test.cc.
#include "daemon/engine/verify.h"

#include <xxhash.h>

#include <catch2/catch.hpp>
#include <numeric>

using namespace shardcast;
using namespace shardcast::daemon;

TEST_CASE("verify: a landed chunk's checksum against the announced one", "[daemon][verify]") {
  auto host = transport::makeHostCopyEngine();
  std::vector<std::byte> bytes(100, std::byte{7});
  auto sum = checksumOf(*host, nullptr, bytes.data(), transport::MemoryKind::kHost, bytes.size());
  REQUIRE(sum.ok());
  CHECK(*sum == XXH64(bytes.data(), bytes.size(), 0));
  const std::string sync = "s1", group = "infer", node = "n2";
  const VerifySite site{sync, group, node, 4, 9};
  CHECK(checkChecksum(*sum, *sum, site).ok());
  const Status bad = checkChecksum(*sum, *sum + 1, site);
  CHECK(bad.code() == absl::StatusCode::kDataLoss);
  CHECK(bad.message() == "sync s1: chunk 9 of transfer 4 arrived at node \"n2\" with a wrong checksum");
}

TEST_CASE("verify: what a rank holds in strided memory against the landed bytes", "[daemon][verify]") {
  auto host = transport::makeHostCopyEngine();
  // The landed chunk: a dense 2x3 box of int32. The rank holds it as the left half of a 2x6 row-major buffer.
  std::vector<int32_t> wire(6), rank(12, -1);
  std::iota(wire.begin(), wire.end(), 10);
  for (int r = 0; r < 2; ++r)
    for (int c = 0; c < 3; ++c) rank[static_cast<size_t>(r * 6 + c)] = wire[static_cast<size_t>(r * 3 + c)];
  HeldPiece p;
  p.held.view = {reinterpret_cast<std::byte*>(rank.data()), transport::MemoryKind::kHost, 0, {6, 1}};
  p.wire = {reinterpret_cast<std::byte*>(wire.data()), transport::MemoryKind::kHost, 0, {3, 1}};
  p.sizes = {2, 3};
  p.elem_bytes = 4;
  p.rank = 3;
  p.tensor = "layers.0.w";
  p.box = planner::Box::fromOffsetsSizes({0, 0}, {2, 3});
  const std::string sync = "s1", group = "infer", node = "n2";
  const VerifySite site{sync, group, node, 4, 9};
  CHECK(checkHeld(*host, {p}, site).ok());
  rank[7] = 0;  // a copy that went astray: row 1, column 1
  const Status bad = checkHeld(*host, {p}, site);
  CHECK(bad.code() == absl::StatusCode::kDataLoss);
  const std::string why(bad.message());
  CHECK(why.find("group \"infer\" rank 3 on node \"n2\" does not hold the bytes of tensor \"layers.0.w\"") !=
        std::string::npos);
  CHECK(why.find("(chunk 9 of transfer 4)") != std::string::npos);
  rank[7] = wire[4];
  rank[2] = 0;  // the last element of row 0, in the box too
  CHECK(!checkHeld(*host, {p}, site).ok());
  rank[2] = wire[2];
  rank[3] = 0;  // outside the box: not the rank's part of this chunk
  CHECK(checkHeld(*host, {p}, site).ok());
}
