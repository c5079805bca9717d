// POSIX shared-memory segments: how client processes hand host tensors to the daemon (a name, a
// size, and an offset into the segment). Move-only; the mapping is released on destruction and
// the name unlinked when this object created it with unlink_on_close.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <optional>
#include <string>

#include "common/status.h"

namespace shardcast::transport {

// Makes memory the daemon moves bytes through ready for a sync: locks it with mlock(2), so the
// kernel neither reclaims nor unmaps its pages (proactive reclaim, e.g. DAMON's pageout scheme,
// unmaps pages that sat idle between syncs even without swap), and reads every page once from user
// and once from kernel mode, so the first sync does not pay this process's first touch of each
// page (under virtualisation with shadow page tables that costs ~9 us per 4 KiB page and mode even
// after MAP_POPULATE: 2.3 s per GiB and mode on the development VM; one read per page elsewhere).
// `data` is page-aligned (a mapping). Locking needs CAP_IPC_LOCK or a large enough
// RLIMIT_MEMLOCK: without them the memory stays unlocked (still correct, slower after idle
// periods) and one warning per process says so. Returns whether the memory is locked.
bool makeResident(void* data, size_t size, const std::string& what);

class ShmSegment {
 public:
  // Creates (O_EXCL) and maps a new segment of `size` bytes, zero-filled.
  static StatusOr<ShmSegment> create(const std::string& name, size_t size, bool unlink_on_close = true);
  // Maps an existing segment, which must be at least `size` bytes, with its pages mapped in at
  // once (MAP_POPULATE).
  // `owner`: the segment must belong to this uid (PERMISSION_DENIED otherwise; checked on the
  // opened descriptor, so a segment swapped after the check is not the one mapped).
  static StatusOr<ShmSegment> open(const std::string& name, size_t size, std::optional<uid_t> owner = std::nullopt);

  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

  // Opened segments: fails (FAILED_PRECONDITION) when the owner truncated the segment below the
  // mapped size, so that touching the mapping would raise SIGBUS. Check before every use.
  Status checkSize() const;
  // Opened segments: unlinks the name if it still names this segment (not a newer one).
  void unlinkName() const;

 private:
  ShmSegment(std::string name, void* data, size_t size, bool unlink, int fd = -1)
      : name_(std::move(name)), data_(data), size_(size), unlink_(unlink), fd_(fd) {}
  void release();

  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool unlink_ = false;
  int fd_ = -1;  // opened segments: kept for checkSize
};

}  // namespace shardcast::transport
