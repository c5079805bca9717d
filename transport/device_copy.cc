#include "transport/device_copy.h"

#include <mutex>
#include <optional>

#include "common/strings.h"
#include "transport/cuda/fp8_quantize.h"
#include "transport/cuda/strided_copy.h"

namespace shardcast::transport {

namespace {

// The alignment two bases share (the kernel's word is at most it).
int64_t baseAlignment(const void* a, const void* b) {
  const auto bits = reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b);
  int64_t align = 16;
  while (align > 1 && (bits % static_cast<uintptr_t>(align)) != 0) align /= 2;
  return align;
}

int64_t runCount(const StridedView& dst, const StridedView& src, const std::vector<int64_t>& extent,
                 int64_t elem_bytes) {
  int64_t runs = 0;
  forEachRun(dst, src, extent, elem_bytes, [&](int64_t, int64_t, int64_t) { ++runs; });
  return runs;
}

class StreamCopyEngine final : public CopyEngine {
 public:
  explicit StreamCopyEngine(std::unique_ptr<DeviceStream> stream) : stream_(std::move(stream)) {}
  const char* name() const override { return "cuda"; }
  bool canCopy(MemoryKind, MemoryKind) const override { return true; }

  Status copy(const StridedView& dst, const StridedView& src, const std::vector<int64_t>& extent,
              int64_t elem_bytes) override {
    if (dst.strides.size() != extent.size() || src.strides.size() != extent.size())
      return absl::InvalidArgumentError(strCat("copy: extent has ", extent.size(), " dims but strides have ",
                                               src.strides.size(), " (src) and ", dst.strides.size(), " (dst)"));
    std::lock_guard<std::mutex> lock(mu_);
    const bool dst_here = onStream(dst), src_here = onStream(src);
    if (stream_->kernels() && (dst_here || src_here)) {
      auto plan = planStridedCopy(dst, src, extent, elem_bytes, baseAlignment(dst.base, src.base));
      if (plan.ok() && plan->runs > 1) {
        if (dst_here && src_here) return launch(*plan, dst.base, src.base);
        if (auto bounced = bounce(dst, src, extent, elem_bytes, plan->runs, dst_here)) return *bounced;
      }
    }
    return copyRuns(dst, src, extent, elem_bytes);
  }

  Status synchronize() override {
    std::lock_guard<std::mutex> lock(mu_);
    return stream_->synchronize();
  }

  // The kernel reads the source on this GPU and writes the output there, or into dense scratch
  // that is then copied out run by run.
  Status quantizeFp8(const StridedView& dst, const StridedView& src, const Fp8QuantizeBox& box) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!onStream(src))
      return absl::UnimplementedError(strCat(stream_->name(), ": fp8 quantisation reads device memory of this GPU"));
    Fp8QuantizeBox here = box;
    here.src_offset = src.offset;
    here.dst_offset = dst.offset;
    here.dst_strides = dst.strides;
    std::vector<int64_t> extent(box.lo.size());
    int64_t count = 1;
    for (size_t d = 0; d < extent.size(); ++d) count *= (extent[d] = box.hi[d] - box.lo[d]);
    const int64_t out_bytes = box.scales ? 4 : 1;
    if (count == 0) return absl::OkStatus();
    if (onStream(dst)) {
      SC_ASSIGN_OR_RETURN(const auto plan, planFp8Quantize(here));
      return quantize(plan, dst.base, src.base);
    }
    SC_ASSIGN_OR_RETURN(std::byte * scratch, stream_->scratch(static_cast<size_t>(count * out_bytes)));
    here.dst_offset = 0;
    here.dst_strides = denseStrides(extent);
    SC_ASSIGN_OR_RETURN(const auto plan, planFp8Quantize(here));
    SC_RETURN_IF_ERROR(quantize(plan, scratch, src.base));
    return copyRuns(dst, {scratch, MemoryKind::kCuda, 0, here.dst_strides}, extent, out_bytes);
  }

  StatusOr<std::shared_ptr<CopyMark>> mark() override {
    std::lock_guard<std::mutex> lock(mu_);
    return stream_->record();
  }

 private:
  bool onStream(const StridedView& v) const { return v.kind == MemoryKind::kCuda && stream_->local(v.base); }

  Status launch(const StridedCopyPlan& plan, std::byte* dst, const std::byte* src) {
    if (Status st = stream_->launch(plan, dst, src); !st.ok())
      return Status(st.code(), strCat(stream_->name(), ": strided copy kernel (", plan.runs, " runs of ",
                                      plan.run_bytes, " bytes, ", plan.word, "-byte words): ", st.message()));
    return absl::OkStatus();
  }

  Status quantize(const Fp8QuantizePlan& plan, std::byte* dst, const std::byte* src) {
    if (Status st = stream_->quantize(plan, dst, src); !st.ok())
      return Status(st.code(), strCat(stream_->name(), ": fp8 quantisation kernel (", plan.blocks, " blocks",
                                      plan.scales ? ", scales" : "", "): ", st.message()));
    return absl::OkStatus();
  }

  Status copyRuns(const StridedView& dst, const StridedView& src, const std::vector<int64_t>& extent,
                  int64_t elem_bytes) {
    Status st;
    forEachRun(dst, src, extent, elem_bytes, [&](int64_t d, int64_t s, int64_t n) {
      if (st.ok()) st = stream_->copy(dst.base + d, src.base + s, static_cast<size_t>(n));
    });
    return st;
  }

  // One side on this stream's GPU with `runs` runs, the other elsewhere: through dense scratch
  // on the GPU (one kernel on the GPU side, the other side's runs as copies) when that is at
  // least four times fewer copies. Empty when not worth it or not possible (the caller copies
  // run by run).
  std::optional<Status> bounce(const StridedView& dst, const StridedView& src, const std::vector<int64_t>& extent,
                               int64_t elem_bytes, int64_t runs, bool into_device) {
    int64_t bytes = elem_bytes;
    for (int64_t e : extent) bytes *= e;
    if (bytes > kMaxBounceBytes) return std::nullopt;
    const StridedView& far = into_device ? src : dst;
    const StridedView dense_far{far.base, far.kind, far.offset, denseStrides(extent)};
    const int64_t far_runs =
        into_device ? runCount(dense_far, far, extent, elem_bytes) : runCount(far, dense_far, extent, elem_bytes);
    if (far_runs * 4 > runs) return std::nullopt;
    auto scratch = stream_->scratch(static_cast<size_t>(bytes));
    if (!scratch.ok()) return scratch.status();
    const StridedView staged{*scratch, MemoryKind::kCuda, 0, denseStrides(extent)};
    const StridedView& near = into_device ? dst : src;
    auto plan = into_device ? planStridedCopy(near, staged, extent, elem_bytes, baseAlignment(near.base, *scratch))
                            : planStridedCopy(staged, near, extent, elem_bytes, baseAlignment(*scratch, near.base));
    if (!plan.ok()) return plan.status();
    if (into_device) {
      SC_RETURN_IF_ERROR(copyRuns(staged, src, extent, elem_bytes));
      return launch(*plan, dst.base, *scratch);
    }
    SC_RETURN_IF_ERROR(launch(*plan, *scratch, src.base));
    return copyRuns(dst, staged, extent, elem_bytes);
  }

  std::mutex mu_;
  std::unique_ptr<DeviceStream> stream_;
};

}  // namespace

std::unique_ptr<CopyEngine> makeStreamCopyEngine(std::unique_ptr<DeviceStream> stream) {
  return std::make_unique<StreamCopyEngine>(std::move(stream));
}

}  // namespace shardcast::transport
