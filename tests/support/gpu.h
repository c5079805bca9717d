// [gpu] tests skip where no GPU is (CI, this machine) and fail there instead when
// SHARDCAST_REQUIRE_GPU is set (scripts/device-check.sh sets it): a check on a GPU machine that
// sees no GPU (a driver older than the bundled CUDA runtime needs, say) must not pass by skipping.
#pragma once

#include <cstdlib>

#include "tests/support/skip.h"
#include "transport/cuda/cuda_support.h"

namespace shardcast::testing {

inline bool gpuRequired() {
  const char* v = std::getenv("SHARDCAST_REQUIRE_GPU");
  return v != nullptr && *v != '\0' && *v != '0';
}

}  // namespace shardcast::testing

// In a Catch2 test body: returns without a GPU, or fails when one is required. It prints
// SHARDCAST-SKIPPED, which ctest reads as "skipped" (tests/CMakeLists.txt), never as passed.
#define SHARDCAST_SKIP_WITHOUT_GPU()                                                 \
  do {                                                                               \
    if (::shardcast::transport::cudaDeviceCount() == 0) {                            \
      if (::shardcast::testing::gpuRequired())                                       \
        FAIL("no GPU visible (" << ::shardcast::transport::cudaUnavailableReason()   \
                                << ") and SHARDCAST_REQUIRE_GPU is set");            \
      SHARDCAST_SKIP("no GPU: " << ::shardcast::transport::cudaUnavailableReason()); \
    }                                                                                \
  } while (0)
