#include "daemon/stage/stage.h"

#include "common/strings.h"
#include "daemon/stage/convert.h"
#include "transport/cuda/fp8_quantize.h"

namespace shardcast::daemon {

Status issueBox(transport::CopyEngine& host, transport::CopyEngine* device, const transport::StridedView& dst,
                const transport::StridedView& src, const std::vector<int64_t>& extent, int64_t elem_bytes) {
  if (dst.kind == transport::MemoryKind::kHost && src.kind == transport::MemoryKind::kHost)
    return host.copy(dst, src, extent, elem_bytes);
  if (device == nullptr) return absl::FailedPreconditionError("device memory to copy but no CUDA copy engine");
  return device->copy(dst, src, extent, elem_bytes);
}

Status copyBox(transport::CopyEngine& host, transport::CopyEngine* device, const transport::StridedView& dst,
               const transport::StridedView& src, const std::vector<int64_t>& extent, int64_t elem_bytes) {
  SC_RETURN_IF_ERROR(issueBox(host, device, dst, src, extent, elem_bytes));
  if (dst.kind == transport::MemoryKind::kHost && src.kind == transport::MemoryKind::kHost) return absl::OkStatus();
  SC_ASSIGN_OR_RETURN(auto mark, device->mark());
  return mark ? mark->wait() : absl::OkStatus();
}

namespace {

// Bytes unchanged where the dtypes agree (a device copy issued, not waited for); the declared
// conversions (planner::convertible) converted on the host: device memory is copied to or from a
// dense host buffer around it, waited for.
class StandardStage final : public Stage {
 public:
  const char* name() const override { return "standard"; }
  Status pack(const TypedView& wire, const TypedView& memory, const std::vector<int64_t>& extent,
              const StageSite& site) override {
    if (computed(site)) return quantize(wire, memory, site);
    return move(wire, memory, extent, site);
  }
  Status unpack(const TypedView& memory, const TypedView& wire, const std::vector<int64_t>& extent,
                const StageSite& site) override {
    return move(memory, wire, extent, site);  // the wire holds the destination's values
  }
  Status copyLocal(const TypedView& dst, const TypedView& src, const std::vector<int64_t>& extent,
                   const StageSite& site) override {
    if (computed(site)) return quantize(dst, src, site);
    return move(dst, src, extent, site);
  }

 private:
  static bool computed(const StageSite& site) {
    return site.layout != nullptr && (site.layout->blockScaled() || site.layout->scale_of >= 0);
  }
  // A block-scaled weight's fp8 values, or its blocks' scales, from a source rank's memory: on
  // the host (vectorised) from host memory, by the GPU's quantisation kernel from device memory
  // (into the output directly, or through its scratch), waited for either way.
  Status quantize(const TypedView& dst, const TypedView& src, const StageSite& site) {
    Status st;
    if (src.view.kind != transport::MemoryKind::kHost) {
      st = quantizeOnDevice(dst, src, site);
    } else if (dst.view.kind != transport::MemoryKind::kHost) {  // host source, device output: via the host
      const auto extent = site.box.sizes();
      const auto dense = transport::denseStrides(extent);
      int64_t count = 1;
      for (int64_t e : extent) count *= e;
      const int64_t out_bytes = site.layout->scale_of >= 0 ? 4 : 1;
      std::vector<std::byte> staged(static_cast<size_t>(count * out_bytes));
      const transport::StridedView host{staged.data(), transport::MemoryKind::kHost, 0, dense};
      st = quantizeOnHost(host, src, site);
      if (st.ok()) st = copyBox(*host_, dst.device, dst.view, host, extent, out_bytes);
    } else {
      st = quantizeOnHost(dst.view, src, site);
    }
    if (!st.ok()) return Status(st.code(), strCat("tensor ", quote(site.tensor), ": ", st.message()));
    return absl::OkStatus();
  }
  Status quantizeOnHost(const transport::StridedView& dst, const TypedView& src, const StageSite& site) {
    return site.layout->scale_of >= 0
               ? scaleBox(dst, src.view, src.dtype, site.box, *site.layout, site.split, site.amaxes)
               : quantizeBox(dst, src.view, src.dtype, site.box, *site.layout, site.split, site.amaxes);
  }
  // Whether the box touches a block whose amax is given (split between source ranks).
  static bool touchesSplit(const StageSite& site) {
    if (site.split == nullptr || site.split->blocks.empty()) return false;
    const planner::TensorLayout& t = *site.layout;
    const planner::Box blocks = t.scale_of >= 0 ? site.box : planner::blocksTouched(site.box, t.block);
    const std::vector<int64_t>& grid = t.scale_of >= 0 ? t.shape : gridOf(t);
    bool touches = false;
    planner::forEachIndex(blocks, [&](const int64_t* k) {
      touches = touches || site.split->find(planner::blockIndex(k, grid)) != nullptr;
    });
    return touches;
  }
  static std::vector<int64_t> gridOf(const planner::TensorLayout& t) {
    std::vector<int64_t> grid(t.shape.size());
    for (size_t d = 0; d < grid.size(); ++d) grid[d] = (t.shape[d] + t.block[d] - 1) / t.block[d];
    return grid;
  }
  Status quantizeOnDevice(const TypedView& dst, const TypedView& src, const StageSite& site) {
    if (src.device == nullptr) return absl::FailedPreconditionError("device memory to quantise but no CUDA engine");
    if (src.dtype != planner::DType::kBFloat16 && src.dtype != planner::DType::kFloat32)
      return absl::InvalidArgumentError(
          strCat("block-scaled fp8 from ", planner::dtypeName(src.dtype), ": only float32 and bfloat16 are quantised"));
    const planner::TensorLayout& t = *site.layout;
    const size_t nd = static_cast<size_t>(site.box.ndim);
    transport::Fp8QuantizeBox box;
    box.lo.assign(site.box.lo.begin(), site.box.lo.begin() + nd);
    box.hi.assign(site.box.hi.begin(), site.box.hi.begin() + nd);
    box.block = t.block;
    box.pow2 = t.pow2;
    box.bf16 = src.dtype == planner::DType::kBFloat16;
    box.dst_strides = dst.view.strides;
    if (t.scale_of >= 0) {  // the source view's element i is block i's first: the weight's strides are / block
      box.scales = true;
      box.shape = t.scaled_shape;
      for (size_t d = 0; d < nd; ++d) {
        if (d >= t.block.size() || src.view.strides[d] % t.block[d] != 0)
          return absl::InternalError("block scales: the source view's strides are not the weight's times the block");
        box.src_strides.push_back(src.view.strides[d] / t.block[d]);
      }
    } else {
      box.shape = t.shape;
      box.src_strides = src.view.strides;
    }
    if (touchesSplit(site)) {
      SC_RETURN_IF_ERROR(quantizeBlockByBlock(dst, src, site, box));
    } else {
      SC_RETURN_IF_ERROR(src.device->quantizeFp8(dst.view, src.view, box));
    }
    SC_ASSIGN_OR_RETURN(auto mark, src.device->mark());
    return mark ? mark->wait() : absl::OkStatus();
  }
  // A box touching split blocks: one launch per block it touches, the split ones with their
  // combined amax (nothing of theirs outside the box is read: it is on other ranks).
  Status quantizeBlockByBlock(const TypedView& dst, const TypedView& src, const StageSite& site,
                              const transport::Fp8QuantizeBox& whole) {
    const planner::TensorLayout& t = *site.layout;
    const bool scales = t.scale_of >= 0;
    const planner::Box blocks = scales ? site.box : planner::blocksTouched(site.box, t.block);
    const std::vector<int64_t>& grid = scales ? t.shape : gridOf(t);
    Status st;
    planner::forEachIndex(blocks, [&](const int64_t* k) {
      if (!st.ok()) return;
      planner::Box one;  // block k as a box of block indices
      one.ndim = blocks.ndim;
      for (int d = 0; d < one.ndim; ++d) {
        one.lo[d] = k[d];
        one.hi[d] = k[d] + 1;
      }
      const planner::Box part =
          scales ? one : planner::intersect(site.box, planner::blockElements(one, t.block, t.shape));
      transport::Fp8QuantizeBox box = whole;
      transport::StridedView to = dst.view, from = src.view;
      for (size_t d = 0; d < box.lo.size(); ++d) {
        box.lo[d] = part.lo[static_cast<int>(d)];
        box.hi[d] = part.hi[static_cast<int>(d)];
        to.offset += (box.lo[d] - whole.lo[d]) * dst.view.strides[d];
        from.offset += (box.lo[d] - whole.lo[d]) * src.view.strides[d];
      }
      if (const float* amax = site.split->find(planner::blockIndex(k, grid))) {
        box.given = true;
        box.amax = *amax;
      }
      st = src.device->quantizeFp8(to, from, box);
    });
    return st;
  }
  Status move(const TypedView& dst, const TypedView& src, const std::vector<int64_t>& extent, const StageSite& site) {
    transport::CopyEngine* device = src.device ? src.device : dst.device;
    if (dst.dtype == src.dtype)
      return issueBox(*host_, device, dst.view, src.view, extent, planner::dtypeBytes(dst.dtype));
    if (!planner::convertible(src.dtype, dst.dtype))
      return absl::InvalidArgumentError(strCat("tensor ", quote(site.tensor), ": no conversion from ",
                                               planner::dtypeName(src.dtype), " to ", planner::dtypeName(dst.dtype)));
    const auto dense = transport::denseStrides(extent);
    int64_t count = 1;
    for (int64_t e : extent) count *= e;
    // Host on both sides: in place. Otherwise through dense host copies of the device side(s).
    std::vector<std::byte> src_host, dst_host;
    transport::StridedView from = src.view, to = dst.view;
    if (src.view.kind != transport::MemoryKind::kHost) {
      src_host.resize(static_cast<size_t>(count * planner::dtypeBytes(src.dtype)));
      from = {src_host.data(), transport::MemoryKind::kHost, 0, dense};
      SC_RETURN_IF_ERROR(copyBox(*host_, device, from, src.view, extent, planner::dtypeBytes(src.dtype)));
    }
    if (dst.view.kind != transport::MemoryKind::kHost) {
      dst_host.resize(static_cast<size_t>(count * planner::dtypeBytes(dst.dtype)));
      to = {dst_host.data(), transport::MemoryKind::kHost, 0, dense};
    }
    if (Status st = convertBox(to, dst.dtype, from, src.dtype, extent); !st.ok())
      return Status(st.code(), strCat("tensor ", quote(site.tensor), ": ", st.message()));
    if (dst.view.kind != transport::MemoryKind::kHost)
      return copyBox(*host_, device, dst.view, to, extent, planner::dtypeBytes(dst.dtype));
    return absl::OkStatus();
  }
  std::unique_ptr<transport::CopyEngine> host_ = transport::makeHostCopyEngine();
};

}  // namespace

std::unique_ptr<Stage> makeStandardStage() { return std::make_unique<StandardStage>(); }

}  // namespace shardcast::daemon
