#include "transport/device_copy.h"

#include <mutex>
#include <optional>
#include <vector>

#include "common/strings.h"
#include "transport/cuda/delta_kernels.h"
#include "transport/cuda/fp8_quantize.h"
#include "transport/cuda/strided_copy.h"

namespace shardcast::transport {

Status DeviceStream::deltaTiles(const DeltaPlan&, const std::byte*, const std::byte*, DeltaTile*) {
  return absl::UnimplementedError(name() + ": the delta kernels were not built");
}
Status DeviceStream::deltaWrite(const DeltaPlan&, const std::byte*, std::byte*, const DeltaTilePlace*, std::byte*,
                                int64_t) {
  return absl::UnimplementedError(name() + ": the delta kernels were not built");
}
Status DeviceStream::deltaScatter(int32_t, std::byte*, int64_t, const int64_t*, const std::byte*, int64_t) {
  return absl::UnimplementedError(name() + ": the delta kernels were not built");
}
Status DeviceStream::hashLeaves(const std::byte*, int64_t, uint64_t*) {
  return absl::UnimplementedError(name() + ": the delta kernels were not built");
}

namespace {

// Waits for a stream's work when it goes out of scope, whatever the way out: host memory its
// queued copies read or write is not freed under them (an error after issuing them).
struct Drain {
  DeviceStream& stream;
  ~Drain() { stream.synchronize().IgnoreError(); }
};

// Device scratch cut into consecutive parts, each 256-byte aligned.
class ScratchParts {
 public:
  // Room for a part of `bytes` (in order of use); then carve() with the same sizes.
  void add(size_t bytes) { total_ += round(bytes); }
  size_t total() const { return total_; }
  std::byte* carve(std::byte* base, size_t bytes) {
    std::byte* p = base + used_;
    used_ += round(bytes);
    return p;
  }

 private:
  static size_t round(size_t n) { return (n + 255) / 256 * 256; }
  size_t total_ = 0, used_ = 0;
};

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

  bool deltaKernels() const override { return stream_->kernels(); }

  // Summaries and leaf hashes on the GPU, placed on the host, records written on the GPU: only the
  // summaries, the leaves and the delta cross to the host.
  StatusOr<std::optional<size_t>> encodeDelta(const std::byte* now, std::byte* base, size_t bytes, size_t unit,
                                              std::byte* out, size_t cap, uint64_t* hash) override {
    std::lock_guard<std::mutex> lock(mu_);
    SC_RETURN_IF_ERROR(checkDeltaArgs(now, base, bytes, unit, "encode"));
    const DeltaPlan plan{static_cast<int64_t>(bytes / unit), static_cast<int32_t>(unit)};
    const auto tiles = static_cast<size_t>(plan.tiles());
    const auto leaves = static_cast<size_t>(hashLeaves(static_cast<int64_t>(bytes)));
    ScratchParts parts;
    parts.add(tiles * sizeof(DeltaTile));
    parts.add(tiles * sizeof(DeltaTilePlace));
    parts.add(leaves * sizeof(uint64_t));
    parts.add(cap);
    SC_ASSIGN_OR_RETURN(std::byte * scratch, stream_->scratch(parts.total()));
    auto* dev_tiles = reinterpret_cast<DeltaTile*>(parts.carve(scratch, tiles * sizeof(DeltaTile)));
    auto* dev_places = reinterpret_cast<DeltaTilePlace*>(parts.carve(scratch, tiles * sizeof(DeltaTilePlace)));
    auto* dev_leaves = reinterpret_cast<uint64_t*>(parts.carve(scratch, leaves * sizeof(uint64_t)));
    std::byte* dev_out = parts.carve(scratch, cap);
    std::vector<DeltaTile> host_tiles(tiles);
    std::vector<uint64_t> host_leaves(leaves);
    const Drain drain{*stream_};  // (declared after what its copies write)
    SC_RETURN_IF_ERROR(stream_->hashLeaves(now, static_cast<int64_t>(bytes), dev_leaves));
    SC_RETURN_IF_ERROR(stream_->deltaTiles(plan, now, base, dev_tiles));
    SC_RETURN_IF_ERROR(stream_->copy(host_tiles.data(), dev_tiles, tiles * sizeof(DeltaTile)));
    SC_RETURN_IF_ERROR(stream_->copy(host_leaves.data(), dev_leaves, leaves * sizeof(uint64_t)));
    SC_RETURN_IF_ERROR(stream_->synchronize());
    *hash = treeHashOfLeaves(host_leaves.data(), static_cast<int64_t>(leaves), static_cast<int64_t>(bytes));
    std::vector<DeltaTilePlace> places(tiles);
    const Drain drain_places{*stream_};
    const int64_t size =
        deltaPlaceTiles(host_tiles.data(), plan.tiles(), plan.unit, places.data(), static_cast<int64_t>(cap));
    if (size < 0) {  // too much changed: the base becomes `now` as it is
      SC_RETURN_IF_ERROR(stream_->copy(base, now, bytes));
      SC_RETURN_IF_ERROR(stream_->synchronize());
      return std::optional<size_t>();
    }
    SC_RETURN_IF_ERROR(stream_->copy(dev_places, places.data(), tiles * sizeof(DeltaTilePlace)));
    SC_RETURN_IF_ERROR(stream_->deltaWrite(plan, now, base, dev_places, dev_out, size));
    if (size > 0) SC_RETURN_IF_ERROR(stream_->copy(out, dev_out, static_cast<size_t>(size)));
    SC_RETURN_IF_ERROR(stream_->synchronize());
    return std::optional<size_t>(static_cast<size_t>(size));
  }

  // Parsed and bounded on the host (a peer's bytes), scattered and hashed on the GPU.
  StatusOr<uint64_t> applyDelta(std::byte* chunk, size_t bytes, size_t unit, const std::byte* delta,
                                size_t delta_bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    SC_RETURN_IF_ERROR(checkDeltaArgs(chunk, chunk, bytes, unit, "apply"));
    std::vector<int64_t> units;
    std::vector<std::byte> values;
    const Drain drain{*stream_};
    SC_RETURN_IF_ERROR(parseDelta(delta, delta_bytes, static_cast<int64_t>(bytes / unit), static_cast<int32_t>(unit),
                                  &units, &values));
    const auto leaves = static_cast<size_t>(hashLeaves(static_cast<int64_t>(bytes)));
    ScratchParts parts;
    parts.add(units.size() * sizeof(int64_t));
    parts.add(values.size());
    parts.add(leaves * sizeof(uint64_t));
    SC_ASSIGN_OR_RETURN(std::byte * scratch, stream_->scratch(parts.total()));
    auto* dev_units = reinterpret_cast<int64_t*>(parts.carve(scratch, units.size() * sizeof(int64_t)));
    std::byte* dev_values = parts.carve(scratch, values.size());
    auto* dev_leaves = reinterpret_cast<uint64_t*>(parts.carve(scratch, leaves * sizeof(uint64_t)));
    if (!units.empty()) {
      SC_RETURN_IF_ERROR(stream_->copy(dev_units, units.data(), units.size() * sizeof(int64_t)));
      SC_RETURN_IF_ERROR(stream_->copy(dev_values, values.data(), values.size()));
      SC_RETURN_IF_ERROR(stream_->deltaScatter(static_cast<int32_t>(unit), chunk, static_cast<int64_t>(bytes),
                                               dev_units, dev_values, static_cast<int64_t>(units.size())));
    }
    return hashAndWait(chunk, bytes, dev_leaves, leaves);
  }

  StatusOr<uint64_t> treeHashOf(const std::byte* data, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!onStream({const_cast<std::byte*>(data), MemoryKind::kCuda, 0, {}}))
      return absl::InvalidArgumentError(strCat(stream_->name(), ": hashes device memory of this GPU only"));
    const auto leaves = static_cast<size_t>(hashLeaves(static_cast<int64_t>(bytes)));
    SC_ASSIGN_OR_RETURN(std::byte * scratch, stream_->scratch(leaves * sizeof(uint64_t) + 1));
    return hashAndWait(data, bytes, reinterpret_cast<uint64_t*>(scratch), leaves);
  }

 private:
  bool onStream(const StridedView& v) const { return v.kind == MemoryKind::kCuda && stream_->local(v.base); }

  Status checkDeltaArgs(const std::byte* a, const std::byte* b, size_t bytes, size_t unit, const char* what) const {
    if (unit == 0 || unit > 8 || (unit & (unit - 1)) != 0 || bytes % unit != 0)
      return absl::InvalidArgumentError(strCat(stream_->name(), ": delta ", what, " of ", bytes, " bytes in units of ",
                                               unit, " (1, 2, 4 or 8, dividing the chunk)"));
    if (!onStream({const_cast<std::byte*>(a), MemoryKind::kCuda, 0, {}}) ||
        !onStream({const_cast<std::byte*>(b), MemoryKind::kCuda, 0, {}}))
      return absl::InvalidArgumentError(strCat(stream_->name(), ": delta ", what, " reads device memory of this GPU"));
    return absl::OkStatus();
  }

  // The tree hash of `bytes` at `data`, its leaves hashed into `leaves` (device scratch), waited for.
  StatusOr<uint64_t> hashAndWait(const std::byte* data, size_t bytes, uint64_t* leaves, size_t count) {
    std::vector<uint64_t> host(count);
    const Drain drain{*stream_};
    SC_RETURN_IF_ERROR(stream_->hashLeaves(data, static_cast<int64_t>(bytes), leaves));
    if (count > 0) SC_RETURN_IF_ERROR(stream_->copy(host.data(), leaves, count * sizeof(uint64_t)));
    SC_RETURN_IF_ERROR(stream_->synchronize());
    return treeHashOfLeaves(host.data(), static_cast<int64_t>(count), static_cast<int64_t>(bytes));
  }

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
