// The data plane's interface: registered memory regions, endpoints to peer daemons, remote writes
// whose completion means "visible at the target", and ordered notifications. Backends: UCX
// (transport/ucx/) and an in-process loopback (transport/loopback/) for tests.
//
// Threading (docs/thread_model.md): every Context owns one progress thread. All methods are
// thread-safe and never block on the network (registration and connect may block briefly,
// closeFence up to its timeout); completion callbacks and the notification handler run on the
// progress thread, never under a lock the caller holds, and must not block. Exceptions: once the
// context is shutting down, a write or notify completes at once on the calling thread with
// FAILED_PRECONDITION, and what is still pending completes on the thread that destroys the context.
// Ownership: the caller keeps source regions and their memory alive until the completion callback
// has run.
#pragma once

#include <array>
#include <chrono>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace shardcast::transport {

enum class MemoryKind { kHost, kCuda };
const char* memoryKindName(MemoryKind kind);

// What a peer needs to write into a region: its address in the owner's address space, its size,
// and the backend's remote key (UCX: the packed rkey when writes are puts; empty with active
// messages and on the loopback). Serialisable, to travel over gRPC.
struct RemoteRegion {
  uint64_t base = 0;
  uint64_t size = 0;
  std::string rkey;

  std::string serialize() const;
  static StatusOr<RemoteRegion> parse(const std::string& bytes);
};

// Memory registered with one Context. Registration happens once: registering the same range
// again returns this same object while it is alive. Released when the last reference goes.
class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;
  MemoryKind kind() const { return kind_; }
  void* data() const { return data_; }
  size_t size() const { return size_; }
  const RemoteRegion& remote() const { return remote_; }

 protected:
  MemoryRegion(MemoryKind kind, void* data, size_t size) : kind_(kind), data_(data), size_(size) {}
  MemoryKind kind_;
  void* data_;
  size_t size_;
  RemoteRegion remote_;
};

using Completion = std::function<void(Status)>;

// Fills `out` with `n` bytes from the kernel's CSPRNG (getrandom(2)): write keys, and the ids that
// name a write on the wire, which a peer must not guess.
void randomBytes(void* out, size_t n);

// The secret that lets one sync attempt's writes and notifications in (docs/security.md): 128
// random bits, handed to the attempt's daemons only in its Prepare, over gRPC with mutual TLS
// (plaintext when the daemons run --insecure). Where the target takes part in a write (UCX active
// messages, the loopback), it lets the write land only while it holds the write's key open
// (Context::openFence) and only inside the ranges opened with it; a UCX put lands by remote key
// instead (WriteOp::key). There is no keyless write.
struct WriteKey {
  static constexpr size_t kBytes = 16;
  std::array<unsigned char, kBytes> bytes{};

  // From the kernel's CSPRNG (getrandom(2)); never all zero.
  static WriteKey random();
  // Exactly kBytes bytes, not all zero; INVALID_ARGUMENT otherwise.
  static StatusOr<WriteKey> fromBytes(std::string_view raw);
  std::string_view view() const { return {reinterpret_cast<const char*>(bytes.data()), bytes.size()}; }
  bool empty() const;  // all zero: no key, and no write carrying it lands anywhere
  friend auto operator<=>(const WriteKey&, const WriteKey&) = default;
};

// Bytes [addr, addr + size) of this context's own registered memory: where writes under one key
// may land (an attempt's landing arena, the rank buffers peers land in directly).
struct LandingRange {
  uint64_t addr = 0;
  uint64_t size = 0;
};

// One remote write: bytes [src_offset, src_offset + length) of `src` into
// [dst_offset, dst_offset + length) of the peer's region `dst`.
struct WriteOp {
  std::shared_ptr<MemoryRegion> src;
  size_t src_offset = 0;
  RemoteRegion dst;
  size_t dst_offset = 0;
  size_t length = 0;
  // The sync attempt's key: the peer lets the write land only while it holds this key open
  // (Context::openFence) and only inside the ranges opened with it; anything else is refused with
  // one answer (ABORTED, "write refused by the peer", whatever the reason: no oracle). A sync opens
  // its key on every node at prepare and closes it when it ends there, so a write of an ended sync
  // (a peer frozen and resumed) can never land in a rank a later sync wrote. Backends that write
  // without the target's help (UCX put: RMA, over hardware that bounds it unless the daemon runs
  // --insecure) land it by remote key instead: docs/transport.md.
  WriteKey key{};
  // Non-empty: a notification (<= kMaxNotifyBytes) for the peer's handler, delivered
  // once this write is visible there, with no ordering against other writes. Over UCX active
  // messages (when it fits in the write's header beside the data header, and the write is not
  // empty) it travels in that header, and on the loopback it is handed over as the write lands, so
  // a relay hears of a chunk as it lands instead of a round trip later behind the chunks sent after
  // it; otherwise (UCX put, a notice too long for the header, an empty write) it follows the write
  // as notify() would, once the write succeeded. The write completes once both are done.
  std::string notice{};
};

// A connection to one peer. Operations complete in any order, except that a notification is
// delivered only after every write issued before it on this endpoint is visible at the peer.
class Endpoint {
 public:
  virtual ~Endpoint() = default;
  // `done` runs once the bytes are visible in the peer's memory, or with the error that stopped them.
  virtual void write(WriteOp op, Completion done) = 0;
  // Many writes, one completion (the first error, if any).
  virtual void writeBatch(std::vector<WriteOp> ops, Completion done) = 0;
  // A small message (<= kMaxNotifyBytes) for the peer's notification handler, ordered after
  // earlier writes.
  // Delivered only while the peer holds `key` open (as a write under it would be); dropped there
  // otherwise.
  virtual void notify(std::string payload, const WriteKey& key, Completion done) = 0;
  // Closes: operations not completed yet fail with FAILED_PRECONDITION, and so do later ones (UCX
  // then closes the connection, flushing it unless it had failed). Idempotent.
  virtual void close() = 0;
  // False once closed, or (UCX) once the peer failed (went away, or stopped completing operations
  // within the op timeout): then Context::connect makes a new endpoint to that address. A loopback
  // endpoint stays open; its operations to a peer that is gone fail with UNAVAILABLE.
  virtual bool open() const = 0;
  virtual const std::string& peerName() const = 0;
};

struct TransportOptions {
  std::string backend = "ucx";     // a name of backends(): "ucx" or "loopback"
  std::string name = "shardcast";  // in log lines ("transport 'x': ...") and as UCX's context name
  // An operation not completed after this long fails with DEADLINE_EXCEEDED (a vanished peer).
  std::chrono::milliseconds op_timeout{30000};
  // Only writes the target can bound to the memory it registered: a backend whose settings would
  // let a peer write elsewhere picks another way where it has one (UCX: active messages instead of
  // put over transports that emulate RMA) and refuses the settings otherwise (INVALID_ARGUMENT).
  // Daemons set it unless run --insecure.
  bool bounded_writes_only = false;
  // Backends' own settings, named "<backend>.<setting>" (UCX's: transport/ucx/ucx_options.h), so
  // one set of options serves every backend. The backend named there parses and checks its own
  // when a context is made and ignores the others'; a name of no backend's, or one its backend
  // does not know or cannot parse, is INVALID_ARGUMENT naming the setting.
  std::map<std::string, std::string> settings;
};

// The settings of `backend` in `options`, by their names without the "<backend>." prefix.
std::map<std::string, std::string> settingsOf(const TransportOptions& options, std::string_view backend);

// The largest notification a caller may send (Endpoint::notify, WriteOp::notice): a larger notice
// fails checkWriteRanges, a larger UCX notify INVALID_ARGUMENT (the loopback's notify does not check).
constexpr size_t kMaxNotifyBytes = size_t{64} << 10;

// What a context does differently from another backend's or settings', for callers that choose a
// path by it. Whether it reaches device memory is Context::canAccess.
struct Capabilities {
  // The target checks every write against its open keys and their ranges before it lands
  // (WriteOp::key: active messages, the loopback). False where a write lands by remote key without
  // the target's help (UCX put), bounded by the hardware to the region the key names (with
  // bounded_writes_only) but not per sync (docs/security.md). The shared transport suite runs its
  // fence cases only where it holds.
  bool target_checks_writes = true;
  // Host memory it sends from or lands in cannot fault inside it when its owner truncates a shm
  // segment under a write: the hardware holds the pages (verbs, CUDA), or every access is a plain
  // load or store of this process (which the segment guard absorbs, transport/shm.h). False where
  // the kernel touches it (tcp's sendmsg and recv, cma): UCX meets EFAULT there and aborts, so a
  // daemon hands such a transport only its own memory (clients' segments are synced packed:
  // Registry::hostSafe).
  bool host_faults_contained = true;
};

class Context {
 public:
  virtual ~Context() = default;
  // Describes backend, its library version, transports and protocol, e.g. "ucx 1.13.1 (tls=tcp,
  // protocol=am, tcp_segment=1M, cuda=no)".
  virtual std::string describe() const = 0;
  // The bytes a peer passes to connect() (exchanged out of band).
  virtual std::string address() const = 0;
  virtual bool canAccess(MemoryKind kind) const = 0;
  virtual Capabilities capabilities() const = 0;
  virtual StatusOr<std::shared_ptr<MemoryRegion>> registerMemory(void* data, size_t size, MemoryKind kind) = 0;
  // Host memory allocated and registered by the backend (staging and landing buffers). With UCX,
  // UCX allocates it as shareable memory: a same-host peer writing by put over shared memory lands
  // in it by plain stores (daemons put over shared memory only when run --insecure).
  virtual StatusOr<std::shared_ptr<MemoryRegion>> allocateMemory(size_t size) = 0;
  // Write fences (WriteOp::key): from openFence, writes under `key` may land inside `ranges` (and
  // only there) and notifications under it are delivered. closeFence refuses later writes under
  // the key and waits up to `timeout` for those landing under it now; false when some were still
  // landing then. openFence of a key open already changes nothing and returns false.
  [[nodiscard]] virtual bool openFence(const WriteKey& key, std::vector<LandingRange> ranges) = 0;
  virtual bool closeFence(const WriteKey& key, std::chrono::milliseconds timeout) = 0;
  // Connects lazily: the same peer address returns the same endpoint while it is open; endpoints
  // no longer open are dropped (their resources freed once no operation holds them).
  virtual StatusOr<std::shared_ptr<Endpoint>> connect(const std::string& peer_address,
                                                      const std::string& peer_name) = 0;
  // Called on the progress thread for every notification a peer sends to this context under a key
  // open here (the key it came under, for the handler to match against what it opened).
  using NotificationHandler = std::function<void(std::string payload, const WriteKey& key)>;
  virtual void setNotificationHandler(NotificationHandler handler) = 0;
};

// A context that passes every call to another, for wrappers that change a few of them (what
// memory it reaches: stageDeviceMemory, reachEmulatedGpus).
class ForwardingContext : public Context {
 public:
  explicit ForwardingContext(std::unique_ptr<Context> inner) : inner_(std::move(inner)) {}
  std::string describe() const override { return inner_->describe(); }
  std::string address() const override { return inner_->address(); }
  bool canAccess(MemoryKind kind) const override { return inner_->canAccess(kind); }
  Capabilities capabilities() const override { return inner_->capabilities(); }
  StatusOr<std::shared_ptr<MemoryRegion>> registerMemory(void* data, size_t size, MemoryKind kind) override {
    return inner_->registerMemory(data, size, kind);
  }
  StatusOr<std::shared_ptr<MemoryRegion>> allocateMemory(size_t size) override { return inner_->allocateMemory(size); }
  [[nodiscard]] bool openFence(const WriteKey& key, std::vector<LandingRange> ranges) override {
    return inner_->openFence(key, std::move(ranges));
  }
  bool closeFence(const WriteKey& key, std::chrono::milliseconds timeout) override {
    return inner_->closeFence(key, timeout);
  }
  StatusOr<std::shared_ptr<Endpoint>> connect(const std::string& peer_address, const std::string& peer_name) override {
    return inner_->connect(peer_address, peer_name);
  }
  void setNotificationHandler(NotificationHandler handler) override {
    inner_->setNotificationHandler(std::move(handler));
  }

 protected:
  Context& inner() const { return *inner_; }

 private:
  std::unique_ptr<Context> inner_;
};

// The backends, by name (transport/backends.cc): a new one is a directory with its own CMake
// target and one row there.
struct Backend {
  const char* name;
  // Checks the options as create would, without making anything (its own settings, and what
  // bounded_writes_only asks of them).
  Status (*check)(const TransportOptions& options);
  StatusOr<std::unique_ptr<Context>> (*create)(const TransportOptions& options);
  const char* description;
};
const std::vector<Backend>& backends();

// INVALID_ARGUMENT, naming the option or setting, where createContext would refuse `options`
// before reaching the backend's library: for checking a configuration at start-up.
Status checkOptions(const TransportOptions& options);
// Creates a context of options.backend, once checkOptions passes.
StatusOr<std::unique_ptr<Context>> createContext(const TransportOptions& options);

// The checks every backend makes of a write before it travels: the source range inside its
// region, the target range inside the remote region (OUT_OF_RANGE naming the peer and the range),
// a notice no larger than kMaxNotifyBytes, a key (INVALID_ARGUMENT).
Status checkWriteRanges(const WriteOp& op, const std::string& peer_name);

}  // namespace shardcast::transport
