// Device buffers without the CUDA toolkit: nothing is available (tests/support/device_buffer.h).
#include "tests/support/device_buffer.h"

namespace shardcast::testing {

namespace {
Status unavailable() { return absl::UnavailableError("shardcast was built without the CUDA toolkit"); }
}  // namespace

StatusOr<std::unique_ptr<DeviceBuffer>> allocateDevice(size_t, int) { return unavailable(); }
StatusOr<std::unique_ptr<CuMemBuffer>> allocateCuMem(size_t, int) { return unavailable(); }
Status copyToDevice(void*, const void*, size_t) { return unavailable(); }
Status copyFromDevice(void*, const void*, size_t) { return unavailable(); }

}  // namespace shardcast::testing
