#include "daemon/engine/delta.h"

#include <cstring>

#include "common/strings.h"
#include "transport/cuda/delta_kernels.h"

namespace shardcast::daemon {

std::optional<size_t> encodeDelta(const std::byte* now, std::byte* before, size_t bytes, size_t unit, std::byte* out,
                                  size_t cap) {
  if (unit == 0 || unit > 8 || (unit & (unit - 1)) != 0 || bytes % unit != 0) return std::nullopt;
  size_t o = 0;
  size_t next = 0;  // the unit after the last one recorded
  auto record = [&](size_t u) {
    size_t gap = u - next;
    if (o + gap / kDeltaSkip + 1 + unit > cap) return false;
    for (; gap >= kDeltaSkip; gap -= kDeltaSkip) out[o++] = std::byte{kDeltaSkip};
    out[o++] = static_cast<std::byte>(gap);
    std::memcpy(out + o, now + u * unit, unit);
    std::memcpy(before + u * unit, now + u * unit, unit);
    o += unit;
    next = u + 1;
    return true;
  };
  // Most words are equal: compare 8 bytes at a time, units only inside a word that differs.
  size_t b = 0;
  for (; b + 8 <= bytes; b += 8) {
    uint64_t x, y;
    std::memcpy(&x, now + b, 8);
    std::memcpy(&y, before + b, 8);
    if (x == y) continue;
    for (size_t u = b / unit; u < (b + 8) / unit; ++u)
      if (std::memcmp(now + u * unit, before + u * unit, unit) != 0 && !record(u)) return std::nullopt;
  }
  for (size_t u = b / unit; u < bytes / unit; ++u)
    if (std::memcmp(now + u * unit, before + u * unit, unit) != 0 && !record(u)) return std::nullopt;
  return o;
}

Status applyDelta(std::byte* base, size_t bytes, size_t unit, const std::byte* delta, size_t delta_bytes) {
  if (unit == 0 || bytes % unit != 0)
    return absl::InvalidArgumentError(strCat("delta: ", bytes, " bytes are not units of ", unit));
  return transport::forEachDeltaRecord(
      delta, delta_bytes, static_cast<int64_t>(bytes / unit), static_cast<int32_t>(unit),
      [&](int64_t u, const std::byte* value) { std::memcpy(base + static_cast<size_t>(u) * unit, value, unit); });
}

// ---- DeltaBases ----

DeltaBases::Base* DeltaBases::Plan::find(int32_t transfer, int32_t chunk) {
  std::lock_guard<std::mutex> lock(owner_->mu_);
  auto it = bases_.find({transfer, chunk});
  return it == bases_.end() ? nullptr : &it->second;
}

DeltaBases::Base* DeltaBases::Plan::make(int32_t transfer, int32_t chunk, size_t bytes) {
  Released released;  // freed after the lock is let go (device memory: the driver waits for its GPU)
  std::lock_guard<std::mutex> lock(owner_->mu_);
  // Dropped while in use (its plan was evicted): nothing more is kept for it.
  if (auto it = owner_->plans_.find(key_); it == owner_->plans_.end() || it->second.get() != this) return nullptr;
  auto it = bases_.find({transfer, chunk});
  const size_t had = it == bases_.end() || it->second.device ? 0 : it->second.bytes.size();
  if (bytes > had && !owner_->makeRoom(bytes - had, 0, this, &released)) return nullptr;
  Base& b = bases_[{transfer, chunk}];
  owner_->uncount(b);
  released.memory.push_back(std::move(b.device));
  b.gpu = -1;
  b.bytes.resize(bytes);
  owner_->bytes_ += bytes;
  b.fence = 0;
  b.committed = false;
  return &b;
}

DeltaBases::Base* DeltaBases::Plan::makeOnDevice(int32_t transfer, int32_t chunk, size_t bytes, int gpu,
                                                 transport::DeviceRuntime& gpus) {
  Released released;  // freed after the lock is let go
  {
    std::lock_guard<std::mutex> lock(owner_->mu_);
    if (auto it = owner_->plans_.find(key_); it == owner_->plans_.end() || it->second.get() != this) return nullptr;
    auto it = bases_.find({transfer, chunk});
    if (it != bases_.end() && it->second.device && it->second.gpu == gpu && it->second.device->size() == bytes) {
      it->second.fence = 0;  // the same memory, about to hold other bytes
      it->second.committed = false;
      return &it->second;
    }
    // Room for it, the device base it replaces credited. The old base goes now (host or device),
    // and the new one's bytes are reserved while it is allocated without the lock (the driver may
    // take a while).
    const uint64_t replaced = it != bases_.end() && it->second.device ? it->second.device->size() : 0;
    if (!owner_->makeRoom(0, bytes > replaced ? bytes - replaced : 0, this, &released)) return nullptr;
    if (it != bases_.end()) {
      owner_->uncount(it->second);
      released.memory.push_back(std::move(it->second.device));
      bases_.erase(it);
    }
    owner_->device_bytes_ += bytes;
  }
  auto memory = gpus.allocateDevice(gpu, bytes);
  std::lock_guard<std::mutex> lock(owner_->mu_);
  // No memory, or the plan was dropped meanwhile (its bases uncounted, not this reservation).
  if (const auto it = owner_->plans_.find(key_);
      !memory.ok() || it == owner_->plans_.end() || it->second.get() != this) {
    if (memory.ok()) released.memory.push_back(std::move(*memory));
    owner_->device_bytes_ -= bytes;
    return nullptr;
  }
  Base& b = bases_[{transfer, chunk}];  // (only the attempt holding this plan touches its bases)
  b.device = std::move(*memory);
  b.gpu = gpu;
  b.fence = 0;
  b.committed = false;
  return &b;
}

std::shared_ptr<DeltaBases::Plan> DeltaBases::claim(const std::string& key, uint64_t fence) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& p = plans_[key];
  if (!p) {
    p = std::make_shared<Plan>();
    p->owner_ = this;
    p->key_ = key;
    lru_.push_front(key);
  } else {
    lru_.remove(key);
    lru_.push_front(key);
  }
  if (p->claimed_by_ != 0 && p->claimed_by_ != fence) return nullptr;
  p->claimed_by_ = fence;
  return p;
}

void DeltaBases::finish(const std::string& key, uint64_t fence, bool committed) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = plans_.find(key);
  if (it == plans_.end() || it->second->claimed_by_ != fence) return;
  for (auto& [at, b] : it->second->bases_)
    if (b.fence == fence) {
      b.committed = committed;
      if (!committed) b.fence = 0;
    }
  it->second->claimed_by_ = 0;
}

void DeltaBases::drop(const std::string& key) {
  std::shared_ptr<Plan> gone;  // freed after the lock is let go
  std::lock_guard<std::mutex> lock(mu_);
  auto it = plans_.find(key);
  if (it == plans_.end()) return;
  // Not cleared: an attempt using them keeps them (and pointers into them) until it lets go.
  for (const auto& [at, b] : it->second->bases_) uncount(b);
  gone = std::move(it->second);
  plans_.erase(it);
  lru_.remove(key);
}

uint64_t DeltaBases::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

uint64_t DeltaBases::device_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return device_bytes_;
}

void DeltaBases::uncount(const Base& b) {
  if (b.device)
    device_bytes_ -= b.device->size();
  else
    bytes_ -= b.bytes.size();
}

bool DeltaBases::makeRoom(uint64_t bytes, uint64_t device, const Plan* keep, Released* released) {
  if (bytes > capacity_ || device > device_capacity_) return false;
  const auto full = [&] { return bytes_ + bytes > capacity_ || device_bytes_ + device > device_capacity_; };
  for (auto it = lru_.rbegin(); it != lru_.rend() && full();) {
    auto& p = plans_[*it];
    if (p.get() == keep || p->claimed_by_ != 0) {
      ++it;
      continue;
    }
    // Not cleared: a plan unclaimed here may still be held by an attempt that let go of it.
    for (const auto& [at, b] : p->bases_) uncount(b);
    released->plans.push_back(std::move(p));
    plans_.erase(*it);
    it = std::make_reverse_iterator(lru_.erase(std::next(it).base()));
  }
  return !full();
}

}  // namespace shardcast::daemon
