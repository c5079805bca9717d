// The pack/unpack stage of a sync: how elements move between a rank's memory and the bytes a
// transfer travels in. The head of a chain packs (rank memory -> wire bytes), every node a
// transfer lands on unpacks (wire bytes -> its ranks' memory), colocated fragments copy rank to
// rank. Views carry the element type of each side, so a stage that converts (fp32 -> bf16,
// bf16 -> fp8 with block scales) or encodes (a delta against the bytes last sent) plugs in here
// and neither the coordinator nor the schedule changes.
//
// Contract: called on a sync's executing threads (several syncs at once: a stage is
// thread-safe); a call returns when host memory it writes holds the bytes; a device copy of
// bytes unchanged is issued on an engine of the views (the one of the side it reads from when
// that is device memory, so it follows the copies that wrote those bytes; else the
// destination's) and done in that engine's order: the caller takes a mark (CopyEngine::mark)
// before anything else reads the destination. Errors name the tensor and the dtypes. The wire carries the destination's
// dtype. Transfers the schedule sends or lands directly (a rank's buffer is the wire: planner/schedule.h) bypass the
// stage: it sends directly only tensors whose source dtype is the destination's, and landing
// directly is always the wire's dtype, so a stage moves same-dtype bytes unchanged.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/stage/convert.h"
#include "planner/box.h"
#include "planner/layout.h"
#include "transport/copy_engine.h"

namespace shardcast::daemon {

// A strided box of elements of one dtype, in host or device memory.
struct TypedView {
  transport::StridedView view;
  planner::DType dtype = planner::DType::kFloat32;
  transport::CopyEngine* device = nullptr;  // device memory: the CUDA engine that copies it
};

// What a call moves: a box (global element indices) of one tensor of the plan, for stages that
// keep per-tensor state or name the tensor in errors.
struct StageSite {
  const std::string& tensor;
  const planner::Box& box;
  // The destination's tensor: a block-scaled weight or a block scale (planner/layout.h) is
  // computed from the source's memory around the box, not copied or converted element by element.
  const planner::TensorLayout* layout = nullptr;
  // The combined amaxes of the block-scaled weight's blocks that source ranks split (null: none).
  const SplitAmax* split = nullptr;
  // The weight's block amaxes already read on this node in this sync (null: read every time).
  BlockAmaxes* amaxes = nullptr;
};

class Stage {
 public:
  virtual ~Stage() = default;
  virtual const char* name() const = 0;
  // Rank memory -> the packed bytes of a transfer (`wire`, dense).
  virtual Status pack(const TypedView& wire, const TypedView& memory, const std::vector<int64_t>& extent,
                      const StageSite& site) = 0;
  // The landed bytes of a transfer (`wire`, dense) -> a destination rank's memory.
  virtual Status unpack(const TypedView& memory, const TypedView& wire, const std::vector<int64_t>& extent,
                        const StageSite& site) = 0;
  // A source rank's memory -> a destination rank's memory on the same node.
  virtual Status copyLocal(const TypedView& dst, const TypedView& src, const std::vector<int64_t>& extent,
                           const StageSite& site) = 0;
};

// The stage every sync uses: bytes unchanged where both dtypes agree (host memcpy, or the CUDA
// engine of a device view); the conversions a destination may declare (planner::convertible:
// float32 -> bfloat16, rounded to nearest even as torch does; float32 / bfloat16 -> block-scaled
// fp8 e4m3 and its scales, daemon/stage/convert.h) converted, at the source's packer (the wire carries
// the destination's dtype); any other pair INVALID_ARGUMENT naming the tensor. Block-scaled
// tensors are quantised on the host (vectorised) from host memory, by the GPU's kernel from device
// memory.
std::unique_ptr<Stage> makeStandardStage();

// Copies the box of `extent` elements of `elem_bytes` between two views with the engine that
// reaches both: `host` for host memory on both sides, else `device`, and waits for it.
Status copyBox(transport::CopyEngine& host, transport::CopyEngine* device, const transport::StridedView& dst,
               const transport::StridedView& src, const std::vector<int64_t>& extent, int64_t elem_bytes);
// The same without waiting: a device copy is issued on `device`, done in its order.
Status issueBox(transport::CopyEngine& host, transport::CopyEngine* device, const transport::StridedView& dst,
                const transport::StridedView& src, const std::vector<int64_t>& extent, int64_t elem_bytes);

}  // namespace shardcast::daemon
