#include "transport/resident.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <vector>

namespace shardcast::transport {

namespace {

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
  // One read per page from user mode and one from kernel mode (see resident.h); reading never races
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

}  // namespace shardcast::transport
