// The device path of whole daemons where there is no GPU: daemons run with --emulate-gpus
// (transport/emulated_gpus.h), ranks register their memory as CUDA buffers (shared-memory segments
// behind emulated IPC handles), and every device copy the daemons issue runs only once they wait
// for it. A send, unpack or commit that does not wait for its copies moves stale bytes, and the
// byte checks below fail.
#include <sys/mman.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <map>
#include <thread>
#include <utility>

#include "client/lib/client.h"
#include "common/fd_passing.h"
#include "common/strings.h"
#include "daemon/stage/convert.h"
#include "planner/layout.h"
#include "tests/daemon/daemon_harness.h"
#include "tests/daemon/in_process_node.h"
#include "tests/daemon/rank_memory.h"
#include "transport/emulated_gpus.h"

using namespace shardcast;
using namespace shardcast::testing;

namespace {

// Trainer: 4 ranks on n0, n0, n1, n1, row shards. Inference: dp=2 x tp=2, replica 0 on n2,
// replica 1 on n0 (colocated with trainer ranks); w in row shards, o in column shards (strided on
// the GPU: packed and unpacked by the kernel through scratch), m converted float32 -> bfloat16.
const char* kTrainer = R"({"group":"trainer","mesh":{"shape":[4]},"nodes":["n0","n0","n1","n1"],"tensors":[
  {"name":"w","shape":[4096,512],"dtype":"int32","placements":[{"shard":{"dim":0}}]},
  {"name":"o","shape":[512,4096],"dtype":"int32","placements":[{"shard":{"dim":0}}]},
  {"name":"m","shape":[64,256],"dtype":"float32","placements":[{"shard":{"dim":0}}]}]})";
const char* kInference = R"({"group":"infer","mesh":{"shape":[2,2]},"nodes":["n2","n2","n0","n0"],"tensors":[
  {"name":"w","shape":[4096,512],"dtype":"int32","placements":[{"replicate":{}},{"shard":{"dim":0}}]},
  {"name":"o","shape":[512,4096],"dtype":"int32","placements":[{"replicate":{}},{"shard":{"dim":1}}]},
  {"name":"m","shape":[64,256],"dtype":"bfloat16","placements":[{"replicate":{}},{"shard":{"dim":1}}]}]})";

// Element `flat` of tensor `t` at `version`; m's values are small integers, exact in bfloat16.
int32_t intValue(size_t t, int64_t flat, int version) { return static_cast<int32_t>(t * 100000 + flat * 10 + version); }
float floatValue(int64_t flat, int version) { return static_cast<float>((flat * 7 + version) % 200); }
uint16_t bf16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);  // exact: the value has at most 8 significant bits
}

// A rank's memory registered as device memory of GPU `gpu` of an emulated node.
v1::RegisterRequest onGpu(v1::RegisterRequest r, const RankMemory& m, int gpu) {
  for (auto& b : *r.mutable_buffers()) {
    const auto where = m.named.at(b.buffer());
    b.clear_shm();
    b.mutable_cuda()->set_handle(transport::EmulatedGpus::handleOf(m.seg->name()));
    b.mutable_cuda()->set_offset(where.first);
    b.mutable_cuda()->set_size(where.second);
    b.mutable_cuda()->set_device(gpu);
  }
  return r;
}

// A source group (every rank at version 1, on `from`) and a destination group (on `to`) of two
// layouts, registered; with `gpus`, each rank's memory is GPU `rank`'s of its emulated node.
struct GroupPair {
  planner::NodeTable nodes;
  planner::ResolvedLayout src, dst;
  std::vector<RankMemory> smem, dmem;

  GroupPair(const char* src_json, const char* dst_json, Daemon& from, Daemon& to, bool gpus, const std::string& tag) {
    const auto src_proto = *planner::parseLayoutJson(src_json, "source layout");
    const auto dst_proto = *planner::parseLayoutJson(dst_json, "destination layout");
    src = *planner::resolveLayout(src_proto, nodes);
    dst = *planner::resolveLayout(dst_proto, nodes);
    auto put = [&](Daemon& d, const v1::RegisterRequest& req, const RankMemory& m, int32_t r) {
      v1::RegisterResponse resp;
      const auto st = d.client()->Register(ctx().get(), gpus ? onGpu(req, m, r) : req, &resp);
      INFO(st.error_message());
      REQUIRE(st.ok());
    };
    for (int32_t r = 0; r < src.world(); ++r) {
      smem.push_back(allocateRank(src, r, tag + "s" + std::to_string(r)));
      forEachElement(src, r, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
        *smem[r].at<int32_t>(p, off) = intValue(t, flat, 1);
      });
      put(from, registerRequest(src_proto, r, src.world(), smem[r], v1::ROLE_SOURCE, 1), smem[r], r);
    }
    for (int32_t r = 0; r < dst.world(); ++r) {
      dmem.push_back(allocateRank(dst, r, tag + "d" + std::to_string(r)));
      put(to, registerRequest(dst_proto, r, dst.world(), dmem[r]), dmem[r], r);
    }
  }
  // Destination elements that do not hold version 1.
  int64_t wrong() {
    int64_t bad = 0;
    for (int32_t r = 0; r < dst.world(); ++r)
      forEachElement(dst, r, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
        bad += *dmem[r].at<int32_t>(p, off) != intValue(t, flat, 1);
      });
    return bad;
  }
};

}  // namespace

TEST_CASE(
    "emulated GPUs: device ranks on every side, single- and double-buffered, sync byte-exact through host "
    "staging, deltas too",
    "[daemon][sync][emulated-gpu]") {
  // Delta bases on the GPUs (their chunks encoded there, issue 51) or none (encoded on the host).
  const std::string device_mib = GENERATE(std::string("0"), std::string("64"));
  const bool on_gpus = device_mib != "0";
  INFO("--delta-device-mib " << device_mib);
  std::vector<int> ports;
  for (int i = 0; i < 3; ++i) ports.push_back(freePort());
  std::vector<std::string> peers;
  for (int p : ports) peers.push_back("127.0.0.1:" + std::to_string(p));
  std::vector<std::unique_ptr<Daemon>> daemons;
  for (int i = 0; i < 3; ++i) {
    // 1 MiB chunks and 2 MiB of staging: several chunks per transfer (sends one chunk behind
    // the packs) and several waves.
    daemons.push_back(
        std::make_unique<Daemon>("n" + std::to_string(i), ports[i], peers,
                                 std::vector<std::string>{"--emulate-gpus", "2", "--chunk-mib", "1", "--staging-mib",
                                                          "2", "--delta-device-mib", device_mib}));
    REQUIRE(daemons.back()->ready());
  }
  auto node = [&](const std::string& name) -> Daemon& { return *daemons[name[1] - '0']; };
  const auto src_proto = *planner::parseLayoutJson(kTrainer, "trainer");
  const auto dst_proto = *planner::parseLayoutJson(kInference, "infer");
  planner::NodeTable nodes;
  const auto src = *planner::resolveLayout(src_proto, nodes);
  const auto dst = *planner::resolveLayout(dst_proto, nodes);
  std::vector<RankMemory> smem, dmem;
  for (int32_t r = 0; r < 4; ++r) smem.push_back(allocateRank(src, r, "egpu-t" + device_mib + std::to_string(r)));
  for (int32_t r = 0; r < 4; ++r) dmem.push_back(allocateRank(dst, r, "egpu-i" + device_mib + std::to_string(r)));
  // The odd destination ranks are double-buffered (one beside a single-buffered rank on each
  // node): a delta into them is rebuilt from the set their engine reads into the other set.
  const auto doubled = [](int32_t r) { return r % 2 == 1; };
  std::map<int32_t, RankMemory> shadow;
  for (int32_t r = 1; r < 4; r += 2) shadow.emplace(r, allocateRank(dst, r, "egpu-b" + device_mib + std::to_string(r)));
  // The set rank r's engine reads: the one its last commit wrote.
  auto in_use = [&](int32_t r) -> RankMemory& {
    if (!doubled(r)) return dmem[r];
    v1::StatusResponse st;
    REQUIRE(node(nodes.name(dst.rank_node[r])).client()->Status(ctx().get(), v1::StatusRequest(), &st).ok());
    for (const auto& group : st.groups())
      for (const auto& rs : group.rank_states())
        if (group.group() == "infer" && rs.rank() == r) return rs.active_set() == 0 ? dmem[r] : shadow.at(r);
    FAIL("rank " << r << " of infer is not on its node");
    return dmem[r];
  };
  // Version v everywhere; with `some`, only every 16th element of w and o changes from v - 1.
  auto fill = [&](int version, bool some) {
    for (int32_t r = 0; r < 4; ++r)
      forEachElement(src, r, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
        if (src.tensors[t].name == "m")
          *smem[r].at<float>(p, off) = floatValue(flat, version);
        else if (!some || flat % 16 == 0)
          *smem[r].at<int32_t>(p, off) = intValue(t, flat, version);
      });
  };
  auto wrong = [&](int version, bool some) {
    int64_t bad = 0;
    for (int32_t r = 0; r < 4; ++r) {
      RankMemory& set = in_use(r);
      forEachElement(dst, r, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
        if (dst.tensors[t].name == "m") {
          bad += *set.at<uint16_t>(p, off) != bf16Bits(floatValue(flat, version));
        } else {
          const int v = some && flat % 16 != 0 ? version - 1 : version;
          bad += *set.at<int32_t>(p, off) != intValue(t, flat, v);
        }
      });
    }
    return bad;
  };
  fill(1, false);
  for (int32_t r = 0; r < 4; ++r) {
    v1::RegisterResponse resp;
    const auto st =
        node(nodes.name(src.rank_node[r]))
            .client()
            ->Register(ctx().get(),
                       onGpu(registerRequest(src_proto, r, 4, smem[r], v1::ROLE_SOURCE, 1), smem[r], r % 2), &resp);
    INFO(st.error_message());
    REQUIRE(st.ok());
  }
  for (int32_t r = 0; r < 4; ++r) {
    auto req = onGpu(registerRequest(dst_proto, r, 4, dmem[r]), dmem[r], r % 2);
    if (doubled(r))
      *req.mutable_shadow_buffers() =
          onGpu(registerRequest(dst_proto, r, 4, shadow.at(r)), shadow.at(r), r % 2).buffers();
    v1::RegisterResponse resp;
    const auto st = node(nodes.name(dst.rank_node[r])).client()->Register(ctx().get(), req, &resp);
    INFO(st.error_message());
    REQUIRE(st.ok());
  }
  auto sync = [&](int version, v1::DeltaMode delta) {
    v1::SyncRequest req;
    req.set_src_group("trainer");
    req.set_dst_group("infer");
    req.set_version(static_cast<uint64_t>(version));
    req.mutable_options()->set_verify(true);
    req.mutable_options()->set_delta(delta);
    v1::SyncResponse out;
    const auto st = node("n1").client()->Sync(ctx(120).get(), req, &out);
    INFO(st.error_message());
    REQUIRE(st.ok());
    return out;
  };
  // Publishes `version` on every source rank after writing it (acquired around the write).
  auto step = [&](int version, bool some) {
    for (int32_t r = 0; r < 4; ++r) {
      v1::AcquireRequest a;
      a.set_group("trainer");
      a.set_rank(r);
      v1::AcquireResponse ar;
      REQUIRE(node(nodes.name(src.rank_node[r])).client()->Acquire(ctx().get(), a, &ar).ok());
    }
    fill(version, some);
    for (int32_t r = 0; r < 4; ++r) {
      v1::ReleaseRequest p;
      p.set_group("trainer");
      p.set_rank(r);
      p.set_version(static_cast<uint64_t>(version));
      v1::ReleaseResponse pr;
      REQUIRE(node(nodes.name(src.rank_node[r])).client()->Release(ctx().get(), p, &pr).ok());
    }
  };

  const auto first = sync(1, v1::DELTA_OFF);
  CHECK(wrong(1, false) == 0);
  CHECK(first.waves() > 1);
  CHECK(first.bytes_landed_direct() == 0);  // staged device memory: planned packed, nothing lands in a rank directly
  CHECK(first.local_bytes() > 0);           // the colocated replica on n0, device to device
  step(2, false);
  CHECK(sync(2, v1::DELTA_AUTO).delta_chunks() == 0);  // no bases yet: dense, and the bases kept
  CHECK(wrong(2, false) == 0);
  step(3, true);
  const auto third = sync(3, v1::DELTA_AUTO);
  CHECK(wrong(3, true) == 0);
  // Rebuilt on the destinations from the bytes their GPUs hold: the double-buffered ranks' from
  // the set in use (version 2), written into the other (version 1 until now).
  CHECK(third.delta_chunks() > 0);
  CHECK(third.wire_bytes() < third.network_bytes());
  // w and o (int32, copied as they are) encoded on the source's GPU against bases kept there; m
  // (float32 -> bfloat16) on the host.
  CHECK((third.gpu_delta_chunks() > 0) == on_gpus);
  CHECK(third.gpu_delta_chunks() < third.delta_chunks());
  // Rebuilt on the destinations' GPUs where --delta-device-mib allows, from any source: the tree
  // hash lets a GPU check what it rebuilt.
  // Every delta landing: the two ranks of each node are on two GPUs, read and written from one.
  CHECK(third.gpu_rebuilt_chunks() == (on_gpus ? third.delta_chunks() : 0));
  CHECK(third.gpu_rebuilt_chunks() <= third.delta_chunks());
  // Everything changed: too much for a delta, dense (the GPU's bases hold it all the same) ...
  step(4, false);
  const auto fourth = sync(4, v1::DELTA_AUTO);
  CHECK(wrong(4, false) == 0);
  CHECK(fourth.gpu_delta_chunks() == 0);
  // ... and the next sparse step is a delta against it.
  step(5, true);
  const auto fifth = sync(5, v1::DELTA_AUTO);
  CHECK(wrong(5, true) == 0);
  CHECK((fifth.gpu_delta_chunks() > 0) == on_gpus);
  CHECK((fifth.gpu_rebuilt_chunks() > 0) == on_gpus);
}

TEST_CASE("emulated GPUs: a handle that names no segment of the caller is refused, naming the buffer",
          "[daemon][emulated-gpu]") {
  const int port = freePort();
  Daemon d("n0", port, {}, {"--emulate-gpus", "1"});
  REQUIRE(d.ready());
  const char* layout = R"({"group":"g","mesh":{"shape":[1]},"nodes":["n0"],"tensors":[
    {"name":"w","shape":[64],"dtype":"int32"}]})";
  const auto proto = *planner::parseLayoutJson(layout, "g");
  planner::NodeTable nodes;
  const auto l = *planner::resolveLayout(proto, nodes);
  auto mem = allocateRank(l, 0, "egpu-bad");
  auto req = onGpu(registerRequest(proto, 0, 1, mem), mem, 0);
  SECTION("no such segment") {
    req.mutable_buffers(0)->mutable_cuda()->set_handle(transport::EmulatedGpus::handleOf("/shardcast-no-such-one"));
    v1::RegisterResponse resp;
    const auto st = d.client()->Register(ctx().get(), req, &resp);
    CHECK(st.error_code() == grpc::StatusCode::NOT_FOUND);
    CHECK_THAT(st.error_message(), Catch::Contains("buffer \"w\""));
  }
  SECTION("not an emulated handle") {
    req.mutable_buffers(0)->mutable_cuda()->set_handle(std::string(64, '\x01'));
    v1::RegisterResponse resp;
    const auto st = d.client()->Register(ctx().get(), req, &resp);
    CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(st.error_message(), Catch::Contains("buffer \"w\""));
  }
  SECTION("a segment not named as Shardcast's") {
    auto other = transport::ShmSegment::create("/sc-egpu-other-" + std::to_string(::getpid()), 4096);
    REQUIRE(other.ok());
    req.mutable_buffers(0)->mutable_cuda()->set_handle(transport::EmulatedGpus::handleOf(other->name()));
    v1::RegisterResponse resp;
    const auto st = d.client()->Register(ctx().get(), req, &resp);
    CHECK(st.error_code() == grpc::StatusCode::PERMISSION_DENIED);
    CHECK_THAT(st.error_message(), Catch::Contains("named under /shardcast"));
  }
  SECTION("a GPU the node does not have") {
    req.mutable_buffers(0)->mutable_cuda()->set_device(1);
    v1::RegisterResponse resp;
    const auto st = d.client()->Register(ctx().get(), req, &resp);
    CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(st.error_message(), Catch::Contains("emulated GPU 1 of 1"));
  }
}

TEST_CASE("emulated GPUs: replicas on one node: a box crosses into the GPUs once, the others copy it GPU to GPU",
          "[daemon][sync][emulated-gpu]") {
  // Two replicas (dp=2 x tp=2) on n1's four GPUs, fed from n0: w (row shards from row shards:
  // each piece contiguous in its rank) lands once and fans out device to device; o (row shards
  // from column shards: each piece strided in its rank) comes from the host copy into every rank.
  const char* trainer = R"({"group":"trainer","mesh":{"shape":[2]},"nodes":["n0","n0"],"tensors":[
    {"name":"w","shape":[1024,256],"dtype":"int32","placements":[{"shard":{"dim":0}}]},
    {"name":"o","shape":[256,1024],"dtype":"int32","placements":[{"shard":{"dim":1}}]}]})";
  const char* inference = R"({"group":"infer","mesh":{"shape":[2,2]},"nodes":["n1","n1","n1","n1"],"tensors":[
    {"name":"w","shape":[1024,256],"dtype":"int32","placements":[{"replicate":{}},{"shard":{"dim":0}}]},
    {"name":"o","shape":[256,1024],"dtype":"int32","placements":[{"replicate":{}},{"shard":{"dim":0}}]}]})";
  std::vector<int> ports{freePort(), freePort()};
  const std::vector<std::string> peers{"127.0.0.1:" + std::to_string(ports[0]),
                                       "127.0.0.1:" + std::to_string(ports[1])};
  Daemon n0("n0", ports[0], peers, {"--emulate-gpus", "2", "--chunk-mib", "1", "--host-zero-copy", "on"});
  Daemon n1("n1", ports[1], peers, {"--emulate-gpus", "4", "--chunk-mib", "1", "--host-zero-copy", "on"});
  REQUIRE(n0.ready());
  REQUIRE(n1.ready());
  GroupPair device(trainer, inference, n0, n1, /*gpus=*/true, "egpu-f");
  v1::SyncRequest req;
  req.set_src_group("trainer");
  req.set_dst_group("infer");
  req.set_version(1);
  v1::SyncResponse out;
  const auto st = n0.client()->Sync(ctx(120).get(), req, &out);
  INFO(st.error_message());
  REQUIRE(st.ok());
  CHECK(device.wrong() == 0);
  CHECK(out.network_bytes() == 2 * (1024 * 256 * 4));   // each byte to n1 once
  CHECK(out.device_fanout_bytes() == 1024 * 256 * 4);   // all of w, for the second replica
  CHECK(out.local_bytes() == 2 * out.network_bytes());  // both replicas, from wire or GPU

  // Groups in host memory beside them are still synced zero-copy: only a sync of groups with
  // staged device memory is planned packed.
  // (w of 2 MiB: its 1 MiB row shards travel alone, not in a bucket, so they can land directly.)
  const char* htrainer = R"({"group":"htrainer","mesh":{"shape":[2]},"nodes":["n0","n0"],"tensors":[
    {"name":"w","shape":[2048,256],"dtype":"int32","placements":[{"shard":{"dim":0}}]}]})";
  const char* hinfer = R"({"group":"hinfer","mesh":{"shape":[2,2]},"nodes":["n1","n1","n1","n1"],"tensors":[
    {"name":"w","shape":[2048,256],"dtype":"int32","placements":[{"replicate":{}},{"shard":{"dim":0}}]}]})";
  GroupPair host(htrainer, hinfer, n0, n1, /*gpus=*/false, "egpu-h");
  req.set_src_group("htrainer");
  req.set_dst_group("hinfer");
  v1::SyncResponse host_out;
  REQUIRE(n0.client()->Sync(ctx(120).get(), req, &host_out).ok());
  CHECK(host_out.bytes_landed_direct() > 0);
  CHECK(host_out.device_fanout_bytes() == 0);
  CHECK(host.wrong() == 0);
}

TEST_CASE("emulated GPUs: block-scaled fp8 from device-resident bf16 is quantised by the GPU kernel, bit for bit",
          "[daemon][sync][emulated-gpu][fp8]") {
  // Trainer: w [256, 320] bf16 in row shards on n0's (emulated) GPUs: two of 128 rows, or three
  // of 86, 86 and 84 rows that cut blocks (their amaxes combined across the GPUs; the kernel
  // quantises a split block's part with the whole block's scale). Inference: fp8 e4m3 in 128 x 128
  // blocks, two column shards of 160 on n1's host memory (a block cut between the ranks:
  // quantised once, both get its scale). The bytes and scales must be the host quantiser's over
  // the whole tensor.
  const int world = GENERATE(2, 3);
  INFO("source world " << world);
  const std::vector<int> ports{freePort(), freePort()};
  const std::vector<std::string> peers{"127.0.0.1:" + std::to_string(ports[0]),
                                       "127.0.0.1:" + std::to_string(ports[1])};
  Daemon n0("n0", ports[0], peers, {"--emulate-gpus", std::to_string(world)});
  Daemon n1("n1", ports[1], peers, {});
  REQUIRE(n0.ready());
  REQUIRE(n1.ready());
  std::string src_nodes = R"("n0")";
  for (int r = 1; r < world; ++r) src_nodes += R"(,"n0")";
  const auto src_proto = *planner::parseLayoutJson(
      R"({"group":"trainer","mesh":{"shape":[)" + std::to_string(world) + R"(]},"nodes":[)" + src_nodes + R"(],
    "tensors":[{"name":"w","shape":[256,320],"dtype":"bfloat16","placements":[{"shard":{"dim":0}}]}]})",
      "trainer");
  const auto dst_proto = *planner::parseLayoutJson(R"({"group":"infer","mesh":{"shape":[2]},"nodes":["n1","n1"],
    "tensors":[{"name":"w","shape":[256,320],"dtype":"float8_e4m3fn","placements":[{"shard":{"dim":1}}],
                "block_scale":{"scale":"w_scale_inv"}}]})",
                                                   "infer");
  planner::NodeTable nodes;
  const auto src = *planner::resolveLayout(src_proto, nodes);
  const auto dst = *planner::resolveLayout(dst_proto, nodes);
  // The whole tensor, and the host quantiser's bytes and scales for it.
  std::vector<uint16_t> whole(256 * 320);
  for (size_t i = 0; i < whole.size(); ++i)
    whole[i] = bf16Bits(static_cast<float>(static_cast<int64_t>(i * 2654435761u % 2001) - 1000) / 64.0f);
  whole[5] = 0x7fc1;                        // a NaN: its block quantises to NaN (world 3: on the first of its two GPUs)
  whole[100 * 320 + 7] = bf16Bits(900.0f);  // world 3: block (0, 0)'s largest, on its second GPU
  planner::TensorLayout w;
  w.shape = {256, 320};
  w.dtype = planner::DType::kFloat8E4M3;
  w.block = {128, 128};
  planner::Box all;
  all.ndim = 2;
  all.hi = {256, 320};
  std::vector<uint8_t> want(whole.size());
  const std::vector<int64_t> strides{320, 1};
  REQUIRE(daemon::quantizeBox({reinterpret_cast<std::byte*>(want.data()), transport::MemoryKind::kHost, 0, strides},
                              {reinterpret_cast<std::byte*>(whole.data()), transport::MemoryKind::kHost, 0, strides},
                              planner::DType::kBFloat16, all, w)
              .ok());
  planner::TensorLayout s;
  s.dtype = planner::DType::kFloat32;
  s.block = w.block;
  s.scale_of = 0;
  s.scaled_shape = w.shape;
  planner::Box blocks;
  blocks.ndim = 2;
  blocks.hi = {2, 3};
  std::vector<float> want_scales(6);
  REQUIRE(
      daemon::scaleBox({reinterpret_cast<std::byte*>(want_scales.data()), transport::MemoryKind::kHost, 0, {3, 1}},
                       {reinterpret_cast<std::byte*>(whole.data()), transport::MemoryKind::kHost, 0, {320 * 128, 128}},
                       planner::DType::kBFloat16, blocks, s)
          .ok());
  std::vector<RankMemory> smem, dmem;
  for (int32_t r = 0; r < world; ++r) {
    smem.push_back(allocateRank(src, r, "efp8-t" + std::to_string(r)));
    forEachElement(src, r, [&](size_t, const planner::PieceRef& p, int64_t off, int64_t flat) {
      *smem[r].at<uint16_t>(p, off) = whole[static_cast<size_t>(flat)];
    });
    v1::RegisterResponse resp;
    REQUIRE(n0.client()
                ->Register(ctx().get(),
                           onGpu(registerRequest(src_proto, r, world, smem[r], v1::ROLE_SOURCE, 1), smem[r], r), &resp)
                .ok());
  }
  for (int32_t r = 0; r < 2; ++r) {
    v1::RegisterResponse resp;
    dmem.push_back(allocateRank(dst, r, "efp8-i" + std::to_string(r)));
    REQUIRE(n1.client()->Register(ctx().get(), registerRequest(dst_proto, r, 2, dmem[r]), &resp).ok());
  }
  v1::SyncRequest req;
  req.set_src_group("trainer");
  req.set_dst_group("infer");
  req.set_version(1);
  v1::SyncResponse out;
  const auto st = n0.client()->Sync(ctx(120).get(), req, &out);
  INFO(st.error_message());
  REQUIRE(st.ok());
  int64_t wrong = 0, checked = 0, scales = 0;
  for (int32_t r = 0; r < 2; ++r)
    forEachElement(dst, r, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
      ++checked;
      if (dst.tensors[t].name == "w") {
        wrong += *dmem[r].at<uint8_t>(p, off) != want[static_cast<size_t>(flat)];
      } else {
        ++scales;
        wrong += std::memcmp(dmem[r].at<float>(p, off), &want_scales[static_cast<size_t>(flat)], 4) != 0;
      }
    });
  CHECK(checked == 256 * 320 + 8);  // every weight, and each rank's 2 x 2 block scales
  CHECK(scales == 8);
  CHECK(wrong == 0);
}

namespace {

// A rank's memory as cuMem allocations of an emulated GPU: `count` memfds of `kAllocation` bytes
// each standing in for the physical allocations, mapped one after another here (as an allocator
// maps them into one reserved range), the rank's buffers laid out in them as allocateRank does.
// A buffer is handed over as the allocations it touches, like torch's expandable segments.
constexpr uint64_t kAllocation = 16384;

struct AllocationRank {
  std::vector<OwnedFd> fds;
  std::byte* base = nullptr;
  uint64_t bytes = 0;
  std::map<int32_t, uint64_t> offset;
  std::map<std::string, std::pair<uint64_t, uint64_t>> named;

  AllocationRank(const planner::ResolvedLayout& l, int32_t rank) {
    uint64_t off = 0;
    for (const auto& [buffer, n] : l.rankBuffers(rank)) {
      offset[buffer] = off;
      named[l.buffer_names[buffer]] = {off, static_cast<uint64_t>(n)};
      off += (static_cast<uint64_t>(n) + 63) / 64 * 64;
    }
    const uint64_t count = std::max<uint64_t>(1, (off + kAllocation - 1) / kAllocation);
    bytes = count * kAllocation;
    void* p = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(p != MAP_FAILED);
    base = static_cast<std::byte*>(p);
    for (uint64_t i = 0; i < count; ++i) {
      fds.emplace_back(::memfd_create("shardcast-test-allocation", MFD_CLOEXEC));
      REQUIRE(fds.back().get() >= 0);
      REQUIRE(::ftruncate(fds.back().get(), kAllocation) == 0);
      REQUIRE(::mmap(base + i * kAllocation, kAllocation, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                     fds.back().get(), 0) != MAP_FAILED);
    }
  }
  ~AllocationRank() { ::munmap(base, bytes); }
  AllocationRank(AllocationRank&& o) noexcept
      : fds(std::move(o.fds)),
        base(std::exchange(o.base, nullptr)),
        bytes(std::exchange(o.bytes, 0)),
        offset(std::move(o.offset)),
        named(std::move(o.named)) {}

  template <typename T>
  T* at(const planner::PieceRef& p, int64_t element) {
    return reinterpret_cast<T*>(base + offset.at(p.buffer)) + element;
  }
  // Whether some buffer spans more than one allocation.
  bool spans() const {
    for (const auto& [name, where] : named)
      if (where.first / kAllocation != (where.first + where.second - 1) / kAllocation) return true;
    return false;
  }
  // The rank's Register request with each buffer's allocations handed to `d`'s descriptor channel.
  v1::RegisterRequest request(const Daemon& d, const v1::Layout& layout, int32_t rank, int32_t world, v1::Role role,
                              uint64_t version, int gpu) const {
    v1::RegisterRequest r;
    r.set_role(role);
    r.set_version(version);
    r.set_group(layout.group());
    r.set_rank(rank);
    r.set_world_size(world);
    *r.mutable_layout() = layout;
    for (const auto& [name, where] : named) {
      const uint64_t first = where.first / kAllocation, last = (where.first + where.second - 1) / kAllocation;
      std::vector<int> handed;
      for (uint64_t i = first; i <= last; ++i) handed.push_back(fds[i].get());
      auto token = handOverFds(fdChannelPath(d.socketPath()), handed);
      REQUIRE(token.ok());
      auto* a = r.add_buffers();
      a->set_buffer(name);
      auto* c = a->mutable_cuda_allocations();
      c->set_token(*token);
      for (uint64_t i = first; i <= last; ++i) c->add_allocation_bytes(kAllocation);
      c->set_offset(where.first - first * kAllocation);
      c->set_size(where.second);
      c->set_device(gpu);
    }
    return r;
  }
};

// Trainer: 2 ranks on n0, row shards; inference: 2 ranks on n1, o in column shards (strided on the
// GPU). Each rank's buffers span several 16 KiB allocations, some buffers two or more.
const char* kAllocTrainer = R"({"group":"trainer","mesh":{"shape":[2]},"nodes":["n0","n0"],"tensors":[
  {"name":"w","shape":[96,100],"dtype":"int32","placements":[{"shard":{"dim":0}}]},
  {"name":"o","shape":[64,96],"dtype":"int32","placements":[{"shard":{"dim":0}}]}]})";
const char* kAllocInference = R"({"group":"infer","mesh":{"shape":[2]},"nodes":["n1","n1"],"tensors":[
  {"name":"w","shape":[96,100],"dtype":"int32","placements":[{"shard":{"dim":0}}]},
  {"name":"o","shape":[64,96],"dtype":"int32","placements":[{"shard":{"dim":1}}]}]})";

}  // namespace

TEST_CASE("emulated GPUs: cuMem allocations handed over by descriptor sync byte-exact, again after a restart",
          "[daemon][sync][emulated-gpu]") {
  const std::vector<int> ports = {freePort(), freePort()};
  const std::vector<std::string> peers = {"127.0.0.1:" + std::to_string(ports[0]),
                                          "127.0.0.1:" + std::to_string(ports[1])};
  const std::vector<std::string> flags = {"--emulate-gpus", "2"};
  auto n0 = std::make_unique<Daemon>("n0", ports[0], peers, flags);
  auto n1 = std::make_unique<Daemon>("n1", ports[1], peers, flags);
  REQUIRE(n0->ready());
  REQUIRE(n1->ready());
  const auto src_proto = *planner::parseLayoutJson(kAllocTrainer, "trainer");
  const auto dst_proto = *planner::parseLayoutJson(kAllocInference, "infer");
  planner::NodeTable nodes;
  const auto src = *planner::resolveLayout(src_proto, nodes);
  const auto dst = *planner::resolveLayout(dst_proto, nodes);
  std::vector<AllocationRank> smem, dmem;
  for (int32_t r = 0; r < 2; ++r) smem.emplace_back(src, r);
  for (int32_t r = 0; r < 2; ++r) dmem.emplace_back(dst, r);
  CHECK(smem[0].spans());
  CHECK(dmem[0].spans());
  for (int32_t r = 0; r < 2; ++r)
    forEachElement(src, r, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
      *smem[r].at<int32_t>(p, off) = intValue(t, flat, 1);
    });
  auto put = [](Daemon& d, const v1::RegisterRequest& req) {
    v1::RegisterResponse resp;
    const auto st = d.client()->Register(ctx().get(), req, &resp);
    INFO(st.error_message());
    REQUIRE(st.ok());
  };
  for (int32_t r = 0; r < 2; ++r) put(*n0, smem[r].request(*n0, src_proto, r, 2, v1::ROLE_SOURCE, 1, r));
  auto registerDestinations = [&] {
    for (int32_t r = 0; r < 2; ++r) put(*n1, dmem[r].request(*n1, dst_proto, r, 2, v1::ROLE_DESTINATION, 0, r));
  };
  registerDestinations();
  auto wrong = [&] {
    int64_t bad = 0;
    for (int32_t r = 0; r < 2; ++r)
      forEachElement(dst, r, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
        bad += *dmem[r].at<int32_t>(p, off) != intValue(t, flat, 1);
      });
    return bad;
  };
  auto sync = [&] {
    v1::SyncRequest req;
    req.set_src_group("trainer");
    req.set_dst_group("infer");
    req.set_version(1);
    req.mutable_options()->set_verify(true);
    v1::SyncResponse out;
    const auto st = n0->client()->Sync(ctx(120).get(), req, &out);
    INFO(st.error_message());
    REQUIRE(st.ok());
  };
  sync();
  CHECK(wrong() == 0);

  // The destination's daemon restarts: its mappings are gone, and the ranks register again with
  // their allocations handed over anew (a token is good for one registration of one daemon).
  n1.reset();
  for (auto& m : dmem) std::memset(m.base, 0, m.bytes);
  n1 = std::make_unique<Daemon>("n1", ports[1], peers, flags);
  REQUIRE(n1->ready());
  registerDestinations();
  sync();
  CHECK(wrong() == 0);
}

TEST_CASE("emulated GPUs: handed-over cuMem allocations are refused when they do not hold the registered bytes",
          "[daemon][emulated-gpu]") {
  const char* layout = R"({"group":"g","mesh":{"shape":[1]},"nodes":["n0"],"tensors":[
    {"name":"w","shape":[2048],"dtype":"int32"}]})";
  const auto proto = *planner::parseLayoutJson(layout, "g");
  planner::NodeTable nodes;
  const auto l = *planner::resolveLayout(proto, nodes);
  AllocationRank mem(l, 0);  // w: 8192 bytes at 0 of one 16 KiB allocation
  auto refused = [](Daemon& d, const v1::RegisterRequest& req, grpc::StatusCode code, const std::string& why,
                    bool tcp = false) {
    v1::RegisterResponse resp;
    const auto st = (tcp ? d.tcpClient() : d.client())->Register(ctx().get(), req, &resp);
    INFO(st.error_message());
    CHECK(st.error_code() == code);
    CHECK_THAT(st.error_message(), Catch::Contains("buffer \"w\"") && Catch::Contains(why));
  };
  SECTION("on the socket") {
    Daemon d("n0", freePort(), {}, {"--emulate-gpus", "1"});
    REQUIRE(d.ready());
    auto req = mem.request(d, proto, 0, 1, v1::ROLE_DESTINATION, 0, 0);
    auto* a = req.mutable_buffers(0)->mutable_cuda_allocations();
    SECTION("an allocation smaller than its registered size") {
      OwnedFd small(::memfd_create("shardcast-test-small", MFD_CLOEXEC));
      REQUIRE(::ftruncate(small.get(), kAllocation / 2) == 0);
      a->set_token(*handOverFds(fdChannelPath(d.socketPath()), {small.get()}));
      refused(d, req, grpc::StatusCode::INVALID_ARGUMENT, "fewer than the 16384 it is registered with");
    }
    SECTION("bytes outside the allocations") {
      a->set_offset(kAllocation - 4096);  // 8192 bytes from 12 KiB: past the 16 KiB allocation
      refused(d, req, grpc::StatusCode::INVALID_ARGUMENT, "lie outside its 1 allocation(s) of 16384 bytes");
    }
    SECTION("a size that is not a multiple of the granularity") {
      a->set_allocation_bytes(0, kAllocation - 100);
      refused(d, req, grpc::StatusCode::INVALID_ARGUMENT, "not a multiple of the allocation granularity");
    }
    SECTION("more sizes than descriptors") {
      a->add_allocation_bytes(kAllocation);
      refused(d, req, grpc::StatusCode::INVALID_ARGUMENT, "1 descriptors were handed over for 2 allocation sizes");
    }
    SECTION("a token used already") {
      v1::RegisterResponse resp;
      REQUIRE(d.client()->Register(ctx().get(), req, &resp).ok());
      v1::UnregisterRequest u;
      u.set_group("g");
      u.set_rank(0);
      v1::UnregisterResponse ur;
      REQUIRE(d.client()->Unregister(ctx().get(), u, &ur).ok());
      refused(d, req, grpc::StatusCode::NOT_FOUND, "was used already");
    }
    SECTION("a token no channel gave") {
      a->set_token("00112233445566778899aabbccddeeff");
      refused(d, req, grpc::StatusCode::NOT_FOUND, "is not one this daemon's descriptor channel gave out");
    }
    SECTION("a GPU the node does not have") {
      a->set_device(3);
      refused(d, req, grpc::StatusCode::INVALID_ARGUMENT, "emulated GPU 3 of 1");
    }
  }
  SECTION("over TCP, by name") {
    Daemon d("n0", freePort(), {}, {"--emulate-gpus", "1", "--insecure"});
    REQUIRE(d.ready());
    auto req = mem.request(d, proto, 0, 1, v1::ROLE_DESTINATION, 0, 0);
    refused(d, req, grpc::StatusCode::INVALID_ARGUMENT, "register only over the daemon's Unix socket, not over TCP",
            /*tcp=*/true);
  }
}

TEST_CASE(
    "emulated GPUs: the C++ client registers cuMem allocations and its session hands them over again after a "
    "restart",
    "[daemon][emulated-gpu]") {
  const int port = freePort();
  auto d =
      std::make_unique<Daemon>("n0", port, std::vector<std::string>{}, std::vector<std::string>{"--emulate-gpus", "1"});
  REQUIRE(d->ready());
  const char* layout = R"({"group":"cg","mesh":{"shape":[1]},"nodes":["n0"],"tensors":[
    {"name":"w","shape":[6000],"dtype":"int32"}]})";
  const auto proto = *planner::parseLayoutJson(layout, "cg");
  planner::NodeTable nodes;
  AllocationRank mem(*planner::resolveLayout(proto, nodes), 0);  // w: 24000 bytes across two allocations
  REQUIRE(mem.spans());
  auto client = Client::connect("unix:" + d->socketPath());
  REQUIRE(client.ok());
  REQUIRE(client->startSession().ok());
  CuMemTensor t;
  t.name = "w";
  for (const auto& fd : mem.fds) t.fds.push_back(fd.get());
  t.allocation_bytes.assign(mem.fds.size(), kAllocation);
  t.bytes = 6000 * 4;
  auto h = client->cuMemHandle(t);
  INFO(h.status().message());
  REQUIRE(h.ok());
  REQUIRE(client->registerRank(proto, 0, std::vector<v1::MemoryHandle>{*h}, RegisterOptions::source(3)).ok());
  auto readyAt = [&](uint64_t version) {
    v1::ListResponse l;
    if (!d->client()->List(ctx().get(), v1::ListRequest(), &l).ok()) return false;
    for (const auto& r : l.ranks())
      if (r.group() == "cg" && r.state() == v1::RANK_READY && r.version() == version) return true;
    return false;
  };
  CHECK(readyAt(3));
  d->kill();
  d = std::make_unique<Daemon>("n0", port, std::vector<std::string>{}, std::vector<std::string>{"--emulate-gpus", "1"});
  REQUIRE(d->ready());
  bool back = false;
  for (int i = 0; i < 100 && !back; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    back = client->reconnects() == 1 && readyAt(3);
  }
  CHECK(back);
  CHECK(client->checkSession().ok());
  CHECK(client->unregisterRank("cg", 0).ok());
}

TEST_CASE(
    "emulated GPUs: a handed-over allocation its owner shrinks fails the sync naming the rank, the daemon stays up",
    "[daemon][emulated-gpu]") {
  const int port = freePort();
  Daemon d("n0", port, {}, {"--emulate-gpus", "1"});
  REQUIRE(d.ready());
  const char* src_json = R"({"group":"ts","mesh":{"shape":[1]},"nodes":["n0"],"tensors":[
    {"name":"w","shape":[6000],"dtype":"int32"}]})";
  const char* dst_json = R"({"group":"td","mesh":{"shape":[1]},"nodes":["n0"],"tensors":[
    {"name":"w","shape":[6000],"dtype":"int32"}]})";
  const auto src_proto = *planner::parseLayoutJson(src_json, "ts");
  const auto dst_proto = *planner::parseLayoutJson(dst_json, "td");
  planner::NodeTable nodes;
  AllocationRank src(*planner::resolveLayout(src_proto, nodes), 0), dst(*planner::resolveLayout(dst_proto, nodes), 0);
  v1::RegisterResponse resp;
  REQUIRE(d.client()->Register(ctx().get(), src.request(d, src_proto, 0, 1, v1::ROLE_SOURCE, 1, 0), &resp).ok());
  REQUIRE(d.client()->Register(ctx().get(), dst.request(d, dst_proto, 0, 1, v1::ROLE_DESTINATION, 0, 0), &resp).ok());
  REQUIRE(::ftruncate(dst.fds[1].get(), 0) == 0);  // the owner frees the second allocation
  v1::SyncRequest sync;
  sync.set_src_group("ts");
  sync.set_dst_group("td");
  sync.set_version(1);
  v1::SyncResponse out;
  const auto st = d.client()->Sync(ctx(60).get(), sync, &out);
  CHECK_FALSE(st.ok());
  CHECK_THAT(st.error_message(), Catch::Contains("rank 0") && Catch::Contains("emulated cuMem allocation 1 was "
                                                                              "truncated to 0 bytes"));
  v1::StatusResponse s;
  CHECK(d.client()->Status(ctx().get(), v1::StatusRequest(), &s).ok());  // still serving
}

TEST_CASE(
    "emulated GPUs the transport reaches: device memory registered directly, written without staging, and a GPU "
    "it cannot reach falls back alone",
    "[daemon][sync][emulated-gpu][device-reach]") {
  // The direct path a CUDA-aware UCX takes (issue 50), decided without a GPU: with
  // --emulate-gpu-reach the transport registers the emulated GPUs' memory itself, so device ranks
  // are read and written in place (zero copy, no staging) and every byte is verified; where it
  // reaches only some GPUs, the buffers of the others are staged one by one (named in Describe
  // and in the log) and the syncs through them are planned packed, byte-exact all the same. With
  // --device-memory staged every buffer is staged though the transport reaches them all.
  const char* trainer = R"({"group":"trainer","mesh":{"shape":[2]},"nodes":["n0","n0"],"tensors":[
    {"name":"w","shape":[2048,256],"dtype":"int32","placements":[{"shard":{"dim":0}}]}]})";
  const char* inference = R"({"group":"infer","mesh":{"shape":[2,2]},"nodes":["n1","n1","n1","n1"],"tensors":[
    {"name":"w","shape":[2048,256],"dtype":"int32","placements":[{"replicate":{}},{"shard":{"dim":0}}]}]})";
  const std::string reach_on_n1 = GENERATE(std::string("all"), std::string("0,1"), std::string("all, staged"));
  INFO("n1 reaches GPUs " << reach_on_n1);
  const bool forced = reach_on_n1 == "all, staged";  // --device-memory staged
  std::vector<int> ports{freePort(), freePort()};
  const std::vector<std::string> peers{"127.0.0.1:" + std::to_string(ports[0]),
                                       "127.0.0.1:" + std::to_string(ports[1])};
  Daemon n0("n0", ports[0], peers,
            {"--emulate-gpus", "2", "--emulate-gpu-reach", "all", "--chunk-mib", "1", "--host-zero-copy", "on"});
  Daemon n1("n1", ports[1], peers,
            {"--emulate-gpus", "4", "--emulate-gpu-reach", forced ? "all" : reach_on_n1, "--chunk-mib", "1",
             "--host-zero-copy", "on", "--device-memory", forced ? "staged" : "auto"});
  REQUIRE(n0.ready());
  REQUIRE(n1.ready());
  GroupPair device(trainer, inference, n0, n1, /*gpus=*/true,
                   "egpu-reach-" + reach_on_n1.substr(0, 1) + (forced ? "-staged" : ""));
  v1::DescribeResponse described;
  REQUIRE(n1.peer()->Describe(ctx().get(), v1::DescribeRequest(), &described).ok());
  std::map<int32_t, bool> staged;  // destination rank (= its GPU) -> its buffer staged
  for (const auto& r : described.ranks())
    for (const auto& b : r.buffers()) staged[r.rank()] = b.staged();
  const bool all = reach_on_n1 == "all";
  CHECK(staged == std::map<int32_t, bool>{{0, forced}, {1, forced}, {2, !all}, {3, !all}});
  v1::StatusResponse status;
  REQUIRE(n1.client()->Status(ctx().get(), v1::StatusRequest(), &status).ok());
  CHECK((status.transport().find("(--device-memory staged)") != std::string::npos) == forced);

  v1::SyncRequest req;
  req.set_src_group("trainer");
  req.set_dst_group("infer");
  req.set_version(1);
  req.mutable_options()->set_verify(true);
  v1::SyncResponse out;
  const auto st = n0.client()->Sync(ctx(120).get(), req, &out);
  INFO(st.error_message());
  REQUIRE(st.ok());
  CHECK(device.wrong() == 0);
  CHECK(out.network_bytes() == 2048 * 256 * 4);  // each byte to n1 once
  if (all)
    CHECK(out.bytes_landed_direct() > 0);  // written into device memory in place: nothing staged
  else
    CHECK(out.bytes_landed_direct() == 0);  // a staged buffer in the sync: planned packed
}

TEST_CASE("emulated GPUs: a client names its GPU by UUID, and the daemon finds it under its own number",
          "[daemon][emulated-gpu]") {
  // A container given only the node's GPU 1 calls it device 0; the daemon sees every GPU.
  transport::EmulatedGpus gpus(2);
  const auto context = InProcessNode::makeContext("n0");
  daemon::Registry registry("n0", *context, gpus);
  const daemon::MemoryCaller root{0, true, true};
  const auto proto = *planner::parseLayoutJson(R"({"group":"g","mesh":{"shape":[1]},"nodes":["n0"],"tensors":[
    {"name":"w","shape":[64],"dtype":"int32"}]})",
                                               "g");
  planner::NodeTable nodes;
  const auto l = *planner::resolveLayout(proto, nodes);
  auto mem = allocateRank(l, 0, "egpu-uuid");
  auto req = onGpu(registerRequest(proto, 0, 1, mem), mem, 0);
  auto* cuda = req.mutable_buffers(0)->mutable_cuda();
  SECTION("named by UUID: the daemon's GPU with it") {
    cuda->set_device_uuid(transport::EmulatedGpus::uuidOf(1));
    const auto registered = registry.registerRank(req, root);
    INFO((registered.ok() ? "" : std::string(registered.status().message())));
    REQUIRE(registered.ok());
    const auto b = registry.localBuffer("g", 0, "w");
    REQUIRE(b.ok());
    CHECK(b->gpu == 1);
  }
  SECTION("without a UUID: the client's number, taken as the daemon's") {
    REQUIRE(registry.registerRank(req, root).ok());
    const auto b = registry.localBuffer("g", 0, "w");
    REQUIRE(b.ok());
    CHECK(b->gpu == 0);
  }
  SECTION("a UUID none of the node's GPUs has is refused, naming the GPUs it has") {
    cuda->set_device_uuid(transport::EmulatedGpus::uuidOf(7));
    const auto refused = registry.registerRank(req, root);
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
    const std::string why(refused.status().message());
    CHECK_THAT(why, Catch::Contains("buffer \"w\""));
    CHECK_THAT(why, Catch::Contains(strCat("the client's device 0, ",
                                           transport::gpuUuidText(transport::EmulatedGpus::uuidOf(7)),
                                           ") is none of this daemon's 2 GPUs")));
    CHECK_THAT(why, Catch::Contains(strCat("1: ", transport::gpuUuidText(transport::EmulatedGpus::uuidOf(1)))));
  }
  SECTION("a UUID that is not 16 bytes is refused") {
    cuda->set_device_uuid("GPU-");
    const auto refused = registry.registerRank(req, root);
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(refused.status().message()), Catch::Contains("GPU UUID of 4 bytes"));
  }
}

TEST_CASE("GPU UUIDs read as nvidia-smi prints them", "[daemon][emulated-gpu]") {
  CHECK(transport::gpuUuidText(std::string("\x01\x23\x45\x67\x89\xab\xcd\xef\x00\x11\x22\x33\x44\x55\x66\x77", 16)) ==
        "GPU-01234567-89ab-cdef-0011-223344556677");
  CHECK(transport::gpuUuidText("ab") == "6162");
}
