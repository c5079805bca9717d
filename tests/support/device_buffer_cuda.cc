// Device buffers through the CUDA runtime (tests/support/device_buffer.h).
#include <cuda.h>  // driver API types; the functions through cudaGetDriverEntryPointByVersion
#include <cuda_runtime_api.h>

#include <vector>

#include "common/strings.h"
#include "tests/support/device_buffer.h"

namespace shardcast::testing {

namespace {

Status cudaStatus(const std::string& what, cudaError_t err) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(strCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

class Device final : public DeviceBuffer {
 public:
  Device(void* p, size_t n) : p_(p), n_(n) {}
  ~Device() override { cudaFree(p_); }
  void* data() const override { return p_; }
  size_t size() const override { return n_; }
  StatusOr<std::string> ipcHandle() const override {
    cudaIpcMemHandle_t h;
    SC_RETURN_IF_ERROR(cudaStatus("cudaIpcGetMemHandle", cudaIpcGetMemHandle(&h, p_)));
    return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
  }

 private:
  void* p_;
  size_t n_;
};

template <typename Fn>
StatusOr<Fn> driverEntry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  SC_RETURN_IF_ERROR(cudaStatus(strCat("cudaGetDriverEntryPointByVersion(", name, ")"),
                                cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found)));
  if (fn == nullptr || found != cudaDriverEntryPointSuccess) return absl::InternalError(strCat(name, " is missing"));
  return reinterpret_cast<Fn>(fn);
}

Status cuStatus(const std::string& what, CUresult rc) {
  if (rc == CUDA_SUCCESS) return absl::OkStatus();
  return absl::InternalError(strCat(what, ": CUresult ", static_cast<int>(rc)));
}

class CuMem final : public CuMemBuffer {
 public:
  ~CuMem() override {
    if (unmap_ != nullptr)
      for (size_t i = 0; i < mapped_; ++i) unmap_(base_ + i * granularity_, granularity_);
    if (release_ != nullptr)
      for (const auto h : handles_) release_(h);
    if (free_ != nullptr && base_ != 0) free_(base_, granularity_ * count_);
  }
  void* data() const override { return reinterpret_cast<void*>(static_cast<uintptr_t>(base_)); }
  size_t size() const override { return granularity_ * count_; }
  size_t allocationBytes() const override { return granularity_; }
  StatusOr<std::vector<OwnedFd>> exportFds() const override {
    std::vector<OwnedFd> out;
    for (const auto h : handles_) {
      int fd = -1;
      SC_RETURN_IF_ERROR(
          cuStatus("cuMemExportToShareableHandle", export_(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)));
      out.emplace_back(fd);
    }
    return out;
  }

  decltype(&cuMemUnmap) unmap_ = nullptr;
  decltype(&cuMemRelease) release_ = nullptr;
  decltype(&cuMemAddressFree) free_ = nullptr;
  decltype(&cuMemExportToShareableHandle) export_ = nullptr;
  std::vector<CUmemGenericAllocationHandle> handles_;
  CUdeviceptr base_ = 0;
  size_t granularity_ = 0, count_ = 0, mapped_ = 0;
};

}  // namespace

StatusOr<std::unique_ptr<CuMemBuffer>> allocateCuMem(size_t count, int device) {
  SC_RETURN_IF_ERROR(cudaStatus(strCat("cudaSetDevice(", device, ")"), cudaSetDevice(device)));
  SC_RETURN_IF_ERROR(cudaStatus("cudaFree(0)", cudaFree(nullptr)));  // the primary context, current
  auto m = std::make_unique<CuMem>();
  SC_ASSIGN_OR_RETURN(m->unmap_, driverEntry<decltype(&cuMemUnmap)>("cuMemUnmap"));
  SC_ASSIGN_OR_RETURN(m->release_, driverEntry<decltype(&cuMemRelease)>("cuMemRelease"));
  SC_ASSIGN_OR_RETURN(m->free_, driverEntry<decltype(&cuMemAddressFree)>("cuMemAddressFree"));
  SC_ASSIGN_OR_RETURN(m->export_, driverEntry<decltype(&cuMemExportToShareableHandle)>("cuMemExportToShareableHandle"));
  SC_ASSIGN_OR_RETURN(auto create, driverEntry<decltype(&cuMemCreate)>("cuMemCreate"));
  SC_ASSIGN_OR_RETURN(auto granularity,
                      driverEntry<decltype(&cuMemGetAllocationGranularity)>("cuMemGetAllocationGranularity"));
  SC_ASSIGN_OR_RETURN(auto reserve, driverEntry<decltype(&cuMemAddressReserve)>("cuMemAddressReserve"));
  SC_ASSIGN_OR_RETURN(auto map, driverEntry<decltype(&cuMemMap)>("cuMemMap"));
  SC_ASSIGN_OR_RETURN(auto access, driverEntry<decltype(&cuMemSetAccess)>("cuMemSetAccess"));
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  SC_RETURN_IF_ERROR(cuStatus("cuMemGetAllocationGranularity",
                              granularity(&m->granularity_, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)));
  m->count_ = count;
  SC_RETURN_IF_ERROR(cuStatus("cuMemAddressReserve", reserve(&m->base_, m->granularity_ * count, 0, 0, 0)));
  for (size_t i = 0; i < count; ++i) {
    CUmemGenericAllocationHandle h{};
    SC_RETURN_IF_ERROR(cuStatus("cuMemCreate", create(&h, m->granularity_, &prop, 0)));
    m->handles_.push_back(h);
    SC_RETURN_IF_ERROR(cuStatus("cuMemMap", map(m->base_ + i * m->granularity_, m->granularity_, 0, h, 0)));
    ++m->mapped_;
  }
  CUmemAccessDesc a{};
  a.location = prop.location;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  SC_RETURN_IF_ERROR(cuStatus("cuMemSetAccess", access(m->base_, m->granularity_ * count, &a, 1)));
  return std::unique_ptr<CuMemBuffer>(std::move(m));
}

StatusOr<std::unique_ptr<DeviceBuffer>> allocateDevice(size_t size, int device) {
  SC_RETURN_IF_ERROR(cudaStatus(strCat("cudaSetDevice(", device, ")"), cudaSetDevice(device)));
  void* p = nullptr;
  SC_RETURN_IF_ERROR(cudaStatus(strCat("cudaMalloc(", size, ")"), cudaMalloc(&p, size)));
  return std::unique_ptr<DeviceBuffer>(std::make_unique<Device>(p, size));
}

Status copyToDevice(void* dst, const void* src, size_t n) {
  return cudaStatus("cudaMemcpy H2D", cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice));
}

Status copyFromDevice(void* dst, const void* src, size_t n) {
  return cudaStatus("cudaMemcpy D2H", cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost));
}

}  // namespace shardcast::testing
