// CUDA support through the CUDA runtime API: streams for the copy engine, IPC, pinned memory.
#include "transport/cuda/cuda_support.h"

#include <cuda.h>  // driver API types only: its functions are reached through the runtime (driverEntry)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/strings.h"
#include "transport/copy_engine.h"
#include "transport/cuda/delta_kernels.h"
#include "transport/cuda/fp8_quantize.h"
#include "transport/cuda/strided_copy.h"
#include "transport/device_copy.h"

namespace shardcast::transport {

namespace {

Status cudaStatus(const std::string& what, cudaError_t err) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // a failed call's error stays pending on the thread: clear it, or the next launch reports it
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

// One CUDA stream of one GPU (transport/device_copy.h runs the copy decisions over it).
class CudaStream final : public DeviceStream {
 public:
  CudaStream(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  ~CudaStream() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    if (scratch_ != nullptr) cudaFree(scratch_);
    cudaStreamDestroy(stream_);
  }
  std::string name() const override { return strCat("cuda:", device_); }
  // Device memory of this GPU (an IPC mapping opened here included).
  bool local(const void* p) const override {
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
      cudaGetLastError();  // not a CUDA pointer: clear the error
      return false;
    }
    return attr.type == cudaMemoryTypeDevice && attr.device == device_;
  }
  bool kernels() const override { return stridedCopyKernelBuilt(); }
  Status launch(const StridedCopyPlan& plan, std::byte* dst, const std::byte* src) override {
    SC_RETURN_IF_ERROR(here());
    return cudaStatus("launch", static_cast<cudaError_t>(launchStridedCopyKernel(plan, dst, src, stream_)));
  }
  Status quantize(const Fp8QuantizePlan& plan, std::byte* dst, const std::byte* src) override {
    SC_RETURN_IF_ERROR(here());
    const int launched = launchFp8QuantizeKernel(plan, dst, src, stream_);
    if (launched == kStridedCopyNotBuilt)
      return absl::UnimplementedError("the fp8 quantisation kernel was not built (no nvcc at build time)");
    return cudaStatus("launch", static_cast<cudaError_t>(launched));
  }
  Status deltaTiles(const DeltaPlan& plan, const std::byte* now, const std::byte* base, DeltaTile* tiles) override {
    SC_RETURN_IF_ERROR(here());
    return launched("delta summary", launchDeltaTilesKernel(plan, now, base, tiles, stream_));
  }
  Status deltaWrite(const DeltaPlan& plan, const std::byte* now, std::byte* base, const DeltaTilePlace* places,
                    std::byte* out, int64_t) override {
    SC_RETURN_IF_ERROR(here());
    return launched("delta records", launchDeltaWriteKernel(plan, now, base, places, out, stream_));
  }
  Status deltaScatter(int32_t unit, std::byte* chunk, int64_t, const int64_t* units, const std::byte* values,
                      int64_t count) override {
    SC_RETURN_IF_ERROR(here());
    return launched("delta scatter", launchDeltaScatterKernel(unit, chunk, units, values, count, stream_));
  }
  Status hashLeaves(const std::byte* data, int64_t bytes, uint64_t* leaves) override {
    SC_RETURN_IF_ERROR(here());
    return launched("leaf hash", launchHashLeavesKernel(data, bytes, leaves, stream_));
  }
  Status copy(void* dst, const void* src, size_t n) override {
    SC_RETURN_IF_ERROR(here());
    return cudaStatus("cudaMemcpyAsync", cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream_));
  }
  StatusOr<std::byte*> scratch(size_t n) override {
    if (n <= scratch_bytes_) return scratch_;
    SC_RETURN_IF_ERROR(here());
    size_t want = size_t{1} << 20;
    while (want < n) want *= 2;
    // Released and allocated in stream order: the copies already issued on the old scratch run
    // first (without stream-ordered allocation: after a synchronisation).
    void* p = nullptr;
    cudaError_t err = cudaMallocAsync(&p, want, stream_);
    if (err == cudaErrorNotSupported) {  // no stream-ordered allocator: after the work issued
      cudaGetLastError();
      SC_RETURN_IF_ERROR(cudaStatus("cudaStreamSynchronize", cudaStreamSynchronize(stream_)));
      err = cudaMalloc(&p, want);
      if (err == cudaSuccess && scratch_ != nullptr) cudaFree(scratch_);
    } else if (err == cudaSuccess && scratch_ != nullptr) {
      err = cudaFreeAsync(scratch_, stream_);
    }
    if (err != cudaSuccess && p != nullptr) {  // keep the old scratch; drop the new one
      cudaFree(p);
      return cudaStatus(strCat("device scratch of ", want, " bytes"), err);
    }
    SC_RETURN_IF_ERROR(cudaStatus(strCat("device scratch of ", want, " bytes"), err));
    scratch_ = static_cast<std::byte*>(p);
    scratch_bytes_ = want;
    return scratch_;
  }
  StatusOr<std::shared_ptr<CopyMark>> record() override {
    SC_RETURN_IF_ERROR(here());
    cudaEvent_t e;
    SC_RETURN_IF_ERROR(
        cudaStatus("cudaEventCreate", cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync)));
    if (const cudaError_t err = cudaEventRecord(e, stream_); err != cudaSuccess) {
      cudaEventDestroy(e);
      return cudaStatus("cudaEventRecord", err);
    }
    return std::shared_ptr<CopyMark>(std::make_shared<Event>(e));
  }
  Status synchronize() override {
    SC_RETURN_IF_ERROR(here());
    return cudaStatus("cudaStreamSynchronize", cudaStreamSynchronize(stream_));
  }

 private:
  class Event final : public CopyMark {
   public:
    explicit Event(cudaEvent_t e) : e_(e) {}
    ~Event() override { cudaEventDestroy(e_); }
    Status wait() override { return cudaStatus("cudaEventSynchronize", cudaEventSynchronize(e_)); }

   private:
    cudaEvent_t e_;
  };
  static Status launched(const char* kernel, int result) {
    if (result == kStridedCopyNotBuilt)
      return absl::UnimplementedError(strCat("the ", kernel, " kernel was not built (no nvcc at build time)"));
    return cudaStatus(strCat(kernel, " kernel launch"), static_cast<cudaError_t>(result));
  }
  Status here() const { return cudaStatus(strCat("cudaSetDevice(", device_, ")"), cudaSetDevice(device_)); }

  int device_;
  cudaStream_t stream_;
  std::byte* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
};

}  // namespace

int cudaDeviceCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

std::string cudaDeviceUuid(int device) {
  // Read once per GPU (cudaGetDeviceProperties fills the whole struct): registrations ask per buffer.
  static const std::vector<std::string> uuids = [] {
    std::vector<std::string> out;
    for (int d = 0; d < cudaDeviceCount(); ++d) {
      cudaDeviceProp prop{};
      out.push_back(cudaGetDeviceProperties(&prop, d) == cudaSuccess
                        ? std::string(reinterpret_cast<const char*>(prop.uuid.bytes), sizeof(prop.uuid.bytes))
                        : std::string());
    }
    return out;
  }();
  return device >= 0 && static_cast<size_t>(device) < uuids.size() ? uuids[static_cast<size_t>(device)] : "";
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

namespace {

// A driver API function, reached through the runtime (the daemon never links libcuda directly).
template <typename Fn>
StatusOr<Fn> driverEntry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  SC_RETURN_IF_ERROR(cudaStatus(strCat("cudaGetDriverEntryPointByVersion(", name, ")"),
                                cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found)));
  if (fn == nullptr || found != cudaDriverEntryPointSuccess)
    return absl::InternalError(strCat(name, " is not available in this driver"));
  return reinterpret_cast<Fn>(fn);
}

Status cuStatus(const std::string& what, CUresult rc, absl::StatusCode code = absl::StatusCode::kInternal) {
  if (rc == CUDA_SUCCESS) return absl::OkStatus();
  return Status(code, strCat(what, ": CUresult ", static_cast<int>(rc)));
}

// The cuMem calls an import needs.
struct VmmDriver {
  decltype(&cuMemImportFromShareableHandle) import_handle = nullptr;
  decltype(&cuMemGetAllocationPropertiesFromHandle) properties = nullptr;
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemAddressFree) free_range = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemRelease) release = nullptr;

  static StatusOr<VmmDriver> load() {
    VmmDriver d;
    SC_ASSIGN_OR_RETURN(d.import_handle,
                        driverEntry<decltype(&cuMemImportFromShareableHandle)>("cuMemImportFromShareableHandle"));
    SC_ASSIGN_OR_RETURN(d.properties, driverEntry<decltype(&cuMemGetAllocationPropertiesFromHandle)>(
                                          "cuMemGetAllocationPropertiesFromHandle"));
    SC_ASSIGN_OR_RETURN(d.granularity,
                        driverEntry<decltype(&cuMemGetAllocationGranularity)>("cuMemGetAllocationGranularity"));
    SC_ASSIGN_OR_RETURN(d.reserve, driverEntry<decltype(&cuMemAddressReserve)>("cuMemAddressReserve"));
    SC_ASSIGN_OR_RETURN(d.free_range, driverEntry<decltype(&cuMemAddressFree)>("cuMemAddressFree"));
    SC_ASSIGN_OR_RETURN(d.map, driverEntry<decltype(&cuMemMap)>("cuMemMap"));
    SC_ASSIGN_OR_RETURN(d.unmap, driverEntry<decltype(&cuMemUnmap)>("cuMemUnmap"));
    SC_ASSIGN_OR_RETURN(d.set_access, driverEntry<decltype(&cuMemSetAccess)>("cuMemSetAccess"));
    SC_ASSIGN_OR_RETURN(d.release, driverEntry<decltype(&cuMemRelease)>("cuMemRelease"));
    return d;
  }
};

// Imported allocations mapped into one reserved range; torn down in reverse: unmapped, released,
// the range freed.
class AllocationsMapping final : public CudaIpcMapping {
 public:
  explicit AllocationsMapping(const VmmDriver& d) : d_(d) {}
  ~AllocationsMapping() override {
    for (const auto& [at, n] : mapped_) d_.unmap(base_ + at, n);
    for (const auto h : handles_) d_.release(h);
    if (base_ != 0) d_.free_range(base_, size_);
  }
  void* data() const override { return reinterpret_cast<void*>(static_cast<uintptr_t>(base_)); }
  size_t size() const override { return size_; }

  const VmmDriver& d_;
  std::vector<CUmemGenericAllocationHandle> handles_;
  CUdeviceptr base_ = 0;
  size_t size_ = 0;
  std::vector<std::pair<size_t, size_t>> mapped_;  // (offset, bytes)
};

}  // namespace

StatusOr<std::unique_ptr<CudaIpcMapping>> importCudaAllocations(std::vector<OwnedFd> fds,
                                                                const std::vector<uint64_t>& allocation_bytes,
                                                                int device) {
  if (fds.empty() || fds.size() != allocation_bytes.size())
    return absl::InvalidArgumentError(
        strCat(fds.size(), " descriptors handed over for ", allocation_bytes.size(), " allocation sizes"));
  if (device < 0 || device >= cudaDeviceCount())
    return absl::InvalidArgumentError(strCat("GPU ", device, " of ", cudaDeviceCount()));
  SC_RETURN_IF_ERROR(cudaStatus(strCat("cudaSetDevice(", device, ")"), cudaSetDevice(device)));
  static const StatusOr<VmmDriver> driver = VmmDriver::load();
  if (!driver.ok()) return driver.status();
  const VmmDriver& d = *driver;
  auto out = std::make_unique<AllocationsMapping>(d);
  size_t total = 0, alignment = 0;
  for (size_t i = 0; i < fds.size(); ++i) {
    CUmemGenericAllocationHandle h{};
    SC_RETURN_IF_ERROR(cuStatus(strCat("allocation ", i, ": cuMemImportFromShareableHandle (posix fd)"),
                                d.import_handle(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fds[i].get())),
                                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                                absl::StatusCode::kInvalidArgument));
    out->handles_.push_back(h);
    CUmemAllocationProp prop{};
    SC_RETURN_IF_ERROR(
        cuStatus(strCat("allocation ", i, ": cuMemGetAllocationPropertiesFromHandle"), d.properties(&prop, h)));
    if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != device)
      return absl::InvalidArgumentError(strCat("allocation ", i, " is not memory of GPU ", device, " (location type ",
                                               static_cast<int>(prop.location.type), ", id ", prop.location.id, ")"));
    size_t granularity = 0;
    SC_RETURN_IF_ERROR(cuStatus(strCat("allocation ", i, ": cuMemGetAllocationGranularity"),
                                d.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)));
    const uint64_t n = allocation_bytes[i];
    if (n == 0 || granularity == 0 || n % granularity != 0)
      return absl::InvalidArgumentError(strCat("allocation ", i, ": ", n,
                                               " bytes is not a multiple of the allocation granularity (", granularity,
                                               " bytes)"));
    if (n > SIZE_MAX - total) return absl::InvalidArgumentError("the allocations' sizes overflow");
    total += n;
    alignment = std::max(alignment, granularity);
  }
  fds.clear();  // the imported handles hold the allocations now
  SC_RETURN_IF_ERROR(cuStatus(strCat("cuMemAddressReserve(", total, " bytes)"),
                              d.reserve(&out->base_, total, alignment, 0, 0), absl::StatusCode::kResourceExhausted));
  out->size_ = total;
  size_t at = 0;
  for (size_t i = 0; i < out->handles_.size(); ++i) {
    // cuMemMap fails when the allocation is smaller than the bytes mapped from it: that is where
    // the size the client gave is checked (the driver reports no imported allocation's size).
    SC_RETURN_IF_ERROR(cuStatus(
        strCat("allocation ", i, ": cuMemMap of ", allocation_bytes[i], " bytes (is the allocation that large?)"),
        d.map(out->base_ + at, allocation_bytes[i], 0, out->handles_[i], 0), absl::StatusCode::kInvalidArgument));
    out->mapped_.emplace_back(at, allocation_bytes[i]);
    at += allocation_bytes[i];
  }
  // Readable and writable by the GPU and by the GPUs that can reach it (fan-out copies between a
  // node's GPUs read such memory from another GPU's stream).
  std::vector<CUmemAccessDesc> access;
  for (int g = 0; g < cudaDeviceCount(); ++g) {
    int peer = 0;
    if (g != device && (cudaDeviceCanAccessPeer(&peer, g, device) != cudaSuccess || peer == 0)) {
      cudaGetLastError();
      continue;
    }
    CUmemAccessDesc a{};
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = g;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    access.push_back(a);
  }
  SC_RETURN_IF_ERROR(cuStatus("cuMemSetAccess", d.set_access(out->base_, total, access.data(), access.size())));
  return std::unique_ptr<CudaIpcMapping>(std::move(out));
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

StatusOr<std::unique_ptr<DeviceMemory>> allocateDeviceMemory(int device, size_t size) {
  class Allocation final : public DeviceMemory {
   public:
    Allocation(int device, void* p, size_t n) : device_(device), p_(p), n_(n) {}
    ~Allocation() override {  // on its device, the thread's current one put back
      int current = 0;
      const bool had = cudaGetDevice(&current) == cudaSuccess;
      cudaSetDevice(device_);
      cudaFree(p_);
      if (had) cudaSetDevice(current);
    }
    std::byte* data() const override { return static_cast<std::byte*>(p_); }
    size_t size() const override { return n_; }

   private:
    int device_;
    void* p_;
    size_t n_;
  };
  SC_RETURN_IF_ERROR(cudaStatus(strCat("cudaSetDevice(", device, ")"), cudaSetDevice(device)));
  void* p = nullptr;
  SC_RETURN_IF_ERROR(cudaStatus(strCat("cudaMalloc(", size, ") on GPU ", device), cudaMalloc(&p, size)));
  return std::unique_ptr<DeviceMemory>(std::make_unique<Allocation>(device, p, size));
}

bool cudaPeerAccess(int device, int peer) {
  if (device == peer) return true;
  int can = 0;
  if (cudaDeviceCanAccessPeer(&can, device, peer) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return can != 0;
}

StatusOr<std::unique_ptr<HostPin>> pinHostMemory(void* data, size_t size) {
  class Registered final : public HostPin {
   public:
    explicit Registered(void* p) : p_(p) {}
    ~Registered() override { cudaHostUnregister(p_); }

   private:
    void* p_;
  };
  if (cudaDeviceCount() == 0) return absl::UnavailableError(cudaUnavailableReason());
  const cudaError_t err = cudaHostRegister(data, size, cudaHostRegisterPortable);
  if (err == cudaErrorHostMemoryAlreadyRegistered) {  // pinned already (by UCX's cuda_copy, say): not ours to undo
    cudaGetLastError();
    return std::make_unique<HostPin>();
  }
  SC_RETURN_IF_ERROR(cudaStatus(strCat("cudaHostRegister(", size, " bytes)"), err));
  return std::unique_ptr<HostPin>(std::make_unique<Registered>(data));
}

StatusOr<std::unique_ptr<CopyEngine>> makeCudaCopyEngine(int device) {
  if (cudaDeviceCount() <= device)
    return absl::UnavailableError(strCat("CUDA device ", device, ": ", cudaUnavailableReason()));
  SC_RETURN_IF_ERROR(cudaStatus(strCat("cudaSetDevice(", device, ")"), cudaSetDevice(device)));
  cudaStream_t stream;
  SC_RETURN_IF_ERROR(cudaStatus("cudaStreamCreate", cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)));
  return makeStreamCopyEngine(std::make_unique<CudaStream>(device, stream));
}

}  // namespace shardcast::transport
