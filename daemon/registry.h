// What local ranks registered with this daemon: their group layouts, and their buffers mapped
// (shared memory, or CUDA IPC) and registered with the transport once. Everything is validated
// against the layout on arrival; memory a client did not register is never reachable.
// Thread-safe: gRPC handlers call it concurrently.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "shardcast/v1/service.pb.h"
#include "transport/copy_engine.h"
#include "transport/device_staging.h"
#include "transport/shm.h"
#include "transport/transport.h"

namespace shardcast::daemon {

// A stable digest of a layout (xxHash64 of its deterministic serialisation), hex.
std::string layoutDigest(const v1::Layout& layout);

class Registry {
 public:
  Registry(std::string node, transport::Context& transport);

  StatusOr<v1::RegisterResponse> registerRank(const v1::RegisterRequest& request);
  Status unregisterRank(const std::string& group, int32_t rank);
  std::vector<v1::RankRegistration> list() const;
  // Groups with ranks here: their ranks, versions and bytes.
  std::vector<v1::GroupStatus> groups() const;
  // What peers need to plan and to write here.
  v1::DescribeResponse describe() const;
  uint64_t registeredBytes() const;
  int32_t registeredRanks() const;

  // A registered buffer as the sync engine uses it, kept mapped while the returned object lives:
  // host shared memory, or device memory (then `copies` is the CUDA engine that reaches it, and
  // `transfer` mirrors it into `region` when the transport cannot reach device memory itself).
  struct LocalBuffer {
    std::byte* data = nullptr;
    uint64_t size = 0;
    transport::MemoryKind kind = transport::MemoryKind::kHost;
    std::shared_ptr<void> keep_alive;
    std::shared_ptr<transport::MemoryRegion> region;  // the registration the buffer lies in
    uint64_t region_offset = 0;                       // of data in that region
    transport::TransferMemory* transfer = nullptr;    // device memory: stageOut before sending from region
    transport::CopyEngine* copies = nullptr;          // device memory: the CUDA copy engine
  };
  StatusOr<LocalBuffer> localBuffer(const std::string& group, int32_t rank, const std::string& buffer) const;
  // Changes with every registration and unregistration (a sync fails if it changes under it).
  uint64_t generation() const;

  // Committed versions of groups with ranks here.
  uint64_t version(const std::string& group) const;
  void commitVersion(const std::string& group, uint64_t version);
  // Waits until `group` reaches `version` or the timeout passes; returns the version then.
  uint64_t waitVersion(const std::string& group, uint64_t version, std::chrono::milliseconds timeout) const;
  bool hasGroup(const std::string& group) const;

 private:
  struct Buffer {
    std::string name;
    uint64_t size = 0;
    std::shared_ptr<transport::ShmSegment> segment;          // shm: the mapping (shared by buffers)
    std::shared_ptr<transport::CudaIpcMapping> cuda;         // cuda: the imported allocation
    std::shared_ptr<transport::TransferMemory> cuda_memory;  // cuda: registered or staged
    std::byte* device = nullptr;                             // cuda: the buffer (offset applied)
    std::shared_ptr<transport::MemoryRegion> region;         // what peers write into
    uint64_t offset = 0;                                     // of the buffer in `region`
  };
  struct Rank {
    std::string group;
    int32_t rank = 0;
    int32_t world = 0;
    std::string digest;
    uint64_t bytes = 0;
    std::vector<Buffer> buffers;
  };
  struct Group {
    v1::Layout layout;
    std::string digest;
  };

  StatusOr<std::unique_ptr<Rank>> build(const v1::RegisterRequest& request, std::string digest);

  std::string node_;
  transport::Context& transport_;
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int32_t>, std::unique_ptr<Rank>> ranks_;
  std::map<std::string, Group> groups_;
  std::map<std::string, uint64_t> versions_;
  uint64_t generation_ = 0;
  mutable std::condition_variable version_cv_;
  // Created on the first CUDA registration; lives as long as the registry (syncs use it).
  std::unique_ptr<transport::CopyEngine> cuda_copies_;
};

}  // namespace shardcast::daemon
