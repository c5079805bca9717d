#include "transport/shm.h"

#include <fcntl.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
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

// Truncation guard. A segment's owner can shrink it at any time; touching the daemon's mapping past
// the new end then raises SIGBUS, on whichever thread touched it (a copy engine, UCX's progress
// thread). Every mapping of an opened segment is registered here; on SIGBUS inside one, the
// handler replaces the whole mapping with private zero pages (mmap MAP_FIXED, a plain syscall) and
// marks it faulted, so the faulting access is retried and completes harmlessly, and checkSize()
// fails from then on: the sync fails naming the rank, the rank must register again, and the
// daemon stays up. A SIGBUS anywhere else goes to the handler installed before ours (UCX's
// backtrace printer, or the default action).
namespace guard {

struct Slot {
  std::atomic<uint64_t> generation{0};  // odd while add() or remove() changes the slot (a seqlock)
  std::atomic<uintptr_t> begin{0};      // 0: free
  std::atomic<size_t> length{0};
  std::atomic<bool> faulted{false};
};
constexpr size_t kSlots = size_t{1} << 16;  // mappings at once; zero pages until used
Slot slots[kSlots];
std::atomic<size_t> used{0};     // slots at or above this were never used
std::atomic<int> in_handler{0};  // handlers running now: remove() waits for them before the unmap
std::mutex mu;                   // add/remove (never taken by the handler)
std::vector<size_t> free_slots;
struct sigaction previous {};

// The slot's range, read consistently (never one mapping's start with another's length).
bool readSlot(const Slot& s, uintptr_t* begin, size_t* length) {
  for (int tries = 0; tries < 64; ++tries) {
    const uint64_t g = s.generation.load(std::memory_order_acquire);
    if (g & 1) continue;
    *begin = s.begin.load(std::memory_order_acquire);
    *length = s.length.load(std::memory_order_acquire);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (s.generation.load(std::memory_order_relaxed) == g) return *begin != 0;
  }
  return false;
}

void onSigbus(int sig, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  in_handler.fetch_add(1, std::memory_order_acq_rel);
  // Only a fault past the end of a mapped file (BUS_ADRERR); a SIGBUS sent by kill() carries a
  // sender, not an address.
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  const size_t n = info->si_code == BUS_ADRERR ? used.load(std::memory_order_acquire) : 0;
  for (size_t i = 0; i < n; ++i) {
    Slot& s = slots[i];
    uintptr_t begin = 0;
    size_t length = 0;
    if (!readSlot(s, &begin, &length) || addr < begin || addr - begin >= length) continue;
    // The raw system call: libc's mmap may be hooked (UCX's memory hooks run callbacks that lock
    // and allocate), which a signal handler must not enter.
    const long p = ::syscall(SYS_mmap, begin, length, PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (p == -1 || static_cast<uintptr_t>(p) != begin) break;
    s.faulted.store(true, std::memory_order_release);
    in_handler.fetch_sub(1, std::memory_order_acq_rel);
    errno = saved_errno;
    return;
  }
  in_handler.fetch_sub(1, std::memory_order_acq_rel);
  errno = saved_errno;
  if ((previous.sa_flags & SA_SIGINFO) && previous.sa_sigaction != nullptr) {
    previous.sa_sigaction(sig, info, context);
    return;
  }
  if (!(previous.sa_flags & SA_SIGINFO) && previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
    previous.sa_handler(sig);
    return;
  }
  if (info->si_code != BUS_ADRERR) return;  // a sent SIGBUS with no handler of its own: ignored, as before us
  ::signal(sig, SIG_DFL);                   // the access faults again and the process dies of it, as without us
}

void install() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = onSigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    if (::sigaction(SIGBUS, &sa, &previous) != 0)
      spdlog::warn("cannot handle SIGBUS ({}): a client truncating its segment mid-sync kills the daemon",
                   std::strerror(errno));
  });
}

// The slot guarding [data, data + size), or -1 when all are taken (the mapping is then unguarded).
int add(void* data, size_t size) {
  install();
  std::lock_guard<std::mutex> lock(mu);
  size_t i;
  if (!free_slots.empty()) {
    i = free_slots.back();
    free_slots.pop_back();
  } else if (used.load() < kSlots) {
    i = used.load();
  } else {
    spdlog::warn("{} shm segments mapped: this one is not guarded against truncation", kSlots);
    return -1;
  }
  slots[i].generation.fetch_add(1, std::memory_order_acq_rel);  // odd: changing
  slots[i].faulted.store(false);
  slots[i].length.store(size, std::memory_order_release);
  slots[i].begin.store(reinterpret_cast<uintptr_t>(data), std::memory_order_release);
  slots[i].generation.fetch_add(1, std::memory_order_acq_rel);  // even: consistent
  if (i == used.load()) used.store(i + 1, std::memory_order_release);
  return static_cast<int>(i);
}

void remove(int slot) {
  if (slot < 0) return;
  std::lock_guard<std::mutex> lock(mu);
  slots[slot].generation.fetch_add(1, std::memory_order_acq_rel);
  slots[slot].begin.store(0, std::memory_order_release);
  slots[slot].generation.fetch_add(1, std::memory_order_acq_rel);
  // A handler that matched this slot before it was cleared may still be remapping it: the caller
  // unmaps only once none runs (handlers are short; this is a few iterations at most).
  while (in_handler.load(std::memory_order_acquire) != 0) std::this_thread::yield();
  free_slots.push_back(static_cast<size_t>(slot));
}

bool faulted(int slot) { return slot >= 0 && slots[slot].faulted.load(std::memory_order_acquire); }

}  // namespace guard

}  // namespace

TruncationGuard::TruncationGuard(void* data, size_t size) : slot_(guard::add(data, size)) {}
TruncationGuard::~TruncationGuard() { guard::remove(slot_); }
bool TruncationGuard::faulted() const { return guard::faulted(slot_); }

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
  if (fd < 0 && (errno == EMFILE || errno == ENFILE))
    return absl::ResourceExhaustedError(
        strCat("shm_open(\"", name, "\"): ", std::strerror(errno),
               ": a descriptor stays open for every shared-memory segment mapped (in shardcastd, every segment "
               "registered with it: each host torch tensor registered in place is one): raise the open-file limit "
               "(ulimit -n, systemd's LimitNOFILE; shardcastd takes the hard limit at start) or register fewer, "
               "larger host tensors"));
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
  ShmSegment out(name, p, size, false, fd);
  out.guard_ = guard::add(p, size);
  out.file_id_ = strCat(st.st_dev, ":", st.st_ino);
  return out;
}

Status ShmSegment::checkSize() const {
  if (fd_ < 0) return absl::OkStatus();
  if (guard::faulted(guard_))
    return absl::FailedPreconditionError(strCat("shm segment \"", name_,
                                                "\" was truncated by its owner while the daemon read or wrote it (",
                                                size_, " bytes registered): register the rank again"));
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
    : name_(std::move(o.name_)),
      data_(o.data_),
      size_(o.size_),
      unlink_(o.unlink_),
      fd_(o.fd_),
      guard_(o.guard_),
      file_id_(std::move(o.file_id_)) {
  o.data_ = nullptr;
  o.unlink_ = false;
  o.fd_ = -1;
  o.guard_ = -1;
}

ShmSegment& ShmSegment::operator=(ShmSegment&& o) noexcept {
  if (this != &o) {
    release();
    name_ = std::move(o.name_);
    data_ = o.data_;
    size_ = o.size_;
    unlink_ = o.unlink_;
    fd_ = o.fd_;
    guard_ = o.guard_;
    file_id_ = std::move(o.file_id_);
    o.data_ = nullptr;
    o.unlink_ = false;
    o.fd_ = -1;
    o.guard_ = -1;
  }
  return *this;
}

ShmSegment::~ShmSegment() { release(); }

void ShmSegment::release() {
  guard::remove(guard_);  // before the unmap: the address range may be reused at once
  guard_ = -1;
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
