// CUDA support through the CUDA runtime API (no kernels: copies, IPC, pinned memory).
#include "transport/cuda/cuda_support.h"

#include <cuda_runtime_api.h>

#include <cstring>

#include "common/strings.h"
#include "transport/copy_engine.h"
#include "transport/cuda/strided_copy.h"

namespace shardcast::transport {

namespace {

Status cudaStatus(const std::string& what, cudaError_t err) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(strCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

class IpcMapping final : public CudaIpcMapping {
 public:
  IpcMapping(void* p, size_t n) : p_(p), n_(n) {}
  ~IpcMapping() override { cudaIpcCloseMemHandle(p_); }
  void* data() const override { return p_; }
  size_t size() const override { return n_; }

 private:
  void* p_;
  size_t n_;
};

class Pinned final : public PinnedBuffer {
 public:
  Pinned(void* p, size_t n) : p_(p), n_(n) {}
  ~Pinned() override { cudaFreeHost(p_); }
  void* data() const override { return p_; }
  size_t size() const override { return n_; }

 private:
  void* p_;
  size_t n_;
};

// The alignment both views' bases share (the kernel's word is at most it).
int64_t baseAlignment(const StridedView& dst, const StridedView& src) {
  const auto bits = reinterpret_cast<uintptr_t>(dst.base) | reinterpret_cast<uintptr_t>(src.base);
  int64_t a = 16;
  while (a > 1 && (bits % static_cast<uintptr_t>(a)) != 0) a /= 2;
  return a;
}

class CudaCopyEngine final : public CopyEngine {
 public:
  CudaCopyEngine(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  ~CudaCopyEngine() override { cudaStreamDestroy(stream_); }
  const char* name() const override { return "cuda"; }
  bool canCopy(MemoryKind, MemoryKind) const override { return true; }
  // Device to device with more than one run: one strided-copy kernel launch (a fused buffer's
  // slice, an FSDP row block out of a TP shard) instead of a cudaMemcpyAsync per run, when both
  // buffers are on this engine's GPU (the kernel runs there; another GPU's memory needs peer
  // access it may not have). Anything else (host memory the kernel cannot reach, another GPU, a
  // single run, a box the kernel does not take, a build without it): cudaMemcpyAsync per
  // contiguous run, which reaches any pair.
  Status copy(const StridedView& dst, const StridedView& src, const std::vector<int64_t>& extent,
              int64_t elem_bytes) override {
    cudaError_t err = cudaSetDevice(device_);
    if (err != cudaSuccess) return cudaStatus(strCat("cudaSetDevice(", device_, ")"), err);
    if (dst.kind == MemoryKind::kCuda && src.kind == MemoryKind::kCuda && onThisDevice(dst.base) &&
        onThisDevice(src.base)) {
      const auto plan = planStridedCopy(dst, src, extent, elem_bytes, baseAlignment(dst, src));
      if (plan.ok() && plan->runs > 1) {
        const int launched = launchStridedCopyKernel(*plan, dst.base, src.base, stream_);
        if (launched == cudaSuccess) return absl::OkStatus();
        if (launched != kStridedCopyNotBuilt)
          return cudaStatus(strCat("strided copy kernel (", plan->runs, " runs of ", plan->run_bytes, " bytes, ",
                                   plan->word, "-byte words)"),
                            static_cast<cudaError_t>(launched));
      }
    }
    forEachRun(dst, src, extent, elem_bytes, [&](int64_t d, int64_t s, int64_t n) {
      if (err == cudaSuccess)
        err = cudaMemcpyAsync(dst.base + d, src.base + s, static_cast<size_t>(n), cudaMemcpyDefault, stream_);
    });
    return cudaStatus("cudaMemcpyAsync", err);
  }
  Status synchronize() override { return cudaStatus("cudaStreamSynchronize", cudaStreamSynchronize(stream_)); }

 private:
  // Device memory of this engine's GPU (an IPC mapping opened there included).
  bool onThisDevice(const void* p) const {
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
      cudaGetLastError();  // not a CUDA pointer: clear the error, take the memcpy path
      return false;
    }
    return attr.type == cudaMemoryTypeDevice && attr.device == device_;
  }
  int device_;
  cudaStream_t stream_;
};

}  // namespace

int cudaDeviceCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

std::string cudaUnavailableReason() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) return strCat("cudaGetDeviceCount: ", cudaGetErrorName(err));
  return n == 0 ? "no CUDA device" : "";
}

namespace {

// The allocation holding `ptr`: its base and size (the driver's cuMemGetAddressRange, reached
// through the runtime so that the daemon never links libcuda directly).
StatusOr<std::pair<unsigned long long, size_t>> allocationRange(const void* ptr) {
  using GetAddressRange = int (*)(unsigned long long*, size_t*, unsigned long long);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  SC_RETURN_IF_ERROR(
      cudaStatus("cudaGetDriverEntryPointByVersion(cuMemGetAddressRange)",
                 cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found)));
  if (fn == nullptr || found != cudaDriverEntryPointSuccess)
    return absl::InternalError("cuMemGetAddressRange is not available");
  unsigned long long base = 0;
  size_t size = 0;
  if (const int rc = reinterpret_cast<GetAddressRange>(fn)(&base, &size, reinterpret_cast<uintptr_t>(ptr)); rc != 0)
    return absl::InternalError(strCat("cuMemGetAddressRange: CUresult ", rc));
  return std::make_pair(base, size);
}

}  // namespace

StatusOr<std::unique_ptr<CudaIpcMapping>> importCudaIpcHandle(const std::string& handle, size_t size, int device) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t))
    return absl::InvalidArgumentError(
        strCat("CUDA IPC handle of ", handle.size(), " bytes (expected ", sizeof(cudaIpcMemHandle_t), ")"));
  SC_RETURN_IF_ERROR(cudaStatus(strCat("cudaSetDevice(", device, ")"), cudaSetDevice(device)));
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  SC_RETURN_IF_ERROR(cudaStatus("cudaIpcOpenMemHandle", cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess)));
  // The bytes a registration claims must exist: the allocation behind the handle is at least
  // `size` long (a smaller one would let syncs read and write past it).
  auto range = allocationRange(p);
  if (!range.ok() || range->second < size) {
    cudaIpcCloseMemHandle(p);
    if (!range.ok()) return range.status();
    return absl::InvalidArgumentError(
        strCat("CUDA IPC handle: the allocation has ", range->second, " bytes but ", size, " are registered in it"));
  }
  return std::unique_ptr<CudaIpcMapping>(std::make_unique<IpcMapping>(p, size));
}

StatusOr<ExportedCudaIpc> exportCudaIpcHandle(const void* device_ptr) {
  cudaPointerAttributes attr{};
  SC_RETURN_IF_ERROR(cudaStatus("cudaPointerGetAttributes", cudaPointerGetAttributes(&attr, device_ptr)));
  if (attr.type != cudaMemoryTypeDevice)
    return absl::InvalidArgumentError("a CUDA IPC handle needs device memory from cudaMalloc (this pointer is not)");
  SC_ASSIGN_OR_RETURN(const auto range, allocationRange(device_ptr));
  const unsigned long long ptr = reinterpret_cast<uintptr_t>(device_ptr);
  const unsigned long long base = range.first;
  SC_RETURN_IF_ERROR(cudaStatus("cudaSetDevice", cudaSetDevice(attr.device)));
  cudaIpcMemHandle_t h;
  SC_RETURN_IF_ERROR(cudaStatus("cudaIpcGetMemHandle", cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base))));
  ExportedCudaIpc out;
  out.handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  out.offset = ptr - base;
  out.device = attr.device;
  return out;
}

StatusOr<std::unique_ptr<PinnedBuffer>> allocatePinned(size_t size) {
  void* p = nullptr;
  SC_RETURN_IF_ERROR(cudaStatus(strCat("cudaMallocHost(", size, ")"), cudaMallocHost(&p, size)));
  return std::unique_ptr<PinnedBuffer>(std::make_unique<Pinned>(p, size));
}

StatusOr<std::unique_ptr<CopyEngine>> makeCudaCopyEngine(int device) {
  if (cudaDeviceCount() <= device)
    return absl::UnavailableError(strCat("CUDA device ", device, ": ", cudaUnavailableReason()));
  SC_RETURN_IF_ERROR(cudaStatus(strCat("cudaSetDevice(", device, ")"), cudaSetDevice(device)));
  cudaStream_t stream;
  SC_RETURN_IF_ERROR(cudaStatus("cudaStreamCreate", cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)));
  return std::unique_ptr<CopyEngine>(std::make_unique<CudaCopyEngine>(device, stream));
}

}  // namespace shardcast::transport
