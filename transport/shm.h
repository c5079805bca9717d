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
  // Opened segments: which file it is ("device:inode"; two names of one file give one id), so
  // registrations can tell that two handles name the same memory. "" for created segments.
  const std::string& fileId() const { return file_id_; }

  // Opened segments: fails (FAILED_PRECONDITION) when the owner truncated the segment below the
  // mapped size, so that touching the mapping would raise SIGBUS, or when it did so while the
  // mapping was touched: opened segments are guarded, the SIGBUS is absorbed (the mapping turns
  // into private zero pages, detached from the owner's memory for good) and reported here. Check
  // before every use and after every copy.
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
  int fd_ = -1;     // opened segments: kept for checkSize
  int guard_ = -1;  // opened segments: the truncation guard's slot (shm.cc)
  std::string file_id_;
};

// A shared mapping of a file its owner can shrink under it (an emulated GPU's memfd, standing in
// for a cuMem allocation): registered with the truncation guard that opened segments use, so a
// SIGBUS from touching it past the file's new end turns the range into private zero pages and is
// reported by faulted() instead of ending the process. Remove (destroy) it before unmapping.
class TruncationGuard {
 public:
  TruncationGuard(void* data, size_t size);
  ~TruncationGuard();
  TruncationGuard(const TruncationGuard&) = delete;
  TruncationGuard& operator=(const TruncationGuard&) = delete;
  bool faulted() const;

 private:
  int slot_ = -1;
};

}  // namespace shardcast::transport
