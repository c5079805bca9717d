// A GPU stream emulated in host memory, for running the CUDA copy engine's code where no GPU is:
// "device" allocations are host buffers the stream knows, kernels are emulated word by word as
// the kernel's threads would copy (emulateStridedCopy), and nothing runs when issued: the work
// queues up per stream and runs, in order, only when a mark of that stream is waited for or it is
// synchronised, as a real stream may run it any time later. A caller that reads bytes before
// waiting sees stale ones; two streams never order each other's work.
#pragma once

#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "transport/cuda/strided_copy.h"
#include "transport/device_copy.h"

namespace shardcast::testing {

class EmulatedDevice {
 public:
  struct Counts {
    int launches = 0, copies = 0, scratch_allocations = 0;
  };

  // A buffer of this emulated GPU's memory (valid while the device lives).
  std::byte* allocate(size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    memory_.push_back(std::make_unique<std::byte[]>(n));
    ranges_[memory_.back().get()] = n;
    return memory_.back().get();
  }
  // A new stream on this device; the engine takes it (the device must outlive it).
  std::unique_ptr<transport::DeviceStream> stream(bool kernels = true) {
    return std::make_unique<Stream>(this, kernels);
  }
  Counts counts() const {
    std::lock_guard<std::mutex> lock(mu_);
    return counts_;
  }
  // Work issued on any stream and not yet run.
  size_t queued() const {
    std::lock_guard<std::mutex> lock(mu_);
    return queued_;
  }

 private:
  class Stream final : public transport::DeviceStream {
   public:
    Stream(EmulatedDevice* d, bool kernels) : d_(d), state_(std::make_shared<State>()), kernels_(kernels) {}
    ~Stream() override { state_->runUntil(UINT64_MAX, d_); }
    std::string name() const override { return "emulated:0"; }
    bool local(const void* p) const override { return d_->local(p); }
    bool kernels() const override { return kernels_; }
    Status launch(const transport::StridedCopyPlan& plan, std::byte* dst, const std::byte* src) override {
      issue([plan, dst, src] { transport::emulateStridedCopy(plan, dst, src); }, &Counts::launches);
      return absl::OkStatus();
    }
    Status copy(void* dst, const void* src, size_t n) override {
      issue([dst, src, n] { std::memcpy(dst, src, n); }, &Counts::copies);
      return absl::OkStatus();
    }
    StatusOr<std::byte*> scratch(size_t n) override {
      if (n > scratch_bytes_) {  // the old one stays allocated: queued work may still use it
        scratch_ = d_->allocate(n);
        scratch_bytes_ = n;
        std::lock_guard<std::mutex> lock(d_->mu_);
        ++d_->counts_.scratch_allocations;
      }
      return scratch_;
    }
    StatusOr<std::shared_ptr<transport::CopyMark>> record() override {
      std::lock_guard<std::mutex> lock(state_->mu);
      return std::shared_ptr<transport::CopyMark>(std::make_shared<Mark>(state_, d_, state_->issued));
    }
    Status synchronize() override {
      state_->runUntil(UINT64_MAX, d_);
      return absl::OkStatus();
    }

   private:
    // The queue, shared with the marks taken on it.
    struct State {
      std::mutex mu;
      std::deque<std::function<void()>> queue;
      uint64_t issued = 0, ran = 0;
      void runUntil(uint64_t at, EmulatedDevice* d) {
        std::lock_guard<std::mutex> lock(mu);
        while (ran < at && !queue.empty()) {
          queue.front()();
          queue.pop_front();
          ++ran;
          std::lock_guard<std::mutex> dl(d->mu_);
          --d->queued_;
        }
      }
    };
    class Mark final : public transport::CopyMark {
     public:
      Mark(std::shared_ptr<State> s, EmulatedDevice* d, uint64_t at) : s_(std::move(s)), d_(d), at_(at) {}
      Status wait() override {
        s_->runUntil(at_, d_);
        return absl::OkStatus();
      }

     private:
      std::shared_ptr<State> s_;
      EmulatedDevice* d_;
      uint64_t at_;
    };
    void issue(std::function<void()> work, int Counts::*counter) {
      {
        std::lock_guard<std::mutex> lock(state_->mu);
        state_->queue.push_back(std::move(work));
        ++state_->issued;
      }
      std::lock_guard<std::mutex> lock(d_->mu_);
      ++d_->queued_;
      ++(d_->counts_.*counter);
    }

    EmulatedDevice* d_;
    std::shared_ptr<State> state_;
    bool kernels_;
    std::byte* scratch_ = nullptr;
    size_t scratch_bytes_ = 0;
  };

  bool local(const void* p) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ranges_.upper_bound(static_cast<const std::byte*>(p));
    if (it == ranges_.begin()) return false;
    --it;
    return static_cast<const std::byte*>(p) < it->first + it->second;
  }

  mutable std::mutex mu_;
  std::vector<std::unique_ptr<std::byte[]>> memory_;
  std::map<const std::byte*, size_t> ranges_;
  size_t queued_ = 0;
  Counts counts_;
};

}  // namespace shardcast::testing
