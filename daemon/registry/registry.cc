// The registry: registration (checked against the layout, the node and the caller), listing and
// Describe, the buffers syncs use, sessions. Memory mapping is in registry_memory.cc, the version
// contract in registry_contract.cc.
#include "daemon/registry/registry.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <thread>

#include "common/strings.h"
#include "daemon/registry/fingerprint.h"
#include "planner/layout.h"
#include "planner/limits.h"
#include "transport/copy_engine.h"

namespace shardcast::daemon {

namespace {

// Whether process `pid` (this daemon's pid namespace) has ended: no such process, or a zombie
// (its memory and descriptors released, so it runs no more code). 0: not known, so not gone.
bool processGone(pid_t pid) {
  if (pid <= 0) return false;
  FILE* f = std::fopen(strCat("/proc/", pid, "/stat").c_str(), "r");
  if (f == nullptr) return errno == ENOENT;
  char line[512] = {};
  const size_t n = std::fread(line, 1, sizeof(line) - 1, f);
  std::fclose(f);
  // "<pid> (<comm>) <state> ...": the state follows the last ')' (comm may hold one).
  const char* close = std::strrchr(line, ')');
  if (n == 0 || close == nullptr || close[1] != ' ') return false;
  return close[2] == 'Z' || close[2] == 'X';
}

std::string randomInstance() {
  std::random_device rd;
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%08x%08x", rd(), rd());
  return hex;
}

// The role a request registers its rank as: a source, or (unspecified too) a destination.
v1::Role roleOf(const v1::RegisterRequest& req) {
  return req.role() == v1::ROLE_SOURCE ? v1::ROLE_SOURCE : v1::ROLE_DESTINATION;
}

// What a request claims on its own, checked before anything is looked up or mapped.
Status checkRegisterRequest(const v1::RegisterRequest& req, const std::string& who) {
  if (req.group().empty()) return absl::InvalidArgumentError("register: group is empty");
  if (req.layout().group() != req.group())
    return absl::InvalidArgumentError(strCat(who, ": the layout is for group \"", req.layout().group(), "\""));
  if (req.role() != v1::ROLE_UNSPECIFIED && !v1::Role_IsValid(req.role()))
    return absl::InvalidArgumentError(strCat(who, ": unknown role ", static_cast<int>(req.role())));
  if (req.version() != 0 && roleOf(req) != v1::ROLE_SOURCE)
    return absl::InvalidArgumentError(strCat(who,
                                             ": only a source rank may register with a version (its own bytes); a "
                                             "destination rank starts EMPTY until a sync commits"));
  if (req.version() != 0 && !planner::isVersion(req.version()))  // 0: none
    return absl::InvalidArgumentError(strCat(who, ": version ", req.version(), " is not in ", planner::kVersionRange));
  if (req.active_set() > 1 || (req.active_set() == 1 && req.shadow_buffers_size() == 0))
    return absl::InvalidArgumentError(strCat(who, ": active set ", req.active_set(),
                                             " (0: buffers, 1: shadow_buffers, which only a double-buffered "
                                             "destination has)"));
  if (req.readers_size() > 64)
    return absl::InvalidArgumentError(strCat(who, ": ", req.readers_size(), " read grants (at most 64)"));
  return absl::OkStatus();
}

// What the session of the rank's registration `registration` is told when `req` (of `holder`)
// takes the rank over on `node`.
v1::SupersededRank supersededNotice(const v1::RegisterRequest& req, const std::string& who, const std::string& node,
                                    const std::string& holder, uint64_t registration) {
  v1::SupersededRank told;
  told.set_group(req.group());
  told.set_rank(req.rank());
  told.set_registration(registration);
  told.set_message(strCat(who, " on node \"", node, "\" was taken over by ", holder, " (registration ", registration,
                          " superseded): this process no longer holds it"));
  return told;
}

}  // namespace

Registry::Registry(std::string node, transport::Context& transport, transport::DeviceRuntime& gpus)
    : node_(std::move(node)), instance_(randomInstance()), transport_(transport), gpus_(gpus) {}

StatusOr<v1::RegisterResponse> Registry::registerRank(const v1::RegisterRequest& req, const MemoryCaller& caller) {
  const std::string who = strCat("group \"", req.group(), "\" rank ", req.rank());
  SC_RETURN_IF_ERROR(checkRegisterRequest(req, who));
  const std::string serialized = planner::serializedLayout(req.layout());
  const std::string digest = planner::layoutDigestOf(serialized);
  const v1::Role role = roleOf(req);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!req.session_id().empty() && !sessions_.count(req.session_id()))
      return absl::FailedPreconditionError(strCat(who, ": session \"", req.session_id(), "\" is not open on node \"",
                                                  node_,
                                                  "\" (the daemon restarted or the session ended): open a new one"));
    SC_RETURN_IF_ERROR(mayJoin(req, digest, role, caller));
  }
  SC_ASSIGN_OR_RETURN(auto rank, build(req, digest, caller));
  rank->fingerprint = sha256(serialized);
  v1::RegisterResponse resp;
  resp.set_layout_digest(digest);
  resp.set_registered_bytes(rank->bytes);
  resp.set_node(node_);
  std::lock_guard<std::mutex> lock(mu_);
  if (!req.session_id().empty() && !sessions_.count(req.session_id()))
    return absl::FailedPreconditionError(
        strCat(who, ": session \"", req.session_id(), "\" ended during the registration"));
  // Again under the lock that commits: another rank of the group may have registered meanwhile.
  SC_RETURN_IF_ERROR(mayJoin(req, digest, role, caller));
  const size_t layout_bytes = req.layout().ByteSizeLong();
  if (const size_t described = describeBytesWith(*rank, layout_bytes); described > planner::limits().max_describe_bytes)
    return absl::ResourceExhaustedError(strCat(who, ": this daemon's registrations would describe themselves in ",
                                               described, " bytes (at most ", planner::limits().max_describe_bytes,
                                               ", what peers can receive)"));
  SC_RETURN_IF_ERROR(ownsItsMemory(*rank));
  if (auto in_use = ranks_.find({req.group(), req.rank()}); in_use != ranks_.end() && !in_use->second->user().empty())
    return absl::FailedPreconditionError(
        strCat(who, " is in use by sync ", in_use->second->user(), ": register it again once that sync ended"));
  if (!groups_.count(req.group()) && static_cast<int>(groups_.size()) >= planner::limits().max_groups_per_daemon)
    return absl::ResourceExhaustedError(strCat(who, ": this daemon already holds ", groups_.size(), " groups (at most ",
                                               planner::limits().max_groups_per_daemon, ")"));
  auto [group, added] = groups_.try_emplace(req.group());
  const std::optional<uid_t> group_owner =
      added ? (caller.local ? std::optional<uid_t>(caller.uid) : std::nullopt) : group->second.owner;
  std::set<uint32_t> readers = added ? std::set<uint32_t>{} : group->second.readers;
  readers.insert(req.readers().begin(), req.readers().end());  // mayJoin: the caller may join it
  uint64_t since = added ? 0 : group->second.since_unix_ms;
  if (added && group_owner) {
    // Its owner's claim dates from its first registration; one that takes its reserved name back
    // keeps the time it had before the restart (the group's first registration cluster-wide).
    const auto r = reserved_.find(req.group());
    since = r != reserved_.end() && r->second.owner == *group_owner &&
                    std::chrono::steady_clock::now() < r->second.until && r->second.since_unix_ms != 0
                ? r->second.since_unix_ms
                : static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                            std::chrono::system_clock::now().time_since_epoch())
                                            .count());
  }
  auto history = std::move(group->second.changes);
  const uint64_t dropped = group->second.dropped;
  group->second = Group{req.layout(), digest, role, group_owner, layout_bytes, std::move(readers), since};
  group->second.changes = std::move(history);
  group->second.dropped = dropped;
  if (added) {
    reserved_.erase(req.group());  // live again (its owner, or past the grace)
    if (group_owner) persistOwners();
  }
  noteChange(group->second, strCat("rank ", req.rank(),
                                   ranks_.count({req.group(), req.rank()}) ? " registered again" : " registered"));
  // A re-registration is a new rank: it starts over. The one it replaces is told (its session) and
  // its segments no other rank maps are unlinked.
  rank->registration = next_registration_++;
  resp.set_registration(rank->registration);
  std::unique_ptr<Rank> superseded;
  if (auto old = ranks_.find({req.group(), req.rank()}); old != ranks_.end()) superseded = std::move(old->second);
  const bool replaced = superseded != nullptr;
  ranks_[{req.group(), req.rank()}] = std::move(rank);
  if (superseded) {
    if (!superseded->session.empty() && superseded->session != req.session_id() && sessions_.count(superseded->session))
      superseded_[superseded->session].push_back(
          supersededNotice(req, who, node_, ranks_[{req.group(), req.rank()}]->holder, superseded->registration));
    unlinkSegments(*superseded);
  }
  state_cv_.notify_all();
  const Rank& r = *ranks_[{req.group(), req.rank()}];
  spdlog::info("{} {}registered as {}: {} buffers, {} bytes, layout {}, {}{}", who, replaced ? "re-" : "",
               v1::roleName(role), r.buffers.size(), resp.registered_bytes(), digest, v1::rankStateName(r.state),
               r.state == v1::RANK_READY ? strCat("(", r.committed, ")") : "");
  return resp;
}

StatusOr<std::unique_ptr<Registry::Rank>> Registry::build(const v1::RegisterRequest& req, std::string digest,
                                                          const MemoryCaller& caller) {
  const std::string who = strCat("group \"", req.group(), "\" rank ", req.rank());
  planner::NodeTable nodes;
  auto layout = planner::resolveLayout(req.layout(), nodes, req.rank());  // this rank's pieces only
  if (!layout.ok()) return absl::InvalidArgumentError(strCat(who, ": ", layout.status().message()));
  if (req.world_size() != layout->world())
    return absl::InvalidArgumentError(
        strCat(who, ": world_size ", req.world_size(), " but the layout's mesh has ", layout->world(), " ranks"));
  if (req.rank() < 0 || req.rank() >= layout->world())
    return absl::InvalidArgumentError(strCat(who, ": rank out of range [0, ", layout->world(), ")"));
  const std::string& rank_node = nodes.name(layout->rank_node[req.rank()]);
  if (rank_node != node_)
    return absl::FailedPreconditionError(
        strCat(who, ": the layout places it on node \"", rank_node, "\" but this daemon is node \"", node_, "\""));
  // The buffers this rank needs and their sizes, against the handles given.
  std::map<std::string, int64_t> needed;
  for (const auto& [buffer, bytes] : layout->rankBuffers(req.rank())) needed[layout->buffer_names[buffer]] = bytes;
  // What the client says it holds there, when it says so: the layout's dtype and element count.
  // A buffer holds one tensor's shard or several fused tensors' (one dtype: their first's).
  std::map<std::string, const planner::TensorLayout*> held_by;
  // A buffer that is exactly one box of one tensor, dense and row-major from its start, has that
  // box's shape: a client's shape must be it, not merely as many elements (a [6, 4] tensor where
  // the layout says [4, 6] would take the bytes scrambled).
  std::map<std::string, std::vector<int64_t>> shapes;
  std::map<std::string, int> pieces_in;
  for (const auto& t : layout->tensors)
    for (const auto& p : t.pieces)
      if (p.rank == req.rank()) {
        const std::string& name = layout->buffer_names[static_cast<size_t>(p.buffer)];
        held_by.emplace(name, &t);
        if (++pieces_in[name] > 1) {
          shapes.erase(name);
          continue;
        }
        const auto sizes = t.boxes[static_cast<size_t>(p.box)].sizes();
        if (p.offset == 0 && layout->strides[static_cast<size_t>(p.strides)] == transport::denseStrides(sizes))
          shapes[name] = sizes;
      }

  auto rank = std::make_unique<Rank>();
  rank->group = req.group();
  rank->rank = req.rank();
  rank->world = req.world_size();
  rank->digest = std::move(digest);
  rank->role = roleOf(req);
  rank->session = req.session_id();
  if (caller.local) {
    rank->owner = caller.uid;
    rank->pid = caller.pid;
  }
  rank->holder = caller.local ? strCat("uid ", caller.uid, " (pid ", caller.pid, ")") : std::string("a remote client");
  if (req.version() > 0) {  // a source's own bytes
    rank->state = v1::RANK_READY;
    rank->committed = req.version();
  }
  SC_ASSIGN_OR_RETURN(rank->buffers, mapBuffers(who, req.buffers(), needed, held_by, shapes, caller));
  if (req.shadow_buffers_size() > 0) {
    // Double-buffered: a second set of the same buffers; syncs write the set not in use.
    if (req.role() == v1::ROLE_SOURCE)
      return absl::InvalidArgumentError(strCat(who, ": only a destination rank is double-buffered (shadow_buffers)"));
    SC_ASSIGN_OR_RETURN(rank->shadow,
                        mapBuffers(strCat(who, " (shadow)"), req.shadow_buffers(), needed, held_by, shapes, caller));
  }
  rank->active = static_cast<int>(req.active_set());
  if (req.held()) {  // as Registry::acquire leaves it (a source's version: what it published before)
    rank->held = true;
    if (rank->role == v1::ROLE_SOURCE) rank->state = v1::RANK_UPDATING;
    if (rank->doubled()) rank->pinned = rank->active;
  }
  for (const auto& set : {&rank->buffers, &rank->shadow})
    for (const auto& b : *set) rank->bytes += b.size;
  for (const auto& b : rank->buffers)  // RemoteBuffer: name, region descriptor, offset, size
    rank->describe_bytes += b.name.size() + (b.region ? b.region->remote().serialize().size() : 0) + 32;
  return rank;
}

Status Registry::mayJoin(const v1::RegisterRequest& req, const std::string& digest, v1::Role role,
                         const MemoryCaller& caller) const {
  const std::string who = strCat("group ", quote(req.group()), " rank ", req.rank());
  auto g = groups_.find(req.group());
  if (g == groups_.end()) {
    auto r = reserved_.find(req.group());
    if (r == reserved_.end() || std::chrono::steady_clock::now() >= r->second.until || caller.any_owner ||
        (caller.local && caller.uid == r->second.owner))
      return absl::OkStatus();
    const auto left =
        std::chrono::duration_cast<std::chrono::seconds>(r->second.until - std::chrono::steady_clock::now());
    return absl::PermissionDeniedError(
        strCat(who, ": the group is reserved for uid ", r->second.owner, ", which held it on node \"", node_,
               "\" before the daemon restarted (for ", left.count() + 1, " s more, --owner-grace-s); ",
               caller.local ? strCat("uid ", caller.uid) : std::string("a remote client"), " may not take it"));
  }
  // A group is its first registering uid's: no other uid adds ranks to it or replaces them.
  if (!caller.any_owner && g->second.owner && !(caller.local && *g->second.owner == caller.uid))
    return absl::PermissionDeniedError(strCat(
        who, ": the group is registered by uid ", *g->second.owner, " on node \"", node_, "\"; ",
        caller.local ? strCat("uid ", caller.uid) : std::string("a remote client"), " may not register its ranks"));
  // A rank is its registering uid's: only it replaces it (the group's owner included: root may
  // have registered a rank of it).
  if (auto r = ranks_.find({req.group(), req.rank()}); r != ranks_.end()) {
    SC_RETURN_IF_ERROR(mayChange(*r->second, caller, "replace"));
    // In use, it is not free to take with or without replace: say so rather than suggest it (its
    // holder may have just closed its client: the rank goes once the sync lets go of it).
    if (!r->second->user().empty())
      return absl::FailedPreconditionError(strCat(who, " is in use by sync ", r->second->user(), " (registered by ",
                                                  r->second->holder, ", registration ", r->second->registration,
                                                  "): register it again once that sync ended"));
    // A second registration never takes a rank over silently: its holder would go on believing
    // it holds the rank (and its version) while another process's memory receives the syncs.
    if (!req.replace())
      return absl::AlreadyExistsError(strCat(who, " is registered already on node \"", node_, "\", by ",
                                             r->second->holder, " (registration ", r->second->registration,
                                             "): register with replace to take it over (its holder is told)"));
  }
  // Every rank of a group must register the same layout (the planner needs one per group) and role.
  bool others = false;
  for (const auto& [key, r] : ranks_) others |= key.first == req.group() && key.second != req.rank();
  if (others && g->second.digest != digest)
    return absl::FailedPreconditionError(strCat(who, ": layout digest ", digest, " differs from ", g->second.digest,
                                                " registered by other ranks of the group"));
  if (others && g->second.role != role)
    return absl::FailedPreconditionError(strCat(who, ": registers as ", v1::roleName(role),
                                                " but the group's other ranks are ", v1::roleName(g->second.role)));
  return absl::OkStatus();
}

size_t Registry::describeBytesWith(const Rank& rank, size_t layout_bytes) const {
  size_t total = rank.describe_bytes + layout_bytes;
  for (const auto& [key, r] : ranks_)
    if (key != std::make_pair(rank.group, rank.rank)) total += r->describe_bytes;
  for (const auto& [name, g] : groups_)
    if (name != rank.group) total += g.layout_bytes;
  return total;
}

Status Registry::mayChange(const Rank& r, const MemoryCaller& caller, const char* what, uint64_t registration) const {
  if (!(caller.any_owner || !r.owner || (caller.local && *r.owner == caller.uid)))
    return absl::PermissionDeniedError(
        strCat("group ", quote(r.group), " rank ", r.rank, " is registered by uid ", *r.owner, ": ",
               caller.local ? strCat("uid ", caller.uid) : std::string("a remote client"), " may not ", what, " it"));
  if (r.orphaned)
    return absl::FailedPreconditionError(strCat(
        "group ", quote(r.group), " rank ", r.rank, " on node ", quote(node_),
        ": its client's session ended while sync ", r.user(), " used it; it is unregistered once that sync lets go (",
        r.holder, "'s registration ", r.registration, "): may not ", what, " it until then"));
  // A registration that was replaced never acts on its successor.
  if (registration != 0 && registration != r.registration)
    return absl::FailedPreconditionError(strCat("group ", quote(r.group), " rank ", r.rank, ": registration ",
                                                registration, " was taken over by ", r.holder, " (registration ",
                                                r.registration, "): this one may not ", what, " it any more"));
  return absl::OkStatus();
}

Status Registry::unregisterRank(const std::string& group, int32_t rank, const MemoryCaller& caller,
                                uint64_t registration) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ranks_.find({group, rank});
  if (it == ranks_.end())
    return absl::NotFoundError(
        strCat("group \"", group, "\" rank ", rank, " is not registered on node \"", node_, "\""));
  SC_RETURN_IF_ERROR(mayChange(*it->second, caller, "unregister", registration));
  if (!it->second->user().empty())
    return absl::FailedPreconditionError(strCat("group \"", group, "\" rank ", rank, " is in use by sync ",
                                                it->second->user(), ": unregister it once that sync ended"));
  removeRank(it, false, "unregistered");
  spdlog::info("group \"{}\" rank {} unregistered", group, rank);
  return absl::OkStatus();
}

void Registry::removeRank(std::map<std::pair<std::string, int32_t>, std::unique_ptr<Rank>>::iterator it, bool unlink,
                          const char* how) {
  const std::string group = it->first.first;
  std::unique_ptr<Rank> gone = std::move(it->second);
  ranks_.erase(it);
  noteChange(groups_[group], strCat("rank ", gone->rank, " ", how));
  bool any = false;
  for (const auto& [key, r] : ranks_) any |= key.first == group;
  if (!any) {
    const bool owned = groups_[group].owner.has_value();
    groups_.erase(group);
    if (owned) persistOwners();
  }
  state_cv_.notify_all();
  if (unlink) unlinkSegments(*gone);
}

void Registry::unlinkSegments(const Rank& gone) {
  std::set<std::string> mapped_elsewhere;
  for (const auto& [key, r] : ranks_)
    for (const auto* set : {&r->buffers, &r->shadow})
      for (const auto& b : *set)
        if (b.segment) mapped_elsewhere.insert(b.segment->name());
  // torch's own: left to torch while the process may still free them (a client that closed its
  // session, a frozen one cut, a replaced holder), and to its torch_shm_manager where this daemon
  // cannot tell (pid 0).
  const bool torchs_too = processGone(gone.pid);
  std::set<std::string> done;
  for (const auto* set : {&gone.buffers, &gone.shadow})
    for (const auto& b : *set)
      if (b.segment && (torchs_too || b.segment->name().rfind(kTorchShmPrefix, 0) != 0) &&
          !mapped_elsewhere.count(b.segment->name()) && done.insert(b.segment->name()).second)
        b.segment->unlinkName();
}

std::vector<v1::RankRegistration> Registry::list() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<v1::RankRegistration> out;
  for (const auto& [key, r] : ranks_) {
    v1::RankRegistration reg;
    reg.set_group(r->group);
    reg.set_rank(r->rank);
    reg.set_world_size(r->world);
    reg.set_node(node_);
    reg.set_layout_digest(r->digest);
    reg.set_registered_bytes(r->bytes);
    for (const auto& b : r->buffers) reg.add_buffers(b.name);
    const v1::RankStatus st = statusOf(*r);
    reg.set_version(st.version());
    reg.set_state(st.state());
    reg.set_role(r->role);
    reg.set_held(r->held);
    reg.set_detail(st.detail());
    if (const auto g = groups_.find(r->group); g != groups_.end()) {
      reg.set_replica_set(g->second.layout.replica_set());
      reg.set_replica(g->second.layout.replica());
    }
    out.push_back(std::move(reg));
  }
  return out;
}

std::vector<v1::GroupStatus> Registry::groups() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, v1::GroupStatus> by_name;
  for (const auto& [key, r] : ranks_) {
    auto& g = by_name[r->group];
    g.set_group(r->group);
    g.set_world_size(r->world);
    g.add_ranks(r->rank);
    g.set_layout_digest(r->digest);
    g.set_registered_bytes(g.registered_bytes() + r->bytes);
    g.set_role(r->role);
    if (const auto known = groups_.find(r->group); known != groups_.end()) {
      g.set_replica_set(known->second.layout.replica_set());
      g.set_replica(known->second.layout.replica());
    }
    *g.add_rank_states() = statusOf(*r);
  }
  std::map<std::string, uint64_t> committed;  // the lowest of each group's ranks here
  for (const auto& [key, r] : ranks_) {
    auto [it, first] = committed.try_emplace(r->group, r->committed);
    if (!first) it->second = std::min(it->second, r->committed);
  }
  std::vector<v1::GroupStatus> out;
  for (auto& [name, g] : by_name) {
    uint64_t version = UINT64_MAX;
    for (const auto& st : g.rank_states()) version = std::min(version, st.state() == v1::RANK_READY ? st.version() : 0);
    g.set_version(version == UINT64_MAX ? 0 : version);
    g.set_committed_version(committed[name]);
    out.push_back(std::move(g));
  }
  return out;
}

Status Registry::keepOwners(const std::string& path, std::chrono::seconds grace) {
  std::lock_guard<std::mutex> lock(mu_);
  owners_path_ = path;
  // Non-blocking: a FIFO planted there cannot hang the start. Anything but this daemon's own
  // regular file is ignored, loudly (the reservations are then lost; the daemon still serves).
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    if (errno != ENOENT) spdlog::warn("owners file {}: {}; no group names reserved", quote(path), std::strerror(errno));
    return absl::OkStatus();
  }
  struct stat st {};
  std::string text;
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == ::geteuid() && st.st_size <= (4 << 20)) {
    text.resize(static_cast<size_t>(st.st_size));
    text.resize(static_cast<size_t>(std::max<ssize_t>(0, ::read(fd, text.data(), text.size()))));
  } else {
    spdlog::warn("owners file {} is not a regular file of this daemon's uid (at most 4 MiB): no group names reserved",
                 quote(path));
  }
  ::close(fd);
  // "uid hex(group) since_unix_ms" per line (an older daemon's: without the time): written by
  // persistOwners, read back as such; anything else skipped.
  const auto until = std::chrono::steady_clock::now() + grace;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const auto space = line.find(' ');
    if (space == std::string::npos || space == 0) continue;
    const auto second = line.find(' ', space + 1);
    uint64_t since = 0;
    if (second != std::string::npos) {
      const std::string digits = line.substr(second + 1);
      char* since_end = nullptr;
      since = std::strtoull(digits.c_str(), &since_end, 10);
      if (digits.empty() || digits.size() > 20 || since_end != digits.c_str() + digits.size()) continue;
    }
    const std::string hex =
        line.substr(space + 1, second == std::string::npos ? std::string::npos : second - space - 1);
    if (hex.empty() || hex.size() % 2 != 0 || hex.size() > 2 * 512) continue;
    std::string group;
    bool ok = true;
    auto nibble = [&](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      ok = false;
      return 0;
    };
    for (size_t i = 0; i < hex.size() && ok; i += 2)
      group.push_back(static_cast<char>(nibble(hex[i]) * 16 + nibble(hex[i + 1])));
    char* end = nullptr;
    const unsigned long uid = std::strtoul(line.c_str(), &end, 10);
    if (!ok || end != line.c_str() + space || uid > UINT32_MAX) continue;
    reserved_[group] = {static_cast<uid_t>(uid), until, since};
  }
  if (!reserved_.empty())
    spdlog::info("{} group name(s) reserved for their owners for {} s (held before this daemon restarted)",
                 reserved_.size(), grace.count());
  return absl::OkStatus();
}

void Registry::persistOwners() const {
  if (owners_path_.empty()) return;
  std::string text;
  const auto line = [&](uid_t owner, const std::string& name, uint64_t since) {
    text += strCat(owner, " ");
    for (const unsigned char c : name) text += fmt::format("{:02x}", c);
    text += strCat(" ", since, "\n");
  };
  for (const auto& [name, g] : groups_)
    if (g.owner) line(*g.owner, name, g.since_unix_ms);
  // Reservations not yet taken up stay reserved across a second restart within the grace.
  const auto now = std::chrono::steady_clock::now();
  for (const auto& [name, r] : reserved_)
    if (!groups_.count(name) && now < r.until) line(r.owner, name, r.since_unix_ms);
  // A fresh file (whatever was planted at the name goes first: a FIFO there would block this open
  // under the registry's lock), then renamed over the old one.
  const std::string tmp = owners_path_ + ".tmp";
  ::unlink(tmp.c_str());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, 0600);
  if (fd < 0) {
    spdlog::warn("owners file {}: {}", tmp, std::strerror(errno));
    return;
  }
  const bool written = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  if (!written || ::rename(tmp.c_str(), owners_path_.c_str()) != 0)
    spdlog::warn("owners file {}: could not be written: {}", owners_path_, std::strerror(errno));
}

bool Registry::hostSafe() const { return host_zero_copy_.value_or(transport_.capabilities().host_faults_contained); }

bool Registry::mustPack(const Buffer& b, bool host_safe) { return !b.region || (b.segment && !host_safe); }

std::string Registry::packedOnly(const std::string& src, const std::vector<std::string>& dst) const {
  const bool host_safe = hostSafe();
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [key, r] : ranks_)
    if (key.first == src || std::find(dst.begin(), dst.end(), key.first) != dst.end())
      for (const auto& b : r->buffers)
        if (mustPack(b, host_safe))
          return strCat("group \"", r->group, "\" rank ", r->rank, " buffer \"", b.name, "\" on node \"", node_, "\" (",
                        b.segment ? "a client's shared memory, which this transport would touch in the kernel"
                                  : "device memory this transport cannot reach",
                        ")");
  return "";
}

v1::DescribeResponse Registry::describe(const v1::DescribeRequest& ask) const {
  v1::DescribeResponse d;
  d.set_node(node_);
  d.set_instance(instance_);
  if (ask.layouts_size() > 0) {  // a gather fetching layouts it lacks: those, and nothing else
    const std::set<std::string> wanted(ask.layouts().begin(), ask.layouts().end());
    std::lock_guard<std::mutex> lock(mu_);
    d.set_generation(generation_);
    for (const auto& [group, g] : groups_)
      if (wanted.count(g.digest)) *d.add_layouts() = g.layout;
    return d;
  }
  d.set_transport_address(transport_.address());
  d.set_relays_call_parts(true);      // (relay.cc: this build's relays do)
  d.set_delta_tree_hash(true);        // (execution.cc: this build's decode checks both hashes)
  d.set_set_layouts_by_digest(true);  // (PlanCache::forSetPrepare)
  const bool host_safe = hostSafe();
  std::lock_guard<std::mutex> lock(mu_);
  d.set_generation(generation_);  // of exactly what follows
  for (const auto& [group, g] : groups_) {
    if (ask.layout_digests())
      (*d.mutable_layout_digests())[group] = g.digest;
    else
      *d.add_layouts() = g.layout;
    if (!g.owner) continue;  // registered by a --insecure daemon's remote caller: nobody's
    auto* a = d.add_access();
    a->set_group(group);
    a->set_owner_uid(*g.owner);
    a->set_since_unix_ms(g.since_unix_ms);
    for (const uint32_t uid : g.readers) a->add_readers(uid);
  }
  // Names reserved for their owners after a restart: their claim on the group, cluster-wide.
  const auto now = std::chrono::steady_clock::now();
  for (const auto& [group, r] : reserved_) {
    if (groups_.count(group) || now >= r.until) continue;
    auto* a = d.add_access();
    a->set_group(group);
    a->set_owner_uid(r.owner);
    a->set_since_unix_ms(r.since_unix_ms);
    a->set_reserved(true);
  }
  for (const auto& [key, r] : ranks_) {
    auto* rr = d.add_ranks();
    rr->set_group(r->group);
    rr->set_rank(r->rank);
    rr->set_layout_digest(r->digest);
    const v1::RankStatus st = statusOf(*r);
    rr->set_version(st.version());
    rr->set_state(st.state());
    rr->set_role(r->role);
    rr->set_held(r->held);
    // Held by its engine on the set a sync would write, written by another sync, or read as a
    // catch-up's seed: a sync cannot write it now.
    rr->set_double_buffered(r->doubled());
    rr->set_refuses_writes(r->role == v1::ROLE_DESTINATION &&
                           ((r->held && (!r->doubled() || r->pinned != r->active)) || !r->user().empty()));
    rr->set_written(!r->writer.empty() || !r->lingering.empty());
    rr->set_readers(static_cast<uint32_t>(r->readers.size()));
    for (const auto& b : r->buffers) {
      auto* rb = rr->add_buffers();
      rb->set_buffer(b.name);
      if (b.region) rb->set_region(b.region->remote().serialize());
      // Device memory the transport cannot reach (no region to offer peers), or a client's segment
      // that a transport faulting in the kernel must not touch: synced packed, through this
      // daemon's own staging and arena.
      if (mustPack(b, host_safe)) rb->set_staged(true);
      rb->set_offset(b.offset);
      rb->set_size(b.size);
    }
  }
  return d;
}

uint64_t Registry::registeredBytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t n = 0;
  for (const auto& [key, r] : ranks_) n += r->bytes;
  return n;
}

StatusOr<std::pair<std::shared_ptr<transport::MemoryRegion>, uint64_t>> Registry::nextLanding(
    const std::string& group, int32_t rank, const std::string& buffer) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ranks_.find({group, rank});
  if (it == ranks_.end())
    return absl::FailedPreconditionError(
        strCat("group \"", group, "\" rank ", rank, " is not registered on node \"", node_, "\""));
  const Rank& r = *it->second;
  const std::vector<Buffer>& next = r.doubled() && r.active == 1 ? r.shadow : r.buffers;  // the set not written now
  if (const Buffer* b = findBuffer(r.doubled() ? next : r.writeSet(), buffer))
    return std::make_pair(b->region, b->segment ? b->offset : 0);  // as localBuffer
  return absl::FailedPreconditionError(strCat("group \"", group, "\" rank ", rank, " has no buffer \"", buffer, "\""));
}

StatusOr<Registry::LocalBuffer> Registry::localBuffer(const std::string& group, int32_t rank, const std::string& buffer,
                                                      Set set) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ranks_.find({group, rank});
  if (it == ranks_.end())
    return absl::FailedPreconditionError(
        strCat("group \"", group, "\" rank ", rank, " is not registered on node \"", node_, "\""));
  const Rank& r = *it->second;
  // Sources and single-buffered destinations: one set.
  if (const Buffer* found = findBuffer(set == Set::kHeld ? r.heldSet() : r.writeSet(), buffer)) {
    const Buffer& b = *found;
    if (b.segment)
      return LocalBuffer{static_cast<std::byte*>(b.segment->data()) + b.offset,
                         b.size,
                         transport::MemoryKind::kHost,
                         b.segment,
                         b.region,
                         b.offset,
                         nullptr,
                         nullptr};
    // Device memory: the IPC mapping and its transfer registration, kept alive together.
    return LocalBuffer{b.device,      b.size, transport::MemoryKind::kCuda, b.cuda_keep,
                       b.region,      0,      b.engines->outgoing.get(),    b.engines->incoming.get(),
                       b.engines->gpu};
  }
  return absl::FailedPreconditionError(strCat("group \"", group, "\" rank ", rank, " has no buffer \"", buffer, "\""));
}

const Registry::Buffer* Registry::findBuffer(const std::vector<Buffer>& set, const std::string& name) {
  const auto it =
      std::lower_bound(set.begin(), set.end(), name, [](const Buffer& b, const std::string& n) { return b.name < n; });
  return it != set.end() && it->name == name ? &*it : nullptr;
}

transport::DeviceRuntime* Registry::deviceRuntime() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cuda_engines_.empty() ? nullptr : &gpus_;
}

uint64_t Registry::generation() const {
  std::lock_guard<std::mutex> lock(mu_);
  return generation_;
}

std::vector<uint64_t> Registry::stamps(const std::vector<std::string>& groups) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint64_t> out;
  out.reserve(groups.size());
  for (const auto& group : groups) {
    const auto it = groups_.find(group);
    out.push_back(it == groups_.end() ? 0 : it->second.changed);
  }
  return out;
}

void Registry::noteChange(Group& group, std::string what) {
  group.changed = ++generation_;
  group.changes.emplace_back(group.changed, std::move(what));
  if (group.changes.size() > kKeptChanges) {
    group.dropped = group.changes.front().first;
    group.changes.erase(group.changes.begin());
  }
}

std::string Registry::changesSince(const std::string& group, uint64_t stamp) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = groups_.find(group);
  if (it == groups_.end()) return "no rank of it is registered here any more";
  const auto& changes = it->second.changes;
  std::vector<std::string> since;
  if (it->second.dropped > stamp) since.push_back("...");  // (older ones since, no longer kept)
  for (const auto& [generation, what] : changes)
    if (generation > stamp) since.push_back(what);
  return strJoin(since, ", ");
}

Registry::Rank* Registry::findRank(const std::string& group, int32_t rank) const {
  auto it = ranks_.find({group, rank});
  return it == ranks_.end() ? nullptr : it->second.get();
}

v1::RankStatus Registry::statusOf(const Rank& r) const {
  v1::RankStatus st;
  st.set_rank(r.rank);
  st.set_state(r.state);
  st.set_held(r.held);
  st.set_node(node_);
  if (r.doubled()) {
    st.set_double_buffered(true);
    st.set_active_set(static_cast<uint32_t>(r.active));
    if (!r.writer.empty()) st.set_writing(r.writing);
  }
  switch (r.state) {
    case v1::RANK_READY:
      st.set_version(r.committed);
      break;
    case v1::RANK_UPDATING:
      st.set_version(r.role == v1::ROLE_SOURCE ? r.committed : r.writing);
      break;
    case v1::RANK_DIRTY:
      st.set_version(r.committed);
      st.set_detail(r.detail);
      break;
    default:
      break;
  }
  return st;
}

std::string Registry::openSession(const std::string& client) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string id = strCat(instance_, "-", next_session_++);
  sessions_.insert(id);
  spdlog::debug("session {} opened ({})", id, client);
  return id;
}

size_t Registry::sessionCount() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sessions_.size();
}

std::vector<v1::SupersededRank> Registry::takeSuperseded(const std::string& session) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = superseded_.find(session);
  if (it == superseded_.end()) return {};
  std::vector<v1::SupersededRank> out = std::move(it->second);
  superseded_.erase(it);
  return out;
}

void Registry::closeSession(const std::string& session) {
  // A client that died closed its session as its descriptors went, a moment before it is a
  // zombie: its processes get that moment (one that closed its session and lives on takes all of
  // it), so that unlinkSegments finds them gone and unlinks torch's segments too.
  std::set<pid_t> pids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [key, r] : ranks_)
      if (r->session == session && r->pid > 0) pids.insert(r->pid);
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
  while (std::any_of(pids.begin(), pids.end(), [](pid_t p) { return !processGone(p); }) &&
         std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::vector<std::string> gone, kept;
  {
    std::lock_guard<std::mutex> lock(mu_);
    sessions_.erase(session);
    superseded_.erase(session);
    for (auto it = ranks_.begin(); it != ranks_.end();) {
      auto next = std::next(it);
      if (Rank& r = *it->second; r.session == session) {
        const std::string who = strCat("group \"", it->first.first, "\" rank ", it->first.second);
        if (r.user().empty()) {
          gone.push_back(who);
          removeRank(it, true, "left with its client's session");
        } else {
          // A sync still reads or writes its memory (maybe a copy stuck past its attempt's end):
          // gone now, the memory could be registered again under it and acquired, written or
          // synced into while that copy lands. The sync using it fails as its group changed.
          kept.push_back(strCat(who, " (sync ", r.user(), ")"));
          r.orphaned = true;
          r.session.clear();
          noteChange(groups_[r.group], strCat("rank ", r.rank, " left with its client's session"));
        }
      }
      it = next;
    }
    if (!kept.empty()) state_cv_.notify_all();
  }
  if (!gone.empty())
    spdlog::info("session {} ended (its client exited or closed): unregistered {}", session, strJoin(gone, ", "));
  if (!kept.empty())
    spdlog::warn("session {} ended (its client exited or closed) while syncs used {}: unregistered once they let go",
                 session, strJoin(kept, ", "));
}

void Registry::removeOrphans() {
  for (auto it = ranks_.begin(); it != ranks_.end();) {
    auto next = std::next(it);
    if (it->second->orphaned && it->second->user().empty()) {
      spdlog::info("group \"{}\" rank {} unregistered: its session had ended while a sync used it", it->first.first,
                   it->first.second);
      removeRank(it, true, "left with its client's session");
    }
    it = next;
  }
}

std::map<v1::RankState, uint64_t> Registry::stateCounts() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<v1::RankState, uint64_t> out;
  for (const auto& [key, r] : ranks_) ++out[r->state];
  return out;
}

int32_t Registry::registeredRanks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int32_t>(ranks_.size());
}

}  // namespace shardcast::daemon
