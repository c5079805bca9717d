// Delta syncs (docs/delta.md): between two RL steps most weights are bit-identical, so a chunk can
// travel as "what changed since the bytes the destination already holds". A source daemon keeps
// the bytes it last sent of each chunk it packs (DeltaBases, host memory, bounded); a destination
// node whose ranks hold exactly those bytes (READY at that version, committed by the sync that sent
// them) gets the changed elements only, and rebuilds the chunk from its ranks' memory before
// unpacking it, checked against a hash of the dense bytes.
//
// Encoding (units of the wire's element size): a byte g < 255 skips g unchanged units, then one
// changed unit's bytes follow; g = 255 skips 255 units with no value. Units after the last record
// are unchanged (an empty delta: nothing changed). 1 + unit bytes per changed unit, so a chunk is
// sent as a delta only when that is smaller than the dense chunk (kDeltaWorthFraction).
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "transport/cuda/delta_plan.h"
#include "transport/device_runtime.h"

namespace shardcast::daemon {

inline constexpr uint8_t kDeltaSkip = transport::kDeltaSkipByte;
// A delta is sent when it is at most this fraction of the dense chunk: below, decoding it costs
// the receiver more than the bytes it saves the link (it reads its ranks' memory and hashes).
inline constexpr double kDeltaWorthFraction = 0.75;

// Encodes `now` against `before` (both `bytes` long, a multiple of `unit`, a power of two up to 8)
// into `out` (room for `cap` bytes) and writes every changed unit of `now` into `before`, which
// then holds `now`. The encoded size; nullopt when it needs more than `cap` bytes or `bytes` is not
// a multiple of `unit` (then `before` is partly updated: copy `now` over it to send dense).
std::optional<size_t> encodeDelta(const std::byte* now, std::byte* before, size_t bytes, size_t unit, std::byte* out,
                                  size_t cap);

// Applies an encoded delta (from a peer: untrusted) to `base` (`bytes` long, units of `unit`) in
// place. INVALID_ARGUMENT when a record points past the end of the base or is cut short.
Status applyDelta(std::byte* base, size_t bytes, size_t unit, const std::byte* delta, size_t delta_bytes);

// The bytes this daemon last sent of each chunk, per plan, as bases for the next version's deltas.
// Bounded by `capacity` bytes over all plans: the least recently used plan's bases go first (not
// one a sync is using); a chunk with no room is sent dense. Thread-safe.
class DeltaBases {
 public:
  struct Base {
    std::vector<std::byte> bytes;                     // in host memory, or
    std::unique_ptr<transport::DeviceMemory> device;  // on GPU `gpu` (a chunk its GPU encodes)
    int gpu = -1;
    uint64_t fence = 0;      // the sync attempt that sent these bytes (0: none, or it failed)
    bool committed = false;  // that attempt committed here: a destination may hold these bytes
    size_t size() const { return device ? device->size() : bytes.size(); }
  };
  // One plan's bases. Only the attempt that claimed it (PlanBases::claim) reads or writes them.
  class Plan {
   public:
    // The base of chunk `chunk` of transfer `transfer`; null when none is kept.
    Base* find(int32_t transfer, int32_t chunk);
    // The base of that chunk, made `bytes` long (contents undefined when new); null when the
    // cache has no room for it.
    Base* make(int32_t transfer, int32_t chunk, size_t bytes);
    // The same on GPU `gpu` (allocated by `gpus`, bounded by the device capacity); null when
    // there is no room or the allocation fails (the chunk is then encoded on the host).
    Base* makeOnDevice(int32_t transfer, int32_t chunk, size_t bytes, int gpu, transport::DeviceRuntime& gpus);

   private:
    friend class DeltaBases;
    DeltaBases* owner_ = nullptr;
    std::string key_;
    uint64_t claimed_by_ = 0;  // the attempt (fence) using these bases, 0: none
    std::map<std::pair<int32_t, int32_t>, Base> bases_;
  };

  // `capacity`: bytes of bases in host memory; `device_capacity`: on GPUs, over all of them.
  explicit DeltaBases(uint64_t capacity, uint64_t device_capacity = 0)
      : capacity_(capacity), device_capacity_(device_capacity) {}
  // The bases of plan `key` for the attempt `fence`: null when another attempt holds them.
  std::shared_ptr<Plan> claim(const std::string& key, uint64_t fence);
  // Attempt `fence` of plan `key` ended: what it sent is a base if it committed, nothing if not.
  void finish(const std::string& key, uint64_t fence, bool committed);
  // The plan was evicted: its bases go too.
  void drop(const std::string& key);
  uint64_t bytes() const;         // held in host memory
  uint64_t device_bytes() const;  // held on GPUs
  uint64_t capacity() const { return capacity_; }
  uint64_t device_capacity() const { return device_capacity_; }

 private:
  // With mu_ held: room for `bytes` more in host memory and `device` more on GPUs, evicting
  // unclaimed plans but `keep` (least recently used first); false when there is none.
  // What a call lets go of, freed once its lock is let go (device memory: the driver waits for
  // the GPU's work); declared before the lock.
  struct Released {
    std::vector<std::shared_ptr<Plan>> plans;
    std::vector<std::unique_ptr<transport::DeviceMemory>> memory;
  };
  bool makeRoom(uint64_t bytes, uint64_t device, const Plan* keep, Released* released);
  // With mu_ held: `b`'s memory no longer counted (it is about to be replaced or dropped).
  void uncount(const Base& b);

  const uint64_t capacity_, device_capacity_;
  mutable std::mutex mu_;
  uint64_t bytes_ = 0, device_bytes_ = 0;
  std::list<std::string> lru_;  // most recently claimed first
  std::map<std::string, std::shared_ptr<Plan>> plans_;
};

}  // namespace shardcast::daemon
