#include "transport/shm.h"

#include <atomic>

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/strings.h"

namespace shardcast::transport {

namespace {

Status errnoStatus(const std::string& what, int err) {
  const std::string msg = strCat(what, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(msg);
  if (err == EEXIST) return absl::AlreadyExistsError(msg);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  if (err == EINVAL) return absl::InvalidArgumentError(msg);
  return absl::InternalError(msg);
}

Status checkName(const std::string& name) {
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos || name.size() > 255)
    return absl::InvalidArgumentError(strCat("shm segment name \"", name,
                                             "\" must look like \"/name\" (one leading slash, at most 255 chars)"));
  return absl::OkStatus();
}

}  // namespace

bool makeResident(void* data, size_t size, const std::string& what) {
  if (size == 0) return true;
  const bool locked = ::mlock(data, size) == 0;
  const int err = errno;
  // One read per page: the page tables this process's accesses go through are complete now. Under
  // a hypervisor that shadows guest page tables, MAP_POPULATE and mlock fill only the guest's, and
  // the first touch of each 4 KiB page from this process still traps (~9 us: seconds per GiB,
  // which the first sync would pay otherwise). Reading never races with the owner's writes.
  const long page = ::sysconf(_SC_PAGESIZE);
  const auto* bytes = static_cast<const volatile unsigned char*>(data);
  unsigned char sink = 0;
  for (size_t at = 0; at < size; at += static_cast<size_t>(page)) sink ^= bytes[at];
  sink ^= bytes[size - 1];
  (void)sink;
  if (locked) return true;
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true))
    spdlog::warn("cannot lock {} ({} bytes) in memory: {}; idle pages may be unmapped by reclaim and cost page faults in "
                 "the next sync (give the daemon CAP_IPC_LOCK or raise RLIMIT_MEMLOCK; warned once)",
                 what, size, std::strerror(err));
  return false;
}

StatusOr<ShmSegment> ShmSegment::create(const std::string& name, size_t size, bool unlink_on_close) {
  SC_RETURN_IF_ERROR(checkName(name));
  if (size == 0) return absl::InvalidArgumentError(strCat("shm segment \"", name, "\": size 0"));
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0660);
  if (fd < 0) return errnoStatus(strCat("shm_open(\"", name, "\", create)"), errno);
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    const int err = errno;
    ::close(fd);
    ::shm_unlink(name.c_str());
    return errnoStatus(strCat("ftruncate(\"", name, "\", ", size, ")"), err);
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) {
    ::shm_unlink(name.c_str());
    return errnoStatus(strCat("mmap(\"", name, "\", ", size, ")"), err);
  }
  return ShmSegment(name, p, size, unlink_on_close);
}

StatusOr<ShmSegment> ShmSegment::open(const std::string& name, size_t size) {
  SC_RETURN_IF_ERROR(checkName(name));
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return errnoStatus(strCat("shm_open(\"", name, "\")"), errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return errnoStatus(strCat("fstat(\"", name, "\")"), err);
  }
  if (static_cast<size_t>(st.st_size) < size) {
    ::close(fd);
    return absl::InvalidArgumentError(
        strCat("shm segment \"", name, "\" has ", st.st_size, " bytes but ", size, " were expected"));
  }
  // MAP_POPULATE: the page tables are filled now, in one pass, rather than by one fault per 4 KiB
  // page when a sync first touches the memory (expensive under virtualisation: seconds per GiB).
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) return errnoStatus(strCat("mmap(\"", name, "\", ", size, ")"), err);
  return ShmSegment(name, p, size, false);
}

ShmSegment::ShmSegment(ShmSegment&& o) noexcept
    : name_(std::move(o.name_)), data_(o.data_), size_(o.size_), unlink_(o.unlink_) {
  o.data_ = nullptr;
  o.unlink_ = false;
}

ShmSegment& ShmSegment::operator=(ShmSegment&& o) noexcept {
  if (this != &o) {
    release();
    name_ = std::move(o.name_);
    data_ = o.data_;
    size_ = o.size_;
    unlink_ = o.unlink_;
    o.data_ = nullptr;
    o.unlink_ = false;
  }
  return *this;
}

ShmSegment::~ShmSegment() { release(); }

void ShmSegment::release() {
  if (data_ && ::munmap(data_, size_) != 0)
    spdlog::warn("munmap of shm segment \"{}\" failed: {}", name_, std::strerror(errno));
  data_ = nullptr;
  if (unlink_ && ::shm_unlink(name_.c_str()) != 0)
    spdlog::warn("shm_unlink(\"{}\") failed: {}", name_, std::strerror(errno));
  unlink_ = false;
}

}  // namespace shardcast::transport
