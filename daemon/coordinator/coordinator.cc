// The coordinator of a sync (coordinator.h): its run through the phases, each in a file of its own
// (gather.cc, prepare.cc, execute.cc, commit.cc), and what every phase shares.
#include "daemon/coordinator/coordinator.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "daemon/coordinator/lease_keeper.h"
#include "planner/report.h"

namespace shardcast::daemon {

// ---- PeerClient ----

PeerClient::PeerClient(const PeerSet& peers, std::vector<std::string> addresses, uint32_t fanout)
    : peers_(peers), addresses_(std::move(addresses)), fanout_(fanout) {}

std::vector<grpc::Status> PeerClient::callRaw(const std::string& method, std::vector<RawCall> calls,
                                              std::string common_request, bool stop_at_failure,
                                              const std::function<grpc::Status(size_t, const RawResult&)>& each) {
  std::vector<grpc::Status> statuses(calls.size());
  TreeOptions options;
  options.method = method;
  options.fanout = fanout_;
  options.stop_at_failure = stop_at_failure;
  options.common_request = std::move(common_request);
  options.track = [this](grpc::ClientContext& c, bool add) { calls_.track(c, add); };
  callTree(peers_, calls, options, [&](size_t i, const RawResult& r) { statuses[i] = each(i, r); });
  return statuses;
}

// ---- SyncCoordinator ----

SyncCoordinator::SyncCoordinator(Context ctx, const v1::SyncRequest& request, std::string id, uint64_t fence)
    : ctx_(std::move(ctx)),
      req_(request),
      src_group_(request.src_group()),
      version_(request.version()),
      id_(std::move(id)),
      fence_(fence),
      lease_(ctx_.config.sync_lease_ms) {
  timeout_ms_ = req_.options().timeout_ms() ? req_.options().timeout_ms() : 300000;
  deadline_ = start_ + std::chrono::milliseconds(timeout_ms_);
}

SyncCoordinator::~SyncCoordinator() {
  if (lease_keeper_) lease_keeper_->stop();
}

Status SyncCoordinator::timed(Status (SyncCoordinator::*phase)(), void (v1::SyncResponse::*seconds)(double)) {
  const auto started = Clock::now();
  Status st = (this->*phase)();
  (out_.*seconds)(since(started));
  return st;
}

StatusOr<v1::SyncResponse> SyncCoordinator::run() {
  using R = v1::SyncResponse;
  const std::string repeat_key = RepeatCache::keyOf(req_, ctx_.caller_uid);
  std::shared_ptr<const RepeatView> repeat;
  if (ctx_.repeats && !ctx_.full_gather && !req_.options().catch_up()) repeat = ctx_.repeats->find(repeat_key);
  if (repeat && !RepeatView::quickEnough(repeat->prepare_seconds, ctx_.config.peer_timeout_ms)) repeat = nullptr;
  if (repeat) {  // each daemon's Prepare checks what the gather would have (repeat_cache.h)
    route_ = Route::kRepeated;
    cluster_ = repeat->cluster;
    src_ = repeat->src;
    dst_ = repeat->dst;
    digests_ = repeat->digests;
    repeat_ = repeat;
    peers_ =
        std::make_unique<PeerClient>(ctx_.peers, cluster_->addresses, static_cast<uint32_t>(ctx_.config.relay_fanout));
    out_.set_repeated(true);
  } else {
    SC_RETURN_IF_ERROR(timed(&SyncCoordinator::gather, &R::set_gather_seconds));
  }
  if (peers_) out_.set_coordinator_calls(static_cast<uint32_t>(peers_->directCalls()));
  if (reads_ == Reads::kNothing) {  // a catch-up with nothing to move
    advance(Step::kGathering, Step::kCommitted);
    out_.set_sync_id(id_);
    out_.set_version(version_);
    out_.set_seconds(since(start_));
    ctx_.progress.update(id_, [&](v1::SyncProgress& p) {
      p.set_version(version_);
      ProgressBoard::setPhase(p, v1::SYNC_COMMITTED);
    });
    return out_;
  }
  advance(Step::kGathering, Step::kPlanning);
  SC_RETURN_IF_ERROR(timed(&SyncCoordinator::plan, &R::set_plan_seconds));
  advance(Step::kPlanning, Step::kPreparing);
  SC_RETURN_IF_ERROR(timed(&SyncCoordinator::prepare, &R::set_prepare_seconds));
  // Given up since its prepare (the lease keeper found a node silent), it executes nothing.
  if (!advance(Step::kPreparing, Step::kExecuting)) return stoppedAnswering(lease_keeper_->stalled());
  SC_RETURN_IF_ERROR(timed(&SyncCoordinator::execute, &R::set_execute_seconds));
  SC_RETURN_IF_ERROR(timed(&SyncCoordinator::commit, &R::set_finish_seconds));
  advance(Step::kCommitting, Step::kCommitted);
  // Replicas that left were named in this committed sync's response: forgotten now (an attempt
  // that failed, or a sync that did, leaves them to be named by the next).
  if (!members_left_.empty()) ctx_.replica_sets.forget(req_.dst_group(), members_left_);
  if (ctx_.repeats && !req_.options().catch_up() && reads_ == Reads::kSource) {
    if (replicas_.empty())
      keepView(repeat_key);
    else if (!plan_->src_digest.empty()) {
      // Stale refusals in a row: none once a Prepare by digest committed; an attempt run again
      // with the layouts (or one that no longer tries by digest) keeps the count.
      // (Other daemons, or one restarted, perhaps with a larger --plan-cache-entries: counted anew.)
      int stale = 0;
      if (!set_by_digest_)
        if (const auto memo = ctx_.repeats->findSet(repeat_key);
            memo && memo->plan_key == plan_->key && memo->daemons == daemonInstances())
          stale = memo->stale_refusals;
      ctx_.repeats->keepSet(repeat_key, SetMemo{plan_->key, daemonInstances(), stale});
    }
  }
  out_.set_layouts_by_digest(layoutsByDigest());
  const auto& stats = plan_->plan.stats;
  out_.set_sync_id(id_);
  out_.set_version(version_);
  out_.set_network_bytes(static_cast<uint64_t>(stats.network_bytes));
  out_.set_local_bytes(static_cast<uint64_t>(stats.local_bytes));
  out_.set_bytes_needed(static_cast<uint64_t>(stats.bytes_needed));
  out_.set_seconds(since(start_));
  out_.set_plan_cached(plan_cached_);
  const SyncCounters moved = moved_.load();
  out_.set_bytes_landed_direct(moved.bytes_landed_direct);
  out_.set_device_fanout_bytes(moved.device_fanout_bytes);
  out_.set_gpu_delta_chunks(moved.gpu_delta_chunks);
  out_.set_gpu_rebuilt_chunks(moved.gpu_rebuilt_chunks);
  out_.set_waves(static_cast<uint32_t>(plan_->waves));
  out_.set_wire_bytes(wire_bytes_);
  out_.set_delta_chunks(moved.delta_chunks);
  out_.set_dense_chunks(moved.dense_chunks);
  out_.set_delta(delta_);
  out_.set_delta_choice(delta_choice_);
  out_.set_strategy(req_.options().strategy());
  if (req_.options().catch_up()) out_.set_seeded_from(src_group_);
  for (auto& o : outcomes_) {
    o.set_committed(o.cut().empty());
    *out_.add_replicas() = o;
  }
  out_.set_plan_summary_json(planner::renderJson(plan_->plan, plan_->nodes, planner::CostModel{}));
  // The one line a committed sync leaves, with its figures (a failed one: the service's warning).
  spdlog::info(
      "sync {}: {} -> {} version {} committed in {:.3f} s (gather {:.3f} s, plan {:.3f} s, prepare {:.3f} s, "
      "execute {:.3f} s, finish {:.3f} s): {} bytes over the network, {} landed direct, {} copied locally",
      id_, src_group_, req_.dst_group(), version_, out_.seconds(), out_.gather_seconds(), out_.plan_seconds(),
      out_.prepare_seconds(), out_.execute_seconds(), out_.finish_seconds(), out_.network_bytes(),
      out_.bytes_landed_direct(), moved.local_bytes);
  return out_;
}

std::vector<std::pair<std::string, std::string>> SyncCoordinator::daemonInstances() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& d : cluster_->view.daemons()) out.emplace_back(d.node(), d.instance());
  return out;
}

void SyncCoordinator::keepView(const std::string& repeat_key) {
  if (digests_.src.empty()) digests_ = {planner::layoutDigest(src_), planner::layoutDigest(dst_)};
  // A folded sync's Prepare took no round: the kept view keeps its earlier Prepare's time.
  const bool folded = route_ == Route::kFolded;
  const double prepare_seconds = folded ? repeat_->prepare_seconds : out_.prepare_seconds();
  if (folded) prepared_ = repeat_->prepared;  // each daemon found them still its own
  for (auto& answer : prepared_) {            // the next sync's landings: double-buffered ranks flipped at this commit
    if (answer.has_next_targets()) answer.mutable_targets()->Swap(answer.mutable_next_targets());
    // The view serves folded syncs, which carry no deltas: their Prepare reports no base (a delta
    // sync's answer here would have a folded Prepare refused as not matching it).
    answer.clear_base_version();
    answer.clear_base_fence();
  }
  const int fold_refusals = folded ? 0 : repeat_ ? repeat_->fold_refusals : ctx_.fold_refusals;
  ctx_.repeats->keep(repeat_key,
                     std::make_shared<const RepeatView>(RepeatView{cluster_, src_, dst_, digests_, std::move(prepared_),
                                                                   fold_refusals, prepare_seconds}));
}

std::vector<std::string> SyncCoordinator::replicasOnlyOn(const std::string& node) const {
  // Once the commit began some replicas may hold the version: running the sync again would
  // misreport them (cut, "not newer"). commit() itself cuts the replicas of a node that fails it.
  if (const Step step = step_.load(); step == Step::kCommitting || step == Step::kCommitted) return {};
  return replicasOn(node);
}

std::vector<std::string> SyncCoordinator::replicasToCut(bool* node_failed) const {
  *node_failed = refusing_replica_.empty();
  if (!refusing_replica_.empty()) return {refusing_replica_};
  return replicasOnlyOn(faulty_node_);
}

bool SyncCoordinator::isReplica(const std::string& group) const {
  for (const auto& r : replicas_)
    if (r.layout.group() == group) return true;
  return false;
}

std::vector<std::string> SyncCoordinator::replicasOn(const std::string& node) const {
  if (!cluster_ || replicas_.empty() || node.empty()) return {};
  std::set<std::string> on;
  for (const auto& d : cluster_->view.daemons()) {
    if (d.node() != node) continue;
    for (const auto& r : d.ranks()) {
      if (r.group() == src_group_) return {};
      if (writes(r.group()) && r.group() != req_.dst_group()) on.insert(r.group());
    }
  }
  return {on.begin(), on.end()};
}

bool SyncCoordinator::writes(const std::string& group) const { return group == req_.dst_group() || isReplica(group); }

const char* SyncCoordinator::stepName(Step step) {
  switch (step) {
    case Step::kGathering:
      return "gathering";
    case Step::kPlanning:
      return "planning";
    case Step::kPreparing:
      return "preparing";
    case Step::kExecuting:
      return "executing";
    case Step::kCommitting:
      return "committing";
    case Step::kCommitted:
      return "committed";
    case Step::kGivenUp:
      return "given up";
  }
  return "?";
}

bool SyncCoordinator::advance(Step from, Step to) {
  Step at = from;
  if (step_.compare_exchange_strong(at, to)) return true;
  if (at == Step::kGivenUp) return false;
  spdlog::critical("sync {}: the coordinator's attempt moved from {} to {} while {}: a bug", id_, stepName(from),
                   stepName(to), stepName(at));
  std::abort();
}

bool SyncCoordinator::executed() const {
  Step at = step_.load();
  if (at == Step::kGivenUp) at = given_up_in_.load();
  // (Given up, its step not recorded yet: giveUp stores it just after its compare-and-swap. Taken
  // as executed, the safe answer: ranks end DIRTY rather than reverted over bytes that may land.)
  return at == Step::kExecuting || at == Step::kCommitting || at == Step::kCommitted || at == Step::kGivenUp;
}

void SyncCoordinator::giveUp(const std::string& reason, const std::string& silent) {
  // From any step before the commit, once; a commit under way is not given up.
  for (Step at = step_.load(); at != Step::kGivenUp && at != Step::kCommitting && at != Step::kCommitted;)
    if (step_.compare_exchange_weak(at, Step::kGivenUp)) {
      given_up_in_ = at;
      peers_->cancelAll();
      finishAll(false, reason, silent);
      return;
    }
}

Status SyncCoordinator::giveUpWith(const Status& failure) {
  giveUp(std::string(failure.message()));
  return failed(failure);
}

std::string SyncCoordinator::firstSilent() {
  const auto& daemons = cluster_->view.daemons();
  std::vector<grpc::ClientContext> contexts(daemons.size());
  std::vector<v1::ProgressResponse> r(daemons.size());
  const v1::ProgressRequest pr;  // the cheapest call: answers NOT_FOUND once the sync is gone
  const auto st =
      fanOut(contexts,
             std::chrono::system_clock::now() + std::chrono::milliseconds(std::min(ctx_.config.peer_timeout_ms, 1000)),
             [&](size_t i, grpc::ClientContext& c, CallDone done) {
               v1::Peer::NewStub(ctx_.peers.channel(cluster_->addresses[i]))
                   ->async()
                   ->Progress(&c, &pr, &r[i], std::move(done));
             });
  for (size_t i = 0; i < daemons.size(); ++i)
    if (st[i].error_code() == grpc::StatusCode::UNAVAILABLE ||
        st[i].error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
      return daemons[i].node();
  return "";
}

void SyncCoordinator::setPhase(v1::SyncPhase phase) {
  ctx_.progress.update(id_, [&](v1::SyncProgress& p) { ProgressBoard::setPhase(p, phase); });
}

void SyncCoordinator::nodeState(size_t i, const std::string& state, const std::string& error) {
  ctx_.progress.update(id_, [&](v1::SyncProgress& p) {
    p.mutable_nodes(static_cast<int>(i))->set_state(state);
    if (!error.empty()) p.mutable_nodes(static_cast<int>(i))->set_error(error);
    p.set_seconds(since(start_));
  });
}

void SyncCoordinator::record(size_t i, uint64_t received, uint64_t sent) {
  ctx_.progress.update(id_, [&](v1::SyncProgress& p) {
    auto* n = p.mutable_nodes(static_cast<int>(i));
    const uint64_t before = n->bytes_received();  // (the total moves by what this node adds: O(1), not O(nodes))
    n->set_bytes_received(std::max(before, received));
    n->set_bytes_sent(std::max(n->bytes_sent(), sent));
    p.set_bytes_done(p.bytes_done() + (n->bytes_received() - before));
    p.set_seconds(since(start_));
  });
}

Status SyncCoordinator::failed(const Status& st) {
  if (lease_keeper_) lease_keeper_->stop();
  // The phase and the error stay as they were: the sync failed only when its runner does not run
  // it again (SyncRunner::run then sets both), and a watcher stops at a failed phase. An attempt
  // run again must show no error meanwhile (a kept view's "stale view" is not the sync's).
  ctx_.progress.update(id_, [&](v1::SyncProgress& p) { p.set_seconds(since(start_)); });
  return st;
}

std::chrono::system_clock::time_point SyncCoordinator::callDeadline() const {
  return std::chrono::system_clock::now() + (deadline_ - Clock::now());
}

}  // namespace shardcast::daemon
