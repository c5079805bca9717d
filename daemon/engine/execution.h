// One execute() call: this daemon's part of one wave of a sync. Copies colocated fragments
// (first wave), packs and sends the transfers this node's source ranks head, then processes every
// chunk that lands here as peers announce it: checks it against the plan, forwards it along its
// relay chain, unpacks it into the local destination ranks. Runs on the calling thread (a gRPC
// handler), fed by the transport's progress thread through SyncAttempt::landed.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "daemon/engine/device_work.h"
#include "daemon/engine/plan_cache.h"
#include "daemon/engine/sync_attempt.h"
#include "daemon/engine/verify.h"
#include "daemon/registry/registry.h"
#include "daemon/stage/stage.h"
#include "shardcast/v1/service.pb.h"
#include "transport/copy_engine.h"
#include "transport/transport.h"

namespace shardcast::daemon {

// What an execution uses of its daemon, and nothing else.
struct ExecutionEnv {
  const std::string& node;  // this daemon's node name (in messages)
  Registry& registry;
  transport::Context& transport;
  Stage& stage;
  transport::CopyEngine& host_copies;  // raw byte copies (checksums of device memory)
  SpareMemory& spares;
  // --delta-device-mib: delta chunks of device memory encoded (against bases kept there) and
  // rebuilt (in one chunk of device memory per GPU, while a sync runs) on the GPUs.
  bool gpu_deltas = false;
};

class Execution {
 public:
  Execution(ExecutionEnv env, std::shared_ptr<SyncAttempt> attempt, const v1::ExecuteRequest& req);
  Status run();

 private:
  using Clock = std::chrono::steady_clock;
  // What this node knows of another: its transport address and where to write into it.
  struct Peer {
    std::string address;
    transport::RemoteRegion arena;
    std::vector<transport::RemoteRegion> regions;
    // (rank, name) -> (region, offset)
    std::map<std::pair<int32_t, std::string>, std::pair<uint32_t, uint64_t>> buffers;
    Registry::Base base;  // what its destination ranks held when prepared (delta syncs)
  };
  // A piece of a landed chunk that a local destination rank holds: where it starts in the
  // transfer's packed bytes, its box, and the rank memory it goes to.
  struct Piece {
    uint64_t at = 0;
    planner::Box part;
    TypedView memory;
    std::vector<int64_t> dense;                     // the wire's strides (the fragment's row-major box)
    const planner::TensorLayout* tensor = nullptr;  // the destination's
    int32_t rank = -1;
    int gpu = -1;  // device memory: its GPU
    // A delta chunk's: where the rank holds its committed version of the box (the base), read to
    // rebuild the chunk. `memory` itself, unless the rank is double-buffered: then its set in use.
    TypedView base;
    int base_gpu = -1;
  };

  Status readDirectory();
  Status gateWrites();
  Status readAmaxes();
  // The combined amaxes of the split blocks of destination tensor `dt` (a block-scaled weight or
  // its scales; null: none split).
  // What the stage needs to move source tensor `st`'s `box` into destination tensor `dt`: with
  // the destination's layout when it is computed there (planner::computedFrom), else nothing.
  StageSite siteOf(const planner::TensorLayout& st, const planner::TensorLayout& dt, const planner::Box& box) const;
  const SplitAmax* splitOf(const planner::TensorLayout& dt) const;
  // The block amaxes this attempt shares between a block-scaled weight's values and its scale
  // tensor (null for any other tensor).
  BlockAmaxes* amaxesOf(const planner::TensorLayout& dt) const;
  // Before every local copy into or out of rank memory: the sync may have been ended meanwhile
  // (aborted, or its lease ran out); then its ranks are no longer its to touch.
  Status alive() const;
  StatusOr<Registry::LocalBuffer> buffer(const planner::ResolvedLayout& l, int32_t rank, int32_t b,
                                         Registry::Set set = Registry::Set::kWritten) const;
  // A rank buffer's view, typed as tensor `t`; device memory is copied on its GPU's engine of
  // `direction` (packs and local copies read with the outgoing one, landings the incoming one),
  // which device_ then waits for.
  enum class Direction { kOutgoing, kIncoming };
  TypedView typed(const Registry::LocalBuffer& b, int64_t offset, std::vector<int64_t> strides,
                  const planner::TensorLayout& t, Direction direction);
  transport::CopyEngine* engine(const Registry::LocalBuffer& b, Direction direction);
  // Sends chunk word.chunk of transfer word.transfer (word.bytes of it, from `off` in `src` on:
  // the chunk's offset is added) to where it lands on `node`, then the word that announces it.
  Status send(const std::shared_ptr<transport::MemoryRegion>& src, uint64_t off, const LandedChunk& word, int32_t node);
  // Delta syncs: the fence of the base every node transfer t lands on holds (0: not all the same,
  // or none), and the unit its deltas are encoded in (the smallest element of its tensors).
  uint64_t deltaTarget(int32_t t) const;
  size_t deltaUnit(int32_t t) const;
  // The chunk just packed at `packed` (dense): encoded against its base when `target` (a base
  // fence) is the base's and that is worth it (word says how it travels; `packed` then holds the
  // delta); the base becomes these bytes either way (when kept).
  Status encodeChunk(int32_t t, int32_t k, std::byte* packed, uint64_t target, LandedChunk* word);
  // Delta syncs from device memory (--delta-device-mib): a chunk of transfer t packed from a
  // GPU is encoded there against a base kept on that GPU, and only the delta crosses to the host.
  // `src`: the chunk's source box (one fragment, copied as it is); `wire`: its dense strides.
  // False when it cannot go that way (no room for a base on the GPU): the host path packs it.
  struct GpuChunk {
    TypedView src;
    std::vector<int64_t> extent, wire;
    const planner::TensorLayout* tensor = nullptr;  // the destination's
    const planner::Box* part = nullptr;             // the chunk's box
    int gpu = -1;                                   // the source's
  };
  StatusOr<bool> sendFromGpu(int32_t t, int32_t k, const GpuChunk& g, uint64_t target,
                             const std::vector<int32_t>& staged,
                             const std::shared_ptr<transport::MemoryRegion>& staging, uint64_t at);
  // Node-local fan-out between GPUs: a box that several local ranks hold (replicas on one node)
  // crosses from host memory into the GPUs once; piece i (device memory, one contiguous run) is
  // copied device to device (NVLink or PCIe peer copies) from the first earlier piece of the same
  // box that came from host memory, returned here; null: piece i comes from the wire. Its copy
  // runs on that rank's engine (the source's), so after the copy into it.
  static const Piece* deviceCopyOf(const std::vector<Piece>& pieces, size_t i);
  // The pieces of chunk `k` of transfer `t` this node's destination ranks hold (but the rank it
  // landed in directly, if it did).
  // `bases`: each piece's `base` as well (a delta chunk).
  StatusOr<std::vector<Piece>> localPieces(int32_t t, int32_t k, bool bases);
  // A delta chunk: rebuilt from the local ranks' bytes (the base) into decoded_, checked.
  Status decode(const LandedChunk& l, const std::byte* delta, const std::vector<Piece>& pieces);
  // The same on a GPU (a tree-hashed delta whose pieces are all device memory: on the first
  // piece's GPU, the others read and written GPU to GPU): the base gathered into device memory,
  // the delta applied and the result hashed there; `u` then reads it from there. False when that
  // is not possible (a piece in host memory, no kernels, no memory): decode().
  struct Unpacked;
  StatusOr<bool> decodeOnGpu(const LandedChunk& l, const std::byte* delta, Unpacked* u);
  // DATA_LOSS: a rebuilt chunk is not the source's (the ranks do not hold the base), naming them.
  Status notRebuilt(const LandedChunk& l, const std::vector<Piece>& pieces) const;
  Status copyColocated();
  std::unique_ptr<transport::DeviceMemory> gpu_chunk_;  // sendFromGpu's dense chunk, on GPU gpu_chunk_gpu_
  int gpu_chunk_gpu_ = -1;
  std::unique_ptr<transport::DeviceMemory> gpu_rebuilt_;  // decodeOnGpu's rebuilt chunk, on GPU gpu_rebuilt_gpu_
  int gpu_rebuilt_gpu_ = -1;
  Status sendHeaded(int32_t t);
  Status ensureStaging();
  Status receive();

  // ---- A landed chunk, in steps (processLanded): check, land, relay, unpack, verify ----
  // Where a checked chunk is on this node.
  struct Arrival {
    const planner::Schedule::Chunk* chunk = nullptr;
    const planner::Schedule::Landing* landing = nullptr;
    bool delta = false;
    // The transfer's bytes here: the region and offset relays send from, and its memory.
    std::shared_ptr<transport::MemoryRegion> region;
    uint64_t region_offset = 0;
    Registry::LocalBuffer memory;
  };
  // A chunk unpacked: its dense bytes (where it landed, or rebuilt from a delta), how to read
  // them, and the pieces the local ranks took.
  struct Unpacked {
    std::byte* wire = nullptr;
    transport::MemoryKind kind = transport::MemoryKind::kHost;
    transport::CopyEngine* copies = nullptr;
    std::vector<Piece> pieces;
  };
  Status processLanded(const LandedChunk& l);
  // The peer's word against the plan (INVALID_ARGUMENT naming what is wrong); each chunk once.
  Status check(const LandedChunk& l);
  // Where it landed; verify: its checksum against the announced one.
  StatusOr<Arrival> land(const LandedChunk& l);
  // To the next nodes of its relay chain.
  Status relay(const LandedChunk& l, const Arrival& at);
  // Into the local destination ranks (a delta rebuilt first: decode).
  StatusOr<Unpacked> unpack(const LandedChunk& l, const Arrival& at);
  // verify (daemon/engine/verify.h): what the ranks hold against what landed, and where, in errors.
  std::vector<HeldPiece> heldPieces(const LandedChunk& l, const Unpacked& u) const;
  VerifySite site(const LandedChunk& l) const;

  ExecutionEnv env_;
  std::shared_ptr<SyncAttempt> a_;
  const v1::ExecuteRequest& req_;
  const CachedPlan& cp_;
  const planner::Plan& plan_;
  const int32_t self_;
  const int32_t wave_;
  const Clock::time_point deadline_;
  std::map<int32_t, Peer> peers_;
  SplitAmaxes split_;                         // readAmaxes()
  std::vector<std::byte> encoded_, decoded_;  // delta syncs: one chunk's delta, one rebuilt chunk
  // The mappings of every rank buffer this execution issued copies on: a client that ends its
  // session mid-sync unregisters its ranks, but their memory stays mapped until the copies into
  // and out of it are done.
  std::map<const void*, std::shared_ptr<void>> mapped_;
  // Device copies issued and not waited for; last, so destroyed (settled) first: nothing this
  // execution issued still reads the arena or staging, or touches a rank, once it is gone.
  DeviceWork device_;
};

}  // namespace shardcast::daemon
