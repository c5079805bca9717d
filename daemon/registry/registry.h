// What local ranks registered with this daemon: their group layouts, and their buffers mapped
// (shared memory, or CUDA IPC) and registered with the transport once. Everything is validated
// against the layout on arrival; memory a client did not register is never reachable.
// Thread-safe: gRPC handlers call it concurrently.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/registry/handed_fds.h"
#include "daemon/registry/sync_preconditions.h"
#include "planner/layout.h"
#include "proto/shardcast/v1/names.h"
#include "shardcast/v1/service.pb.h"
#include "transport/copy_engine.h"
#include "transport/device_runtime.h"
#include "transport/device_staging.h"
#include "transport/shm.h"
#include "transport/transport.h"

namespace shardcast::daemon {

// Who registers memory, as the daemon knows it: a caller on the Unix socket has the uid the kernel
// reports for its connection (SO_PEERCRED) and may register only shm segments it owns, named
// under kShmPrefixes. The rank is then that uid's: only it (or root) may re-register, unregister,
// acquire, publish or release it. `any_owner`: root, or a --insecure daemon's TCP caller.
struct MemoryCaller {
  uid_t uid = 0;
  bool local = false;      // on the Unix socket: `uid` is the kernel's word
  bool any_owner = false;  // root, or --insecure
  pid_t pid = 0;           // on the Unix socket: the process, for messages
};

// Names a registered shm segment may have: the clients' own and torch's file_system strategy's.
// torch's own segments (its file_system sharing strategy): torch unlinks each itself when the
// storage is freed, and aborts the process when the name is gone by then; its torch_shm_manager
// unlinks those of a process that died. The daemon unlinks them only once the process that
// registered them is gone (a container killed with its manager would leave them in /dev/shm).
inline constexpr const char* kTorchShmPrefix = "/torch_";
inline constexpr const char* kShmPrefixes[] = {"/shardcast", kTorchShmPrefix};

class Registry {
 public:
  // `gpus`: the runtime CUDA buffers are imported and copied with (emulated GPUs in tests).
  Registry(std::string node, transport::Context& transport, transport::DeviceRuntime& gpus = transport::cudaRuntime());

  StatusOr<v1::RegisterResponse> registerRank(const v1::RegisterRequest& request, const MemoryCaller& caller);
  // Refused (FAILED_PRECONDITION) while a sync uses the rank: its memory may still be written.
  // Unregister, acquire and release (publish) are the rank's owner's (MemoryCaller): anyone else
  // gets PERMISSION_DENIED, checked under the lock that acts.
  // `registration`: 0, or the RegisterResponse.registration the caller holds (a later registration
  // of the rank is then left alone: FAILED_PRECONDITION). Likewise for acquire and release.
  Status unregisterRank(const std::string& group, int32_t rank, const MemoryCaller& caller, uint64_t registration = 0);
  std::vector<v1::RankRegistration> list() const;
  // Groups with ranks here: their ranks, versions and bytes.
  std::vector<v1::GroupStatus> groups() const;
  // What peers need to plan and to write here: as DescribeRequest asks (its `syncs` aside), each
  // group's layout whole, named by digest only (layout_digests), or only the layouts asked for by
  // digest (layouts).
  v1::DescribeResponse describe(const v1::DescribeRequest& ask = {}) const;
  uint64_t registeredBytes() const;
  // The runtime of the GPUs whose memory is registered here (a sync's host staging is then
  // pinned for their copies); null while none is.
  transport::DeviceRuntime* deviceRuntime() const;
  int32_t registeredRanks() const;
  // Descriptors of cuMem allocations handed over on the socket's side channel (daemon/server/
  // fd_channel.h), until a registration's CudaAllocationsHandle names their token.
  HandedFds& handedFds() { return handed_fds_; }

  // A registered buffer as the sync engine uses it, kept mapped while the returned object lives:
  // host shared memory, or device memory (then `outgoing` and `incoming` are the copy engines of
  // its GPU's two streams, and `region` is null when the transport cannot reach device memory:
  // its bytes are staged, and syncs planned packed).
  struct LocalBuffer {
    std::byte* data = nullptr;
    uint64_t size = 0;
    transport::MemoryKind kind = transport::MemoryKind::kHost;
    std::shared_ptr<void> keep_alive;
    std::shared_ptr<transport::MemoryRegion> region;  // the registration the buffer lies in
    uint64_t region_offset = 0;                       // of data in that region
    transport::CopyEngine* outgoing = nullptr;        // device memory: packs, sends, local copies out
    transport::CopyEngine* incoming = nullptr;        // device memory: landings, unpacks
    int gpu = -1;                                     // device memory: its GPU
  };
  // `set`: the one syncs write (kWritten), or the one holding the rank's committed version
  // (kHeld: a delta's base); the same set unless the rank is double-buffered.
  enum class Set { kWritten, kHeld };
  StatusOr<LocalBuffer> localBuffer(const std::string& group, int32_t rank, const std::string& buffer,
                                    Set set = Set::kWritten) const;
  // Where the sync after the one writing the rank now would land `buffer` if this one commits:
  // a double-buffered rank flips at commit, so the next writes the set in use now; any other
  // rank, the same buffer. The registration and the buffer's offset in it.
  StatusOr<std::pair<std::shared_ptr<transport::MemoryRegion>, uint64_t>> nextLanding(const std::string& group,
                                                                                      int32_t rank,
                                                                                      const std::string& buffer) const;
  // Changes with every registration and unregistration here (a coordinator's kept view of this
  // node, PrepareRequest.expect, is stale once it changed).
  uint64_t generation() const;
  // Per group, the generation of the last registration or unregistration of a rank of it here
  // (0: none registered here). A sync fails when its own groups' change under it; other groups'
  // registrations do not concern it.
  std::vector<uint64_t> stamps(const std::vector<std::string>& groups) const;
  // What changed in `group`'s registrations here since generation `stamp` ("rank 2 left with its
  // client's session, rank 2 registered again"; "no rank of it is registered here any more" once
  // none is), for the sync it fails.
  std::string changesSince(const std::string& group, uint64_t stamp) const;
  const std::string& instance() const { return instance_; }
  const std::string& node() const { return node_; }
  std::string transportAddress() const { return transport_.address(); }

  // ---- the version contract (see docs/daemon.md, "Rank states") ----

  // Starts sync `id` of version V from `src` into `dst` on this node, atomically: every source
  // rank here must be READY at exactly V and not acquired (it gains a reader: its owner's acquire
  // waits until the sync ends); every destination rank here must be a destination, not acquired,
  // not being written, and have committed only older versions (it becomes UPDATING(V)). Every
  // involved shm segment is checked for truncation. Nothing changes when it fails.
  // `src_digest` / `dst_digest`: the layouts the sync was planned for; every rank here must have
  // registered exactly those (a group registered again with another layout is refused).
  // `fence`: the attempt's; committing it records it (a delta base names the attempt that sent it).
  // `base`, when given: what every destination rank here held as it was taken (Base{} when one was
  // not READY or they differ). A double-buffered rank's is the set in use (Set::kHeld), which the
  // sync does not write: a delta is rebuilt from it into the other set.
  struct Base {
    uint64_t version = 0;
    uint64_t fence = 0;  // of the sync attempt that committed it
  };
  Status beginSync(const std::string& id, const std::string& src, const std::string& dst, uint64_t version,
                   const std::string& src_digest, const std::string& dst_digest, uint64_t fence = 0,
                   Base* base = nullptr);
  // The destination of a sync as the registry sees it: (group, layout digest) of each group it
  // writes here. One group, or every replica of a replica set taking part (each its own group).
  using Destination = std::vector<std::pair<std::string, std::string>>;
  // As above, into every group of `dst`.
  // `seed`: `src` is a destination group read at `version` (a catch-up's seed replica): each of
  // its ranks here must be READY at exactly `version`, single-buffered and not being written; it
  // gains a reader, and no sync writes it until the reading sync ends.
  // `supersedes`: the fences of this sync's earlier attempts in the same Sync call
  // (PrepareRequest.supersedes): only those may be taken over on ranks they still write (Rank::lingering).
  // `owners`: each group's owner as the coordinator found it cluster-wide (PrepareRequest.owners):
  // a group of `src` or `dst` held here under another owner (or none) is refused, naming both.
  // `fingerprints`: group -> SHA-256 of the layout the plan was made from (CachedPlan::
  // layout_fingerprints); a rank of such a group that registered another layout under the same
  // digest (crafted to collide) is refused: a plan of another layout would move other bytes, and
  // might reach past the rank's buffers.
  Status beginSync(const std::string& id, const std::string& src, const Destination& dst, uint64_t version,
                   const std::string& src_digest, uint64_t fence = 0, Base* base = nullptr, bool seed = false,
                   const std::vector<uint64_t>& supersedes = {}, const std::map<std::string, uint32_t>& owners = {},
                   const std::map<std::string, std::string>& fingerprints = {});
  // Before every use of the involved ranks' memory (every execute): segments still whole.
  Status checkSync(const std::string& src, const std::string& dst) const;
  Status checkSync(const std::string& src, const std::vector<std::string>& dst) const;
  // A buffer of `src` or `dst` here that syncs must move packed (Describe's RemoteBuffer.staged:
  // device memory the transport cannot reach, or a client's segment the transport would touch in
  // the kernel), described for errors; "" when there is none.
  std::string packedOnly(const std::string& src, const std::vector<std::string>& dst) const;
  enum class SyncEnd {
    kCommit,    // every byte landed everywhere: destination ranks READY(V)
    kRevert,    // nothing was written anywhere: destination ranks back to where they were
    kDirty,     // bytes may have landed: destination ranks DIRTY (with `reason`)
    kDraining,  // as kDirty, but writes are still landing: the ranks stay held until drained()
  };
  // A kDraining attempt's (id, fence) writes are done: its destination ranks take syncs again,
  // and `src` (the group it read, "" when its end already let go of it: endSync) its writer.
  void drained(const std::string& id, uint64_t fence, const std::string& src, const std::vector<std::string>& dst);
  // Ends attempt (id, fence) on its ranks, and its read of `src` ("": it still reads it, until
  // drained()). Returns the states of the destination ranks it was writing here, after the change
  // (none for ranks a later attempt of the id took over).
  std::vector<v1::RankStatus> endSync(const std::string& id, uint64_t fence, const std::string& src,
                                      const std::string& dst, SyncEnd end, const std::string& reason = "");
  std::vector<v1::RankStatus> endSync(const std::string& id, uint64_t fence, const std::string& src,
                                      const std::vector<std::string>& dst, SyncEnd end, const std::string& reason = "");

  // The owner takes a rank (see AcquireRequest) / gives it back (ReleaseRequest).
  // `gone`: polled while waiting; true when the caller went away (its call was cancelled): then
  // the rank is not taken (CANCELLED), so no ownerless acquire holds it later.
  StatusOr<v1::RankStatus> acquire(const std::string& group, int32_t rank, const MemoryCaller& caller,
                                   std::chrono::milliseconds timeout, const std::function<bool()>& gone = nullptr,
                                   uint64_t registration = 0);
  StatusOr<v1::RankStatus> release(const std::string& group, int32_t rank, uint64_t version, const MemoryCaller& caller,
                                   uint64_t registration = 0);
  // Waits until every rank of `group` here is READY at >= `version` or the timeout passes;
  // FAILED_PRECONDITION naming the rank when one is DIRTY, NOT_FOUND when none is registered.
  // `gone`: polled while waiting; true when the caller went away: then CANCELLED.
  StatusOr<v1::WaitVersionResponse> waitVersion(const std::string& group, uint64_t version,
                                                std::chrono::milliseconds timeout,
                                                const std::function<bool()>& gone = nullptr) const;

  // Sessions (client liveness): registrations made under a session end with it.
  std::string openSession(const std::string& client);
  // Unregisters the session's ranks and unlinks their shm segments (those no other rank maps).
  // A rank a sync still uses is unregistered once that sync lets go of it (Rank::orphaned);
  // meanwhile every use of it is refused, and its group counts as changed for that sync.
  void closeSession(const std::string& session);
  // Sessions open now.
  size_t sessionCount() const;
  // What happened to the session's ranks since the last call: each one another process took over
  // (RegisterRequest.replace), as SessionEvent.superseded says it.
  std::vector<v1::SupersededRank> takeSuperseded(const std::string& session);
  // Shutdown: every waiting acquire and waitVersion returns UNAVAILABLE now.
  void shutdown();
  // Ranks per state, for metrics.
  std::map<v1::RankState, uint64_t> stateCounts() const;

  // Group owners outlive a restart (docs/security.md, "Group names after a restart"): `path`
  // (beside the socket, the daemon's own) holds the owned groups, rewritten whenever a group gains
  // or loses its owner. What it held at start stays reserved for its owner uid for `grace`: no
  // other uid registers those names meanwhile, so a restart cannot be raced to squat a running
  // job's group. Describe names the reservations (GroupAccess.reserved), with the time the owner
  // first held the group: the coordinators' gathers count them as the owner's claim on every node.
  // A file that is missing, or is not the daemon's own regular file, reserves nothing.
  Status keepOwners(const std::string& path, std::chrono::seconds grace);
  // Whether peers may send from and land in clients' shm segments directly (Describe's
  // RemoteBuffer.staged): by default where the transport cannot fault on a truncated segment
  // (transport::Capabilities::host_faults_contained); --host-zero-copy overrides it.
  void setHostZeroCopy(bool on) { host_zero_copy_ = on; }

 private:
  // With mu_ held: rewrites the owners file (keepOwners), if any; failures are logged.
  void persistOwners() const;
  // The copy engines of each GPU with registered memory, one stream per direction so that
  // landings are not queued behind packs; created on the GPU's first registration, they live as
  // long as the registry (syncs use them).
  struct DeviceEngines {
    std::unique_ptr<transport::CopyEngine> outgoing, incoming;
    int gpu = -1;
  };
  struct Buffer {
    std::string name;
    uint64_t size = 0;
    std::shared_ptr<transport::ShmSegment> segment;          // shm: the mapping (shared by buffers)
    std::shared_ptr<transport::CudaIpcMapping> cuda;         // cuda: the imported allocation(s)
    std::shared_ptr<transport::TransferMemory> cuda_memory;  // cuda: registered or staged
    std::shared_ptr<void> cuda_keep;                         // cuda: both of the above, kept alive as one
    std::byte* device = nullptr;                             // cuda: the buffer (offset applied)
    const DeviceEngines* engines = nullptr;                  // cuda: its GPU's
    std::shared_ptr<transport::MemoryRegion> region;         // what peers write into
    uint64_t offset = 0;                                     // of the buffer in `region`
    // What memory it is, for ownsItsMemory: the shm file ("shm " + ShmSegment::fileId()) or the
    // CUDA IPC allocation ("cuda <gpu> <handle>"), and where the buffer starts in it. "" for
    // cuMem allocations handed over by descriptor (not compared).
    std::string memory;
    uint64_t memory_offset = 0;
    uint64_t memory_bytes = 0;  // what the layout gives it (a handle may declare more)
  };
  struct Rank {
    std::string group;
    int32_t rank = 0;
    int32_t world = 0;
    std::string digest;
    std::string fingerprint;  // SHA-256 of the layout's serialisation (registry/fingerprint.h)
    uint64_t bytes = 0;
    // Each set sorted by name (mapBuffers): a sync looks a buffer up for every piece it moves, and
    // a MoE registers tens of thousands (findBuffer).
    std::vector<Buffer> buffers;
    // Double-buffered destination: the second set; `active` is the set the state describes (0:
    // buffers, 1: shadow), syncs write the other; `pinned` the set its engine acquired (-1: none).
    std::vector<Buffer> shadow;
    int active = 0;
    int pinned = -1;
    bool doubled() const { return !shadow.empty(); }
    // The set syncs write: the only one for single-buffered ranks.
    const std::vector<Buffer>& writeSet() const { return doubled() && active == 0 ? shadow : buffers; }
    // The set holding `committed`: the only one for single-buffered ranks.
    const std::vector<Buffer>& heldSet() const { return doubled() && active == 1 ? shadow : buffers; }
    v1::Role role = v1::ROLE_DESTINATION;
    v1::RankState state = v1::RANK_EMPTY;
    uint64_t committed = 0;     // destination: last committed version; source: last published
    uint64_t writing = 0;       // destination, UPDATING: the version being written
    uint64_t committed_by = 0;  // destination: the fence of the sync attempt that committed `committed`
    uint64_t writer_fence = 0;  // destination: the fence of the sync writing it
    bool held = false;          // acquired by its owner
    std::string detail;         // DIRTY: which sync, why
    std::string session;
    // Its session ended while a sync still used it (closeSession): it stays, refusing every use,
    // until that sync lets go (removeOrphans), so that its memory is never registered again under
    // it while a stuck copy of the sync may still read or write it.
    bool orphaned = false;
    std::optional<uid_t> owner;  // the uid that registered it over the Unix socket
    // The process that registered it over the Unix socket, as this daemon's pid namespace sees
    // it (0: not known: over TCP, or a process of a namespace this one does not see).
    pid_t pid = 0;
    uint64_t registration = 0;  // RegisterResponse.registration
    std::string holder;         // "uid U (pid P)", for the process that replaces it
    size_t describe_bytes = 0;  // what it adds to Describe (its buffers' entries)
    // Syncs reading it (a source, or a catch-up's seed), once per attempt: two attempts of one
    // sync id (a retry) each hold their own entry, so the first one's end (or, draining, its
    // drained()) leaves the second's.
    std::multiset<std::pair<std::string, uint64_t>> readers;  // (sync id, attempt fence)
    std::string writer;                                       // destination: the sync writing it
    // Destination, single-buffered: earlier attempts of the sync writing it (or that last wrote
    // it), by fence, whose writes may still land (a peer frozen mid-write). A retried attempt of
    // one sync id and version writes the same bytes where they land, so it may take the rank
    // over (beginSync); nothing else may (another sync, an acquire, a re-registration) until
    // each has ended (endSync) or drained (drained).
    struct Lingering {
      std::string id;
      uint64_t version = 0;
    };
    std::map<uint64_t, Lingering> lingering;
    // The sync using it, for errors: its writer, an attempt still landing, or a reader ("": none).
    std::string user() const {
      if (!writer.empty()) return writer;
      if (!lingering.empty()) return lingering.begin()->second.id;
      return readers.empty() ? std::string() : readers.begin()->first;
    }
    // Destination, UPDATING: where it was before, for kRevert.
    v1::RankState before = v1::RANK_EMPTY;
    std::string before_detail;
  };
  // What the sync preconditions (sync_preconditions.h) look at of a rank.
  static RankFacts factsOf(const Rank& r);
  struct Group {
    v1::Layout layout;
    std::string digest;
    v1::Role role = v1::ROLE_DESTINATION;
    std::optional<uid_t> owner;  // the uid of its first rank registered over the Unix socket
    size_t layout_bytes = 0;     // the layout's serialised size (in Describe once)
    std::set<uint32_t> readers;  // RegisterRequest.readers: uids the owner lets sync it out of here
    // When it got its owner here (GroupAccess.since_unix_ms): the owner's claim on the group across
    // the cluster, the earliest of which is the group's. Kept through a restart by the owners file.
    uint64_t since_unix_ms = 0;
    uint64_t changed = 0;  // the generation of its last registration or unregistration (stamps())
    // Its last registration changes (at most kKeptChanges), by generation, for the sync they fail:
    // "rank 2 registered again" (changesSince).
    std::vector<std::pair<uint64_t, std::string>> changes{};
    uint64_t dropped = 0;  // the generation of the newest change no longer kept
  };
  static constexpr size_t kKeptChanges = 8;
  // With mu_ held: `group`'s registrations changed (`what`, naming the rank): a new generation.
  void noteChange(Group& group, std::string what);
  // With mu_ held: Describe's size if `rank` joined (replacing its predecessor, if any) with a
  // layout of `layout_bytes`.
  size_t describeBytesWith(const Rank& rank, size_t layout_bytes) const;

  // With mu_ held: unlinks the shm segments of `gone` that no registered rank maps any more;
  // torch's (kTorchShmPrefix) only once the process that registered `gone` is known to be gone.
  void unlinkSegments(const Rank& gone);
  // With mu_ held: may `caller` register this rank of `req.group()` with this layout and role?
  Status mayJoin(const v1::RegisterRequest& req, const std::string& digest, v1::Role role,
                 const MemoryCaller& caller) const;
  // With mu_ held: may `caller` unregister, acquire or publish `r`? `registration`: as the public
  // calls take it (0: any).
  Status mayChange(const Rank& r, const MemoryCaller& caller, const char* what, uint64_t registration = 0) const;

  // With mu_ held: `r`'s memory against itself and every other rank's here. A destination's
  // buffers (either set) overlap no other buffer; a source's overlap no destination's (sources may
  // share memory: a tied weight read under two names). The rank `r` replaces is not compared.
  // Otherwise a sync writes one buffer's bytes over another's, or over a source's, unseen.
  Status ownsItsMemory(const Rank& r) const;
  StatusOr<std::unique_ptr<Rank>> build(const v1::RegisterRequest& request, std::string digest,
                                        const MemoryCaller& caller);
  // The buffer of `set` (sorted by name) named `name`, or nullptr.
  static const Buffer* findBuffer(const std::vector<Buffer>& set, const std::string& name);
  // One set of a rank's buffers from its handles, checked against what the layout gives it,
  // sorted by name.
  // A CUDA buffer of a registration (an IPC handle, or cuMem allocations handed over by
  // descriptor): imported, on a GPU of this daemon, ready for the transport (registered directly
  // or staged: said once in the log) into `b`.
  // This daemon's number of the GPU a client named: the one with `uuid` when given (a container
  // numbers its GPUs its own way), else `client_device` itself.
  StatusOr<int> daemonDevice(int client_device, const std::string& uuid) const;
  Status mapDeviceBuffer(const std::string& who, const std::string& name, const v1::MemoryHandle& h, int64_t needed,
                         const MemoryCaller& caller, Buffer* b);
  StatusOr<std::vector<Buffer>> mapBuffers(const std::string& who,
                                           const google::protobuf::RepeatedPtrField<v1::MemoryHandle>& handles,
                                           std::map<std::string, int64_t> needed,
                                           const std::map<std::string, const planner::TensorLayout*>& held_by,
                                           const std::map<std::string, std::vector<int64_t>>& shapes,
                                           const MemoryCaller& caller);
  v1::RankStatus statusOf(const Rank& r) const;
  Rank* findRank(const std::string& group, int32_t rank) const;
  Status checkSegments(const Rank& r) const;
  // With mu_ held: unregisters the orphaned ranks no sync uses any more (Rank::orphaned).
  void removeOrphans();
  // Unregisters (with mu_ held); unlinks its segments when `unlink` and nothing else maps them.
  // `how`: what happened, after "rank R" (Group::change).
  void removeRank(std::map<std::pair<std::string, int32_t>, std::unique_ptr<Rank>>::iterator it, bool unlink,
                  const char* how);

  std::string node_;
  std::string instance_;  // random per daemon start (DescribeResponse.instance)
  transport::Context& transport_;
  transport::DeviceRuntime& gpus_;
  HandedFds handed_fds_;
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int32_t>, std::unique_ptr<Rank>> ranks_;
  std::map<std::string, Group> groups_;
  // keepOwners: the file, and the groups reserved for their owner uid until a time.
  std::string owners_path_;
  std::optional<bool> host_zero_copy_;  // setHostZeroCopy; unset: the transport's capability
  bool hostSafe() const;                // clients' segments may be handed to the transport
  static bool mustPack(const Buffer& b, bool host_safe);
  // A group name held before a restart: its owner, until when it is kept for it, and since when
  // the owner held it (GroupAccess.since_unix_ms, which its re-registration keeps).
  struct Reservation {
    uid_t owner = 0;
    std::chrono::steady_clock::time_point until;
    uint64_t since_unix_ms = 0;
  };
  std::map<std::string, Reservation> reserved_;
  std::set<std::string> sessions_;
  std::map<std::string, std::vector<v1::SupersededRank>> superseded_;  // by session: takeSuperseded
  uint64_t next_registration_ = 1;
  uint64_t next_session_ = 1;
  uint64_t generation_ = 0;
  bool stopping_ = false;
  mutable std::condition_variable state_cv_;  // any rank state, reader or writer change
  StatusOr<const DeviceEngines*> deviceEngines(int gpu);
  // By GPU. Declared last, so destroyed first: each waits for its stream before the mappings its
  // copies read and write are closed.
  std::map<int, DeviceEngines> cuda_engines_;
};

}  // namespace shardcast::daemon
