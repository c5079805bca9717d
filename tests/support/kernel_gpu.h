// A GPU for the kernel tests, emulated (transport/emulated_gpus.h) or real (a CUDA copy engine and
// device buffers): its engine, and how to allocate, fill and read back its memory. The same
// checks then run on both (tests/daemon/fp8_device_test.cc, delta_device_test.cc).
#pragma once

#include <catch2/catch.hpp>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "tests/support/device_buffer.h"
#include "transport/copy_engine.h"
#include "transport/emulated_gpus.h"

namespace shardcast::testing {

struct KernelGpu {
  transport::CopyEngine* engine = nullptr;
  std::function<std::byte*(size_t)> allocate;  // valid while the GPU (and `buffers`) live
  std::function<void(std::byte*, const void*, size_t)> upload;
  std::function<void(void*, const std::byte*, size_t)> download;
};

// GPU 0 of `gpus` (emulated memory is host memory: plain copies).
inline KernelGpu emulatedKernelGpu(transport::EmulatedGpus& gpus, transport::CopyEngine& engine) {
  return {&engine, [&gpus](size_t n) { return gpus.allocate(0, n); },
          [](std::byte* d, const void* s, size_t n) { std::memcpy(d, s, n); },
          [](void* d, const std::byte* s, size_t n) { std::memcpy(d, s, n); }};
}

// GPU 0 through `engine` (makeCudaCopyEngine(0)); its allocations are kept in `buffers`.
inline KernelGpu cudaKernelGpu(transport::CopyEngine& engine, std::vector<std::unique_ptr<DeviceBuffer>>& buffers) {
  return {&engine,
          [&buffers](size_t n) {
            auto b = allocateDevice(n, 0);
            REQUIRE(b.ok());
            buffers.push_back(std::move(*b));
            return static_cast<std::byte*>(buffers.back()->data());
          },
          [](std::byte* d, const void* s, size_t n) { REQUIRE(copyToDevice(d, s, n).ok()); },
          [](void* d, const std::byte* s, size_t n) { REQUIRE(copyFromDevice(d, s, n).ok()); }};
}

}  // namespace shardcast::testing
