#include "transport/ucx/ucx_context.h"

#include <poll.h>
#include <spdlog/spdlog.h>
#include <ucp/api/ucp.h>
#include <ucs/debug/log_def.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <type_traits>
#include <unordered_map>

#include "common/logging.h"
#include "common/strings.h"
#include "transport/region_table.h"
#include "transport/task_queue.h"
#include "transport/ucx/ucx_options.h"
#include "transport/ucx/wire.h"

namespace shardcast::transport {

namespace {

using Clock = std::chrono::steady_clock;

// Active-message ids; every header is written and read by transport/ucx/wire.h.
constexpr unsigned kAmData = 1;    // header: data header, then its notice; payload: the bytes to place
constexpr unsigned kAmAck = 2;     // header: ack header; payload: error message (if any)
constexpr unsigned kAmNotify = 3;  // header: notify header (the key); payload: the notification

// The one answer a refused write gets, whatever refused it (no key, a closed key, a range outside
// the key's landing ranges, memory not registered): a sender learns nothing about where memory is.
constexpr char kRefused[] = "write refused by the peer (no open sync attempt of this key lands there)";

std::string ucxError(const std::string& what, ucs_status_t st) { return strCat(what, ": ", ucs_status_string(st)); }

Status statusFromUcs(const std::string& what, ucs_status_t st) {
  const std::string msg = ucxError(what, st);
  switch (st) {
    case UCS_ERR_CANCELED:
      return absl::CancelledError(msg);
    case UCS_ERR_TIMED_OUT:
      return absl::DeadlineExceededError(msg);
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_REJECTED:
      return absl::UnavailableError(msg);
    case UCS_ERR_NO_MEMORY:
      return absl::ResourceExhaustedError(msg);
    case UCS_ERR_INVALID_PARAM:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::InternalError(msg);
  }
}

// UCX's own log (ucs_warn and the like: one line per active message of an id nothing handles,
// which any peer can send) goes through spdlog, each line's source location at most once per 10 s
// with a count of those held back, so a flood costs bounded output. UCX's level (UCX_LOG_LEVEL,
// warn by default) still decides what reaches it; its fatal errors bypass handlers (stderr).
ucs_log_func_rc_t ucxLogLine(const char* file, unsigned line, const char*, ucs_log_level_t level,
                             const ucs_log_component_config_t*, const char* format, va_list ap) {
  static LogLimiter limiter;
  uint64_t held = 0;
  if (!limiter.allow(strCat(file, ":", line), &held)) return UCS_LOG_FUNC_RC_STOP;
  std::array<char, 512> text{};
  va_list copy;
  va_copy(copy, ap);
  std::vsnprintf(text.data(), text.size(), format, copy);
  va_end(copy);
  const char* base = std::strrchr(file, '/');
  const std::string more = held ? strCat(" (", held, " more like it in the last 10 s)") : std::string();
  const spdlog::level::level_enum to = level <= UCS_LOG_LEVEL_ERROR  ? spdlog::level::err
                                       : level == UCS_LOG_LEVEL_WARN ? spdlog::level::warn
                                       : level <= UCS_LOG_LEVEL_INFO ? spdlog::level::info
                                                                     : spdlog::level::debug;
  spdlog::log(to, "ucx: {} ({}:{}){}", text.data(), base ? base + 1 : file, line, more);
  return UCS_LOG_FUNC_RC_STOP;  // not UCX's own printer as well
}

// ---- RAII owners of UCX handles (member order in users encodes teardown order) -----------------

struct UcxCore {
  ucp_context_h ctx = nullptr;
  ~UcxCore() {
    if (ctx) ucp_cleanup(ctx);
  }
};

class UcxRegion final : public MemoryRegion {
 public:
  UcxRegion(std::shared_ptr<UcxCore> core, std::shared_ptr<RegionTable> table, void* data, size_t size, MemoryKind kind,
            ucp_mem_h memh)
      : MemoryRegion(kind, data, size), core_(std::move(core)), table_(std::move(table)), memh_(memh) {}
  ~UcxRegion() override {
    table_->remove(data_, size_, kind_);
    const ucs_status_t st = ucp_mem_unmap(core_->ctx, memh_);
    if (st != UCS_OK) spdlog::warn("ucp_mem_unmap of {} bytes at {}: {}", size_, data_, ucs_status_string(st));
  }
  ucp_mem_h memh() const { return memh_; }
  void setRemote(RemoteRegion r) { remote_ = std::move(r); }

 private:
  std::shared_ptr<UcxCore> core_;
  std::shared_ptr<RegionTable> table_;
  ucp_mem_h memh_;
};

class UcxEngine;

// Progress-thread state of one endpoint.
struct EpState {
  UcxEngine* engine = nullptr;
  ucp_ep_h ep = nullptr;
  std::string address;
  std::string name;
  Status error;                    // non-OK once the peer failed or the endpoint closed (progress thread only)
  std::atomic<bool> usable{true};  // error.ok(), for other threads (Endpoint::open)
  // Unpacked remote keys by their packed bytes, destroyed with the endpoint's close.
  struct RkeyDestroy {
    void operator()(ucp_rkey_h k) const { ucp_rkey_destroy(k); }
  };
  std::map<std::string, std::unique_ptr<std::remove_pointer_t<ucp_rkey_h>, RkeyDestroy>> rkeys;
  uint64_t next_seq = 1;
  std::set<uint64_t> incomplete;  // seqs of writes not yet visible at the peer
  struct PendingNotify {
    std::string payload;
    WriteKey key;
    uint64_t after_seq;
    Completion done;
  };
  std::deque<PendingNotify> notifies;
};

struct PendingOp {
  Completion done;
  Status status;
  int remaining = 0;
  Clock::time_point deadline;
  std::shared_ptr<EpState> ep;
  uint64_t seq = 0;
  size_t bytes = 0;
  std::vector<uint64_t> am_writes;  // wire ids of its active-message writes (UcxEngine::am_writes_)
};

// One active-message write, by the id it carries on the wire: random, so that nobody outside the
// sync can name it in an ack. It is done when UCX reports it sent (its source may be reused) and
// its target acked it under the write's own key, whichever comes last, or when the send failed (no
// ack follows). Anything else that claims to ack it (no key, another key, a second ack) is counted
// and dropped: an operation completes once, never early.
struct AmWrite {
  uint64_t op_id = 0;
  WriteKey key;
  bool sent = false;
  bool acked = false;
  Status status;
};

// Wire ids of active-message writes: 64 random bits each from the kernel's CSPRNG, drawn 512 at a
// time (one getrandom per 512 writes).
class WireIds {
 public:
  uint64_t next() {
    if (used_ == ids_.size()) {
      randomBytes(ids_.data(), sizeof(ids_));
      used_ = 0;
    }
    return ids_[used_++];
  }

 private:
  std::array<uint64_t, 512> ids_{};
  size_t used_ = ids_.size();
};

// The per-request callback context: which engine and operation a UCX request belongs to.
struct RequestCtx {
  UcxEngine* engine = nullptr;
  uint64_t op_id = 0;              // 0: no operation to account (acks, notifications)
  bool data = false;               // an AM write (wire_id), done once sent and acked
  uint64_t wire_id = 0;            // sender side: the AM write's id on the wire (am_writes_)
  std::string header{};            // the AM header (wire.h), kept alive until sent
  std::string payload{};           // notification / ack message bytes kept alive until sent; receiver: a write's notice
  Completion done{};               // notifications
  ucp_ep_h reply_ep = nullptr;     // receiver side: where to ack a rendezvous receive
  WriteKey key{};                  // receiver side: the key a write's notice is delivered under
  RegionTable::Landing landing{};  // receiver side: the write's fence and target region, held until it is in
  bool* ran_inline = nullptr;      // set while issue() waits for UCX's call: its callback ran inside it
};

// A request's context belongs to the code that made it until UCX holds the request: a pointer that
// is neither NULL (done at once, no callback) nor an error. From then on the request's callback
// owns it and frees it (Callbacks below). Every other way out frees it with its owner.
using RequestCtxPtr = std::unique_ptr<RequestCtx>;

// Hands `ctx` over to the callback of `req` when `req` is in flight; true then.
bool handOver(ucs_status_ptr_t req, RequestCtxPtr& ctx) {
  if (req == nullptr || UCS_PTR_IS_ERR(req)) return false;
  static_cast<void>(ctx.release());  // the callback's now
  return true;
}

// Makes UCX's call (a ucp_*_nbx whose user data is ctx). UCX may complete the request inside the
// call, its callback run before the call returns (a send on an endpoint that failed, even with
// UCP_OP_ATTR_FLAG_NO_IMM_CMPL): the callback then did everything and freed ctx and the request,
// and this returns nothing. Else UCX's status pointer, ctx still the caller's (handOver).
template <class Call>
std::optional<ucs_status_ptr_t> issue(RequestCtxPtr& ctx, Call&& call) {
  bool ran_inline = false;
  ctx->ran_inline = &ran_inline;
  RequestCtx* raw = ctx.release();  // the callback's while UCX holds the call
  const ucs_status_ptr_t req = call();
  if (ran_inline) return std::nullopt;
  raw->ran_inline = nullptr;
  ctx.reset(raw);
  return req;
}

// Frees a UCX request (when there is one) as its callback returns.
struct RequestRelease {
  void* request;
  ~RequestRelease() {
    if (request) ucp_request_free(request);
  }
};

class UcxEndpoint;

class UcxEngine {
 public:
  UcxEngine(TransportOptions options, std::shared_ptr<UcxCore> core, ucp_worker_h worker, Protocol protocol,
            bool peer_failure)
      : options_(std::move(options)),
        core_(std::move(core)),
        worker_(worker),
        protocol_(protocol),
        peer_failure_(peer_failure),
        regions_(std::make_shared<RegionTable>()) {}

  Status start();
  void stop();
  ~UcxEngine();

  const TransportOptions& options() const { return options_; }
  Protocol protocol() const { return protocol_; }
  const std::string& address() const { return address_; }
  std::shared_ptr<UcxCore> core() const { return core_; }
  std::shared_ptr<RegionTable> regions() const { return regions_; }
  Mailbox& mailbox() { return mailbox_; }

  void setHandler(Context::NotificationHandler h) {
    std::lock_guard<std::mutex> lock(handler_mu_);
    handler_ = std::move(h);
  }

  // ---- progress thread only ----
  StatusOr<std::shared_ptr<EpState>> openEndpoint(const std::string& address, const std::string& name);
  void submitWrites(const std::shared_ptr<EpState>& ep, std::vector<WriteOp> ops, Completion done);
  void submitNotify(const std::shared_ptr<EpState>& ep, std::string payload, const WriteKey& key, Completion done);
  void closeEndpoint(const std::shared_ptr<EpState>& ep, bool force);

 private:
  friend struct Callbacks;
  void run();
  bool progressUntilQuiet();
  void partDone(uint64_t op_id, const Status& st);
  void finishOp(uint64_t op_id);
  void amWriteSent(uint64_t wire_id, const Status& st);
  void amWriteDone(std::unordered_map<uint64_t, AmWrite>::iterator it);
  // quiet: an intentional close (logged at debug), not a failure.
  void failEndpoint(EpState& ep, const Status& st, bool quiet = false);
  void flushNotifies(EpState& ep);
  void sendNotify(EpState& ep, std::string payload, const WriteKey& key, Completion done);
  void checkDeadlines();
  void sendAck(ucp_ep_h reply_ep, uint64_t op_id, const Status& st, const WriteKey& key);
  StatusOr<ucp_rkey_h> rkeyFor(EpState& ep, const std::string& packed);
  ucs_status_t onData(const void* header, size_t header_length, void* data, size_t length,
                      const ucp_am_recv_param_t* param);
  ucs_status_t onAck(const void* header, size_t header_length, void* data, size_t length);
  ucs_status_t onNotify(const void* header, size_t header_length, void* data, size_t length,
                        const ucp_am_recv_param_t* param);
  void deliver(std::string payload, const WriteKey& key);  // to the notification handler
  void warnRefused(const std::string& what);               // rate-limited: peers are untrusted

  TransportOptions options_;
  std::shared_ptr<UcxCore> core_;
  ucp_worker_h worker_;
  Protocol protocol_;  // put or am (auto resolved at creation)
  bool peer_failure_;  // ask UCX for peer-failure detection (network transports have it)
  std::shared_ptr<RegionTable> regions_;
  std::string address_;
  int efd_ = -1;
  size_t max_am_header_ = 0;  // a notice travels in its write's header when that fits in this
  Mailbox mailbox_;
  std::mutex handler_mu_;
  Context::NotificationHandler handler_;
  uint64_t refused_ = 0;  // messages refused or dropped (progress thread only)
  // Progress thread state.
  std::unordered_map<uint64_t, PendingOp> ops_;
  uint64_t next_op_ = 1;  // local only: the wire names an AM write by its own random id
  std::unordered_map<uint64_t, AmWrite> am_writes_;
  WireIds wire_ids_;
  uint64_t second_acks_ = 0;  // acks of an AM write that was acked already (dropped)
  std::vector<std::shared_ptr<EpState>> endpoints_;
  bool stopping_ = false;  // progress thread only
  std::atomic<bool> stopped_{false};
  std::thread thread_;
};

// C callbacks: UCX calls them on the progress thread, from inside ucp_worker_progress.
struct Callbacks {
  static void onSend(void* request, ucs_status_t st, void* user) {
    const RequestRelease release{request};
    const RequestCtxPtr ctx(static_cast<RequestCtx*>(user));
    if (ctx->ran_inline) *ctx->ran_inline = true;
    if (ctx->data) {
      // An AM write: done once its ack came too (or now, if the send failed).
      ctx->engine->amWriteSent(ctx->wire_id, st == UCS_OK ? Status() : statusFromUcs("send", st));
    } else if (ctx->op_id) {
      // A put or a flush: complete once sent.
      ctx->engine->partDone(ctx->op_id, st == UCS_OK ? Status() : statusFromUcs("send", st));
    } else if (ctx->done) {
      ctx->done(st == UCS_OK ? Status() : statusFromUcs("notification", st));
    }
  }
  static void onRecvData(void* request, ucs_status_t st, size_t, void* user) {
    const RequestRelease release{request};
    const RequestCtxPtr ctx(static_cast<RequestCtx*>(user));
    if (ctx->ran_inline) *ctx->ran_inline = true;
    if (st == UCS_OK && !ctx->payload.empty()) ctx->engine->deliver(std::move(ctx->payload), ctx->key);
    // A receive that failed with its connection (the peer timed out, reset or cancelled it) is not
    // acked: the reply endpoint is failed, UCX may already have released it, and a send on it
    // crashed the daemon under partitions; the sender's write fails with the same connection.
    if (connectionLost(st)) return;
    ctx->engine->sendAck(ctx->reply_ep, ctx->op_id, st == UCS_OK ? Status() : statusFromUcs("receive", st), ctx->key);
  }
  static bool connectionLost(ucs_status_t st) {
    switch (st) {
      case UCS_ERR_ENDPOINT_TIMEOUT:
      case UCS_ERR_CONNECTION_RESET:
      case UCS_ERR_CANCELED:
      case UCS_ERR_UNREACHABLE:
      case UCS_ERR_NOT_CONNECTED:
      case UCS_ERR_IO_ERROR:
      case UCS_ERR_REJECTED:
        return true;
      default:
        return false;
    }
  }
  static ucs_status_t onAmData(void* arg, const void* header, size_t hlen, void* data, size_t len,
                               const ucp_am_recv_param_t* param) {
    return static_cast<UcxEngine*>(arg)->onData(header, hlen, data, len, param);
  }
  static ucs_status_t onAmAck(void* arg, const void* header, size_t hlen, void* data, size_t len,
                              const ucp_am_recv_param_t*) {
    return static_cast<UcxEngine*>(arg)->onAck(header, hlen, data, len);
  }
  static ucs_status_t onAmNotify(void* arg, const void* header, size_t hlen, void* data, size_t len,
                                 const ucp_am_recv_param_t* param) {
    return static_cast<UcxEngine*>(arg)->onNotify(header, hlen, data, len, param);
  }
  static void onEpError(void* arg, ucp_ep_h, ucs_status_t st) {
    auto* ep = static_cast<EpState*>(arg);
    ep->engine->failEndpoint(*ep,
                             absl::UnavailableError(ucxError(strCat("peer '", ep->name, "': connection lost"), st)));
  }
};

Status UcxEngine::start() {
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS | UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
  ucs_status_t st = ucp_worker_query(worker_, &attr);
  if (st != UCS_OK) return statusFromUcs("ucp_worker_query", st);
  address_.assign(static_cast<const char*>(static_cast<void*>(attr.address)), attr.address_length);
  max_am_header_ = attr.max_am_header;
  ucp_worker_release_address(worker_, attr.address);
  st = ucp_worker_get_efd(worker_, &efd_);
  if (st != UCS_OK) return statusFromUcs("ucp_worker_get_efd", st);
  struct Handler {
    unsigned id;
    ucp_am_recv_callback_t cb;
  };
  for (const Handler& h : {Handler{kAmData, &Callbacks::onAmData}, Handler{kAmAck, &Callbacks::onAmAck},
                           Handler{kAmNotify, &Callbacks::onAmNotify}}) {
    ucp_am_handler_param_t p{};
    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                   UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    p.id = h.id;
    p.cb = h.cb;
    p.arg = this;
    p.flags = UCP_AM_FLAG_WHOLE_MSG;
    st = ucp_worker_set_am_recv_handler(worker_, &p);
    if (st != UCS_OK) return statusFromUcs("ucp_worker_set_am_recv_handler", st);
  }
  thread_ = std::thread([this] { run(); });
  return absl::OkStatus();
}

void UcxEngine::run() {
  int idle = 0;
  auto last_deadline_check = Clock::now();
  while (!stopped_) {
    // Progress before running tasks as well as after: a task touches the worker (creates, closes
    // and sends on endpoints), and must never run between a progress call and the work UCX
    // deferred from it to the next one (see progressUntilQuiet).
    bool busy = progressUntilQuiet();
    if (mailbox_.queue().drain() > 0) {
      busy = true;
      progressUntilQuiet();
    }
    const auto now = Clock::now();
    if (now - last_deadline_check > std::chrono::milliseconds(10)) {
      checkDeadlines();
      last_deadline_check = now;
    }
    if (stopping_ && !stopped_) {
      bool all_closed = true;
      for (const auto& ep : endpoints_) all_closed = all_closed && ep->ep == nullptr;
      if (all_closed) stopped_ = true;
    }
    if (busy) {
      idle = 0;
      continue;
    }
    // Spin briefly (latency), then sleep on the worker's event fd and the task queue: for 10 ms
    // while operations are in flight (their deadlines are checked), else until something happens
    // (every new operation and stop() come through the queue; 200 ms at most). An idle daemon
    // wakes 5 times a second, not 100 (64 daemons on 2 cores spent a fifth of the CPU here).
    if (++idle < 64) continue;
    if (ucp_worker_arm(worker_) != UCS_OK) continue;
    pollfd fds[2] = {{efd_, POLLIN, 0}, {mailbox_.queue().fd(), POLLIN, 0}};
    ::poll(fds, 2, ops_.empty() && !stopping_ ? 200 : 10);
  }
}

// UCX defers some work to the next progress call through one-shot callbacks, and the call that
// registers one may report no progress: UCX 1.13's TCP transport marks a receive-only endpoint
// whose peer vanished as failed and destroys it from the next call, asserting that it has not
// gained a send side meanwhile. The chaos soak once aborted a daemon on that assertion
// (tcp_ep.c:478, `!(ep->flags & UCT_TCP_EP_FLAG_CTX_TYPE_TX)`, on a receiver whose sender was
// killed) after the idle sleep grew to 200 ms, with tasks running before the deferred destroy.
// So progress until two calls in a row report nothing (the first quiet call runs whatever the
// last busy one deferred), and again before any task runs.
bool UcxEngine::progressUntilQuiet() {
  bool busy = false;
  for (int quiet = 0; quiet < 2;) {
    if (ucp_worker_progress(worker_) != 0) {
      busy = true;
      quiet = 0;
    } else {
      ++quiet;
    }
  }
  return busy;
}

void UcxEngine::stop() {
  if (!thread_.joinable()) return;
  mailbox_.shutdown();
  // Close every endpoint gracefully on the progress thread; force whatever is left after 2 s.
  mailbox_.queue().push([this] {
    stopping_ = true;
    for (auto& ep : endpoints_) closeEndpoint(ep, false);
  });
  const auto give_up = Clock::now() + std::chrono::seconds(2);
  while (!stopped_ && Clock::now() < give_up) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (!stopped_) {
    mailbox_.queue().push([this] {
      for (auto& ep : endpoints_) closeEndpoint(ep, true);
      stopped_ = true;
    });
  }
  thread_.join();
  // Operations still pending can no longer complete.
  auto pending = std::move(ops_);
  for (auto& [id, op] : pending)
    if (op.done) op.done(absl::CancelledError("transport context shut down"));
}

UcxEngine::~UcxEngine() {
  stop();
  if (worker_) ucp_worker_destroy(worker_);
}

StatusOr<std::shared_ptr<EpState>> UcxEngine::openEndpoint(const std::string& address, const std::string& name) {
  auto state = std::make_shared<EpState>();
  state->engine = this;
  state->address = address;
  state->name = name;
  ucp_ep_params_t p{};
  p.field_mask =
      UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.address = reinterpret_cast<const ucp_address_t*>(address.data());
  p.err_mode = peer_failure_ ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  p.err_handler.cb = &Callbacks::onEpError;
  p.err_handler.arg = state.get();
  ucs_status_t st = ucp_ep_create(worker_, &p, &state->ep);
  if (st == UCS_ERR_UNREACHABLE) {
    // Some transports (UCX 1.13's shared memory) have no peer-failure handler: connect without
    // one. A vanished peer is then detected by the operation timeout instead.
    p.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    st = ucp_ep_create(worker_, &p, &state->ep);
    if (st == UCS_OK)
      spdlog::debug("transport '{}': peer '{}' reached without peer-failure detection", options_.name, name);
  }
  if (st != UCS_OK) return statusFromUcs(strCat("connect to peer '", name, "'"), st);
  // Endpoints whose peer failed are closed now (their operations have all failed), closed ones
  // forgotten: a long-lived daemon whose peers come and go keeps only the live ones.
  for (auto& old : endpoints_)
    if (old->ep && !old->error.ok()) closeEndpoint(old, true);
  std::erase_if(endpoints_, [](const std::shared_ptr<EpState>& e) { return e->ep == nullptr; });
  endpoints_.push_back(state);
  return state;
}

StatusOr<ucp_rkey_h> UcxEngine::rkeyFor(EpState& ep, const std::string& packed) {
  auto it = ep.rkeys.find(packed);
  if (it != ep.rkeys.end()) return it->second.get();
  ucp_rkey_h rkey = nullptr;
  const ucs_status_t st = ucp_ep_rkey_unpack(ep.ep, packed.data(), &rkey);
  if (st != UCS_OK) return statusFromUcs(strCat("peer '", ep.name, "': unpack remote key"), st);
  ep.rkeys.emplace(packed, rkey);  // owned from here
  return rkey;
}

// One function, over 80 lines, by design: UCX may finish the operation from inside any of its
// calls here (an endpoint failing), so the operation is looked up again before each UCX call, and
// every part is issued in one place that sees that rule.
void UcxEngine::submitWrites(const std::shared_ptr<EpState>& ep, std::vector<WriteOp> ops, Completion done) {
  if (!ep->error.ok()) return done(ep->error);
  for (const WriteOp& w : ops)
    if (auto checked = checkWriteRanges(w, ep->name); !checked.ok()) return done(checked);
  const uint64_t id = next_op_++;
  PendingOp& op = ops_[id];
  op.done = std::move(done);
  op.deadline = Clock::now() + options_.op_timeout;
  op.ep = ep;
  op.seq = ep->next_seq++;
  ep->incomplete.insert(op.seq);
  op.remaining = 1;  // held until every part is issued, so that an early completion cannot finish it
  for (const WriteOp& w : ops) op.bytes += w.length;
  // Notices that cannot ride in their write's header (put, or too long for it) follow as
  // notifications once this operation succeeded (never for a failed write); the caller's
  // completion then waits for them too.
  std::vector<std::pair<std::string, WriteKey>> follow;
  for (WriteOp& w : ops)
    if (!w.notice.empty() &&
        (protocol_ == Protocol::kPut || w.length == 0 || ucx_wire::kDataHeaderBytes + w.notice.size() > max_am_header_))
      follow.emplace_back(std::move(w.notice), w.key);
  if (!follow.empty()) {
    struct Join {
      size_t left;
      Status status;
      Completion done;
    };
    auto join = std::make_shared<Join>(Join{follow.size() + 1, Status(), std::move(op.done)});
    auto part = [join](Status st) {
      if (!st.ok() && join->status.ok()) join->status = st;
      if (--join->left == 0 && join->done) join->done(join->status);
    };
    // Runs in finishOp, which sends the queued notifications next (or at shutdown, failed).
    op.done = [ep, seq = op.seq, follow = std::move(follow), part](Status st) mutable {
      for (auto& [n, key] : follow) {
        if (st.ok())
          ep->notifies.push_back({std::move(n), key, seq, part});
        else
          part(st);
      }
      part(st);
    };
  }
  // UCX may report the endpoint failed from inside a send call; failEndpoint then finishes this
  // operation at once. So the operation is looked up again before each part, never through a
  // reference held across a UCX call, and no further part is issued once it is finished.
  auto hold = [this, id]() {
    auto it = ops_.find(id);
    if (it == ops_.end()) return false;
    ++it->second.remaining;
    return true;
  };
  for (const WriteOp& w : ops) {
    if (w.length == 0) continue;
    if (!hold()) return;
    auto* region = static_cast<UcxRegion*>(w.src.get());
    void* src = static_cast<std::byte*>(w.src->data()) + w.src_offset;
    auto ctx = std::make_unique<RequestCtx>(RequestCtx{.engine = this, .op_id = id});
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH |
                      UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    rp.cb.send = &Callbacks::onSend;
    rp.user_data = ctx.get();
    rp.memh = region->memh();
    std::optional<ucs_status_ptr_t> issued;
    if (protocol_ == Protocol::kPut) {
      auto rkey = rkeyFor(*ep, w.dst.rkey);
      if (!rkey.ok()) {
        partDone(id, rkey.status());
        continue;
      }
      issued = issue(ctx, [&] { return ucp_put_nbx(ep->ep, src, w.length, w.dst.base + w.dst_offset, *rkey, &rp); });
    } else {
      uint64_t wire_id = wire_ids_.next();
      while (wire_id == 0 || am_writes_.count(wire_id)) wire_id = wire_ids_.next();
      am_writes_.emplace(wire_id, AmWrite{.op_id = id, .key = w.key, .sent = false, .acked = false, .status = {}});
      ops_.find(id)->second.am_writes.push_back(wire_id);  // there: hold() found it
      ctx->data = true;
      ctx->wire_id = wire_id;
      ctx->header = ucx_wire::encodeData(wire_id, w.dst.base + w.dst_offset, w.length, w.key, w.notice);
      rp.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
      rp.flags = UCP_AM_SEND_FLAG_REPLY;
      const std::string& header = ctx->header;
      issued = issue(
          ctx, [&] { return ucp_am_send_nbx(ep->ep, kAmData, header.data(), header.size(), src, w.length, &rp); });
    }
    if (!issued) continue;  // completed inside the call: its callback accounted for it
    const ucs_status_ptr_t req = *issued;
    const bool am = ctx->data;
    const uint64_t wire_id = ctx->wire_id;
    if (handOver(req, ctx)) continue;
    if (req == nullptr && am) {
      amWriteSent(wire_id, Status());  // sent at once (NO_IMM_CMPL asks UCX not to)
    } else if (UCS_PTR_IS_ERR(req)) {
      const Status failed =
          statusFromUcs(strCat("write of ", w.length, " bytes to peer '", ep->name, "'"), UCS_PTR_STATUS(req));
      if (am)
        amWriteSent(wire_id, failed);
      else
        partDone(id, failed);
    }
  }
  if (protocol_ == Protocol::kPut) {
    // Remote visibility: a flush completes after every earlier put reached the peer's memory.
    if (!hold()) return;
    auto ctx = std::make_unique<RequestCtx>(RequestCtx{.engine = this, .op_id = id});
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.send = &Callbacks::onSend;
    rp.user_data = ctx.get();
    const auto issued = issue(ctx, [&] { return ucp_ep_flush_nbx(ep->ep, &rp); });
    if (issued && !handOver(*issued, ctx))
      partDone(id, *issued == nullptr
                       ? Status()
                       : statusFromUcs(strCat("flush to peer '", ep->name, "'"), UCS_PTR_STATUS(*issued)));
  }
  partDone(id, Status());  // release the hold taken above
}

void UcxEngine::partDone(uint64_t op_id, const Status& st) {
  auto it = ops_.find(op_id);
  if (it == ops_.end()) return;
  PendingOp& op = it->second;
  if (!st.ok() && op.status.ok()) op.status = Status(st.code(), strCat("peer '", op.ep->name, "': ", st.message()));
  if (--op.remaining == 0) finishOp(op_id);
}

void UcxEngine::amWriteSent(uint64_t wire_id, const Status& st) {
  auto it = am_writes_.find(wire_id);
  if (it == am_writes_.end()) return;
  AmWrite& w = it->second;
  w.sent = true;
  if (!st.ok() && w.status.ok()) w.status = st;
  // A failed send gets no ack; an operation that already finished (failed, timed out) waits for
  // no ack either, only for UCX to be done with the source.
  if (!st.ok() || w.acked || !ops_.contains(w.op_id)) amWriteDone(it);
}

void UcxEngine::amWriteDone(std::unordered_map<uint64_t, AmWrite>::iterator it) {
  const uint64_t op_id = it->second.op_id;
  const Status st = std::move(it->second.status);
  am_writes_.erase(it);
  partDone(op_id, st);
}

void UcxEngine::finishOp(uint64_t op_id) {
  auto it = ops_.find(op_id);
  if (it == ops_.end()) return;
  PendingOp op = std::move(it->second);
  ops_.erase(it);
  // Its AM writes that UCX is done with are forgotten (a later ack of one is dropped); the others
  // go when their send completes (amWriteSent).
  for (const uint64_t wire_id : op.am_writes)
    if (auto w = am_writes_.find(wire_id); w != am_writes_.end() && w->second.sent) am_writes_.erase(w);
  op.ep->incomplete.erase(op.seq);
  if (op.done) op.done(op.status);
  flushNotifies(*op.ep);
}

void UcxEngine::submitNotify(const std::shared_ptr<EpState>& ep, std::string payload, const WriteKey& key,
                             Completion done) {
  if (!ep->error.ok()) return done(ep->error);
  if (key.empty())
    return done(absl::InvalidArgumentError(strCat("notification to peer '", ep->name, "': no write key")));
  if (payload.size() > kMaxNotifyBytes)
    return done(
        absl::InvalidArgumentError(strCat("notification of ", payload.size(), " bytes exceeds ", kMaxNotifyBytes)));
  ep->notifies.push_back({std::move(payload), key, ep->next_seq - 1, std::move(done)});
  flushNotifies(*ep);
}

// Sends the queued notifications whose earlier writes are all visible at the peer, in order.
void UcxEngine::flushNotifies(EpState& ep) {
  while (!ep.notifies.empty()) {
    auto& n = ep.notifies.front();
    if (!ep.incomplete.empty() && *ep.incomplete.begin() <= n.after_seq) return;
    auto pending = std::move(n);
    ep.notifies.pop_front();
    sendNotify(ep, std::move(pending.payload), pending.key, std::move(pending.done));
  }
}

void UcxEngine::sendNotify(EpState& ep, std::string payload, const WriteKey& key, Completion done) {
  if (!ep.error.ok()) return done(ep.error);
  auto ctx = std::make_unique<RequestCtx>(RequestCtx{
      .engine = this, .header = ucx_wire::encodeNotify(key), .payload = std::move(payload), .done = std::move(done)});
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  rp.cb.send = &Callbacks::onSend;
  rp.user_data = ctx.get();
  rp.flags = UCP_AM_SEND_FLAG_EAGER;
  const RequestCtx& c = *ctx;
  const auto issued = issue(ctx, [&] {
    return ucp_am_send_nbx(ep.ep, kAmNotify, c.header.data(), c.header.size(), c.payload.data(), c.payload.size(), &rp);
  });
  if (!issued) return;  // its callback told `done`
  const ucs_status_ptr_t req = *issued;
  if (!handOver(req, ctx)) {
    const ucs_status_t st = req == nullptr ? UCS_OK : UCS_PTR_STATUS(req);
    Completion cb = std::move(ctx->done);
    ctx.reset();
    cb(st == UCS_OK ? Status() : statusFromUcs(strCat("notify peer '", ep.name, "'"), st));
  }
}

void UcxEngine::failEndpoint(EpState& ep, const Status& st, bool quiet) {
  if (ep.error.ok()) {
    ep.error = st;
    ep.usable = false;
    // A peer that goes while nothing is in flight to it (a clean stop, a restart between syncs)
    // is normal: worth a warning only when it fails writes or notifications.
    bool busy = !ep.notifies.empty();
    for (const auto& [id, op] : ops_) busy = busy || op.ep.get() == &ep;
    if (quiet || stopping_)
      spdlog::debug("transport '{}': {}", options_.name, std::string(st.message()));
    else if (!busy)
      spdlog::info("transport '{}': {} (nothing was in flight to it)", options_.name, std::string(st.message()));
    else
      spdlog::warn("transport '{}': {}", options_.name, std::string(st.message()));
  }
  std::vector<uint64_t> failed;
  for (auto& [id, op] : ops_)
    if (op.ep.get() == &ep) failed.push_back(id);
  for (uint64_t id : failed) {
    auto it = ops_.find(id);
    if (it->second.status.ok()) it->second.status = st;
    finishOp(id);
  }
  auto notifies = std::move(ep.notifies);
  for (auto& n : notifies) n.done(st);
}

void UcxEngine::closeEndpoint(const std::shared_ptr<EpState>& ep, bool force) {
  if (!ep->ep) return;
  ep->usable = false;
  auto inFlight = [&] {
    if (!ep->notifies.empty()) return true;
    for (const auto& [id, op] : ops_)
      if (op.ep == ep) return true;
    return false;
  };
  force = force || !ep->error.ok();  // a failed connection cannot be flushed
  if (!force) {
    // A graceful close lets what was started finish first (bounded: the peer may be gone), each
    // completion running as its operation completes.
    // (At shutdown stop() bounds all closes together: no wait here.)
    const auto give_up = Clock::now() + (stopping_ ? std::chrono::seconds(0) : std::chrono::seconds(2));
    while (inFlight() && Clock::now() < give_up) ucp_worker_progress(worker_);
    force = inFlight() && !stopping_;
  }
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t req = ucp_ep_close_nbx(ep->ep, &rp);
  ep->ep = nullptr;
  if (req != nullptr && !UCS_PTR_IS_ERR(req)) {
    // Keep progressing until the close completes (the peer must keep progressing too: it does,
    // on its own progress thread), bounded so that a vanished peer cannot hang shutdown.
    const auto give_up = Clock::now() + std::chrono::seconds(2);
    while (ucp_request_check_status(req) == UCS_INPROGRESS && Clock::now() < give_up) ucp_worker_progress(worker_);
    if (ucp_request_check_status(req) == UCS_INPROGRESS) {
      spdlog::warn("transport '{}': closing endpoint to '{}' did not finish in 2 s", options_.name, ep->name);
      ucp_request_cancel(worker_, req);
      while (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_worker_progress(worker_);
    }
    ucp_request_free(req);
  }
  // Only now, with no request of the endpoint left in UCX, does what is still pending fail: a
  // completion tells its caller the source may be reused, and a flush during the close could
  // still have read it.
  failEndpoint(*ep, absl::FailedPreconditionError(strCat("endpoint to peer '", ep->name, "' is closed")),
               /*quiet=*/true);
  ep->rkeys.clear();
}

void UcxEngine::checkDeadlines() {
  const auto now = Clock::now();
  std::vector<std::shared_ptr<EpState>> expired;
  for (auto& [id, op] : ops_)
    if (now > op.deadline && op.ep->error.ok()) expired.push_back(op.ep);
  for (auto& ep : expired) {
    if (!ep->error.ok()) continue;
    // The peer stopped answering: fail everything on the endpoint and drop it, so that no request
    // can touch the caller's memory after its completion has run.
    failEndpoint(*ep, absl::DeadlineExceededError(strCat("peer '", ep->name, "': no completion after ",
                                                         options_.op_timeout.count(), " ms (peer gone?)")));
    auto shared = ep;
    closeEndpoint(shared, true);
  }
}

void UcxEngine::sendAck(ucp_ep_h reply_ep, uint64_t op_id, const Status& st, const WriteKey& key) {
  if (!reply_ep) return;
  auto ctx = std::make_unique<RequestCtx>(
      RequestCtx{.engine = this,
                 .header = ucx_wire::encodeAck(op_id, static_cast<int32_t>(st.code()), key),
                 .payload = std::string(st.message())});
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  rp.cb.send = &Callbacks::onSend;
  rp.user_data = ctx.get();
  rp.flags = UCP_AM_SEND_FLAG_EAGER;
  const RequestCtx& c = *ctx;
  const auto issued = issue(ctx, [&] {
    return ucp_am_send_nbx(reply_ep, kAmAck, c.header.data(), c.header.size(), c.payload.data(), c.payload.size(), &rp);
  });
  if (!issued) return;
  const ucs_status_ptr_t req = *issued;
  if (!handOver(req, ctx) && UCS_PTR_IS_ERR(req))
    spdlog::warn("transport '{}': ack of op {}: {}", options_.name, op_id, ucs_status_string(UCS_PTR_STATUS(req)));
}

ucs_status_t UcxEngine::onData(const void* header, size_t hlen, void* data, size_t len,
                               const ucp_am_recv_param_t* param) {
  ucp_ep_h reply = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
  const std::string_view bytes(static_cast<const char*>(header), hlen);
  auto h = ucx_wire::parseHeader(bytes, ucx_wire::MessageType::kData);
  if (!h.ok()) {
    warnRefused(strCat("dropped a data message: ", h.status().message()));
    // Refused at once, not left to time out, where the header still names the operation (a
    // shardcastd of another version), under the key its header carries where it has one (a sender
    // believes no ack without its write's key).
    const uint64_t op_id = ucx_wire::foreignOpId(bytes);
    const WriteKey key = ucx_wire::foreignKey(bytes);
    if (op_id != 0 && !key.empty())
      sendAck(reply, op_id,
              absl::FailedPreconditionError(strCat("the peer refused a data message: ", h.status().message())), key);
    return UCS_OK;
  }
  // The key first, then the range inside the key's landing ranges, then registered memory: one
  // answer for all of them.
  RegionTable::Landing landing = h->length == len ? regions_->admit(h->key, h->addr, len) : RegionTable::Landing{};
  if (!landing) {
    warnRefused(strCat("refused a write of ", len, " bytes"));
    sendAck(reply, h->op_id, absl::AbortedError(kRefused), h->key);
    return UCS_OK;
  }
  std::string notice(h->notice);
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    auto ctx = std::make_unique<RequestCtx>(RequestCtx{.engine = this,
                                                       .op_id = h->op_id,
                                                       .payload = std::move(notice),
                                                       .reply_ep = reply,
                                                       .key = h->key,
                                                       .landing = std::move(landing)});
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = &Callbacks::onRecvData;
    rp.user_data = ctx.get();
    const auto issued =
        issue(ctx, [&] { return ucp_am_recv_data_nbx(worker_, data, reinterpret_cast<void*>(h->addr), len, &rp); });
    if (!issued) return UCS_OK;  // landed inside the call: its callback delivered and acked it
    const ucs_status_ptr_t req = *issued;
    if (!handOver(req, ctx)) {
      if (req == nullptr && !ctx->payload.empty()) deliver(std::move(ctx->payload), h->key);  // landed at once
      sendAck(reply, h->op_id, req == nullptr ? Status() : statusFromUcs("receive", UCS_PTR_STATUS(req)), h->key);
    }
    return UCS_OK;
  }
  std::memcpy(reinterpret_cast<void*>(h->addr), data, len);
  if (!notice.empty()) deliver(std::move(notice), h->key);
  sendAck(reply, h->op_id, Status(), h->key);
  return UCS_OK;
}

ucs_status_t UcxEngine::onAck(const void* header, size_t hlen, void* data, size_t len) {
  auto h = ucx_wire::parseHeader({static_cast<const char*>(header), hlen}, ucx_wire::MessageType::kAck);
  if (!h.ok()) {
    warnRefused(strCat("dropped an ack: ", h.status().message()));
    return UCS_OK;
  }
  // Believed only for a write in flight (its id is random), from whoever holds that write's key,
  // and once: an ack anyone could forge or replay neither fails nor finishes a write.
  auto it = am_writes_.find(h->op_id);
  if (it == am_writes_.end()) {
    warnRefused("dropped an ack of no write in flight here");
    return UCS_OK;
  }
  AmWrite& w = it->second;
  if (h->key != w.key) {
    warnRefused("dropped an ack of a write under a key not its own");
    return UCS_OK;
  }
  if (w.acked) {
    ++second_acks_;
    warnRefused(strCat("dropped a second ack of one write (", second_acks_, " so far)"));
    return UCS_OK;
  }
  w.acked = true;
  const auto code = static_cast<absl::StatusCode>(h->code);
  if (code != absl::StatusCode::kOk && w.status.ok())
    w.status = Status(code, std::string(static_cast<char*>(data), len));
  if (w.sent) amWriteDone(it);
  return UCS_OK;
}

ucs_status_t UcxEngine::onNotify(const void* header, size_t hlen, void* data, size_t len,
                                 const ucp_am_recv_param_t* param) {
  auto h = ucx_wire::parseHeader({static_cast<const char*>(header), hlen}, ucx_wire::MessageType::kNotify);
  if (!h.ok()) {
    warnRefused(strCat("dropped a notification: ", h.status().message()));
    return UCS_OK;
  }
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    warnRefused(strCat("dropped a rendezvous notification of ", len, " bytes"));
    return UCS_OK;
  }
  if (!regions_->fenceOpen(h->key)) {
    // Routine, and harmless (nothing lands): a folded attempt's readiness word reaches peers that
    // have not opened the attempt yet, and they say so themselves once open (sync_attempt.cc).
    spdlog::debug("transport '{}': dropped a notification under a key not open here", options_.name);
    return UCS_OK;
  }
  deliver(std::string(static_cast<char*>(data), len), h->key);
  return UCS_OK;
}

void UcxEngine::deliver(std::string payload, const WriteKey& key) {
  Context::NotificationHandler handler;
  {
    std::lock_guard<std::mutex> lock(handler_mu_);
    handler = handler_;
  }
  if (handler) handler(std::move(payload), key);
}

void UcxEngine::warnRefused(const std::string& what) {
  // The first few, then one in a thousand: a peer that floods refused messages cannot fill the log.
  ++refused_;
  if (refused_ <= 8 || refused_ % 1000 == 0)
    spdlog::warn("transport '{}': {} ({} refused so far)", options_.name, what, refused_);
}

// ---- public objects -----------------------------------------------------------------------------

class UcxEndpoint final : public Endpoint {
 public:
  UcxEndpoint(std::shared_ptr<UcxEngine> engine, std::shared_ptr<EpState> state)
      : engine_(std::move(engine)), state_(std::move(state)) {}

  void write(WriteOp op, Completion done) override {
    std::vector<WriteOp> ops;
    ops.push_back(std::move(op));
    writeBatch(std::move(ops), std::move(done));
  }
  void writeBatch(std::vector<WriteOp> ops, Completion done) override {
    auto fallback = done;
    if (!engine_->mailbox().post(
            [e = engine_.get(), s = state_, ops = std::move(ops), done = std::move(done)]() mutable {
              e->submitWrites(s, std::move(ops), std::move(done));
            }))
      fallback(absl::FailedPreconditionError("transport context is shut down"));
  }
  void notify(std::string payload, const WriteKey& key, Completion done) override {
    auto fallback = done;
    if (!engine_->mailbox().post(
            [e = engine_.get(), s = state_, p = std::move(payload), key, done = std::move(done)]() mutable {
              e->submitNotify(s, std::move(p), key, std::move(done));
            }))
      fallback(absl::FailedPreconditionError("transport context is shut down"));
  }
  void close() override {
    state_->usable = false;
    engine_->mailbox().post([e = engine_.get(), s = state_] { e->closeEndpoint(s, false); });
  }
  bool open() const override { return state_->usable; }
  const std::string& peerName() const override { return state_->name; }

 private:
  std::shared_ptr<UcxEngine> engine_;  // kept alive; refuses work once its context shut it down
  std::shared_ptr<EpState> state_;
};

class UcxContext final : public Context {
 public:
  UcxContext(std::shared_ptr<UcxEngine> engine, std::string tls, std::string tcp_segment, bool cuda)
      : engine_(std::move(engine)), tls_(std::move(tls)), tcp_segment_(std::move(tcp_segment)), cuda_(cuda) {}
  ~UcxContext() override { engine_->stop(); }

  std::string describe() const override {
    // The library loaded, which may not be the one built against (libucp.so.0 is ABI-compatible
    // across versions: a cluster's own CUDA- and verbs-aware UCX replaces the build's).
    return strCat("ucx ", ucp_get_version_string(), " (tls=", tls_.empty() ? "default" : tls_,
                  ", protocol=", protocolName(engine_->protocol()),
                  tcp_segment_.empty() ? "" : strCat(", tcp_segment=", tcp_segment_), ", cuda=", cuda_ ? "yes" : "no",
                  ")");
  }
  std::string address() const override { return engine_->address(); }
  bool openFence(const WriteKey& key, std::vector<LandingRange> ranges) override {
    return engine_->regions()->openFence(key, std::move(ranges));
  }
  bool closeFence(const WriteKey& key, std::chrono::milliseconds timeout) override {
    return engine_->regions()->closeFence(key, timeout);
  }
  bool canAccess(MemoryKind kind) const override { return kind == MemoryKind::kHost || cuda_; }
  Capabilities capabilities() const override {
    Capabilities c;
    c.target_checks_writes = engine_->protocol() == Protocol::kAm;  // a put lands by remote key
    c.host_faults_contained = putIsBounded(tls_);                   // only hardware transports (and self) in the set
    return c;
  }

  StatusOr<std::shared_ptr<MemoryRegion>> registerMemory(void* data, size_t size, MemoryKind kind) override {
    if (!data || size == 0) return absl::InvalidArgumentError("registerMemory: null or empty range");
    if (!canAccess(kind))
      return absl::FailedPreconditionError(strCat("this UCX (", describe(), ") cannot access ", memoryKindName(kind),
                                                  " memory: stage it through pinned host memory"));
    if (auto existing = engine_->regions()->find(data, size, kind)) return existing;
    return map(data, size, kind);
  }

  StatusOr<std::shared_ptr<MemoryRegion>> allocateMemory(size_t size) override {
    if (size == 0) return absl::InvalidArgumentError("allocateMemory: size 0");
    return map(nullptr, size, MemoryKind::kHost);
  }

  StatusOr<std::shared_ptr<Endpoint>> connect(const std::string& peer_address, const std::string& peer_name) override {
    std::lock_guard<std::mutex> lock(mu_);
    // A failed or closed endpoint is not handed out again (a peer that stopped answering for a
    // while and came back is reached through a new one); dropping it here frees it once the
    // operations still holding it complete.
    std::erase_if(endpoints_, [](const auto& entry) { return !entry.second->open(); });
    auto it = endpoints_.find(peer_address);
    if (it != endpoints_.end()) return std::shared_ptr<Endpoint>(it->second);
    // Endpoint creation is a worker call: run it on the progress thread and wait for it.
    std::promise<StatusOr<std::shared_ptr<EpState>>> done;
    auto result = done.get_future();
    if (!engine_->mailbox().post([&] { done.set_value(engine_->openEndpoint(peer_address, peer_name)); }))
      return absl::FailedPreconditionError("transport context is shut down");
    auto state = result.get();
    if (!state.ok()) return state.status();
    auto ep = std::make_shared<UcxEndpoint>(engine_, *state);
    endpoints_.emplace(peer_address, ep);
    return std::shared_ptr<Endpoint>(ep);
  }

  void setNotificationHandler(NotificationHandler handler) override { engine_->setHandler(std::move(handler)); }

 private:
  // Registers [data, data + size), or lets UCX allocate `size` bytes when data is null.
  StatusOr<std::shared_ptr<MemoryRegion>> map(void* data, size_t size, MemoryKind kind) {
    ucp_mem_map_params_t p{};
    p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                   UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    p.address = data;
    p.length = size;
    p.memory_type = kind == MemoryKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
    p.flags = data ? 0 : UCP_MEM_MAP_ALLOCATE;
    ucp_mem_h memh = nullptr;
    ucs_status_t st = ucp_mem_map(engine_->core()->ctx, &p, &memh);
    if (st != UCS_OK)
      return statusFromUcs(
          strCat(data ? "register " : "allocate ", size, " bytes of ", memoryKindName(kind), " memory"), st);
    if (!data) {
      ucp_mem_attr_t attr{};
      attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS;
      st = ucp_mem_query(memh, &attr);
      if (st != UCS_OK) {
        ucp_mem_unmap(engine_->core()->ctx, memh);
        return statusFromUcs("ucp_mem_query", st);
      }
      data = attr.address;
    }
    auto region = std::make_shared<UcxRegion>(engine_->core(), engine_->regions(), data, size, kind, memh);
    RemoteRegion remote;
    remote.base = reinterpret_cast<uint64_t>(data);
    remote.size = size;
    // A remote key is what lets a peer write here without us: packed only when writes are puts
    // (active messages land through our own handler, which checks every range).
    if (engine_->protocol() == Protocol::kPut) {
      void* rkey_buf = nullptr;
      size_t rkey_len = 0;
      st = ucp_rkey_pack(engine_->core()->ctx, memh, &rkey_buf, &rkey_len);
      if (st != UCS_OK) return statusFromUcs("ucp_rkey_pack", st);
      remote.rkey.assign(static_cast<char*>(rkey_buf), rkey_len);
      ucp_rkey_buffer_release(rkey_buf);
    }
    region->setRemote(std::move(remote));
    engine_->regions()->add(region);
    return std::shared_ptr<MemoryRegion>(region);
  }

  std::shared_ptr<UcxEngine> engine_;
  std::string tls_;
  std::string tcp_segment_;  // UCX_TCP_RX_SEG_SIZE in effect, for describe() ("" without tcp)
  bool cuda_;
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<UcxEndpoint>> endpoints_;
};

}  // namespace

StatusOr<std::unique_ptr<Context>> createUcxContext(const TransportOptions& options) {
  static std::once_flag log_routed;
  std::call_once(log_routed, [] { ucs_log_push_handler(&ucxLogLine); });
  // The protocol first: it decides whether this context serves RMA at all. UCX answers the RMA
  // requests of any peer (a put lands, a get is answered, at whatever address the request names)
  // whenever the feature is on, emulated in software over tcp, cma and shared memory: so the
  // feature is requested only for put, which runs only over hardware that bounds it (or
  // --insecure). Active-message writes land through onData, which checks every key and range.
  SC_ASSIGN_OR_RETURN(const ResolvedUcxOptions resolved, resolveUcxOptions(options));
  const UcxOptions& ucx = resolved.options;
  const std::string& tls = resolved.tls;
  const Protocol protocol = resolved.protocol;
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return statusFromUcs("ucp_config_read", st);
  if (!ucx.tls.empty()) {
    st = ucp_config_modify(config, "TLS", ucx.tls.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      return absl::InvalidArgumentError(ucxError(strCat("UCX transports \"", ucx.tls, "\""), st));
    }
  }
  std::string tcp_segment = mayUseTcp(tls) ? "64K" : "";  // UCX 1.13's default; none without tcp
  if (const char* env = std::getenv("UCX_TCP_RX_SEG_SIZE")) {
    tcp_segment = env;
  } else if (ucx.tcp_segment_bytes > 0 && mayUseTcp(tls)) {
    // A transport-level key (the tcp interface's RX_SEG_SIZE), which UCX applies to the interfaces
    // that have it; only set where tcp may be used, or UCX warns that no interface took it.
    const size_t b = ucx.tcp_segment_bytes;  // in UCX's size syntax, e.g. "1M"
    tcp_segment = b % (1 << 20) == 0 ? strCat(b >> 20, "M") : b % 1024 == 0 ? strCat(b >> 10, "K") : std::to_string(b);
    // UCX 1.13 takes the interface's key alone; later versions (1.22: NVIDIA's CUDA-aware build)
    // only with the transport's prefix.
    st = ucp_config_modify(config, "RX_SEG_SIZE", tcp_segment.c_str());
    if (st != UCS_OK) st = ucp_config_modify(config, "TCP_RX_SEG_SIZE", tcp_segment.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      return absl::InvalidArgumentError(ucxError(strCat("UCX TCP segment size ", ucx.tcp_segment_bytes), st));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP | (protocol == Protocol::kPut ? UCP_FEATURE_RMA : 0);
  params.mt_workers_shared = 1;  // registration runs on caller threads, the worker on its own
  params.name = options.name.c_str();
  auto core = std::make_shared<UcxCore>();
  st = ucp_init(&params, config, &core->ctx);
  ucp_config_release(config);
  if (st != UCS_OK) return statusFromUcs(strCat("ucp_init (UCX_TLS=", tls.empty() ? "default" : tls, ")"), st);

  ucp_context_attr_t cattr{};
  cattr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  st = ucp_context_query(core->ctx, &cattr);
  if (st != UCS_OK) return statusFromUcs("ucp_context_query", st);
  const bool cuda = (cattr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread touches the worker
  ucp_worker_h worker = nullptr;
  st = ucp_worker_create(core->ctx, &wp, &worker);
  if (st != UCS_OK) return statusFromUcs("ucp_worker_create", st);

  auto engine = std::make_shared<UcxEngine>(options, core, worker, protocol, hasNetworkTransport(tls));
  SC_RETURN_IF_ERROR(engine->start());
  auto ctx = std::make_unique<UcxContext>(std::move(engine), tls, tcp_segment, cuda);
  spdlog::debug("transport '{}': {}", options.name, ctx->describe());
  return std::unique_ptr<Context>(std::move(ctx));
}

}  // namespace shardcast::transport
