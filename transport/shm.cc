#include "transport/shm.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <vector>

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
    return absl::InvalidArgumentError(
        strCat("shm segment name \"", name, "\" must look like \"/name\" (one leading slash, at most 255 chars)"));
  return absl::OkStatus();
}

// Reads one byte of every page from kernel mode: writes them to a pipe (1,024 pages per call) and
// drains it. The kernel's own accesses to this memory (a TCP send straight from a rank's buffer)
// then find their page-table entries filled too; see makeResident.
void readPagesFromKernel(const unsigned char* data, size_t size, size_t page) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return;  // an optimisation only: the first sync pays instead
  constexpr size_t kBatch = 1024;            // IOV_MAX; 1 KiB fits the pipe, so writev never blocks
  std::vector<iovec> iov;
  iov.reserve(kBatch);
  char sink[kBatch];
  auto flush = [&] {
    const ssize_t n = ::writev(fds[1], iov.data(), static_cast<int>(iov.size()));
    for (ssize_t got = 0; n > 0 && got < n;) {
      const ssize_t r = ::read(fds[0], sink, static_cast<size_t>(n - got));
      if (r <= 0) break;
      got += r;
    }
    iov.clear();
  };
  for (size_t at = 0; at < size; at += page) {
    iov.push_back({const_cast<unsigned char*>(data) + at, 1});
    if (iov.size() == kBatch) flush();
  }
  if (!iov.empty()) flush();
  ::close(fds[0]);
  ::close(fds[1]);
}

}  // namespace

bool makeResident(void* data, size_t size, const std::string& what) {
  if (size == 0) return true;
  const bool locked = ::mlock(data, size) == 0;
  const int err = errno;
  // One read per page from user mode and one from kernel mode (see shm.h); reading never races
  // with the owner's writes.
  const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const auto* bytes = static_cast<const volatile unsigned char*>(data);
  unsigned char sink = 0;
  for (size_t at = 0; at < size; at += page) sink ^= bytes[at];
  (void)sink;
  readPagesFromKernel(static_cast<const unsigned char*>(data), size, page);
  if (locked) return true;
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true))
    spdlog::warn(
        "cannot lock {} ({} bytes) in memory: {}; idle pages may be unmapped by reclaim and cost page faults in "
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

StatusOr<ShmSegment> ShmSegment::open(const std::string& name, size_t size, std::optional<uid_t> owner) {
  SC_RETURN_IF_ERROR(checkName(name));
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return errnoStatus(strCat("shm_open(\"", name, "\")"), errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return errnoStatus(strCat("fstat(\"", name, "\")"), err);
  }
  if (owner && st.st_uid != *owner) {
    ::close(fd);
    return absl::PermissionDeniedError(strCat("shm segment ", quote(name), " belongs to uid ", st.st_uid,
                                              ", not to uid ", *owner, " (a rank registers only its own memory)"));
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
  if (p == MAP_FAILED) {
    ::close(fd);
    return errnoStatus(strCat("mmap(\"", name, "\", ", size, ")"), err);
  }
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  return ShmSegment(name, p, size, false, fd);
}

Status ShmSegment::checkSize() const {
  if (fd_ < 0) return absl::OkStatus();
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return errnoStatus(strCat("fstat(\"", name_, "\")"), errno);
  if (static_cast<uint64_t>(st.st_size) < size_)
    return absl::FailedPreconditionError(strCat("shm segment \"", name_, "\" was truncated to ", st.st_size,
                                                " bytes while registered with ", size_,
                                                " (its owner resized or freed it)"));
  return absl::OkStatus();
}

void ShmSegment::unlinkName() const {
  if (fd_ < 0) return;
  struct stat ours {
  }, named{};
  const int fd = ::shm_open(name_.c_str(), O_RDONLY, 0);
  if (fd < 0) return;  // already gone
  const bool same = ::fstat(fd_, &ours) == 0 && ::fstat(fd, &named) == 0 && ours.st_ino == named.st_ino &&
                    ours.st_dev == named.st_dev;
  ::close(fd);
  if (same && ::shm_unlink(name_.c_str()) != 0 && errno != ENOENT)
    spdlog::warn("shm_unlink(\"{}\") failed: {}", name_, std::strerror(errno));
}

ShmSegment::ShmSegment(ShmSegment&& o) noexcept
    : name_(std::move(o.name_)), data_(o.data_), size_(o.size_), unlink_(o.unlink_), fd_(o.fd_) {
  o.data_ = nullptr;
  o.unlink_ = false;
  o.fd_ = -1;
}

ShmSegment& ShmSegment::operator=(ShmSegment&& o) noexcept {
  if (this != &o) {
    release();
    name_ = std::move(o.name_);
    data_ = o.data_;
    size_ = o.size_;
    unlink_ = o.unlink_;
    fd_ = o.fd_;
    o.data_ = nullptr;
    o.unlink_ = false;
    o.fd_ = -1;
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
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

}  // namespace shardcast::transport
