#include "transport/shm.h"

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
    return absl::InvalidArgumentError(
        strCat("shm segment name \"", name, "\" must look like \"/name\" (one leading slash, at most 255 chars)"));
  return absl::OkStatus();
}

}  // namespace

StatusOr<ShmSegment> ShmSegment::create(const std::string& name, size_t size, bool unlink_on_close) {
  SC_RETURN_IF_ERROR(checkName(name));
  if (size == 0) return absl::InvalidArgumentError(strCat("shm segment \"", name, "\": size 0"));
  // 0600 whatever the umask: only its owner, and the daemon (root, or CAP_DAC_OVERRIDE, which
  // opens a segment only for the uid that owns it), may map it (docs/security.md).
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return errnoStatus(strCat("shm_open(\"", name, "\", create)"), errno);
  if (::fchmod(fd, 0600) != 0) {
    const int err = errno;
    ::close(fd);
    ::shm_unlink(name.c_str());
    return errnoStatus(strCat("fchmod(\"", name, "\", 0600)"), err);
  }
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
