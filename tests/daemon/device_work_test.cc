// What a sync does around device copies that run on after they are issued
// (daemon/engine/device_work.h), and the stage's device moves, on an emulated GPU stream
// (transport/emulated_gpus.h: copies run only once waited for).
#include "daemon/engine/device_work.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <vector>

#include "daemon/stage/stage.h"
#include "transport/device_copy.h"
#include "transport/emulated_gpus.h"

using namespace shardcast;
using namespace shardcast::daemon;
using transport::MemoryKind;

namespace {

// Issues a copy of `n` bytes from device memory to `dst` on `engine`.
void issue(transport::CopyEngine& engine, std::byte* dst, std::byte* device, size_t n) {
  REQUIRE(
      engine.copy({dst, MemoryKind::kHost, 0, {1}}, {device, MemoryKind::kCuda, 0, {1}}, {static_cast<int64_t>(n)}, 1)
          .ok());
}

}  // namespace

TEST_CASE("a chunk's follow-up runs once its device copies are done, one chunk behind", "[daemon][device-work]") {
  transport::EmulatedGpus gpu(1);
  auto engine = transport::makeStreamCopyEngine(gpu.stream(0));
  constexpr size_t kChunk = 1024;
  std::byte* device = gpu.allocate(0, 4 * kChunk);
  for (size_t i = 0; i < 4 * kChunk; ++i) device[i] = static_cast<std::byte>(i / kChunk + 1);
  std::vector<std::byte> wire(4 * kChunk, std::byte{0});
  std::vector<int> sent;  // chunks, in the order their follow-ups ran, each checked complete
  DeviceWork work;
  auto follow = [&](int k) {
    return [&, k]() -> Status {
      for (size_t i = 0; i < kChunk; ++i)
        if (wire[k * kChunk + i] != static_cast<std::byte>(k + 1))
          return absl::DataLossError("a follow-up ran before its chunk was copied");
      sent.push_back(k);
      return absl::OkStatus();
    };
  };
  for (int k = 0; k < 4; ++k) {
    issue(*work.use(engine.get()), wire.data() + k * kChunk, device + k * kChunk, kChunk);
    REQUIRE(work.whenCopied(follow(k)).ok());
    // Chunk k waits (the GPU copies it while k-1 is sent); k-1 has been sent.
    CHECK(sent.size() == static_cast<size_t>(k));
  }
  REQUIRE(work.flush().ok());
  CHECK(sent == std::vector<int>{0, 1, 2, 3});
  REQUIRE(work.settle().ok());
  CHECK(gpu.queued() == 0);
}

TEST_CASE("without device copies a follow-up runs at once, and its error is the caller's", "[daemon][device-work]") {
  DeviceWork work;
  CHECK(work.use(nullptr) == nullptr);
  int ran = 0;
  REQUIRE(work.whenCopied([&] {
                ++ran;
                return absl::OkStatus();
              })
              .ok());
  CHECK(ran == 1);
  const Status st = work.whenCopied([] { return absl::DataLossError("wrong bytes"); });
  CHECK(st.code() == absl::StatusCode::kDataLoss);
  CHECK(work.settle().ok());
}

TEST_CASE("settling waits for every engine used, and a failed execution's follow-up never runs",
          "[daemon][device-work]") {
  transport::EmulatedGpus gpu(1);
  auto outgoing = transport::makeStreamCopyEngine(gpu.stream(0));
  auto incoming = transport::makeStreamCopyEngine(gpu.stream(0));
  std::byte* device = gpu.allocate(0, 256);
  std::memset(device, 7, 256);
  std::vector<std::byte> a(256), b(256), c(256);
  bool ran = false;
  {
    DeviceWork work;
    issue(*work.use(outgoing.get()), a.data(), device, 256);
    issue(*work.use(incoming.get()), b.data(), device, 256);
    REQUIRE(work.whenCopied([&] {
                  ran = true;
                  return absl::OkStatus();
                })
                .ok());
    REQUIRE(work.settle().ok());
    CHECK(a[255] == std::byte{7});
    CHECK(b[255] == std::byte{7});
    CHECK_FALSE(ran);  // settling runs no follow-up
    issue(*work.use(incoming.get()), c.data(), device, 256);
    CHECK(c[0] == std::byte{0});
  }  // destroyed (as a failed execution is): settled, the follow-up dropped
  CHECK(c[255] == std::byte{7});
  CHECK_FALSE(ran);
  CHECK(gpu.queued() == 0);
}

TEST_CASE("the standard stage issues device moves without waiting and converts through waited copies",
          "[daemon][device-work]") {
  transport::EmulatedGpus gpu(1);
  auto engine = transport::makeStreamCopyEngine(gpu.stream(0));
  auto stage = makeStandardStage();
  const std::string name = "w";
  const planner::Box box = planner::Box::whole({4, 8});
  std::byte* device = gpu.allocate(0, 4 * 8 * 4);
  std::vector<float> values(32);
  for (int i = 0; i < 32; ++i) values[static_cast<size_t>(i)] = 1.5f * static_cast<float>(i);
  std::memcpy(device, values.data(), sizeof(float) * 32);
  const TypedView memory{{device, MemoryKind::kCuda, 0, {8, 1}}, planner::DType::kFloat32, engine.get()};
  {
    std::vector<float> wire(32, 0.0f);
    const TypedView out{{reinterpret_cast<std::byte*>(wire.data()), MemoryKind::kHost, 0, {8, 1}},
                        planner::DType::kFloat32};
    REQUIRE(stage->pack(out, memory, {4, 8}, {name, box}).ok());
    CHECK(wire[31] == 0.0f);  // same dtype: issued on the device's engine only
    auto mark = engine->mark();
    REQUIRE(mark.ok());
    REQUIRE((*mark)->wait().ok());
    CHECK(wire == values);
  }
  {
    std::vector<uint16_t> wire(32, 0);
    const TypedView out{{reinterpret_cast<std::byte*>(wire.data()), MemoryKind::kHost, 0, {8, 1}},
                        planner::DType::kBFloat16};
    REQUIRE(stage->pack(out, memory, {4, 8}, {name, box}).ok());
    // Converted on the host from a waited copy: done on return (1.5 * 31 = 46.5 is 0x423a in bf16).
    CHECK(wire[31] == 0x423a);
  }
}
