#include "transport/loopback/loopback.h"

#include <poll.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <thread>

#include "common/strings.h"
#include "transport/region_table.h"
#include "transport/task_queue.h"

namespace shardcast::transport {

namespace {

// What outlives a context for as long as a peer's in-flight operation needs it.
struct LoopbackState {
  std::string name;
  Mailbox mailbox;
  TaskQueue& tasks = mailbox.queue();
  RegionTable regions;
  std::mutex handler_mu;
  Context::NotificationHandler handler;
};

std::mutex g_registry_mu;
std::map<std::string, std::weak_ptr<LoopbackState>> g_registry;
std::atomic<uint64_t> g_next_id{1};

std::shared_ptr<LoopbackState> lookup(const std::string& address) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = g_registry.find(address);
  return it == g_registry.end() ? nullptr : it->second.lock();
}

class LoopbackRegion final : public MemoryRegion {
 public:
  LoopbackRegion(std::shared_ptr<LoopbackState> owner, void* data, size_t size, MemoryKind kind)
      : MemoryRegion(kind, data, size), owner_(std::move(owner)) {
    remote_.base = reinterpret_cast<uint64_t>(data);
    remote_.size = size;
  }
  ~LoopbackRegion() override { owner_->regions.remove(data_, size_, kind_); }
  void own(std::shared_ptr<std::byte[]> memory) { memory_ = std::move(memory); }

 private:
  std::shared_ptr<LoopbackState> owner_;
  std::shared_ptr<std::byte[]> memory_;  // set when the backend allocated the memory
};

class LoopbackEndpoint final : public Endpoint {
 public:
  LoopbackEndpoint(std::shared_ptr<LoopbackState> self, std::string peer_address, std::string peer_name)
      : self_(std::move(self)), peer_address_(std::move(peer_address)), peer_name_(std::move(peer_name)) {}

  void write(WriteOp op, Completion done) override {
    std::vector<WriteOp> ops;
    ops.push_back(std::move(op));
    writeBatch(std::move(ops), std::move(done));
  }

  // Runs on this context's thread, in issue order: a later notify sees every earlier write done.
  void writeBatch(std::vector<WriteOp> ops, Completion done) override {
    auto fallback = done;
    const bool posted = self_->mailbox.post([this_ep = this, ops = std::move(ops), done = std::move(done),
                                             closed = closed_]() {
      if (closed->load())
        return done(absl::FailedPreconditionError(strCat("endpoint to peer '", this_ep->peer_name_, "' is closed")));
      auto peer = lookup(this_ep->peer_address_);
      if (!peer)
        return done(
            absl::UnavailableError(strCat("peer '", this_ep->peer_name_, "' (", this_ep->peer_address_, ") is gone")));
      for (const WriteOp& op : ops) {
        if (Status st = checkWriteRanges(op, this_ep->peer_name_); !st.ok()) return done(st);
        // The target's own check, as UCX's active-message handler makes it on arrival: the key
        // open there, the range inside its landing ranges and registered memory; one answer.
        auto landing = peer->regions.admit(op.key, op.dst.base + op.dst_offset, op.length);
        if (!landing)
          return done(absl::AbortedError(strCat("write to peer '", this_ep->peer_name_,
                                                "': write refused by the peer (no open sync attempt of "
                                                "this key lands there)")));
        std::memcpy(reinterpret_cast<void*>(op.dst.base + op.dst_offset),
                    static_cast<const std::byte*>(op.src->data()) + op.src_offset, op.length);
        if (!op.notice.empty()) deliver(peer, op.notice, op.key);
      }
      done(absl::OkStatus());
    });
    if (!posted) fallback(absl::FailedPreconditionError("transport context is shut down"));
  }

  void notify(std::string payload, const WriteKey& key, Completion done) override {
    auto fallback = done;
    const bool posted = self_->mailbox.post([this_ep = this, payload = std::move(payload), key, done = std::move(done),
                                             closed = closed_]() mutable {
      if (closed->load())
        return done(absl::FailedPreconditionError(strCat("endpoint to peer '", this_ep->peer_name_, "' is closed")));
      auto peer = lookup(this_ep->peer_address_);
      if (!peer) return done(absl::UnavailableError(strCat("peer '", this_ep->peer_name_, "' is gone")));
      if (key.empty())
        return done(
            absl::InvalidArgumentError(strCat("notification to peer '", this_ep->peer_name_, "': no write key")));
      // Dropped there unless the key is open, as UCX's handler does.
      if (peer->regions.fenceOpen(key)) deliver(peer, std::move(payload), key);
      done(absl::OkStatus());
    });
    if (!posted) fallback(absl::FailedPreconditionError("transport context is shut down"));
  }

  void close() override { closed_->store(true); }
  bool open() const override { return !closed_->load(); }
  const std::string& peerName() const override { return peer_name_; }

 private:
  // To the peer's notification handler, on the peer's thread.
  static void deliver(const std::shared_ptr<LoopbackState>& peer, std::string payload, const WriteKey& key) {
    peer->mailbox.post([peer, payload = std::move(payload), key]() mutable {
      Context::NotificationHandler handler;
      {
        std::lock_guard<std::mutex> lock(peer->handler_mu);
        handler = peer->handler;
      }
      if (handler) handler(std::move(payload), key);
    });
  }

  std::shared_ptr<LoopbackState> self_;
  std::string peer_address_;
  std::string peer_name_;
  std::shared_ptr<std::atomic<bool>> closed_ = std::make_shared<std::atomic<bool>>(false);
};

class LoopbackContext final : public Context {
 public:
  explicit LoopbackContext(const TransportOptions& options) : state_(std::make_shared<LoopbackState>()) {
    state_->name = options.name;
    address_ = strCat("loopback:", g_next_id++);
    {
      std::lock_guard<std::mutex> lock(g_registry_mu);
      g_registry[address_] = state_;
    }
    thread_ = std::thread([this] { run(); });
  }

  ~LoopbackContext() override {
    {
      std::lock_guard<std::mutex> lock(g_registry_mu);
      g_registry.erase(address_);
    }
    state_->mailbox.shutdown();
    stop_ = true;
    state_->tasks.push([] {});
    thread_.join();
    state_->tasks.drain();  // complete whatever was queued after the thread stopped
  }

  std::string describe() const override { return "loopback"; }
  bool openFence(const WriteKey& key, std::vector<LandingRange> ranges) override {
    return state_->regions.openFence(key, std::move(ranges));
  }
  bool closeFence(const WriteKey& key, std::chrono::milliseconds timeout) override {
    return state_->regions.closeFence(key, timeout);
  }
  std::string address() const override { return address_; }
  bool canAccess(MemoryKind kind) const override { return kind == MemoryKind::kHost; }
  // The target checks every write, and every access is a memcpy of this process.
  Capabilities capabilities() const override { return Capabilities{}; }

  StatusOr<std::shared_ptr<MemoryRegion>> registerMemory(void* data, size_t size, MemoryKind kind) override {
    if (kind != MemoryKind::kHost)
      return absl::FailedPreconditionError("loopback backend: only host memory can be registered");
    if (!data || size == 0) return absl::InvalidArgumentError("registerMemory: null or empty range");
    if (auto existing = state_->regions.find(data, size, kind)) return existing;
    auto r = std::make_shared<LoopbackRegion>(state_, data, size, kind);
    state_->regions.add(r);
    return std::shared_ptr<MemoryRegion>(r);
  }

  StatusOr<std::shared_ptr<MemoryRegion>> allocateMemory(size_t size) override {
    if (size == 0) return absl::InvalidArgumentError("allocateMemory: size 0");
    auto owned = std::shared_ptr<std::byte[]>(new (std::nothrow) std::byte[size]());
    if (!owned) return absl::ResourceExhaustedError(strCat("allocateMemory: ", size, " bytes"));
    auto r = std::make_shared<LoopbackRegion>(state_, owned.get(), size, MemoryKind::kHost);
    r->own(std::move(owned));
    state_->regions.add(r);
    return std::shared_ptr<MemoryRegion>(r);
  }

  StatusOr<std::shared_ptr<Endpoint>> connect(const std::string& peer_address, const std::string& peer_name) override {
    if (!lookup(peer_address))
      return absl::UnavailableError(
          strCat("connect to peer '", peer_name, "': no loopback context at \"", peer_address, "\""));
    std::lock_guard<std::mutex> lock(mu_);
    std::erase_if(endpoints_, [](const auto& entry) { return !entry.second->open(); });
    auto& ep = endpoints_[peer_address];
    if (!ep) ep = std::make_shared<LoopbackEndpoint>(state_, peer_address, peer_name);
    return std::shared_ptr<Endpoint>(ep);
  }

  void setNotificationHandler(NotificationHandler handler) override {
    std::lock_guard<std::mutex> lock(state_->handler_mu);
    state_->handler = std::move(handler);
  }

 private:
  void run() {
    while (!stop_) {
      pollfd p{state_->tasks.fd(), POLLIN, 0};
      ::poll(&p, 1, 100);
      state_->tasks.drain();
    }
  }

  std::shared_ptr<LoopbackState> state_;
  std::string address_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<LoopbackEndpoint>> endpoints_;
  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: joined before the members above go away
};

}  // namespace

Status checkLoopbackOptions(const TransportOptions& options) {
  const auto own = settingsOf(options, "loopback");
  if (!own.empty())
    return absl::InvalidArgumentError(
        strCat("unknown transport setting ", quote("loopback." + own.begin()->first), " (the loopback has none)"));
  return absl::OkStatus();
}

StatusOr<std::unique_ptr<Context>> createLoopbackContext(const TransportOptions& options) {
  return std::unique_ptr<Context>(std::make_unique<LoopbackContext>(options));
}

}  // namespace shardcast::transport
