#include "transport/emulated_gpus.h"

#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>

#include "common/strings.h"
#include "transport/cuda/delta_kernels.h"
#include "transport/cuda/fp8_quantize.h"
#include "transport/cuda/strided_copy.h"
#include "transport/shm.h"

namespace shardcast::transport {

namespace {
constexpr char kHandlePrefix[] = "shardcast-emulated-gpu:";
constexpr char kSegmentPrefix[] = "/shardcast";  // what Shardcast's clients and tests name theirs
}  // namespace

class EmulatedGpus::Stream final : public DeviceStream {
 public:
  Stream(EmulatedGpus* gpus, int device, bool kernels)
      : gpus_(gpus), device_(device), kernels_(kernels), queue_(std::make_shared<Queue>()) {}
  ~Stream() override { queue_->runUntil(UINT64_MAX, gpus_); }
  std::string name() const override { return strCat("emulated:", device_); }
  bool local(const void* p) const override { return gpus_->onDevice(p, device_); }
  bool kernels() const override { return kernels_; }
  Status launch(const StridedCopyPlan& plan, std::byte* dst, const std::byte* src) override {
    Footprint f;
    const int64_t per_run = plan.run_bytes / plan.word;
    for (int64_t r = 0; r < plan.runs; ++r) {
      int64_t d = 0, s = 0;
      stridedCopyWordOffsets(plan, r * per_run, &d, &s);
      f.writes.emplace_back(address(dst + d), address(dst + d + plan.run_bytes));
      f.reads.emplace_back(address(src + s), address(src + s + plan.run_bytes));
    }
    issue([plan, dst, src] { emulateStridedCopy(plan, dst, src); }, &Counts::launches, std::move(f),
          strCat("a kernel (", plan.runs, " runs of ", plan.run_bytes, " bytes)"));
    return absl::OkStatus();
  }
  Status quantize(const Fp8QuantizePlan& plan, std::byte* dst, const std::byte* src) override {
    if (!kernels_) return DeviceStream::quantize(plan, dst, src);
    if (plan.blocks == 0) return absl::OkStatus();
    Footprint f;
    int64_t s0 = 0, s1 = 0, d0 = 0, d1 = 0;
    fp8QuantizeFootprint(plan, &s0, &s1, &d0, &d1);
    f.writes.emplace_back(address(dst + d0), address(dst + d1));
    f.reads.emplace_back(address(src + s0), address(src + s1));
    issue([plan, dst, src] { emulateFp8Quantize(plan, dst, src); }, &Counts::launches, std::move(f),
          strCat("an fp8 quantisation kernel (", plan.blocks, " blocks)"));
    return absl::OkStatus();
  }
  Status deltaTiles(const DeltaPlan& plan, const std::byte* now, const std::byte* base, DeltaTile* tiles) override {
    if (!kernels_) return DeviceStream::deltaTiles(plan, now, base, tiles);
    const int64_t bytes = plan.units * plan.unit;
    Footprint f;
    f.reads = {{address(now), address(now + bytes)}, {address(base), address(base + bytes)}};
    f.writes = {{address(tiles), address(tiles + plan.tiles())}};
    issue([plan, now, base, tiles] { emulateDeltaTiles(plan, now, base, tiles); }, &Counts::launches, std::move(f),
          strCat("a delta summary kernel (", plan.tiles(), " tiles)"));
    return absl::OkStatus();
  }
  Status deltaWrite(const DeltaPlan& plan, const std::byte* now, std::byte* base, const DeltaTilePlace* places,
                    std::byte* out, int64_t out_bytes) override {
    if (!kernels_) return DeviceStream::deltaWrite(plan, now, base, places, out, out_bytes);
    const int64_t bytes = plan.units * plan.unit;
    Footprint f;
    f.reads = {{address(now), address(now + bytes)}, {address(places), address(places + plan.tiles())}};
    f.writes = {{address(base), address(base + bytes)}, {address(out), address(out + out_bytes)}};
    issue([plan, now, base, places, out] { emulateDeltaWrite(plan, now, base, places, out); }, &Counts::launches,
          std::move(f), strCat("a delta records kernel (", plan.tiles(), " tiles)"));
    return absl::OkStatus();
  }
  Status deltaScatter(int32_t unit, std::byte* chunk, int64_t chunk_bytes, const int64_t* units,
                      const std::byte* values, int64_t count) override {
    if (!kernels_) return DeviceStream::deltaScatter(unit, chunk, chunk_bytes, units, values, count);
    Footprint f;
    f.reads = {{address(units), address(units + count)}, {address(values), address(values + count * unit)}};
    f.writes = {{address(chunk), address(chunk + chunk_bytes)}};
    issue([unit, chunk, units, values, count] { emulateDeltaScatter(unit, chunk, units, values, count); },
          &Counts::launches, std::move(f), strCat("a delta scatter kernel (", count, " units)"));
    return absl::OkStatus();
  }
  Status hashLeaves(const std::byte* data, int64_t bytes, uint64_t* leaves) override {
    if (!kernels_) return DeviceStream::hashLeaves(data, bytes, leaves);
    Footprint f;
    f.reads = {{address(data), address(data + bytes)}};
    f.writes = {{address(leaves), address(leaves + transport::hashLeaves(bytes))}};
    issue([data, bytes, leaves] { emulateHashLeaves(data, bytes, leaves); }, &Counts::launches, std::move(f),
          strCat("a leaf hash kernel (", bytes, " bytes)"));
    return absl::OkStatus();
  }
  Status copy(void* dst, const void* src, size_t n) override {
    Footprint f;
    f.writes.emplace_back(address(dst), address(dst) + n);
    f.reads.emplace_back(address(src), address(src) + n);
    issue([dst, src, n] { std::memcpy(dst, src, n); }, &Counts::copies, std::move(f),
          strCat("a copy of ", n, " bytes"));
    return absl::OkStatus();
  }
  StatusOr<std::byte*> scratch(size_t n) override {
    if (n > scratch_bytes_) {  // the old scratch stays allocated: work queued on it still runs
      scratch_ = gpus_->allocate(device_, n);
      scratch_bytes_ = n;
      gpus_->counted(&Counts::scratch_allocations, 0);
    }
    return scratch_;
  }
  StatusOr<std::shared_ptr<CopyMark>> record() override {
    std::lock_guard<std::mutex> lock(queue_->mu);
    return std::shared_ptr<CopyMark>(std::make_shared<Mark>(queue_, gpus_, queue_->issued));
  }
  Status synchronize() override {
    queue_->runUntil(UINT64_MAX, gpus_);
    return absl::OkStatus();
  }

 private:
  static uintptr_t address(const void* p) { return reinterpret_cast<uintptr_t>(p); }
  // The stream's work, shared with the marks taken on it.
  struct Queue {
    std::mutex mu;
    std::deque<std::function<void()>> work;
    uint64_t issued = 0, ran = 0;
    void runUntil(uint64_t at, EmulatedGpus* gpus) {
      std::lock_guard<std::mutex> lock(mu);
      while (ran < at && !work.empty()) {
        work.front()();
        work.pop_front();
        gpus->done(this, ran++);
        gpus->counted(nullptr, -1);
      }
    }
  };
  class Mark final : public CopyMark {
   public:
    Mark(std::shared_ptr<Queue> q, EmulatedGpus* gpus, uint64_t at) : q_(std::move(q)), gpus_(gpus), at_(at) {}
    Status wait() override {
      q_->runUntil(at_, gpus_);
      return absl::OkStatus();
    }

   private:
    std::shared_ptr<Queue> q_;
    EmulatedGpus* gpus_;
    uint64_t at_;
  };
  void issue(std::function<void()> work, int Counts::*counter, Footprint f, const std::string& what) {
    {
      std::lock_guard<std::mutex> lock(queue_->mu);
      gpus_->queue(queue_.get(), queue_->issued, std::move(f), strCat(what, " on ", name()));
      queue_->work.push_back(std::move(work));
      ++queue_->issued;
    }
    gpus_->counted(counter, 1);
  }

  EmulatedGpus* gpus_;
  int device_;
  bool kernels_;
  std::shared_ptr<Queue> queue_;
  std::byte* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
};

std::string EmulatedGpus::handleOf(const std::string& shm_name) { return kHandlePrefix + shm_name; }

std::string EmulatedGpus::uuidOf(int device) {
  std::string uuid = "shardcast-gpu";
  for (const int shift : {16, 8, 0}) uuid += static_cast<char>((static_cast<uint32_t>(device) >> shift) & 0xff);
  return uuid;
}

std::byte* EmulatedGpus::allocate(int device, size_t n) {
  auto block = std::make_unique<std::byte[]>(n);
  std::byte* p = block.get();
  std::lock_guard<std::mutex> lock(mu_);
  memory_.push_back(std::move(block));
  ranges_[p] = {n, device};
  return p;
}

std::unique_ptr<DeviceStream> EmulatedGpus::stream(int device, bool kernels) {
  return std::make_unique<Stream>(this, device, kernels);
}

EmulatedGpus::Counts EmulatedGpus::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counts_;
}

size_t EmulatedGpus::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queued_;
}

std::string EmulatedGpus::unavailableReason() const { return count_ > 0 ? "" : "no emulated GPUs"; }

StatusOr<std::unique_ptr<CudaIpcMapping>> EmulatedGpus::importHandle(const std::string& handle, size_t size, int device,
                                                                     std::optional<uid_t> owner) {
  if (device < 0 || device >= count_)
    return absl::InvalidArgumentError(strCat("emulated GPU ", device, " of ", count_));
  if (handle.rfind(kHandlePrefix, 0) != 0)
    return absl::InvalidArgumentError(
        strCat("an emulated GPU's IPC handle names a shared-memory segment (\"", kHandlePrefix, "/name\")"));
  const std::string name = handle.substr(sizeof(kHandlePrefix) - 1);
  if (name.rfind(kSegmentPrefix, 0) != 0)
    return absl::PermissionDeniedError(
        strCat("an emulated GPU's memory is a segment named under ", kSegmentPrefix, ", not ", quote(name)));
  SC_ASSIGN_OR_RETURN(auto segment, ShmSegment::open(name, size, owner));
  class Mapping final : public CudaIpcMapping {
   public:
    Mapping(EmulatedGpus* gpus, ShmSegment segment, size_t size)
        : gpus_(gpus), segment_(std::move(segment)), size_(size) {}
    ~Mapping() override { gpus_->removeRange(static_cast<std::byte*>(segment_.data())); }
    void* data() const override { return segment_.data(); }
    size_t size() const override { return size_; }
    Status check() const override { return segment_.checkSize(); }

   private:
    EmulatedGpus* gpus_;
    ShmSegment segment_;
    size_t size_;
  };
  addRange(static_cast<std::byte*>(segment.data()), segment.size(), device);
  return std::unique_ptr<CudaIpcMapping>(std::make_unique<Mapping>(this, std::move(segment), size));
}

StatusOr<std::unique_ptr<CudaIpcMapping>> EmulatedGpus::importAllocations(std::vector<OwnedFd> fds,
                                                                          const std::vector<uint64_t>& allocation_bytes,
                                                                          int device) {
  if (device < 0 || device >= count_)
    return absl::InvalidArgumentError(strCat("emulated GPU ", device, " of ", count_));
  if (fds.empty() || fds.size() != allocation_bytes.size())
    return absl::InvalidArgumentError(
        strCat(fds.size(), " descriptors handed over for ", allocation_bytes.size(), " allocation sizes"));
  const uint64_t granularity = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  uint64_t total = 0;
  for (size_t i = 0; i < fds.size(); ++i) {
    const uint64_t n = allocation_bytes[i];
    if (n == 0 || n % granularity != 0)
      return absl::InvalidArgumentError(strCat("allocation ", i, ": ", n,
                                               " bytes is not a multiple of the allocation granularity (", granularity,
                                               " bytes)"));
    struct stat st {};
    if (::fstat(fds[i].get(), &st) != 0)
      return absl::InvalidArgumentError(strCat("allocation ", i, ": fstat: ", std::strerror(errno)));
    if (static_cast<uint64_t>(st.st_size) < n)
      return absl::InvalidArgumentError(
          strCat("allocation ", i, " has ", st.st_size, " bytes, fewer than the ", n, " it is registered with"));
    if (n > UINT64_MAX - total) return absl::InvalidArgumentError("the allocations' sizes overflow");
    total += n;
  }
  // One reserved range, then each allocation mapped over its part of it (cuMemAddressReserve and
  // cuMemMap): consecutive allocations are consecutive bytes, as in the client's process.
  void* base = ::mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED)
    return absl::ResourceExhaustedError(strCat("reserving ", total, " bytes: ", std::strerror(errno)));
  class Mapping final : public CudaIpcMapping {
   public:
    Mapping(EmulatedGpus* gpus, void* base, size_t size, std::vector<OwnedFd> fds, std::vector<uint64_t> bytes)
        : gpus_(gpus), base_(base), size_(size), fds_(std::move(fds)), bytes_(std::move(bytes)) {}
    ~Mapping() override {
      if (registered_) gpus_->removeRange(static_cast<std::byte*>(base_));
      guards_.clear();  // before the unmap: the range may be reused at once
      ::munmap(base_, size_);
    }
    void* data() const override { return base_; }
    size_t size() const override { return size_; }
    // A memfd can be truncated by its owner, as a segment can (a cuMem allocation cannot shrink).
    Status check() const override {
      for (size_t i = 0; i < fds_.size(); ++i) {
        if (i < guards_.size() && guards_[i]->faulted())
          return absl::FailedPreconditionError(strCat("emulated cuMem allocation ", i,
                                                      " was truncated by its owner while the daemon read or wrote it: "
                                                      "register the rank again"));
        struct stat st {};
        if (::fstat(fds_[i].get(), &st) != 0 || static_cast<uint64_t>(st.st_size) < bytes_[i])
          return absl::FailedPreconditionError(strCat("emulated cuMem allocation ", i, " was truncated to ", st.st_size,
                                                      " bytes (", bytes_[i], " are mapped)"));
      }
      return absl::OkStatus();
    }
    Status map() {
      uint64_t at = 0;
      for (size_t i = 0; i < fds_.size(); ++i) {
        if (::mmap(static_cast<std::byte*>(base_) + at, bytes_[i], PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                   fds_[i].get(), 0) == MAP_FAILED)
          return absl::InvalidArgumentError(strCat("allocation ", i, ": mmap: ", std::strerror(errno)));
        // Its owner can shrink the memfd (a cuMem allocation cannot shrink): guarded as segments are.
        guards_.push_back(std::make_unique<TruncationGuard>(static_cast<std::byte*>(base_) + at, bytes_[i]));
        at += bytes_[i];
      }
      return absl::OkStatus();
    }
    bool registered_ = false;

   private:
    EmulatedGpus* gpus_;
    void* base_;
    size_t size_;
    std::vector<OwnedFd> fds_;
    std::vector<uint64_t> bytes_;
    std::vector<std::unique_ptr<TruncationGuard>> guards_;  // one per allocation, removed before the unmap
  };
  auto mapping = std::make_unique<Mapping>(this, base, total, std::move(fds), allocation_bytes);
  SC_RETURN_IF_ERROR(mapping->map());
  addRange(static_cast<std::byte*>(base), total, device);
  mapping->registered_ = true;
  return std::unique_ptr<CudaIpcMapping>(std::move(mapping));
}

StatusOr<std::unique_ptr<CopyEngine>> EmulatedGpus::makeEngine(int device) {
  if (device < 0 || device >= count_) return absl::UnavailableError(strCat("emulated GPU ", device, " of ", count_));
  return makeStreamCopyEngine(stream(device));
}

StatusOr<std::unique_ptr<HostPin>> EmulatedGpus::pinHost(void*, size_t) {
  counted(&Counts::pins, 0);
  return std::make_unique<HostPin>();
}

StatusOr<std::unique_ptr<DeviceMemory>> EmulatedGpus::allocateDevice(int device, size_t size) {
  if (device < 0 || device >= count_)
    return absl::InvalidArgumentError(strCat("no emulated GPU ", device, " (", count_, " emulated)"));
  class Allocation final : public DeviceMemory {
   public:
    Allocation(EmulatedGpus* gpus, size_t n, int device)
        : gpus_(gpus), block_(std::make_unique<std::byte[]>(std::max<size_t>(n, 1))), n_(n) {
      gpus_->addRange(block_.get(), std::max<size_t>(n, 1), device);
    }
    ~Allocation() override { gpus_->removeRange(block_.get()); }
    std::byte* data() const override { return block_.get(); }
    size_t size() const override { return n_; }

   private:
    EmulatedGpus* gpus_;
    std::unique_ptr<std::byte[]> block_;
    size_t n_;
  };
  return std::unique_ptr<DeviceMemory>(std::make_unique<Allocation>(this, size, device));
}

bool EmulatedGpus::onDevice(const void* p, int device) const {
  const auto* b = static_cast<const std::byte*>(p);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ranges_.upper_bound(b);
  if (it == ranges_.begin()) return false;
  --it;
  return b < it->first + it->second.size && it->second.device == device;
}

std::optional<int> EmulatedGpus::deviceOf(const void* p) const {
  const auto* b = static_cast<const std::byte*>(p);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ranges_.upper_bound(b);
  if (it == ranges_.begin()) return std::nullopt;
  --it;
  if (b >= it->first + it->second.size) return std::nullopt;
  return it->second.device;
}

void EmulatedGpus::addRange(const std::byte* p, size_t n, int device) {
  std::lock_guard<std::mutex> lock(mu_);
  ranges_[p] = {n, device};
}

void EmulatedGpus::removeRange(const std::byte* p) {
  std::lock_guard<std::mutex> lock(mu_);
  ranges_.erase(p);
}

namespace {

using Ranges = std::vector<std::pair<uintptr_t, uintptr_t>>;

void normalise(Ranges* r) {
  std::sort(r->begin(), r->end());
  Ranges merged;
  for (const auto& x : *r) {
    if (x.first == x.second) continue;
    if (!merged.empty() && x.first <= merged.back().second)
      merged.back().second = std::max(merged.back().second, x.second);
    else
      merged.push_back(x);
  }
  *r = std::move(merged);
}

bool overlap(const Ranges& a, const Ranges& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (a[i].second <= b[j].first)
      ++i;
    else if (b[j].second <= a[i].first)
      ++j;
    else
      return true;
  }
  return false;
}

}  // namespace

void EmulatedGpus::queue(const void* stream, uint64_t seq, Footprint f, const std::string& what) {
  normalise(&f.reads);
  normalise(&f.writes);
  std::string hazard;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& q : pending_) {
      if (q.stream == stream) continue;
      if (overlap(f.writes, q.f.writes) || overlap(f.writes, q.f.reads) || overlap(f.reads, q.f.writes)) {
        ++counts_.hazards;
        hazard = strCat(what, " touches bytes that ", q.what,
                        ", still queued, writes or reads: the two streams "
                        "do not order them, so on a GPU they race");
        break;
      }
    }
    pending_.push_back({stream, seq, std::move(f), what});
  }
  if (!hazard.empty() && abort_on_hazard_) {
    spdlog::critical("emulated GPUs: {}", hazard);
    std::abort();
  }
}

void EmulatedGpus::done(const void* stream, uint64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = pending_.begin(); it != pending_.end(); ++it)
    if (it->stream == stream && it->seq == seq) {
      pending_.erase(it);
      return;
    }
}

void EmulatedGpus::counted(int Counts::*counter, int queued_delta) {
  std::lock_guard<std::mutex> lock(mu_);
  if (counter != nullptr) ++(counts_.*counter);
  queued_ = static_cast<size_t>(static_cast<int64_t>(queued_) + queued_delta);
}

namespace {

class EmulatedReach final : public ForwardingContext {
 public:
  EmulatedReach(std::unique_ptr<Context> inner, const EmulatedGpus& gpus, std::set<int> reach)
      : ForwardingContext(std::move(inner)), gpus_(gpus), reach_(std::move(reach)) {}

  std::string describe() const override {
    std::vector<int> gpus;
    for (int d = 0; d < gpus_.deviceCount(); ++d)
      if (reaches(d)) gpus.push_back(d);
    return strCat(inner().describe(), ", reaching emulated GPU memory (GPUs ", strJoin(gpus, ","), ")");
  }
  bool canAccess(MemoryKind) const override { return true; }
  StatusOr<std::shared_ptr<MemoryRegion>> registerMemory(void* data, size_t size, MemoryKind kind) override {
    if (kind == MemoryKind::kHost) return inner().registerMemory(data, size, kind);
    const auto device = size == 0 ? std::nullopt : gpus_.deviceOf(data);
    if (!device || gpus_.deviceOf(static_cast<std::byte*>(data) + size - 1) != device)
      return absl::InvalidArgumentError("registerMemory: device memory that no one emulated GPU holds");
    if (!reaches(*device))
      return absl::FailedPreconditionError(
          strCat("the transport does not reach GPU ", *device, "'s memory (--emulate-gpu-reach)"));
    return inner().registerMemory(data, size, MemoryKind::kHost);  // what emulated device memory is
  }

 private:
  bool reaches(int device) const { return reach_.empty() || reach_.count(device) > 0; }

  const EmulatedGpus& gpus_;
  const std::set<int> reach_;
};

}  // namespace

std::unique_ptr<Context> reachEmulatedGpus(std::unique_ptr<Context> inner, const EmulatedGpus& gpus,
                                           std::set<int> reach) {
  return std::make_unique<EmulatedReach>(std::move(inner), gpus, std::move(reach));
}

}  // namespace shardcast::transport
